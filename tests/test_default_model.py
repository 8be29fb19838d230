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
