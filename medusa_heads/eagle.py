"""An EAGLE-style draft: one small decoder layer run autoregressively over the base model's features.

At sequence position t the draft reads f_t, the base model's last hidden state there (post final norm:
what enters lm_head, the same tensor in training and in decoding), and the embedding of token t + 1; a
linear map 2h -> h and one decoder layer (Llama-style, without its first norm) turn them into g_{t+1}, a
guess of f_{t+1}. The base lm_head (or the rows of a draft vocabulary) scores g_{t+1}, guessing token
t + 2, and g_{t+1} goes on as the feature of the next position: so the draft runs ahead of the base.

Decoding (`Drafting`): the draft keeps its own KV cache, one entry per position of real features. Each
step first runs the entries the last verification accepted, then grows a tree as EAGLE-2 does
(`tree.DynamicTree`): `depth` rounds, each running the `topk` best frontier nodes through the draft with
tree attention and giving each its `topk` best children, a node scoring the product of the draft's
probabilities along its path; the `tokens - 1` best nodes go to the base model for verification, with the
same acceptance as Medusa's trees (greedy output identical to plain greedy, `exact` sampling exact).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels, lean, speed
from .cache import TreeCache
from .tree import DynamicTree, StepTree
from .vocabulary import DraftVocabulary

KIND = "eagle"


@dataclass
class EagleConfig:
    hidden_size: int  # width of the base model's last hidden state
    vocab_size: int  # rows of the base lm_head
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    draft_vocab: int = 0  # > 0: the draft proposes only these tokens (`token_map`), a cheaper projection
    kind: str = KIND

    def __post_init__(self) -> None:
        if self.kind != KIND:
            raise ValueError(f"not an EAGLE-style draft config (kind={self.kind!r})")
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab must be in [0, {self.vocab_size}], got {self.draft_vocab}")

    @classmethod
    def for_base(cls, config, draft_vocab: int = 0) -> EagleConfig:
        """A draft layer shaped like one of the base model's layers (attention heads, MLP width)."""
        text = config.get_text_config()
        hidden = text.hidden_size
        heads = getattr(text, "num_attention_heads", None) or text.n_head
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
        rope = getattr(text, "rope_parameters", None) or {}
        return cls(hidden, text.vocab_size, heads, kv, head_dim, intermediate,
                   float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
                   float(getattr(text, "rms_norm_eps", 1e-6)), draft_vocab)

    def to_dict(self) -> dict:
        return asdict(self)


