"""Folders whose files may be run as code (the programs `lazyckpt._device.programs` caches,
which jax loads through pickle), opened so that no other account can have put
anything there.

The rules are ssh's for `authorized_keys`, applied from `/` down. Above the folder
asked for, each folder is owned by root or the user, and where others can write it,
it is sticky: only an entry's owner can then replace the entry (`/tmp`). A link on
the way is followed only where root or the user owns it (the user's own
`~/.cache -> /data/cache`); in a sticky folder another account can own one, so
resolving the path first (`realpath`) and judging what it names would trust that
account's choice of folder. The folder asked for, and the one made below it, are the
user's alone (owned by them, writable by no one else) and never links. Each folder
is opened from the one above it (`dir_fd=`, `O_NOFOLLOW`) and judged by `fstat` of
what was opened; the caller then reaches its files through the descriptor returned,
so what was judged is what is used, whatever a path names later.

Two exceptions, for common setups where no one else can write: a folder its group
can write, where that group is its owner's alone (the user private groups of Fedora
and RHEL, under their umask 002: `~/.cache` made `drwxrwxr-x`; Debian's OpenSSH makes
the same exception), and, in a user namespace that maps only some ids (bwrap,
Flatpak, rootless containers), above the folder asked for, the id that the owners it
does not map show as (`/proc/sys/kernel/overflowuid`), which the host's root is
among.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import stat
import sys

if sys.platform != "win32":  # (no owners there: see SUPPORTED)
    import grp
    import pwd

SUPPORTED = (
    hasattr(os, "getuid")
    and hasattr(os, "O_DIRECTORY")
    and {os.open, os.stat, os.mkdir, os.readlink} <= os.supports_dir_fd
)
"""Whether folders can be judged here (not on Windows: no owners, no `dir_fd`)."""

_FOLDER = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
"""(`O_NONBLOCK`: a FIFO opens at once, and is then refused, instead of waiting for a
writer.)"""
_MOST_LINKS = 40
"""Links followed on one path at most, as Linux does (`ELOOP`): a loop of links ends."""


class Refused(Exception):
    """A folder another account could have changed, and what was found there. The
    caller does not use the folder, and says why (`ProgramCacheWarning`)."""


def open_folder(root: str, below: str) -> int:
    """A descriptor of the folder `root/below`, each folder missing on the way made
    (mode 0o700), whose every folder from `/` down passes the rules above; `Refused`
    where one does not, `OSError` where one cannot be made or opened."""
    if not os.path.isabs(root):
        raise Refused(f"{root} is not an absolute path")
    outer = _walk(root)
    try:
        _judge(outer, root, above=False)
        path = os.path.join(root, below)
        if stat.S_ISLNK(_made(below, outer).st_mode):
            raise Refused(f"{path} is a link")
        inner = os.open(below, _FOLDER, dir_fd=outer)
    finally:
        os.close(outer)
    try:
        _judge(inner, path, above=False)
    except BaseException:
        os.close(inner)
        raise
    return inner


def _walk(root: str) -> int:
    """`root` opened one folder at a time from `/`, as `realpath` would resolve it,
    each folder passing the rules for those above and each link owned by root or
    the user."""
    names = collections.deque(root.split("/"))
    folders, paths = [os.open("/", _FOLDER)], ["/"]
    links = 0
    try:
        _judge(folders[0], "/", above=True)
        while names:
            name = names.popleft()
            if name in ("", "."):
                continue
            if name == "..":
                if len(folders) > 1:
                    os.close(folders.pop())
                    paths.pop()
                continue
            path = os.path.join(paths[-1], name)
            info = _made(name, folders[-1])
            if stat.S_ISLNK(info.st_mode):
                links += 1
                if info.st_uid not in _owners(above=True):
                    raise Refused(f"{path} is a link owned by user id {info.st_uid}")
                if links > _MOST_LINKS:
                    raise Refused(f"{root} goes through more than {_MOST_LINKS} links")
                target = os.readlink(name, dir_fd=folders[-1])
                if target.startswith("/"):
                    while len(folders) > 1:
                        os.close(folders.pop())
                        paths.pop()
                names.extendleft(reversed(target.split("/")))
                continue
            folders.append(os.open(name, _FOLDER, dir_fd=folders[-1]))
            paths.append(path)
            _judge(folders[-1], path, above=True)
        return folders.pop()
    finally:
        for folder in folders:
            os.close(folder)


def _made(name: str, folder: int) -> os.stat_result:
    """What `name` in `folder` is (a link as itself), made a folder where missing."""
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # (made meanwhile by another process)
            os.mkdir(name, 0o700, dir_fd=folder)
        return os.stat(name, dir_fd=folder, follow_symlinks=False)


def _judge(folder: int, path: str, *, above: bool) -> None:
    """`Refused` unless the folder open as `folder` is owned by the user (or, `above`
    the folder asked for, root) and writable by no one else (or, above, sticky): its
    group may write it where the group is its owner's alone."""
    info = os.fstat(folder)
    if info.st_uid not in _owners(above=above):
        raise Refused(f"{path} is owned by user id {info.st_uid}, not by you")
    if above and info.st_mode & stat.S_ISVTX:
        return
    if info.st_mode & stat.S_IWOTH or (
        info.st_mode & stat.S_IWGRP and not _alone(info.st_gid, info.st_uid)
    ):
        who = "others" if info.st_mode & stat.S_IWOTH else "its group"
        raise Refused(f"{path} can be written by {who} (mode {stat.filemode(info.st_mode)})")


