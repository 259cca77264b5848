"""`hf://` paths: a model on the Hugging Face Hub, pinned to one commit, read by ranges.

`hf://ORG/NAME[@REVISION][/PATH]` (and `hf://datasets/...`, `hf://spaces/...`; the
revision a branch, a tag, a commit or its first digits, `@1a2b3c4` as messages show
it) is resolved once, at `normalize`, with `huggingface_hub`'s settings (the `lazyckpt[hf]`
extra): its endpoint (`HF_ENDPOINT`), its token (`HF_TOKEN`, or the saved login) and
its cache are the user's own. One request (the repository's info at that revision,
through lazyckpt's client, bounded as every read is) gives the commit and the file
list, with each file's blob; every later read asks for `resolve/{commit}/...`, so a
push to the repository while a tree is open never mixes two revisions. The Hub
resolves a branch or tag named as a commit before the commit itself, `resolve/`
included: each answer must say it is the commit's (`X-Repo-Commit`) and name the
listed blob (`lazyckpt._storage.http.answers.from_commit`), else it is refused.

What it resolves to:

- the folder (or file) in the local Hugging Face cache, where the cache holds every
  safetensors file and index of the folder for that commit: read from disk, no request;
- an Orbax checkpoint (or a CheckpointManager root, a step, an item): its folder in
  the cache's snapshot, where the cache holds every file of it (after `hf download`);
- else the `https://` URL of `resolve/{commit}/PATH` at the endpoint, registered with
  `lazyckpt._storage.http.web` with its file list, the token and the local paths of the
  files the cache does hold (`Site.local`): those are read from disk, the others by
  Range requests (an Orbax checkpoint's by tensorstore's drivers, through
  `lazyckpt._storage.http.relay`).

Messages show neither place, but the `hf://` path of the commit
(`hf://ORG/NAME@1a2b3c4/PATH`): both are registered with `lazyckpt._display`.
"""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse
from typing import Any

from lazyckpt import _display
from lazyckpt._errors import (
    CheckpointNotFoundError,
    MissingExtraError,
    StorageAccessError,
    json_or_corrupt,
)
from lazyckpt._storage import folders
from lazyckpt._storage.http import range_reads, web_options
from lazyckpt._storage.http.transport import said
from lazyckpt._text import printable

SCHEME = "hf://"
_KINDS = {"datasets": "dataset", "spaces": "space"}
_MODEL_FILES = (".safetensors", ".safetensors.index.json")
_WEIGHT_FILES = (".bin", ".pt", ".pth", ".npz", ".npy", ".msgpack", ".index.json")
"""Weight files of other formats (PyTorch, NumPy, flax msgpack), read where a folder
has no safetensors."""
_FILES = (*_MODEL_FILES, *_WEIGHT_FILES)
_OFFLINE = (
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
    "flax_model.msgpack.index.json",
    "flax_model.msgpack",
)
"""What a model folder is found by in the cache, offline, after its safetensors index."""
_SINGLE = folders.SINGLE_FILES
_ORBAX_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "checkpoint")
"""Files that make a folder an Orbax checkpoint (its tree; the legacy msgpack one), or
one of the steps or items under it."""
_FORM = "hf://ORG/NAME[@REVISION][/PATH] (or hf://datasets/ORG/NAME..., hf://spaces/ORG/NAME...)"
# An organization or repository name as the Hub allows it (huggingface_hub's
# validate_repo_id), in ASCII: no '%', so nothing decodes into a '/' or a '..'.
_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def is_hub(path: str) -> bool:
    return path.startswith(SCHEME)


