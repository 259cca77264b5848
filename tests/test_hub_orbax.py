"""Orbax checkpoints on the loopback Hub (`tests/hub_server.py`) and at plain https://
URLs, written by Orbax itself: the same tree and values as from disk, read lazily
(counted in requests and bytes), and damaged copies refused as they are on disk."""

from __future__ import annotations

import itertools
import os
import re
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import lazyckpt
from lazyckpt import LazyArray
from lazyckpt._storage.http import relay
from tests.helpers import (
    LAYOUTS,
    assert_loaded,
    expected,
    handler_save,
    orbax_save,
    rich_tree,
    stored_chunk_bytes,
    structure,
)
from tests.hub_server import HubServer
from tests.test_legacy import _legacy_checkpoint

pytest.importorskip("huggingface_hub")
ocp = pytest.importorskip("orbax.checkpoint")


def _files(folder: Path, under: str) -> dict[str, bytes]:
    """The files of `folder`, by their path in a repository under `under`."""
    return {
        f"{under}/{file.relative_to(folder).as_posix()}": file.read_bytes()
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }


def _layers(count: int, side: int = 16) -> dict[str, Any]:
    """A model of `count` small layers (`side` x `side`) and one 1 MiB embedding."""
    rng = np.random.default_rng(0)
    return {
        "params": {
            f"layer_{i}": {"w": rng.standard_normal((side, side), dtype=np.float32)}
            for i in range(count)
        },
        "embed": rng.standard_normal((256, 1024), dtype=np.float32),
        "step": 12,
    }


def _chunked_save(path: Path, tree: Any) -> Path:
    """Orbax's own save, with the embedding in 64 KiB chunks (16 rows each)."""
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=64 << 10), tree)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    return path


def _served(hub: HubServer) -> dict[str, int]:
    """Bytes of data files (`d/`) the server sent since its log was cleared, by file."""
    sent: dict[str, int] = defaultdict(int)
    for request in hub.log:
        if "/d/" in request.path and request.status in (200, 206):
            sent[request.path.rsplit("/", 1)[1]] += request.bytes_sent
    return sent


def _orbax_restored(path: Path) -> Any:
    """What Orbax's own restore gives, as host values."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(path)


def _assert_values(loaded: Any, restored: Any) -> None:
    """`loaded` holds Orbax's restored values (its scalars come back as 0-d arrays)."""
    mine, orbax = (jax.tree_util.tree_flatten_with_path(tree)[0] for tree in (loaded, restored))
    assert [path for path, _ in mine] == [path for path, _ in orbax]
    for (path, value), (_, want) in zip(mine, orbax, strict=True):
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(want), jax.tree_util.keystr(path)
        )


def test_an_ocdbt_checkpoint_on_the_hub(hub: HubServer, tmp_path: Path) -> None:
    """The tree is Orbax's metadata's, read in a few requests; a slice reads only its
    chunks; `load` reads each stored byte at most once and gives Orbax's values."""
    local = _chunked_save(tmp_path / "ckpt", _layers(20))
    hub.commit("org/jax", _files(local, "ckpt"))
    hub.clear_log()
    tree = lazyckpt.open("hf://org/jax/ckpt")
    opened = len(hub.log)
    assert opened <= 8, [request.path for request in hub.log]
    assert sum(_served(hub).values()) < 64 << 10  # its b-tree (20 KiB), none of 1.1 MiB of arrays

    with ocp.PyTreeCheckpointer() as checkpointer:
        saved = checkpointer.metadata(local).item_metadata.tree
    for key, leaf in lazyckpt.leaves(tree):
        if isinstance(leaf, LazyArray):
            meta = saved["embed"] if key == "embed" else saved["params"][key.split("/")[1]]["w"]
            assert (leaf.shape, leaf.dtype) == (tuple(meta.shape), meta.dtype), key
    assert tree["embed"].chunks != tree["embed"].shape

    hub.clear_log()
    rows = tree["embed"][20:40].get()
    np.testing.assert_array_equal(rows, _layers(20)["embed"][20:40])
    chunks = stored_chunk_bytes(local, tree["embed"][20:40])
    assert chunks <= sum(_served(hub).values()) <= chunks + (32 << 10)  # its chunks, no others

    hub.clear_log()
    loaded = lazyckpt.load(tree)
    sizes = {file.name: file.stat().st_size for file in local.rglob("d/*")}
    for name, sent in _served(hub).items():
        assert sent <= sizes[name], name
    # tensorstore asks again for the manifest at each array's open: answered as pinned.
    assert not any("manifest.ocdbt" in request.path for request in hub.log)
    _assert_values(loaded, _orbax_restored(local))


