"""The conformance suites can fail: deliberately wrong components fail the checks that concern them."""

import os

import jax
import jax.numpy as jnp
import pytest

import axcore
from axcore.checkpoint import TensorStoreBackend
from axcore.config import replace
from axcore.experiment import load_experiment
from axcore.kernels import SUPPORTED, Support, XlaAttention
from axcore.layers import FeedForward, LearnedPositionEmbedding, MultiheadAttention, PositionEmbedding
from axcore.testing import (
    DEFAULT_CASES,
    TINY_OVERRIDES,
    AttentionCase,
    check_attention_kernel,
    checkpoint,
    position,
    transform,
)
from axcore.testing.attention import check_case, check_declines_unknown_extras

pytest_plugins = ["pytester"]

CASES = {c.name: c for c in DEFAULT_CASES}
CAUSAL_GQA = CASES["f32-causal-gqa"]
MASKED = CASES["f32-causal-sliding-padding-cross"]


class Wrapped(XlaAttention):
    """The reference kernel with the problem (or inputs) changed before the call: a wrong kernel."""

    name = "wrong"

    def __init__(self, change_problem=None, change_inputs=None):
        self.change_problem = change_problem or (lambda p: p)
        self.change_inputs = change_inputs or (lambda q, k, v, kw: (q, k, v, kw))

    def __call__(self, problem, q, k, v, **kw):
        q, k, v, kw = self.change_inputs(q, k, v, kw)
        return super().__call__(self.change_problem(problem), q, k, v, **kw)


def _replace(problem, **fields):
    import dataclasses

    return dataclasses.replace(problem, **fields)


def _gqa_by_modulo(q, k, v, kw):  # Query head n reads kv head n % kv_heads instead of n // group.
    group = q.shape[2] // k.shape[2]
    return q, jnp.tile(k, (1, 1, group, 1)), jnp.tile(v, (1, 1, group, 1)), kw


@pytest.mark.parametrize(
    "kernel, case",
    [
        (Wrapped(lambda p: _replace(p, causal=False)), CAUSAL_GQA),  # Ignores the causal mask.
        (Wrapped(lambda p: _replace(p, scale=p.scale * 1.1)), CASES["f32"]),  # Wrong softmax scale.
        (Wrapped(lambda p: _replace(p, sliding_window=None)), MASKED),  # Ignores the window.
        (Wrapped(change_inputs=lambda q, k, v, kw: (q, k, v, {})), MASKED),  # Ignores key padding.
        (Wrapped(change_inputs=_gqa_by_modulo), CAUSAL_GQA),  # Wrong GQA head mapping.
    ],
    ids=["no-causal", "scale", "no-window", "no-padding", "gqa-modulo"],
)
def test_wrong_attention_numbers_fail(kernel, case):
    with pytest.raises(AssertionError, match="differs from the attention formula"):
        check_case(kernel, case)


def test_wrong_attention_gradient_fails():
    reference = XlaAttention()

    @jax.custom_vjp
    def attention(q, k, v):
        return reference(CASES["f32"].problem(), q, k, v)

    def fwd(q, k, v):
        return attention(q, k, v), (q, k, v)

    def bwd(res, g):
        _, vjp = jax.vjp(lambda *a: reference(CASES["f32"].problem(), *a), *res)
        dq, dk, dv = vjp(g)
        return dq * 0.5, dk, dv  # Right forward, wrong dq.

    attention.defvjp(fwd, bwd)

    class HalfDq(XlaAttention):
        name = "half_dq"

        def __call__(self, problem, q, k, v, **kw):
            return attention(q, k, v)

    with pytest.raises(AssertionError, match="dq differs"):
        check_case(HalfDq(), CASES["f32"])


def test_dishonest_is_supported_fails():
    class AcceptsAnything(XlaAttention):
        name = "accepts_anything"

        def is_supported(self, problem):
            return SUPPORTED

    class SilentDecline(XlaAttention):
        name = "silent"

        def is_supported(self, problem):
            return Support(False)

    class DeclinesAll(XlaAttention):
        name = "declines_all"

        def is_supported(self, problem):
            return Support(False, "never")

    with pytest.raises(AssertionError, match="unknown extras"):
        check_declines_unknown_extras(AcceptsAnything(), CASES["f32"])
    with pytest.raises(AssertionError, match="without a reason"):
        check_case(SilentDecline(), CASES["f32"])
    with pytest.raises(AssertionError, match="declined every case"):
        check_attention_kernel(DeclinesAll(), [AttentionCase("tiny", q_len=2, kv_len=2)])


