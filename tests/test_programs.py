"""Programs for devices compiled once per machine (`lazyckpt._device.programs`): a later
process loads what an earlier one compiled, and a cache that is damaged, shared or
switched off only costs a compilation. A program file is code (jax loads it through
pickle), so the tests plant a pickle that makes a marker folder when loaded where
another account could put one, and check that it is never loaded. CPU devices stand
in for an accelerator (`PLATFORMS`), as in test_staged.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import grp
import json
import os
import pickle
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from safetensors.numpy import save_file

import lazyckpt
import lazyckpt._device.programs as programs
import lazyckpt._device.shard as on_device
from lazyckpt import ProgramCacheWarning
from lazyckpt._device.platforms import PLATFORMS, Platform
from lazyckpt._storage import trusted

ROOT = Path(__file__).resolve().parent.parent

# One process's placement of a 2 MiB bfloat16 array in pieces (bands of 256 KiB: the
# buffer, the update and the bitcast are compiled), printing how many programs its
# backend compiled, whether the values arrived bit for bit, and the most bytes Python
# held at once meanwhile (tracemalloc: a program file read whole would count).
PLACE = textwrap.dedent(
    """
    import json, sys, tracemalloc
    import jax, numpy as np
    import lazyckpt
    from lazyckpt._device.platforms import PLATFORMS, Platform
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **_: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None
    )
    PLATFORMS["cpu"] = Platform(staged=True, adopts=True)
    path = sys.argv[1]
    tracemalloc.start()
    placed = lazyckpt.device_put(
        lazyckpt.open(path), jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        memory_budget=1 << 20,
    )
    peak = tracemalloc.get_traced_memory()[1]
    stored = np.load(path + ".npy")
    same = np.asarray(placed["w"]).tobytes() == stored.tobytes()
    print(json.dumps({"compiled": len(compiles), "same": same, "peak": peak}))
    """
)


def _weights(folder: Path) -> str:
    values = np.random.default_rng(0).standard_normal((1024, 1024), np.float32)
    values = values.astype(ml_dtypes.bfloat16)
    path = str(folder / "model.safetensors")
    save_file({"w": values}, path)
    np.save(path + ".npy", values)
    return path


def _place(path: str, cache: str, timeout: int = 600) -> dict[str, Any]:
    environment = {**os.environ, programs.CACHE_VARIABLE: cache}
    done = subprocess.run(
        [sys.executable, "-c", PLACE, path],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=timeout,
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
    monkeypatch.setitem(PLATFORMS, "cpu", Platform(staged=True, adopts=True))
    monkeypatch.setattr(programs, "_LOADED", {})
    monkeypatch.setattr(programs, "_WARNED", set(), raising=False)
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


def test_a_folder_others_can_write_is_not_used_and_named_once(tmp_path: Path, cache: Path) -> None:
    path = _weights(tmp_path)
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    with _refusals() as refused:
        with programs.folder() as found:
            assert found is None
        assert _placed_bits(path) == np.load(path + ".npy").tobytes()
        _forget()
        assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert not list(cache.iterdir())
    assert len(refused) == 1  # once per process, however many programs are asked for
    assert f"{cache} can be written by others" in refused[0]
    assert f"{programs.CACHE_VARIABLE}= (empty) to turn the cache off" in refused[0]


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
    with programs.folder() as found:
        assert found is None
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
    stale = cache / f"{0:064x}.{0:016x}.tmp"  # named as the cache names what it writes
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


# What another account can do to a cache, and what the cache must then refuse.

OTHER = 65534
"""Another account's user id (`nobody`)."""

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="acting as another account (uid 65534: a command run as it, or a chown to "
    "it) needs root, which the tests have in CI",
)


