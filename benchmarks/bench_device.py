"""Restoring onto an accelerator (issue 47): lazyckpt against Orbax's restore and the
safetensors library + `jax.device_put`, on the same files, in the same run.

    python benchmarks/bench_device.py [--root DIR] [--gib 3] [--big-gib 2] [--repeat N]
                                      [--kind tree|big] [--only NAME]
    python benchmarks/bench_device.py --shapes [--gib 3] [--repeat N]
    python benchmarks/bench_device.py --stages [--gib 3]
    python benchmarks/bench_device.py --streams [--gib 3]

Run it on a machine with a TPU or GPU; where JAX finds none it says so and measures
on the CPU devices instead. Two checkpoints, each written as Orbax (orbax-checkpoint's
defaults: zarr, zstd, OCDBT) and as one `model.safetensors` file:
- `tree`: `--gib` GiB of bfloat16 in 64 MiB arrays (`layers/N/w`, 4096 x 8192) and
  32 small arrays (`layers/N/scale`, 4096 floats);
- `big`: one bfloat16 array of `--big-gib` GiB, larger than any budget.

Every case runs in a fresh process with the files in the page cache, and places the
whole tree on the first device (`SingleDeviceSharding`):
- `ceilings`: host to device, one 64 MiB transfer at a time and 8 at once (from host
  arrays already in memory), and reading the safetensors file with 1, 6 and 12
  threads into reused buffers: what a restore cannot beat. And two pipelines written
  by hand, what a restore can reach on that machine: the safetensors file read and
  sent (threads that each read a piece into a buffer of their own and send it, the
  best of three piece sizes), and Orbax's zstd chunks read, decoded and sent (threads
  that each decode a chunk from its data file into a buffer of their own and send it
  as it fills, the best of three thread counts; a restore from Orbax is compared
  with this one);
- Orbax: `PyTreeCheckpointer.restore` with `ArrayRestoreArgs` naming the sharding;
- safetensors: `safetensors.numpy.load_file`, then `jax.device_put`;
- lazyckpt: `device_put(open(path), sharding)` at the default budget and at
  `memory_budget="256MiB"`. The programs it compiles to assemble a shard on the
  device are kept across processes (`LAZYCKPT_CACHE_DIR`, here a folder of the run's
  own), filled before the timings; for `big`, the cases named "first use" start with
  none, as on a new machine, and compile them; the others load them. "first use,
  runtime started" makes one transfer of 16 bytes before its clock starts: the
  device's runtime takes host memory of its own at a process's first transfer
  (185 MiB on a TPU v5e), which every program that places anything pays once.

`--shapes` measures instead, on the tree from safetensors, the shapes of the threads
that read and send its raw pieces (`SHAPES`): the best of N placements each (at
least 3), in one process. `--stages` times the stages of a placement of the tree from
Orbax (`STAGES`: decoding, waiting for blocks, sending, waiting for room), each
summed over its threads, in a process that placed it once.

`--streams` measures where the tree from Orbax stops with nothing sent (`stream_rates`):
its chunks decoded on 12 and 6 threads by zstd's own reader and by lazyckpt's chunk
streams, then through `_engine.stream.read_blocks` as a placement streams them, at several
budgets.

`--kind tree` or `--kind big` runs one checkpoint's cases (and its ceilings): the
whole run takes over ten minutes on a TPU v5e host, the most one command may run on
the machines lent to this project; run it in two parts there.

Printed: seconds, GB/s, peak host memory above the process's baseline (the kernel's
high-water mark, reset before the restore), and lazyckpt's speed over each peer.
Before the timings, lazyckpt places bfloat16, float8_e4m3fn and int8 arrays with a
small budget (many pieces each) and compares them bit for bit with the file.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from common import GiB, MiB, Timers, fresh_dir, in_fresh_process, machine, measure, orbax_save

ROWS, COLUMNS = 4096, 8192  # 64 MiB of bfloat16
SMALL = 32


def _device() -> Any:
    import jax

    return jax.devices()[0]


def _sharding() -> Any:
    import jax

    return jax.sharding.SingleDeviceSharding(_device())


def _tree(kind: str, gib: float) -> dict[str, Any]:
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    if kind == "big":
        rows = int(gib * GiB) // (2 * 32768)
        values = rng.standard_normal((rows, 32768), np.float32).astype(ml_dtypes.bfloat16)
        return {"w": values}
    count = max(1, int(gib * GiB) // (ROWS * COLUMNS * 2))
    block = rng.standard_normal((ROWS, COLUMNS), np.float32).astype(ml_dtypes.bfloat16)
    layers = {}
    for i in range(count):
        # Distinct values per array, made cheaply: the block rolled by i rows.
        layers[str(i)] = {"w": np.roll(block, i, axis=0)}
        if i < SMALL:
            layers[str(i)]["scale"] = np.full(4096, i, np.float32)
    return {"layers": layers}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def make(root: Path, kind: str, gib: float) -> tuple[str, str]:
    from safetensors.numpy import save_file

    tree = _tree(kind, gib)
    orbax = fresh_dir(root / kind / "orbax")
    orbax_save(orbax, tree)
    safetensors = root / kind / "model.safetensors"
    save_file(_flat(tree), str(safetensors))
    return str(orbax), str(safetensors)


def ceilings(files: list[str], orbax: str) -> dict[str, Any]:
    """Host-to-device bandwidth (one transfer, eight at once), file reads (one, six
    and twelve threads, reused buffers), reading and sending the file by hand, and
    reading, decoding and sending `orbax`'s chunks by hand, in GB/s."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import numpy as np

    device = _device()
    host = np.ones(64 * MiB, np.uint8)
    jax.device_put(host, device).block_until_ready()
    out: dict[str, Any] = {"device": f"{device.platform} {device.device_kind}"}
    for name, at_once in (("h2d_one", 1), ("h2d_8", 8)):
        part = host[: 64 * MiB // at_once]
        start, sent = time.perf_counter(), 0
        while time.perf_counter() - start < 2:
            jax.block_until_ready([jax.device_put(part, device) for _ in range(at_once)])
            sent += 64 * MiB
        out[name] = sent / (time.perf_counter() - start) / 1e9
    size = sum(os.path.getsize(f) for f in files)
    spans = [(f, at) for f in files for at in range(0, os.path.getsize(f), 16 * MiB)]
    for name, threads in (("read_one", 1), ("read_6", 6), ("read_12", 12)):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(_read_spans, [spans[i::threads] for i in range(threads)]))
        out[name] = size / (time.perf_counter() - start) / 1e9
    # Both at once, written by hand: threads that each read a piece into a buffer of
    # their own and send it (the best of three shapes of that pipeline).
    best = 0.0
    for piece, threads in ((16 * MiB, 12), (32 * MiB, 6), (64 * MiB, 3)):
        work = [(f, at) for f in files for at in range(0, os.path.getsize(f), piece)]
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(_read_and_send, [(work[i::threads], piece) for i in range(threads)]))
        best = max(best, size / (time.perf_counter() - start) / 1e9)
    out["read_and_send"] = best
    out["decode_and_send"] = _decode_and_send_ceiling(orbax, size)
    return out


