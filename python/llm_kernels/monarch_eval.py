"""Accuracy of a Monarch conversion: perplexity of a causal LM on a text before and after
monarchize() replaces the chosen nn.Linear layers (issue 6, "accuracy tool").

    from llm_kernels.monarch_eval import compare_perplexity
    result = compare_perplexity(model, input_ids, ["model.layers.1[01].self_attn.*_proj"], nblocks=4)
    result.before, result.after, result.report   # perplexities and monarchize's per-layer report

Works with any module whose forward takes `input_ids` and returns logits (a tensor, or an object
with `.logits`, as Hugging Face causal LMs do). Command line: `llm-kernels monarch-ppl`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .monarch import ConversionRecord, monarchize


@torch.no_grad()
def perplexity(model: torch.nn.Module, input_ids: torch.Tensor, window: int = 512) -> float:
    """exp(mean next-token negative log-likelihood) of input_ids (1-d or (1, T)) under model,
    in consecutive non-overlapping windows of `window` tokens (each predicts its own tokens 2..)."""
    ids = input_ids.reshape(-1)
    if ids.numel() < 2:
        raise ValueError(f"llm_kernels.perplexity: input_ids: expected at least 2 tokens, got {ids.numel()}")
    if window < 2:
        raise ValueError(f"llm_kernels.perplexity: window: expected >= 2, got {window}")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start : start + window].to(device)
        if chunk.numel() < 2:
            break
        out = model(input_ids=chunk[None])
        logits = (out.logits if hasattr(out, "logits") else out)[0, :-1].float()
        total += float(F.cross_entropy(logits, chunk[1:], reduction="sum"))
        count += chunk.numel() - 1
    return math.exp(total / count)


@dataclass
class PerplexityComparison:
    before: float
    after: float
    report: list[ConversionRecord]

    @property
    def ratio(self) -> float:
        return self.after / self.before


def compare_perplexity(model: torch.nn.Module, input_ids: torch.Tensor, targets: list[str] | str, nblocks: int,
                       window: int = 512, in_place: bool = False) -> PerplexityComparison:
    """Perplexity before and after monarchize(model, targets, nblocks). The model is converted
    in place only with in_place=True (otherwise a deep copy is)."""
    was_training = model.training
    model.eval()
    before = perplexity(model, input_ids, window)
    converted = model if in_place else copy.deepcopy(model)
    report = monarchize(converted, targets, nblocks)
    if not report:
        raise ValueError(f"llm_kernels.compare_perplexity: targets: no nn.Linear matched {targets!r}")
    converted.eval()
    after = perplexity(converted, input_ids, window)
    model.train(was_training)
    return PerplexityComparison(before, after, report)
