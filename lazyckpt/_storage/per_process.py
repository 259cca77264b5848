"""One object per process, made at first use: the HTTP client, the relay and the read
engine's thread pools, whose threads a forked child does not have, so a child makes
its own. And tensorstore's own threads, which a child cannot have: tensorstore aborts
a process forked after it started them at its next read (`pthread_atfork`), so lazyckpt
refuses that read by name first (`tensorstore_io`)."""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from lazyckpt._errors import StorageAccessError

T = TypeVar("T")


class PerProcess(Generic[T]):
    """The object `make` returns, made once per process, at the first `get`."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._value: T | None = None
        self._lock = threading.Lock()
        # A forked child has the object's sockets and pools but none of their threads.
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def made(self) -> T | None:
        """The object, where this process made it; None before its first `get`."""
        return self._value

    def _forget(self) -> None:
        self._value, self._lock = None, threading.Lock()


_tensorstore_ran = False
"""Whether tensorstore may have started its threads in this process: lazyckpt asked it
for I/O, or one of its threads (`ts_pool_worker`...) ran at a fork. Its threads end
when idle, but its fork guard, once set up, stays."""
_forked_after_tensorstore = False
"""Whether this process is a fork of one where `_tensorstore_ran` held (or of a child of
one): tensorstore aborts it at its next read."""


def tensorstore_io(where: str) -> None:
    """Before lazyckpt asks tensorstore to read or write `where`: a
    `StorageAccessError` in a process forked after tensorstore started its threads,
    instead of tensorstore's abort, which kills the process ("fork() use detected").
    What lazyckpt reads itself (safetensors and other raw files, on disk or over HTTP)
    works in such a child."""
    global _tensorstore_ran
    if _forked_after_tensorstore:
        raise StorageAccessError(
            f"{where}: not read or written in this process, a fork of one in which tensorstore "
            "had started its threads: tensorstore aborts a forked process at its next "
            "read (its threads are not in the child). Read it in the parent before "
            "forking, or start this process with multiprocessing's 'spawn' or "
            "'forkserver' method (for torch's DataLoader, multiprocessing_context='spawn')"
        )
    _tensorstore_ran = True


def _tensorstore_threads() -> bool:
    """Whether a thread of tensorstore's runs in this process (they are named `ts_...`);
    False where the system does not say (no /proc)."""
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as name:
                if name.read().startswith("ts_"):
                    return True
        except OSError:  # (the thread ended meanwhile)
            continue
    return False


def _before_fork() -> None:
    global _tensorstore_ran
    # (tensorstore used by others in this process too: orbax, the caller's own code)
    _tensorstore_ran = _tensorstore_ran or _tensorstore_threads()


def _after_fork_in_child() -> None:
    global _forked_after_tensorstore
    _forked_after_tensorstore = _forked_after_tensorstore or _tensorstore_ran


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
