"""The benchmark's methods (transformers, this loop, Medusa, llama.cpp) and the interleaved run over questions."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..generate import generate

PLD_TOKENS = 10  # prompt_lookup_num_tokens for hf-pld, transformers' documented default
REFERENCE = "hf"


def load_questions(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[dict]:
    """Spec-Bench JSONL: one {"question_id", "category", "turns": [...]} per line; optionally only the
    first `per_category` questions of each category, then the first `limit`."""
    questions = []
    for number, line in enumerate(Path(path).read_text().split("\n"), 1):  # not splitlines(): see train/data.py
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            turns = record["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError("turns must be a non-empty list of strings")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{number}: not a Spec-Bench question ({err})") from err
        questions.append({"question_id": record.get("question_id", number), "category": record.get("category", "all"),
                          "turns": turns})
    if not questions:
        raise ValueError(f"{path} holds no questions")
    if per_category:
        kept, seen = [], defaultdict(int)
        for q in questions:
            seen[q["category"]] += 1
            if seen[q["category"]] <= per_category:
                kept.append(q)
        questions = kept
    return questions[:limit] if limit else questions


PEER = "llama.cpp"


class Method:
    """One way to answer: returns (new tokens, decoding steps, ...) for a prompt. 'medusa[:TREE]@DIR' decodes
    with the draft of heads folder DIR (Medusa heads or an EAGLE-style draft) on the same base model."""

    def __init__(self, name: str, model, llama_cpp: str | Path | None = None, gguf: str | Path | None = None):
        spec, _, heads = name.partition("@")
        self.name, self.model = name, model.with_heads(heads) if heads else model
        kind, _, option = spec.partition(":")
        if kind not in ("hf", "hf-pld", "plain", "medusa", "medusa-adapt", PEER):
            raise ValueError(f"unknown method {name!r}: use hf, hf-pld, plain, medusa[:TREE][@HEADS], "
                             f"medusa-adapt[:TREE][@HEADS] or {PEER}:VARIANT")
        self.kind = kind
        self.tree = "plain" if kind == "plain" else (option or "auto")
        self.peer = None
        if kind == PEER:
            from ..peers import LlamaCpp

            if not (llama_cpp and gguf):
                raise ValueError(f"method {name!r} needs the llama.cpp binaries (--llama-cpp DIR) and a GGUF (--gguf)")
            self.peer = LlamaCpp(llama_cpp, gguf, option or "gguf", model.require_tokenizer())

    def run(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], int, list[int], float | None]:
        """New tokens, decoding steps, tokens emitted per step (empty where unknown), and the seconds
        the method measured itself (None: time it from outside)."""
        if self.peer is not None:
            tokens, seconds = self.peer.run(ids, max_new_tokens)
            return tokens, len(tokens), [], seconds
        if self.kind.startswith("hf"):
            return (*self._run_hf(ids, max_new_tokens), None)
        adapt = self.kind == "medusa-adapt"
        out = generate(self.model, ids, max_new_tokens=max_new_tokens, tree=self.tree, adapt=adapt)
        return out.new_tokens[0], out.steps, out.accept_lengths[0], None

    def _run_hf(self, ids, max_new_tokens):
        base = self.model.base_model
        calls = []
        hook = base.register_forward_pre_hook(lambda *_: calls.append(1))
        extra = {"prompt_lookup_num_tokens": PLD_TOKENS} if self.kind == "hf-pld" else {}
        try:
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=self.model.tokenizer.pad_token_id, **extra)
        finally:
            hook.remove()
        return out[0, ids.shape[1] :].tolist(), len(calls), []


def run_bench(model, questions: list[dict], methods: list[str | Method], max_new_tokens: int, repeats: int = 1,
              max_turns: int | None = None) -> dict:
    """Answer every question with every method, interleaved; return all raw measurements."""
    runners = [m if isinstance(m, Method) else Method(m, model) for m in methods]
    warm = model.chat_ids("Hello!")
    for runner in runners:  # warm-up: first calls pay for allocations and lazy inits
        runner.run(warm, 8)
    records = []
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    bar = tqdm(questions, desc="bench", unit="q")
    for qi, question in enumerate(bar):
        histories = {r.name: [] for r in runners}
        order = runners[qi % len(runners):] + runners[: qi % len(runners)]  # rotate so no method always goes first
        for turn, text in enumerate(question["turns"][:max_turns]):
            for runner in order:
                history = histories[runner.name]
                history.append({"role": "user", "content": text})
                ids = model.chat_ids(history)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    tokens, steps, accept_lengths, own = runner.run(ids, max_new_tokens)
                    times.append(own if own is not None else time.perf_counter() - start)
                seconds = statistics.median(times)
                history.append({"role": "assistant", "content": model.tokenizer.decode(tokens,
                                                                                       skip_special_tokens=True)})
                records.append({"question_id": question["question_id"], "category": question["category"],
                                "turn": turn, "method": runner.name, "new_tokens": len(tokens), "seconds": seconds,
                                "tokens_per_second": len(tokens) / seconds, "steps": steps,
                                "accept_lengths": accept_lengths, "tokens": tokens, "prompt_tokens": ids.shape[1]})
                totals[runner.name][0] += len(tokens)
                totals[runner.name][1] += seconds
        if REFERENCE in totals:
            ref = totals[REFERENCE][0] / totals[REFERENCE][1]
            bar.set_postfix({n: f"{t[0] / t[1] / ref:.2f}x" for n, t in totals.items() if n != REFERENCE})
    return {"records": records, "settings": {"methods": [r.name for r in runners], "max_new_tokens": max_new_tokens,
                                             "repeats": repeats, "questions": len(questions),
                                             "max_turns": max_turns}}
