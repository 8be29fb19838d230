"""Medusa speculative decoding for any Hugging Face causal LM."""

from .acceptance import Sampling
from .decoding import Decoding
from .generate import GenerationOutput
from .heads import HeadsConfig, MedusaHeads
from .model import MedusaModel
from .tree import Tree

__all__ = ["Decoding", "GenerationOutput", "HeadsConfig", "MedusaHeads", "MedusaModel", "Sampling", "Tree"]
__version__ = "0.1.0"
