"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the text's last
few tokens (in the prompt or the answer so far). Free to compute, and right surprisingly often
when an answer quotes, lists or repeats: code, extraction, structured text."""

from __future__ import annotations

MIN_NGRAM = 3  # shorter matches guess wrong too often to pay for their verification
MAX_NGRAM = 4


def continuation(context: list[int], max_tokens: int) -> list[int]:
    """Up to max_tokens tokens that followed the latest earlier occurrence of the context's last
    n tokens, for the longest n in MAX_NGRAM..MIN_NGRAM that occurs; [] when none does."""
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(context) <= n:
            continue
        suffix, last = context[-n:], context[-1]
        for end in range(len(context) - 2, n - 2, -1):  # end: index of the occurrence's last token
            if context[end] == last and context[end - n + 1 : end + 1] == suffix:
                return context[end + 1 : end + 1 + max_tokens]
    return []


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ (the shorter length when one extends the other):
    how many tokens of a draft a are right when b is what decoding emits."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
