"""Speed levers of the decoding loop that leave its outputs exact; each can be switched off.

Skinny matmuls: a decoding step runs every linear layer over a few rows (1 to ~64 tree tokens per
sequence). On a CPU, F.linear over 2-16 rows takes MKL's general kernel, which is 2-4x slower than
the same product written as W @ x^T (2-core AVX2 machine: lm_head of SmolLM2-135M over 2 rows
18.8 -> 4.9 ms, over 16 rows 20.3 -> 14.6 ms). One row is a gemv, which MKL runs on one thread, and
some widths take slower kernels: 1 and 3 rows are padded to 2 and 4, above 8 rows to the next
multiple of 8 (2-core AMD EPYC, SmolLM2-135M's linear layers with cold caches, as in decoding:
1 row 47 -> 24 ms, 3 rows 32 -> 29 ms, 13 rows 97 -> 62 ms, 25 rows 101 -> 89 ms). The decoder's
linear layers and the heads' draft projection take that route during a decoding step only
(transformers' own generate is untouched), in float32 only: bfloat16's F.linear (oneDNN) is already
fast and flat there (1 row 20.6 ms, 16 rows 25.5 ms, W @ x^T 22.4 and 29.2 ms). Set
MEDUSA_HEADS_SKINNY_MATMUL=0 to turn it off.

Compiled decoding passes (opt-in: `MedusaModel.compile_decoding()`, `--compile`): the decoder's
verification passes run through torch.compile, which fuses the many small operations around the
matrix products (norms, rotary embeddings, residuals, cache writes) that eager mode runs one by one.
Shapes are dynamic (batch, tree size and cache length change between passes), so it compiles once
for one-token passes and once for tree passes (and again for batch 1 vs more); the first compile
takes minutes on a small CPU, later processes reuse inductor's on-disk cache (faster, not instant).
Prefill stays eager.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

SKINNY_ROWS = 64  # up to this many rows, W @ x^T beats F.linear on the CPUs measured
ENABLED = os.environ.get("MEDUSA_HEADS_SKINNY_MATMUL", "1") != "0"
_in_step = ContextVar("medusa_heads_decoding_step", default=False)


def padded_rows(rows: int) -> int:
    """How many rows to multiply for `rows`: 1 and 3 rows as 2 and 4 (MKL runs a one-row product, a
    gemv, on one thread; 3 is slower than 4), more than 8 up to a multiple of 8 (faster kernels)."""
    if rows <= 4:
        return rows + rows % 2
    return rows if rows <= 8 else -(-rows // 8) * 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the skinny route on a CPU within a decoding step."""
    rows = x.numel() // max(1, x.shape[-1])
    # a compiled graph only ever runs inside decoding steps (and the context variable cannot be traced)
    compiling = torch.compiler.is_compiling()
    skinny = x.device.type == "cpu" and weight.dtype == torch.float32 and 0 < rows <= SKINNY_ROWS
    if ENABLED and skinny and (compiling or _in_step.get()):
        # one compiled graph serves every tree size: padding that depends on the size would recompile
        padded = padded_rows(rows) if rows == 1 or not compiling else rows
        # row-major in and out: x^T's fast layout for MKL, and what later kernels expect (flash
        # attention wants the queries' last dimension contiguous, else it falls back to the math path)
        flat = x.reshape(rows, x.shape[-1])
        if padded > rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        flat = flat.contiguous()
        out = (weight @ flat.T)[:, :rows].T.contiguous().reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def _module_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


def install(model: nn.Module) -> None:
    """Give the model's CPU float linear layers the skinny route (idempotent; no-op when switched off)."""
    if not ENABLED:
        return
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and "forward" not in vars(module):
            module.forward = partial(_module_linear, module)


@contextmanager
def decoding_step():
    """Within this context, installed linear layers over a few rows use W @ x^T."""
    token = _in_step.set(True)
    try:
        yield
    finally:
        _in_step.reset(token)


def compiled_decoder(body: nn.Module):
    """body's forward (the decoder that returns last hidden states) through torch.compile, with dynamic shapes."""
    return torch.compile(body.forward, dynamic=True)
