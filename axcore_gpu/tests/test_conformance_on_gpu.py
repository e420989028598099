"""Every GPU attention kernel, compiled for the GPU (not interpreted), runs axcore's attention conformance suite.

Skipped without a CUDA GPU (CI has none); on a GPU machine `pytest tests/gpu` runs them.
The interpret-mode suites (`test_pallas_conformance.py`) check the Pallas kernel's
arithmetic on CPU; these check what the GPU actually runs: Triton's lowering of the Pallas
kernel and cuDNN's fused attention, over the default cases (float32 and bfloat16, causal,
GQA, sliding windows, padding, a 200-token case past the tile sizes) and segment ids.
"""

import jax
import pytest

from axcore.testing import AttentionKernelConformance

from axcore_gpu.cudnn_attention import CudnnAttention
from axcore_gpu.pallas_attention import PallasAttention

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (compiled kernels)")


class TestPallasAttentionOnGpu(AttentionKernelConformance):
    kernel = PallasAttention()
    platform = "gpu"


class TestPallasAttentionLargeBlocksOnGpu(AttentionKernelConformance):
    kernel = PallasAttention(block_q=128, block_k=64, block_q_backward=64, block_k_backward=128)
    platform = "gpu"


class TestCudnnAttentionOnGpu(AttentionKernelConformance):
    kernel = CudnnAttention()
    platform = "gpu"
