"""Throughput and latency of batched decoding, Medusa against plain, at several batch sizes."""

from __future__ import annotations

import statistics
import time

import torch

from .report import environment


def load_bench(model, questions: list[dict], batch_sizes: list[int], max_new_tokens: int, tree=None) -> dict:
    """Throughput and latency of batched decoding: Medusa vs plain at each batch size, interleaved.

    A batch of B first turns decodes together (rows leave as they finish). Latency of
    a request = seconds until its row finished. Greedy outputs of both methods are compared.
    """
    from ..decoder import mean_accepted_length, pad_batch
    from ..decoding import Decoding
    from ..generate import make_decoder

    prompts = [model.chat_ids(q["turns"][0])[0].tolist() for q in questions]
    methods = {"plain": "plain", "medusa": tree}
    for spec in methods.values():  # warm-up
        warm = make_decoder(model, torch.tensor([prompts[0]], device=model.device),
                            Decoding(max_new_tokens=8, tree=spec))
        for _ in warm.steps():
            pass
    rows = []
    for size in batch_sizes:
        ids, mask = pad_batch([prompts[i % len(prompts)] for i in range(size)])
        outputs = {}
        for name, spec in methods.items():
            decoder = make_decoder(model, ids.to(model.device), Decoding(max_new_tokens=max_new_tokens, tree=spec),
                                   mask.to(model.device))
            start, finished = time.perf_counter(), {}
            for updates in decoder.steps():
                now = time.perf_counter() - start
                finished.update({u.row: now for u in updates if u.finish_reason})
            seconds = time.perf_counter() - start
            rows_done = [decoder.progress(row) for row in sorted(finished)]
            tokens = [r.tokens for r in rows_done]
            outputs[name] = tokens
            rows.append({"batch_size": size, "method": name, "new_tokens": sum(map(len, tokens)), "seconds": seconds,
                         "tokens_per_second": sum(map(len, tokens)) / seconds,
                         "mean_latency": statistics.mean(finished.values()),
                         "mean_accepted_length": mean_accepted_length([r.accept_lengths for r in rows_done])})
        rows[-1]["identical_to_plain"] = outputs["medusa"] == outputs["plain"]
        rows[-1]["speedup_vs_plain"] = rows[-1]["tokens_per_second"] / rows[-2]["tokens_per_second"]
    return {"rows": rows, "settings": {"batch_sizes": batch_sizes, "max_new_tokens": max_new_tokens,
                                       "questions": len(questions), "tree": str(tree or "default")},
            "environment": environment(model)}


def load_markdown(result: dict) -> str:
    lines = ["| batch | method | total tok/s | mean latency (s) | mean accepted length | speed-up vs plain |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        speedup = f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else "1.00x"
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['mean_latency']:.2f} | "
                     f"{r['mean_accepted_length']:.2f} | {speedup} |")
    same = all(r.get("identical_to_plain", True) for r in result["rows"])
    return "\n".join(lines) + f"\n\nGreedy outputs identical to plain batched decoding: {'yes' if same else 'NO'}\n"
