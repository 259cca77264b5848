"""Run hostile cases in this process, under a memory limit: what each did, as JSON lines.

    python -m tests.hostile_child CASES.json

CASES.json is a list of `{"name", "path", "do", "kwargs"}` (and what a kind names
besides: `key`, `step` and `astype` for the view that `stats_json` summarizes;
`key` and `versus` or `numpy` for `diff`, or `other`, a second checkpoint; `out` for `save` and `convert`, and `key`
for the one array `save` writes; `args` for the commands). For each case this prints
`{"name": ..., "started": true}` before it runs and `{"name": ..., "outcome": ...}`
after, where the outcome is `ok` (`ok: <report>` for `verify`, `ok: <JSON>` for
`stats_json` and `diff`),
`lazyckpt:<ErrorClass>: <message>` or
`other:<ErrorClass>: <message>`; a case that crashes the interpreter or hangs leaves
only its `started` line, and the parent sees the exit status or the timeout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys
from typing import Any

_WRITTEN = 64 << 20
"""The largest file a case that writes may make: a write past it fails (EFBIG), so that
a save of exabytes fails fast instead of filling the disk."""


def _view(tree: Any, case: dict[str, Any]) -> Any:
    """The tree, or the view of it a case names: `tree[key][::step].astype(astype)`."""
    if "key" in case:
        tree = tree[case["key"]]
    if "step" in case:
        tree = tree[:: case["step"]]
    if "astype" in case:
        tree = tree.astype(case["astype"])
    return tree


def _writing() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (_WRITTEN, _WRITTEN))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _do(lazyckpt: Any, case: dict[str, Any]) -> str | None:
    """Run the case; what it found, where that is more than success."""
    path, do, kwargs = case["path"], case["do"], case.get("kwargs", {})
    if do == "open":
        lazyckpt.open(path, **kwargs)
    elif do == "summary":
        str(lazyckpt.summary(lazyckpt.open(path, **kwargs)))
    elif do == "load":
        lazyckpt.load(lazyckpt.open(path, **kwargs), memory_budget=64 << 20)
    elif do in ("get", "get_slice"):
        first = next((leaf for _, leaf in lazyckpt.leaves(lazyckpt.open(path))), None)
        if not isinstance(first, lazyckpt.LazyArray):
            return f"the first leaf is {type(first).__name__}"
        (first[:4] if do == "get_slice" else first).get()
    elif do in ("load_after_fifo", "get_after_fifo"):
        # A FIFO put in a file's place after `open`: the read must refuse it, not wait.
        tree = lazyckpt.open(path)
        victim = os.path.join(path, case["victim"])
        os.unlink(victim)
        os.mkfifo(victim)
        if do == "load_after_fifo":
            lazyckpt.load(tree, memory_budget=64 << 20)
        else:
            tree[case["key"]].get()
    elif do == "verify":
        result = lazyckpt.verify(lazyckpt.open(path), memory_budget=64 << 20, progress=False)
        return str(result)
    elif do == "device_put":
        # Onto a target that names no sharding: each array goes where it was saved.
        import jax

        tree = lazyckpt.open(path)
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
        placed = jax.tree.leaves(lazyckpt.device_put(tree, like))
        return " ".join(str(device) for leaf in placed for device in leaf.devices())
    elif do == "stats":
        lazyckpt.stats(lazyckpt.open(path), memory_budget=64 << 20)
    elif do == "stats_json":
        view = _view(lazyckpt.open(path), case)
        table = lazyckpt.stats(view, memory_budget=64 << 20, progress=False, **kwargs)
        return json.dumps(table.describe())
    elif do == "diff":
        import numpy as np

        tree = lazyckpt.open(path)
        if "other" in case:  # two checkpoints, whole
            left, right = tree, lazyckpt.open(case["other"])
        else:
            left = {"v": tree[case["key"]]}
            right = {
                "v": np.broadcast_to(np.asarray(case["numpy"], left["v"].dtype), left["v"].shape)
                if "numpy" in case
                else tree[case["versus"]]
            }
        found = lazyckpt.diff(
            left, right, values=True, memory_budget=64 << 20, progress=False, **kwargs
        )
        return json.dumps(found.describe())
    elif do in ("save", "convert"):
        _writing()
        if do == "save":
            tree = lazyckpt.open(path)
            if "key" in case:
                tree = {case["key"]: tree[case["key"]]}
            lazyckpt.save(case["out"], tree, memory_budget=64 << 20, progress=False, **kwargs)
        else:
            found = lazyckpt.convert(
                path, case["out"], memory_budget=64 << 20, progress=False, **kwargs
            )
            return None if isinstance(found, str) else str(found)
    elif do in ("show", "inspect", "convert_cli"):
        from lazyckpt._cli.main import main

        if do == "convert_cli":
            _writing()
        args = [do.removesuffix("_cli"), path, *case.get("args", [])]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            # --traceback: errors that are no LazyckptError surface as themselves.
            code = main(["--traceback", *args])
        if code:
            raise lazyckpt.LazyckptError(f"the command exited with {code}")
    else:
        raise ValueError(f"unknown case action {do!r}")
    return None


def main(cases_file: str) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    import lazyckpt

    for name in lazyckpt.__all__:  # (the package loads its modules on first use: now,
        getattr(lazyckpt, name)  # not under the limit, which a library's load can fail)
    jax.devices()
    limit = int(os.environ.get("HOSTILE_MEMORY", str(4 << 30)))
    # Beyond what the interpreter and jax already mapped: the cases get `limit` more.
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + limit, mapped + limit))
    with open(cases_file) as f:
        cases = json.load(f)
    for case in cases:
        print(json.dumps({"name": case["name"], "started": True}), flush=True)
        try:
            found = _do(lazyckpt, case)
            outcome = "ok" if found is None else f"ok: {found}"
        except lazyckpt.LazyckptError as error:
            outcome = f"lazyckpt:{type(error).__name__}: {error}"
        except BaseException as error:  # noqa: BLE001 - what the parent checks for
            outcome = f"other:{type(error).__name__}: {str(error)[:300]}"
        print(json.dumps({"name": case["name"], "outcome": outcome}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
