"""Candidate trees: static paths of head ranks, and the buffers that verify them in one pass.

A path lists, per depth, the rank of the candidate taken from that depth's head: `[0, 1]` is rank 0
of head 1 then rank 1 of head 2. Node 0 is the root (the base model's own next token); the other
nodes are sorted by depth so that every parent comes before its children.

An EAGLE-style draft grows a new tree at every step instead (`DynamicTree`, `medusa_heads.eagle`). Either
way, what one step verifies is a `StepTree`: one tree per row.

A tree may also carry a prompt-lookup branch (`lookup` > 0): a chain of up to that many tokens
below the root, drafted by `lookup.continuation` instead of the heads. Its nodes come after the
head nodes, so a step without a lookup match verifies only the head part: every buffer's prefix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

PRESET_DIR = Path(__file__).parent / "trees"


@dataclass
class Level:
    """The head nodes at depth d + 1 and the nodes they hang from, by node index: what head d drafts."""

    sources: torch.Tensor  # (m,) the nodes at depth d that have children
    parents: torch.Tensor  # (m,) each source's parent, as a position among the sources of depth d - 1 (0 at d = 0)
    children: torch.Tensor  # (c,) the nodes at depth d + 1
    source_of_child: torch.Tensor  # (c,) each child's parent, as a position among sources
    ranks: torch.Tensor  # (c,) each child's rank among its head's guesses


class Tree:
    """A tree of candidate paths with its precomputed verification buffers (all on CPU)."""

    def __init__(self, paths: list[list[int]] | list[tuple[int, ...]], name: str = "custom", lookup: int = 0):
        if not isinstance(lookup, int) or lookup < 0:
            raise ValueError(f"lookup must be a number of tokens >= 0, got {lookup!r}")
        self.name, self.lookup = name, lookup
        nodes: set[tuple[int, ...]] = set()
        for path in paths:
            path = tuple(path)
            if not path or not all(isinstance(r, int) and r >= 0 for r in path):
                raise ValueError(f"tree path {list(path)} must be a non-empty list of ranks >= 0")
            nodes.update(path[:i] for i in range(1, len(path) + 1))  # every prefix is a node too
        self.paths: list[tuple[int, ...]] = sorted(nodes, key=lambda p: (len(p), p))
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        self.head_size = 1 + len(self.paths)  # root and head nodes
        chain = range(self.head_size, self.head_size + lookup)  # the lookup branch's nodes
        parents = [0] + [index.get(p[:-1], 0) for p in self.paths] + [i - 1 if i > self.head_size else 0 for i in chain]

        n = len(parents)
        self.size = n  # most tokens verified per step, root included
        self.depths = torch.tensor([0] + [len(p) for p in self.paths] + list(range(1, lookup + 1)))  # (n,)
        self.ranks = torch.tensor([p[-1] for p in self.paths], dtype=torch.long)  # (head_size-1,)
        self.parents = torch.tensor(parents)  # (n,), the root is its own parent
        self.depth = max((len(p) for p in self.paths), default=0)  # heads the tree needs
        self.reach = max(self.depth, lookup)  # tokens sit up to this far past the last accepted one
        self.topk = int(self.ranks.max()) + 1 if self.paths else 1

        mask = torch.eye(n, dtype=torch.bool)  # (n, n): row i sees its ancestors and itself
        for i in range(1, n):
            mask[i] |= mask[parents[i]]
        self.mask = mask

        leaves = sorted(set(range(n)) - set(parents[1:])) if n > 1 else [0]
        retrieve = torch.full((len(leaves), self.reach + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            chain = [leaf]
            while chain[-1] != 0:
                chain.append(parents[chain[-1]])
            retrieve[row, : len(chain)] = torch.tensor(chain[::-1])
        self.retrieve = retrieve  # (P, reach + 1): root-to-leaf node indices, -1 padded

    def levels(self, device: torch.device | str = "cpu") -> list[Level]:
        """The head nodes depth by depth, as the heads draft them (`MedusaHeads.draft`)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)} | {(): 0}
        levels, previous = [], [0]
        for d in range(self.depth):
            below = [p for p in self.paths if len(p) == d + 1]
            sources = sorted({index[p[:-1]] for p in below})
            parents = [previous.index(index[self.paths[s - 1][:-1]]) if s else 0 for s in sources]
            children, source_of_child = [index[p] for p in below], [sources.index(index[p[:-1]]) for p in below]
            columns = (sources, parents, children, source_of_child, [p[-1] for p in below])
            levels.append(Level(*(torch.tensor(c, dtype=torch.long, device=device) for c in columns)))
            previous = sources
        return levels

    def check(self, num_heads: int, topk_limit: int) -> None:
        """Raise when the tree needs more heads than the model has, or ranks beyond what top-k offers."""
        if self.depth > num_heads:
            raise ValueError(
                f"tree {self.name!r} is {self.depth} deep but the model has {num_heads} heads: "
                f"use a tree of depth <= {num_heads} (e.g. 'chain-{num_heads}')"
            )
        if self.topk > topk_limit:
            raise ValueError(f"tree {self.name!r} asks for rank {self.topk - 1}, beyond the top-{topk_limit} available")

    def to_json(self) -> dict:
        lookup = {"lookup": self.lookup} if self.lookup else {}
        return {"name": self.name, "paths": [list(p) for p in self.paths], **lookup}

    def save(self, path: str | Path, **extra) -> None:
        Path(path).write_text(json.dumps({**self.to_json(), **extra}, indent=1) + "\n")

    def __repr__(self) -> str:
        return f"Tree({self.name!r}, size={self.size}, depth={self.depth}, topk={self.topk}, lookup={self.lookup})"

    def with_lookup(self, tokens: int) -> Tree:
        """The same head paths with a prompt-lookup branch of up to `tokens` tokens."""
        name = self.name.split("+lookup")[0] + (f"+lookup{tokens}" if tokens else "")
        return Tree([list(p) for p in self.paths], name=name, lookup=tokens)

    @classmethod
    def chain(cls, depth: int) -> Tree:
        """Top-1 of each of the first `depth` heads: the single chain vLLM and TGI draft."""
        return cls([[0] * depth], name=f"chain-{depth}") if depth else cls([], name="plain")

    @classmethod
    def dense(cls, width: int, depth: int) -> Tree:
        """Every combination of the top-`width` ranks of the first `depth` heads."""
        paths: list[list[int]] = [[]]
        for _ in range(depth):
            paths = [[*p, r] for p in paths for r in range(width)]
        return cls(paths, name=f"dense-{width}x{depth}")

    @classmethod
    def load(cls, spec: str | Path | Tree | list) -> Tree | DynamicTree:
        """A Tree from a preset name, a JSON file, or a list of paths; 'dynamic-NxDxK' is the `DynamicTree`
        an EAGLE-style draft grows.

        Presets: 'plain' (no candidates), 'chain-D', 'dense-WxD', and the JSON files shipped in
        medusa_heads/trees ('reference' is the original 63-node tree, 'default' the calibrated one).
        'SPEC+lookupL' adds (or replaces) a prompt-lookup branch of L tokens; 'SPEC+lookup0' drops it.
        """
        if isinstance(spec, (Tree, DynamicTree)):
            return spec
        if isinstance(spec, list):
            return cls(spec)
        text = str(spec)
        if m := re.fullmatch(r"(.+)\+lookup(\d+)", text):
            return cls.load(m[1]).with_lookup(int(m[2]))
        if text == "plain":
            return cls.chain(0)
        if text.startswith("dynamic-"):
            return DynamicTree.parse(text)
        if m := re.fullmatch(r"chain-(\d+)", text):
            return cls.chain(int(m[1]))
        if m := re.fullmatch(r"dense-(\d+)x(\d+)", text):
            return cls.dense(int(m[1]), int(m[2]))
        file = Path(text)
        if not file.suffix and (PRESET_DIR / f"{text}.json").exists():
            file = PRESET_DIR / f"{text}.json"
        if not file.exists():
            names = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
            raise ValueError(
                f"unknown tree {text!r}: give a JSON file, 'plain', 'chain-D', 'dense-WxD' or one of {names}"
            )
        data = json.loads(file.read_text())
        if isinstance(data, list):
            return cls(data, name=file.stem)
        if "paths" not in data and str(data.get("name", "")).startswith("dynamic-"):
            return DynamicTree.parse(data["name"])
        return cls(data["paths"], name=data.get("name", file.stem), lookup=data.get("lookup", 0))


