"""The read engine: each stored chunk read once, memory within the budget, in-place fills."""

from __future__ import annotations

import mmap
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt._array.geometry import chunk_blocks
from lazyckpt._engine import memory
from lazyckpt._engine.stored import StoredArray
from tests.helpers import LAYOUTS, orbax_save, rss_probe, stored_chunk_bytes


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory, mesh: Any) -> tuple[Path, np.ndarray]:
    """A 4 MiB array stored in chunks of at most 64 KiB, saved by orbax."""
    value = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    sharded = jax.device_put(value, NamedSharding(jax.make_mesh((8,), ("d",)), P("d", None)))
    import orbax.checkpoint as ocp

    path = tmp_path_factory.mktemp("big") / "ckpt"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as checkpointer:
        checkpointer.save(
            path,
            args=ocp.args.PyTreeSave(
                {"w": sharded}, save_args={"w": ocp.SaveArgs(chunk_byte_size=64 << 10)}
            ),
        )
    return path, value


@pytest.mark.parametrize(
    "spec", [P("d"), P(None, "d"), P("d", None)], ids=["rows8", "columns8", "rows8b"]
)
def test_misaligned_shardings_read_each_chunk_once(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any, spec: P
) -> None:
    """Stored kernel chunks are (16, 64); 8-way shards cut through them."""
    path, tree = saved
    kernel = lazyckpt.open(path)["params"]["dense"]["kernel"]
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), spec)
    with count_bytes() as read:
        placed = lazyckpt.device_put(kernel, sharding)
    needed = stored_chunk_bytes(path, kernel)
    assert read[0] <= 1.05 * needed
    want = np.asarray(tree["params"]["dense"]["kernel"])
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_misaligned_view_with_cast(saved: tuple[Path, dict[str, Any]], count_bytes: Any) -> None:
    path, tree = saved
    kernel = lazyckpt.open(path)["params"]["dense"]["kernel"]
    view = kernel[5:61, 3:]
    sharding = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("b", None))
    target = jax.ShapeDtypeStruct((56, 125), jnp.bfloat16, sharding=sharding)
    with count_bytes() as read:
        placed = lazyckpt.device_put(view, target)
    assert read[0] <= 1.05 * stored_chunk_bytes(path, view)
    want = np.asarray(tree["params"]["dense"]["kernel"])[5:61, 3:].astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(placed), want)


def test_array_larger_than_the_budget(big: tuple[Path, np.ndarray], count_bytes: Any) -> None:
    path, value = big
    w = lazyckpt.open(path)["w"]
    assert np.prod(w.chunks) * 4 <= 64 << 10 and w.nbytes == 4 << 20
    with count_bytes() as read:
        loaded = lazyckpt.load(w, memory_budget=256 << 10)
    np.testing.assert_array_equal(loaded, value)
    assert read[0] == stored_chunk_bytes(path, w)  # every chunk once
    placed = lazyckpt.device_put(
        w, NamedSharding(jax.make_mesh((8,), ("d",)), P(None, "d")), memory_budget=256 << 10
    )
    np.testing.assert_array_equal(np.asarray(placed), value)


def test_blocks_follow_chunks_and_the_budget() -> None:
    box = ((0, 1000), (0, 1000))
    blocks = list(chunk_blocks(box, (128, 128), 4, 256 << 10))
    assert all(
        (high - low) * 4 * (b[1][1] - b[1][0]) <= 256 << 10 for b in blocks for low, high in [b[0]]
    )
    covered = np.zeros((1000, 1000), np.int8)
    for (r0, r1), (c0, c1) in blocks:
        assert r0 % 128 == 0 and c0 % 128 == 0
        covered[r0:r1, c0:c1] += 1
    assert (covered == 1).all()
    # A chunk larger than the budget is still one block.
    assert list(chunk_blocks(((0, 10),), (10,), 8, 16)) == [((0, 10),)]


