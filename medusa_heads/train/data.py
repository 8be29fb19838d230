"""Conversations in, token ids and assistant-only labels out.

Reads ShareGPT (`{"conversations": [{"from", "value"}]}`) and the messages form
(`{"messages": [{"role", "content"}]}`), as a JSON array or JSONL. Labels are -100 everywhere but
on the assistant's tokens, located by rendering the chat template one message at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

IGNORE = -100
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system", "bard": "assistant", "bing": "assistant"}


class DataError(ValueError):
    """A record that cannot be used, with where it is."""


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE except on assistant tokens


def iter_records(path: str | Path) -> Iterator[tuple[str, dict | None, str | None]]:
    """(location, record, problem) for every record of a JSON array or JSONL file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not valid JSON ({err})") from err
        for number, record in enumerate(records, 1):
            yield f"{path}: record {number}", record, None
        return
    # JSONL lines end at "\n" only: splitlines() would also split at U+2028 and friends inside strings
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line), None
        except json.JSONDecodeError as err:
            yield f"{path}:{number}", None, f"not valid JSON ({err.msg})"


def to_messages(record: dict) -> list[dict[str, str]]:
    """A record in either form as chat messages; raises ValueError naming what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected an object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise ValueError("no 'conversations' or 'messages' field")
    if not isinstance(turns, list) or not turns:
        raise ValueError("the conversation is empty")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise ValueError(f"turn {i} needs '{role_key}' and '{text_key}'")
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"turn {i} has unknown role {turn[role_key]!r}")
        if not isinstance(turn[text_key], str):
            raise ValueError(f"turn {i} text is not a string")
        messages.append({"role": role, "content": turn[text_key]})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn to learn from")
    return messages


def read_conversations(path: str | Path, skip_bad: bool = False) -> tuple[list[list[dict]], int]:
    """All conversations in a file, and how many bad records were skipped (skip_bad) or raise."""
    conversations, skipped = [], 0
    for where, record, problem in iter_records(path):
        try:
            if problem:
                raise ValueError(problem)
            conversations.append(to_messages(record))
        except ValueError as err:
            if not skip_bad:
                raise DataError(f"{where}: {err} (pass --skip-bad to skip such records)") from err
            skipped += 1
    if not conversations:
        raise DataError(f"{path} holds no usable conversation")
    return conversations, skipped


def tokenize(tokenizer, messages: list[dict], max_length: int) -> Example:
    """Token ids of the whole chat, labels on assistant tokens only, truncated to max_length."""
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = _render(tokenizer, messages[:i], generation_prompt=True)
            _extend(ids, labels, prompt, learn=False)
        full = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        _extend(ids, labels, full, learn=message["role"] == "assistant")
    return Example(ids[:max_length], labels[:max_length])


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                  return_dict=True)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if generation_prompt else "")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _extend(ids: list[int], labels: list[int], rendered: list[int], learn: bool) -> None:
    """Append the part of `rendered` beyond what ids already hold (templates render prefixes stably)."""
    if rendered[: len(ids)] != ids:
        raise DataError("the chat template does not render conversations prefix by prefix; cannot locate "
                        "assistant tokens")
    new = rendered[len(ids):]
    ids.extend(new)
    labels.extend(new if learn else [IGNORE] * len(new))
