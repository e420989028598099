"""Kernel registry and the attention op."""

from axcore.kernels.attention import ATTENTION_OP, AttentionProblem, XlaAttention, causal_mask
from axcore.kernels.registry import SUPPORTED, Kernel, KernelRegistry, Support

__all__ = [
    "ATTENTION_OP",
    "SUPPORTED",
    "AttentionProblem",
    "Kernel",
    "KernelRegistry",
    "Support",
    "XlaAttention",
    "causal_mask",
]
