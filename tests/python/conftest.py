import os
import zlib

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if os.environ.get("LLMK_REQUIRE_GPU") and not HAS_GPU:
    raise RuntimeError("LLMK_REQUIRE_GPU is set but torch sees no GPU: refusing to skip GPU tests")
GPU_REASON = "no GPU on this machine: GPU case not run"

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON))]

# DESIGN.md tolerances for ||out - ref|| / ||ref|| against a float64 reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    den = (ref if scale is None else scale.double().cpu()).norm()
    num = (out - ref).norm()
    return float(num / den) if den > 0 else float(num)


def rel_err_stored(out: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_err against the float64 reference rounded to out's dtype: the kernel's error beyond the
    rounding that storing the exact answer would need. Matters for elementwise outputs of a few
    elements, where one tiny value (an fp16 subnormal, say) can only be stored to ~1 part in 6."""
    return rel_err(out, ref.to(out.dtype))


def poison_allocator(device: str, nbytes: int) -> None:
    """Fill the GPU caching allocator's free blocks with NaN so an unwritten output shows up."""
    if device == "cuda":
        t = torch.full((max(nbytes, 4) // 4 + 1024,), float("nan"), device=device)
        del t


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test draws its random inputs from its own seed (its name, plus LLMK_TEST_SEED when set),
    so a failure reproduces on rerun; sweep LLMK_TEST_SEED to look for inputs a test is fragile to."""
    base = int(os.environ.get("LLMK_TEST_SEED", "0"))
    torch.manual_seed(base * 1_000_003 + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