class DraftLayer(nn.Module):
    """Attention over the draft's cache (or causal, without one), then a SwiGLU MLP behind an RMSNorm."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_attention_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        inverse = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inverse, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: TreeCache | None = None,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, q, H) at positions (B, q); with a cache (prepared for this pass), attend where `allowed`
        (B, 1, q, visible slots); without one, causally over x. Within a decoding step on a CPU (float32, the
        kernels built: `speed.native_draft`) a pass over the cache is one C++ call (`csrc/decoder_layers.cpp`)
        over the products' bfloat16 copies."""
        batch, q, _ = x.shape
        angles = positions[..., None].float() * self.inv_freq  # (B, q, head_dim / 2)
        cos, sin = (torch.cat([f, f], dim=-1).to(x.dtype) for f in (angles.cos(), angles.sin()))
        if cache is not None and speed.native_draft(x):
            return self._native(x, cos, sin, cache, allowed)
        cos, sin = cos[:, None], sin[:, None]

        def heads(layer: nn.Linear, count: int, rotate: bool) -> torch.Tensor:
            t = layer(x).view(batch, q, count, self.head_dim).transpose(1, 2)
            if not rotate:
                return t
            half = torch.cat([-t[..., self.head_dim // 2:], t[..., : self.head_dim // 2]], dim=-1)
            return t * cos + half * sin

        query, key, value = heads(self.q_proj, self.heads, True), heads(self.k_proj, self.kv_heads, True), heads(
            self.v_proj, self.kv_heads, False)
        if cache is not None:
            key, value = cache.update(key, value, 0)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, is_causal=cache is None,
                                             enable_gqa=self.heads != self.kv_heads)
        x = x + self.o_proj(out.transpose(1, 2).reshape(batch, q, -1))
        h = self.post_attention_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def _native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TreeCache,
                allowed: torch.Tensor) -> torch.Tensor:
        """The pass as `decoder_layers` runs a base layer without its input norm, nor a final one."""
        none = x.new_empty(0)  # a norm or a bias the layer does not have

        def products(*names: str) -> list[torch.Tensor]:  # (weight, bias) of each
            return [t for name in names for t in (speed.draft_weight(getattr(self, name).weight), none)]

        params = [none, none, none, *products("q_proj", "k_proj", "v_proj", "o_proj"), self.post_attention_norm.weight,
                  *products("gate_proj", "up_proj", "down_proj")]
        mask = torch.zeros(x.shape[0], 1, *allowed.shape[-2:], dtype=x.dtype).masked_fill_(
            ~allowed, torch.finfo(x.dtype).min)
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        residual = x.clone(memory_format=torch.contiguous_format)  # the call updates it in place
        return kernels.load().decoder_layers(
            residual, params, False, sizes, False, [self.gate_proj.out_features] * 2, none,
            self.post_attention_norm.eps, lean.Native.ROUTES["draft"], cos, sin,
            *cache.for_kernels(x, self.kv_heads, self.head_dim), [mask], self.head_dim**-0.5)


class EagleDraft(DraftVocabulary):
    """The draft module: `fc` (2h -> h) and one `DraftLayer`; the base model's token embeddings and lm_head
    are borrowed, frozen, and not part of its parameters (nor of its saved weights)."""

    def __init__(self, config: EagleConfig, embeddings: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.layer = DraftLayer(config)
        object.__setattr__(self, "base_embeddings", embeddings)
        self.borrow_lm_head(lm_head, config.draft_vocab)
        self.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: TreeCache | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """g (B, q, H) from features f_t (B, q, H) and the tokens t + 1 (B, q) at positions t (B, q)."""
        embedded = self.base_embeddings(tokens.to(self.base_embeddings.weight.device)).to(self.fc.weight.dtype)
        x = speed.draft_linear(torch.cat([features.to(self.fc.weight.dtype), embedded], dim=-1), self.fc.weight,
                               self.fc.bias)
        return self.layer(x, positions, cache, allowed)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of the draft's states."""
        return self.shared_logits(states)


class Drafting:
    """The draft's side of a decoding batch: its KV cache (slot i holds the entry of position i, made from
    real features) and, per row, the entries not yet run: (features, next tokens, count)."""

    def __init__(self, draft: EagleDraft, shape: DynamicTree):
        self.draft, self.shape = draft, shape
        self.cache: TreeCache | None = None
        self.features = self.tokens = self.counts = None

    def join(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, slots: int) -> None:
        """Rows that joined the batch: their prompts' entries (B', T, H), (B', T), (B',); `slots` the base
        cache's size for them."""
        cache = TreeCache(1, features.shape[0], slots + self.shape.depth * self.shape.topk, features.device)
        if self.cache is None:
            self.cache, self.features, self.tokens, self.counts = cache, features, tokens, counts
            return
        self.cache.extend(cache)
        width = max(self.tokens.shape[1], tokens.shape[1])
        self.features = torch.cat([_pad(self.features, width), _pad(features, width)])
        self.tokens = torch.cat([_pad(self.tokens, width), _pad(tokens, width)])
        self.counts = torch.cat([self.counts, counts])

    def keep(self, index: torch.Tensor) -> None:
        """Keep the rows listed in index, in that order."""
        self.cache.keep_rows(index)
        self.features, self.tokens, self.counts = self.features[index], self.tokens[index], self.counts[index]

    def accepted(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """What a verification kept per row: the features of its accepted nodes (B, a, H), the token after
        each (B, a) and how many of the a are real (B,)."""
        self.features, self.tokens, self.counts = features, tokens, counts

    @torch.inference_mode()
    def tree(self, root: torch.Tensor) -> StepTree:
        """Run the pending entries, then grow this step's tree below each row's root token (B,)."""
        draft, cache, shape = self.draft, self.cache, self.shape
        batch, width = self.tokens.shape
        device = root.device
        rows = torch.arange(batch, device=device)
        lengths = cache.lengths
        positions = lengths[:, None] + torch.arange(width, device=device)
        slots = torch.arange(int(lengths.max()) + width, device=device)
        cache.prepare(width, slots.numel())
        allowed = slots[None, None, None, :] <= positions[:, None, :, None]
        state = draft(self.features, self.tokens, positions, cache, allowed)[rows, self.counts - 1]  # (B, H)
        cache.commit(self.counts)

        k = shape.topk
        logp = torch.log_softmax(draft.logits(state).float(), dim=-1)
        scores, index = logp.topk(k, dim=-1)  # depth 1: the root's best children
        tokens = draft.token_ids(index)
        pool_tokens, pool_parents, pool_scores = [tokens], [torch.full_like(index, -1)], [scores]
        frontier = torch.arange(k, device=device).expand(batch, k)  # pool indices of the nodes to expand
        inputs = state[:, None].expand(batch, k, state.shape[-1])  # the feature each frontier node reads
        seen = torch.eye(k, shape.depth * k, dtype=torch.bool, device=device).expand(batch, k, -1)
        lengths, pooled = cache.lengths, k
        for d in range(1, shape.depth):
            # the frontier (depth d: its tokens and scores) through the draft: it sees the cache, its
            # ancestors and itself
            slots = torch.arange(int(lengths.max()) + d * k, device=device)
            rel = slots[None, :] - lengths[:, None]  # (B, S)
            ancestors = seen.gather(2, rel.clamp(0, d * k - 1)[:, None, :].expand(batch, k, -1))
            allowed = ((rel < 0)[:, None, :] | (ancestors & (rel < d * k)[:, None, :]))[:, None]
            cache.prepare(k, slots.numel(), offset=(d - 1) * k)
            out = draft(inputs, tokens, (lengths + d - 1)[:, None].expand(batch, k), cache, allowed)  # (B, k, H)
            logp = torch.log_softmax(draft.logits(out).float(), dim=-1)
            child_scores, index = logp.topk(k, dim=-1)  # (B, k, k)
            child_scores = (scores[..., None] + child_scores).flatten(1)
            child_tokens = draft.token_ids(index).flatten(1)
            pool_tokens.append(child_tokens)
            pool_parents.append(frontier[:, :, None].expand(batch, k, k).flatten(1))
            pool_scores.append(child_scores)
            if d + 1 < shape.depth:  # the best k children are the next frontier
                scores, best = child_scores.topk(k, dim=-1)  # (B, k)
                tokens, parent = child_tokens.gather(1, best), best // k
                frontier = pooled + best
                inputs = out.gather(1, parent[..., None].expand(-1, -1, out.shape[-1]))
                seen = seen.gather(1, parent[..., None].expand(-1, -1, seen.shape[-1]))
                seen[:, torch.arange(k, device=device), d * k + torch.arange(k, device=device)] = True
            pooled += k * k
        return _best_nodes(root, torch.cat(pool_tokens, 1), torch.cat(pool_parents, 1), torch.cat(pool_scores, 1),
                           shape)


def _best_nodes(root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                shape: DynamicTree) -> StepTree:
    """The root and the `shape.tokens - 1` best-scoring nodes of the pool (B, P) as a tree, parents first.

    A node scores at most its parent (log-probabilities add up), and the pool lists parents before their
    children, so a stable sort keeps every chosen node's ancestors.
    """
    batch, device = tokens.shape[0], tokens.device
    chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : shape.tokens - 1]
    chosen = chosen.sort(dim=-1).values  # pool order: parents before children
    node_of = torch.zeros_like(parents)  # pool index -> node index (0: not chosen)
    node_of.scatter_(1, chosen, torch.arange(1, chosen.shape[1] + 1, device=device).expand_as(chosen))
    parent_pool = parents.gather(1, chosen)
    node_parents = torch.where(parent_pool < 0, 0, node_of.gather(1, parent_pool.clamp(min=0)))
    node_parents = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), node_parents], 1)  # (B, n)
    node_tokens = torch.cat([root[:, None], tokens.gather(1, chosen)], 1)
    return StepTree.from_parents(node_tokens, node_parents, shape.depth)


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """t padded with zeros along dim 1 to `width`."""
    pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
    return F.pad(t, pad)
