"""`hf://` and `https://` paths, against the loopback Hub of tests/hub_server.py (its
revisions, `resolve/` redirecting to a CDN origin, Range, gated and private repos,
injected failures), with `huggingface_hub` resolving the endpoint, token and cache."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save

import lazyckpt
from lazyckpt._cli.main import main
from lazyckpt._storage import metrics, network
from tests import hub_server
from tests.hub_server import HubServer, folder_files

hh = pytest.importorskip("huggingface_hub")
constants = pytest.importorskip("huggingface_hub.constants")

LAYERS = 4
SHARDS = tuple(f"model-0000{i + 1}-of-0000{LAYERS}.safetensors" for i in range(LAYERS))


def model(scale: float = 1.0) -> tuple[dict[str, bytes], dict[str, np.ndarray]]:
    """A sharded model, one layer a shard: its files and its tensors."""
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}
    files: dict[str, bytes] = {}
    weight_map = {}
    for layer, shard in enumerate(SHARDS):
        mine = {
            f"model.layers.{layer}.mlp.up_proj.weight": (
                rng.standard_normal((64, 32)).astype(np.float32) * scale
            ),
            f"model.layers.{layer}.input_layernorm.weight": np.ones(32, np.float32),
        }
        tensors.update(mine)
        files[shard] = save(mine)
        weight_map.update(dict.fromkeys(mine, shard))
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": weight_map}
    ).encode()
    files["config.json"] = b'{"model_type": "toy"}'
    return files, tensors


def up(tree: Any, layer: int) -> Any:
    return tree["model"]["layers"][str(layer)]["mlp"]["up_proj"]["weight"]


def data_requests(hub: HubServer) -> list[Any]:
    """Requests for the model's files (not the Hub's API)."""
    return [e for e in hub.log if "/resolve/" in e.path or e.server == "cdn"]


def test_a_sharded_model_opens_with_a_request_or_two_per_file(hub: HubServer) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    hub.clear_log()
    tree = lazyckpt.open("hf://org/model")
    paths = [(e.server, e.method, e.path.rsplit("/", 1)[-1], e.status) for e in hub.log]
    api = [p for p in paths if p[0] == "hub" and "/api/models/" in hub.log[paths.index(p)].path]
    assert len(api) == 1  # the revision, resolved to its commit, and the file list
    index = [p for p in paths if p[2] == "model.safetensors.index.json"]
    assert len(index) == 1
    for shard in SHARDS:  # the redirect, and one ranged read of its header
        assert [p[3] for p in paths if p[2] == shard] == [302, 206]
    assert "config.json" not in {p[2] for p in paths}
    np.testing.assert_array_equal(up(tree, 2).get(), tensors["model.layers.2.mlp.up_proj.weight"])


def test_one_layer_reads_only_its_ranges(hub: HubServer) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    hub.clear_log()
    before = metrics.bytes_read()
    rows = up(tree, 1)[10:20].get()
    assert metrics.bytes_read() - before == 10 * 32 * 4
    np.testing.assert_array_equal(rows, tensors["model.layers.1.mlp.up_proj.weight"][10:20])
    # Straight to the CDN address the open was redirected to, with no token there.
    assert [(e.server, e.range) for e in hub.log] == [("cdn", f"bytes={_row(tree, 1, 10)}")]


def _row(tree: Any, layer: int, row: int) -> str:
    stored = up(tree, layer).stored
    start = stored.start + row * 32 * 4
    return f"{start}-{start + 10 * 32 * 4 - 1}"


def test_a_push_during_a_session_does_not_change_an_open_tree(hub: HubServer) -> None:
    files, tensors = model()
    first = hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    pushed, _ = model(scale=2.0)
    hub.commit("org/model", pushed)
    want = tensors["model.layers.0.mlp.up_proj.weight"]
    np.testing.assert_array_equal(up(tree, 0).get(), want)  # still the first commit
    np.testing.assert_array_equal(up(lazyckpt.open("hf://org/model"), 0).get(), 2 * want)
    pinned = lazyckpt.open(f"hf://org/model@{first}/{SHARDS[0]}")
    np.testing.assert_array_equal(up(pinned, 0).get(), want)


def test_files_in_the_cache_are_read_from_disk(hub: HubServer) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    for name in (*SHARDS, "model.safetensors.index.json"):
        hh.hf_hub_download("org/model", name)
    hub.clear_log()
    tree = lazyckpt.open("hf://org/model")
    loaded = lazyckpt.load(tree)
    assert not data_requests(hub)  # only the revision's commit was asked for
    raw = up(tree, 3).stored.raw_file()  # positioned reads of the cache's copy
    assert raw is not None and raw[0].startswith(constants.HF_HUB_CACHE)
    np.testing.assert_array_equal(
        loaded["model"]["layers"]["3"]["mlp"]["up_proj"]["weight"],
        tensors["model.layers.3.mlp.up_proj.weight"],
    )


def test_a_shard_in_the_cache_is_read_from_disk_the_others_by_ranges(hub: HubServer) -> None:
    files, _ = model()
    commit = hub.commit("org/model", files)
    cached = hh.hf_hub_download("org/model", SHARDS[1])
    hub.clear_log()
    tree = lazyckpt.open("hf://org/model")
    stored = up(tree, 1).stored
    assert stored.raw_file() == (cached, stored.start)  # positioned reads, into place
    assert stored.remote_raw() is None
    before = metrics.bytes_read()
    rows = up(tree, 1)[10:20].get()  # (a short run: through the folder's reader)
    assert metrics.bytes_read() - before == 10 * 32 * 4
    loaded = lazyckpt.load(lazyckpt.open("hf://org/model", flat=True))
    assert not [e for e in hub.log if e.path.endswith(SHARDS[1])]
    for shard in (SHARDS[0], *SHARDS[2:]):
        sent = [e for e in hub.log if e.server == "cdn" and e.path.endswith(shard)]
        assert sent and all(e.range and e.status == 206 for e in sent)
    for shard in SHARDS:
        for name, want in load_file(hub.root / "org/model" / commit / shard).items():
            np.testing.assert_array_equal(loaded[name], want)
    np.testing.assert_array_equal(
        rows, load_file(cached)["model.layers.1.mlp.up_proj.weight"][10:20]
    )


def test_an_index_in_the_cache_is_not_asked_for(hub: HubServer) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    hh.hf_hub_download("org/model", "model.safetensors.index.json")
    hub.clear_log()
    tree = lazyckpt.open("hf://org/model")
    assert not [e for e in hub.log if e.path.endswith("model.safetensors.index.json")]
    assert [e for e in data_requests(hub) if e.path.endswith(SHARDS[0])]
    np.testing.assert_array_equal(up(tree, 0).get(), tensors["model.layers.0.mlp.up_proj.weight"])


def test_a_damaged_file_in_the_cache_is_named_with_its_fix(hub: HubServer) -> None:
    """A truncated copy is refused at open, naming it and how to download it again; a
    FIFO put in its blob's place after open is refused, never waited on."""
    files, _ = model()
    hub.commit("org/model", files)
    cached = hh.hf_hub_download("org/model", SHARDS[2])
    blob = Path(cached).resolve()
    blob.write_bytes(files[SHARDS[2]][:-100])
    with pytest.raises(
        lazyckpt.CorruptCheckpointError,
        match=rf"^hf://org/model@[0-9a-f]{{7}}/{SHARDS[2]} \(org/model at main, commit "
        rf"[0-9a-f]{{12}}\): its copy in the Hugging Face cache holds "
        rf"{len(files[SHARDS[2]]) - 100} bytes; .*"
        rf"truncated: .*force_download=True\), or delete it from the cache .*"
        rf"{re.escape(str(blob))}\) and download it again",
    ):
        lazyckpt.open("hf://org/model")
    blob.write_bytes(bytes(len(files[SHARDS[2]])))  # zeroed, as a failed copy leaves it
    with pytest.raises(
        lazyckpt.CorruptCheckpointError,
        match=rf"{SHARDS[2]}.*read from its copy in the Hugging Face cache: .*force_download"
        rf"=True\), or delete it from the cache .*{re.escape(str(blob))}\) and download it again",
    ):
        lazyckpt.open("hf://org/model")
    blob.write_bytes(files[SHARDS[2]])
    tree = lazyckpt.open("hf://org/model")
    blob.write_bytes(files[SHARDS[2]][:200])  # shortened after open
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"copy .*holds 200 bytes, fewer"):
        up(tree, 2)[60:, :4].get()  # (short runs: through the folder's reader)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"truncated since it was opened"):
        up(tree, 2)[60:].get()  # (straight into place)
    blob.unlink()
    os.mkfifo(blob)
    for read in (lambda: up(tree, 2)[10:20].get(), lambda: lazyckpt.load(up(tree, 2))):
        with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"not a regular file \(a FIFO"):
            read()


