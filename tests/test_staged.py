"""Arrays bound for accelerators, placed in pieces within the host budget
(`lazyckpt._device.staged`). CI has no accelerator: these tests send CPU devices down the
same path (`PLATFORMS`), where the results stay in host memory, so memory is
measured as the peak above what the read returns."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import mmap
import os
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import lazyckpt
import lazyckpt._device.senders as sending
import lazyckpt._device.shard as on_device
import lazyckpt._device.staged as staged
from lazyckpt._device.platforms import PLATFORMS, Platform
from lazyckpt._engine import memory, raw
from tests.helpers import orbax_save, rss_probe

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _cpu_as_accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(PLATFORMS, "cpu", Platform(staged=True, adopts=True))
    yield


def _raw_values(rows: int = 1024, columns: int = 2048) -> dict[str, np.ndarray]:
    """Every bit pattern, NaN payloads and subnormals too, in bfloat16, float8 and int8;
    2 MiB each, over what is read in batches of small arrays."""
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, columns), dtype=np.uint8)
    return {
        "bf16": raw.view(ml_dtypes.bfloat16),
        "f8": raw.view(ml_dtypes.float8_e4m3fn),
        "i8": raw.view(np.int8),
    }


def _bits(array: Any) -> tuple[np.dtype[Any], bytes]:
    host = np.asarray(jax.device_get(array))
    return host.dtype, host.tobytes()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("staged")
    values = _raw_values()
    save_file(values, str(folder / "model.safetensors"))
    return {
        "orbax": orbax_save(folder / "orbax", values),
        "safetensors": folder / "model.safetensors",
        "chunked": Path(lazyckpt.save(folder / "chunked", values, chunk_bytes=256 << 10)),
    }


@pytest.mark.parametrize("kind", ["orbax", "safetensors", "chunked"])
@pytest.mark.parametrize("budget", [256 << 10, 3 * MiB, None], ids=["pieces", "rows", "whole"])
@pytest.mark.parametrize("spec", [P(), P("x"), P("x", "y"), P(None, "y")])
def test_values_arrive_bit_for_bit(
    files: dict[str, Path], kind: str, budget: int | None, spec: P
) -> None:
    """Shards placed whole, in rows read raw, and streamed block by block (a stored
    chunk larger than half the budget), replicated or not, equal the stored bytes."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = lazyckpt.device_put(
        lazyckpt.open(files[kind]), NamedSharding(mesh, spec), memory_budget=budget
    )
    for key, expected in _raw_values().items():
        assert placed[key].sharding.spec == spec
        assert _bits(placed[key]) == (expected.dtype, expected.tobytes()), key


def test_views_and_targets_take_the_same_path(files: dict[str, Path], tmp_path: Path) -> None:
    """Cast, transposed, sliced, gathered and dequantized views, and an abstract target's
    shardings, placed in pieces equal what `.get()` reads."""
    tree = lazyckpt.open(files["orbax"])
    device = SingleDeviceSharding(jax.devices()[1])
    views = {
        "cast": tree["bf16"].astype("float32"),
        "T": tree["i8"].T,
        "rows": tree["f8"][7:200:3],
        "picked": lazyckpt.take(tree["bf16"], np.array([5, 1, 250, 5]), axis=0),
    }
    codes = _raw_values()["i8"].view(np.uint8) % 0x70  # finite float8_e4m3fn codes
    scales = np.linspace(0.5, 2.0, 8 * 16, dtype=np.float32).reshape(8, 16)
    quantized = tmp_path / "fp8.safetensors"
    save_file({"w": codes.view(ml_dtypes.float8_e4m3fn), "w_scale_inv": scales}, str(quantized))
    dense = lazyckpt.open(quantized)
    views["dequantized"] = lazyckpt.dequantize_fp8(dense["w"], dense["w_scale_inv"])
    placed = lazyckpt.device_put(views, device, memory_budget=512 << 10)
    for key, view in views.items():
        assert placed[key].sharding == device
        assert _bits(placed[key]) == _bits(view.get()), key
    target = {
        key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=device)
        for key, value in _raw_values().items()
    }
    restored = lazyckpt.device_put(tree, target, memory_budget=512 << 10)
    for key, expected in _raw_values().items():
        assert _bits(restored[key]) == (expected.dtype, expected.tobytes())


def _held_after_reserves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """What the gate holds after each of its reservations, as they are made."""
    seen: list[int] = []
    reserve = staged._Gate.reserve

    def counted(gate: staged._Gate, nbytes: int) -> None:
        reserve(gate, nbytes)
        seen.append(gate.held)

    monkeypatch.setattr(staged._Gate, "reserve", counted)
    return seen


