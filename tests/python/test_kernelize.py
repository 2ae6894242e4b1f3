"""kernelize / unkernelize on tiny Hugging Face models of each supported family, and `llm-kernels e2e`.

Models are built from configs with random weights (nothing is downloaded); norm weights are
randomised so that Gemma's (1 + w) form and LLaMA's w form give different answers."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

import llm_kernels as lk  # noqa: E402
from llm_kernels import decode, e2e, flash, fuse, hf, layers, ops, rope_kv  # noqa: E402
from llm_kernels.cli import app  # noqa: E402

from conftest import (DEVICES, HAS_GPU, GPU_REASON, CountingOps, hf_ids, hf_kv_patchable,  # noqa: E402
                      hf_layers_fusable, hf_left_pad, hf_logits, hf_padded_errors, rel_err,
                      caching_allocator_off, skip_graphs_without_caching_allocator, tiny_hf_model)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
}
LAYERS = 2


def make(family: str, device: str = "cpu", dtype=torch.float32, seed: int = 0):
    cfg_name, model_name = FAMILIES[family]
    extra = dict(num_hidden_layers=LAYERS)
    if family == "gemma":
        extra.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    return tiny_hf_model(cfg_name, model_name, extra, device=device, dtype=dtype, seed=seed)


logits, ids_for = hf_logits, hf_ids


@pytest.fixture(autouse=True)
def _always_unpatched():
    """No test leaves a rope patch behind (they are process-wide)."""
    yield
    assert hf._ROPE_PATCHES == {}, f"rope patches left: {list(hf._ROPE_PATCHES)}"
    assert hf._KV_PATCH == [], "the StaticLayer.update patch was left on"


def _modeling(model):
    return sys.modules[type(model).__module__]


needs_layer_fusion = pytest.mark.skipif(not hf_layers_fusable(), reason=f"transformers {transformers.__version__}'s "
                                        "decoder layers return a tuple: kernelize leaves the layers unfused")


needs_kv_patch = pytest.mark.skipif(not hf_kv_patchable(), reason=f"transformers {transformers.__version__} has no "
                                    "StaticLayer with cumulative_length (5.x): the kv_cache patch is left alone")


# ---------------------------------------------------------------------------------- swaps
@pytest.mark.parametrize("family", FAMILIES)
def test_kernelize_swaps_each_family(family):
    model = make(family)
    norms = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    expected_norms = LAYERS * (4 if family == "qwen3" else 2) + 1
    assert len(norms) == expected_norms
    original_rope = _modeling(model).apply_rotary_pos_emb
    report = lk.kernelize(model)
    try:
        for name in norms:
            new = model.get_submodule(name)
            assert type(new) is layers.RMSNorm, name
            assert new.offset == (1.0 if family == "gemma" else 0.0)
        for i in range(LAYERS):
            mlp = model.model.layers[i].mlp
            if family == "gemma":
                assert type(mlp) is hf.GatedMLP and mlp.approximate == "tanh"
            else:
                assert type(mlp) is layers.LlamaMLP
        assert _modeling(model).apply_rotary_pos_emb is ops.apply_rotary_pos_emb
        attention = hf.register_attention() == ""  # "" where this transformers supports it
        assert model.config._attn_implementation == (hf.ATTN_NAME if attention else "sdpa")
        fams = {s.family for s in report.swapped}
        kv = hf_kv_patchable()
        assert fams == {"rms_norm", "mlp", "rope", "fuse"} | ({"attention"} if attention else set()) | (
            {"linear"} if hasattr(layers, "Linear") else set()) | ({"kv_cache"} if kv else set())
        assert not kv or hf._static_layer_class().update is hf._static_layer_update
        assert len(report.by_family("rms_norm")) == expected_norms
        assert hf.is_kernelized(model)
        text = str(report)
        assert "RMSNorm" in text and "left alone" in text or not report.left_alone
    finally:
        lk.unkernelize(model)
    assert _modeling(model).apply_rotary_pos_emb is original_rope


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_round_trips(family):
    model = make(family)
    before = model.state_dict(keep_vars=True)
    params_before = {n: p for n, p in model.named_parameters()}
    lk.kernelize(model)
    try:
        after = model.state_dict(keep_vars=True)
        assert list(after) == list(before)
        for k in before:
            assert after[k] is before[k], k
        assert {n: p for n, p in model.named_parameters()}.keys() == params_before.keys()
        # a checkpoint of the original loads strictly into the kernelized model
        fresh = make(family, seed=1)
        model.load_state_dict(fresh.state_dict(), strict=True)
        ids = ids_for("cpu")
        lk.unkernelize(model)
        ref = logits(fresh, ids)
        lk.kernelize(model)
        assert rel_err(logits(model, ids), ref) < 1e-5
    finally:
        lk.unkernelize(model)


def _dtype_cases():
    cases = [("cpu", torch.float32)]
    gpu = pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
    cases += [pytest.param("cuda", torch.float32, marks=gpu), pytest.param("cuda", torch.bfloat16, marks=gpu)]
    return cases


@pytest.mark.parametrize("device,dtype", _dtype_cases())
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_agree_and_unkernelize_is_exact(family, device, dtype):
    model = make(family, device, dtype)
    ids = ids_for(device)
    pad = hf_left_pad(ids)
    ref, ref_pad = logits(model, ids), logits(model, ids, attention_mask=pad)
    modules_before = dict(model.named_modules())
    lk.kernelize(model)
    try:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel_err(logits(model, ids), ref) < tol
        assert all(e < tol for e in hf_padded_errors(model, ids, pad, ref_pad))
    finally:
        lk.unkernelize(model)
    assert not hf.is_kernelized(model)
    after = dict(model.named_modules())
    assert after.keys() == modules_before.keys()
    assert all(after[k] is modules_before[k] for k in after)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_our_attention_kernel_runs_inside_the_model(device, monkeypatch):
    """With our kernel enabled (CPU: flash.use_on_cpu), maskless prefill goes through
    flash.attention, and the logits still agree."""
    if hf.register_attention():
        pytest.skip(hf.register_attention())
    monkeypatch.setattr(flash, "use_on_cpu", True)
    calls = []
    real = flash.attention
    monkeypatch.setattr(flash, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = make("llama", device)
    ids = ids_for(device, batch=1, seq=33)
    ref = logits(model, ids)
    lk.kernelize(model)
    try:
        out = logits(model, ids)
    finally:
        lk.unkernelize(model)
    if device == "cpu":  # on the GPU: ours once its kernel takes fp32 (issue 4), PyTorch before
        assert len(calls) == LAYERS
    assert rel_err(out, ref) < 1e-5


def test_masked_decode_steps_use_our_decode_kernel(device, monkeypatch):
    """Decode steps over a static cache carry a 4-D mask: they run decode_attention with that mask
    (CPU: flash.use_on_cpu), and the logits agree with HF's sdpa."""
    if hf.register_attention():
        pytest.skip(hf.register_attention())
    monkeypatch.setattr(flash, "use_on_cpu", True)
    calls = []
    real = decode.decode_attention
    monkeypatch.setattr(decode, "decode_attention", lambda *a, **k: calls.append(k["attn_mask"].shape) or real(*a, **k))
    dtype = torch.float16 if device == "cuda" else torch.float32  # the GPU kernel takes fp16/bf16
    model = make("llama", device, dtype=dtype)
    prompt = ids_for(device, batch=2, seq=9)
    _, ref = hf_decode_steps(model, prompt, step_mask=True)
    lk.kernelize(model)
    try:
        replay_decode_steps(model, prompt, ref, step_mask=True)
    finally:
        lk.unkernelize(model)
    assert len(calls) >= 3 * LAYERS and calls[0] == (2, 1, 1, 24)


