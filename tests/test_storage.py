"""The storage contract: what every backend (`lazyckpt._storage.paths.Storage`) must do, run
against each of them: a local folder, a real S3-compatible server (moto), a Google
Cloud Storage emulator and a folder served over plain HTTP, all on 127.0.0.1. A new
backend joins `BACKENDS` and must pass all of it, as zarr's stores pass its
`StoreTests`. The web backend is read-only: its files are written to the disk behind
the server and found by name (`probes.present`, then `folders.register`), as a
format finds them; the cases that write through the backend skip it, saying why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import lazyckpt
from lazyckpt._storage import folders, probes
from lazyckpt._storage import paths as fs
from lazyckpt._storage.kvstore import Store
from tests.hub_server import HubServer

BACKENDS = ["local", "s3", "gcs", "web"]
_SERVED: dict[str, Path] = {}
"""The web backend's folders, by URL: the disk folder the server answers from."""


def _refuses_writes(root: str) -> bool:
    """Whether `root` is the web backend's, which is read-only: every write refused."""
    if root not in _SERVED:
        return False
    for write in (fs.delete_folder, fs.probe_write, fs.make_folder):
        with pytest.raises(lazyckpt.StorageAccessError, match="reads over HTTP but does not"):
            write(fs.join(root, "next"))
    return True


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(tmp_path_factory.mktemp("web")) as server:
        yield server


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty folder on the backend, named for the test."""
    name = request.node.name.replace("[", "-").rstrip("]")
    if request.param == "local":
        return str(tmp_path)
    if request.param == "web":
        server: HubServer = request.getfixturevalue("web")
        _SERVED[server.plain_url(name)] = server.plain_root / name
        return server.plain_url(name)
    bucket = request.getfixturevalue("s3") and "s3://ckpts" if request.param == "s3" else None
    if request.param == "gcs":
        bucket = request.getfixturevalue("gcs")
    return f"{bucket}/contract/{name}"


def _on_disk(path: str) -> str:
    """Where a file of the web backend's folder is written (the disk behind the
    server); any other backend's path as it is."""
    for url, folder in _SERVED.items():
        if path == url or path.startswith(url + "/"):
            return str(folder) + path[len(url) :]
    return path


def _fill(root: str) -> None:
    if root in _SERVED:  # (read-only: written behind the server, then found by name)
        _fill(_on_disk(root))
        names = ["a.txt", "sub/b.bin"]
        found = probes.present(root, [*names, "absent"])
        folders.register(root, folders.Site(tuple(sorted(found)), asked=(*names, "absent")))
        return
    fs.make_folder(root)
    fs.make_folder(fs.join(root, "sub"))
    fs.write_bytes(fs.join(root, "a.txt"), b"alpha")
    fs.write_bytes(fs.join(fs.join(root, "sub"), "b.bin"), bytes(range(256)))