def parse(url: str) -> tuple[str, str, str | None, str]:
    """`(repo_type, repo_id, revision, path)` of an `hf://` URL. A revision with `/` in
    it is percent-encoded (`@feature%2Fx`), but for the Hub's own `refs/pr/N` and
    `refs/convert/NAME`, written as they are."""
    rest = url[len(SCHEME) :].strip("/")
    parts = rest.split("/")
    repo_type = "model"
    if parts and parts[0] in _KINDS:
        repo_type = _KINDS[parts.pop(0)]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise _malformed(url, "no ORG/NAME")
    org, (name, _, revision) = parts[0], parts[1].partition("@")
    for part in (org, name):
        if not _NAME.fullmatch(part) or ".." in part or "--" in part:
            raise _malformed(
                url,
                f"{part!r} is not a Hub name (ASCII letters, digits and '_', with '-' or '.' "
                "inside, never '--' or '..')",
            )
    rest_parts = parts[2:]
    if revision == "refs" and rest_parts[:1] in (["pr"], ["convert"]) and len(rest_parts) > 1:
        revision = "/".join(["refs", *rest_parts[:2]])
        rest_parts = rest_parts[2:]
    revision = urllib.parse.unquote(revision)
    # Git refuses '..' in a ref name, and the offline cache looks a branch up as a file.
    if revision and any(p in ("", ".", "..") for p in revision.split("/")):
        raise _malformed(url, f"the revision {revision!r} has an empty, '.' or '..' part")
    for part in rest_parts:
        # Not read as an escape anywhere, but a server may decode '%2e%2e' or '%2F'.
        decoded = urllib.parse.unquote(part)
        if decoded in ("", ".", "..") or "/" in decoded or "\\" in decoded:
            raise _malformed(url, f"the path has a part {part!r}")
    return repo_type, f"{org}/{name}", revision or None, "/".join(rest_parts)


def _malformed(url: str, found: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"{printable(url)[:300]}: expected {_FORM}; {printable(found)[:300]}"
    )


def resolve(url: str) -> str:
    """The place to read `url` from: a local folder of the cache, or an `https://` URL
    registered with its files, both at the commit its revision names now."""
    hub = _import()
    parsed = parse(url)
    try:
        return _resolve(hub, *parsed)
    except hub.errors.HFValidationError as error:
        # A name `parse` let through that huggingface_hub refuses (a length, '.git').
        raise _malformed(url, str(error)) from None


def _resolve(hub: Any, repo_type: str, repo_id: str, revision: str | None, path: str) -> str:
    hub.utils.validate_repo_id(repo_id)  # huggingface_hub's own rules, before any request
    shown = f"hf://{_kind(repo_type)}{repo_id}" + (f"@{revision}" if revision else "")
    web_options.refuse_for_hub(shown, f"{_kind(repo_type)}{repo_id}")
    if path and not path.endswith(_FILES) and "." in posixpath.basename(path):
        raise CheckpointNotFoundError(
            f"{shown}: {path!r} is not a weight file or index; give the folder, a "
            ".safetensors file, model.safetensors.index.json, or a .bin, .pt, .pth, "
            ".npz, .npy or .msgpack file"
        )
    folder = posixpath.dirname(path) if path.endswith(_FILES) else path
    prefix = f"{folder}/" if folder else ""
    if hub.constants.HF_HUB_OFFLINE:
        return _offline(hub, repo_type, repo_id, revision, path, prefix, shown)
    token = hub.get_token()
    if token:
        _display.hide(token)  # (where a server's text quotes it)
    endpoint = hub.constants.ENDPOINT.rstrip("/")
    try:
        commit, names, blobs = _info(endpoint, repo_type, repo_id, revision, token, shown)
    except StorageAccessError as error:
        if not getattr(error, "gave_up", False) or not _in_cache(hub, repo_type, repo_id):
            raise
        raise StorageAccessError(
            f"{error}; the Hugging Face cache holds files of {repo_id}: set HF_HUB_OFFLINE=1 "
            "to read them without asking the Hub"
        ) from None
    _pinned(shown, revision, commit, "the Hub")
    _name(hub, repo_type, repo_id, commit)
    if path.endswith(_FILES) and path not in names:
        raise CheckpointNotFoundError(
            f"{shown}: no file {path!r} at commit {commit[:12]}; it holds "
            f"{[n for n in names if n.endswith(_FILES)][:8]}"
        )
    inside = [n[len(prefix) :] for n in names if n.startswith(prefix)]
    models = [n for n in inside if "/" not in n and n.endswith(_MODEL_FILES)]
    if not models:  # (only where there is no safetensors form: it is read instead)
        models = [n for n in inside if "/" not in n and n.endswith(_WEIGHT_FILES)]
    orbax = not models and any(posixpath.basename(n) in _ORBAX_FILES for n in inside)
    if not models and not orbax:
        raise CheckpointNotFoundError(
            f"{shown}: no safetensors files or Orbax checkpoint in {folder or 'the repository'} "
            f"at commit {commit[:12]}; it holds {sorted({n.split('/')[0] for n in inside})[:8]}"
        )
    wanted = inside if orbax else models
    if path.endswith(_SINGLE):
        wanted = [posixpath.basename(path)]
    cached = _cached(hub, repo_type, repo_id, commit, prefix, wanted)
    if len(cached) == len(wanted):
        found = cached[wanted[0]]
        if orbax:  # (the snapshot's folder, whose files link into the cache's blobs)
            return found[: -len(wanted[0])].rstrip("/")
        return found if path.endswith(_SINGLE) else os.path.dirname(found)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    described = f"{repo_id} at {revision or 'main'}, commit {commit[:12]}"
    blobs = {name[len(prefix) :]: blob for name, blob in blobs.items() if name.startswith(prefix)}
    site = folders.Site(tuple(inside), headers, (commit,), described, local=cached, blobs=blobs)
    return _register(hub, repo_type, repo_id, commit, path, site)


