"""Packed rows through CausalLM: a packed batch's loss and gradients equal the sum over its documents.

A batch of 2 rows packing 5 documents of different lengths (plus padding) is built by hand
in NumPy, following `axcore.data.schema` (segment ids from 1, 0 = padding; positions
restarting at 0 with each document; `target_weights` 0 on padding and on a masked span),
independently of the input pipeline. Its token-weighted loss sum (`loss * num_tokens`)
and the gradients of that sum must equal the sums over the documents, each run alone
in its own row (positions 0..n-1, no segment ids), to 1e-5 in float32: for the XLA
reference attention with learned input positions (layers unrolled, and scanned), RoPE and
ALiBi, and, with RoPE, for every attention kernel that accepts segment ids, run in Pallas
interpret mode on CPU (the Pallas GPU kernel, TPU splash and TPU flash). The unpacked documents always run
through the reference kernel, so each kernel is checked against it, not against itself.

Also: RoPE sees the per-document positions in every layer (a document's first token is
rotated by angle 0), a packed batch without its segment ids or positions gives other
numbers (the check can fail), and a model that does not accept a batch field is named.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import replace
from axcore.data import DataError
from axcore.data.schema import BATCH_SCHEMA
from axcore.kernels import AttentionProblem, XlaAttention, record_kernel_choices
from axcore.layers import CausalLM, MultiheadAttention, RepeatedTransformer
from axcore.module import no_context

from axcore_alibi.layer import AlibiBias
from axcore_rope import RotaryEmbedding

# The hardware plugins are not installed in CI (tests/gpu and tests/tpu put them on the path the same way).
_ROOT = pathlib.Path(__file__).resolve().parents[2]
for _package in ("axcore_gpu", "axcore_tpu"):
    if str(_ROOT / _package) not in sys.path:
        sys.path.insert(0, str(_ROOT / _package))

from axcore_gpu.cudnn_attention import CudnnAttention  # noqa: E402
from axcore_gpu.pallas_attention import PallasAttention  # noqa: E402
from axcore_tpu.flash_attention import PallasTpuAttention  # noqa: E402
from axcore_tpu.splash_attention import SplashAttention  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, HIDDEN = 32, 16, 2, 2, 32
# Row length: a multiple of 128, the TPU kernels' lane width.
SEQ = 128
# Input tokens of each document, per row (row 0: 111 tokens + 17 padding; row 1: 115 + 13).
ROWS = [[50, 41, 20], [70, 45]]
# Float32 throughout; sums over ~230 tokens and two layers reordered by packing.
TOL = 1e-5
# Interpret mode's grid loops make compiling, not running, the cost: optimize less.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# -- The batch, by hand ----------------------------------------------------------------------


def _documents(seed=0):
    """Each document as `(tokens int32 [n + 1], loss_mask [n + 1])` (the interface's document dict)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i, n in enumerate(length for row in ROWS for length in row):
        tokens = rng.integers(0, VOCAB, n + 1).astype(np.int32)
        mask = np.ones(n + 1, np.uint8)
        if i == 1:  # A masked span, as a chat's user turn: those targets carry no weight.
            mask[5:17] = 0
        docs.append((tokens, mask))
    return docs


def _one_per_row(docs):
    """Each document alone at the start of its own row of SEQ tokens, no positions or segment ids.

    Inputs tokens[:-1], targets tokens[1:], weights mask[1:]; the rest of the row is padding
    (label -1, weight 0), which a causal model's earlier tokens never see.
    """
    batch = {
        "input_ids": np.zeros((len(docs), SEQ), np.int32),
        "target_labels": np.full((len(docs), SEQ), -1, np.int32),
        "target_weights": np.zeros((len(docs), SEQ), np.float32),
    }
    for row, (tokens, mask) in enumerate(docs):
        n = len(tokens) - 1
        batch["input_ids"][row, :n] = tokens[:-1]
        batch["target_labels"][row, :n] = tokens[1:]
        batch["target_weights"][row, :n] = mask[1:]
    return batch


def _packed(docs):
    """The documents packed in order into `len(ROWS)` rows of SEQ tokens (every BATCH_SCHEMA field)."""
    batch = {name: np.full((len(ROWS), SEQ), pad) for name, pad in
             [("input_ids", 0), ("target_labels", -1), ("target_weights", 0.0), ("positions", 0), ("segment_ids", 0)]}
    it = iter(docs)
    for row, lengths in enumerate(ROWS):
        start = 0
        for segment, n in enumerate(lengths, start=1):
            tokens, mask = next(it)
            span = slice(start, start + n)
            batch["input_ids"][row, span] = tokens[:-1]
            batch["target_labels"][row, span] = tokens[1:]
            batch["target_weights"][row, span] = mask[1:]
            batch["positions"][row, span] = np.arange(n)
            batch["segment_ids"][row, span] = segment
            start += n
    batch = {name: batch[name].astype(BATCH_SCHEMA[name].dtype) for name in batch}
    BATCH_SCHEMA.check(batch, len(ROWS), SEQ, where="the hand-packed batch")
    return batch


DOCS = _documents()
PACKED = _packed(DOCS)


# -- Models ----------------------------------------------------------------------------------


class _Kernels:
    """Registers the segment-id-capable kernels in Pallas interpret mode, so they run on CPU."""

    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        register(PallasAttention(interpret=True, block_q=32, block_k=32))
        register(SplashAttention(interpret=True, block_q=128, block_kv=128))
        register(PallasTpuAttention(interpret=True))


@functools.cache
def _registries():
    return axcore.create_plugin_manager(["interpret_kernels"], objects={"interpret_kernels": _Kernels()}).registries


def _model(positions: str, kernel: str | None = None, rotary=RotaryEmbedding):
    """A tiny CausalLM, attention forced to `kernel`; `positions` in {"learned", "rope", "alibi"},
    or "learned, scanned" (a `RepeatedTransformer` decoder: the layers under `lax.scan`)."""
    cfg = CausalLM.default_config().set(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS)
    if positions.endswith(", scanned"):
        cfg.decoder = RepeatedTransformer.default_config()
        cfg.decoder.layer.self_attention.causal = True
    cfg.decoder.layer.self_attention.num_heads = HEADS
    cfg.decoder.layer.feed_forward.hidden_dim = HIDDEN
    cfg.position_embedding.max_len = SEQ
    slot = {"rope": rotary.default_config(), "alibi": AlibiBias.default_config()}.get(positions)
    if slot is not None:
        cfg.position_embedding = None
    cfg = replace(cfg, MultiheadAttention, lambda _, a: a.set(position_embedding=slot, kernel=kernel))
    return cfg.instantiate(name="lm", registries=_registries())


@functools.cache
def _params(positions: str):
    """Random parameters of `_model(positions)` (the same for every kernel), drawn in NumPy:
    norm scales near 1, everything else N(0, 0.3^2). (`initialize` would compile for seconds.)"""
    rng = np.random.default_rng(1)

    def draw(path, leaf):
        noise = rng.normal(size=leaf.shape)
        value = 1.0 + 0.1 * noise if jax.tree_util.keystr(path).endswith("['scale']") else 0.3 * noise
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, _model(positions).abstract_parameters())


