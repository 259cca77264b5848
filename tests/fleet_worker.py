"""One process of a conversion divided among processes: `python -m tests.fleet_worker SPEC_JSON`.

SPEC: {"process": i, "processes": n, "port": p, "steps": [...]}; each step is
  {"source": S, "destination": D, "kwargs": {...convert's keywords...},
   "fail": {"process": i, "where": "orbax" | "safetensors" | "source"} or absent,
   "add_jax_leaf": true | "global" or absent}
(`fail`: that process's writing raises, in the Orbax or the safetensors writer, or
its source is missing: "source", or it divides the work otherwise than the others:
"division", or it writes its safetensors files into a folder of its own: "unshared";
`add_jax_leaf`: convert with a transform that adds a jax.Array leaf, `extra`, which
JSON kwargs cannot carry: `jnp.arange(8.0)`, or "global": one sharded across the
processes).
Prints one JSON line per step: the error (None, or `Class: message`), the bytes its
`lazyckpt.measure()` counted during the convert, the bytes it read from local files
without tensorstore (a safetensors source's reads), and those a plain `open` of the
source reads (its headers, which every process reads).
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any


def _die_with_parent() -> None:
    """Linux: be killed with the test that started this worker (a killed pytest
    leaves no worker waiting on the others)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _jax_leaf(sharded: bool) -> Any:
    import jax
    import jax.numpy as jnp
    import numpy as np

    if not sharded:
        return jnp.arange(8.0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.arange(8.0 * jax.device_count(), dtype=np.float32)
    return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])


def _adding(leaf: Any) -> Any:
    return lambda tree: {**tree, "extra": leaf}


def main(config: dict[str, Any]) -> None:
    _die_with_parent()
    from tests.multihost_worker import join_job

    join_job(config, devices=1)
    import importlib

    import jax

    import lazyckpt
    from lazyckpt._storage.metrics import direct_bytes_read

    me = jax.process_index()
    writers = {
        "orbax": ("lazyckpt._orbax.write_together", "write_arrays"),
        "safetensors": ("lazyckpt._safetensors.write_together", "write_file"),
    }
    for step in config["steps"]:
        out: dict[str, Any] = {"do": "convert", "process": me}
        fail = step.get("fail")
        patched = None
        source = step["source"]
        where = None if fail is None or fail["process"] != me else fail["where"]
        if where == "source":
            source += "-missing"  # (this process's copy of the source is not there)
        elif where in ("division", "unshared"):
            module = importlib.import_module(
                "lazyckpt._convert.fleet"
                if where == "division"
                else "lazyckpt._safetensors.write_together"
            )
            name = "divide" if where == "division" else "file_writer"
            original = getattr(module, name)
            patched = (module, name, original)
            if where == "division":  # (each unit to the next process: not the others' split)
                setattr(
                    module,
                    name,
                    lambda units, divide=original, n=config["processes"]: [
                        (o + 1) % n for o in divide(units)
                    ],
                )
            else:
                elsewhere = tempfile.mkdtemp()
                setattr(
                    module, name, lambda _, *rest, at=elsewhere, writer=original: writer(at, *rest)
                )
        elif where is not None:
            module_name, name = writers[fail["where"]]
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # (an older lazyckpt, without that writer: no failure)
                module = None
            if module is not None:
                patched = (module, name, getattr(module, name))

                def failing(*_: Any, **__: Any) -> Any:
                    raise OSError(28, "injected: No space left on device")

                setattr(module, name, failing)
        kwargs = dict(step["kwargs"])
        if step.get("add_jax_leaf"):
            kwargs["transform"] = _adding(_jax_leaf(step["add_jax_leaf"] == "global"))
        before = direct_bytes_read()
        lazyckpt.open(step["source"])
        out["opened"] = direct_bytes_read() - before
        try:
            before = direct_bytes_read()
            with lazyckpt.measure() as cost:
                lazyckpt.convert(source, step["destination"], **kwargs)
            out["direct"] = direct_bytes_read() - before
            out["measured"] = cost.bytes_read
            out["error"] = None
        except Exception as error:  # noqa: BLE001 - a raw builtin one too: the test names it
            out["error"] = f"{type(error).__name__}: {error}"
        if patched is not None:
            setattr(patched[0], patched[1], patched[2])
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
