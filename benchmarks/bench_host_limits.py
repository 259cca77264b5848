"""What limits placing a tree decoded from Orbax on an accelerator's host (issue 47):
the host's own rates, each measured alone and then together, beside lazyckpt's.

    python benchmarks/bench_host_limits.py [--root DIR] [--gib 3]

Runs where JAX finds no accelerator too (it then says so, and the sends go to a CPU
device, which adopts host memory rather than copying it). On the tree of
`bench_device.py` (`--gib` GiB of bfloat16 in 64 MiB arrays, written by Orbax with
its defaults: one zstd chunk per array), in one process, each the best of two:

- fresh memory: 128 MiB anonymous maps filled once, by 1 and 8 threads, touched
  page by page or mapped with `MAP_POPULATE`; and a buffer filled again;
- decoding alone: lazyckpt's chunk streams into a buffer of each thread's own, on
  1, 4, 8 and 12 threads;
- sending alone: 12 threads each sending 13 MiB pieces of uint16 from a buffer of
  its own and waiting for each, plain (`jax.device_put`) and written into a shard's
  buffer on the device as lazyckpt writes them (`shard.write`);
- decoding and sending by hand: 12 threads each decoding a chunk into a buffer of its
  own (8, 16 or 64 MiB) and sending each buffer as it fills, waiting for it; and the
  same with each buffer written into its chunk's buffer on the device as lazyckpt
  writes a shard's pieces (8 and 16 MiB);
- one thread sending 13 MiB pieces into a shard's buffer, one at a time as a
  placement's consumer does: the milliseconds a piece spends in `jax.device_put`, in
  calling the write program and waiting for the transfer, alone and while 12 threads
  decode the tree, with the pieces' starts given as host integers and already on the
  device;
- lazyckpt: `device_put` of the whole tree at the default budget and at 256 MiB
  (programs compiled by a first placement), with the seconds its decoding threads
  spend decoding, summed, and where its consumer's time goes.
"""

from __future__ import annotations

import argparse
import itertools
import math
import mmap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import MiB, Timers, fresh_dir, in_fresh_process, machine, measure

FILL = 128 * MiB
PIECE_ROWS = 832  # x 8192 uint16: 13 MiB, the pieces a placement sends at its default budget


def _rate(nbytes: int, work: Callable[[], Any]) -> float:
    """GB/s of `nbytes` through `work`, the best of two."""
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _threads(count: int, work: Callable[[Any], None], shares: list[Any]) -> None:
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(work, shares))


def _fill_fresh(populate: bool) -> None:
    import numpy as np

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    memory = mmap.mmap(-1, FILL, flags=flags)
    values = np.frombuffer(memory, np.uint8)
    values.fill(1)
    del values
    memory.close()


def memory_rates() -> dict[str, float]:
    import numpy as np

    rates = {}
    for populate, how in ((False, "touched"), (True, "MAP_POPULATE")):
        for count in (1, 8):
            rates[f"fresh memory filled, {how}, {count} threads"] = _rate(
                count * FILL,
                lambda c=count, p=populate: _threads(c, lambda _: _fill_fresh(p), [0] * c),
            )
    again = np.zeros(FILL, np.uint8)
    rates["the same memory filled again, 1 thread"] = _rate(FILL, lambda: again.fill(1))
    return rates


def _chunks(path: str) -> tuple[list[tuple[Any, tuple[int, ...]]], int]:
    import jax

    import lazyckpt
    from lazyckpt._engine.stored import stored_array

    leaves = [leaf for leaf in jax.tree.leaves(lazyckpt.open(path)) if leaf.nbytes >= MiB]
    chunks = []
    for leaf in leaves:
        stored = stored_array(leaf)
        grid = [math.ceil(n / c) for n, c in zip(stored.shape, stored.chunks, strict=True)]
        chunks += [(stored, index) for index in itertools.product(*map(range, grid))]
    return chunks, sum(leaf.nbytes for leaf in leaves)


Send = Callable[[Any, tuple[int, ...], tuple[tuple[int, int], ...], Any], None]
"""`send(stored, index, slab, values)`: a decoded slab of chunk `index` of `stored`."""


def _decode(share: list[Any], buffer: int, send: Send | None) -> None:
    """Each chunk of `share` decoded by lazyckpt's `ChunkStream` into one buffer of
    `buffer` bytes, sent each time it is full (where `send`)."""
    import numpy as np

    from lazyckpt._array.geometry import chunk_box, slabs
    from lazyckpt._engine.decode import READ_BYTES, ChunkStream

    out = np.empty(buffer, np.uint8)
    for stored, index in share:
        stream = ChunkStream(stored, index, READ_BYTES)
        itemsize = stored.dtype.itemsize
        for slab in slabs(chunk_box(index, stored.chunks), stored.codec.order, itemsize, buffer):
            nbytes = math.prod(high - low for low, high in slab) * itemsize
            stream.next(slab, out.data[:nbytes])
            if send is not None:
                send(stored, index, slab, out[:nbytes])
        stream.finish()
        stream.close()