def _register(
    hub: Any, repo_type: str, repo_id: str, commit: str, path: str, site: folders.Site
) -> str:
    """The `resolve/` URL of `path` at `commit`, its folder registered with `site`."""
    folder = posixpath.dirname(path) if path.endswith(_FILES) else path
    base = _resolve_url(hub, repo_type, repo_id, commit)
    location = "/".join([base, *(p for p in folder.split("/") if p)])
    folders.register(location, site)
    if path.endswith(_SINGLE):
        return f"{location}/{posixpath.basename(path)}"
    return location


def _offline(
    hub: Any,
    repo_type: str,
    repo_id: str,
    revision: str | None,
    path: str,
    prefix: str,
    shown: str,
) -> str:
    """With `HF_HUB_OFFLINE` set: the cache's folder for `revision` (a branch or tag
    through the cache's refs, as `huggingface_hub` resolves it offline; a short
    commit among the cache's commits)."""
    asked, revision = revision, _offline_commit(hub, repo_type, repo_id, revision, shown)
    cache = "the Hugging Face cache (HF_HUB_OFFLINE is set)"
    single = path.endswith(_SINGLE)
    probe = path if single else prefix + "model.safetensors.index.json"
    found = []
    names = (probe,) if single else (probe, *(prefix + name for name in _OFFLINE))
    for name in names:
        hit = hub.try_to_load_from_cache(
            repo_id, name, revision=revision or "main", repo_type=repo_type
        )
        if isinstance(hit, str):
            commit = _commit_of(hub, hit, repo_type, repo_id)
            _pinned(shown, asked, commit, cache)
            found.append(hit)
            _name(hub, repo_type, repo_id, commit)
    snapshot = None if found or single else _snapshot(hub, repo_type, repo_id, revision)
    if snapshot is not None and os.path.isdir(os.path.join(snapshot, prefix)):  # (Orbax)
        _pinned(shown, asked, os.path.basename(snapshot), cache)
        _name(hub, repo_type, repo_id, os.path.basename(snapshot))
        return os.path.join(snapshot, prefix).rstrip("/")
    if not found and not single and snapshot is None and _in_cache(hub, repo_type, repo_id):
        refs = os.path.join(os.path.dirname(_snapshots(hub, repo_type, repo_id)), "refs")
        held = sorted(
            os.path.relpath(os.path.join(parent, name), refs).replace(os.sep, "/")
            for parent, _, names in os.walk(refs)
            for name in names
        )
        raise CheckpointNotFoundError(
            f"{shown}: HF_HUB_OFFLINE is set and the local cache holds no revision "
            f"{asked or 'main'!r} of {repo_id} (it holds {held[:8] or 'no branch or tag'}); "
            "unset HF_HUB_OFFLINE to ask the Hub, or download that revision first "
            f"(`hf download {repo_id} --revision {asked or 'main'}`)"
        )
    if not found:
        raise CheckpointNotFoundError(
            f"{shown}: HF_HUB_OFFLINE is set and the local cache holds no model there "
            f"({probe}); unset it, or download the model first (`hf download {repo_id}`)"
        )
    return found[0] if single else os.path.dirname(found[0])