def test_the_pieces_in_flight_stay_within_half_the_budget(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host bytes of pieces filled and not yet sent, counted as they are let in."""
    seen = _held_after_reserves(monkeypatch)
    budget = 3 * MiB
    for kind in ("orbax", "safetensors"):
        seen.clear()
        lazyckpt.device_put(
            lazyckpt.open(files[kind]), SingleDeviceSharding(jax.devices()[0]), memory_budget=budget
        )
        assert len(seen) > 3 and max(seen) <= budget // 2, (kind, seen)


@pytest.mark.parametrize("budget", [64 * MiB, 4 * MiB], ids=["one-fill", "streamed"])
def test_a_chunk_shared_by_shards_is_read_once(
    tmp_path: Path,
    count_bytes: Callable[[], contextlib.AbstractContextManager[list[int]]],
    budget: int,
) -> None:
    """One stored chunk of 8 MiB placed over 8 devices: read once for all of its shards,
    in one fill where they fit half the budget together, streamed together where not."""
    values = np.random.default_rng(2).standard_normal((1024, 2048), np.float32)
    path = lazyckpt.save(tmp_path / "ckpt", {"w": values}, chunk_bytes=8 * MiB)
    tree = lazyckpt.open(path)
    with count_bytes() as whole:
        tree["w"].get()
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with count_bytes() as read:
        placed = lazyckpt.device_put(tree["w"], NamedSharding(mesh, P("x")), memory_budget=budget)
    assert 0.98 * whole[0] <= read[0] <= 1.02 * whole[0], (read, whole)  # (metadata aside)
    assert _bits(placed) == (values.dtype, values.tobytes())


def test_a_streamed_shard_that_comes_whole_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards streamed together (over half the budget in all) that each come as one
    block are those blocks, even where making a shard's buffer on the device is slow
    (half a second on a TPU): no buffer made beside the reads replaces them."""
    empty = on_device.empty

    def slow_empty(*args: Any) -> Any:
        time.sleep(0.2)
        return empty(*args)

    monkeypatch.setattr(on_device, "empty", slow_empty)
    written: list[bool] = []
    write = on_device.Shard.write

    def counted(shard: on_device.Shard, index: Any, values: np.ndarray) -> Any:
        written.append(values.shape == shard.shape)
        return write(shard, index, values)

    monkeypatch.setattr(on_device.Shard, "write", counted)
    values = np.random.default_rng(3).standard_normal((512, 1024), np.float32)
    tree = lazyckpt.open(lazyckpt.save(tmp_path / "ckpt", {"w": values}, chunk_bytes=256 << 10))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    view = tree["w"][:128]  # shards of 64 KiB, the smallest block a stream cuts
    placed = lazyckpt.device_put(view, NamedSharding(mesh, P("x")), memory_budget=256 << 10)
    assert written and all(written), written
    assert _bits(placed) == (values.dtype, values[:128].tobytes())


def test_raw_shards_that_fit_alone_but_not_together_are_filled_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw array over 8 devices whose shards each fit half the budget but not all
    together: what the gate holds stays within half the budget."""
    values = np.random.default_rng(4).standard_normal((2048, 2048), np.float32)  # 16 MiB
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    seen = _held_after_reserves(monkeypatch)
    budget = 6 * MiB
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    tree = lazyckpt.open(tmp_path / "model.safetensors")
    placed = lazyckpt.device_put(tree["w"], NamedSharding(mesh, P("x")), memory_budget=budget)
    assert len(seen) >= 8 and max(seen) <= budget // 2, seen
    assert _bits(placed) == (values.dtype, values.tobytes())


def test_rows_wider_than_a_piece_are_cut_along_the_next_dimension(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw array one of whose rows holds more than a piece: pieces stay within a
    quarter of half the budget, and the values arrive whole."""
    values = np.arange(4 * 128 * 2048, dtype=np.float32).reshape(4, 128, 2048)  # rows of 1 MiB
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    seen: list[int] = []
    reserve = staged._Gate.reserve

    def counted_reserve(gate: staged._Gate, nbytes: int) -> None:
        seen.append(nbytes)
        reserve(gate, nbytes)

    monkeypatch.setattr(staged._Gate, "reserve", counted_reserve)
    budget = 512 << 10
    tree = lazyckpt.open(tmp_path / "model.safetensors")
    placed = lazyckpt.device_put(
        tree["w"], SingleDeviceSharding(jax.devices()[0]), memory_budget=budget
    )
    assert len(seen) > 8 and max(seen) <= budget // 8, seen
    assert _bits(placed) == (values.dtype, values.tobytes())


def test_64_bit_values_without_x64_are_placed_as_jax_places_them(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """With jax's 64-bit types off, float64 and int64 arrive as float32 and int32, as
    `jax.device_put` makes them, with no warning."""
    values = {
        "f": np.linspace(0, 1, 1 << 18),
        "i": np.arange(1 << 18, dtype=np.int64),
    }
    save_file(values, str(tmp_path / "model.safetensors"))
    sharding = SingleDeviceSharding(jax.devices()[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placed = lazyckpt.device_put(
            lazyckpt.open(tmp_path / "model.safetensors"), sharding, memory_budget=256 << 10
        )
    for key, value in values.items():
        expected = jax.device_put(value, sharding)
        assert placed[key].dtype == expected.dtype
        assert np.array_equal(np.asarray(placed[key]), np.asarray(expected))


def _counting_maps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every memory map made from now on that maps no file (a buffer's)."""
    made: list[int] = []
    new_map = mmap.mmap

    def counted_map(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        if fileno == -1:
            made.append(length)
        return new_map(fileno, length, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", counted_map)
    return made


class _FileMap(mmap.mmap):
    """A map of a file that notes what `madvise` was asked, and refuses `refuse`'s
    option with its error number."""

    advised: list[int]
    refuse: tuple[int | None, int] = (None, 0)

    def madvise(self, option: int, *args: int) -> None:
        self.advised.append(option)
        if option == self.refuse[0]:
            raise OSError(self.refuse[1], os.strerror(self.refuse[1]))
        super().madvise(option, *args)


def _file_maps(monkeypatch: pytest.MonkeyPatch) -> list[_FileMap]:
    """Every map of a file made from now on."""
    maps: list[_FileMap] = []
    new_map = mmap.mmap

    def kept_map(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        if fileno == -1:
            return new_map(fileno, length, *args, **kwargs)
        made_map = _FileMap(fileno, length, *args, **kwargs)
        made_map.advised = []
        maps.append(made_map)
        return made_map

    monkeypatch.setattr(mmap, "mmap", kept_map)
    return maps


def _placed_exactly(tree: Any, values: dict[str, np.ndarray], budget: int) -> None:
    """`tree` placed on the first device within `budget`, each array equal to `values`'
    bit for bit."""
    placed = lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=budget)
    for key, expected in values.items():
        assert _bits(placed[key]) == (expected.dtype, expected.tobytes()), key


def _three_arrays_of_16_mib(folder: Path) -> tuple[dict[str, np.ndarray], Any]:
    """Three float32 arrays of 16 MiB in a safetensors file, and the file opened."""
    rng = np.random.default_rng(5)
    values = {f"w{k}": rng.standard_normal((4096, 1024), np.float32) for k in range(3)}
    save_file(values, str(folder / "model.safetensors"))
    return values, lazyckpt.open(folder / "model.safetensors")


def test_pieces_bound_for_copying_devices_reuse_their_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where devices copy what is sent (an accelerator's), pieces the engine fills (here
    cast to bfloat16 as they are read) go into the memory of earlier pieces whose
    transfers are done, so that few buffers are ever made; what pieces hold stays
    within half the budget, and what the pool keeps within the budget. (On CPU a
    piece sent whole stays the device's memory, so only pieces written into a shard's
    buffer can come back here.)"""
    monkeypatch.setitem(PLATFORMS, "cpu", Platform(staged=True, adopts=False))
    values, tree = _three_arrays_of_16_mib(tmp_path)
    made = _counting_maps(monkeypatch)
    seen: list[tuple[int, int]] = []
    take = staged._Gate.take

    def counted_take(
        gate: staged._Gate, shape: tuple[int, ...], dtype: Any
    ) -> tuple[np.ndarray, int]:
        taken = take(gate, shape, dtype)
        seen.append((gate.held, gate.pool.held))
        return taken

    monkeypatch.setattr(staged._Gate, "take", counted_take)
    budget = 8 * MiB  # (pieces of 1 MiB of bfloat16)
    views = {key: view.astype(ml_dtypes.bfloat16) for key, view in tree.items()}
    placed = lazyckpt.device_put(
        views, SingleDeviceSharding(jax.devices()[0]), memory_budget=budget
    )
    for key, expected in values.items():
        assert _bits(placed[key]) == _bits(expected.astype(ml_dtypes.bfloat16)), key
    assert len(seen) >= 12 and len(made) <= len(seen) // 3, (made, seen)
    assert max(held for held, _ in seen) <= budget // 2, seen
    # (and a piece whose write into the shard has yet to run: on CPU, what was sent is
    # the host memory itself until then)
    assert max(pooled for _, pooled in seen) <= budget // 2 + MiB, seen


@pytest.fixture
def copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU devices taken for devices that copy what is sent, and pieces of any size
    read and sent by threads of their own (`lazyckpt._device.senders`)."""
    monkeypatch.setitem(PLATFORMS, "cpu", Platform(staged=True, adopts=False))
    monkeypatch.setattr(sending, "SENT_ALONE", 0)


@pytest.fixture
def reading(copying: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`copying`, with every piece read into a buffer of the pool, none sent from a map
    of its file."""
    monkeypatch.setattr(sending, "SENT_FROM_MAPS", False)


def _sent_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many reads each `Senders.run` is given, from now on."""
    sent: list[int] = []
    run = sending.Senders.run

    def counted(senders: sending.Senders, reads: Any) -> None:
        sent.append(len(reads))
        run(senders, reads)

    monkeypatch.setattr(sending.Senders, "run", counted)
    return sent


@pytest.mark.usefixtures("copying")
@pytest.mark.parametrize("maps", [True, False], ids=["maps", "reads"])
@pytest.mark.parametrize("budget", [256 << 10, 3 * MiB, None], ids=["pieces", "rows", "whole"])
@pytest.mark.parametrize("spec", [P(), P("x"), P(None, "y")])
def test_raw_pieces_read_and_sent_by_threads_arrive_bit_for_bit(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, maps: bool, budget: int | None, spec: P
) -> None:
    """Bound for devices that copy, the pieces of arrays stored raw in a local file are
    sent by threads of their own, from maps of the file or read; several pieces of one
    shard written at once, and shards whose runs are too short for it (columns),
    arrive exactly."""
    monkeypatch.setattr(sending, "SENT_FROM_MAPS", maps)
    sent = _sent_reads(monkeypatch)
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = lazyckpt.device_put(
        lazyckpt.open(files["safetensors"]), NamedSharding(mesh, spec), memory_budget=budget
    )
    for key, expected in _raw_values().items():
        assert placed[key].sharding.spec == spec
        assert _bits(placed[key]) == (expected.dtype, expected.tobytes()), key
    assert bool(sent) == (spec != P(None, "y")), sent  # (rows of 2 KiB: too short alone)


@pytest.mark.usefixtures("copying")
def test_views_read_and_sent_by_threads_equal_what_get_reads(files: dict[str, Path]) -> None:
    """Sliced views, new axes, picked indices and views empty along a new axis (whose
    stored box is not empty) equal `.get()`."""
    w = lazyckpt.open(files["safetensors"])["bf16"]
    views = {
        "rows": w[3:700],
        "new axes": w[None, 2:62, :, None],
        "picked": w[5, None],
        "empty on a new axis": w[None][0:0],
        "empty inside": w[:, None][:, 0:0],
    }
    placed = lazyckpt.device_put(
        views, SingleDeviceSharding(jax.devices()[0]), memory_budget=256 << 10
    )
    for key, view in views.items():
        assert placed[key].shape == view.shape, key
        assert _bits(placed[key]) == _bits(view.get()), key


def test_only_large_pieces_are_read_and_sent_by_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces of `SENT_ALONE` bytes or more go to the sending threads; smaller ones
    through the engine, which keeps more of them in flight."""
    monkeypatch.setitem(PLATFORMS, "cpu", Platform(staged=True, adopts=False))
    sent = _sent_reads(monkeypatch)
    values = {
        "large": np.arange(sending.SENT_ALONE // 4, dtype=np.float32).reshape(-1, 1024),
        "small": np.arange(1 << 19, dtype=np.float32).reshape(-1, 1024),  # 2 MiB
    }
    save_file(values, str(tmp_path / "model.safetensors"))
    placed = lazyckpt.device_put(
        lazyckpt.open(tmp_path / "model.safetensors"),
        SingleDeviceSharding(jax.devices()[0]),
        memory_budget=64 * MiB,
    )
    assert sent == [1], sent
    for key, expected in values.items():
        assert _bits(placed[key]) == (expected.dtype, expected.tobytes()), key


@pytest.mark.usefixtures("reading")
def test_raw_pieces_sent_by_threads_stay_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pieces the sending threads hold, from their read to the end of their
    transfer, stay within half the budget as they are let in (and with what buffers
    used again hold besides, within the budget), in buffers used again."""
    values, tree = _three_arrays_of_16_mib(tmp_path)
    made = _counting_maps(monkeypatch)
    let_in: list[int] = []
    held: list[int] = []
    hold, grow = sending.Senders.hold, sending.Senders.grow

    def counted_hold(senders: sending.Senders, nbytes: int) -> bool:
        taken = hold(senders, nbytes)
        let_in.append(senders.held)
        return taken

    def counted_grow(senders: sending.Senders, nbytes: int) -> None:
        grow(senders, nbytes)
        held.append(senders.held)

    monkeypatch.setattr(sending.Senders, "hold", counted_hold)
    monkeypatch.setattr(sending.Senders, "grow", counted_grow)
    budget = 8 * MiB  # (pieces of 1 MiB)
    _placed_exactly(tree, values, budget)
    assert len(let_in) == 48 and max(let_in) <= budget // 2, let_in
    assert max(held) <= budget, held
    assert len(made) <= len(let_in) // 4, made  # (on CPU, pending writes keep a few)


@pytest.mark.usefixtures("reading")
def test_buffers_come_back_once_jax_lets_go_of_what_it_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on an accelerator's host, where JAX keeps a host array it sent until its
    garbage-collector callback runs (and `device_put` pauses the collector): the
    placement runs that callback before it makes new memory, with no collection, and
    fills the same buffer again."""
    from jax._src import lib  # (what JAX's callback calls; kept here until it runs)

    runtime = lib._jax  # type: ignore[attr-defined]
    kept: list[np.ndarray] = []
    put, collect_garbage = jax.device_put, runtime.collect_garbage

    def copying_put(x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, np.ndarray):
            kept.append(x)
            x = x.copy()
        return put(x, *args, **kwargs)

    def collected() -> None:
        kept.clear()
        collect_garbage()

    collections: list[int] = []
    monkeypatch.setattr(jax, "device_put", copying_put)
    monkeypatch.setattr(runtime, "collect_garbage", collected)
    monkeypatch.setattr(gc, "collect", lambda generation=2: collections.append(generation))
    values, tree = _three_arrays_of_16_mib(tmp_path)
    made = _counting_maps(monkeypatch)
    _placed_exactly(tree, values, 32 * MiB)
    assert made == [16 * MiB] and not collections, (made, collections)


@pytest.mark.usefixtures("copying")
def test_pieces_of_one_run_are_sent_from_maps_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole tensor (one run of the file's bytes) is sent from a map of the file's
    pages: no buffer is made or read into, its bytes are counted as read, the pieces
    held stay within half the budget, and each map is let go once its transfer is
    done."""
    from lazyckpt._storage import metrics

    values, tree = _three_arrays_of_16_mib(tmp_path)
    made = _counting_maps(monkeypatch)
    maps = _file_maps(monkeypatch)
    held: list[int] = []
    hold = sending.Senders.hold

    def counted_hold(senders: sending.Senders, nbytes: int) -> bool:
        taken = hold(senders, nbytes)
        held.append(senders.held)
        return taken

    monkeypatch.setattr(sending.Senders, "hold", counted_hold)
    before = metrics.direct_bytes_read()
    _placed_exactly(tree, values, 64 * MiB)
    assert metrics.direct_bytes_read() - before == 48 * MiB
    assert made == [] and len(maps) == 3, (made, maps)
    assert len(held) == 3 and max(held) <= 32 * MiB, held
    assert all(m.closed for m in maps), maps


@pytest.mark.usefixtures("copying")
def test_bands_of_rows_are_sent_from_maps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard larger than half the budget, cut into bands of rows: each band is one
    run of the file, sent from a map, and written into the shard on the device."""
    values, tree = _three_arrays_of_16_mib(tmp_path)
    maps = _file_maps(monkeypatch)
    _placed_exactly(tree, values, 8 * MiB)
    assert len(maps) == 3 * 16 and all(m.closed for m in maps), len(maps)


@pytest.mark.usefixtures("copying")
def test_maps_jax_still_refers_to_are_let_go_later_and_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on an accelerator's host, where JAX keeps a host array it sent until its
    callback runs: a map still referred to once its transfer is done has its pages
    dropped and is kept, to be unmapped at a later turn; past `KEPT_MAPS` of them,
    pieces are read into buffers instead (each kept map holds a file descriptor)."""
    kept: list[np.ndarray] = []
    put = jax.device_put

    def keeping_put(x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, np.ndarray):
            kept.append(x)
        return put(x, *args, **kwargs)

    values, tree = _three_arrays_of_16_mib(tmp_path)
    made = _counting_maps(monkeypatch)
    maps = _file_maps(monkeypatch)
    monkeypatch.setattr(jax, "device_put", keeping_put)
    monkeypatch.setattr(sending, "release_sent", lambda: None)
    monkeypatch.setattr(sending, "KEPT_MAPS", 2)
    _placed_exactly(tree, values, 64 * MiB)
    assert len(maps) == 2 and not any(m.closed for m in maps), maps
    assert all(m.advised[-1] == mmap.MADV_DONTNEED for m in maps), [m.advised for m in maps]
    assert made == [16 * MiB], made  # (the third piece, read)
    kept.clear()
    gc.collect()  # (JAX's reference gone: the kept maps go with their arrays)


@pytest.mark.usefixtures("copying")
def test_a_failure_letting_a_map_go_is_raised_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error after a piece's transfer, while its map is let go, still lets its bytes
    go: the placement raises it, where it had waited forever for room."""
    _, tree = _three_arrays_of_16_mib(tmp_path)

    def failing() -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(sending, "release_sent", failing)
    raised: list[BaseException] = []

    def place() -> None:
        try:
            lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=8 * MiB)
        except BaseException as error:  # noqa: BLE001 - looked at below
            raised.append(error)

    thread = threading.Thread(target=place, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the placement waited forever"
    assert len(raised) == 1 and isinstance(raised[0], OSError), raised


@pytest.mark.usefixtures("copying")
def test_pieces_not_aligned_to_their_items_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A safetensors file whose data starts at an odd offset (the format does not make
    its writer pad the header): its pieces are read, not mapped, and arrive exactly."""
    values = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    entry = {"dtype": "F32", "shape": list(values.shape), "data_offsets": [0, values.nbytes]}
    header = json.dumps({"w": entry}).encode()
    header += b" " * ((8 - (8 + len(header)) % 8) % 8 + 3)  # the data at 3 mod 8
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + values.tobytes())
    maps = _file_maps(monkeypatch)
    placed = lazyckpt.device_put(
        lazyckpt.open(path), SingleDeviceSharding(jax.devices()[0]), memory_budget=64 * MiB
    )
    assert _bits(placed["w"]) == (values.dtype, values.tobytes())
    assert maps == [], maps


@pytest.mark.usefixtures("copying")
@pytest.mark.parametrize(
    ("refused", "read"),
    [("mmap", True), ("populate with EIO", True), ("populate with EINVAL", False)],
)
def test_a_file_that_cannot_be_mapped_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str, read: bool
) -> None:
    """Where the file system refuses to map the file (some FUSE and network ones), or
    its pages cannot be had at once (a failing disk), its pieces are read into buffers
    instead; where mapping them in at once is not known (an older kernel, gVisor), they
    are mapped all the same, and asked for ahead."""
    values, tree = _three_arrays_of_16_mib(tmp_path)
    made = _counting_maps(monkeypatch)
    maps = _file_maps(monkeypatch)
    counted = mmap.mmap
    errors = {"populate with EIO": errno.EIO, "populate with EINVAL": errno.EINVAL}

    def refusing(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        if fileno != -1 and refused == "mmap":
            raise OSError(errno.ENODEV, "No such device")
        made_map = counted(fileno, length, *args, **kwargs)
        if isinstance(made_map, _FileMap) and refused in errors:
            made_map.refuse = (raw._POPULATE_READ, errors[refused])
        return made_map

    monkeypatch.setattr(mmap, "mmap", refusing)
    _placed_exactly(tree, values, 64 * MiB)
    assert bool(made) == read and all(length == 16 * MiB for length in made), made
    if refused == "populate with EINVAL":
        advised = [m.advised[:2] for m in maps]
        assert len(maps) == 3 and all(
            a == [raw._POPULATE_READ, mmap.MADV_WILLNEED] for a in advised
        ), advised


@pytest.mark.usefixtures("copying")
@pytest.mark.parametrize("maps", [True, False], ids=["maps", "reads"])
def test_the_first_failure_of_a_sending_thread_stops_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, maps: bool
) -> None:
    """One read (or map) failing: the other threads take no further piece, and that
    failure is the one raised."""
    values = {f"w{k}": np.full((512, 1024), k, np.float32) for k in range(40)}  # 2 MiB
    save_file(values, str(tmp_path / "model.safetensors"))
    tree = lazyckpt.open(tmp_path / "model.safetensors")
    calls: list[int] = []
    lock = threading.Lock()
    name = "mapped" if maps else "read_parts"
    read = getattr(sending, name)

    def failing(*args: Any) -> Any:
        with lock:
            calls.append(len(calls))
            first = len(calls) == 2
        if first:
            raise lazyckpt.CorruptCheckpointError("the second read")
        time.sleep(0.01)
        return read(*args)

    monkeypatch.setattr(sending, "SENT_FROM_MAPS", maps)
    monkeypatch.setattr(sending, name, failing)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"^the second read$"):
        lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=64 * MiB)
    assert len(calls) <= 2 + 2 * sending._SENDERS, calls


def _parts_of_a_32_mib_piece(folder: Path) -> tuple[np.ndarray, Any]:
    values = np.arange(8 * MiB, dtype=np.float32).reshape(-1, 1024)  # 32 MiB, one piece
    save_file({"w": values}, str(folder / "model.safetensors"))
    return values, lazyckpt.open(folder / "model.safetensors")


@pytest.mark.usefixtures("reading")
def test_a_large_piece_is_read_in_parts_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece of several `READ_PART`s is read in parts by the reading threads, all at
    once: each part waits until every other has started."""
    values, tree = _parts_of_a_32_mib_piece(tmp_path)
    parts = 32 * MiB // sending.READ_PART
    together = threading.Barrier(parts, timeout=60)
    seen: list[tuple[str, int]] = []
    read_parts = raw.read_parts

    def read_together(file: str, stored: Any, job: list[raw.Part], buffer: Any) -> None:
        seen.append((threading.current_thread().name, sum(length for _, _, length in job)))
        together.wait()  # (broken, and raised, where the parts are read one by one)
        read_parts(file, stored, job, buffer)

    monkeypatch.setattr(sending, "read_parts", read_together)
    placed = lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=None)
    assert _bits(placed["w"]) == (values.dtype, values.tobytes())
    assert sorted(length for _, length in seen) == [sending.READ_PART] * parts, seen
    assert all(name.startswith("lazyckpt-read") for name, _ in seen), seen


@pytest.mark.usefixtures("reading")
def test_a_failed_part_is_raised_once_every_part_is_done_with_the_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first part failing: the piece's other parts, still writing into its buffer,
    finish before its bytes are let go and the error is raised."""
    _, tree = _parts_of_a_32_mib_piece(tmp_path)
    finished: list[int] = []
    at_release: list[int] = []
    read_parts = raw.read_parts
    release = sending.Senders.release

    def first_fails(file: str, stored: Any, job: list[raw.Part], buffer: Any) -> None:
        if job[0][1] == 0:
            raise lazyckpt.CorruptCheckpointError("the first part")
        time.sleep(0.2)
        read_parts(file, stored, job, buffer)
        finished.append(job[0][1])

    def released(senders: sending.Senders, nbytes: int) -> None:
        at_release.append(len(finished))
        release(senders, nbytes)

    monkeypatch.setattr(sending, "read_parts", first_fails)
    monkeypatch.setattr(sending.Senders, "release", released)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"^the first part$"):
        lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=None)
    assert at_release == [32 * MiB // sending.READ_PART - 1], at_release


@pytest.mark.usefixtures("copying")
def test_pieces_of_many_runs_are_read_in_parts_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh: jax.sharding.Mesh
) -> None:
    """Column shards: each piece is many runs of 128 KiB, which parts cut and group."""
    values = np.random.default_rng(0).random((64, 65536), dtype=np.float32)  # 16 MiB
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    sent = _sent_reads(monkeypatch)
    monkeypatch.setattr(sending, "READ_PART", 300 << 10)
    tree = lazyckpt.open(tmp_path / "model.safetensors")
    placed = lazyckpt.device_put(tree, NamedSharding(mesh, P(None, "y")), memory_budget="8MiB")
    assert sent, sent
    assert _bits(placed["w"]) == (values.dtype, values.tobytes())


@pytest.mark.usefixtures("copying")
def test_a_file_truncated_under_the_sending_threads_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file cut short after it was opened: the threads stop, and the error says the
    checkpoint changed, as any read's does."""
    values = {f"w{k}": np.full((512, 1024), k, np.float32) for k in range(8)}  # 2 MiB
    path = tmp_path / "model.safetensors"
    save_file(values, str(path))
    tree = lazyckpt.open(path)
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)
    sent = _sent_reads(monkeypatch)
    with pytest.raises(lazyckpt.LazyckptError, match="changed since it was opened"):
        lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=8 * MiB)
    assert sent == [8], sent