@dataclass
class StepTree:
    """The trees one decoding step verifies, one per row, nodes sorted so that parents come first."""

    tokens: torch.Tensor  # (B, n) the node tokens, the root's first
    parents: torch.Tensor  # (B, n) the root is its own parent
    depths: torch.Tensor  # (B, n)
    mask: torch.Tensor  # (B, n, n) node i sees its ancestors and itself
    retrieve: torch.Tensor  # (B, P, reach + 1) root-to-node paths, -1 padded

    @classmethod
    def of(cls, tokens: torch.Tensor, buffers) -> StepTree:
        """A static tree's first tokens.shape[1] nodes for every row (`buffers`: the tree's tensors on the
        device, as views: nothing is copied per row)."""
        batch, n = tokens.shape
        retrieve = buffers.retrieve
        if n < buffers.parents.shape[0]:
            retrieve = retrieve.masked_fill(retrieve >= n, -1)
        return cls(tokens, buffers.parents[:n].expand(batch, n), buffers.depths[:n].expand(batch, n),
                   buffers.mask[:n, :n].expand(batch, n, n), retrieve.expand(batch, *retrieve.shape))

    def with_chain(self, chain: torch.Tensor, reach: int) -> StepTree:
        """These trees with a chain of tokens (B, L) below each root (a prompt-lookup branch), `reach` deep."""
        batch, n = self.tokens.shape
        below = torch.arange(n - 1, n - 1 + chain.shape[1], device=chain.device)
        below[0] = 0
        parents = torch.cat([self.parents, below.expand(batch, -1)], 1)
        return StepTree.from_parents(torch.cat([self.tokens, chain], 1), parents, reach)

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, depth: int) -> StepTree:
        """The trees of these per-row parents (B, n), at most `depth` deep; every node ends a path."""
        batch, n = parents.shape
        eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n)
        mask = eye
        for _ in range(depth):
            mask = eye | mask.gather(1, parents[..., None].expand(batch, n, n))
        depths = mask.sum(-1) - 1
        levels = torch.arange(depth + 1, device=parents.device)
        at_level = mask[:, :, None, :] & (depths[:, None, None, :] == levels[None, None, :, None])  # (B, n, D+1, n)
        retrieve = torch.where(at_level.any(-1), at_level.int().argmax(-1), -1)
        return cls(tokens, parents, depths, mask, retrieve)


