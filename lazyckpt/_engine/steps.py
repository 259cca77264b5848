"""How a stream's jobs in flight go on (`lazyckpt._engine.stream`): their blocks taken
in order, or as they are ready, by the stream's consumer; or each job sending its own
blocks on the decoding threads, only its end coming back.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
from collections.abc import Callable

import tensorstore as ts

from lazyckpt._engine.jobs import END, SKIP, Block, Job
from lazyckpt._engine.scheduler import in_pool, on_pool_thread


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
    """The jobs in flight, each handing its blocks to `send` as it makes them (on the
    decoding thread that made the block, or, where a block comes from another thread,
    tensorstore's, on a decoding thread) and going on once `send` returns: no block
    waits for the consumer, which is told only of each job's end or failure (`next`,
    or nothing for `WAIT_SECONDS`). `stop` waits until every job has finished the
    step or send it is in and started no other."""

    def __init__(self, send: Callable[[Job, list[Block]], None]) -> None:
        self.send = send
        self.ended: queue.SimpleQueue[tuple[Job, BaseException | None]] = queue.SimpleQueue()
        self.running = 0
        self.stopped = False
        self._driving = 0  # jobs that have neither ended nor seen `stopped`
        self._quiet = threading.Condition()

    def __bool__(self) -> bool:
        return self.running > 0

    def start(self, job: Job) -> None:
        self.running += 1
        with self._quiet:
            self._driving += 1
        self._drive(job, None)

    def next(self) -> tuple[Job | None, object]:
        """A job's `END`, or its failure raised; `(None, None)` after `WAIT_SECONDS`
        without either (the consumer's chance to check memory)."""
        try:
            job, error = self.ended.get(timeout=WAIT_SECONDS)
        except queue.Empty:
            return None, None
        if error is not None:
            raise error
        return job, END

    def go_on(self, job: Job) -> None:
        raise AssertionError("sending jobs go on by themselves")

    def end(self, job: Job) -> None:
        self.running -= 1

    def stop(self) -> None:
        self.stopped = True
        with self._quiet:
            self._quiet.wait_for(lambda: self._driving == 0)

    def _drive(self, job: Job, done: ts.Future[object] | None) -> None:
        """Take `job` on from its step `done` (None: from its start) until a step is
        not done yet: its block sent, the next step started. A failure anywhere ends
        the job with it (raised by `next`): nothing is left to a callback's thread."""
        try:
            while not self.stopped:
                if done is not None:
                    result = done.result()
                    if result is END:
                        self._finish(job, None)
                        return
                    if result is not SKIP:
                        assert isinstance(result, (tuple, list))  # a block, or its pieces
                        blocks = result if isinstance(result, list) else [result]
                        if not on_pool_thread():  # (tensorstore's: not kept waiting)
                            in_pool(functools.partial(self._send_then_drive, job, blocks))
                            return
                        self.send(job, blocks)
                        del blocks, result
                        if self.stopped:
                            break
                done = job.step()
                if not done.done():
                    # (where it is done meanwhile, the callback runs here: once more)
                    done.add_done_callback(lambda later: self._drive(job, later))
                    return
            self._finish(job, None, stopped=True)
        except BaseException as error:  # noqa: BLE001 - raised by `next`
            self._finish(job, error)

    def _send_then_drive(self, job: Job, blocks: list[Block]) -> None:
        try:
            if not self.stopped:
                self.send(job, blocks)
        except BaseException as error:  # noqa: BLE001 - raised by `next`
            self._finish(job, error)
            return
        del blocks
        self._drive(job, None)

    def _finish(self, job: Job, error: BaseException | None, stopped: bool = False) -> None:
        if not stopped:
            self.ended.put((job, error))
        with self._quiet:
            self._driving -= 1
            self._quiet.notify_all()


WAIT_SECONDS = 0.25
"""How long the consumer of sending jobs waits for one to end before it looks at the
process's memory (`lazyckpt._engine.memory`'s guard, and the pool's free buffers)."""


Steps = InOrder | AsReady | Sending