def hf_decode_steps(model, prompt, step_mask: bool, steps: int = 3):
    """The (not kernelized) model's greedy decode over a static cache of 24 slots: the loop and,
    per step, (the tokens fed, the logits)."""
    loop = e2e.DecodeLoop(model, model, prompt, max_len=24, step_mask=step_mask)
    ref = []
    for _ in range(steps):
        fed = loop.ids.clone()
        loop.step()
        ref.append((fed, loop.logits.float()))
    return loop, ref


def replay_decode_steps(model, prompt, ref, step_mask: bool):
    """The same steps on `model` (kernelized by the caller), fed the reference's tokens step by
    step (a near-tie may flip a token in fp16), each step's logits checked against the reference's;
    returns the loop."""
    loop = e2e.DecodeLoop(model, model, prompt, max_len=24, step_mask=step_mask)
    tol = 1e-5 if next(model.parameters()).dtype == torch.float32 else 1e-2
    for ids, logits in ref:
        loop.ids.copy_(ids)
        loop.step()
        assert rel_err(loop.logits.float(), logits) < tol
    return loop


@pytest.mark.parametrize("exact", [True, False])
def test_maskless_decode_steps_run_to_exact_lengths(device, monkeypatch, exact):
    """Decode steps over a static cache called without a mask: HF builds causal_mask_function's mask,
    which our mask function tags with the exact lengths (last position + 1), so decode_attention runs
    without the mask up to them (LLMK_DECODE_EXACT_LENGTHS, on by default; off: with the mask over the whole cache);
    the logits agree with HF's sdpa step by step, also for 2 tokens a step (T = 2)."""
    if hf.register_attention():
        pytest.skip(hf.register_attention())
    monkeypatch.setattr(flash, "use_on_cpu", True)
    monkeypatch.setattr(hf, "EXACT_LENGTHS", exact)
    calls = []
    real = decode.decode_attention

    def spy(q, k, v, seq_lens, *a, **kw):
        calls.append((kw["attn_mask"] is None, seq_lens.tolist(), k.shape[2]))
        return real(q, k, v, seq_lens, *a, **kw)

    monkeypatch.setattr(decode, "decode_attention", spy)
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = make("llama", device, dtype=dtype)
    prompt = ids_for(device, batch=2, seq=9)
    ref_loop, ref = hf_decode_steps(model, prompt, step_mask=False)
    lk.kernelize(model)
    try:
        cache = replay_decode_steps(model, prompt, ref, step_mask=False).cache
        # two new tokens in one call (positions 12 and 13 after the three steps at 9, 10, 11)
        two = ids_for(device, batch=2, seq=2)
        pos = torch.arange(12, 14, device=device)
        with torch.no_grad():
            out = model(input_ids=two, past_key_values=cache, use_cache=True, cache_position=pos,
                        position_ids=pos[None]).logits
    finally:
        lk.unkernelize(model)
    assert len(calls) == 4 * LAYERS
    for i, (maskless, lens, cap) in enumerate(calls):
        assert cap == 24
        want = [10 + i // LAYERS] * 2 if i < 3 * LAYERS else [14, 14]
        assert (maskless, lens) == ((True, want) if exact else (False, [24, 24])), i
    with torch.no_grad():
        ref_out = model(input_ids=two, past_key_values=ref_loop.cache, use_cache=True, cache_position=pos,
                        position_ids=pos[None]).logits
    assert rel_err(out.float(), ref_out.float()) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_exact_lengths_tag_only_the_plain_causal_mask(monkeypatch):
    """The mask function tags sdpa's mask with the lengths (q_offset + T) only for the plain causal
    mask of a step of up to 8 tokens with a position tensor: not with a padding mask, a key offset,
    a local window, another mask function, an int position (a cache without a position tensor),
    more than 8 tokens, or with the switch off; the mask itself is sdpa's either way."""
    if hf.register_attention():
        pytest.skip(hf.register_attention())
    import inspect

    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

    if "q_offset" not in inspect.signature(sdpa_mask).parameters:
        pytest.skip("this transformers' sdpa_mask takes cache_position (4.5x): the q_offset form is checked here")
    monkeypatch.setattr(hf, "EXACT_LENGTHS", True)
    base = dict(batch_size=2, q_length=1, kv_length=24, q_offset=torch.tensor(9), kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip=False,
                dtype=torch.float32, config=None, use_vmap=False, device="cpu")
    tagged = hf._causal_mask_with_lengths(**base)
    assert getattr(tagged, hf._EXACT_LENGTHS_ATTR).tolist() == [10, 10]
    assert tagged.shape == (2, 1, 1, 24) and tagged[1, 0, 0].tolist() == [True] * 10 + [False] * 14
    two = hf._causal_mask_with_lengths(**{**base, "q_length": 2})
    assert getattr(two, hf._EXACT_LENGTHS_ATTR).tolist() == [11, 11]
    assert two[0, 0, 0].tolist() == [True] * 10 + [False] * 14 and two[0, 0, 1].tolist() == [True] * 11 + [False] * 13
    padded = torch.ones(2, 24, dtype=torch.bool)
    padded[1, :3] = False
    for change in (dict(attention_mask=padded), dict(attention_mask=torch.ones(2, 24, dtype=torch.bool)),
                   dict(kv_offset=3), dict(local_size=4), dict(q_offset=9), dict(q_length=9),
                   dict(mask_function=and_masks(causal_mask_function, lambda b, h, q, k: k >= 0))):
        mask = hf._causal_mask_with_lengths(**{**base, **change})
        assert mask is None or not hasattr(mask, hf._EXACT_LENGTHS_ATTR), change
    monkeypatch.setattr(hf, "EXACT_LENGTHS", False)
    assert not hasattr(hf._causal_mask_with_lengths(**base), hf._EXACT_LENGTHS_ATTR)


@pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
def test_maskless_decode_steps_replay_in_a_cuda_graph(monkeypatch):
    """LLMK_DECODE_EXACT_LENGTHS on: a decode step called without a mask, captured in a CUDA graph
    after one eager step and replayed four times (the lengths come from the cache's position
    tensor at each replay), gives HF's logits of each step."""
    if hf.register_attention():
        pytest.skip(hf.register_attention())
    monkeypatch.setattr(hf, "EXACT_LENGTHS", True)
    model = make("llama", "cuda", dtype=torch.float16)
    prompt = ids_for("cuda", batch=2, seq=9)
    _, ref = hf_decode_steps(model, prompt, step_mask=False, steps=5)
    lk.kernelize(model)
    try:
        loop = replay_decode_steps(model, prompt, ref[:1], step_mask=False)  # eager: the first step
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop.step()
        for ids, logits in ref[1:]:
            loop.ids.copy_(ids)
            graph.replay()
            assert rel_err(loop.logits.float(), logits) < 1e-2
    finally:
        lk.unkernelize(model)


@pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
@pytest.mark.parametrize("keep", [True, False])
def test_masked_decode_keeps_a_zeroed_workspace_per_module(monkeypatch, keep):
    """A static-cache step split over the workspace (1080 slots: several splits) runs on a zeroed
    workspace kept per attention module, without a memset of the split counters: eager calls and
    CUDA-graph replays match float64, and every call leaves the counters zero. Off
    (LLMK_DECODE_KEEP_WORKSPACE=0): nothing kept, same results."""
    monkeypatch.setattr(hf, "KEEP_DECODE_WORKSPACE", keep)
    B, Hq, Hkv, D, S, dtype = 1, 32, 8, 64, 1080, torch.bfloat16
    modules = [nn.Identity(), nn.Identity()]
    key, value = (torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype) for _ in range(2))
    query = torch.randn(B, Hq, 1, D, device="cuda", dtype=dtype)
    mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=dtype)

    def step():
        return [hf._masked_decode(m, query, key, value, mask, D ** -0.5) for m in modules]

    def check(outs, n):
        ref = decode.decode_attention_ref(query.transpose(1, 2).double(), key.double(), value.double(),
                                          torch.full((B,), n, dtype=torch.int32, device="cuda"))
        for out in outs:
            assert rel_err(out, ref) < 1e-2, n

    nbytes = decode.decode_workspace_size(query.transpose(1, 2), key)
    assert nbytes > B * Hkv * 4  # split: partial results and counters
    for n in (1000, 17):  # eager
        mask.zero_()
        mask[..., n:] = torch.finfo(dtype).min
        check(step(), n)
    skip_graphs_without_caching_allocator("the eager calls ran")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for n in (1080, 333, 1000):
        mask.zero_()
        mask[..., n:] = torch.finfo(dtype).min
        query.copy_(torch.randn_like(query))
        g.replay()
        torch.cuda.synchronize()
        check(outs, n)
    if not keep:
        assert not any(m in hf._KEPT_WORKSPACES for m in modules)
        return
    counters_at = nbytes - (B * Hkv * 4 + 15) // 16 * 16  # behind the partials (16-byte aligned)
    kept = [ws for m in modules for ws in hf._KEPT_WORKSPACES[m].values()]
    assert len(kept) == 2 and kept[0].data_ptr() != kept[1].data_ptr()  # one a module
    for ws in kept:
        assert ws.numel() == nbytes and not ws[counters_at:counters_at + B * Hkv * 4].any()


