"""Where a decoding step's time goes, on the device at hand (the default model unless --base/--heads).

    python scripts/profile_step.py [--tree default] [--steps 40] [--base MODEL --heads DIR] [--dtype bfloat16]
                                   [--compile]

Wraps the parts of a decoding step with wall-clock timers (exact on a CPU; on a GPU each part is
synchronised first): the heads' proposals, the base model's verification forward, its logits
(lm_head), acceptance, the cache commit, emitting tokens with the stop rules. The rest is the
step's own mask, position and Python work. Prefill and warm-up steps are not counted. Then the step's matrix
products alone (the base's linear layers, fused siblings as one, and lm_head, over as many rows as the step's
tree has tokens, by the kernel route the step takes): what is not a matrix product is the rest of the step.
`--compile` runs the passes through the compiled decoder; each tree's warm-up (its compile, if any) is timed,
and so is the whole start: a fresh process, from its first line to its first timed step.
"""

import argparse
import time
from collections import defaultdict

import psutil
import torch

from medusa_heads import Decoding, MedusaModel, adapter, decoder, generate, speed
from medusa_heads.cache import TreeCache
from medusa_heads.heads import MedusaHeads

TIMES: dict[str, float] = defaultdict(float)
PASS_ROWS: list[int] = []  # tokens per pass of the base model, as the cache is prepared for them
PARTS = [(MedusaHeads, "draft", "heads (draft)"), (decoder.Decoder, "_forward", "base forward (decoder layers)"),
         (adapter, "logits", "verification logits (lm_head)"), (decoder, "accept", "acceptance"),
         (TreeCache, "commit", "cache commit"), (decoder.Decoder, "_emit", "emit + stop rules")]


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


def products_alone(model: MedusaModel, routes: speed.Routes | None, rows: int, steps: int) -> float:
    """Seconds a step's matrix products take by themselves (median of `steps` steps; all products in turn, so
    the caches are as cold as in decoding)."""
    products = speed._products(model.base_model)
    inputs = {weight.shape[1]: torch.randn(rows, weight.shape[1], dtype=weight.dtype) for weight, _ in products}
    times = []
    with torch.inference_mode(), speed.decoding_step(routes):
        route = speed.ROUTES[speed.step_route(rows, products[0][0].dtype, sum(w.numel() for w, _ in products))]
        for _ in range(steps + 4):
            start = time.perf_counter()
            for weight, bias in products:
                route(inputs[weight.shape[1]], weight, bias)
            times.append(time.perf_counter() - start)
    return sorted(times[4:])[steps // 2]


def count_rows() -> None:
    prepare = TreeCache.prepare

    def counted(self, query_length: int, *args, **kwargs):
        PASS_ROWS.append(query_length)
        return prepare(self, query_length, *args, **kwargs)

    TreeCache.prepare = counted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base")
    parser.add_argument("--heads")
    parser.add_argument("--tree", default="auto", help="a preset, a tree file, or auto (the one chosen here)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--compile", action="store_true", help="the passes through the compiled decoder")
    args = parser.parse_args()
    model = MedusaModel.from_pretrained(args.base, heads=args.heads, projection="shared",
                                        dtype=getattr(torch, args.dtype))
    if args.compile:
        model.compile_decoding()
    for owner, name, label in PARTS:
        wrap(owner, name, label, model.device)
    count_rows()
    ids = model.chat_ids("Write a short story about a robot who learns to paint.")
    for tree in ["plain", args.tree]:
        depth = generate.resolve_tree(model, tree).depth
        decoding = Decoding(max_new_tokens=(depth + 1) * (args.steps + 4), tree=tree)
        engine = generate.make_decoder(model, ids, decoding, eos_token_id=[])
        loop = engine.steps()
        warm_up = time.perf_counter()
        for _ in range(4):  # prefill, then warm-up steps
            next(loop)
        warm_up = time.perf_counter() - warm_up
        if tree == "plain":
            started = time.time() - psutil.Process().create_time()
            print(f"first timed step {started:.1f} s after the process started")
        TIMES.clear()
        PASS_ROWS.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            next(loop)
        total = time.perf_counter() - start
        rows = sorted(PASS_ROWS)[len(PASS_ROWS) // 2]
        print(f"\ntree {tree}: {rows} tokens per pass (median; the tree has {engine.tree.size}), "
              f"{total / args.steps * 1000:.1f} ms per step; prefill + 3 warm-up steps {warm_up:.1f} s")
        parts = [(label, TIMES[label]) for _, _, label in PARTS]
        for label, seconds in [*parts, ("masks, positions, Python", total - sum(s for _, s in parts))]:
            print(f"  {label:32s} {seconds / args.steps * 1000:7.2f} ms  {seconds / total:6.1%}")
        step, alone = total / args.steps, products_alone(model, engine.step_routes, rows, args.steps)
        print(f"  matrix products alone ({rows} rows): {alone * 1000:.1f} ms; the rest (heads included) "
              f"{(step - alone) * 1000:.1f} ms ({(step - alone) / step:.0%} of the step)")


if __name__ == "__main__":
    main()
