"""Publishing a checkpoint atomically: build it in a temporary folder, rename it in.

The temporary folder sits next to the destination and its name contains Orbax's
`.orbax-checkpoint-tmp` marker, so lazyckpt, Orbax and CheckpointManager all treat
it as unfinished and never open or list it. A save killed at any moment leaves
either no checkpoint at the destination or a complete one. Temporary names are
unique per save, so a leftover never blocks a later save; the next successful
save to the same destination deletes leftovers whose save is over (their process
is gone, or it is this one and they are not in use).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator

from lazyckpt._errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    LazyckptError,
    LeftoverWarning,
    StorageAccessError,
    warn,
)
from lazyckpt._storage import paths
from lazyckpt._text import ascii_int

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # renameat2 flags (linux/paths.h)
_AT_FDCWD = -100


TMP_MARKER = ".orbax-checkpoint-tmp"
"""In the name of a folder whose save has not committed: Orbax's marker, which
lazyckpt's temporary folders carry too, so that Orbax and lazyckpt skip each other's."""


def is_unfinished(name: str) -> bool:
    """Whether a folder named `name` is a save that never committed."""
    return TMP_MARKER in name


_ENDED: set[str] = set()
"""Names of the temporary folders of this process's saves that are over (failed, or
published but for late writes): the only ones of this process a save may delete."""

SETTLE_SECONDS = 0.2
"""How long the temporary folder of a failed save must stay deleted before the
failure is raised (at most ten times as long in all; see `_delete_settled`)."""


def _tmp_prefix(final: str) -> str:
    return f"{final}{TMP_MARKER}-lazyckpt-{socket.gethostname()}-"


@contextlib.contextmanager
def publishing(
    final: str,
    *,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    file: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[str]:
    """Yield a fresh temporary folder (with `file=True`, the path of a file to write);
    on a clean exit, make it `final`.

    Raises CheckpointExistsError if `final` exists and `overwrite` is false, or if it
    exists and `replaceable(final)` (the format's test of a checkpoint) is false. On an
    exception the temporary folder is removed and `final` is untouched. In a bucket
    a new checkpoint is written in place and an overwrite is staged (see
    `_publishing_to_bucket`). With `keep`, an
    overwrite replaces only the entries of `final` that the save owns: those whose
    names `keep` accepts (a model folder's `config.json`, say) stay, hard-linked into
    the new folder before it takes the old one's place.
    """
    if is_unfinished(paths.basename(final)):
        raise LazyckptError(
            f"{final}: names containing {TMP_MARKER!r} mark unfinished saves and are "
            "never read; choose another name"
        )
    if not paths.atomic_rename(final):
        with _publishing_to_bucket(
            final, overwrite=overwrite, replaceable=replaceable, keep=keep
        ) as target:
            yield target
        if not paths.bucket_root(final):  # (nothing lies beside a bucket's root)
            _remove_leftovers(final)
        return
    _check_destination(final, overwrite, replaceable, file)
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
    except OSError as error:
        raise LazyckptError(
            f"{final}: cannot create the folder it goes in ({error}); choose a path whose "
            "parent is, or can be, a folder"
        ) from None
    tmp = f"{_tmp_prefix(final)}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        if not file:
            os.mkdir(tmp)
    except OSError as error:
        raise write_error(final, error) from None
    try:
        yield tmp
        if keep is not None and not file and os.path.isdir(final):
            _carry_over(final, tmp, keep)
        _sync_tree(tmp)
        _publish(tmp, final, overwrite)
    except OSError as error:
        _delete_settled(tmp)
        if isinstance(error, LazyckptError):
            raise
        raise write_error(final, error) from None
    except BaseException:
        _delete_settled(tmp)
        raise
    finally:
        _ENDED.add(os.path.basename(tmp))
    _sync_dir(os.path.dirname(final))
    _remove_leftovers(final)


def _carry_over(final: str, tmp: str, keep: Callable[[str], bool]) -> None:
    """Hard-link into `tmp` what `final` holds that the new save keeps and did not
    write itself (copied where a link is refused)."""
    for name in os.listdir(final):
        source, target = os.path.join(final, name), os.path.join(tmp, name)
        if not keep(name) or os.path.lexists(target):
            continue
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, target)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@contextlib.contextmanager
def _publishing_to_bucket(
    final: str,
    *,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    keep: Callable[[str], bool] | None,
) -> Iterator[str]:
    """Object stores have no rename. A new checkpoint is written in place, its commit
    object last (`commit_success.txt`, or a model's index: the caller's last write),
    as Orbax does; until it exists, readers treat the folder as unfinished, and a
    failed save removes what it wrote.

    An overwrite stages: the new checkpoint is written whole beside the old one, in a
    folder named as unfinished, and only then is the old one deleted (its commit
    object first; with `keep`, only the entries `keep` refuses) and the new one copied
    into its place, commit object last. A failure before that leaves the old
    checkpoint untouched; the copy costs a second transfer of the new bytes."""
    existing = paths.listdir(final) if paths.isdir(final) else []
    interrupted = interrupted_overwrite(final)
    if not existing:
        try:
            yield final
        except BaseException as error:
            with contextlib.suppress(Exception):
                _delete_owned(final, paths.listdir(final), keep)
            if isinstance(error, OSError) and not isinstance(error, LazyckptError):
                raise write_error(final, error) from None  # (a local scratch file, say)
            raise
        if interrupted is not None:
            paths.delete_file(final + SWAP_SUFFIX)
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{final} already exists ({len(existing)} entries); pass overwrite=True "
            "(--overwrite) to replace it, or choose a new path"
        )
    if interrupted is None and not replaceable(final):
        raise CheckpointExistsError(
            f"{final} exists and does not look like a checkpoint; lazyckpt replaces "
            "only checkpoints, delete it yourself if it should go"
        )
    paths.probe_write(final)  # before anything is written: can we write here at all?
    staging = f"{_tmp_prefix(final)}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield staging
    except BaseException as error:
        with contextlib.suppress(Exception):
            paths.delete_folder(staging)
        if isinstance(error, OSError) and not isinstance(error, LazyckptError):
            raise write_error(final, error) from None
        raise
    finally:
        _ENDED.add(paths.basename(staging))
    # From here until the copy is complete `final` holds no whole checkpoint: the
    # marker beside it says where the new one is (see `interrupted_overwrite`).
    paths.write_bytes(final + SWAP_SUFFIX, staging.encode())
    _delete_owned(final, paths.listdir(final), keep)
    try:
        for name in sorted(paths.walk_files(staging), key=_commit_last):
            paths.copy_file(paths.join(staging, name), paths.join(final, name))
    except LazyckptError as error:
        raise CheckpointWriteError(
            errno.EIO,
            f"{final}: the new checkpoint is complete at {staging}, but copying it into "
            f"place failed ({error}); the old one is already deleted. Copy that folder's "
            "files into place (commit_success.txt or the index last), or save again "
            "with overwrite=True",
        ) from None
    paths.delete_file(final + SWAP_SUFFIX)
    paths.delete_folder(staging)


SWAP_SUFFIX = ".lazyckpt-overwrite"
"""Beside a bucket checkpoint being replaced (`<final>.lazyckpt-overwrite`), from the
deletion of the old one until the new one is copied in whole: the staged folder that
holds the new one."""


def interrupted_overwrite(final: str) -> str | None:
    """Where the complete new checkpoint of an overwrite of `final` in a bucket is, if
    that overwrite was interrupted while copying it in (else None)."""
    if not paths.is_bucket(final) or paths.bucket_root(final):
        return None  # (none beside a local folder, a URL lazyckpt never writes, a bucket's root)
    found = paths.read_text(final + SWAP_SUFFIX)
    return found.strip() if found else None


def _commit_last(name: str) -> tuple[int, str]:
    """Copy order: data (carried `config.json` and tokenizer files too), then a
    model's index (`*.index.json`), then `commit_success.txt`."""
    return (2 if name == "commit_success.txt" else name.endswith(".index.json"), name)


def _delete_owned(final: str, names: list[str], keep: Callable[[str], bool] | None) -> None:
    if keep is None:
        paths.delete_folder(final)  # commit_success.txt goes first: never half old, half new
        return
    owned = [name for name in names if not keep(name)]
    # An index (`*.json`) before the files it names.
    for name in sorted(owned, key=lambda name: (not name.endswith(".json"), name)):
        paths.delete_file(paths.join(final, name))


def _check_destination(
    final: str, overwrite: bool, replaceable: Callable[[str], bool], file: bool
) -> None:
    if not os.path.lexists(final):
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{final} already exists; pass overwrite=True (--overwrite) to replace it, "
            "or choose a new path"
        )
    if file:
        if not os.path.isfile(final) or os.path.islink(final) or not replaceable(final):
            raise CheckpointExistsError(
                f"{final} exists and is not a safetensors file; lazyckpt replaces only "
                "checkpoints, delete it yourself if it should go"
            )
        _check_writable(final, os.path.dirname(final))
        return
    if not os.path.isdir(final) or os.path.islink(final):
        raise CheckpointExistsError(
            f"{final} exists and is not a folder; lazyckpt replaces only checkpoints, "
            "delete it yourself if it should go"
        )
    if os.listdir(final) and not replaceable(final):
        raise CheckpointExistsError(
            f"{final} exists and does not look like a checkpoint of the format being saved (an "
            "Orbax checkpoint: _METADATA or _CHECKPOINT_METADATA; a safetensors model: "
            "an index or model.safetensors that parse); lazyckpt replaces only those, "
            "delete it yourself if it should go"
        )
    _check_removable(final)


def write_error(final: str, error: OSError) -> LazyckptError:
    """The error for a file system failure while saving to `final`."""
    where = error.filename or final
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageAccessError(
            f"{final}: cannot write {where} ({error.strerror}); nothing was saved. Save to "
            "a folder you can write, or fix its permissions"
        )
    return CheckpointWriteError(
        error.errno or 0,
        f"{final}: writing {where} failed ({error.strerror}); nothing was saved"
        + ("; free some space and save again" if error.errno == errno.ENOSPC else ""),
    )


def write_failure(final: str, what: str, error: Exception) -> LazyckptError:
    """The error for a failed write of `what` by tensorstore while saving to `final`."""
    if isinstance(error, LazyckptError):
        return error
    if paths.is_remote(final):
        return paths.storage_error(final, error)
    text = str(error)
    if "No space left" in text or "RESOURCE_EXHAUSTED" in text or "File too large" in text:
        return CheckpointWriteError(
            errno.ENOSPC if "No space" in text else errno.EFBIG,
            f"{final}: writing {what} failed, the file system refused the data "
            f"({text[:160]}); nothing was saved; free some space and save again",
        )
    if any(s in text for s in ("Permission denied", "PERMISSION_DENIED", "Read-only file system")):
        return StorageAccessError(
            f"{final}: writing {what} was refused ({text[:160]}); nothing was saved. Save to "
            "a folder you can write, or fix its permissions"
        )
    return LazyckptError(f"{final}: writing {what} failed ({text[:300]}); nothing was saved")


def _check_removable(final: str) -> None:
    """Before replacing `final`: that its old files can be deleted once the new
    checkpoint is in place, so that a save never ends half done."""
    for folder, subfolders, _ in os.walk(final):
        _check_writable(final, folder)
        subfolders[:] = [s for s in subfolders if not os.path.islink(os.path.join(folder, s))]


def _check_writable(final: str, folder: str) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        raise StorageAccessError(
            f"{final}: its folder {folder} is read-only, so the old checkpoint could "
            "not be removed after the new one is in place; nothing was saved. Make it "
            "writable, or save to a new path"
        )


def _publish(tmp: str, final: str, overwrite: bool) -> None:
    """Rename `tmp` to `final`; when replacing, swap them atomically where the OS can."""
    if not overwrite or not os.path.lexists(final):
        if not _renameat2(tmp, final, _RENAME_NOREPLACE):
            if os.path.lexists(final):
                raise CheckpointExistsError(
                    f"{final} appeared while the checkpoint was being written; the new "
                    "one was discarded. Save again with overwrite=True to replace it"
                )
            os.rename(tmp, final)
        return
    if _renameat2(tmp, final, _RENAME_EXCHANGE):
        _discard(tmp, final)  # now holds the old checkpoint
        return
    # No atomic exchange here (NFS, for one): move the old one aside first. A crash
    # between the two renames leaves no checkpoint at `final`; the old one stays in
    # `aside` until a later save to `final` succeeds.
    aside = f"{_tmp_prefix(final)}{os.getpid()}-replaced-{secrets.token_hex(4)}"
    os.rename(final, aside)
    os.rename(tmp, final)
    _ENDED.add(os.path.basename(aside))
    _discard(aside, final)


def _discard(old: str, final: str) -> None:
    """Delete the replaced checkpoint; if that fails, the save still succeeded: say so,
    and where the old one is."""
    try:
        _delete(old)
    except OSError as error:
        warn(
            f"saved {final}; the checkpoint it replaced, now at {old}, could not be deleted "
            f"({error.strerror}); it is never read, delete it yourself",
            LeftoverWarning,
        )


def _renameat2(source: str, destination: str, flags: int) -> bool:
    """Linux renameat2; False where the system or filesystem does not support it."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    result = call(
        _AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), ctypes.c_uint(flags)
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    if code == errno.EEXIST:
        return False  # NOREPLACE refused: the caller reports it
    raise OSError(code, os.strerror(code), destination)


def _delete(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _delete_settled(tmp: str) -> None:
    """Delete the temporary folder of a failed save, again each time it reappears,
    until it has stayed away for `SETTLE_SECONDS`. Tensorstore reports a save's first
    failed write while writes it started alongside run on, and those re-create the
    folder (1 failed save in 6 to 10 on a full disk here). What reappears later still
    is deleted by the next save to the same destination (`_remove_leftovers`)."""
    deadline = time.monotonic() + 10 * SETTLE_SECONDS
    gone_since = time.monotonic()
    while True:
        if os.path.lexists(tmp):
            _delete_quietly(tmp)
            gone_since = time.monotonic()
        now = time.monotonic()
        if now - gone_since >= SETTLE_SECONDS or now >= deadline:
            return
        time.sleep(SETTLE_SECONDS / 10)


def _delete_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        _delete(path)


def _sync_tree(root: str) -> None:
    """fsync every file and folder under `root` (or the file `root`), so the rename
    publishes durable data."""
    if os.path.isfile(root):
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(folder)


def _sync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_leftovers(final: str) -> None:
    """Delete this host's temporary folders for `final` whose save is over: their
    process is gone (in a bucket, the staged overwrites of killed saves), or it is
    this process and the save ended (a failed save's folder that writes still in
    flight re-created). Another thread's save in progress, or another machine's with
    the same host name and pid, is never one of this process's ended saves.

    Names are matched exactly (host, pid, 8 hex digits), so that another host whose
    name merely starts with this one's keeps its saves in progress. A `-replaced-`
    folder holds the checkpoint an interrupted overwrite moved aside; once a save to
    `final` has succeeded since, it is obsolete too.
    """
    prefix = _tmp_prefix(final)
    pattern = re.compile(re.escape(paths.basename(prefix)) + r"([0-9]+)-(?:replaced-)?[0-9a-f]{8}")
    for name in paths.starting_with(prefix):
        match = pattern.fullmatch(name)
        pid = ascii_int(match[1], _PID_DIGITS) if match and match[1][0] != "0" else None
        if pid is None or pid >= _PID_LIMIT:
            continue  # (no pid as os.getpid() is written: no save's folder, leave it)
        if name not in _ENDED if pid == os.getpid() else _alive(pid):
            continue
        leftover = paths.join(paths.dirname(final), name)
        if paths.atomic_rename(final):
            _delete_quietly(leftover)
        else:
            with contextlib.suppress(LazyckptError):
                paths.delete_folder(leftover)  # (a bucket's leftovers are folders)


_PID_DIGITS, _PID_LIMIT = 10, 2**31  # pids are C ints: os.kill() overflows past them


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
