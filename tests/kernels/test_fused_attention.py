"""FusedAttentionKernel: the shared support tail and call of fused attention kernels, against NumPy."""

import numpy as np
import pytest

from axcore.kernels import SUPPORTED, AttentionProblem, Support
from axcore.kernels.fused_attention import FusedAttentionKernel


class SegmentSoftmax(FusedAttentionKernel):
    """Plain softmax attention with the segment and key masks, one kv head per query head."""

    name = "segment_softmax"

    def check(self, problem):
        return Support(False, "does not implement a soft-cap") if problem.softcap is not None else SUPPORTED

    def attend(self, problem, q, k, v, q_segment_ids=None, kv_segment_ids=None, kv_mask=None):
        import jax.numpy as jnp

        logits = jnp.einsum("btnh,bsnh->bnts", q, k) * problem.scale
        keep = jnp.ones(logits.shape, bool)
        if q_segment_ids is not None:
            keep &= (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
        if kv_mask is not None:
            keep &= kv_mask[:, None, None, :].astype(bool)
        masked = jnp.where(keep, logits, -jnp.inf)
        weights = jnp.exp(masked - masked.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
        return jnp.einsum("bnts,bsnh->btnh", weights, v)


def _numpy_attention(q, k, v, scale, keep):
    """Softmax attention `[b, t, n, h]` with `keep[b, t, s]` the visible keys."""
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = np.where(keep[:, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", weights / weights.sum(-1, keepdims=True), v)


def test_the_call_passes_segment_ids_and_the_key_mask_by_name():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 6, 2, 4)).astype(np.float32) for _ in range(3))
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]], np.int32)
    kv_mask = np.array([[1, 1, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1]], bool)
    problem = AttentionProblem.of(q, k, scale=0.5, has_segment_ids=True, has_kv_mask=True)
    out = SegmentSoftmax()(problem, q, k, v, kv_mask=kv_mask, q_segment_ids=segments, kv_segment_ids=segments)
    keep = (segments[:, :, None] == segments[:, None, :]) & kv_mask[:, None, :]
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v, 0.5, keep), rtol=1e-5, atol=1e-6)


def test_support_declines_the_kernels_own_then_the_unknown_extras():
    q = np.zeros((1, 4, 2, 4), np.float32)
    kernel = SegmentSoftmax()
    assert kernel.is_supported(AttentionProblem.of(q, q))
    own = kernel.is_supported(AttentionProblem.of(q, q, softcap=2.0, extras=("zigzag",)))
    assert not own and own.reason == "does not implement a soft-cap"
    extra = kernel.is_supported(AttentionProblem.of(q, q, extras=("zigzag",)))
    assert not extra and "zigzag" in extra.reason


def test_the_call_refuses_declined_inputs_naming_the_kernel():
    q = np.zeros((1, 4, 2, 4), np.float32)
    problem = AttentionProblem.of(q, q)
    with pytest.raises(ValueError, match=r"segment_softmax attention was given \['bias', 'q_positions'\]"):
        SegmentSoftmax()(problem, q, q, q, bias=q, q_positions=np.arange(4))
    with pytest.raises(ValueError, match="segment_softmax attention needs q_segment_ids and kv_segment_ids together"):
        SegmentSoftmax()(problem, q, q, q, q_segment_ids=np.zeros((1, 4), np.int32))


def test_a_kernel_may_decline_segment_ids_as_inputs():
    class NoSegments(SegmentSoftmax):
        declined_inputs = ("q_segment_ids", "kv_segment_ids", *SegmentSoftmax.declined_inputs)

    q = np.zeros((1, 4, 2, 4), np.float32)
    ids = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match=r"was given \['kv_segment_ids', 'q_segment_ids'\]"):
        NoSegments()(AttentionProblem.of(q, q), q, q, q, q_segment_ids=ids, kv_segment_ids=ids)