class _IntoShard:
    """Sends each slab into a buffer of its chunk on the device, written there as
    lazyckpt writes a shard's pieces (`shard.write`), waiting for each transfer;
    for chunks of 2-byte values in C order, as the tree's."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.chunk: tuple[int, tuple[int, ...]] | None = None
        self.buffer: Any = None

    def __call__(self, stored: Any, index: tuple[int, ...], slab: Any, values: Any) -> None:
        import jax
        import numpy as np

        from lazyckpt._array.geometry import chunk_box
        from lazyckpt._device import shard

        box = chunk_box(index, stored.chunks)
        if self.chunk != (id(stored), index):
            if self.buffer is not None:
                self.buffer.block_until_ready()
            shape = tuple(high - low for low, high in box)
            self.buffer = shard.empty(shape, np.dtype(np.uint16), self.device)
            self.chunk = (id(stored), index)
        piece = values.view(np.uint16).reshape([high - low for low, high in slab])
        sent = jax.device_put(piece, self.device)
        starts = tuple(low - first for (low, _), (first, _) in zip(slab, box, strict=True))
        self.buffer = shard.write(self.buffer, sent, starts)
        sent.block_until_ready()


def decode_and_send_rates(path: str) -> dict[str, float]:
    import jax
    import numpy as np

    from lazyckpt._device import shard

    device = jax.devices()[0]
    jax.device_put(np.zeros(4, np.float32), device).block_until_ready()
    chunks, size = _chunks(path)
    rates = {}
    for count in (1, 4, 8, 12):
        shares = [chunks[i::count] for i in range(count)]
        rates[f"decoding alone, {count} threads"] = _rate(
            size, lambda c=count, s=shares: _threads(c, lambda x: _decode(x, 16 * MiB, None), s)
        )

    def send(stored: Any, index: Any, slab: Any, values: Any) -> None:
        jax.device_put(values, device).block_until_ready()

    shares = [chunks[i::12] for i in range(12)]
    for buffer in (8, 16, 64):
        rates[f"decoded and sent by hand, 12 threads, {buffer} MiB buffers"] = _rate(
            size, lambda b=buffer: _threads(12, lambda x: _decode(x, b * MiB, send), shares)
        )
    for buffer in (8, 16):
        _decode(chunks[:1], buffer * MiB, _IntoShard(device))  # (its programs compiled)
        rates[f"the same, {buffer} MiB, written into a shard's buffer"] = _rate(
            size,
            lambda b=buffer: _threads(
                12, lambda x: _decode(x, b * MiB, _IntoShard(device)), shares
            ),
        )
    shape = (4096, 8192)  # a 64 MiB shard of uint16, as bfloat16 is written

    def pieces(written: bool) -> None:
        host = np.ones((PIECE_ROWS, shape[1]), np.uint16)
        for _ in range(4):
            dtype = np.dtype(np.uint16)
            buffer = shard.empty(shape, dtype, device) if written else None
            for at in range(0, shape[0] - PIECE_ROWS + 1, PIECE_ROWS):
                sent = jax.device_put(host, device)
                if buffer is not None:
                    buffer = shard.write(buffer, sent, (at, 0))
                sent.block_until_ready()
            if buffer is not None:
                buffer.block_until_ready()

    sent_bytes = 12 * 4 * (shape[0] // PIECE_ROWS) * PIECE_ROWS * shape[1] * 2
    for written, how in ((False, "plain"), (True, "written into a shard's buffer")):
        pieces(written)  # (its programs compiled)
        rates[f"sending alone, 12 threads, 13 MiB pieces, {how}"] = _rate(
            sent_bytes, lambda w=written: _threads(12, lambda _: pieces(w), [0] * 12)
        )
    return rates


def send_costs(path: str) -> dict[str, tuple[float, float, float]]:
    """What one thread sending 13 MiB pieces into a shard's buffer, one at a time (as a
    placement's consumer sends), spends a piece: milliseconds in `jax.device_put`, in
    calling the write program and waiting for the transfer; alone, and while 12
    threads decode the tree (nothing else sent); with the pieces' starts given as host
    integers (each call sends them) and taken from the device (`shard.Starts`, as
    lazyckpt writes)."""
    import jax
    import numpy as np

    from lazyckpt._device import shard

    device = jax.devices()[0]
    chunks, _ = _chunks(path)
    shape, dtype = (4096, 8192), np.dtype(np.uint16)
    host = np.ones((PIECE_ROWS, shape[1]), np.uint16)

    def sending(until: Callable[[], bool], at: Any) -> tuple[float, float, float]:
        spent, count = [0.0, 0.0, 0.0], 0
        while not until():
            buffer = shard.empty(shape, dtype, device)
            for row in range(0, shape[0] - PIECE_ROWS + 1, PIECE_ROWS):
                start = time.perf_counter()
                sent = jax.device_put(host, device)
                put = time.perf_counter()
                buffer = shard.write(buffer, sent, (row, 0), at)
                written = time.perf_counter()
                sent.block_until_ready()
                for k, seconds in enumerate(
                    (put - start, written - put, time.perf_counter() - written)
                ):
                    spent[k] += seconds
                count += 1
            buffer.block_until_ready()
        a, b, c = (1e3 * seconds / count for seconds in spent)
        return a, b, c

    def rounds(count: int) -> Callable[[], bool]:
        left = iter(range(count))
        return lambda: next(left, None) is None

    costs = {}
    for at, how in ((None, "starts from the host"), (shard.Starts(), "starts on the device")):
        sending(rounds(1), at)  # (its programs compiled, its starts sent)
        costs[f"one thread sending alone, {how}"] = sending(rounds(8), at)
        with ThreadPoolExecutor(12) as pool:
            decoding = [pool.submit(_decode, chunks[i::12], 16 * MiB, None) for i in range(12)]
            costs[f"the same while 12 threads decode, {how}"] = sending(
                lambda d=decoding: all(job.done() for job in d), at
            )
    return costs


def placement_rates(path: str) -> dict[str, tuple[float, ...]]:
    """lazyckpt's placement: GB/s, host peak MiB, decoding threads busy on average, and
    the seconds its consumer (the thread that sends the streamed blocks) spends waiting
    for blocks, writing them into shards and looking at the process's size."""
    import jax

    import lazyckpt
    from lazyckpt._device import shard
    from lazyckpt._engine import decode, memory, stream

    size = sum(leaf.nbytes for leaf in jax.tree.leaves(lazyckpt.open(path)))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    timers = Timers()
    timers.time(decode.ChunkStream, "next", "decoding")
    timers.time(stream._AsReady, "next", "waiting")
    timers.time(shard.Shard, "write", "writing")
    timers.time(memory.MemoryGuard, "check", "checking")
    rows = {}
    for budget in (None, "256MiB"):

        def place(budget: str | None = budget) -> Any:
            tree = lazyckpt.open(path)
            return jax.block_until_ready(lazyckpt.device_put(tree, sharding, memory_budget=budget))

        place()  # (the programs that assemble shards, compiled)
        best: tuple[float, ...] = ()
        for _ in range(2):
            timers.spent.clear()
            found = measure(place)
            seconds = found["seconds"]
            row = (seconds, found["peak_above_baseline"], timers.spent["decoding"] / seconds)
            row += tuple(timers.spent[name] for name in ("waiting", "writing", "checking"))
            best = row if not best or row < best else best
        seconds, peak, *rest = best
        rows[f"lazyckpt device_put, {budget or 'default budget'}"] = (
            size / seconds / 1e9,
            peak / MiB,
            *rest,
        )
    return rows


