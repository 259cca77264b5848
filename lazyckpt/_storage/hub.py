"""`hf://` paths: a model on the Hugging Face Hub, pinned to one commit, read by ranges.

`hf://ORG/NAME[@REVISION][/PATH]` (and `hf://datasets/...`, `hf://spaces/...`) is
resolved once, at `normalize`, with `huggingface_hub` (the `lazyckpt[hf]` extra): its
endpoint (`HF_ENDPOINT`), its token (`HF_TOKEN`, or the saved login) and its cache are
the user's own. One request (the repository's info at that revision) gives the commit
and the file list; every later read asks for `resolve/{commit}/...`, so a push to the
repository while a tree is open never mixes two revisions.

What it resolves to:

- the folder (or file) in the local Hugging Face cache, where the cache holds every
  safetensors file and index of the folder for that commit: read from disk, no request;
- else the `https://` URL of `resolve/{commit}/PATH` at the endpoint, registered with
  `lazyckpt._storage.web` with its file list and the token, read by Range requests.
"""

from __future__ import annotations

import os
import posixpath
import time
import urllib.parse
from typing import Any

from lazyckpt._errors import (
    CheckpointNotFoundError,
    LazyckptError,
    MissingExtraError,
    StorageAccessError,
)
from lazyckpt._storage import web

SCHEME = "hf://"
_KINDS = {"datasets": "dataset", "spaces": "space"}
_MODEL_FILES = (".safetensors", ".safetensors.index.json")


def is_hub(path: str) -> bool:
    return path.startswith(SCHEME)


def parse(url: str) -> tuple[str, str, str | None, str]:
    """`(repo_type, repo_id, revision, path)` of an `hf://` URL."""
    rest = url[len(SCHEME) :].strip("/")
    parts = rest.split("/")
    repo_type = "model"
    if parts and parts[0] in _KINDS:
        repo_type = _KINDS[parts.pop(0)]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise CheckpointNotFoundError(
            f"{url}: expected hf://ORG/NAME[@REVISION][/PATH] (or hf://datasets/ORG/NAME...)"
        )
    name, _, revision = parts[1].partition("@")
    path = "/".join(parts[2:])
    return repo_type, f"{parts[0]}/{name}", urllib.parse.unquote(revision) or None, path


def resolve(url: str) -> str:
    """The place to read `url` from: a local folder of the cache, or an `https://` URL
    registered with its files, both at the commit its revision names now."""
    hub = _import()
    repo_type, repo_id, revision, path = parse(url)
    shown = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
    token = hub.get_token()
    info = _info(hub, repo_type, repo_id, revision, token, shown)
    commit = str(info.sha)
    names = [str(s.rfilename) for s in (info.siblings or [])]
    folder = path
    if path.endswith(".safetensors") or path.endswith(".json"):
        if path not in names:
            raise CheckpointNotFoundError(
                f"{shown}: no file {path!r} at commit {commit[:12]}; it holds "
                f"{[n for n in names if n.endswith(_MODEL_FILES)][:8]}"
            )
        folder = posixpath.dirname(path)
    prefix = f"{folder}/" if folder else ""
    inside = [n[len(prefix) :] for n in names if n.startswith(prefix)]
    models = [n for n in inside if "/" not in n and n.endswith(_MODEL_FILES)]
    if not models:
        raise CheckpointNotFoundError(
            f"{shown}: no safetensors files in {folder or 'the repository'} at commit "
            f"{commit[:12]}; it holds {sorted({n.split('/')[0] for n in inside})[:8]}"
        )
    cached = _cached(hub, repo_type, repo_id, commit, prefix, models)
    if cached is not None:
        return (
            cached
            if not path.endswith(".safetensors")
            else os.path.join(cached, posixpath.basename(path))
        )
    kind = "" if repo_type == "model" else f"{repo_type}s/"
    base = f"{hub.constants.ENDPOINT.rstrip('/')}/{kind}{repo_id}/resolve/{commit}"
    location = base + "".join(f"/{urllib.parse.quote(p)}" for p in folder.split("/") if p)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    described = f"{repo_id} at {revision or 'main'}, commit {commit[:12]}"
    web.register(location, web.Site(tuple(inside), headers, (commit,), described))
    if path.endswith(".safetensors"):
        return f"{location}/{urllib.parse.quote(posixpath.basename(path))}"
    return location


def _import() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError:
        raise MissingExtraError(
            "hf:// paths need huggingface_hub, for the Hub's endpoint, token and cache: "
            "pip install 'lazyckpt[hf]'"
        ) from None
    return huggingface_hub


def _info(
    hub: Any, repo_type: str, repo_id: str, revision: str | None, token: str | None, shown: str
) -> Any:
    """The repository's info at `revision`, tried again on 429 and 5xx."""
    errors = hub.errors
    api = hub.HfApi(endpoint=hub.constants.ENDPOINT)
    delay = 0.25
    for attempt in range(web.RETRIES):
        try:
            return api.repo_info(repo_id, revision=revision, repo_type=repo_type, token=token)
        except errors.GatedRepoError:
            raise StorageAccessError(
                f"{shown}: the repository is gated; accept its terms on the Hub, then log in "
                "(`hf auth login`) or set HF_TOKEN to a token of that account"
            ) from None
        except errors.RevisionNotFoundError:
            raise CheckpointNotFoundError(
                f"{shown}: the repository has no revision {revision!r} (a branch, tag or "
                "commit); check the name after '@'"
            ) from None
        except errors.RepositoryNotFoundError:
            hint = (
                "set HF_TOKEN or log in (`hf auth login`) if it is private"
                if token is None
                else "or the token has no access to it"
            )
            raise CheckpointNotFoundError(
                f"{shown}: no such repository at {hub.constants.ENDPOINT} ({hint})"
            ) from None
        except errors.HfHubHTTPError as error:
            status = getattr(getattr(error, "response", None), "status_code", None)
            if status in (401, 403):
                raise StorageAccessError(
                    f"{shown}: the Hub refused the token (HTTP {status}); log in again "
                    "(`hf auth login`) or set HF_TOKEN to a valid token"
                ) from None
            if status not in (429, 500, 502, 503, 504) or attempt == web.RETRIES - 1:
                raise StorageAccessError(
                    f"{shown}: the Hub answered HTTP {status} ({str(error)[:160]})"
                ) from None
        except LazyckptError:
            raise
        except Exception as error:  # noqa: BLE001 - the HTTP client's, made ours
            if attempt == web.RETRIES - 1:
                raise StorageAccessError(
                    f"{shown}: {hub.constants.ENDPOINT} could not be reached "
                    f"({type(error).__name__}: {str(error)[:160]}); check the network and "
                    "HF_ENDPOINT"
                ) from None
        time.sleep(delay)
        delay = min(2 * delay, 4.0)
    raise AssertionError("unreachable")


def _cached(
    hub: Any, repo_type: str, repo_id: str, commit: str, prefix: str, models: list[str]
) -> str | None:
    """The cache's folder of `prefix` at `commit`, where it holds every model file."""
    found = []
    for name in models:
        path = hub.try_to_load_from_cache(
            repo_id, prefix + name, revision=commit, repo_type=repo_type
        )
        if not isinstance(path, str):
            return None
        found.append(path)
    return os.path.dirname(found[0])
