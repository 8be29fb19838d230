"""Integration: the embedded default model (SmolLM2-135M-Instruct) against transformers' generate."""

import json

import pytest
import torch
from conftest import SHARED_DATA

pytestmark = pytest.mark.integration


def mt_bench_first_turns(limit: int) -> list[str]:
    path = SHARED_DATA / "mt_bench_question.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found (the shared data folder is not next to the project)")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines()[:limit]]


def test_greedy_equals_transformers_on_mt_bench(default_model):
    for question in mt_bench_first_turns(2):
        ids = default_model.chat_ids(question)
        expected = default_model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                                     do_sample=False)
        out = default_model.generate(ids, max_new_tokens=32, tree="chain-3")
        assert torch.equal(out.sequences, expected)


def test_chat_template_and_text(default_model):
    out = default_model.generate(default_model.chat_ids("What is the capital of France?"), max_new_tokens=16)
    assert "Paris" in out.texts[0]


def test_shipped_heads_load_by_default_and_accept_several_tokens_per_step():
    from medusa_heads import MedusaModel
    from medusa_heads.default import shipped_heads_dir

    if shipped_heads_dir() is None:
        pytest.skip("no heads shipped in medusa_heads/default_heads")
    model = MedusaModel.from_pretrained()  # the embedded default with its shipped heads and tree
    assert model.heads.config.num_heads >= 3
    accepted = []
    for question in mt_bench_first_turns(3):
        ids = model.chat_ids(question)
        out = model.generate(ids, max_new_tokens=64)
        assert out.new_tokens == model.generate(ids, max_new_tokens=64, tree="plain").new_tokens
        accepted.append(out.mean_accepted_length)
    assert sum(accepted) / len(accepted) > 1.2, accepted  # untrained heads stay near 1.0


def test_the_gguf_converts_once_into_the_cache(default_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from medusa_heads import default

    monkeypatch.setenv("MEDUSA_HEADS_CACHE", str(tmp_path))
    folder = default.default_base_dir()  # a fresh cache: converted from the package's GGUF now
    assert folder == tmp_path / default.DEFAULT_NAME and (folder / "config.json").exists()
    assert not list(tmp_path.glob("tmp*"))  # the conversion's temporary folder is gone
    converted = AutoModelForCausalLM.from_pretrained(folder)
    for name, weight in default_model.base_model.state_dict().items():
        assert torch.equal(converted.state_dict()[name], weight), name
    monkeypatch.setattr(default, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert default.default_base_dir() == folder