def _device_kind() -> str:
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return "no accelerator found: sending to a CPU device, which adopts host memory"
    return f"sending to {device.platform} {device.device_kind}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench-limits"))
    parser.add_argument("--gib", type=float, default=3.0)
    args = parser.parse_args()
    from bench_device import make

    print(machine())
    print(in_fresh_process(_device_kind))
    root = fresh_dir(args.root)
    orbax, _ = in_fresh_process(make, root, "tree", args.gib)
    for name, rate in in_fresh_process(memory_rates).items():
        print(f"{name:60} {rate:6.2f} GB/s")
    for name, rate in in_fresh_process(decode_and_send_rates, orbax).items():
        print(f"{name:60} {rate:6.2f} GB/s")
    for name, (put, write, wait) in in_fresh_process(send_costs, orbax).items():
        print(
            f"{name:64} a 13 MiB piece: {put:5.2f} ms in device_put, "
            f"{write:5.2f} ms calling the write program, {wait:5.2f} ms waiting"
        )
    for name, (rate, peak, busy, waiting, writing, checking) in in_fresh_process(
        placement_rates, orbax
    ).items():
        print(f"{name:60} {rate:6.2f} GB/s, peak {peak:5.0f} MiB, {busy:4.1f} threads decoding")
        if writing:  # (blocks sent in pieces: not where the devices adopt host memory)
            print(
                f"{'':60} its consumer: {waiting:.2f} s waiting for blocks, {writing:.2f} s "
                f"writing them, {checking:.2f} s looking at the process's size"
            )


if __name__ == "__main__":
    main()