def test_opening_costs_the_same_requests_for_many_arrays(hub: HubServer, tmp_path: Path) -> None:
    """4 arrays or 400 (of 4 KiB: not inline in the b-tree, whose nodes stay small)."""
    for count in (4, 400):
        local = orbax_save(tmp_path / f"ckpt_{count}", _layers(count, side=32))
        hub.commit("org/jax", _files(local, f"ckpt_{count}"))
    counts = []
    for count in (4, 400):
        hub.clear_log()
        tree = lazyckpt.open(f"hf://org/jax/ckpt_{count}")
        assert len(tree["params"]) == count
        counts.append(len(hub.log))
    assert counts[0] == counts[1], counts


def test_files_in_the_cache_are_read_from_disk(hub: HubServer, tmp_path: Path) -> None:
    """A checkpoint the cache holds part of: those files are never asked for."""
    import huggingface_hub

    local = _chunked_save(tmp_path / "ckpt", _layers(3))
    hub.commit("org/jax", _files(local, "ckpt"))
    data_file = max(local.rglob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
    cached = ["_METADATA", "manifest.ocdbt", data_file.relative_to(local).as_posix()]
    for name in cached:
        huggingface_hub.hf_hub_download("org/jax", f"ckpt/{name}")
    hub.clear_log()
    tree = lazyckpt.open("hf://org/jax/ckpt")
    _assert_values(lazyckpt.load(tree), _orbax_restored(local))
    asked = {request.path.split("/ckpt/", 1)[-1] for request in hub.log}
    assert not asked & set(cached), asked
    assert any(name.startswith("d/") for name in asked)  # the root's b-tree, not cached


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_reads_as_from_disk(
    hub: HubServer, tmp_path: Path, mesh: jax.sharding.Mesh, layout: str
) -> None:
    tree = rich_tree(mesh)
    if layout in ("standard_checkpointer", "v1_api"):  # (they refuse strings and scalars)
        tree = lazyckpt.select(tree, lambda _, v: isinstance(v, jax.Array | np.ndarray))
    local = LAYOUTS[layout](tmp_path / "ckpt", tree)
    hub.commit("org/jax", _files(local, "ckpt"))
    remote = lazyckpt.open("hf://org/jax/ckpt")
    assert structure(remote) == structure(lazyckpt.open(local))
    assert_loaded(lazyckpt.load(remote), expected(tree))
    assert lazyckpt.verify(remote).ok  # (a folder per array is listed from the Hub's files)


def test_a_legacy_msgpack_checkpoint(hub: HubServer, tmp_path: Path) -> None:
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4), "n": 3}
    local = _legacy_checkpoint(tmp_path / "ckpt", tree, aggregated={"b"})
    hub.commit("org/jax", _files(local, "ckpt"))
    assert_loaded(lazyckpt.load(lazyckpt.open("hf://org/jax/ckpt")), expected(tree))


def _manager_root(root: Path) -> dict[int, dict[str, Any]]:
    """Two steps of a CheckpointManager (Orbax's default names), with a JSON item."""
    trees = {step: {"w": np.full((4, 4), step, np.float32)} for step in (1, 2)}
    with ocp.CheckpointManager(root) as manager:
        for step, tree in trees.items():
            items = {"state": ocp.args.StandardSave(tree), "meta": ocp.args.JsonSave({"s": step})}
            manager.save(step, args=ocp.args.Composite(**items))
    return trees


def test_a_checkpoint_manager_root_on_the_hub(hub: HubServer, tmp_path: Path) -> None:
    trees = _manager_root(tmp_path / "run")
    hub.commit("org/jax", _files(tmp_path / "run", "run"))
    root = "hf://org/jax/run"
    assert lazyckpt.steps(root) == [1, 2]
    assert lazyckpt.items(root) == {"meta": "json", "state": "pytree"}
    assert_loaded(lazyckpt.load(lazyckpt.open(root, item="state")), expected(trees[2]))
    first = lazyckpt.open(root, step=1, item="state")
    np.testing.assert_array_equal(first["w"].get(), trees[1]["w"])
    assert lazyckpt.open(root, step=1, item="meta") == {"s": 1}