def test_iter_blocks_streams_views_within_the_budget(big: tuple[Path, np.ndarray]) -> None:
    path, value = big
    w = lazyckpt.open(path)["w"]
    budget = 512 << 10
    views = {
        "whole": (w, value),
        "slice": (w[100:900, 64:], value[100:900, 64:]),
        "row": (w[7], value[7]),
        "newaxis_cast": (
            w[None, :300, ::1].astype(np.float16),
            value[None, :300].astype(np.float16),
        ),
        "strided": (w[::3, ::-5], value[::3, ::-5]),
    }
    for _ in lazyckpt.iter_blocks({"v": w}, memory_budget=budget):
        pass  # (the engine's threads and reusable buffers made first, outside the trace)
    for name, (view, want) in views.items():
        got = np.zeros(want.shape, want.dtype)
        hits = np.zeros(want.shape, np.int8)
        tracemalloc.start()
        for key, index, block in lazyckpt.iter_blocks({"v": view}, memory_budget=budget):
            assert key == "v" and block.dtype == want.dtype, name  # its path in the tree
            got[index] = block
            hits[index] += 1
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert (hits == 1).all(), name
        assert peak < 2 * budget + (64 << 10), (name, peak)


@pytest.mark.parametrize("writer", ["numpy", "safetensors"])
def test_strided_views_of_raw_bytes_stream_within_the_budget(tmp_path: Path, writer: str) -> None:
    """A strided view of a tensor stored as raw bytes is read in bands of the view (it
    had been read whole, whatever the budget): `w[:, ::2]` splits a fused gate/up
    projection."""
    value = np.random.default_rng(1).standard_normal((2048, 2048), dtype=np.float32)  # 16 MiB
    if writer == "numpy":
        path = tmp_path / "w.npy"
        np.save(path, value)
    else:
        from safetensors.numpy import save_file

        path = tmp_path / "model.safetensors"
        save_file({"w": value}, str(path))
    w = lazyckpt.open(path)["w"]
    budget = 4 << 20
    for index in (np.s_[::2], np.s_[:, ::2], np.s_[::3, ::-5]):
        want = value[index]
        got = np.zeros(want.shape, want.dtype)
        hits = np.zeros(want.shape, np.int8)
        tracemalloc.start()
        for _, at, block in lazyckpt.iter_blocks({"v": w[index]}, memory_budget=budget):
            got[at] = block
            hits[at] += 1
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        np.testing.assert_array_equal(got, want, err_msg=str(index))
        assert (hits == 1).all(), index
        assert peak < 2 * budget, (index, peak)


def test_streaming_statistics_match_numpy(big: tuple[Path, np.ndarray]) -> None:
    path, value = big
    total, squares, count = 0.0, 0.0, 0
    for _, _, block in lazyckpt.iter_blocks(lazyckpt.open(path), memory_budget=1 << 20):
        total += float(block.astype(np.float64).sum())
        squares += float((block.astype(np.float64) ** 2).sum())
        count += block.size
    mean = total / count
    assert count == value.size
    assert mean == pytest.approx(value.astype(np.float64).mean(), rel=1e-9, abs=1e-12)
    assert squares / count - mean**2 == pytest.approx(value.astype(np.float64).var(), rel=1e-9)


def test_load_peak_memory_is_the_output_plus_the_budget(big: tuple[Path, np.ndarray]) -> None:
    path, value = big
    w = lazyckpt.open(path)["w"]
    tracemalloc.start()
    loaded = lazyckpt.load(w.astype(np.float64), memory_budget=256 << 10)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    np.testing.assert_array_equal(loaded, value.astype(np.float64))
    # The float64 output (8 MiB) plus blocks in flight; a whole-array temporary would
    # add 4 MiB more.
    assert peak < loaded.nbytes + 2 * (256 << 10) + (64 << 10)


def test_device_put_adopts_aligned_buffers_on_cpu(big: tuple[Path, np.ndarray]) -> None:
    path, value = big
    mesh = jax.make_mesh((8,), ("d",))
    placed = lazyckpt.device_put(lazyckpt.open(path)["w"], NamedSharding(mesh, P("d")))
    for shard in placed.addressable_shards:
        assert shard.data.unsafe_buffer_pointer() % 64 == 0
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_progress_bar(saved: tuple[Path, Any], capsys: Any) -> None:
    lazy = lazyckpt.open(saved[0])
    lazyckpt.load(lazy, progress=True)
    err = capsys.readouterr().err  # (tqdm's line: not a terminal, so no widget)
    assert err.startswith("\rlazyckpt load: ") and "lazyckpt load: 100%|" in err
    assert err.endswith("\n")
    lazyckpt.load(lazy, progress=False)
    assert capsys.readouterr().err == ""


