"""Ops (`dot`, `attention`, `paged_attention`, `rms_norm`), their problems, and the kernel registry."""

from axcore.kernels.adapter_rows import adapter_rows, current_adapter_rows
from axcore.kernels.attention import ATTENTION, AttentionProblem, XlaAttention, causal_mask, sliding_window_mask
from axcore.kernels.dot import DOT, DotProblem, XlaCpuDot, XlaDot, dot_problem, reference_dot
from axcore.kernels.norm import RMS_NORM, RMSNormProblem, XlaRMSNorm, reference_rms_norm, rms_norm_problem
from axcore.kernels.paged_attention import PAGED_ATTENTION, PagedAttentionProblem, XlaPagedAttention
from axcore.kernels.paged_decode_cpu import XlaCpuPagedDecode
from axcore.kernels.registry import (
    SUPPORTED,
    Kernel,
    KernelDecision,
    KernelRegistry,
    Op,
    OpEnvironment,
    OpRegistry,
    Problem,
    Support,
    current_environment,
    current_platform,
    describe_kernel_choices,
    format_kernel_decisions,
    op_environment,
    record_kernel_choices,
    record_kernel_decisions,
    unknown_extras,
)

__all__ = [
    "ATTENTION",
    "DOT",
    "PAGED_ATTENTION",
    "RMS_NORM",
    "SUPPORTED",
    "AttentionProblem",
    "DotProblem",
    "Kernel",
    "KernelDecision",
    "KernelRegistry",
    "Op",
    "OpEnvironment",
    "OpRegistry",
    "PagedAttentionProblem",
    "Problem",
    "RMSNormProblem",
    "Support",
    "XlaAttention",
    "XlaCpuDot",
    "XlaCpuPagedDecode",
    "XlaDot",
    "XlaPagedAttention",
    "XlaRMSNorm",
    "adapter_rows",
    "causal_mask",
    "current_adapter_rows",
    "current_environment",
    "current_platform",
    "describe_kernel_choices",
    "dot_problem",
    "format_kernel_decisions",
    "op_environment",
    "record_kernel_choices",
    "record_kernel_decisions",
    "reference_dot",
    "reference_rms_norm",
    "rms_norm_problem",
    "sliding_window_mask",
    "unknown_extras",
]
