import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import ARCHS, VOCAB, tiny_model

from medusa_heads import MedusaModel

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Tests decode with the unprobed kernel routes and the shipped tree, and write no tuning into the user
# cache; tests/test_tuning.py turns the probe on, in a temporary cache.
os.environ["MEDUSA_HEADS_TUNE"] = "0"


def randomize_heads(model: MedusaModel, seed: int = 1, std: float = 0.3) -> MedusaModel:
    """Give the heads random weights so that they propose varied (sometimes right) candidates."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * std)
    return model


def medusa_tiny(arch: str = "llama", tied: bool = False, num_heads: int = 4, seed: int = 0, **kwargs) -> MedusaModel:
    return randomize_heads(MedusaModel.from_pretrained(tiny_model(arch, tied, seed), num_heads=num_heads, **kwargs))


def hf_greedy(base, ids: torch.Tensor, max_new_tokens: int, eos_token_id=None, attention_mask=None) -> torch.Tensor:
    """transformers' own greedy generate: the reference every greedy Medusa run must equal."""
    ids = ids.to(base.device)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(base.device)
    return base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=0).cpu()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny Llama (float32) and its tokenizer saved as a Hugging Face folder, for the CLI and server."""
    from tiny import tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").float().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_model():
    """The embedded default (SmolLM2-135M-Instruct) with fresh shared heads; integration tests only."""
    from medusa_heads.default import default_base_dir

    try:
        base = default_base_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return MedusaModel.from_pretrained(base, num_heads=3, projection="shared")


__all__ = ["ARCHS", "SHARED_DATA", "VOCAB", "hf_greedy", "medusa_tiny", "randomize_heads", "tiny_model"]