def test_every_verb_reads_over_http(hub: HubServer, tmp_path: Path) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = lazyckpt.device_put(up(tree, 1), NamedSharding(mesh, P("x", "y")))
    np.testing.assert_array_equal(np.asarray(placed), tensors["model.layers.1.mlp.up_proj.weight"])
    blocks = list(lazyckpt.iter_blocks(up(tree, 2), memory_budget="1KiB"))
    assert len(blocks) >= 1
    table = lazyckpt.stats(tree)
    assert table["model/layers/0/mlp/up_proj/weight"].max == pytest.approx(
        float(tensors["model.layers.0.mlp.up_proj.weight"].max())
    )
    assert lazyckpt.verify(tree).ok
    remote = r"hf://org/model is a remote model folder: its config.json and tokenizer"
    with pytest.warns(lazyckpt.CarriedFilesWarning, match=remote):
        out = lazyckpt.convert("hf://org/model", tmp_path / "orbax", select="model/layers/0/**")
    restored = ocp.PyTreeCheckpointer().restore(out)
    np.testing.assert_array_equal(
        np.asarray(restored["model"]["layers"]["0"]["mlp"]["up_proj"]["weight"]),
        tensors["model.layers.0.mlp.up_proj.weight"],
    )
    with pytest.warns(lazyckpt.CarriedFilesWarning, match=remote):
        copy = lazyckpt.convert("hf://org/model", tmp_path / "copy", to="safetensors")
    assert not lazyckpt.diff(tree, lazyckpt.open(copy), values=True)


