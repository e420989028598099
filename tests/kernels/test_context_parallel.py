"""Context parallelism: the `context_ring` and `context_all_gather` attention kernels, zigzag load
balancing, kernel choice by platform and length, a kernel added through hooks, the
`context_parallel` modifier, and 20 training steps on a (data 2, context 4) mesh.

The 8-device checks run in one subprocess (`context_parallel_worker.py`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`), shared through a module fixture;
the rest runs here on one device or on abstract meshes.
"""

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import axcore
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.kernels import AttentionProblem, Support, XlaAttention, op_environment, record_kernel_choices
from axcore.kernels.attention import ZIGZAG_EXTRA, zigzag_permutation
from axcore.kernels.attention_context import context_layout, zigzag_layout
from axcore.layers import MultiheadAttention
from axcore.testing import TINY_OVERRIDES, run_host_device_worker

WORKER = pathlib.Path(__file__).parent / "context_parallel_worker.py"
# Output and gradient error allowed (float32, relative to the largest reference value).
ATOL = 1e-5
# Relative loss difference allowed at every one of the 20 steps.
RTOL = 1e-5
# Natural order, multi-head; zigzag order, GQA (6 query heads over 2 kv heads), packed segments, a window, a soft-cap.
KERNEL_CASES = ["causal", "causal_balanced_gqa_segments_window"]


@pytest.fixture(scope="module")
def results():
    return run_host_device_worker(WORKER, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["context_ring", "context_all_gather"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_context_kernels_match_dense_attention_and_its_gradients(results, kernel, case):
    errors = results["kernels"][f"{kernel}/{case}"]
    assert set(errors) == {"out", "dq", "dk", "dv"}
    for name, err in errors.items():
        assert err <= ATOL, f"{kernel}/{case} {name}: {err}"


@pytest.mark.slow
def test_data2_context4_training_matches_one_device(results):
    runs = results["runs"]
    reference = runs["one_device"]["losses"]
    assert runs["one_device"]["kernels"]["attention"].startswith("xla")
    assert runs["data2_context4_ring"]["kernels"]["attention"] == "context_ring (2 sites)"
    assert runs["data2_context4_ring"]["context_shards"] == 4  # The batch was reordered (load balancing on).
    losses = runs["data2_context4_ring"]["losses"]
    assert len(losses) == len(reference) == 20
    for step, (got, want) in enumerate(zip(losses, reference), 1):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: {got} vs single-device {want}"
    assert reference[-1] < reference[0] - 1.0  # It trained.


def test_zigzag_permutation_gives_each_shard_an_early_and_a_late_chunk():
    perm = zigzag_permutation(16, 4)
    # 8 chunks of 2: shard i holds chunks i and 7 - i.
    want = [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert perm.tolist() == want
    # Causal work (keys seen = original index + 1) is the same on every shard.
    work = (perm + 1).reshape(4, 4).sum(axis=1)
    assert work.tolist() == [34] * 4
    assert zigzag_permutation(6, 1).tolist() == list(range(6))
    with pytest.raises(ValueError):
        zigzag_permutation(12, 4)


def _dense(q, k, v, allowed):
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[3])
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", probs / probs.sum(-1, keepdims=True), v)


def test_xla_reference_masks_zigzag_stored_sequences_by_original_order():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 16, 2, 4)).astype(np.float32) for _ in range(3))
    i, j = np.arange(16)[:, None], np.arange(16)[None, :]
    want = _dense(q, k, v, (j <= i) & (i - j < 5))
    perm = zigzag_permutation(16, 4)
    problem = AttentionProblem.of(q, k, causal=True, sliding_window=5, extras={ZIGZAG_EXTRA: 4})
    assert XlaAttention().is_supported(problem)
    got = XlaAttention()(problem, q[:, perm], k[:, perm], v[:, perm])
    np.testing.assert_allclose(np.asarray(got)[:, np.argsort(perm)], want, atol=1e-5)


def _problem(mesh, length, platform="cpu", seq_axis="context", **fields):
    shape = (2, length, 8, 64)
    spec = P("data" if "data" in mesh.axis_names else None, seq_axis, None, None)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    return AttentionProblem.of(x, x, platform=platform, mesh=mesh, input_specs=(spec, spec, spec), causal=True, **fields)


def test_kernel_choice_by_axis_length_and_features():
    registries = axcore.create_plugin_manager([]).registries
    mesh = AbstractMesh((2, 4), ("data", "context"))

    def pick(problem):
        return registries.kernels.select("attention", problem).name

    assert pick(_problem(mesh, 4096, "gpu")) == "context_all_gather"  # Short: one gather.
    assert pick(_problem(mesh, 65536, "gpu")) == "context_ring"  # Long: the ring.
    assert pick(_problem(mesh, 16384, "tpu")) == "context_all_gather"
    assert pick(_problem(mesh, 16384, "gpu")) == "context_ring"
    # Features the context kernels lack, or the sequence over another axis: the xla reference (GSPMD).
    assert pick(_problem(mesh, 4096, bias_slopes=(0.5,) * 8)) == "xla"
    seq_mesh = AbstractMesh((2, 4), ("context", "sequence"))
    seq_problem = _problem(seq_mesh, 4096, seq_axis="sequence")
    assert pick(seq_problem) == "xla"
    assert "not 'context' alone" in context_layout(seq_problem)[0].reason


