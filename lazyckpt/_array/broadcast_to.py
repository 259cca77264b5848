"""`np.broadcast_to` as a computed view: a part's elements repeated along the
dimensions where it has size 1 (a torch tensor saved `expand`ed, its strides 0 there).
A box of the view reads the part's box once, whatever the repeats."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from lazyckpt._array.compose import Computed, Part, view_chunks
from lazyckpt._array.geometry import Box


@attrs.frozen(eq=False)
class BroadcastTo(Computed):
    """`array` (of the view's rank) repeated to `shape` along its size-1 dimensions."""

    array: Part

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.array,)

    def _repeats(self, dim: int) -> bool:
        return self.array.shape[dim] != self.shape[dim]

    @property
    def chunks(self) -> tuple[int, ...]:
        # 1 along a repeated dimension: blocks grow from it as the budget allows, each
        # reading its part's box once, and none is larger than the budget.
        inner = view_chunks(self.array)
        return tuple(1 if self._repeats(d) else c for d, c in enumerate(inner))

    def inputs(self, box: Box) -> tuple[Box, ...]:
        return (tuple((0, 1) if self._repeats(d) else span for d, span in enumerate(box)),)

    def compute(self, box: Box, values: Sequence[np.ndarray], out: np.ndarray) -> None:
        np.copyto(out, np.broadcast_to(values[0], out.shape), casting="unsafe")

    def describe(self) -> str:
        return f"broadcast from {self.array.shape}"
