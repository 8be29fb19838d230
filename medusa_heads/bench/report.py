"""The benchmark's summary per method and category, its environment, and the report (markdown, JSON, plots)."""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from pathlib import Path

import torch
import transformers

from ..lookup import first_difference
from .runners import PEER, REFERENCE


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
    from ..tuning import machine

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
