"""Medusa heads: K heads of L residual blocks each, then a projection to the vocabulary."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

PROJECTIONS = ("own", "shared")


@dataclass
class HeadsConfig:
    num_heads: int = 5  # K: head k guesses the token k+1 places after the base model's next token
    num_layers: int = 1  # L: residual blocks per head
    projection: str = "own"  # "own": a vocabulary projection per head; "shared": reuse the base lm_head
    hidden_size: int = 0  # width of the base model's last hidden state
    vocab_size: int = 0  # rows of the base model's lm_head
    draft_vocab: int = 0  # > 0: the heads propose only these tokens (`token_map`), a cheaper projection
    next_token: bool = False  # heads also read the base model's next token (the tree's root), known before they guess

    def __post_init__(self) -> None:
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if self.draft_vocab and (self.projection != "shared" or not 0 < self.draft_vocab <= self.vocab_size):
            raise ValueError(f"draft_vocab needs projection='shared' and 0 < draft_vocab <= vocab_size "
                             f"({self.vocab_size}), got {self.draft_vocab} with projection={self.projection!r}")

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


class MedusaHeads(nn.Module):
    """K Medusa heads over the base model's last hidden state.

    `next_token` heads also read the token the base model chose at that position (the tree's root):
    head k adds a learned map (starting at zero) of that token's RMS-normalised lm_head row to the
    hidden state before its blocks, so that it guesses token t + k + 2 knowing token t + 1 (as
    Hydra's heads do for their first token).

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
        # Held outside the module tree: the base model owns it, we only borrow it.
        object.__setattr__(self, "base_lm_head", lm_head)
        draft = torch.arange(config.draft_vocab) if config.draft_vocab else None
        self.register_buffer("token_map", draft)  # saved with the heads (None: the full vocabulary)
        self.register_buffer("draft_weight", None if draft is None else lm_head.weight.detach()[draft].clone(),
                             persistent=False)
        if draft is not None:
            self.register_load_state_dict_post_hook(lambda module, _: module.set_token_map(module.token_map))
        self.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    def set_token_map(self, token_ids: torch.Tensor) -> None:
        """Choose the draft vocabulary: the token ids the heads may propose (draft_vocab of them)."""
        if self.token_map is None or token_ids.shape != self.token_map.shape:
            raise ValueError(f"need {self.config.draft_vocab} token ids for this draft vocabulary")
        if token_ids.numel() and not 0 <= int(token_ids.min()) <= int(token_ids.max()) < self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}) for this vocabulary")
        with torch.no_grad():
            self.token_map.copy_(token_ids)
            self.draft_weight.copy_(self.base_lm_head.weight[self.token_map.to(self.base_lm_head.weight.device)])

    def head_logits(self, hidden: torch.Tensor, k: int, next_token: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of head k (0-based): (*hidden.shape[:-1], vocab or draft_vocab); `next_token`
        (hidden.shape[:-1]) is the base model's token at each position, for next_token heads."""
        return self._project(self._head_input(hidden, k, self._token_features(next_token)), k)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None,
                next_token: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the first num_heads heads (default all): (K, *hidden.shape[:-1], vocab or draft_vocab)."""
        count = self.config.num_heads if num_heads is None else num_heads
        features = self._token_features(next_token)  # once for all heads
        states = [self._head_input(hidden, k, features) for k in range(count)]
        if self.projections is None:  # one vocabulary matmul for all heads
            return self._project(torch.stack(states))
        return torch.stack([self._project(x, k) for k, x in enumerate(states)])

    def propose(self, hidden: torch.Tensor, topk: int, num_heads: int | None = None,
                next_token: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids of each head's top-k guesses, best first: (K, *hidden.shape[:-1], topk)."""
        top = self(hidden, num_heads, next_token).topk(topk, dim=-1).indices
        return top if self.token_map is None else self.token_map[top]

    def draft_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Where each token id sits in the heads' logits; -1 for tokens outside the draft vocabulary."""
        if self.token_map is None:
            return token_ids
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        lookup[self.token_map.to(token_ids.device)] = torch.arange(len(self.token_map), device=token_ids.device)
        return lookup[token_ids]

    def _token_features(self, next_token: torch.Tensor | None) -> torch.Tensor | None:
        """The RMS-normalised lm_head rows of the next tokens, for next_token heads (else None)."""
        if self.token_inputs is None:
            return None
        if next_token is None:
            raise ValueError("these heads read the base model's next token: pass next_token")
        rows = self.base_lm_head.weight[next_token.to(self.base_lm_head.weight.device)].to(self._dtype)
        return nn.functional.rms_norm(rows, rows.shape[-1:])

    def _head_input(self, hidden: torch.Tensor, k: int, features: torch.Tensor | None) -> torch.Tensor:
        x = hidden.to(self._dtype)
        if features is not None:
            x = x + self.token_inputs[k](features)
        return self.blocks[k](x)

    def _project(self, states: torch.Tensor, k: int | None = None) -> torch.Tensor:
        if self.projections is not None:
            return self.projections[k](states)
        if self.token_map is None:
            return self.base_lm_head(states.to(self.base_lm_head.weight.dtype))
        bias = getattr(self.base_lm_head, "bias", None)
        bias = None if bias is None else bias[self.token_map].to(self.draft_weight.dtype)
        return nn.functional.linear(states.to(self.draft_weight.dtype), self.draft_weight, bias)

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.parameters(), self.base_lm_head.weight).dtype


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
