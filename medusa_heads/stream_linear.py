"""The "stream" kernel route: a float32 linear product over a few rows that reads each weight row once for all of
them (`csrc/stream_linear.cpp`), so that a decoding step's products run at the memory's speed. It is compiled on
first use for the CPU at hand (-march=native, with torch's C++ extension tools: a C++ compiler and ninja; about
30 s, once per machine and torch version) and kept in torch's extension folder. Where it cannot be built (no
compiler, no AVX2/FMA, not x86) the route is left out and the other routes decode as before; the probe
(`speed.probe_routes`) times it against them and takes it only where it is faster. Set
MEDUSA_HEADS_STREAM_KERNEL=0 to leave it out."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ENABLED = os.environ.get("MEDUSA_HEADS_STREAM_KERNEL", "1") != "0"
SOURCE = Path(__file__).parent / "csrc" / "stream_linear.cpp"
STALE_LOCK_SECONDS = 600  # a build lock this old is a killed build's, not a running one's


@functools.cache
def build_key() -> str:
    """What a build is for: one CPU (its flags), torch version and source (a new key: a new build, and a new
    probe of the routes)."""
    from .tuning import cpu_info

    _, flags = cpu_info()
    key = " ".join(sorted(flags)) + torch.__version__ + SOURCE.read_text()
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@functools.cache
def kernel() -> Callable | None:
    """The compiled product (x, weight, bias) -> x weight^T + bias, built now if this machine has none; None
    where it cannot be built (a warning says why)."""
    if not ENABLED:
        return None
    from torch.utils import cpp_extension

    name = f"medusa_heads_stream_linear_{build_key()}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    folder = root / name
    if not (folder / f"{name}.so").exists():
        print("medusa-heads: compiling the stream kernel for this CPU (once, ~40 s)", file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"  # torch's build lock: one left by a build killed midway would make every load wait
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    scripts = str(Path(sys.executable).parent)  # where pip put ninja, if the environment is not activated
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:
        module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                    extra_ldflags=["-fopenmp"],
                                    build_directory=str(folder), verbose=False)
    except (RuntimeError, OSError, ImportError) as err:
        warnings.warn(f"the stream kernel could not be built ({str(err).splitlines()[0]}); decoding takes the "
                      "other kernel routes", stacklevel=2)
        return None
    return module.stream_linear


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x weight^T + bias by the stream kernel (RuntimeError where it is not available or not applicable)."""
    product = kernel()
    if product is None:
        raise RuntimeError("the stream kernel is not available on this machine")
    return product(x, weight, bias)
