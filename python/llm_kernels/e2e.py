"""What `llm-kernels e2e` measures: a whole LLaMA-shaped model (random weights, built from a config:
nothing is downloaded), in several variants, for prefill latency, decode tokens/s and peak memory,
with the kernelized model's logits checked against Hugging Face eager beside the speed.

Variants: hf_eager, hf_sdpa (Hugging Face's attention implementations), compile (hf_sdpa under
torch.compile), kernelized (llm_kernels.kernelize(fuse=False), as before), kernelized_compile,
kernelized_fused (kernelize's default: gate+up and q+k+v as one skinny GEMM each at decode shapes),
kernelized_fused_compile, kernelized_monarch (kernelized_fused with the q/k/v/o projections of the
last `monarch_last` decoder layers projected onto Monarch factors of `monarch_nblocks` blocks: lossy,
so its logits are not compared; its roof counts the bytes of its own, smaller weights), and
hf_sdpa under torch.compile's other modes: compile_reduce_overhead (its own CUDA graphs) and
compile_max_autotune (max-autotune-no-cudagraphs), last in priority.

Prefill: one forward over `prefill_len` tokens at batch 1, no cache, last-token logits only
(as generate does), median of CUDA-event times.
Decode: a static KV cache (transformers' StaticCache) filled with `context` tokens, then greedy
steps of one token per sequence at each batch size. On the GPU one step (forward, argmax, position
and mask updates) is captured in a CUDA graph and replayed, so launch overhead is gone for every
variant alike; compiled variants compile the forward and are captured the same way, except
compile_reduce_overhead, whose steps replay torch.compile's own CUDA graphs.
Where the capture fails the step runs eagerly and the record says so.
Memory: peak allocated bytes during each measurement (weights included).
Correctness: logits over the whole prompt of kernelized and hf_sdpa vs hf_eager: max abs diff and
top-1 agreement.

A time budget keeps the run short: measurements run in priority order and a measurement that does
not fit in the time left is skipped (and listed as skipped). Compile measurements are the slow ones.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import statistics
import time
import traceback
from typing import Callable

import torch

from . import bench
from . import hf as kz

CONFIGS = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    # Llama-3-8B's shapes (grouped K/V heads, intermediate 14336, a 128256-token head): the decode
    # GEMMs of the 4096 x 14336 / 14336 x 4096 rows inside a model (16 GB of bf16 weights)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}
# --family: the Hugging Face classes the config's shapes are built into, and what else the family's
# config needs (head_dim is always hidden / heads, so every family has the config's shapes).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(hidden_activation="gelu_pytorch_tanh")),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "glm": ("GlmConfig", "GlmForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}
VARIANTS = ("hf_eager", "hf_sdpa", "compile", "kernelized", "kernelized_compile", "kernelized_fused",
            "kernelized_fused_no_pdl", "kernelized_fused_compile", "kernelized_monarch", "compile_reduce_overhead",
            "compile_max_autotune")
# variants that change the model's weights (a lossy projection): no logit comparison
LOSSY_VARIANTS = ("kernelized_monarch",)
# kernelized_fused without programmatic dependent launch (LLMK_PDL=0 while the variant is active;
# the others run with it, the library's default: our kernels may launch while the previous one
# finishes; NVIDIA compute capability 9.0+, elsewhere the same as kernelized_fused)
NO_PDL_VARIANTS = ("kernelized_fused_no_pdl",)
# former variant names and what to ask for instead
RENAMED = {"kernelized_fused_pdl": "kernelized_fused (programmatic dependent launch is the default since "
                                   "2026-12-03; kernelized_fused_no_pdl runs without it)"}
# in priority order (the time budget may skip the last ones)
COMPILED = ("compile", "kernelized_fused_compile", "kernelized_compile", "compile_reduce_overhead",
            "compile_max_autotune")
# torch.compile's mode per compiled variant (default: "default"). reduce-overhead captures CUDA
# graphs itself, so its decode steps are not captured again by measure_decode;
# max-autotune-no-cudagraphs (autotuned GEMMs and Triton kernels) is captured like the others.
COMPILE_MODES = {"compile_reduce_overhead": "reduce-overhead", "compile_max_autotune": "max-autotune-no-cudagraphs"}
OWN_GRAPHS = ("compile_reduce_overhead",)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def unknown_variant(v: str) -> str:
    """The error message for a variant name that is not in VARIANTS."""
    if v in RENAMED:
        return f"variant {v!r} is gone: use {RENAMED[v]}"
    return f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}"


@dataclasses.dataclass
class Settings:
    config: str = "1b"
    family: str = "llama"  # FAMILIES: the Hugging Face model class built with the config's shapes
    device: str = "cuda"
    dtype: str = "bf16"
    variants: tuple = VARIANTS
    prefill_len: int = 2048
    context: int = 128  # tokens in the cache before decode steps are timed
    batches: tuple = (1, 32)
    steps: int = 64  # timed decode steps
    iters: int = 10  # timed prefill runs
    budget_s: float = 110.0
    cuda_graphs: bool = True
    monarch_last: int = 6  # kernelized_monarch: decoder layers whose q/k/v/o become Monarch
    monarch_nblocks: int = 4
    # decode steps pass their own 4-D mask (True) or none, so that the model builds its causal mask
    # from the cache positions each step, as a call without attention_mask does (False)
    step_mask: bool = True

    @classmethod
    def quick(cls, device: str, **kw) -> "Settings":
        small = dict(config="tiny", prefill_len=64, context=16, batches=(1, 4), steps=8, iters=3, budget_s=60.0)
        if device == "cuda":
            small.update(config="1b", prefill_len=512, context=32, batches=(1, 32), steps=16, iters=5)
        small.update({k: v for k, v in kw.items() if v is not None})
        return cls(device=device, **small)


@dataclasses.dataclass
class Record:
    variant: str
    metric: str  # "prefill" or "decode"
    batch: int
    tokens: int  # prefill length, or decode steps
    status: str  # ok, skipped, error
    ms: float | None = None  # prefill latency, or time per decode step
    tok_s: float | None = None
    peak_gib: float | None = None
    cuda_graph: bool | None = None
    host_ms: float | None = None  # prefill: how long the call took to return (on the GPU: to enqueue its work)
    weight_bytes: int | None = None  # decode: the bytes of weights this variant's step reads per token
    note: str = ""


# ---------------------------------------------------------------------------------- helpers
def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError("llm-kernels e2e needs transformers (pip install transformers)") from e
    try:  # attention chosen per call from config._attn_implementation: 4.48 and later
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"llm-kernels e2e needs transformers >= 4.48, found {transformers.__version__}") from e
    return transformers


def build_model(name: str, device: str, dtype: torch.dtype, seed: int = 0, family: str = "llama"):
    """A model of `family` (FAMILIES; default LlamaForCausalLM) with the named config's shapes and
    random weights, on `device`."""
    tf = _transformers()
    config_class, model_class, extra = FAMILIES[family]
    if not hasattr(tf, config_class) or not hasattr(tf, model_class):
        raise RuntimeError(f"llm-kernels e2e: transformers {tf.__version__} has no {model_class} (--family {family})")
    shape = CONFIGS[name]
    cfg = getattr(tf, config_class)(**shape, **extra, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                                    max_position_embeddings=8192, tie_word_embeddings=False,
                                    pad_token_id=None, bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(tf, model_class)(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _forward_kwargs(model) -> dict:
    """The names this transformers uses: the cache argument, logits_to_keep, cache_position."""
    names = _params(model.forward)
    return {
        "cache": "cache" if "cache" in names else "past_key_values",
        "keep": next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in names), None),
        "cache_position": "cache_position" in names,
    }


def _static_cache(model, batch: int, max_len: int, device, dtype):
    from transformers import StaticCache

    wanted = dict(config=model.config, max_cache_len=max_len, max_batch_size=batch, batch_size=batch,
                  device=device, dtype=dtype)
    names = _params(StaticCache.__init__)
    return StaticCache(**{k: v for k, v in wanted.items() if k in names})


def _set_attention(model, impl: str) -> None:
    model.config._attn_implementation = impl


_PDL_SAVED: list = []  # the caller's LLMK_PDL while a variant has set it


def _set_pdl(on: bool) -> None:
    """LLMK_PDL=1 (the library's default) for a variant and 0 for a NO_PDL_VARIANTS one, whatever
    the caller set (read by the library at every launch, so CUDA graphs captured meanwhile keep it)."""
    if not _PDL_SAVED:
        _PDL_SAVED.append(os.environ.get("LLMK_PDL"))
    os.environ["LLMK_PDL"] = "1" if on else "0"


def _restore_pdl() -> None:
    """The caller's LLMK_PDL back."""
    if _PDL_SAVED:
        old = _PDL_SAVED.pop()
        if old is None:
            os.environ.pop("LLMK_PDL", None)
        else:
            os.environ["LLMK_PDL"] = old


def activate(model, variant: str, ops=None, s: Settings | None = None) -> Callable:
    """Puts the model in `variant`'s state; returns the callable to run (compiled or not)."""
    kz.unkernelize(model)
    _set_pdl(variant not in NO_PDL_VARIANTS)
    _set_attention(model, "eager" if variant == "hf_eager" else "sdpa")
    if variant == "kernelized_monarch":
        s = s or Settings()
        kz.kernelize(model, ops=ops, monarch_last=s.monarch_last, monarch_nblocks=s.monarch_nblocks)
    elif variant.startswith("kernelized"):
        # kernelized: as before (no GEMM fusion); kernelized_fused: gate+up and q+k+v fused
        kz.kernelize(model, ops=ops, fuse="fused" in variant)
    if variant in COMPILED:
        return torch.compile(model, dynamic=False, mode=COMPILE_MODES.get(variant, "default"))
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device: str, iters: int, warmup: int = 2) -> tuple[float, float]:
    """Medians over iters calls of (elapsed ms, host ms). On the GPU: the time between CUDA events
    around fn, and the time fn takes to return, i.e. to enqueue its kernels (near the elapsed time
    when the call is bound by its launches, or when it synchronises inside); on the CPU both are
    the wall time."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times, host = [], []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            host.append(times[-1])
    return statistics.median(times), statistics.median(host)


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


# ------------------------------------------------------------------------------ measurements
def measure_prefill(model, fn, s: Settings, ids: torch.Tensor) -> Record:
    names = _forward_kwargs(model)
    kwargs = {"use_cache": False}
    if names["keep"]:
        kwargs[names["keep"]] = 1

    def run():
        with torch.no_grad():
            return fn(input_ids=ids, **kwargs)

    _reset_peak(s.device)
    ms, host_ms = _time_ms(run, s.device, s.iters)
    return Record("", "prefill", ids.shape[0], ids.shape[1], "ok", ms=ms, tok_s=ids.numel() / ms * 1e3,
                  peak_gib=_peak_gib(s.device), host_ms=host_ms)


class DecodeLoop:
    """Greedy decoding over a static cache, one token per sequence per step(), with every input
    (token ids, position, cache position, additive mask) in fixed tensors updated in place, so a
    step can be captured in a CUDA graph and replayed. `ids` holds the latest token of each row.
    step_mask=False: no mask is passed (the model makes its own from the cache positions)."""

    def __init__(self, model, fn, prompt: torch.Tensor, max_len: int, step_mask: bool = True):
        names = _forward_kwargs(model)
        device, dtype = prompt.device, next(model.parameters()).dtype
        batch, context = prompt.shape
        self.cache = _static_cache(model, batch, max_len, device, dtype)
        pre = {names["cache"]: self.cache, "use_cache": True}
        if names["keep"]:
            pre[names["keep"]] = 1
        if names["cache_position"]:
            pre["cache_position"] = torch.arange(context, device=device)
        with torch.no_grad():
            out = model(input_ids=prompt, **pre)  # the prompt, eager and not timed
        self.ids = out.logits[:, -1:].argmax(-1).to(torch.long).contiguous()
        self.pos = torch.full((1,), context, dtype=torch.long, device=device)
        self.step_mask = step_mask
        self.kwargs = {names["cache"]: self.cache, "use_cache": True, "position_ids": self.pos.view(1, 1)}
        if step_mask:
            # 0 where a cache slot holds a key, the dtype's min elsewhere; step() opens the slot it writes
            self.mask = torch.full((batch, 1, 1, max_len), torch.finfo(dtype).min, dtype=dtype, device=device)
            self.mask[..., :context] = 0
            self.kwargs["attention_mask"] = self.mask
        if names["cache_position"]:
            self.kwargs["cache_position"] = self.pos
        self.fn = fn

    def step(self) -> None:
        with torch.no_grad():
            if self.step_mask:
                self.mask.index_fill_(-1, self.pos, 0.0)
            logits = self.fn(input_ids=self.ids, **self.kwargs).logits
            self.logits = logits  # the step's logits (for checks)
            self.ids.copy_(logits[:, -1:].argmax(-1))
            self.pos.add_(1)


def measure_decode(model, fn, s: Settings, batch: int, vocab: int, own_graphs: bool = False) -> Record:
    """Greedy decode steps after `context` tokens, over a static cache; one step captured in a CUDA
    graph on the GPU (falling back to eager steps if the capture fails)."""
    device = s.device
    warmup = 3
    _reset_peak(device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, vocab, (batch, s.context), generator=gen).to(device)
    loop = DecodeLoop(model, fn, prompt, max_len=s.context + warmup + s.steps + 8, step_mask=s.step_mask)
    graph, note = None, ""
    if device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                loop.step()
        torch.cuda.current_stream().wait_stream(stream)
        if own_graphs:
            note = "decode steps replayed by torch.compile's own CUDA graphs (reduce-overhead)"
        elif s.cuda_graphs:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    loop.step()
            except Exception as e:  # noqa: BLE001 - record it and time eager steps instead
                graph = None
                note = f"CUDA graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); eager steps"
                torch.cuda.synchronize()
    else:
        for _ in range(warmup):
            loop.step()
    run = graph.replay if graph is not None else loop.step
    _sync(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(s.steps):
            run()
        end.record()
        end.synchronize()
        total_ms = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        for _ in range(s.steps):
            run()
        total_ms = (time.perf_counter() - t0) * 1e3
    rec = Record("", "decode", batch, s.steps, "ok", ms=total_ms / s.steps, tok_s=batch * s.steps / total_ms * 1e3,
                 peak_gib=_peak_gib(device), cuda_graph=(graph is not None or own_graphs) if device == "cuda" else None,
                 note=note)
    del graph, loop
    return rec


def profile_decode(s: Settings, variant: str, batch: int = 1, steps: int = 8, top: int = 30) -> dict:
    """Where a decode step's GPU time goes: the kernels of `steps` eager steps of `variant` under
    torch.profiler (kernel durations are the same inside a CUDA graph), grouped by name, beside the
    time of one step replayed from a CUDA graph. The gap between the two is what the graph does not
    hide: launch latency between back-to-back small kernels."""
    from torch.profiler import ProfilerActivity, profile

    if s.device != "cuda":
        raise RuntimeError("llm-kernels e2e --profile: needs the GPU")
    model = build_model(s.config, s.device, DTYPES[s.dtype], family=s.family)
    vocab = model.config.vocab_size
    graph_rec = measure_decode(model, activate(model, variant, s=s), dataclasses.replace(s, steps=max(steps, 16)),
                               batch, vocab)
    fn = activate(model, variant, s=s)
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, vocab, (batch, s.context), generator=gen).to(s.device)
    loop = DecodeLoop(model, fn, prompt, max_len=s.context + steps + 8, step_mask=s.step_mask)
    for _ in range(3):
        loop.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.step()
        torch.cuda.synchronize()
    kernels = []
    for ev in prof.key_averages():
        total = getattr(ev, "self_device_time_total", None)
        if total is None:
            total = getattr(ev, "self_cuda_time_total", 0.0)
        if total <= 0:
            continue
        kernels.append({"name": ev.key, "calls_per_step": ev.count / steps, "us_per_step": total / steps,
                        "us_per_call": total / ev.count})
    kernels.sort(key=lambda k: -k["us_per_step"])
    kz.unkernelize(model)
    _restore_pdl()
    return {
        "variant": variant, "batch": batch, "steps": steps,
        "graph_step_us": graph_rec.ms * 1e3 if graph_rec.ms else None,
        "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
        "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
        "weight_bytes_per_token": _weight_bytes(model),
        "top": kernels[:top],
    }


def correctness(model, s: Settings, ids: torch.Tensor, ops=None) -> list[dict]:
    """Logits over the whole prompt of hf_sdpa and kernelized against hf_eager."""
    logits = {}
    checked = ("hf_sdpa", "kernelized", "kernelized_fused", "kernelized_fused_no_pdl")
    for variant in ("hf_eager",) + checked:
        fn = activate(model, variant, ops)
        with torch.no_grad():
            logits[variant] = fn(input_ids=ids, use_cache=False).logits.float()
    kz.unkernelize(model)
    _restore_pdl()
    ref = logits["hf_eager"]
    out = []
    for variant in checked:
        got = logits[variant]
        out.append({
            "variant": variant, "vs": "hf_eager",
            "max_abs_diff": float((got - ref).abs().max()),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "max_abs_logit": float(ref.abs().max()),
            "tokens": ids.numel(),
        })
    return out


def _weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter, less the input embedding (one row
    per token), unless it is tied to the output head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not emb:
        total -= emb.numel() * emb.element_size()
    return total


def _meta(model, s: Settings, copy_gbps: float | None) -> dict:
    import transformers

    from .bench import _meta as bench_meta

    meta = bench_meta(s.device, copy_gbps or 0.0)
    meta.pop("timer", None)
    nparams = sum(p.numel() for p in model.parameters())
    wbytes = _weight_bytes(model)
    meta.update(
        transformers=transformers.__version__, config=s.config, family=s.family, model_class=type(model).__name__,
        model_shape=CONFIGS[s.config], params=nparams,
        dtype=s.dtype, prefill_len=s.prefill_len, context=s.context, decode_steps=s.steps, prefill_iters=s.iters,
        budget_s=s.budget_s, weight_bytes_per_token=wbytes, monarch_last=s.monarch_last,
        monarch_nblocks=s.monarch_nblocks,
        decode_step_mask="the loop's own 4-D mask" if s.step_mask else "none (the model builds its causal mask)",
        decode_exact_lengths=kz.EXACT_LENGTHS,  # LLMK_DECODE_EXACT_LENGTHS, as read at import
        timer="CUDA events, prefill median; decode total over the steps" if s.device == "cuda" else "wall clock",
        compile_mode="torch.compile, dynamic=False: default mode (compile, kernelized_*_compile), "
                     "reduce-overhead (compile_reduce_overhead: its own CUDA graphs), max-autotune-no-cudagraphs "
                     "(compile_max_autotune); the others' decode step captured in our CUDA graph",
    )
    if copy_gbps:
        meta["decode_roof_tok_s_batch1"] = copy_gbps * 1e9 / wbytes
    return meta


# ------------------------------------------------------------------------------------- run
def plan(s: Settings) -> list[tuple[str, str, int]]:
    """(variant, metric, batch) in priority order: eager variants first, then compiled ones."""
    eager = [v for v in ("hf_sdpa", "kernelized_fused", "kernelized_fused_no_pdl", "kernelized", "hf_eager",
                         "kernelized_monarch") if v in s.variants]
    compiled = [v for v in COMPILED if v in s.variants]
    units = [(v, "prefill", 1) for v in eager]
    for b in s.batches:
        units += [(v, "decode", b) for v in eager]
    b1 = s.batches[:1]
    units += [(v, "decode", b) for b in b1 for v in compiled]
    units += [(v, "prefill", 1) for v in compiled]
    units += [(v, "decode", b) for b in s.batches[1:] for v in compiled]
    return units


def run(s: Settings, progress=None, log=print, ops=None) -> dict:
    for v in s.variants:
        if v not in VARIANTS:
            raise ValueError(f"llm-kernels e2e: {unknown_variant(v)}")
    if s.config not in CONFIGS:
        raise ValueError(f"llm-kernels e2e: unknown config {s.config!r}; choose from {', '.join(CONFIGS)}")
    if s.family not in FAMILIES:
        raise ValueError(f"llm-kernels e2e: unknown family {s.family!r}; choose from {', '.join(FAMILIES)}")
    if s.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("llm-kernels e2e: --device cuda but torch sees no GPU")
    t0 = time.perf_counter()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    dtype = DTYPES[s.dtype]
    model = build_model(s.config, s.device, dtype, family=s.family)
    vocab = model.config.vocab_size
    copy_gbps = None
    if s.device == "cuda":
        from .bench import _event_timer, copy_bandwidth_gbps

        copy_gbps = copy_bandwidth_gbps("cuda", _event_timer)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (1, s.prefill_len), generator=gen).to(s.device)
    log(f"model {s.config} built ({_count(sum(p.numel() for p in model.parameters()))} params) "
        f"in {time.perf_counter() - t0:.1f} s")
    result = {"meta": _meta(model, s, copy_gbps), "correctness": [], "records": [], "kernelize": []}
    try:
        result["correctness"] = correctness(model, s, ids, ops)
    except Exception as e:  # noqa: BLE001
        result["correctness_error"] = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    report = kz.kernelize(model, ops=ops)
    result["kernelize"] = [dataclasses.asdict(r) for r in report]
    kz.unkernelize(model)

    units = plan(s)
    if s.device != "cuda":
        if any(u[0] in COMPILED for u in units):
            result["meta"]["note"] = "compile variants run on the GPU only"
        units = [u for u in units if u[0] not in COMPILED]
    task = progress.add_task("e2e", total=len(units)) if progress else None
    compile_times: list[float] = []  # seconds each compiled measurement took (compiling included)
    for variant, metric, batch in units:
        elapsed = time.perf_counter() - t0
        need = (max(compile_times) if compile_times else 60.0) if variant in COMPILED else 3.0
        tokens = s.prefill_len if metric == "prefill" else s.steps
        if elapsed + need > s.budget_s:
            rec = Record(variant, metric, batch, tokens, "skipped",
                         note=f"time budget ({s.budget_s:.0f} s; {elapsed:.0f} s used, needs ~{need:.0f} s)")
        else:
            u0 = time.perf_counter()
            try:
                fn = activate(model, variant, ops, s)
                if metric == "prefill":
                    rec = measure_prefill(model, fn, s, ids)
                else:
                    rec = measure_decode(model, fn, s, batch, vocab, own_graphs=variant in OWN_GRAPHS)
                    rec.weight_bytes = _weight_bytes(model)
                rec.variant = variant
            except Exception as e:  # noqa: BLE001 - keep going: one variant failing says something
                rec = Record(variant, metric, batch, tokens, "error", note=f"{type(e).__name__}: {str(e)[:300]}")
                log(f"{variant} {metric} b{batch}: {traceback.format_exc()}")
            finally:
                kz.unkernelize(model)
                _restore_pdl()
            if variant in COMPILED:
                compile_times.append(time.perf_counter() - u0)
        result["records"].append(dataclasses.asdict(rec))
        if progress:
            progress.advance(task)
    result["meta"]["wall_s"] = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------------------- output
def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """The summary table: one row per variant."""
    recs = result["records"]
    batches = sorted({r["batch"] for r in recs if r["metric"] == "decode"})
    corr = {c["variant"]: c for c in result["correctness"]}
    roof = result["meta"].get("decode_roof_tok_s_batch1")
    base = next((r for r in recs if r["variant"] == "hf_sdpa" and r["metric"] == "prefill" and r["status"] == "ok"), None)
    header = ["variant", "prefill ms", "vs hf_sdpa"]
    for b in batches:
        header.append(f"decode b{b} tok/s")
    if roof:
        header.append("b1 % of roof")
    header += ["peak GiB", "max abs Δlogit vs eager", "top-1 vs eager"]
    table = []
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    for v in VARIANTS:
        if v not in variants:
            continue
        mine = [r for r in recs if r["variant"] == v]

        def cell(metric, batch, key, spec):
            r = next((r for r in mine if r["metric"] == metric and r["batch"] == batch), None)
            if r is None:
                return "-"
            if r["status"] != "ok":
                return r["status"]
            text = _fmt(r[key], spec)
            return text + (" (no graph)" if r.get("cuda_graph") is False else "")

        pre = next((r for r in mine if r["metric"] == "prefill" and r["status"] == "ok"), None)
        row = [v, cell("prefill", 1, "ms", ".2f"),
               f"{base['ms'] / pre['ms']:.2f}x" if base and pre else "-"]
        for b in batches:
            row.append(cell("decode", b, "tok_s", ".0f"))
        if roof:
            r1 = next((r for r in mine if r["metric"] == "decode" and r["batch"] == 1 and r["status"] == "ok"), None)
            own = r1 and r1.get("weight_bytes") and result["meta"].get("copy_gbps")
            # each variant against the bytes its own weights take (fewer for the Monarch variant)
            r1_roof = result["meta"]["copy_gbps"] * 1e9 / r1["weight_bytes"] if own else roof
            row.append(f"{100 * r1['tok_s'] / r1_roof:.0f}%" if r1 else "-")
        peaks = [r["peak_gib"] for r in mine if r["peak_gib"] is not None]
        row.append(f"{max(peaks):.2f}" if peaks else "-")
        c = corr.get(v)
        if v == "hf_eager":
            row += ["(reference)", "(reference)"]
        elif v in LOSSY_VARIANTS:
            row += ["(lossy)", "(lossy)"]
        else:
            row += [_fmt(c and c["max_abs_diff"], ".3g"), f"{100 * c['top1_agreement']:.1f}%" if c else "-"]
        table.append(row)
    return header, table


def notes(result: dict) -> list[str]:
    out = []
    if result["meta"].get("note"):
        out.append(result["meta"]["note"])
    if result.get("correctness_error"):
        out.append(f"correctness check failed: {result['correctness_error']}")
    for r in result["records"]:
        if r["note"]:
            out.append(f"{r['variant']} {r['metric']} b{r['batch']}: {r['status']}: {r['note']}")
    hosted = [r for r in result["records"] if r["metric"] == "prefill" and r["status"] == "ok"
              and r.get("host_ms") is not None]
    if result["meta"].get("device") == "cuda" and hosted:
        times = ", ".join(f"{r['variant']} {r['host_ms']:.2f} of {r['ms']:.2f} ms" for r in hosted)
        out.append(f"prefill, time for the forward call to return (Python enqueueing the kernels) of the GPU "
                   f"time: {times} (near the GPU time: bound by launches, or synchronising inside)")
    if any(r["variant"] == "kernelized_monarch" for r in result["records"]):
        m = result["meta"]
        out.append(f"kernelized_monarch: kernelized_fused with q/k/v/o of the last {m.get('monarch_last')} decoder "
                   f"layers projected onto Monarch factors of {m.get('monarch_nblocks')} blocks (lossy, so its logits "
                   f"are not compared; its % of roof counts its own weights' bytes)")
    swapped = [k for k in result["kernelize"] if k["replacement"]]
    fams = sorted({k["family"] for k in swapped})
    out.append(f"kernelize swapped {len(swapped)} modules/functions ({', '.join(fams)}); "
               f"left {len(result['kernelize']) - len(swapped)} alone")
    return out


def to_markdown(result: dict, command: str = "") -> str:
    meta = result["meta"]
    where = meta.get("gpu", meta.get("cpu"))
    lines = [
        f"### End to end: {meta.get('model_class', 'LlamaForCausalLM')} with the {meta['config']} shapes "
        f"({_count(meta['params'])} params, {meta['dtype']}, random weights)",
        "",
        f"Measured {meta['date']} on {where} (torch {meta['torch']}, transformers {meta['transformers']}); "
        f"prefill {meta['prefill_len']} tokens at batch 1; decode {meta['decode_steps']} steps after "
        f"{meta['context']} cached tokens, static cache"
        + (", CUDA graphs" if meta["device"] == "cuda" else "") + f"; {meta['timer']}.",
    ]
    if meta.get("copy_gbps"):
        lines.append(f"Copy bandwidth {meta['copy_gbps'] / 1000:.2f} TB/s; weight-streaming roof at batch 1: "
                     f"{meta['decode_roof_tok_s_batch1']:.0f} tok/s ({meta['weight_bytes_per_token'] / 1e9:.2f} GB per token).")
    if command:
        lines.append(f"Command: `{command}`")
    header, table = rows(result)
    lines += ["", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    extra = notes(result)
    if extra:
        lines += ["", "Notes:"] + [f"- {n}" for n in extra]
    return "\n".join(lines) + "\n"


def to_rich(result: dict):
    from rich.table import Table

    meta = result["meta"]
    header, table = rows(result)
    t = Table(title=f"llm-kernels e2e: {meta.get('family', 'llama')} {meta['config']} {meta['dtype']} on "
                    f"{meta.get('gpu', meta.get('cpu'))}")
    for h in header:
        t.add_column(h, justify="left" if h == "variant" else "right")
    for r in table:
        t.add_row(*r)
    return t


def save(result: dict, json_path: str | None, md_path: str | None, command: str = "") -> None:
    bench.write_outputs(result, json_path, md_path, to_markdown(result, command))
