"""Programs that assemble a shard on an accelerator from pieces sent by the host
(`lazyckpt._staged`): its buffer made on the device, pieces written into it in place,
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

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from lazyckpt import _programs as programs
from lazyckpt._array.dtypes import finfo, issubdtype

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
    """The program behind `empty` for this shape, dtype and device (`_programs`:
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
        return jax.lax.dynamic_update_slice(buffer, piece, starts)

    return jax.jit(write, donate_argnums=0)


def write_program(
    shape: tuple[int, ...], piece: tuple[int, ...], dtype: np.dtype[Any], device: jax.Device
) -> Any:
    """The program behind `write` for a buffer of `shape` and pieces of shape `piece`;
    starts are traced, so one program serves every position of a piece."""
    import jax

    starts = tuple(jax.ShapeDtypeStruct((), np.int32) for _ in shape)
    buffer, part = _abstract(shape, dtype, device), _abstract(piece, dtype, device)
    return programs.compiled(_write_fn(), (buffer, part, starts), device)


def write(buffer: jax.Array, piece: jax.Array, starts: tuple[int, ...]) -> jax.Array:
    """`buffer` with `piece` at `starts`, in place (the buffer is donated)."""
    program = write_program(buffer.shape, piece.shape, buffer.dtype, _device(buffer))
    result: jax.Array = program(buffer, piece, tuple(np.int32(s) for s in starts))
    return result


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
        CHANGED[key] = ranges(changed)
    return CHANGED[key]


def ranges(values: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Sorted integers as inclusive ranges of consecutive ones."""
    if not len(values):
        return ()
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate([values[:1], values[breaks + 1]])
    ends = np.concatenate([values[breaks], values[-1:]])
    return tuple((int(a), int(b)) for a, b in zip(starts, ends, strict=True))


@functools.cache
def holds_fn(ranges: tuple[tuple[int, int], ...]) -> Any:
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


def holds_any(buffer: jax.Array, ranges: tuple[tuple[int, int], ...]) -> bool:
    """Whether any of `buffer`'s integers falls in `ranges` (on its device: integer
    comparisons, exact, one pass over its memory)."""
    program = program_for(holds_fn(ranges), buffer.shape, buffer.dtype, _device(buffer))
    return bool(program(buffer))
