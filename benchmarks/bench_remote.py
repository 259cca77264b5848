"""Requests to open checkpoints in object storage (a local S3-compatible server).

    python benchmarks/bench_remote.py [--root DIR]

Starts moto's S3 server on 127.0.0.1, uploads the 10,000-array checkpoint of
bench_open.py (and a 100-array one), and counts the HTTP requests that
`lazyckpt.open` makes (tensorstore's /tensorstore/http/request_started), with the
bytes it reads. Orbax's `metadata()` is tried on the same URL.

Then a 64 MiB safetensors model (16 float32 tensors of 4 MiB) in the same bucket:
`lazyckpt.load` of it after `open`, with its requests, seconds and peak memory over
the data, against boto3's `get_object` of the file and `safetensors.numpy.load`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from bench_open import make_checkpoint
from common import in_fresh_process, machine, measure, versions


def _requests() -> int:
    import tensorstore as ts

    for metric in ts.experimental_collect_matching_metrics("/tensorstore/http/request_started"):
        return sum(int(v.get("value", 0)) for v in metric["values"])
    return 0


def _bytes() -> int:
    import tensorstore as ts

    total = 0
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/bytes_read"):
        total += sum(int(v.get("value", 0)) for v in metric["values"])
    return total


def measure_open(url: str, endpoint: str) -> dict[str, Any]:
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import lazyckpt

    requests, read = _requests(), _bytes()
    start = time.perf_counter()
    tree = lazyckpt.open(url)
    seconds = time.perf_counter() - start
    arrays = sum(1 for _, leaf in lazyckpt.leaves(tree) if isinstance(leaf, lazyckpt.LazyArray))
    return {
        "requests": _requests() - requests,
        "bytes": _bytes() - read,
        "seconds": seconds,
        "arrays": arrays,
    }


def orbax_metadata(url: str, endpoint: str) -> dict[str, Any]:
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import orbax.checkpoint as ocp

    requests = _requests()
    start = time.perf_counter()
    try:
        ocp.PyTreeCheckpointer().metadata(url)
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"}
    return {"requests": _requests() - requests, "seconds": time.perf_counter() - start}


def measure_safetensors(url: str, endpoint: str) -> dict[str, Any]:
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import lazyckpt

    tree = lazyckpt.open(url)
    requests = _requests()
    found = measure(lambda: lazyckpt.load(tree))
    found["requests"] = _requests() - requests
    return found


def boto_safetensors(endpoint: str) -> dict[str, Any]:
    import boto3
    from safetensors.numpy import load

    client = boto3.client("s3", endpoint_url=endpoint)
    return measure(
        lambda: load(client.get_object(Bucket="bench", Key="st/model.safetensors")["Body"].read())
    )


def main() -> None:
    import boto3
    from moto.server import ThreadedMotoServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    args = parser.parse_args()
    for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_REGION": "us-east-1"}.items():  # fmt: skip
        os.environ.setdefault(key, value)
    print(f"machine: {machine()}\n{versions()}")
    big = args.root / "open_10k"
    if not (big / "_METADATA").exists():
        in_fresh_process(make_checkpoint, big)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    try:
        files = [p for p in big.rglob("*") if p.is_file()]
        for path in files:
            key = f"open_10k/{path.relative_to(big).as_posix()}"
            client.put_object(Bucket="bench", Key=key, Body=path.read_bytes())
        print(f"uploaded {big} ({len(files)} files) to s3://bench/open_10k on {endpoint}\n")
        url = "s3://bench/open_10k"
        ours = in_fresh_process(measure_open, url, endpoint)
        theirs = in_fresh_process(orbax_metadata, url, endpoint)
        print(
            f"lazyckpt.open   {ours['arrays']:,} arrays: {ours['requests']} requests, "
            f"{ours['bytes']:,} bytes, {ours['seconds']:.2f} s"
        )
        if "error" in theirs:
            print(f"orbax metadata(): cannot read this store here ({theirs['error']})")
        else:
            print(f"orbax metadata(): {theirs['requests']} requests, {theirs['seconds']:.2f} s")
        _safetensors(client, endpoint)
    finally:
        server.stop()


def _safetensors(client: Any, endpoint: str) -> None:
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(7)
    tensors = {f"w{i}": rng.standard_normal((1024, 1024), np.float32) for i in range(16)}
    client.put_object(Bucket="bench", Key="st/model.safetensors", Body=save(tensors))
    data = 64 << 20
    ours = in_fresh_process(measure_safetensors, "s3://bench/st/model.safetensors", endpoint)
    theirs = in_fresh_process(boto_safetensors, endpoint)
    print(
        f"\nsafetensors, 64 MiB in s3: lazyckpt.load {ours['seconds']:.2f} s, "
        f"{ours['requests']} requests, peak {ours['peak_above_baseline'] / data:.2f}x the data; "
        f"boto3 get_object + safetensors load {theirs['seconds']:.2f} s, "
        f"peak {theirs['peak_above_baseline'] / data:.2f}x"
    )


if __name__ == "__main__":
    main()