def _decode_and_send_ceiling(orbax: str, size: int) -> float:
    """Orbax's stored chunks read, decoded and sent by hand, in GB/s of `size`
    decoded bytes: threads that each take a chunk, decode it from its data file as a
    stream (zstd's own reader over the file, 4 MiB reads) into a 64 MiB buffer of
    their own and send each buffer as it fills, waiting for the transfer (the best of
    three thread counts). lazyckpt only says where each chunk lies (the OCDBT
    b-tree and the zarr shard's index); what a restore of that format can reach on
    the machine."""
    import itertools
    import math
    from concurrent.futures import ThreadPoolExecutor

    import jax

    import lazyckpt
    from lazyckpt._engine.decode import ChunkStream
    from lazyckpt._engine.stored import stored_array

    chunks: list[tuple[str, int, int]] = []  # (file, offset, decoded bytes)
    for leaf in jax.tree.leaves(lazyckpt.open(orbax)):
        if leaf.nbytes < MiB:  # (the small arrays, 0.02% of the tree: inline in the b-tree)
            continue
        stored = stored_array(leaf)
        assert stored.codec is not None and stored.codec.zstd, f"{leaf.key}: not zstd chunks"
        grid = [math.ceil(n / c) for n, c in zip(stored.shape, stored.chunks, strict=True)]
        for index in itertools.product(*map(range, grid)):
            stream = ChunkStream(stored, index, 0)  # (where its bytes lie in its key's value)
            located, place = stream._locate(), stored.store.local_file(stream.key)
            assert located and place, f"{stream.key}: not in a local file"
            chunks.append((place[0], place[1] + located[0], stream.total))
    best = 0.0
    for threads in (12, 6, 3):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(_decode_and_send, [chunks[i::threads] for i in range(threads)]))
        best = max(best, size / (time.perf_counter() - start) / 1e9)
    return best


