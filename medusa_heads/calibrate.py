"""Size the tree to the device: measure head accuracies and the cost of verifying n tokens, then
pick the tree that maximises expected accepted length per unit of time.

- accuracies: per head k and rank r, how often the head's rank-r guess is the token it aims at,
  on the model's own greedy answers (`accuracy.head_ranks`).
- cost curve: c(n) = time of one decoding step that verifies n tree tokens (heads and acceptance
  included) / time of one plain decoding step, on this device, the two kinds of steps alternating
  so that drift hits both alike; fitted non-decreasing in n (where a flat curve meets timing noise,
  a bigger pass can measure cheaper than a smaller one).
- trees: the value of a node is the product, over its path, of the accuracy of head d at rank r
  (the chance that the whole path is right); the best tree of n nodes adds, one at a time, the most
  valuable node whose parent is already in (greedy frontier search). Its expected accepted length
  is 1 (the bonus token) + the sum of its node values.
- replay: greedy decoding of the same answers is then replayed step by step for each of those
  trees, with and without a prompt-lookup branch of L tokens. This is exact, not an estimate (at
  each step it knows where the heads ranked their targets and what the lookup drafts), and the
  cost of each step is c at the number of tokens it verifies. Of the trees and L whose replayed
  speed-up is within `tolerance` of the highest (closer than that is within the noise of c), the
  one whose steps cost least is chosen: its speed hangs least on the wide passes' costs and on how
  well the record's acceptance carries over to other text, and it leaves the most compute free.

What the heads do on the answers (accuracies and per-step ranks and drafts: a `Record`) does not
depend on the machine; only the cost curve does. So `medusa calibrate` saves the record with the
heads (replay.json), and a new machine measures only its cost curve to choose its own tree
(`choose`, called by `medusa_heads.tuning`).

An EAGLE-style draft grows its own trees, so there is nothing to replay: its record (`DynamicRecord`,
dynamic.json) is the accepted length that greedy decoding of the answers measures with each
`DYNAMIC_SHAPES` tree, also the same on any machine; a machine then measures each shape's step cost and
takes the best accepted length per cost (`choose_dynamic`).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from . import lookup
from .accuracy import accuracy_table, head_ranks, rank_hits
from .decoding import Decoding
from .generate import make_decoder
from .lookup import first_difference
from .tree import DynamicTree, Tree

LOOKUPS = (0, 2, 4, 6, 8, 12)  # prompt-lookup branch lengths tried
TOLERANCE = 0.03  # replayed speed-ups this close to the best count as equal (c's spread over probes, 1-3 %)


@dataclass
class Steps:
    """What greedy decoding of one known answer meets at each step i (whose root is answer token i)."""

    ranks: list[tuple[int, ...]]  # where each head ranked its target (`accuracy.head_ranks`)
    drafts: list[tuple[int, int]]  # the prompt-lookup draft (of max(LOOKUPS) tokens): (tokens, right ones)


class SavedRecord:
    """A record of what some heads do, saved as JSON in their folder (`FILE`); its fingerprint keys the tuning."""

    FILE: str

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | Path):
        return cls.from_json(json.loads(Path(path).read_text()))

    @classmethod
    def from_json(cls, data: dict):
        return cls(**data)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the whole record, computed once (every decoder's tuning key holds it)."""
        return hashlib.sha256(json.dumps(asdict(self)).encode()).hexdigest()[:16]


@dataclass
class Record(SavedRecord):
    """What some heads do on the model's greedy answers to a set of prompts, on any machine."""

    accuracy_top_r: list[list[float]]  # per head, top-1..r accuracy (cumulative over ranks)
    targets: list[int]  # per head, the steps that had a target
    answers: list[Steps]  # the replay record of each answer
    max_new_tokens: int

    FILE = "replay.json"  # its name in a heads folder

    @classmethod
    def from_json(cls, data: dict) -> Record:
        answers = [Steps([tuple(r) for r in a["ranks"]], [tuple(d) for d in a["drafts"]]) for a in data["answers"]]
        return cls(data["accuracy_top_r"], data["targets"], answers, data["max_new_tokens"])


def record_steps(model, sequence: torch.Tensor, start: int, max_rank: int) -> tuple[Steps, torch.Tensor]:
    """The replay record of an answer (prompt + answer tokens, the answer from `start` on), and its head ranks."""
    ranks = head_ranks(model, sequence, start, max_rank)
    tokens = sequence.tolist()
    drafts = []
    for i in range(len(tokens) - start):
        draft = lookup.continuation(tokens[: start + i + 1], max(LOOKUPS))
        right = first_difference(draft, tokens[start + i + 1 :])  # the drafted tokens decoding would accept
        drafts.append((len(draft), right))
    return Steps([tuple(column) for column in ranks.T.tolist()], drafts), ranks


