"""Placing arrays on accelerators in pieces, with the host's share bounded by the budget.

On CPU devices a filled host buffer becomes the shard itself (`_materialize`), so the
results are memory the read is meant to leave behind. A TPU or GPU shard is only
staged on the host: filled whole, a shard of 2 GiB would need 2 GiB of host memory
whatever the budget, and many in flight more. Here each shard is streamed instead
(`_engine.stream.iter_blocks`: whole stored chunks, or slabs of one larger than a
block, each chunk read once), every block is sent to its devices as it comes, and
written into the shard's buffer on the device by a jitted `dynamic_update_slice`
that donates the buffer, so it is updated in place: no second copy of the shard in
device memory, and on the host only the blocks being read and those being sent.
Half the budget reads, half carries blocks whose transfers have not finished: a
block is let go once its copy on the device is ready. A shard that one block holds
whole is sent as that block, with no buffer to write into.

Values arrive bit for bit. A transfer copies bytes, but a TPU computing on floats
narrower than 32 bits canonicalizes NaN payloads and flushes bfloat16's subnormals
to zero, even in a copy (measured on a v5e: 80,850 of 16 Mi random bfloat16 bytes
changed by `dynamic_update_slice`). Such shards are written as unsigned integers of
their width, which every device copies exactly, and made floats at the end by a
bitcast, again in place. Which bit patterns that bitcast changes is measured once per
device kind and dtype (all 2**8 or 2**16 of them); where the device changes some, the
integers are first searched for them on the device, and a shard holding one is
brought back and sent whole from the host instead (exact, over the budget, with an
`OverBudgetWarning`).
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lazyckpt._array import compose
from lazyckpt._array.dtypes import finfo, issubdtype
from lazyckpt._array.geometry import Box, box_bytes
from lazyckpt._engine.decode import decodes
from lazyckpt._engine.fill import schedule_fill
from lazyckpt._engine.memory import Destination
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.raw import source
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._engine.stream import iter_blocks
from lazyckpt._errors import OverBudgetWarning, warn
from lazyckpt._lazy import LazyArray
from lazyckpt._text import human_bytes

if TYPE_CHECKING:
    import jax
    from jax.sharding import Sharding

STAGED_PLATFORMS = frozenset({"tpu", "gpu", "cuda", "rocm"})
"""Device platforms whose shards are staged on the host and sent in pieces; every
other platform's devices (CPU) adopt the filled host buffer as the shard."""


def staged(sharding: Sharding) -> bool:
    """Whether arrays placed with `sharding` are sent in pieces: some device of this
    process that it places on is an accelerator's."""
    platforms = {str(getattr(d, "platform", "")) for d in sharding.addressable_devices}
    return not platforms.isdisjoint(STAGED_PLATFORMS)