class _Planted:
    """What another account would put under a program's name: a pickle that, loaded,
    makes the folder `marker` (any code could run there)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def _plant(folder: Path, names: Sequence[str], marker: Path) -> None:
    """`folder` (a folder of the user's alone) holding the payload under `names`."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in names:
        (folder / name).write_bytes(pickle.dumps(_Planted(marker)))


def _learn(path: str, cache: Path) -> list[str]:
    """The names of the programs placing `path` needs, compiled into `cache` (and then
    forgotten by this process)."""
    _placed_bits(path)
    _forget()
    return sorted(os.listdir(cache))


def _as_other_user(folder: Path, *command: str) -> None:
    """`command` run in `folder` as another account: what it leaves there is its doing."""
    subprocess.run(
        command, cwd=folder, user=OTHER, group=OTHER, extra_groups=[], check=True, timeout=60
    )


@contextlib.contextmanager
def _refusals() -> Iterator[list[str]]:
    """The messages of the `ProgramCacheWarning`s given in the block, once it ends
    (any other warning is an error, as in the rest of the suite)."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        warnings.simplefilter("always", ProgramCacheWarning)
        yield found
    found.extend(str(w.message) for w in caught if issubclass(w.category, ProgramCacheWarning))


@needs_root
def test_a_link_another_account_planted_above_the_cache_is_not_followed(
    tmp_path: Path, cache: Path, compiled: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LAZYCKPT_CACHE_DIR=/tmp/mine` where another account made `/tmp/mine` first: a
    link to a folder of the user's that holds a pickle under a program's name. The
    user's own link there is followed (as `~/.cache -> /data/cache`)."""
    path = _weights(tmp_path)
    expected = np.load(path + ".npy").tobytes()
    names = _learn(path, cache)
    marker, downloads = tmp_path / "ran", tmp_path / "downloads"
    _plant(downloads / "programs", names, marker)
    shared = tmp_path / "shared"  # as /tmp: anyone may add, each entry only its owner replace
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    _as_other_user(shared, "ln", "-s", str(downloads), "mine")
    assert (shared / "mine").lstat().st_uid == OTHER
    monkeypatch.setenv(programs.CACHE_VARIABLE, str(shared / "mine"))
    compiled.clear()
    with _refusals() as refused:
        assert _placed_bits(path) == expected
    assert not marker.exists()  # the payload was not loaded
    assert len(compiled) == len(names)  # compiled instead
    assert len(refused) == 1
    assert f"{shared / 'mine'} is a link owned by user id {OTHER}" in refused[0]
    (shared / "own").symlink_to(cache.parent)  # the user's own link, to their real cache
    monkeypatch.setenv(programs.CACHE_VARIABLE, str(shared / "own"))
    _forget()
    compiled.clear()
    assert _placed_bits(path) == expected
    assert not compiled  # loaded through it


@needs_root
def test_programs_swapped_for_a_link_by_another_account_is_not_followed(
    tmp_path: Path, cache: Path, compiled: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache in a folder a team shares (others may write it): another account puts a
    link to a folder of the user's in place of `programs/`."""
    path = _weights(tmp_path)
    names = _learn(path, cache)
    marker, downloads = tmp_path / "ran", tmp_path / "downloads"
    _plant(downloads, names, marker)
    team = tmp_path / "team"
    (team / "programs").mkdir(parents=True, mode=0o700)
    team.chmod(0o777)
    _as_other_user(team, "mv", "programs", "moved")
    _as_other_user(team, "ln", "-s", str(downloads), "programs")
    monkeypatch.setenv(programs.CACHE_VARIABLE, str(team))
    compiled.clear()
    with _refusals() as refused:
        assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert not marker.exists()
    assert len(compiled) == len(names)
    assert len(refused) == 1 and f"{team} can be written by others" in refused[0]


def test_a_link_in_place_of_the_programs_folder_is_not_followed(
    tmp_path: Path, cache: Path, compiled: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the configured folder nothing is a link, whoever made it."""
    path = _weights(tmp_path)
    names = _learn(path, cache)
    marker, downloads = tmp_path / "ran", tmp_path / "downloads"
    _plant(downloads, names, marker)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (root / "programs").symlink_to(downloads)
    monkeypatch.setenv(programs.CACHE_VARIABLE, str(root))
    compiled.clear()
    with _refusals() as refused:
        assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert not marker.exists()
    assert len(compiled) == len(names)
    assert len(refused) == 1 and f"{root / 'programs'} is a link" in refused[0]


@pytest.mark.parametrize(
    ("change", "found"),
    [
        ("owned by another account", f"is owned by user id {OTHER}, not by you"),
        ("writable by others", "can be written by others"),
        ("writable by its group, which has another member", "can be written by its group"),
    ],
)
def test_a_folder_above_the_cache_others_could_change_is_not_used(
    tmp_path: Path,
    cache: Path,
    compiled: list[str],
    monkeypatch: pytest.MonkeyPatch,
    change: str,
    found: str,
) -> None:
    """Whoever may replace an entry of a folder above the cache could have put its own
    `cache/programs` there (a group's other member too); where only an entry's owner
    may (a sticky folder, /tmp), the cache is used."""
    _accounts(monkeypatch, shared=True)
    if change == "owned by another account" and os.geteuid() != 0:
        pytest.skip("giving a folder to another account (chown to uid 65534) needs root")
    path = _weights(tmp_path)
    expected = np.load(path + ".npy").tobytes()
    names = _learn(path, cache)
    marker, above = tmp_path / "ran", tmp_path / "above"
    above.mkdir(mode=0o700)
    _plant(above / "cache" / "programs", names, marker)
    (above / "cache").chmod(0o700)
    mode = 0o777 if change == "writable by others" else 0o770 if "group" in change else 0o755
    above.chmod(mode)
    if change == "owned by another account":
        os.chown(above, OTHER, OTHER)
    monkeypatch.setenv(programs.CACHE_VARIABLE, str(above / "cache"))
    compiled.clear()
    with _refusals() as refused:
        assert _placed_bits(path) == expected
    assert not marker.exists()
    assert len(compiled) == len(names)
    assert len(refused) == 1 and f"{above} {found}" in refused[0]
    if change != "owned by another account":
        above.chmod(mode | stat.S_ISVTX)
        for name in names:  # the user's own programs now, in a folder of theirs
            shutil.copyfile(cache / name, above / "cache" / "programs" / name)
        _forget()
        compiled.clear()
        assert _placed_bits(path) == expected
        assert not compiled


@needs_root
def test_a_program_file_owned_by_another_account_is_not_loaded(
    tmp_path: Path, cache: Path, compiled: list[str]
) -> None:
    path = _weights(tmp_path)
    names = _learn(path, cache)
    marker = tmp_path / "ran"
    _plant(cache, names, marker)
    for name in names:
        os.chown(cache / name, OTHER, OTHER)
    compiled.clear()
    assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert not marker.exists()
    assert len(compiled) == len(names)
    assert all((cache / name).stat().st_uid == os.getuid() for name in names)  # written anew


def test_the_cache_never_removes_a_file_it_did_not_write(
    tmp_path: Path, cache: Path, compiled: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LAZYCKPT_CACHE_DIR=~` where `~/programs/` holds the user's own weights: the
    folder is not the cache's, so nothing is written there and nothing removed."""
    path = _weights(tmp_path)
    home = tmp_path / "home"
    (home / "programs").mkdir(parents=True, mode=0o700)
    weights = home / "programs" / "pytorch_model.bin"
    weights.write_bytes(b"the user's own weights" * 1000)
    day_ago = time.time() - 86400
    os.utime(weights, (day_ago, day_ago))  # the oldest file there: the first to trim
    monkeypatch.setenv(programs.CACHE_VARIABLE, str(home))
    monkeypatch.setattr(programs, "LIMIT", 0)  # every placement that compiles trims
    with _refusals() as refused:
        assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert weights.read_bytes() == b"the user's own weights" * 1000
    assert os.listdir(home / "programs") == ["pytorch_model.bin"]
    assert compiled
    assert len(refused) == 1 and "holds 'pytorch_model.bin'" in refused[0]


@pytest.mark.parametrize(
    ("variable", "planted"),
    [(programs.CACHE_VARIABLE, "programs"), ("XDG_CACHE_HOME", "lazyckpt/programs")],
)
def test_a_relative_cache_location_is_not_used(
    tmp_path: Path,
    cache: Path,
    compiled: list[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    planted: str,
) -> None:
    """Run inside a cloned repository that carries a `programs/` folder, a relative
    location would load the repository's files: LAZYCKPT_CACHE_DIR's means no cache
    (and says so), XDG_CACHE_HOME's is ignored (as the XDG specification says)."""
    path = _weights(tmp_path)
    names = _learn(path, cache)
    marker, repository, home = tmp_path / "ran", tmp_path / "repository", tmp_path / "home"
    _plant(repository / planted, names, marker)
    monkeypatch.chdir(repository)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(programs.CACHE_VARIABLE)
    monkeypatch.setenv(variable, ".")
    compiled.clear()
    with _refusals() as refused:
        assert _placed_bits(path) == np.load(path + ".npy").tobytes()
    assert not marker.exists()
    assert len(compiled) == len(names)
    if variable == programs.CACHE_VARIABLE:
        assert len(refused) == 1
        assert f"{programs.CACHE_VARIABLE}=. is not an absolute path" in refused[0]
    else:
        assert not refused
        assert sorted(os.listdir(home / ".cache" / "lazyckpt" / "programs")) == names


@pytest.mark.parametrize("planted", ["a FIFO", "a 1 GiB file"])
def test_what_cannot_be_a_program_under_its_name_is_not_read(tmp_path: Path, planted: str) -> None:
    """A FIFO, opened to be read, would wait for a writer forever; a file far larger
    than any program would be read whole. Either is compiled again instead, in a child
    process, so that a hang fails the test."""
    path, root = _weights(tmp_path), tmp_path / "cache"
    assert _place(path, str(root))["same"]
    victim = sorted((root / "programs").iterdir())[0]
    victim.unlink()
    if planted == "a FIFO":
        os.mkfifo(victim, 0o600)
    else:
        with open(victim, "wb") as out:  # (sparse: the disk holds none of it)
            out.truncate(1 << 30)
    placed = _place(path, str(root), timeout=300)
    assert placed["same"]
    assert placed["compiled"] == 1
    assert placed["peak"] < 256 << 20  # never read: reading it would hold 1 GiB
    assert stat.S_ISREG(victim.stat().st_mode) and victim.stat().st_size < programs.MOST


# Common setups where no other account can write, which the cache uses.


def _accounts(monkeypatch: pytest.MonkeyPatch, *, shared: bool) -> None:
    """The account database the cache consults: the user's primary group (that of the
    folders they make) is theirs alone, a user private group as Fedora makes one;
    `shared`, it lists another account too."""
    me = pwd.struct_passwd(("me", "x", os.getuid(), os.getgid(), "", "/home/me", "/bin/sh"))
    other = pwd.struct_passwd(("other", "x", OTHER, OTHER, "", "/nonexistent", "/bin/sh"))
    group = grp.struct_group(("me", "x", os.getgid(), ["me", "other"] if shared else []))
    monkeypatch.setattr(pwd, "getpwall", lambda: [me, other])
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: {me.pw_uid: me, OTHER: other}[uid])
    monkeypatch.setattr(grp, "getgrgid", lambda gid: {os.getgid(): group}[gid])


def test_folders_the_users_own_group_can_write_are_used(
    tmp_path: Path, cache: Path, compiled: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the umask 002 of Fedora and RHEL, whose user private groups hold no one
    else, `~` and `~/.cache` are made `drwxrwxr-x` (as pip makes `~/.cache/pip`): the
    cache under them is used, without a warning."""
    _accounts(monkeypatch, shared=False)
    path = _weights(tmp_path)
    expected = np.load(path + ".npy").tobytes()
    home = tmp_path / "home"
    before = os.umask(0o002)
    try:
        (home / ".cache" / "pip").mkdir(parents=True)
    finally:
        os.umask(before)
    assert stat.S_IMODE((home / ".cache").stat().st_mode) == 0o775
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(programs.CACHE_VARIABLE)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    with _refusals() as refused:
        assert _placed_bits(path) == expected
        names = sorted(os.listdir(home / ".cache" / "lazyckpt" / "programs"))
        _forget()
        compiled.clear()
        assert _placed_bits(path) == expected
    assert not refused
    assert names and not compiled  # written by the first, loaded by the second


# Run in a user namespace that maps root alone (as bwrap and Flatpak map the user
# alone): a folder of an account it does not map shows as the overflow id.
IN_NAMESPACE = textwrap.dedent(
    """
    import ctypes, json, os, sys, warnings
    import lazyckpt._device.programs as programs
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        print(json.dumps({"errno": ctypes.get_errno()}))
        sys.exit()
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)
    found = {}
    for root in sys.argv[1:]:
        os.environ[programs.CACHE_VARIABLE] = root
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with programs.folder() as opened:
                used = opened is not None
        found[root] = [used, [str(w.message) for w in caught]]
    print(json.dumps({"found": found, "shown": os.stat(os.path.dirname(sys.argv[1])).st_uid}))
    """
)


@needs_root
def test_in_a_user_namespace_folders_above_shown_as_the_overflow_id_are_used(
    tmp_path: Path, cache: Path
) -> None:
    """Inside bwrap or Flatpak, `/` and `/home` (the host's root's) show as the overflow
    id (65534): a folder above the cache that shows so counts as root's there, and the
    cache is used; the folder asked for, shown so, is still refused (it is not the
    user's). Outside the namespace, the same folders are refused."""
    host = tmp_path / "host"  # an account's the namespace does not map
    (host / "cache").mkdir(parents=True, mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    host.chmod(0o755)
    os.chown(host, 4321, 4321)
    os.chown(theirs, 4321, 4321)
    roots = [str(host / "cache"), str(theirs)]
    done = subprocess.run(
        [sys.executable, "-c", IN_NAMESPACE, *roots],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    if "errno" in result:
        pytest.skip(f"no user namespace here (unshare: errno {result['errno']})")
    overflow = int(Path("/proc/sys/kernel/overflowuid").read_text())
    assert result["shown"] == overflow
    assert result["found"][roots[0]] == [True, []]
    used, said = result["found"][roots[1]]
    assert not used and f"{theirs} is owned by user id {overflow}, not by you" in said[0]
    for root in roots:  # (outside it: owned by 4321)
        with _refusals() as refused, pytest.MonkeyPatch.context() as patch:
            patch.setenv(programs.CACHE_VARIABLE, root)
            with programs.folder() as opened:
                assert opened is None
        assert len(refused) == 1 and "is owned by user id 4321, not by you" in refused[0]


# A placement never fails because of the cache.


def test_the_warning_made_an_error_does_not_fail_the_placement(
    tmp_path: Path, cache: Path, compiled: list[str]
) -> None:
    """Under `-W error` (pytest's `filterwarnings = error`), the warning about a refused
    folder is raised where it is given, after the program was compiled: dropped
    there, and the placement goes on."""
    path = _weights(tmp_path)
    expected = np.load(path + ".npy").tobytes()
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _placed_bits(path) == expected
        first = len(compiled)
        _forget()
        assert _placed_bits(path) == expected
    assert first and len(compiled) == 2 * first
    assert not list(cache.iterdir())


def _descriptor_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class _Unreadable:
    """A file whose reads fail as a failing disk's do."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> _Unreadable:
        return self

    def __exit__(self, *exception: object) -> None:
        pass

    def read(self, size: int = -1) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="descriptors named by /proc")
@pytest.mark.parametrize("failing", ["listing", "fstat", "reading"])
def test_a_cache_that_fails_does_not_fail_the_placement(
    tmp_path: Path,
    cache: Path,
    compiled: list[str],
    monkeypatch: pytest.MonkeyPatch,
    failing: str,
) -> None:
    """Once the folder holds programs, listing it fails (no descriptor left: EMFILE; in
    the trim after a program is written, and before one is loaded), or a program
    file's `fstat` or read fails (EIO): each placement compiles instead."""
    path = _weights(tmp_path)
    expected = np.load(path + ".npy").tobytes()
    real_listdir, real_fstat = os.listdir, os.fstat

    def holds_programs() -> bool:
        return cache.is_dir() and any(name.endswith(".bin") for name in real_listdir(cache))

    def listdir(folder: Any = ".") -> list[str]:
        if isinstance(folder, int) and _descriptor_of(folder) == str(cache) and holds_programs():
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_listdir(folder)

    def fstat(fd: int) -> os.stat_result:
        found = _descriptor_of(fd)
        if found.startswith(str(cache)) and found.endswith(".bin"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fstat(fd)

    if failing == "listing":
        monkeypatch.setattr(os, "listdir", listdir)
    elif failing == "fstat":
        monkeypatch.setattr(os, "fstat", fstat)
    else:
        monkeypatch.setattr(trusted, "open", _Unreadable, raising=False)
    assert _placed_bits(path) == expected
    first = len(compiled)
    assert first and holds_programs()
    _forget()
    assert _placed_bits(path) == expected
    assert len(compiled) == 2 * first  # nothing loaded: compiled again
