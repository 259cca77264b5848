"""An Orbax checkpoint on the Hugging Face Hub over a wide-area link: lazyckpt reading
it in place against downloading it with huggingface_hub and restoring it with Orbax.

    python benchmarks/bench_hub_orbax.py [--mib 128] [--layers 24] [--repeat 3]
                                         [--latency 60] [--rate 40] [--memory-budget 1GiB]

The checkpoint is written by orbax-checkpoint itself (`PyTreeCheckpointer`: OCDBT and
zarr), a model-like tree of `--layers` layers of four float32 weights and a norm,
`--mib` MiB in all, and committed to the loopback Hub of tests/hub_server.py under
`ckpt/` (its binary files behind the Hub's LFS redirect to a second origin). The Hub
runs in its own process, where each request waits `--latency` ms and each connection's
bodies go no faster than `--rate` MB/s, as in bench_wan.py. Each measurement is a
fresh process with an empty Hugging Face cache; the sides alternate, and each figure
is the median of `--repeat`:

- one array (one layer's largest weight): `lazyckpt.open("hf://org/model/ckpt")`, then
  its `.get()`, against `snapshot_download` of the folder and Orbax's partial restore
  of that array (`PyTreeRestore(..., partial_restore=True)`);
- the whole tree: `lazyckpt.load` (with `--memory-budget`, if given) against
  `snapshot_download` and `PyTreeCheckpointer().restore`.

Requests and bytes are the server's (both origins, redirects included); "re-sent" is
bytes the server sent more than once for the same file. Peak memory is the peak RSS
above the process's baseline just before the operation.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_hub import patch_endpoint
from common import MiB, machine, peak_bytes, reset_peak, rss_bytes, versions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO, FOLDER = "org/model", "ckpt"
WIDTHS = {  # a layer's weights, in multiples of d: 12 d^2 float32 (and a norm of d)
    ("attn", "qkv"): (1, 3),
    ("attn", "out"): (1, 1),
    ("mlp", "up"): (1, 4),
    ("mlp", "down"): (4, 1),
}
RANGE = re.compile(r"bytes=(\d+)-")


def model(mib: int, layers: int) -> dict[str, Any]:
    """`layers` layers of 12 d^2 float32 weights (d a multiple of 8), about `mib` MiB."""
    import numpy as np

    d = max(8, round((mib * MiB / (48 * layers)) ** 0.5 / 8) * 8)
    rng = np.random.default_rng(37)
    tree: dict[str, Any] = {}
    for i in range(layers):
        layer: dict[str, Any] = {"norm": np.ones(d, np.float32)}
        for (block, name), (rows, cols) in WIDTHS.items():
            shape = (rows * d, cols * d)
            layer.setdefault(block, {})[name] = rng.standard_normal(shape, np.float32)
        tree[f"layer_{i:02d}"] = layer
    return tree


def wanted(layers: int) -> tuple[str, str, str]:
    """The one array read: the middle layer's largest weight."""
    return (f"layer_{layers // 2:02d}", "mlp", "up")


def sent(log: list[Any]) -> dict[str, int]:
    """Requests, body bytes, and bytes sent again for a range already sent of a file."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for request in log:
        if request.method == "GET" and request.status in (200, 206) and request.bytes_sent:
            start = 0
            if request.status == 206:
                found = RANGE.match(request.range or "")
                start = int(found.group(1)) if found else 0
            file = request.path.split("?")[0].split(f"/{FOLDER}/", 1)[-1]
            spans.setdefault(file, []).append((start, start + request.bytes_sent))
    total = sum(e.bytes_sent for e in log)
    unique = 0
    for ranges in spans.values():
        reach = 0
        for start, stop in sorted(ranges):
            unique += max(0, stop - max(start, reach))
            reach = max(reach, stop)
    return {"requests": len(log), "bytes": total, "resent": total - unique}


def serve(root: str, args: argparse.Namespace, control: Any, replies: Any) -> None:
    """Write the checkpoint with Orbax, then serve it until told to stop."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from tests.hub_server import HubServer

    tree = model(args.mib, args.layers)
    local = Path(root) / "local"
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(local, tree)
    files = {
        f"{FOLDER}/{file.relative_to(local).as_posix()}": file.read_bytes()
        for file in sorted(local.rglob("*"))
        if file.is_file()
    }
    leaves = jax.tree.leaves(tree)
    one = tree[wanted(args.layers)[0]]["mlp"]["up"]
    facts = {
        "stored": sum(len(data) for data in files.values()),
        "files": len(files),
        "largest": max(len(data) for data in files.values()),
        "arrays": len(leaves),
        "data": sum(leaf.nbytes for leaf in leaves),
        "one": one.nbytes,
        "one_shape": one.shape,
        "check_one": float(one.sum(dtype=np.float64)),
        "check_all": sum(float(leaf.sum(dtype=np.float64)) for leaf in leaves),
    }
    del tree, leaves, one
    with HubServer(Path(root) / "hub") as hub:
        hub.commit(REPO, files)
        del files
        for file in (Path(root) / "hub").rglob("*"):  # hashed now, off the clock
            if file.is_file():
                hub.blob(file)
        hub.latency, hub.rate = args.latency / 1000, args.rate * 1e6
        replies.put((hub.endpoint, facts))
        for command in iter(control.get, "stop"):
            replies.put(sent(hub.log) if command == "log" else hub.clear_log())