def put_staged(
    placements: Sequence[tuple[LazyArray, Sharding, dict[Box, list[jax.Device]]]],
    budget: int,
    progress: Progress | None,
) -> list[jax.Array]:
    """Each `(array, sharding, regions)` placed on its devices within `budget` host
    bytes; `regions` maps each distinct region this process holds to the devices
    that hold it.

    Half the budget is for reads in flight, half for filled pieces until their
    transfers are done. A region of at most half the budget is one piece, filled by
    the engine as any read is (raw bytes straight into it, chunks decoded on every
    core) and sent whole. A larger one is cut into rows where its bytes lie raw in a
    file (each piece reads only its own bytes), and otherwise streamed block by block
    (`iter_blocks`: a stored chunk larger than a piece is decoded once, in slabs).
    """
    import jax

    half = max(1, budget // 2)
    scheduler = Scheduler(half, progress)
    gate = _Gate(half, scheduler)
    shards: list[_Shard] = []
    streamed: list[tuple[LazyArray, _Shard]] = []
    try:
        for array, _, regions in placements:
            for region, devices in regions.items():
                shard = _Shard(array.key, region, devices, array.dtype)
                shards.append(shard)
                pieces = _pieces(array, region, half)
                if pieces is None:
                    streamed.append((array[tuple(slice(*r) for r in region)], shard))
                for piece in pieces or ():
                    _fill(array, piece, shard, gate, scheduler)
        scheduler.drain()
        if streamed:
            for position, index, values in iter_blocks([v for v, _ in streamed], half, progress):
                gate.reserve(_held_bytes(values))
                gate.sent(_held_bytes(values), streamed[position][1].write(index, values))
                del values
        gate.drain()
    except BaseException:
        scheduler.abandon()
        raise
    placed: list[jax.Array] = []
    at = 0
    for array, sharding, regions in placements:
        parts = shards[at : at + len(regions)]
        at += len(regions)
        arrays = [buffer for part in parts for buffer in part.finished()]
        placed.append(jax.make_array_from_single_device_arrays(array.shape, sharding, arrays))
    jax.block_until_ready(placed)
    return placed


def _pieces(array: LazyArray, region: Box, half: int) -> list[Box] | None:
    """The pieces `region` is filled in: itself, if it holds at most `half` bytes;
    bands of rows of a quarter of that, where its bytes lie raw in a file; None where
    it must be streamed."""
    itemsize = array.dtype.itemsize
    if box_bytes(region, itemsize) <= half:
        return [region]
    stored = array.stored
    if not region or isinstance(stored, compose.Node) or decodes(stored) or source(stored) is None:
        return None
    (low, high), rest = region[0], region[1:]
    rows = max(1, (half // 4) // max(1, box_bytes(((0, 1), *rest), itemsize)))
    return [((at, min(at + rows, high)), *rest) for at in range(low, high, rows)]


def _fill(array: LazyArray, piece: Box, shard: _Shard, gate: _Gate, scheduler: Scheduler) -> None:
    """Fill `piece` of `array` through the engine once the gate lets its bytes in,
    then send it to the shard's devices."""
    nbytes = box_bytes(piece, array.dtype.itemsize)
    gate.reserve(nbytes)
    destination = Destination(piece, array.dtype, aligned=True)
    index = tuple(slice(p[0] - r[0], p[1] - r[0]) for p, r in zip(piece, shard.region, strict=True))

    def send() -> None:
        gate.sent(nbytes, shard.write(index, destination.buffer()))
        destination.out = None  # (held by the transfer until it is done, not here)

    schedule_fill(array, [destination], scheduler, send)


class _Gate:
    """Host bytes of pieces between their fill and the end of their transfer, at most
    `limit` (one piece at least): a piece waits for reads to finish, whose pieces go
    out, or for the oldest transfer."""

    def __init__(self, limit: int, scheduler: Scheduler) -> None:
        self.limit, self.scheduler = limit, scheduler
        self.held = 0
        self.sending: collections.deque[tuple[int, list[jax.Array]]] = collections.deque()

    def reserve(self, nbytes: int) -> None:
        while self.held and self.held + nbytes > self.limit:
            if self.sending:
                self._wait_oldest()
            elif not self.scheduler.finish_one():
                break
        self.held += nbytes

    def sent(self, nbytes: int, arrays: list[jax.Array]) -> None:
        self.sending.append((nbytes, arrays))

    def drain(self) -> None:
        while self.sending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        import jax

        nbytes, arrays = self.sending.popleft()
        jax.block_until_ready(arrays)
        self.held -= nbytes


class _Shard:
    """One region of a placed array on its devices: a buffer on each, written block by
    block (as unsigned integers for floats narrower than 32 bits), or the one block
    that covers it."""

    def __init__(
        self, key: str, region: Box, devices: Sequence[jax.Device], dtype: np.dtype[Any]
    ) -> None:
        self.key, self.region = key, region
        self.devices, self.dtype = list(devices), np.dtype(dtype)
        self.shape = tuple(high - low for low, high in region)
        self.written = _written_dtype(self.dtype)
        self.buffers: list[jax.Array] | None = None
        self.whole = False

    def write(self, index: tuple[slice, ...], values: np.ndarray) -> list[jax.Array]:
        """Send `values` (`index` of this region) to every device and write them in;
        the arrays sent, for the caller to wait on."""
        import jax

        if values.shape == self.shape:  # the whole region in one block
            self.buffers = [
                jax.device_put(values, device, may_alias=True) for device in self.devices
            ]
            self.whole = True
            return self.buffers
        sent = [
            jax.device_put(values.view(self.written), device, may_alias=True)
            for device in self.devices
        ]
        if self.buffers is None:
            self.buffers = [_empty(self.shape, self.written, device) for device in self.devices]
        starts = tuple(s.indices(n)[0] for s, n in zip(index, self.shape, strict=True))
        self.buffers = [
            _written(buffer, piece, starts)
            for buffer, piece in zip(self.buffers, sent, strict=True)
        ]
        return sent

    def finished(self) -> list[jax.Array]:
        """The shard on each device, in its own dtype."""
        import jax

        assert self.buffers is not None
        if self.whole or self.written == self.dtype:
            return self.buffers
        changed = _changed_patterns(self.devices[0], self.dtype)
        if changed and _holds_any(self.buffers[0], changed):
            size = human_bytes(math.prod(self.shape) * self.dtype.itemsize)
            kind = self.devices[0].device_kind
            warn(
                f"{self.key}: a shard of {size} went to {kind} whole from host memory, over "
                f"memory_budget: it holds {self.dtype} values that {kind} changes when it "
                "assembles a shard from pieces (NaN payloads or subnormals), and they must "
                "arrive bit for bit",
                OverBudgetWarning,
            )
            host = np.asarray(jax.device_get(self.buffers[0])).view(self.dtype)
            return [jax.device_put(host, device) for device in self.devices]
        return [_bitcast(buffer, self.dtype) for buffer in self.buffers]


def _written_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """What a shard of `dtype` is written as on the device: unsigned integers of its
    width for floats narrower than 32 bits, `dtype` itself otherwise."""
    if issubdtype(dtype, np.floating) and finfo(dtype).bits in (8, 16):
        return np.dtype(f"uint{finfo(dtype).bits}")
    return dtype  # (float4 and float6 are packed below a byte: no integer of their width)


def _held_bytes(values: np.ndarray) -> int:
    """The host memory that keeping `values` keeps: all of the array it is a view of."""
    base: Any = values
    while isinstance(base.base, np.ndarray):
        base = base.base
    return int(max(base.nbytes, values.nbytes))


@functools.cache
def _empty_fn(shape: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device) -> Any:
    import jax
    import jax.numpy as jnp

    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device) -> jax.Array:
    """A buffer for a shard on `device`, made there (zeros: JAX has no uninitialized
    arrays; the device fills it far faster than the host sends)."""
    result: jax.Array = _empty_fn(shape, np.dtype(dtype), device)()
    return result


@functools.cache
def _write_fn() -> Any:
    import jax

    def write(buffer: jax.Array, piece: jax.Array, starts: tuple[jax.Array, ...]) -> jax.Array:
        return jax.lax.dynamic_update_slice(buffer, piece, starts)

    return jax.jit(write, donate_argnums=0)


def _written(buffer: jax.Array, piece: jax.Array, starts: tuple[int, ...]) -> jax.Array:
    """`buffer` with `piece` at `starts`, in place (the buffer is donated); starts are
    traced, so one compilation serves every position of a piece of that shape."""
    result: jax.Array = _write_fn()(buffer, piece, starts)
    return result


@functools.cache
def _bitcast_fn(dtype: np.dtype[Any]) -> Any:
    import jax

    return jax.jit(lambda x: jax.lax.bitcast_convert_type(x, dtype), donate_argnums=0)


def _bitcast(buffer: jax.Array, dtype: np.dtype[Any]) -> jax.Array:
    """`buffer`'s unsigned integers as `dtype`, in place (donated)."""
    result: jax.Array = _bitcast_fn(np.dtype(dtype))(buffer)
    return result


_CHANGED: dict[tuple[str, str, np.dtype[Any]], tuple[tuple[int, int], ...]] = {}


def _changed_patterns(device: jax.Device, dtype: np.dtype[Any]) -> tuple[tuple[int, int], ...]:
    """The bit patterns of `dtype` that `device` changes when it bitcasts unsigned
    integers to it, as inclusive ranges; measured once per device kind and dtype by
    sending every pattern there and back."""
    import jax

    key = (device.platform, device.device_kind, np.dtype(dtype))
    if key not in _CHANGED:
        unsigned = _written_dtype(np.dtype(dtype))
        patterns = np.arange(1 << (8 * unsigned.itemsize), dtype=unsigned)
        back = np.asarray(jax.device_get(_bitcast(jax.device_put(patterns, device), dtype)))
        changed = np.flatnonzero(back.view(unsigned) != patterns)
        _CHANGED[key] = _ranges(changed)
    return _CHANGED[key]


def _ranges(values: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Sorted integers as inclusive ranges of consecutive ones."""
    if not len(values):
        return ()
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate([values[:1], values[breaks + 1]])
    ends = np.concatenate([values[breaks], values[-1:]])
    return tuple((int(a), int(b)) for a, b in zip(starts, ends, strict=True))


@functools.cache
def _holds_fn(ranges: tuple[tuple[int, int], ...]) -> Any:
    import jax
    import jax.numpy as jnp

    table = None
    if len(ranges) > 16:  # scattered patterns: look each integer up instead
        table = np.zeros(ranges[-1][1] + 1, bool)
        for low, high in ranges:
            table[low : high + 1] = True

    def holds(x: jax.Array) -> jax.Array:
        if table is not None:
            return jnp.any(jnp.take(jnp.asarray(table), x, mode="fill", fill_value=False))
        found = jnp.zeros(x.shape, bool)
        for low, high in ranges:
            found = found | ((x >= low) & (x <= high))
        return jnp.any(found)

    return jax.jit(holds)


def _holds_any(buffer: jax.Array, ranges: tuple[tuple[int, int], ...]) -> bool:
    """Whether any of `buffer`'s integers falls in `ranges` (on its device: integer
    comparisons, exact, one pass over its memory)."""
    return bool(_holds_fn(ranges)(buffer))
