"""Where a decoding step's time goes, on the device at hand (the default model unless --base/--heads).

    python scripts/profile_step.py [--tree default] [--steps 40] [--base MODEL --heads DIR]

Wraps the parts of a decoding step with wall-clock timers (exact on a CPU; on a GPU each part is
synchronised first): the heads' proposals, the base model's verification forward, its logits
(lm_head), acceptance, the cache commit, emitting tokens with the stop rules. The rest is the
step's own mask, position and Python work. Prefill and warm-up steps are not counted.
"""

import argparse
import time
from collections import defaultdict

import torch

from medusa_heads import MedusaModel, adapter, generate
from medusa_heads.cache import TreeCache
from medusa_heads.heads import MedusaHeads

TIMES: dict[str, float] = defaultdict(float)
PARTS = [(MedusaHeads, "propose", "heads (propose)"), (generate.Decoder, "_forward", "base forward (decoder layers)"),
         (adapter, "logits", "verification logits (lm_head)"), (generate, "accept", "acceptance"),
         (TreeCache, "commit", "cache commit"), (generate.Decoder, "_emit", "emit + stop rules")]


def wrap(owner, name: str, label: str, device: torch.device) -> None:
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = original(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        TIMES[label] += time.perf_counter() - start
        return result

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base")
    parser.add_argument("--heads")
    parser.add_argument("--tree", default="default")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    model = MedusaModel.from_pretrained(args.base, heads=args.heads, projection="shared")
    for owner, name, label in PARTS:
        wrap(owner, name, label, model.device)
    ids = model.chat_ids("Write a short story about a robot who learns to paint.")
    for tree in ["plain", args.tree]:
        depth = generate.resolve_tree(model, tree).depth
        decoder = generate.make_decoder(model, ids, None, max_new_tokens=(depth + 1) * (args.steps + 4), tree=tree,
                                        eos_token_id=[])
        loop = decoder.steps()
        for _ in range(4):  # prefill, then warm-up steps
            next(loop)
        TIMES.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            next(loop)
        total = time.perf_counter() - start
        print(f"\ntree {tree}: {decoder.tree.size} tokens per pass, {total / args.steps * 1000:.1f} ms per step")
        rows = [(label, TIMES[label]) for _, _, label in PARTS]
        for label, seconds in [*rows, ("masks, positions, Python", total - sum(s for _, s in rows))]:
            print(f"  {label:32s} {seconds / args.steps * 1000:7.2f} ms  {seconds / total:6.1%}")


if __name__ == "__main__":
    main()