@dataclass(frozen=True)
class DynamicTree:
    """A tree grown anew at every step by an EAGLE-style draft's own confidence (EAGLE-2): `depth` rounds,
    each expanding the `topk` best frontier nodes by their `topk` best children; the `tokens - 1` best
    nodes (a node scores the product of the draft's probabilities along its path) are verified with the
    root. Named 'dynamic-TOKENSxDEPTHxTOPK', and '+lookupL' with a prompt-lookup branch of up to L tokens
    below the root (as a static tree's)."""

    tokens: int
    depth: int
    topk: int
    lookup: int = 0

    def __post_init__(self) -> None:
        pool = self.topk + (self.depth - 1) * self.topk**2
        if not isinstance(self.lookup, int) or self.lookup < 0:
            raise ValueError(f"lookup must be a number of tokens >= 0, got {self.lookup!r}")
        if self.depth < 1 or self.topk < 1 or not 2 <= self.tokens <= pool + 1:
            raise ValueError(f"a dynamic tree needs depth >= 1, topk >= 1 and 2 <= tokens <= {pool + 1} (what "
                             f"{self.depth} rounds of top-{self.topk} grow, plus the root), got {self.name!r}")

    @classmethod
    def parse(cls, name: str) -> DynamicTree:
        if not (m := re.fullmatch(r"dynamic-(\d+)x(\d+)x(\d+)", name)):
            raise ValueError(f"a dynamic tree is named 'dynamic-TOKENSxDEPTHxTOPK' (e.g. 'dynamic-16x4x4'), "
                             f"got {name!r}")
        return cls(int(m[1]), int(m[2]), int(m[3]))

    @property
    def name(self) -> str:
        return f"dynamic-{self.tokens}x{self.depth}x{self.topk}" + (f"+lookup{self.lookup}" if self.lookup else "")

    @property
    def size(self) -> int:
        return self.tokens + self.lookup

    @property
    def head_size(self) -> int:
        return self.tokens

    @property
    def reach(self) -> int:
        return max(self.depth, self.lookup)

    def with_lookup(self, tokens: int) -> DynamicTree:
        return DynamicTree(self.tokens, self.depth, self.topk, tokens)

    def to_json(self) -> dict:
        return {"name": self.name}

    save = Tree.save

    def __repr__(self) -> str:
        return f"DynamicTree({self.name!r})"
