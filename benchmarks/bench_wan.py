"""A model on the Hugging Face Hub over a wide-area link: lazyckpt against downloading
it first with huggingface_hub (the baseline of issue 36).

    python benchmarks/bench_wan.py [--repeat 3] [--links 60:40,10:200,150:20]

The loopback Hub of tests/hub_server.py runs in its own process, where each request
waits one round trip (`latency`) and each connection's bodies go no faster than a cap
(`rate`), as a CDN serves one TCP stream: loopback alone hides both. The model is
256 MiB: 4 shards of 16 float32 tensors of 4 MiB. Each measurement is a fresh process
with an empty Hugging Face cache; the runs of the two sides alternate, and each figure
is the median of `--repeat`.

- whole model: `lazyckpt.load("hf://org/model")` against `snapshot_download` and
  `safetensors.numpy.load_file` of each shard;
- one layer (4 tensors, 16 MiB of a 64 MiB shard): `lazyckpt.load` of them against
  `hf_hub_download` of the shard and `safe_open(...).get_tensor`.

It prints seconds, requests (lazyckpt's), peak memory above the baseline over the data
read, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_hub import patch_endpoint
from common import machine, measure, versions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20
SHARDS = 4
TENSORS = 16
ROWS, COLS = 1024, 1024  # float32: 4 MiB a tensor
LAYER = [f"model.layers.{i}.weight" for i in range(4)]  # in the first shard


def model_files() -> dict[str, bytes]:
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(36)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for shard in range(SHARDS):
        name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {
            f"model.layers.{shard * TENSORS + i}.weight": rng.standard_normal(
                (ROWS, COLS), np.float32
            )
            for i in range(TENSORS)
        }
        files[name] = save(tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": weight_map}
    ).encode()
    return files


def serve(root: str, latency: float, rate: float, ready: Any, done: Any) -> None:
    """The Hub, in its own process, until `done` is set."""
    from tests.hub_server import HubServer

    with HubServer(root) as hub:
        hub.commit("org/model", model_files())
        for file in Path(root).rglob("*"):  # hashed now, not in the first run's requests
            if file.is_file():
                hub.blob(file)
        hub.latency, hub.rate = latency, rate
        ready.put((hub.endpoint, hub.cdn))
        done.wait()


def _client(endpoint: str, cache: str) -> None:
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    patch_endpoint(endpoint, cache).HF_TOKEN_PATH = os.path.join(cache, "no-token")


def run(side: str, case: str, endpoint: str) -> dict[str, Any]:
    """One measurement in this (fresh) process: seconds, requests, peak, data."""
    with tempfile.TemporaryDirectory() as cache:
        _client(endpoint, cache)
        import lazyckpt

        if side == "lazyckpt":

            def operation() -> Any:
                wanted = None if case == "whole" else [k.replace(".", "/") for k in LAYER]
                return lazyckpt.load("hf://org/model", wanted)  # open, then read

        else:
            import huggingface_hub
            from safetensors import safe_open
            from safetensors.numpy import load_file

            def operation() -> Any:
                if case == "whole":
                    folder = huggingface_hub.snapshot_download("org/model")
                    return [
                        load_file(os.path.join(folder, name))
                        for name in sorted(os.listdir(folder))
                        if name.endswith(".safetensors")
                    ]
                shard = f"model-00001-of-{SHARDS:05d}.safetensors"
                file = huggingface_hub.hf_hub_download("org/model", shard)
                with safe_open(file, "np") as f:
                    return {k: f.get_tensor(k) for k in LAYER}

        with lazyckpt.measure() as cost:  # (measure, of benchmarks/common.py: time and peak)
            found = measure(operation)
        found["requests"] = cost.requests
        return found


def _in_process(side: str, case: str, endpoint: str) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(run, (side, case, endpoint))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--links", default="60:40,10:200,150:20", help="ROUND_TRIP_MS:MB_PER_S, comma-separated"
    )
    args = parser.parse_args()
    print(machine())
    print(versions())
    data = {"whole": SHARDS * TENSORS * ROWS * COLS * 4, "layer": len(LAYER) * ROWS * COLS * 4}
    context = multiprocessing.get_context("spawn")
    print(
        "| link | case | lazyckpt s | requests | peak / data | download, then load s "
        "| peak / data | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for link in args.links.split(","):
        milliseconds, megabytes = (float(x) for x in link.split(":"))
        with tempfile.TemporaryDirectory() as root:
            ready, done = context.Queue(), context.Event()
            server = context.Process(
                target=serve, args=(root, milliseconds / 1000, megabytes * 1e6, ready, done)
            )
            server.start()
            endpoint, _ = ready.get(timeout=300)
            try:
                for case in ("whole", "layer"):
                    runs: dict[str, list[dict[str, Any]]] = {"lazyckpt": [], "download": []}
                    for _ in range(args.repeat):
                        for side in runs:  # alternating
                            runs[side].append(_in_process(side, case, endpoint))
                    ours, theirs = (
                        {
                            key: statistics.median(r[key] for r in runs[side])
                            for key in ("seconds", "requests", "peak_above_baseline")
                        }
                        for side in ("lazyckpt", "download")
                    )
                    print(
                        f"| {milliseconds:g} ms, {megabytes:g} MB/s | {case} "
                        f"| {ours['seconds']:.2f} | {ours['requests']:.0f} "
                        f"| {ours['peak_above_baseline'] / data[case]:.2f}x "
                        f"| {theirs['seconds']:.2f} "
                        f"| {theirs['peak_above_baseline'] / data[case]:.2f}x "
                        f"| {theirs['seconds'] / ours['seconds']:.2f}x |",
                        flush=True,
                    )
            finally:
                done.set()
                server.join(30)


if __name__ == "__main__":
    main()
