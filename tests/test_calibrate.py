"""Tree calibration: greedy frontier search by hand, and the whole command on a tiny model."""

import itertools
import json
import subprocess
import sys

import pytest
import torch
from conftest import medusa_tiny
from tiny import tiny_model, tiny_tokenizer

from medusa_heads import Tree
from medusa_heads.calibrate import (
    LOOKUPS,
    TOLERANCE,
    Record,
    best_trees,
    calibrate,
    interpolate,
    nondecreasing,
    pick,
    rank_accuracy,
    record_steps,
    replay,
)


def test_frontier_search_by_hand():
    accuracy = [[0.6, 0.2], [0.5, 0.1]]  # head 1 and head 2, ranks 0 and 1
    trees = best_trees(accuracy, max_nodes=5)
    added = [(set(t.paths) - set(prev.paths)).pop() for (prev, _), (t, _) in itertools.pairwise(trees)]
    assert added == [(0,), (0, 0), (1,), (1, 0), (0, 1)]
    assert [round(e, 4) for _, e in trees] == [1.0, 1.6, 1.9, 2.1, 2.2, 2.26]
    assert trees[0][0].size == 1


def test_rank_accuracy_from_cumulative_accuracy():
    cumulative = [[0.3, 0.5, 0.6], [0.1, 0.1, 0.4]]
    assert torch.tensor(rank_accuracy(cumulative)).flatten().tolist() == pytest.approx([0.3, 0.2, 0.1, 0.1, 0.0, 0.3])


@pytest.mark.parametrize("tree", ["reference", "dense-3x2", "default+lookup4", "plain+lookup6", "reference+lookup3"])
def test_replay_takes_the_steps_decoding_takes(tree):
    model = medusa_tiny("llama")
    prompt = torch.tensor([[3, 4, 5]])  # the tiny model soon repeats itself: the lookup branch drafts
    out = model.generate(prompt, max_new_tokens=40, tree=tree, eos_token_id=[])
    assert any(a > 1 for a in out.accept_lengths[0])
    steps, _ = record_steps(model, out.sequences[0], start=prompt.shape[1], max_rank=10)
    tokens, count, spent = replay(steps, Tree.load(tree), cost=lambda n: n)
    assert (tokens, count) == (40, len(out.accept_lengths[0]))
    assert spent >= (count - 1) * Tree.load(tree).head_size


def test_cost_interpolation_extends_the_last_segment():
    cost = interpolate([1, 3, 5], [1.0, 2.0, 2.5])
    assert [cost(n) for n in (1, 2, 3, 4, 5, 7)] == [1.0, 1.5, 2.0, 2.25, 2.5, 3.0]


def test_cost_fit_pools_decreasing_runs():
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert nondecreasing([1.0, 1.3, 1.2, 1.1, 2.0]) == pytest.approx([1.0, 1.2, 1.2, 1.2, 2.0])
    assert nondecreasing([2.0, 1.0]) == [1.5, 1.5]


def test_pick_prefers_cheaper_steps_within_the_tolerance():
    options = [(1.50, 1.3, "fastest"), (1.47, 1.1, "close"), (1.30, 1.0, "slow"), (1.49, 1.6, "wide")]
    assert pick(options, 0.03)[2] == "close"
    assert pick(options, 0.0)[2] == "fastest"
    assert pick(options, 0.2)[2] == "slow"


@pytest.mark.parametrize("next_token", [False, True])
def test_calibrate_on_a_tiny_model(next_token):
    model = medusa_tiny("llama", num_heads=3, next_token=next_token)
    prompts = [torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7, 8, 9]])]
    result = calibrate(model, prompts, max_new_tokens=16, max_nodes=12, sizes=[1, 4, 12])
    assert [row["nodes"] for row in result["table"]] == [1, 4, 12]
    lengths = [row["expected_accepted_length"] for row in result["table"]]
    assert lengths == sorted(lengths) and lengths[0] >= 1.0
    assert all(row["cost"] > 0 for row in result["table"])
    assert all([r["lookup"] for r in row["replay"]] == list(LOOKUPS) for row in result["table"])
    tree = result["tree"]
    assert tree.depth <= 3 and tree.head_size - 1 in (1, 4, 12)
    options = {(row["nodes"], r["lookup"]): (r["speedup"], r["step_cost"])
               for row in result["table"] for r in row["replay"]}
    fastest = max(speedup for speedup, _ in options.values())
    close = [cost for speedup, cost in options.values() if speedup >= (1 - TOLERANCE) * fastest]
    speedup, cost = options[tree.head_size - 1, tree.lookup]  # the tolerance rule: among the close, the cheapest
    assert speedup >= (1 - TOLERANCE) * fastest and cost == min(close)
    assert result["record"].max_new_tokens == 16 and len(result["record"].answers) == 2 and model.record is not None
    out = model.generate(prompts[0], max_new_tokens=16, tree=tree)  # usable as is
    assert torch.equal(out.sequences, model.generate(prompts[0], max_new_tokens=16, tree="plain").sequences)


@pytest.mark.slow
def test_calibrate_command(tmp_path):
    base = tmp_path / "base"
    tiny_model("llama").float().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "turns": [t]}) for i, t in enumerate(["c d e", "f g", "h i j"])))
    trained_on = tmp_path / "distilled.jsonl"
    trained_on.write_text(json.dumps({"id": "1", "conversations": []}) + "\n")
    out = subprocess.run([sys.executable, "-m", "medusa_heads.cli", "calibrate", "--base", str(base), "--prompts",
                          str(prompts), "--out", str(tmp_path / "tree.json"), "--max-new-tokens", "12",
                          "--max-nodes", "8", "--exclude", str(trained_on), "--record", str(tmp_path / "replay.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "replayed accepted length / speed-up" in out.stdout and "tree written" in out.stdout
    assert "greedy answers to 2 prompts" in out.stdout  # the training prompt is held out
    saved = json.loads((tmp_path / "tree.json").read_text())
    assert {"paths", "table", "accuracy_top_r"} <= set(saved)
    tree = Tree.load(tmp_path / "tree.json")
    chose = f"chose {tree.head_size - 1} head nodes (depth {tree.depth}) and a lookup branch of {tree.lookup}"
    assert chose in out.stdout
    record = Record.load(tmp_path / "replay.json")  # what tree=auto chooses from elsewhere
    assert len(record.answers) == 2 and record.max_new_tokens == 12 and record.accuracy_top_r == saved["accuracy_top_r"]
