"""Acceptance rules as pure functions, on hand-made trees and logits."""

import math

import pytest
import torch

from medusa_heads import Sampling, Tree
from medusa_heads.acceptance import accept, longest_path, repeats_a_sibling, sampling_probs, typical_accept

TREE = Tree([[0], [1], [0, 0], [0, 1], [1, 0]])  # nodes: root, a=(0), b=(1), aa, ab, ba


def one_hot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.full((1, len(targets), vocab), -10.0)
    logits[0, torch.arange(len(targets)), torch.tensor(targets)] = 10.0
    return logits


def test_greedy_takes_the_longest_agreeing_path_and_the_bonus():
    tokens = torch.tensor([[5, 3, 4, 6, 7, 1]])
    # base argmax at each node: root -> 4 (so b is right), b -> 1 (so ba is right), ba -> 2 (bonus)
    logits = one_hot_logits([4, 0, 1, 0, 0, 2])
    result = accept(tokens, logits, TREE.parents, TREE.retrieve, Sampling("greedy"))
    assert result.count.tolist() == [2]
    assert result.path.tolist() == [[0, 2, 5]]
    assert result.next_token.tolist() == [2]


def test_greedy_with_nothing_accepted_emits_the_root_prediction():
    tokens = torch.tensor([[5, 3, 4, 6, 7, 1]])
    logits = one_hot_logits([0, 0, 0, 0, 0, 0])
    result = accept(tokens, logits, TREE.parents, TREE.retrieve, Sampling("greedy"))
    assert result.count.tolist() == [0] and result.next_token.tolist() == [0]


def test_typical_threshold_by_hand():
    # p = (0.5, 0.3, 0.2): H = 1.0297 nats; delta * exp(-H) = 0.3 * 0.3571 = 0.1071; min(0.09, .) = 0.09
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert typical_accept(probs, torch.tensor(2), 0.09, 0.3)  # 0.2 > 0.09
    assert not typical_accept(probs, torch.tensor(3), 0.09, 0.3)  # 0 < 0.09
    # p = (0.6, 0.33, 0.07): delta * exp(-H) = 0.127 > epsilon = 0.05, so the threshold is epsilon and
    # 0.07 passes (a max() of the two would reject it); with epsilon = 0.2 the threshold is 0.127
    probs = torch.tensor([0.6, 0.33, 0.07])
    entropy = -sum(p * math.log(p) for p in (0.6, 0.33, 0.07))
    assert 0.07 < 0.3 * math.exp(-entropy) < 0.2
    assert typical_accept(probs, torch.tensor(2), 0.05, 0.3)
    assert not typical_accept(probs, torch.tensor(2), 0.2, 0.3)
    # a flat distribution over 8 tokens: H = ln 8, delta * exp(-H) = 0.3 / 8 = 0.0375 < epsilon
    flat = torch.full((8,), 1 / 8)
    assert typical_accept(flat, torch.tensor(0), 0.09, 0.3)  # 0.125 > 0.0375
    assert not typical_accept(flat, torch.tensor(0), 0.2, 4.0)  # threshold min(0.2, 0.5) = 0.2


def test_typical_breaks_ties_by_summed_log_probability():
    accepted = torch.tensor([[True, True, True, False, False, False]])  # a and b both pass, no grandchild
    score = torch.tensor([[0.0, -2.0, -0.5, 0.0, 0.0, 0.0]])
    path, count = longest_path(accepted, TREE.retrieve, score)
    assert count.tolist() == [1] and path[0, 1].item() == 2  # b wins: -0.5 > -2.0


def test_exact_follows_the_samples():
    tokens = torch.tensor([[5, 3, 4, 6, 7, 1]])
    logits = one_hot_logits([3, 6, 0, 0, 0, 0]) * 10  # samples are certain: root -> 3 = a, a -> 6 = aa
    result = accept(tokens, logits, TREE.parents, TREE.retrieve, Sampling("exact", temperature=1.0))
    assert result.path.tolist() == [[0, 1, 3]] and result.count.tolist() == [2]


def test_exact_tests_only_the_first_of_equal_siblings():
    tree = Tree([[0], [1]], lookup=2)  # root, a, b, then the lookup chain l1 -> l2
    tokens = torch.tensor([[5, 3, 4, 3, 6]])  # l1 repeats a
    assert repeats_a_sibling(tokens, tree.parents).tolist() == [[False, False, False, True, False]]
    logits = one_hot_logits([3, 7, 0, 6, 0]) * 10  # samples: root -> 3, a -> 7, l1 -> 6
    exact = accept(tokens, logits, tree.parents, tree.retrieve, Sampling("exact", temperature=1.0))
    assert exact.path[0, : exact.count + 1].tolist() == [0, 1] and exact.next_token.tolist() == [7]
    greedy = accept(tokens, logits, tree.parents, tree.retrieve, Sampling("greedy"))
    assert greedy.path.tolist() == [[0, 3, 4]] and greedy.next_token.tolist() == [0]  # greedy takes either


def test_top_p_keeps_the_smallest_nucleus():
    probs = sampling_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), temperature=1.0, top_p=0.8)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(sampling_probs(torch.tensor([0.0, 0.0]), 2.0), torch.tensor([0.5, 0.5]))


def test_tiny_temperature_and_top_p_still_give_a_distribution():
    # 5e-324 is the smallest float64 and 0 in float32: the most likely token must still be kept
    assert torch.equal(sampling_probs(torch.tensor([[1.0, 3.0, 2.0, 2.5]]), 1.0, top_p=5e-324),
                       torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(sampling_probs(torch.tensor([[1.0, 3.0, 2.0, 3.0]]), 5e-324),
                       torch.tensor([[0.0, 0.5, 0.0, 0.5]]))


def test_sampling_needs_a_temperature():
    with pytest.raises(ValueError, match="temperature > 0"):
        Sampling("exact", temperature=0)
    with pytest.raises(ValueError, match="acceptance must be one of"):
        Sampling("lossy")
