"""Medusa decoding: prefill, then one tree-verification pass per step, for a batch of prompts.

Per step and row: the heads read the hidden state of the last accepted token and propose top-k
tokens; the tree picks candidates from them; the base model verifies all tree tokens in one pass
(a 4D mask lets each see the prompt and its ancestors; position = length + depth); acceptance keeps
the longest agreeing path plus a bonus token; the cache keeps the accepted rows.

Rows carry their own lengths, so prompts of different lengths (padded on either side, described by
`attention_mask`) decode together, and a row that finishes leaves the batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from . import adapter
from .acceptance import Sampling, accept, sample, sampling_probs
from .cache import TreeCache
from .tree import Tree


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, prompt + new) per row: its prompt, then its new tokens, pad-filled
    new_tokens: list[list[int]]  # per row, the generated tokens
    accept_lengths: list[list[int]]  # per row, tokens emitted at each step (prefill = 1), bonus included
    texts: list[str] | None = None  # per row, decoded new text, cut before any stop string
    finish_reasons: list[str] = field(default_factory=list)  # per row: "stop" (EOS / stop string) or "length"
    elapsed: float = 0.0  # seconds, prefill included

    @property
    def steps(self) -> int:
        return max(len(a) for a in self.accept_lengths)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per decoding step over all rows, bonus included (plain decoding = 1.0)."""
        return sum(map(sum, self.accept_lengths)) / max(1, sum(map(len, self.accept_lengths)))


