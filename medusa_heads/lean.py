"""The base's decoder as a few functions per layer rather than transformers' modules, for the Llama family
(Llama, Mistral, Qwen2, Qwen3: RMS norms, rotary embeddings, a gated SiLU MLP) on a CPU.

A decoding pass of a small model spends about as long in its layers' small operations (norms, rotary embeddings,
cache writes, the activation: 5-20 torch operations each, and the modules' Python around them) as in its matrix
products. Where the C++ kernels are built (`medusa_heads.kernels`), a pass (float32 or bfloat16) is one call that
runs every layer with those operations fused; else the layers run here with transformers' own operations, in the
same order. The products take the kernel routes of `medusa_heads.speed`; the attention is torch's sdpa, or in the
C++ call for passes of up to 64 tokens its own (`csrc/attention.cpp`). On a 2-core AMD EPYC, SmolLM2-135M's plain
step took 37.5 ms instead of 48.4 (fused operations called from Python), a 15-token tree step 46.7 instead of
60.1. A float32 model's hidden states equal transformers' up to the fused operations' rounding (a bfloat16 model's
C++ pass runs in float32: see `Native`). Set MEDUSA_HEADS_LEAN_DECODER=0 to run transformers' modules.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from . import kernels, speed

if TYPE_CHECKING:
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
    the step directly (through the modules they cost ~7 ms a step more on SmolLM2-135M). Where the kernels are
    built, the whole pass (float32 or bfloat16) is one C++ call (`csrc/decoder_layers.cpp`; the loop over layers in
    Python costs ~1.5 ms a step more on SmolLM2-135M); else the layers run here, with transformers' own operations.
    Made per `Decoder`: a change to the weights after it is not seen."""

    def __init__(self, body: nn.Module):
        self.body = body
        self.layer_types = getattr(body.config, "layer_types", None)
        self.layers = [(layer.input_layernorm, layer.self_attn, Products(layer.self_attn, "q_proj", "k_proj", "v_proj"),
                        Products(layer.self_attn, "o_proj"), layer.post_attention_layernorm,
                        Products(layer.mlp, "gate_proj", "up_proj"), Products(layer.mlp, "down_proj"))
                       for layer in body.layers]
        self.elements = sum(weight.numel() for _, _, qkv, o, _, gate_up, down in self.layers
                            for group in (qkv, o, gate_up, down) for weight, _ in group.weights)  # of the products
        self.routed = all(type(module) is speed.RoutedLinear for module in body.layers.modules()
                          if isinstance(module, nn.Linear))
        self.native = Native(self) if Native.runs(self) else None

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | dict[str, torch.Tensor], positions: torch.Tensor,
                cache: TreeCache) -> torch.Tensor:
        """The last hidden states (B, n, H) for ids (B, n) at positions, writing their keys and values into the
        cache as `cache.prepare` set; mask: `adapter.attention_mask`'s, one per layer type or one for all."""
        hidden = self.body.embed_tokens(ids)
        dtype = hidden.dtype
        route = speed.step_route(ids.numel(), dtype, self.elements) if self.routed else "aten"
        if self.native:  # in float32, a bfloat16 model's pass too (its additive masks as well)
            hidden = hidden.float()
            mask = {kind: m.float() for kind, m in mask.items()} if isinstance(mask, dict) else mask.float()
        cos, sin = self.body.rotary_emb(hidden, position_ids=positions)
        masks = [mask[kind] for kind in self.layer_types] if isinstance(mask, dict) else [mask] * len(self.layers)
        if self.native:
            return self.native.forward(hidden, cos, sin, route, masks, cache).to(dtype)
        linear, delta = speed.ROUTES[route], None  # delta: the last layer's MLP output, added by the next norm
        layers = zip(self.layers, masks, strict=True)
        for i, ((norm, attention, qkv, o, post_norm, gate_up, down), layer_mask) in enumerate(layers):
            x = _rms_norm(hidden, norm, delta)
            query, key, value = qkv(x, linear)
            if hasattr(attention, "q_norm"):  # Qwen3: a norm per head before the rotary embedding
                query = attention.q_norm(query.unflatten(-1, (-1, attention.head_dim))).flatten(-2)
                key = attention.k_norm(key.unflatten(-1, (-1, attention.head_dim))).flatten(-2)
            query, keys, values = _rotary_write(query, key, value, cos, sin, cache, i)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=layer_mask, scale=attention.scaling,
                                                 enable_gqa=True)
            (out,) = o(out.transpose(1, 2).flatten(-2), linear)
            x = _rms_norm(hidden, post_norm, out)
            gate, up = gate_up(x, linear)
            (delta,) = down(F.silu(gate) * up, linear)
        return _rms_norm(hidden, self.body.norm, delta)


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


