"""Medusa decoding: prefill, then one tree-verification pass per step, for a batch of prompts.

Per step and row: the heads read the hidden state of the last accepted token and propose top-k
tokens; the tree picks candidates from them (and, with a lookup branch, adds the tokens that followed
the text's last n-gram where it occurred before); the base model verifies all tree tokens in one pass
(a 4D mask lets each see the prompt and its ancestors; position = length + depth); acceptance keeps
the longest agreeing path plus a bonus token; the cache keeps the accepted rows.

With an EAGLE-style draft instead of heads (`medusa_heads.eagle`), the draft grows each row's tree anew
at every step (`DynamicTree`), and the same pass verifies it.

Rows carry their own lengths, so prompts of different lengths (padded on either side, described by
`attention_mask`) decode together, and a row that finishes leaves the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field

import torch

from . import adapter, adaptive, eagle, lean, lookup, speed
from .acceptance import Sampling, accept, choose
from .cache import TreeCache
from .decoding import Decoding
from .tree import DynamicTree, StepTree, Tree


def mean_accepted_length(accept_lengths: list[list[int]]) -> float:
    """Tokens per decoding step over rows' per-step token counts, bonus included, the prefill counting as a
    step that emits one (plain decoding = 1.0)."""
    return sum(map(sum, accept_lengths)) / max(1, sum(map(len, accept_lengths)))


@dataclass
class Request:
    """One prompt for `Decoder.add`, with its own settings. Requests added in one call that share their
    sampling settings and seed draw from one random stream (so a sampled batch repeats as a batch)."""

    prompt: torch.Tensor  # (T,) token ids
    max_new_tokens: int = Decoding.max_new_tokens
    sampling: Sampling = field(default_factory=Sampling)
    stop: str | list[str] | None = None  # strings that end the answer
    eos_token_id: int | list[int] | None = None  # None: the model's
    seed: int | None = Decoding.seed

    @classmethod
    def batch(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **settings) -> list[Request]:
        """One request per row of input_ids (B, T), without the padding that attention_mask marks (left or
        right); `settings`: the other fields, the same for every row."""
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape (batch, length) with length >= 1, got "
                             f"{tuple(input_ids.shape)}")
        if attention_mask is None:
            return [cls(row, **settings) for row in input_ids]
        if attention_mask.shape != input_ids.shape:
            raise ValueError("attention_mask must have the shape of input_ids")
        if not attention_mask.any(-1).all():
            raise ValueError("every prompt needs at least one token (a row of attention_mask is all zeros)")
        return [cls(row[mask.bool()], **settings) for row, mask in zip(input_ids, attention_mask, strict=True)]


@dataclass(frozen=True)
class Update:
    """What one step did to one row: the tokens it emitted (its accepted length), and why it ended, if it did."""

    row: int
    tokens: list[int]
    finish_reason: str | None


@dataclass(frozen=True)
class Progress:
    """A row so far, as `Decoder.progress` reports it."""

    prompt_tokens: int
    tokens: list[int]
    accept_lengths: list[int]
    finish_reason: str | None  # "stop", "length", "cancelled" or None (still decoding)
    verified: list[int]  # tokens each decoding step verified for the row: its tree's nodes and its lookup draft

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length([self.accept_lengths])


@dataclass(eq=False)
class _Row:
    """One prompt while it decodes, with its own settings."""

    prompt: list[int]
    sampling: Sampling
    generator: torch.Generator  # shared by the rows added together
    max_new_tokens: int
    eos: set[int]
    stop: list[str]
    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)  # per decoding step: its tree's nodes and its lookup draft
    lookup_budget: int = 0  # most lookup tokens this row drafts (`adaptive`)
    head_depth: float | None = None  # moving average of how deep the heads' guesses were right (`adaptive`)
    stop_at: int | None = None  # character offset of a stop string in the decoded text
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length" or "cancelled" once done


class _Buffers:
    """A tree's verification buffers on the decoding device."""

    def __init__(self, tree: Tree, device: torch.device):
        self.depths, self.parents, self.retrieve, self.mask = (
            t.to(device) for t in (tree.depths, tree.parents, tree.retrieve, tree.mask))
        self.levels = tree.levels(device)