def _token_sum(model):
    """`(params, batch) -> loss * num_tokens`: the target_weights-weighted sum of token cross-entropies."""

    def fn(params, batch):
        (loss, metrics), _ = axcore.functional(model, params, (batch,), None, False)
        return loss * metrics["num_tokens"]

    return jax.jit(jax.value_and_grad(fn), compiler_options=FAST_COMPILE)


def _as_float64(value, grads):
    return float(value), jax.tree.map(lambda g: np.asarray(g, np.float64), grads)


@functools.cache
def _one_document_at_a_time(positions: str):
    """The documents unpacked, one per row (reference kernel): `(loss sum, gradient tree)` in float64."""
    return _as_float64(*_token_sum(_model(positions))(_params(positions), _one_per_row(DOCS)))


def _check_equal(actual, expected, what):
    (value, grads), (want_value, want_grads) = actual, expected
    np.testing.assert_allclose(value, want_value, rtol=TOL, err_msg=f"{what}: loss * num_tokens")
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    want = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
    for path, g in flat:
        w = want[path]
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(
            g, w, rtol=TOL, atol=TOL * scale, err_msg=f"{what}: gradient {jax.tree_util.keystr(path)}"
        )


def _packed_sums(positions, kernel=None, batch=PACKED):
    """`(loss sum, gradient tree)` of the packed `batch`, every attention layer on `kernel` (checked)."""
    with record_kernel_choices() as choices:
        result = _as_float64(*_token_sum(_model(positions, kernel))(_params(positions), batch))
    if kernel is not None:  # Every attention call ran on it (none fell back).
        assert set(choices["attention"]) == {kernel}, choices["attention"]
    return result


