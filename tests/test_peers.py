"""llama.cpp as a benchmark method: the real binaries on the embedded GGUF, where they are built."""

import os
from pathlib import Path

import pytest
import torch
from conftest import medusa_tiny
from tiny import tiny_tokenizer

from medusa_heads.bench import Method

PEER_DIR = Path(os.environ.get("LLAMA_CPP_PEER", Path.home() / ".cache" / "llama-cpp-peer"))


def test_a_llama_cpp_method_needs_its_binaries():
    model = medusa_tiny("llama")
    model.tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="--llama-cpp DIR"):
        Method("llama.cpp:F32", model)
    with pytest.raises(FileNotFoundError, match="build-llama-cpp"):
        Method("llama.cpp:gguf", model, llama_cpp="/nonexistent", gguf="model.gguf")
    with pytest.raises(ValueError, match=r"unknown llama\.cpp variant"):
        Method("llama.cpp:Q9", model, llama_cpp="/nonexistent", gguf="model.gguf")


@pytest.mark.integration
@pytest.mark.skipif(not (PEER_DIR / "llama-completion").exists(),
                    reason=f"llama.cpp not built in {PEER_DIR} (../shared/tools/build-llama-cpp builds it)")
@pytest.mark.parametrize("variant", ["gguf", "F32"])
def test_llama_cpp_answers_with_its_own_timings(default_model, tmp_path, monkeypatch, variant):
    from medusa_heads.default import gguf_path

    monkeypatch.setenv("MEDUSA_HEADS_CACHE", str(tmp_path))  # the F32 file is made afresh
    method = Method(f"llama.cpp:{variant}", default_model, PEER_DIR, gguf_path())
    ids = default_model.chat_ids("What is the capital of France?")
    tokens, steps, _, seconds = method.run(ids, 24)
    assert 0 < len(tokens) <= 24 and steps == len(tokens) and 0 < seconds < 60
    if variant == "F32":  # unquantised: the same greedy answer as transformers on the converted weights
        assert "Paris" in default_model.tokenizer.decode(tokens)  # (Q4_1's own numerics answer otherwise)
        assert method.peer.gguf.name.endswith(".F32.gguf") and method.peer.gguf.parent == tmp_path / "llama-cpp"
        expected = default_model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                                     do_sample=False)[0, ids.shape[1]:].tolist()
        assert tokens[:8] == expected[:8]
