"""Which tree candidates to keep: greedy, typical and exact acceptance as pure tensor functions.

All three share one rule: a node is accepted when its parent was accepted and its token passes a
per-node test at its parent; the longest accepted root-to-leaf prefix wins and one more token (the
bonus) is taken from the base model's distribution at its last node.

- greedy: the test is "equals the base argmax at the parent".
- exact: one token is sampled from the base distribution at every node; the test is "equals the
  sample at the parent". Following the tree while the samples agree with it, then emitting the
  first sample that leaves it, draws each token from the base model's own conditional: the output
  is distributed exactly as plain sampling. (This is the residual-renormalising tree rejection
  sampler for deterministic drafts: child i of a node is accepted with probability p(x_i) overall,
  and the residual after rejecting all children is p restricted to the other tokens.)
- typical: the test is p(x) > min(epsilon, delta * exp(-H(p))) at the parent; equally long paths
  are ranked by their summed log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels, speed
from .settings import setting

MODES = ("greedy", "typical", "exact")


@dataclass
class Sampling:
    """How tokens are chosen; one object for every acceptance mode, so defaults live in one place."""

    acceptance: str = setting("greedy", "greedy (identical to plain greedy decoding), exact (samples exactly as the "
                              "base model) or typical (the paper's typical acceptance: faster, not exact)", MODES)
    temperature: float = setting(1.0, "softmax temperature for typical / exact")
    top_p: float = setting(1.0, "nucleus filter for typical / exact")
    epsilon: float = setting(0.09, "typical: hard probability threshold")
    delta: float = setting(0.3, "typical: entropy-scaled threshold factor")

    def __post_init__(self) -> None:
        if self.acceptance not in MODES:
            raise ValueError(f"acceptance must be one of {MODES}, got {self.acceptance!r}")
        if self.acceptance != "greedy" and not self.temperature > 0:
            raise ValueError(f"acceptance={self.acceptance!r} samples and needs temperature > 0; use 'greedy' for 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Accepted:
    path: torch.Tensor  # (B, depth+1) node indices of the chosen root-to-leaf path, -1 padded
    count: torch.Tensor  # (B,) accepted candidates below the root
    next_token: torch.Tensor  # (B,) the bonus token, taken at path[count]


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) restricted to the smallest top set of mass >= top_p, renormalised. In float64 from
    the largest logit, so that any T > 0 and top_p > 0 give a distribution (in float32, T = 5e-324 is 0 and
    top_p = 5e-324 would drop every token)."""
    logits = logits.double()
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # mass before this token already enough
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.float()


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs (..., V) -> (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits (..., V): the argmax for greedy, else a sample at T / top_p."""
    if sampling.acceptance == "greedy":
        return logits.argmax(-1)
    return sample(sampling_probs(logits, sampling.temperature, sampling.top_p), generator)


def typical_accept(probs: torch.Tensor, tokens: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """Typical acceptance of tokens (...,) under probs (..., V): p(x) > min(epsilon, delta * exp(-H))."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    return probs.gather(-1, tokens[..., None])[..., 0] > threshold


def repeats_a_sibling(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(B, n): True where an earlier node with the same parent holds the same token; parents (n,) or (B, n)."""
    parents = parents.expand(tokens.shape)
    index = torch.arange(parents.shape[-1], device=parents.device)
    earlier_sibling = ((parents[:, :, None] == parents[:, None, :]) & (index[None, :] < index[:, None])
                       & (index[None, :] > 0))
    return ((tokens[:, :, None] == tokens[:, None, :]) & earlier_sibling).any(-1)


def longest_path(accept: torch.Tensor, retrieve: torch.Tensor, score: torch.Tensor | None = None):
    """The longest accepted prefix over all root-to-leaf paths.

    accept: (B, n) per-node test results (the root's is ignored); retrieve: (P, depth+1) or, one tree per
    row, (B, P, depth+1), -1 padded; score: optional (B, n) per-node score that breaks ties between equally
    long paths. Returns (path (B, depth+1), count (B,)).
    """
    batch = accept.shape[0]
    retrieve = retrieve.expand(batch, *retrieve.shape[-2:])
    nodes = retrieve.clamp(min=0)[..., 1:]  # (B, P, depth)
    flat = nodes.reshape(batch, -1)
    ok = accept.gather(1, flat).view(nodes.shape) & (retrieve[..., 1:] >= 0)  # (B, P, depth)
    run = ok.long().cumprod(-1)
    lengths = run.sum(-1)  # (B, P)
    if score is None:
        best = lengths.argmax(-1)
    else:
        path_score = (score.gather(1, flat).view(nodes.shape) * run).sum(-1)
        ties = lengths == lengths.max(-1, keepdim=True).values
        best = path_score.masked_fill(~ties, float("-inf")).argmax(-1)
    rows = torch.arange(batch, device=accept.device)
    return retrieve[rows, best], lengths[rows, best]


def accept(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    parents: torch.Tensor,
    retrieve: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Verify a tree: tokens (B, n) at the tree nodes, logits (B, n, V) the base model's there; parents (n,)
    and retrieve (P, depth+1) describe the tree (`Tree`), or one tree per row, (B, n) and (B, P, depth+1)."""
    if sampling.acceptance == "greedy" and speed.native_accept(logits):
        return Accepted(*kernels.load().greedy_accept(tokens, logits, parents, retrieve))
    score = None
    parents = parents.expand(tokens.shape)
    if sampling.acceptance == "typical":
        probs = sampling_probs(logits, sampling.temperature, sampling.top_p)
        parent_probs = probs.gather(1, parents[..., None].expand(-1, -1, probs.shape[-1]))  # (B, n, V)
        passed = typical_accept(parent_probs, tokens, sampling.epsilon, sampling.delta)
        score = torch.log(parent_probs.gather(-1, tokens[..., None])[..., 0].clamp_min(1e-30))
    else:
        target = choose(logits, sampling, generator)  # (B, n): argmax or one sample per node
        passed = tokens == target.gather(1, parents)
        if sampling.acceptance == "exact":
            passed &= ~repeats_a_sibling(tokens, parents)
    path, count = longest_path(passed, retrieve, score)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    last = path[rows, count]
    if sampling.acceptance == "typical":
        next_token = choose(logits[rows, last], sampling, generator)
    else:
        next_token = target[rows, last]
    return Accepted(path=path, count=count, next_token=next_token)
