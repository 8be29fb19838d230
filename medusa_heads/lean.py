"""The base's decoder as a few functions per layer rather than transformers' modules, for the Llama family
(Llama, Mistral, Qwen2, Qwen3: RMS norms, rotary embeddings, a gated SiLU MLP) on a CPU.

A decoding pass of a small model spends about as long in its layers' small operations (norms, rotary
embeddings, cache writes, the activation: 5-20 torch operations each, and the modules' Python around them) as
in its matrix products. Here each of those is one call: a fused C++ operation where the kernels are built
(float32; `medusa_heads.kernels`), else transformers' own operations in the same order. The linear layers and
the attention are the model's own modules and torch's sdpa, so the kernel routes of `medusa_heads.speed` apply.
On a 2-core AMD EPYC, SmolLM2-135M's plain step takes 37.5 ms instead of 48.4, a 15-token tree step 46.7
instead of 60.1. Hidden states equal transformers' up to the fused operations' rounding. Set
MEDUSA_HEADS_LEAN_DECODER=0 to run transformers' modules.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F

from . import kernels
from .cache import TreeCache

ENABLED = os.environ.get("MEDUSA_HEADS_LEAN_DECODER", "1") != "0"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def supports(base: nn.Module) -> bool:
    """Whether the lean decoder runs this model: a Llama-family model with sdpa attention and SiLU, on a CPU."""
    config = base.config
    return (ENABLED and config.model_type in FAMILIES and config.hidden_act == "silu" and base.device.type == "cpu"
            and config._attn_implementation == "sdpa")


def forward(body: nn.Module, ids: torch.Tensor, mask: torch.Tensor | dict[str, torch.Tensor],
            positions: torch.Tensor, cache: TreeCache) -> torch.Tensor:
    """body's last hidden states (B, n, H) for ids (B, n) at positions, writing their keys and values into the
    cache as `cache.prepare` set; mask: `adapter.attention_mask`'s, one per layer type or one for all."""
    hidden = body.embed_tokens(ids)
    cos, sin = body.rotary_emb(hidden, position_ids=positions)
    layer_types = getattr(body.config, "layer_types", None)
    delta = None  # the last layer's MLP output, added to hidden by the next norm
    for i, layer in enumerate(body.layers):
        attention, mlp = layer.self_attn, layer.mlp
        x = rms_norm(hidden, layer.input_layernorm, delta)
        query, key = attention.q_proj(x), attention.k_proj(x)
        if hasattr(attention, "q_norm"):  # Qwen3: a norm per head before the rotary embedding
            query = attention.q_norm(query.unflatten(-1, (-1, attention.head_dim))).flatten(-2)
            key = attention.k_norm(key.unflatten(-1, (-1, attention.head_dim))).flatten(-2)
        query, keys, values = rotary_write(query, key, attention.v_proj(x), cos, sin, cache, i)
        layer_mask = mask[layer_types[i]] if isinstance(mask, dict) else mask
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=layer_mask, scale=attention.scaling,
                                             enable_gqa=True)
        out = attention.o_proj(out.transpose(1, 2).flatten(-2))
        x = rms_norm(hidden, layer.post_attention_layernorm, out)
        delta = mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    return rms_norm(hidden, body.norm, delta)


def _fused(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and kernels.load() is not None


def rms_norm(hidden: torch.Tensor, norm: nn.Module, delta: torch.Tensor | None = None) -> torch.Tensor:
    """hidden += delta (in place: the residual stream), then the norm of hidden."""
    if _fused(hidden, norm.weight) and hidden.is_contiguous() and (delta is None or delta.is_contiguous()):
        return kernels.load().rms_norm(hidden, norm.weight, norm.variance_epsilon, delta)
    if delta is not None:
        hidden += delta
    return norm(hidden)


def rotary_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: TreeCache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys (B, n, heads * D) rotated by cos / sin (B, n, D); the keys and values (B, n, kv_heads * D)
    written into the cache's layer; the queries (B, heads, n, D) with the keys and values the pass attends to."""
    head_dim = cos.shape[-1]
    if cache.keys is None:  # the first pass: the cache takes its shapes from the keys and values
        cache.allocate(*(t.unflatten(-1, (-1, head_dim)).transpose(1, 2) for t in (key, value)))
    if _fused(query, key, value, cos, cache.keys):
        rows, slots = cache.write_index
        query = kernels.load().rotary_write(query, key, value, cos, sin, cache.keys[layer], cache.values[layer],
                                       rows[:, 0], slots)
        return query, *cache.read(layer)
    query, key, value = (t.unflatten(-1, (-1, head_dim)).transpose(1, 2) for t in (query, key, value))
    cos, sin = cos[:, None], sin[:, None]
    query, key = query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
    return query, *cache.update(key, value, layer)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    if _fused(gate, up) and gate.dim() == 3:
        return kernels.load().silu_mul(gate, up)
    return F.silu(gate) * up
