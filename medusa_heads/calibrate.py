"""Size the tree to the device: measure head accuracies and the cost of verifying n tokens, then
pick the tree that maximises expected accepted length per unit of time.

- accuracies: per head k and rank r, how often the head's rank-r guess is the token it aims at,
  on the model's own greedy answers (`accuracy.head_hits`).
- cost curve: c(n) = time of one decoding step that verifies n tree tokens (heads and acceptance
  included) / time of one plain decoding step, on this device.
- trees: the value of a node is the product, over its path, of the accuracy of head d at rank r
  (the chance that the whole path is right); the best tree of n nodes adds, one at a time, the most
  valuable node whose parent is already in (greedy frontier search). Its expected accepted length
  is 1 (the bonus token) + the sum of its node values.
"""

from __future__ import annotations

import heapq
import time

import torch

from .accuracy import accuracy_table, head_hits
from .generate import make_decoder
from .tree import Tree


def rank_accuracy(hits: torch.Tensor, counts: torch.Tensor) -> list[list[float]]:
    """Probability that head k's rank-r guess is right: differences of the cumulative top-r hits."""
    cumulative = torch.tensor(accuracy_table(hits, counts), dtype=torch.float64)
    first = cumulative[:, :1]
    return torch.cat([first, cumulative[:, 1:] - cumulative[:, :-1]], dim=1).tolist()


def best_trees(accuracy: list[list[float]], max_nodes: int) -> list[tuple[Tree, float]]:
    """For n = 0..max_nodes, the greedy best tree of n nodes and its expected accepted length."""
    depth, ranks = len(accuracy), len(accuracy[0])
    frontier = [(-accuracy[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    paths: list[tuple[int, ...]] = []
    expected = 1.0
    result = [(Tree([], name="plain"), expected)]
    while frontier and len(paths) < max_nodes:
        negative, path = heapq.heappop(frontier)
        paths.append(path)
        expected -= negative
        result.append((Tree([list(p) for p in paths], name=f"calibrated-{len(paths)}"), expected))
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(frontier, (negative * accuracy[len(path)][r], (*path, r)))
    return result


@torch.inference_mode()
def measure_accuracy(model, prompts: list[torch.Tensor], max_new_tokens: int, max_rank: int = 10):
    """Per-head hits (cumulative over ranks) and target counts on the model's greedy answers."""
    hits = torch.zeros(model.heads.config.num_heads, max_rank, dtype=torch.long)
    counts = torch.zeros(model.heads.config.num_heads, dtype=torch.long)
    for ids in prompts:
        out = model.generate(ids, max_new_tokens=max_new_tokens, tree="plain")
        h, c = head_hits(model, out.sequences[0].to(model.device), start=ids.shape[1], max_rank=max_rank)
        hits, counts = hits + h, counts + c
    return hits, counts


def step_time(model, ids: torch.Tensor, tree: Tree, steps: int = 8) -> float:
    """Seconds per decoding step with this tree (prefill and a first step excluded)."""
    enough = (steps + 2) * (tree.depth + 1)  # never runs out before the last timed step
    decoder = make_decoder(model, ids, None, max_new_tokens=enough, tree=tree, eos_token_id=[])
    loop = decoder.steps()
    next(loop)  # prefill
    next(loop)  # a first step warms up
    start = time.perf_counter()
    for _ in range(steps):
        next(loop)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return (time.perf_counter() - start) / steps


def cost_curve(model, ids: torch.Tensor, trees: list[Tree], steps: int = 8, rounds: int = 5) -> list[float]:
    """c(n) for each tree relative to a plain decoding step: rounds interleave every tree and plain
    decoding so that drift hits all alike; the median over rounds is kept."""
    plain = Tree([], name="plain")
    times: list[list[float]] = [[] for _ in range(len(trees) + 1)]
    for _ in range(rounds):
        for i, tree in enumerate([plain, *trees]):
            times[i].append(step_time(model, ids, tree, steps))
    medians = [sorted(t)[len(t) // 2] for t in times]
    return [m / medians[0] for m in medians[1:]]


def calibrate(model, prompts: list[torch.Tensor], max_new_tokens: int = 128, max_nodes: int = 64,
              sizes: list[int] | None = None, max_rank: int = 10) -> dict:
    """Measure, search, and pick: returns the table and the chosen tree."""
    hits, counts = measure_accuracy(model, prompts, max_new_tokens, max_rank)
    accuracy = rank_accuracy(hits, counts)
    candidates = best_trees(accuracy, max_nodes)
    # n = 0 is plain decoding (c = 1): chosen when no tree pays for itself, e.g. with untrained heads
    sizes = sizes or sorted({n for n in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n <= max_nodes} | {max_nodes})
    chosen_rows = [(n, *candidates[n]) for n in sizes if n < len(candidates)]
    if not chosen_rows:
        raise ValueError(f"no tree size in {sizes} is possible with at most {len(candidates) - 1} nodes")
    costs = cost_curve(model, prompts[0], [tree for _, tree, _ in chosen_rows])
    table = [{"nodes": n, "expected_accepted_length": expected, "cost": cost, "expected_speedup": expected / cost}
             for (n, _, expected), cost in zip(chosen_rows, costs, strict=True)]
    best = max(range(len(table)), key=lambda i: table[i]["expected_speedup"])
    tree = chosen_rows[best][1]
    tree.name = "calibrated"
    return {"tree": tree, "table": table, "accuracy_top_r": accuracy_table(hits, counts), "targets": counts.tolist()}
