"""MedusaModel: an unmodified Hugging Face causal LM, its tokenizer, and Medusa heads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import adapter, default, speed
from .calibrate import DynamicRecord, Record, load_record
from .eagle import EagleConfig, EagleDraft
from .heads import HeadsConfig, MedusaHeads
from .io import load_heads, save_heads

DRAFTS = ("medusa", "eagle")  # what drafts a step's candidates: Medusa heads, or an EAGLE-style draft


class MedusaModel(nn.Module):
    """A base causal LM plus Medusa heads (or an EAGLE-style draft in their place).

    Attributes: `base_model` (the Hugging Face model, untouched), `heads` (MedusaHeads or EagleDraft),
    `tokenizer` (or None), `config` (the base model's config), `compiled_decoder` (None unless
    `compile_decoding()` was called), `record` (the heads' replay record, from which each machine
    chooses its tree, or None), `tuning` (what the probe chose here, once decoding has begun).
    """

    def __init__(self, base_model: PreTrainedModel, heads: MedusaHeads | EagleDraft, tokenizer: Any = None,
                 record: Record | DynamicRecord | None = None):
        super().__init__()
        adapter.check_supported(base_model)
        self.base_model = base_model
        self.heads = heads.to(device=base_model.device, dtype=base_model.dtype)
        self.tokenizer = tokenizer
        self.config = base_model.config
        self.compiled_decoder = None
        self.record = record
        self.tuning = None

    @classmethod
    def from_pretrained(
        cls,
        base: str | Path | PreTrainedModel | None = None,
        heads: str | Path | None = None,
        num_heads: int = 5,
        num_layers: int = 1,
        projection: str = "own",
        draft_vocab: int = 0,
        next_token: bool = False,
        chained: bool = False,
        draft: str = "medusa",
        tokenizer: Any = None,
        **hf_kwargs: Any,
    ) -> MedusaModel:
        """Load a base model (hub id, local folder, GGUF file, loaded model; None: the embedded
        default) and attach heads from a folder, or fresh heads when `heads` is None (num_heads,
        num_layers, projection, draft_vocab, next_token and chained describe fresh heads; see HeadsConfig;
        draft="eagle": a fresh EAGLE-style draft instead, with draft_vocab; see `medusa_heads.eagle`).

        With no base and no heads, the heads shipped for the embedded default are attached.
        `hf_kwargs` go to `AutoModelForCausalLM.from_pretrained` (e.g. dtype, device_map).
        """
        if base is None:
            base = default.default_base_dir()
            if heads is None:
                heads = default.shipped_heads_dir()
        base_model, tok = load_base(base, **hf_kwargs)
        if heads is not None and (Path(heads) / "adapter").is_dir():  # Medusa-2: a LoRA-tuned backbone
            from peft import PeftModel

            base_model = PeftModel.from_pretrained(base_model, Path(heads) / "adapter").merge_and_unload()
        tokenizer = tokenizer if tokenizer is not None else tok
        lm_head = adapter.lm_head(base_model)
        if draft not in DRAFTS:
            raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
        if heads is None and draft == "eagle":
            medusa_heads = EagleDraft(EagleConfig.for_base(base_model.config, draft_vocab),
                                      base_model.get_input_embeddings(), lm_head)
        elif heads is None:
            vocab, hidden = lm_head.weight.shape
            config = HeadsConfig(num_heads, num_layers, projection, hidden, vocab, draft_vocab, next_token, chained)
            medusa_heads = MedusaHeads(config, lm_head)
        else:
            medusa_heads = load_heads(heads, base_model)
            _warn_other_base(heads, base_model)
        record = load_record(heads) if heads is not None else None
        return cls(base_model.eval(), medusa_heads.eval(), tokenizer, record)

    def with_heads(self, heads: str | Path) -> MedusaModel:
        """The same base model and tokenizer with the draft (heads or EAGLE-style) of another heads folder."""
        return MedusaModel(self.base_model, load_heads(heads, self.base_model), self.tokenizer, load_record(heads))

    def install_speed_levers(self) -> None:
        """Give decoding steps the speed levers of `medusa_heads.speed` (once; a one-token forward shows
        which linear layers read the same input)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        speed.install(self, sample=lambda: self.base_model(input_ids=ids, use_cache=False))

    def compile_decoding(self) -> MedusaModel:
        """Run decoding passes through torch.compile from now on (see `medusa_heads.speed`): faster
        steps, after a compile of a few minutes on a small CPU at the first passes."""
        self.compiled_decoder = speed.compiled_decoder(adapter.decoder(self.base_model))
        return self

    def save_pretrained(self, directory: str | Path, **extra: Any) -> Path:
        """Save the heads (not the base model) as a native heads folder, with their replay record if any."""
        path = save_heads(self.heads, directory, base_model=self.base_name, **extra)
        if self.record is not None:
            self.record.save(path / self.record.FILE)
        return path

    @property
    def base_name(self) -> str:
        return str(getattr(self.config, "name_or_path", "") or self.config._name_or_path or "")

    @property
    def device(self) -> torch.device:
        return self.base_model.device

    def chat_ids(self, messages: list[dict[str, str]] | str) -> torch.Tensor:
        """Token ids (1, T) of a chat ready for the assistant's answer (a str is one user turn)."""
        tokenizer = self.require_tokenizer()
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
        return torch.tensor([ids], device=self.device)

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass tokenizer= to MedusaModel.from_pretrained")
        return self.tokenizer

    def generate(self, input_ids: torch.Tensor, **kwargs: Any):
        """Medusa decoding; see `medusa_heads.generate.generate` for the arguments."""
        from .generate import generate

        return generate(self, input_ids, **kwargs)

    def stream(self, input_ids: torch.Tensor, **kwargs: Any):
        """Yield decoded text increments as tokens are accepted; see `medusa_heads.generate.stream`."""
        from .generate import stream

        return stream(self, input_ids, **kwargs)


def load_base(base: str | Path | PreTrainedModel, **hf_kwargs: Any) -> tuple[PreTrainedModel, Any]:
    """A causal LM and its tokenizer (None when it cannot be found) from any supported source."""
    if isinstance(base, PreTrainedModel):
        return base, _try_tokenizer(base.name_or_path, local_files_only=True)
    if isinstance(base, nn.Module):
        raise TypeError(f"base must be a transformers PreTrainedModel, got {type(base).__name__}")
    path = Path(base)
    source: dict[str, Any] = {"pretrained_model_name_or_path": str(base)}
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        source = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    elif path.exists() and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(**source, **hf_kwargs)
    tokenizer_kwargs = {"gguf_file": source["gguf_file"]} if "gguf_file" in source else {}
    return model, _try_tokenizer(source["pretrained_model_name_or_path"], **tokenizer_kwargs)


def _try_tokenizer(name: str, **kwargs: Any):
    if not name:
        return None
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError):
        return None


def recorded_base(heads_dir: str | Path) -> str:
    """The base model a heads folder records it was made for (native or original config), or ""."""
    file = Path(heads_dir) / "config.json"
    try:
        config = json.loads(file.read_text()) if file.exists() else {}
    except ValueError:
        return ""
    return str(config.get("base_model") or config.get("base_model_name_or_path") or "")


def _warn_other_base(heads_dir: str | Path, base_model: PreTrainedModel) -> None:
    made_for = recorded_base(heads_dir)
    name = str(base_model.name_or_path or "")
    if made_for and name and Path(made_for).name != Path(name).name:
        warnings.warn(f"heads in {heads_dir} were trained for {made_for!r}, loading them on {name!r}", stacklevel=3)