def run(
    side: str, case: str, endpoint: str, args: argparse.Namespace, control: Any, replies: Any
) -> dict[str, Any]:
    """One measurement in this (fresh) process: seconds, requests, bytes, peak."""
    import jax
    import numpy as np

    def server(command: str) -> Any:
        control.put(command)
        return replies.get()

    with tempfile.TemporaryDirectory() as cache:
        os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        patch_endpoint(endpoint, cache).HF_TOKEN_PATH = os.path.join(cache, "no-token")
        import gc

        import huggingface_hub
        import orbax.checkpoint as ocp

        import lazyckpt

        for name in lazyckpt.__all__:  # (it loads its modules on first use: not on the clock)
            getattr(lazyckpt, name)
        layer, block, name = wanted(args.layers)
        out: dict[str, Any] = {}
        gc.collect()
        baseline = rss_bytes()
        server("clear")
        reset_peak()
        start = time.perf_counter()
        with lazyckpt.measure() as cost:
            if side == "lazyckpt":
                tree = lazyckpt.open(f"hf://{REPO}/{FOLDER}")
                out["first"] = time.perf_counter() - start
                paused = time.perf_counter()
                out["first_log"] = server("log")
                start += time.perf_counter() - paused  # (the question to the server is off it)
                if case == "one":
                    result = tree[layer][block][name].get()
                else:
                    result = lazyckpt.load(tree, memory_budget=args.memory_budget)
            else:
                folder = huggingface_hub.snapshot_download(REPO, allow_patterns=f"{FOLDER}/*")
                out["first"] = time.perf_counter() - start
                path = Path(folder) / FOLDER
                with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
                    if case == "one":
                        saved = checkpointer.metadata(path).item_metadata.tree
                        item = {layer: {block: {name: saved[layer][block][name]}}}
                        restore_args = {
                            layer: {block: {name: ocp.RestoreArgs(restore_type=np.ndarray)}}
                        }
                        result = checkpointer.restore(
                            path,
                            args=ocp.args.PyTreeRestore(
                                item, restore_args=restore_args, partial_restore=True
                            ),
                        )
                    else:
                        result = checkpointer.restore(path)
        out["seconds"] = time.perf_counter() - start
        out["peak"] = peak_bytes() - baseline
        out["log"] = server("log")
        out["measured"] = {"requests": cost.requests, "bytes": cost.bytes_read}
        if case == "one":
            if side == "orbax":
                result = result[layer][block][name]
            out["check"] = float(np.asarray(result).sum(dtype=np.float64))
        else:
            leaves = jax.tree.leaves(result)
            out["check"] = sum(float(np.asarray(x).sum(dtype=np.float64)) for x in leaves)
        return out


def _child(results: Any, *args: Any) -> None:
    results.put(run(*args))