def _decode_and_send(chunks: list[tuple[str, int, int]]) -> None:
    import jax
    import numpy as np
    import zstandard

    device = _device()
    out = np.empty(64 * MiB, np.uint8)
    for path, offset, nbytes in chunks:
        with open(path, "rb", buffering=0) as file:
            file.seek(offset)
            reader = zstandard.ZstdDecompressor().stream_reader(file, read_size=4 * MiB)
            for at in range(0, nbytes, out.nbytes):
                filled, size = 0, min(out.nbytes, nbytes - at)
                while filled < size:
                    got = reader.readinto(out.data[filled:size])
                    assert got, f"{path}: a zstd frame ends early"
                    filled += got
                jax.device_put(out[:size], device).block_until_ready()


def _read_and_send(job: tuple[list[tuple[str, int]], int]) -> None:
    """Read each `(file, offset)`'s piece into one reused buffer and send it to the
    device, waiting for each transfer before the buffer is filled again."""
    import jax
    import numpy as np

    spans, piece = job
    buffer = np.empty(piece, np.uint8)
    device = _device()
    handles: dict[str, int] = {}
    for path, at in spans:
        got = os.preadv(handles.setdefault(path, os.open(path, os.O_RDONLY)), [buffer], at)
        jax.device_put(buffer[:got], device).block_until_ready()
    for fd in handles.values():
        os.close(fd)


def _read_spans(spans: list[tuple[str, int]]) -> None:
    """Read each `(file, offset)`'s 16 MiB into one reused buffer."""
    import numpy as np

    buffer = np.empty(16 * MiB, np.uint8)
    handles: dict[str, int] = {}
    for path, at in spans:
        os.preadv(handles.setdefault(path, os.open(path, os.O_RDONLY)), [buffer], at)
    for fd in handles.values():
        os.close(fd)


def check_values(root: str) -> dict[str, Any]:
    """bfloat16, float8_e4m3fn and int8 placed with a 4 MiB budget, fetched back and
    compared bit for bit with the values written."""
    import jax
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    import lazyckpt

    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(2048, 8192), dtype=np.uint8)
    values = {
        "bf16": raw.view(ml_dtypes.bfloat16),
        "f8": raw.view(ml_dtypes.float8_e4m3fn),
        "i8": raw.view(np.int8),
        # Weights as trained ones are: no NaN, no subnormal, so bitcast in place.
        "bf16_weights": rng.standard_normal((2048, 4096), np.float32).astype(ml_dtypes.bfloat16),
    }
    folder = Path(root) / "values"
    orbax = fresh_dir(folder / "orbax")
    orbax_save(orbax, values)
    save_file(values, str(folder / "model.safetensors"))
    found = {}
    for name, path in (("orbax", orbax), ("safetensors", folder / "model.safetensors")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            placed = lazyckpt.device_put(lazyckpt.open(path), _sharding(), memory_budget="4MiB")
        found[f"{name} sent whole"] = sorted(str(w.message).split(":")[0] for w in caught)
        for key, expected in values.items():
            back = np.asarray(jax.device_get(placed[key]))
            same = back.dtype == expected.dtype and back.tobytes() == expected.tobytes()
            found[f"{name}/{key}"] = "equal" if same else "DIFFERENT"
    return found


def orbax_restore(path: str, kind: str, gib: float) -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp

    sharding = _sharding()
    args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=sharding), _shapes(kind, gib))
    checkpointer = ocp.PyTreeCheckpointer()

    def restore() -> Any:
        tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
        return jax.block_until_ready(tree)

    return measure(restore)


