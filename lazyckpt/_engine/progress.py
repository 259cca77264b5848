"""Progress of long reads and writes, drawn by tqdm.

tqdm is the bar the JAX and Hugging Face tools already show (`huggingface_hub`'s
downloads, `transformers`' loading): through `tqdm.auto` it is a widget in Jupyter and
a line on a terminal, with rate and time left, so lazyckpt draws no bar of its own. It
is an optional extra (`lazyckpt[progress]`, also in `lazyckpt[notebook]`).

`progress=None`, the default of every verb, shows a bar in a notebook or on a
terminal, when tqdm is installed, and never in a CI log (`CI` set): from the start for
reads of at least `AUTO_MIN_BYTES`, and for reads of at least `LATE_MIN_BYTES` once
they have taken `LATE_SECONDS` (a model read over a slow network, in bytes per
second; a quick read draws nothing). `True` always shows it; `False` never.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from lazyckpt._errors import MissingExtraError

AUTO_MIN_BYTES = 256 << 20
"""Reads of at least this many bytes show their bar from the start."""
LATE_MIN_BYTES = 16 << 20
"""Reads of at least this many bytes show their bar once they take `LATE_SECONDS`."""
LATE_SECONDS = 2.0


@contextlib.contextmanager
def shown(enabled: bool | None, total: int, label: str) -> Iterator[Progress | None]:
    """`Progress.maybe(...)`, closed however the block ends: a read that fails leaves
    no bar behind, open in a notebook or drawn over by the error."""
    bar = Progress.maybe(enabled, total, label)
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


class Progress:
    """Bytes done out of `total`, on a tqdm bar; `advance` may be called from any
    thread (the engine's callbacks run on tensorstore's and the decoding threads)."""

    def __init__(self, total: int, label: str, *, late: bool = False) -> None:
        if _tqdm() is None:
            raise MissingExtraError(
                f"{label}: progress=True draws its bar with tqdm, which is not installed; "
                "pip install 'lazyckpt[progress]' (or pass progress=False)"
            )
        self._total, self._label = total, label
        self._lock = threading.Lock()
        self._done = 0
        self._start = time.monotonic()
        self._closed = False
        self._bar = None if late else self._drawn()

    def _drawn(self) -> Any:
        return _tqdm()(
            total=self._total,
            initial=min(self._done, self._total),
            desc=self._label,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            mininterval=0.2,
            dynamic_ncols=True,
        )

    @classmethod
    def maybe(cls, enabled: bool | None, total: int, label: str) -> Progress | None:
        """A bar if `enabled`; if None (auto), in a notebook or on a terminal, outside
        CI, when tqdm is installed: for a read of at least `AUTO_MIN_BYTES`, or of at
        least `LATE_MIN_BYTES` once it has taken `LATE_SECONDS`."""
        if enabled is None:
            if not _interactive() or _tqdm() is None:
                return None
            if total >= AUTO_MIN_BYTES:
                return cls(total, label)
            return cls(total, label, late=True) if total >= LATE_MIN_BYTES else None
        return cls(total, label) if enabled else None

    def advance(self, nbytes: int) -> None:
        """Count `nbytes` more done; the bar stops at its total (pieces cut to one shape
        read a few rows twice)."""
        with self._lock:
            shown = max(0, min(nbytes, self._total - self._done))
            self._done += nbytes
            if self._closed:
                return  # (a late bar drawn now would never be closed)
            if self._bar is None and time.monotonic() - self._start >= LATE_SECONDS:
                self._bar = self._drawn()  # (from what is done so far)
            elif self._bar is not None:
                self._bar.update(shown)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._bar is not None:
                self._bar.close()


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None
    return tqdm


def _interactive() -> bool:
    """In a Jupyter kernel, or with stderr on a terminal; never in CI."""
    if os.environ.get("CI"):
        return False
    return in_notebook() is not None or sys.stderr.isatty()


def in_notebook() -> Any:
    """The IPython shell of the Jupyter kernel this runs in, or None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if shell is not None and "IPKernelApp" in getattr(shell, "config", {}) else None
