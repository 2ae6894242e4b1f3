"""How much a Monarch conversion costs in accuracy: perplexity of a causal LM on a text before and
after `monarchize`.

    from llm_kernels.perplexity import perplexity, monarch_perplexity
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    ppl = perplexity(model, ids, window=1024, stride=512)
    result = monarch_perplexity(model, ids, targets="model.layers.1[01].self_attn.*_proj", nblocks=4)
    print(result.before, result.after)   # converts the model in place

Or from the command line, with a local model directory (nothing is downloaded):

    llm-kernels perplexity ./my-llama text.txt --targets "model.layers.*.self_attn.*_proj" --nblocks 4
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .monarch import ConversionRecord, monarchize


@torch.no_grad()
def perplexity(model: torch.nn.Module, input_ids: torch.Tensor, window: int | None = None,
               stride: int | None = None) -> float:
    """exp(mean negative log-likelihood) of tokens 1..L-1 of the 1-D `input_ids`, each predicted
    from the tokens before it. Texts longer than `window` are scored with a sliding window that
    advances by `stride` (default: window / 2, at most window - 1), so every token is scored
    exactly once, with at least one token of context. Log-probabilities are
    summed in float64."""
    if input_ids.dim() != 1 or input_ids.numel() < 2:
        raise ValueError(f"llm_kernels.perplexity: input_ids must be 1-D with at least 2 tokens, got shape {tuple(input_ids.shape)}")
    length = input_ids.numel()
    window = length if window is None else window
    stride = max(1, window // 2) if stride is None else stride
    if window < 2 or not 0 < stride <= window:
        raise ValueError(f"llm_kernels.perplexity: need window >= 2 and 0 < stride <= window, got stride={stride}, window={window}")
    device = next(model.parameters()).device
    total, count, scored_to = 0.0, 0, 1  # token 0 has no prediction
    begin = 0
    while scored_to < length:
        end = min(begin + window, length)
        ids = input_ids[begin:end].to(device).unsqueeze(0)
        logits = model(ids).logits[0].double()
        # logits[t] predicts token begin + t + 1; score the tokens in [scored_to, end).
        first = scored_to - begin - 1
        logp = torch.log_softmax(logits[first:end - begin - 1], dim=-1)
        targets = ids[0, first + 1:end - begin]
        total -= float(logp.gather(-1, targets.unsqueeze(-1)).sum())
        count += targets.numel()
        scored_to = end
        begin = min(begin + stride, end - 1)  # the next window's first scored token has context
    return math.exp(total / count)


@dataclasses.dataclass
class MonarchPerplexity:
    before: float
    after: float
    layers: list[ConversionRecord]

    @property
    def params_before(self) -> int:
        return sum(r.params_before for r in self.layers)

    @property
    def params_after(self) -> int:
        return sum(r.params_after for r in self.layers)


def monarch_perplexity(model: torch.nn.Module, input_ids: torch.Tensor, targets: list[str] | str,
                       nblocks: int, window: int | None = None, stride: int | None = None) -> MonarchPerplexity:
    """Perplexity before, then `monarchize(model, targets, nblocks)` in place, then perplexity
    after, with the per-layer conversion report."""
    before = perplexity(model, input_ids, window, stride)
    layers = monarchize(model, targets, nblocks)
    if not layers:
        raise ValueError(f"llm_kernels.monarch_perplexity: no nn.Linear matches {targets!r}")
    return MonarchPerplexity(before, perplexity(model, input_ids, window, stride), layers)
