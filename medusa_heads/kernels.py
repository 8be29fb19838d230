"""The C++ kernels of a CPU decoding step (`csrc/`), compiled on first use for the CPU at hand: the "stream" linear
product (`csrc/stream_linear.cpp`: a product over a few rows, summed in float32, that reads each weight row once for
all of them, so that a decoding step's products run at the memory's speed; a kernel route of `medusa_heads.speed`
for float32 and bfloat16 models; over bfloat16 weights for drafts, `speed.draft_linear`), the "columns" product
(`csrc/columns_linear.cpp`: over a weight laid out once by blocks of 16 outputs, `speed.columns`, each output summed
alone, so that 8-16 rows cost little more than one), the fused small operations
of a Llama-family layer (`csrc/decoder_ops.cpp`) and the attention of a pass of a few tokens (`csrc/attention.cpp`),
used by `medusa_heads.lean` and an EAGLE-style draft's layer (`medusa_heads.eagle`), chained Medusa heads' draft of
a tree (`csrc/draft_heads.cpp`, `speed.native_draft`) and greedy acceptance (`csrc/greedy_accept.cpp`,
`speed.native_accept`) and the moves of a cache commit (`csrc/cache_commit.cpp`, `speed.native_commit`). They are
built with torch's C++ extension tools (a C++ compiler and ninja; -march=native; 1-3 minutes on 2 cores, once per
machine, torch version and source) into torch's extension folder. Where they cannot be built (no compiler, no
AVX2/FMA, not x86) a warning says why and decoding does without them: the probe (`speed.probe_routes`) leaves the
stream route out, and the lean decoder runs transformers' own operations. Set MEDUSA_HEADS_KERNELS=0 to do without
them."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch

ENABLED = os.environ.get("MEDUSA_HEADS_KERNELS", "1") != "0"
FOLDER = Path(__file__).parent / "csrc"
SOURCES = sorted(FOLDER.glob("*.cpp"))
HEADERS = sorted(FOLDER.glob("*.h"))
STALE_LOCK_SECONDS = 600  # a build lock this old is a killed build's, not a running one's


@functools.cache
def build_key() -> str:
    """What a build is for: one CPU (its flags), torch version and sources (a new key: a new build, and a new
    probe of the routes)."""
    from .tuning import cpu_info

    _, flags = cpu_info()
    key = " ".join(sorted(flags)) + torch.__version__ + "".join(p.read_text() for p in SOURCES + HEADERS)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@functools.cache
def load():
    """The compiled module (its functions: see `csrc/bindings.cpp`), built now if this machine has none; None
    where it cannot be built (a warning says why) or MEDUSA_HEADS_KERNELS=0."""
    if not ENABLED:
        return None
    from torch.utils import cpp_extension

    name = f"medusa_heads_kernels_{build_key()}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    folder = root / name
    if not (folder / f"{name}.so").exists():
        print("medusa-heads: compiling the decoding kernels for this CPU (once, 1-3 minutes)", file=sys.stderr,
              flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"  # torch's build lock: one left by a build killed midway would make every load wait
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    scripts = str(Path(sys.executable).parent)  # where pip put ninja, if the environment is not activated
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:
        # no fused multiply-adds where the source does not ask for them: sums round as in torch's own operations
        module = cpp_extension.load(name, [str(p) for p in SOURCES],
                                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                                    extra_ldflags=["-fopenmp"],
                                    build_directory=str(folder), verbose=False)
    except (RuntimeError, OSError, ImportError) as err:
        warnings.warn(f"the decoding kernels could not be built ({str(err).splitlines()[0]}); decoding does "
                      "without them (slower on a CPU)", stacklevel=2)
        return None
    return module


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  draft: bool = False) -> torch.Tensor:
    """x weight^T + bias by the stream kernel (RuntimeError where it is not available or not applicable); draft: a
    draft's product, whose sums may round in another order than a base model's (faster where the caches hold it)."""
    return _built("stream").stream_linear(x, weight, bias, draft)


def columns_linear(x: torch.Tensor, columns: torch.Tensor, bias: torch.Tensor | None, outputs: int) -> torch.Tensor:
    """x W^T + bias by the columns kernel, over `columns`, W (outputs, K) as `speed.columns` lays it out
    (RuntimeError where it is not available or not applicable)."""
    return _built("columns").columns_linear(x, columns, bias, outputs)


def _built(kernel: str):
    """The compiled module, or a RuntimeError that says this kernel is not available here."""
    module = load()
    if module is None:
        raise RuntimeError(f"the {kernel} kernel is not available on this machine")
    return module
