"""kernelize on tiny models of every supported Hugging Face family beyond the five that
test_kernelize.py covers in depth: what is swapped, logits against the original (with and without
padding), unkernelize, and a static-cache greedy decode against generate.

Each family's table row names what kernelize must do with it, so a family that silently stops
being swapped (a transformers release renames a module, changes a rope form) fails here. Models
are built from configs with random weights (nothing is downloaded); norm weights are randomised so
that the (1 + w) and w forms differ."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402  (a dependency of transformers)

import llm_kernels as lk  # noqa: E402
from llm_kernels import flash, fuse, hf, layers, ops  # noqa: E402

from conftest import (DEVICES, GPU_REASON, HAS_GPU, TINY_HF, CountingOps, hf_ids, hf_kv_patchable,  # noqa: E402
                      hf_layers_fusable, hf_left_pad, hf_logits, hf_padded_errors, rel_err, tiny_hf_model)


@dataclasses.dataclass
class Family:
    config: str
    model: str
    mlp: type | None  # what every decoder layer's dense MLP becomes (None: there is none, e.g. MoE experts)
    rope: str | None  # the ops function that replaces the modeling module's apply_rotary_pos_emb
    attn: str = "sdpa"  # the implementation the model is built with
    extra: dict = dataclasses.field(default_factory=dict)
    left_alone: tuple = ()  # report families allowed to have modules left alone besides "fuse"
    fused_layer: bool = False  # whether its decoder layers get fuse.layer_forward (LLaMA's pre-norm layout)
    rotary_left: str = ""  # the reason its rotary module may be left alone (in this transformers; "": never)


LAYERS_FUSABLE = hf_layers_fusable()
GELU_TANH = dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
MOE = ("mlp",)  # the experts (fused 3-D weights) stay Hugging Face's
PER_LAYER_TYPE = "it has no inv_freq vector"  # (transformers 5.x: one inv_freq per layer type)

FAMILIES = {
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", hf.GatedMLP, "apply_rotary_pos_emb", attn="eager",
                     extra=dict(GELU_TANH, sliding_window=8)),  # soft-capping: eager, kept for those calls
    "gemma3_text": Family("Gemma3TextConfig", "Gemma3ForCausalLM", hf.GatedMLP, "apply_rotary_pos_emb",
                          extra=dict(GELU_TANH, sliding_window=8), rotary_left=PER_LAYER_TYPE),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", layers.GateUpMLP, "apply_rotary_pos_emb",
                   extra=dict(partial_rotary_factor=0.5), fused_layer=True),
    "glm": Family("GlmConfig", "GlmForCausalLM", layers.GateUpMLP, "apply_rotary_pos_emb_interleaved", fused_layer=True),
    "glm4": Family("Glm4Config", "Glm4ForCausalLM", layers.GateUpMLP, "apply_rotary_pos_emb_interleaved"),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb"),
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb",
                    extra=dict(sliding_window=8), rotary_left=PER_LAYER_TYPE),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb",
                      extra=dict(residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.1)),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb", fused_layer=True),
    "ministral": Family("MinistralConfig", "MinistralForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb", fused_layer=True),
    "helium": Family("HeliumConfig", "HeliumForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb_interleaved", fused_layer=True),
    "ernie4_5": Family("Ernie4_5Config", "Ernie4_5ForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb_interleaved", fused_layer=True),
    "exaone4": Family("Exaone4Config", "Exaone4ForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb"),
    "seed_oss": Family("SeedOssConfig", "SeedOssForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb", fused_layer=True),
    "hunyuan_v1_dense": Family("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", layers.LlamaMLP,
                               "apply_rotary_pos_emb", fused_layer=True),
    "cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", layers.LlamaMLP, "apply_rotary_pos_emb_interleaved_pairs",
                      extra=dict(sliding_window=8),  # LayerNorm: no RMSNorm to swap
                      rotary_left="its angles are none of the forms ours computes"),  # repeat_interleave
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", None, "apply_rotary_pos_emb", left_alone=MOE,
                        extra=dict(moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4,
                                   num_experts_per_tok=2)),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", None, "apply_rotary_pos_emb", left_alone=MOE,
                        extra=dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", None, "apply_rotary_pos_emb", left_alone=MOE,
                      extra=dict(num_local_experts=4, num_experts_per_tok=2)),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM", None, "apply_rotary_pos_emb_halfwidth", attn="eager",
                      left_alone=MOE, extra=dict(num_local_experts=4, num_experts_per_tok=2)),  # sinks: eager
}


def make(name: str, device: str = "cpu", dtype=torch.float32, seed: int = 0):
    fam = FAMILIES[name]
    extra = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, **fam.extra)
    return tiny_hf_model(fam.config, fam.model, extra, attn=fam.attn, device=device, dtype=dtype, seed=seed)


logits, ids_for = hf_logits, hf_ids


@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    assert hf._ROPE_PATCHES == {}, f"rope patches left: {list(hf._ROPE_PATCHES)}"
    assert hf._KV_PATCH == [] and hf._EAGER_CONFIGS == {}


def _cases():
    gpu = pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
    return [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=gpu)]


@pytest.mark.parametrize("device,dtype", _cases())
@pytest.mark.parametrize("name", FAMILIES)
def test_family_is_swapped_and_agrees(name, device, dtype, monkeypatch):
    monkeypatch.setattr(flash, "use_on_cpu", True)  # our attention kernels on the CPU too
    fam = FAMILIES[name]
    if device == "cuda" and fam.left_alone == MOE:
        # bf16 flips top-k expert choices of near-tied tokens (H200, 2026-12-05: Mixtral's padded row
        # 0.030 against 0.0066 unpadded): compared in fp32, where the routing is the original's
        dtype = torch.float32
    model = make(name, device, dtype)
    modeling = __import__(type(model).__module__, fromlist=["_"])
    original_rope = modeling.apply_rotary_pos_emb
    ids = ids_for(device)
    pad = hf_left_pad(ids)
    try:
        ref, ref_pad = logits(model, ids), logits(model, ids, attention_mask=pad)
    except RuntimeError as e:  # e.g. Phi-3's partial rotary before transformers had it
        pytest.skip(f"the original {name} model fails in transformers {transformers.__version__}: {e}")
    modules_before = dict(model.named_modules())
    norms = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    report = lk.kernelize(model)
    try:
        assert report.swapped, str(report)
        rotary = [s for s in report.by_family("rope") if s.name.endswith("rotary_emb")]
        assert len(rotary) == 1, str(report)
        if not fam.rotary_left:
            assert rotary[0].swapped, str(report)
        else:  # left alone for this reason, or swapped where this transformers computes one of our forms
            assert rotary[0].swapped or rotary[0].reason.startswith(fam.rotary_left), str(report)
        left = {s.family for s in report.left_alone if s not in rotary} - {"fuse"}
        kv = hf_kv_patchable()
        old_attention = [s for s in report.by_family("attention") if "ALL_ATTENTION_FUNCTIONS" in s.reason
                         or s.reason.startswith("this transformers has no")]
        # kv_cache: transformers 5's StaticLayer; attention: the attention and mask interfaces (4.53+) and
        # modeling files that use them (4.57's Qwen2-MoE does not)
        assert left <= set(fam.left_alone) | (set() if kv else {"kv_cache"}) | (
            {"attention"} if old_attention else set()), str(report)
        for n in norms:
            assert type(model.get_submodule(n)) is layers.RMSNorm, n
        for layer in model.model.layers:
            if fam.mlp is not None:
                assert type(layer.mlp) is fam.mlp
        assert modeling.apply_rotary_pos_emb is getattr(ops, fam.rope)
        fused = {s.name: s.swapped for s in report.by_family("fuse")}
        expect = fam.fused_layer and LAYERS_FUSABLE  # (transformers 4.48's layers return tuples: never fused)
        assert all(fused.get(f"model.layers.{i}") == expect for i in range(len(model.model.layers))), fused
        assert model.config._attn_implementation == (fam.attn if old_attention else hf.ATTN_NAME)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel_err(logits(model, ids), ref) < tol
        assert all(e < tol for e in hf_padded_errors(model, ids, pad, ref_pad))
    finally:
        lk.unkernelize(model)
    assert modeling.apply_rotary_pos_emb is original_rope
    assert all(m is modules_before[n] for n, m in model.named_modules())
    assert model.config._attn_implementation == fam.attn
    assert torch.equal(logits(model, ids), ref)


# Families whose every attention call carries what our kernels do not compute (Gemma 2's soft-capping,
# gpt-oss's sinks): kernelize keeps their eager attention for those calls.
EAGER_ATTENTION = ("gemma2", "gpt_oss")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
def test_family_generates_what_the_original_generates(name, device, monkeypatch):
    """Greedy generate of the kernelized model, with a static cache (decode steps through our
    masked decode attention, the cache-update patch and, where the family has them, the fused GEMMs
    and layers) and with the default dynamic cache, gives the original's tokens, sliding-window
    layers included (prompt 9 tokens, window 8)."""
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    monkeypatch.setattr(flash, "use_on_cpu", True)  # our attention kernels on the CPU too
    model = make(name, device)
    prompt = ids_for(device, batch=2, seq=9)
    try:
        ref = model.generate(prompt, max_new_tokens=6, do_sample=False)
    except RuntimeError as e:
        pytest.skip(f"the original {name} model fails in transformers {transformers.__version__}: {e}")
    try:
        static_ok = torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False,
                                               cache_implementation="static"), ref)
    except (ValueError, RuntimeError):  # no static cache for the family in this transformers, or a broken one
        static_ok = None
    calls = [0]
    real = hf.decode.decode_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hf.decode, "decode_attention", counted)
    counting = CountingOps(fuse.decode._ops)
    monkeypatch.setattr(fuse.decode, "_ops", counting)
    report = lk.kernelize(model)
    try:
        if static_ok is not None:
            static = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
            # (in fp32 our GPU kernels step aside: the GPU case checks the tokens only)
            ours = bool(report.by_family("attention")[0].swapped) and name not in EAGER_ATTENTION and device == "cpu"
            assert (calls[0] > 0) == ours
            # fused layers ran their fused path: a down_proj with the residual epilogue per layer and step
            layers_fused = any(s.swapped and s.name == "model.layers.0" for s in report.by_family("fuse"))
            assert (counting.fusions.count((False, True)) >= 5 * len(model.model.layers)) == (
                layers_fused and device == "cpu")
        dynamic = model.generate(prompt, max_new_tokens=6, do_sample=False)
    finally:
        lk.unkernelize(model)
    assert torch.equal(dynamic, ref)
    if static_ok is not None:
        assert static_ok, "the original's static-cache generate differs from its dynamic one"
        assert torch.equal(static, ref)


@pytest.mark.parametrize("name", ["phi3", "glm", "cohere2", "gpt_oss", "gemma2"])
def test_family_training_gradients_agree(name):
    """mode="training" through the new parts' backward: GateUpMLP (Phi-3, GLM), the interleaved,
    pair-repeated and half-width rope forms (GLM, Cohere, gpt-oss), the eager-fallback model
    (Gemma 2): loss and every parameter's gradient against the original's."""
    model = make(name)
    model.train()
    ids = ids_for("cpu")
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except RuntimeError as e:  # e.g. Phi-3's partial rotary before transformers had it
        pytest.skip(f"the original {name} model fails in transformers {transformers.__version__}: {e}")
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    report = lk.kernelize(model, mode="training")
    try:
        assert {s.family for s in report.swapped} >= {"rms_norm", "rope"} or name == "cohere2"
        model(input_ids=ids, labels=ids).loss.backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    finally:
        lk.unkernelize(model)
    assert got.keys() == ref.keys()
    for n in ref:
        assert rel_err(got[n], ref[n]) < 1e-5, n


@pytest.mark.parametrize("name", ["phi3", "glm", "gpt_oss"])
def test_family_attention_and_mlp_compile_fullgraph(name):
    """A kernelized layer's attention (the interleaved and half-width rope forms, partial rotary)
    and MLP (GateUpMLP) each trace in one graph (CPU: aot_eager runs our fake implementations).
    (Whole layers: gpt-oss's experts loop does not trace in every transformers.)"""
    model = make(name)
    lk.kernelize(model)
    try:
        layer = model.model.layers[0]
        x = torch.randn(2, 7, 128)
        pe = model.model.rotary_emb(x, torch.arange(7)[None])
        parts = [(layer.self_attn, dict(hidden_states=x, position_embeddings=pe, attention_mask=None))]
        if isinstance(layer.mlp, layers.GateUpMLP):
            parts.append((layer.mlp, dict(x=x)))
        for part, kwargs in parts:
            with torch.no_grad():
                ref = part(**kwargs)
                torch._dynamo.reset()
                out = torch.compile(part, fullgraph=True, backend="aot_eager")(**kwargs)
            ref, out = (t[0] if isinstance(t, tuple) else t for t in (ref, out))
            assert rel_err(out, ref) < 1e-5, type(part).__name__
    finally:
        lk.unkernelize(model)
        torch._dynamo.reset()


def test_monarch_last_converts_a_single_qkv_proj():
    """monarch_last on Phi-3 converts its one qkv_proj (and o_proj) of the last layer; its layer then
    runs unfused, the model still runs, and unkernelize puts the Linears back."""
    from llm_kernels import monarch

    model = make("phi3")
    report = lk.kernelize(model, monarch_last=1, monarch_nblocks=4)
    attn = model.model.layers[-1].self_attn
    try:
        assert sorted(s.name for s in report.by_family("monarch") if s.swapped) == [
            "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.qkv_proj"]
        assert isinstance(attn.qkv_proj, monarch.MonarchLinear)
        assert not any(s.swapped for s in report.by_family("fuse") if s.name == "model.layers.1")
        assert torch.isfinite(logits(model, ids_for("cpu"))).all()
    finally:
        lk.unkernelize(model)
    assert type(attn.qkv_proj) is torch.nn.Linear and type(attn.o_proj) is torch.nn.Linear


def test_a_family_whose_attention_reads_q_k_between_rope_and_the_cache_is_not_deferred():
    """Hunyuan normalises q and k after the rotation: the deferred rotation (rope_kv.py) would hand
    those norms unfilled tensors, so its attention class must not be armed; LLaMA's is."""
    from llm_kernels import rope_kv

    llama = __import__("transformers.models.llama.modeling_llama", fromlist=["_"])
    assert rope_kv._rope_then_update(llama.LlamaAttention)
    if not hasattr(transformers, "HunYuanDenseV1Config"):
        pytest.skip("this transformers has no Hunyuan")
    hunyuan = __import__("transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense", fromlist=["_"])
    assert not rope_kv._rope_then_update(hunyuan.HunYuanDenseV1Attention)


# ------------------------------------------------------------------- vision-language models
SIGLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
QWEN_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128)


