"""The Monarch accuracy tool: perplexity of a small causal LM (built from a config, byte-level
tokens, trained briefly on the text in data/, no downloads) before and after conversion."""

import math
import pathlib

import pytest
import torch

from llm_kernels.monarch_eval import compare_perplexity, perplexity

TEXT = (pathlib.Path(__file__).parent / "data" / "monarch_text.txt").read_bytes()


@pytest.fixture(scope="module")
def trained():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.tensor(list(TEXT), dtype=torch.long)
    untrained = perplexity(model, ids, window=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        starts = torch.randint(0, ids.numel() - 129, (4,), generator=gen)
        batch = torch.stack([ids[s : s + 129] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, ids, untrained


def test_training_made_the_weights_meaningful(trained):
    model, ids, untrained = trained
    ppl = perplexity(model, ids, window=128)
    assert ppl < 0.5 * untrained and ppl < 20, (ppl, untrained)


def test_one_block_is_exact_and_more_blocks_cost_accuracy(trained):
    model, ids, _ = trained
    targets = ["model.layers.1.self_attn.*_proj", "model.layers.1.mlp.*_proj"]
    exact = compare_perplexity(model, ids, targets, nblocks=1, window=128)
    assert len(exact.report) == 7
    assert math.isclose(exact.after, exact.before, rel_tol=1e-3), (exact.before, exact.after)
    lossy = compare_perplexity(model, ids, targets, nblocks=8, window=128)
    assert all(r.params_after < r.params_before for r in lossy.report)
    assert all(0 < r.relative_error < 1 for r in lossy.report)
    assert lossy.after > lossy.before and math.isfinite(lossy.after)
    # the original model is untouched (a copy was converted)
    assert type(model.model.layers[1].self_attn.q_proj).__name__ == "Linear"


def test_bad_inputs(trained):
    model, ids, _ = trained
    with pytest.raises(ValueError, match="no nn.Linear matched"):
        compare_perplexity(model, ids, ["nothing.*"], nblocks=4)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, ids[:1])


def test_cli_monarch_ppl(trained, tmp_path):
    import json

    from typer.testing import CliRunner

    from llm_kernels.cli import app

    model, ids, _ = trained
    model.save_pretrained(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_bytes(TEXT)
    result = CliRunner().invoke(app, ["monarch-ppl", str(tmp_path / "tiny"), str(text), "--target",
                                      "model.layers.1.self_attn.*_proj", "--nblocks", "1", "--window", "128",
                                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])  # after any progress bars
    assert len(data["layers"]) == 4 and math.isclose(data["after"], data["before"], rel_tol=1e-3)
