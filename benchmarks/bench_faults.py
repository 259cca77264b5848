"""Reads over HTTP against a misbehaving server: how long each takes to end, how many
requests it makes and how much memory it grows by (issue 35).

    python benchmarks/bench_faults.py

Each case runs in a fresh process against `tests/hostile_server.py` on 127.0.0.1, with
a 120 s cap:

- a 503 storm during `load` of 16 tensors of 4 MiB (read in 1 MiB requests): seconds
  and requests until the error;
- an endless chunked `model.safetensors.index.json`: peak RSS growth until refused;
- a range whose body arrives a byte a second: seconds until the error, with
  `timeout=5, retries=2`;
- healthy reads, for the cost of the checks: 200 ranges of 1 MiB, ms a read.

Run with `PYTHONPATH` at an older checkout to compare: on a version without
`lazyckpt.network_options`, the options are left at that version's own.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import machine, peak_bytes, reset_peak, versions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20


def _options(**changes: Any) -> None:
    import lazyckpt

    if hasattr(lazyckpt, "network_options"):
        lazyckpt.network_options(**changes)


def storm() -> dict[str, Any]:
    import numpy as np
    from safetensors.numpy import save

    import lazyckpt
    from tests.hostile_server import HostileServer

    rng = np.random.default_rng(0)
    values = {f"w{i}": rng.standard_normal((4096, 256)).astype(np.float32) for i in range(16)}
    failing = threading.Event()

    def trick(handler: Any, file: Any) -> bool:
        if not failing.is_set():
            return False
        handler.answer(503, {}, b"busy")
        return True

    with HostileServer() as server:
        tree = lazyckpt.open(server.put("model.safetensors", save(values), trick=trick))
        failing.set()
        with lazyckpt.measure() as cost:
            try:
                lazyckpt.load(tree)
                outcome = "loaded"
            except Exception as error:  # noqa: BLE001 - the outcome measured
                outcome = type(error).__name__
            seconds = cost.seconds
            time.sleep(3)  # reads still running after the error
        return {"outcome": outcome, "s": seconds, "requests": cost.requests}


def endless() -> dict[str, Any]:
    import lazyckpt
    import lazyckpt._open  # (jax, imported before the baseline)
    from tests.hostile_server import HostileServer

    def trick(handler: Any, file: Any) -> bool:
        handler.endless_chunks(handler.validators(file))
        return True

    with HostileServer() as server:
        server.put("m/model.safetensors.index.json", b"{}", trick=trick)
        reset_peak()
        baseline, start = peak_bytes(), time.perf_counter()
        try:
            lazyckpt.open(f"{server.url}/m")
            outcome = "opened"
        except Exception as error:  # noqa: BLE001 - the outcome measured
            outcome = type(error).__name__
        return {
            "outcome": outcome,
            "s": time.perf_counter() - start,
            "grown MiB": (peak_bytes() - baseline) / MiB,
        }


def drip() -> dict[str, Any]:
    import numpy as np
    from safetensors.numpy import save

    import lazyckpt
    from tests.hostile_server import HostileServer

    _options(timeout=5, retries=2)

    def trick(handler: Any, file: Any) -> bool:
        wanted = handler.headers.get("Range", "")
        if wanted.startswith("bytes=0-"):
            return False
        start, stop = (int(n) for n in wanted[6:].split("-"))
        head = (
            f"HTTP/1.1 206 Partial Content\r\nContent-Length: {stop + 1 - start}\r\n"
            f"Content-Range: bytes {start}-{stop}/{len(file.data)}\r\nETag: {file.etag}\r\n\r\n"
        )
        handler.drip(head.encode())
        return True

    values = {"w": np.ones((1024, 256), np.float32), "b": np.ones(256, np.float32)}
    with HostileServer() as server:
        tree = lazyckpt.open(server.put("model.safetensors", save(values), trick=trick))
        start = time.perf_counter()
        try:
            tree["w"].get()
            outcome = "read"
        except Exception as error:  # noqa: BLE001 - the outcome measured
            outcome = type(error).__name__
        return {"outcome": outcome, "s": time.perf_counter() - start}


def healthy() -> dict[str, Any]:
    import os

    from lazyckpt._storage.http.range_reads import client
    from tests.hostile_server import HostileServer

    with HostileServer() as server:
        url = server.put("f.bin", os.urandom(8 * MiB))
        reader = client()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            futures = [
                reader.submit(url, reader.read, url, i % 7 * MiB, i % 7 * MiB + MiB)
                for i in range(200)
            ]
            for future in futures:
                future.result()
            best = min(best, time.perf_counter() - start)
        return {"outcome": "read", "ms a read": best * 1000 / 200}


def _child(name: str, queue: Any) -> None:
    queue.put(globals()[name]())


def main() -> None:
    print(machine())
    print(versions())
    context = multiprocessing.get_context("spawn")
    print("| case | outcome | figures |")
    print("|---|---|---|")
    for name in ("storm", "endless", "drip", "healthy"):
        queue = context.Queue()
        process = context.Process(target=_child, args=(name, queue))
        process.start()
        process.join(120)
        if process.is_alive():
            process.kill()
            print(f"| {name} | still running after 120 s (killed) | |")
            continue
        found = queue.get(timeout=5)
        outcome = found.pop("outcome")
        figures = ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in found.items()
        )
        print(f"| {name} | {outcome} | {figures} |")


if __name__ == "__main__":
    main()
