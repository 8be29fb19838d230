"""Per request, the tree follows what is accepted; the tokens stay those of plain decoding."""

import pytest
import torch
from conftest import ARCHS, hf_greedy, medusa_tiny

from medusa_heads import adaptive
from medusa_heads.decoding import Decoding
from medusa_heads.generate import make_decoder


def test_lookup_budget_grows_after_a_right_draft_and_shrinks_after_a_wrong_one():
    assert adaptive.next_lookup_budget(4, drafted=4, right=4, most=12) == 6
    assert adaptive.next_lookup_budget(11, drafted=3, right=3, most=12) == 12  # a short draft, all right
    assert adaptive.next_lookup_budget(4, drafted=4, right=2, most=12) == 3
    assert adaptive.next_lookup_budget(1, drafted=1, right=0, most=12) == 1
    assert adaptive.next_lookup_budget(5, drafted=0, right=0, most=12) == 5  # no match: nothing learnt


def test_heads_threshold_from_the_cost_curve():
    curve = {"tokens": [1, 5, 9], "cost": [1.0, 1.2, 1.6]}
    assert adaptive.heads_threshold(curve, head_size=9) == pytest.approx(0.6)
    assert adaptive.heads_threshold(curve, head_size=7) == pytest.approx(0.4)
    assert adaptive.heads_threshold(None, head_size=9) is None


def test_head_depth_is_the_deepest_node_whose_path_was_emitted():
    # root, then nodes [0], [1], [0, 0], [1, 0] (depths 1, 1, 2, 2; parents 0, 0, 1, 2)
    depths = torch.tensor([0, 1, 1, 2, 2])
    parents = [0, 0, 0, 1, 2]
    mask = torch.eye(5, dtype=torch.bool)
    for i in range(1, 5):
        mask[i] |= mask[parents[i]]
    tokens = torch.tensor([[9, 5, 6, 7, 8],    # emitted 6, 8: node [1] then its child [1, 0]
                           [9, 5, 6, 7, 8],    # emitted 5, 8: node [0]; [0, 0] guessed 7, not 8
                           [9, 5, 6, 7, 8]])   # emitted 4: nothing
    emitted = torch.tensor([[6, 8, 0], [5, 8, 0], [4, 0, 0]])
    count = torch.tensor([1, 1, 0])  # accepted candidates (the last emitted token is the bonus)
    assert adaptive.head_depths(tokens, emitted, count, depths, mask).tolist() == [2, 1, 0]
    # a node is not right beyond the tokens emitted, even where the padding equals its guess
    assert adaptive.head_depths(tokens[:1], torch.tensor([[6, 8, 0]]), torch.tensor([0]), depths, mask).tolist() == [1]


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_turned_off_keep_the_tokens_and_come_back(arch, monkeypatch):
    model = medusa_tiny(arch)
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 6]])
    drafts = []
    real = model.heads.draft
    monkeypatch.setattr(model.heads, "draft", lambda *a: drafts.append(1) or real(*a))
    decoder = make_decoder(model, ids, Decoding(max_new_tokens=32, tree="default+lookup6", adapt=True), eos_token_id=[])
    decoder.heads_threshold = 99.0  # no head depth pays: heads only on the refresh steps
    for _ in decoder.steps():
        pass
    row = decoder._rows[0]
    assert row.tokens == hf_greedy(model.base_model, ids, 32)[0, ids.shape[1]:].tolist()
    steps = len(row.accept_lengths) - 1
    assert 1 <= len(drafts) <= 1 + steps // adaptive.REFRESH  # the first step (unmeasured) and the refreshes
    assert row.head_depth is not None


def test_lookup_budget_follows_each_row_and_static_keeps_the_tree():
    model = medusa_tiny("llama")
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    adapted = make_decoder(model, ids, Decoding(max_new_tokens=40, tree="plain+lookup12", adapt=True), eos_token_id=[])
    static = make_decoder(model, ids, Decoding(max_new_tokens=40, tree="plain+lookup12"), eos_token_id=[])
    budgets = []
    for _ in adapted.steps():
        budgets.append(adapted._rows[0].lookup_budget)
    for _ in static.steps():
        assert static._rows[0].lookup_budget == 12
    assert len(set(budgets)) > 1 and min(budgets) < 12
    assert adapted._rows[0].tokens == static._rows[0].tokens
