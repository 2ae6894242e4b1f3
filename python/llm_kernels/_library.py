"""Loads the compiled op library (libllmk_torch.so) that registers torch.ops.llm_kernels.*."""

from __future__ import annotations

import ctypes
import os
import pathlib

import torch

_HERE = pathlib.Path(__file__).resolve().parent


def library_path() -> pathlib.Path:
    for name in ("libllmk_torch.so", "libllmk_torch.dylib", "llmk_torch.dll"):
        if (_HERE / name).exists():
            return _HERE / name
    raise ImportError(
        f"llm_kernels: the compiled library is missing from {_HERE}; "
        "install the package with `pip install --no-build-isolation .`"
    )


torch.ops.load_library(str(library_path()))


def _build_string(symbol: str) -> str:
    fn = getattr(ctypes.CDLL(str(_HERE / "libllmk.so")), symbol)
    fn.restype = ctypes.c_char_p
    return fn().decode()


def gpu_backend() -> str:
    """'cuda', 'hip' or 'off': the GPU backend libllmk was built with."""
    return _build_string("llmk_gpu_backend")


def gpu_targets() -> list[str]:
    """The GPU targets libllmk holds code for, as the build named them: CUDA architectures
    ('80', '90a') or AMD processors ('gfx90a', 'gfx942'); empty without a GPU backend."""
    return [t for t in _build_string("llmk_gpu_targets").split(",") if t]


# Read once at import: torch.compile cannot trace the ctypes call, and the rules that route calls
# by the kernel that would run (flash._runs_portable_kernel, decode.skinny_takes) run inside
# compiled graphs.
GPU_BACKEND = gpu_backend()


def device_major(device) -> int:
    """The GPU's compute capability major number (torch.compile folds it to a constant)."""
    return torch.cuda.get_device_properties(device).major


def env_flag(name: str) -> bool:
    """gpu::env_flag's rule (src/gpu/runtime.h): the variable is set, not empty and not "0"."""
    return os.environ.get(name, "") not in ("", "0")


def eight_element_loads_ruled_out(tensors, counts) -> bool:
    """Whether gpu::vector_width (src/gpu/runtime.h) would give 16-bit tensors less than 8-element
    (16-byte) loads: an element count (row length, stride) not a multiple of 8, or a data pointer
    not 16-byte aligned. Pointers are unknown while torch.compile traces and are not checked then
    (a misaligned input runs the scalar-load kernel: right, only slower)."""
    if any(c % 8 != 0 for c in counts):
        return True
    return not torch.compiler.is_compiling() and any(t.data_ptr() % 16 != 0 for t in tensors)
