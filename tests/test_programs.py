"""Programs for devices compiled once per machine (`lazyckpt._programs`): a later
process loads what an earlier one compiled, and a cache that is damaged, shared or
switched off only costs a compilation. CPU devices stand in for an accelerator
(`STAGED_PLATFORMS`), as in test_staged.py."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from safetensors.numpy import save_file

import lazyckpt
import lazyckpt._on_device as on_device
import lazyckpt._programs as programs
import lazyckpt._staged as staged

ROOT = Path(__file__).resolve().parent.parent

# One process's placement of a 2 MiB bfloat16 array in pieces (bands of 256 KiB: the
# buffer, the update and the bitcast are compiled), printing how many programs its
# backend compiled and whether the values arrived bit for bit.
PLACE = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    import lazyckpt, lazyckpt._staged as staged
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **_: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None
    )
    staged.STAGED_PLATFORMS = frozenset({"cpu"})
    path = sys.argv[1]
    placed = lazyckpt.device_put(
        lazyckpt.open(path), jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        memory_budget=1 << 20,
    )
    stored = np.load(path + ".npy")
    same = np.asarray(placed["w"]).tobytes() == stored.tobytes()
    print(json.dumps({"compiled": len(compiles), "same": same}))
    """
)


def _weights(folder: Path) -> str:
    values = np.random.default_rng(0).standard_normal((1024, 1024), np.float32)
    values = values.astype(ml_dtypes.bfloat16)
    path = str(folder / "model.safetensors")
    save_file({"w": values}, path)
    np.save(path + ".npy", values)
    return path


def _place(path: str, cache: str) -> dict[str, Any]:
    environment = {**os.environ, programs.CACHE_VARIABLE: cache}
    done = subprocess.run(
        [sys.executable, "-c", PLACE, path],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=600,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_later_process_loads_what_the_first_compiled(tmp_path: Path) -> None:
    path, cache = _weights(tmp_path), str(tmp_path / "cache")
    first = _place(path, cache)
    files = sorted((tmp_path / "cache" / "programs").iterdir())
    second = _place(path, cache)
    assert first["same"] and second["same"]
    assert first["compiled"] >= 3  # the buffer, the update and the bitcast
    assert len(files) == first["compiled"]
    assert second["compiled"] == 0
    assert sorted((tmp_path / "cache" / "programs").iterdir()) == files


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache folder of this test's own, and this process's programs forgotten, so
    that each is compiled or loaded again."""
    monkeypatch.setenv(programs.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setattr(staged, "STAGED_PLATFORMS", frozenset({"cpu"}))
    monkeypatch.setattr(programs, "_LOADED", {})
    monkeypatch.setattr(on_device, "CHANGED", {})
    jax.clear_caches()
    yield tmp_path / "cache" / "programs"


def _forget() -> None:
    """This process's programs forgotten, by lazyckpt and by jax, as in a new process."""
    programs._LOADED.clear()
    on_device.CHANGED.clear()
    jax.clear_caches()


@pytest.fixture
def compiled() -> Iterator[list[str]]:
    """The programs the backend compiles while the test runs, one entry each."""
    names: list[str] = []

    def count(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    yield names
    jax.monitoring.unregister_event_duration_listener(count)


def _placed_bits(path: str) -> bytes:
    sharding = SingleDeviceSharding(jax.devices()[0])
    placed = lazyckpt.device_put(lazyckpt.open(path), sharding, memory_budget=1 << 20)
    return np.asarray(placed["w"]).tobytes()


def test_damaged_programs_are_compiled_and_written_again(
    tmp_path: Path, cache: Path, compiled: list[str]
) -> None:
    path = _weights(tmp_path)
    expected = np.load(path + ".npy").tobytes()
    assert _placed_bits(path) == expected
    files = sorted(cache.iterdir())
    for file in files:
        file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])
    _forget()
    compiled.clear()
    assert _placed_bits(path) == expected
    assert len(compiled) == len(files)
    payloads = {file.name: file.read_bytes() for file in files}
    _forget()
    compiled.clear()
    assert _placed_bits(path) == expected
    assert not compiled  # the files written again load
    assert {file.name: file.read_bytes() for file in cache.iterdir()} == payloads


def test_a_folder_others_can_write_is_not_used(tmp_path: Path, cache: Path) -> None:
    path = _weights(tmp_path)
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    assert programs.folder() is None
    assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert not list(cache.iterdir())


