"""How tensors are read over HTTP and from buckets: in a few large ranged requests, as
many at once as `NetworkOptions.connections` allows, straight into the result (no
second copy); small neighbours in one request. Asserted by the requests the servers
saw and the bytes they sent, never by times."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

import lazyckpt
from lazyckpt._storage import metrics
from tests.hub_server import HubServer

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[HubServer]:
    """The loopback Hub's plain files (`/plain/...`, with an ETag): a server with no API."""
    with HubServer(tmp_path / "hub") as hub:
        yield hub


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(36)
    return {
        "big": rng.standard_normal((2048, 1024), dtype=np.float32),  # 8 MiB
        "norm.a": np.arange(256, dtype=np.float32),
        "norm.b": np.arange(256, dtype=np.float32) * 2,
        "norm.c": np.ones(300, dtype=np.float16),
    }


def ranges(hub: HubServer, name: str) -> list[tuple[int, int]]:
    """The byte ranges `[first, last + 1)` asked of `name`, in order asked."""
    found = []
    for entry in hub.log:
        if entry.path.endswith(name) and entry.range:
            match = re.fullmatch(r"bytes=(\d+)-(\d+)", entry.range)
            assert match, entry.range
            found.append((int(match[1]), int(match[2]) + 1))
    return sorted(found)


def opened(hub: HubServer, values: dict[str, np.ndarray]) -> tuple[Any, int]:
    """The file served at a plain URL, opened; and where its data starts."""
    data = save(values)
    url = hub.add_plain_file("m/model.safetensors", data)
    tree = lazyckpt.open(url, flat=True)
    return tree, 8 + int.from_bytes(data[:8], "little")


def test_a_large_tensor_is_a_few_large_requests(plain: HubServer) -> None:
    values = tensors()
    tree, _ = opened(plain, values)
    plain.clear_log()
    with lazyckpt.network_options(request_bytes=2 * MiB):
        loaded = lazyckpt.load(tree["big"], memory_budget=256 * MiB)
    np.testing.assert_array_equal(loaded, values["big"])
    asked = ranges(plain, "model.safetensors")
    start = tree["big"].stored.start
    # 8 MiB in 2 MiB ranges, back to back: each byte asked for once.
    assert asked == [(start + i * 2 * MiB, start + (i + 1) * 2 * MiB) for i in range(4)]
    assert sum(e.bytes_sent for e in plain.log) == 8 * MiB