class Decoder:
    """Decodes a changing batch: rows join with `add` (prefilled at the next step), every `step`
    verifies every active row's tree in one forward pass and says what each row emitted, and finished
    rows leave the batch; `progress` and `text` read a row, `cancel` stops it, `forget` drops its record.
    With `adapt`, each row's tree follows what it accepts (`medusa_heads.adaptive`)."""

    def __init__(self, model, tree: Tree | DynamicTree, adapt: bool = False):
        _check_tree(model, tree, adapt)
        from .tuning import tuning  # (it decodes to measure)

        self.model, self.tree, self.device, self.adapt = model, tree, model.device, adapt
        model.install_speed_levers()
        tuned = tuning(model)
        self.routes = tuned.routes if tuned else None  # the kernel route of each product, as probed here: prefills'
        self.step_routes = self.routes.for_steps() if tuned else None  # and decoding steps' (rows round alike)
        # the decoder's passes as `medusa_heads.lean`'s functions, where they run this model
        self.lean = lean.Plan(adapter.decoder(model.base_model)) if lean.supports(model.base_model) else None
        self.drafting = eagle.Drafting(model.heads, tree) if isinstance(tree, DynamicTree) else None
        self.full = None if self.drafting else _Buffers(tree, self.device)
        # the root and the lookup branch alone: the steps whose rows' heads do not pay
        self.lookup_only = _Buffers(Tree([], lookup=tree.lookup), self.device) if adapt and tree.lookup else None
        curve = tuned.cost_curve if adapt and tuned and tree.head_size > 1 else None
        self.heads_threshold = adaptive.heads_threshold(curve, tree.head_size)
        self.decoded_steps = 0
        self._rows: dict[int, _Row] = {}  # every row added, by id, until the caller forgets it
        self._updates: list[Update] = []  # what the current step emitted
        self.active: list[int] = []  # batch position -> row id
        self.pending: list[int] = []  # added, not yet prefilled
        self.cache: TreeCache | None = None
        self.hidden = self.root = None  # (B, H) last accepted hidden state, (B,) next token
        self._ids = itertools.count()

    def add(self, requests: Request | list[Request]) -> list[int]:
        """Queue requests to join at the next step; returns their row ids."""
        requests = [requests] if isinstance(requests, Request) else requests
        streams: dict[tuple, torch.Generator] = {}  # one per (sampling, seed) in this call
        ids = []
        for request in requests:
            if request.prompt.ndim != 1 or request.prompt.numel() == 0:
                raise ValueError(f"a request's prompt is a non-empty 1-D tensor of token ids, got shape "
                                 f"{tuple(request.prompt.shape)}")
            if request.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
            stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
            if any(not s for s in stop):
                raise ValueError("stop strings must be non-empty")
            if stop:
                self.model.require_tokenizer()
            key = (astuple(request.sampling), request.seed)
            if key not in streams:
                streams[key] = torch.Generator(device=self.device)
                if request.seed is None:
                    streams[key].seed()
                else:
                    streams[key].manual_seed(request.seed)
            ids.append(next(self._ids))
            self._rows[ids[-1]] = _Row(request.prompt.tolist(), request.sampling, streams[key], request.max_new_tokens,
                                       _eos_ids(self.model, request.eos_token_id), stop,
                                       lookup_budget=self.tree.lookup)
        self.pending += ids
        return ids

    def cancel(self, row_id: int) -> None:
        """Stop decoding a row now (its client left)."""
        row = self._rows[row_id]
        row.finish_reason = row.finish_reason or "cancelled"
        if row_id in self.pending:
            self.pending.remove(row_id)
        if row_id in self.active:
            self._keep([b for b, i in enumerate(self.active) if i != row_id])

    def forget(self, row_id: int) -> None:
        """Drop the record of a row that is done (finished or cancelled)."""
        if not self._rows[row_id].finish_reason:
            raise ValueError(f"row {row_id} is still decoding: cancel it first")
        del self._rows[row_id]

    def progress(self, row_id: int) -> Progress:
        row = self._rows[row_id]
        return Progress(len(row.prompt), list(row.tokens), list(row.accept_lengths), row.finish_reason,
                        list(row.verified))

    @property
    def busy(self) -> bool:
        return bool(self.active or self.pending)

    def steps(self) -> Iterator[list[Update]]:
        """Decode until every row is done; yields each step's updates (the first step is the prefill)."""
        while self.busy:
            yield self.step()

    def step(self) -> list[Update]:
        """Prefill the rows that joined, or else advance every active row by one verification pass; what
        each row emitted."""
        self._updates = []
        with speed.decoding_step(self.routes if self.pending else self.step_routes):
            if self.pending:
                self._prefill()
            else:
                self._decode()
        return self._updates

    # -- the two kinds of step ----------------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self) -> None:
        ids_of_rows, self.pending = self.pending, []
        prompts = [self._rows[i].prompt for i in ids_of_rows]
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        layers = self.model.config.get_text_config().num_hidden_layers
        longest = max(self._rows[i].max_new_tokens for i in ids_of_rows)
        cache = TreeCache(layers, len(prompts), int(lengths.max()) + longest + self.tree.size, self.device)
        last = features = None  # (B, H) hidden state of each prompt's last token; (B, T, H) all, for a draft
        for chunk in _similar_lengths(prompts):  # little padding, bounded memory
            width = max(len(prompts[b]) for b in chunk)
            ids = pad_batch([prompts[b] for b in chunk])[0].to(self.device)
            positions = torch.arange(width, device=self.device).expand(len(chunk), width)
            allowed = positions[:, :, None] >= positions[:, None, :]  # causal, (B', T, T)
            rows = torch.tensor(chunk, device=self.device)
            hidden = self._forward(cache, ids, positions, allowed[:, None], visible=width, rows=rows)
            if last is None:
                last = hidden.new_empty(len(prompts), hidden.shape[-1])
                if self.drafting:
                    features = hidden.new_zeros(len(prompts), int(lengths.max()), hidden.shape[-1])
            last[rows] = hidden[torch.arange(len(chunk), device=self.device), lengths[rows] - 1]
            if self.drafting:
                features[rows, :width] = hidden
        logits = adapter.logits(self.model.base_model, last)
        first = torch.empty(len(prompts), dtype=torch.long, device=self.device)
        for group, row in self._groups(ids_of_rows):
            index = torch.tensor(group, device=self.device)
            first[index] = choose(logits[index], row.sampling, row.generator)
        cache.commit(lengths)
        if self.drafting:  # the draft's entries: each position's features with the token after it
            after = pad_batch([[*p[1:], 0] for p in prompts])[0].to(self.device)
            after[torch.arange(len(prompts), device=self.device), lengths - 1] = first
            self.drafting.join(features, after, lengths, cache.max_len)
        if self.active:
            self.cache.extend(cache)
            self.hidden, self.root = torch.cat([self.hidden, last]), torch.cat([self.root, first])
        else:
            self.cache, self.hidden, self.root = cache, last, first
        self.active += ids_of_rows
        start = len(self.active) - len(ids_of_rows)
        self._emit(first[:, None], torch.ones_like(first), positions=range(start, len(self.active)))

    @torch.inference_mode()
    def _decode(self) -> None:
        batch = self.root.shape[0]
        requests = [self._rows[i] for i in self.active]
        if self.drafting:
            step, heads_on, drafts = self.drafting.tree(self.root), None, self._lookup_drafts(requests)
            if any(drafts):
                step = step.with_chain(self._padded(drafts, requests), self.tree.reach)
        else:
            step, heads_on, drafts = self._static_tree(requests)
        tokens = step.tokens
        n = tokens.shape[1]
        nodes = n - max(map(len, drafts), default=0)  # the tree's nodes, the (padded) lookup branch aside
        for row, draft in zip(requests, drafts or [[]] * batch, strict=True):
            row.verified.append(nodes + len(draft))
        lengths = self.cache.lengths
        positions = lengths[:, None] + step.depths  # (B, n)
        slots = torch.arange(int(lengths.max()) + n, device=self.device)
        rel = slots[None, :] - lengths[:, None]  # (B, S): slot offset from each row's tree start
        in_tree = (rel >= 0) & (rel < n)
        tree_part = step.mask.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(batch, n, -1)) & in_tree[:, None]
        allowed = (rel < 0)[:, None, :] | tree_part  # (B, n, S)
        hidden = self._forward(self.cache, tokens, positions, allowed[:, None], visible=slots.numel(), compiled=True)
        logits = adapter.logits(self.model.base_model, hidden)  # (B, n, V)
        path, count, next_token = self._accept(step, logits)
        path = path.clamp(min=0)  # (B, depth+1)
        self.cache.commit(count + 1, path if n > 1 else None)
        rows = torch.arange(batch, device=self.device)
        self.hidden, self.root = hidden[rows, path[rows, count]], next_token
        emitted = torch.cat([tokens.gather(1, path[:, 1:]), next_token[:, None]], dim=1)  # (B, depth+1)
        emitted[rows, count] = next_token  # the bonus goes right after the accepted candidates
        if self.drafting:  # the accepted nodes' features, each with the token after it
            self.drafting.accepted(hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1])), emitted,
                                   count + 1)
        if self.adapt:
            self._follow(requests, tokens, emitted, count, drafts, heads_on)
        self._emit(emitted, count + 1, positions=range(batch))

    def _accept(self, step: StepTree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's accepted path (B, depth+1), count (B,) and bonus token (B,); rows that share settings are
        accepted together (all rows at once where they all do)."""
        groups = self._groups(self.active)
        if len(groups) == 1:
            result = accept(step.tokens, logits, step.parents, step.retrieve, groups[0][1].sampling,
                            groups[0][1].generator)
            return result.path, result.count, result.next_token
        batch = logits.shape[0]
        path = torch.empty(batch, step.retrieve.shape[-1], dtype=torch.long, device=self.device)
        count = torch.empty(batch, dtype=torch.long, device=self.device)
        next_token = torch.empty(batch, dtype=torch.long, device=self.device)
        for group, row in groups:
            index = torch.tensor(group, device=self.device)
            result = accept(step.tokens[index], logits[index], step.parents[index], step.retrieve[index], row.sampling,
                            row.generator)
            path[index], count[index], next_token[index] = result.path, result.count, result.next_token
        return path, count, next_token

    def _static_tree(self, requests: list[_Row]) -> tuple[StepTree, bool, list[list[int]]]:
        """This step's nodes of the static tree: the heads' candidates (unless they do not pay this step) and
        the rows' prompt-lookup drafts; with whether the heads drafted, and the lookup drafts."""
        heads_on = self.tree.head_size > 1 and self._heads_pay(requests)
        buffers = self.full if heads_on or self.lookup_only is None else self.lookup_only
        tokens = self.root[:, None]
        if heads_on:
            candidates = self.model.heads.draft(self.hidden, self.root, buffers.levels, self.tree.topk)
            tokens = torch.cat([tokens, candidates], dim=1)  # (B, head_size)
        drafts = self._lookup_drafts(requests)
        if any(drafts):
            tokens = torch.cat([tokens, self._padded(drafts, requests)], dim=1)
        return StepTree.of(tokens, buffers), heads_on, drafts  # (the lookup branch may be cut short)

    def _lookup_drafts(self, requests: list[_Row]) -> list[list[int]]:
        """Each row's prompt-lookup draft (none without a lookup branch)."""
        return [lookup.continuation(r.prompt + r.tokens, r.lookup_budget) for r in requests if self.tree.lookup]

    def _padded(self, drafts: list[list[int]], requests: list[_Row]) -> torch.Tensor:
        """The rows' prompt-lookup drafts (B, longest draft), shorter ones padded with their text's
        last token (a pad that happens to be right is still verified, so it is still right)."""
        width = max(map(len, drafts))
        padded = [d + [(r.tokens or r.prompt)[-1]] * (width - len(d)) for d, r in zip(drafts, requests, strict=True)]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _heads_pay(self, requests: list[_Row]) -> bool:
        """Whether this step verifies the heads' guesses: some row's heads pay for themselves (or are
        not measured yet), or it is a step that measures them again."""
        if self.heads_threshold is None:
            return True
        self.decoded_steps += 1
        return self.decoded_steps % adaptive.REFRESH == 0 or any(
            r.head_depth is None or r.head_depth >= self.heads_threshold for r in requests)

    def _follow(self, requests: list[_Row], tokens, emitted, count, drafts: list[list[int]], heads_on: bool) -> None:
        """Update each row's head-depth average and lookup budget from what this step emitted."""
        if heads_on and self.heads_threshold is not None:
            size = self.tree.head_size
            depths = adaptive.head_depths(tokens[:, :size], emitted, count, self.full.depths[:size],
                                          self.full.mask[:size, :size])
            for row, depth in zip(requests, depths.tolist(), strict=True):
                row.head_depth = adaptive.smoothed(row.head_depth, depth)
        if any(drafts):
            for row, draft, out, c in zip(requests, drafts, emitted.tolist(), count.tolist(), strict=True):
                right = lookup.first_difference(draft, out[: c + 1])
                row.lookup_budget = adaptive.next_lookup_budget(row.lookup_budget, len(draft), right, self.tree.lookup)

    def _forward(self, cache: TreeCache, ids, positions, allowed, visible: int, rows=None,
                 compiled: bool = False) -> torch.Tensor:
        """Run the base model's decoder over ids, writing their keys/values into the cache (into
        `rows` of it only, when given); `compiled`: through the model's compiled decoder, if any."""
        cache.prepare(ids.shape[1], visible, rows)
        base = self.model.base_model
        mask = adapter.attention_mask(base.config, allowed, positions, base.dtype)
        compiled = compiled and self.model.compiled_decoder
        if self.lean and not compiled:
            return self.lean.forward(ids, mask, positions, cache)
        body = compiled or adapter.decoder(base)
        out = body(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        return out.last_hidden_state

    # -- bookkeeping --------------------------------------------------------------------------

    def _groups(self, row_ids: list[int]) -> list[tuple[list[int], _Row]]:
        """Batch positions of rows that share settings (they were added together), with one such row."""
        groups: dict[int, list[int]] = {}
        for position, row_id in enumerate(row_ids):
            groups.setdefault(id(self._rows[row_id].generator), []).append(position)
        return [(p, self._rows[row_ids[p[0]]]) for p in groups.values()]

    def _emit(self, emitted: torch.Tensor, counts: torch.Tensor, positions: range) -> None:
        """Append new tokens to the rows at these batch positions, apply the stop rules, drop finished rows."""
        finished = set()
        for b, tokens, count in zip(positions, emitted.tolist(), counts.tolist(), strict=True):
            row = self._rows[self.active[b]]
            row.accept_lengths.append(0)
            for token in tokens[:count]:
                row.tokens.append(token)
                row.accept_lengths[-1] += 1
                row.finish_reason = self._finish_reason(row)
                if row.finish_reason:
                    finished.add(b)
                    break
            self._updates.append(Update(self.active[b], row.tokens[len(row.tokens) - row.accept_lengths[-1]:],
                                        row.finish_reason))
        if finished:
            self._keep([b for b in range(len(self.active)) if b not in finished])

    def _finish_reason(self, row: _Row) -> str | None:
        """Why the row ends after its last token: "stop", "length", or None (it goes on)."""
        if row.tokens[-1] in row.eos:
            return "stop"
        if row.stop:
            # a stop string of c characters ends within the last c tokens (plus a few that decode to nothing)
            window = self.model.tokenizer.decode(row.tokens[-(_STOP_SLACK + max(map(len, row.stop))):],
                                                 skip_special_tokens=True)
            if any(s in window for s in row.stop):
                text = self.model.tokenizer.decode(row.tokens, skip_special_tokens=True)
                row.stop_at = min(i for s in row.stop if (i := text.find(s)) >= 0)
                return "stop"
        return "length" if len(row.tokens) >= row.max_new_tokens else None

    @torch.inference_mode()  # the cache was made in inference mode; cancel() comes from outside it
    def _keep(self, keep: list[int]) -> None:
        """Shrink the batch to the rows at positions `keep`: rows from the end fill the gaps."""
        kept = set(keep)
        gaps = [b for b in range(len(keep)) if b not in kept]
        order = list(range(len(keep)))
        for gap, row in zip(gaps, [b for b in keep if b >= len(keep)], strict=True):
            order[gap] = row
        self.active = [self.active[b] for b in order]
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self.hidden, self.root = self.hidden[index], self.root[index]
        self.cache.keep_rows(index)
        if self.drafting:
            self.drafting.keep(index)

    def text(self, row_id: int) -> str:
        """A row's decoded text so far, cut before a stop string."""
        row = self._rows[row_id]
        text = self.model.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return text[: row.stop_at] if row.stop_at is not None else text


_STOP_SLACK = 16  # extra tokens decoded when looking for a stop string that the last token may complete


class TextDeltas:
    """The new text of one row since the last call, holding back what may still change: the tail
    that could grow into a stop string, and an incomplete multi-byte character."""

    def __init__(self, decoder: Decoder, row: int = 0):
        self.decoder, self.row, self.sent = decoder, row, ""
        self.hold = max((len(s) for s in decoder._rows[row].stop), default=1) - 1

    def __call__(self) -> str:
        text = self.decoder.text(self.row)
        if not self.decoder._rows[self.row].finish_reason:
            text = text[: len(text) - self.hold].rstrip("\ufffd")
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


PREFILL_TOKENS = 4096  # padded tokens per prefill pass (one longer prompt goes alone)


def _similar_lengths(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of the prompts in groups of similar lengths, each at most PREFILL_TOKENS padded tokens
    (each group in index order, so that one group of everything is the whole batch as it stands)."""
    order = sorted(range(len(prompts)), key=lambda b: len(prompts[b]))
    groups: list[list[int]] = []
    for b in order:  # ascending, so the newest prompt is the group's longest
        if groups and (len(groups[-1]) + 1) * len(prompts[b]) <= PREFILL_TOKENS:
            groups[-1].append(b)
        else:
            groups.append([b])
    return [sorted(group) for group in groups]


def pad_batch(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids and attention_mask (B, longest) for token lists of any lengths."""
    ids = torch.full((len(prompts), max(map(len, prompts))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    return ids, mask


def _check_tree(model, tree: Tree | DynamicTree, adapt: bool) -> None:
    """Raise when the tree does not fit the model's draft (Medusa heads or an EAGLE-style draft)."""
    draft = model.heads
    if isinstance(draft, eagle.EagleDraft):
        if isinstance(tree, Tree) and tree.size > 1:
            raise ValueError(f"an EAGLE-style draft grows its own tree at each step: use tree='dynamic-NxDxK' "
                             f"(e.g. 'dynamic-16x4x4') or 'auto', not {tree.name!r}")
    elif isinstance(tree, DynamicTree):
        raise ValueError(f"{tree.name!r} is grown by an EAGLE-style draft; these are Medusa heads: use a static "
                         "tree (e.g. 'auto', 'default', 'chain-3')")
    elif tree.size > 1:
        tree.check(draft.config.num_heads, draft.config.draft_vocab or draft.config.vocab_size)
    if adapt and isinstance(tree, DynamicTree):
        raise ValueError("adapt follows a static tree's heads; a dynamic tree follows the draft's confidence already")


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        generation = getattr(model.base_model, "generation_config", None)
        eos_token_id = getattr(generation, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = model.config.eos_token_id
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def pad_id(model) -> int:
    """The id that pads token ids: the tokenizer's, else the config's, else 0."""
    tokenizer = model.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return pad if pad is not None else getattr(model.config, "pad_token_id", None) or 0
