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

from . import kernels, speed
from .cache import TreeCache

ENABLED = os.environ.get("MEDUSA_HEADS_LEAN_DECODER", "1") != "0"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
Attended = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # queries, keys, values of an attention


def supports(base: nn.Module) -> bool:
    """Whether the lean decoder runs this model: a Llama-family model with sdpa attention and SiLU, on a CPU."""
    config = base.config
    return (ENABLED and config.model_type in FAMILIES and config.hidden_act == "silu" and base.device.type == "cpu"
            and config._attn_implementation == "sdpa")


class Plan:
    """A model's decoder as the lean functions read it: per layer its norms, its attention and the weights of its
    products, the fused ones (`speed.Siblings`: q/k/v, gate/up) as one. Its products call the kernel route of
    the step directly (through the modules they cost ~7 ms a step more on SmolLM2-135M). Made per `Decoder`: a
    change to the weights after it is not seen."""

    def __init__(self, body: nn.Module):
        self.body = body
        self.layer_types = getattr(body.config, "layer_types", None)
        self.layers = [(layer.input_layernorm, layer.self_attn, Products(layer.self_attn, "q_proj", "k_proj", "v_proj"),
                        Products(layer.self_attn, "o_proj"), layer.post_attention_layernorm,
                        Products(layer.mlp, "gate_proj", "up_proj"), Products(layer.mlp, "down_proj"))
                       for layer in body.layers]
        weight = body.embed_tokens.weight
        fused = weight.dtype == torch.float32 and weight.device.type == "cpu" and kernels.load() is not None
        self.ops = FusedOps(kernels.load()) if fused else TorchOps
        self.routed = all(type(module) is speed.RoutedLinear for module in body.layers.modules()
                          if isinstance(module, nn.Linear))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | dict[str, torch.Tensor], positions: torch.Tensor,
                cache: TreeCache) -> torch.Tensor:
        """The last hidden states (B, n, H) for ids (B, n) at positions, writing their keys and values into the
        cache as `cache.prepare` set; mask: `adapter.attention_mask`'s, one per layer type or one for all."""
        hidden = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(hidden, position_ids=positions)
        linear = speed.step_route(ids.numel(), hidden.dtype) if self.routed else F.linear
        ops, delta = self.ops, None  # delta: the last layer's MLP output, added to hidden by the next norm
        for i, (norm, attention, qkv, o, post_norm, gate_up, down) in enumerate(self.layers):
            x = ops.rms_norm(hidden, norm, delta)
            query, key, value = qkv(x, linear)
            if hasattr(attention, "q_norm"):  # Qwen3: a norm per head before the rotary embedding
                query = attention.q_norm(query.unflatten(-1, (-1, attention.head_dim))).flatten(-2)
                key = attention.k_norm(key.unflatten(-1, (-1, attention.head_dim))).flatten(-2)
            query, keys, values = ops.rotary_write(query, key, value, cos, sin, cache, i)
            layer_mask = mask[self.layer_types[i]] if isinstance(mask, dict) else mask
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=layer_mask, scale=attention.scaling,
                                                 enable_gqa=True)
            (out,) = o(out.transpose(1, 2).flatten(-2), linear)
            x = ops.rms_norm(hidden, post_norm, out)
            (delta,) = down(ops.silu_mul(*gate_up(x, linear)), linear)
        return ops.rms_norm(hidden, self.body.norm, delta)


class Products:
    """The products of a module's linear layers that read one input: one over their weights concatenated where
    `speed.install` fused them, else one each; called, their outputs in order."""

    def __init__(self, module: nn.Module, *names: str):
        layers = [getattr(module, name) for name in names]
        group = getattr(layers[0], "siblings", None)
        if len(layers) > 1 and speed.FUSED and group is not None and group.layers == layers:
            self.weights, self.sizes = [group.fused()], group.sizes
        else:
            self.weights, self.sizes = [(layer.weight, layer.bias) for layer in layers], None

    def __call__(self, x: torch.Tensor, linear) -> list[torch.Tensor]:
        if self.sizes is not None:
            return linear(x, *self.weights[0]).split(self.sizes, dim=-1)
        return [linear(x, weight, bias) for weight, bias in self.weights]


class TorchOps:
    """The small operations of a layer as transformers' modeling code runs them (any dtype and device)."""

    @staticmethod
    def rms_norm(hidden: torch.Tensor, norm: nn.Module, delta: torch.Tensor | None) -> torch.Tensor:
        """hidden += delta (in place: the residual stream), then the norm of hidden."""
        if delta is not None:
            hidden += delta
        return norm(hidden)

    @staticmethod
    def rotary_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache: TreeCache, layer: int) -> Attended:
        """Queries and keys (B, n, heads * D) rotated by cos / sin (B, n, D); the keys and values (B, n,
        kv_heads * D) written into the cache's layer; the queries (B, heads, n, D) with the keys and values the
        pass attends to."""
        query, key, value = (t.unflatten(-1, (-1, cos.shape[-1])).transpose(1, 2) for t in (query, key, value))
        cos, sin = cos[:, None], sin[:, None]
        query, key = query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
        return query, *cache.update(key, value, layer)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedOps:
    """The same, each one C++ operation (`csrc/decoder_ops.cpp`: float32 on a CPU, contiguous rows)."""

    def __init__(self, module):
        self.kernels = module

    def rms_norm(self, hidden: torch.Tensor, norm: nn.Module, delta: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon, delta)

    def rotary_write(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache: TreeCache, layer: int) -> Attended:
        if cache.keys is None:  # a first pass: the cache takes its shapes from the keys and values
            cache.allocate(*(t.unflatten(-1, (-1, cos.shape[-1])).transpose(1, 2) for t in (key, value)))
        rows, slots = cache.write_index
        query = self.kernels.rotary_write(query, key, value, cos, sin, cache.keys[layer], cache.values[layer],
                                          rows[:, 0], slots)
        return query, *cache.read(layer)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate, up)
