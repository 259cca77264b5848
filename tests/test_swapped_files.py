"""A file of an open checkpoint moved away, another put in its place and the first
moved back while a read goes on, or made a link out of the folder after `open`: the
read says the checkpoint changed, naming the file, and never hands back values of two
files. The swap happens at the moment lazyckpt opens the file for a later piece
(`os.open`, which its own reads call for each piece); the checkpoint's generation,
checked at the end of the read, is the same again by then."""

from __future__ import annotations

import os
import re
import shutil
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from safetensors.numpy import save_file

import lazyckpt
import lazyckpt._device.senders as sending
from lazyckpt._device.platforms import PLATFORMS, Platform
from lazyckpt._engine import raw
from lazyckpt._storage.identities import FileIdentities
from tests.helpers import orbax_save
from tests.hub_server import HubServer
from tests.test_hub import SHARDS, model, up

MiB = 1 << 20


def _tensors(seed: int) -> dict[str, np.ndarray]:
    """Two float32 tensors of 2 MiB (over what is read in batches of small arrays)."""
    rng = np.random.default_rng(seed)
    return {f"w{k}": rng.standard_normal((512, 1024)).astype(np.float32) for k in range(2)}


def _swap_at_open(
    monkeypatch: pytest.MonkeyPatch,
    opened: Path,
    stand_in: Callable[[], bytes],
    *,
    swapped: Path | None = None,
    first: Callable[[str], bool] | None = None,
) -> list[str]:
    """From now on, at the second `os.open` of a file that `first` picks (default: of
    `opened` itself), that file (`swapped`, where `opened` is a link to it) is moved
    aside, a file holding `stand_in()` put in its place and opened, and the first file
    moved back: the read that opened it reads the stand-in. The paths opened, in
    order (the swapped one last)."""
    picks = first or (lambda path: path == os.fspath(opened))
    real_open = os.open
    seen: list[str] = []
    lock = threading.Lock()

    def swapping(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        name = os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else ""
        if not picks(name):
            return real_open(path, flags, *args, **kwargs)
        with lock:
            seen.append(name)
            if len(seen) != 2:
                return real_open(path, flags, *args, **kwargs)
            target = swapped or Path(name)
            aside = target.with_name(target.name + ".aside")
            replacement = target.with_name(target.name + ".stand-in")
            replacement.write_bytes(stand_in())
            os.rename(target, aside)
            os.rename(replacement, target)
            try:
                return real_open(path, flags, *args, **kwargs)
            finally:
                os.rename(aside, target)

    monkeypatch.setattr(os, "open", swapping)
    return seen


def _other_tensors(path: Path) -> Callable[[], bytes]:
    """A safetensors file of the same size as `path`, and the same header, but other
    values."""
    other = path.with_name("other.safetensors")
    save_file(_tensors(1), str(other))
    assert other.stat().st_size == path.stat().st_size
    return other.read_bytes


def _changed(file: Path | str) -> Any:
    return pytest.raises(
        lazyckpt.CheckpointChangedError,
        match=rf"{re.escape(os.fspath(file))} was overwritten or changed since it was opened.*open it again",
    )


def test_a_file_swapped_between_pieces_of_a_load_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load` reads a safetensors tensor straight into its result by positioned reads,
    opening the file for each piece: the second piece opened another file."""
    path = tmp_path / "model.safetensors"
    save_file(_tensors(0), str(path))
    stand_in = _other_tensors(path)
    tree = lazyckpt.open(path)
    seen = _swap_at_open(monkeypatch, path, stand_in)
    with _changed(path):
        lazyckpt.load(tree)
    assert len(seen) >= 2, seen
    monkeypatch.undo()  # the first file, back in place, reads as it was opened
    loaded = lazyckpt.load(tree)
    assert all(np.array_equal(loaded[k], v) for k, v in _tensors(0).items())


@pytest.fixture
def copying(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU devices taken for accelerators that copy what is sent, and pieces of any size
    read and sent by `lazyckpt._device.senders`' threads (as tests/test_staged.py does)."""
    monkeypatch.setitem(PLATFORMS, "cpu", Platform(staged=True, adopts=False))
    monkeypatch.setattr(sending, "SENT_ALONE", 0)
    yield


@pytest.mark.usefixtures("copying")
@pytest.mark.parametrize("maps", [True, False], ids=["mapped", "read"])
def test_a_file_swapped_between_pieces_sent_to_devices_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, maps: bool
) -> None:
    """`device_put` onto staged devices sends each piece from a map of the file (or read
    into a buffer), opening the file for each: the second piece opened another file."""
    monkeypatch.setattr(sending, "SENT_FROM_MAPS", maps)
    mapped: list[int] = []
    real_mapped = raw.mapped

    def counted(*args: Any) -> Any:
        mapped.append(1)
        return real_mapped(*args)

    monkeypatch.setattr(sending, "mapped", counted)
    path = tmp_path / "model.safetensors"
    save_file(_tensors(0), str(path))
    stand_in = _other_tensors(path)
    tree = lazyckpt.open(path)
    seen = _swap_at_open(monkeypatch, path, stand_in)
    with _changed(path):
        lazyckpt.device_put(tree, SingleDeviceSharding(jax.devices()[0]), memory_budget=8 * MiB)
    assert len(seen) >= 2, seen
    assert bool(mapped) == maps, mapped


def _orbax(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """An OCDBT checkpoint written by Orbax: two arrays of 2 MiB, one chunk each, of
    random bits (which zstd stores as they are), and a small one."""
    rng = np.random.default_rng(2)
    values = {f"w{k}": rng.integers(0, 1 << 32, (512, 1024), dtype=np.uint32) for k in range(2)}
    values["small"] = np.arange(12, dtype=np.int32)
    return orbax_save(path, values), values


def _places(tree: Any) -> dict[str, list[tuple[int, int]]]:
    """Where the large arrays' chunks lie: each data file, and its values' byte ranges."""
    places: dict[str, list[tuple[int, int]]] = {}
    for name in ("w0", "w1"):
        stored = tree[name].stored
        place = stored.store.local_file(stored.codec.chunk_key(stored.name, (0, 0), stored.chunks))
        assert place is not None and Path(place[0]).parent.name == "d", place
        places.setdefault(place[0], []).append((place[1], place[2]))
    return places


def _other_values(file: Path, places: list[tuple[int, int]]) -> bytes:
    """`file`'s bytes with a byte changed inside each value it holds: zstd frames of
    raw blocks, without checksums, that decode to other values."""
    data = bytearray(file.read_bytes())
    for offset, length in places:
        assert length > 4096
        data[offset + 4096] ^= 0xFF
    return bytes(data)


def test_a_data_file_swapped_between_chunks_of_a_load_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load` decodes an OCDBT checkpoint's chunks from its data files, opened by
    lazyckpt for each chunk (`FileSource`): the second data file opened (the first
    one's again, or another) was another file."""
    path, values = _orbax(tmp_path / "ckpt")
    tree = lazyckpt.open(path)
    places = _places(tree)
    swapped: list[str] = []

    def stand_in() -> bytes:
        file = Path(seen[-1])
        swapped.append(str(file))
        return _other_values(file, places[str(file)])

    seen = _swap_at_open(monkeypatch, path, stand_in, first=lambda name: name in places)
    with pytest.raises(lazyckpt.CheckpointChangedError) as raised:
        lazyckpt.load(tree)
    assert swapped and swapped[0] in str(raised.value), (swapped, raised.value)
    assert "changed since it was opened" in str(raised.value)
    monkeypatch.undo()
    loaded = lazyckpt.load(tree)
    assert all(np.array_equal(loaded[k], v) for k, v in values.items())


def _linked_inside(path: Path) -> None:
    """Every data file of the checkpoint moved into another folder of it, and linked
    from where it was."""
    moved = path / "moved"
    moved.mkdir()
    for file in list(path.rglob("d/*")):
        target = moved / f"{file.parent.parent.name}-{file.name}"
        file.rename(target)
        file.symlink_to(os.path.relpath(target, file.parent))


def _in_hf_cache(path: Path, root: Path) -> Path:
    """The checkpoint as the Hugging Face cache holds it: a snapshot folder whose files
    are links into the repository's blobs."""
    repo = root / "hub" / "models--org--model"
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "abcd")
    (repo / "blobs").mkdir(parents=True)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        blob = repo / "blobs" / f"blob{len(list((repo / 'blobs').iterdir()))}"
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(path)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.mark.parametrize("layout", ["plain", "links inside", "hf cache"])
@pytest.mark.parametrize("copy", ["same bytes", "other bytes"])
def test_a_data_file_made_a_link_out_of_the_folder_after_open_is_refused(
    tmp_path: Path, layout: str, copy: str
) -> None:
    """A checkpoint read while its data files are plain, links inside its folder or the
    Hugging Face cache's links into its blobs; one of them then made a link to a copy
    outside the folder (as `open` refuses it): the next reads refuse it by name, those
    of its large chunks by lazyckpt (`FileSource`) and those of a small array through
    tensorstore's driver, which are checked just before it reads."""
    path, values = _orbax(tmp_path / "ckpt")
    if layout == "links inside":
        _linked_inside(path)
    elif layout == "hf cache":
        path = _in_hf_cache(path, tmp_path)
    tree = lazyckpt.open(path)
    loaded = lazyckpt.load(tree)
    assert all(np.array_equal(loaded[k], v) for k, v in values.items())
    file, places = next(iter(_places(tree).items()))
    outside = tmp_path / "outside"
    if copy == "same bytes":
        outside.write_bytes(Path(file).read_bytes())
    else:
        outside.write_bytes(_other_values(Path(file), places))
    os.unlink(file)
    os.symlink(outside, file)
    with _changed(file):  # (its values, which lazyckpt reads itself)
        lazyckpt.load(tree)
    with _changed(file):  # (read through tensorstore's driver: checked before)
        tree["small"].get()


def test_a_blob_of_the_hf_cache_swapped_between_pieces_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A safetensors file in a snapshot of the Hugging Face cache (a link into its
    blobs) reads; its blob swapped between pieces of a later read is refused, named by
    the snapshot's path."""
    saved = tmp_path / "model" / "model.safetensors"
    saved.parent.mkdir()
    save_file(_tensors(0), str(saved))
    snapshot = _in_hf_cache(saved.parent, tmp_path)
    stand_in = _other_tensors(saved)
    path = snapshot / "model.safetensors"
    tree = lazyckpt.open(path)
    assert all(np.array_equal(tree[k].get(), v) for k, v in _tensors(0).items())
    seen = _swap_at_open(monkeypatch, path, stand_in, swapped=path.resolve())
    with _changed(path):
        lazyckpt.load(tree)
    assert len(seen) >= 2, seen


def test_a_hub_file_whose_copy_in_the_cache_is_replaced_after_open_is_refused(
    hub: HubServer,
) -> None:
    """`hf://` with one shard in the Hugging Face cache, read from the cache's copy
    (its header at `open`, then a slice); that copy replaced by a file of the same size
    but other values: both ways of reading it from disk refuse it."""
    hh = pytest.importorskip("huggingface_hub")
    files, tensors = model()
    hub.commit("org/model", files)
    cached = Path(hh.hf_hub_download("org/model", SHARDS[1])).resolve()
    tree = lazyckpt.open("hf://org/model")
    name = "model.layers.1.mlp.up_proj.weight"
    np.testing.assert_array_equal(up(tree, 1)[:, 3:5].get(), tensors[name][:, 3:5])
    other = model(scale=2.0)[0][SHARDS[1]]
    assert len(other) == cached.stat().st_size
    cached.with_name("other").write_bytes(other)
    os.replace(cached.with_name("other"), cached)
    changed = rf"{re.escape(SHARDS[1])}.*(replaced|changed) since (the model|it) was opened.*open it again"
    with pytest.raises(lazyckpt.CheckpointChangedError, match=changed):
        up(tree, 1)[:, 3:5].get()  # (short runs: answered from the copy by `WebFiles`)
    with pytest.raises(lazyckpt.CheckpointChangedError, match=changed):
        up(tree, 1).get()  # (one long run: positioned reads into the result)


# Reads that lazyckpt made through tensorstore's file driver before: a safetensors
# tensor read by chunks of its grid (cast, transposed) or by rows, and a NumPy file
# in the other byte order, now read through one descriptor per piece.

_VIEWS: dict[str, Callable[[Any], Any]] = {
    "cast": lambda view: view.astype(np.float64),
    "transposed": lambda view: view.T,
    "every other row": lambda view: view[::2],
}


@pytest.mark.parametrize("how", sorted(_VIEWS))
def test_a_file_swapped_between_chunks_of_a_view_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A view read by chunks of its tensor's grid (or, `[::2]`, by one range of rows a
    tensor): each piece opens the file again, and the second opened another file."""
    path = tmp_path / "model.safetensors"
    save_file(_tensors(0), str(path))
    stand_in = _other_tensors(path)
    tree = lazyckpt.open(path)
    views = {name: _VIEWS[how](tensor) for name, tensor in tree.items()}
    seen = _swap_at_open(monkeypatch, path, stand_in)
    with _changed(path):
        lazyckpt.load(views)
    assert len(seen) >= 2, seen
    monkeypatch.undo()
    loaded = lazyckpt.load(views)
    expected = {name: np.asarray(_VIEWS[how](v)) for name, v in _tensors(0).items()}
    assert all(np.array_equal(loaded[k], v) for k, v in expected.items())


def test_a_file_in_the_other_byte_order_swapped_between_chunks_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big-endian `.npy` file (which is read by chunks, and swapped to native order)."""
    values = np.arange(1 << 20, dtype=">f4").reshape(1024, 1024)
    path = tmp_path / "w.npy"
    np.save(path, values)
    other = tmp_path / "other.npy"
    np.save(other, values + 1)
    tree = lazyckpt.open(path)
    seen = _swap_at_open(monkeypatch, path, other.read_bytes)
    with _changed(path):
        lazyckpt.load(tree)
    assert len(seen) >= 2, seen
    monkeypatch.undo()
    assert np.array_equal(lazyckpt.load(tree)["w"], values)


