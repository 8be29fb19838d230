"""Speed levers of the decoding loop that leave its outputs exact; each can be switched off.

Kernel routes: a decoding step runs every linear layer over a few rows (1 to ~64 tree tokens per
sequence). On a CPU there are two exact ways to do it, and which is faster depends on the CPU and
the number of rows: "aten" (F.linear: MKL's sgemm in float32) and "packed" (oneDNN's linear over a
copy of the weight reordered once into its blocked layout). On a 2-core AMD EPYC packed is nearly
flat in the rows and aten grows fast (SmolLM2-135M's 210 linear layers with cold caches: 1 row 41
-> 21 ms, 16 rows 76 -> 27 ms); on a 2-core Sapphire Rapids aten wins at one row. So
`probe_routes` times both on the model's own layers, per row count, and the decoding step takes the
faster (`Routes`, chosen per machine by `medusa_heads.tuning`). A third route, "stream"
(`medusa_heads.kernels`, compiled on first use), reads each weight row once for all rows: on a
2-core AMD EPYC it takes SmolLM2-135M's products at 1 row in ~27-34 ms against packed's ~40-52, and
wins up to ~16 rows; the probe takes it where it measures faster. A bfloat16 model's products take it too
(summed in float32, by AVX512-BF16 pair products where the CPU has them, rounded once): on a 2-core Zen 4
SmolLM2-135M's in 10.6 ms at 1 row, 12.9 at 4, against packed bfloat16's 18.4 and 16.0. Without a probe,
float32 takes the packed route and bfloat16 aten. Each packed weight is a second copy of the weight, made at its first
use once packing has paid (`Routes`: until then the copies are rented) and remade when the weight
changes; a model whose copies would not fit in half the free memory decodes without them. Set
MEDUSA_HEADS_PACKED_WEIGHTS=0 to turn packing off. Transformers' own generate is untouched: routes apply
within a decoding step only.

Fused siblings: layers that read the same input one after another (q/k/v, gate/up: found by
watching one forward) take one product over their weights concatenated, which halves the number of
products of a Llama layer (each oneDNN call costs ~25 us however small; on a 2-core AMD EPYC a plain
step takes 0.94x the time, a tree step 0.96x). The concatenated weight is one more copy of those
layers. Set MEDUSA_HEADS_FUSED_LINEARS=0 to turn it off.

Grouped attention: with grouped-query attention (fewer key/value heads than query heads) and a tree
mask, transformers' sdpa attention copies every key/value head once per query head it serves, per
layer and pass (SmolLM2-135M: 3x its cache read each step). Within a decoding step on a CPU, sdpa
reads the shared heads in place instead (`enable_gqa`): on a 2-core AMD EPYC, 30 layers of a
21-token tree over 2000 cached tokens take 40 ms instead of 94. Outside a step, and on a GPU (where
a mask with `enable_gqa` falls back to the slow math kernel), transformers' function runs as is.
Set MEDUSA_HEADS_GROUPED_ATTENTION=0 to turn it off.

Drafts in bfloat16: a draft's proposals are all verified, so they need not round as the base model's products do.
Within a decoding step on a CPU, a draft's vocabulary projection (`draft_linear`: the Medusa heads' or an
EAGLE-style draft's lm_head rows, 8,192 x 576 for the default heads) reads a bfloat16 copy of its float32 weight
through the stream kernel, its sums in four chains a row (a one-row product over a weight the caches hold is bound
by the adds' latency, not the memory): half the memory, and ~0.5 ms instead of ~1 per level of the heads' tree on a
2-core AMD EPYC (Zen 3). The outputs are unchanged: greedy and exact sampling accept only what the base model
chooses. Set MEDUSA_HEADS_DRAFT_BF16=0 to turn it off.

Native drafts: within a decoding step on a CPU, chained Medusa heads in float32 draft a whole tree in one C++ call
(`native_draft`; `csrc/draft_heads.cpp`): per depth the token input, the residual blocks, the projection and the
top-k, with no torch operation between them. After a step's 540 MB of weights the caches hold none of Python's
or torch's own code and data, so each small operation costs ~0.1 ms there: the default heads' 2-level draft took
2.1 ms instead of 4.4 (Zen 3, cold caches). Set MEDUSA_HEADS_NATIVE_DRAFT=0 to draft with the heads' modules.

Native acceptance: within a decoding step on a CPU, greedy acceptance of float32 logits is one C++ call
(`native_accept`; `csrc/greedy_accept.cpp`): the argmax at every node, the longest agreeing path and the bonus
token, with the same results as its dozen torch operations: with cold caches 0.25 ms instead of 0.83 for one node,
0.31 instead of 1.03 for nine (Zen 3). Keeping the accepted tokens in the cache (any acceptance: `native_commit`;
`csrc/cache_commit.cpp`) is one C++ loop too, instead of torch's indexed copies. Set MEDUSA_HEADS_NATIVE_ACCEPT=0
to accept and keep with those.

Compiled decoding passes (opt-in: `MedusaModel.compile_decoding()`, `--compile`): the decoder's
verification passes run through torch.compile, which fuses the many small operations around the
matrix products (norms, rotary embeddings, residuals, cache writes) that eager mode runs one by one.
Shapes are dynamic (batch, tree size and cache length change between passes), so it compiles once
for one-token passes and once for tree passes (and again for batch 1 vs more); the first compile
takes about a minute per graph on a 2-core CPU, later processes reuse inductor's on-disk cache (15 s
to the first compiled step on a 2-core AMD EPYC). Prefill stays eager.
"""

