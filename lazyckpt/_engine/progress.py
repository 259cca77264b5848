"""A one-line progress bar for long reads, on stderr; off unless asked or interactive."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from lazyckpt._text import human_bytes

_AUTO_MIN_BYTES = 256 << 20  # below this a read is quick; no bar unless asked
_REDRAW_SECONDS = 0.2


class Progress:
    """Counts bytes done out of `total` and redraws at most every 0.2 s."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._start = time.perf_counter()
        self._drawn = 0.0

    @classmethod
    def maybe(cls, enabled: bool | None, total: int, label: str) -> Progress | None:
        """A bar if `enabled`, or if None (auto) when stderr is a terminal and the read is
        large; else None."""
        if enabled is None:
            enabled = sys.stderr.isatty() and total >= _AUTO_MIN_BYTES
        return cls(total, label) if enabled else None

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self._drawn >= _REDRAW_SECONDS or self.done >= self.total:
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self._start, 1e-9)
        percent = 100 * self.done / self.total if self.total else 100.0
        self.stream.write(
            f"\r{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} "
            f"({percent:.0f}%), {human_bytes(int(rate))}/s   "
        )
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()
