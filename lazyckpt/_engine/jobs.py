"""The jobs a stream runs (`lazyckpt._engine.stream`): each produces consecutive
blocks of one array, step by step, as futures of `(index, values, work)`; and the
jobs of arrays that tensorstore reads, whole chunks grouped up to a block's share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import tensorstore as ts

from lazyckpt._array import compose
from lazyckpt._array.geometry import (
    Box,
    box_bytes,
    chunk_blocks,
    in_view,
    strided_block,
    to_stored,
    view_origins,
)
from lazyckpt._array.selection import Selection
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.fill import read_box
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._engine.share import Sharing
from lazyckpt._engine.stored import stored_array, ts_held
from lazyckpt._storage.futures import ready, then

END = object()
SKIP = object()  # a step whose block holds none of the view's elements
Block = tuple[tuple[slice, ...], np.ndarray, int]
"""What a job's step produces: a block's index in the view, its values, and its size."""


class Job:
    """Consecutive blocks of one array; `step()` starts producing the next, a future
    of `(index, values, work)` or `END`. Steps of one job run one after another."""

    def __init__(
        self,
        position: int,
        held: int,
        steps: Iterator[Callable[[], ts.Future[object]]],
        sharing: Sharing | None = None,
    ) -> None:
        self.position, self.held, self._steps = position, held, steps
        self.sharing = sharing
        """Views of one stored array that this job's blocks are cut into."""

    def step(self) -> ts.Future[object]:
        start = next(self._steps, None)
        if start is None:
            return ready(END)
        result: ts.Future[object] = start()
        return result

    def steps(self) -> Iterator[Callable[[], ts.Future[object]]]:
        return self._steps

    def placed(self, place: compose.Place) -> Job:
        """This job's blocks as blocks of a composed view that this array is part of."""

        def move(result: object) -> object:
            if result is END or result is SKIP:
                return result
            assert isinstance(result, tuple)
            index, values, work = result
            # The block's work is counted once, with its first piece.
            return [
                (moved, piece, work if i == 0 else 0)
                for i, (moved, piece) in enumerate(place(index, values))
            ]

        steps = (lambda start=start: then(start(), move) for start in self._steps)
        return Job(self.position, self.held, steps)


def picked(job: Job, selection: Selection, box: Box) -> Job:
    """`job`, which streams the stored `box` around a strided view, with each block cut
    down to the view's elements in it (`SKIP` where there are none)."""

    def pick(result: object) -> object:
        if result is END:
            return END
        assert isinstance(result, tuple)
        index, values, _ = result
        found = strided_block(selection, box, index, values)
        if found is None:
            return SKIP
        return (*found, found[1].nbytes)

    steps = (lambda start=start: then(start(), pick) for start in job.steps())
    return Job(job.position, job.held, steps)


def ts_step(
    array: ArrayView, index: tuple[slice, ...], nbytes: int
) -> Callable[[], ts.Future[Block]]:
    return lambda: then(array[index].read(), lambda values: (index, values, nbytes))


def ts_jobs(
    position: int, array: ArrayView, mapping: Sequence[tuple[int, int] | None], limits: Scheduler
) -> Iterator[Job]:
    """Blocks read by tensorstore: whole chunks, grouped up to a block's share."""
    stored = stored_array(array)
    box = to_stored(array, mapping, tuple((0, n) for n in array.shape))
    # In-memory values, and raw bytes (straight into place: a local file's, or ranges
    # of a remote one's), are read by the view itself.
    by_view = (
        stored.inline is not None
        or stored.raw_file() is not None
        or stored.remote_raw() is not None
    )
    opened = None if by_view else stored.open()
    origins = view_origins(mapping, len(stored.shape))
    itemsize = stored.dtype.itemsize
    for part in chunk_blocks(box, stored.chunks, itemsize, limits.block_bytes):
        index, shape = in_view(mapping, part, origins)
        nbytes = box_bytes(part, itemsize)
        held = ts_held(stored, part)
        if opened is None:
            yield Job(position, held, iter([ts_step(array, index, array[index].nbytes)]))
            continue

        def start(
            part: Box = part,
            index: tuple[slice, ...] = index,
            shape: tuple[int, ...] = shape,
            n: int = nbytes,
        ) -> ts.Future[Block]:
            future = read_box(stored, opened, part)()
            return then(
                future,
                lambda data: (index, data.reshape(shape).astype(array.dtype, copy=False), n),
            )

        yield Job(position, held, iter([start]))
