"""One object per process, made at first use: the HTTP client and the relay, whose
threads a forked child does not have, so a child makes its own."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

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
