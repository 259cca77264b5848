"""The loopback Hub of tests/hub_server.py, checked with `huggingface_hub` itself.

`huggingface_hub` reads HF_ENDPOINT once, at import, into `constants.ENDPOINT` and
`constants.HUGGINGFACE_CO_URL_TEMPLATE` (what `hf_hub_url` builds on), and its
module-level functions (`huggingface_hub.model_info`, ...) are bound to an `HfApi()`
made at import. In this process the fixture therefore patches both constants (and the
cache and token paths) and the tests call `HfApi(endpoint=...)`; the last test shows the
other way, HF_ENDPOINT set before the import, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hub_server import HubServer

hh = pytest.importorskip("huggingface_hub")
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.numpy import save  # noqa: E402

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def sharded_model() -> dict[str, bytes]:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones(4, dtype=np.int64)
    index = {
        "metadata": {"total_size": a.nbytes + b.nbytes},
        "weight_map": {"a": SHARDS[0], "b": SHARDS[1]},
    }
    return {
        SHARDS[0]: save({"a": a}),
        SHARDS[1]: save({"b": b}),
        "model.safetensors.index.json": json.dumps(index).encode(),
        "config.json": b'{"model_type": "toy"}',
    }


def api(hub: HubServer) -> Any:
    return hh.HfApi(endpoint=hub.endpoint)


def test_model_info_gives_the_commit_of_a_branch_tag_or_sha(hub: HubServer) -> None:
    first = hub.commit("org/model", sharded_model())
    hub.tag("org/model", "v1")
    second = hub.commit("org/model", {"config.json": b"{}"})  # a push moves main
    assert api(hub).model_info("org/model").sha == second
    assert api(hub).model_info("org/model", revision="v1").sha == first
    info = api(hub).model_info("org/model", revision=first, files_metadata=True)
    assert info.sha == first
    assert sorted(s.rfilename for s in info.siblings) == sorted(sharded_model())
    lfs = {s.rfilename: s.lfs for s in info.siblings}
    assert lfs[SHARDS[0]] is not None and lfs["config.json"] is None
    assert sorted(api(hub).list_repo_files("org/model", revision=first)) == sorted(sharded_model())


def test_a_short_commit_resolves_where_it_begins_one_commit(hub: HubServer) -> None:
    """As the Hub resolves `859350e`: in the API, and in `resolve/` for
    `hf_hub_download`, which keeps it in the cache's refs as it keeps a branch."""
    first = hub.commit("org/model", sharded_model())
    second = hub.commit("org/model", {"config.json": b"{}"})
    assert api(hub).model_info("org/model", revision=first[:7]).sha == first
    assert api(hub).model_info("org/model", revision=second[:4]).sha == second
    path = hh.hf_hub_download("org/model", "config.json", revision=first[:7])
    assert f"/snapshots/{first}/" in path
    assert Path(path).read_bytes() == sharded_model()["config.json"]
    assert hh.try_to_load_from_cache("org/model", "config.json", revision=first[:7]) == path
    absent = next(d * 7 for d in "0123456789abcdef" if d * 7 not in (first[:7], second[:7]))
    with pytest.raises(RevisionNotFoundError):  # no commit begins so
        api(hub).model_info("org/model", revision=absent)
    twin = first[:6] + ("1" if first[6] == "0" else "0") * 34
    (hub.root / "org/model" / twin).mkdir()  # a commit that begins alike
    with pytest.raises(RevisionNotFoundError):
        api(hub).model_info("org/model", revision=first[:6])
    assert api(hub).model_info("org/model", revision=first[:7]).sha == first


def test_hf_hub_download_caches_the_file_for_its_commit(hub: HubServer) -> None:
    sha = hub.commit("org/model", sharded_model())
    path = hh.hf_hub_download("org/model", SHARDS[0])
    assert Path(path).read_bytes() == sharded_model()[SHARDS[0]]
    assert hh.try_to_load_from_cache("org/model", SHARDS[0], revision=sha) == path
    assert hh.try_to_load_from_cache("org/model", SHARDS[0]) == path  # refs/main holds sha
    assert f"/snapshots/{sha}/" in path
    requests = [(r.server, r.method, r.status) for r in hub.log]
    assert requests[-2:] == [("hub", "HEAD", 302), ("cdn", "GET", 200)]

    newer = hub.commit("org/model", {SHARDS[0]: b"changed"})
    assert Path(hh.hf_hub_download("org/model", SHARDS[0])).read_bytes() == b"changed"
    assert hh.try_to_load_from_cache("org/model", SHARDS[0], revision=newer) != path
    assert Path(path).read_bytes() == sharded_model()[SHARDS[0]]  # the old commit stays


def test_get_safetensors_metadata_of_a_sharded_model(hub: HubServer) -> None:
    sha = hub.commit("org/model", sharded_model())
    hub.clear_log()
    meta = api(hub).get_safetensors_metadata("org/model", revision=sha)
    assert meta.sharded and meta.weight_map == {"a": SHARDS[0], "b": SHARDS[1]}
    a = meta.files_metadata[SHARDS[0]].tensors["a"]
    assert (a.dtype, a.shape) == ("F32", [2, 3])
    # Each shard header: one GET `Range: bytes=0-100000` on resolve/, 302, then 206 at the CDN.
    heads = [r for r in hub.log if r.range == "bytes=0-100000"]
    assert sorted((r.server, r.status) for r in heads) == [("cdn", 206)] * 2 + [("hub", 302)] * 2
    assert all(f"/resolve/{sha}/" in r.path for r in heads if r.server == "hub")


