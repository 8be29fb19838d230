"""Medusa heads: K heads of L residual blocks each, then a projection to the vocabulary."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from . import kernels, speed
from .tree import Level
from .vocabulary import DraftVocabulary

PROJECTIONS = ("own", "shared")
_NONE = torch.empty(0)  # what the C++ draft takes for a bias the projection does not have


@dataclass
class HeadsConfig:
    num_heads: int = 5  # K: head k guesses the token k+1 places after the base model's next token
    num_layers: int = 1  # L: residual blocks per head
    projection: str = "own"  # "own": a vocabulary projection per head; "shared": reuse the base lm_head
    hidden_size: int = 0  # width of the base model's last hidden state
    vocab_size: int = 0  # rows of the base model's lm_head
    draft_vocab: int = 0  # > 0: the heads propose only these tokens (`token_map`), a cheaper projection
    next_token: bool = False  # heads also read the base model's next token (the tree's root), known before they guess
    chained: bool = False  # head k reads the candidate path's token at depth k, through head k-1 (needs next_token)

    def __post_init__(self) -> None:
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if self.draft_vocab and (self.projection != "shared" or not 0 < self.draft_vocab <= self.vocab_size):
            raise ValueError(f"draft_vocab needs projection='shared' and 0 < draft_vocab <= vocab_size "
                             f"({self.vocab_size}), got {self.draft_vocab} with projection={self.projection!r}")
        if self.chained and not self.next_token:
            raise ValueError("chained heads read the tokens of the path they extend: they need next_token=True")

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W and b start at zero so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(DraftVocabulary):
    """K Medusa heads over the base model's last hidden state.

    `next_token` heads also read the token the base model chose at that position (the tree's root):
    head k adds a learned map (starting at zero) of that token's RMS-normalised lm_head row to the
    hidden state before its blocks, so that it guesses token t + k + 2 knowing token t + 1 (as
    Hydra's heads do for their first token).

    `chained` heads go further (Hydra's sequential heads): head k reads the output state of head
    k - 1 instead of the hidden state, plus the token the path holds at depth k (the root for head
    0, then the candidates of the heads before it), so each head guesses knowing the whole path it
    extends. In a tree, head k then runs once per depth-k node that has children. They train on
    the real tokens (teacher forcing): the only case that matters, since a guess counts only when
    the path before it was right. Head k-1's state enters head k without gradient, so each head's
    blocks learn their own target only (with the gradient flowing back, head 1 lost 0.04 top-1).

    `own` projection: each head has a vocabulary projection, initialised as a copy of lm_head.
    `shared` projection: every head reuses the base lm_head, which stays frozen and is not part of
    this module's parameters (nor of its saved weights). With a draft vocabulary, only the lm_head
    rows of `token_map` (saved with the heads) are used: logits index into token_map, and
    `propose` returns token ids.
    """

    def __init__(self, config: HeadsConfig, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        self.token_inputs = nn.ModuleList(_zero_linear(config.hidden_size) for _ in range(config.num_heads)) if (
            config.next_token) else None
        if config.projection == "own":
            self.projections = nn.ModuleList(_copy_linear(lm_head) for _ in range(config.num_heads))
        else:
            self.projections = None
        self.borrow_lm_head(lm_head, config.draft_vocab)
        self.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    def states(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None,
               num_heads: int | None = None) -> torch.Tensor:
        """Each head's state before the vocabulary projection: (K, *hidden.shape[:-1], H).

        tokens (next_token heads): the base model's next token at each position, (*hidden.shape[:-1],),
        or the path from it, (*hidden.shape[:-1], K): that token, then the K - 1 tokens after it,
        which chained heads need (the others read only the first).
        """
        count = self.config.num_heads if num_heads is None else num_heads
        chained = self.config.chained
        if self.token_inputs is not None and tokens is None:
            raise ValueError("these heads read the base model's next token: pass tokens")
        path = tokens is not None and tokens.dim() == hidden.dim()
        if chained and not (path and tokens.shape[-1] >= count):
            raise ValueError(f"chained heads read the path's tokens: pass tokens of shape (..., {count})")
        x = hidden.to(self._dtype)
        shared = None if tokens is None or chained else self._token_features(tokens[..., 0] if path else tokens)
        out: list[torch.Tensor] = []
        for k in range(count):
            if chained:
                out.append(self._advance(out[-1].detach() if out else x, k, self._token_features(tokens[..., k])))
            else:
                out.append(self._advance(x, k, shared))
        return torch.stack(out)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the first num_heads heads (default all): (K, *hidden.shape[:-1], vocab or draft_vocab);
        tokens as for `states`."""
        states = self.states(hidden, tokens, num_heads)
        if self.projections is None:  # one vocabulary matmul for all heads
            return self.project(states)
        return torch.stack([self.project(x, k) for k, x in enumerate(states)])

    def propose(self, hidden: torch.Tensor, topk: int, num_heads: int | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids of each head's top-k guesses, best first: (K, *hidden.shape[:-1], topk)."""
        return self.token_ids(self(hidden, num_heads, tokens).topk(topk, dim=-1).indices)

    def draft(self, hidden: torch.Tensor, root: torch.Tensor, levels: list[Level], topk: int) -> torch.Tensor:
        """Candidate tokens of a tree's head nodes, (B, nodes - 1), for rows whose last accepted
        hidden state is hidden (B, H) and whose next token (the tree's root) is root (B,)."""
        if (self.config.chained and speed.native_draft(hidden, (torch.float32, torch.bfloat16))
                and self._dtype == self.base_lm_head.weight.dtype):
            return self._native_draft(hidden, root, levels, topk)
        tokens = root.new_empty(root.shape[0], 1 + sum(len(level.children) for level in levels))
        tokens[:, 0] = root
        if not self.config.chained:  # all nodes of a depth take from one top-k list
            top = self.propose(hidden, topk, len(levels), root)  # (D, B, topk)
            for k, level in enumerate(levels):
                tokens[:, level.children] = top[k][:, level.ranks]
            return tokens[:, 1:]
        state = hidden[:, None].to(self._dtype)  # (B, 1 or the previous depth's sources, H)
        for k, level in enumerate(levels):
            state = self._advance(state[:, level.parents], k, self._token_features(tokens[:, level.sources]))
            top = self.token_ids(self.project(state, k).topk(topk, dim=-1).indices)  # (B, sources, topk)
            tokens[:, level.children] = top[:, level.source_of_child, level.ranks]
        return tokens[:, 1:]

    def _native_draft(self, hidden: torch.Tensor, root: torch.Tensor, levels: list[Level], topk: int) -> torch.Tensor:
        """`draft` of chained heads as one C++ call (`csrc/draft_heads.cpp`): the same operations, the products by
        the stream kernel, the draft vocabulary's projection over `speed.draft_weight`; bfloat16 heads in float32
        over their bfloat16 weights."""
        params: list[torch.Tensor] = []
        for k in range(len(levels)):
            params.append(self.token_inputs[k].weight)
            for block in self.blocks[k]:
                params += [block.linear.weight, block.linear.bias]
            if self.projections is not None:
                weight, bias = self.projections[k].weight, self.projections[k].bias
            else:
                weight, bias = self.shared_projection()
                weight = weight if self.token_map is None else speed.draft_weight(weight)
            params += [weight, _NONE if bias is None else bias]
        parts = [t for level in levels for t in (level.sources, level.parents, level.children, level.source_of_child,
                                                 level.ranks)]
        eps = torch.finfo(torch.float32).eps  # rms_norm's for float32 and bfloat16 rows alike (it sums in float32)
        return kernels.load().chained_draft(hidden.float(), root, self.base_lm_head.weight, eps, params,
                                            self.config.num_layers, parts, topk, self.token_map)

    def _token_features(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The RMS-normalised lm_head rows of these tokens, for next_token heads (else None)."""
        if self.token_inputs is None:
            return None
        rows = self.base_lm_head.weight[tokens.to(self.base_lm_head.weight.device)].to(self._dtype)
        return nn.functional.rms_norm(rows, rows.shape[-1:])

    def _advance(self, state: torch.Tensor, k: int, features: torch.Tensor | None) -> torch.Tensor:
        """Head k's blocks over a state (the hidden state, or head k-1's for chained heads) plus its token map."""
        if features is not None:
            state = state + self.token_inputs[k](features)
        return self.blocks[k](state)

    def project(self, states: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Vocabulary (or draft vocabulary) logits of head states; k: whose projection, for own projections."""
        if self.projections is not None:
            return self.projections[k](states)
        return self.shared_logits(states)

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.parameters(), self.base_lm_head.weight).dtype


def path_tokens(ids: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """ids[s], ids[s + 1], ..., ids[s + length - 1] for each start s (clamped at the end of ids):
    (len(starts), length), the path the heads read at a position whose next token is ids[s]."""
    ahead = torch.arange(length, device=starts.device)
    return ids[(starts[:, None] + ahead).clamp(max=ids.numel() - 1)]


def _zero_linear(size: int) -> nn.Linear:
    layer = nn.Linear(size, size, bias=False)
    nn.init.zeros_(layer.weight)
    return layer


def _copy_linear(lm_head: nn.Module) -> nn.Linear:
    """A fresh Linear holding an exact copy of lm_head's weights (never tied to them)."""
    weight = lm_head.weight.detach()
    bias = getattr(lm_head, "bias", None)
    proj = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        proj.weight.copy_(weight)
        if bias is not None:
            proj.bias.copy_(bias.detach())
    return proj