from __future__ import annotations

import os
import random
import statistics
import time
import warnings
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import kernels, lean
from .kernels import stream_linear

ENABLED = os.environ.get("MEDUSA_HEADS_PACKED_WEIGHTS", "1") != "0" and torch.backends.mkldnn.is_available()
FUSED = os.environ.get("MEDUSA_HEADS_FUSED_LINEARS", "1") != "0"
GROUPED_ATTENTION = os.environ.get("MEDUSA_HEADS_GROUPED_ATTENTION", "1") != "0"
DRAFT_BF16 = os.environ.get("MEDUSA_HEADS_DRAFT_BF16", "1") != "0"
NATIVE_DRAFT = os.environ.get("MEDUSA_HEADS_NATIVE_DRAFT", "1") != "0"
NATIVE_ACCEPT = os.environ.get("MEDUSA_HEADS_NATIVE_ACCEPT", "1") != "0"
ROUTED_DTYPES = (torch.float32, torch.bfloat16)
PROBE_WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # rows per product that `probe_routes` times
_packed = WeakIdKeyDictionary()  # weight -> (its version when packed, its packed copy)
_halves = WeakIdKeyDictionary()  # weight -> (its version when copied, its bfloat16 copy)
_columns = WeakIdKeyDictionary()  # weight -> (its version when laid out, its copy by columns)
_PACKED_FOR_ROWS = 16  # the row count oneDNN picks the packed layout for
ROW_EXACT = ("stream", "columns")  # the routes whose every output sums over k in one order whatever the other rows
STEP_ROWS = 16  # the widths a decoding step's route is chosen for (a plain step's row to a wide tree's)