def _offline_commit(
    hub: Any, repo_type: str, repo_id: str, revision: str | None, shown: str
) -> str | None:
    """`revision` as the cache answers for it offline: a branch or tag (or a short
    commit `huggingface_hub` resolved online) through the cache's refs, else the first
    hex digits of a commit (`1a2b3c4`, as messages show one), which the Hub resolves
    online, as the one commit of the cache's snapshots that they begin."""
    if revision is None or not _SHORT_COMMIT.fullmatch(revision):
        return revision
    snapshots = _snapshots(hub, repo_type, repo_id)
    if os.path.isfile(os.path.join(os.path.dirname(snapshots), "refs", revision)):
        return revision
    try:
        names = os.listdir(snapshots)
    except OSError:  # (nothing of the repository in the cache)
        return revision
    found = sorted(name for name in names if name.startswith(revision) and _COMMIT.fullmatch(name))
    if len(found) > 1:
        raise CheckpointNotFoundError(
            f"{shown}: HF_HUB_OFFLINE is set and the cache holds {len(found)} commits that "
            f"begin with {revision!r} ({', '.join(name[:12] for name in found[:4])}); give "
            "more digits of the commit"
        )
    return found[0] if found else revision


def _pinned(shown: str, revision: str | None, commit: str, by: str) -> None:
    """Refuse `commit`, which `by` resolved `revision` to, where the revision names
    another commit by its 40 hex digits: the Hub, and the cache's refs, resolve a branch
    or tag of that name first, whose files would be read instead. (A shorter prefix
    resolves as it always has: a branch of that name first, as the Hub answers.)"""
    if revision is None or not _COMMIT.fullmatch(revision.lower()) or commit == revision.lower():
        return
    raise CheckpointNotFoundError(
        f"{shown}: the revision {revision!r} names a commit by its 40 hex digits, but {by} "
        f"resolved it to commit {commit!r}: a branch or tag of that name shadows the commit, "
        f"so nothing was read. To read that branch, give its full name "
        f"(@refs%2Fheads%2F{revision}) or the commit it holds now (@{commit}); to read the "
        "commit, ask the repository's owners to rename the branch"
    )


def _kind(repo_type: str) -> str:
    """The part of a path that names the kind of repository: `datasets/`, `spaces/`,
    or none for a model."""
    return "" if repo_type == "model" else f"{repo_type}s/"


def _resolve_url(hub: Any, repo_type: str, repo_id: str, commit: str) -> str:
    """Where the files of `commit` are asked for: `ENDPOINT/ORG/NAME/resolve/COMMIT`."""
    endpoint = hub.constants.ENDPOINT.rstrip("/")
    return f"{endpoint}/{_kind(repo_type)}{repo_id}/resolve/{commit}"