def _shapes(kind: str, gib: float) -> dict[str, Any]:
    if kind == "big":
        return {"w": 0}
    count = max(1, int(gib * GiB) // (ROWS * COLUMNS * 2))
    return {
        "layers": {str(i): {"w": 0, **({"scale": 0} if i < SMALL else {})} for i in range(count)}
    }


def safetensors_put(path: str) -> dict[str, Any]:
    import jax
    from safetensors.numpy import load_file

    sharding = _sharding()

    def restore() -> Any:
        return jax.block_until_ready(jax.device_put(load_file(path), sharding))

    return measure(restore)


def lazy_put(path: str, budget: str | None) -> dict[str, Any]:
    import jax

    import lazyckpt

    sharding = _sharding()

    def restore() -> Any:
        tree = lazyckpt.open(path)
        return jax.block_until_ready(lazyckpt.device_put(tree, sharding, memory_budget=budget))

    return measure(restore)


def lazy_put_started(path: str, budget: str | None) -> dict[str, Any]:
    """`lazy_put`, after one transfer of 16 bytes to the device: the runtime's own
    memory for transfers, taken at a process's first, is then in the baseline."""
    import jax
    import numpy as np

    jax.device_put(np.zeros(4, np.float32), _device()).block_until_ready()
    return lazy_put(path, budget)


def lazy_put_again(path: str, budget: str | None) -> dict[str, Any]:
    """Placed once, then measured placing again in that process: with the programs
    that assemble a shard on the device already compiled."""
    import jax

    import lazyckpt

    sharding = _sharding()

    def restore() -> Any:
        tree = lazyckpt.open(path)
        return jax.block_until_ready(lazyckpt.device_put(tree, sharding, memory_budget=budget))

    jax.block_until_ready(restore())
    return measure(restore)


def compiling_only(path: str) -> dict[str, Any]:
    """The host memory and time of compiling, alone, the programs that assemble the
    `big` array on the device from bands (`lazyckpt._device.shard`)."""
    import ml_dtypes
    import numpy as np

    from lazyckpt._device import shard as on_device

    device = _device()
    bf16, written = np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)
    shape = tuple(_big_shape(path))

    os.environ["LAZYCKPT_CACHE_DIR"] = ""  # (compiled, never loaded)

    def compile_all() -> Any:
        buffer = on_device.empty(shape, written, device)
        band = (max(1, (128 << 20) // 4 // (shape[1] * 2)), shape[1])  # a 256 MiB budget's
        on_device.write_program(shape, band, written, device)
        changed = on_device.changed_patterns(device, bf16)
        if changed:
            on_device.program_for(on_device.holds_fn(changed), shape, written, device)
        on_device.program_for(on_device.bitcast_fn(bf16), shape, written, device)
        return buffer

    return measure(compile_all)


SHAPES = [(3, 6, 16), (2, 6, 16), (4, 6, 16), (3, 4, 16), (3, 8, 16), (3, 6, 8), (3, 6, 32)]
"""Shapes of lazyckpt's threads that `--shapes` compares: sending threads, reading
threads, MiB a reading thread reads at a time (`lazyckpt._device.senders`)."""


def thread_shapes(path: str, rounds: int) -> dict[str, Any]:
    """The best of `rounds` placements of `path` with each of `SHAPES` (`best`), in a
    process that placed it once first; the shapes taken in turn each round, so that a
    drift of the machine falls on all of them. `sent`: whether the threads sent
    anything (CPU devices adopt host buffers instead)."""
    import jax

    import lazyckpt
    from lazyckpt._device import senders as threads
    from lazyckpt._device import staged as _staged

    sharding = _sharding()

    def place() -> Any:
        return jax.block_until_ready(lazyckpt.device_put(lazyckpt.open(path), sharding))

    place()
    best: dict[str, float] = {}
    for _ in range(rounds):
        for senders, readers, part in SHAPES:
            threads._SENDERS, threads._READERS, threads.READ_PART = senders, readers, part << 20
            start = time.perf_counter()
            place()
            name = f"{senders} senders, {readers} readers, {part} MiB parts"
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    return {"best": best, "sent": _staged.staged(sharding)}


STAGES = {
    ("lazyckpt._engine.decode", "ChunkStream", "next"): "decoding slabs, reads included",
    ("lazyckpt._engine.decode", "ChunkStream", "_open"): "opening chunks",
    ("lazyckpt._engine.stream", "_AsReady", "next"): "waiting for a block",
    ("lazyckpt._device.shard", "Shard", "write"): "sending blocks",
    ("lazyckpt._device.staged", "_Gate", "reserve"): "waiting for room",
}
"""What `--stages` times: (module, class, method) and what it is called."""


def stage_times(path: str) -> dict[str, Any]:
    """Where a placement of `path` spends its time, in a process that placed it once:
    the seconds spent in each of `STAGES`, summed over the threads that ran it, beside
    the placement's own. CPU devices are made to take the accelerators' path (pieces
    sent, and copied out of host memory), so that it runs anywhere."""
    import importlib

    import jax

    import lazyckpt
    from lazyckpt._device import staged as _staged
    from lazyckpt._device.platforms import PLATFORMS, Platform

    sharding = _sharding()
    if not _staged.staged(sharding):
        PLATFORMS["cpu"] = Platform(staged=True, adopts=False)
    timers = Timers()
    for (module, owner, name), label in STAGES.items():
        timers.time(getattr(importlib.import_module(module), owner), name, label)
    spent = timers.spent

    def place() -> Any:
        return jax.block_until_ready(lazyckpt.device_put(lazyckpt.open(path), sharding))

    place()
    spent.clear()
    start = time.perf_counter()
    place()
    return {"placement": time.perf_counter() - start, **spent}


STREAM_THREADS = (12, 6)
STREAM_BUDGETS = (208, 512, 1024)  # MiB for the reads: half of 416 MiB (13 cores), and more


def stream_rates(path: str) -> dict[str, tuple[float, float, float]]:
    """Where the tree from Orbax stops, with nothing sent: its chunks decoded by N
    threads each looping over its share, by zstd's own stream reader over the data
    file and by lazyckpt's `ChunkStream` (4 MiB slabs into a 13 MiB buffer of the
    thread's own); then `_engine.stream.read_blocks` as a placement streams them (blocks of a
    sixteenth, as ready, dropped as they come) at several budgets. Each: (GB/s, the
    seconds spent in `ChunkStream.next` summed over threads, 0 for zstd by hand,
    and the MiB of fresh memory mapped for blocks), the best of two, in one process."""
    import itertools
    import math
    import mmap
    import types
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import numpy as np
    import zstandard

    import lazyckpt
    from lazyckpt._array.geometry import chunk_box, slabs
    from lazyckpt._engine import decode, memory, stream
    from lazyckpt._engine.memory import BufferPool
    from lazyckpt._engine.stored import stored_array

    leaves = [leaf for leaf in jax.tree.leaves(lazyckpt.open(path)) if leaf.nbytes >= MiB]
    size = sum(leaf.nbytes for leaf in leaves)
    chunks = []  # (stored, index, file, offset)
    for leaf in leaves:
        stored = stored_array(leaf)
        grid = [math.ceil(n / c) for n, c in zip(stored.shape, stored.chunks, strict=True)]
        for index in itertools.product(*map(range, grid)):
            chunk = decode.ChunkStream(stored, index, 0)
            located, place = chunk._locate(), stored.store.local_file(chunk.key)
            assert located and place, f"{chunk.key}: not in a local file"
            chunks.append((stored, index, place[0], place[1] + located[0]))
    buffer = 13 * MiB

    def by_hand(share: list[Any]) -> None:
        out = np.empty(buffer, np.uint8)
        for stored, _, file_path, offset in share:
            total = math.prod(stored.chunks) * stored.dtype.itemsize
            with open(file_path, "rb", buffering=0) as file:
                file.seek(offset)
                reader = zstandard.ZstdDecompressor().stream_reader(file, read_size=4 * MiB)
                for at in range(0, total, buffer):
                    want, filled = min(buffer, total - at), 0
                    while filled < want:
                        filled += reader.readinto(out.data[filled:want])

    def ours(share: list[Any]) -> None:
        out = memoryview(np.empty(buffer, np.uint8))
        for stored, index, _, _ in share:
            chunk = decode.ChunkStream(stored, index, decode.READ_BYTES)
            at, itemsize = 0, stored.dtype.itemsize
            for slab in slabs(
                chunk_box(index, stored.chunks), stored.codec.order, itemsize, 4 * MiB
            ):
                nbytes = math.prod(high - low for low, high in slab) * itemsize
                at = 0 if at + nbytes > buffer else at
                chunk.next(slab, out[at : at + nbytes])
                at += nbytes
            chunk.finish()
            chunk.close()

    timers = Timers()
    timers.time(decode.ChunkStream, "next", "next")
    spent = timers.spent

    class Mapping:  # (the blocks' memory, fresh pages, as `memory` maps it)
        def __call__(self, fileno: int, length: int, *args: Any) -> mmap.mmap:
            timers.add("mapped", length)
            return mmap.mmap(fileno, length, *args)

    memory.mmap = types.SimpleNamespace(mmap=Mapping(), PAGESIZE=mmap.PAGESIZE)  # type: ignore[assignment]
    cases: dict[str, Any] = {}
    for threads in STREAM_THREADS:
        for name, work in (("zstd by hand", by_hand), ("ChunkStream", ours)):
            cases[f"{name}, {threads} threads"] = lambda work=work, n=threads: list(
                ThreadPoolExecutor(n).map(work, [chunks[i::n] for i in range(n)])
            )
    for mib in STREAM_BUDGETS:

        def blocks(half: int = mib * MiB) -> None:
            pool = BufferPool(half)
            for _ in stream.read_blocks(leaves, half, pool=pool, in_order=False, block=half // 16):
                pass

        # (labelled by read_blocks's old name, iter_blocks, so that figures stay comparable)
        cases[f"iter_blocks, {mib} MiB, blocks of {mib // 16} MiB"] = blocks
    rates: dict[str, tuple[float, float, float]] = {}
    for name, case in cases.items():
        for _ in range(2):
            spent.clear()
            start = time.perf_counter()
            case()
            seconds = time.perf_counter() - start
            if size / seconds / 1e9 > rates.get(name, (0.0,))[0]:
                rates[name] = (size / seconds / 1e9, spent["next"], spent["mapped"] / MiB)
    return rates


def _big_shape(path: str) -> tuple[int, ...]:
    import lazyckpt

    return tuple(lazyckpt.open(path)["w"].shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench-device"))
    parser.add_argument("--gib", type=float, default=3.0)
    parser.add_argument("--big-gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--kind",
        choices=("tree", "big"),
        help="only this checkpoint (the values are checked with the tree): a run in two parts",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--only", help="run only the cases whose name starts with this (`lazyckpt`)"
    )
    parser.add_argument(
        "--shapes",
        action="store_true",
        help="only compare shapes of lazyckpt's reading threads on the tree from safetensors",
    )
    parser.add_argument(
        "--streams",
        action="store_true",
        help="only compare decoding the tree from Orbax by hand, by lazyckpt's chunk "
        "streams, and through _engine.stream.read_blocks, nothing sent",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="only time the stages of a placement of the tree from Orbax",
    )
    args = parser.parse_args()
    print(machine())
    root = fresh_dir(args.root)
    if args.stages:
        orbax, _ = in_fresh_process(make, root, "tree", args.gib)
        for name, seconds in in_fresh_process(stage_times, orbax).items():
            print(f"{name:40} {seconds:7.3f} s")
        return
    if args.streams:
        orbax, _ = in_fresh_process(make, root, "tree", args.gib)
        for name, (rate, decoding, mapped) in in_fresh_process(stream_rates, orbax).items():
            print(
                f"{name:44} {rate:6.2f} GB/s, {decoding:6.2f} s in ChunkStream.next, "
                f"{mapped:5.0f} MiB mapped afresh"
            )
        return
    if args.shapes:
        _, safetensors = in_fresh_process(make, root, "tree", args.gib)
        data = os.path.getsize(safetensors)
        shapes = in_fresh_process(thread_shapes, safetensors, max(3, args.repeat))
        if not shapes["sent"]:
            print("CPU devices adopt the host buffers: no shape below sends anything")
        for name, seconds in shapes["best"].items():
            print(f"{name:40} {seconds:6.3f} s {data / seconds / 1e9:6.2f} GB/s")
        return
    # The programs lazyckpt compiles for the device, kept across processes: the cases
    # named "first use" start without them, the others find them there.
    programs = root / "programs"
    os.environ["LAZYCKPT_CACHE_DIR"] = str(programs)
    ceiling_files = []
    report: dict[str, Any] = {"machine": machine()}
    if args.kind != "big":
        values = in_fresh_process(check_values, str(root))
        print("bit for bit:", ", ".join(f"{k} {v}" for k, v in values.items()))
        report["values"] = values
    for kind, gib in (("tree", args.gib), ("big", args.big_gib)):
        if args.kind not in (None, kind):
            continue
        orbax, safetensors = in_fresh_process(make, root, kind, gib)
        ceiling_files.append(safetensors)
        data = os.path.getsize(safetensors)
        cases = {
            "orbax restore": (orbax_restore, orbax, kind, gib),
            "safetensors load_file + device_put": (safetensors_put, safetensors),
            "lazyckpt orbax": (lazy_put, orbax, None),
            "lazyckpt orbax, 256MiB": (lazy_put, orbax, "256MiB"),
            "lazyckpt safetensors": (lazy_put, safetensors, None),
            "lazyckpt safetensors, 256MiB": (lazy_put, safetensors, "256MiB"),
        }
        if kind == "big":  # what compiling for the device costs where nothing is cached
            cases = {
                "lazyckpt safetensors, first use": (lazy_put, safetensors, None),
                "lazyckpt safetensors, 256MiB, first use": (lazy_put, safetensors, "256MiB"),
                "lazyckpt safetensors, 256MiB, first use, runtime started": (
                    lazy_put_started,
                    safetensors,
                    "256MiB",
                ),
                **cases,
                "lazyckpt compiling only": (compiling_only, safetensors),
                "lazyckpt safetensors again, 256MiB": (lazy_put_again, safetensors, "256MiB"),
            }
        figures = {}
        lazy_cases = not args.only or any(
            name.startswith("lazyckpt") and name.startswith(args.only) for name in cases
        )
        if lazy_cases:
            # The programs the later cases load: each budget cuts its own pieces, and
            # Orbax's streamed blocks are not safetensors' bands.
            for path in (safetensors, orbax):
                if not args.only or any(
                    name.startswith(args.only) and fn_args[0] == path
                    for name, (_, *fn_args) in cases.items()
                ):
                    for budget in (None, "256MiB"):
                        in_fresh_process(lazy_put, path, budget)
        for name, (fn, *fn_args) in cases.items():
            if args.only and not name.startswith(args.only):
                continue
            # (first use: a folder of its own, empty; the others share one, filled first)
            first_use = root / f"programs-{len(figures)}"
            os.environ["LAZYCKPT_CACHE_DIR"] = str(first_use if "first use" in name else programs)
            runs = [in_fresh_process(fn, *fn_args) for _ in range(args.repeat)]
            figures[name] = min(runs, key=lambda r: r["seconds"])
        limits = in_fresh_process(ceilings, [safetensors], orbax)
        if kind == "tree":
            print(
                f"device: {limits['device']}; ceilings: host->device {limits['h2d_one']:.2f} GB/s "
                f"(one transfer), {limits['h2d_8']:.2f} GB/s (8 at once); file reads "
                f"{limits['read_one']:.2f} GB/s (1 thread), {limits['read_6']:.2f} GB/s (6), "
                f"{limits['read_12']:.2f} GB/s (12)"
            )
        slower = min(
            max(limits["h2d_one"], limits["h2d_8"]),
            max(limits["read_one"], limits["read_6"], limits["read_12"]),
        )
        both, decoded = limits["read_and_send"], limits["decode_and_send"]
        print(
            f"\n{kind}: {data / GiB:.2f} GiB; the slower ceiling {slower:.2f} GB/s; by hand: "
            f"the file read and sent {both:.2f} GB/s, Orbax's chunks read, decoded and sent "
            f"{decoded:.2f} GB/s"
        )
        print(f"{'case':56} {'seconds':>8} {'GB/s':>6} {'host peak':>10}  vs ceiling, by hand")
        for name, r in figures.items():
            rate = data / r["seconds"] / 1e9
            hand = decoded if "orbax" in name else both
            print(
                f"{name:56} {r['seconds']:8.2f} {rate:6.2f} "
                f"{r['peak_above_baseline'] / MiB:7.0f} MiB  {rate / slower:.2f}x {rate / hand:.2f}x"
            )
        for peer, ours in (
            ("orbax restore", "lazyckpt orbax"),
            ("safetensors load_file + device_put", "lazyckpt safetensors"),
        ):
            if peer not in figures or ours not in figures:
                continue
            print(
                f"{ours} over {peer}: {figures[peer]['seconds'] / figures[ours]['seconds']:.2f}x "
                f"at the default budget"
                + "".join(
                    f", {figures[peer]['seconds'] / figures[name]['seconds']:.2f}x {name[len(ours) + 2 :]}"
                    for name in figures
                    if name.startswith(ours + ",")
                )
            )
        report[kind] = {"bytes": data, "ceilings": limits, "cases": figures}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
