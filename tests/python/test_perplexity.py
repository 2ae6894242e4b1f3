"""The Monarch accuracy tool: perplexity before and after conversion, on a tiny byte-level LLaMA
trained briefly on the text in data/tiny_corpus.txt (no downloads; weights are not pure noise)."""

import copy
import math
import pathlib

import pytest
import torch

from conftest import DEVICES
from llm_kernels.perplexity import monarch_perplexity, perplexity

transformers = pytest.importorskip("transformers")

CORPUS = (pathlib.Path(__file__).parent / "data" / "tiny_corpus.txt").read_bytes()


def _ids() -> torch.Tensor:
    return torch.tensor(list(CORPUS), dtype=torch.long)


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    model = transformers.LlamaForCausalLM(config).float()
    untrained = copy.deepcopy(model).eval()
    ids, opt = _ids(), torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        starts = torch.randint(0, ids.numel() - 65, (8,), generator=gen)
        batch = torch.stack([ids[s:s + 65] for s in starts.tolist()])
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), untrained


def _manual_ppl(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(ids.unsqueeze(0)).logits[0].double(), -1)
    return math.exp(-float(logp[:-1].gather(-1, ids[1:].unsqueeze(-1)).mean()))


def test_matches_exp_mean_nll(trained):
    model, _ = trained
    ids = _ids()[:300]
    assert perplexity(model, ids) == pytest.approx(_manual_ppl(model, ids), rel=1e-9)


def test_training_made_the_weights_meaningful(trained):
    model, untrained = trained
    ids = _ids()[:400]
    assert perplexity(model, ids) < 0.5 * perplexity(untrained, ids)


def test_sliding_window_scores_every_token_once(trained):
    model, _ = trained
    ids = _ids()[:200]
    full = perplexity(model, ids)
    # A window as long as the text is the full computation; shorter windows see less context,
    # so their perplexity differs but stays finite and close.
    assert perplexity(model, ids, window=200, stride=50) == pytest.approx(full, rel=1e-9)
    for window, stride in [(64, 32), (64, 64), (2, 1), (50, 7)]:
        ppl = perplexity(model, ids, window=window, stride=stride)
        assert math.isfinite(ppl) and ppl > 1
    # window = 2 scores each token from its predecessor alone: a bigram-context check by hand.
    with torch.no_grad():
        nll = 0.0
        for t in range(1, 40):
            logits = model(ids[t - 1:t + 1].unsqueeze(0)).logits[0, 0].double()
            nll -= float(torch.log_softmax(logits, -1)[ids[t]])
    assert perplexity(model, ids[:40], window=2, stride=1) == pytest.approx(math.exp(nll / 39), rel=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_monarch_conversion_before_and_after(trained, device):
    model, _ = trained
    ids = _ids()[:300]
    exact = copy.deepcopy(model).to(device)
    # One block is a dense matrix: the projection is exact and perplexity must not move.
    one = monarch_perplexity(exact, ids, "model.layers.*.self_attn.*_proj", nblocks=1)
    assert len(one.layers) == 8
    assert one.after == pytest.approx(one.before, rel=1e-4)
    lossy = copy.deepcopy(model).to(device)
    four = monarch_perplexity(lossy, ids, "model.layers.*.self_attn.*_proj", nblocks=4)
    assert four.params_after < four.params_before
    assert all(r.relative_error > 0.01 for r in four.layers)
    assert four.after != pytest.approx(four.before, rel=1e-3)
    assert four.before == pytest.approx(one.before, rel=1e-6)


def test_bad_inputs(trained):
    model, _ = trained
    with pytest.raises(ValueError, match="1-D with at least 2 tokens"):
        perplexity(model, _ids()[:1])
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, _ids()[:10], window=4, stride=5)
    with pytest.raises(ValueError, match="no nn.Linear matches"):
        monarch_perplexity(copy.deepcopy(model), _ids()[:10], "nothing.*", nblocks=2)


def test_cli_reports_before_and_after(trained, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from typer.testing import CliRunner

    from llm_kernels.cli import app

    model, _ = trained
    model.save_pretrained(tmp_path / "model")
    # A byte-level tokenizer whose ids are the byte values the model was trained on (GPT-2's
    # byte-to-symbol table, no merges).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    others = [b for b in range(256) if b not in printable]
    symbol = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    tok = Tokenizer(models.BPE(vocab={symbol[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_bytes(CORPUS[:300])
    result = CliRunner().invoke(app, [
        "perplexity", str(tmp_path / "model"), str(tmp_path / "text.txt"), "--targets",
        "model.layers.*.self_attn.q_proj", "--nblocks", "4", "--device", "cpu", "--dtype", "fp32",
    ])
    assert result.exit_code == 0, result.output
    expected = perplexity(model, _ids()[:300])
    assert f"perplexity before {expected:.4f}," in result.output
