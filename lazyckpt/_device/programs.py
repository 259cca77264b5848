"""Programs for a device compiled once per machine, not once per process.

Compiling the few programs that assemble a shard on an accelerator (`shard`) is
most of a first placement's cost there, in time and in host memory that XLA's
compiler for the chip keeps, where loading the same executables, compiled earlier and
serialized, costs a small part of either (docs/benchmarks.md, section 29). So each
program compiled is written to a cache folder, and a later process loads it instead of
compiling.

The folder is `LAZYCKPT_CACHE_DIR/programs` (set and empty: no cache), else
`$XDG_CACHE_HOME/lazyckpt/programs` (`~/.cache/lazyckpt/programs`); a relative path is
never used. A file is named by a hash of everything its executable depends on (the
lowered program, the device, the versions of jax, jaxlib and the device's runtime,
XLA's flags). jax loads it through pickle, so a file is code: the folder is used only
where no other account can have changed it (`_storage.trusted`) and it holds nothing
but the cache's own names, and a file is read only where it is a regular file of the
user's of at most `MOST` bytes. Anything refused is compiled as if there were no cache
(a refused folder is named once per process, `ProgramCacheWarning`, once the program
is ready). A placement never fails because of the cache: a folder, file or listing that
cannot be read or written, and the warning itself turned into an error (`-W error`),
cost a compilation at most. The folder keeps at most `LIMIT` bytes, the programs used
longest ago going first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lazyckpt._errors import ProgramCacheWarning, warn
from lazyckpt._storage import trusted

if TYPE_CHECKING:
    import jax

CACHE_VARIABLE = "LAZYCKPT_CACHE_DIR"
_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_FLAGS")
"""The environment's settings that change what XLA compiles."""

_PROGRAM = re.compile(r"[0-9a-f]{64}\.bin")
_TEMPORARY = re.compile(r"[0-9a-f]{64}\.[0-9a-f]{16}\.tmp|tmp[0-9a-z_]{8}\.tmp")
"""A program being written (`_write`), or one that earlier releases, which wrote
through `tempfile.mkstemp`, left behind."""

MOST = 64 << 20
"""The largest program file read: programs are 60-750 KiB, so this leaves room for far
larger ones while a file of gigabytes under a program's name is never read."""

_LOCK = threading.Lock()
_LOADED: dict[Hashable, concurrent.futures.Future[Any]] = {}
"""Each program of this process, by its function, arguments and device: compiled or
loaded once, by the first thread that asks (the others wait for it)."""
_WARNED: set[str] = set()
"""The folders refused this process, each named in one warning."""


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
        with folder() as cache:
            program = lowered.compile() if cache is None else _through(cache, lowered, device)
    except BaseException as error:
        with _LOCK:
            del _LOADED[key]  # (asked again, it is tried again)
        future.set_exception(error)  # (and those waiting are told)
        raise
    future.set_result(program)
    return program


@contextlib.contextmanager
def folder() -> Iterator[int | None]:
    """The cache folder, made if missing, as a descriptor to reach its files through
    (`dir_fd=`); None where there is none to use: switched off, no home folder, a
    read-only one, or one refused (then named in a `ProgramCacheWarning` as the block
    ends: once the program is ready)."""
    opened, refused = _open()
    try:
        yield opened
    finally:
        if opened is not None:
            os.close(opened)
        if refused is not None:
            _refuse(*refused)


def _through(cache: int, lowered: Any, device: jax.Device) -> Any:
    """`lowered`'s program loaded from the folder `cache`, else compiled and written
    there; the cache failing (a file that cannot be read, a folder that cannot be
    listed or written) only costs the compilation, whose own errors are raised."""
    try:
        name = f"{_name(lowered, device)}.bin"
    except Exception:  # noqa: BLE001 - no name to file it under: compiled only
        return lowered.compile()
    try:
        program = _load(cache, name, lowered, device)
    except Exception:  # noqa: BLE001 - no program from the cache: compiled instead
        program = None
    if program is None:
        program = lowered.compile()
        _keep(cache, name, program)
    return program


def _root() -> str | None:
    """Where the cache's folder goes, as configured; None for no cache."""
    configured = os.environ.get(CACHE_VARIABLE)
    if configured is not None:
        return os.path.expanduser(configured) or None
    home = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(home):  # (unset, or relative: ignored, as XDG says)
        home = str(Path.home() / ".cache")
    return os.path.join(home, "lazyckpt") if os.path.isabs(home) else None  # (relative HOME)


