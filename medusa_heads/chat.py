"""`medusa chat`: a terminal chat that streams answers and shows tokens/s and mean accepted length."""

from __future__ import annotations

import time
from collections.abc import Callable

from .decoder import TextDeltas
from .decoding import Decoding
from .generate import make_decoder

HELP = "medusa chat: type a message; /reset clears the history, /exit quits"


def run_chat(model, decoding: Decoding, read: Callable[[str], str] = input,
             write: Callable[[str], None] = print) -> None:
    """Read-eval-print loop; each answer decoded as `decoding` says."""
    write(HELP)
    history: list[dict[str, str]] = []
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            write("")
            return
        if line == "/exit":
            return
        if line == "/reset":
            history.clear()
            write("(history cleared)")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        start = time.perf_counter()
        decoder = make_decoder(model, model.chat_ids(history), decoding)
        deltas = TextDeltas(decoder)
        write("assistant> ", end="", flush=True)
        for _ in decoder.steps():
            if delta := deltas():
                write(delta, end="", flush=True)
        elapsed = time.perf_counter() - start
        row = decoder.progress(0)
        write("")
        write(f"[{len(row.tokens)} tokens, {len(row.tokens) / elapsed:.1f} tok/s, mean accepted length "
              f"{row.mean_accepted_length:.2f}]")
        history.append({"role": "assistant", "content": decoder.text(0)})