# An Orbax checkpoint written without OCDBT: one file per chunk, which `open` does not
# list; each folder's files are recorded at the first read there.


def _zarr(path: Path, seed: int, side: int) -> tuple[Path, dict[str, np.ndarray]]:
    """A checkpoint of two arrays of `side` x 512 random int32 values (2 MiB and more:
    decoded by lazyckpt from their files; 256 KiB: read in batches of small arrays),
    one chunk file each, without OCDBT."""
    rng = np.random.default_rng(seed)
    values = {f"w{k}": rng.integers(0, 1 << 30, (side, 512), dtype=np.int32) for k in range(2)}
    return orbax_save(path, values, use_ocdbt=False), values


def _chunk_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.glob("w*/*") if not p.name.startswith("."))
    assert [p.parent.name for p in files] == ["w0", "w1"], files
    return files


@pytest.mark.parametrize("side", [1024, 128], ids=["decoded", "small"])
def test_a_chunk_file_swapped_between_arrays_of_a_load_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, side: int
) -> None:
    """The second chunk file a load opens was moved aside, the other checkpoint's put in
    its place and read, and the first moved back: refused by name, never one result
    of each checkpoint."""
    path, values = _zarr(tmp_path / "ckpt", 0, side)
    other, _ = _zarr(tmp_path / "other", 1, side)
    chunks = {str(file) for file in _chunk_files(path)}
    tree = lazyckpt.open(path)

    def stand_in() -> bytes:
        return (other / Path(seen[-1]).relative_to(path)).read_bytes()

    seen = _swap_at_open(monkeypatch, path, stand_in, first=lambda name: name in chunks)
    with pytest.raises(lazyckpt.CheckpointChangedError) as raised:
        lazyckpt.load(tree)
    assert len(seen) == 2 and seen[1] in str(raised.value), (seen, raised.value)
    monkeypatch.undo()
    loaded = lazyckpt.load(tree)
    assert all(np.array_equal(loaded[k], v) for k, v in values.items())


