"""Reading one whole view for `LazyArray.read` (`get()`): decoded by lazyckpt, one job
per stored chunk on the decoding threads (`read_view`; a whole array over HTTP in
coalesced ranges, `coalesced.read_whole`), or a composed view through the engine
(`read_composed`)."""

from __future__ import annotations

import collections

import numpy as np

from lazyckpt._array.geometry import bounds, chunks_in
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.coalesced import read_whole
from lazyckpt._engine.decode import job_bytes
from lazyckpt._engine.fill import decode_into, schedule_fill, windows
from lazyckpt._engine.memory import Destination, check_fits
from lazyckpt._engine.scheduler import DEFAULT_MEMORY_BUDGET, Scheduler, in_pool, pool_size
from lazyckpt._engine.stored import stored_array, stores
from lazyckpt._storage.futures import all_of, ready, then
from lazyckpt._storage.kvstore import check_unchanged
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.paths import is_remote


def read_view(array: ArrayView) -> ts.Future[np.ndarray]:
    """A future of the whole view, decoded by lazyckpt: one job per stored chunk it
    touches, on the decoding threads (no job waits on another, so any thread may call
    this). Each job holds a few MiB while it runs; the result is allocated once."""
    stored = stored_array(array)
    destination = Destination(tuple((0, n) for n in array.shape), array.dtype, key=array.key)
    check_fits(f"reading {array.key!r} {array.shape}", destination.out_nbytes())
    selection = array.selection
    if 0 in array.shape:
        return ready(destination.buffer())
    coalesced = read_whole(array)  # (over HTTP: its chunks' ranges all at once)
    if coalesced is not None:
        return coalesced
    read_bytes, window = windows(DEFAULT_MEMORY_BUDGET)
    indices = collections.deque(chunks_in(bounds(selection), stored.chunks))
    users = [(destination, selection)]
    # Workers that take chunks until none is left: as many as the cores, or over a
    # network as many as the default budget holds streams (each waits a round trip
    # per window).
    remote = is_remote(stored.store.location)
    workers = DEFAULT_MEMORY_BUDGET // job_bytes(read_bytes, window) if remote else 0
    workers = max(workers, pool_size())

    def work() -> None:
        while True:
            try:
                index = indices.popleft()
            except IndexError:
                return
            try:
                decode_into(array, index, users, read_bytes, window)
            except BaseException:
                indices.clear()  # (the read failed: no other worker starts a chunk)
                raise

    jobs = [in_pool(work, waits=remote) for _ in range(min(workers, len(indices)))]
    # Settled once every job ended: none still writes into the result after a failure.
    return then(all_of(jobs, lambda error: error), lambda _: destination.buffer())


def read_composed(array: ArrayView) -> np.ndarray:
    """The whole of a composed view (`lazyckpt.stack`, `transpose`...), read with the
    default budget: each stored chunk of its parts read once."""
    scheduler = Scheduler(None)
    destination = Destination(tuple((0, n) for n in array.shape), array.dtype, key=array.key)
    schedule_fill(array, [destination], scheduler, lambda: None)
    scheduler.drain()
    check_unchanged(stores([array]))
    return destination.buffer()
