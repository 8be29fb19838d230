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

    def __post_init__(self) -> None:
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")

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

    `own` projection: each head has a vocabulary projection, initialised as a copy of lm_head.
    `shared` projection: every head reuses the base lm_head, which stays frozen and is not part of
    this module's parameters (nor of its saved weights).
    """

    def __init__(self, config: HeadsConfig, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        if config.projection == "own":
            self.projections = nn.ModuleList(_copy_linear(lm_head) for _ in range(config.num_heads))
        else:
            self.projections = None
        self.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        # Held outside the module tree: the base model owns it, we only borrow it.
        object.__setattr__(self, "base_lm_head", lm_head)

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head k (0-based): (*hidden.shape[:-1], vocab)."""
        state = self.blocks[k](hidden.to(self._dtype))
        if self.projections is None:
            return self.base_lm_head(state.to(self.base_lm_head.weight.dtype))
        return self.projections[k](state)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first num_heads heads (default all): (K, *hidden.shape[:-1], vocab)."""
        count = self.config.num_heads if num_heads is None else num_heads
        if self.projections is None:  # one vocabulary matmul for all heads
            states = torch.stack([self.blocks[k](hidden.to(self._dtype)) for k in range(count)])
            return self.base_lm_head(states.to(self.base_lm_head.weight.dtype))
        return torch.stack([self.head_logits(hidden, k) for k in range(count)])

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.parameters(), self.base_lm_head.weight).dtype


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
