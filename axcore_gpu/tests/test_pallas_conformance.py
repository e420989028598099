"""The Pallas GPU attention kernel, in interpret mode, runs axcore's attention conformance suite (small cases)."""

from axcore.testing import AttentionCase, AttentionKernelConformance

from axcore_gpu.pallas_attention import PallasAttention


class TestPallasAttentionInterpret(AttentionKernelConformance):
    kernel = PallasAttention(interpret=True)
    # Interpret mode is slow to compile (~5 s a case): one small case with every mask and GQA;
    # bfloat16 and more shapes are in test_pallas_attention.py.
    cases = (
        AttentionCase("f32-causal-gqa-sliding-padding", num_heads=4, num_kv_heads=2, causal=True, sliding_window=3,
                      kv_padding=2),
        # Past the 64-row default blocks and a multiple of none: block edges, internal padding, skipped blocks.
        AttentionCase("f32-causal-long-padding", q_len=200, kv_len=200, num_heads=2, num_kv_heads=1, causal=True,
                      kv_padding=37),
    )
