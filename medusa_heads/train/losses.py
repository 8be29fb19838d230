"""Training losses: the Medusa heads loss, the EAGLE-style draft's loss, and the backbone's LM / distillation
loss for Medusa-2."""

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


def eagle_loss(draft, hidden: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, noise: float = 0.0,
               depths: int = 1, decay: float = 0.8, topk: int = 5):
    """EAGLE's loss where the token after next is an assistant token: SmoothL1 between the draft's guess
    g_{t+1} and the base's feature f_{t+1}, plus 0.1 x the cross-entropy of the draft's logits against the
    base's next-token distribution there (both over the draft vocabulary).

    With depths > 1 (EAGLE-3's training-time test), pass k runs the draft again over the guesses of pass
    k - 1 (each position's guess as the feature of the next one, with the real tokens), as drafting along a
    right path does at depth k + 1; its loss weighs decay**k. Also (top-1 hits, top-k hits, count) of each
    depth's guess of its token, as a (depths, 3) table like `heads_loss`'s.

    hidden: (B, T, H) the base's last hidden states (post final norm); ids, labels: (B, T); noise: the width
    of the uniform noise added to the input features (training only).
    """
    features = hidden[:, :-1]
    if noise:
        features = features + (torch.rand_like(features) - 0.5) * noise
    positions = torch.arange(features.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(depths, 3, dtype=torch.long)
    for k in range(min(depths, hidden.shape[1] - 2)):
        n = features.shape[1]
        guesses = draft(features, ids[:, 1 + k : 1 + k + n], positions[:, :n] + k)  # g_{t+k+1}
        keep = labels[:, 2 + k :] != IGNORE  # the token g_{t+k+1} guesses: t + k + 2
        if keep.any():
            guess, target = guesses[:, :-1][keep].float(), hidden[:, 1 + k : -1][keep].float()
            logits = draft.logits(guess).float()
            with torch.no_grad():
                base = torch.softmax(draft.logits(target).float(), dim=-1)
            soft_ce = -(base * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            total = total + decay**k * (F.smooth_l1_loss(guess, target) + 0.1 * soft_ce)
            with torch.no_grad():
                index = draft.draft_index(labels[:, 2 + k :][keep])
                top = logits.topk(topk, dim=-1).indices
                stats[k] = torch.stack([(top[:, 0] == index).sum(), (top == index[:, None]).any(-1).sum(),
                                        torch.tensor(index.numel())])
        features = guesses[:, :-1]
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
