"""Everything that differs between Hugging Face architectures, in one place.

The engine never touches modeling code: it calls the model's own decoder with a 4D attention mask,
explicit position ids and our cache. What varies by family is where the decoder and lm_head live,
whether logits are soft-capped (Gemma 2), and whether some layers use a sliding window (Mistral,
Qwen2/3, Gemma 2/3), which gets its own mask.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

SUPPORTED_ATTENTION = ("sdpa", "eager")


def check_supported(base: PreTrainedModel) -> None:
    """Raise with a way out when the engine cannot run this model."""
    config = base.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(base).__name__} is an encoder-decoder model; Medusa needs a decoder-only causal LM")
    if base.get_output_embeddings() is None:
        raise ValueError(f"{type(base).__name__} has no lm_head: load it with AutoModelForCausalLM")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"{type(base).__name__} has {sorted(layer_types)} layers; tree verification needs attention "
            "layers only (recurrent or linear-attention state cannot be rolled back per branch)"
        )
    impl = config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {impl!r} cannot take a tree mask: load the model with "
            "attn_implementation='sdpa' (or 'eager')"
        )


def decoder(base: PreTrainedModel) -> nn.Module:
    """The transformer body that returns last hidden states (LlamaModel, GPT2Model, ...)."""
    return base.base_model


def lm_head(base: PreTrainedModel) -> nn.Linear:
    return base.get_output_embeddings()


def logits(base: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The base model's logits from its last hidden states, as its own forward computes them."""
    out = lm_head(base)(hidden)
    cap = getattr(base.config, "final_logit_softcapping", None)
    if cap:
        out = torch.tanh(out / cap) * cap
    return out


def attention_mask(
    config, allowed: torch.Tensor, query_positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Turn allowed (B, 1, q, kv) into the additive mask(s) the model's attention layers expect.

    Slot i of the cache holds position i for committed tokens; tree tokens sit just past them and
    only see ancestors within a few positions, so one slot-distance test applies the window.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = set(getattr(config, "layer_types", None) or ())
    full = _additive(allowed, dtype)
    if not window or (layer_types and "sliding_attention" not in layer_types):
        return full
    slots = torch.arange(allowed.shape[-1], device=allowed.device)
    near = (query_positions[:, None, :, None] - slots) < window  # (B, 1, q, kv)
    sliding = _additive(allowed & near, dtype)
    if not layer_types:  # one window for every layer (Mistral, Phi-3)
        return sliding
    return {"full_attention": full, "sliding_attention": sliding}


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