def test_requests_share_the_budget_among_the_connections(plain: HubServer) -> None:
    """A request is the memory budget shared among the connections (at least 1 MiB):
    every connection has one in flight, and no more is in flight than the budget."""
    values = tensors()
    tree, _ = opened(plain, values)
    for budget, connections, size in ((16 * MiB, 4, 4 * MiB), (8 * MiB, 16, MiB)):
        plain.clear_log()
        with lazyckpt.network_options(connections=connections):
            loaded = lazyckpt.load(tree["big"], memory_budget=budget)
        np.testing.assert_array_equal(loaded, values["big"])
        asked = ranges(plain, "model.safetensors")
        assert [b - a for a, b in asked] == [size] * (8 * MiB // size)


def test_a_get_is_cut_among_the_connections(plain: HubServer) -> None:
    values = tensors()
    tree, _ = opened(plain, values)
    plain.clear_log()
    with lazyckpt.network_options(connections=4):
        got = tree["big"][512:].get()  # 6 MiB: four requests of 1.5 MiB, at once
    np.testing.assert_array_equal(got, values["big"][512:])
    asked = ranges(plain, "model.safetensors")
    assert [b - a for a, b in asked] == [6 * MiB // 4] * 4
    assert sum(e.bytes_sent for e in plain.log) == 6 * MiB


def test_small_neighbours_are_one_request_across_small_gaps(plain: HubServer) -> None:
    values = tensors()
    tree, _ = opened(plain, values)
    plain.clear_log()
    small = {k: v for k, v in tree.items() if k.startswith("norm")}
    loaded = lazyckpt.load(small)
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, values[name])
    assert len(ranges(plain, "model.safetensors")) == 1


def test_bytes_land_in_place_with_no_second_copy(plain: HubServer) -> None:
    """A 64 MiB load grows the process by the data and little more: the bodies are
    read into the result arrays themselves (a copy would show as 2x)."""
    rng = np.random.default_rng(0)
    values = {f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(16)}
    url = plain.add_plain_file("big/model.safetensors", save(values))
    probe = (
        "import os, resource, sys, lazyckpt, lazyckpt._open\n"
        f"tree = lazyckpt.open({url!r})\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "loaded = lazyckpt.load(tree)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grown = int(done.stdout.split()[-1])
    data = 64 * MiB
    assert grown < 1.10 * data + 8 * MiB, f"grew by {grown / data:.2f}x the data"


def test_bucket_tensors_are_read_in_large_ranges(s3: Any) -> None:
    values = tensors()
    s3.put_object(Bucket="ckpts", Key="st/model.safetensors", Body=save(values))
    tree = lazyckpt.open("s3://ckpts/st/model.safetensors", flat=True)
    for size in (2 * MiB, 8 * MiB):
        before, read = _s3_reads(), metrics.bytes_read()
        with lazyckpt.network_options(request_bytes=size):
            loaded = lazyckpt.load(tree["big"], memory_budget=256 * MiB)
        np.testing.assert_array_equal(loaded, values["big"])
        # Its ranges, and one look at the file's generation: that it did not change.
        assert _s3_reads() - before == 8 * MiB // size + 1
        assert metrics.bytes_read() - read == 8 * MiB


def _s3_reads() -> int:
    import tensorstore as ts

    total = 0
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/read"):
        if metric["name"] == "/tensorstore/kvstore/s3/read":
            total += sum(int(v.get("value", 0)) for v in metric["values"])
    return total


def test_a_stream_reads_each_byte_once_in_large_ranges(plain: HubServer) -> None:
    """`iter_blocks` (behind `stats`, `convert`, `verify`) reads each block by ranges
    straight into it, as `load` does: each byte once, in requests of 1 MiB or more."""
    values = tensors()
    tree, _ = opened(plain, values)
    plain.clear_log()
    out = np.zeros_like(values["big"])
    for _, index, block in lazyckpt.iter_blocks({"big": tree["big"]}, memory_budget=64 * MiB):
        out[index] = block
    np.testing.assert_array_equal(out, values["big"])
    asked = ranges(plain, "model.safetensors")
    sizes = [b - a for a, b in asked]
    assert sum(sizes) == 8 * MiB and min(sizes) >= MiB, sizes
    assert sum(e.bytes_sent for e in plain.log) == 8 * MiB


def test_safetensors_on_gcs_are_read_in_large_ranges(gcs: str) -> None:
    """gs:// through tensorstore's gcs driver (the emulator): a tensor's ranges land in
    place, each byte read once."""
    import tensorstore as ts

    values = tensors()
    bucket = ts.KvStore.open({"driver": "gcs", "bucket": "ckpts"}).result()
    bucket.write("st/model.safetensors", save(values)).result()
    tree = lazyckpt.open(f"{gcs}/st/model.safetensors", flat=True)
    with lazyckpt.measure() as cost:
        loaded = lazyckpt.load(tree["big"], memory_budget=256 * MiB)
    np.testing.assert_array_equal(loaded, values["big"])
    # One range of 8 MiB (a 256 MiB budget over 32 connections), and a look at the
    # object's generation afterwards (its metadata, under 1 KiB): that it did not change.
    assert cost.requests == 2
    assert 8 * MiB <= cost.bytes_read < 8 * MiB + 4096
    np.testing.assert_array_equal(tree["norm.b"][3:7].get(), values["norm.b"][3:7])
