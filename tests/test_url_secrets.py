"""URLs that carry a secret, against loopback servers (tests/hostile_server.py) that
refuse a request without it: a user name and password (a raw '@' in the password
too), sent as HTTP Basic auth as requests sends it, and a pre-signed file's query
string (`?X-Amz-Signature=...`), sent with every request for the file. Neither is
ever shown: not in errors, reprs, summaries, notebook HTML or the command line."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import numpy as np
import pytest
import requests
from safetensors.numpy import save

import lazyckpt
from lazyckpt._cli.main import main
from lazyckpt._storage import paths
from tests.helpers import ROOT, orbax_save
from tests.hostile_server import File, HostileServer, _Handler
from tests.test_torch_files import FIXTURES, _expected

PASSWORD = "p@ss"
SIGNATURE = "X-Amz-Signature=5ec2e7&X-Amz-Expires=3600&X-Amz-Credential=AKIA%2F20260101"
SECRETS = ("p@ss", "ss@", "user:", "5ec2e7", "AKIA", "Expires")
"""What no output may hold: the password, a part of it, and the signed query's values."""


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(49)
    return {f"layer.{i}.w": rng.standard_normal((8, 4)).astype(np.float32) for i in range(3)}


@pytest.fixture
def server() -> Iterator[HostileServer]:
    with HostileServer() as running:
        yield running


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _with_password(handler: _Handler, file: File) -> bool:
    """A 401 unless the request carries `user` and `PASSWORD` as Basic auth."""
    if handler.headers.get("Authorization") != basic("user", PASSWORD):
        handler.answer(401, {"WWW-Authenticate": 'Basic realm="m"'}, b"unauthorized")
        return True
    return False


def _signed(handler: _Handler, file: File) -> bool:
    """A 403, as S3 answers, unless the request carries the signed query string."""
    if urlsplit(handler.path).query != SIGNATURE:
        handler.answer(403, {}, b"<Error><Code>SignatureDoesNotMatch</Code></Error>")
        return True
    return False


def with_password(url: str, password: str = PASSWORD) -> str:
    return url.replace("http://", f"http://user:{password}@")


