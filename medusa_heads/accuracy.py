"""How often each head's top-r guesses hold the token it aims at, measured on real answers."""

from __future__ import annotations

import torch

from . import adapter


@torch.inference_mode()
def head_hits(model, sequence: torch.Tensor, start: int, max_rank: int = 10) -> torch.Tensor:
    """Per head and rank, how many positions of an answer the head's top-`max_rank` got right.

    sequence: (T,) prompt + answer tokens; positions from `start - 1` on (the hidden states that
    predict answer tokens) are scored. Head k at position t aims at token t + k + 2 (the base
    model's own next token is t + 1). Returns (hits (K, max_rank) cumulative over ranks, counts (K,)).
    """
    base = model.base_model
    ids = sequence[None].to(model.device)
    hidden = adapter.decoder(base)(input_ids=ids).last_hidden_state[0, start - 1 : -1]  # (A, H)
    answer = ids[0, start - 1 :]
    top = model.heads.propose(hidden, max_rank, next_token=answer[1:])  # (K, A, r) token ids
    hits = torch.zeros(top.shape[0], max_rank, dtype=torch.long)
    counts = torch.zeros(top.shape[0], dtype=torch.long)
    for k in range(top.shape[0]):
        n = answer.numel() - (k + 2)
        if n <= 0:
            continue
        target = answer[k + 2 :]  # (n,)
        first_hit = (top[k, :n] == target[:, None]).float().argmax(-1)  # rank of the hit (0 if none)
        found = (top[k, :n] == target[:, None]).any(-1)
        ranks = torch.where(found, first_hit, torch.full_like(first_hit, max_rank))
        hits[k] = (ranks[:, None] <= torch.arange(max_rank, device=ranks.device)).sum(0).cpu()
        counts[k] = n
    return hits, counts


def accuracy_table(hits: torch.Tensor, counts: torch.Tensor) -> list[list[float]]:
    """Top-1..r accuracy per head from summed head_hits results."""
    return (hits.double() / counts.clamp_min(1)[:, None]).tolist()