def test_the_command_line_inspects_a_hub_model(hub: HubServer, tmp_path: Path) -> None:
    files, _ = model()
    hub.commit("org/model", files)
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_TOKEN_PATH": str(tmp_path / "no-token"),
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-m", "lazyckpt._cli.main", "inspect", "hf://org/model"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stderr
    assert "up_proj" in result.stdout and "float32[64,32]" in result.stdout


def test_plain_https_without_the_hub_api(hub: HubServer) -> None:
    files, tensors = model()
    for name, data in files.items():
        hub.add_plain_file(f"m/{name}", data)
    url = hub.plain_url("m")
    hub.clear_log()
    tree = lazyckpt.open(url)
    np.testing.assert_array_equal(up(tree, 3).get(), tensors["model.layers.3.mlp.up_proj.weight"])
    assert not any("/api/" in e.path for e in hub.log)
    single = lazyckpt.open(hub.plain_url(f"m/{SHARDS[1]}"))
    np.testing.assert_array_equal(
        up(single, 1)[5].get(), tensors["model.layers.1.mlp.up_proj.weight"][5]
    )


def test_failures_that_pass_are_tried_again(hub: HubServer) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    up(tree, 0).get()  # the CDN address is known from here on
    hub.fail_next(2, 429, retry_after=0)
    hub.fail_next(1, 503, retry_after=0)
    np.testing.assert_array_equal(up(tree, 0).get(), tensors["model.layers.0.mlp.up_proj.weight"])
    assert [e.status for e in hub.log[-4:]] == [429, 429, 503, 206]


@pytest.mark.parametrize(
    ("setup", "path", "error", "match"),
    [
        (
            "missing repo",
            "hf://org/nothing",
            lazyckpt.CheckpointNotFoundError,
            r"hf://org/nothing: no such repository at http://127.0.0.1:\d+ \(set HF_TOKEN",
        ),
        (
            "",
            "hf://datasets/org/model@v1",
            lazyckpt.CheckpointNotFoundError,
            r"^hf://datasets/org/model@v1: no such repository at",
        ),
        (
            "",
            "hf://org/model@v9",
            lazyckpt.CheckpointNotFoundError,
            r"hf://org/model@v9: the repository has no revision 'v9'",
        ),
        (
            "",
            "hf://org/model/nothing.safetensors",
            lazyckpt.CheckpointNotFoundError,
            r"hf://org/model: no file 'nothing.safetensors' at commit [0-9a-f]{12}",
        ),
        (
            "gated",
            "hf://org/model",
            lazyckpt.StorageAccessError,
            r"hf://org/model: .*gated.*HF_TOKEN|access denied.*HF_TOKEN",
        ),
        (
            "private",
            "hf://org/model",
            lazyckpt.CheckpointNotFoundError,
            r"no such repository .*set HF_TOKEN or log in",
        ),
        (
            "wrong token",
            "hf://org/model",
            lazyckpt.StorageAccessError,
            r"refused the token|access denied",
        ),
        (
            "no range",
            "hf://org/model",
            lazyckpt.StorageAccessError,
            r"model-00001-of-00004.safetensors \(org/model at main, commit [0-9a-f]{12}\): the server ignores Range requests",
        ),
        (
            "no network",
            "hf://org/model",
            lazyckpt.StorageAccessError,
            r"could not be reached .*HF_ENDPOINT",
        ),
    ],
)
def test_errors_name_the_repo_revision_and_file(
    hub: HubServer,
    monkeypatch: pytest.MonkeyPatch,
    setup: str,
    path: str,
    error: type[Exception],
    match: str,
) -> None:
    files, _ = model()
    hub.commit("org/model", files)
    if setup == "gated":
        hub.create_repo("org/model", gated="manual", allowed_tokens={"member"})
    elif setup == "private":
        hub.create_repo("org/model", private=True, allowed_tokens={"member"})
    elif setup == "wrong token":
        hub.create_repo("org/model", private=True, allowed_tokens={"member"})
        monkeypatch.setenv("HF_TOKEN", "not-a-token")
    elif setup == "no range":
        hub.ignore_range = True
    elif setup == "no network":
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setattr(network, "_OPTIONS", [lazyckpt.NetworkOptions(retries=2)])
    with pytest.raises(error, match=match):
        lazyckpt.open(path)


FORM = (
    r"expected hf://ORG/NAME\[@REVISION\]\[/PATH\] \(or hf://datasets/ORG/NAME\.\.\., "
    r"hf://spaces/ORG/NAME\.\.\.\); "
)


