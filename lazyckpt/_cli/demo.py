"""`lazyckpt demo`: write a small sharded checkpoint, then open, inspect, select,
reshard and load it, printing what each step read from storage (`lazyckpt.measure`)."""

from __future__ import annotations

import os
import tempfile

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import lazyckpt
from lazyckpt._text import human_bytes

_DEVICES = 8


def run(keep: str | None = None) -> None:
    # Fake 8 CPU devices so the demo shards on any machine; must precede jax's
    # backend start-up, which happens on first device use (not on import).
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
        ).strip()
    if keep:
        _walkthrough(os.path.abspath(keep))
        return
    with tempfile.TemporaryDirectory(prefix="lazyckpt-demo-") as tmp:
        _walkthrough(os.path.join(tmp, "checkpoint"))


def _walkthrough(path: str) -> None:
    devices = jax.devices()
    if len(devices) < _DEVICES:
        raise lazyckpt.LazyckptError(
            f"the demo needs {_DEVICES} devices but jax sees {len(devices)}; unset XLA_FLAGS "
            "or set --xla_force_host_platform_device_count=8"
        )
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=devices[:_DEVICES])
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((256, 128), dtype=np.float32)
    embed = rng.standard_normal((1024, 256), dtype=np.float32)
    bias = np.linspace(-1, 1, 128, dtype=np.float32)
    state = {
        "params": {
            "embed": jax.device_put(embed, NamedSharding(mesh, PartitionSpec("data", None))),
            "dense": {
                "kernel": jax.device_put(
                    kernel, NamedSharding(mesh, PartitionSpec("data", "model"))
                ),
                "bias": jax.device_put(bias, NamedSharding(mesh, PartitionSpec())),
            },
        },
        "opt_state": {
            "mu": jax.device_put(np.zeros_like(kernel), NamedSharding(mesh, PartitionSpec())),
            "count": 1000,
        },
        "step": 1000,
        "note": "saved by lazyckpt demo",
    }

    print(f"1. Save: a train state on a 4x2 mesh of {_DEVICES} CPU devices, with sharded")
    print("   (P('data', 'model'), P('data', None)) and replicated (P()) arrays.")
    try:
        lazyckpt.save(path, state)
    except lazyckpt.CheckpointExistsError:  # (its fix, overwrite=True, is not the demo's)
        raise lazyckpt.CheckpointExistsError(
            f"--keep {path}: the folder already exists, and the demo replaces nothing; "
            "remove it, or pass --keep a folder that does not exist yet"
        ) from None
    print(f"   wrote {path}\n")

    with lazyckpt.measure() as cost:
        tree = lazyckpt.open(path)
    print("2. Open: only metadata is read (the b-tree, the zarr headers, _METADATA).")
    print(f"   read {cost}; none of it array chunks")
    print("   lazyckpt.summary(tree) (in a notebook: a collapsible tree):")
    for line in str(lazyckpt.summary(tree)).splitlines():
        print(f"   {line}")

    print("\n3. Select: params only, nothing read; the optimizer state is never touched.")
    params = lazyckpt.select(tree, "params/**")
    print(f"   selected {[key for key, _ in lazyckpt.leaves(params)]}")
    shapes = jax.eval_shape(
        lambda p: p["embed"] @ p["dense"]["kernel"] + p["dense"]["bias"], params["params"]
    )
    print(f"   jax.eval_shape on the lazy tree, no data read: {shapes}")

    with lazyckpt.measure() as cost:
        rows = params["params"]["embed"][10:13, :4].get()
    print("\n4. Slice: embed[10:13, :4] reads only the one chunk that holds those rows.")
    print(
        f"   read {cost} (embed holds {human_bytes(embed.nbytes)});"
        f" values match: {np.array_equal(rows, embed[10:13, :4])}"
    )

    print("\n5. Reshard: onto a 2x4 mesh, reusing the saved partition specs by axis name;")
    print("   each device reads only its own shard, replicated arrays are read once.")
    new_mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices[:_DEVICES])
    with lazyckpt.measure() as cost:
        on_devices = lazyckpt.device_put(params, lazyckpt.saved_shardings(new_mesh))
    placed = on_devices["params"]["dense"]["kernel"]
    print(
        f"   kernel: {placed.sharding.spec} on mesh {dict(new_mesh.shape)}, "
        f"shard shape {placed.addressable_shards[0].data.shape}, "
        f"equal to saved: {np.array_equal(np.asarray(placed), kernel)}"
    )
    print(
        f"   read {cost} (params hold "
        f"{human_bytes(sum(a.nbytes for _, a in lazyckpt.leaves(params)))})"
    )

    print("\n6. Load to host: the dense layer as NumPy, cast to bfloat16 while reading.")
    dense = lazyckpt.load(lazyckpt.select(tree, "params/dense/*"))["params"]["dense"]
    half = tree["params"]["dense"]["kernel"].astype("bfloat16").get()
    print(
        f"   kernel {dense['kernel'].dtype}{list(dense['kernel'].shape)}, "
        f"bias {dense['bias'].dtype}{list(dense['bias'].shape)}, bfloat16 copy {half.dtype}"
    )
    print(f"   step = {tree['step']}, note = {tree['note']!r}")
    print("\nDone: the optimizer state was never read.")
