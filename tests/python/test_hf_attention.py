"""`attn_implementation="llm_kernels"`: our attention registered with transformers'
AttentionInterface and chosen by name when a model is built, without kernelize."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llm_kernels import flash, hf  # noqa: E402

from conftest import DEVICES, rel_err  # noqa: E402


def _config(attn: str):
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,  # head dim 64
                                   max_position_embeddings=256)
    cfg._attn_implementation = attn
    return cfg


@pytest.mark.parametrize("device", DEVICES)
def test_models_built_with_llm_kernels_attention_match_eager(device, monkeypatch):
    reason = hf.register_attention()
    if reason:
        pytest.skip(reason)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(_config("llm_kernels")).to(device=device, dtype=dtype).eval()
    eager = transformers.LlamaForCausalLM(_config("eager")).to(device=device, dtype=dtype).eval()
    eager.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "llm_kernels"
    calls = []
    real = flash.attention
    monkeypatch.setattr(flash, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(flash, "use_on_cpu", True)  # our CPU kernel too, so the CPU test covers the path
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, eager(input_ids=ids).logits
    assert calls, "the llm_kernels attention never reached our kernel"
    assert rel_err(got.double(), want.double()) < (1e-5 if device == "cpu" else 2e-2)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_calls_sdpa_cannot_take_go_to_the_models_eager_function(name, monkeypatch):
    """A model built with attn_implementation="llm_kernels" directly (no kernelize) whose calls carry
    what neither our kernels nor HF's sdpa compute (Gemma 2's logit soft-capping, which HF's sdpa
    refuses; gpt-oss's sinks, which it would drop) runs them through its modeling file's eager
    attention, and matches a model built with eager."""
    from test_kernelize_families import FAMILIES, ids_for, make

    reason = hf.register_attention()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(flash, "use_on_cpu", True)
    eager = make(name)
    fam = FAMILIES[name]
    cfg = getattr(transformers, fam.config).from_dict(eager.config.to_dict())
    ours = getattr(transformers, fam.model)._from_config(cfg, attn_implementation="llm_kernels").eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "llm_kernels"
    ids = ids_for("cpu")
    with torch.no_grad():
        assert rel_err(ours(input_ids=ids).logits, eager(input_ids=ids).logits) < 1e-5


@pytest.mark.parametrize("extra", ["softcap", "s_aux", "sinks", "position_bias", "cu_seq_lens_q", "output_attentions"])
def test_arguments_our_kernels_do_not_take_are_not_run_by_them(extra, monkeypatch):
    """A maskless call that carries any argument changing what attention computes (soft-capping,
    sinks, a position bias, packed sequences, returned weights) never reaches our kernel."""
    monkeypatch.setattr(flash, "use_on_cpu", True)
    if hf._HF_SDPA is None and hf.register_attention():
        pytest.skip("this transformers has no attention interface")
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 1, False
    q, k, v = (torch.randn(1, 2, 5, 64) for _ in range(3))
    reached = []
    monkeypatch.setattr(flash, "sdpa", lambda query, *a, **kw: reached.append(1) or query)
    monkeypatch.setattr(hf, "_HF_SDPA", lambda *a, **kw: ("fallback", None))
    value = True if extra == "output_attentions" else torch.ones(2)
    out = hf.attention_forward(module, q, k, v, None, scaling=0.125, **{extra: value})
    assert not reached and out[0] == "fallback"
    hf.attention_forward(module, q, k, v, None, scaling=0.125)  # without it: our kernel
    assert reached
