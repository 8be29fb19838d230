"""Training losses: the Medusa heads loss, and the backbone's LM / distillation loss for Medusa-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..heads import path_tokens
from .data import IGNORE


def head_targets(labels: torch.Tensor, k: int) -> torch.Tensor:
    """What head k (0-based) aims at from each position, flat over (B, T); IGNORE where nothing.

    Head k at position t aims at token t + k + 2; the base lm_head itself covers t + 1.
    """
    shift = k + 2
    target = torch.full_like(labels, IGNORE)
    target[:, :-shift] = labels[:, shift:]
    return target.reshape(-1)


def heads_loss(heads, hidden: torch.Tensor, labels: torch.Tensor, decay: float = 0.8, topk: int = 5,
               ids: torch.Tensor | None = None):
    """sum_k decay^k * CE_k over assistant targets; also per-head (top-1 hits, top-k hits, count).

    hidden: (B, T, H) last hidden states; labels: (B, T) with IGNORE outside assistant tokens; ids:
    (B, T) the tokens, which next_token heads read (token t + 1 at position t; chained heads also
    the tokens after it, the path as it stands when the earlier heads guessed right).
    Only positions with a target go through the heads; with a draft vocabulary, targets outside it
    count as misses and add no loss.
    """
    K = heads.config.num_heads
    targets = torch.stack([head_targets(labels, k) for k in range(K)])  # (K, B*T)
    where = (targets != IGNORE).any(0).nonzero(as_tuple=True)[0]
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(K, 3, dtype=torch.long)
    if where.numel() == 0:
        return total, stats
    tokens = None if ids is None else path_tokens(ids.reshape(-1), where + 1, K)  # (N, K)
    states = heads.states(hidden.reshape(-1, hidden.shape[-1])[where], tokens)  # (K, N, H)
    for k in range(K):
        target = targets[k, where]
        keep = target != IGNORE
        if not keep.any():
            continue
        logits = heads.project(states[k][keep], k).float()  # (n, V or draft_vocab)
        index = heads.draft_index(target[keep])  # -1: a token the heads cannot propose (a miss, no loss)
        ce = F.cross_entropy(logits, index, ignore_index=-1, reduction="sum") / (index >= 0).sum().clamp_min(1)
        total = total + decay**k * ce
        with torch.no_grad():
            top = logits.topk(topk, dim=-1).indices
            stats[k, 0] = (top[:, 0] == index).sum()
            stats[k, 1] = (top == index[:, None]).any(-1).sum()
            stats[k, 2] = index.numel()
    return total, stats


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on assistant tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE)


def distill_kl(logits: torch.Tensor, original_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """KL(original || trained) of the next-token distributions at positions that predict assistant tokens."""
    mask = labels[:, 1:] != IGNORE
    new = F.log_softmax(logits[:, :-1][mask].float(), dim=-1)
    old = F.log_softmax(original_logits[:, :-1][mask].float(), dim=-1)
    return F.kl_div(new, old, log_target=True, reduction="batchmean")