def test_greedy_generate_matches():
    model = make("llama")
    prompt = ids_for("cpu", batch=1, seq=7)
    ref = model.generate(prompt, max_new_tokens=6, do_sample=False)
    lk.kernelize(model)
    try:
        got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    finally:
        lk.unkernelize(model)
    assert torch.equal(got, ref)


# ------------------------------------------------------------------------------ options
def test_ops_restricts_the_families():
    model = make("qwen3")
    report = lk.kernelize(model, ops=["rms_norm"])
    try:
        assert {s.family for s in report.swapped} == {"rms_norm"}
        assert type(model.model.layers[0].mlp).__name__ == "Qwen3MLP"
        assert model.config._attn_implementation == "sdpa"
        for s in report.left_alone:
            assert s.reason == "not in ops="
    finally:
        lk.unkernelize(model)
    with pytest.raises(ValueError, match="unknown family 'norms'"):
        lk.kernelize(model, ops=["norms"])
    with pytest.raises(ValueError, match="mode: expected 'inference' or 'training', got 'fast'"):
        lk.kernelize(model, mode="fast")


def test_training_mode_uses_ops_with_backward_and_gradients_agree():
    model = make("llama")
    model.train()
    ids = ids_for("cpu")
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    report = lk.kernelize(model, mode="training")
    try:
        attn = report.by_family("attention")
        assert len(attn) == 1 and not attn[0].swapped and "backward" in attn[0].reason
        assert {"rms_norm", "mlp", "rope"} <= {s.family for s in report.swapped}
        assert model.model.layers[0].input_layernorm.training  # the train/eval flag is kept
        model(input_ids=ids, labels=ids).loss.backward()
        for n, p in model.named_parameters():
            assert rel_err(p.grad, ref[n]) < 1e-4, n
    finally:
        lk.unkernelize(model)


def test_kernelize_twice_and_two_models_share_the_rope_patch():
    a, b = make("llama"), make("llama", seed=1)
    original = _modeling(a).apply_rotary_pos_emb
    lk.kernelize(a)
    lk.kernelize(a)  # again: unkernelizes first, nothing doubles
    lk.kernelize(b)
    assert _modeling(a).apply_rotary_pos_emb is ops.apply_rotary_pos_emb
    lk.unkernelize(a)
    assert _modeling(a).apply_rotary_pos_emb is ops.apply_rotary_pos_emb  # b still needs it
    lk.unkernelize(b)
    assert _modeling(a).apply_rotary_pos_emb is original
    assert lk.unkernelize(b) == []  # not kernelized: nothing to do


def _static_layer():
    cls = hf._static_layer_class()
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no cache_utils.StaticLayer")
    return cls


@needs_kv_patch
def test_kv_cache_patch_is_shared_counted_and_restored():
    cls = _static_layer()
    original = cls.update
    a, b = make("llama"), make("llama", seed=1)
    lk.kernelize(a)
    lk.kernelize(b)
    assert cls.update is hf._static_layer_update
    lk.unkernelize(a)
    assert cls.update is hf._static_layer_update  # b still holds it
    assert "transformers.cache_utils.StaticLayer.update" in lk.unkernelize(b)
    assert cls.update is original
    for kw, reason in ((dict(ops=["rms_norm"]), "not in ops="), (dict(mode="training"), "no backward")):
        report = lk.kernelize(a, **kw)
        [entry] = report.by_family("kv_cache")
        assert cls.update is original and entry.replacement is None and reason in entry.reason
        lk.unkernelize(a)


@needs_kv_patch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_patch_writes_what_hf_writes(device, dtype, monkeypatch):
    """A prefill (HF's own code) then one-token updates through write_kv_cache: the same keys,
    values and length as HF's update, from key states that are transposed views as HF makes them."""
    cls = _static_layer()
    original = cls.update
    calls = []
    real = decode.write_kv_cache
    monkeypatch.setattr(decode, "write_kv_cache", lambda *a, **k: calls.append(a[4].shape) or real(*a, **k))
    model = make("llama")
    lk.kernelize(model)
    try:
        ours, theirs = cls(max_cache_len=13), cls(max_cache_len=13)
        B, H, D = 3, 2, 64

        def states(t):  # (B, T, H, D) projections viewed as (B, H, T, D), as HF's attention does
            return (torch.randn(B, t, H, D, dtype=dtype).transpose(1, 2).to(device) for _ in range(2))

        for t in (5, 1, 1, 2, 1):
            k, v = states(t)
            got = ours.update(k, v)
            want = original(theirs, k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert int(ours.cumulative_length) == int(theirs.cumulative_length)
        assert calls == [(B, 1)] * 3  # the one-token updates only
        assert int(ours.get_seq_length()) == 10
    finally:
        lk.unkernelize(model)


@needs_kv_patch
def test_kv_cache_patch_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces the patched update (write_kv_cache is a mutating custom
    op) and gives what HF's update gives."""
    cls = _static_layer()
    original = cls.update
    model = make("llama")
    lk.kernelize(model)
    try:
        ours, theirs = cls(max_cache_len=9), cls(max_cache_len=9)
        k, v = torch.randn(2, 2, 4, 64), torch.randn(2, 2, 4, 64)
        ours.update(k, v)
        original(theirs, k, v)
        step = torch.compile(lambda layer, k1, v1: layer.update(k1, v1), fullgraph=True)
        for _ in range(3):
            k1, v1 = torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64)
            got, want = step(ours, k1, v1), original(theirs, k1, v1)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert int(ours.cumulative_length) == int(theirs.cumulative_length) == 7
    finally:
        lk.unkernelize(model)
        torch._dynamo.reset()