def _text(**kw):
    return dict(TINY_HF, vocab_size=300, pad_token_id=None, bos_token_id=None, eos_token_id=None, **kw)


# name: (config class, model class, the text model type, config kwargs)
VLMS = {
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", "gemma3_text",
               lambda: dict(text_config=_text(hidden_activation="gelu_pytorch_tanh", sliding_window=8),
                            vision_config=SIGLIP, mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
                            eoi_token_index=298)),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", "llama",
              lambda: dict(text_config=dict(model_type="llama", **_text()), vision_config=SIGLIP, image_token_index=299)),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", "mistral",
                 lambda: dict(text_config=dict(model_type="mistral", **_text()), image_token_index=299,
                              vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                                 patch_size=14, head_dim=32))),
    "paligemma": ("PaliGemmaConfig", "PaliGemmaForConditionalGeneration", "gemma",
                  lambda: dict(text_config=dict(model_type="gemma", **_text(hidden_activation="gelu_pytorch_tanh")),
                               vision_config=SIGLIP, image_token_index=299, projection_dim=128)),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "qwen2_vl_text",
                 lambda: dict(text_config=_text(rope_scaling=dict(type="mrope", mrope_section=[8, 12, 12])),
                              vision_config=dict(depth=1, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2),
                              image_token_id=299, video_token_id=298, vision_start_token_id=297)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text",
                   lambda: dict(text_config=_text(rope_scaling=dict(type="mrope", mrope_section=[8, 12, 12])),
                                vision_config=dict(QWEN_VISION, fullatt_block_indexes=[0]), image_token_id=299,
                                video_token_id=298, vision_start_token_id=297)),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "qwen3_vl_text",
                 lambda: dict(text_config=_text(rope_scaling=dict(rope_type="default", mrope_section=[8, 12, 12],
                                                                  mrope_interleaved=True)),
                              vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0]), image_token_id=299,
                              video_token_id=298, vision_start_token_id=297)),
}