def _open() -> tuple[int | None, tuple[str, str] | None]:
    """What `folder` yields (the folder opened by `trusted.open_folder`, or None), and
    where it was refused, the configured folder and why (for `_refuse`)."""
    try:
        root = _root()
    except Exception:  # noqa: BLE001 - no home folder (a container run as a bare user id)
        return None, None
    if root is None or not trusted.SUPPORTED:
        return None, None
    try:
        if not os.path.isabs(root):  # (a cloned repository's `programs/`, say)
            raise trusted.Refused(f"{CACHE_VARIABLE}={root} is not an absolute path")
        opened = trusted.open_folder(root, "programs")
        try:
            strangers = sorted(name for name in os.listdir(opened) if not _ours(name))
            if strangers:
                more = f" and {len(strangers) - 1} more" if len(strangers) > 1 else ""
                raise trusted.Refused(
                    f"{os.path.join(root, 'programs')} holds {strangers[0]!r}{more}, which "
                    "the cache did not write (move them out)"
                )
        except BaseException:
            os.close(opened)
            raise
        return opened, None
    except trusted.Refused as refused:
        return None, (root, str(refused))
    except Exception:  # noqa: BLE001 - a read-only file system, a full disk: no cache
        return None, None


def _ours(name: str) -> bool:
    return bool(_PROGRAM.fullmatch(name) or _TEMPORARY.fullmatch(name))


def _refuse(root: str, reason: str) -> None:
    """Say, once per process, why the folder of `root` is not used: a warning, which a
    filter that turns it into an error (`-W error`) raises here, where it is dropped
    (the placement goes on)."""
    with _LOCK:
        first = root not in _WARNED
        _WARNED.add(root)
    if not first:
        return
    with contextlib.suppress(Exception):
        warn(
            f"lazyckpt does not use its cache of compiled programs: {reason}. Each "
            f"process compiles its programs again (seconds on an accelerator). Make the "
            f"folders yours alone (owned by you, not writable by others), set "
            f"{CACHE_VARIABLE} to an absolute path of a folder of your own, or set "
            f"{CACHE_VARIABLE}= (empty) to turn the cache off.",
            ProgramCacheWarning,
        )


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


def _load(cache: int, name: str, lowered: Any, device: jax.Device) -> Any:
    """The program in the file `name`, or None where it is not there, is refused
    (`trusted.read_file`) or cannot be loaded (written by a process that stopped
    halfway, say: it is then compiled and written again)."""
    from jax.experimental import serialize_executable

    payload = trusted.read_file(cache, name, MOST)
    if payload is None:
        return None
    with contextlib.suppress(OSError):  # (used now: kept over those used longer ago)
        os.utime(name, dir_fd=cache, follow_symlinks=False)
    try:
        return serialize_executable.deserialize_and_load(
            payload, lowered.in_tree, lowered.out_tree, device.client, [device]
        )
    except Exception:  # noqa: BLE001 - any damage to a cached file: compiled instead
        return None


def _keep(cache: int, name: str, program: Any) -> None:
    """`program` written as the file `name`, and the folder trimmed; where any of it
    fails (an executable this jax cannot serialize, a full disk, no descriptor left to
    list the folder with), the folder stays as it was or as far as it got."""
    from jax.experimental import serialize_executable

    with contextlib.suppress(Exception):
        payload, _, _ = serialize_executable.serialize(program)
        _write(cache, name, payload)
        _trim(cache)


def _write(cache: int, name: str, payload: bytes) -> None:
    """`payload` as the file `name`, whole or not at all (readers never see a part); a
    disk that refuses it leaves the folder as it was."""
    temporary = f"{name.removesuffix('.bin')}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        out = os.open(temporary, flags, 0o600, dir_fd=cache)
    except OSError:
        return
    try:
        with open(out, "wb") as file:
            file.write(payload)
        os.replace(temporary, name, src_dir_fd=cache, dst_dir_fd=cache)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=cache)


LIMIT = 256 << 20
"""The most bytes of programs kept: a program is 60-750 KiB, and each upgrade of jax
or of the device's runtime makes a new set."""


def _trim(cache: int) -> None:
    """The programs used longest ago removed while the folder holds over `LIMIT`
    (a program loaded counts as used then), and what a process that stopped while
    writing left behind: only files named as the cache names them."""
    files = []
    for name in os.listdir(cache):
        with contextlib.suppress(OSError):
            info = os.stat(name, dir_fd=cache, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                continue
            if _TEMPORARY.fullmatch(name) and info.st_mtime < time.time() - 3600:
                os.unlink(name, dir_fd=cache)
            elif _PROGRAM.fullmatch(name):
                files.append((info.st_mtime, info.st_size, name))
    total = sum(size for _, size, _ in files)
    for _, size, name in sorted(files):
        if total <= LIMIT:
            break
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=cache)
        total -= size