@pytest.mark.parametrize("copies", [False, True], ids=["engine", "threads"])
def test_the_progress_bar_ends_at_its_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, copies: bool
) -> None:
    """Bands of one shape (the last overlaps the one before, its rows read twice): the
    bar stops at the bytes placed, not past them."""
    pytest.importorskip("tqdm")
    from lazyckpt._engine import progress

    if copies:
        request.getfixturevalue("copying")
    values = np.random.default_rng(7).standard_normal((1000, 1024), np.float32)  # 4 MiB
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    ended: list[tuple[int, int]] = []
    close = progress.Progress.close

    def closed(bar: progress.Progress) -> None:
        assert bar._bar is not None
        ended.append((bar._bar.n, bar._total))
        close(bar)

    monkeypatch.setattr(progress.Progress, "close", closed)
    placed = lazyckpt.device_put(
        lazyckpt.open(tmp_path / "model.safetensors"),
        SingleDeviceSharding(jax.devices()[0]),
        memory_budget=2 * MiB,
        progress=True,
    )
    assert _bits(placed["w"]) == (values.dtype, values.tobytes())
    assert ended == [(values.nbytes, values.nbytes)], ended


@pytest.mark.parametrize("present", [True, False])
def test_a_device_that_changes_bit_patterns_gets_the_shard_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, present: bool
) -> None:
    """Where the device would change some bfloat16 patterns (a TPU flushes subnormals),
    a shard holding one is sent whole from the host, exact, with a warning; one
    holding none is bitcast in place."""
    device = jax.devices()[0]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    values = _raw_values()["bf16"].view(np.uint16).copy()
    pattern = 0x0001  # bfloat16's smallest subnormal
    if not present:
        values[values == pattern] = 0
    monkeypatch.setitem(
        on_device.CHANGED, (device.platform, device.device_kind, bf16), ((pattern, pattern),)
    )
    tree = lazyckpt.open(orbax_save(tmp_path / "ckpt", {"w": values.view(bf16)}))
    sharding = SingleDeviceSharding(device)
    if present:
        with pytest.warns(
            lazyckpt.OverBudgetWarning, match=r"^w: a shard of 2.0 MiB went to cpu whole from host"
        ):
            placed = lazyckpt.device_put(tree["w"], sharding, memory_budget=256 << 10)
    else:
        placed = lazyckpt.device_put(tree["w"], sharding, memory_budget=256 << 10)
    assert _bits(placed) == (bf16, values.tobytes())


