"""The folders at a URL whose files lazyckpt knows, and how to ask for them: a folder of
the Hugging Face Hub listed at a pinned commit (`lazyckpt._storage.http.hub`), or one
whose files a format found by name (`register`; a URL has no listing of its own); and
where a file's bytes lie in the Hugging Face cache (`local_copy`, `cached_fix`)."""

from __future__ import annotations

import os
import posixpath
import re
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
    `X-Linked-Etag` or `ETag`: `lazyckpt._storage.http.answers.from_commit`)."""
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


def local_copy(path: str) -> str | None:
    """The local file that holds the bytes of the file at `path` (its copy in the
    Hugging Face cache, `Site.local`), or None where it is read over HTTP."""
    folder, _, name = path.rstrip("/").rpartition("/")
    found = listing(folder)
    return found.local.get(name) if found is not None else None


_SNAPSHOT = re.compile(r"(models|datasets|spaces)--([^/]+)/snapshots/([^/]+)/(.+)")
"""A file of a snapshot folder of the Hugging Face cache: its repository's kind, its
id with `--` for `/` (which no id holds), its commit, and its name."""


def cached_copy(file: str) -> str | None:
    """The file of the Hugging Face cache that holds the bytes of `file`: an `hf://`
    file's local copy, or `file` itself where it is in a snapshot folder (a model
    opened from the folder `snapshot_download` gave); None for any other file."""
    local = local_copy(file)
    if local is not None:
        return local
    local = file.replace(os.sep, "/")
    return local if "://" not in local and _SNAPSHOT.search(local) else None


def cached_fix(file: str) -> str:
    """What to do about a damaged file in the Hugging Face cache (`file`, its path in
    a snapshot folder): `hf_hub_download` alone returns the damaged copy as it is."""
    again = "hf_hub_download(..., force_download=True)"
    found = _SNAPSHOT.search(file.replace(os.sep, "/"))
    if found is not None:
        kind, repo, commit, name = found.groups()
        typed = "" if kind == "models" else f", repo_type={kind[:-1]!r}"
        again = (
            f"hf_hub_download({repo.replace('--', '/')!r}, {name!r}, revision={commit!r}"
            f"{typed}, force_download=True)"
        )
    return (
        f"downloading it again as usual returns the damaged copy as it is: fetch it again "
        f"with {again}, or delete it from the cache (`hf cache rm`, or remove it and its "
        f"blob {os.path.realpath(file)}) and download it again"
    )


def redownload(file: str) -> str:
    """The fix for a damaged `file`: downloaded or copied again, or, where it is the
    Hugging Face cache's copy, fetched again past the cache (`cached_fix`)."""
    local = cached_copy(file)
    if local is None:
        return "download or copy it again"
    return f"and it is the Hugging Face cache's copy: {cached_fix(local)}"
