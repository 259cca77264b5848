"""Shared benchmark plumbing: fresh processes, peak memory, bytes read, data sets.

Every measurement runs in a fresh `spawn`ed process, so imports, caches and memory
high-water marks of one do not leak into the next. Inside it, the peak RSS is reset
(`/proc/self/clear_refs`) just before the timed operation, so "peak - baseline" is
what that operation added.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

MiB = 1 << 20
GiB = 1 << 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def bytes_read() -> int:
    from lazyckpt._storage.metrics import bytes_read as counted

    return counted()


def measure(operation: Callable[[], Any], keep: bool = False) -> dict[str, Any]:
    """Time `operation`, with bytes read and peak memory above the baseline."""
    import gc

    package = sys.modules.get("lazyckpt")
    if package is not None:  # (it loads its modules on first use: not on the clock)
        for name in package.__all__:
            getattr(package, name)
    gc.collect()
    baseline = rss_bytes()
    try:
        reset_peak()
        sampler = None
    except OSError:  # (gVisor, as on the TPU machines, refuses clear_refs)
        sampler = _Sampler()
    before = bytes_read()
    start = time.perf_counter()
    result = operation()
    seconds = time.perf_counter() - start
    peak = peak_bytes() if sampler is None else sampler.stop()
    out = {
        "seconds": seconds,
        "bytes_read": bytes_read() - before,
        "peak_above_baseline": peak - baseline,
        "baseline": baseline,
        "peak_sampled": sampler is not None,
    }
    if keep:
        out["result"] = result
    del result
    return out


class _Sampler:
    """The largest RSS seen by a thread that reads it every millisecond: the peak where
    the kernel's high-water mark cannot be reset (it may miss a peak shorter than
    that)."""

    def __init__(self) -> None:
        import threading

        self.peak = rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, rss_bytes())


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of `measure` results that took least time."""
    return min(runs, key=lambda r: r["seconds"])


class Timers:
    """Seconds spent in functions or methods made timed (`time`), summed over the
    threads that run them, and other amounts added by label (`add`)."""

    def __init__(self) -> None:
        self.spent: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, label: str, amount: float) -> None:
        with self._lock:
            self.spent[label] += amount

    def time(self, owner: Any, name: str, label: str) -> None:
        """`owner.name` (a class's method, a module's function) timed from now on, its
        seconds added to `label`."""
        real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - start)

        setattr(owner, name, timed)


def in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run `fn(*args)` in a new interpreter and return its (picklable) result."""
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(fn, args)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB RAM, {platform.system()}"


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(
        f"{name} {version(name)}" for name in ("jax", "tensorstore", "orbax-checkpoint", "lazyckpt")
    )


def orbax_save(path: Path, tree: Any, **handler_options: Any) -> None:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler_options)) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree))


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def ratio(anchor: float, ours: float) -> str:
    return f"{anchor / ours:.2f}x" if ours else "inf"


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"
