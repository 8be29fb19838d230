"""Heads checkpoints in the layouts of other projects: read them, and write them for serving engines.

Layouts (head h, layer l, L layers per head):
- original Medusa-1 (FasterDecoding/Medusa `medusa_lm_head.pt` / `.safetensors`):
  `{h}.{l}.linear.weight|bias`, projection `{h}.{L}.weight`; config `medusa_num_heads`, ...
- original "version 2": the same ResBlocks, no projection (logits from the base lm_head).
- Medusa-2 full model folders: the same keys under `medusa_head.` inside the model's weights.
- vLLM (`model_type: medusa`): `blocks.{h}.layers.{l}.weight|bias`, `lm_heads.{h}.weight`, or one
  `lm_heads.0.weight` with `original_lm_head: true`.
The number of heads and layers always comes from the weight keys: published configs are wrong.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ORIGINAL_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_ORIGINAL_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)")
_VLLM_KEY = re.compile(r"(?:blocks\.(\d+)\.layers\.(\d+)|lm_heads\.(\d+))\.(weight|bias)")


class ForeignFormatError(ValueError):
    """A checkpoint in another project's layout that cannot be read."""


def detect(directory: Path) -> str:
    """'native', 'original', 'medusa2' or 'vllm', from the files in a folder."""
    config = _read_json(directory / "config.json") if (directory / "config.json").exists() else {}
    if config.get("format") == "medusa-heads":
        return "native"
    if any((directory / f).exists() for f in ORIGINAL_FILES):
        return "original"
    if config.get("model_type") == "medusa":
        return "vllm"
    if "medusa_num_heads" in config or any("medusa_head." in k for k in _weight_keys(directory)):
        return "medusa2"
    raise ForeignFormatError(
        f"{directory} holds no heads this project can read: expected a medusa-heads folder, "
        f"{' or '.join(ORIGINAL_FILES)}, a vLLM Medusa folder or a Medusa-2 model folder"
    )


