"""Tiny random models of every supported family, built from configs (no downloads)."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

DEVICE = os.environ.get("MEDUSA_TEST_DEVICE", "cpu")  # scripts/gpu_check.sh runs some tests with "cuda"

VOCAB = 16  # small, so that random heads often guess right and trees get exercised

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", **COMMON),
    "mistral": dict(model_type="mistral", sliding_window=6, **COMMON),
    "qwen2": dict(model_type="qwen2", **COMMON),
    "qwen3": dict(model_type="qwen3", head_dim=8, **COMMON),
    "gemma2": dict(model_type="gemma2", head_dim=8, sliding_window=6, final_logit_softcapping=5.0,
                   attn_logit_softcapping=None, query_pre_attn_scalar=8, **COMMON),
    "gemma3": dict(model_type="gemma3_text", head_dim=8, sliding_window=6, query_pre_attn_scalar=8,
                   layer_types=["sliding_attention", "full_attention"], **COMMON),
    "phi3": dict(model_type="phi3", **COMMON),
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt_neox": dict(model_type="gpt_neox", **{k: v for k, v in COMMON.items() if k != "num_key_value_heads"}),
}
ARCHS = sorted(CONFIGS)


def tiny_model(arch: str, tied: bool = False, seed: int = 0, dtype: torch.dtype = torch.float64):
    """A random model of the given family; float64 so that argmax never flips on rounding."""
    spec = dict(CONFIGS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, tie_word_embeddings=tied)
    attention = "eager" if arch == "gemma2" else "sdpa"  # Gemma 2 has no sdpa path in transformers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.to(DEVICE, dtype).eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def tiny_tokenizer():
    """A real fast tokenizer over the tiny vocabulary, with a chat template: <pad>, <s>, </s>, the
    three roles, then the letters a..j."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "user", "assistant", "system"] + [chr(ord("a") + i) for i in range(VOCAB - 6)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