class TrivialContextAttention:
    """A further context kernel: runs the xla reference under GSPMD (records what it was asked)."""

    name = "context_trivial"
    priority = 100

    def __init__(self):
        self.extras = []

    def is_supported(self, problem):
        support, _ = context_layout(problem)
        return support if not support else Support(True)

    def __call__(self, problem, q, k, v, **inputs):
        self.extras.append(dict(problem.extras))
        return XlaAttention()(problem, q, k, v, **inputs)


class TrivialPlugin:
    def __init__(self):
        self.kernel = TrivialContextAttention()

    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        register(self.kernel)


def _attention_kernel(pm, mesh):
    """The attention kernel an attention layer selects under `mesh` with a zigzag-ordered sequence."""
    cfg = MultiheadAttention.default_config().set(input_dim=32, num_heads=4, num_kv_heads=2, causal=True)
    layer = cfg.instantiate(name="attn", registries=pm.registries)
    params = jax.eval_shape(layer.initialize, jax.random.key(0))
    x = jax.ShapeDtypeStruct((2, 64, 32), jnp.float32)
    with op_environment(mesh), zigzag_layout(4), record_kernel_choices() as choices:
        jax.eval_shape(lambda p, x: axcore.functional(layer, p, (x,), None, False)[0], params, x)
    return choices["attention"]


def test_a_further_context_kernel_registers_through_hooks():
    mesh = AbstractMesh((2, 4), ("data", "context"))
    plugin = TrivialPlugin()
    pm = axcore.create_plugin_manager(["trivial"], objects={"trivial": plugin})
    assert list(_attention_kernel(pm, mesh)) == ["context_trivial"]
    assert plugin.kernel.extras == [{ZIGZAG_EXTRA: 4}]  # The layer told it the order.
    assert list(_attention_kernel(axcore.create_plugin_manager([]), mesh)) == ["context_all_gather"]


RULE = "mesh_rules=[{name: long, instance_type: 'cpu-.*', mesh_shape: [-1], mesh_axis_names: [data], modifiers: [%s]}]"


def _layout(seq_len, modifier="{type: context_parallel, size: 4, min_seq_len: 64}"):
    exp = load_experiment(None, [f"input.seq_len={seq_len}", "mesh.instance_type=cpu-8", RULE % modifier])
    return exp.config


def test_context_parallel_modifier_turns_on_above_a_sequence_length():
    long = _layout(128)
    assert (long.mesh.mesh_shape, long.mesh.mesh_axis_names) == ((-1, 4), ("data", "context"))
    assert long.model.context_load_balance is True
    short = _layout(32)
    assert (short.mesh.mesh_shape, short.mesh.mesh_axis_names) == ((-1,), ("data",))
    off = _layout(64, "{type: context_parallel, size: 2, load_balance: false}")
    assert off.mesh.mesh_axis_names == ("data", "context") and off.model.context_load_balance is False
    with pytest.raises(ConfigError, match="multiple of 8"):
        _layout(68)


@pytest.mark.slow
def test_zigzag_reordered_model_input_keeps_the_loss(monkeypatch):
    """RoPE model, packed rows (positions restart per document): the loss with the batch reordered for
    4 context shards (the xla reference masking by original order) equals the natural-order loss
    (the gradients of the context kernels are checked on 8 devices above)."""
    from axcore.layers import CausalLM


    exp = load_experiment(None, [*TINY_OVERRIDES, "plugins=[rope]", "model.num_layers=1", "model.decoder.layer.self_attention.num_kv_heads=1"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (2, 32)).astype(np.int32)
    segments = np.repeat([[1, 2, 3]], 2, axis=0).repeat([10, 14, 8], axis=1).astype(np.int32)
    positions = np.concatenate([np.arange(10), np.arange(14), np.arange(8)])[None].repeat(2, 0).astype(np.int32)
    weights = (rng.random((2, 32)) > 0.2).astype(np.float32)
    batch = {"input_ids": ids, "target_labels": np.roll(ids, -1, 1), "target_weights": weights,
             "positions": positions, "segment_ids": segments}

    def loss():
        return float(jax.jit(lambda p: axcore.functional(model, p, (batch,), None, True)[0][0])(params))

    want = loss()
    monkeypatch.setattr(CausalLM, "context_shards", lambda self, shape: 4)
    assert abs(loss() - want) <= 1e-6 * abs(want)