def _snapshots(hub: Any, repo_type: str, repo_id: str) -> str:
    """The cache's folder of the repository's snapshots, one per commit."""
    folder = hub.file_download.repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    return os.path.join(hub.constants.HF_HUB_CACHE, folder, "snapshots")


def _name(hub: Any, repo_type: str, repo_id: str, commit: str) -> None:
    """Show the places `commit` of the repository is read from, its `resolve/` URL and
    its snapshot folder in the cache, as the `hf://` path they are
    (`hf://ORG/NAME@1a2b3c4`) in every message: `lazyckpt._display`."""
    shown = _display.hub_name(_kind(repo_type), repo_id, commit)
    _display.register(_resolve_url(hub, repo_type, repo_id, commit), shown)
    snapshot = os.path.join(_snapshots(hub, repo_type, repo_id), commit)
    for place in {snapshot, os.path.abspath(snapshot)}:
        _display.register(place, shown)


def _in_cache(hub: Any, repo_type: str, repo_id: str) -> bool:
    """Whether the cache holds a snapshot of the repository (of any commit)."""
    try:
        return bool(os.listdir(_snapshots(hub, repo_type, repo_id)))
    except OSError:
        return False


def _commit_of(hub: Any, file: str, repo_type: str, repo_id: str) -> str:
    """The commit of a file of the cache's snapshots (`.../snapshots/COMMIT/...`)."""
    return os.path.relpath(file, _snapshots(hub, repo_type, repo_id)).split(os.sep)[0]


def _snapshot(hub: Any, repo_type: str, repo_id: str, revision: str | None) -> str | None:
    """The cache's snapshot folder of `revision` (a branch or tag through its refs), or
    None where it has none."""
    try:
        found = hub.snapshot_download(
            repo_id, revision=revision or "main", repo_type=repo_type, local_files_only=True
        )
    except (hub.errors.LocalEntryNotFoundError, OSError, ValueError):
        return None
    return str(found)


def _import() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
        import huggingface_hub.utils
    except ImportError:
        raise MissingExtraError(
            "hf:// paths need huggingface_hub, for the Hub's endpoint, token and cache: "
            "pip install 'lazyckpt[hf]'"
        ) from None
    return huggingface_hub


_API = {"model": "models", "dataset": "datasets", "space": "spaces"}
_INFO_LIMIT = 64 << 20
"""The most bytes of a repository's info read (a model's file list: a few KB)."""
_COMMIT = re.compile(r"[0-9a-f]{40}", re.ASCII)
_SHORT_COMMIT = re.compile(r"[0-9a-f]{4,39}", re.ASCII)
_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}", re.ASCII | re.IGNORECASE)
"""A git blob id (SHA-1) or an LFS object's SHA-256."""
"""The first digits of a commit, as git abbreviates one (4 at least)."""


def _info(
    endpoint: str,
    repo_type: str,
    repo_id: str,
    revision: str | None,
    token: str | None,
    shown: str,
) -> tuple[str, list[str], dict[str, str]]:
    """The commit `revision` names now, the files it holds and their blobs: one
    request to the Hub's API (`/api/models/ORG/NAME/revision/REV?blobs=true`, as
    `huggingface_hub.repo_info(files_metadata=True)` asks), through lazyckpt's client,
    so that its deadline, retries and body limit hold there too. The Hub's errors are
    read from `X-Error-Code`, as `huggingface_hub` reads them."""
    url = f"{endpoint}/api/{_API[repo_type]}/{repo_id}"
    if revision is not None:
        url += f"/revision/{urllib.parse.quote(revision, safe='')}"
    url += "?blobs=true"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    named = f"{shown} (the Hub's API at {endpoint})"
    answer = range_reads.client().get(url, headers, limit=_INFO_LIMIT, named=named)
    code = answer.headers.get("x-error-code", "")
    status = answer.status
    if code == "GatedRepo":
        raise StorageAccessError(
            f"{shown}: the repository is gated; accept its terms on the Hub, then log in "
            "(`hf auth login`) or set HF_TOKEN to a token of that account"
        )
    if code == "RevisionNotFound":
        raise CheckpointNotFoundError(
            f"{shown}: the repository has no revision {revision!r} (a branch, tag or "
            "commit, or the first digits of one commit; one with '/' is percent-encoded, "
            "@feature%2Fx, but refs/pr/N); check the name after '@'"
        )
    if code == "RepoNotFound" or (status == 404 and not code):
        hint = (
            "set HF_TOKEN or log in (`hf auth login`) if it is private"
            if token is None
            else "or the token has no access to it"
        )
        raise CheckpointNotFoundError(f"{shown}: no such repository at {endpoint} ({hint})")
    if status in (401, 403):
        raise StorageAccessError(
            f"{shown}: the Hub refused the token (HTTP {status}); log in again "
            "(`hf auth login`) or set HF_TOKEN to a valid token"
        )
    message = said(answer.headers.get("x-error-message", ""), 160)
    if status != 200:
        raise StorageAccessError(f"{shown}: the Hub answered HTTP {status} ({message})")
    return _commit_and_files(named, bytes(answer.body))