# -- The packed batch equals its documents ---------------------------------------------------


def test_the_hand_packed_batch_follows_the_schema():
    # Every document's tokens sit once in the packed batch, weights total the unpacked weights.
    assert PACKED["target_weights"].sum() == sum(m[1:].sum() for _, m in DOCS)
    assert [np.unique(r[r > 0]).tolist() for r in PACKED["segment_ids"]] == [[1, 2, 3], [1, 2]]
    assert (PACKED["target_labels"][PACKED["segment_ids"] == 0] == -1).all()
    assert (PACKED["positions"][PACKED["segment_ids"] > 0] < max(max(r) for r in ROWS)).all()


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi", "learned, scanned"])
def test_packed_loss_and_gradients_equal_the_sum_over_documents_reference_kernel(positions):
    _check_equal(_packed_sums(positions, "xla"), _one_document_at_a_time(positions), f"{positions}, xla")


def test_without_segment_ids_or_positions_the_numbers_differ():
    """The comparison can fail: attention across documents (no segment ids) or positions that do not
    restart (learned input positions) change the loss by far more than the tolerance."""
    expected, _ = _one_document_at_a_time("learned")
    no_segments = {k: v for k, v in PACKED.items() if k != "segment_ids"}
    no_positions = {k: v for k, v in PACKED.items() if k != "positions"}
    model, params = _model("learned"), _params("learned")
    for what, batch in (("no segment ids", no_segments), ("no positions", no_positions)):
        (loss, metrics), _ = jax.jit(lambda p, b: axcore.functional(model, p, (b,), None, False))(params, batch)
        value = float(loss * metrics["num_tokens"])
        assert abs(value - expected) > 100 * TOL * abs(expected), what


# Every registered kernel that accepts segment ids, in interpret mode (RoPE, float32).
SEGMENT_KERNELS = ["pallas", "splash", "pallas_tpu"]


@pytest.mark.parametrize("kernel", SEGMENT_KERNELS)
def test_packed_loss_and_gradients_equal_the_sum_over_documents_each_kernel(kernel):
    _check_equal(_packed_sums("rope", kernel), _one_document_at_a_time("rope"), f"rope, {kernel}")


