"""The TPU attention kernels (splash, Pallas TPU flash), in interpret mode, run axcore's attention
conformance suite: one case each, at the 128-lane sequence length they need (more shapes and
bfloat16 are in test_tpu_attention.py)."""

from axcore.testing import AttentionCase, AttentionKernelConformance

from axcore_tpu.flash_attention import PallasTpuAttention
from axcore_tpu.splash_attention import SplashAttention

# Every mask kind and GQA in one case, at the smallest length the kernels take (row 1 is padded).
CASE = dict(batch=2, q_len=128, kv_len=128, num_heads=2, num_kv_heads=1, head_dim=8, causal=True, kv_padding=16)


class TestSplashAttentionInterpret(AttentionKernelConformance):
    kernel = SplashAttention(interpret=True)
    cases = (
        AttentionCase("f32-causal-gqa-sliding-padding", sliding_window=40, **CASE),
        # Two 128-lane blocks: the block edge inside the window and the causal diagonal.
        AttentionCase("f32-causal-two-blocks", **{**CASE, "q_len": 256, "kv_len": 256, "kv_padding": 37}, sliding_window=150),
    )


class TestPallasTpuAttentionInterpret(AttentionKernelConformance):
    kernel = PallasTpuAttention(interpret=True)
    # No sliding window: it declines one (the suite checks the decline has a reason).
    cases = (
        AttentionCase("f32-causal-gqa-padding", **CASE),
        AttentionCase("f32-causal-two-blocks", **{**CASE, "q_len": 256, "kv_len": 256, "kv_padding": 37}),
    )