def _commit_and_files(named: str, body: bytes | bytearray) -> tuple[str, list[str], dict[str, str]]:
    """`sha`, the `siblings`' names and their blobs (`_blobs`) of the Hub's answer,
    checked."""
    info = json_or_corrupt(named, bytes(body), "the Hub answered something else; try again")
    sha = info.get("sha") if isinstance(info, dict) else None
    siblings = info.get("siblings") if isinstance(info, dict) else None
    names = (
        [entry.get("rfilename") for entry in siblings if isinstance(entry, dict)]
        if isinstance(siblings, list)
        else None
    )
    if (
        not isinstance(sha, str)
        or not _COMMIT.fullmatch(sha)
        or names is None
        or not all(isinstance(name, str) for name in names)
    ):
        raise StorageAccessError(
            f"{named}: the answer is not a repository's info (a 40-digit commit `sha` and "
            "`siblings` with file names); check HF_ENDPOINT"
        )
    return sha, [str(name) for name in names], _blobs(siblings or [])


def _blobs(siblings: list[Any]) -> dict[str, str]:
    """Each file's blob as the listing gives it, where it does: an LFS file's sha256
    (`lfs.sha256`), another's git blob id (`blobId`); what the Hub's answers for the
    file name as its `X-Linked-Etag` or `ETag`, as `huggingface_hub` reads them."""
    found = {}
    for entry in siblings:
        if not isinstance(entry, dict):
            continue
        lfs = entry.get("lfs")
        blob = lfs.get("sha256") if isinstance(lfs, dict) else entry.get("blobId")
        if isinstance(blob, str) and _BLOB.fullmatch(blob):
            found[entry["rfilename"]] = blob.lower()
    return found


def _cached(
    hub: Any, repo_type: str, repo_id: str, commit: str, prefix: str, wanted: list[str]
) -> dict[str, str]:
    """The files of `wanted` that the cache holds at `commit`: their local paths, by
    name (links into the cache's blobs), from one walk of the commit's snapshot folder
    (an Orbax checkpoint has thousands of files, and asking the cache for each costs a
    lookup apiece)."""
    root = os.path.join(_snapshots(hub, repo_type, repo_id), commit, prefix)
    present = _present(root)
    found = {}
    for name in wanted:
        path = os.path.join(root, *name.split("/"))
        if name in present and os.path.isfile(path):  # (a link to a blob that is there)
            found[name] = path
    return found


def _present(root: str) -> set[str]:
    """The names of the files under the folder `root` (`a/b` in a subfolder `a`)."""
    present: set[str] = set()
    for parent, _, files in os.walk(root):
        inner = os.path.relpath(parent, root).replace(os.sep, "/")
        present.update(name if inner == "." else f"{inner}/{name}" for name in files)
    return present
