"""The lean decoder (`medusa_heads.lean`) computes what transformers' modules compute, for the families it runs,
and leaves the others to them. Float64 here: transformers' own operations (the fused C++ ones: test_kernels.py)."""

import pytest
import torch
from tiny import tiny_model

from medusa_heads import adapter, lean
from medusa_heads.cache import TreeCache

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def passes(base, run, steps=((7, None), (3, [[1, 0, 0], [1, 1, 0], [1, 0, 1]]))):
    """Hidden states of a prefill then a 3-token tree pass (run: body, ids, mask, positions, cache -> hidden),
    with the cache they leave."""
    generator = torch.Generator().manual_seed(0)
    cache = TreeCache(base.config.num_hidden_layers, 2, 16, base.device)
    outputs = []
    for n, tree in steps:
        start = int(cache.lengths.max())
        ids = torch.randint(3, 16, (2, n), generator=generator)
        visible = start + n
        tree_part = torch.tensor(tree, dtype=torch.bool) if tree else torch.ones(n, n, dtype=torch.bool).tril()
        allowed = torch.cat([torch.ones(n, start, dtype=torch.bool), tree_part], 1).expand(2, n, visible)
        depths = tree_part.sum(1) - 1
        positions = start + depths.expand(2, n)
        cache.prepare(n, visible)
        mask = adapter.attention_mask(base.config, allowed[:, None], positions, base.dtype)
        with torch.inference_mode():
            outputs.append(run(adapter.decoder(base), ids, mask, positions, cache))
        cache.commit(torch.full((2,), n if tree is None else 1))
    return outputs, cache


def lean_forward(body, ids, mask, positions, cache):
    return lean.Plan(body).forward(ids, mask, positions, cache)


def transformers_forward(body, ids, mask, positions, cache):
    out = body(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    return out.last_hidden_state


@pytest.mark.parametrize("arch", FAMILIES)
def test_lean_decoder_equals_transformers_modules(arch):
    base = tiny_model(arch)
    assert lean.supports(base)
    (ours, our_cache), (theirs, their_cache) = passes(base, lean_forward), passes(base, transformers_forward)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert torch.allclose(our_cache.keys, their_cache.keys, rtol=1e-12, atol=1e-12)
    assert torch.allclose(our_cache.values, their_cache.values, rtol=1e-12, atol=1e-12)


def test_other_families_and_eager_attention_keep_transformers_modules(monkeypatch):
    for arch in ("gemma2", "gemma3", "phi3", "gpt2", "gpt_neox"):
        assert not lean.supports(tiny_model(arch)), arch
    base = tiny_model("llama")
    base.config._attn_implementation = "eager"
    assert not lean.supports(base)
    monkeypatch.setattr(lean, "ENABLED", False)
    assert not lean.supports(tiny_model("llama"))