def read_foreign(directory: Path, kind: str) -> tuple[dict[str, torch.Tensor], int, int, bool]:
    """Native-named state dict, heads K, layers L and whether each head has its own projection."""
    if kind == "original":
        return _from_original(_load_original(directory))
    if kind == "medusa2":
        weights = _load_all_safetensors(directory)
        prefix = "medusa_head."
        return _from_original({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
    return _from_vllm(_load_all_safetensors(directory), _read_json(directory / "config.json"))


def export(state: dict[str, torch.Tensor], num_heads: int, num_layers: int, lm_head_weight: torch.Tensor | None,
           out: Path, fmt: str, base_model: str) -> Path:
    """Write native-named heads weights in an engine's layout; lm_head_weight is set for shared heads."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    hidden = lm_head_weight.shape[1] if lm_head_weight is not None else state["projections.0.weight"].shape[1]
    vocab = lm_head_weight.shape[0] if lm_head_weight is not None else state["projections.0.weight"].shape[0]
    if fmt == "vllm":
        weights = {}
        for key, value in state.items():
            parts = key.split(".")
            if parts[0] == "blocks":  # blocks.{h}.{l}.linear.{weight|bias}
                weights[f"blocks.{parts[1]}.layers.{parts[2]}.{parts[4]}"] = value
            else:  # projections.{h}.{weight|bias}
                weights[f"lm_heads.{parts[1]}.{parts[2]}"] = value
        if lm_head_weight is not None:
            weights["lm_heads.0.weight"] = lm_head_weight.detach().contiguous().cpu()
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": hidden,
                  "vocab_size": vocab, "num_heads": num_heads, "num_hidden_layers": num_layers,
                  "truncated_vocab_size": vocab, "medusa_fc_bias": True,
                  "original_lm_head": lm_head_weight is not None, "base_model_name_or_path": base_model}
        save_file(weights, out / "model.safetensors")
    elif fmt in ("medusa", "tgi"):
        weights = {}
        for key, value in state.items():
            parts = key.split(".")
            if parts[0] == "blocks":
                weights[f"{parts[1]}.{parts[2]}.linear.{parts[4]}"] = value
            else:
                weights[f"{parts[1]}.{num_layers}.{parts[2]}"] = value
        config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                  "base_model_name_or_path": base_model, "hidden_size": hidden, "vocab_size": vocab}
        if lm_head_weight is not None:
            config["version"] = "2"
        save_file(weights, out / ORIGINAL_FILES[0])
    else:
        raise ValueError(f"unknown export format {fmt!r}: use vllm, tgi or medusa")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "README.md").write_text(_serving_readme(fmt, out, base_model, num_heads, lm_head_weight is not None))
    return out


def _from_original(state: dict[str, torch.Tensor]):
    native, heads, layers, projections = {}, set(), set(), set()
    for key, value in state.items():
        m = _ORIGINAL_KEY.fullmatch(key)
        if not m:
            raise ForeignFormatError(f"unexpected key {key!r} in an original Medusa checkpoint")
        h, index, linear, kind = int(m[1]), int(m[2]), m[3], m[4]
        heads.add(h)
        if linear:
            layers.add(index)
            native[f"blocks.{h}.{index}.linear.{kind}"] = value
        else:
            projections.add((h, index))
            native[f"projections.{h}.{kind}"] = value
    if not heads:
        raise ForeignFormatError("the checkpoint holds no Medusa head weights")
    num_heads, num_layers = max(heads) + 1, (max(layers) + 1 if layers else 0)
    if any(index != num_layers for _, index in projections):
        raise ForeignFormatError(f"projection keys do not sit after the {num_layers} residual layers")
    return native, num_heads, num_layers, bool(projections)


def _from_vllm(state: dict[str, torch.Tensor], config: dict):
    native, heads, layers = {}, set(), set()
    shared = bool(config.get("original_lm_head"))
    if int(config.get("truncated_vocab_size") or config.get("vocab_size", 0)) != int(config.get("vocab_size", 0)):
        raise ForeignFormatError("vLLM heads with a truncated vocabulary (token_map) are not supported")
    for key, value in state.items():
        key = key.removeprefix("medusa_heads.")
        m = _VLLM_KEY.fullmatch(key)
        if not m:
            raise ForeignFormatError(f"unexpected key {key!r} in a vLLM Medusa checkpoint")
        if m[1] is not None:
            heads.add(int(m[1]))
            layers.add(int(m[2]))
            native[f"blocks.{m[1]}.{m[2]}.linear.{m[4]}"] = value
        elif not shared:
            native[f"projections.{m[3]}.{m[4]}"] = value
    if not heads:
        raise ForeignFormatError("the checkpoint holds no Medusa head weights")
    return native, max(heads) + 1, max(layers) + 1, not shared


def _load_original(directory: Path) -> dict[str, torch.Tensor]:
    safetensors_file, pt_file = (directory / f for f in ORIGINAL_FILES)
    if safetensors_file.exists():
        return load_file(safetensors_file)
    try:
        state = torch.load(pt_file, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler refuses anything but tensors and plain containers
        raise ForeignFormatError(
            f"{pt_file} was refused by torch.load(weights_only=True): it holds more than tensors "
            f"({type(err).__name__}); convert it to safetensors from a trusted environment"
        ) from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ForeignFormatError(f"{pt_file} is not a state dict of tensors")
    return state


def _load_all_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ForeignFormatError(f"{directory} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def _weight_keys(directory: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            keys.extend(f.keys())
    return keys


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ForeignFormatError(f"{path} is not valid JSON ({err})") from err


def _serving_readme(fmt: str, out: Path, base: str, num_heads: int, shared: bool) -> str:
    base = base or "BASE_MODEL"
    if fmt == "vllm":
        spec = json.dumps({"method": "medusa", "model": str(out), "num_speculative_tokens": num_heads})
        return (f"# Medusa heads for vLLM\n\n```sh\nvllm serve {base} --speculative-config '{spec}'\n```\n\n"
                "vLLM drafts a single chain (the top-1 token of each head) and verifies it; "
                "medusa-heads verifies a whole tree.\n")
    if fmt == "tgi":
        layout = "version 2 (shared lm_head, one layer)" if shared else "version 1 (own projections)"
        return (f"# Medusa heads for Text Generation Inference ({layout})\n\n"
                f"`config.json` names the base model ({base}); TGI loads it from there.\n\n```sh\n"
                f"text-generation-launcher --model-id {out} --speculate {num_heads}\n```\n")
    return ("# Medusa heads in the original FasterDecoding/Medusa layout\n\n"
            f"Base model: {base}. Load with the original code, TensorRT-LLM's Medusa converter, or\n"
            f"`MedusaModel.from_pretrained('{base}', heads='{out}')`.\n")
