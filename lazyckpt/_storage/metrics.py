"""Bytes read from storage: tensorstore's own counters, and lazyckpt's direct reads
(`lazyckpt._engine.raw`), which tensorstore does not see."""

from __future__ import annotations

import threading

import tensorstore as ts

_DIRECT = [0]
_LOCK = threading.Lock()


def count_direct(nbytes: int) -> None:
    """Add `nbytes` read from a file without tensorstore."""
    with _LOCK:
        _DIRECT[0] += nbytes


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
