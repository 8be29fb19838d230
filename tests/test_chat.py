"""`medusa chat` used as a person would: through a pseudo-terminal, typing and reading the stream."""

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from medusa_heads import MedusaModel


class Terminal:
    def __init__(self, command):
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.screen = ""

    def read_until(self, text: str, timeout: float = 60, times: int = 1) -> str:
        deadline = time.time() + timeout
        while self.screen.count(text) < times:
            if time.time() > deadline:
                raise AssertionError(f"{text!r} never appeared; screen:\n{self.screen}")
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.screen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:
                    break
        return self.screen

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())


@pytest.mark.slow
def test_chat_session(tiny_folder):
    library = MedusaModel.from_pretrained(tiny_folder, projection="shared")
    term = Terminal([sys.executable, "-m", "medusa_heads.cli", "chat", "--base", str(tiny_folder),
                     "--max-new-tokens", "12"])
    term.read_until("you> ")
    term.type("c d e")
    screen = term.read_until("mean accepted length")
    first = library.generate(library.chat_ids("c d e"), max_new_tokens=12).texts[0]
    assert f"assistant> {first}" in screen.replace("\r", "")
    assert "tok/s" in screen
    # the second turn sees the first: its answer is the library's for the whole history
    term.type("f g")
    history = [{"role": "user", "content": "c d e"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "f g"}]
    second = library.generate(library.chat_ids(history), max_new_tokens=12).texts[0]
    term.read_until(f"assistant> {second}")
    term.type("/reset")
    term.read_until("(history cleared)")
    term.type("f g")  # now without history: the answer of a fresh chat
    fresh = library.generate(library.chat_ids("f g"), max_new_tokens=12).texts[0]
    assert fresh != second  # so the reset is visible
    term.read_until(f"assistant> {fresh}")
    term.read_until("mean accepted length", times=3)
    term.type("/exit")
    assert term.process.wait(timeout=30) == 0