def test_changed_patterns_are_measured_as_ranges() -> None:
    assert on_device.runs(np.array([1, 2, 3, 7, 9, 10])) == ((1, 3), (7, 7), (9, 10))
    assert on_device.runs(np.array([], np.int64)) == ()
    device = jax.devices()[0]
    assert on_device.changed_patterns(device, np.dtype(ml_dtypes.bfloat16)) == ()  # CPU: none


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["orbax", "safetensors"])
def test_a_shard_larger_than_the_budget_stays_near_it(tmp_path: Path, kind: str) -> None:
    """One 256 MiB array, a single stored chunk, placed with a 32 MiB budget: the
    process grows by what it returns and at most 1.25 times the budget besides."""
    rows = np.random.default_rng(1).standard_normal((1, 8192), np.float32)
    values = {"w": np.repeat(rows, 8192, axis=0)}  # 256 MiB
    if kind == "orbax":
        path = orbax_save(tmp_path / "orbax", values)
    else:
        path = tmp_path / "model.safetensors"
        save_file(values, str(path))
    del values
    budget = 32 * MiB
    found = rss_probe(path, "staged", budget)
    assert found["kept"] == 256 * MiB
    assert found["peak"] - found["kept"] <= 1.25 * budget, found


@pytest.mark.slow
def test_many_large_chunks_streamed_at_once_stay_near_the_budget(tmp_path: Path) -> None:
    """Eight arrays of 16 MiB, one zstd chunk each, placed with a 32 MiB budget: their
    chunks stream at once, blocks taken as they are ready, and the process grows by
    what it returns and at most 1.25 times the budget besides."""
    rng = np.random.default_rng(2)
    values = {f"w{i}": rng.standard_normal((1024, 4096), np.float32) for i in range(8)}
    path = orbax_save(tmp_path / "orbax", values)
    del values
    budget = 32 * MiB
    found = rss_probe(path, "staged", budget)
    assert found["kept"] == 128 * MiB
    assert found["peak"] - found["kept"] <= 1.25 * budget, found