def in_process(*args: Any) -> dict[str, Any]:
    """`run(*args)` in a fresh process (a `Process`, not a `Pool`: the server's queues
    go along)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_child, args=(results, *args))
    process.start()
    try:
        while True:
            try:
                return results.get(timeout=1)
            except queue.Empty:
                if not process.is_alive():
                    raise RuntimeError(f"the run {args[:2]} died: {process.exitcode}") from None
    finally:
        process.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="checkpoint size, MiB")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency", type=float, default=60, help="ms a request waits")
    parser.add_argument("--rate", type=float, default=40, help="MB/s a connection, at most")
    parser.add_argument("--memory-budget", help="lazyckpt.load's (default: its own)")
    args = parser.parse_args()
    import huggingface_hub

    print(machine())
    print(f"{versions()}, huggingface_hub {huggingface_hub.__version__}")
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as root:
        control, replies = context.Queue(), context.Queue()
        hub = context.Process(target=serve, args=(root, args, control, replies))
        hub.start()
        try:
            endpoint, facts = replies.get(timeout=600)
            print(
                f"checkpoint: {args.layers} layers, {facts['arrays']} arrays, "
                f"{facts['data'] / MiB:,.1f} MiB of float32, {facts['files']} files, "
                f"{facts['stored']:,} bytes stored, the largest {facts['largest'] / MiB:.1f} MiB; "
                f"one array {facts['one_shape']}, "
                f"{facts['one'] / MiB:.1f} MiB; link {args.latency:g} ms, {args.rate:g} MB/s; "
                f"lazyckpt.load's memory_budget {args.memory_budget or 'default'}\n"
            )
            runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for i in range(args.repeat):
                for case in ("one", "whole"):
                    sides = ("lazyckpt", "orbax") if i % 2 == 0 else ("orbax", "lazyckpt")
                    for side in sides:
                        found = in_process(side, case, endpoint, args, control, replies)
                        want = facts["check_one" if case == "one" else "check_all"]
                        if found["check"] != want:
                            raise AssertionError(f"{side} {case}: {found['check']} != {want}")
                        runs.setdefault((side, case), []).append(found)
        finally:
            control.put("stop")
            hub.join(60)
    report(runs, facts)


def report(runs: dict[tuple[str, str], list[dict[str, Any]]], facts: dict[str, Any]) -> None:
    figures = {
        "first": lambda r: r["first"],
        "seconds": lambda r: r["seconds"],
        "requests": lambda r: r["log"]["requests"],
        "bytes": lambda r: r["log"]["bytes"],
        "resent": lambda r: r["log"]["resent"],
        "peak": lambda r: r["peak"],
        "open_requests": lambda r: r.get("first_log", {}).get("requests", 0),
        "open_bytes": lambda r: r.get("first_log", {}).get("bytes", 0),
        "open_resent": lambda r: r.get("first_log", {}).get("resent", 0),
        "measured_requests": lambda r: r["measured"]["requests"],
        "measured_bytes": lambda r: r["measured"]["bytes"],
    }
    median = {
        key: {name: statistics.median(get(r) for r in found) for name, get in figures.items()}
        for key, found in runs.items()
    }
    print(
        "| row | open / download s | total s | requests | transferred | re-sent "
        "| peak above baseline (/ data) | time / lazyckpt |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ours = median["lazyckpt", "one"]
    print(
        f"| lazyckpt `open` alone | {ours['first']:.2f} | | {ours['open_requests']:.0f} "
        f"| {ours['open_bytes'] / MiB:,.2f} MiB | {ours['open_resent'] / MiB:,.2f} MiB | | |"
    )
    rows = (
        ("lazyckpt `open` + one array `.get()`", "lazyckpt", "one"),
        ("`snapshot_download` + Orbax partial restore of it", "orbax", "one"),
        ("lazyckpt `open` + `load` of the whole tree", "lazyckpt", "whole"),
        ("`snapshot_download` + Orbax restore of the whole tree", "orbax", "whole"),
    )
    for label, side, case in rows:
        m = median[side, case]
        data = facts["one" if case == "one" else "data"]
        ratio = m["seconds"] / median["lazyckpt", case]["seconds"]
        print(
            f"| {label} | {m['first']:.2f} | {m['seconds']:.2f} | {m['requests']:.0f} "
            f"| {m['bytes'] / MiB:,.1f} MiB | {m['resent'] / MiB:,.1f} MiB "
            f"| {m['peak'] / MiB:,.1f} MiB ({m['peak'] / data:.2f}x) | {ratio:.2f}x |"
        )
    print(
        "\nlazyckpt.measure() of lazyckpt's runs: "
        + ", ".join(
            f"{case} {median['lazyckpt', case]['measured_requests']:.0f} requests and "
            f"{median['lazyckpt', case]['measured_bytes']:,.0f} bytes"
            for case in ("one", "whole")
        )
    )
    for (side, case), found in sorted(runs.items()):
        print(f"{side} {case}: " + ", ".join(f"{r['seconds']:.2f}" for r in found) + " s")


if __name__ == "__main__":
    main()
