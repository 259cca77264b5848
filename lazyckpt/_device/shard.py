"""Programs that assemble a shard on an accelerator from pieces sent by the host
(`lazyckpt._device.staged`): its buffer made on the device, pieces written into it in place,
and floats narrower than 32 bits made from the unsigned integers they were written as.

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

import concurrent.futures
import functools
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lazyckpt._array.dtypes import finfo, issubdtype
from lazyckpt._array.geometry import Box, box_shape
from lazyckpt._device import programs
from lazyckpt._device.platforms import all_copy
from lazyckpt._errors import OverBudgetWarning, warn
from lazyckpt._text import human_bytes

if TYPE_CHECKING:
    import jax


def written_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """What a shard of `dtype` is written as on the device: unsigned integers of its
    width for floats narrower than 32 bits, `dtype` itself otherwise."""
    if issubdtype(dtype, np.floating) and finfo(dtype).bits in (8, 16):
        return np.dtype(f"uint{finfo(dtype).bits}")
    # float4 and float6 are narrower than any unsigned integer jax bitcasts from: they
    # are written as themselves (no device measured here changes their patterns).
    return dtype


def device_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """What a shard of `dtype` is on the device while it is written: `written_dtype`,
    without jax's 64-bit types where they are off (32 bits)."""
    import jax

    return np.dtype(jax.dtypes.canonicalize_dtype(written_dtype(dtype)))


def _abstract(shape: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device) -> Any:
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def _device(array: jax.Array) -> jax.Device:
    (device,) = array.devices()
    return device


@functools.cache
def _empty_fn(shape: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device) -> Any:
    import jax
    import jax.numpy as jnp

    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def empty_program(shape: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device) -> Any:
    """The program behind `empty` for this shape, dtype and device (`programs`:
    compiled, or loaded where an earlier process compiled it)."""
    return programs.compiled(_empty_fn(shape, np.dtype(dtype), device), (), device)


def empty(shape: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device) -> jax.Array:
    """A buffer for a shard on `device`, made there (zeros: JAX has no uninitialized
    arrays; the device fills it far faster than the host sends)."""
    result: jax.Array = empty_program(shape, dtype, device)()
    return result


@functools.cache
def _write_fn() -> Any:
    import jax

    def write(buffer: jax.Array, piece: jax.Array, starts: tuple[jax.Array, ...]) -> jax.Array:
        # (a piece of fewer dimensions fills the buffer's leading ones with size 1)
        piece = piece.reshape((1,) * (buffer.ndim - piece.ndim) + piece.shape)
        return jax.lax.dynamic_update_slice(buffer, piece, starts)

    return jax.jit(write, donate_argnums=0)


def write_program(
    shape: tuple[int, ...], piece: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device
) -> Any:
    """The program behind `write` for a buffer of `shape` and pieces of shape `piece`;
    starts are traced, so one program serves every position of a piece."""
    import jax

    def arguments() -> tuple[Any, ...]:
        starts = tuple(jax.ShapeDtypeStruct((), np.int32) for _ in shape)
        return _abstract(shape, dtype, device), _abstract(piece, dtype, device), starts

    key = ("write", tuple(shape), tuple(piece), np.dtype(dtype))
    return programs.compiled_as(key, _write_fn(), arguments, device)


def write(
    buffer: jax.Array, piece: jax.Array, starts: tuple[int, ...], at: Starts | None = None
) -> jax.Array:
    """`buffer` with `piece` at `starts`, in place (the buffer is donated); the starts
    taken from `at` where given, already on the device."""
    device = _device(buffer)
    program = write_program(buffer.shape, piece.shape, buffer.dtype, device)
    where = at.on(device, starts) if at is not None else tuple(np.int32(s) for s in starts)
    result: jax.Array = program(buffer, piece, where)
    return result


class Starts:
    """Where pieces start in their shards, as int32 scalars on each device, each made
    once for all the shards of a placement that share it (most do).

    Given as host integers, a piece's starts were transfers of their own each time it
    was written, and the write program's call cost several times more, most of all
    while threads decode (`benchmarks/bench_host_limits.py`, docs/benchmarks.md,
    section 29).
    """

    def __init__(self) -> None:
        self._made: dict[tuple[tuple[int, ...], jax.Device], tuple[Any, ...]] = {}

    def on(self, device: jax.Device, starts: tuple[int, ...]) -> tuple[Any, ...]:
        """`starts` for a piece written on `device`: host integers the first time (which
        costs less than making them on the device where no other piece shares them),
        int32 scalars on the device from the second on."""
        import jax

        key = (starts, device)
        found = self._made.get(key)
        if found is None:
            found = self._made[key] = tuple(np.int32(s) for s in starts)
        elif found and isinstance(found[0], np.integer):  # (two threads may both make them)
            found = self._made[key] = tuple(jax.device_put(list(found), device))
        return found


