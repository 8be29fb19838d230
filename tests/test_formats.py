"""Foreign checkpoint layouts: synthetic checkpoints built from the documented keys load with
identical logits; exports re-import identically; mismatches fail with a message naming the problem."""

import json

import pytest
import torch
from conftest import randomize_heads, tiny_model
from safetensors.torch import load_file, save_file

from medusa_heads import MedusaModel
from medusa_heads.io import HeadsFormatError, export_heads

K, L = 3, 2


@pytest.fixture
def native():
    """Tiny Llama with 3 own-projection heads of 2 layers, random weights."""
    return randomize_heads(MedusaModel.from_pretrained(tiny_model("llama"), num_heads=K, num_layers=L))


@pytest.fixture
def shared():
    return randomize_heads(MedusaModel.from_pretrained(tiny_model("llama"), num_heads=K, num_layers=1,
                                                       projection="shared"))


def original_keys(model, projection=True):
    """The original Medusa-1 layout: {h}.{l}.linear.weight|bias and {h}.{L}.weight."""
    heads, state = model.heads, {}
    layers = heads.config.num_layers
    for h in range(heads.config.num_heads):
        for layer in range(layers):
            state[f"{h}.{layer}.linear.weight"] = heads.blocks[h][layer].linear.weight.detach().clone()
            state[f"{h}.{layer}.linear.bias"] = heads.blocks[h][layer].linear.bias.detach().clone()
        if projection:
            state[f"{h}.{layers}.weight"] = heads.projections[h].weight.detach().clone()
    return state


def same_logits(a, b):
    hidden = torch.randn(2, 3, 32, dtype=torch.float64)
    return torch.equal(a.heads(hidden), b.heads(hidden))


def test_original_v1_pt_with_a_wrong_config(tmp_path, native):
    torch.save(original_keys(native), tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))  # wrong
    loaded = MedusaModel.from_pretrained(native.base_model, heads=tmp_path)
    assert (loaded.heads.config.num_heads, loaded.heads.config.num_layers) == (K, L)
    assert loaded.heads.config.projection == "own" and same_logits(native, loaded)


def test_original_v1_safetensors(tmp_path, native):
    save_file(original_keys(native), tmp_path / "medusa_lm_head.safetensors")
    assert same_logits(native, MedusaModel.from_pretrained(native.base_model, heads=tmp_path))


def test_original_v2_resblocks_only(tmp_path, shared):
    save_file(original_keys(shared, projection=False), tmp_path / "medusa_lm_head.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": K, "version": "2"}))
    loaded = MedusaModel.from_pretrained(shared.base_model, heads=tmp_path)
    assert loaded.heads.config.projection == "shared" and same_logits(shared, loaded)


def test_medusa2_full_model_folder(tmp_path, native):
    native.base_model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights.update({f"medusa_head.{k}": v for k, v in original_keys(native).items()})
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 1, "medusa_num_layers": 1}))
    loaded = MedusaModel.from_pretrained(tmp_path, heads=tmp_path, dtype=torch.float64)
    assert loaded.heads.config.num_heads == K and same_logits(native, loaded)


def vllm_folder(path, model, shared=False):
    """By hand, as vLLM's loader reads it (blocks.{h}.layers.{l}.*, lm_heads.{h}.weight)."""
    state = {}
    for key, value in original_keys(model, projection=not shared).items():
        h, index, *rest = key.split(".")
        if rest[0] == "linear":
            state[f"blocks.{h}.layers.{index}.{rest[1]}"] = value
        else:
            state[f"lm_heads.{h}.{rest[0]}"] = value
    if shared:
        state["lm_heads.0.weight"] = model.base_model.lm_head.weight.detach().clone()
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "model_type": "medusa", "hidden_size": 32, "vocab_size": 16, "num_heads": 1, "num_hidden_layers": 1,
        "truncated_vocab_size": 16, "medusa_fc_bias": True, "original_lm_head": shared}))


@pytest.mark.parametrize("kind", ["own", "shared"])
def test_vllm_folder(tmp_path, native, shared, kind):
    model = native if kind == "own" else shared
    vllm_folder(tmp_path, model, shared=kind == "shared")
    assert same_logits(model, MedusaModel.from_pretrained(model.base_model, heads=tmp_path))


