"""Programs for a device compiled once per machine, not once per process.

Compiling the few programs that assemble a shard on an accelerator (`_on_device`) is
most of a first placement's cost there. On a TPU v5e, compiling the five that place
one 2 GiB array took 2.1 s and left 300 MiB of host memory with the process (XLA's
compiler for the chip; measured since, a process's first transfer to the chip, of
any size, takes 185 MiB of its own); loading the same five executables, compiled
earlier and serialized, took 0.11 s and 11 MiB. So each program compiled is written to
a cache folder, and a later process loads it instead of compiling.

The folder is `LAZYCKPT_CACHE_DIR/programs` where that is set (set and empty: no
cache), else `$XDG_CACHE_HOME/lazyckpt/programs` (`~/.cache/lazyckpt/programs`). A
program's file is named by a hash of everything its executable depends on: the program
as lowered for its arguments, the device it runs on, the versions of jax, jaxlib and
the device's runtime, and the flags given to XLA. jax loads an executable through
pickle, so files are trusted only in a folder that the user alone owns and can write;
elsewhere, or where a file cannot be loaded, the program is compiled as if there were
no cache. A placement never fails because of the cache. The folder holds at most
`LIMIT` bytes: the programs used longest ago go first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

CACHE_VARIABLE = "LAZYCKPT_CACHE_DIR"
_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_FLAGS")
"""The environment's settings that change what XLA compiles."""

_LOCK = threading.Lock()
_LOADED: dict[Hashable, concurrent.futures.Future[Any]] = {}
"""Each program of this process, by its function, arguments and device: compiled or
loaded once, by the first thread that asks (the others wait for it)."""


def compiled(function: Any, arguments: tuple[Any, ...], device: jax.Device) -> Any:
    """The jitted `function` compiled for `arguments` (abstract: `jax.ShapeDtypeStruct`s,
    on `device`), as a `jax.stages.Compiled` to call with concrete ones: from this
    process's programs, else loaded from the cache folder, else compiled (and then
    written there)."""
    import jax

    signature = tuple((leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(arguments))
    return compiled_as((function, signature), function, lambda: arguments, device)


def compiled_as(
    key: Hashable, function: Any, arguments: Callable[[], tuple[Any, ...]], device: jax.Device
) -> Any:
    """`compiled(function, arguments(), device)`, found among this process's programs by
    `key` (which must tell apart everything `arguments` may be): for a program asked
    for each piece a placement sends, a lookup of microseconds where making the
    abstract arguments and their signature took tens."""
    import jax

    key = (key, device, jax.config.read("jax_enable_x64"))
    with _LOCK:
        future = _LOADED.get(key)
        if future is not None:
            first = False
        else:
            first, future = True, concurrent.futures.Future()
            _LOADED[key] = future
    if not first:
        return future.result()
    try:
        lowered = function.lower(*arguments())
        file, path = None, folder()
        if path is not None:
            file = path / f"{_name(lowered, device)}.bin"
        program = _load(file, lowered, device) or _compile(file, lowered)
    except BaseException as error:
        with _LOCK:
            del _LOADED[key]  # (asked again, it is tried again)
        future.set_exception(error)  # (and those waiting are told)
        raise
    future.set_result(program)
    return program


def folder() -> Path | None:
    """The cache folder, made if missing; None where there is none to use (no home
    folder to put it in, a read-only one, a folder others can write)."""
    configured = os.environ.get(CACHE_VARIABLE)
    if configured == "":
        return None
    try:
        if configured is not None:
            root = Path(configured).expanduser()
        else:
            home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
            root = Path(home) / "lazyckpt"
        path = root / "programs"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path if _owned(path.stat()) else None
    except (OSError, RuntimeError):  # (RuntimeError: no home folder, as in containers)
        return None


def _owned(info: os.stat_result) -> bool:
    """Whether what `info` describes is the user's alone: owned by them, writable by
    no one else."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return True  # (no owners to compare)
    return info.st_uid == getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _name(lowered: Any, device: jax.Device) -> str:
    import jax
    from jaxlib import version

    parts = [
        lowered.as_text(),
        jax.__version__,
        version.__version__,
        device.client.platform,
        device.client.platform_version,
        device.device_kind,
        str(device.id),
        str(device.process_index),
        *(os.environ.get(name, "") for name in _FLAG_VARIABLES),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _load(file: Path | None, lowered: Any, device: jax.Device) -> Any:
    """The program in `file` (None: no cache folder), or None where it is not there
    or cannot be loaded (written by a process that stopped halfway, say: it is then
    compiled and written again)."""
    from jax.experimental import serialize_executable

    if file is None:
        return None
    try:
        # (opened, then checked: the file read is the file whose owner was checked)
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        with os.fdopen(descriptor, "rb") as opened:
            if not _owned(os.fstat(opened.fileno())):
                return None
            payload = opened.read()
            with contextlib.suppress(OSError):
                os.utime(opened.fileno())  # (used now: kept over those used longer ago)
        return serialize_executable.deserialize_and_load(
            payload, lowered.in_tree, lowered.out_tree, device.client, [device]
        )
    except Exception:  # noqa: BLE001 - any damage to a cached file: compiled instead
        return None


def _compile(file: Path | None, lowered: Any) -> Any:
    """`lowered` compiled, and written as `file` where there is a cache folder (a file
    that cannot be written leaves the folder as it was)."""
    from jax.experimental import serialize_executable

    program = lowered.compile()
    if file is None:
        return program
    try:
        payload, _, _ = serialize_executable.serialize(program)
    except Exception:  # noqa: BLE001 - an executable this jax cannot serialize
        return program
    _write(file, payload)
    _trim(file.parent)
    return program


def _write(file: Path, payload: bytes) -> None:
    """`payload` as `file`, whole or not at all (readers never see a part); a disk
    that refuses it leaves the folder as it was."""
    try:
        descriptor, temporary = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(payload)
        os.replace(temporary, file)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


LIMIT = 256 << 20
"""The most bytes of programs kept: a program is 60-750 KiB, and each upgrade of jax
or of the device's runtime makes a new set."""


def _trim(path: Path) -> None:
    """The programs used longest ago removed while the folder holds over `LIMIT`
    (a program loaded counts as used then), and what a process that stopped while
    writing left behind."""
    files = []
    for file in path.iterdir():
        with contextlib.suppress(OSError):
            info = file.stat()
            if file.suffix == ".tmp" and info.st_mtime < time.time() - 3600:
                file.unlink()
            elif file.suffix == ".bin":
                files.append((info.st_mtime, info.st_size, file))
    total = sum(size for _, size, _ in files)
    for _, size, file in sorted(files):
        if total <= LIMIT:
            break
        with contextlib.suppress(OSError):
            file.unlink()
        total -= size
