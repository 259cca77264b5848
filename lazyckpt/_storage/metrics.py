"""Bytes read from storage: tensorstore's own counters, and lazyckpt's direct reads
(`lazyckpt._engine.raw`, and HTTP's `lazyckpt._storage.web`), which tensorstore does not
see; and the HTTP requests made."""

from __future__ import annotations

import threading

import tensorstore as ts

_DIRECT = [0]
_REQUESTS = [0]
_LOCK = threading.Lock()


def count_direct(nbytes: int) -> None:
    """Add `nbytes` read from a file without tensorstore."""
    with _LOCK:
        _DIRECT[0] += nbytes


def count_request() -> None:
    """Count one HTTP request made without tensorstore (`lazyckpt._storage.web`)."""
    with _LOCK:
        _REQUESTS[0] += 1


def requests_made() -> int:
    """HTTP requests made without tensorstore in this process so far."""
    return _REQUESTS[0]


def direct_bytes_read() -> int:
    """Bytes read from files without tensorstore in this process so far: a local
    safetensors source's, which a save's own reads of its destination never add to."""
    return _DIRECT[0]


def bytes_read() -> int:
    """Total bytes read from any kvstore or file in this process so far."""
    total = _DIRECT[0]
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if metric["name"].endswith("/bytes_read"):
            total += sum(int(v.get("value", 0)) for v in metric["values"])
    return total
