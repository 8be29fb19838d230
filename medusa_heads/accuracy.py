"""How often each head's top-r guesses hold the token it aims at, measured on real answers."""

from __future__ import annotations

import torch

from . import adapter
from .heads import path_tokens


@torch.inference_mode()
def head_ranks(model, sequence: torch.Tensor, start: int, max_rank: int = 10) -> torch.Tensor:
    """Where each head ranked the token it aims at, at each step of an answer's greedy decoding.

    sequence: (T,) prompt + answer tokens, the answer from `start` on. Column i is the step whose
    root is answer token i: the heads read the hidden state of the token before it (and chained heads
    the answer tokens i..i + k: the path as it stands when all earlier guesses were right), and head
    k aims at answer token i + k + 1. Returns (K, A) ranks: max_rank where the top-max_rank missed it,
    -1 where the answer ends before the target.
    """
    base = model.base_model
    ids = sequence[None].to(model.device)
    hidden = adapter.decoder(base)(input_ids=ids).last_hidden_state[0, start - 1 : -1]  # (A, H)
    answer = ids[0, start:]
    path = path_tokens(answer, torch.arange(answer.numel(), device=answer.device), model.heads.config.num_heads)
    top = model.heads.propose(hidden, max_rank, tokens=path)  # (K, A, r) token ids
    ranks = torch.full(top.shape[:2], -1, dtype=torch.long, device=top.device)
    for k in range(top.shape[0]):
        target = answer[k + 1 :]  # (A - k - 1,)
        match = top[k, : target.numel()] == target[:, None]
        ranks[k, : target.numel()] = torch.where(match.any(-1), match.float().argmax(-1), max_rank)
    return ranks.cpu()


def rank_hits(ranks: torch.Tensor, max_rank: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """From head_ranks (of one answer, or of several side by side): per head and rank, how many
    steps had the target within the top r, (K, max_rank) cumulative over ranks; and the steps
    that had a target, (K,)."""
    scored = ranks >= 0
    hits = (scored[..., None] & (ranks[..., None] <= torch.arange(max_rank))).sum(1)
    return hits, scored.sum(1)


def accuracy_table(hits: torch.Tensor, counts: torch.Tensor) -> list[list[float]]:
    """Top-1..r accuracy per head from summed rank_hits results."""
    return (hits.double() / counts.clamp_min(1)[:, None]).tolist()
