"""Tree buffers: mask, depths, levels, retrieve paths, presets and errors."""

import json

import pytest
import torch

from medusa_heads import Tree


def test_buffers_of_a_small_tree():
    tree = Tree([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert tree.paths == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert tree.size == 6 and tree.depth == 2 and tree.topk == 2
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.parents.tolist() == [0, 0, 0, 1, 1, 2]
    levels = [{k: v.tolist() for k, v in vars(level).items()} for level in tree.levels()]
    assert levels == [
        dict(sources=[0], parents=[0], children=[1, 2], source_of_child=[0, 0], ranks=[0, 1]),
        dict(sources=[1, 2], parents=[0, 0], children=[3, 4, 5], source_of_child=[0, 0, 1], ranks=[0, 1, 0]),
    ]
    expected_mask = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.mask, expected_mask)
    assert tree.retrieve.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    deeper = Tree([[0, 0, 0], [1, 0, 1]]).levels()[2]  # nodes 3 (0, 0) and 4 (1, 0) hang from 1 and 2
    assert (deeper.sources.tolist(), deeper.parents.tolist(), deeper.children.tolist()) == ([3, 4], [0, 1], [5, 6])


def test_missing_prefixes_are_added_and_duplicates_merged():
    tree = Tree([[2, 1], [2, 1], [0]])
    assert tree.paths == [(0,), (2,), (2, 1)]
    assert tree.retrieve.tolist() == [[0, 1, -1], [0, 2, 3]]


def test_a_lookup_branch_is_a_chain_after_the_head_nodes():
    tree = Tree([[0], [1], [0, 0]], lookup=3)
    assert tree.head_size == 4 and tree.size == 7 and tree.depth == 2 and tree.lookup == 3
    assert tree.parents.tolist() == [0, 0, 0, 1, 0, 4, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 1, 2, 3]
    assert [level.children.tolist() for level in tree.levels()] == [[1, 2], [3]]  # head nodes only
    assert tree.retrieve.tolist() == [[0, 2, -1, -1], [0, 1, 3, -1], [0, 4, 5, 6]]
    assert tree.mask[6].tolist() == [True, False, False, False, True, True, True]
    plain = Tree.load("plain+lookup2")
    assert plain.head_size == 1 and plain.depth == 0 and plain.retrieve.tolist() == [[0, 1, 2]]


def test_lookup_presets_and_round_trip(tmp_path):
    tree = Tree.load("reference+lookup5")
    assert tree.lookup == 5 and tree.paths == Tree.load("reference").paths and tree.name == "reference+lookup5"
    assert Tree.load("reference+lookup5+lookup0").lookup == 0
    tree.save(tmp_path / "t.json")
    again = Tree.load(tmp_path / "t.json")
    assert again.lookup == 5 and again.paths == tree.paths and again.size == 64 + 5
    with pytest.raises(ValueError, match="lookup must be a number of tokens >= 0"):
        Tree([[0]], lookup=-1)


def test_reference_tree_matches_the_paper():
    tree = Tree.load("reference")
    assert tree.size == 64 and tree.depth == 4
    assert torch.bincount(tree.depths)[1:].tolist() == [10, 28, 23, 2]
    assert tree.retrieve.shape[0] == 42


def test_presets():
    assert Tree.load("plain").size == 1
    chain = Tree.load("chain-3")
    assert chain.paths == [(0,), (0, 0), (0, 0, 0)] and chain.retrieve.tolist() == [[0, 1, 2, 3]]
    dense = Tree.load("dense-3x2")
    assert dense.size == 1 + 3 + 9 and dense.retrieve.shape == (9, 3)
    assert Tree.load("default").depth >= 1


def test_json_file_round_trip(tmp_path):
    tree = Tree([[0], [0, 0], [1]], name="mine")
    tree.save(tmp_path / "t.json", about="test")
    assert json.loads((tmp_path / "t.json").read_text())["about"] == "test"
    again = Tree.load(tmp_path / "t.json")
    assert again.paths == tree.paths and again.name == "mine"
    (tmp_path / "list.json").write_text("[[0], [1]]")
    assert Tree.load(tmp_path / "list.json").size == 3


def test_errors():
    with pytest.raises(ValueError, match="unknown tree 'nope'"):
        Tree.load("nope")
    with pytest.raises(ValueError, match="ranks >= 0"):
        Tree([[0, -1]])
    with pytest.raises(ValueError, match="4 deep but the model has 3 heads"):
        Tree.load("reference").check(num_heads=3, topk_limit=100)
    with pytest.raises(ValueError, match="rank 9, beyond the top-5"):
        Tree.load("reference").check(num_heads=5, topk_limit=5)
