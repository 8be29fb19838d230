"""The generation worker behind the server: one thread owns the model and advances every admitted
request one decoding step at a time, round-robin, so concurrent streams all progress.

Up to `max_concurrency` requests decode at once; up to `max_queue` more wait; beyond that
`submit` raises `Busy` (HTTP 429). A cancelled request (client gone) is dropped at its next turn.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from ..generate import Decoder, TextDeltas, make_decoder

log = logging.getLogger("medusa_heads.serve")


class Busy(Exception):
    """Every decoding slot and every queue place is taken."""


@dataclass(eq=False)  # compared by identity
class Job:
    input_ids: torch.Tensor  # (1, T)
    options: dict  # make_decoder keyword arguments
    loop: asyncio.AbstractEventLoop
    # ("text", str) | ("done", dict) | ("invalid", message) for a bad request | ("error", message)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


@dataclass(eq=False)
class _Running:
    job: Job
    decoder: Decoder
    steps: object  # the decoder's step iterator
    deltas: TextDeltas


class Engine:
    def __init__(self, model, max_concurrency: int = 4, max_queue: int = 64):
        self.model, self.max_concurrency, self.max_queue = model, max_concurrency, max_queue
        self.waiting: deque[Job] = deque()  # guarded by the lock, like `admitted`
        self.running: list[_Running] = []  # touched by the worker thread only
        self.admitted = 0  # waiting + running
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._work, name="medusa-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.admitted >= self.max_concurrency + self.max_queue:
                raise Busy()
            self.admitted += 1
            self.waiting.append(job)
        self.wake.set()

    def _work(self) -> None:
        while not self.stopping.is_set():
            self._admit()
            if not self.running:
                self.wake.wait(0.1)
                self.wake.clear()
                continue
            for entry in list(self.running):
                self._advance(entry)
        with self.lock:
            left = [entry.job for entry in self.running] + list(self.waiting)
        for job in left:
            job.send("error", "the server is shutting down")

    def _next_waiting(self) -> Job | None:
        with self.lock:
            return self.waiting.popleft() if self.waiting else None

    def _admit(self) -> None:
        while len(self.running) < self.max_concurrency and (job := self._next_waiting()) is not None:
            if job.cancelled.is_set():
                self._release()
                continue
            try:
                decoder = make_decoder(self.model, job.input_ids, None, **job.options)
            except ValueError as err:
                job.send("invalid", str(err))
                self._release()
                continue
            self.running.append(_Running(job, decoder, decoder.steps(), TextDeltas(decoder)))

    def _advance(self, entry: _Running) -> None:
        job = entry.job
        if job.cancelled.is_set():
            self._finish(entry)
            return
        try:
            next(entry.steps, None)
        except Exception:  # a bug or an out-of-memory: report it without the traceback, keep serving
            log.exception("generation failed")
            job.send("error", "generation failed")
            self._finish(entry)
            return
        if delta := entry.deltas():
            job.send("text", delta)
        row = entry.decoder.rows[0]
        if row.finish_reason:
            job.send("done", {"finish_reason": row.finish_reason, "prompt_tokens": len(row.prompt),
                              "completion_tokens": len(row.tokens),
                              "mean_accepted_length": sum(row.accept_lengths) / max(1, len(row.accept_lengths))})
            self._finish(entry)

    def _finish(self, entry: _Running) -> None:
        self.running.remove(entry)
        self._release()

    def _release(self) -> None:
        with self.lock:
            self.admitted -= 1
