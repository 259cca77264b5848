"""One process of a multi-process test: `python -m tests.multihost_worker SPEC_JSON`.

SPEC: {"process": i, "processes": n, "port": p, "steps": [...]}; each step is one of
  {"do": "save", "path": P, "spec": [...], "seed": s}
  {"do": "restore", "path": P, "spec": [...], "seed": s}
  {"do": "save_disagree", "path": P}          (process 1 passes another tree)
  {"do": "put_disagree", "path": P}           (process 1 asks for another sharding)
  {"do": "broadcast", "path": P, "mesh": [4, 2], "specs": {KEY: [...]},
   "broadcast": bool, "fail": i or None, "budget": a size or None,
   "broadcast_of": {i: bool}, "budget_of": {i: size},     (per-process overrides)
   "staged": bool, "fail_write": i or None,     (CPU devices sent to as accelerators are;
   "fail_finish": i or None}                     process `fail_write` fails on its devices
                                               before the all-reduce, `fail_finish` after)
                                              (device_put onto a ("data", "model")
                                               mesh; process `fail` fails its reads)
SPEC may also say "devices": the CPU devices of each process (default 4).
Prints one JSON line per step: what it did, bytes read, the stored bytes of the
chunks its devices need, and whether every local shard holds the right values (for
`broadcast`, bit for bit against a plain read of the same region).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SHAPE = (256, 96)  # rows and columns split by up to 16 devices; chunks > 1 KiB (not inline)


def values(seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32)


def spec(entries: list[Any]) -> Any:
    from jax.sharding import PartitionSpec as P

    return P(*[tuple(e) if isinstance(e, list) else e for e in entries])


def mesh() -> Any:
    import jax

    return jax.make_mesh((len(jax.devices()),), ("d",))


def _needed(kv: Any, lazy_and_indices: Any, itertools: Any) -> int:
    """Stored size of the chunks that this process's shards need (read after the
    measurement, straight from the OCDBT database)."""
    lazy, indices = lazy_and_indices
    keys = set()
    for index in indices:
        ranges = []
        for s, n, c in zip(index, lazy.shape, lazy.chunks, strict=True):
            start, stop, _ = s.indices(n)
            ranges.append(range(start // c, (stop - 1) // c + 1))
        keys.update(itertools.product(*ranges))
    return sum(len(kv.read("w/c/" + "/".join(map(str, k))).result().value) for k in keys)


def join_job(config: dict[str, Any], devices: int) -> None:
    """Join the job of `config` ({"process", "processes", "port"}) on 127.0.0.1, with
    `devices` CPU devices and gloo's collectives."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"127.0.0.1:{config['port']}"
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=config["processes"],
        process_id=config["process"],
        coordinator_bind_address=address,
    )


def main(config: dict[str, Any]) -> None:
    join_job(config, config.get("devices", 4))
    import itertools

    import jax
    import numpy as np
    import tensorstore as ts
    from jax.sharding import NamedSharding

    import lazyckpt
    from lazyckpt._storage.metrics import bytes_read

    me = jax.process_index()
    for step in config["steps"]:
        out: dict[str, Any] = {"do": step["do"], "process": me}
        try:
            if step["do"] == "save":
                sharding = NamedSharding(mesh(), spec(step["spec"]))
                full = values(step["seed"])
                array = jax.make_array_from_callback(SHAPE, sharding, full.__getitem__)
                lazyckpt.save(step["path"], {"w": array, "note": "multi"})
            elif step["do"] == "restore":
                sharding = NamedSharding(mesh(), spec(step["spec"]))
                lazy = lazyckpt.open(step["path"])["w"]
                before = bytes_read()
                placed = lazyckpt.device_put(lazy, sharding)
                out["read"] = bytes_read() - before
                full = values(step["seed"])
                out["ok"] = all(
                    np.array_equal(np.asarray(s.data), full[s.index])
                    for s in placed.addressable_shards
                )
                kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step['path']}/"})
                indices = [s.index for s in placed.addressable_shards]
                out["needed"] = _needed(kv.result(), (lazy, indices), itertools)
            elif step["do"] == "save_disagree":
                sharding = NamedSharding(mesh(), spec(["d"] if me != 1 else [None, "d"]))
                array = jax.make_array_from_callback(SHAPE, sharding, lambda i: values(0)[i])
                lazyckpt.save(step["path"], {"w": array})
            elif step["do"] == "broadcast":
                out.update(_broadcast(step, me))
            elif step["do"] == "put_disagree":
                lazy = lazyckpt.open(step["path"])["w"]
                chosen = spec(["d"] if me != 1 else [None, "d"])
                lazyckpt.device_put(lazy, NamedSharding(mesh(), chosen))
            out["error"] = None
        except lazyckpt.LazyckptError as error:
            out["error"] = f"{type(error).__name__}: {error}"
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


