"""URLs that carry a secret, against loopback servers (tests/hostile_server.py) that
refuse a request without it: a user name and password (a raw '@' in the password
too), sent as HTTP Basic auth as requests sends it, and a pre-signed file's query
string (`?X-Amz-Signature=...`), sent with every request for the file. Neither is
ever shown: not in errors, reprs, summaries, notebook HTML or the command line."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests
from safetensors.numpy import save

import lazyckpt
from lazyckpt._cli.main import main
from lazyckpt._storage import paths
from tests.helpers import orbax_save
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
    ],
)
def test_a_summary_titled_by_a_url_never_shows_its_secrets(title: str) -> None:
    summary = lazyckpt.summary({"w": np.zeros(2, np.float32)}, title=title)
    for text in (summary.text(), summary._repr_html_()):
        assert "cr3t" not in text and "user:" not in text, text
    assert summary.text().startswith(("http://...@host/m: 1 array", "https://host/x.safetensors"))
