"""Answers that real servers, CDNs and proxies give and lazyckpt must read right: a
206 whose complete length is `*`, a CDN that refuses the Hub's address at the first
read, a 429 with Retry-After, a 304 from a caching proxy, a range compressed on its
way. Each is read as what it is, or refused by a message that names the file, what
was expected, what came, and what to do; never read as the file's bytes."""

from __future__ import annotations

import gzip
from collections.abc import Iterator

import numpy as np
import pytest
from safetensors.numpy import save

import lazyckpt
from tests.hostile_server import File, HostileServer, _Handler
from tests.hub_server import HubServer
from tests.test_hub import SHARDS, model, up
from tests.test_network import QUICK, outcome, raised, tensors


@pytest.fixture
def server() -> Iterator[HostileServer]:
    with HostileServer() as running:
        yield running


def _after_the_header(handler: _Handler) -> tuple[int, int] | None:
    """The range asked for, unless it is the header's read at open (answered as usual)."""
    wanted = handler.headers.get("Range", "")
    if wanted.startswith("bytes=0-"):
        return None
    start, stop = (int(n) for n in wanted[6:].split("-"))
    return start, stop


def test_a_range_of_unknown_complete_length_is_read(server: HostileServer) -> None:
    """RFC 9110 lets a 206 say `bytes a-b/*`: the bytes asked for, the file's size
    unsaid. Its size is known from the header's read; the values are read, not taken
    for a change (they were: "its size was N, the answer gave none"). A real change is
    still caught, by the ETag."""
    values = tensors(count=2, rows=1024)

    def unsized(handler: _Handler, file: File) -> bool:
        if (wanted := _after_the_header(handler)) is None:
            return False
        start, stop = wanted
        body = file.data[start : stop + 1]
        headers = {**handler.validators(file), "Content-Range": f"bytes {start}-{stop}/*"}
        handler.answer(206, headers, body)
        return True

    url = server.put("model.safetensors", save(values), trick=unsized)
    tree = lazyckpt.open(url)
    found = outcome(lambda: lazyckpt.load(tree))
    assert isinstance(found, dict), repr(found)
    np.testing.assert_array_equal(found["layer"]["1"]["w"], values["layer.1.w"])
    assert any(r.headers.get("Range", "").startswith("bytes=") for r in server.log[1:])
    changed = {k: v + 1 for k, v in values.items()}
    server.put("model.safetensors", save(changed), trick=unsized)  # (a new ETag)
    raised(
        outcome(lambda: tree["layer"]["0"]["w"].get()),
        lazyckpt.CheckpointChangedError,
        r"model.safetensors changed since it was opened",
    )


def test_a_compressed_range_is_refused_never_read(server: HostileServer) -> None:
    """A proxy that gzips a range (lazyckpt asked for identity): its bytes are not the
    file's. Padded to the length asked for, they were read as values; cut short, they
    were taken for a server that stops early."""

    def gzipped(pad: bool) -> object:
        def trick(handler: _Handler, file: File) -> bool:
            if (wanted := _after_the_header(handler)) is None:
                return False
            start, stop = wanted
            body = gzip.compress(file.data[start : stop + 1])
            if pad:
                body = (body + bytes(stop + 1 - start))[: stop + 1 - start]
            last = start + len(body) - 1
            headers = {
                **handler.validators(file),
                "Content-Encoding": "gzip",
                "Content-Range": f"bytes {start}-{last}/{len(file.data)}",
            }
            handler.answer(206, headers, body)
            return True

        return trick

    values = tensors(count=1, rows=1024)
    for pad in (True, False):
        url = server.put(f"p{pad}.safetensors", save(values), trick=gzipped(pad))  # type: ignore[arg-type]
        tree = lazyckpt.open(url)
        raised(
            outcome(lambda tree=tree: tree["layer"]["0"]["w"].get()),  # type: ignore[misc]
            lazyckpt.StorageAccessError,
            rf"p{pad}.safetensors: the server answered a Range request for the file's bytes "
            r"as stored \(Accept-Encoding: identity\) with Content-Encoding 'gzip': the bytes "
            r"sent are compressed, not the file's.*A proxy or the server compressed them",
        )


def test_encodings_that_name_no_compression_are_read(server: HostileServer) -> None:
    """`identity`, and the `none` or `UTF-8` that some stores set by mistake, leave the
    bytes as stored: read, as before compressed answers were refused."""

    def encoded(encoding: str) -> object:
        def trick(handler: _Handler, file: File) -> bool:
            if (wanted := _after_the_header(handler)) is None:
                return False
            start, stop = wanted
            headers = {
                **handler.validators(file),
                "Content-Encoding": encoding,
                "Content-Range": f"bytes {start}-{stop}/{len(file.data)}",
            }
            handler.answer(206, headers, file.data[start : stop + 1])
            return True

        return trick

    values = tensors(count=1, rows=64)
    for k, encoding in enumerate(("identity", "none", "UTF-8", "identity, identity")):
        url = server.put(f"e{k}.safetensors", save(values), trick=encoded(encoding))  # type: ignore[arg-type]
        got = lazyckpt.open(url)["layer"]["0"]["w"].get()
        np.testing.assert_array_equal(got, values["layer.0.w"])


def test_a_304_is_named_as_a_caching_proxy_s(server: HostileServer) -> None:
    def stale(handler: _Handler, file: File) -> bool:
        if _after_the_header(handler) is None:
            return False
        handler.answer(304, handler.validators(file), b"")
        return True

    tree = lazyckpt.open(server.put("model.safetensors", save(tensors(count=1)), trick=stale))
    raised(
        outcome(lambda: tree["layer"]["0"]["w"].get()),
        lazyckpt.StorageAccessError,
        r"model.safetensors: the server answered HTTP 304 Not Modified, which answers only a "
        r"request that asks whether a copy is still current.*A caching proxy between here "
        r"and the server answered for it",
    )