def test_one_line_subclass_fails_for_a_wrong_kernel(pytester):
    pytester.makepyfile(
        """
        import dataclasses
        from axcore.kernels import XlaAttention
        from axcore.testing import AttentionCase, AttentionKernelConformance

        class NoCausal(XlaAttention):
            name = "no_causal"
            def __call__(self, problem, q, k, v, **kw):
                return super().__call__(dataclasses.replace(problem, causal=False), q, k, v, **kw)

        CASES = [AttentionCase("causal", q_len=4, kv_len=4, causal=True)]

        class TestRight(AttentionKernelConformance):
            kernel = XlaAttention()
            cases = CASES

        class TestWrong(AttentionKernelConformance):
            kernel = NoCausal()
            cases = CASES
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=8, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*TestWrong::test_matches_the_attention_formula*",
            "*TestWrong::test_segment_ids_keep_packed_documents_apart*",
        ]
    )


# -- position embeddings ---------------------------------------------------------------


class AbsoluteBias(PositionEmbedding):
    """A bias on absolute key positions (not relative), in float32 regardless of q's dtype."""

    def attention_bias(self, q_positions, k_positions):
        return 0.1 * k_positions[:, None, None, :].astype(jnp.float32) + 0 * q_positions[:, None, :, None]

    def transform_qk(self, q, k, q_positions, k_positions):
        return q.astype(jnp.float32), k  # Wrong: changes q's dtype.


def _built(config):
    return position.build(config, axcore.create_plugin_manager().registries)


def test_position_checks_fail_for_wrong_embeddings():
    layer, params = _built(AbsoluteBias.default_config())
    with pytest.raises(AssertionError, match="claims relative positions"):
        position.check_relative_invariance(layer, params)
    with pytest.raises(AssertionError, match="transform_qk: q"):
        position.check_shapes_and_dtypes(layer, params, jnp.bfloat16)
    learned = _built(LearnedPositionEmbedding.default_config().set(max_len=32))
    with pytest.raises(AssertionError, match="embed_inputs depends on absolute positions"):
        position.check_relative_invariance(*learned)
    with pytest.raises(AssertionError, match="no output depends on the positions"):
        position.check_positions_matter(*_built(PositionEmbedding.default_config()))


# -- checkpoint backends -----------------------------------------------------------------


class ListsUncommitted(TensorStoreBackend):
    def all_steps(self):
        return sorted(set(super().all_steps()) | set(self.incomplete_steps()))


class IgnoresTargetSharding(TensorStoreBackend):
    def restore(self, target, step=None):
        state, metadata = super().restore(target, step)
        return jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), state), metadata


def _uncommit(directory, step):
    os.remove(os.path.join(directory, f"step_{step:08d}", "COMMITTED"))


def test_checkpoint_checks_fail_for_wrong_backends(tmp_path):
    with pytest.raises(AssertionError, match="uncommitted step is listed"):
        checkpoint.check_commit_atomicity(ListsUncommitted, str(tmp_path / "a"), _uncommit)
    with pytest.raises(AssertionError, match="asked for"):
        checkpoint.check_restore_into_another_sharding(IgnoresTargetSharding, str(tmp_path / "b"))


# -- config transforms -------------------------------------------------------------------


class Wrong:
    """Config transforms that break one rule each, chosen by `mode`."""

    def __init__(self, mode):
        self.mode = mode

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        if self.mode == "attention_only":  # Said to target feed-forward layers too, but misses them.
            return replace(config, MultiheadAttention, lambda _, c: c.set(softcap=5.0))
        new = replace(config, FeedForward, lambda _, c: c.set(hidden_dim=c.hidden_dim * 2))  # Not idempotent.
        if self.mode == "also_dim":  # Touches the model width too.
            new = new.clone()
            new.model.dim = 48
        return new


def _run(mode):
    manager = axcore.create_plugin_manager(["wrong"], objects={"wrong": Wrong(mode)})
    before = load_experiment("default", [*TINY_OVERRIDES, "plugins=[]"]).config
    settings = manager.settings()
    return manager, settings, before, transform.transform(manager, before, settings)


def test_transform_checks_fail_for_wrong_transforms():
    manager, _, before, after = _run("attention_only")
    with pytest.raises(AssertionError, match="left these targets unchanged: model.decoder.layer.feed_forward"):
        transform.check_applies_to_every_target(before, after, (MultiheadAttention, FeedForward), manager.registries)
    manager, settings, before, after = _run("double")
    transform.check_applies_to_every_target(before, after, FeedForward, manager.registries)
    with pytest.raises(AssertionError, match="applying the transform twice changes"):
        transform.check_idempotent_or_refuses(manager, after, settings, manager.registries)
    manager, _, before, after = _run("also_dim")
    allowed = transform.target_paths(before, FeedForward)
    with pytest.raises(AssertionError, match="outside its targets: model.dim"):
        transform.check_touches_nothing_else(before, after, allowed, manager.registries)
