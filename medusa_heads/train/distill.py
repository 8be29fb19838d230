"""Self-distillation: the model answers the prompts itself; ShareGPT JSONL out, resumable.

Every user turn is answered in order, later turns seeing the model's own earlier answers. Each
finished conversation is appended as one complete line (one write, flushed and fsynced); on a
rerun, a torn last line is cut off and every prompt already written is skipped, so after any
number of kills the file ends with every prompt exactly once.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from ..generate import pad_batch
from .data import DataError, iter_records, to_messages

Answerer = Callable[[list[list[dict]]], list[str]]  # chats ending with a user turn -> answers


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


def completed_ids(out: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off first."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(out, "r+b") as f:
            f.truncate(end)
    done = set()
    for number, line in enumerate(data[:end].decode().split("\n")[:-1], 1):
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError) as err:
            raise DataError(f"{out}:{number}: not a distilled record ({err}); move the file away to start over"
                            ) from err
    return done


def distill(prompts: list[tuple[str, list[str]]], answer: Answerer, out: str | Path, batch_size: int = 16,
            progress: bool = True) -> int:
    """Answer every prompt not yet in `out`, appending ShareGPT records; returns how many were added."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(out)
    todo = [(key, turns) for key, turns in prompts if key not in done]
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", disable=not progress)
    with open(out, "ab") as f:
        for batch in _batches(todo, batch_size):
            chats: list[list[dict]] = [[] for _ in batch]
            for turn in range(max(len(turns) for _, turns in batch)):
                live = [i for i, (_, turns) in enumerate(batch) if turn < len(turns)]
                for i in live:
                    chats[i].append({"role": "user", "content": batch[i][1][turn]})
                for i, text in zip(live, answer([chats[i] for i in live]), strict=True):
                    chats[i].append({"role": "assistant", "content": text})
            for (key, _), chat in zip(batch, chats, strict=True):
                record = {"id": key, "conversations": [
                    {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in chat]}
                f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()
    return len(todo)


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def local_answerer(model, max_new_tokens: int, temperature: float, seed: int | None = None) -> Answerer:
    """Answers with the model itself, a batch at a time (greedy at temperature 0, else exact sampling;
    with a seed, batch i samples with seed + i)."""
    tokenizer = model.require_tokenizer()
    calls = itertools.count()

    def answer(chats: list[list[dict]]) -> list[str]:
        call = next(calls)
        ids, mask = pad_batch([model.chat_ids(chat)[0].tolist() for chat in chats], tokenizer.pad_token_id or 0)
        sampling = {"acceptance": "greedy"} if temperature == 0 else {"acceptance": "exact", "temperature": temperature}
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
                             tree="plain", seed=None if seed is None else seed + call, **sampling)
        return [text.strip() for text in out.texts]

    return answer


def endpoint_answerer(url: str, model_name: str | None, max_new_tokens: int, temperature: float,
                      concurrency: int = 8, api_key: str = "none") -> Answerer:
    """Answers through any OpenAI-compatible server (e.g. vLLM), `concurrency` requests at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=api_key)
    name = model_name or client.models.list().data[0].id

    def one(chat: list[dict]) -> str:
        reply = client.chat.completions.create(model=name, messages=chat, max_tokens=max_new_tokens,
                                               temperature=temperature)
        return (reply.choices[0].message.content or "").strip()

    def answer(chats: list[list[dict]]) -> list[str]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, chats))

    return answer
