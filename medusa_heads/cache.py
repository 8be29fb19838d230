"""A preallocated, position-indexed KV cache with per-row lengths.

Slot i of a row holds the keys/values of that row's token at position i. A forward pass writes its
tokens at slots [length, length + q) of each row (set by `prepare`); `commit` then keeps the chosen
ones by moving them to [length, length + a) and advancing the row's length. Rejected rows are never
cleared: they lie past the length and are overwritten by the next pass.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kernels, speed


class TreeCacheLayer(CacheLayerMixin):
    """One attention layer's view of the cache, for transformers' queries (sizes); the buffers are the cache's."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: TreeCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.allocate(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise NotImplementedError("TreeCache.update writes every layer")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.visible, 0

    def get_seq_length(self) -> int:
        return int(self.owner.lengths.max())

    def get_max_length(self) -> int:
        return self.owner.max_len


class TreeCache(Cache):
    """KV cache for one batch of sequences, sized to what the request needs: the keys/values of all layers
    in one buffer each, (layers, B, kv_heads, max_len, head_dim), so that keeping the accepted tokens is
    one operation for all layers."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, device: torch.device):
        self.max_len = max_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # committed tokens per row
        self.write_index: tuple[torch.Tensor, torch.Tensor] | None = None
        self.visible = max_len  # slots the attention reads this pass (the rest is unused)
        self.subset: torch.Tensor | None = None  # the rows this pass runs on (None: all)
        self.keys = self.values = None  # made at the first update, when the shapes are known
        super().__init__(layers=[TreeCacheLayer(self) for _ in range(num_layers)])

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = self.lengths.shape[0], key_states.shape[1]
        kw = dict(dtype=key_states.dtype, device=key_states.device)
        self.keys = torch.zeros(len(self.layers), batch, heads, self.max_len, key_states.shape[-1], **kw)
        self.values = torch.zeros(len(self.layers), batch, heads, self.max_len, value_states.shape[-1], **kw)
        for layer in self.layers:
            layer.is_initialized = True

    def for_kernels(self, like: torch.Tensor, kv_heads: int, head_dim: int) -> tuple:
        """What a pass of the C++ kernels (`decoder_layers`) takes of the cache: the buffers (allocated at a first
        pass, for kv_heads x head_dim in like's dtype and device), where it writes, which rows it runs on and
        how many slots it reads."""
        if self.keys is None:
            shape = like.new_empty(0, kv_heads, 0, head_dim)
            self.allocate(shape, shape)
        rows, slots = self.write_index
        return self.keys, self.values, rows[:, 0], slots, self.subset, self.visible

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys is None:
            self.allocate(key_states, value_states)
        if key_states.shape[1] != self.keys.shape[2] or key_states.shape[-1] != self.keys.shape[-1]:
            raise ValueError("this model's attention layers differ in key/value heads or head size, "
                             "which the tree cache does not support")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows, slots = self.write_index  # (B, 1), (B, q)
        # keys[rows, :, slots] has shape (B, q, kv_heads, head_dim)
        keys[rows, :, slots] = key_states.transpose(1, 2)
        values[rows, :, slots] = value_states.transpose(1, 2)
        return self.read(layer_idx)

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values (B, kv_heads, visible, head_dim) of one layer that this pass attends to."""
        keys, values, span = self.keys[layer_idx], self.values[layer_idx], self.visible
        if self.subset is not None:
            return keys[self.subset, :, :span], values[self.subset, :, :span]
        return keys[:, :, :span], values[:, :, :span]

    def prepare(self, query_length: int, visible: int, rows: torch.Tensor | None = None, offset: int = 0) -> None:
        """Set where the next pass writes its `query_length` tokens (from `offset` slots past each row's
        length), and how many slots it reads; `rows` (B',) runs the pass on those rows only (e.g. a prefill
        in chunks of similar lengths)."""
        if visible > self.max_len:
            raise RuntimeError(f"KV cache of {self.max_len} slots cannot hold {visible} tokens")
        every = torch.arange(self.lengths.shape[0], device=self.lengths.device)
        if rows is not None and rows.shape == every.shape and torch.equal(rows, every):
            rows = None  # all rows in order: the buffers are read in place, not gathered
        self.subset = rows
        if rows is None:
            rows = every
        offsets = torch.arange(offset, offset + query_length, device=self.lengths.device)
        self.write_index = (rows[:, None], self.lengths[rows, None] + offsets)
        self.visible = visible

    def extend(self, other: TreeCache) -> None:
        """Append other's rows to this batch (both padded to the longer slot axis; a cache never written to
        holds zeros)."""
        size = max(self.max_len, other.max_len)
        like = self.keys if self.keys is not None else other.keys

        def rows(cache: TreeCache, t: torch.Tensor | None) -> torch.Tensor:
            if t is None:
                return like.new_zeros(like.shape[0], cache.lengths.shape[0], like.shape[2], size, like.shape[4])
            return torch.nn.functional.pad(t, (0, 0, 0, size - t.shape[3]))

        if like is not None:
            self.keys = torch.cat([rows(self, self.keys), rows(other, other.keys)], dim=1)
            self.values = torch.cat([rows(self, self.values), rows(other, other.values)], dim=1)
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
        if self.keys is not None:
            self.keys[:, moved], self.values[:, moved] = self.keys[:, source], self.values[:, source]
            self.keys, self.values = self.keys[:, : len(index)], self.values[:, : len(index)]

    def commit(self, counts: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Keep, per row, the first counts[b] of the tokens the last pass wrote.

        keep (B, a): keep[b, j] is an offset into those tokens, moved to offset j; None when the kept
        tokens already sit in order (a prefill, or a tree of the root alone).
        """
        if keep is not None and self.keys is not None:
            if speed.native_commit(self.keys):
                kernels.load().commit_moves(self.keys, self.values, self.lengths, keep, counts)
            else:
                rows = torch.arange(keep.shape[0], device=keep.device)[:, None]
                base = self.lengths[:, None]
                src, dst = base + keep, base + torch.arange(keep.shape[1], device=keep.device)
                self.keys[:, rows, :, dst] = self.keys[:, rows, :, src]
                self.values[:, rows, :, dst] = self.values[:, rows, :, src]
        self.lengths += counts