def shown(tree: Any, path: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Everything lazyckpt shows of an open tree and its path: the tree's repr and its
    arrays' stored files, its summary as text and as notebook HTML, and what
    `lazyckpt inspect` and `show` print."""
    leaves = lazyckpt.open(path, flat=True)
    summary = lazyckpt.summary(tree, title=path)
    texts = [repr(tree), summary.text(), summary._repr_html_()]
    texts += [repr(leaf.stored) + leaf._repr_html_() for leaf in leaves.values()]
    for args in (["inspect", path], ["inspect", "--json", path], ["show", path, "layer/0/w"]):
        assert main(args) == 0
        out, err = capsys.readouterr()
        texts.append(out + err)
    return "\n".join(texts)


def never_shown(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, (secret, text)


def test_a_password_with_a_raw_at_sign_is_sent_as_basic_auth_and_never_shown(
    server: HostileServer, capsys: pytest.CaptureFixture[str]
) -> None:
    values = tensors()
    server.put("m/model.safetensors", save(values), trick=_with_password)
    folder = with_password(f"{server.url}/m")  # http://user:p@ss@127.0.0.1:PORT/m
    host = server.url.removeprefix("http://")
    assert paths.normalize(folder) == f"{server.url}/m"  # the host after the last '@'
    tree = lazyckpt.open(folder)
    loaded = lazyckpt.load(tree)
    for name, value in values.items():
        np.testing.assert_array_equal(loaded["layer"][name.split(".")[1]]["w"], value)
    assert lazyckpt.verify(folder).ok
    # As requests sends the URL's user name and password (curl refuses a raw '@').
    sent = requests.Request("GET", folder).prepare().headers["Authorization"]
    assert sent == basic("user", PASSWORD)
    assert server.log
    assert {request.headers.get("Authorization") for request in server.log} == {sent}
    text = shown(tree, folder, capsys)
    assert f"http://...@{host}/m: 3 arrays" in text  # the summary's title, and inspect's
    never_shown(text)
    with pytest.raises(lazyckpt.StorageAccessError, match=r"access denied") as denied:
        lazyckpt.open(with_password(f"{server.url}/m", "wr0ng@ss"))
    assert str(denied.value).startswith(f"http://...@{host}/m/model.safetensors: ")
    assert "wr0ng" not in str(denied.value)


def test_an_orbax_checkpoint_behind_a_password_reads_through_the_relay(
    server: HostileServer, tmp_path: Path
) -> None:
    """tensorstore's drivers read it through lazyckpt's client (`relay`), which sends
    the URL's credentials with every request too."""
    values: dict[str, Any] = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    values["b"] = np.ones(3)
    local = orbax_save(tmp_path / "ckpt", values)
    for file in sorted(local.rglob("*")):
        if file.is_file():
            name = file.relative_to(local).as_posix()
            server.put(f"ckpt/{name}", file.read_bytes(), trick=_with_password)
    url = with_password(f"{server.url}/ckpt")
    tree = lazyckpt.open(url)
    np.testing.assert_array_equal(tree["w"][8:16].get(), values["w"][8:16])
    np.testing.assert_array_equal(lazyckpt.load(tree)["b"], values["b"])
    assert any("/d/" in request.path for request in server.log)  # the OCDBT data files
    assert {r.headers.get("Authorization") for r in server.log} == {basic("user", PASSWORD)}
    never_shown(repr(tree) + lazyckpt.summary(tree, title=url).text())


def test_credentials_are_decoded_and_sent_to_their_origin_only(server: HostileServer) -> None:
    with HostileServer() as cdn:  # another port: another origin
        values = tensors()
        cdn.put("signed/model.safetensors", save(values))

        def to_cdn(handler: _Handler, file: File) -> bool:
            if not _with_password(handler, file):
                handler.answer(302, {"Location": f"{cdn.url}/signed/model.safetensors"}, b"")
            return True

        server.put("m/model.safetensors", b"", trick=to_cdn)
        # Percent-encoded ':' and '@' are the password's own, decoded before sending.
        url = with_password(f"{server.url}/m/model.safetensors", "p%40ss")
        tree = lazyckpt.open(url, flat=True)
        np.testing.assert_array_equal(tree["layer.2.w"].get(), values["layer.2.w"])
        assert requests.Request("GET", url).prepare().headers["Authorization"] == basic(
            "user", PASSWORD
        )
        assert server.log and cdn.log
        assert all(r.headers.get("Authorization") == basic("user", PASSWORD) for r in server.log)
        assert all("Authorization" not in r.headers for r in cdn.log)


def test_failures_to_connect_never_show_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "http://user:p@ss@127.0.0.1:1/m/model.safetensors"  # nothing listens on port 1
    with lazyckpt.network_options(retries=1), pytest.raises(lazyckpt.StorageAccessError) as failed:
        lazyckpt.open(url)
    message = str(failed.value)
    assert message.startswith("http://...@127.0.0.1:1/m/model.safetensors: http://127.0.0.1:1 ")
    assert "ConnectionRefusedError" in message  # the host after the last '@', not 'ss@...'
    never_shown(message)
    with lazyckpt.network_options(retries=1):
        assert main(["inspect", url]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("lazyckpt: error: http://...@127.0.0.1:1/m/model.safetensors: ")
    never_shown(out + err)


def test_a_password_and_a_token_together_are_refused_before_any_request(
    server: HostileServer,
) -> None:
    url = with_password(server.put("m/model.safetensors", save(tensors())))
    for options in ({"token": "t0ken"}, {"headers": {"authorization": "Bearer t0ken"}}):
        with pytest.raises(lazyckpt.LazyTypeError, match=r"user name and password .*give one"):
            lazyckpt.open(url, storage_options=options)
    assert server.log == []


def test_a_presigned_safetensors_file_opens_as_one_file_with_its_query(
    server: HostileServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    values = tensors()
    file = server.put("m/x.safetensors", save(values, {"made": "here"}), trick=_signed)
    with pytest.raises(urllib.error.HTTPError, match="403"):  # the server wants the signature
        urllib.request.urlopen(file)
    server.log.clear()
    url = f"{file}?{SIGNATURE}"
    assert paths.normalize(url) == file  # its format read from the path, not the query
    tree = lazyckpt.open(url)
    loaded = lazyckpt.load(tree)
    for name, value in values.items():
        np.testing.assert_array_equal(loaded["layer"][name.split(".")[1]]["w"], value)
    assert lazyckpt.verify(url).ok
    assert lazyckpt.safetensors_metadata(url) == {"made": "here"}
    copy = lazyckpt.open(lazyckpt.convert(url, tmp_path / "copy"))
    np.testing.assert_array_equal(copy["layer"]["1"]["w"].get(), values["layer.1.w"])
    assert len(server.log) > 2
    assert all(urlsplit(r.path).query == SIGNATURE for r in server.log)
    text = shown(tree, url, capsys)
    assert f"file='{file}?...'" in text
    assert f"{file}?...: 3 arrays" in text
    never_shown(text)


@pytest.mark.parametrize("name", ["state.pt", "weights.npz"])
def test_presigned_torch_and_numpy_files_read_as_their_writers_wrote_them(
    server: HostileServer, tmp_path: Path, name: str
) -> None:
    if name == "state.pt":  # written by torch: tests/fixtures/torch
        data, expected = (FIXTURES / name).read_bytes(), _expected(FIXTURES)
    else:
        written: dict[str, Any] = {"params/w": np.arange(12, dtype=np.float32).reshape(3, 4)}
        written["step"] = np.array(3)
        np.savez(tmp_path / name, **written)
        data = (tmp_path / name).read_bytes()
        with np.load(tmp_path / name) as reread:
            expected = {key: reread[key] for key in reread.files}
    url = f"{server.put(f'w/{name}', data, trick=_signed)}?{SIGNATURE}"
    tree = lazyckpt.open(url, flat=True)
    assert sorted(tree) == sorted(expected)
    for key, want in expected.items():
        got = (
            np.asarray(tree[key].get()) if isinstance(tree[key], lazyckpt.LazyArray) else tree[key]
        )
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())
    assert server.log and all(urlsplit(r.path).query == SIGNATURE for r in server.log)


def test_presigned_failures_name_the_file_without_its_signature(
    server: HostileServer, capsys: pytest.CaptureFixture[str]
) -> None:
    def expired(handler: _Handler, file: File) -> bool:
        handler.answer(403, {}, b"<Error><Code>AccessDenied</Code>Request has expired</Error>")
        return True

    damaged = server.put("m/damaged.safetensors", b"\x05\0\0\0\0\0\0\0{}xxx", trick=_signed)
    gone = server.put("m/expired.safetensors", save(tensors()), trick=expired)
    folder = f"{server.url}/m"
    for url, kind, match in [
        (damaged, lazyckpt.CorruptCheckpointError, "the header is not valid JSON"),
        (gone, lazyckpt.StorageAccessError, "signature may have expired: sign"),
        (f"{server.url}/m/absent.safetensors", lazyckpt.CheckpointNotFoundError, "not exist"),
        (folder, lazyckpt.CheckpointNotFoundError, "names no weight file .*give a file's URL"),
    ]:
        server.log.clear()
        with pytest.raises(kind, match=match) as failed:
            lazyckpt.open(f"{url}?{SIGNATURE}")
        assert str(failed.value).startswith(f"{url}?...")
        never_shown(str(failed.value))
        assert main(["inspect", f"{url}?{SIGNATURE}"]) == 1
        out, err = capsys.readouterr()
        assert err.startswith(f"lazyckpt: error: {url}?...")
        never_shown(out + err)
    # A folder's URL with a query: nothing inside it asked for without the query.
    assert not [r for r in server.log if r.path.startswith("/m/")]


SIGNED = (
    "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20260101%2F"
    "us-east-1%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&"
    f"X-Amz-SignedHeaders=host&X-Amz-Signature={'5ec2e7' * 10}abcd"
)
"""A pre-signed URL's query as S3 signs one: its signature, 64 hex digits."""


def _s3_error(path: str) -> str:
    """S3's SignatureDoesNotMatch, which quotes the signature and the canonical request:
    the query's parameters sorted, less the signature, each value as it was sent."""
    query = urlsplit(path).query.split("&")
    canonical = "&".join(sorted(p for p in query if not p.startswith("X-Amz-Signature=")))
    signature = next(p for p in query if p.startswith("X-Amz-Signature=")).partition("=")[2]
    return (
        "<Error><Code>SignatureDoesNotMatch</Code><SignatureProvided>"
        f"{signature}</SignatureProvided><CanonicalRequest>GET\n{urlsplit(path).path}\n"
        f"{canonical}\nhost:127.0.0.1\n\nhost\nUNSIGNED-PAYLOAD</CanonicalRequest></Error>"
    )


QUOTINGS: list[tuple[str, Callable[[str], str]]] = [
    ("the request line", lambda path: f"<h1>Bad Request</h1><p>GET {path} HTTP/1.1</p>"),
    ("it percent-encoded", lambda path: f"invalid path {quote(path, safe='')}"),
    ("it decoded", lambda path: f"invalid path {unquote(path)}"),
    ("lower-case escapes", lambda path: f"invalid path {quote(path, safe='').lower()}"),
]
"""How a server's error page quotes the request it refuses (its path and query)."""


def _quoting(status: int, body: Callable[[str], str]) -> Any:
    """A trick: `status`, its reason and body quoting the request (`body`)."""

    def answer(handler: _Handler, file: File) -> bool:
        handler.send_response(status, f"refused {handler.path}")
        handler.send_header("Content-Length", str(len(body(handler.path).encode())))
        handler.end_headers()
        handler.wfile.write(body(handler.path).encode())
        return True

    return answer


@pytest.mark.parametrize("query", [SIGNATURE, SIGNED])
def test_an_error_page_quoting_the_signed_request_never_shows_its_query(
    server: HostileServer, capsys: pytest.CaptureFixture[str], query: str
) -> None:
    """A 400 quotes the server's error page, which quotes the request line: its query
    (the signature) was shown with it. Now hidden in every form a server quotes it
    (encoded, decoded, its values one by one), in the error, its repr, any warning and
    the command line; a 403 and a 500 quote no page, and still say what happened."""
    said = {
        400: r"the server answered HTTP 400 \('",
        403: r"access denied .* a pre-signed URL's signature may have expired",
        500: r"kept failing \(HTTP 500\) after 1 attempts",
    }
    # S3's error quotes the signature alone: hidden where it is one (8 characters
    # or more, as any is: 64 hex digits), and the other values quoted one by one.
    quotings = [*QUOTINGS, ("an S3 error", _s3_error)] if query == SIGNED else QUOTINGS
    secrets = ("5ec2e7", "AKIA") if query == SIGNED else SECRETS
    for (how, body), status in [(q, s) for q in quotings for s in (400, 403, 500)]:
        name = f"{status}/{how.replace(' ', '-')}/x.safetensors"
        file = server.put(name, save(tensors()), trick=_quoting(status, body))
        url = f"{file}?{query}"
        with warnings.catch_warnings(record=True) as warned, lazyckpt.network_options(retries=1):
            warnings.simplefilter("always")
            with pytest.raises(lazyckpt.StorageAccessError, match=said[status]) as failed:
                lazyckpt.open(url)
            assert main(["inspect", url]) == 1
        out, err = capsys.readouterr()
        assert str(failed.value).startswith(f"{file}?...: ")
        assert err.startswith(f"lazyckpt: error: {file}?...: ")
        text = "\n".join([str(failed.value), repr(failed.value), out, err, *map(str, warned)])
        for secret in secrets:
            assert secret not in text, (how, status, secret, text)
    assert {urlsplit(r.path).query for r in server.log if "?" in r.path} == {query}


def test_an_error_page_quoting_the_credentials_sent_never_shows_them(
    server: HostileServer,
) -> None:
    """A server whose error page echoes the request's headers: a URL's password, sent
    as Basic auth, and a token, as `Authorization: Bearer`, were shown with it."""

    def echo(handler: _Handler, file: File) -> bool:
        sent = handler.headers.get("Authorization", "")
        decoded = base64.b64decode(sent.partition(" ")[2]).decode() if "Basic" in sent else ""
        handler.answer(400, {}, f"bad request: Authorization: {sent} ({decoded})".encode())
        return True

    file = server.put("m/model.safetensors", save(tensors()), trick=echo)
    token = "hf_t0kenT0kenT0ken"
    for url, options in [(with_password(file), None), (file, {"token": token})]:
        with pytest.raises(lazyckpt.StorageAccessError, match=r"HTTP 400 \('bad request") as bad:
            lazyckpt.open(url, storage_options=options)
        text = str(bad.value) + repr(bad.value)
        for secret in (*SECRETS, basic("user", PASSWORD).split()[1], token, "t0ken"):
            assert secret not in text, (secret, text)


def _page(status: int, body: str) -> Any:
    """A trick: `status`, its body `body` (an error page of the server's own words)."""

    def answer(handler: _Handler, file: File) -> bool:
        handler.answer(status, {}, body.encode())
        return True

    return answer


def test_an_error_page_keeps_its_words_and_hides_only_credentials(server: HostileServer) -> None:
    """What an open sends besides credentials (a signed query's algorithm, a content
    type it asks for; an `Accept` header) was hidden from every later message of the
    process: a server's `AWS4-HMAC-SHA256` or `application/json` became `...`. Now only
    credentials are: the query's signature and credential, an API key's header."""
    signature = "5ec2e7a9" * 8
    query = (
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20260101%2F"
        "us-east-1%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&"
        "response-content-type=application%2Foctet-stream&X-Amz-SignedHeaders=host&"
        f"X-Amz-Signature={signature}"
    )
    key = "k3y-0f-th3-cl13nt"
    headers = {"Accept": "application/json", "Cache-Control": "no-cache", "X-Api-Key": key}
    lazyckpt.open(f"{server.put('m/a.safetensors', save(tensors()))}?{query}")
    lazyckpt.open(
        server.put("m/b.safetensors", save(tensors())), storage_options={"headers": headers}
    )
    pages = [
        "only AWS4-HMAC-SHA256 is accepted",
        "expected Content-Type application/octet-stream, got text/html",
        "this endpoint answers application/json only",
        "cache is no-cache for /models/x",
    ]
    for number, words in enumerate(pages):
        body = f"{words}; signature {signature.upper()}, key {key}, for AKIAIOSFODNN7EXAMPLE/20260101/us-east-1/s3/aws4_request"
        file = server.put(f"e/{number}.safetensors", b"", trick=_page(400, body))
        with pytest.raises(lazyckpt.StorageAccessError, match="HTTP 400") as failed:
            lazyckpt.open(f"{file}?{query}", storage_options={"headers": headers})
        assert f"HTTP 400 ('{words}; signature ..., key ..., for ...')" in str(failed.value)


SAS = "sv=2021-08-06&sp=r&se=2026-01-01T00%3A00%3A00Z&sr=b&sig=Zm9vYmFy%2FQUJD%2BZGVmZ2hpams%3D"
"""An Azure SAS token, its signature base64 (`Zm9vYmFy/QUJD+ZGVmZ2hpams=`)."""
SAS_SIGNATURE = "Zm9vYmFy/QUJD+ZGVmZ2hpams="
_JSON = SAS_SIGNATURE.replace("/", "\\u002f").replace("+", "\\u002b").replace("=", "\\u003d")
_HTML = SAS_SIGNATURE.replace("/", "&#x2F;").replace("+", "&#43;").replace("=", "&#61;")
ESCAPED: list[tuple[str, str]] = [
    ("JSON's \\/", '{"error":"bad sig ' + SAS_SIGNATURE.replace("/", "\\/") + '"}'),
    ("JSON's \\u", '{"error":"bad sig ' + _JSON + '"}'),
    ("HTML entities", f"<p>bad sig {_HTML}</p>"),
    ("two lines", f"bad sig {SAS_SIGNATURE[:10]}\r\n{SAS_SIGNATURE[10:]}"),
    ("its query in XML", f"<Query>{SAS.replace('&', '&amp;')}</Query>"),
    ("lower-case escapes", f"bad sig {quote(SAS_SIGNATURE, safe='').lower()}"),
]
"""How a server's error page may quote a signature: escaped as JSON or HTML escape it,
cut across two lines."""


@pytest.mark.parametrize(("how", "body"), ESCAPED, ids=[how for how, _ in ESCAPED])
def test_a_signature_the_error_page_escapes_is_never_shown(
    server: HostileServer, capsys: pytest.CaptureFixture[str], how: str, body: str
) -> None:
    """An error page that quotes a SAS signature escaped (`\\/`, `\\u002f`, `&#x2F;`) or
    cut across lines showed it: only the forms a URL writes were hidden."""
    file = server.put("m/x.safetensors", b"", trick=_page(400, body))
    url = f"{file}?{SAS}"
    with pytest.raises(lazyckpt.StorageAccessError, match=r"HTTP 400 \('") as failed:
        lazyckpt.open(url)
    assert main(["inspect", url]) == 1
    out, err = capsys.readouterr()
    text = "\n".join([str(failed.value), repr(failed.value), out, err]).lower()
    for piece in ("zm9vymfy", "qujd", "zgvmz2hpams"):
        assert piece not in text, (how, text)
    assert "..." in str(failed.value).partition("HTTP 400")[2]


_MANY = """
import json, secrets, sys, tracemalloc
import lazyckpt
from lazyckpt import _display

base, count = sys.argv[1], int(sys.argv[2])
tracemalloc.start()
for number in range(count):
    query = (
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600"
        f"&X-Amz-Security-Token={secrets.token_urlsafe(450)}"
        f"&X-Amz-Signature={secrets.token_hex(32)}"
    )
    lazyckpt.open(f"{base}/m/{number}.safetensors?{query}")
    try:
        lazyckpt.open(f"{base}/e/{number}.safetensors?{query}")
    except lazyckpt.StorageAccessError as error:
        assert query[-64:] not in str(error) and "HTTP 400" in str(error), str(error)
    if number % 100 == 99:
        held = tracemalloc.get_traced_memory()[0]
        first = held if number == 99 else first
        print(json.dumps({
            "opened": number + 1,
            "grown": held - first,
            "secrets": len(getattr(_display, "_SECRETS", ())),
            "places": len(_display._NAMES),
        }), flush=True)
        if held - first > 16 << 20:
            break
"""
"""A child process that opens `count` pre-signed URLs, each with a server error page
quoting its request (so that each error hides its signature), and says every hundred
how much more memory Python holds than after the first hundred (stopping past 16 MiB)
and what `lazyckpt._display` holds."""


def _no_delay(trick: Any = None) -> Any:
    """A trick: the answer sent at once (TCP_NODELAY), not 40 ms later, when the
    client's delayed ACK lets Nagle send the body after the head; then `trick`'s."""

    def answer(handler: _Handler, file: File) -> bool:
        handler.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return trick is not None and trick(handler, file)

    return answer


@pytest.mark.slow
def test_a_thousand_presigned_urls_keep_what_hides_them_small(server: HostileServer) -> None:
    """Each pre-signed URL opened registered its place and the forms of its query with
    `lazyckpt._display` for the rest of the process, and each registration rebuilt one
    regular expression of them all, which `re`'s cache kept: 100 URLs took 113 MiB and
    8 s, 1,000 took minutes. Now the registries keep the latest few hundred queries and
    thousands of places, searched by substring: after the first hundred of a thousand
    URLs, in a child process, Python holds less than 16 MiB more (the places of 2,000
    files and a few hundred queries), and each error still hides its signature."""
    data = save(tensors())
    count = 1000
    for number in range(count):
        server.put(f"m/{number}.safetensors", data, trick=_no_delay())
        page = _quoting(400, lambda path: f"<p>Bad Request: GET {path} HTTP/1.1</p>")
        server.put(f"e/{number}.safetensors", b"", trick=_no_delay(page))
    done = subprocess.run(
        [sys.executable, "-c", _MANY, server.url, str(count)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "MALLOC_ARENA_MAX": "2"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line) for line in done.stdout.splitlines()]
    assert found[-1]["opened"] == count and found[-1]["grown"] < 16 << 20, found
    assert found[-1]["secrets"] <= 512 and found[-1]["places"] <= 4096, found


@pytest.mark.parametrize("mark", ["\x01", "\x1f", "\x7f", "\x85", "\u2028", "\n", "\t", " ", "é"])
def test_a_query_holding_a_control_character_is_refused_unshown_before_any_request(
    server: HostileServer, capsys: pytest.CaptureFixture[str], mark: str
) -> None:
    """A raw control character, space or non-ASCII letter in a signed URL's query (a
    URL pasted broken): Python's error quoted the query by its repr, where the
    replacement of the query as it stands missed it (`\\x01`). Refused before any
    request, by what it holds, the query never shown."""
    file = server.put("m/x.safetensors", save(tensors()), trick=_signed)
    url = f"{file}?{SIGNATURE[:24]}{mark}{SIGNATURE[24:]}"
    holds = rf"its query string holds {re.escape(ascii(mark))} \(a space, control or non-ASCII"
    with pytest.raises(lazyckpt.StorageAccessError, match=holds) as refused:
        lazyckpt.open(url)
    message = str(refused.value)
    assert message.startswith(f"{file}?...: not a URL lazyckpt can ask for: ")
    assert "percent-encode it" in message
    assert main(["inspect", url]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"lazyckpt: error: {file}?...: not a URL")
    never_shown("\n".join([message, repr(refused.value), out, err]))
    assert server.log == []


def _needs(password: str) -> Any:
    """A trick: a 401 unless the request carries `user` and `password` as Basic auth."""

    def check(handler: _Handler, file: File) -> bool:
        if handler.headers.get("Authorization") != basic("user", password):
            handler.answer(401, {"WWW-Authenticate": 'Basic realm="m"'}, b"unauthorized")
            return True
        return False

    return check


@pytest.mark.parametrize("mark", [" ", "|", "^", "{", "}", '"', "<", ">", "`", "'"])
def test_a_password_holding_what_no_url_holds_raw_is_sent_and_never_shown(
    server: HostileServer, capsys: pytest.CaptureFixture[str], mark: str
) -> None:
    """Characters a URL holds only percent-encoded, which requests sends raw too, and
    which once ended the password that messages and titles hid."""
    password = f"se{mark}cr3t"
    server.put("m/model.safetensors", save(tensors()), trick=_needs(password))
    url = with_password(f"{server.url}/m", password)
    assert requests.Request("GET", url).prepare().headers["Authorization"] == basic(
        "user", password
    )
    tree = lazyckpt.open(url)
    text = shown(tree, url, capsys)
    assert f"http://...@{server.url.removeprefix('http://')}/m: 3 arrays" in text
    for secret in ("cr3t", "user:", f"se{mark}"):
        assert secret not in text, (secret, text)


@pytest.mark.parametrize(
    "password", ["se/cr3t", "1234/cr3t", "se?cr3t", "se#cr3t", "se\\cr3t", "1234?cr3t"]
)
def test_a_password_holding_what_ends_a_host_is_refused_unshown_before_any_request(
    server: HostileServer, capsys: pytest.CaptureFixture[str], password: str
) -> None:
    """The host ends at the first '/', '?', '#' or '\\', as the URL standard, requests
    and curl read it: `user:1234/cr3t@host` would name the host 'user', port 1234,
    and the path `/cr3t@host/...`. Refused, and the URL shown without any of it."""
    host = server.url.removeprefix("http://")
    url = with_password(f"{server.url}/m", password)
    with pytest.raises(lazyckpt.StorageAccessError) as refused:
        lazyckpt.open(url)
    message = str(refused.value)
    assert message.startswith(f"http://...@{host}/m: not a URL lazyckpt can ask for: ")
    assert "('/' as %2F, '?' as %3F, '#' as %23, '\\' as %5C, '@' as %40)" in message
    assert main(["inspect", url]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"lazyckpt: error: http://...@{host}/m: not a URL")
    for secret in ("cr3t", "user:", ":1234", ":se"):
        assert secret not in message + repr(refused.value) + out + err, secret
    assert server.log == []


@pytest.mark.parametrize(
    "url",
    [
        "http://user:s3cret@127.0.0.1:99999/m",
        "http://user:s3cret@127.0.0.1:x/m",
        "http://user:s3cret@[::1/m",
        "http://user:s3\uff0fcret@127.0.0.1:1/m",  # ('/' under NFKC: Python shows the host)
        "http://user:s3cret@/m",
        "http://user:s3cret@:81/m",
    ],
)
def test_a_malformed_host_is_refused_without_python_repeating_the_password(url: str) -> None:
    with (
        lazyckpt.network_options(retries=1),
        pytest.raises(
            lazyckpt.StorageAccessError, match=r"host or port is malformed|no host"
        ) as bad,
    ):
        lazyckpt.open(url)
    assert str(bad.value).startswith(f"http://...@{url.rpartition('@')[2]}: not a URL")
    assert "s3" not in str(bad.value) and "user" not in str(bad.value)


@pytest.mark.parametrize(
    "title",
    [
        "http://user:se\ncr3t@host/m",
        "http://user:se\tcr3t@host/m",
        "http://user:se cr3t@host/m",
        "http://user:se/cr3t@host/m",
        "https://host/x.safetensors?sig=ab|cr3t",
        'https://host/x.safetensors?sig=ab"cr3t',
        "https://host/x.safetensors#ab<cr3t>",
        "https://host/x.safetensors?sig=ab\x1fcr3t",  # (what `\\s` takes for a space)
        "https://host/x.safetensors?sig=ab\u2028cr3t",
    ],
)
def test_a_summary_titled_by_a_url_never_shows_its_secrets(title: str) -> None:
    summary = lazyckpt.summary({"w": np.zeros(2, np.float32)}, title=title)
    for text in (summary.text(), summary._repr_html_()):
        assert "cr3t" not in text and "user:" not in text, text
    assert summary.text().startswith(("http://...@host/m: 1 array", "https://host/x.safetensors"))