@pytest.mark.parametrize(
    ("path", "found"),
    [
        ("hf://../../x", r"'\.\.' is not a Hub name"),
        ("hf://org%2F..%2Fevil/x", r"'org%2F\.\.%2Fevil' is not a Hub name"),
        ("hf://datasets/../org/m", r"'\.\.' is not a Hub name"),
        ("hf://spaces/org/..", r"'\.\.' is not a Hub name"),
        ("hf://org/model%2F..", r"'model%2F\.\.' is not a Hub name"),
        ("hf://org/a..b", r"'a\.\.b' is not a Hub name"),
        ("hf://-org/model", r"'-org' is not a Hub name"),
        ("hf://org/model/../other", r"the path has a part '\.\.'"),
        ("hf://org/model/%2e%2E/x", r"the path has a part '%2e%2E'"),
        ("hf://org/model/a%2Fb.safetensors", r"the path has a part 'a%2Fb.safetensors'"),
        ("hf://org/model//x", r"the path has a part ''"),
        ("hf://org/model@..%2Fmain", r"the revision '\.\./main' has an empty, '\.' or '\.\.' part"),
        ("hf://org/model.git", r"Repo_id cannot end by '\.git'"),  # huggingface_hub's own
        ("hf://org/" + "m" * 97, r"'m{97}' is not a Hub name"),
        ("hf://datasets/org", r"no ORG/NAME"),
    ],
)
def test_malformed_hub_paths_name_the_form_and_send_nothing(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, path: str, found: str
) -> None:
    """Refused before any request, as lazyckpt's error, not huggingface_hub's
    HFValidationError; offline too, where the cache is looked in instead."""
    files, _ = model()
    hub.commit("org/model", files)
    hub.clear_log()
    for offline in (False, True):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        with pytest.raises(lazyckpt.CheckpointNotFoundError) as raised:
            lazyckpt.open(path)
        assert re.match(rf"{re.escape(path)}: {FORM}{found}", str(raised.value)), raised.value
        assert not isinstance(raised.value, hh.errors.HFValidationError)
    assert hub.log == []