def test_kernels_say_whether_they_take_segment_ids():
    """The kernels above accept this model's packed problem; cuDNN declines it, with the reason."""
    q = jax.ShapeDtypeStruct((len(ROWS), SEQ, HEADS, DIM // HEADS), jnp.float32)
    kernels = {k.name: k for k in _registries().kernels.candidates("attention")}
    for name in SEGMENT_KERNELS + ["xla"]:
        problem = AttentionProblem.of(q, q, platform="cpu", causal=True, has_segment_ids=True)
        assert kernels[name].is_supported(problem), (name, kernels[name].is_supported(problem).reason)
    gpu_problem = AttentionProblem.of(
        jax.ShapeDtypeStruct((2, SEQ, 2, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, SEQ, 2, 64), jnp.bfloat16),
        platform="gpu", causal=True,
    )
    cudnn = CudnnAttention(compute_capability=(9, 0))
    assert cudnn.is_supported(gpu_problem)  # The same problem without segment ids is taken...
    support = cudnn.is_supported(dataclasses.replace(gpu_problem, has_segment_ids=True))
    assert not support and "segment ids" in support.reason  # ...and declined with them.
    assert isinstance(kernels["xla"], XlaAttention)


# -- RoPE sees per-document positions --------------------------------------------------------


class _RecordingRotary(RotaryEmbedding):
    """RotaryEmbedding that records the queries and positions it rotates (module outputs)."""

    def transform_qk(self, q, k, q_positions, k_positions):
        q_out, k_out = super().transform_qk(q, k, q_positions, k_positions)
        self.add_module_output("rope_record", {"q": q, "q_out": q_out, "positions": q_positions})
        return q_out, k_out


def _np_rotate_half(x, positions, theta=10000.0):
    """NumPy RoPE (rotate-half pairing): x `[b, t, heads, h]` rotated by `positions * theta^(-2i/h)`."""
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(0, 2 * half, 2) / (2 * half))
    angles = positions[..., None, None] * freqs  # [b, t, 1, h/2]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


def test_rope_positions_restart_at_each_document_in_every_layer():
    model = _model("rope", "xla", rotary=_RecordingRotary)
    _, collection = jax.jit(lambda p, b: axcore.functional(model, p, (b,), None, False))(_params("rope"), PACKED)
    firsts = (PACKED["positions"] == 0) & (PACKED["segment_ids"] > 0)
    assert firsts.sum() == sum(len(r) for r in ROWS)
    for i in range(LAYERS):
        record = collection.module_outputs["decoder"][f"layer{i}"]["self_attention"]["position_embedding"]
        record = jax.tree.map(lambda a: np.asarray(a, np.float64), record["rope_record"])
        np.testing.assert_array_equal(record["positions"], PACKED["positions"])
        # Each document's first token is rotated by angle 0 (left as it is), the rest by their own position.
        np.testing.assert_allclose(record["q_out"][firsts], record["q"][firsts], rtol=0, atol=1e-6)
        np.testing.assert_allclose(
            record["q_out"], _np_rotate_half(record["q"], PACKED["positions"]), rtol=1e-5, atol=1e-5
        )


# -- Batch fields the model accepts ----------------------------------------------------------


def test_causal_lm_accepts_every_schema_field():
    model = _model("learned")
    assert set(BATCH_SCHEMA.names) | {"kv_mask"} == model.accepted_batch_fields()
    BATCH_SCHEMA.check_accepted(model.accepted_batch_fields(), "CausalLM")  # No error.


class _NoSegmentsLM(CausalLM):
    """A model that predates packing: it reads no segment ids."""

    @no_context
    def accepted_batch_fields(self):
        return super().accepted_batch_fields() - {"segment_ids"}


def test_a_model_without_segment_ids_is_named_with_the_field():
    cfg = _NoSegmentsLM.default_config().set(vocab_size=VOCAB, dim=DIM, num_layers=1)
    cfg.decoder.layer.self_attention.num_heads = HEADS
    cfg.decoder.layer.feed_forward.hidden_dim = HIDDEN
    model = cfg.instantiate(name="lm", registries=_registries())
    with pytest.raises(DataError, match=r"carries \['segment_ids'\], which _NoSegmentsLM does not accept"):
        BATCH_SCHEMA.check_accepted(model.accepted_batch_fields(), type(model).__name__)
    # Its forward refuses the field rather than silently letting documents attend to each other.
    with pytest.raises(ValueError, match=r"fields \['segment_ids'\] that _NoSegmentsLM.forward does not read"):
        jax.eval_shape(lambda p: axcore.functional(model, p, (PACKED,), None, False), model.abstract_parameters())
