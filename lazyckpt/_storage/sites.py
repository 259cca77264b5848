"""The folders over HTTP(S) whose files lazyckpt knows, and how to ask for them: a
folder of the Hugging Face Hub listed at a pinned commit (`lazyckpt._storage.hub`),
or a folder whose files a caller probed (`lazyckpt._safetensors.over_http`); a URL
has no listing of its own."""

from __future__ import annotations

import posixpath
import threading

import attrs


@attrs.frozen
class Site:
    """A folder that lazyckpt knows the files of."""

    names: tuple[str, ...]
    headers: dict[str, str] = attrs.field(factory=dict)
    """Headers of requests to the folder's own origin (`Authorization`)."""
    generation: tuple[object, ...] = ()
    """What identifies its contents (a Hub commit): pinned, never asked again."""
    describe: str = ""
    """How errors name it (`org/model at revision main (commit 1a2b...)`)."""
    local: dict[str, str] = attrs.field(factory=dict)
    """Local copies of some of its files, by name (in the Hugging Face cache): read from disk."""


_SITES: dict[str, Site] = {}
_SITES_LOCK = threading.Lock()


def register(folder: str, site: Site) -> None:
    """Tell the storage which files `folder` holds, and how to ask for them."""
    with _SITES_LOCK:
        _SITES[folder.rstrip("/")] = site


def site(path: str) -> Site | None:
    """The registered folder that holds `path`, or is it."""
    folder = path.rstrip("/")
    with _SITES_LOCK:
        return _SITES.get(folder) or _SITES.get(posixpath.dirname(folder))


def hub_listed(folder: str) -> bool:
    """Whether `folder` was listed at a pinned revision (a Hub commit), which never
    changes; a folder probed over plain HTTP is probed again at each open."""
    found = listing(folder)
    return found is not None and bool(found.generation)


def listing(folder: str) -> Site | None:
    """The registered folder `folder`, exactly."""
    with _SITES_LOCK:
        return _SITES.get(folder.rstrip("/"))


def describe(path: str) -> str:
    found = site(path)
    return f"{path} ({found.describe})" if found is not None and found.describe else path