def replay(steps: Steps, tree: Tree, cost: Callable[[int], float]) -> tuple[int, int, float]:
    """Greedy decoding of a recorded answer with this tree: (tokens, steps with the prefill, summed
    cost of the steps after it). A step accepts the longest tree path whose head ranks all hit, or
    the right part of the lookup draft, whichever is longer, then the bonus token."""
    paths, length = set(tree.paths), len(steps.drafts)
    i, count, spent = 0, 1, 0.0  # the prefill emits answer token 0
    while i + 1 < length:
        ranks, (drafted, right) = steps.ranks[i], steps.drafts[i]
        heads = 0
        while heads < tree.depth and ranks[: heads + 1] in paths:
            heads += 1
        i += max(heads, min(right, tree.lookup)) + 1
        count += 1
        spent += cost(tree.head_size + min(drafted, tree.lookup))
    return length, count, spent


def interpolate(tokens: list[int], costs: list[float]) -> Callable[[int], float]:
    """c at any number of tokens: piecewise linear through the measured points, extended past the last."""
    slope = (costs[-1] - costs[-2]) / (tokens[-1] - tokens[-2]) if len(tokens) > 1 else 0.0

    def cost(n: int) -> float:
        return float(np.interp(n, tokens, costs)) + max(0, n - tokens[-1]) * slope

    return cost


def nondecreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of values (pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (mean, count) of runs of pooled values
    for value in values:
        mean, count = value, 1
        while blocks and blocks[-1][0] > mean:
            previous, n = blocks.pop()
            mean, count = (previous * n + mean * count) / (n + count), n + count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


def rank_accuracy(accuracy_top_r: list[list[float]]) -> list[list[float]]:
    """Probability that head k's rank-r guess is right: differences of the cumulative top-r accuracies."""
    cumulative = torch.tensor(accuracy_top_r, dtype=torch.float64)
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
def record_answers(model, prompts: list[torch.Tensor], max_new_tokens: int, max_rank: int = 10) -> Record:
    """The replay record of the model's greedy answer to each prompt, with the heads' accuracies over all."""
    answers, ranks = [], []
    for ids in prompts:
        out = model.generate(ids, max_new_tokens=max_new_tokens, tree="plain")
        steps, r = record_steps(model, out.sequences[0].to(model.device), start=ids.shape[1], max_rank=max_rank)
        answers.append(steps)
        ranks.append(r)
    hits, counts = rank_hits(torch.cat(ranks, dim=1), max_rank)
    return Record(accuracy_table(hits, counts), counts.tolist(), answers, max_new_tokens)


def paired_cost(model, ids: torch.Tensor, tree: Tree, steps: int = 8) -> float:
    """c of one tree: the time of its decoding steps over that of plain ones, the two alternating step by step
    (after a prefill and a first step each) so that drift and bursts on a shared machine hit both alike."""
    loops = []
    for each in (Tree([], name="plain"), tree):
        enough = (steps + 2) * (each.depth + 1)  # never runs out before the last timed step
        loop = make_decoder(model, ids, Decoding(max_new_tokens=enough, tree=each), eos_token_id=[]).steps()
        next(loop)  # prefill
        next(loop)  # a first step warms up
        loops.append(loop)
    spent = [0.0, 0.0]
    for _ in range(steps):
        for i, loop in enumerate(loops):
            start = time.perf_counter()
            next(loop)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            spent[i] += time.perf_counter() - start
    return spent[1] / spent[0]


def cost_curve(model, ids: torch.Tensor, trees: list[Tree], steps: int = 8, rounds: int = 5,
               progress: Callable[[], None] | None = None) -> list[float]:
    """c(n) for each tree relative to a plain decoding step (`paired_cost`), the median over rounds that each
    measure every tree."""
    costs: list[list[float]] = [[] for _ in trees]
    for _ in range(rounds):
        for i, tree in enumerate(trees):
            costs[i].append(paired_cost(model, ids, tree, steps))
            if progress:
                progress()
    return [sorted(c)[len(c) // 2] for c in costs]


def pick(options: list[tuple], tolerance: float) -> tuple:
    """Of (speed-up, cost of a step, ...) options, the one with the cheapest steps among those whose speed-up
    is within tolerance of the best."""
    fastest = max(option[0] for option in options)
    return min((option for option in options if option[0] >= (1 - tolerance) * fastest), key=lambda o: o[1])


SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # head nodes of the trees whose cost is measured


def choose(model, record: Record, ids: torch.Tensor, max_nodes: int = 64, sizes: list[int] | None = None,
           tolerance: float = TOLERANCE, steps: int = 8, rounds: int = 5,
           progress: Callable[[], None] | None = None) -> dict:
    """This device's tree for these heads: the best tree of each size from the record's accuracies,
    the cost of each measured here (decoding steps from prompt ids), every (tree, lookup) replayed
    over the record's answers, and the pick. Returns the chosen tree, the table and the cost curve."""
    candidates = best_trees(rank_accuracy(record.accuracy_top_r), max_nodes)
    # n = 0 is plain decoding (c = 1): chosen when no tree pays for itself, e.g. with untrained heads
    sizes = sizes or sorted({n for n in SIZES if n <= max_nodes} | {max_nodes})
    chosen_rows = [(n, *candidates[n]) for n in sizes if n < len(candidates)]
    if not chosen_rows:
        raise ValueError(f"no tree size in {sizes} is possible with at most {len(candidates) - 1} nodes")
    measured = cost_curve(model, ids, [tree for _, tree, _ in chosen_rows], steps, rounds, progress)
    widths = [1] + [n + 1 for n, _, _ in chosen_rows if n > 0]  # the plain step, then each tree's pass
    costs = [1.0] + [c for (n, _, _), c in zip(chosen_rows, measured, strict=True) if n > 0]
    fitted = nondecreasing(costs)
    cost = interpolate(widths, fitted)
    table, options = [], []  # options: (replayed speed-up, cost of a step, head tree, lookup tokens)
    for (n, tree, expected), raw in zip(chosen_rows, measured, strict=True):
        c = cost(n + 1)
        replays = []
        for lookup_tokens in LOOKUPS:
            candidate = tree.with_lookup(lookup_tokens)
            tokens, count, spent = map(sum, zip(*(replay(r, candidate, cost) for r in record.answers), strict=True))
            speedup = (tokens - len(record.answers)) / spent  # plain decoding spends c = 1 per token after the first
            step_cost = spent / max(1, count - len(record.answers))
            replays.append({"lookup": lookup_tokens, "accepted_length": tokens / count, "speedup": speedup,
                            "step_cost": step_cost})
            options.append((speedup, step_cost, tree, lookup_tokens))
        table.append({"nodes": n, "expected_accepted_length": expected, "measured_cost": raw, "cost": c,
                      "expected_speedup": expected / c, "replay": replays})
    _, _, tree, lookup_tokens = pick(options, tolerance)
    tree = Tree([list(p) for p in tree.paths], name="calibrated").with_lookup(lookup_tokens)
    return {"tree": tree, "table": table, "cost_curve": {"tokens": widths, "cost": fitted}}


DYNAMIC_SHAPES = ("dynamic-2x1x1", "dynamic-3x2x1", "dynamic-5x4x1", "dynamic-8x3x3", "dynamic-12x4x3",
                  "dynamic-16x4x4", "dynamic-24x5x4", "dynamic-32x6x6", "dynamic-48x6x8", "dynamic-64x7x8",
                  "dynamic-2x1x1+lookup4", "dynamic-2x1x1+lookup8", "dynamic-3x2x1+lookup4", "dynamic-3x2x1+lookup8",
                  "dynamic-8x3x3+lookup4", "dynamic-8x3x3+lookup8",
                  "dynamic-16x4x4+lookup8")  # an EAGLE draft's candidates
VERIFY_LADDER = (2, 4, 8, 12, 16, 24, 32)  # tokens verified by the shapes (two draft rounds of top-6: the same
# draft work for all) that measure what each further verified token costs: a lookup branch's, whose length a
# random probe prompt never shows


@dataclass
class DynamicRecord(SavedRecord):
    """The accepted length of an EAGLE-style draft with each dynamic tree, on the model's greedy answers to a
    set of prompts (the same on any machine), and how many tokens its steps verified."""

    accepted_length: dict[str, float]  # DynamicTree name -> tokens per step, prefill included
    verified: dict[str, float]  # DynamicTree name -> tokens verified per decoding step: its nodes and lookup drafts
    prompts: int
    max_new_tokens: int

    FILE = "dynamic.json"  # its name in a heads folder

    @classmethod
    def from_json(cls, data: dict) -> DynamicRecord:
        if "verified" not in data:
            raise OutdatedRecord("it lacks the tokens its steps verified")
        return cls(**data)


class OutdatedRecord(ValueError):
    """A saved record from an older version, which lacks what choosing a tree now needs."""


def load_record(directory: str | Path) -> Record | DynamicRecord | None:
    """The record saved in a heads folder (Medusa heads' replay record, or an EAGLE draft's), if any; an
    outdated one is ignored, with a warning that says how to record it again."""
    for kind in (Record, DynamicRecord):
        if (Path(directory) / kind.FILE).exists():
            try:
                return kind.load(Path(directory) / kind.FILE)
            except OutdatedRecord as e:
                warnings.warn(f"{Path(directory) / kind.FILE} is ignored: {e}; run `medusa calibrate --heads "
                              f"{directory}` to record it again", stacklevel=2)
    return None


@torch.inference_mode()
def record_dynamic(model, prompts: list[torch.Tensor], max_new_tokens: int,
                   shapes: tuple[str, ...] = DYNAMIC_SHAPES) -> DynamicRecord:
    """Greedy-decode every prompt with every shape; the accepted length of each and the tokens its steps
    verified (all shapes give the same tokens, so each is measured on the same answers)."""
    accepted, verified = {}, {}
    for name in shapes:
        outputs = [model.generate(ids, max_new_tokens=max_new_tokens, tree=name) for ids in prompts]
        accepted[name] = sum(len(o.new_tokens[0]) for o in outputs) / sum(o.steps for o in outputs)
        verified[name] = sum(sum(o.verified[0]) for o in outputs) / max(1, sum(len(o.verified[0]) for o in outputs))
    return DynamicRecord(accepted, verified, len(prompts), max_new_tokens)


def timed_shapes(record: DynamicRecord) -> list[DynamicTree]:
    """The shapes `choose_dynamic` times: each recorded one without its lookup branch, then (if some shape has
    a lookup branch) the `VERIFY_LADDER`."""
    shapes = [Tree.load(name) for name in record.accepted_length]
    ladder = _ladder() if any(shape.lookup for shape in shapes) else []
    return list(dict.fromkeys([replace(shape, lookup=0) for shape in shapes] + ladder))


def _ladder() -> list[DynamicTree]:
    return [DynamicTree(n, 2, 6) for n in VERIFY_LADDER]


def choose_dynamic(model, record: DynamicRecord, ids: torch.Tensor, tolerance: float = TOLERANCE, steps: int = 8,
                   rounds: int = 5, progress: Callable[[], None] | None = None) -> dict:
    """This device's dynamic tree: the step cost of each recorded shape here (relative to a plain step), and of
    those whose accepted length per cost is within tolerance of the best, the one whose steps cost least.

    A shape's steps are timed without its lookup branch (on the probe's prompt a lookup drafts nothing), and
    the branch adds what verifying the recorded mean of lookup tokens costs: the difference, on the
    `VERIFY_LADDER` shapes, between verifying the shape's nodes and them plus those tokens. Returns the
    chosen tree, the table and the cost curve (by tokens verified per step)."""
    shapes = [Tree.load(name) for name in record.accepted_length]
    timed = timed_shapes(record)
    costs = dict(zip(timed, cost_curve(model, ids, timed, steps, rounds, progress), strict=True))
    if any(shape.lookup for shape in shapes):
        verify = interpolate(list(VERIFY_LADDER), nondecreasing([costs[shape] for shape in _ladder()]))
    table, options = [], [(1.0, 1.0, Tree([], name="plain"))]
    for shape in shapes:
        accepted, cost = record.accepted_length[shape.name], costs[replace(shape, lookup=0)]
        if shape.lookup:
            cost += verify(record.verified[shape.name]) - verify(shape.tokens)
        table.append({"tree": shape.name, "accepted_length": accepted, "cost": cost, "speedup": accepted / cost})
        options.append((accepted / cost, cost, shape))
    _, _, tree = pick(options, tolerance)
    curve = sorted({shape.tokens: costs[replace(shape, lookup=0)] for shape in shapes}.items())
    return {"tree": tree, "table": table,
            "cost_curve": {"tokens": [1] + [n for n, _ in curve], "cost": [1.0] + [c for _, c in curve]}}


def calibrate(model, prompts: list[torch.Tensor], max_new_tokens: int = 128, max_nodes: int = 64,
              sizes: list[int] | None = None, max_rank: int = 10, tolerance: float = TOLERANCE) -> dict:
    """Record the heads on the prompts' answers, then choose this device's tree: `choose`'s result and the
    record (which the model carries from then on)."""
    model.record = None  # (while it changes, decoders probe only the kernel routes: see medusa_heads.tuning)
    record = record_answers(model, prompts, max_new_tokens, max_rank)
    result = choose(model, record, prompts[0], max_nodes, sizes, tolerance)
    model.record = record
    return {**result, "record": record}