class TestStorageContract:
    def test_paths_compose(self, root: str) -> None:
        child = fs.join(root, "x")
        assert fs.basename(child) == "x" and fs.dirname(child) == root
        assert fs.storage(root) is fs.storage(child)
        assert fs.normalize(root) == root

    def test_written_files_are_read_listed_and_walked(self, root: str) -> None:
        with fs.session():
            _fill(root)
            assert fs.read_bytes(fs.join(root, "a.txt")) == b"alpha"
            assert fs.read_text(fs.join(root, "a.txt")) == "alpha"
            assert fs.listdir(root) == ["a.txt", "sub"]
            assert fs.isdir(root) and fs.isdir(fs.join(root, "sub"))
            assert fs.isfile(fs.join(root, "a.txt")) and not fs.isfile(fs.join(root, "sub"))
            assert fs.exists(fs.join(root, "sub")) and not fs.exists(fs.join(root, "nope"))
            assert sorted(fs.walk_files(root)) == ["a.txt", "sub/b.bin"]

    def test_missing_files_read_as_none(self, root: str) -> None:
        _fill(root)
        assert fs.read_bytes(fs.join(root, "absent")) is None
        assert fs.read_text(fs.join(fs.join(root, "sub"), "absent.json")) is None
        assert fs.read_bytes(fs.join(root, "sub")) is None  # a folder is no file

    def test_reads_are_bounded_and_text_checked(self, root: str) -> None:
        _fill(root)
        # (over HTTP a file past its limit is the server's fault: refused as too large)
        refused, said = (
            (lazyckpt.TooLargeError, r"b.bin holds 256 bytes, over the 100")
            if root in _SERVED
            else (lazyckpt.CorruptCheckpointError, r"b.bin holds more than 100 bytes")
        )
        with pytest.raises(refused, match=said):
            fs.read_bytes(fs.join(fs.join(root, "sub"), "b.bin"), limit=100)
        with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"b.bin is not UTF-8 text"):
            fs.read_text(fs.join(fs.join(root, "sub"), "b.bin"))

    def test_delete_folder_removes_everything(self, root: str) -> None:
        if _refuses_writes(root):
            return
        _fill(root)
        fs.delete_folder(root)
        with fs.session():
            assert not fs.exists(root) and not fs.isdir(root)
            assert not fs.isfile(fs.join(root, "a.txt"))

    def test_probe_write_leaves_nothing(self, root: str) -> None:
        if _refuses_writes(root):
            return
        _fill(root)
        before = sorted(fs.walk_files(fs.dirname(root)))
        fs.probe_write(fs.join(root, "next"))
        assert sorted(fs.walk_files(fs.dirname(root))) == before

    def test_generation_changes_when_metadata_is_rewritten(self, root: str) -> None:
        if root in _SERVED:
            # (its generation is a Hub commit's, pinned when listed; a probed folder's is ())
            pytest.skip("a folder over plain HTTP has no generation to change")
        _fill(root)
        fs.write_bytes(fs.join(root, "_METADATA"), b"{}")
        first = fs.generation(root)
        assert fs.generation(root) == first
        fs.write_bytes(fs.join(root, "_METADATA"), b'{"tree_metadata": {}}')
        assert fs.generation(root) != first

    def test_kvstore_spec_reads_the_same_files(self, root: str) -> None:
        if root in _SERVED:
            pytest.skip("read over HTTP by lazyckpt's client (Store.open), not a tensorstore spec")
        _fill(root)
        store = ts.KvStore.open(fs.kvstore_spec(root)).result()
        assert store.read("a.txt").result().value == b"alpha"
        assert store.read("sub/b.bin").result().value == bytes(range(256))

    def test_a_checkpoint_saves_and_opens(self, root: str, request: pytest.FixtureRequest) -> None:
        if "gcs" in request.node.name:
            # The emulator's object generations are not ones tensorstore's OCDBT driver
            # accepts ("Malformed StorageGeneration"): OCDBT on gs:// is not exercised.
            pytest.skip("OCDBT on the GCS emulator")
        value = np.arange(24, dtype=np.float32).reshape(4, 6)
        path = fs.join(root, "ckpt")
        saved = lazyckpt.save(_on_disk(path), {"w": value, "note": "hi"})
        opened = lazyckpt.open(path if root in _SERVED else saved)
        assert opened["note"] == "hi"
        np.testing.assert_array_equal(opened["w"][1:3].get(), value[1:3])
        assert lazyckpt.verify(opened, progress=False).ok

    def test_a_store_reads_byte_ranges_by_name(self, root: str) -> None:
        """What formats and the engine ask of any backend's `Store`: a file's bytes by
        name, whole, in a range, and landed in a buffer of theirs."""
        _fill(root)
        store = Store.open(fs.join(root, "sub"), ocdbt=False)
        assert bytes(store.read("b.bin").result().value) == bytes(range(256))
        assert bytes(store.read("b.bin", slice(10, 20)).result().value) == bytes(range(10, 20))
        buffer = bytearray(16)
        answer = store.read_into("b.bin", 100, memoryview(buffer)).result()
        assert answer.state == "value" and buffer == bytes(range(100, 116))
        assert store.read("absent.bin").result().state == "missing"


def test_every_backend_implements_the_protocol() -> None:
    members: Any = [
        name for name in dir(fs.Storage) if not name.startswith("_") and name != "atomic_rename"
    ]
    for backend in (fs.storage("/tmp"), fs.storage("s3://b/p"), fs.storage("http://h/p")):
        missing = [name for name in members if not callable(getattr(backend, name, None))]
        assert not missing and isinstance(backend.atomic_rename, bool), (backend, missing)
