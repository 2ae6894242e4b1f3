"""What `llm-kernels probe` reports: the device, the toolchain, which attention backends the
installed PyTorch really has and which one it runs for a typical fp16 causal call, and whether our
kernels launch with programmatic dependent launch."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ._library import gpu_backend, gpu_targets

_BACKEND_KERNEL_HINTS = {
    "flash": ("flash",),
    "cudnn": ("cudnn",),
    "efficient": ("efficient", "mem_eff", "fmha_cutlass", "attention_kernel"),
}


def _sdpa_backends(device: str) -> dict[str, bool]:
    """Runs one small fp16 causal call with each backend forced: True where it runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 8, 128, 64, device=device, dtype=torch.float16)
    found = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            found[name] = True
        except RuntimeError:
            found[name] = False
    return found


def _sdpa_default_choice(device: str) -> str:
    """Profiles the default fp16 causal SDPA call and names the backend whose kernels ran."""
    q = torch.randn(1, 32, 1024, 128, device=device, dtype=torch.float16)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
    names = " ".join(e.key.lower() for e in prof.key_averages())
    for backend, hints in _BACKEND_KERNEL_HINTS.items():
        if any(h in names for h in hints):
            return backend
    return "math (the S x S path)" if ("bmm" in names or "gemm" in names) else "unknown"


def pdl_state(backend: str, capability: tuple[int, int] | None, env: str | None) -> str:
    """Whether our decode-path kernels launch with programmatic dependent launch, in words: the
    rule of gpu::pdl_enabled (src/gpu/runtime.cu), on for an NVIDIA GPU of compute capability 9.0+
    unless LLMK_PDL=0 (unset or empty: on; read at every launch)."""
    if backend != "cuda" or capability is None:
        return "off (NVIDIA only)" if backend == "hip" else "off (no GPU backend)"
    if tuple(capability) < (9, 0):
        return "off (needs compute capability 9.0+)"
    if env == "0":
        return "off (LLMK_PDL=0)"
    return "on (LLMK_PDL=0 turns it off)"


def code_for_device(backend: str, targets: list[str], arch: str) -> str:
    """Whether the library holds code that runs on a GPU of this arch ("gfx942:sramecc+:xnack-" or
    "sm_90"), in words, with the rebuild command when it does not. AMD GPUs run only code built for
    their exact processor; NVIDIA GPUs run sm_XY code on the same major at minor >= Y (not the
    arch-specific "a" targets, which run only on XY itself) and JIT-compile PTX of an older arch.
    CMake's targets: "80" is sm_80 code plus compute_80 PTX, "80-real" the code alone,
    "80-virtual" the PTX alone."""
    if backend == "off":
        return "no GPU code (a CPU-only build)"
    if backend == "hip":
        processor = arch.split(":")[0]
        if processor in targets:
            return f"yes ({processor} code)"
        return (f"NO: built for {', '.join(targets)}, this GPU is {processor}; rebuild with "
                f"-DLLMK_HIP_ARCHITECTURES={processor} (pip: -C cmake.define.LLMK_HIP_ARCHITECTURES={processor})")
    cc = int(arch.removeprefix("sm_"))
    sass, ptx = [], []
    for t in targets:
        num, _, kind = t.partition("-")
        if not num[:2].isdigit():
            return f"unknown (built for CMake's {t!r})"
        specific = num.endswith(("a", "f"))
        n = int(num.rstrip("af"))
        if kind != "virtual" and (n == cc or (not specific and n // 10 == cc // 10 and n <= cc)):
            sass.append(num)
        if kind != "real" and (n == cc or (not specific and n <= cc)):
            ptx.append(n)
    if sass:
        return f"yes (sm_{max(sass, key=lambda s: int(s.rstrip('af')))} code)"
    if ptx:
        return (f"through PTX: compute_{max(ptx)} is compiled for this GPU when first loaded (slower start; "
                f"no kernels of newer archs); -DCMAKE_CUDA_ARCHITECTURES={cc} builds its own code")
    return (f"NO: built for {', '.join(targets)}, this GPU is sm_{cc}; rebuild with "
            f"-DCMAKE_CUDA_ARCHITECTURES={cc} (pip: -C cmake.define.CMAKE_CUDA_ARCHITECTURES={cc})")


def sdpa_drop_in_choice(device: str) -> str:
    """Who runs llm_kernels.sdpa's typical call here (fp16 (1, 8, 128, 64), causal): ours, or
    PyTorch's and why (flash._why_not_ours)."""
    from . import flash

    q = torch.zeros(1, 8, 128, 64, device=device, dtype=torch.float16)
    why = flash._why_not_ours(q, q, q, None, 0.0, True, None, False)
    return "ours" if why is None else f"PyTorch's SDPA: {why}"


def collect() -> dict:
    info: dict = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "llmk_gpu_backend": gpu_backend(),
        "llmk_gpu_targets": gpu_targets(),
    }
    if not torch.cuda.is_available():
        info["device"] = "cpu (no GPU visible to torch)"
        return info
    p = torch.cuda.get_device_properties(0)
    vendor = "AMD" if torch.version.hip else "NVIDIA"
    # (CUDA builds of torch have gcnArchName too, holding the device's name: read it on ROCm only)
    arch = (getattr(p, "gcnArchName", None) if torch.version.hip else None) or f"sm_{p.major}{p.minor}"
    info.update(
        device=p.name,
        vendor=vendor,
        arch=arch,
        multiprocessors=p.multi_processor_count,
        memory_gib=round(p.total_memory / 2**30, 1),
        warp_size=getattr(p, "warp_size", 64 if vendor == "AMD" and arch.startswith("gfx9") else 32),
    )
    info["llmk_code_for_this_gpu"] = code_for_device(info["llmk_gpu_backend"], info["llmk_gpu_targets"], arch)
    info["programmatic_dependent_launch"] = pdl_state(
        info["llmk_gpu_backend"], None if torch.version.hip else (p.major, p.minor), os.environ.get("LLMK_PDL"))
    info["sdpa_drop_in_fp16"] = sdpa_drop_in_choice("cuda")
    try:
        info["sdpa_backends_available"] = _sdpa_backends("cuda")
        info["sdpa_backend_used_fp16_causal"] = _sdpa_default_choice("cuda")
    except Exception as e:  # a broken backend must not hide the rest of the report
        info["sdpa_probe_error"] = f"{type(e).__name__}: {e}"
    if torch.version.hip:
        enabled = os.environ.get("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL") == "1"
        if not info.get("sdpa_backends_available", {}).get("flash", False):
            info["rocm_note"] = (
                "flash attention is not available"
                + ("" if enabled else "; TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 may enable it on this GPU")
            )
    return info
