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

import json
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from .accuracy import accuracy_table, head_ranks, rank_hits
from .generate import generate
from .lookup import first_difference

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
    """One way to answer: returns (new tokens, decoding steps, ...) for a prompt."""

    def __init__(self, name: str, model, llama_cpp: str | Path | None = None, gguf: str | Path | None = None):
        self.name, self.model = name, model
        kind, _, option = name.partition(":")
        if kind not in ("hf", "hf-pld", "plain", "medusa", "medusa-adapt", PEER):
            raise ValueError(f"unknown method {name!r}: use hf, hf-pld, plain, medusa[:TREE], medusa-adapt[:TREE] "
                             f"or {PEER}:VARIANT")
        self.kind = kind
        self.tree = "plain" if kind == "plain" else (option or "auto")
        self.peer = None
        if kind == PEER:
            from .peers import LlamaCpp

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


def summarize(records: list[dict], reference: str = REFERENCE) -> dict:
    """Per method, overall and per category: tok/s, speed-up, mean accepted length; output mismatches."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["method"], r["category"])].append(r)
        groups[(r["method"], "overall")].append(r)

    def stats(rows):
        tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
        steps = sum(r["steps"] for r in rows)
        return {"new_tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                "mean_accepted_length": tokens / max(1, steps)}

    table = {key: stats(rows) for key, rows in groups.items()}
    summary: dict[str, dict] = defaultdict(dict)
    for (method, category), s in table.items():
        ref = table.get((reference, category))
        s["speedup"] = s["tokens_per_second"] / ref["tokens_per_second"] if ref else None
        summary[method][category] = s
    outputs = {(r["question_id"], r["turn"]): r["tokens"] for r in records if r["method"] == reference}
    mismatches = [{"method": r["method"], "question_id": r["question_id"], "turn": r["turn"],
                   "first_difference": first_difference(r["tokens"], outputs[(r["question_id"], r["turn"])])}
                  for r in records
                  if r["method"] != reference and not r["method"].startswith(PEER)
                  and (r["question_id"], r["turn"]) in outputs
                  and r["tokens"] != outputs[(r["question_id"], r["turn"])]]
    return {"methods": dict(summary), "mismatches": mismatches, "reference": reference}


def environment(model) -> dict:
    from .tuning import machine

    described = machine(model)
    return {"machine": platform.machine(), "processor": described["gpu"] or described["cpu"], "isa": described["isa"],
            "platform": platform.platform(), "cpus": torch.get_num_threads(), "device": str(model.device),
            "tuning": model.tuning.summary() if model.tuning else None,
            "cuda": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": Path(model.base_name).name,
            "heads": model.heads.config.to_dict(), "dtype": str(model.base_model.dtype)}


def write_report(result: dict, out: str | Path) -> Path:
    """results.json, report.md and PNG plots in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "report.md").write_text(report_markdown(result))
    plot(result, out)
    return out


def report_markdown(result: dict) -> str:
    summary, settings, env = result["summary"], result["settings"], result["environment"]
    methods = list(summary["methods"])
    categories = sorted({c for m in summary["methods"].values() for c in m} - {"overall"})
    machine, reference = env["processor"] or env["machine"], summary["reference"]
    lines = [f"# Benchmark: {env['model']}", "",
             f"{settings['questions']} questions, {settings['max_new_tokens']} new tokens max, greedy, batch 1, "
             f"median of {settings['repeats']}; {env['device']} ({env['cpus']} threads, {machine}), "
             f"torch {env['torch']}, transformers {env['transformers']}, {env['dtype']}; ISA: "
             f"{' '.join(env.get('isa') or []) or '-'}.", "", f"Tuning: {env.get('tuning') or 'off'}", "",
             f"| method | tok/s | speed-up vs {reference} | mean accepted length | new tokens |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for m in methods:
        s = summary["methods"][m]["overall"]
        speedup = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        lines.append(f"| {m} | {s['tokens_per_second']:.1f} | {speedup} | {s['mean_accepted_length']:.2f} | "
                     f"{s['new_tokens']} |")
    for key, title, unit in (("speedup", f"Speed-up vs {reference}", "x"), ("mean_accepted_length",
                                                                            "Mean accepted length", "")):
        lines += ["", f"{title} per category:", "", "| method | " + " | ".join(categories) + " |",
                  "| --- |" + " ---: |" * len(categories)]
        for m in methods:
            cells = [summary["methods"][m].get(c, {}).get(key) for c in categories]
            lines.append(f"| {m} | " + " | ".join(f"{x:.2f}{unit}" if x else "-" for x in cells) + " |")
    if accuracy := result.get("head_accuracy"):
        lines += ["", "Head accuracy on the answers (top-1 / top-5):", ""]
        lines += [f"- head {k + 1}: {row[0]:.3f} / {row[min(4, len(row) - 1)]:.3f}" for k, row in enumerate(accuracy)]
    mismatches = summary["mismatches"]
    lines += ["", f"Greedy outputs identical to {reference}: {'yes, all' if not mismatches else 'NO'}"]
    lines += [f"- {x['method']} differs on question {x['question_id']} turn {x['turn']} from token "
              f"{x['first_difference']}" for x in mismatches]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]["methods"]
    categories = [*sorted({c for m in summary.values() for c in m} - {"overall"}), "overall"]
    fig, ax = plt.subplots(figsize=(max(6, len(categories) * 1.2), 4))
    width = 0.8 / max(1, len(summary))
    for i, (method, per_category) in enumerate(summary.items()):
        values = [(per_category.get(c) or {}).get("speedup") or 0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(summary) - 1) / 2 for x in range(len(categories))], categories, rotation=30)
    ax.set_ylabel(f"speed-up vs {result['summary']['reference']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in summary:
        if method.startswith("medusa"):
            lengths = [a for r in result["records"] if r["method"] == method for a in r["accept_lengths"][1:]]
            if lengths:
                ax.hist(lengths, bins=range(1, max(lengths) + 2), alpha=0.5, label=method, align="left")
    ax.set_xlabel("tokens accepted per step (bonus included)")
    ax.set_ylabel("steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accepted_lengths.png", dpi=120)
    plt.close(fig)

    if accuracy := result.get("head_accuracy"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for k, row in enumerate(accuracy):
            ax.plot(range(1, len(row) + 1), row, marker="o", label=f"head {k + 1}")
        ax.set_xlabel("top-r")
        ax.set_ylabel("accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "head_accuracy.png", dpi=120)
        plt.close(fig)


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


def load_bench(model, questions: list[dict], batch_sizes: list[int], max_new_tokens: int, tree=None) -> dict:
    """Throughput and latency of batched decoding: Medusa vs plain at each batch size, interleaved.

    A batch of B first turns decodes together (rows leave as they finish). Latency of
    a request = seconds until its row finished. Greedy outputs of both methods are compared.
    """
    from .generate import make_decoder, mean_accepted_length, pad_batch

    prompts = [model.chat_ids(q["turns"][0])[0].tolist() for q in questions]
    methods = {"plain": "plain", "medusa": tree}
    for spec in methods.values():  # warm-up
        for _ in make_decoder(model, torch.tensor([prompts[0]], device=model.device), None, 8, tree=spec).steps():
            pass
    rows = []
    for size in batch_sizes:
        ids, mask = pad_batch([prompts[i % len(prompts)] for i in range(size)])
        outputs = {}
        for name, spec in methods.items():
            decoder = make_decoder(model, ids.to(model.device), mask.to(model.device), max_new_tokens, tree=spec)
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