def test_monarch_last_converts_the_last_layers_and_unkernelize_restores():
    model = make("llama")
    ids = ids_for("cpu")
    ref = logits(model, ids)
    report = lk.kernelize(model, monarch_last=1, monarch_nblocks=2)
    try:
        conv = report.by_family("monarch")
        assert [s.name for s in conv] == [f"model.layers.{LAYERS - 1}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        assert all(s.swapped and "relative weight error" in s.reason for s in conv)
        assert isinstance(model.model.layers[LAYERS - 1].self_attn.q_proj, lk.MonarchLinear)
        first = model.model.layers[0].self_attn.q_proj  # an nn.Linear (or our Linear drop-in), not Monarch
        assert isinstance(first, nn.Linear) and not isinstance(first, lk.MonarchLinear)
        assert torch.isfinite(logits(model, ids)).all()
    finally:
        lk.unkernelize(model)
    assert type(model.model.layers[LAYERS - 1].self_attn.q_proj) is nn.Linear
    assert torch.equal(logits(model, ids), ref)


def test_linear_is_used_when_layers_has_it(monkeypatch):
    class FakeLinear(nn.Linear):
        @classmethod
        def from_module(cls, linear):
            new = cls.__new__(cls)
            nn.Module.__init__(new)
            new.in_features, new.out_features = linear.in_features, linear.out_features
            new.weight, new.bias = linear.weight, linear.bias
            return new

    model = make("llama")
    ids = ids_for("cpu")
    ref = logits(model, ids)
    report = lk.kernelize(model)
    try:
        if not hasattr(layers, "Linear"):
            assert all("does not exist" in s.reason for s in report.by_family("linear"))
    finally:
        lk.unkernelize(model)
    monkeypatch.setattr(layers, "Linear", FakeLinear, raising=False)
    report = lk.kernelize(model)
    try:
        lin = report.by_family("linear")
        assert len(lin) == LAYERS * 7 + 1 and all(s.swapped for s in lin)
        assert type(model.lm_head) is FakeLinear and type(model.model.layers[0].mlp.up_proj) is FakeLinear
        assert rel_err(logits(model, ids), ref) < 1e-5
    finally:
        lk.unkernelize(model)
    report = lk.kernelize(model, mode="training")
    try:
        assert all(not s.swapped and "no backward" in s.reason for s in report.by_family("linear"))
    finally:
        lk.unkernelize(model)


# ------------------------------------------------------------------------- left alone
def test_unsupported_models_are_left_alone_with_a_reason():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    before = dict(model.named_modules())
    report = lk.kernelize(model)
    assert len(report) == 1 and not report[0].swapped
    assert "model type 'gpt2' is not supported" in report[0].reason
    assert dict(model.named_modules()) == before and not hf.is_kernelized(model)

    report = lk.kernelize(nn.Sequential(nn.Linear(4, 4)))
    assert "not a transformers model" in report[0].reason


def test_modules_that_do_not_match_our_ops_are_left_alone(monkeypatch):
    class OddRMSNorm(nn.Module):  # a LayerNorm under an RMSNorm name
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return nn.functional.layer_norm(x, x.shape[-1:], self.weight, eps=self.variance_epsilon)

    def inverse_rope(q, k, cos, sin, unsqueeze_dim=1):  # rotates the other way: none of our forms
        def rot(x):
            x1, x2 = x.chunk(2, -1)
            return torch.cat((-x2, x1), -1)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos - rot(q) * sin, k * cos - rot(k) * sin

    model = make("llama")
    model.model.norm = OddRMSNorm(128)
    monkeypatch.setattr(_modeling(model), "apply_rotary_pos_emb", inverse_rope)
    model.model.layers[0].mlp.act_fn = nn.ReLU()
    report = lk.kernelize(model)
    try:
        why = {s.name: s.reason for s in report.left_alone}
        assert why["model.norm"] == "its forward is not rms_norm(x) * weight or * (1 + weight)"
        assert why["model.layers.0.mlp"] == "activation ReLU is not SiLU or GELU"
        assert type(model.model.layers[1].mlp) is layers.LlamaMLP
        rope = [r for r in report.by_family("rope") if r.name.endswith("apply_rotary_pos_emb")]
        assert len(rope) == 1 and rope[0].reason.startswith("it is none of the forms ours computes")
        assert _modeling(model).apply_rotary_pos_emb is inverse_rope
    finally:
        lk.unkernelize(model)


# ------------------------------------------------------------------------- rotary angles
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv_dtype", [torch.float32, torch.bfloat16])
def test_rotary_module_gets_one_launch_angles(device, dtype, inv_dtype, monkeypatch):
    """The rotary embedding module's forward becomes ops.rope_angles: the very values of LLaMA's
    forward (bit for bit in half precision; on the GPU in float32 too, where both call cosf / sinf),
    at positions far past max_position_embeddings, with rope scaling (llama3's inv_freq, yarn's
    attention_scaling), also with inv_freq cast to bfloat16 as `model.to(torch.bfloat16)` leaves it
    (the class's forward upcasts the rounded values); unkernelize gives the class's forward back."""
    for rope_parameters in (None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}):
        extra = {} if rope_parameters is None else {"rope_parameters": dict(rope_parameters, rope_theta=10000.0)}
        model = tiny_hf_model("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=1, **extra), device=device)
        rotary, real_angles = model.model.rotary_emb, ops.rope_angles
        rotary.to(inv_dtype)  # casts its buffers (inv_freq) as a model's .to(dtype) does
        assert rotary.inv_freq.dtype == inv_dtype
        x = torch.zeros(1, device=device, dtype=dtype)
        positions = torch.tensor([[0, 1, 77, 4097], [32768, 131071, 5, 999999]], device=device)
        want = rotary(x, positions)
        report = lk.kernelize(model)
        try:
            rec = [r for r in report.by_family("rope") if r.name == "model.rotary_emb"]
            assert len(rec) == 1 and rec[0].replacement == "llm_kernels.hf.rotary_forward", rec
            calls = []
            monkeypatch.setattr(ops, "rope_angles", lambda *a, **k: calls.append(a) or real_angles(*a, **k))
            got = rotary(x, positions)
            assert len(calls) == 1
            monkeypatch.setenv("LLMK_ROTARY_ANGLES", "0")  # the switch: the class's own forward
            off = rotary(x, positions)
            monkeypatch.delenv("LLMK_ROTARY_ANGLES")
            monkeypatch.setattr(ops, "rope_angles", real_angles)
            assert len(calls) == 1 and all(torch.equal(o, w) for o, w in zip(off, want))
            for w, g in zip(want, got):
                assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device
                if dtype == torch.float32 and device == "cpu":  # torch's CPU cos is SLEEF's, ours libm's
                    torch.testing.assert_close(g, w, rtol=0, atol=2e-7)
                else:
                    assert torch.equal(g, w), (rope_parameters, (g.float() - w.float()).abs().max())
            if rope_parameters is None:  # the swapped forward traces whole
                torch._dynamo.reset()
                compiled = torch.compile(lambda t, p: rotary(t, p), fullgraph=True)(x, positions)
                assert all(torch.equal(c, g) for c, g in zip(compiled, got))
        finally:
            restored = lk.unkernelize(model)
        assert "model.rotary_emb" in restored and "forward" not in rotary.__dict__


def test_rotary_modules_that_differ_are_left_alone():
    """A rotary module whose angles are not LLaMA's, one with dynamic angles and one with hooks keep
    their forward, each with its reason."""
    model = make("llama")
    rotary = model.model.rotary_emb

    base = type(rotary)

    class PairsRotaryEmbedding(base):  # each angle repeated per pair (Cohere's layout): none of our forms
        def forward(self, x, position_ids):
            cos, sin = base.forward(self, x, position_ids)
            half = cos.shape[-1] // 2
            return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)

    rotary.__class__ = PairsRotaryEmbedding
    report = lk.kernelize(model)
    try:
        why = {s.name: s.reason for s in report.left_alone}
        assert why["model.rotary_emb"] == ("its angles are none of the forms ours computes (LLaMA's, kept in "
                                           "float32 (OLMo 2, ERNIE 4.5), half width (gpt-oss))")
        assert "forward" not in rotary.__dict__
    finally:
        lk.unkernelize(model)
    rotary.__class__ = base
    rotary.rope_type = "dynamic"
    report = lk.kernelize(model)
    try:
        why = {s.name: s.reason for s in report.left_alone}
        assert why["model.rotary_emb"] == "its angles change with the sequence length (rope_type 'dynamic')"
    finally:
        lk.unkernelize(model)
    rotary.rope_type = "default"
    rotary.register_forward_hook(lambda *a: None)
    report = lk.kernelize(model)
    try:
        assert {s.name: s.reason for s in report.left_alone}["model.rotary_emb"] == "it has forward hooks"
    finally:
        lk.unkernelize(model)


