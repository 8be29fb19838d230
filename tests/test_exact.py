"""Exact acceptance samples from the base model's own distribution (chi-square on 20,000 samples)."""

import numpy as np
import pytest
import torch
from conftest import VOCAB, medusa_tiny

from medusa_heads.acceptance import sampling_probs

SAMPLES = 20_000
PROMPT = [3, 4, 5, 6]
REPEATING = [3, 4, 5, 6, 2, 7, 3, 0, 10, 6, 2, 7]  # greedy goes on 3 0 10: what the lookup branch drafts


def exact_joint(base, temperature: float, top_p: float, prompt: list[int] = PROMPT) -> np.ndarray:
    """p(t1, t2, t3) of plain sampling, computed from the model over every prefix: (V, V, V)."""
    joint = torch.ones(())
    prefixes = [[]]
    for _ in range(3):
        ids = torch.tensor([prompt + p for p in prefixes])
        with torch.no_grad():
            logits = base(ids).logits[:, -1]
        probs = sampling_probs(logits, temperature, top_p).double()  # (prefixes, V)
        joint = (joint.reshape(-1, 1) * probs).reshape(-1)
        prefixes = [[*p, t] for p in prefixes for t in range(VOCAB)]
    return joint.reshape(VOCAB, VOCAB, VOCAB).numpy()


def sampled_counts(model, acceptance: str, temperature: float, top_p: float, prompt: list[int] = PROMPT,
                   tree: str = "dense-3x2"):
    ids = torch.tensor([prompt]).repeat(SAMPLES, 1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, tree=tree,
                         acceptance=acceptance, temperature=temperature, top_p=top_p, eos_token_id=[], seed=1234)
    counts = np.zeros((VOCAB,) * 3)
    for t1, t2, t3 in out.new_tokens:
        counts[t1, t2, t3] += 1
    from_tree = np.mean([lengths[1] >= 2 for lengths in out.accept_lengths])  # t2 was a tree candidate
    return counts, from_tree


def chi_square_tail(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square distributed with dof degrees of freedom."""
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(statistic / 2, dtype=torch.float64)).item()


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit on the (t1, t2) joint and on t3's marginal, cells with < 5 expected pooled."""
    pvalues = []
    for axes in [(2,), (0, 1)]:
        observed, expected = counts.sum(axis=axes).ravel(), probs.sum(axis=axes).ravel() * counts.sum()
        impossible = expected == 0
        if observed[impossible].any():  # a token outside the top-p nucleus was emitted
            return 0.0
        observed, expected = observed[~impossible], expected[~impossible]
        small = expected < 5
        if small.any():
            observed = np.append(observed[~small], observed[small].sum())
            expected = np.append(expected[~small], expected[small].sum())
        expected *= observed.sum() / expected.sum()
        pvalues.append(chi_square_tail(((observed - expected) ** 2 / expected).sum(), len(observed) - 1))
    return min(pvalues)


@pytest.fixture(scope="module")
def model():
    return medusa_tiny("llama", num_heads=2, seed=3).float()  # float32: numerics do not matter here


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_exact_matches_the_base_distribution(model, temperature, top_p):
    counts, from_tree = sampled_counts(model, "exact", temperature, top_p)
    assert from_tree > 0.1  # thousands of rows took token 2 (and maybe 3) from the tree
    assert chi_square_p(counts, exact_joint(model.base_model, temperature, top_p)) > 1e-3


def test_exact_with_a_lookup_branch_matches_the_base_distribution(model):
    """The lookup draft always repeats one of the heads' guesses (they cover the vocabulary): exact
    acceptance must not count that token twice (a second sample there would favour the draft)."""
    # a low temperature makes the drafted path likely, so a bias towards it would show (p ~ 1e-29)
    counts, _ = sampled_counts(model, "exact", 0.1, 1.0, REPEATING, f"dense-{VOCAB}x1+lookup2")
    assert chi_square_p(counts, exact_joint(model.base_model, 0.1, 1.0, REPEATING)) > 1e-3


def test_a_lossy_sampler_fails_the_same_test(model):
    counts, _ = sampled_counts(model, "typical", 1.0, 1.0)
    assert chi_square_p(counts, exact_joint(model.base_model, 1.0, 1.0)) < 1e-6