def test_wrong_hidden_size_and_missing_key(tmp_path, native):
    state = original_keys(native)
    state["0.0.linear.weight"] = torch.zeros(24, 24, dtype=torch.float64)
    save_file(state, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(HeadsFormatError, match="made for hidden size 24 and vocabulary 16, but this base model has 32"):
        MedusaModel.from_pretrained(native.base_model, heads=tmp_path)
    state = original_keys(native)
    del state["2.1.linear.bias"]
    save_file(state, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(HeadsFormatError, match=r"missing keys \['blocks.2.1.linear.bias'\]"):
        MedusaModel.from_pretrained(native.base_model, heads=tmp_path)
    other = tiny_model("gpt2")
    other.resize_token_embeddings(20)
    save_file(original_keys(native), tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(HeadsFormatError, match="vocabulary 16, but this base model has 32 and 20"):
        MedusaModel.from_pretrained(other, heads=tmp_path)


class NotATensor:
    pass


def test_pickles_beyond_tensors_are_refused(tmp_path, native):
    torch.save({"0.0.linear.weight": NotATensor()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(HeadsFormatError, match=r"refused by torch.load\(weights_only=True\)"):
        MedusaModel.from_pretrained(native.base_model, heads=tmp_path)


@pytest.mark.parametrize("fmt", ["vllm", "tgi", "medusa"])
@pytest.mark.parametrize("kind", ["own", "shared"])
def test_export_round_trip(tmp_path, native, shared, fmt, kind):
    model = native if kind == "own" else shared
    out = export_heads(model.heads, tmp_path / fmt, fmt, base_model="tiny-llama")
    assert "README.md" in {p.name for p in out.iterdir()}
    assert same_logits(model, MedusaModel.from_pretrained(model.base_model, heads=out))


def test_tgi_refuses_deep_shared_heads(tmp_path):
    model = MedusaModel.from_pretrained(tiny_model("llama"), num_heads=2, num_layers=2, projection="shared")
    with pytest.raises(ValueError, match="exactly one layer"):
        export_heads(model.heads, tmp_path, "tgi")


@pytest.mark.parametrize("fmt", ["vllm", "tgi", "medusa"])
def test_next_token_heads_are_not_exported(tmp_path, fmt):
    model = MedusaModel.from_pretrained(tiny_model("llama"), num_heads=2, projection="shared", next_token=True)
    with pytest.raises(ValueError, match="only the native format holds them"):
        export_heads(model.heads, tmp_path, fmt)
    assert not any(tmp_path.iterdir())


def test_vllm_export_matches_what_vllm_reads(tmp_path, native, shared):
    """Names checked against vLLM's loader, vllm/model_executor/models/medusa.py (`Medusa.__init__`
    builds `blocks.{h}.layers.{l}` Linear layers with bias only when `medusa_fc_bias`, and
    `lm_heads.{h}`, or a single `lm_head` filled from `lm_heads.0.weight` when `original_lm_head`;
    `load_weights` strips a `medusa_heads.` prefix), and its config class,
    vllm/transformers_utils/configs/medusa.py (`MedusaConfig`: model_type 'medusa', hidden_size,
    vocab_size, num_heads, num_hidden_layers, truncated_vocab_size)."""
    out = export_heads(native.heads, tmp_path / "own", "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"]) == (K, L)
    assert (config["hidden_size"], config["vocab_size"], config["truncated_vocab_size"]) == (32, 16, 16)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is False
    keys = set(load_file(out / "model.safetensors"))
    expected = {f"blocks.{h}.layers.{layer}.{p}" for h in range(K) for layer in range(L) for p in ("weight", "bias")}
    assert keys == expected | {f"lm_heads.{h}.weight" for h in range(K)}
    out = export_heads(shared.heads, tmp_path / "shared", "vllm")
    assert json.loads((out / "config.json").read_text())["original_lm_head"] is True
    assert {k for k in load_file(out / "model.safetensors") if k.startswith("lm_heads")} == {"lm_heads.0.weight"}
    assert "--speculative-config" in (out / "README.md").read_text()
