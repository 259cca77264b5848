"""How a stream's jobs in flight go on (`lazyckpt._engine.stream`): their blocks taken
in order, or as they are ready, by the stream's consumer; or each job sending its own
blocks on the decoding threads, only its end coming back.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Callable

import tensorstore as ts

from lazyckpt._engine.jobs import END, SKIP, Block, Job
from lazyckpt._engine.scheduler import in_pool


class InOrder:
    """The jobs in flight, their blocks taken in the order the jobs started: the first
    job's, to its end, then the next one's."""

    def __init__(self) -> None:
        self.active: collections.deque[tuple[Job, ts.Future[object]]] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self.active)

    def start(self, job: Job) -> None:
        self.active.append((job, job.step()))

    def next(self) -> tuple[Job, object]:
        job, pending = self.active[0]
        return job, pending.result()

    def go_on(self, job: Job) -> None:
        self.active[0] = (job, job.step())

    def end(self, job: Job) -> None:
        self.active.popleft()

    def stop(self) -> None:
        """(the steps in flight finish; none is started after them)"""


class AsReady:
    """The jobs in flight, their blocks taken as they are ready, whichever job's."""

    def __init__(self) -> None:
        self.ready: queue.SimpleQueue[tuple[Job, ts.Future[object]]] = queue.SimpleQueue()
        self.running = 0

    def __bool__(self) -> bool:
        return self.running > 0

    def start(self, job: Job) -> None:
        self.running += 1
        self.go_on(job)

    def next(self) -> tuple[Job, object]:
        job, done = self.ready.get()
        return job, done.result()

    def go_on(self, job: Job) -> None:
        job.step().add_done_callback(lambda done: self.ready.put((job, done)))

    def end(self, job: Job) -> None:
        self.running -= 1

    def stop(self) -> None:
        """(the steps in flight finish; none is started after them)"""


class Sending:
    """The jobs in flight, each handing its blocks to `send` on a decoding thread as
    it makes them and going on once `send` returns: no block waits for the consumer,
    which is told only of each job's end (or failure). `stop` lets each job finish
    the step it is in and start no other."""

    def __init__(self, send: Callable[[Job, list[Block]], None]) -> None:
        self.send = send
        self.ended: queue.SimpleQueue[tuple[Job, ts.Future[object]]] = queue.SimpleQueue()
        self.running = 0
        self.stopped = False

    def __bool__(self) -> bool:
        return self.running > 0

    def start(self, job: Job) -> None:
        self.running += 1
        self.go_on(job)

    def next(self) -> tuple[Job, object]:
        job, done = self.ended.get()
        return job, done.result()  # (END, or a step's or a send's failure raised)

    def go_on(self, job: Job) -> None:
        job.step().add_done_callback(lambda done: self._made(job, done))

    def end(self, job: Job) -> None:
        self.running -= 1

    def stop(self) -> None:
        self.stopped = True

    def _made(self, job: Job, done: ts.Future[object]) -> None:
        """A step of `job` is done (on whichever thread finished it: a tensorstore read's
        may be tensorstore's own, so the send runs on a decoding thread)."""
        if self.stopped:
            return
        try:
            result = done.result()
        except Exception:  # noqa: BLE001 - raised by `next`
            self.ended.put((job, done))
            return
        if result is END:
            self.ended.put((job, done))
            return
        if result is SKIP:
            in_pool(lambda: self.go_on(job))
            return
        assert isinstance(result, (tuple, list))  # a block, or a placed block's pieces
        blocks = result if isinstance(result, list) else [result]
        in_pool(lambda: self._send(job, blocks)).add_done_callback(
            lambda sent: self._sent(job, sent)
        )

    def _send(self, job: Job, blocks: list[Block]) -> None:
        if not self.stopped:  # (stopped while it waited for a thread: not sent)
            self.send(job, blocks)

    def _sent(self, job: Job, sent: ts.Future[None]) -> None:
        try:
            sent.result()
        except Exception:  # noqa: BLE001 - raised by `next`
            self.ended.put((job, sent))
            return
        if not self.stopped:
            self.go_on(job)


Steps = InOrder | AsReady | Sending