class _Transfer:
    """A transfer that is done once said so, or once waited for."""

    def __init__(self) -> None:
        self.done = False

    def is_ready(self) -> bool:
        return self.done

    def block_until_ready(self) -> _Transfer:
        self.done = True
        return self


def test_a_piece_in_flight_keeps_its_memory_until_its_transfer_is_done() -> None:
    """Whatever the runtime holds during a transfer, the gate keeps what it sent until
    the transfer is done: only then may a later piece be filled into it, and then
    without the gate waiting for anything."""
    from lazyckpt._engine.scheduler import Scheduler

    gate = staged._Gate(64 * MiB, Scheduler(64 * MiB), memory.BufferPool(64 * MiB))
    first, second = _Transfer(), _Transfer()
    values, held = gate.take((4 * MiB,), np.dtype(np.uint8))
    address = values.ctypes.data
    gate.sent(held, [cast(Any, first)], values)
    del values
    values, held = gate.take((4 * MiB,), np.dtype(np.uint8))
    assert values.ctypes.data != address  # (the first is in flight)
    gate.sent(held, [cast(Any, second)], values)
    del values
    first.done = True
    values, _ = gate.take((4 * MiB,), np.dtype(np.uint8))
    assert values.ctypes.data == address and gate.pool.held == 8 * MiB  # nothing new
    assert not second.done and gate.held == 8 * MiB  # (the second: not waited for)