def test_modules_with_hooks_are_left_alone():
    model = make("llama")
    model.model.norm.register_forward_hook(lambda *a: None)
    report = lk.kernelize(model)
    try:
        assert {s.name: s.reason for s in report.left_alone}["model.norm"] == "it has forward hooks"
    finally:
        lk.unkernelize(model)


# ------------------------------------------------------------------------- compile, GPU
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_decoder_layer(device):
    model = make("qwen3", device)
    lk.kernelize(model)
    try:
        layer = model.model.layers[0]
        x = torch.randn(2, 17, 128, device=device)
        pe = model.model.rotary_emb(x, torch.arange(17, device=device)[None])
        with torch.no_grad():
            ref = layer(x, position_embeddings=pe, attention_mask=None)
            torch._dynamo.reset()
            # CPU: trace and run our fake impls without a C++ compiler; GPU: inductor.
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
            out = compiled(x, position_embeddings=pe, attention_mask=None)
        ref, out = (t[0] if isinstance(t, tuple) else t for t in (ref, out))
        assert rel_err(out, ref) < 1e-5
    finally:
        lk.unkernelize(model)
        torch._dynamo.reset()


@contextlib.contextmanager
def decode_loop(model, variant: str, prompt: torch.Tensor, max_len: int = 32):
    """e2e's decode loop over `model` activated as `variant` (the prompt already run), reverted after."""
    fn = e2e.activate(model, variant)
    try:
        yield e2e.DecodeLoop(model, fn, prompt, max_len=max_len)
    finally:
        hf.unkernelize(model)
        e2e._restore_pdl()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["hf_sdpa", "kernelized", "kernelized_fused", "kernelized_fused_no_pdl"])
def test_static_cache_decode_loop_matches_generate(device, variant, monkeypatch):
    """e2e's decode loop (static cache, in-place position and mask) gives generate's greedy tokens,
    also replayed from a CUDA graph on the GPU (kernelized_fused: the fused GEMMs, on the CPU too;
    _no_pdl: without programmatic dependent launch, the others with it on Hopper)."""
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    model = make("llama", device)
    prompt = ids_for(device, batch=2, seq=9)
    ref = model.generate(prompt, max_new_tokens=7, do_sample=False)[:, 9:]
    with decode_loop(model, variant, prompt) as loop:
        got = [loop.ids.clone()]
        loop.step()
        got.append(loop.ids.clone())
        if device == "cuda" and not caching_allocator_off():  # (capture needs the caching allocator)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                loop.step()
            torch.cuda.current_stream().wait_stream(stream)
            got.append(loop.ids.clone())
            with torch.cuda.graph(graph):
                loop.step()
            for _ in range(4):
                graph.replay()
                got.append(loop.ids.clone())
        else:
            for _ in range(5):
                loop.step()
                got.append(loop.ids.clone())
    assert torch.equal(torch.cat(got, 1), ref)


