"""llm_kernels: fused GPU kernels for transformer inference (CUDA and HIP), with CPU fallbacks.

    import llm_kernels as lk
    y = lk.rms_norm(x, weight, eps=1e-6)
    y, residual = lk.fused_add_rms_norm(x, residual, weight, eps=1e-6)
    h = lk.swiglu(gate, up); h = lk.silu_and_mul(gate_up)      # silu(gate) * up
    h = lk.geglu(gate, up, approximate="tanh"); h = lk.gelu_and_mul(gate_up)

    report = lk.kernelize(hf_model)   # a Hugging Face LLaMA/Qwen/Gemma/Phi-3/... on our kernels

Ops live in torch.ops.llm_kernels.*; reference implementations in llm_kernels.reference.
"""

from ._library import gpu_backend, library_path
from .ops import (
    apply_rotary_pos_emb,
    fused_add_rms_norm,
    gelu_and_mul,
    geglu,
    geglu_chunked,
    rms_norm,
    rope,
    rope_angles,
    silu_and_mul,
    swiglu,
)
from .layers import GEGLU, GateUpMLP, LlamaMLP, RMSNorm
from . import monarch, reference
from .flash import attention, attention_varlen, patch_sdpa, sdpa
from .monarch import MonarchLinear, load_monarch, monarch_matmul, monarchize, save_monarch
from .hf import KernelizeReport, kernelize, unkernelize
from .decode import (decode_attention, rope_write_kv_cache, skinny_gemm, skinny_gemm_rope_kv,  # issue 5: the decode path
                     write_kv_cache)

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "swiglu",
    "geglu",
    "silu_and_mul",
    "gelu_and_mul",
    "geglu_chunked",
    "rope",
    "rope_angles",
    "apply_rotary_pos_emb",
    "attention",
    "attention_varlen",
    "sdpa",
    "patch_sdpa",
    "RMSNorm",
    "LlamaMLP",
    "GateUpMLP",
    "GEGLU",
    "reference",
    "monarch",
    "MonarchLinear",
    "monarch_matmul",
    "monarchize",
    "save_monarch",
    "load_monarch",
    "kernelize",
    "unkernelize",
    "KernelizeReport",
    "decode_attention",
    "write_kv_cache",
    "rope_write_kv_cache",
    "skinny_gemm",
    "skinny_gemm_rope_kv",
    "gpu_backend",
    "library_path",
]
__version__ = "0.1.0"
