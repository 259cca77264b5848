"""The folders over HTTP(S) whose files lazyckpt knows, and how to ask for them: a
folder of the Hugging Face Hub listed at a pinned commit (`lazyckpt._storage.hub`),
or a folder whose files a caller probed (`lazyckpt._safetensors.over_http`); a URL
has no listing of its own."""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Iterator

import attrs

SINGLE_FILES = (".safetensors", ".bin", ".pt", ".pth", ".npz", ".npy", ".msgpack")
"""The names of files that are a model by themselves: what an `hf://` path, or a
pre-signed URL, may name as one file."""


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
    blobs: dict[str, str] = attrs.field(factory=dict)
    """What the Hub's listing gives as each file's blob, by name: an LFS file's sha256,
    another's git blob id; what the Hub's answers for the file must name (its
    `X-Linked-Etag` or `ETag`: `lazyckpt._storage.answers.from_commit`)."""
    asked: tuple[str, ...] | None = None
    """Over plain HTTP, the names a caller asked for, of which `names` are those that
    were there: the folder may hold others, which no listing shows. None where
    `names` is the folder's whole listing (the Hub's)."""

    def lacks(self, name: str) -> bool:
        """Whether the folder is known to hold no file `name` (a path inside it)."""
        return name not in self.names and (self.asked is None or name in self.asked)


def _subfolders(folder: str, site: Site) -> dict[str, Site]:
    """The sites of every subfolder of `folder`, by URL: the names under each, and the
    local copies and blobs of those."""
    names: dict[str, list[str]] = {}
    asked: dict[str, list[str]] = {}
    local: dict[str, dict[str, str]] = {}
    blobs: dict[str, dict[str, str]] = {}
    for name in site.names:
        for inner, rest in _folders(name):
            names.setdefault(inner, []).append(rest)
            if name in site.local:
                local.setdefault(inner, {})[rest] = site.local[name]
            if name in site.blobs:
                blobs.setdefault(inner, {})[rest] = site.blobs[name]
    for name in site.asked or ():
        for inner, rest in _folders(name):
            asked.setdefault(inner, []).append(rest)
    return {
        f"{folder}/{inner}": attrs.evolve(
            site,
            names=tuple(under),
            local=local.get(inner, {}),
            blobs=blobs.get(inner, {}),
            asked=None if site.asked is None else tuple(asked.get(inner, ())),
        )
        for inner, under in names.items()
    }


def _folders(name: str) -> Iterator[tuple[str, str]]:
    """`(folder, rest)` for each folder on the path `name`: `a/b/c` gives `(a, b/c)`
    and `(a/b, c)`."""
    parts = name.split("/")
    for depth in range(1, len(parts)):
        yield "/".join(parts[:depth]), "/".join(parts[depth:])


_SITES: dict[str, Site] = {}
_INSIDE: dict[str, Site] = {}
"""The sites of the subfolders of registered folders (`_subfolders`)."""
_SITES_LOCK = threading.Lock()


def register(folder: str, site: Site) -> None:
    """Tell the storage which files `folder` holds (also in its subfolders, by their
    paths), and how to ask for them."""
    with _SITES_LOCK:
        folder = folder.rstrip("/")
        # What was known of its subfolders is superseded (a step probed before its root).
        for known in (_INSIDE, _SITES):
            for inner in [inner for inner in known if inner.startswith(folder + "/")]:
                del known[inner]
        _SITES[folder] = site
        _INSIDE.update(_subfolders(folder, site))


def site(path: str) -> Site | None:
    """The known folder that holds `path`, or is it."""
    folder = path.rstrip("/")
    return listing(folder) or listing(posixpath.dirname(folder))


def hub_listed(folder: str) -> bool:
    """Whether `folder` was listed at a pinned revision (a Hub commit), which never
    changes; a folder probed over plain HTTP is probed again at each open."""
    found = listing(folder)
    return found is not None and bool(found.generation)


def listing(folder: str) -> Site | None:
    """The known folder `folder`: registered, or inside a registered folder."""
    folder = folder.rstrip("/")
    with _SITES_LOCK:
        return _SITES.get(folder) or _INSIDE.get(folder)


def probed(folder: str) -> bool:
    """Whether `folder` is over plain HTTP, known only by the files a caller probed."""
    found = listing(folder)
    return found is not None and found.asked is not None


def describe(path: str) -> str:
    found = site(path)
    return f"{path} ({found.describe})" if found is not None and found.describe else path