def test_no_cache_where_the_variable_is_empty(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(programs.CACHE_VARIABLE, "")
    path = _weights(tmp_path)
    assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert not cache.exists()


def test_loaded_programs_update_the_buffer_in_place(cache: Path, compiled: list[str]) -> None:
    """A program loaded from the cache still donates the buffer it writes into (no
    second copy of a shard in device memory)."""
    device = jax.devices()[0]
    written = np.dtype(np.uint16)
    on_device.empty_program((8, 4), written, device)
    on_device.write_program((8, 4), (2, 4), written, device)
    _forget()
    compiled.clear()
    buffer = on_device.empty((8, 4), written, device)
    piece = jax.device_put(np.arange(8, dtype=np.uint16).reshape(2, 4), device)
    result = on_device.write(buffer, piece, (2, 0))
    assert not compiled  # both loaded
    assert buffer.is_deleted()
    expected = np.zeros((8, 4), np.uint16)
    expected[2:4] = np.arange(8).reshape(2, 4)
    np.testing.assert_array_equal(np.asarray(result), expected)


def test_threads_asking_for_one_program_share_one_compilation(
    cache: Path, compiled: list[str]
) -> None:
    device, written = jax.devices()[0], np.dtype(np.uint16)
    start = threading.Barrier(8)

    def ask() -> Any:
        start.wait()
        return on_device.write_program((16, 8), (4, 8), written, device)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        programs_ = list(pool.map(lambda _: ask(), range(8)))
    assert len(compiled) == 1
    assert all(program is programs_[0] for program in programs_)


def test_threads_waiting_on_a_failed_compilation_are_told(cache: Path) -> None:
    """Those waiting for a program whose compilation fails get its error, none hangs,
    and asked again it is tried again."""
    device = jax.devices()[0]
    start = threading.Barrier(8)

    def refused(x: jax.Array) -> jax.Array:
        raise ValueError("refused to trace")

    function = jax.jit(refused)

    def ask() -> Any:
        start.wait()
        return programs.compiled(
            function, (on_device._abstract((4,), np.dtype(np.float32), device),), device
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        asked = [pool.submit(ask) for _ in range(8)]
        errors = [future.exception(timeout=120) for future in asked]
    assert all(isinstance(error, ValueError) for error in errors), errors
    assert not programs._LOADED
    with pytest.raises(ValueError, match="refused to trace"):
        programs.compiled(
            function, (on_device._abstract((4,), np.dtype(np.float32), device),), device
        )


def test_a_file_others_can_write_is_not_loaded(
    tmp_path: Path, cache: Path, compiled: list[str]
) -> None:
    path = _weights(tmp_path)
    assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    files = sorted(cache.iterdir())
    for file in files:
        file.chmod(0o664)
    _forget()
    compiled.clear()
    assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert len(compiled) == len(files)


def test_no_cache_without_a_home_folder(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose user has no home folder (a container run as a bare user id)
    places as without a cache."""

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(programs.CACHE_VARIABLE)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    assert programs.folder() is None
    path = _weights(tmp_path)
    assert _placed_bits(path) == np.load(path + ".npy").tobytes()


def test_the_folder_keeps_the_programs_used_last_within_its_limit(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Programs loaded lately are kept, those used longest ago go once the folder is
    over its limit, and what a writer that stopped halfway left is cleared."""
    path = _weights(tmp_path)
    _placed_bits(path)
    current = {file.name for file in cache.iterdir()}
    day_ago = time.time() - 86400
    for file in cache.iterdir():
        os.utime(file, (day_ago, day_ago))
    _forget()
    _placed_bits(path)  # loads them: used now
    assert all(file.stat().st_mtime > day_ago + 3600 for file in cache.iterdir())
    old = [cache / f"{n:064x}.bin" for n in range(4)]
    for file in old:
        file.write_bytes(b"\0" * (64 << 10))
        os.utime(file, (day_ago, day_ago))
    stale = cache / "abandoned.tmp"
    stale.write_bytes(b"\0" * 100)
    os.utime(stale, (day_ago, day_ago))
    kept = sum(file.stat().st_size for file in cache.iterdir() if file.name in current)
    monkeypatch.setattr(programs, "LIMIT", kept + (64 << 10))
    values = np.random.default_rng(1).standard_normal((2048, 512), np.float32)
    save_file({"w": values.astype(ml_dtypes.bfloat16)}, str(tmp_path / "other.safetensors"))
    _placed_bits(str(tmp_path / "other.safetensors"))  # new programs written
    names = {file.name for file in cache.iterdir()}
    assert current <= names
    assert not any(file.name in names for file in old)
    assert stale.name not in names
    assert sum(file.stat().st_size for file in cache.iterdir()) <= programs.LIMIT
