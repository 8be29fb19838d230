"""tree="auto": what decodes fastest on the machine at hand, measured on first use and cached.

Machines differ (a 2-core AMD EPYC with AVX2, a 2-core Sapphire Rapids with AMX, a GPU...) and a
choice that wins on one loses on another, so nothing here is chosen by CPU name. On first use of a
model on a machine, a short probe (under a minute for the default model) measures:

1. the kernel route of every linear product, per number of rows (`speed.probe_routes`);
2. with those routes, the cost curve c(n) of decoding steps over the candidate trees of the heads;
3. the tree: the heads' replay record (`calibrate.Record`, shipped with them as replay.json and
   written by `medusa calibrate`) replayed under that curve (`calibrate.choose`); for an EAGLE-style
   draft, the dynamic tree with the best recorded accepted length per measured step cost
   (`calibrate.choose_dynamic`, from its dynamic.json).

The result is cached in the user cache (`default.cache_dir()/tuning`), keyed by what it depends on:
CPU model and ISA flags (or GPU), threads, torch version, base model, dtype, device, heads, the
speed levers switched on and the probe's version.
`medusa calibrate --probe` measures again. MEDUSA_HEADS_TUNE=0 turns the probe off: then the
shipped tree and the unprobed routes. Heads without a replay record get the probed routes and the
shipped tree (or the deepest chain they allow).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import speed
from .calibrate import DynamicRecord, choose, choose_dynamic, timed_shapes
from .default import cache_dir
from .tree import Tree

NOTABLE_ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_ne_convert", "amx_tile",
               "amx_bf16", "amx_int8", "neon", "asimd", "sve")  # reported, never used to decide
ROUTE_ROUNDS = 3  # kernel-route timing rounds in the probe
ROUNDS, STEPS = 3, 6  # cost-curve rounds and timed steps per tree in the probe
SIZES = (0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 64)  # head nodes of the trees the probe measures (fewer than calibrate's)
PROBE_PROMPT = 48  # tokens of the (seeded random) prompt the probe decodes from
PROBE_VERSION = 6  # raised when what a decoding step computes changes (2: fused siblings, grouped attention; 3: the
# stream kernel route; 4: the time to pack, for the rental of packed copies; 5: c paired with plain steps, the pick;
# 6: the columns route; steps take one route whose rows round alone at every width)


@dataclass
class Tuning:
    """What the probe chose for a model on this machine."""

    machine: dict  # `machine()` where it was measured
    routes: speed.Routes
    tree: Tree | None  # None: the heads carry no replay record (the shipped tree applies)
    cost_curve: dict | None  # {"tokens": [...], "cost": [...]}: c at passes of that many tokens
    table: list[dict] | None  # `calibrate.choose`'s table
    seconds: float  # how long the probe took
    cached: bool = False  # read from the cache in this process

    def summary(self) -> str:
        """One line for logs: the machine, the routes, the curve and the tree."""
        m = self.machine
        where = m["gpu"] or f"{m['cpu']} [{' '.join(m['isa']) or 'no listed ISA extensions'}]"
        parts = [f"{where}, {m['threads']} threads, torch {m['torch']}, {m['dtype']}"]
        for dtype, names in self.routes.choice.items():
            runs = ", ".join(f"{w}:{r}" for w, r in zip(self.routes.widths, names, strict=True))
            parts.append(f"{dtype.removeprefix('torch.')} routes by rows {runs}")
        if self.cost_curve:
            c = dict(zip(self.cost_curve["tokens"], self.cost_curve["cost"], strict=True))
            parts.append("c(n) " + " ".join(f"{n}:{v:.2f}" for n, v in c.items() if n in (2, 5, 9, 17, 33, 65)))
        if self.tree is not None:
            parts.append(f"tree {self.tree.head_size - 1} head nodes + lookup {self.tree.lookup}")
        origin = "cached" if self.cached else f"probed in {self.seconds:.0f} s"
        return f"tuning ({origin}): " + "; ".join(parts)

    def to_json(self) -> dict:
        return {"machine": self.machine, "routes": self.routes.to_json(),
                "tree": self.tree.to_json() if self.tree is not None else None,
                "cost_curve": self.cost_curve, "table": self.table, "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: dict) -> Tuning:
        tree = data["tree"]
        if tree and "paths" not in tree:
            tree = Tree.load(tree["name"])  # a DynamicTree
        elif tree:
            tree = Tree(tree["paths"], name=tree["name"], lookup=tree.get("lookup", 0))
        return cls(data["machine"], speed.Routes.from_json(data["routes"]), tree, data["cost_curve"], data["table"],
                   data["seconds"], cached=True)


def enabled() -> bool:
    return os.environ.get("MEDUSA_HEADS_TUNE", "1") != "0"


def machine(model) -> dict:
    """What the measurements depend on, as reported with every figure: CPU (model, notable ISA
    extensions, a hash of all its flags) or GPU, threads, versions, model, dtype, heads."""
    cpu, flags = cpu_info()
    device = model.device
    record = model.record
    heads = json.dumps(model.heads.config.to_dict(), sort_keys=True) + (record.fingerprint if record else "")
    return {"cpu": cpu, "isa": [f for f in NOTABLE_ISA if f in flags],
            "cpu_flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "device": str(device),
            "model": Path(model.base_name).name,
            "model_config": hashlib.sha256(model.config.to_json_string().encode()).hexdigest()[:16],
            "dtype": str(model.base_model.dtype).removeprefix("torch."),
            "heads": hashlib.sha256(heads.encode()).hexdigest()[:16], "levers": speed.levers(),
            "probe": PROBE_VERSION}


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags (from /proc/cpuinfo where there is one)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and value.strip():
                name = value.strip()
            elif key in ("flags", "Features"):
                flags = set(value.split())
            if flags and key == "":  # the first processor's block is enough
                break
    except OSError:
        pass
    return name, frozenset(flags)


def cache_file(description: dict) -> Path:
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "tuning" / f"{description['model'] or 'model'}-{key}.json"


def tuning(model, refresh: bool = False) -> Tuning | None:
    """The model's tuning on this machine: remembered on the model, else read from the cache, else
    probed (and cached); `refresh` probes again. None when the probe is turned off."""
    if not enabled():
        return None
    description = machine(model)
    if not refresh and model.tuning is not None and model.tuning.machine == description:
        return model.tuning
    file = cache_file(description)
    result = None
    if file.exists() and not refresh:
        try:
            result = Tuning.from_json(json.loads(file.read_text()))
        except (ValueError, KeyError, TypeError):  # unreadable (e.g. an older layout): probe again
            result = None
        if result is not None and result.machine != description:
            result = None
    if result is None:
        result = probe(model, description)
        file.parent.mkdir(parents=True, exist_ok=True)
        temporary = file.with_suffix(".tmp")
        temporary.write_text(json.dumps(result.to_json(), indent=1) + "\n")
        temporary.replace(file)
    model.tuning = result
    return result


def probe(model, description: dict) -> Tuning:
    """Measure routes, then (heads with a replay record) the cost curve and the tree; with a progress bar."""
    start = time.perf_counter()
    record = model.record
    dtypes = {layer.weight.dtype for layer in speed.cpu_linears(model)} if speed.ENABLED else set()
    trees = len(timed_shapes(record)) if isinstance(record, DynamicRecord) else len(SIZES)
    runs = ROUTE_ROUNDS * len(dtypes) + (ROUNDS * trees if record else 0)
    with tqdm(total=runs, desc="probing this machine (once)", unit="run", leave=False) as bar:
        model.install_speed_levers()
        routes = speed.probe_routes(model, rounds=ROUTE_ROUNDS, progress=bar.update)
        tree = cost_curve = table = None
        if record is not None:
            model.tuning = Tuning(description, routes, None, None, None, 0.0)  # the curve is measured with them
            ids = torch.randint(model.config.get_text_config().vocab_size, (1, PROBE_PROMPT),
                                generator=torch.Generator().manual_seed(0)).to(model.device)
            if isinstance(record, DynamicRecord):
                result = choose_dynamic(model, record, ids, steps=STEPS, rounds=ROUNDS, progress=bar.update)
            else:
                result = choose(model, record, ids, sizes=list(SIZES), steps=STEPS, rounds=ROUNDS,
                                progress=bar.update)
                result["tree"].name = "auto"
            tree, cost_curve, table = result["tree"], result["cost_curve"], result["table"]
    return Tuning(description, routes, tree, cost_curve, table, time.perf_counter() - start)
