"""llama.cpp beside us: the peer a CPU user would pick, on the same GGUF, measured in the same run.

`LlamaCpp` answers a chat prompt with llama.cpp's `llama-completion` (greedy, this machine's
threads) and takes llama.cpp's own timings of the prompt and of the generation: model loading is
left out, as it is for every other method of the benchmark. Variants: the GGUF as given (the
embedded default ships Q4_1) and F32 / BF16 made from it once with `llama-quantize
--allow-requantize` (cached next to the converted models). `../shared/tools/build-llama-cpp`
builds the binaries.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import torch

from .default import cache_dir

VARIANTS = ("gguf", "F32", "BF16")  # the file as given, and requantized from it
_TIMING = re.compile(r"(prompt eval|eval) time\s*=\s*([\d.]+) ms\s*/\s*(\d+) (?:tokens|runs)")
_END = " [end of text]"  # what llama-completion prints where the model stopped


def binary(folder: str | Path, name: str) -> Path:
    path = Path(folder) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: build llama.cpp with ../shared/tools/build-llama-cpp and give "
                                "the folder it prints")
    return path


def requantized(folder: str | Path, gguf: Path, variant: str) -> Path:
    """The GGUF as given ("gguf"), or requantized to F32 / BF16 once (cached)."""
    if variant == "gguf":
        return gguf
    target = cache_dir() / "llama-cpp" / f"{gguf.stem}.{variant}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        subprocess.run([str(binary(folder, "llama-quantize")), "--allow-requantize", str(gguf), str(partial), variant],
                       check=True, capture_output=True, text=True)
        partial.replace(target)
    return target


class LlamaCpp:
    """One llama.cpp variant as a benchmark method: greedy answers and llama.cpp's own timings."""

    def __init__(self, folder: str | Path, gguf: str | Path, variant: str, tokenizer):
        if variant not in VARIANTS:
            raise ValueError(f"unknown llama.cpp variant {variant!r}: use one of {', '.join(VARIANTS)}")
        self.program = binary(folder, "llama-completion")
        self.gguf = requantized(folder, Path(gguf), variant)
        self.tokenizer = tokenizer
        self.repack = True  # oneDNN-like weight repacking; off after a crash (seen with Q4_1 on Sapphire Rapids)

    def run(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float]:
        """New tokens (llama.cpp's text re-tokenised by our tokenizer, plus EOS where it stopped) and the
        seconds llama.cpp spent on the prompt and the generation."""
        prompt = self.tokenizer.decode(ids[0].tolist(), skip_special_tokens=False)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
            file.write(prompt)
            file.flush()
            done = self._complete(file.name, max_new_tokens)
            if done.returncode != 0 and self.repack:
                self.repack = False
                done = self._complete(file.name, max_new_tokens)
        if done.returncode != 0:
            raise RuntimeError(f"llama-completion failed on {self.gguf.name}: {done.stderr[-2000:]}")
        timings = {kind: float(ms) for kind, ms, _ in _TIMING.findall(done.stderr)}
        if set(timings) != {"prompt eval", "eval"}:
            raise RuntimeError(f"llama-completion printed no timings: {done.stderr[-2000:]}")
        text, stopped = done.stdout.removeprefix("\n"), False
        if text.rstrip().endswith(_END):
            text, stopped = text.rstrip().removesuffix(_END), True
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if stopped and self.tokenizer.eos_token_id is not None:
            tokens.append(self.tokenizer.eos_token_id)
        return tokens[:max_new_tokens], (timings["prompt eval"] + timings["eval"]) / 1000

    def _complete(self, prompt_file: str, max_new_tokens: int) -> subprocess.CompletedProcess:
        command = [str(self.program), "-m", str(self.gguf), "-f", prompt_file, "-n", str(max_new_tokens),
                   "-t", str(torch.get_num_threads()), "--temp", "0", "--seed", "0", "-no-cnv", "--no-display-prompt",
                   "--simple-io", "-c", "4096", "--perf"]
        if not self.repack:
            command.append("--no-repack")
        # errors="replace": an answer cut at the token limit can end inside a multi-byte character
        return subprocess.run(command, capture_output=True, encoding="utf-8", errors="replace",
                              stdin=subprocess.DEVNULL, timeout=600)
