"""llm_kernels: fused GPU kernels for transformer inference (CUDA and HIP), with CPU fallbacks.

    import llm_kernels as lk
    y = lk.rms_norm(x, weight, eps=1e-6)
    y, residual = lk.fused_add_rms_norm(x, residual, weight, eps=1e-6)

Ops live in torch.ops.llm_kernels.*; reference implementations in llm_kernels.reference.
"""

from ._library import gpu_backend, library_path
from .ops import fused_add_rms_norm, rms_norm
from .layers import RMSNorm
from . import reference

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "RMSNorm",
    "reference",
    "gpu_backend",
    "library_path",
]
__version__ = "0.1.0"
