"""Ops (`dot`, `attention`), their problems, and the kernel registry."""

from axcore.kernels.attention import ATTENTION, AttentionProblem, XlaAttention, causal_mask, sliding_window_mask
from axcore.kernels.dot import DOT, DotProblem, XlaCpuDot, XlaDot, dot_problem, reference_dot
from axcore.kernels.registry import (
    SUPPORTED,
    Kernel,
    KernelRegistry,
    Op,
    OpEnvironment,
    OpRegistry,
    Problem,
    Support,
    current_environment,
    describe_kernel_choices,
    op_environment,
    record_kernel_choices,
    unknown_extras,
)

__all__ = [
    "ATTENTION",
    "DOT",
    "SUPPORTED",
    "AttentionProblem",
    "DotProblem",
    "Kernel",
    "KernelRegistry",
    "Op",
    "OpEnvironment",
    "OpRegistry",
    "Problem",
    "Support",
    "XlaAttention",
    "XlaCpuDot",
    "XlaDot",
    "causal_mask",
    "current_environment",
    "describe_kernel_choices",
    "dot_problem",
    "op_environment",
    "record_kernel_choices",
    "reference_dot",
    "sliding_window_mask",
    "unknown_extras",
]
