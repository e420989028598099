"""The `paged_attention` op's XLA reference kernel and the XLA:CPU decode kernel against NumPy dense attention,
the slots, their registration and selection, and the paged check failing a kernel that drops the sliding window."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.errors import UnknownComponentError
from axcore.experiment import load_experiment
from axcore.experiment.builtins import create_plugin_manager
from axcore.kernels import (
    PAGED_ATTENTION,
    PagedAttentionProblem,
    Support,
    XlaCpuPagedDecode,
    XlaPagedAttention,
    preferred_kernels,
)
from axcore.kernels.paged_attention import paged_slots
from axcore.layers.transformer import TransformerLayer
from axcore.testing import TINY_OVERRIDES
from axcore.testing.decoding import check_paged_matches_forward


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    heads: int = 4
    kv_heads: int = 4
    window: int | None = None
    softcap: float | None = None
    slopes: bool = False
    # A position bias through `bias_fn` (the same for every head): -0.05 * (p - j)^2.
    squared_bias: bool = False
    dtype: str = "float32"


CASES = [
    Case("mha"),
    Case("gqa-window-softcap", kv_heads=2, window=5, softcap=2.0),
    Case("mqa-alibi", kv_heads=1, slopes=True),
    Case("gqa-bf16", kv_heads=2, window=3, dtype="bfloat16"),
    Case("gqa3-bias-fn", heads=6, kv_heads=3, squared_bias=True),
]
BLOCK, NUM_BLOCKS, HEAD_DIM = 4, 16, 8


def random_step(rng):
    """Three rows over shuffled blocks: a prompt chunk at 5..8, a decode token at 13, an empty row; two
    sequences' contexts filled with random keys/values (the slots the step reads)."""
    tables = np.zeros((3, 5), np.int32)
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))
    tables[0, :3], tables[1, :4] = ids[:3], ids[3:7]
    positions = np.array([[5, 6, 7, 8], [13, 0, 0, 0], [0, 0, 0, 0]], np.int32)
    num_new = np.array([4, 1, 0], np.int32)
    return tables, positions, num_new


