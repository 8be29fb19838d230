"""Self-distillation: the model answers the prompts itself; ShareGPT JSONL out, resumable.

Every user turn is answered in order, later turns seeing the model's own earlier answers. Each
finished conversation is appended as one complete line (one write, flushed and fsynced); on a
rerun, a torn last line is cut off and every prompt already written is skipped, so after any
number of kills the file ends with every prompt exactly once.

`answers`: a prompt-free copy of the answers (gzip JSONL of id + assistant turns) that can be
committed or carried where the prompts may not go; a rerun rebuilds the records from it and the
prompts instead of answering again.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from ..acceptance import Sampling
from ..decoder import Decoder, Request
from ..tree import Tree
from .data import DataError, iter_records, to_messages


def read_prompts(path: str | Path) -> list[tuple[str, list[str]]]:
    """(id, user turns) per record: Spec-Bench style {"turns": [...]} or ShareGPT / messages."""
    prompts, seen = [], set()
    for where, record, problem in iter_records(path):
        if problem:
            raise DataError(f"{where}: {problem}")
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object")
        if "turns" in record:
            turns = record["turns"]
        else:
            try:
                turns = [m["content"] for m in to_messages(_with_placeholder(record)) if m["role"] == "user"]
            except ValueError as err:
                raise DataError(f"{where}: {err}") from err
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise DataError(f"{where}: needs a non-empty list of user turns")
        key = str(record.get("id", record.get("question_id", where)))
        if key in seen:
            raise DataError(f"{where}: duplicate id {key!r}")
        seen.add(key)
        prompts.append((key, turns))
    return prompts


def _with_placeholder(record: dict) -> dict:
    """ShareGPT prompts may lack assistant turns (they are regenerated anyway)."""
    field = "conversations" if "conversations" in record else "messages"
    role, text = ("from", "value") if field == "conversations" else ("role", "content")
    turns = record.get(field)
    if isinstance(turns, list):
        return {field: [*turns, {role: "assistant", text: ""}]}
    return record


def _records(path: str | Path) -> list[tuple[str, dict]]:
    """(id, record) of the complete records in a distilled file (a torn last line is not a record yet)."""
    data = Path(path).read_bytes()
    records = []
    for number, line in enumerate(data[: data.rfind(b"\n") + 1].decode().split("\n")[:-1], 1):
        try:
            record = json.loads(line)
            records.append((str(record["id"]), record))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{path}:{number}: not a distilled record ({err}); move the file away to start over"
                            ) from err
    return records


def record_ids(path: str | Path) -> set[str]:
    """Ids of the complete records in a distilled file."""
    return {key for key, _ in _records(path)}


def _append(f, lines: list[str]) -> None:
    """Appends whole lines, flushed and fsynced: a kill leaves at most a torn last line."""
    f.write("".join(lines).encode())
    f.flush()
    os.fsync(f.fileno())


def _sharegpt_line(key: str, chat: list[dict]) -> str:
    """One distilled record: the chat (role / content messages) as a ShareGPT conversation."""
    conversation = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in chat]
    return json.dumps({"id": key, "conversations": conversation}, ensure_ascii=False) + "\n"


def completed_ids(out: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off first."""
    if not out.exists():
        return set()
    end = out.read_bytes().rfind(b"\n") + 1
    if end < out.stat().st_size:
        with open(out, "r+b") as f:
            f.truncate(end)
    return record_ids(out)


def save_answers(out: Path, answers: Path) -> int:
    """Writes the assistant turns of every complete record of `out` to `answers` (atomically), keeping the answers
    already there for prompts not in `out` (a run over fewer prompts loses none); returns how many are written."""
    fresh = {key: json.dumps({"id": key, "answers": [m["value"] for m in rec["conversations"] if m["from"] == "gpt"]},
                             ensure_ascii=False) + "\n" for key, rec in _records(out)}
    # in the file's own order, new prompts last: the same answers give the same bytes (no churn where committed)
    old = [(str(json.loads(line)["id"]), line) for line in _answer_lines(answers)] if answers.exists() else []
    lines = [fresh.pop(key, line) for key, line in old] + list(fresh.values())
    tmp = answers.with_name(answers.name + ".tmp")
    # no name or time in the gzip header either
    with open(tmp, "wb") as raw, io.TextIOWrapper(gzip.GzipFile("", "wb", fileobj=raw, mtime=0), encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, answers)
    return len(lines)


def _answer_lines(answers: Path) -> list[str]:
    """The lines of an answers file (records split on newlines only: an answer may hold U+2028)."""
    with gzip.open(answers, "rb") as f:
        return [line + "\n" for line in f.read().decode("utf-8").split("\n")[:-1]]


def restore_answers(prompts: list[tuple[str, list[str]]], answers: Path, out: Path, done: set[str]) -> set[str]:
    """Appends to `out` the records of `answers` for these prompts not in `done`; returns their ids."""
    wanted, restored, lines = dict(prompts), set(), []
    for number, line in enumerate(_answer_lines(answers), 1):
        record = json.loads(line)
        key, replies = str(record["id"]), record["answers"]
        if key in done or key in restored or key not in wanted:
            continue
        turns = wanted[key]
        if len(replies) != len(turns):
            raise DataError(f"{answers}:{number}: {len(replies)} answers for the {len(turns)} turns of "
                            f"prompt {key!r}: these answers are for other prompts; pass the prompts they "
                            "were made from, or move the file away")
        chat = [m for turn, reply in zip(turns, replies, strict=True)
                for m in ({"role": "user", "content": turn}, {"role": "assistant", "content": reply})]
        lines.append(_sharegpt_line(key, chat))
        restored.add(key)
    with open(out, "ab") as f:
        _append(f, lines)
    return restored


