"""Remote reads straight into place (over HTTP, from the Hub, in buckets) that go
wrong: a file gone or truncated after open, options changed while reads run, an open
that fails half way. Each is an error, never values left uninitialised or a hang."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from lazyckpt._storage import network
from tests.hub_server import HubServer
from tests.test_hub import SHARDS, model, up


@pytest.mark.parametrize("read", ["get", "load"])
def test_a_hub_shard_gone_after_open_is_an_error_not_garbage(hub: HubServer, read: str) -> None:
    """A shard deleted after open is an error naming it (the shards' headers were read
    before the tree's store was made, and what they saw is its own: a 404 afterwards is
    a change, and a "missing" answer is never taken for the bytes)."""
    files, tensors = model()
    sha = hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    os.unlink(hub.root / "org/model" / sha / SHARDS[2])
    with pytest.raises(lazyckpt.LazyckptError, match=SHARDS[2]):
        values = up(tree, 2).get() if read == "get" else lazyckpt.load(up(tree, 2))
        # (reached only where no error was raised: what came back)
        assert np.array_equal(values, tensors["model.layers.2.mlp.up_proj.weight"])


def test_a_bucket_model_truncated_after_open_fails_without_hanging(s3: Any) -> None:
    """A bucket file truncated after open: `get` and `load` say it changed. The error
    is made (`read_error` asks the bucket whether it changed, and waits) on lazyckpt's
    threads; on tensorstore's, that wait never ended."""
    values = {"w": np.arange(1 << 20, dtype=np.float32)}
    url = lazyckpt.save("s3://ckpts/review-truncated", values, format="safetensors")
    tree = lazyckpt.open(url)
    key = "review-truncated/model.safetensors"
    body = s3.get_object(Bucket="ckpts", Key=key)["Body"].read()
    s3.put_object(Bucket="ckpts", Key=key, Body=body[: len(body) // 2])
    outcomes: list[BaseException | None] = []

    def reads() -> None:
        for read in (lambda: tree["w"].get(), lambda: lazyckpt.load(tree)):
            try:
                read()
                outcomes.append(None)
            except Exception as error:  # noqa: BLE001 - looked at below
                outcomes.append(error)

    thread = threading.Thread(target=reads, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"hung after {outcomes}"
    assert all(isinstance(o, lazyckpt.CheckpointChangedError) for o in outcomes), outcomes


def test_requests_are_never_slivers_of_a_run(tmp_path: Path) -> None:
    """Each run of bytes is cut on its own, into equal requests of at least 1 MiB: 8 rows
    of 1 MiB + 4 bytes are 8 requests (they were 16, of 4, 8, 12... bytes and 1 MiB
    less those, a round trip each, where jobs were filled across runs)."""
    from safetensors.numpy import save

    from tests.test_http_reads import ranges

    values = {"big": np.arange(8 * 300_000, dtype=np.float32).reshape(8, 300_000)}
    with HubServer(tmp_path / "hub") as server:
        url = server.add_plain_file("m/model.safetensors", save(values))
        tree = lazyckpt.open(url, flat=True)
        server.clear_log()
        with lazyckpt.network_options(request_bytes=1 << 20):
            got = lazyckpt.load(tree["big"][:, :262_145], memory_budget=64 << 20)
        np.testing.assert_array_equal(got, values["big"][:, :262_145])
        sizes = [high - low for low, high in ranges(server, "model.safetensors")]
    assert min(sizes) >= 1 << 20 and len(sizes) == 8, sorted(sizes)


def test_changing_connections_while_reads_run_fails_no_read(tmp_path: Path) -> None:
    """`connections` changed while reads run: the old threads finish what they run, and
    no read is handed to a pool another thread shut down (that was a `RuntimeError`
    out of a plain `get`)."""
    from safetensors.numpy import save

    values = {f"t{i}": np.full((300_000,), i, dtype=np.float32) for i in range(8)}
    before = network.options().connections
    errors: list[str] = []
    stop = threading.Event()
    with HubServer(tmp_path / "hub") as server:
        tree = lazyckpt.open(server.add_plain_file("m/model.safetensors", save(values)), flat=True)

        def reader() -> None:
            while not stop.is_set():
                for key in values:
                    try:
                        tree[key][:200_000].get()
                    except Exception as error:  # noqa: BLE001 - looked at below
                        errors.append(repr(error)[:200])
                        stop.set()

        def flipper() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                lazyckpt.network_options(connections=1 + n % 3)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        threads.append(threading.Thread(target=flipper))
        for thread in threads:
            thread.start()
        stop.wait(5)
        stop.set()
        for thread in threads:
            thread.join()
        lazyckpt.network_options(connections=before)
    assert errors == []


def test_a_failed_open_leaves_no_early_reads(hub: HubServer) -> None:
    """The shards' first 64 KiB, read while the index is, are dropped when the open
    fails (the index does not parse): they would be kept for the life of the process,
    up to 256 x 64 KiB a folder, for each commit opened."""
    from lazyckpt._storage import probes

    files, _ = model()
    files["model.safetensors.index.json"] = b"{not json"
    hub.commit("org/broken", files)
    with pytest.raises(lazyckpt.CorruptCheckpointError):
        lazyckpt.open("hf://org/broken")
    assert [key for key in probes._AHEAD if "org/broken" in key[0]] == []
