"""Per request, the tree follows what is accepted. Greedy output is unchanged (any tree verifies the
same tokens) and exact sampling stays exact (the choice depends only on earlier steps).

- The lookup branch: each row drafts up to its own budget of tokens, which grows by 2 after a draft
  that was right to its end and shrinks by 1 after one that was not (the rule transformers'
  assisted generation sizes its drafts by), between 1 and the tree's lookup length.
- The heads' part: each row keeps a moving average of how deep the heads' guesses were right, over
  the steps that verified them. When every row's average is below what the head nodes cost (from
  the probed cost curve: c(head tokens) / c(1) - 1 tokens per step), steps verify only the root and
  the lookup branch, except every REFRESH-th step, which measures the heads again. Without a probed
  curve the heads always run.
"""

from __future__ import annotations

import numpy as np
import torch

REFRESH = 8  # with the heads off, every REFRESH-th step runs them to measure them again
SMOOTHING = 0.3  # weight of the latest step in a row's average head depth


def next_lookup_budget(budget: int, drafted: int, right: int, most: int) -> int:
    """A row's lookup budget after a step that drafted `drafted` tokens, `right` of them accepted."""
    if not drafted:
        return budget
    return min(most, budget + 2) if right >= drafted else max(1, budget - 1)


def smoothed(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value


def heads_threshold(cost_curve: dict | None, head_size: int) -> float | None:
    """Tokens per step below which the head nodes do not pay for themselves; None without a curve."""
    if not cost_curve:
        return None
    tokens, cost = cost_curve["tokens"], cost_curve["cost"]
    return float(np.interp(head_size, tokens, cost) / np.interp(1, tokens, cost)) - 1


def head_depths(tokens: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor, depths: torch.Tensor,
                ancestors: torch.Tensor) -> torch.Tensor:
    """How deep the heads' guesses were right this step, per row (B,): the deepest head node whose
    path matches the emitted tokens. tokens (B, 1 + m): root and the m head nodes' candidates;
    emitted (B, W): this step's tokens, count + 1 of them valid; depths (1 + m,); ancestors (1 + m,
    1 + m): the tree's mask (each node sees its ancestors and itself)."""
    d = depths[1:]  # (m,)
    expected = emitted.gather(1, (d - 1).clamp(max=emitted.shape[1] - 1).expand(len(emitted), -1))  # (B, m)
    match = (tokens[:, 1:] == expected) & (d[None] <= count[:, None] + 1)
    ok = (match[:, None, :] | ~ancestors[None, 1:, 1:]).all(-1)  # (B, m): the node and its ancestors match
    return (ok * d).amax(-1)