@pytest.mark.parametrize("side", [1024, 128], ids=["decoded", "small"])
@pytest.mark.parametrize("layout", ["plain", "links inside", "hf cache"])
def test_a_chunk_file_made_a_link_out_of_the_folder_after_open_is_refused(
    tmp_path: Path, layout: str, side: int
) -> None:
    """Chunk files that are plain, links inside the checkpoint or the Hugging Face
    cache's links into its blobs read; one then made a link to a copy of itself
    outside the folder is refused by name, by a checkpoint read before (its folder
    listed then) and by one opened before but not read (listed now), and read where
    `open` was told to allow such links."""
    path, values = _zarr(tmp_path / "ckpt", 0, side)
    if layout == "links inside":
        moved = path / "moved"
        moved.mkdir()
        for file in _chunk_files(path):
            target = moved / file.parent.name
            file.rename(target)
            file.symlink_to(os.path.relpath(target, file.parent))
    elif layout == "hf cache":
        path = _in_hf_cache(path, tmp_path)
    read, unread = lazyckpt.open(path), lazyckpt.open(path)
    loaded = lazyckpt.load(read)
    assert all(np.array_equal(loaded[k], v) for k, v in values.items())
    victim = _chunk_files(path)[1]
    outside = tmp_path / "outside"
    outside.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(outside)
    with _changed(victim):
        lazyckpt.load(read)
    with _changed(victim):
        lazyckpt.load(unread)
    allowed = lazyckpt.load(lazyckpt.open(path, allow_outside_links=True))
    assert all(np.array_equal(allowed[k], v) for k, v in values.items())


def test_a_folder_of_many_chunk_files_costs_a_few_bytes_a_file(tmp_path: Path) -> None:
    """20,000 chunk files in one folder, recorded at the first read there: well under 64
    bytes held a file (a dict of their paths held about 230); a file put there later
    is none of the checkpoint's."""
    root = tmp_path / "ckpt"
    folder = root / "params" / "layers_0" / "mlp" / "kernel"
    folder.mkdir(parents=True)
    for i in range(20_000):
        (folder / f"{i // 100}.{i % 100}.0").touch()
    identities = FileIdentities(str(root))
    first = folder / "7.7.0"
    tracemalloc.start()
    try:
        assert identities.same(str(first), first.stat())
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 20_000 * 64, held
    assert all(identities.same(str(file), file.stat()) for file in list(folder.iterdir())[:100])
    late = folder / "200.0.0"
    late.touch()
    assert not identities.same(str(late), late.stat())