@pytest.mark.parametrize("name", VLMS)
def test_vision_language_model_kernelizes_its_language_model(name, monkeypatch):
    """kernelize(vlm) kernelizes the text decoder (and the top-level lm_head), leaves the vision
    tower alone, agrees with the original on text (logits and static-cache greedy generate), and
    unkernelize restores every module."""
    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    monkeypatch.setattr(flash, "use_on_cpu", True)
    cfg_name, model_name, text_type, kwargs = VLMS[name]
    if not hasattr(transformers, cfg_name) or not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    try:
        cfg = getattr(transformers, cfg_name)(**kwargs())
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(cfg).eval()
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # an older transformers' configs differ
        pytest.skip(f"a tiny {model_name} cannot be built in transformers {transformers.__version__}: {e}")
    ids = torch.randint(0, 290, (2, 11), generator=torch.Generator().manual_seed(3))
    ref = logits(model, ids)
    try:
        ref_gen = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    except ValueError:  # no static cache for this model in this transformers
        ref_gen = None
    modules_before = dict(model.named_modules())
    report = lk.kernelize(model)
    if not report[0].swapped and Version(transformers.__version__) < Version("4.57"):
        pytest.skip(f"transformers {transformers.__version__}'s {model_name} does not give its language model the "
                    "text config (kernelize finds the language model from 4.57 on)")
    try:
        lm_name = report[0].name
        assert report[0].family == "model" and report[0].swapped, str(report)
        lm = model.get_submodule(lm_name)
        assert lm.config.model_type == text_type and hf.is_kernelized(model) and hf.is_kernelized(lm)
        swapped = [s.name for s in report.swapped if s.family in ("rms_norm", "mlp", "linear")]
        assert swapped and all(n.startswith(lm_name + ".") or n == "lm_head" for n in swapped), swapped
        assert "lm_head" in swapped
        vision = [n for n in modules_before if n and not n.startswith(lm_name) and n != "lm_head"]
        assert any("vis" in n for n in vision) and all(model.get_submodule(n) is modules_before[n] for n in vision)
        assert rel_err(logits(model, ids), ref) < 1e-5
        if ref_gen is not None:
            assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static"),
                               ref_gen)
    finally:
        restored = lk.unkernelize(model)
    assert "lm_head" in restored and any(r.startswith(lm_name + ".") for r in restored)
    assert not hf.is_kernelized(model) and not hf.is_kernelized(lm)
    assert all(m is modules_before[n] for n, m in model.named_modules())
    assert torch.equal(logits(model, ids), ref)


def test_supported_model_types_are_all_tested():
    """Every model type kernelize accepts has a table row here (as a model or a VLM's text decoder)
    or in test_kernelize.py."""
    from test_kernelize import FAMILIES as CORE

    tested = set(CORE) | set(FAMILIES) | {v[2] for v in VLMS.values()}
    assert set(hf.SUPPORTED_MODEL_TYPES) == tested
