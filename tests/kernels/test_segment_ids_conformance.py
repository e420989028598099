"""The conformance suite's segment-ids check (`check_segment_ids`) passes honest kernels and fails wrong ones."""

import dataclasses

import pytest

from axcore.kernels import Support, XlaAttention
from axcore.testing import DEFAULT_CASES
from axcore.testing.conformance import check_segment_ids, segment_lengths

CASES = {c.name: c for c in DEFAULT_CASES}


class IgnoresSegments(XlaAttention):
    """Accepts segment ids and drops them: packed documents attend to each other."""

    name = "ignores_segments"

    def __call__(self, problem, q, k, v, *, q_segment_ids=None, kv_segment_ids=None, **kw):
        return super().__call__(dataclasses.replace(problem, has_segment_ids=False), q, k, v, **kw)


class Declines(XlaAttention):
    name = "declines"

    def __init__(self, reason):
        self.reason = reason

    def is_supported(self, problem):
        return Support(False, self.reason) if problem.has_segment_ids else super().is_supported(problem)


def test_segment_lengths_fill_each_row():
    assert segment_lengths(8, 2) == [[3, 3, 2], [5, 3]]
    assert [sum(r) for r in segment_lengths(128, 3)] == [128] * 3


@pytest.mark.parametrize("case", ["f32", "f32-causal-gqa", "bf16-causal-gqa"])
def test_the_reference_kernel_keeps_segments_apart(case):
    assert check_segment_ids(XlaAttention(), CASES[case])


def test_a_kernel_that_ignores_segment_ids_fails():
    with pytest.raises(AssertionError, match="differs from the attention formula"):
        check_segment_ids(IgnoresSegments(), CASES["f32-causal-gqa"])


def test_a_decline_needs_a_reason():
    assert not check_segment_ids(Declines("no segment ids here"), CASES["f32"])
    with pytest.raises(AssertionError, match="declined segment ids without a reason"):
        check_segment_ids(Declines(" "), CASES["f32"])
