"""Heads folders: the native one (config.json + model.safetensors; Medusa heads or an EAGLE-style draft,
told apart by the config's "kind"), and foreign Medusa layouts, loaded strictly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import adapter, eagle, formats
from .eagle import EagleConfig, EagleDraft
from .heads import HeadsConfig, MedusaHeads

FORMAT = "medusa-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class HeadsFormatError(ValueError):
    """A heads checkpoint that cannot be used with this model."""


def folder_format(directory: str | Path) -> str:
    """'native', 'original', 'medusa2' or 'vllm'."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadsFormatError(f"heads folder {directory} does not exist")
    try:
        return formats.detect(directory)
    except formats.ForeignFormatError as err:
        raise HeadsFormatError(str(err)) from err


def save_heads(heads: MedusaHeads | EagleDraft, directory: str | Path, base_model: str = "", **extra) -> Path:
    """Write heads as a native folder; `extra` entries (e.g. training metrics) go into config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": FORMAT})
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, **heads.config.to_dict(), "base_model": base_model}
    (directory / CONFIG_FILE).write_text(json.dumps({**config, **extra}, indent=2) + "\n")
    return directory


def read_config(directory: str | Path) -> dict:
    directory = Path(directory)
    file = directory / CONFIG_FILE
    if not directory.is_dir():
        raise HeadsFormatError(f"heads folder {directory} does not exist")
    if not file.exists():
        raise HeadsFormatError(f"{directory} has no {CONFIG_FILE}: not a heads folder")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise HeadsFormatError(f"{file} is not valid JSON ({err})") from err
    if config.get("format") != FORMAT:
        raise HeadsFormatError(f"{file} is not a {FORMAT} config (format={config.get('format')!r})")
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise HeadsFormatError(f"{file} has format version {config['format_version']}; upgrade medusa-heads")
    return config


def load_heads(directory: str | Path, base) -> MedusaHeads | EagleDraft:
    """Build the draft (Medusa heads or an EAGLE-style draft) a heads folder holds, for this base model,
    and fill it from the folder, strictly."""
    directory = Path(directory)
    lm_head = adapter.lm_head(base)
    kind = folder_format(directory)
    if kind != "native":
        return _load_foreign(directory, kind, lm_head)
    raw = read_config(directory)
    draft_class = EagleConfig if raw.get("kind") == eagle.KIND else HeadsConfig
    fields = draft_class.__dataclass_fields__
    try:
        config = draft_class(**{k: v for k, v in raw.items() if k in fields})
    except (TypeError, ValueError) as err:
        raise HeadsFormatError(f"{directory / CONFIG_FILE} does not describe a draft: {err}") from err
    _check_sizes(config, lm_head, directory, raw.get("base_model"))
    weights = directory / WEIGHTS_FILE
    if not weights.exists():
        raise HeadsFormatError(f"{directory} has no {WEIGHTS_FILE}")
    try:
        state = load_file(weights)
    except Exception as err:  # safetensors raises several types for a damaged file
        raise HeadsFormatError(f"cannot read {weights}: {err}") from err
    heads = (EagleDraft(config, base.get_input_embeddings(), lm_head) if isinstance(config, EagleConfig)
             else MedusaHeads(config, lm_head))
    load_strict(heads, state, source=str(weights))
    return heads


def _load_foreign(directory: Path, kind: str, lm_head: torch.nn.Module) -> MedusaHeads:
    try:
        state, num_heads, num_layers, own = formats.read_foreign(directory, kind)
    except formats.ForeignFormatError as err:
        raise HeadsFormatError(str(err)) from err
    except Exception as err:  # a damaged weights file
        raise HeadsFormatError(f"cannot read the heads in {directory}: {err}") from err
    first = state.get("blocks.0.0.linear.weight", state.get("projections.0.weight"))
    hidden = first.shape[-1] if first is not None else lm_head.weight.shape[1]
    vocab = state["projections.0.weight"].shape[0] if own and "projections.0.weight" in state else (
        lm_head.weight.shape[0])
    config = HeadsConfig(num_heads, num_layers, "own" if own else "shared", hidden_size=hidden, vocab_size=vocab)
    _check_sizes(config, lm_head, directory, None)
    heads = MedusaHeads(config, lm_head)
    load_strict(heads, state, source=f"{directory} ({kind} layout)")
    return heads


def _check_sizes(config: HeadsConfig | EagleConfig, lm_head: torch.nn.Module, directory: Path,
                 made_for: str | None) -> None:
    vocab, hidden = lm_head.weight.shape
    if (config.hidden_size, config.vocab_size) != (hidden, vocab):
        raise HeadsFormatError(
            f"heads in {directory} were made for hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size}, but this base model has {hidden} and {vocab}: they belong to another base "
            f"({made_for or 'unknown'})"
        )


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """load_state_dict that names every missing, unexpected or misshapen key."""
    expected = module.state_dict()
    problems = []
    if missing := sorted(set(expected) - set(state)):
        problems.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected := sorted(set(state) - set(expected)):
        problems.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for key in sorted(set(state) & set(expected)):
        if state[key].shape != expected[key].shape:
            problems.append(f"{key} has shape {tuple(state[key].shape)}, expected {tuple(expected[key].shape)}")
    if problems:
        raise HeadsFormatError(f"{source} does not fit these heads: " + "; ".join(problems))
    module.load_state_dict(state, strict=True)


def export_heads(heads: MedusaHeads, out: str | Path, fmt: str, base_model: str = "") -> Path:
    """Write heads for a serving engine: 'vllm', 'tgi' or 'medusa' (the original layout).

    A draft vocabulary is not exported: the engines project onto the full vocabulary.
    """
    if isinstance(heads, EagleDraft):
        raise ValueError("this is an EAGLE-style draft; the engines' Medusa layouts hold Medusa heads only: export "
                         "Medusa heads, or serve the draft with `medusa serve`")
    config = heads.config
    if config.next_token:
        raise ValueError("these heads read the base model's next token, which the engines' Medusa heads do not: "
                         "only the native format holds them (train without --next-token to export)")
    if fmt == "tgi" and config.projection == "shared" and config.num_layers != 1:
        raise ValueError("TGI reads shared-projection heads (Medusa 'version 2') with exactly one layer")
    shared = heads.base_lm_head.weight if config.projection == "shared" else None
    state = {k: v for k, v in heads.state_dict().items() if k != "token_map"}  # engines use the full vocabulary
    return formats.export(state, config.num_heads, config.num_layers, shared, Path(out), fmt, base_model)