def test_progress_auto_is_off_in_ci_and_for_small_reads(
    saved: tuple[Path, Any], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lazyckpt._engine import progress

    lazy = lazyckpt.open(saved[0])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(progress, "AUTO_MIN_BYTES", 0)
    lazyckpt.load(lazy)  # a terminal, but a CI log: no bar
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("CI")
    lazyckpt.load(lazy)
    assert "lazyckpt load: 100%|" in capsys.readouterr().err
    monkeypatch.setattr(progress, "AUTO_MIN_BYTES", 1 << 40)
    lazyckpt.load(lazy)  # a quick read: no bar
    assert capsys.readouterr().err == ""


def test_a_read_that_takes_long_shows_its_bar_late(
    saved: tuple[Path, Any], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below `AUTO_MIN_BYTES`, a read shows its bar once it has taken `LATE_SECONDS` (a
    model over a slow network), from the bytes done by then; a quick one never does."""
    from lazyckpt._engine import progress

    lazy = lazyckpt.open(saved[0])
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(progress, "AUTO_MIN_BYTES", 1 << 40)
    monkeypatch.setattr(progress, "LATE_MIN_BYTES", 0)
    monkeypatch.setattr(progress, "LATE_SECONDS", 1e9)
    lazyckpt.load(lazy)  # quicker than that: no bar
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "LATE_SECONDS", 0.0)
    lazyckpt.load(lazy)
    assert "lazyckpt load: 100%|" in capsys.readouterr().err


def test_a_late_bar_is_never_drawn_after_its_close(
    capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes counted after `close` (a straggling job) draw no bar that nothing would close."""
    pytest.importorskip("tqdm")
    from lazyckpt._engine import progress

    monkeypatch.setattr(progress, "LATE_SECONDS", 0.0)
    bar = progress.Progress(100, "late", late=True)
    bar.close()
    bar.advance(1)
    assert capsys.readouterr().err == ""


def test_remote_requests_cover_each_run_once_without_slivers() -> None:
    """A remote run is cut on its own into equal requests of at least `MIN_REQUEST`
    bytes (a shorter run is one request), each byte once; an empty run is none."""
    from lazyckpt._engine import raw

    source = raw.Source(None, 0, key="k")  # type: ignore[arg-type]  # (jobs reads no array)
    mib = raw.MIN_REQUEST
    runs = [(0, 0, 0), (7, 0, 5), (100, 5, 3 * mib + 1), (10**9, 5 + 3 * mib + 1, 2 * mib - 1)]
    for piece in (mib, 2 * mib, 16 * mib):
        jobs = [job for [job] in source.jobs(iter(runs), piece)]
        covered = sorted((at, at + length) for _, at, length in jobs)
        assert [low for low, _ in covered[1:]] == [high for _, high in covered[:-1]]
        assert (covered[0][0], covered[-1][1]) == (0, 5 + 5 * mib)
        assert all(length >= mib for file_at, _, length in jobs if file_at >= 100)


def test_progress_without_tqdm(saved: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    lazy = lazyckpt.open(saved[0])
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # (an import of it fails)
    with pytest.raises(lazyckpt.MissingExtraError, match=r"pip install 'lazyckpt\[progress\]'"):
        lazyckpt.load(lazy, progress=True)
    assert isinstance(lazyckpt.load(lazy), dict)  # auto: no bar, no error


def test_a_failed_read_closes_its_bar(saved: tuple[Path, Any], tmp_path: Path, capsys: Any) -> None:
    import shutil

    from tqdm import tqdm  # type: ignore[import-untyped]

    copy = Path(shutil.copytree(saved[0], tmp_path / "copy"))
    lazy = lazyckpt.open(copy)
    for data_file in copy.glob("ocdbt.process_0/d/*"):
        data_file.unlink()
    with pytest.raises(lazyckpt.CorruptCheckpointError):
        lazyckpt.load(lazy, progress=True)
    assert not list(tqdm._instances)
    assert capsys.readouterr().err.endswith("\n")  # (the error starts on a line of its own)


def test_progress_counts_from_many_threads() -> None:
    from lazyckpt._engine.progress import Progress

    bar = Progress(8 * 1000, "count")

    def count() -> None:
        for _ in range(1000):
            bar.advance(1)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bar._bar is not None and bar._bar.n == 8000
    bar.close()


def test_budget_must_be_positive(saved: tuple[Path, Any]) -> None:
    with pytest.raises(lazyckpt.SizeError, match=r"memory_budget=0 is not a size: a size is at"):
        lazyckpt.load(lazyckpt.open(saved[0]), memory_budget=0)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_process_memory_stays_within_the_budget(wide: Path) -> None:
    """Peak RSS of a fresh process, not just NumPy's allocations: the allocator must
    hand freed buffers back. At this 96 MiB budget the stream of 256 MiB grew the
    process by 70-100 MiB here (115 MiB once on a busy machine); ignoring the budget
    (a 1 GiB one) it grows by 218-251 MiB, every chunk in flight. device_put needs
    21-38 MiB beyond the arrays, 54-65 MiB with a 1 GiB budget: the budget does not
    bind there, and the bound catches a host copy of the tree (256 MiB more)."""
    budget = 96 << 20
    stream = rss_probe(wide, "stream", budget)
    assert stream["peak"] < budget + (64 << 20), stream
    placed = rss_probe(wide, "device_put", budget)
    assert placed["kept"] == 256 << 20
    assert placed["peak"] - placed["kept"] <= budget, placed


@pytest.mark.parametrize(
    "layout",
    ["ocdbt_zarr2", "ocdbt_zarr3", "folders_zarr2", "uncompressed_folders", "subchunked_zarr2"],
)
def test_many_small_arrays_are_read_in_batches(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch, count_bytes: Any
) -> None:
    """A load (or a device_put onto this process's devices) of hundreds of small arrays
    opens no tensorstore array: their chunks are read in batches and decoded by
    lazyckpt, each stored byte once, every value right (dtypes, a scalar, an array of
    several chunks)."""
    rng = np.random.default_rng(11)
    tree: dict[str, Any] = {
        f"p{i:03d}": rng.standard_normal((i % 7 + 1, 3)).astype(np.float32) for i in range(300)
    }
    tree["bf16"] = np.linspace(-2, 2, 10).astype(jnp.bfloat16)
    tree["mask"] = np.arange(12).reshape(3, 4) % 3 == 0
    tree["count"] = np.array(-7, np.int64)
    tree["wide"] = np.arange(4096, dtype=np.int32).reshape(64, 64)  # several chunks
    path = LAYOUTS[layout](tmp_path / "ckpt", tree)
    lazy = lazyckpt.open(path)
    opened: list[str] = []
    real = StoredArray.open

    def counted(self: StoredArray) -> Any:
        opened.append(self.key)
        return real(self)

    monkeypatch.setattr(StoredArray, "open", counted)  # (tensorstore's path opens first)
    with count_bytes() as read:
        loaded = lazyckpt.load(lazy)
    assert opened == [], opened[:5]
    for key, value in tree.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
        assert loaded[key].dtype == np.asarray(value).dtype and loaded[key].flags.writeable, key
    if layout.startswith("ocdbt"):
        stored = sum(
            stored_chunk_bytes(path, leaf) for _, leaf in lazyckpt.leaves(lazy) if leaf.size
        )
        assert read[0] <= stored * 1.05 + (64 << 10), (read[0], stored)
    # Onto devices too, in batches within a small budget.
    sharding = NamedSharding(jax.make_mesh((4, 2), ("a", "b")), P())
    placed = lazyckpt.device_put(lazy, sharding, memory_budget=16 << 10)
    assert opened == [], opened[:5]
    for key, value in tree.items():
        assert placed[key].sharding == sharding, key
        np.testing.assert_array_equal(np.asarray(placed[key]), value, err_msg=key)


@pytest.fixture(scope="module")
def one_chunk(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A 32 MiB array that orbax stores as one zstd chunk (one device: one shard)."""
    value = np.random.default_rng(1).standard_normal((8192, 1024), dtype=np.float32)
    path = orbax_save(tmp_path_factory.mktemp("one") / "ckpt", {"w": value}, zarr3=True)
    return path, value


def test_streamed_blocks_reuse_memory_nothing_holds(
    one_chunk: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk streamed in blocks is decoded into the memory of blocks the consumer has
    let go of, not into fresh memory each time; blocks the consumer keeps are never
    written again. (A decoding thread lets go of the block it handed over only once it
    holds the GIL again: on a busy machine a buffer or two more are made, measured
    up to 5 for the 16 blocks with three busy processes on two cores.)"""
    path, value = one_chunk
    w = lazyckpt.open(path)["w"]
    assert w.chunks == w.shape
    made: list[int] = []
    new_map = mmap.mmap

    def counted_map(fileno: int, length: int) -> mmap.mmap:
        made.append(length)
        return new_map(fileno, length)

    monkeypatch.setattr(mmap, "mmap", counted_map)
    budget = 16 << 20
    blocks = 0
    for _, index, block in lazyckpt.iter_blocks(w, memory_budget=budget):
        np.testing.assert_array_equal(block, value[index])
        blocks += 1
        del block
    assert blocks >= 16 and len(made) <= 6, (blocks, made)
    made.clear()
    kept = list(lazyckpt.iter_blocks(w, memory_budget=budget))
    assert len(made) == len(kept)  # each kept block its own memory
    for _, index, block in kept:
        np.testing.assert_array_equal(block, value[index])


def test_a_buffer_pool_reuses_only_free_memory_and_keeps_within_its_limits() -> None:
    """Memory is reused once no view of it is left, and not before; free buffers are let
    go where the pool would hold more than `limit`, or keep more than `keep` free."""
    pool = memory.BufferPool(6 << 20, keep=5 << 20)
    first = pool.empty((1 << 20,), np.float32)  # 4 MiB
    view = first[10:20]
    del first
    second = pool.empty((1 << 20,), np.float32)
    assert not np.shares_memory(second, view)  # a view keeps its memory in use
    assert pool.held == 8 << 20  # over `limit`: nothing free to let go
    view[:] = 1.0
    del second
    third = pool.empty((1 << 19,), np.float32)  # 2 MiB, in the free 4 MiB buffer
    third[:] = 2.0
    assert pool.held == 8 << 20 and (view == 1.0).all()
    del view, third  # two 4 MiB buffers free: over `keep` and `limit`, one let go
    large = pool.empty((2 << 20,), np.float32)  # 8 MiB: neither fits, so both let go
    assert pool.held == 8 << 20 and large.nbytes == 8 << 20
    del large
    small = pool.empty((1 << 18,), np.float32)  # 1 MiB: the free 8 MiB is too large
    assert pool.held == 1 << 20 and small.nbytes == 1 << 20
    others = [pool.empty((1 << 20,), np.float32) for _ in range(2)]  # 2 x 4 MiB
    del small, others
    pool.settle()  # free buffers let go now, not at the next `empty`
    assert pool.held == 5 << 20  # within `keep`: the 1 MiB and one 4 MiB buffer


_SIZES_SCRIPT = """
import os
import numpy as np
from lazyckpt._engine import memory
before = memory._rss()
grown = np.ones(64 << 20, np.uint8)
after = memory._rss()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    del grown
    os.write(write, str(memory._rss()).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as answer:
    child = int(answer.read())
os.waitpid(pid, 0)
print(before, after, child, memory._rss())
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_the_process_size_is_read_afresh_and_by_a_forked_child_its_own(tmp_path: Path) -> None:
    """The guard's look at the process's size (its file kept open between looks) sees
    memory taken since the last look, and a child forked after a look sees its own
    size: it lets go of what the parent keeps, and its look says so."""
    import subprocess

    script = tmp_path / "sizes.py"
    script.write_text(_SIZES_SCRIPT)
    found = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    before, after, child, parent = map(int, found.stdout.split())
    assert after - before >= 60 << 20, found.stdout
    assert child <= after - (60 << 20) and parent >= after - (1 << 20), found.stdout


_TAKEN_SCRIPT = """
import os
from lazyckpt._engine import memory
first = memory._rss()
fd = memory._STATM.fd
os.closerange(3, 1 << 16)  # (as a daemonizing library does)
again = memory._rss()
os.close(memory._STATM.fd)
read, write = os.pipe()
while read != memory._STATM.fd and write != memory._STATM.fd:  # (the number taken by a pipe)
    read, write = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        os.fstat(read), os.fstat(write)
        os._exit(0)
    except OSError:
        os._exit(1)
_, status = os.waitpid(pid, 0)
print(first, again, memory._rss(), os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_the_process_size_is_read_again_after_its_file_is_closed_behind_its_back(
    tmp_path: Path,
) -> None:
    """Every descriptor closed under it: the next look opens the file again. Its number
    then taken by a pipe: the look opens its own, and a forked child keeps the pipe."""
    import subprocess

    script = tmp_path / "taken.py"
    script.write_text(_TAKEN_SCRIPT)
    found = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    first, again, later, child = map(int, found.stdout.split())
    assert abs(again - first) < 16 << 20 and abs(later - first) < 16 << 20, found.stdout
    assert child == 0, "the forked child lost the pipe that took the descriptor's number"