def program_for(
    function: Any, shape: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device
) -> Any:
    """The jitted `function` of one array of this shape and dtype on `device`, as a
    program (compiled, or loaded where an earlier process compiled it)."""
    return programs.compiled(function, (_abstract(shape, dtype, device),), device)


@functools.cache
def bitcast_fn(dtype: np.dtype[Any]) -> Any:
    import jax

    return jax.jit(lambda x: jax.lax.bitcast_convert_type(x, dtype), donate_argnums=0)


def bitcast(buffer: jax.Array, dtype: np.dtype[Any]) -> jax.Array:
    """`buffer`'s unsigned integers as `dtype`, in place (donated)."""
    program = program_for(bitcast_fn(np.dtype(dtype)), buffer.shape, buffer.dtype, _device(buffer))
    result: jax.Array = program(buffer)
    return result


CHANGED: dict[tuple[str, str, np.dtype[Any]], tuple[tuple[int, int], ...]] = {}


def changed_patterns(device: jax.Device, dtype: np.dtype[Any]) -> tuple[tuple[int, int], ...]:
    """The bit patterns of `dtype` that `device` changes when it bitcasts unsigned
    integers to it, as inclusive ranges; measured once per device kind and dtype by
    sending every pattern there and back."""
    import jax

    key = (device.platform, device.device_kind, np.dtype(dtype))
    if key not in CHANGED:
        # (on the first device of its kind, whichever shard asks: one program for all)
        alike = [d for d in device.client.local_devices() if d.device_kind == device.device_kind]
        device = min(alike, key=lambda d: d.id, default=device)
        unsigned = written_dtype(np.dtype(dtype))
        patterns = np.arange(1 << (8 * unsigned.itemsize), dtype=unsigned)
        back = np.asarray(jax.device_get(bitcast(jax.device_put(patterns, device), dtype)))
        changed = np.flatnonzero(back.view(unsigned) != patterns)
        CHANGED[key] = runs(changed)
    return CHANGED[key]