def test_plain_https_reads_the_names_the_format_gives(hub: HubServer, tmp_path: Path) -> None:
    """Without a listing: a PyTree folder and a step folder open; a root's step opens
    by its number; listing a root's steps is a clear error."""
    local = _chunked_save(tmp_path / "ckpt", _layers(3))
    trees = _manager_root(tmp_path / "run")
    for name, data in {**_files(local, "ckpt"), **_files(tmp_path / "run", "run")}.items():
        hub.add_plain_file(name, data)
    tree = lazyckpt.open(hub.plain_url("ckpt"))
    _assert_values(lazyckpt.load(tree), _orbax_restored(local))
    assert lazyckpt.items(hub.plain_url("run/1")) == {"meta": "json", "state": "pytree"}
    assert lazyckpt.items(hub.plain_url("run"), step=2) == {"meta": "json", "state": "pytree"}
    step = lazyckpt.open(hub.plain_url("run"), step=1, item="state")
    np.testing.assert_array_equal(step["w"].get(), trees[1]["w"])
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="plain HTTP has no listing"):
        lazyckpt.steps(hub.plain_url("run"))
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match=r"no step folder .*/run/7"):
        lazyckpt.open(hub.plain_url("run"), step=7)


def _damaged(local: Path, damage: str) -> str:
    """Damage a copy of the checkpoint at `local`: remove a `d/` file of its arrays, or
    cut its manifest short; the damaged file's name."""
    if damage == "missing data file":
        victim = max(local.rglob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
        victim.unlink()
    else:
        victim = local / "manifest.ocdbt"
        victim.write_bytes(victim.read_bytes()[:40])
    return victim.name


def _failure(action: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(lazyckpt.LazyckptError) as caught:
        action()
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize("damage", ["missing data file", "manifest cut short"])
def test_a_damaged_repository_fails_as_on_disk(hub: HubServer, tmp_path: Path, damage: str) -> None:
    local = orbax_save(tmp_path / "ckpt", _layers(3))
    _damaged(local, damage)
    hub.commit("org/jax", _files(local, "ckpt"))

    def read(path: str) -> None:
        lazyckpt.load(lazyckpt.open(path))

    on_disk = _failure(lambda: read(str(local)))
    on_hub = _failure(lambda: read("hf://org/jax/ckpt"))
    assert on_hub[0] is on_disk[0] is lazyckpt.CorruptCheckpointError
    # The same words, naming the checkpoint where it is.
    remote_words = re.sub(r"\S*ckpt\S*", "PATH", on_hub[1]).replace("local file ", "")
    local_words = re.sub(r"\S*ckpt\S*", "PATH", on_disk[1]).replace("local file ", "")
    assert remote_words == local_words, (on_hub[1], on_disk[1])


@pytest.mark.parametrize("name", ["manifest.ocdbt", "data file"])
def test_a_listed_file_the_server_answers_404_for_is_named(
    hub: HubServer, tmp_path: Path, name: str
) -> None:
    """A file the Hub lists at the commit whose object is missing (404 at `resolve/`)
    is named with the 404, not taken for absent: a missing manifest.ocdbt was read as
    a folder-per-array layout, and reported as a zarr header missing from a local copy."""
    local = orbax_save(tmp_path / "ckpt", _layers(3))
    commit = hub.commit("org/jax", _files(local, "ckpt"))
    if name == "data file":
        victim = max(local.rglob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
        name = victim.relative_to(local).as_posix()
    hub.fail_next(100, 404, retry_after=None, path_prefix=f"/org/jax/resolve/{commit}/ckpt/{name}")
    with pytest.raises(
        lazyckpt.CheckpointNotFoundError,
        match=rf"^hf://org/jax@{commit[:7]}/ckpt/{re.escape(name)} \(org/jax at main, commit "
        rf"{commit[:12]}\): the Hub lists this file at the commit, but its server answered "
        r"HTTP 404: the file's stored object is missing there\. Try again later",
    ):
        lazyckpt.load(lazyckpt.open("hf://org/jax/ckpt"))


def test_what_the_client_refuses_reaches_the_caller(hub: HubServer, tmp_path: Path) -> None:
    """A server that fails every attempt, and a file replaced after `open` (at a plain
    URL): lazyckpt's own errors, not tensorstore's, through the relay."""
    local = _chunked_save(tmp_path / "ckpt", _layers(3))
    for name, data in _files(local, "ckpt").items():
        hub.add_plain_file(name, data)
    tree = lazyckpt.open(hub.plain_url("ckpt"))
    hub.fail_next(100, 500)
    with pytest.raises(lazyckpt.StorageAccessError, match="HTTP 500"):
        tree["embed"][:4].get()
    hub.clear_faults()
    victim = max(local.rglob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
    name = victim.relative_to(tmp_path).as_posix()
    tree = lazyckpt.open(hub.plain_url("ckpt"))
    tree["embed"][:1].get()  # (pins the data file's version)
    hub.add_plain_file(name, victim.read_bytes()[::-1])
    with pytest.raises(lazyckpt.CheckpointChangedError):
        tree["embed"][100:].get()


@pytest.mark.parametrize("ocdbt", [True, False])
def test_uncompressed_chunks_that_fill_whole_windows(
    hub: HubServer, tmp_path: Path, ocdbt: bool
) -> None:
    """Raw chunks of 4 MiB, decoded by lazyckpt in windows that end where the chunk
    does: the read past its end (a HEAD in OCDBT, a 416 in a folder) is its end, as
    on disk."""
    tree = {"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}
    local = handler_save(use_ocdbt=ocdbt, use_compression=False)(tmp_path / "ckpt", tree)
    hub.commit("org/jax", _files(local, "ckpt"))
    remote = lazyckpt.open("hf://org/jax/ckpt")
    np.testing.assert_array_equal(lazyckpt.load(remote)["w"], tree["w"])
    np.testing.assert_array_equal(remote["w"][500:510].get(), tree["w"][500:510])
    assert lazyckpt.verify(remote).ok


def test_answers_stream_in_pieces(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks that tensorstore reads whole go through the relay a piece at a time (a
    piece of 64 KiB here): each piece held while it is sent, no cap on the file."""
    monkeypatch.setattr(relay, "_PIECE", 64 << 10)
    tree = {"w": np.random.default_rng(0).standard_normal((512, 1024), dtype=np.float32)}
    local = _legacy_checkpoint(tmp_path / "ckpt", tree, aggregated=set())  # 512 KiB chunks
    hub.commit("org/jax", _files(local, "ckpt"))
    hub.clear_log()
    np.testing.assert_array_equal(lazyckpt.open("hf://org/jax/ckpt")["w"].get(), tree["w"])
    pieces = [r for r in hub.log if r.server == "cdn" and "/w/" in r.path and r.status == 206]
    assert len(pieces) > 8 and all(r.bytes_sent <= 64 << 10 for r in pieces)


def test_the_relay_refuses_paths_out_of_the_folder(hub: HubServer) -> None:
    hub.add_plain_file("ckpt/_METADATA", b"{}")
    hub.add_plain_file("elsewhere/secret.txt", b"secret")
    owner = type("Owner", (), {})()
    base = relay.address(hub.plain_url("ckpt"), owner)
    hub.clear_log()
    for key in ("..%2Felsewhere%2Fsecret.txt", "a%2F..%2F..%2Felsewhere%2Fsecret.txt", "%2Fx"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + key, timeout=30)
        refused.value.close()
        assert refused.value.code == 403
    assert hub.log == []
    with urllib.request.urlopen(base + "_METADATA", timeout=30) as answer:
        assert answer.read() == b"{}"
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(base.replace(base.split("/")[3], "0" * 32) + "_METADATA")
    wrong.value.close()
    assert wrong.value.code == 404


def test_failures_that_are_not_lazyckpts_are_told_not_retried(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure in the relay that is no LazyckptError (an OSError of the cache) is
    kept as a StorageAccessError and answered once: tensorstore does not retry it."""
    local = _chunked_save(tmp_path / "ckpt", _layers(3))
    hub.commit("org/jax", _files(local, "ckpt"))
    tree = lazyckpt.open("hf://org/jax/ckpt")
    calls: list[tuple[str, str | None]] = []

    def broken(files: object, key: str, asked: str | None) -> relay.RelayReply:
        calls.append((key, asked))
        raise PermissionError(13, "Permission denied", "/cache/blob")

    monkeypatch.setattr(relay, "serve", broken)
    with pytest.raises(lazyckpt.StorageAccessError, match="Permission denied"):
        tree["embed"][:4].get()
    assert calls and len(set(calls)) == len(calls)  # (each read asked once)


def test_an_http_proxy_never_sees_the_relay(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensorstore's client honours `http_proxy`: the relay's address is kept out of it
    (`no_proxy`), or every read would go to the proxy with the relay's secret."""
    local = _chunked_save(tmp_path / "ckpt", _layers(3))
    hub.commit("org/jax", _files(local, "ckpt"))
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # (nothing listens there)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    tree = lazyckpt.open("hf://org/jax/ckpt")
    np.testing.assert_array_equal(tree["embed"][:4].get(), _layers(3)["embed"][:4])
    assert "127.0.0.1" in os.environ["no_proxy"].split(",")


def _weights(count: int) -> dict[str, Any]:
    """`count` float32 weights of 1 to 2 MiB (one zstd chunk each, as Orbax saves them),
    one whose first half is zeros and second half random bits (which zstd stores as
    they are, in blocks a few bytes longer), a small one and a scalar."""
    rng = np.random.default_rng(1)
    tree: dict[str, Any] = {
        f"w{i}": rng.standard_normal((256 + 32 * i, 1024), dtype=np.float32) for i in range(count)
    }
    zeros_first = rng.integers(0, 2**32, (512, 1024), dtype=np.uint32)
    zeros_first[:256] = 0
    return {**tree, "zeros_first": zeros_first, "bias": np.ones(16, np.float32), "step": 3}


def _data_requests(hub: HubServer) -> list[Any]:
    """The ranged reads of data files (`d/`) the server answered since its log was
    cleared (the CDN's, after the Hub's redirects)."""
    return [r for r in hub.log if "/d/" in r.path and r.status == 206]


def _stored_values(local: Path, tree: Any) -> int:
    """Stored bytes of every chunk of the arrays of `tree` that lie in data files."""
    return sum(
        stored_chunk_bytes(local, leaf)
        for _, leaf in lazyckpt.leaves(tree)
        if isinstance(leaf, LazyArray) and leaf.nbytes > 64
    )


def test_a_whole_tree_comes_in_a_few_large_ranges(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load` of a whole tree reads its chunks' byte ranges in the data files straight
    into the results: neighbours together, in as many requests as connections (two
    here) per data file at most, each stored byte once; the values are Orbax's,
    decoded in place (where the values decoded from its zeros reach its random bits'
    stored bytes, those are copied out ahead of zstd)."""
    from lazyckpt._engine import decode

    local = orbax_save(tmp_path / "ckpt", _weights(8))
    hub.commit("org/jax", _files(local, "ckpt"))
    tree = lazyckpt.open("hf://org/jax/ckpt")
    copies: list[int] = []
    copy_ahead = decode._Tail.copy_ahead

    def counted(tail: Any) -> None:
        copies.append(1)
        copy_ahead(tail)

    monkeypatch.setattr(decode._Tail, "copy_ahead", counted)
    hub.clear_log()
    with lazyckpt.network_options(connections=2):
        loaded = lazyckpt.load(tree)
    _assert_values(loaded, _orbax_restored(local))
    assert copies  # (`zeros_first`)
    reads = _data_requests(hub)
    files = {r.path.rsplit("/", 1)[1] for r in reads}
    assert len(reads) <= len(files) + 2, [(r.path[-8:], r.range) for r in reads]
    stored = _stored_values(local, tree)
    assert stored <= sum(r.bytes_sent for r in reads) <= stored + len(files) * (64 << 10)
    sizes = {file.name: file.stat().st_size for file in local.rglob("d/*")}
    for name, sent in _served(hub).items():  # (each byte once at most)
        assert sent <= sizes[name], name


def test_uncompressed_chunks_come_straight_into_place(hub: HubServer, tmp_path: Path) -> None:
    """Without compression the stored bytes are the values: each request's body lands
    where they belong, nothing decoded."""
    tree = _weights(4)
    local = handler_save(use_ocdbt=True, use_compression=False)(tmp_path / "ckpt", tree)
    hub.commit("org/jax", _files(local, "ckpt"))
    remote = lazyckpt.open("hf://org/jax/ckpt")
    hub.clear_log()
    with lazyckpt.network_options(connections=2):
        loaded = lazyckpt.load(remote)
    _assert_values(loaded, _orbax_restored(local))
    reads = _data_requests(hub)
    assert len(reads) <= len({r.path for r in reads}) + 2
    assert sum(r.bytes_sent for r in reads) == _stored_values(local, remote)


def test_a_large_chunk_comes_in_parallel_ranges(hub: HubServer, tmp_path: Path) -> None:
    """One chunk of 8 MiB, with 4 connections: four requests of about 2 MiB at once,
    into the one result, by `load` and by `get()`; a view of part of it, in the same
    load, is read as before."""
    tree = {"w": np.random.default_rng(2).standard_normal((2048, 1024), dtype=np.float32)}
    local = orbax_save(tmp_path / "ckpt", tree)
    hub.commit("org/jax", _files(local, "ckpt"))
    remote = lazyckpt.open("hf://org/jax/ckpt")
    hub.clear_log()
    with lazyckpt.network_options(connections=4):
        np.testing.assert_array_equal(lazyckpt.load(remote)["w"], tree["w"])
    reads = _data_requests(hub)
    assert len(reads) == 4
    assert sum(r.bytes_sent for r in reads) == stored_chunk_bytes(local, remote["w"])
    hub.clear_log()
    with lazyckpt.network_options(connections=4):
        np.testing.assert_array_equal(remote["w"].get(), tree["w"])
    assert sorted(r.range for r in _data_requests(hub)) == sorted(r.range for r in reads)
    loaded = lazyckpt.load({"whole": remote["w"], "rows": remote["w"][10:20]})
    np.testing.assert_array_equal(loaded["whole"], tree["w"])
    np.testing.assert_array_equal(loaded["rows"], tree["w"][10:20])


@pytest.mark.parametrize("damage", ["frame header", "data file cut short"])
def test_a_damaged_chunk_read_in_ranges_is_refused(
    hub: HubServer, tmp_path: Path, damage: str
) -> None:
    """Damage that the b-tree cannot see, found as the chunks come in: a chunk whose
    zstd frame is broken names its array; a data file shorter than the b-tree says
    names the file."""
    tree = {"w": np.random.default_rng(3).standard_normal((512, 1024), dtype=np.float32)}
    local = orbax_save(tmp_path / "ckpt", tree)
    victim = max(local.rglob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    if damage == "frame header":
        at = data.index(b"\x28\xb5\x2f\xfd")  # zstd's magic number, at the chunk's start
        data[at : at + 4] = b"\0\0\0\0"
        expected = r"array 'w' chunk \[0, 0\] .* does not start with a zstd frame"
    else:
        del data[len(data) // 2 :]
        expected = r"truncated"
    victim.write_bytes(bytes(data))
    hub.commit("org/jax", _files(local, "ckpt"))
    remote = lazyckpt.open("hf://org/jax/ckpt")
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=expected):
        lazyckpt.load(remote)


def test_a_streamed_chunk_is_located_and_read_once(hub: HubServer, tmp_path: Path) -> None:
    """A chunk larger than a block, streamed (`iter_blocks`, as `stats`, `save` and
    placing on accelerators stream it): no stored byte is asked for twice (its header
    was read alone, by a stream of its own, before the decoding read it again: a
    round trip more a chunk)."""
    rng = np.random.default_rng(3)
    tree = {"w": rng.standard_normal((2048, 1024), dtype=np.float32)}  # one 8 MiB chunk
    local = orbax_save(tmp_path / "ckpt", tree)
    hub.commit("org/jax", _files(local, "ckpt"))
    remote = lazyckpt.open("hf://org/jax/ckpt")
    hub.clear_log()
    streamed = np.empty_like(tree["w"])
    blocks = 0
    for _, index, values in lazyckpt.iter_blocks(remote, memory_budget="4MiB"):
        streamed[index] = values
        blocks += 1
    np.testing.assert_array_equal(streamed, tree["w"])
    assert blocks > 1
    reads = _data_requests(hub)
    spans = sorted(_span(r.range) for r in reads)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), spans
    assert sum(r.bytes_sent for r in reads) < stored_chunk_bytes(local, remote["w"]) + 4096


def _span(header: str) -> tuple[int, int]:
    """A `Range: bytes=a-b` header's half-open span."""
    start, end = header.removeprefix("bytes=").split("-")
    return int(start), int(end) + 1
