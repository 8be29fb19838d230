"""The benchmark suite: MT-bench plus task types the heads were not trained on, one row each.

Categories, drawn in file order from a prompts file of {"id", "category", "source", "turns"}
records (../shared/data/train_prompts.jsonl) whose ids are not excluded (the heads' distilled
training data), first turns only:

- translation: "translation" prompts
- summarization: "summarization" prompts (a passage to summarise)
- passage-qa: questions over a passage (the source says "passage"; not its summarization, rewriting,
  extraction or writing prompts)
- math: "math" word problems
- code: "coding" prompts

and "mt-bench": MT-bench questions taken from each of its categories in turn, under one row.
"""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import zip_longest
from pathlib import Path

from .bench import load_questions

CATEGORIES = {  # suite row: does a prompts-file record belong to it
    "translation": lambda r: r.get("category") == "translation",
    "summarization": lambda r: r.get("category") == "summarization",
    "passage-qa": lambda r: "passage" in str(r.get("source", ""))
    and r.get("category") not in ("summarization", "rewriting", "extraction", "writing"),
    "math": lambda r: r.get("category") == "math",
    "code": lambda r: r.get("category") == "coding",
}


def suite_questions(prompts_file: str | Path, mt_bench: str | Path | None, per_category: int,
                    exclude: set[str] = frozenset()) -> list[dict]:
    """per_category questions of each suite category (Spec-Bench layout, first turn only)."""
    picked: dict[str, list[dict]] = {name: [] for name in CATEGORIES}
    for number, line in enumerate(Path(prompts_file).read_text().split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key, first = str(record["id"]), record["turns"][0]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            raise ValueError(f"{prompts_file}:{number}: not a prompt record with an id and turns ({err})") from err
        if key in exclude:
            continue
        for name, belongs in CATEGORIES.items():
            if belongs(record) and len(picked[name]) < per_category:
                picked[name].append({"question_id": key, "category": name, "turns": [first]})
    short = [name for name, questions in picked.items() if len(questions) < per_category]
    if short:
        raise ValueError(f"{prompts_file}: fewer than {per_category} prompts left for {', '.join(short)}")
    questions = [q for name in CATEGORIES for q in picked[name]]
    if mt_bench:
        by_category = defaultdict(list)
        for q in load_questions(mt_bench):
            by_category[q["category"]].append(q)
        round_robin = [q for group in zip_longest(*by_category.values()) for q in group if q]
        questions += [{**q, "category": "mt-bench", "turns": q["turns"][:1]} for q in round_robin[:per_category]]
    return questions
