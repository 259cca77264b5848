"""Bytes read from storage, and requests sent over the network: tensorstore's own
counters, and lazyckpt's direct reads (`lazyckpt._engine.raw`, and HTTP's
`lazyckpt._storage.http.transport` and `web`), which tensorstore does not see."""

from __future__ import annotations

import threading

from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none

_DIRECT = [0]
_REQUESTS = [0]
_LOCK = threading.Lock()

_NETWORK_KVSTORES = ("s3", "gcs", "gcs_grpc")
"""tensorstore's kvstores that read over the network (`file` reads a disk; `ocdbt` and
`zip` read through another kvstore, which counts the bytes and requests)."""
_RELAYED = "http"
"""The kvstore that lazyckpt's tensorstore reads over HTTP go through: to the relay
(`lazyckpt._storage.http.relay`), whose requests lazyckpt's client makes and counts."""


def count_direct(nbytes: int) -> None:
    """Add `nbytes` read from a file without tensorstore."""
    with _LOCK:
        _DIRECT[0] += nbytes


def count_request() -> None:
    """Count one HTTP request made without tensorstore (`lazyckpt._storage.http.transport`)."""
    with _LOCK:
        _REQUESTS[0] += 1


def direct_bytes_read() -> int:
    """Bytes read from files without tensorstore in this process so far: a local
    safetensors source's, or the stored bytes of chunks that lazyckpt decodes from
    local files; a save's own reads of its destination never add to it."""
    return _DIRECT[0]


def bytes_read() -> int:
    """Total bytes read from any kvstore or file in this process so far."""
    return totals()[0]


def requests_made() -> int:
    """Requests sent over the network in this process so far (see `totals`)."""
    return totals()[1]


def totals() -> tuple[int, int]:
    """Bytes read from any kvstore or file, and requests sent over the network, in this
    process so far. A request is one answered by lazyckpt's HTTP client (retries
    included), or one of tensorstore's network reads: a read after it merged nearby ones
    (`/tensorstore/kvstore/s3/batch_read`, one GET), and each retry of one."""
    nbytes, requests = _DIRECT[0], _REQUESTS[0]
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        driver, _, name = metric["name"].removeprefix("/tensorstore/kvstore/").partition("/")
        value = sum(int(v.get("value", 0)) for v in metric["values"])
        if driver == _RELAYED:
            continue
        if name == "bytes_read":
            nbytes += value
        elif driver in _NETWORK_KVSTORES and name in ("batch_read", "retries"):
            requests += value
    return nbytes, requests