@dataclass(frozen=True)
class Routes:
    """The kernel route of a linear product by dtype and row count: per dtype name, the route chosen
    at each probed width; a product takes the choice of the smallest probed width >= its rows (the
    largest beyond them). Dtypes not probed take the unprobed default.

    Packed copies cost time to make (SmolLM2-135M's: ~0.86 s on a 2-core AMD EPYC, Zen 3, what some eighteen
    prefills of 30 tokens gain by them), so where the probe timed that (`packing`), products whose choice is
    packed take the fastest other route until the time they lost by it reaches the time to pack, then the packed
    copies are made (ski rental: at most twice the best choice in hindsight, for one prompt or a server's
    thousands)."""

    widths: tuple[int, ...] = PROBE_WIDTHS
    choice: dict[str, tuple[str, ...]] = field(default_factory=dict)  # "torch.float32" -> route per width
    times: dict[str, dict[str, tuple[float, ...]]] = field(default_factory=dict)  # dtype -> route -> ms per width
    packing: dict[str, tuple[float, int]] = field(default_factory=dict)  # dtype -> (ms to pack, elements packed)
    lost: dict[str, float] = field(default_factory=dict, compare=False)  # dtype -> ms lost so far without packing

    def route(self, rows: int, dtype: torch.dtype, elements: int) -> str:
        """The route of products of `rows` rows over `elements` weight elements in all (charged to the rental of
        packed copies, when it runs)."""
        key = str(dtype)
        names = self.choice.get(key)
        if names is None:
            return "packed" if dtype == torch.float32 else "aten"
        width = min(bisect_left(self.widths, rows), len(names) - 1)
        name = names[width]
        if name != "packed" or key not in self.packing or self.lost.get(key, 0.0) >= self.packing[key][0]:
            return name
        times = self.times[key]
        other = min((r for r in times if r != "packed"), key=lambda r: times[r][width])
        self.lost[key] = self.lost.get(key, 0.0) + (times[other][width] - times["packed"][width]) * (
            elements / self.packing[key][1])
        return name if self.lost[key] >= self.packing[key][0] else other

    def for_steps(self) -> Routes:
        """These routes for the passes of decoding steps: per dtype, one route whose rows round alone (`ROW_EXACT`)
        at every row count, so that a tree pass's rows round as a plain step's row does and greedy output does not
        depend on the tree (nor on the rows beside it in a batch): the one of least probed time summed over the
        widths up to `STEP_ROWS` (or the one-row choice, where it is one and nothing was timed)."""
        choice, steps = {}, [i for i, w in enumerate(self.widths) if w <= STEP_ROWS]
        for key, names in self.choice.items():
            times = {r: t for r, t in self.times.get(key, {}).items() if r in ROW_EXACT}
            exact = min(times, key=lambda r: sum(times[r][i] for i in steps),
                        default=names[0] if names[0] in ROW_EXACT else None)
            choice[key] = names if exact is None else (exact,) * len(names)
        return replace(self, choice=choice, lost={})

    def to_json(self) -> dict:
        return {"widths": list(self.widths), "choice": {k: list(v) for k, v in self.choice.items()},
                "times": {k: {r: list(t) for r, t in v.items()} for k, v in self.times.items()},
                "packing": {k: list(v) for k, v in self.packing.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Routes:
        times = {k: {r: tuple(t) for r, t in v.items()} for k, v in data.get("times", {}).items()}
        packing = {k: tuple(v) for k, v in data.get("packing", {}).items()}
        return cls(tuple(data["widths"]), {k: tuple(v) for k, v in data["choice"].items()}, times, packing)

    def table(self) -> str:
        """The probed milliseconds of all linear layers per route and width, one line per dtype and route."""
        lines = [f"{'rows':>22} " + "".join(f"{w:>8}" for w in self.widths)]
        for dtype, routes in self.times.items():
            for route, ms in routes.items():
                lines.append(f"{dtype.removeprefix('torch.') + ' ' + route:>22} " + "".join(f"{t:>8.1f}" for t in ms))
        return "\n".join(lines)


_in_step: ContextVar[Routes | None] = ContextVar("medusa_heads_decoding_step", default=None)


def _copy(copies: WeakIdKeyDictionary, weight: torch.Tensor, make: Callable) -> torch.Tensor:
    """make(weight), made once per version of the weight and kept in copies."""
    version = (weight.data_ptr(), weight._version)
    entry = copies.get(weight)
    if entry is None or entry[0] != version:
        entry = copies[weight] = version, make(weight.detach())
    return entry[1]


def packed(weight: torch.Tensor) -> torch.Tensor:
    """weight in oneDNN's blocked layout for linear products, packed once per version of the weight."""
    return _copy(_packed, weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, _PACKED_FOR_ROWS))


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear over weight's packed copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "none", [], "")


def columns(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) laid out by columns for `csrc/columns_linear.cpp`, once per version of it: blocks of 16 outputs,
    each k's 16 weights together (float32: (N / 16, K, 16); bfloat16: k in pairs, (N / 16, K / 2, 16, 2)); zeros
    pad N to 16s and a bfloat16 K to 2s."""
    def lay_out(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        pairs = 2 if w.dtype == torch.bfloat16 else 1
        padded = F.pad(w, (0, -k % pairs, 0, -n % 16))
        blocks = padded.view(padded.shape[0] // 16, 16, padded.shape[1] // pairs, pairs).transpose(1, 2)
        return blocks.contiguous() if pairs == 2 else blocks.squeeze(-1).contiguous()

    return _copy(_columns, weight, lay_out)


def _columns_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The columns kernel's product over weight's copy by columns."""
    return kernels.columns_linear(x, columns(weight), bias, weight.shape[0])


ROUTES: dict[str, Callable] = {"aten": F.linear, "packed": _packed_linear, "stream": stream_linear,
                               "columns": _columns_linear}


def step_route(rows: int, dtype: torch.dtype, elements: int) -> str:
    """The route (a name in ROUTES) this decoding step's Routes choose for products of `rows` rows of dtype over
    `elements` weight elements in all."""
    return (_in_step.get() or Routes()).route(rows, dtype, elements)


def _routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product by the route this decoding step's Routes choose for its rows and dtype."""
    return ROUTES[step_route(x.numel() // x.shape[-1], x.dtype, weight.numel())](x, weight, bias)


# the same, as one opaque operation to torch.compile: the route is chosen when the graph runs (its dispatch
# costs ~10 us a call: eager calls the function)
_routed_linear_op = torch.library.custom_op("medusa_heads::routed_linear", _routed_linear, mutates_args=())


@_routed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by the chosen kernel route on a CPU within a decoding step (a compiled graph only runs in one)."""
    routed = x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in ROUTED_DTYPES
    if ENABLED and routed and _inside_step():
        return (_routed_linear_op if torch.compiler.is_compiling() else _routed_linear)(x, weight, bias)
    return F.linear(x, weight, bias)


def draft_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight a draft's product reads: within a decoding step on a CPU where the stream kernel is built, a
    bfloat16 copy of a float32 weight (made once per version of it); elsewhere the weight itself."""
    if DRAFT_BF16 and weight.device.type == "cpu" and weight.dtype == torch.float32 and _kernels_in_step():
        return _copy(_halves, weight, lambda w: w.to(torch.bfloat16))
    return weight


def draft_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A draft's product: float32 x times `draft_weight` by the stream kernel where that is a bfloat16 copy;
    elsewhere `linear`."""
    read = draft_weight(weight)
    if read.dtype != weight.dtype and x.dtype == weight.dtype:
        return stream_linear(x, read, bias, draft=True)
    return linear(x, weight, bias)


def native_draft(hidden: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether a draft of hidden states in one of these dtypes runs as one C++ call (chained Medusa heads:
    `csrc/draft_heads.cpp`, float32 or bfloat16; an EAGLE-style draft's layer: `csrc/decoder_layers.cpp`, float32):
    within a decoding step on a CPU, where the kernels are built."""
    return NATIVE_DRAFT and hidden.device.type == "cpu" and hidden.dtype in dtypes and _kernels_in_step()


def native_accept(logits: torch.Tensor) -> bool:
    """Whether greedy acceptance of these logits runs as one C++ call (`csrc/greedy_accept.cpp`): float32 or
    bfloat16 within a decoding step on a CPU, where the kernels are built."""
    return (NATIVE_ACCEPT and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
            and _kernels_in_step())


def native_commit(keys: torch.Tensor) -> bool:
    """Whether a cache commit moves the kept tokens in one C++ call (`csrc/cache_commit.cpp`): a contiguous CPU
    buffer within a decoding step, where the kernels are built."""
    return NATIVE_ACCEPT and keys.device.type == "cpu" and keys.is_contiguous() and _kernels_in_step()


def _kernels_in_step() -> bool:
    """Whether this runs eagerly within a decoding step, with the C++ kernels built."""
    return _in_step.get() is not None and not torch.compiler.is_compiling() and kernels.load() is not None


class RoutedLinear(nn.Linear):
    """An nn.Linear whose products take the kernel route within a decoding step (`install` gives a layer
    this class; one class, so that one compiled graph serves every layer). `siblings`: the group the
    layer belongs to, if any."""

    siblings: Siblings | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or self.siblings is None or not FUSED or not _inside_step():
            return linear(x, self.weight, self.bias)
        return self.siblings.product(self, x)


def levers() -> list[str]:
    """The speed levers switched on (they change what a step costs)."""
    on = {"packed": ENABLED, "fused": ENABLED and FUSED, "grouped-attention": GROUPED_ATTENTION,
          f"kernels-{kernels.build_key()}": kernels.ENABLED, "lean": lean.ENABLED,
          "draft-bf16": DRAFT_BF16 and kernels.ENABLED, "native-draft": NATIVE_DRAFT and kernels.ENABLED,
          "native-accept": NATIVE_ACCEPT and kernels.ENABLED}
    return [name for name, enabled in on.items() if enabled]


def _inside_step() -> bool:
    """Whether this runs within a decoding step (a compiled graph only runs in one: the context variable
    cannot be traced)."""
    return torch.compiler.is_compiling() or _in_step.get() is not None


def grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except within a decoding step on a CPU, where a masked pass of several
    queries over grouped key/value heads reads them in place rather than repeated per query head."""
    plain = kwargs.get("dropout", 0.0) == 0.0 and not kwargs.keys() & {"softcap", "position_bias", "s_aux"}
    grouped = query.shape[1] != key.shape[1] and query.shape[2] > 1 and attention_mask is not None
    if not (plain and grouped and query.device.type == "cpu" and _inside_step()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"),
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _free_memory() -> float:
    """Bytes of free physical memory (infinite where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return float("inf")


def cpu_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's linear layers whose products take a kernel route."""
    return [module for module in model.modules() if type(module) in (nn.Linear, RoutedLinear)
            and module.weight.device.type == "cpu" and module.weight.dtype in ROUTED_DTYPES]


def install(model: nn.Module, sample: Callable[[], object] | None = None) -> None:
    """Give the model's CPU linear layers the routed product, if their copies (packed, and by columns) fit in half
    the free memory, and sdpa attention the grouped route (idempotent; no-op when switched off). `sample` runs one
    forward of the model: the layers it shows reading the same input one after another take one product."""
    if GROUPED_ATTENTION:
        AttentionInterface.register("sdpa", grouped_attention)
    if not ENABLED:
        return
    layers = [layer for layer in cpu_linears(model) if type(layer) is nn.Linear]
    groups = _siblings(layers, sample) if sample and layers else []
    fused = [layer for group in groups for layer in group.layers]  # their concatenated weights: one more copy
    needed = 2 * sum(layer.weight.nbytes for layer in layers + fused)
    if needed > _free_memory() / 2:
        warnings.warn(f"the weights' packed and by-columns copies would take {needed / 2**30:.1f} GiB, more than "
                      "half the free memory: decoding without them (slower on a CPU)", stacklevel=2)
        return
    for layer in layers:
        layer.__class__ = RoutedLinear
    for group in groups:
        for layer in group.layers:
            layer.siblings = group


def _siblings(layers: list[nn.Linear], sample: Callable[[], object]) -> list[Siblings]:
    """Runs of two or more layers called one after another on the same input tensor in `sample`."""
    calls: list[tuple[nn.Linear, torch.Tensor]] = []
    hooks = [layer.register_forward_pre_hook(lambda layer, args: calls.append((layer, args[0]))) for layer in layers]
    try:
        with torch.inference_mode():
            sample()
    finally:
        for hook in hooks:
            hook.remove()
    once = {layer for layer, n in Counter(layer for layer, _ in calls).items() if n == 1}
    runs: list[list[nn.Linear]] = []
    for i, (layer, x) in enumerate(calls):
        if i and calls[i - 1][1] is x:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return [Siblings(run) for run in runs if len(run) > 1 and set(run) <= once
            and len({(layer.weight.dtype, layer.bias is None) for layer in run}) == 1]


class Siblings:
    """Linear layers that read the same input one after another (q/k/v, gate/up): within a decoding step
    the first computes all their products as one, over their weights concatenated (remade when one of
    them changes), and the others take their share of it."""

    def __init__(self, layers: list[nn.Linear]):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self._version: tuple = ()
        self._fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.pending: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None  # first one's input, outputs

    def fused(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        params = [p for layer in self.layers for p in (layer.weight, layer.bias) if p is not None]
        version = tuple((p.data_ptr(), p._version) for p in params)
        if version != self._version:  # made as a normal tensor (decoding runs in inference mode), so that
            with torch.inference_mode(False):  # its packed copy can follow its version
                weight = torch.cat([layer.weight.detach() for layer in self.layers])
                bias = None if self.layers[0].bias is None else torch.cat([lay.bias.detach() for lay in self.layers])
            self._fused, self._version = (weight, bias), version
        return self._fused

    def product(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """layer's product with x: the first layer computes all of them, the others take theirs (or compute
        their own, called on another input than the first one's)."""
        i = self.layers.index(layer)
        if i == 0:
            outputs = linear(x, *self.fused()).split(self.sizes, dim=-1)
            self.pending = x, outputs
            return outputs[0]
        pending, self.pending = self.pending, (self.pending if i < len(self.layers) - 1 else None)
        if pending is not None and pending[0] is x:
            return pending[1][i]
        return linear(x, layer.weight, layer.bias)


@contextmanager
def decoding_step(routes: Routes | None = None):
    """Within this context, installed linear layers take the kernel routes given (else the unprobed defaults)."""
    token = _in_step.set(routes or Routes())
    try:
        yield
    finally:
        _in_step.reset(token)


def probe_routes(model: nn.Module, widths: Iterable[int] = PROBE_WIDTHS, rounds: int = 5,
                 progress: Callable[[], None] | None = None) -> Routes:
    """Time every kernel route on the model's own CPU linear products (all of them in turn, so caches are
    cold as in decoding; siblings as the one product they take), at each row count; per dtype present,
    the fastest route at each width (median over rounds that shuffle the routes), with those medians. A
    route that fails for a dtype (e.g. packed bfloat16 on a CPU without the instructions oneDNN needs) is
    left out."""
    widths, choice, measured, packing = tuple(widths), {}, {}, {}
    if not ENABLED:
        return Routes(widths, choice)
    order = random.Random(0)
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for weight, bias in _products(model):
        by_dtype.setdefault(weight.dtype, []).append((weight, bias))
    for dtype, products in by_dtype.items():
        routes = [name for name, fn in ROUTES.items() if _works(fn, *products[0])]
        if "packed" in routes:
            for weight, _ in products:  # made anew, as a process makes them at its first packed product
                _packed.pop(weight, None)
            start = time.perf_counter()
            for weight, _ in products:
                packed(weight)
            packing[str(dtype)] = (time.perf_counter() - start) * 1000, sum(weight.numel() for weight, _ in products)
        inputs = {w: {n: torch.randn(w, n, dtype=dtype) for n in {weight.shape[1] for weight, _ in products}}
                  for w in widths}
        times: dict[tuple[int, str], list[float]] = {(w, r): [] for w in widths for r in routes}
        with torch.inference_mode():
            for _ in range(rounds):
                for w in widths:
                    for route in order.sample(routes, len(routes)):
                        fn, x = ROUTES[route], inputs[w]
                        start = time.perf_counter()
                        for weight, bias in products:
                            fn(x[weight.shape[1]], weight, bias)
                        times[w, route].append(time.perf_counter() - start)
                if progress:
                    progress()
        medians = {key: statistics.median(t) * 1000 for key, t in times.items()}
        choice[str(dtype)] = tuple(min(routes, key=lambda r, w=w: medians[w, r]) for w in widths)
        measured[str(dtype)] = {r: tuple(medians[w, r] for w in widths) for r in routes}
    # this process made the packed copies as it timed them: no rental
    return Routes(widths, choice, measured, packing, lost={k: ms for k, (ms, _) in packing.items()})


def _products(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The weight and bias of each product a decoding step computes: siblings' fused, other layers' own."""
    products, groups = [], set()
    for layer in cpu_linears(model):
        group = getattr(layer, "siblings", None)
        if group is None:
            products.append((layer.weight.detach(), None if layer.bias is None else layer.bias.detach()))
        elif group not in groups:
            groups.add(group)
            products.append(group.fused())
    return products


def _works(route: Callable, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    try:
        with torch.inference_mode():
            route(torch.zeros(1, weight.shape[1], dtype=weight.dtype), weight, bias)
        return True
    except RuntimeError:
        return False


def compiled_decoder(body: nn.Module):
    """body's forward (the decoder that returns last hidden states) through torch.compile, with dynamic shapes."""
    compiled = torch.compile(body.forward, dynamic=True)

    def forward(*args, **kwargs):
        # python floats (norm epsilons, scales) as constants: else dynamo traces them as symbols, then
        # specializes them and traces the whole model again (twice the compile time)
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return forward