def _rms_norm(hidden: torch.Tensor, norm: nn.Module, delta: torch.Tensor | None) -> torch.Tensor:
    """hidden += delta (in place: the residual stream), then the norm of hidden."""
    if delta is not None:
        hidden += delta
    return norm(hidden)


def _rotary_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: TreeCache, layer: int) -> Attended:
    """Queries and keys (B, n, heads * D) rotated by cos / sin (B, n, D); the keys and values (B, n, kv_heads * D)
    written into the cache's layer; the queries (B, heads, n, D) with the keys and values the pass attends to."""
    query, key, value = (t.unflatten(-1, (-1, cos.shape[-1])).transpose(1, 2) for t in (query, key, value))
    cos, sin = cos[:, None], sin[:, None]
    query, key = query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
    return query, *cache.update(key, value, layer)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Native:
    """A plan's pass as one call of the C++ kernels' `decoder_layers` (on a CPU, where they are built):
    the same operations in the same order, the small ones fused (`csrc/decoder_ops.cpp`). A bfloat16 model's pass
    runs in float32 too (its residual stream, norms, rotary embeddings, attention and cache), over its products'
    bfloat16 weights: on a 2-core Zen 4 its small operations through torch took 12 of a 21 ms plain step."""

    # csrc/decoder_layers.cpp's numbers of the step routes, and of a draft's products (`eagle.DraftLayer`)
    ROUTES: ClassVar[dict[str, int]] = {"aten": 0, "stream": 1, "packed": 2, "draft": 3, "columns": 4}

    @staticmethod
    def runs(plan: Plan) -> bool:
        """Whether this plan's model can: float32 or bfloat16 on a CPU with the kernels built, every norm with one
        epsilon, every layer's products fused alike."""
        weight = plan.body.embed_tokens.weight
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" or kernels.load() is None:
            return False
        norms = [m for m in plan.body.modules() if hasattr(m, "variance_epsilon")]
        fused = {(qkv.sizes is not None, gate_up.sizes is not None) for _, _, qkv, _, _, gate_up, _ in plan.layers}
        return len({m.variance_epsilon for m in norms}) == 1 and len(fused) == 1

    def __init__(self, plan: Plan):
        self.kernels = kernels.load()
        first = plan.layers[0]
        self.eps = first[0].variance_epsilon
        self.scaling, self.head_dim = first[1].scaling, first[1].head_dim
        self.kv_heads = plan.body.config.num_key_value_heads
        self.qkv_fused, self.gate_up_fused = first[2].sizes is not None, first[5].sizes is not None
        self.qkv_sizes = [getattr(first[1], n).out_features for n in ("q_proj", "k_proj", "v_proj")]
        self.gate_up_sizes = [getattr(plan.body.layers[0].mlp, n).out_features for n in ("gate_proj", "up_proj")]
        self.final_norm = plan.body.norm.weight.float()  # norms and biases in float32 (a bfloat16 model's: copies)
        none = torch.empty(0)  # what the C++ call takes for a norm or a bias the model does not have

        def products(group: Products) -> list[tuple[torch.Tensor, bool]]:
            return [entry for w, b in group.weights for entry in ((w, True), (none if b is None else b.float(), False))]

        self.entries: list[tuple[torch.Tensor, bool]] = []  # (tensor, whether it is a product's weight) in order
        for norm, attention, qkv, o, post_norm, gate_up, down in plan.layers:
            q_norm, k_norm = (getattr(attention, name, None) for name in ("q_norm", "k_norm"))
            self.entries += [(norm.weight.float(), False), (none if q_norm is None else q_norm.weight.float(), False),
                             (none if k_norm is None else k_norm.weight.float(), False)]
            self.entries += products(qkv) + products(o) + [(post_norm.weight.float(), False)]
            self.entries += products(gate_up) + products(down)
        self.params: dict[str, list[torch.Tensor]] = {}  # per route: the tensors it takes (copies of the weights
        # for "packed" and "columns")

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, route: str,
                masks: list[torch.Tensor | None], cache: TreeCache) -> torch.Tensor:
        params = self.params.get(route)
        if params is None:
            copy = {"packed": speed.packed, "columns": speed.columns}.get(route)
            params = self.params[route] = [copy(t) if copy and weight else t for t, weight in self.entries]
        return self.kernels.decoder_layers(
            hidden, params, self.qkv_fused, self.qkv_sizes, self.gate_up_fused, self.gate_up_sizes, self.final_norm,
            self.eps, self.ROUTES[route], cos, sin, *cache.for_kernels(hidden, self.kv_heads, self.head_dim), masks,
            self.scaling)
