"""Where decoded chunks' stored bytes come from (`lazyckpt._engine.sources`): a local
file's bytes read by lazyckpt into reused memory, tensorstore's kvstore elsewhere;
and streams whose chunks decode at once, their blocks taken as they are ready
(`read_blocks(in_order=False)`, as placing on accelerators takes them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import SingleDeviceSharding

import lazyckpt
import lazyckpt._device.staged as staged
from lazyckpt._device.platforms import PLATFORMS, Platform
from lazyckpt._engine import sources
from lazyckpt._engine.decode import ChunkStream
from lazyckpt._engine.stream import read_blocks
from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._storage.local import pread_into
from lazyckpt._storage.metrics import direct_bytes_read
from tests.helpers import orbax_save

MiB = 1 << 20


def _values(count: int = 2) -> dict[str, np.ndarray]:
    """`count` float32 arrays of 4 MiB, one stored chunk each, random normal values
    (which zstd shrinks a little)."""
    rng = np.random.default_rng(3)
    return {f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(count)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return orbax_save(tmp_path_factory.mktemp("sources") / "orbax", _values())


def _tensorstore_file_bytes() -> int:
    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(int(v.get("value", 0)) for metric in found for v in metric["values"])


def test_chunks_in_local_data_files_are_read_by_lazyckpt(checkpoint: Path) -> None:
    """A chunk in an OCDBT data file: its stored bytes read by lazyckpt (counted as
    its direct reads), not by tensorstore's file kvstore, and decoded exactly."""
    tree = lazyckpt.open(checkpoint)
    stored = tree["w0"].stored
    key = stored.codec.chunk_key(stored.name, (0, 0), stored.chunks)
    place = stored.store.local_file(key)
    assert place is not None and Path(place[0]).parent.name == "d", place
    length = place[2]
    assert length is not None and length < 4 * MiB  # (compressed)
    direct, through_tensorstore = direct_bytes_read(), _tensorstore_file_bytes()
    values = tree["w0"].get()
    assert direct_bytes_read() - direct >= length
    assert _tensorstore_file_bytes() - through_tensorstore < length // 8
    assert values.tobytes() == _values()["w0"].tobytes()


def test_many_windows_through_two_buffers_decode_exactly(checkpoint: Path) -> None:
    """Windows of 4 KiB, hundreds of them, through the two buffers that take turns:
    zstd is handed one while the other is read into, and decodes every value."""
    stored = lazyckpt.open(checkpoint)["w1"].stored
    stream = ChunkStream(stored, (0, 0), 4 << 10)
    out = bytearray(4 * MiB)
    try:
        stream.next(((0, 1024), (0, 1024)), memoryview(out))
        stream.finish()
    finally:
        stream.close()
    assert bytes(out) == _values()["w1"].tobytes()