def distill(prompts: list[tuple[str, list[str]]], answerer: Answerer, out: str | Path, progress: bool = True,
            answers: str | Path | None = None) -> int:
    """Answer every prompt not yet in `out`, appending ShareGPT records; returns how many were added.
    With `answers`, the prompts answered there are restored first and every answer is copied there after.

    Conversations flow through the answerer continuously: when one finishes, the next prompt takes
    its place, so the batch stays full (no waiting for the longest answer of a batch).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(out)
    if answers is not None and Path(answers).exists():
        done |= restore_answers(prompts, Path(answers), out, done)
    todo = deque((key, turns) for key, turns in prompts if key not in done)
    added = len(todo)
    chats: dict[str, tuple[list[str], list[dict]]] = {}  # in flight: key -> (user turns, chat so far)
    bar = tqdm(total=added, desc="distill", unit="prompt", disable=not progress)
    with open(out, "ab") as f:
        while todo or chats:
            while todo and answerer.has_room():
                key, turns = todo.popleft()
                chats[key] = (turns, [{"role": "user", "content": turns[0]}])
                answerer.submit(key, chats[key][1])
            for key, text in answerer.results(drain=not todo):
                turns, chat = chats[key]
                chat.append({"role": "assistant", "content": text})
                if len(chat) // 2 < len(turns):  # the next turn sees the model's own answer
                    chat.append({"role": "user", "content": turns[len(chat) // 2]})
                    answerer.submit(key, chat)
                    continue
                del chats[key]
                _append(f, [_sharegpt_line(key, chat)])
                bar.update(1)
    bar.close()
    if answers is not None:
        save_answers(out, Path(answers))
    return added


class Answerer(Protocol):
    """Answers chats (ending with a user turn) a few at a time, in whatever order they finish."""

    def has_room(self) -> bool: ...

    def submit(self, key: str, chat: list[dict]) -> None: ...

    def results(self, drain: bool = False) -> list[tuple[str, str]]:
        """Waits until at least one submitted chat is answered; returns (key, answer) pairs. `drain`:
        no new prompts will come, so nothing submitted should wait for more company."""
        ...


class LocalAnswerer:
    """Answers with the model itself, continuously batched: up to batch_size rows decode together;
    free places are refilled in groups of at least a quarter of the batch (joining costs a copy of
    the KV cache). Greedy at temperature 0, else exact sampling, seeded per group of joiners (so a
    sampled run repeats only with the same batch size and no interruption)."""

    def __init__(self, model, max_new_tokens: int, temperature: float, seed: int | None = None, batch_size: int = 16):
        model.require_tokenizer()
        self.model = model
        self.decoder = Decoder(model, Tree.load("plain"))
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed
        self.sampling = Sampling() if temperature == 0 else Sampling("exact", temperature)
        self.waiting: list[tuple[str, torch.Tensor]] = []  # submitted, not yet in the decoder
        self.keys: dict[int, str] = {}  # decoder row id -> key
        self.groups = itertools.count()

    def has_room(self) -> bool:
        return len(self.waiting) + len(self.keys) < self.batch_size

    def submit(self, key: str, chat: list[dict]) -> None:
        self.waiting.append((key, self.model.chat_ids(chat)[0]))

    def results(self, drain: bool = False) -> list[tuple[str, str]]:
        if self.waiting and (drain or not self.keys or len(self.waiting) >= max(1, self.batch_size // 4)):
            seed = None if self.seed is None else self.seed + next(self.groups)
            rows = self.decoder.add([Request(ids, self.max_new_tokens, self.sampling, seed=seed)
                                     for _, ids in self.waiting])
            self.keys.update(zip(rows, (key for key, _ in self.waiting), strict=True))
            self.waiting = []
        while True:
            finished = [u.row for u in self.decoder.step() if u.finish_reason]
            if finished:
                answers = [(self.keys.pop(row), self.decoder.text(row).strip()) for row in finished]
                for row in finished:
                    self.decoder.forget(row)
                return answers


class EndpointAnswerer:
    """Answers through any OpenAI-compatible server (e.g. vLLM), `concurrency` requests at a time."""

    def __init__(self, url: str, model_name: str | None, max_new_tokens: int, temperature: float,
                 concurrency: int = 8, api_key: str = "none"):
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key=api_key)
        self.name = model_name or self.client.models.list().data[0].id
        self.max_new_tokens, self.temperature, self.concurrency = max_new_tokens, temperature, concurrency
        self.pool = ThreadPoolExecutor(concurrency)
        self.futures: dict[Future, str] = {}

    def has_room(self) -> bool:
        return len(self.futures) < self.concurrency

    def submit(self, key: str, chat: list[dict]) -> None:
        self.futures[self.pool.submit(self._ask, list(chat))] = key

    def _ask(self, chat: list[dict]) -> str:
        reply = self.client.chat.completions.create(model=self.name, messages=chat, max_tokens=self.max_new_tokens,
                                                    temperature=self.temperature)
        return (reply.choices[0].message.content or "").strip()

    def results(self, drain: bool = False) -> list[tuple[str, str]]:
        finished, _ = wait(self.futures, return_when=FIRST_COMPLETED)
        try:
            return [(self.futures.pop(future), future.result()) for future in finished]
        except Exception:  # stop the other requests too; answers not yet written are asked again on rerun
            self.pool.shutdown(wait=False, cancel_futures=True)
            raise
