"""What a block of code read: bytes, network requests and time (`measure`)."""

from __future__ import annotations

import time
from types import TracebackType

from lazyckpt._storage import metrics
from lazyckpt._text import human_bytes


class ReadCost:
    """What a `measure()` block read: the bytes, the network requests, and its time.

    Inside the block it counts so far; after it, what the block cost. `str` says it in
    words: `12.0 MiB in 4 requests, 0.31 s, 38.7 MiB/s`.

    Attributes:
        bytes_read: Bytes read from storage, as stored (compressed chunks count what
            they take on disk), by every backend: local files, buckets, HTTP and the Hub.
        requests: Requests sent over the network. Over HTTP(S) and from the Hub, each
            request of lazyckpt's client that was answered, retries included. In
            buckets (`s3://`, `gs://`), each read tensorstore sent after merging nearby
            ones (one GET each), and each of its retries. Local files, and the files of
            the Hugging Face cache, take none.
        seconds: Time from the start of the block to its end (to now, inside it).
    """

    __slots__ = ("_end", "_start")

    def __init__(self) -> None:
        self._start = _now()
        self._end: tuple[int, int, float] | None = None

    def __enter__(self) -> ReadCost:
        # From the block's start, not `measure()`'s call (a cost made earlier, or
        # entered again).
        self._start, self._end = _now(), None
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._end = _now()

    @property
    def bytes_read(self) -> int:
        return self._since()[0]

    @property
    def requests(self) -> int:
        return self._since()[1]

    @property
    def seconds(self) -> float:
        return self._since()[2]

    @property
    def bytes_per_second(self) -> float:
        """`bytes_read` over `seconds`."""
        nbytes, _, seconds = self._since()
        return nbytes / seconds if seconds > 0 else 0.0

    def _since(self) -> tuple[int, int, float]:
        end = self._end if self._end is not None else _now()
        return end[0] - self._start[0], end[1] - self._start[1], end[2] - self._start[2]

    def __str__(self) -> str:
        nbytes, requests, seconds = self._since()
        if requests == 0:
            sent = ", no network requests"
        else:
            sent = f" in {requests} request{'s' if requests != 1 else ''}"
        took = f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1000:.1f} ms"
        rate = human_bytes(int(nbytes / seconds)) if seconds > 0 else "0 B"
        return f"{human_bytes(nbytes)}{sent}, {took}, {rate}/s"

    def __repr__(self) -> str:
        return f"ReadCost({self})"


def measure() -> ReadCost:
    """Count what a block of code reads from storage: bytes, network requests, time.

    >>> tree = lazyckpt.open(fp8)                  # a local safetensors file
    >>> with lazyckpt.measure() as cost:
    ...     bias = lazyckpt.load(tree["b"])
    >>> cost.bytes_read, cost.requests             # its five float32s, no more
    (20, 0)
    >>> print(cost)                                # doctest: +ELLIPSIS
    20 B, no network requests, ...

    The counters are the process's: reads by other threads while the block runs
    (another `load`, a data loader) count too, and a block inside another counts in
    both. A read that went wrong counts what it read before it failed. See `ReadCost`
    for what a request is on each backend.

    Returns:
        A `ReadCost`, counting from the start of the `with` block to its end.
    """
    return ReadCost()


def _now() -> tuple[int, int, float]:
    nbytes, requests = metrics.totals()
    return nbytes, requests, time.perf_counter()
