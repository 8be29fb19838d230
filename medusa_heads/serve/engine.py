"""The generation worker behind the server: one thread owns the model and one batched Decoder.

Up to `max_concurrency` requests decode together in one batch (each step verifies every row's tree
in one forward pass); a request that arrives joins at the next step and a finished one leaves.
Up to `max_queue` more wait; beyond that `submit` raises `Busy` (HTTP 429). A cancelled request
(client gone) leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from ..decoder import Decoder, Request, TextDeltas, Update
from ..generate import resolve_tree

log = logging.getLogger("medusa_heads.serve")


class Busy(Exception):
    """Every decoding slot and every queue place is taken."""


@dataclass(eq=False)  # compared by identity
class Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    # ("text", str) | ("done", dict) | ("invalid", message) for a bad request | ("error", message)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class Engine:
    """Continuous batching: requests join the running batch at the next step and leave when done."""

    def __init__(self, model, max_concurrency: int = 4, max_queue: int = 64, tree=None):
        self.model, self.max_concurrency, self.max_queue = model, max_concurrency, max_queue
        self.tree = resolve_tree(model, tree)
        self.decoder = Decoder(model, self.tree)
        self.jobs: dict[int, tuple[Job, TextDeltas]] = {}  # decoder row id -> its job (worker thread only)
        self.waiting: deque[Job] = deque()  # guarded by the lock, like `admitted`
        self.admitted = 0  # waiting + decoding
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

    @property
    def running(self) -> int:
        return len(self.jobs)

    def run_once(self) -> bool:
        """Admit waiting requests, run one step of the batch, publish; False when there was nothing to do."""
        try:
            self._admit()
            if not self.decoder.busy:
                return False
            self._publish(self.decoder.step())
        except Exception:  # a bug or an out-of-memory: fail this batch without a traceback, keep serving
            log.exception("generation failed")
            for job, _ in self.jobs.values():
                job.send("error", "generation failed")
                self._release()
            self.jobs.clear()
            self.decoder = Decoder(self.model, self.tree)
        return True

    def _work(self) -> None:
        while not self.stopping.is_set():
            if not self.run_once():
                self.wake.wait(0.1)
                self.wake.clear()
        with self.lock:
            left = [job for job, _ in self.jobs.values()] + list(self.waiting)
        for job in left:
            job.send("error", "the server is shutting down")

    def _next_waiting(self) -> Job | None:
        with self.lock:
            return self.waiting.popleft() if self.waiting else None

    def _admit(self) -> None:
        while len(self.jobs) < self.max_concurrency and (job := self._next_waiting()) is not None:
            if job.cancelled.is_set():
                self._release()
                continue
            try:
                row_id = self.decoder.add(job.request)[0]
            except ValueError as err:
                job.send("invalid", str(err))
                self._release()
                continue
            self.jobs[row_id] = (job, TextDeltas(self.decoder, row_id))

    def _publish(self, updates: list[Update]) -> None:
        """Send every request its new text; finish the done ones and drop those whose client left."""
        finished = {u.row for u in updates if u.finish_reason}
        for row_id, (job, deltas) in list(self.jobs.items()):
            if job.cancelled.is_set():
                self.decoder.cancel(row_id)
                self._forget(row_id)
                continue
            if delta := deltas():
                job.send("text", delta)
            if row_id in finished:
                row = self.decoder.progress(row_id)
                job.send("done", {"finish_reason": row.finish_reason, "prompt_tokens": row.prompt_tokens,
                                  "completion_tokens": len(row.tokens),
                                  "mean_accepted_length": row.mean_accepted_length})
                self._forget(row_id)

    def _forget(self, row_id: int) -> None:
        self.jobs.pop(row_id)
        self.decoder.forget(row_id)
        self._release()

    def _release(self) -> None:
        with self.lock:
            self.admitted -= 1
