"""Heads start as exact copies of the base model's next-token logits; layers are distinct modules."""

import pytest
import torch
from conftest import ARCHS, medusa_tiny, tiny_model

from medusa_heads import HeadsConfig, MedusaHeads, MedusaModel, Tree
from medusa_heads.adapter import decoder, lm_head


def last_hidden(base, ids):
    return decoder(base)(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("projection", ["own", "shared"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_heads_return_base_logits(arch, projection):
    base = tiny_model(arch, tied=arch in ("llama", "gpt2"))
    model = MedusaModel.from_pretrained(base, num_heads=3, projection=projection)
    hidden = last_hidden(base, torch.tensor([[3, 4, 5, 6]]))
    head_logits = model.heads(hidden)
    assert head_logits.shape == (3, 1, 4, base.config.vocab_size)
    for k in range(3):
        assert torch.equal(head_logits[k], lm_head(base)(hidden))


@pytest.mark.integration
@pytest.mark.parametrize("projection", ["own", "shared"])
def test_fresh_heads_on_default_model(default_model, projection):
    base = default_model.base_model
    heads = MedusaHeads(HeadsConfig(3, 1, projection, 576, 49152), lm_head(base))
    hidden = last_hidden(base, default_model.chat_ids("Hi there"))
    head_logits = heads(hidden)
    for k in range(3):
        assert torch.equal(head_logits[k], lm_head(base)(hidden))


def test_layers_are_distinct_parameters():
    base = tiny_model("llama")
    model = MedusaModel.from_pretrained(base, num_heads=2, num_layers=3)
    linears = [block.linear for head in model.heads.blocks for block in head]
    assert len(linears) == 6
    assert len({id(lin.weight) for lin in linears}) == 6
    assert len({lin.weight.data_ptr() for lin in linears}) == 6
    with torch.no_grad():
        linears[0].weight.fill_(1.0)
    assert all(torch.count_nonzero(lin.weight) == 0 for lin in linears[1:])


def test_own_projection_is_a_copy_not_a_tie():
    base = tiny_model("llama", tied=True)
    model = MedusaModel.from_pretrained(base, num_heads=2, projection="own")
    proj = model.heads.projections[0]
    assert proj.weight.data_ptr() != lm_head(base).weight.data_ptr()
    with torch.no_grad():
        proj.weight.add_(1.0)
    assert not torch.equal(proj.weight, lm_head(base).weight)


def test_shared_projection_has_no_vocabulary_weights():
    base = tiny_model("qwen2")
    model = MedusaModel.from_pretrained(base, num_heads=4, projection="shared")
    assert all("projection" not in k for k in model.heads.state_dict())
    assert sum(p.numel() for p in model.heads.parameters()) == 4 * (32 * 32 + 32)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="projection"):
        HeadsConfig(projection="tied")
    with pytest.raises(ValueError, match="num_heads"):
        HeadsConfig(num_heads=0)
    with pytest.raises(ValueError, match="need next_token=True"):
        HeadsConfig(chained=True)


@pytest.mark.parametrize(("kind", "projection"), [("plain", "own"), ("next_token", "shared"), ("chained", "own"),
                                                  ("chained", "shared")])
def test_a_tree_drafts_each_node_from_its_own_path(kind, projection):
    """Every candidate is the rank its path names among the guesses of the head at its depth, that
    head reading the path above it (chained heads), or only the root (the others)."""
    model = medusa_tiny("llama", num_heads=3, projection=projection, draft_vocab=12 if projection == "shared" else 0,
                        next_token=kind != "plain", chained=kind == "chained")
    tree = Tree([[0, 0, 0], [1, 0, 1], [2, 1], [0, 2], [1, 1, 0]])
    hidden, root = torch.randn(2, model.config.hidden_size), torch.tensor([3, 9])
    candidates = model.heads.draft(hidden, root, tree.levels(), tree.topk)
    for b in range(2):
        for i, path in enumerate(tree.paths):
            above = [candidates[b, tree.paths.index(path[:j])].item() for j in range(1, len(path))]
            tokens = torch.tensor([[root[b].item(), *above] + [0] * (3 - len(path))])
            guesses = model.heads.propose(hidden[b : b + 1], tree.topk, tokens=tokens)  # (K, 1, topk)
            assert candidates[b, i] == guesses[len(path) - 1, 0, path[-1]], (b, path)
    if kind == "chained":  # the root alone is not enough for them
        with pytest.raises(ValueError, match="path's tokens"):
            model.heads(hidden, tokens=root)


def test_draft_vocabulary_projects_onto_the_chosen_rows_only():
    base = tiny_model("qwen2")
    model = MedusaModel.from_pretrained(base, num_heads=2, projection="shared", draft_vocab=5)
    chosen = torch.tensor([3, 7, 11, 12, 15])
    model.heads.set_token_map(chosen)
    hidden = last_hidden(base, torch.tensor([[3, 4, 5, 6]]))
    full = lm_head(base)(hidden)
    torch.testing.assert_close(model.heads(hidden)[1], full[..., chosen], rtol=0, atol=1e-12)  # float64
    best = full[..., chosen].topk(2, dim=-1).indices
    assert torch.equal(model.heads.propose(hidden, 2)[0], chosen[best])  # token ids, not draft positions
    assert model.heads.draft_index(torch.tensor([7, 8, 15])).tolist() == [1, -1, 4]
    with pytest.raises(ValueError, match="draft_vocab needs projection='shared'"):
        HeadsConfig(projection="own", vocab_size=10, draft_vocab=5)