@pytest.mark.parametrize(
    ("after", "said"), [("3", "'3'"), ("3600", "'3600'.*8 s at most"), ("", "")]
)
def test_a_429_says_rate_limited_and_what_the_server_asked(
    server: HostileServer, after: str, said: str
) -> None:
    """Past its attempts, a read that kept getting 429 says so (it said "could not be
    reached or kept failing"), with the server's Retry-After and HF_TOKEN's limits."""

    def limited(handler: _Handler, file: File) -> bool:
        if _after_the_header(handler) is None:
            return False
        handler.answer(429, {"Retry-After": after} if after else {}, b"slow down")
        return True

    tree = lazyckpt.open(server.put("model.safetensors", save(tensors(count=1)), trick=limited))
    with lazyckpt.network_options(**{**QUICK, "retries": 1}):  # type: ignore[arg-type]
        found = raised(
            outcome(lambda: tree["layer"]["0"]["w"].get()),
            lazyckpt.StorageAccessError,
            r"model.safetensors: http://127.0.0.1:\d+ rate-limited the requests \(HTTP 429 "
            rf"Too Many Requests\).*{said}.*set HF_TOKEN",
        )
    assert ("Retry-After" in str(found)) == bool(after)


def test_a_rate_limited_hub_names_the_file_and_hf_token(hub: HubServer) -> None:
    files, _ = model()
    hub.commit("org/model", files)
    tree = lazyckpt.open("hf://org/model")
    hub.fail_next(2, 429, retry_after=1, path_prefix="/cdn/")
    with lazyckpt.network_options(**QUICK):  # type: ignore[arg-type]
        raised(
            outcome(lambda: up(tree, 0).get()),
            lazyckpt.StorageAccessError,
            rf"^hf://org/model@[0-9a-f]{{7}}/{SHARDS[0]} \(org/model at main, commit "
            r"[0-9a-f]{12}\): http://127.0.0.1:\d+ rate-limited the requests \(HTTP 429.*"
            r"asking to wait '1' \(Retry-After\).*set HF_TOKEN",
        )


def _one_file(hub: HubServer) -> np.ndarray:
    values = tensors(count=1)
    hub.commit("org/one", {"model.safetensors": save(values)})
    return values["layer.0.w"]


@pytest.mark.parametrize("status", [403, 404])
def test_the_first_refusal_at_the_cdn_is_asked_of_the_hub_again(
    hub: HubServer, status: int
) -> None:
    """The first read of a file in the process (its CDN address not yet known) that
    the CDN refuses (a signed address that expired on its way, or a stale one) is asked
    of the Hub again, once, as a remembered address is; it failed at once before."""
    want = _one_file(hub)
    hub.clear_log()
    hub.fail_next(1, status, retry_after=None, path_prefix="/cdn/")
    tree = outcome(lambda: lazyckpt.open("hf://org/one"))
    assert not isinstance(tree, BaseException), repr(tree)
    np.testing.assert_array_equal(tree["layer"]["0"]["w"].get(), want)  # type: ignore[index]
    reads = [(e.server, e.status) for e in hub.log if "/api/" not in e.path]
    assert reads[:4] == [("hub", 302), ("cdn", status), ("hub", 302), ("cdn", 206)]


@pytest.mark.parametrize("status", [401, 403])
def test_a_refusal_at_the_hub_s_own_origin_is_about_credentials(
    hub: HubServer, status: int
) -> None:
    """A Hub whose files are served from its own origin (a mirror, an Enterprise
    endpoint), which is sent the token: a refusal there is about access, said as the
    Hub's, and not asked again; it had been blamed on a firewall blocking another
    host."""
    hub.same_origin_cdn = True
    _one_file(hub)
    hub.clear_log()
    hub.fail_next(2, status, retry_after=None, path_prefix="/cdn/")
    found = raised(
        outcome(lambda: lazyckpt.open("hf://org/one")),
        lazyckpt.StorageAccessError,
        r"access denied; for a gated or private Hugging Face repository, log in",
    )
    assert "firewall" not in str(found)
    assert [e.status for e in hub.log if "/cdn/" in e.path] == [status]


@pytest.mark.parametrize(
    ("status", "error", "match"),
    [
        (
            403,
            lazyckpt.StorageAccessError,
            r"the Hub redirected to the file's address at http://127.0.0.1:\d+, which refused "
            r"it \(HTTP 403\), again at the address the Hub then gave afresh; a firewall or "
            r"proxy that lets the Hub through may block that host",
        ),
        (
            404,
            lazyckpt.CheckpointNotFoundError,
            r"the Hub lists this file at the commit, but its server answered HTTP 404 \(again "
            r"at the address the Hub then gave afresh\)",
        ),
    ],
)
def test_a_cdn_that_refuses_the_hub_s_address_twice_is_named(
    hub: HubServer, status: int, error: type[BaseException], match: str
) -> None:
    """Refused again after asking the Hub afresh: the file, the CDN's host and the
    status (a 403 was "log in or set HF_TOKEN", which the Hub, redirecting, had
    granted)."""
    _one_file(hub)
    hub.fail_next(2, status, retry_after=None, path_prefix="/cdn/")
    found = raised(
        outcome(lambda: lazyckpt.open("hf://org/one")),
        error,
        rf"^hf://org/one@[0-9a-f]{{7}}/model.safetensors \(org/one at main, commit "
        rf"[0-9a-f]{{12}}\): {match}",
    )
    assert "HF_TOKEN" not in str(found)
