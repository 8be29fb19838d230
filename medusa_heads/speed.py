"""Speed levers of the decoding loop that leave its outputs exact; each can be switched off.

Packed weights: a decoding step runs every linear layer over a few rows (1 to ~64 tree tokens per
sequence). On a CPU, F.linear takes MKL's sgemm, which is slow over few rows and grows fast with
them; oneDNN's linear over a weight reordered once into its blocked layout is nearly flat (2-core
AMD EPYC, SmolLM2-135M's 210 linear layers with cold caches, as in decoding: 1 row 41 -> 21 ms,
8 rows 65 -> 24 ms, 16 rows 76 -> 27 ms, 64 rows 160 -> 56 ms). During a decoding step (transformers'
own generate is untouched) the decoder's float32 linear layers and the heads' draft projection run
that way on a CPU. Each packed weight is a second copy of the weight, made at its first use and
remade when the weight changes; a model whose copies would not fit in half the free memory decodes
without them. Set MEDUSA_HEADS_PACKED_WEIGHTS=0 to turn it off.

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
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.weak import WeakIdKeyDictionary

ENABLED = os.environ.get("MEDUSA_HEADS_PACKED_WEIGHTS", "1") != "0" and torch.backends.mkldnn.is_available()
_in_step = ContextVar("medusa_heads_decoding_step", default=False)
_packed = WeakIdKeyDictionary()  # weight -> (its version when packed, its packed copy)
_PACKED_FOR_ROWS = 16  # the row count oneDNN picks the packed layout for


def packed(weight: torch.Tensor) -> torch.Tensor:
    """weight in oneDNN's blocked layout for linear products, packed once per version of the weight."""
    version = (weight.data_ptr(), weight._version)
    entry = _packed.get(weight)
    if entry is None or entry[0] != version:
        entry = _packed[weight] = version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKED_FOR_ROWS)
    return entry[1]


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear over weight's packed copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "none", [], "")


# the same, as one opaque operation to torch.compile (its dispatch costs ~10 us a call: eager calls the function)
_packed_linear_op = torch.library.custom_op("medusa_heads::packed_linear", _packed_linear, mutates_args=())


@_packed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, over the packed weight on a CPU within a decoding step (a compiled graph only runs in one)."""
    compiling = torch.compiler.is_compiling()  # the context variable cannot be traced
    cpu_float = x.device.type == "cpu" and weight.dtype == torch.float32 == x.dtype
    if ENABLED and cpu_float and (compiling or _in_step.get()):
        return (_packed_linear_op if compiling else _packed_linear)(x, weight, bias)
    return F.linear(x, weight, bias)


def _module_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


def _free_memory() -> float:
    """Bytes of free physical memory (infinite where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return float("inf")


def install(model: nn.Module) -> None:
    """Give the model's CPU linear layers the packed route, if their packed copies fit in half the free
    memory (idempotent; no-op when switched off)."""
    if not ENABLED:
        return
    layers = [module for module in model.modules()
              if type(module) is nn.Linear and module.weight.device.type == "cpu" and "forward" not in vars(module)]
    needed = sum(layer.weight.nbytes for layer in layers if layer.weight.dtype == torch.float32)
    if needed > _free_memory() / 2:
        warnings.warn(f"packed weights would take {needed / 2**30:.1f} GiB, more than half the free memory: "
                      "decoding without them (slower on a CPU)", stacklevel=2)
        return
    for layer in layers:
        layer.forward = partial(_module_linear, layer)


@contextmanager
def decoding_step():
    """Within this context, installed linear layers use packed weights."""
    token = _in_step.set(True)
    try:
        yield
    finally:
        _in_step.reset(token)


def compiled_decoder(body: nn.Module):
    """body's forward (the decoder that returns last hidden states) through torch.compile, with dynamic shapes."""
    return torch.compile(body.forward, dynamic=True)