def _decode_runs_with(monkeypatch, family: str, device: str, switch: str, counted: tuple) -> dict:
    """Four kernelized_fused decode steps of `family` (batch 2, a 9-token prompt; bf16 on the GPU, the
    dtype its fused layers take, fp32 on the CPU) with rope_kv.<switch> on and off:
    {on: (tokens, calls of each decode.<name> in `counted` over the steps, [(keys, values, length)
    of every cache layer])}."""
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    monkeypatch.delenv("LLMK_FUSE_GEGLU", raising=False)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    calls = dict.fromkeys(counted, 0)

    def counting(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in counted:
        monkeypatch.setattr(decode, name, counting(name, getattr(decode, name)))
    prompt = ids_for(device, batch=2, seq=9)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(rope_kv, switch, on)
        with decode_loop(make(family, device, dtype), "kernelized_fused", prompt) as loop:
            got = [loop.ids.clone()]
            calls.update(dict.fromkeys(counted, 0))
            for _ in range(4):
                loop.step()
                got.append(loop.ids.clone())
            caches = [(layer.keys.clone(), layer.values.clone(), int(layer.cumulative_length)) for layer in loop.cache.layers]
        runs[on] = torch.cat(got, 1), dict(calls), caches
    return runs


def _greedy(family: str) -> torch.Tensor:
    """generate's 5 greedy tokens after _decode_runs_with's prompt (CPU, fp32)."""
    return make(family, "cpu", torch.float32).generate(ids_for("cpu", batch=2, seq=9), max_new_tokens=5,
                                                        do_sample=False)[:, 9:]


@needs_kv_patch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_step_rope_and_kv_write_in_one_launch(device, family, monkeypatch):
    """Fused decoder layers at one token: the rope call and the static cache's update become one
    rope_write_kv_cache launch per layer (rope_kv.py), and with LLMK_FUSE_ROPE_KV=0 rope then
    write_kv_cache; both give the same tokens and caches (the CPU in fp32: generate's greedy tokens
    too). On the GPU in bf16, the dtype the GPU's fused layers take (fp32 layers run unfused).
    Every family: Qwen3 rotates after its q/k norms; Gemma's layers fuse with the GEGLU-tanh
    epilogue (by default; LLMK_FUSE_GEGLU unset here); Mistral's default config gives
    sliding-window cache layers, whose update stays Hugging Face's, so it keeps rope and the cache
    update apart. (The projection's own rotation, LLMK_FUSE_ROPE_GEMM, off here: the next test.)"""
    monkeypatch.setattr(rope_kv, "GEMM_ENABLED", False)
    runs = _decode_runs_with(monkeypatch, family, device, "ENABLED", ("rope_write_kv_cache", "write_kv_cache"))
    steps = 4 * LAYERS
    if family == "mistral":
        assert runs[True][1]["rope_write_kv_cache"] == runs[False][1]["rope_write_kv_cache"] == 0
    else:
        assert runs[True][1] == {"rope_write_kv_cache": steps, "write_kv_cache": 0}
        assert runs[False][1] == {"rope_write_kv_cache": 0, "write_kv_cache": steps}
    assert torch.equal(runs[True][0], runs[False][0])
    for (k_on, v_on, _), (k_off, v_off, _) in zip(runs[True][2], runs[False][2]):
        torch.testing.assert_close(k_on, k_off)  # rotated: fp32 math rounded once either way
        assert torch.equal(v_on, v_off)
    if device == "cpu":
        assert torch.equal(runs[True][0], _greedy(family))


@needs_kv_patch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_step_rope_and_kv_write_in_the_qkv_projection(device, family, monkeypatch):
    """The default (LLMK_FUSE_ROPE_GEMM=0 turns it off): a fused layer's q/k/v projection rotates q and k and writes the cache
    itself (one skinny_gemm_rope_kv call per layer and step, no rope_write_kv_cache or write_kv_cache)
    where its attention takes plain views of the projections (LLaMA, Qwen2, Gemma); Qwen3 (q/k norms
    before the rotation) keeps the rope_write_kv_cache launch, Mistral's sliding-window layers HF's
    update. Tokens and caches as with the fusion off (bitwise: the same two calls on the CPU, the
    same kernel's sums on the GPU), and the CPU in fp32 gives generate's greedy tokens."""
    runs = _decode_runs_with(monkeypatch, family, device, "GEMM_ENABLED",
                             ("skinny_gemm_rope_kv", "rope_write_kv_cache", "write_kv_cache"))
    steps = 4 * LAYERS
    gemm, fused = (dict(skinny_gemm_rope_kv=g, rope_write_kv_cache=f, write_kv_cache=0) for g, f in ((steps, 0), (0, steps)))
    if family == "mistral":
        assert runs[True][1] == runs[False][1] and runs[True][1]["skinny_gemm_rope_kv"] == 0
        assert runs[True][1]["rope_write_kv_cache"] == 0
    elif family == "qwen3":
        assert runs[True][1] == runs[False][1] == fused
    else:
        assert runs[True][1] == gemm and runs[False][1] == fused
    assert torch.equal(runs[True][0], runs[False][0])
    for (k_on, v_on, n_on), (k_off, v_off, n_off) in zip(runs[True][2], runs[False][2]):
        assert torch.equal(k_on, k_off) and torch.equal(v_on, v_off) and n_on == n_off
    if device == "cpu":
        assert torch.equal(runs[True][0], _greedy(family))


def test_plain_projections_read_from_the_source():
    """The fused projection's rotation needs q, k and v as plain views of q_proj / k_proj / v_proj:
    LLaMA's attention has them; Qwen3's normalises q and k first, so it must not be armed."""
    llama = __import__("transformers.models.llama.modeling_llama", fromlist=["_"])
    qwen3 = __import__("transformers.models.qwen3.modeling_qwen3", fromlist=["_"])
    assert rope_kv._plain_projections(llama.LlamaAttention)
    assert not rope_kv._plain_projections(qwen3.Qwen3Attention)


# ----------------------------------------------------------------------------------- e2e
@pytest.mark.parametrize("name, says", [("kernelized_fused_pdl", "kernelized_fused_no_pdl runs without it"),
                                        ("no_such_variant", "choose from hf_eager")])
def test_e2e_cli_names_a_bad_variant(name, says):
    result = CliRunner().invoke(app, ["e2e", "--device", "cpu", "--variant", name])
    assert result.exit_code != 0
    assert says in " ".join(result.output.replace("│", " ").split())  # (rich wraps it in a box)


def test_e2e_cli_quick_on_the_cpu(tmp_path):
    out_json, out_md = tmp_path / "e.json", tmp_path / "e.md"
    # a budget no machine reaches: the quick preset's 60 s skipped the last unit (hf_eager decode
    # b4) on the loaded GPU machine (12 pytest workers), 2026-12-01
    result = CliRunner().invoke(app, ["e2e", "--quick", "--device", "cpu", "--steps", "3", "--iters", "1",
                                      "--budget-s", "3600", "--json", str(out_json), "--md", str(out_md)])
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    assert data["meta"]["config"] == "tiny"
    ok = {(r["variant"], r["metric"], r["batch"]) for r in data["records"] if r["status"] == "ok"}
    for v in ("hf_eager", "hf_sdpa", "kernelized", "kernelized_monarch"):
        assert {(v, "prefill", 1), (v, "decode", 1), (v, "decode", 4)} <= ok
    # the Monarch variant's step reads fewer weight bytes (its q/k/v/o factors) than the dense one's
    wbytes = {r["variant"]: r["weight_bytes"] for r in data["records"] if r["metric"] == "decode"}
    assert wbytes["kernelized_monarch"] < wbytes["kernelized"] == wbytes["hf_sdpa"] == data["meta"]["weight_bytes_per_token"]
    assert all(r["tok_s"] > 0 for r in data["records"] if r["status"] == "ok")
    prefill = [r for r in data["records"] if r["metric"] == "prefill" and r["status"] == "ok"]
    assert prefill and all(r["host_ms"] > 0 for r in prefill)  # the CPU's wall time, as ms
    assert not any("enqueueing" in n for n in e2e.notes(data))  # a GPU-only reading
    corr = {c["variant"]: c for c in data["correctness"]}
    assert corr["kernelized"]["max_abs_diff"] < 1e-4 and corr["kernelized"]["top1_agreement"] == 1.0
    assert any(k["replacement"] for k in data["kernelize"])
    assert "kernelized_monarch" not in corr  # lossy: not compared
    md = out_md.read_text()
    assert "| kernelized |" in md and "top-1 vs eager" in md
    assert "| kernelized_monarch |" in md and "(lossy)" in md and "last 6 decoder layers" in md


def test_e2e_cli_decode_steps_without_a_mask_on_the_cpu(tmp_path):
    """--no-step-mask: the decode steps pass no mask (the model builds its own each step); every
    variant decodes and the JSON says which mask the steps had."""
    out_json = tmp_path / "e.json"
    result = CliRunner().invoke(app, ["e2e", "--quick", "--device", "cpu", "--steps", "2", "--iters", "1",
                                      "--variant", "hf_sdpa", "--variant", "kernelized_fused", "--no-step-mask",
                                      "--budget-s", "3600", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    assert data["meta"]["decode_step_mask"].startswith("none")
    decode_ok = {r["variant"] for r in data["records"] if r["metric"] == "decode" and r["status"] == "ok"}
    assert decode_ok == {"hf_sdpa", "kernelized_fused"}


@pytest.mark.parametrize("family, model_class", [("phi3", "Phi3ForCausalLM"), ("gemma", "GemmaForCausalLM")])
def test_e2e_cli_family_on_the_cpu(tmp_path, family, model_class):
    """--family builds that family's model with the config's shapes; kernelized logits still agree
    with eager (Phi-3: GateUpMLP and its fused layers; Gemma: GELU MLP, (1 + w) norms)."""
    out_json = tmp_path / "e.json"
    result = CliRunner().invoke(app, ["e2e", "--quick", "--device", "cpu", "--family", family, "--steps", "2",
                                      "--iters", "1", "--variant", "hf_eager", "--variant", "kernelized_fused",
                                      "--budget-s", "3600", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    assert data["meta"]["family"] == family and data["meta"]["model_class"] == model_class
    corr = {c["variant"]: c for c in data["correctness"]}
    assert corr["kernelized_fused"]["max_abs_diff"] < 1e-4 and corr["kernelized_fused"]["top1_agreement"] == 1.0
    assert all(r["status"] == "ok" for r in data["records"])
    bad = CliRunner().invoke(app, ["e2e", "--quick", "--device", "cpu", "--family", "gpt2"])
    assert bad.exit_code != 0 and "unknown family 'gpt2'" in bad.output


@pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
def test_e2e_cli_quick_on_the_gpu(tmp_path):
    """The GPU path on the tiny config without compiling: decode steps replayed from CUDA graphs."""
    out_json = tmp_path / "g.json"
    result = CliRunner().invoke(app, ["e2e", "--quick", "--device", "cuda", "--config", "tiny", "--no-compile",
                                      "--steps", "4", "--iters", "2", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    recs = data["records"]
    assert {r["status"] for r in recs} == {"ok"}, [r["note"] for r in recs]
    assert all(r["cuda_graph"] for r in recs if r["metric"] == "decode"), [r["note"] for r in recs]
    assert all(r["peak_gib"] > 0 for r in recs)
    assert all(0 < r["host_ms"] for r in recs if r["metric"] == "prefill")
    assert any("enqueueing" in n for n in e2e.notes(data))
    assert data["meta"]["decode_roof_tok_s_batch1"] > 0
    corr = {c["variant"]: c for c in data["correctness"]}
    assert corr["kernelized"]["top1_agreement"] > 0.9


@pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
def test_e2e_profile_lists_our_kernels_in_a_decode_step(tmp_path):
    """--profile: the kernelized decode step runs our kernels (names in llmk::) and HF's does not."""
    skip_graphs_without_caching_allocator()  # (the profile times a graph replay)
    out_json = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["e2e", "--profile", "--device", "cuda", "--config", "tiny", "--context", "16",
                                      "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    by_variant = {r["variant"]: r for r in json.loads(out_json.read_text())}
    for r in by_variant.values():
        assert r["kernels_per_step"] >= 1 and r["graph_step_us"] > 0
        assert abs(sum(k["us_per_step"] for k in r["top"]) - r["kernel_us_per_step"]) <= 1e-6 * r["kernel_us_per_step"] \
            or len(r["top"]) == 30
    assert any("llmk" in k["name"] for k in by_variant["kernelized_fused"]["top"])
    assert not any("llmk" in k["name"] for k in by_variant["hf_sdpa"]["top"])


def test_e2e_notes_give_the_prefill_host_time_on_the_gpu():
    rec = dict(variant="hf_sdpa", metric="prefill", batch=1, tokens=2048, status="ok", ms=21.64, host_ms=20.9,
               note="")
    skipped = dict(rec, variant="kernelized", status="skipped", ms=None, host_ms=None)
    result = dict(meta=dict(device="cuda"), records=[rec, skipped], kernelize=[])
    line = next(n for n in e2e.notes(result) if "enqueueing" in n)
    assert "hf_sdpa 20.90 of 21.64 ms" in line and "kernelized" not in line
    result["meta"]["device"] = "cpu"
    assert not any("enqueueing" in n for n in e2e.notes(result))


@pytest.mark.parametrize("name, params, kv_rows, mlp_rows, vocab", [
    ("1b", 1.104e9, 512, 8192, 32000),
    ("7b", 6.738e9, 4096, 11008, 32000),  # Llama-2-7B's
    ("8b", 8.030e9, 1024, 14336, 128256),  # Llama-3-8B's shapes
])
def test_e2e_configs_build_the_shapes_they_name(name, params, kv_rows, mlp_rows, vocab):
    """Each e2e config builds (on the meta device: no memory) a model of its parameter count (7b and
    8b: the published models') and projection shapes."""
    model = e2e.build_model(name, "meta", torch.bfloat16)
    layer = model.model.layers[0]
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
    assert layer.self_attn.k_proj.weight.shape == (kv_rows, model.config.hidden_size)
    assert layer.mlp.gate_proj.weight.shape == (mlp_rows, model.config.hidden_size)
    assert model.lm_head.weight.shape[0] == vocab


def test_e2e_time_ms_returns_elapsed_and_host_time_on_the_cpu():
    ms, host = e2e._time_ms(lambda: sum(range(20000)), "cpu", iters=3, warmup=1)
    assert ms > 0 and host == ms


def test_e2e_profile_needs_the_gpu():
    """--profile times GPU kernels: on the CPU a usage error (exit 2), not a traceback from inside;
    the API call itself still refuses (profile_decode)."""
    result = CliRunner().invoke(app, ["e2e", "--profile", "--device", "cpu", "--config", "tiny"])
    assert result.exit_code == 2, result.output
    assert "--profile times the GPU's kernels" in result.output
    with pytest.raises(RuntimeError, match="needs the GPU"):
        e2e.profile_decode(e2e.Settings(device="cpu", config="tiny"), "kernelized")


def test_e2e_rejects_unknown_variant():
    result = CliRunner().invoke(app, ["e2e", "--variant", "nope"])
    assert result.exit_code != 0 and "unknown variant" in result.output


def test_e2e_plan_puts_eager_variants_first():
    s = e2e.Settings(device="cuda")
    units = e2e.plan(s)
    first_compiled = next(i for i, u in enumerate(units) if u[0] in e2e.COMPILED)
    assert all(u[0] not in e2e.COMPILED for u in units[:first_compiled])
    assert units[first_compiled] == ("compile", "decode", 1)
    assert units[first_compiled + 1] == ("kernelized_fused_compile", "decode", 1)
    assert len(units) == 6 * 3 + 5 * 3  # 6 eager and 5 compiled variants x (prefill, decode b1, b32)
    assert units[first_compiled - 1] == ("kernelized_monarch", "decode", 32)  # the last eager one


def test_e2e_compile_modes():
    """The compiled variants' torch.compile modes; reduce-overhead replays its own CUDA graphs."""
    assert set(e2e.COMPILE_MODES) <= set(e2e.COMPILED) and set(e2e.OWN_GRAPHS) <= set(e2e.COMPILED)
    assert e2e.COMPILE_MODES["compile_reduce_overhead"] == "reduce-overhead"
    assert e2e.OWN_GRAPHS == ("compile_reduce_overhead",)


# --------------------------------------------------------------- decode-shape GEMM fusion
def test_mlp_norm_switch_read_at_import():
    """LLMK_FUSE_MLP_NORM: 1 forces the gate/up prologue, 0 its own launch, unset (or empty) leaves
    it to the weight size; anything else warns and leaves it to the size (a fresh interpreter, one
    module reload per value)."""
    code = (
        "import importlib, os, warnings\n"
        "import llm_kernels.fuse as fuse\n"
        "for v in ['1', '0', '', 'yes']:\n"
        "    os.environ['LLMK_FUSE_MLP_NORM'] = v\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        importlib.reload(fuse)\n"
        "    print(repr(v), fuse.MLP_NORM_PROLOGUE, len(caught))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == ["'1' True 0", "'0' False 0", "'' None 0", "'yes' None 1"]


# (QKV_NORM_PROLOGUE, MLP_NORM_PROLOGUE, MLP_NORM_PROLOGUE_MAX_BYTES, gate/up norm as prologue?)
NORM_PLACEMENTS = [(False, True, 0, True), (True, False, 1 << 40, False), (False, False, 1 << 40, False),
                   (True, None, 1 << 40, True), (True, None, 0, False)]  # None: by the gate/up weight's size


@needs_layer_fusion
@pytest.mark.parametrize("qkv_prologue, mlp_setting, mlp_max_bytes, mlp_prologue", NORM_PLACEMENTS)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_layer_with_norms_as_own_launches(qkv_prologue, mlp_setting, mlp_max_bytes, mlp_prologue, device,
                                                monkeypatch):
    """fuse.QKV_NORM_PROLOGUE off (LLMK_FUSE_QKV_NORM=0), fuse.MLP_NORM_PROLOGUE forced either way
    (LLMK_FUSE_MLP_NORM) or by size (unset: prologue while the gate/up weight is at most
    MLP_NORM_PROLOGUE_MAX_BYTES): a norm not in a prologue runs before a plain GEMM, the layer still
    matches and the other fusions stay."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    monkeypatch.setattr(fuse, "QKV_NORM_PROLOGUE", qkv_prologue)
    monkeypatch.setattr(fuse, "MLP_NORM_PROLOGUE", mlp_setting)
    monkeypatch.setattr(fuse, "MLP_NORM_PROLOGUE_MAX_BYTES", mlp_max_bytes)
    counting = CountingOps(fuse.decode._ops)
    monkeypatch.setattr(fuse.decode, "_ops", counting)
    model = make("llama", device, dtype)
    ids = ids_for(device, batch=1, seq=5)
    ref = logits(model, ids)
    lk.kernelize(model)
    try:
        counting.fusions.clear()
        counting.fixed.clear()
        assert rel_err(logits(model, ids), ref) < (1e-5 if dtype == torch.float32 else 3e-2)
        # (norm prologue, residual epilogue) per skinny GEMM call with fusion arguments
        assert counting.fusions.count((True, False)) == (int(qkv_prologue) + int(mlp_prologue)) * LAYERS
        # plus lm_head on the GPU (a kernelized Linear: fusion arguments, none of them set)
        plain = (2 - int(qkv_prologue) - int(mlp_prologue)) * LAYERS + (1 if device == "cuda" else 0)
        assert counting.fusions.count((False, False)) == plain
        assert counting.fusions.count((False, True)) == (2 if device == "cuda" else 1) * LAYERS
        # every call on a model's weights promises them fixed (read before the PDL wait on Hopper)
        assert counting.fixed and all(counting.fixed), counting.fixed
    finally:
        lk.unkernelize(model)


@needs_layer_fusion
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])  # qwen2: q/k/v biases; gemma: GEGLU-tanh, (1 + w) norms
@pytest.mark.parametrize("device", DEVICES)
def test_fused_gemms_match_keep_the_state_dict_and_unfuse(family, device, monkeypatch):
    """kernelize's gate+up (SwiGLU epilogue; GEGLU-tanh for Gemma, by default, the
    switch unset here) and q+k+v fusion: the decode-shape forward runs one GEMM per group and
    matches; parameters keep their names, objects and state dict (views into one tensor);
    load_state_dict writes through; unkernelize leaves independent tensors, same values."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    epilogue = "geglu_tanh" if family == "gemma" else "swiglu"
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    monkeypatch.delenv("LLMK_FUSE_GEGLU", raising=False)
    counting = CountingOps(fuse.decode._ops)
    monkeypatch.setattr(fuse.decode, "_ops", counting)
    model = make(family, device, dtype)
    ids = ids_for(device, batch=1, seq=5)  # 5 rows: the fused path
    ref = logits(model, ids)
    params = dict(model.named_parameters())
    before = model.state_dict(keep_vars=True)
    values = {k: v.detach().clone() for k, v in before.items()}
    report = lk.kernelize(model)
    try:
        fused = [r for r in report.by_family("fuse") if r.swapped]
        assert len(fused) == LAYERS * 5, [str(r) for r in report.by_family("fuse")]  # gate+up, q, k, v, layer
        after = model.state_dict(keep_vars=True)
        assert list(after) == list(before) and all(after[k] is before[k] for k in before)
        assert dict(model.named_parameters()).keys() == params.keys()
        assert all(torch.equal(after[k], values[k]) for k in values)
        layer = model.model.layers[0]
        mlp, attn = layer.mlp, layer.self_attn
        assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr() + mlp.gate_proj.weight.numel() * mlp.gate_proj.weight.element_size()
        assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
        assert type(attn.q_proj) is fuse.FusedProjection and type(attn.v_proj) is fuse.FusedProjection
        counting.calls.clear()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert rel_err(logits(model, ids), ref) < tol
        inter = mlp.gate_proj.out_features
        qkv = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
        assert counting.calls.count((epilogue, 2 * inter)) == LAYERS
        assert counting.calls.count(("none", qkv)) == LAYERS
        assert ("none", attn.k_proj.out_features) not in counting.calls  # k and v came from the fused q call
        # the layers' forward: both RMSNorms as GEMM prologues, both residual adds as epilogues
        assert counting.fusions.count((True, False)) == 2 * LAYERS
        # (o_proj: the skinny GEMM's epilogue on the GPU; decode.Linear adds it after F.linear on the CPU)
        assert counting.fusions.count((False, True)) == (2 if device == "cuda" else 1) * LAYERS
        assert type(layer).forward is not layer.forward.__func__
        # more than 16 rows: the usual path, same answers
        ids_long = ids_for(device, batch=2, seq=19)
        counting.calls.clear()
        lk.unkernelize(model)
        ref_long = logits(model, ids_long)
        lk.kernelize(model)
        assert rel_err(logits(model, ids_long), ref_long) < tol
        assert all(a == "none" for a, _ in counting.calls)
        # a checkpoint loads strictly, through the views into the fused tensors
        fresh = make(family, device, dtype, seed=1)
        model.load_state_dict(fresh.state_dict(), strict=True)
        assert rel_err(logits(model, ids), logits(fresh, ids)) < tol
    finally:
        lk.unkernelize(model)
    assert not hf.is_kernelized(model)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(model.get_parameter(k) is p for k, p in params.items())
    layer = model.model.layers[0]
    storages = {p.untyped_storage().data_ptr() for p in (layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight,
                                                        layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                                        layer.self_attn.v_proj.weight)}
    assert len(storages) == 5  # independent tensors again
    assert rel_err(logits(model, ids), logits(fresh, ids)) < 1e-6


def test_geglu_epilogue_switch_and_gate_up_mlp(monkeypatch):
    """The GEGLU-tanh epilogue runs fused by default; LLMK_FUSE_GEGLU=0 turns it off on the GPU
    (not on the CPU); a GateUpMLP with GELU tanh and fuse_decode runs its gate/up product with it (one
    skinny GEMM), matching its unfused forward."""
    monkeypatch.delenv("LLMK_FUSE_GEGLU", raising=False)
    assert fuse.geglu_on(torch.device("cpu")) and fuse.geglu_on(torch.device("cuda", 0))
    monkeypatch.setenv("LLMK_FUSE_GEGLU", "0")
    assert fuse.geglu_on(torch.device("cpu")) and not fuse.geglu_on(torch.device("cuda", 0))
    monkeypatch.setenv("LLMK_FUSE_GEGLU", "1")
    assert fuse.geglu_on(torch.device("cuda", 0))
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    counting = CountingOps(fuse.decode._ops)
    monkeypatch.setattr(fuse.decode, "_ops", counting)
    torch.manual_seed(0)
    mlp = layers.GateUpMLP(24, 40, activation="gelu_tanh").eval()
    x = torch.randn(3, 24)
    with torch.no_grad():
        want = mlp(x)
        mlp.fuse_decode = True
        got = mlp(x)
    assert counting.calls == [("geglu_tanh", 80)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert fuse.gate_up_of(layers.GateUpMLP(24, 40, activation="gelu")) is None  # erf GELU: no epilogue


@needs_layer_fusion
def test_fused_layer_forward_guards_and_is_removed(monkeypatch):
    """layer_forward is each fused layer's own forward until unkernelize; an attention module that
    projects something other than the layer's input is refused loudly, not computed wrong."""
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    model = make("llama")
    ids = ids_for("cpu", batch=1, seq=3)
    report = lk.kernelize(model)
    layer = model.model.layers[0]
    try:
        assert [r.name for r in report.by_family("fuse") if r.replacement == "llm_kernels.fuse.layer_forward"] == [
            f"model.layers.{i}" for i in range(LAYERS)]
        assert layer.forward.__func__ is fuse.layer_forward
        x = torch.randn(1, 3, 128)
        with torch.no_grad():
            assert fuse.layer_ready(layer, x)
            model.train()  # dropout would run in the layer's own forward: the fused path steps aside
            assert not fuse.layer_ready(layer, x)
            model.eval()
        attn = layer.self_attn
        original = type(attn).forward
        monkeypatch.setattr(attn, "forward", lambda hidden_states, **kw: original(attn, hidden_states * 2, **kw))
        with pytest.raises(RuntimeError, match="called a q/k/v projection on something other than the layer's input"):
            logits(model, ids)
    finally:
        lk.unkernelize(model)
    assert "forward" not in vars(layer)


def test_fusion_is_optional_and_left_alone_in_training():
    model = make("llama")
    report = lk.kernelize(model, fuse=False)
    try:
        assert not report.by_family("fuse")
        assert type(model.model.layers[0].self_attn.q_proj) is not fuse.FusedProjection
    finally:
        lk.unkernelize(model)
    report = lk.kernelize(model, mode="training")
    try:
        assert report.by_family("fuse") and all(not r.swapped and "training" in r.reason for r in report.by_family("fuse"))
    finally:
        lk.unkernelize(model)


@needs_layer_fusion
@pytest.mark.parametrize("device", DEVICES)
def test_fused_decoder_layer_compiles_fullgraph(device, monkeypatch):
    """The q/k/v hand-off and the fused SwiGLU GEMM trace into one graph at decode shapes."""
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = make("qwen3", device, dtype)
    lk.kernelize(model)
    try:
        layer = model.model.layers[0]
        x = torch.randn(1, 5, 128, device=device, dtype=dtype)
        pe = model.model.rotary_emb(x, torch.arange(5, device=device)[None])
        with torch.no_grad():
            ref = layer(x, position_embeddings=pe, attention_mask=None)
            torch._dynamo.reset()
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
            out = compiled(x, position_embeddings=pe, attention_mask=None)
            out2 = compiled(x, position_embeddings=pe, attention_mask=None)
        ref, out, out2 = (t[0] if isinstance(t, tuple) else t for t in (ref, out, out2))
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2) and torch.equal(out, out2)
        group = layer.self_attn.q_proj._group
        assert group.x is None and group.out is None  # nothing kept alive after the v projection
    finally:
        lk.unkernelize(model)
        torch._dynamo.reset()