def _broadcast(step: dict[str, Any], me: int) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding

    import lazyckpt
    from lazyckpt._engine.stored import StoredArray
    from lazyckpt._storage.metrics import bytes_read

    grid = jax.make_mesh(tuple(step["mesh"]), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    lazy = lazyckpt.open(step["path"])
    chosen = {key: lazy[key] for key in step["specs"]}
    shardings = {key: NamedSharding(grid, spec(s)) for key, s in step["specs"].items()}
    sent: list[int] = []  # bytes of parts sent to a device in pieces, from _broadcast
    regions: list[int] = []  # host buffers of whole regions made by _broadcast
    if step.get("staged"):
        import lazyckpt._device.collective as spreading
        import lazyckpt._device.shard as on_device
        import lazyckpt._device.staged as staged
        from lazyckpt._array.geometry import box_bytes
        from lazyckpt._device.platforms import PLATFORMS, Platform

        PLATFORMS["cpu"] = Platform(staged=True, adopts=False)
        send_shards = staged.send_shards
        result_empty = getattr(spreading, "result_empty")  # noqa: B009 - (replaced below)

        def counted(work: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("raw"):  # (the broadcast's parts, not other placements)
                sent.extend(
                    box_bytes(box, view.dtype.itemsize) for view, boxes in work for box in boxes
                )
            return send_shards(work, *args, **kwargs)

        def counted_empty(shape: Any, dtype: Any) -> Any:
            regions.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
            return result_empty(shape, dtype)

        setattr(staged, "send_shards", counted)  # noqa: B010
        setattr(spreading, "result_empty", counted_empty)  # noqa: B010
        if step.get("fail_finish") == me:

            def failing_finish(*_: Any) -> Any:
                raise lazyckpt.LazyckptError("injected failure making floats on a device")

            setattr(on_device, "finish", failing_finish)  # noqa: B010
        if step.get("fail_write") == me:

            def failing_write(*_: Any) -> Any:
                raise lazyckpt.LazyckptError("injected failure writing a part on a device")

            setattr(on_device, "write", failing_write)  # noqa: B010
    if step.get("fail") == me:

        def failing(self: Any) -> Any:
            raise lazyckpt.CorruptCheckpointError(f"injected failure reading {self.key!r}")

        StoredArray.open = failing  # type: ignore[method-assign]
    before = bytes_read()
    flag = step.get("broadcast_of", {}).get(str(me), step["broadcast"])
    budget = step.get("budget_of", {}).get(str(me), step.get("budget"))
    placed = lazyckpt.device_put(chosen, shardings, broadcast=flag, memory_budget=budget)
    read = bytes_read() - before

    def same_bits(a: Any, b: Any) -> bool:
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()

    ok = all(
        placed[key].sharding == shardings[key]
        and all(
            same_bits(s.data, chosen[key][s.index].get()) for s in placed[key].addressable_shards
        )
        for key in chosen
    )
    return {"read": read, "ok": ok, "sent": sum(sent), "regions": regions}


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
