"""The library's entry points: `generate` for a batch of prompts and `stream` for one, over `medusa_heads.decoder`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .decoder import Decoder, Request, TextDeltas, mean_accepted_length, pad_id
from .decoding import Decoding
from .eagle import EagleDraft
from .tree import DynamicTree, Tree

DEFAULT_DYNAMIC = "dynamic-16x4x4"  # an EAGLE-style draft's tree when none is given


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, T + longest answer): input_ids as given (padding kept), then each row's new
    # tokens, pad-filled after a row finishes: the layout of transformers' generate
    new_tokens: list[list[int]]  # per row, the generated tokens
    accept_lengths: list[list[int]]  # per row, tokens emitted at each step (prefill = 1), bonus included
    texts: list[str] | None = None  # per row, decoded new text, cut before any stop string
    finish_reasons: list[str] = field(default_factory=list)  # per row: "stop" (EOS / stop string) or "length"
    elapsed: float = 0.0  # seconds, prefill included
    verified: list[list[int]] = field(default_factory=list)  # per row, tokens each decoding step verified for
    # it (its tree's nodes and its lookup draft; a batch's pass is as wide as its widest row's)

    @property
    def steps(self) -> int:
        return max(len(a) for a in self.accept_lengths)

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.accept_lengths)


def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             eos_token_id: int | list[int] | None = None, **settings) -> GenerationOutput:
    """Generate with Medusa heads (or an EAGLE-style draft).

    input_ids: (B, T); with B > 1 give attention_mask (left or right padding both work).
    eos_token_id: defaults to the model's. settings: the fields of `medusa_heads.decoding.Decoding`, e.g.
    max_new_tokens, acceptance ("greedy": identical to plain greedy decoding; "exact": samples exactly as
    the base model at this temperature / top_p; "typical": the paper's typical acceptance, epsilon/delta),
    tree ("auto", the default, picks the tree probed fastest on this machine for these heads, see
    `medusa_heads.tuning`; or a Tree, a preset name, a JSON file or a list of paths; for an EAGLE-style draft,
    "dynamic-NxDxK"), stop (strings that end generation), seed, adapt.
    """
    decoder = make_decoder(model, input_ids, Decoding(**settings), attention_mask, eos_token_id)
    start = time.perf_counter()
    for _ in decoder.steps():
        pass
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return _output(decoder, input_ids, time.perf_counter() - start)


def _output(decoder: Decoder, input_ids: torch.Tensor, elapsed: float) -> GenerationOutput:
    """The result of the rows `make_decoder` added from input_ids (B, T)."""
    rows = [decoder.progress(i) for i in range(input_ids.shape[0])]
    new = torch.full((len(rows), max(len(r.tokens) for r in rows)), pad_id(decoder.model), dtype=torch.long)
    for i, r in enumerate(rows):
        new[i, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
    texts = [decoder.text(i) for i in range(len(rows))] if decoder.model.tokenizer is not None else None
    return GenerationOutput(sequences=torch.cat([input_ids.cpu(), new], dim=1), new_tokens=[r.tokens for r in rows],
                            accept_lengths=[r.accept_lengths for r in rows], texts=texts,
                            finish_reasons=[r.finish_reason for r in rows], elapsed=elapsed,
                            verified=[r.verified for r in rows])


def stream(model, input_ids: torch.Tensor, eos_token_id: int | list[int] | None = None, **settings) -> Iterator[str]:
    """Like `generate` for one prompt, but yields the decoded text as it grows (stop strings cut)."""
    if input_ids.shape[0] != 1:
        raise ValueError("stream() takes one prompt; use generate() for a batch")
    model.require_tokenizer()
    decoder = make_decoder(model, input_ids, Decoding(**settings), eos_token_id=eos_token_id)
    deltas = TextDeltas(decoder)
    for _ in decoder.steps():
        if delta := deltas():
            yield delta


def make_decoder(model, input_ids: torch.Tensor, decoding: Decoding, attention_mask: torch.Tensor | None = None,
                 eos_token_id: int | list[int] | None = None) -> Decoder:
    """A Decoder holding one request per row of input_ids (B, T), decoded as `decoding` says."""
    decoder = Decoder(model, resolve_tree(model, decoding.tree), decoding.adapt)
    decoder.add(Request.batch(input_ids, attention_mask, eos_token_id=eos_token_id, **decoding.request_settings()))
    return decoder


def resolve_tree(model, tree) -> Tree | DynamicTree:
    """The tree to use: the given one; for "auto" (or None) the one probed on this machine, else (no
    probe, or heads without a replay record) the default preset when the heads are deep enough (an
    EAGLE-style draft: `DEFAULT_DYNAMIC`)."""
    from .tuning import tuning

    if tree is not None and tree != "auto":
        return Tree.load(tree)
    tuned = tuning(model)
    if tuned is not None and tuned.tree is not None:
        return tuned.tree
    if isinstance(model.heads, EagleDraft):
        return Tree.load(DEFAULT_DYNAMIC)
    default = Tree.load("default")
    return default if default.depth <= model.heads.config.num_heads else Tree.chain(model.heads.config.num_heads)