def test_the_hub_errors_map_to_huggingface_hub_exceptions(hub: HubServer) -> None:
    hub.commit("org/model", sharded_model())
    with pytest.raises(RepositoryNotFoundError):
        api(hub).model_info("org/missing")
    with pytest.raises(RevisionNotFoundError):
        api(hub).model_info("org/model", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hh.hf_hub_download("org/model", "config.json", revision="no-such-branch")
    with pytest.raises(EntryNotFoundError):
        hh.hf_hub_download("org/model", "missing.json")


def test_gated_and_private_repos_need_a_member_token(hub: HubServer) -> None:
    hub.create_repo("org/gated", gated="manual", allowed_tokens={"member"})
    hub.commit("org/gated", sharded_model())
    hub.create_repo("org/private", private=True, allowed_tokens={"member"})
    hub.commit("org/private", sharded_model())
    assert api(hub).model_info("org/gated").gated == "manual"  # the API stays open
    with pytest.raises(GatedRepoError) as anonymous:
        hh.hf_hub_download("org/gated", "config.json")
    assert anonymous.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as stranger:
        hh.hf_hub_download("org/gated", "config.json", token="stranger")
    assert stranger.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError, match="Invalid credentials"):
        api(hub).model_info("org/gated", token="forged")
    path = hh.hf_hub_download("org/gated", SHARDS[1], token="member")
    assert Path(path).read_bytes() == sharded_model()[SHARDS[1]]
    # The token goes to the Hub, not to the CDN it redirects to.
    auth = {(r.server, r.authorization) for r in hub.log[-2:]}
    assert auth == {("hub", "Bearer member"), ("cdn", None)}

    for token in (None, "stranger"):
        with pytest.raises(RepositoryNotFoundError) as private:
            api(hub).model_info("org/private", token=token)
        assert not isinstance(private.value, GatedRepoError)
    assert api(hub).model_info("org/private", token="member").private


def test_hf_file_system_reads_a_byte_range(hub: HubServer) -> None:
    hub.commit("org/model", sharded_model())
    fs = hh.HfFileSystem(endpoint=hub.endpoint, skip_instance_cache=True)
    hub.clear_log()
    with fs.open(f"org/model/{SHARDS[0]}", "rb", block_size=16) as f:
        f.seek(3)
        assert f.read(5) == sharded_model()[SHARDS[0]][3:8]
    ranged = [(r.server, r.status) for r in hub.log if r.range]
    assert ranged == [("hub", 302), ("cdn", 206)]  # fsspec reads ahead: bytes=3-23
    assert {r.range for r in hub.log if r.range} == {hub.log[-1].range}
    assert hub.log[-1].range is not None and hub.log[-1].range.startswith("bytes=3-")


def test_injected_failures_are_retried_where_huggingface_hub_retries(hub: HubServer) -> None:
    hub.commit("org/model", sharded_model())
    hub.fail_next(1, 503, retry_after=0)  # huggingface_hub then sleeps Retry-After + 1 s
    assert SHARDS[0] in api(hub).list_repo_files("org/model")  # paginated: http_backoff
    assert [r.status for r in hub.log] == [503, 200]
    hub.fail_next(1, 429)
    with pytest.raises(HfHubHTTPError) as error:  # model_info does not retry
        api(hub).model_info("org/model")
    assert error.value.response.status_code == 429
    assert error.value.response.headers["Retry-After"] == "0"


def test_ranges_plain_files_and_a_server_that_ignores_range(hub: HubServer) -> None:
    data = bytes(range(200))
    url = hub.add_plain_file("dir/model.safetensors", data)

    def get(range_: str | None) -> tuple[int, bytes, str | None]:
        request = urllib.request.Request(url, headers={"Range": range_} if range_ else {})
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, response.read(), response.headers["Content-Range"]
        except urllib.error.HTTPError as error:
            return error.code, b"", error.headers["Content-Range"]

    assert get("bytes=10-19") == (206, data[10:20], "bytes 10-19/200")
    assert get("bytes=190-") == (206, data[190:], "bytes 190-199/200")
    assert get("bytes=-5") == (206, data[-5:], "bytes 195-199/200")
    assert get("bytes=150-999") == (206, data[150:], "bytes 150-199/200")
    assert get("bytes=200-300") == (416, b"", "bytes */200")
    assert get(None) == (200, data, None)
    hub.ignore_range = True
    assert get("bytes=10-19") == (200, data, None)
    assert [r.bytes_sent for r in hub.log[-2:]] == [200, 200]
    assert hub.log[-1].range == "bytes=10-19"


def test_hf_endpoint_set_before_the_import(tmp_path: Path) -> None:
    script = """if True:
        import os, sys
        from huggingface_hub import hf_hub_download, model_info, try_to_load_from_cache
        sha = model_info("org/model").sha
        path = hf_hub_download("org/model", "config.json")
        assert try_to_load_from_cache("org/model", "config.json", revision=sha) == path
        print(sha)
    """
    with HubServer(tmp_path / "hub") as server:
        sha = server.commit("org/model", sharded_model())
        env = {
            **os.environ,
            "HF_ENDPOINT": server.endpoint,
            "HF_HOME": str(tmp_path / "home"),
            "HF_HUB_CACHE": str(tmp_path / "cache"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        env.pop("HF_TOKEN", None)
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
        )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == sha
