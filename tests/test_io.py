"""Native heads folders: round trip, and clear errors for anything that does not fit."""

import json

import pytest
import torch
from conftest import medusa_tiny, tiny_model
from safetensors.torch import load_file, save_file

from medusa_heads import MedusaModel
from medusa_heads.io import HeadsFormatError


@pytest.mark.parametrize("projection", ["own", "shared"])
def test_round_trip_gives_identical_logits(tmp_path, projection):
    model = medusa_tiny("llama", num_heads=3, projection=projection)
    model.save_pretrained(tmp_path / "heads")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["num_heads"] == 3 and config["projection"] == projection and config["format_version"] == 1
    loaded = MedusaModel.from_pretrained(model.base_model, heads=tmp_path / "heads")
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)
    assert torch.equal(model.heads(hidden), loaded.heads(hidden))


def test_draft_vocabulary_round_trip(tmp_path):
    model = medusa_tiny("llama", num_heads=2, projection="shared", draft_vocab=6)
    model.heads.set_token_map(torch.tensor([2, 3, 5, 8, 13, 14]))
    model.save_pretrained(tmp_path)
    loaded = MedusaModel.from_pretrained(model.base_model, heads=tmp_path)  # token map and its rows restored
    hidden = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(loaded.heads.propose(hidden, 3), model.heads.propose(hidden, 3))
    assert set(loaded.heads.propose(hidden, 3).unique().tolist()) <= {2, 3, 5, 8, 13, 14}


@pytest.fixture
def saved(tmp_path):
    model = medusa_tiny("llama", num_heads=2, num_layers=2)
    model.save_pretrained(tmp_path)
    return model, tmp_path


def test_missing_key_is_named(saved):
    model, path = saved
    state = load_file(path / "model.safetensors")
    del state["blocks.1.1.linear.bias"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(HeadsFormatError, match=r"missing keys \['blocks.1.1.linear.bias'\]"):
        MedusaModel.from_pretrained(model.base_model, heads=path)


def test_unexpected_key_and_wrong_shape_are_named(saved):
    model, path = saved
    state = load_file(path / "model.safetensors")
    state["blocks.0.0.linear.weight"] = torch.zeros(3, 3)
    state["extra.weight"] = torch.zeros(1)
    save_file(state, path / "model.safetensors")
    expected = r"unexpected keys \['extra.weight'\].*shape \(3, 3\), expected \(32, 32\)"
    with pytest.raises(HeadsFormatError, match=expected):
        MedusaModel.from_pretrained(model.base_model, heads=path)


def test_corrupted_weights_file(saved):
    model, path = saved
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(HeadsFormatError, match="cannot read"):
        MedusaModel.from_pretrained(model.base_model, heads=path)


def test_heads_for_another_base(saved):
    _, path = saved
    other = tiny_model("gpt2")
    other.resize_token_embeddings(20)
    with pytest.raises(HeadsFormatError, match=r"made for hidden size 32 and vocabulary 16.*has 32 and 20"):
        MedusaModel.from_pretrained(other, heads=path)


def test_not_a_heads_folder(tmp_path):
    base = tiny_model("llama")
    with pytest.raises(HeadsFormatError, match="does not exist"):
        MedusaModel.from_pretrained(base, heads=tmp_path / "nope")
    with pytest.raises(HeadsFormatError, match="holds no heads this project can read"):
        MedusaModel.from_pretrained(base, heads=tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HeadsFormatError, match="not valid JSON"):
        MedusaModel.from_pretrained(base, heads=tmp_path)
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 2}')
    with pytest.raises(HeadsFormatError, match=r"has no \.safetensors weights"):
        MedusaModel.from_pretrained(base, heads=tmp_path)
