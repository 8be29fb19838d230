"""Spec-Bench-style benchmark: every method on the same questions, interleaved, outputs checked.

Methods: `hf` (transformers generate, greedy: the reference), `hf-pld` (transformers prompt lookup
decoding), `plain` (this project's loop without heads), `medusa` (the tree probed for this machine,
`tree="auto"`), `medusa:TREE` (any other tree), `medusa-adapt[:TREE]` (the same with per-request
adaptation, `medusa_heads.adaptive`) and `llama.cpp:VARIANT` (llama.cpp on the GGUF, as
given or requantized to F32 / BF16: `medusa_heads.peers`). Speed-up = method tok/s / hf tok/s,
where tok/s is a method's total new tokens over its total time (wall time; llama.cpp's own prompt +
generation timings, which leave out its process start and model load). Mean accepted length = new
tokens / decoding steps (forward passes of the base model for the hf methods, prefill included).
llama.cpp's outputs (other numerics, often another quantisation) are not compared.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..accuracy import accuracy_table, head_ranks, rank_hits
from .load import load_bench, load_markdown
from .report import environment, summarize, write_report
from .runners import REFERENCE, Method, load_questions, run_bench

__all__ = ["Method", "bench", "load_bench", "load_markdown", "load_questions"]


def bench(model, questions: list[dict], methods: list[str | Method], out: str | Path, max_new_tokens: int = 256,
          repeats: int = 1, max_turns: int | None = None) -> dict:
    """The whole benchmark: run, summarise, measure head accuracy on the reference answers, write the report."""
    model.require_tokenizer()
    runners = [m if isinstance(m, Method) else Method(m, model) for m in methods]  # bad names fail before any work
    names = [r.name for r in runners]
    reference = REFERENCE if REFERENCE in names else names[0]
    result = run_bench(model, questions, runners, max_new_tokens, repeats, max_turns)
    result["summary"] = summarize(result["records"], reference)
    result["environment"] = environment(model)
    hits, counts = 0, 0
    for r in (r for r in result["records"] if r["method"] == reference and r["turn"] == 0):
        question = next(q for q in questions if q["question_id"] == r["question_id"])
        prompt = model.chat_ids(question["turns"][0])[0]
        answer = torch.cat([prompt, torch.tensor(r["tokens"], device=prompt.device)])
        h, c = rank_hits(head_ranks(model, answer, start=prompt.numel()))
        hits, counts = hits + h, counts + c
    result["head_accuracy"] = accuracy_table(hits, counts) if torch.is_tensor(counts) else None
    write_report(result, out)
    return result