def test_a_gated_repo_opens_with_a_granted_token(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    hub.create_repo("org/model", gated="manual", allowed_tokens={"member"})
    monkeypatch.setenv("HF_TOKEN", "member")
    tree = lazyckpt.open("hf://org/model")
    np.testing.assert_array_equal(up(tree, 1).get(), tensors["model.layers.1.mlp.up_proj.weight"])
    cdn = [e for e in hub.log if e.server == "cdn"]
    assert cdn and all(e.authorization is None for e in cdn)  # the token stays with the Hub
    assert any(e.authorization == "Bearer member" for e in hub.log if e.server == "hub")


def test_a_file_that_changes_size_after_open_is_refused(hub: HubServer) -> None:
    files, tensors = model()
    for name, data in files.items():
        hub.add_plain_file(f"m/{name}", data)
    tree = lazyckpt.open(hub.plain_url("m"))
    layer = tensors["model.layers.2.mlp.up_proj.weight"]
    hub.add_plain_file(f"m/{SHARDS[2]}", files[SHARDS[2]] + bytes(64))
    with pytest.raises(
        lazyckpt.CheckpointChangedError, match=rf"{SHARDS[2]} changed since it was opened"
    ):
        up(tree, 2).get()
    assert layer.shape == (64, 32)


def test_a_cdn_address_that_answers_404_is_asked_for_again(hub: HubServer) -> None:
    """At a pinned commit a file cannot change: a 404 at the CDN address a redirect
    gave is asked of the Hub again, as an expired one's 403 is; a 404 there too is a
    missing object, never a file that changed."""
    files, tensors = model()
    hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    want = tensors["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_array_equal(up(tree, 1)[:2].get(), want[:2])  # (the CDN address)
    hub.clear_log()
    hub.fail_next(1, 404, retry_after=None, path_prefix="/cdn/")
    np.testing.assert_array_equal(up(tree, 1)[2:4].get(), want[2:4])
    assert [(e.server, e.status) for e in hub.log] == [("cdn", 404), ("hub", 302), ("cdn", 206)]
    hub.fail_next(2, 404, retry_after=None, path_prefix="/cdn/")
    with pytest.raises(
        lazyckpt.CheckpointNotFoundError,
        match=rf"^hf://org/model@[0-9a-f]{{7}}/{SHARDS[1]} \(org/model at main, commit "
        r"[0-9a-f]{12}\): the Hub lists this file at the commit, but its server answered "
        r"HTTP 404 \(again at the address the Hub then gave afresh\): the file's stored "
        r"object is missing there",
    ):
        up(tree, 1)[4:6].get()


@pytest.mark.parametrize("damage", ["header", "truncated"])
@pytest.mark.parametrize("opened", ["snapshot folder", "hf://"])
def test_a_damaged_file_the_cache_holds_whole_names_how_to_fetch_it_again(
    hub: HubServer, damage: str, opened: str
) -> None:
    """A model the cache holds whole, opened from its snapshot folder (or by hf://,
    which reads that folder): a damaged file's fix is to fetch it past the cache,
    which `hf_hub_download` alone returns as it is (the advice was "download or copy
    it again", or none for a damaged header)."""
    files, _ = model()
    hub.commit("org/model", files)
    folder = Path(hh.snapshot_download("org/model"))
    blob = (folder / SHARDS[1]).resolve()
    data = files[SHARDS[1]]
    blob.write_bytes(data[:8] + b"#" + data[9:] if damage == "header" else data[:-100])
    fix = (
        rf"hf_hub_download\('org/model', '{SHARDS[1]}', revision='[0-9a-f]{{40}}', "
        rf"force_download=True\), or delete it from the cache \(`hf cache rm`, or remove it "
        rf"and its blob {re.escape(str(blob))}\) and download it again"
    )
    found = {
        "header": r"the header is not valid JSON .*read from its copy in the Hugging Face "
        r"cache: downloading it again as usual returns the damaged copy as it is: fetch it "
        rf"again with {fix}",
        "truncated": r"is too short for the end of its data .*the file is truncated, and it is "
        r"the Hugging Face cache's copy: downloading it again as usual returns the damaged "
        rf"copy as it is: fetch it again with {fix}",
    }[damage]
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=found):
        lazyckpt.open(str(folder) if opened == "snapshot folder" else "hf://org/model")


def test_an_unreachable_hub_with_the_model_cached_suggests_offline(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, _ = model()
    hub.commit("org/model", files)
    hh.snapshot_download("org/model")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(network, "_OPTIONS", [lazyckpt.NetworkOptions(retries=2)])
    with pytest.raises(
        lazyckpt.StorageAccessError,
        match=r"^hf://org/model \(the Hub's API at .*could not be reached .*; the Hugging "
        r"Face cache holds files of org/model: set HF_HUB_OFFLINE=1 to read them without "
        r"asking the Hub$",
    ):
        lazyckpt.open("hf://org/model")
    with pytest.raises(lazyckpt.StorageAccessError, match=r"could not be reached") as caught:
        lazyckpt.open("hf://org/other")  # (nothing of it in the cache)
    assert "HF_HUB_OFFLINE" not in str(caught.value)


def test_names_that_need_quoting_and_pull_request_revisions(hub: HubServer) -> None:
    """Shard names with a space, `+` or a non-ASCII letter, through the index and by
    their own path; a revision `refs/pr/1` written as it is."""
    a, b = np.arange(6, dtype=np.float32), np.ones(3, np.float32)
    shards = ("my model+1.safetensors", "modèle-ü.safetensors")
    index = {"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1]}}
    files = {
        shards[0]: save({"a": a}),
        shards[1]: save({"b": b}),
        "model.safetensors.index.json": json.dumps(index).encode(),
    }
    hub.commit("org/odd", files)
    tree = lazyckpt.open("hf://org/odd")
    np.testing.assert_array_equal(tree["a"].get(), a)
    np.testing.assert_array_equal(tree["b"].get(), b)
    np.testing.assert_array_equal(lazyckpt.open(f"hf://org/odd/{shards[1]}")["b"].get(), b)
    hub.commit("org/odd", {shards[0]: save({"a": 2 * a})}, branch="refs/pr/1")
    np.testing.assert_array_equal(lazyckpt.open("hf://org/odd@refs/pr/1")["a"].get(), 2 * a)
    np.testing.assert_array_equal(lazyckpt.open("hf://org/odd@refs%2Fpr%2F1")["a"].get(), 2 * a)


def test_a_plain_url_changed_opens_again_with_its_new_files(hub: HubServer) -> None:
    files, tensors = model()
    for name, data in files.items():
        hub.add_plain_file(f"m/{name}", data)
    url = hub.plain_url("m")
    tree = lazyckpt.open(url)
    changed, _ = model(scale=3.0)
    hub.add_plain_file(f"m/{SHARDS[0]}", changed[SHARDS[0]] + bytes(8))
    with pytest.raises(lazyckpt.CheckpointChangedError):
        up(tree, 0).get()
    again = lazyckpt.open(url)  # a new open pins what the server holds now
    np.testing.assert_array_equal(
        up(again, 0).get(), 3 * tensors["model.layers.0.mlp.up_proj.weight"]
    )
    hub.add_plain_file(f"m/{SHARDS[1]}", files[SHARDS[1]][:100])  # shrunk below a read
    with pytest.raises(lazyckpt.CheckpointChangedError, match=rf"{SHARDS[1]} changed"):
        up(again, 1)[60:].get()


def test_the_short_commit_shown_opens_that_commit_again(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hf://ORG/NAME@1a2b3c4`, as lazyckpt shows a path, pasted back: the Hub resolves
    the short commit online (`/api/models/ORG/NAME/revision/1a2b3c4`), the cache's
    snapshots offline; the same tree, after a push moved the branch on."""
    files, tensors = model()
    first = hub.commit("org/model", files)
    assert main(["inspect", "hf://org/model"]) == 0
    shown = capsys.readouterr().out.splitlines()[0].split(": ")[0]
    assert shown == f"hf://org/model@{first[:7]}"
    pushed, _ = model(scale=2.0)
    hub.commit("org/model", pushed)
    want = tensors["model.layers.0.mlp.up_proj.weight"]
    for path in (shown, f"{shown}/{SHARDS[0]}"):  # as it heads a table, as errors name a file
        np.testing.assert_array_equal(up(lazyckpt.open(path), 0).get(), want)
    assert main(["inspect", shown]) == 0
    assert capsys.readouterr().out.startswith(f"{shown}: {2 * LAYERS} arrays")
    hh.snapshot_download("org/model", revision=first)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.clear_log()
    np.testing.assert_array_equal(up(lazyckpt.open(shown), 0).get(), want)
    assert not hub.log
    # Another commit of the cache that begins alike: more digits tell them apart.
    other = first[:7] + ("1" if first[7] == "0" else "0") * 33
    snapshots = Path(constants.HF_HUB_CACHE) / "models--org--model" / "snapshots"
    (snapshots / other).mkdir()
    with pytest.raises(
        lazyckpt.CheckpointNotFoundError, match=rf"2 commits that begin with '{first[:7]}'"
    ):
        lazyckpt.open(shown)
    np.testing.assert_array_equal(up(lazyckpt.open(f"hf://org/model@{first[:8]}"), 0).get(), want)


def test_offline_the_cache_answers_for_a_branch(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, tensors = model()
    files["model.safetensors"] = files[SHARDS[0]]  # cached, but not the file asked for below
    hub.commit("org/model", files)
    for name in (*SHARDS, "model.safetensors.index.json", "model.safetensors"):
        hh.hf_hub_download("org/model", name)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.clear_log()
    tree = lazyckpt.open("hf://org/model")
    np.testing.assert_array_equal(up(tree, 2).get(), tensors["model.layers.2.mlp.up_proj.weight"])
    assert not hub.log
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="HF_HUB_OFFLINE is set"):
        lazyckpt.open("hf://org/other")
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="HF_HUB_OFFLINE is set"):
        lazyckpt.open("hf://org/model/absent.safetensors")  # a file: that one, not another


def test_a_branch_named_like_a_commit_is_refused_for_that_commit(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hf://ORG/NAME@<40 hex>` pins a commit; a branch of that name, which the Hub
    resolves first, pointing elsewhere was read in its place. Refused by name before
    any file is read, online and offline (where the cache's refs resolve it alike); a
    commit pinned in full that no branch shadows still opens."""
    files, tensors = model()
    first = hub.commit("org/model", files)
    pushed, _ = model(scale=2.0)
    other = hub.commit("org/model", pushed, branch="next")
    hub.tag("org/model", first, "next")  # a branch named as `first`, at `other`
    want = tensors["model.layers.0.mlp.up_proj.weight"]
    refused = (
        rf"hf://org/model@{first}: the revision '{first}' names a commit by its 40 hex "
        rf"digits, but {{by}} resolved it to commit '{other}': a branch or tag of that name "
        rf"shadows the commit, so nothing was read\. To read that branch, give its full "
        rf"name \(@refs%2Fheads%2F{first}\) or the commit it holds now \(@{other}\)"
    )
    hub.clear_log()
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match=refused.format(by="the Hub")):
        lazyckpt.open(f"hf://org/model@{first}")
    assert [e.path for e in hub.log] == [f"/api/models/org/model/revision/{first}?blobs=true"]
    for fix in (f"refs%2Fheads%2F{first}", other):  # the branch, as the message says
        np.testing.assert_array_equal(up(lazyckpt.open(f"hf://org/model@{fix}"), 0).get(), 2 * want)
    # huggingface_hub asked for `first` too, and its cache's refs now name the branch.
    hh.snapshot_download("org/model", revision=first)
    assert (
        Path(constants.HF_HUB_CACHE) / "models--org--model" / "refs" / first
    ).read_text() == other
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.clear_log()
    cache = r"the Hugging Face cache \(HF_HUB_OFFLINE is set\)"
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match=refused.format(by=cache)):
        lazyckpt.open(f"hf://org/model@{first}")
    np.testing.assert_array_equal(up(lazyckpt.open(f"hf://org/model@{other}"), 0).get(), 2 * want)
    assert hub.log == []


def _shadowed(commit: str, answered: str, name: str, revision: str = "main") -> str:
    """The refusal of a file whose `resolve/{commit}/` answer came from another commit."""
    return (
        rf"^hf://org/\w+@{commit[:7]}/{re.escape(name)} \(org/\w+ at {re.escape(revision)}, "
        rf"commit {commit[:12]}\): the Hub answered for the file with commit '{answered}' "
        rf"\(X-Repo-Commit\), not {commit}, the commit the open resolved: a branch or tag "
        rf"named {commit} shadows that commit \(the Hub resolves a branch or tag before a "
        r"commit of the same name\), so nothing of that answer was used\. Ask the "
        r"repository's owners to rename or delete that branch or tag"
    )


@pytest.mark.parametrize("resolve_cache", [False, True], ids=["direct", "resolve-cache"])
@pytest.mark.parametrize("revision", ["", "@main", "@v1", "@short"])
def test_a_branch_named_after_the_commit_a_revision_names_is_refused(
    hub: HubServer, revision: str, resolve_cache: bool
) -> None:
    """Anyone who can push a branch named after main's commit served its files for
    `hf://ORG/NAME`, `@main`, a tag or a short commit: the revision resolves to the
    commit, and the Hub answers `resolve/COMMIT/...` from the branch of that name.
    The Hub says which commit it answered from (`X-Repo-Commit`): another is refused
    by name at the first file, before any of the other commit's bytes are asked for;
    whether the Hub serves a small file there, or redirects to its commit's
    `resolve-cache/` address (as it does for a public repository's)."""
    hub.resolve_cache = resolve_cache
    files, tensors = model()
    first = hub.commit("org/model", files)
    hub.tag("org/model", "v1")
    want = tensors["model.layers.0.mlp.up_proj.weight"]
    path = f"hf://org/model{revision.replace('short', first[:7])}"
    evil, _ = model(scale=-5.0)
    other = hub.commit("org/model", evil, branch="x")
    hub.tag("org/model", first, "x")  # a branch named as main's commit, at `other`
    hub.clear_log()
    named = revision.removeprefix("@").replace("short", first[:7]) or "main"
    refused = _shadowed(first, other, "model.safetensors.index.json", named)
    with pytest.raises(lazyckpt.CheckpointChangedError, match=refused):
        lazyckpt.open(path)
    assert not [e for e in hub.log if f"/cdn/org/model/{other}/" in e.path]
    # The owners delete the branch: the commit reads.
    del hub.repos["org/model"].refs[first]
    hub.clear_log()
    np.testing.assert_array_equal(up(lazyckpt.open(path), 0).get(), want)
    assert (307 in {e.status for e in hub.log}) is resolve_cache


def test_a_branch_named_after_an_open_commit_pushed_later_is_refused(hub: HubServer) -> None:
    """`hf://ORG/NAME@<40 hex>` opened, then a branch of that name pushed, then a CDN
    address that expired: asked again of the Hub, which answered from the branch, and
    the other commit's values were read (-5 times main's). Refused by name."""
    files, tensors = model()
    first = hub.commit("org/model", files)
    tree = lazyckpt.open(f"hf://org/model@{first}")
    want = tensors["model.layers.0.mlp.up_proj.weight"]
    np.testing.assert_array_equal(up(tree, 0).get(), want)
    evil, _ = model(scale=-5.0)
    other = hub.commit("org/model", evil, branch="x")
    hub.tag("org/model", first, "x")
    hub.fail_next(1, 403, retry_after=None, path_prefix="/cdn/")  # (a signed address expired)
    refused = _shadowed(first, other, SHARDS[1], first)
    with pytest.raises(lazyckpt.CheckpointChangedError, match=refused):
        up(tree, 1).get()


def test_a_file_the_hub_answers_with_another_blob_than_it_listed_is_refused(
    hub: HubServer,
) -> None:
    """The listing the open read gives each file's blob (`?blobs=true`: an LFS file's
    sha256); an answer naming another for the file at that commit (`X-Linked-Etag`:
    a store that swapped the object) was read, its values -5 times main's. Refused."""
    files, tensors = model()
    first = hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    evil, _ = model(scale=-5.0)
    hub.swap("org/model", first, SHARDS[1], evil[SHARDS[1]])
    hub.fail_next(1, 403, retry_after=None, path_prefix="/cdn/")  # (asked of the Hub again)
    listed, served = (hashlib.sha256(f[SHARDS[1]]).hexdigest() for f in (files, evil))
    with pytest.raises(
        lazyckpt.CheckpointChangedError,
        match=rf"^hf://org/model@{first[:7]}/{SHARDS[1]} \(org/model at main, commit "
        rf"{first[:12]}\): the Hub answered for the file with blob {served} \(X-Linked-Etag "
        rf"or ETag\), but the listing of commit {first[:12]} that the open read gives {listed}",
    ):
        up(tree, 1).get()
    np.testing.assert_array_equal(up(tree, 0).get(), tensors["model.layers.0.mlp.up_proj.weight"])


def test_an_answer_that_does_not_say_its_commit_is_refused(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror or proxy that drops the Hub's `X-Repo-Commit`: which commit its files
    are from cannot be told, so none is read (`huggingface_hub` refuses it too)."""
    files, _ = model()
    first = hub.commit("org/model", files)
    send = hub_server._Handler._send

    def dropping(handler: Any, status: int, headers: dict[str, str], *rest: Any) -> None:
        send(handler, status, {k: v for k, v in headers.items() if k != "X-Repo-Commit"}, *rest)

    monkeypatch.setattr(hub_server._Handler, "_send", dropping)
    with pytest.raises(
        lazyckpt.StorageAccessError,
        match=rf"^hf://org/model@{first[:7]}/model\.safetensors\.index\.json \(org/model at "
        rf"main, commit {first[:12]}\): the answer does not say which commit it is from \(no "
        r"X-Repo-Commit header, which the Hub sends with every file\)",
    ):
        lazyckpt.open("hf://org/model")


def test_an_orbax_file_first_read_after_a_branch_shadows_its_commit_is_refused(
    hub: HubServer, tmp_path: Path
) -> None:
    """An Orbax checkpoint read through the relay: its chunk, first asked for after a
    branch named as the commit was pushed, came from that branch (negated values).
    Refused by name, through tensorstore, as lazyckpt's own error."""
    from tests.helpers import orbax_save

    w = np.arange(1.0, 257.0, dtype=np.float32).reshape(16, 16)
    saved = orbax_save(tmp_path / "ckpt", {"w": w}, use_ocdbt=False)
    negated = orbax_save(tmp_path / "negated", {"w": -w}, use_ocdbt=False)
    first = hub.commit("org/jax", folder_files(saved, "ckpt"))
    tree = lazyckpt.open(f"hf://org/jax@{first}/ckpt")
    assert not [e for e in hub.log if "/w/0" in e.path]  # (its chunk not read yet)
    shadow = folder_files(negated, "ckpt")
    other = hub.commit("org/jax", shadow, branch=first)
    with pytest.raises(
        lazyckpt.CheckpointChangedError, match=_shadowed(first, other, "ckpt/w/0.0", first)
    ):
        tree["w"].get()
    del hub.repos["org/jax"].refs[first]
    np.testing.assert_array_equal(tree["w"].get(), w)


def test_neighbouring_small_tensors_are_one_request(hub: HubServer) -> None:
    files, tensors = model()
    hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    layer = tree["model"]["layers"]["1"]
    hub.clear_log()
    loaded = lazyckpt.load({"layer": layer, "again": up(tree, 1)})
    assert [e.server for e in hub.log] == ["cdn"]  # the shard's two tensors, one range
    want = tensors["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_array_equal(loaded["layer"]["mlp"]["up_proj"]["weight"], want)
    np.testing.assert_array_equal(loaded["again"], want)
    loaded["again"][0, 0] = 7.0  # tied weights loaded twice are two arrays
    assert loaded["layer"]["mlp"]["up_proj"]["weight"][0, 0] == want[0, 0]


def test_load_and_iter_blocks_take_a_path(hub: HubServer, tmp_path: Path) -> None:
    """`load("hf://...")` opens the model first (it returned the string, a leaf that is
    no LazyArray); so does `iter_blocks`, and both take local paths too."""
    files, tensors = model()
    hub.commit("org/model", files)
    loaded = lazyckpt.load("hf://org/model", "model/layers/2/**")
    np.testing.assert_array_equal(up(loaded, 2), tensors["model.layers.2.mlp.up_proj.weight"])
    folder = tmp_path / "local"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    for path in (folder, str(folder)):
        blocks = {key for key, _, _ in lazyckpt.iter_blocks(path, "model/layers/0/**")}
        assert blocks == {
            "model/layers/0/mlp/up_proj/weight",
            "model/layers/0/input_layernorm/weight",
        }


def test_shard_headers_are_read_while_the_index_is(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the Hub the file list names the shards, so their headers are asked for
    before the index is read, not a round trip after it: the index's read here waits
    until the server has answered every shard's header."""
    import time

    from lazyckpt._safetensors import read

    files, tensors = model()
    hub.commit("org/model", files)
    hub.clear_log()
    original = read._index
    seen: list[int] = []

    def index_later(folder: str) -> Any:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            headers = [e for e in hub.log if e.server == "cdn" and e.range == "bytes=0-65535"]
            if len(headers) == len(SHARDS):
                break
            time.sleep(0.01)
        seen.append(len(headers))
        return original(folder)

    monkeypatch.setattr(read, "_index", index_later)
    tree = lazyckpt.open("hf://org/model")
    assert seen == [len(SHARDS)]
    for shard in SHARDS:  # still one redirect and one ranged read a shard
        assert [e.status for e in hub.log if e.path.endswith(shard)] == [302, 206]
    np.testing.assert_array_equal(up(tree, 3).get(), tensors["model.layers.3.mlp.up_proj.weight"])


def test_an_orbax_checkpoint_on_the_hub_opens_from_the_cache(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Orbax checkpoint (written by Orbax) in a repository, and a CheckpointManager
    root of two steps: read over HTTP, and from the Hugging Face cache once
    `hf download` put it there, with no request but the revision's
    (tests/test_hub_orbax.py reads them over HTTP in every layout)."""
    from tests.helpers import orbax_manager_save, orbax_save

    params = {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.int32)}
    saved = orbax_save(tmp_path / "ckpt", params)
    root = orbax_manager_save(
        tmp_path / "run",
        {step: {"state": ocp.args.StandardSave({"w": params["w"] * step})} for step in (1, 2)},
    )
    hub.commit("org/jax-model", {**folder_files(saved), "README.md": b"# a JAX model"})
    hub.commit("org/run", {f"train/{k}": v for k, v in folder_files(root).items()})
    hub.clear_log()
    np.testing.assert_array_equal(lazyckpt.open("hf://org/jax-model")["w"].get(), params["w"])
    assert any("/resolve/" in e.path for e in hub.log)
    hh.snapshot_download("org/jax-model")
    hh.snapshot_download("org/run")
    hub.clear_log()
    tree = lazyckpt.open("hf://org/jax-model")
    restored = ocp.PyTreeCheckpointer().restore(saved)
    for name in params:
        np.testing.assert_array_equal(tree[name].get(), restored[name])
    assert lazyckpt.steps("hf://org/run/train") == [1, 2]
    state = lazyckpt.open("hf://org/run/train", step=2, item="state")
    np.testing.assert_array_equal(state["w"].get(), params["w"] * 2)
    assert all("/api/" in e.path for e in hub.log)  # the revisions, nothing else
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.clear_log()
    np.testing.assert_array_equal(lazyckpt.open("hf://org/jax-model")["b"].get(), params["b"])
    assert hub.log == []
    # The cache's links into its blobs are its own; a link elsewhere is still refused.
    snapshot = Path(hh.snapshot_download("org/jax-model"))
    (tmp_path / "elsewhere").write_bytes(b"{}")
    (snapshot / "extra.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(lazyckpt.NotACheckpointError, match=r"extra\.json is a symlink"):
        lazyckpt.open("hf://org/jax-model")
