"""`storage_options` of plain http(s):// URLs (tests/hostile_server.py on loopback):
`headers` and a `token` go to the URL's own origin only, are checked before any
request, and each open sends its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

import lazyckpt
from tests.hostile_server import File, HostileServer, _Handler

KEY = {"X-Api-Key": "k-123"}
TOKEN = "abc"


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer.{i}.w": rng.standard_normal((8, 4)).astype(np.float32) for i in range(4)}


@pytest.fixture
def server() -> Iterator[HostileServer]:
    with HostileServer() as running:
        yield running


def _guarded(handler: _Handler, file: File) -> bool:
    """A 401 unless the request carries the key and the token."""
    if (
        handler.headers.get("X-Api-Key") != KEY["X-Api-Key"]
        or handler.headers.get("Authorization") != f"Bearer {TOKEN}"
    ):
        handler.answer(401, {}, b"unauthorized")
        return True
    return False


def _sharded(server: HostileServer) -> dict[str, np.ndarray]:
    """A model of two shards and an index under `/m`, served to the key and token only."""
    values = tensors()
    names = sorted(values)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {name: shard for shard, held in shards.items() for name in held}
    index = {"metadata": {"total_size": "0"}, "weight_map": weight_map}
    server.put("m/model.safetensors.index.json", json.dumps(index).encode(), trick=_guarded)
    for shard, held in shards.items():
        server.put(
            f"m/{shard}", save({n: values[n] for n in held}, {"made": "here"}), trick=_guarded
        )
    return values


def test_headers_and_token_go_with_every_request_of_every_verb(
    server: HostileServer, tmp_path: Path
) -> None:
    values = _sharded(server)
    options: dict[str, Any] = {"headers": KEY, "token": TOKEN}
    folder = f"{server.url}/m"
    tree = lazyckpt.open(folder, storage_options=options, flat=True)
    loaded = lazyckpt.load(tree)  # read after open returned, outside its call
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[name], value)
    assert lazyckpt.safetensors_metadata(folder, storage_options=options) == {
        "total_size": "0",
        "made": "here",
    }
    assert lazyckpt.verify(folder, storage_options=options).ok
    copy = lazyckpt.convert(folder, tmp_path / "copy", storage_options=options)
    np.testing.assert_array_equal(lazyckpt.open(copy)["layer"]["0"]["w"].get(), values["layer.0.w"])
    assert server.log
    for request in server.log:
        assert request.headers.get("X-Api-Key") == KEY["X-Api-Key"], request.path
        assert request.headers.get("Authorization") == f"Bearer {TOKEN}", request.path
    with pytest.raises(
        lazyckpt.StorageAccessError, match=r"access denied .*storage_options=\{'token'"
    ):
        lazyckpt.open(folder)


def test_headers_never_follow_a_redirect_to_another_origin(server: HostileServer) -> None:
    with HostileServer() as cdn:  # another port: another origin
        values = tensors()
        cdn.put("signed/model.safetensors", save(values))

        def to_cdn(handler: _Handler, file: File) -> bool:
            handler.answer(302, {"Location": f"{cdn.url}/signed/model.safetensors"}, b"")
            return True

        url = server.put("m/model.safetensors", b"", trick=to_cdn)
        tree = lazyckpt.open(url, storage_options={"headers": KEY, "token": TOKEN}, flat=True)
        np.testing.assert_array_equal(tree["layer.3.w"].get(), values["layer.3.w"])
        assert server.log and cdn.log
        for request in server.log:
            assert request.headers.get("X-Api-Key") == KEY["X-Api-Key"]
            assert request.headers.get("Authorization") == f"Bearer {TOKEN}"
        for request in cdn.log:
            assert {name.lower() for name in request.headers} & {
                "x-api-key",
                "authorization",
            } == set()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"headers": {"X-Key": "s3cret\r\nInjected: 1"}}, r"\['headers'\]\['X-Key'\] takes text"),
        ({"headers": {"X-Key": "s3cret\n"}}, r"CR, LF or other control"),
        ({"headers": {"X-Key": 5}}, r"\['X-Key'\] takes text .*not a int"),
        ({"headers": {"Bad Name": "s3cret"}}, r"a key 'Bad Name' that is no header name"),
        ({"headers": {"X\r\nY": "s3cret"}}, r"a key 'X\\\\r\\\\nY' that is no header name"),
        ({"headers": {"range": "bytes=0-"}}, r"sets 'range', which lazyckpt sets itself"),
        ({"headers": {"If-Match": "*"}}, r"sets 'If-Match', which lazyckpt sets itself"),
        ({"headers": {"Host": "elsewhere"}}, r"sets 'Host'"),
        ({"headers": ["X-Key"]}, r"\['headers'\] takes a dict .*not a list"),
        ({"token": 3}, r"\['token'\] takes a bearer token.*not a int"),
        ({"token": ""}, r"not empty text"),
        ({"token": "s3cret\r\nX: 1"}, r"not text with a space, control"),
        (
            {"token": "s3cret", "headers": {"authorization": "Basic x"}},
            r"both a 'token' and an Authorization header",
        ),
        (
            {"endpoint": "http://x", "token": "s3cret"},
            r"take \['headers', 'token'\], not \['endpoint'\]",
        ),
        ({"retries": 3}, r"not \['retries'\].*network_options"),
    ],
)
def test_bad_options_are_refused_by_name_before_any_request(
    server: HostileServer, options: dict[str, Any], match: str
) -> None:
    url = server.put("m/model.safetensors", save(tensors()))
    for call in (
        lambda: lazyckpt.open(url, storage_options=options),
        lambda: lazyckpt.open(f"{server.url}/m", storage_options=options),
        lambda: lazyckpt.safetensors_metadata(url, storage_options=options),
    ):
        with pytest.raises(lazyckpt.LazyTypeError, match=match) as caught:
            call()
        assert isinstance(caught.value, TypeError)
        assert url.rsplit("/", 1)[0] in str(caught.value)
        assert "s3cret" not in str(caught.value)  # a value may be a secret
    assert server.log == []


def test_each_open_sends_its_own_headers_whenever_it_reads(server: HostileServer) -> None:
    values = tensors()
    url = server.put("m/model.safetensors", save(values))
    first = lazyckpt.open(url, storage_options={"token": "one"}, flat=True)
    second = lazyckpt.open(url, storage_options={"token": "two", "headers": KEY}, flat=True)
    plain = lazyckpt.open(url, flat=True)
    for tree, sent in [
        (first, {"Authorization": "Bearer one"}),
        (second, {"Authorization": "Bearer two", **KEY}),
        (plain, {}),
        (first, {"Authorization": "Bearer one"}),
    ]:
        server.log.clear()
        np.testing.assert_array_equal(tree["layer.1.w"].get(), values["layer.1.w"])
        assert server.log
        for request in server.log:
            found = {
                name: value
                for name, value in request.headers.items()
                if name.lower() in ("authorization", "x-api-key")
            }
            assert found == sent


def test_an_hf_path_takes_the_hub_token_not_storage_options() -> None:
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=r"hf://org/m: storage_options \['token'\] are for https:// URLs.*HF_TOKEN",
    ):
        lazyckpt.open("hf://org/m", storage_options={"token": "s3cret"})


def test_a_bucket_refuses_the_options_of_an_https_url() -> None:
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=r"s3://b/m: storage_options \['token'\] are for https:// URLs; a bucket's",
    ):
        lazyckpt.open("s3://b/m", storage_options={"token": "s3cret"})