def numpy_paged(case, q, key, value, tables, positions, num_new):
    """float64 dense attention per valid token over its sequence's slots 0..p (gathered by hand)."""
    out = np.zeros(q.shape)
    group = case.heads // case.kv_heads
    slopes = 2.0 ** (-np.arange(1, case.heads + 1)) if case.slopes else np.zeros(case.heads)
    for b in range(q.shape[0]):
        for i in range(num_new[b]):
            p = positions[b, i]
            j = np.arange(p + 1)
            k = key[tables[b, j // BLOCK], j % BLOCK].astype(np.float64)  # [p+1, kv, h]
            v = value[tables[b, j // BLOCK], j % BLOCK].astype(np.float64)
            for n in range(case.heads):
                logits = k[:, n // group] @ q[b, i, n].astype(np.float64) / np.sqrt(HEAD_DIM)
                if case.softcap:
                    logits = case.softcap * np.tanh(logits / case.softcap)
                logits = logits - slopes[n] * (p - j) - (0.05 * (p - j) ** 2 if case.squared_bias else 0)
                if case.window is not None:
                    logits = np.where(p - j < case.window, logits, -np.inf)
                w = np.exp(logits - logits.max())
                out[b, i, n] = (w / w.sum()) @ v[:, n // group]
    return out


def check_against_numpy(case, kernel, tables, positions, num_new, rng, q_len, platform=None):
    """Runs `kernel` on random q / cache in `case`'s dtype and compares each row's valid tokens with
    `numpy_paged` (every output finite, padding and empty rows included)."""
    dtype = jnp.dtype(case.dtype)
    q = rng.normal(size=(len(tables), q_len, case.heads, HEAD_DIM)).astype(np.float32)
    key, value = (rng.normal(size=(NUM_BLOCKS, BLOCK, case.kv_heads, HEAD_DIM)).astype(np.float32) for _ in "kv")
    q, key, value = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (q, key, value))
    slopes = tuple(2.0 ** (-np.arange(1, case.heads + 1))) if case.slopes else None
    problem = PagedAttentionProblem.of(
        q, key, tables, platform=platform, sliding_window=case.window, softcap=case.softcap, bias_slopes=slopes,
        bias_fn=squared_bias if case.squared_bias else None,
    )
    assert kernel.is_supported(problem)
    got = jax.jit(lambda *a: kernel(problem, *a))(
        *(jnp.asarray(a, dtype) for a in (q, key, value)), tables, positions, num_new
    )
    assert got.dtype == dtype and got.shape == q.shape
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    want = numpy_paged(case, q, key, value, tables, positions, num_new)
    tol = 2e-2 if case.dtype == "bfloat16" else 1e-5
    for b in range(len(tables)):
        np.testing.assert_allclose(got[b, : num_new[b]], want[b, : num_new[b]], atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_kernel_matches_numpy_dense_attention(case):
    rng = np.random.default_rng(0)
    tables, positions, num_new = random_step(rng)
    check_against_numpy(case, XlaPagedAttention(), tables, positions, num_new, rng, q_len=4)


def squared_bias(q_positions, kv_positions):
    """`bias_fn` of the `squared_bias` case: `[b, 1, t, s]`."""
    distance = (q_positions[:, :, None] - kv_positions[:, None, :]).astype(jnp.float32)
    return (-0.05 * distance**2)[:, None]


def decode_step(rng, batch=5, width=6):
    """Decode rows (one new token each) over shuffled blocks: contexts ending mid-block, on a block's last
    slot, on a block's first slot, a one-token context, and an empty padding row (table of zeros)."""
    ends = np.array([13, 7, 8, 0, 0])[:batch]
    tables = np.zeros((batch, width), np.int32)
    ids = iter(rng.permutation(np.arange(1, NUM_BLOCKS)))
    for b in range(batch - 1):
        for i in range(ends[b] // BLOCK + 1):
            tables[b, i] = next(ids)
    num_new = np.array([1] * (batch - 1) + [0], np.int32)
    return tables, ends[:, None].astype(np.int32), num_new


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_cpu_decode_kernel_matches_numpy_dense_attention(case):
    rng = np.random.default_rng(1)
    tables, positions, num_new = decode_step(rng)
    check_against_numpy(case, XlaCpuPagedDecode(), tables, positions, num_new, rng, q_len=1, platform="cpu")


def test_the_cpu_decode_kernel_is_chosen_for_cpu_decode_steps_only():
    registries = create_plugin_manager([]).registries
    q, key, tables = np.zeros((2, 1, 4, 8)), np.zeros((4, 4, 2, 8)), np.zeros((2, 2), np.int32)
    decode = PagedAttentionProblem.of(q, key, tables, platform="cpu")
    assert registries.kernels.select("paged_attention", decode).name == "xla_cpu_decode"
    chunk = PagedAttentionProblem.of(np.zeros((2, 3, 4, 8)), key, tables, platform="cpu")
    assert registries.kernels.select("paged_attention", chunk).name == "xla"
    kernel = XlaCpuPagedDecode()
    for problem, reason in [
        (chunk, "q_len 3"),
        (dataclasses.replace(decode, platform="gpu"), "cpu platform"),
        (dataclasses.replace(decode, num_heads=32, num_kv_heads=16), "16 kv heads"),
        (dataclasses.replace(decode, num_heads=3), "multiple"),
        (dataclasses.replace(decode, extras={"fp8": True}), "fp8"),
    ]:
        support = kernel.is_supported(problem)
        assert not support and reason in support.reason


def test_preferred_kernels_are_tried_first_and_fall_back_when_they_decline():
    registries = create_plugin_manager([]).registries
    key, tables = np.zeros((4, 4, 2, 8)), np.zeros((2, 2), np.int32)
    decode = PagedAttentionProblem.of(np.zeros((2, 1, 4, 8)), key, tables, platform="cpu")
    chunk = PagedAttentionProblem.of(np.zeros((2, 3, 4, 8)), key, tables, platform="cpu")
    select = registries.kernels.select
    with preferred_kernels({"paged_attention": "xla"}):
        assert select("paged_attention", decode).name == "xla"
        assert select("paged_attention", decode, requested="xla_cpu_decode").name == "xla_cpu_decode"
    with preferred_kernels({"paged_attention": "xla_cpu_decode"}):
        assert select("paged_attention", chunk).name == "xla"  # It declines prefill chunks: priority order.
    assert select("paged_attention", decode).name == "xla_cpu_decode"  # Outside: the usual order.
    with preferred_kernels({"paged_attention": "xla_decode"}), pytest.raises(UnknownComponentError, match="xla_cpu_decode"):
        select("paged_attention", decode)


def test_new_tokens_write_their_own_slots_and_padding_the_null_block():
    tables = np.array([[7, 3, 0], [2, 0, 0]], np.int32)
    positions = np.array([[3, 4, 5], [1, 9, 9]], np.int32)
    num_new = np.array([3, 1], np.int32)
    got = np.asarray(paged_slots(jnp.asarray(positions), jnp.asarray(num_new), jnp.asarray(tables), 4))
    # block * 4 + offset: position 3 in block 7, 4 and 5 in block 3; row 1's padding in block 0.
    np.testing.assert_array_equal(got, [[7 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1], [2 * 4 + 1, 1, 1]])


def test_the_kernels_plugin_registers_the_op_and_the_reference_declines_unknown_extras():
    registries = create_plugin_manager([]).registries
    q, key, tables = np.zeros((1, 1, 2, 8)), np.zeros((4, 4, 2, 8)), np.zeros((1, 2), np.int32)
    problem = PagedAttentionProblem.of(q, key, tables, platform="gpu")
    assert registries.kernels.select("paged_attention", problem).name == "xla"
    assert registries.ops["paged_attention"] is PAGED_ATTENTION
    declined = XlaPagedAttention().is_supported(dataclasses.replace(problem, extras={"fp8": True}))
    assert not declined and "fp8" in declined.reason
    uneven = XlaPagedAttention().is_supported(dataclasses.replace(problem, num_heads=3))
    assert not uneven and "multiple" in uneven.reason


class DropsTheWindow(XlaPagedAttention):
    """A broken kernel: attends to the whole context whatever the sliding window."""

    name = "drops_window"
    priority = 10

    def __call__(self, problem, *args):
        return super().__call__(dataclasses.replace(problem, sliding_window=None), *args)

    def is_supported(self, problem):
        return Support(True)


class DropsTheWindowPlugin:
    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register("paged_attention", DropsTheWindow())


def test_the_paged_check_fails_a_kernel_that_ignores_the_sliding_window():
    overrides = [*TINY_OVERRIDES, "plugins=[broken]", "model.compute_dtype=float32",
                 "model.decoder.layer.self_attention.sliding_window=3"]
    exp = load_experiment(None, overrides, objects={"broken": DropsTheWindowPlugin()})
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(1))
    with pytest.raises(AssertionError, match="paged KV-cache decoding .* differs from the full forward"):
        check_paged_matches_forward(model, params, vocab=int(exp.config.model.vocab_size))


def test_a_layer_without_a_paged_cache_is_refused_naming_it():
    class NoPagedAttention(axcore.layers.BaseLayer):
        class Config(axcore.layers.BaseLayer.Config):
            input_dim: int = 8

    cfg = TransformerLayer.default_config().set(input_dim=8, self_attention=NoPagedAttention.default_config())
    cfg.feed_forward.hidden_dim = 16
    layer = cfg.instantiate(name="layer")
    with pytest.raises(TypeError, match=r"layer\.self_attention: NoPagedAttention has no paged KV cache"):
        layer.init_paged_cache(4, 2)
