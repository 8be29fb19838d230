"""`medusa demo`: answer a few prompts, timing plain decoding and Medusa side by side."""

from __future__ import annotations

import time

from .generate import generate


def run_demo(model, prompts: list[str], max_new_tokens: int) -> None:
    """Print each answer with plain and Medusa tokens/s, the speed-up and the mean accepted length."""
    warm = model.chat_ids("Hello")
    generate(model, warm, max_new_tokens=8, tree="plain")
    generate(model, warm, max_new_tokens=8)
    heads = model.heads.config
    print(f"model: {model.base_name}  heads: {heads.num_heads} x {heads.num_layers} layer(s), {heads.projection} "
          f"projection  device: {model.device}")
    totals = {"plain": [0, 0.0], "medusa": [0, 0.0]}
    for prompt in prompts:
        ids = model.chat_ids(prompt)
        plain = generate(model, ids, max_new_tokens=max_new_tokens, tree="plain")
        start = time.perf_counter()
        medusa = generate(model, ids, max_new_tokens=max_new_tokens)
        elapsed = time.perf_counter() - start
        rates = {}
        for name, out, seconds in (("plain", plain, plain.elapsed), ("medusa", medusa, elapsed)):
            tokens = len(out.new_tokens[0])
            totals[name][0] += tokens
            totals[name][1] += seconds
            rates[name] = tokens / seconds
        same = "identical to plain decoding" if medusa.new_tokens == plain.new_tokens else "DIFFERS from plain decoding"
        print(f"\n>>> {prompt}\n{medusa.texts[0].strip()}\n")
        print(f"    plain {rates['plain']:.1f} tok/s | medusa {rates['medusa']:.1f} tok/s | "
              f"speed-up {rates['medusa'] / rates['plain']:.2f}x | mean accepted length "
              f"{medusa.mean_accepted_length:.2f} | {same}")
    overall = (totals["medusa"][0] / totals["medusa"][1]) / (totals["plain"][0] / totals["plain"][1])
    print(f"\noverall speed-up: {overall:.2f}x")