def test_a_data_file_cut_short_is_named(checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(checkpoint, tmp_path / "orbax"))
    tree = lazyckpt.open(copy)
    stored = tree["w0"].stored
    path, offset, length = stored.store.local_file(
        stored.codec.chunk_key(stored.name, (0, 0), stored.chunks)
    )
    with open(path, "r+b") as file:
        file.truncate(offset + length // 2)
    with pytest.raises(CorruptCheckpointError, match=r"ocdbt\.process_0/d/\w+: holds \d+ bytes"):
        tree["w0"].get()
    Path(path).unlink()
    with pytest.raises(
        CorruptCheckpointError, match=r"d/\w+ is missing, and the checkpoint places"
    ):
        tree["w0"].get()


def test_buffers_are_handed_on_while_sources_are_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Window buffers go from a source that closes to the next one; no more are kept
    free than are in use, and none once none is."""
    monkeypatch.setattr(sources, "_windows", sources._Windows())
    file = tmp_path / "bytes"
    file.write_bytes(bytes(range(256)) * 64)
    first = sources.FileSource(str(file), 0, None, 1024)
    second = sources.FileSource(str(file), 0, None, 1024)
    assert first.first() == "value" and bytes(first.read()) == bytes(range(256)) * 4
    handed = {id(buffer) for buffer in first._buffers}
    first.close()
    third = sources.FileSource(str(file), 1024, 2048, 1024)
    assert {id(buffer) for buffer in third._buffers} == handed
    assert third.first() == "value" and bytes(third.read()) == bytes(range(256)) * 4
    assert third.read() == b""
    more = [sources.FileSource(str(file), 0, None, 1024) for _ in range(3)]
    for source in more:
        source.close()
    assert sources._windows._kept <= sources._windows._taken == 4  # (second's and third's)
    second.close()
    third.close()
    assert sources._windows._kept == sources._windows._taken == 0
    assert not any(sources._windows._free.values())


def test_a_source_closed_mid_read_waits_for_its_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing waits for the window being read ahead: its buffer goes to the next
    source only once nothing writes into it."""
    file = tmp_path / "bytes"
    file.write_bytes(bytes(4096))
    finished: list[float] = []
    real = pread_into

    def slow(fd: int, view: memoryview, offset: int) -> int:
        time.sleep(0.3)
        done = real(fd, view, offset)
        finished.append(time.monotonic())
        return done

    monkeypatch.setattr(sources, "pread_into", slow)
    source = sources.FileSource(str(file), 0, None, 1024)
    assert source.first() == "value"  # (the second window now read ahead)
    source.close()
    closed = time.monotonic()
    assert len(finished) == 2 and finished[-1] <= closed


def test_streams_as_ready_decode_their_chunks_at_once(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken as they are ready, a job goes on while an earlier one is not done: the
    first chunk's second slab waits for the second chunk's second slab, which a stream
    in the jobs' order would decode only after the whole first chunk."""
    tree = lazyckpt.open(checkpoint)
    second_of_w1 = threading.Event()
    waited: list[bool] = []
    real = ChunkStream.next

    def next_slab(stream: ChunkStream, slab: Any, into: Any = None) -> Any:
        if stream.stored.key == "w0" and stream.done:
            waited.append(second_of_w1.wait(timeout=10))
        out = real(stream, slab, into)
        if stream.stored.key == "w1" and stream.done > MiB:
            second_of_w1.set()
        return out

    monkeypatch.setattr(ChunkStream, "next", next_slab)
    # A block of 1 MiB: four slabs a chunk; room for both jobs at once.
    blocks = read_blocks([tree["w0"], tree["w1"]], 24 * MiB, in_order=False, block=MiB)
    got: dict[int, list[tuple[Any, np.ndarray]]] = {0: [], 1: []}
    for position, index, values in blocks:
        got[position].append((index, values.copy()))
    assert waited and all(waited)
    for position, key in enumerate(("w0", "w1")):
        whole = np.empty((1024, 1024), np.float32)
        for index, values in got[position]:
            whole[index] = values
        assert whole.tobytes() == _values()[key].tobytes()


def test_placements_stream_chunks_larger_than_a_block(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bound for an accelerator, an array whose stored chunks are larger than a block
    of half the budget is streamed (many chunks decode at once, each holding a block),
    not filled whole; one with small chunks, or raw bytes, is filled whole."""
    monkeypatch.setitem(PLATFORMS, "cpu", Platform(staged=True, adopts=True))
    tree = lazyckpt.open(checkpoint)
    budget = 16 * MiB  # half 8 MiB, a block 1 MiB: the 4 MiB chunks are larger
    assert staged._large_chunks(tree["w0"], budget // 2)
    assert not staged._large_chunks(tree["w0"], 64 * MiB)
    assert not staged._large_chunks(tree["w0"].T, budget // 2)  # (a composed view)
    small = lazyckpt.open(lazyckpt.save(tmp_path / "small", _values(1), chunk_bytes=256 << 10))
    assert not staged._large_chunks(small["w0"], budget // 2)
    streamed: list[int] = []
    real = read_blocks

    def counted(views: Any, *args: Any, **kwargs: Any) -> Any:
        assert kwargs["in_order"] is False  # (blocks as they are ready)
        streamed.append(len(views))
        return real(views, *args, **kwargs)

    monkeypatch.setattr(staged, "read_blocks", counted)
    placed = lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=budget)
    assert streamed == [2]
    for key, expected in _values().items():
        assert np.asarray(jax.device_get(placed[key])).tobytes() == expected.tobytes()


def test_names_that_leave_the_checkpoint_are_left_to_the_driver(checkpoint: Path) -> None:
    """A data file or chunk key that names a path outside the checkpoint's folder (a
    hostile b-tree or metadata) is never opened by lazyckpt: tensorstore's driver
    reads it, and refuses such names."""
    store = lazyckpt.open(checkpoint)["w0"].stored.store
    place = store.index.locate("w0/0.0") if store.index is not None else None
    assert isinstance(place, tuple) and store.local_file("w0/0.0") is not None
    for file in ("../../etc/passwd", "/etc/passwd", "d/../../x", "d//x", "./d/x", "d\\..\\x"):
        store.index._places[b"w0/0.0"] = (file, 0, 10)
        assert store.local_file("w0/0.0") is None, file
    store.index._places[b"w0/0.0"] = place


def test_chunk_keys_that_leave_a_folder_are_left_to_the_driver(tmp_path: Path) -> None:
    folder = orbax_save(tmp_path / "folder", _values(1), use_ocdbt=False)
    store = lazyckpt.open(folder)["w0"].stored.store
    assert store.local_file("w0/0.0") == (str(folder / "w0" / "0.0"), 0, None)
    for key in ("../outside", "/etc/passwd", "w0/../../x", "w0\x00y", "w0\\..\\x"):
        assert store.local_file(key) is None, key


def test_a_source_closed_in_a_forked_child_lets_the_parent_keep_its_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closed in another process than the one that opened it (a fork), a source
    closes its file and hands nothing back: the windows and the reading thread are
    the parent's."""
    monkeypatch.setattr(sources, "_windows", sources._Windows())
    file = tmp_path / "bytes"
    file.write_bytes(bytes(4096))
    source = sources.FileSource(str(file), 0, None, 1024)
    assert source.first() == "value"
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)
    source.close()
    assert source.fd is None and sources._windows._taken == 2


def test_chunks_are_read_from_their_files_where_open_did_not_walk_the_tree(
    tmp_path: Path,
) -> None:
    """An array of many chunks: `open` reads too few of the database's keys to walk
    its b-tree, and the first chunk read walks it."""
    values = {"w": np.random.default_rng(4).standard_normal((64, 65536)).astype(np.float32)}
    path = lazyckpt.save(tmp_path / "many", values, chunk_bytes=1 << 20)  # 16 chunks
    tree = lazyckpt.open(path)
    index = tree["w"].stored.store.index
    assert index is not None and not index.walked
    direct = direct_bytes_read()
    assert tree["w"].get().tobytes() == values["w"].tobytes()
    assert index.walked and direct_bytes_read() - direct > 8 * MiB


def test_a_checkpoint_replaced_after_open_is_said_so(checkpoint: Path, tmp_path: Path) -> None:
    """Read from the files of a checkpoint saved again since `open`: the error says it
    changed, not that it is damaged."""
    copy = Path(shutil.copytree(checkpoint, tmp_path / "orbax"))
    tree = lazyckpt.open(copy)
    shutil.rmtree(copy)
    orbax_save(copy, _values())
    with pytest.raises(lazyckpt.CheckpointChangedError):
        tree["w0"].get()


def test_a_forked_child_reads_chunks_from_their_files(checkpoint: Path, tmp_path: Path) -> None:
    """In a child forked after the parent read (tensorstore's threads are not in the
    child, nor the reading threads), a chunk the b-tree placed is read by lazyckpt; one
    whose b-tree was not walked before the fork is refused by name (walking it would
    take tensorstore, which aborts a forked child)."""
    script = tmp_path / "fork.py"
    script.write_text(
        "import os, sys\n"
        "import lazyckpt\n"
        "tree = lazyckpt.open(sys.argv[1])\n"
        "if sys.argv[2] == 'read':\n"
        "    tree['w0'].get()\n"
        "read, write = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        message = tree['w1'].get().tobytes().hex()[:64]\n"
        "    except BaseException as error:\n"
        "        message = f'{type(error).__name__}: {error}'\n"
        "    os.write(write, message.encode())\n"
        "    os._exit(0)\n"
        "os.close(write)\n"
        "os.waitpid(pid, 0)\n"
        "print(os.read(read, 4096).decode())\n"
    )

    def child(path: Path, before: str) -> str:
        found = subprocess.run(
            [sys.executable, str(script), str(path), before],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return found.stdout.strip() + found.stderr[-2000:]

    assert child(checkpoint, "read") == _values()["w1"].tobytes().hex()[:64]
    # Eight chunks in one array: `open` reads too few keys to walk the b-tree.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = np.random.default_rng(5).standard_normal((2048, 1024)).astype(np.float32)
    sharded = jax.device_put(
        rows, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    )
    unwalked = orbax_save(tmp_path / "unwalked", {"w0": sharded, "w1": sharded})
    assert child(unwalked, "open").startswith("StorageAccessError: ")
