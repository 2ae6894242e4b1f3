import os
import re
import zlib

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if os.environ.get("LLMK_REQUIRE_GPU") and not HAS_GPU:
    raise RuntimeError("LLMK_REQUIRE_GPU is set but torch sees no GPU: refusing to skip GPU tests")
GPU_REASON = "no GPU on this machine: GPU case not run"

# Under compute-sanitizer (scripts/gpu_check.sh sets LLMK_MEMCHECK=1, the caching allocator off),
# torch's own memory-efficient SDPA kernel (fmha_cutlassF_f32_aligned_64x64_rf_sm80) reads 16 bytes
# past the end of a float32 attention mask that Hugging Face's reference models pass it (H100,
# 2026-12-06: "Invalid __global__ read of size 16 bytes", 120-byte allocation; every share of the
# Python memcheck stopped at test_family_generates_what_the_original_generates). The fault is
# torch's, in the originals our kernels are compared with, and poisons the CUDA context for every
# test after it, so the memcheck run gives torch's math backend that work instead.
if HAS_GPU and os.environ.get("LLMK_MEMCHECK") == "1":
    torch.backends.cuda.enable_mem_efficient_sdp(False)

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


def at_thread_counts(fn, counts=(1, 3)) -> list:
    """[fn() at each torch thread count in counts], the thread count restored after."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)


def caching_allocator_off() -> bool:
    """torch's CUDA caching allocator is off (scripts/gpu_check.sh's memcheck run), so CUDA graphs
    cannot be captured."""
    return bool(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING"))


def skip_graphs_without_caching_allocator(what: str = "") -> None:
    """Skip the rest of a test that captures CUDA graphs when the caching allocator is off
    (scripts/gpu_check.sh's memcheck run: capture needs the allocator). Call it after the test's
    eager part, which then still runs under memcheck. (The reason names no GPU: the GPU-skip checks
    of gpu_check.sh look for that word.)"""
    if caching_allocator_off():
        pytest.skip("CUDA graphs need the caching allocator, off in memcheck runs" + (f": {what}" if what else ""))


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


# ------------------------------------------------------------- tiny Hugging Face models (kernelize)
TINY_HF = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=128, head_dim=64, max_position_embeddings=256)


def tiny_hf_model(config: str, model: str, extra: dict | None = None, attn: str = "sdpa", device: str = "cpu",
                  dtype=torch.float32, seed: int = 0):
    """A 2-layer transformers model of class `model` from config class `config` (TINY_HF plus
    `extra`) with random weights and randomised norm weights (so that the (1 + w) and w forms of
    RMSNorm differ); skips the test where the installed transformers lacks the classes."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, config) or not hasattr(transformers, model):
        pytest.skip(f"transformers {transformers.__version__} has no {model}")
    cfg = getattr(transformers, config)(**{**TINY_HF, **(extra or {})})
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    built = getattr(transformers, model)(cfg)
    with torch.no_grad():
        for name, p in built.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 1.5)
    return built.to(device=device, dtype=dtype).eval()


def hf_logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def hf_ids(device, batch=2, seq=19):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(3)).to(device)


class CountingOps:
    """Stands in for torch.ops.llm_kernels inside llm_kernels.fuse (monkeypatch fuse.decode._ops):
    counts skinny_gemm calls by (activation, weight rows), in `fusions` by (norm prologue?,
    residual epilogue?), and records each call's fixed_weight in `fixed`."""

    def __init__(self, real):
        self.real, self.calls, self.fusions, self.fixed = real, [], [], []

    def __getattr__(self, name):  # every other op as it is
        return getattr(self.real, name)

    def skinny_gemm(self, x, w, b, activation, portable, *fused, **kwargs):
        self.calls.append((activation, w.shape[0]))
        if fused:
            self.fusions.append((fused[0] is not None, len(fused) > 3 and fused[3] is not None))
        self.fixed.append(kwargs.get("fixed_weight", fused[4] if len(fused) > 4 else False))
        return self.real.skinny_gemm(x, w, b, activation, portable, *fused, **kwargs)


def hf_layers_fusable() -> bool:
    """Whether this transformers' LLaMA decoder layer passes kernelize's layout probe for the fused
    decoder layer (layers that return a tensor, not the tuple of transformers 4.48's era)."""
    from llm_kernels import hf

    model = tiny_hf_model("LlamaConfig", "LlamaForCausalLM")
    return hf._probe_layer(model.model.layers[0]) == ""


def hf_kv_patchable() -> bool:
    """Whether this transformers has the static cache layer kernelize's kv_cache patch takes (5.x:
    StaticLayer with a cumulative_length tensor); older ones keep HF's update and report why."""
    from llm_kernels import hf

    static = hf._static_layer_class()
    return static is not None and isinstance(getattr(static(max_cache_len=1), "cumulative_length", None), torch.Tensor)


def hf_left_pad(ids: torch.Tensor) -> torch.Tensor:
    """An attention mask with the first row left-padded by 5 tokens (the masked path)."""
    pad = torch.ones_like(ids)
    pad[0, :5] = 0
    return pad


def hf_padded_errors(model, ids, pad, ref_pad) -> tuple[float, float]:
    """rel_err of the model's logits with the left-padded mask against ref_pad: the unpadded row,
    and the padded row's real tokens."""
    got = hf_logits(model, ids, attention_mask=pad)
    return rel_err(got[1], ref_pad[1]), rel_err(got[0, 5:], ref_pad[0, 5:])


_GPU_SKIP_REASON = re.compile(r"GPU|sm_\d|compute capability")


def _gpu_only(item) -> bool:
    """A test that runs only with a GPU: a cuda parameter (DEVICES) or a skipif whose reason names
    the GPU or a compute capability. Marked llmk_gpu, so that scripts/gpu_check.sh's memcheck can
    select every such test (`-k llmk_gpu`), not only those with "cuda" in their ids."""
    return "cuda" in item.name or any(_GPU_SKIP_REASON.search(str(m.kwargs.get("reason", "")))
                                      for m in item.iter_markers("skipif"))


def pytest_configure(config):
    config.addinivalue_line("markers", "llmk_gpu: runs only with a GPU (set by conftest.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _gpu_only(item):
            item.add_marker("llmk_gpu")
