"""How far Medusa-2's greedy answers drift from the original model's, and its accepted length.

    python scripts/medusa2_drift.py HEADS_DIR QUESTIONS.jsonl [--per-category N] [--max-new-tokens T]

HEADS_DIR is a Medusa-2 output (heads + LoRA adapter) for the embedded default model. The original
answers come from plain greedy decoding of the untouched model; Medusa-2 answers from greedy Medusa
decoding of the tuned one (identical to its own plain decoding).
"""

import argparse
import json

from medusa_heads import MedusaModel
from medusa_heads.bench import load_questions
from medusa_heads.lookup import first_difference


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("heads")
    parser.add_argument("questions")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    original = MedusaModel.from_pretrained()  # the embedded default, untouched
    tuned = MedusaModel.from_pretrained(None, heads=args.heads)
    rows = []
    for question in load_questions(args.questions, per_category=args.per_category):
        prompt = question["turns"][0]
        before = original.generate(original.chat_ids(prompt), max_new_tokens=args.max_new_tokens, tree="plain")
        after = tuned.generate(tuned.chat_ids(prompt), max_new_tokens=args.max_new_tokens)
        a, b = before.new_tokens[0], after.new_tokens[0]
        rows.append({"category": question["category"], "identical": a == b, "common_prefix": first_difference(a, b),
                     "original_tokens": len(a), "mean_accepted_length": after.mean_accepted_length})
    n = len(rows)
    summary = {"questions": n, "identical_answers": sum(r["identical"] for r in rows),
               "mean_common_prefix_tokens": sum(r["common_prefix"] for r in rows) / n,
               "mean_original_tokens": sum(r["original_tokens"] for r in rows) / n,
               "medusa2_mean_accepted_length": sum(r["mean_accepted_length"] for r in rows) / n}
    print(json.dumps({"summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