def runs(values: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Sorted integers as inclusive runs of consecutive ones."""
    if not len(values):
        return ()
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate([values[:1], values[breaks + 1]])
    ends = np.concatenate([values[breaks], values[-1:]])
    return tuple((int(a), int(b)) for a, b in zip(starts, ends, strict=True))


@functools.cache
def holds_fn(changed: tuple[tuple[int, int], ...]) -> Any:
    import jax
    import jax.numpy as jnp

    table = None
    if len(changed) > 16:  # scattered patterns: look each integer up instead
        table = np.zeros(changed[-1][1] + 1, bool)
        for low, high in changed:
            table[low : high + 1] = True

    def holds(x: jax.Array) -> jax.Array:
        if table is not None:
            return jnp.any(jnp.take(jnp.asarray(table), x, mode="fill", fill_value=False))
        found = jnp.zeros(x.shape, bool)
        for low, high in changed:
            found = found | ((x >= low) & (x <= high))
        return jnp.any(found)

    return jax.jit(holds)


def holds_any(buffer: jax.Array, changed: tuple[tuple[int, int], ...]) -> bool:
    """Whether any of `buffer`'s integers falls in `changed` (on its device: integer
    comparisons, exact, one pass over its memory)."""
    program = program_for(holds_fn(changed), buffer.shape, buffer.dtype, _device(buffer))
    return bool(program(buffer))


def release_sent() -> None:
    """Let JAX drop the host arrays it sent to devices whose transfers are done.

    The runtime lets go of a sent array on a thread of its own, where it cannot drop a
    Python reference; JAX drops those in a callback of Python's garbage collector
    (jax-ml/jax#14882) and when a jitted program is next called. lazyckpt pauses the
    collector while it places a tree (`gc_paused`), and a shard sent whole calls no
    program: on a TPU host a sent array stayed referenced long after its transfer, so
    the memory it was sent from was not filled again (docs/benchmarks.md, section 29). This runs that
    callback alone: no collection, which would run other objects' finalizers on
    lazyckpt's threads. A JAX without it is left to its own time.
    """
    import gc

    for callback in gc.callbacks:
        if getattr(callback, "__name__", "") == "_xla_gc_callback":
            callback("stop", {"generation": 0, "collected": 0, "uncollectable": 0})
            return


class Shard:
    """One region of a placed array on its devices: a buffer on each, written block by
    block (as unsigned integers for floats narrower than 32 bits), or the one block
    that covers it."""

    def __init__(
        self,
        key: str,
        region: Box,
        devices: Sequence[jax.Device],
        dtype: np.dtype[Any],
        *,
        raw: bool = False,
        starts: Starts | None = None,
    ) -> None:
        self.key, self.region = key, region
        self.devices, self.dtype = list(devices), np.dtype(dtype)
        self.shape = box_shape(region)
        self.written = written_dtype(self.dtype)
        self.raw = raw
        """Whether the shard stays as it is written (unsigned integers for floats
        narrower than 32 bits, even where sent whole), for a caller that computes on
        its bits and makes it `dtype` itself (`lazyckpt._device.collective`)."""
        self.starts = starts if starts is not None else Starts()
        """Where pieces start, on the devices: shared by the shards of a placement."""
        self.copies = all_copy(self.devices)
        """Whether the devices copy what is sent out of host memory, which can then be
        used again once the transfer is done."""
        self.buffers: list[jax.Array] | None = None
        self.whole = False
        self.preparing: list[concurrent.futures.Future[None]] = []
        self._writing = threading.Lock()

    def prepare(
        self, compilers: concurrent.futures.Executor, pieces: Collection[tuple[int, ...]]
    ) -> None:
        """Start compiling (or loading, `programs`) the programs that make this shard's
        buffers and assemble it from pieces of the shapes `pieces` (others when they
        come). The buffers themselves are made by the first piece that is not the
        whole shard: a streamed shard may come whole, as one block."""
        self.preparing = [
            compilers.submit(empty_program, self.shape, self.device_dtype, device)
            for device in self.devices
        ]
        self.preparing += [
            compilers.submit(write_program, self.shape, piece, self.device_dtype, device)
            for piece in pieces
            for device in self.devices
        ]
        if self.written != self.dtype and not self.raw:
            self.preparing.append(compilers.submit(self._compile_finish))

    @property
    def device_dtype(self) -> np.dtype[Any]:
        """The dtype of the buffers on the devices while they are written."""
        return device_dtype(self.dtype)

    def _compile_finish(self) -> None:
        changed = changed_patterns(self.devices[0], self.dtype)
        if changed:
            holds = holds_fn(changed)
            program_for(holds, self.shape, self.device_dtype, self.devices[0])
        bitcast = bitcast_fn(self.dtype)
        for device in self.devices:
            program_for(bitcast, self.shape, self.device_dtype, device)

    def write(self, index: tuple[slice, ...], values: np.ndarray) -> list[jax.Array]:
        """Send `values` (`index` of this region) to every device and write them in;
        the arrays sent, for the caller to wait on."""
        import jax

        if values.shape == self.shape:  # the whole region in one block
            whole = values.view(self.written) if self.raw else values
            self.buffers = [
                jax.device_put(whole, device, may_alias=not self.copies) for device in self.devices
            ]
            self.whole = True
            return self.buffers
        sent = [
            jax.device_put(values.view(self.written), device, may_alias=not self.copies)
            for device in self.devices
        ]
        starts = tuple(s.indices(n)[0] for s, n in zip(index, self.shape, strict=True))
        with self._writing:  # (each write donates the buffer the one before made)
            if self.buffers is None:
                self.buffers = [
                    empty(self.shape, self.device_dtype, device) for device in self.devices
                ]
            self.buffers = [
                write(buffer, piece, starts, self.starts)
                for buffer, piece in zip(self.buffers, sent, strict=True)
            ]
        return sent

    def finished(self) -> list[jax.Array]:
        """The shard on each device, in its own dtype (as it is written where `raw`)."""
        for preparing in self.preparing:
            preparing.result()
        assert self.buffers is not None
        if self.whole or self.written == self.dtype or self.raw:
            return self.buffers
        return finish(self.key, self.buffers, self.dtype)


def finish(key: str, buffers: list[jax.Array], dtype: np.dtype[Any]) -> list[jax.Array]:
    """`buffers` (the same values on several devices, written as unsigned integers)
    made `dtype` in place; where the devices would change some of their bit patterns,
    brought back and sent whole from the host instead (exact, over the budget)."""
    import jax

    device = _device(buffers[0])
    changed = changed_patterns(device, dtype)
    if changed and holds_any(buffers[0], changed):
        size = human_bytes(buffers[0].size * np.dtype(dtype).itemsize)
        kind = device.device_kind
        warn(
            f"{key}: a shard of {size} went to {kind} whole from host memory, over "
            f"memory_budget: it holds {dtype} values that {kind} changes when it "
            "assembles a shard from pieces (NaN payloads or subnormals), and they must "
            "arrive bit for bit",
            OverBudgetWarning,
        )
        host = np.asarray(jax.device_get(buffers[0])).view(dtype)
        return [jax.device_put(host, _device(buffer)) for buffer in buffers]
    return [bitcast(buffer, dtype) for buffer in buffers]