class _Unready:
    """A transfer of a runtime whose arrays cannot say whether they are ready."""

    def block_until_ready(self) -> _Unready:
        return self


def test_a_gate_whose_transfers_cannot_say_keeps_their_pieces_until_it_waits() -> None:
    from lazyckpt._engine.scheduler import Scheduler

    gate = staged._Gate(64 * MiB, Scheduler(64 * MiB), memory.BufferPool(64 * MiB))
    values, held = gate.take((4 * MiB,), np.dtype(np.uint8))
    address = values.ctypes.data
    gate.sent(held, [cast(Any, _Unready())], values)
    del values
    values, _ = gate.take((4 * MiB,), np.dtype(np.uint8))
    assert values.ctypes.data != address and gate.held == 8 * MiB


@pytest.mark.usefixtures("copying")
def test_the_starts_of_pieces_go_to_each_device_once_a_placement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four streamed arrays cut alike on one device: each piece's starts are sent to
    the device once for all four arrays, not once for each piece written."""
    values = {
        f"w{i}": np.random.default_rng(i).standard_normal((512, 1024), np.float32) for i in range(4)
    }
    path = orbax_save(tmp_path / "ckpt", values)
    written, starts_sent = [], []
    write, put = on_device.write, jax.device_put

    def counted_write(*args: Any) -> Any:
        written.append(args[2])
        return write(*args)

    def counted_put(x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, list) and all(isinstance(s, np.int32) for s in x):
            starts_sent.append(tuple(int(s) for s in x))
        return put(x, *args, **kwargs)

    monkeypatch.setattr(on_device, "write", counted_write)
    monkeypatch.setattr(jax, "device_put", counted_put)
    sharding = SingleDeviceSharding(jax.devices()[0])
    placed = lazyckpt.device_put(lazyckpt.open(path), sharding, memory_budget=2 * MiB)
    for key, array in values.items():
        assert _bits(placed[key]) == (array.dtype, array.tobytes())
    assert len(written) == 4 * len(set(written)) > 4  # (every array cut into pieces alike)
    assert sorted(starts_sent) == sorted(set(written))
