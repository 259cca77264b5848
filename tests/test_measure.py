"""`lazyckpt.measure`: the bytes and requests a block read, on every backend, checked
against what the file holds and what the servers saw."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save, save_file

import lazyckpt
from tests.hub_server import HubServer
from tests.test_hub import model, up

MiB = 1 << 20


def test_a_selective_load_from_a_local_file_costs_its_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    values = {
        "embed": rng.standard_normal((4096, 256), dtype=np.float32),
        "head": rng.standard_normal((256, 64), dtype=np.float32),
    }
    save_file(values, tmp_path / "model.safetensors")
    tree = lazyckpt.open(tmp_path / "model.safetensors")
    with lazyckpt.measure() as cost:
        head = lazyckpt.load(tree["head"])
        rows = lazyckpt.load(tree["embed"][100:200])
    np.testing.assert_array_equal(head, values["head"])
    np.testing.assert_array_equal(rows, values["embed"][100:200])
    assert cost.bytes_read == values["head"].nbytes + rows.nbytes
    assert cost.requests == 0
    assert cost.seconds > 0
    assert str(cost).startswith("164.0 KiB, no network requests, ")
    assert repr(cost) == f"ReadCost({cost})"


def test_after_the_block_the_cost_stays(tmp_path: Path) -> None:
    save_file({"w": np.ones(1024, np.float32)}, tmp_path / "w.safetensors")
    tree = lazyckpt.open(tmp_path / "w.safetensors")
    with lazyckpt.measure() as cost:
        lazyckpt.load(tree["w"][:10])
        assert cost.bytes_read == 40  # inside the block: so far
    lazyckpt.load(tree["w"])
    assert (cost.bytes_read, cost.requests) == (40, 0)
    assert cost.seconds == cost.seconds


def test_a_cost_counts_from_its_blocks_start(tmp_path: Path) -> None:
    """A cost made before its block, or entered again, counts its block's reads only
    (it counted from `measure()`'s call, and a second block stayed at the first's)."""
    lazyckpt.save(tmp_path / "w.safetensors", {"w": np.ones(10, np.float32)})
    tree = lazyckpt.open(tmp_path / "w.safetensors")
    cost = lazyckpt.measure()
    lazyckpt.load(tree)  # before the block
    with cost:
        pass
    assert cost.bytes_read == 0
    with cost:
        lazyckpt.load(tree)
    assert cost.bytes_read == 40


def test_reads_in_other_threads_count(tmp_path: Path) -> None:
    save_file({"w": np.ones(1024, np.float32)}, tmp_path / "w.safetensors")
    tree = lazyckpt.open(tmp_path / "w.safetensors")
    with lazyckpt.measure() as cost:
        reader = threading.Thread(target=lambda: lazyckpt.load(tree["w"]))
        reader.start()
        reader.join()
    assert cost.bytes_read == 4096


def test_requests_to_the_hub_are_those_the_server_saw(hub: HubServer) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    hub.clear_log()
    with lazyckpt.measure() as opening:
        tree = lazyckpt.open("hf://org/model")
    assert opening.requests == len(hub.log)
    hub.clear_log()
    with lazyckpt.measure() as cost:
        rows = lazyckpt.load(up(tree, 1)[10:20])
        whole = lazyckpt.load(lazyckpt.select(tree, "model/layers/2/**"))
    np.testing.assert_array_equal(rows, tensors["model.layers.1.mlp.up_proj.weight"][10:20])
    assert whole["model"]["layers"]["2"]["mlp"]["up_proj"]["weight"].shape == (64, 32)
    assert cost.requests == len(hub.log) > 0
    assert cost.bytes_read == sum(e.bytes_sent for e in hub.log) == 10 * 32 * 4 + (64 + 1) * 32 * 4
    assert f" in {len(hub.log)} requests, " in str(cost)


def test_a_read_from_the_hub_draws_its_bytes_per_second(hub: HubServer, capsys: Any) -> None:
    tqdm = pytest.importorskip("tqdm")
    files, _ = model()
    hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    with lazyckpt.measure() as cost:
        lazyckpt.load(tree, progress=True)
    last = capsys.readouterr().err.rsplit("\r", 1)[-1]
    done = tqdm.tqdm.format_sizeof(cost.bytes_read, divisor=1024)  # the bar's total: 32.5k
    assert last.startswith("lazyckpt load: 100%|") and f" {done}/{done} [" in last
    assert re.search(r", [\d.]+[kMG]?B/s\]\n$", last)


def test_a_bucket_read_counts_tensorstores_requests(s3: Any) -> None:
    values = {"big": np.arange(2 * MiB, dtype=np.float32)}  # 8 MiB
    s3.put_object(Bucket="ckpts", Key="st/model.safetensors", Body=save(values))
    tree = lazyckpt.open("s3://ckpts/st/model.safetensors", flat=True)
    with lazyckpt.network_options(request_bytes=2 * MiB), lazyckpt.measure() as cost:
        loaded = lazyckpt.load(tree["big"], memory_budget=256 * MiB)
    np.testing.assert_array_equal(loaded, values["big"])
    # Its four ranges, and one look at the file's generation: that it did not change.
    assert (cost.bytes_read, cost.requests) == (8 * MiB, 4 + 1)


@pytest.mark.parametrize(
    ("nbytes", "requests", "seconds", "shown"),
    [
        (12 * MiB, 4, 0.31, "12.0 MiB in 4 requests, 0.31 s, 38.7 MiB/s"),
        (300, 1, 0.002, "300 B in 1 request, 2.0 ms, 146.5 KiB/s"),
        (0, 0, 0.0, "0 B, no network requests, 0.0 ms, 0 B/s"),
    ],
)
def test_a_cost_reads_as_a_sentence(
    nbytes: int, requests: int, seconds: float, shown: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lazyckpt import _measure

    start = (0, 0, 100.0)  # (read by `measure()`, then at the block's start)
    readings = iter([start, start, (nbytes, requests, 100.0 + seconds)])
    monkeypatch.setattr(_measure, "_now", lambda: next(readings))
    with lazyckpt.measure() as cost:
        pass
    assert str(cost) == shown
