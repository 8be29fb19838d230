"""A preallocated, position-indexed KV cache with per-row lengths.

Slot i of a row holds the keys/values of that row's token at position i. A forward pass writes its
tokens at slots [length, length + q) of each row (set by `prepare`); `commit` then keeps the chosen
ones by moving them to [length, length + a) and advancing the row's length. Rejected rows are never
cleared: they lie past the length and are overwritten by the next pass.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class TreeCacheLayer(CacheLayerMixin):
    """One attention layer's buffers: keys/values of shape (B, kv_heads, max_len, head_dim)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: TreeCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, size = self.owner.lengths.shape[0], key_states.shape[1], self.owner.max_len
        kw = dict(dtype=key_states.dtype, device=key_states.device)
        self.keys = torch.zeros(batch, heads, size, key_states.shape[-1], **kw)
        self.values = torch.zeros(batch, heads, size, value_states.shape[-1], **kw)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, slots = self.owner.write_index  # (B, 1), (B, q)
        # keys[rows, :, slots] has shape (B, q, kv_heads, head_dim)
        self.keys[rows, :, slots] = key_states.transpose(1, 2)
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        span = self.owner.visible
        if self.owner.subset is not None:
            return self.keys[self.owner.subset, :, :span], self.values[self.owner.subset, :, :span]
        return self.keys[:, :, :span], self.values[:, :, :span]

    def commit(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst in each row; both (B, a)."""
        self.keys[rows, :, dst] = self.keys[rows, :, src]
        self.values[rows, :, dst] = self.values[rows, :, src]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.visible, 0

    def get_seq_length(self) -> int:
        return int(self.owner.lengths.max())

    def get_max_length(self) -> int:
        return self.owner.max_len


class TreeCache(Cache):
    """KV cache for one batch of sequences, sized to what the request needs."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, device: torch.device):
        self.max_len = max_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # committed tokens per row
        self.write_index: tuple[torch.Tensor, torch.Tensor] | None = None
        self.visible = max_len  # slots the attention reads this pass (the rest is unused)
        self.subset: torch.Tensor | None = None  # the rows this pass runs on (None: all)
        super().__init__(layers=[TreeCacheLayer(self) for _ in range(num_layers)])

    def prepare(self, query_length: int, visible: int, rows: torch.Tensor | None = None) -> None:
        """Set where the next pass writes its `query_length` tokens, and how many slots it reads;
        `rows` (B',) runs the pass on those rows only (e.g. a prefill in chunks of similar lengths)."""
        if visible > self.max_len:
            raise RuntimeError(f"KV cache of {self.max_len} slots cannot hold {visible} tokens")
        every = torch.arange(self.lengths.shape[0], device=self.lengths.device)
        if rows is not None and rows.shape == every.shape and torch.equal(rows, every):
            rows = None  # all rows in order: the buffers are read in place, not gathered
        self.subset = rows
        if rows is None:
            rows = every
        offsets = torch.arange(query_length, device=self.lengths.device)
        self.write_index = (rows[:, None], self.lengths[rows, None] + offsets)
        self.visible = visible

    def extend(self, other: TreeCache) -> None:
        """Append other's rows to this batch (both padded to the longer slot axis)."""
        size = max(self.max_len, other.max_len)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, 0, size - t.shape[2]))

        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if mine.is_initialized and theirs.is_initialized:
                mine.keys = torch.cat([pad(mine.keys), pad(theirs.keys)])
                mine.values = torch.cat([pad(mine.values), pad(theirs.values)])
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.max_len = size

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows listed in index (B',), in that order: finished sequences leave the batch.

        Rows already in place are not copied, so filling the gaps with rows from the end of the
        batch (what the decoder does) costs only those rows, not the whole cache.
        """
        moved = (index != torch.arange(len(index), device=index.device)).nonzero().squeeze(1)
        source = index[moved]
        self.lengths = self.lengths[index]
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[moved], layer.values[moved] = layer.keys[source], layer.values[source]
                layer.keys, layer.values = layer.keys[: len(index)], layer.values[: len(index)]

    def commit(self, counts: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Keep, per row, the first counts[b] of the tokens the last pass wrote.

        keep (B, a): keep[b, j] is an offset into those tokens, moved to offset j; None when the kept
        tokens already sit in order (a prefill, or a tree of the root alone).
        """
        if keep is not None:
            rows = torch.arange(keep.shape[0], device=keep.device)[:, None]
            base = self.lengths[:, None]
            offsets = torch.arange(keep.shape[1], device=keep.device)
            for layer in self.layers:
                if layer.is_initialized:
                    layer.commit(rows, base + keep, base + offsets)
        self.lengths += counts