@dataclass
class _Row:
    """Bookkeeping for one prompt while it decodes."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    stop_at: int | None = None  # character offset of a stop string in the decoded text
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" once done


class Decoder:
    """Runs the decoding loop for one batch; `steps()` yields the tokens each step adds per row."""

    def __init__(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int,
        tree: Tree,
        sampling: Sampling,
        eos_token_id: int | list[int] | None,
        stop: list[str],
        seed: int | None,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if tree.size > 1:
            tree.check(model.heads.config.num_heads, model.heads.config.vocab_size)
        if stop:
            model.require_tokenizer()
        self.model, self.tree, self.sampling, self.stop = model, tree, sampling, stop
        self.max_new_tokens = max_new_tokens
        self.eos = _eos_ids(model, eos_token_id)
        self.device = model.device
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.rows = [_Row(prompt) for prompt in _prompts(input_ids, attention_mask)]
        self.active = list(range(len(self.rows)))  # batch position -> row index
        tree_buffers = (tree.depths, tree.parents, tree.retrieve, tree.mask, tree.candidate_index(tree.topk))
        self.depths, self.parents, self.retrieve, self.tree_mask, self.cand_index = (
            t.to(self.device) for t in tree_buffers
        )

    # -- the loop -----------------------------------------------------------------------------

    def steps(self) -> Iterator[None]:
        """Decode until every row is done; yields after the prefill and after every step."""
        self._prefill()
        yield
        while self.active:
            self._step()
            yield

    @torch.inference_mode()
    def _prefill(self) -> None:
        prompts = [self.rows[i].prompt for i in self.active]
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, device=self.device)
        layers = self.model.config.get_text_config().num_hidden_layers
        self.cache = TreeCache(layers, len(prompts), width + self.max_new_tokens + self.tree.size, self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        allowed = positions[:, :, None] >= positions[:, None, :]  # causal, (B, T, T)
        hidden = self._forward(ids, positions, allowed[:, None], visible=width)
        rows = torch.arange(len(prompts), device=self.device)
        last = hidden[rows, lengths - 1]  # (B, H)
        logits = adapter.logits(self.model.base_model, last)
        if self.sampling.acceptance == "greedy":
            first = logits.argmax(-1)
        else:
            first = sample(sampling_probs(logits, self.sampling.temperature, self.sampling.top_p), self.generator)
        self.cache.commit(torch.arange(width, device=self.device).expand(len(prompts), width), lengths)
        self.hidden, self.root = last, first
        self._emit(first[:, None], torch.ones_like(first))

    @torch.inference_mode()
    def _step(self) -> None:
        batch, n = self.root.shape[0], self.tree.size
        tokens = self.root[:, None]
        if n > 1:
            head_logits = self.model.heads(self.hidden, num_heads=self.tree.depth)  # (D, B, V)
            top = head_logits.topk(self.tree.topk, dim=-1).indices  # (D, B, topk)
            candidates = top.permute(1, 0, 2).reshape(batch, -1)[:, self.cand_index]  # (B, n-1)
            tokens = torch.cat([tokens, candidates], dim=1)  # (B, n)
        lengths = self.cache.lengths
        positions = lengths[:, None] + self.depths  # (B, n)
        slots = torch.arange(int(lengths.max()) + n, device=self.device)
        rel = slots[None, :] - lengths[:, None]  # (B, S): slot offset from each row's tree start
        in_tree = (rel >= 0) & (rel < n)
        tree_part = self.tree_mask[:, rel.clamp(0, n - 1)].permute(1, 0, 2) & in_tree[:, None]  # (B, n, S)
        allowed = (rel < 0)[:, None, :] | tree_part
        hidden = self._forward(tokens, positions, allowed[:, None], visible=slots.numel())
        logits = adapter.logits(self.model.base_model, hidden)  # (B, n, V)
        result = accept(tokens, logits, self.parents, self.retrieve, self.sampling, self.generator)
        path = result.path.clamp(min=0)  # (B, depth+1)
        self.cache.commit(path, result.count + 1)
        rows = torch.arange(batch, device=self.device)
        last = path[rows, result.count]
        self.hidden, self.root = hidden[rows, last], result.next_token
        emitted = torch.cat([tokens.gather(1, path[:, 1:]), result.next_token[:, None]], dim=1)  # (B, depth+1)
        # the bonus goes right after the accepted candidates
        emitted[rows, result.count] = result.next_token
        self._emit(emitted, result.count + 1)

    def _forward(self, ids, positions, allowed, visible: int) -> torch.Tensor:
        """Run the base model's decoder over ids, writing their keys/values into the cache."""
        self.cache.prepare(ids.shape[1], visible)
        base = self.model.base_model
        mask = adapter.attention_mask(base.config, allowed, positions, base.dtype)
        out = adapter.decoder(base)(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True
        )
        return out.last_hidden_state

    # -- bookkeeping --------------------------------------------------------------------------

    def _emit(self, emitted: torch.Tensor, counts: torch.Tensor) -> None:
        """Append each active row's new tokens, apply the stop rules, drop finished rows."""
        keep = []
        for b, (tokens, count) in enumerate(zip(emitted.tolist(), counts.tolist(), strict=True)):
            row = self.rows[self.active[b]]
            row.accept_lengths.append(0)
            for token in tokens[:count]:
                row.tokens.append(token)
                row.accept_lengths[-1] += 1
                row.finish_reason = self._finish_reason(row)
                if row.finish_reason:
                    break
            if not row.finish_reason:
                keep.append(b)
        if len(keep) < len(self.active):
            self._keep(keep)

    def _finish_reason(self, row: _Row) -> str | None:
        """Why the row ends after its last token: "stop", "length", or None (it goes on)."""
        if row.tokens[-1] in self.eos:
            return "stop"
        if self.stop:
            window = self.model.tokenizer.decode(row.tokens[-_STOP_WINDOW:], skip_special_tokens=True)
            if any(s in window for s in self.stop):
                text = self.model.tokenizer.decode(row.tokens, skip_special_tokens=True)
                row.stop_at = min(i for s in self.stop if (i := text.find(s)) >= 0)
                return "stop"
        return "length" if len(row.tokens) >= self.max_new_tokens else None

    def _keep(self, keep: list[int]) -> None:
        """Shrink the batch to the rows at positions `keep`."""
        self.active = [self.active[b] for b in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.hidden, self.root = self.hidden[index], self.root[index]
        self.cache.keep_rows(index)

    def output(self, elapsed: float) -> GenerationOutput:
        pad = _pad_id(self.model)
        width = max(len(r.prompt) + len(r.tokens) for r in self.rows)
        sequences = torch.full((len(self.rows), width), pad, dtype=torch.long)
        for i, r in enumerate(self.rows):
            sequences[i, : len(r.prompt) + len(r.tokens)] = torch.tensor(r.prompt + r.tokens)
        texts = [self.text(i) for i in range(len(self.rows))] if self.model.tokenizer is not None else None
        return GenerationOutput(
            sequences=sequences,
            new_tokens=[r.tokens for r in self.rows],
            accept_lengths=[r.accept_lengths for r in self.rows],
            texts=texts,
            finish_reasons=[r.finish_reason for r in self.rows],
            elapsed=elapsed,
        )

    def text(self, i: int) -> str:
        """Row i's decoded text so far, cut before a stop string."""
        row = self.rows[i]
        text = self.model.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return text[: row.stop_at] if row.stop_at is not None else text


_STOP_WINDOW = 32  # tokens decoded to look for a stop string that the last token may complete


def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 256,
    acceptance: str = "greedy",
    temperature: float = 1.0,
    top_p: float = 1.0,
    tree: str | Tree | list | None = None,
    stop: str | list[str] | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> GenerationOutput:
    """Generate with Medusa heads.

    input_ids: (B, T); with B > 1 give attention_mask (left or right padding both work).
    acceptance: "greedy" (identical to plain greedy decoding), "exact" (samples exactly as the base
    model at this temperature / top_p) or "typical" (the paper's typical acceptance, epsilon/delta).
    tree: a Tree, a preset name ("default", "reference", "chain-3", "dense-2x3", "plain"), a JSON file
    or a list of paths; None picks the default tree (or the deepest chain the heads allow).
    stop: strings that end generation; eos_token_id: defaults to the model's.
    """
    decoder = make_decoder(model, input_ids, attention_mask, max_new_tokens, acceptance, temperature, top_p, tree, stop,
                       eos_token_id, seed, epsilon, delta)
    start = time.perf_counter()
    for _ in decoder.steps():
        pass
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return decoder.output(time.perf_counter() - start)


class TextDeltas:
    """The new text of one row since the last call, holding back what may still change: the tail
    that could grow into a stop string, and an incomplete multi-byte character."""

    def __init__(self, decoder: Decoder, row: int = 0):
        self.decoder, self.row, self.sent = decoder, row, ""
        self.hold = max((len(s) for s in decoder.stop), default=1) - 1

    def __call__(self) -> str:
        text = self.decoder.text(self.row)
        if not self.decoder.rows[self.row].finish_reason:
            text = text[: len(text) - self.hold].rstrip("\ufffd")
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def stream(model, input_ids: torch.Tensor, **kwargs) -> Iterator[str]:
    """Like `generate` for one prompt, but yields the decoded text as it grows (stop strings cut)."""
    if input_ids.shape[0] != 1:
        raise ValueError("stream() takes one prompt; use generate() for a batch")
    model.require_tokenizer()
    decoder = make_decoder(model, input_ids, None, **kwargs)
    deltas = TextDeltas(decoder)
    for _ in decoder.steps():
        if delta := deltas():
            yield delta


def make_decoder(model, input_ids, attention_mask, max_new_tokens=256, acceptance="greedy", temperature=1.0, top_p=1.0,
             tree=None, stop=None, eos_token_id=None, seed=None, epsilon=0.09, delta=0.3) -> Decoder:
    sampling = Sampling(acceptance, temperature, top_p, epsilon, delta)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return Decoder(model, input_ids, attention_mask, max_new_tokens, resolve_tree(model, tree), sampling,
                   eos_token_id, stops, seed)


def resolve_tree(model, tree) -> Tree:
    """The tree to use: the given one, else the default preset when the heads are deep enough."""
    if tree is not None:
        return Tree.load(tree)
    default = Tree.load("default")
    return default if default.depth <= model.heads.config.num_heads else Tree.chain(model.heads.config.num_heads)


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (batch, length) with length >= 1, got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ValueError("attention_mask must have the shape of input_ids")
    rows = zip(input_ids.tolist(), attention_mask.tolist(), strict=True)
    prompts = [[t for t, m in zip(ids, mask, strict=True) if m] for ids, mask in rows]
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token (a row of attention_mask is all zeros)")
    return prompts


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        generation = getattr(model.base_model, "generation_config", None)
        eos_token_id = getattr(generation, "eos_token_id", None) or model.config.eos_token_id
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def _pad_id(model) -> int:
    tokenizer = model.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return pad if pad is not None else getattr(model.config, "pad_token_id", None) or 0
