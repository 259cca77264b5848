"""A model on the Hugging Face Hub, explored without downloading it (issue 27).

    python benchmarks/bench_hub.py [--files 163] [--repeat 3]

Serves a synthetic sharded model of `--files` safetensors files (DeepSeek-V3 has 163)
from the loopback Hub of tests/hub_server.py: the Hub's API, `resolve/` answering
with a redirect to a second origin (its CDN), Range. Then, on the same server in the
same run:

- opening it: `lazyckpt.open("hf://...")` against `huggingface_hub`'s
  `get_safetensors_metadata` (headers only, no lazy tree): requests and time;
- `lazyckpt.stats` of one layer: bytes transferred, against the sizes of the files
  that hold it, which a download would fetch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import machine, versions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS_PER_FILE = 1
EXPERTS = 8


def model_files(count: int) -> dict[str, bytes]:
    """`count` shards, a layer each (8 experts, a norm), and their index."""
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for layer in range(count):
        shard = f"model-{layer + 1:05d}-of-{count:05d}.safetensors"
        tensors = {
            f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight": rng.standard_normal(
                (128, 256), np.float32
            )
            for e in range(EXPERTS)
        }
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = np.ones(256, np.float32)
        files[shard] = save(tensors)
        weight_map.update(dict.fromkeys(tensors, shard))
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": weight_map}
    ).encode()
    return files


def patch_endpoint(endpoint: str, cache: str) -> Any:
    """Point huggingface_hub at the loopback Hub (it reads HF_ENDPOINT at import)."""
    import huggingface_hub.constants as constants

    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_CACHE = cache
    return constants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=163)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import huggingface_hub

    import lazyckpt
    from tests.hub_server import HubServer

    print(
        f"machine: {machine()}\nversions: {versions()}, huggingface_hub {huggingface_hub.__version__}"
    )
    with tempfile.TemporaryDirectory() as root, HubServer(Path(root) / "hub") as hub:
        patch_endpoint(hub.endpoint, str(Path(root) / "cache"))
        files = model_files(args.files)
        hub.commit("org/big", files)
        total = sum(len(data) for name, data in files.items() if name.endswith(".safetensors"))
        print(f"model: {args.files} files, {total / 2**20:,.1f} MiB of safetensors\n")
        api = huggingface_hub.HfApi(endpoint=hub.endpoint)
        api.model_info("org/big")  # huggingface_hub's first-use requests, off the clock
        for verb in lazyckpt.__all__:  # lazyckpt loads its modules on first use: off it too
            getattr(lazyckpt, verb)
        rows = []
        theirs = (
            "huggingface_hub get_safetensors_metadata",
            lambda: api.get_safetensors_metadata("org/big"),
        )
        # A later open of the same commit goes straight to the CDN addresses the first
        # was redirected to (a commit's files never change; an expired address is
        # resolved again). Each round pushes a new commit, so each first open is one.
        first = (
            "lazyckpt.open('hf://org/big'), first of a commit",
            lambda: lazyckpt.open("hf://org/big"),
        )
        later = ("lazyckpt.open('hf://org/big'), later", lambda: lazyckpt.open("hf://org/big"))
        for i in range(args.repeat):  # interleaved, in turns first (the server shares the GIL)
            hub.commit("org/big", {"README.md": f"round {i}".encode()})
            order = (theirs, first, later) if i % 2 else (first, later, theirs)
            for name, run in order:
                hub.clear_log()
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
                log = hub.log
                sent = sum(e.bytes_sent for e in log)
                rows.append((name, seconds, len(log), sent))
        print("| open | best time s | requests | bytes transferred |")
        print("|---|---|---|---|")
        for name in dict.fromkeys(r[0] for r in rows):
            mine = [r for r in rows if r[0] == name]
            best = min(mine, key=lambda r: r[1])
            print(f"| {name} | {best[1]:.3f} | {best[2]} | {best[3]:,} |")

        tree = lazyckpt.open("hf://org/big")
        layer = str(args.files // 2)
        hub.clear_log()
        with lazyckpt.measure() as cost:
            table = lazyckpt.stats({"layer": tree["model"]["layers"][layer]})
        read = cost.bytes_read
        sent = sum(e.bytes_sent for e in hub.log)
        shard = f"model-{int(layer) + 1:05d}-of-{args.files:05d}.safetensors"
        arrays = sum(a.nbytes for _, a in lazyckpt.leaves(tree["model"]["layers"][layer]))
        print(
            f"\nstats of layer {layer} ({len(table)} arrays, {arrays:,} bytes): "
            f"{len(hub.log)} requests, {sent:,} bytes transferred ({read:,} read); "
            f"a download of its file: {len(files[shard]):,} bytes; of the model: {total:,}"
        )


if __name__ == "__main__":
    main()