def _owners(*, above: bool) -> tuple[int, ...]:
    """Whom a folder (a link, `above` the folder asked for) may belong to."""
    if not above:
        return (os.getuid(),)
    overflow = _overflow_id()
    return (0, os.getuid()) if overflow is None else (0, os.getuid(), overflow)


@functools.cache
def _overflow_id() -> int | None:
    """The id that owners outside this process's user namespace show as, where the
    namespace maps only some ids (bwrap, Flatpak, rootless containers: `/` and `/home`,
    the host's root's, show as it); None where it maps them all, or outside Linux."""
    try:
        with open("/proc/self/uid_map") as mapped:
            if mapped.read().split() == ["0", "0", "4294967295"]:
                return None
        with open("/proc/sys/kernel/overflowuid") as overflow:
            return int(overflow.read())
    except (OSError, ValueError):
        return None


def _alone(gid: int, uid: int) -> bool:
    """Whether the group `gid` has one member, the account `uid`: its primary group or
    listing it, and no one else's primary group nor listing anyone else (a user
    private group)."""
    try:
        group = grp.getgrgid(gid)
        owner = pwd.getpwuid(uid)
        others = any(entry.pw_gid == gid and entry.pw_uid != uid for entry in pwd.getpwall())
    except (KeyError, OSError):  # (a group or owner the system does not know)
        return False
    member = owner.pw_gid == gid or owner.pw_name in group.gr_mem
    return member and not others and set(group.gr_mem) <= {owner.pw_name}


def read_file(folder: int, name: str, most: int) -> bytes | None:
    """The bytes of the file `name` in `folder`, where it is a regular file of the
    user's that no one else can write, of at most `most` bytes; else None (a FIFO,
    a link, a file too large to be what the caller wrote, none at all)."""
    try:
        opened = os.open(name, _FILE, dir_fd=folder)
    except OSError:
        return None
    try:
        info = os.fstat(opened)
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.getuid()
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            or info.st_size > most
        ):
            return None
        with open(opened, "rb", closefd=False) as file:
            return file.read(info.st_size)  # (a file grown since fstat: only its start)
    except OSError:  # (a disk that fails the read: no program from it)
        return None
    finally:
        os.close(opened)
