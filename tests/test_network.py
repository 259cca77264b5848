"""Reads over HTTP against a misbehaving server (tests/hostile_server.py): every answer
ends in a result or a `LazyckptError` naming the URL, within a bounded time and memory,
never a hang, a raw exception or two versions of a file mixed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

import lazyckpt
from lazyckpt._storage import metrics, network, paths
from lazyckpt._storage.http import relay
from tests.hostile_server import File, HostileServer, _Handler

ROOT = Path(__file__).parent.parent
HANG = 60.0
"""Seconds after which a call counts as hung; what must end ends well before."""


def tensors(count: int = 4, rows: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        f"layer.{i}.w": rng.standard_normal((rows, 32)).astype(np.float32) for i in range(count)
    }


def outcome(call: Callable[[], object], seconds: float = HANG) -> object:
    """What `call` returned or raised; fails the test where it runs past `seconds`."""
    found: list[object] = []

    def run() -> None:
        try:
            found.append(call())
        except BaseException as error:  # noqa: BLE001 - the outcome under test
            found.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    return found[0]


def _grown_in_child(code: str) -> list[str]:
    """What `code` prints in a fresh process (jax imported first), then the growth of
    its peak RSS while it ran, in bytes. The process ends there, whatever reads still
    wait on a server."""
    probe = (
        "import os, resource, sys, threading, time, lazyckpt, lazyckpt._open\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"{code}"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def raised(found: object, kind: type[BaseException], match: str) -> BaseException:
    assert isinstance(found, kind), f"expected {kind.__name__}, got {found!r}"
    assert isinstance(found, lazyckpt.LazyckptError)
    import re

    assert re.search(match, str(found)), f"{match!r} not in {found}"
    return found


@pytest.fixture
def server() -> Iterator[HostileServer]:
    with HostileServer() as running:
        yield running


QUICK = {"timeout": 2.0, "min_rate": 1 << 20, "retries": 2}
"""Deadlines of 2 s and two attempts, so that failures end in seconds: set around the
call that must fail only, so that a busy machine never fails the calls that must not."""


# -- 1. bodies bounded as they stream --------------------------------------------------


def _endless(handler: _Handler, file: File) -> bool:
    handler.endless_chunks(handler.validators(file))
    return True


def _declares_a_terabyte(handler: _Handler, file: File) -> bool:
    handler.send_response(200)
    handler.send_header("Content-Length", str(1 << 40))
    handler.end_headers()
    handler.wfile.write(b"{" * 1024)
    handler.close_connection = True
    return True


@pytest.mark.parametrize("trick", [_endless, _declares_a_terabyte])
def test_an_index_too_large_is_refused_as_it_streams(
    server: HostileServer, trick: Callable[[_Handler, File], bool]
) -> None:
    server.put("m/model.safetensors.index.json", b"{}", trick=trick)
    found = outcome(lambda: lazyckpt.open(f"{server.url}/m"))
    raised(
        found,
        lazyckpt.TooLargeError,
        rf"{server.url}/m/model.safetensors.index.json holds (more than )?\d+ bytes, over "
        rf"the {64 << 20} lazyckpt reads",
    )


def test_any_file_read_whole_over_http_stops_at_64_mib(server: HostileServer) -> None:
    """A file of no kind of its own (the callers' default limit is 1 GiB) is read up
    to 64 MiB over HTTP, as the guide says."""
    url = server.put("notes.json", b"{}", trick=_endless)
    raised(
        outcome(lambda: paths.read_text(url)),
        lazyckpt.TooLargeError,
        rf"notes.json holds more than {64 << 20} bytes",
    )


def test_an_endless_index_grows_the_process_by_its_limit_at_most(
    server: HostileServer,
) -> None:
    """In a child process, its peak RSS measured: the body is refused at 64 MiB (the
    index's limit), not read to the end (it was 1.3 GB before)."""
    url = server.put("m/model.safetensors.index.json", b"{}", trick=_endless)
    verdict, grown = _grown_in_child(
        "try:\n"
        f"    lazyckpt.open({url.rsplit('/', 1)[0]!r})\n"
        "except lazyckpt.TooLargeError as error:\n"
        "    print('refused')\n"
    )
    assert verdict == "refused"
    assert int(grown) < (64 << 20) + (48 << 20), f"grew by {int(grown) >> 20} MiB"


def test_a_range_answered_with_more_bytes_than_asked_is_refused(server: HostileServer) -> None:
    values = tensors(rows=1024)  # 128 KiB each: past the header's first read

    def longer(handler: _Handler, file: File) -> bool:
        if handler.headers.get("Range", "").startswith("bytes=0-"):
            return False  # the header as it is
        handler.serve(file, extra=64)
        return True

    url = server.put("model.safetensors", save(values), trick=longer)
    tree = lazyckpt.open(url)
    for read in (lambda: tree["layer"]["1"]["w"].get(), lambda: lazyckpt.load(tree)):
        raised(
            outcome(read),
            lazyckpt.StorageAccessError,
            r"model.safetensors: the server answered \d+ bytes to a request for \d+; it "
            r"does not serve byte ranges correctly",
        )


# -- 2. deadlines --------------------------------------------------------------------


def _slow_headers(handler: _Handler, file: File) -> bool:
    handler.drip(b"HTTP/1.1 200 OK\r\nX-Slow:")
    return True


def _slow_body(handler: _Handler, file: File) -> bool:
    if handler.headers.get("Range", "").startswith("bytes=0-"):
        return False
    size = len(file.data)
    start, stop = (int(n) for n in handler.headers["Range"][6:].split("-"))
    head = (
        f"HTTP/1.1 206 Partial Content\r\nContent-Length: {stop + 1 - start}\r\n"
        f"Content-Range: bytes {start}-{stop}/{size}\r\nETag: {file.etag}\r\n\r\n"
    )
    handler.drip(head.encode() + file.data[start : start + 8])
    return True


@pytest.mark.parametrize("trick", [_slow_headers, _slow_body])
def test_a_server_that_sends_a_byte_a_second_misses_its_deadline(
    server: HostileServer, trick: Callable[[_Handler, File], bool]
) -> None:
    """Each receive waits no later than the request's deadline, however often a byte
    comes: the read ends in a StorageAccessError after its attempts."""
    url = server.put("model.safetensors", save(tensors()), trick=trick)
    tree = lazyckpt.open(url) if trick is _slow_body else None
    start = time.monotonic()
    with lazyckpt.network_options(**QUICK) as quick:  # type: ignore[arg-type]
        if tree is None:
            found = outcome(lambda: lazyckpt.open(url))
        else:
            found = outcome(lambda: tree["layer"]["2"]["w"].get())
    raised(
        found,
        lazyckpt.StorageAccessError,
        r"model.safetensors: http://127.0.0.1:\d+ could not be reached or kept failing "
        r"\(no complete answer within [\d.]+ s, its deadline .*\) after 2 attempts",
    )
    # Hang guard, not a timing: the bound the guide states, with room for a busy machine.
    assert time.monotonic() - start < quick.bound() + 30
    assert len(server.requests("model.safetensors")) <= 2 + quick.retries  # (after open's 2)


def test_an_orbax_checkpoint_whose_data_file_drips_misses_its_deadline(
    server: HostileServer, tmp_path: Path
) -> None:
    """tensorstore's drivers read an Orbax checkpoint over HTTP through lazyckpt's
    client (`relay`): a data file that drips fails its reads within their deadlines,
    as lazyckpt's StorageAccessError, not a wait or tensorstore's error."""
    from tests.helpers import orbax_save

    local = orbax_save(tmp_path / "ckpt", {"w": np.arange(1 << 20, dtype=np.float32)})
    for file in sorted(local.rglob("*")):
        if file.is_file():
            name = file.relative_to(local).as_posix()
            dripping = name.startswith("ocdbt.process_") and "/d/" in name
            server.put(f"ckpt/{name}", file.read_bytes(), trick=_slow_headers if dripping else None)
    tree = lazyckpt.open(f"{server.url}/ckpt")
    start = time.monotonic()
    with lazyckpt.network_options(**QUICK) as quick:  # type: ignore[arg-type]
        found = outcome(lambda: tree["w"][:8].get())
    raised(found, lazyckpt.StorageAccessError, r"ckpt/ocdbt.process_0/d/\w+.*kept failing")
    made = relay._RELAY.made()
    assert made is not None and made.secret not in str(found)
    # Hang guard, not a timing: the bound the guide states, with room for a busy machine.
    assert time.monotonic() - start < quick.bound() + 30


def test_network_options_are_checked_and_restored() -> None:
    before = network.options()
    with lazyckpt.network_options(timeout=2.5, retries=3) as now:
        assert (now.timeout, now.retries) == (2.5, 3)
        assert network.options() == now
    assert network.options() == before
    for bad in ({"timeout": 0}, {"retries": 0}, {"min_rate": float("inf")}, {"retries": True}):
        with pytest.raises(lazyckpt.LazyTypeError, match=r"network_options\(\w+=\.\.\.\)"):
            lazyckpt.network_options(**bad)


@pytest.mark.parametrize(
    ("setting", "value", "spelled"),
    [
        ("min_rate", 1e-6, r"bytes a second from 1024 \(1 KiB/s\) to 1073741824 \(1 GiB/s\)"),
        ("min_rate", 1000, r"bytes a second from 1024"),
        ("min_rate", 1 << 40, r"bytes a second from 1024"),
        ("timeout", 1e6, r"seconds from 0\.1 to 3600 \(an hour\)"),
        ("timeout", 0.01, r"seconds from 0\.1 to 3600"),
    ],
    ids=["min_rate=1e-6", "min_rate=1000", "min_rate=2**40", "timeout=1e6", "timeout=0.01"],
)
def test_network_settings_outside_their_ranges_are_refused(
    setting: str, value: float, spelled: str
) -> None:
    """A deadline is `timeout` plus a request's size at `min_rate`: `min_rate=1e-6`
    allowed a stalled server 10**12 s. Each setting has a range, which the error names
    with why it ends there; the ends themselves are taken."""
    before = network.options()
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=rf"^network_options\({setting}=\.\.\.\) takes {spelled}.*, not {value!r}: .*"
        "give a number in that range",
    ):
        lazyckpt.network_options(**{setting: value})  # type: ignore[arg-type]
    assert network.options() == before
    with lazyckpt.network_options(timeout=0.1, min_rate=1 << 30) as fast:
        assert fast.deadline_for(1 << 30) == 1.1
    with lazyckpt.network_options(timeout=3600, min_rate=1024) as slow:
        assert slow.deadline_for(1 << 20) == 3600 + 1024


def test_network_options_from_the_environment() -> None:
    probe = "import lazyckpt; print(lazyckpt.network_options())"
    environment = {**os.environ, "LAZYCKPT_HTTP_TIMEOUT": "7.5", "LAZYCKPT_HTTP_RETRIES": "2"}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=environment, cwd=ROOT
    )
    assert "NetworkOptions(timeout=7.5, min_rate=65536, retries=2" in done.stdout, done.stderr
    environment["LAZYCKPT_HTTP_RETRIES"] = "²"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=environment, cwd=ROOT
    )
    assert "LAZYCKPT_HTTP_RETRIES='²' is not a number" in done.stderr
    environment["LAZYCKPT_HTTP_RETRIES"] = "2"
    environment["LAZYCKPT_HTTP_MIN_RATE"] = "0.000001"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=environment, cwd=ROOT
    )
    assert (
        "network_options(min_rate=...) takes bytes a second from 1024 (1 KiB/s)" in done.stderr
    ), done.stderr
    assert "(from the environment's LAZYCKPT_HTTP_*)" in done.stderr


# -- 4. never two versions mixed -----------------------------------------------------


@pytest.mark.parametrize("validators", ["etag", "last-modified", "etag, ignoring If-Match"])
def test_a_file_rewritten_between_two_reads_is_caught(
    server: HostileServer, validators: str
) -> None:
    """Version B of the file has the same size as version A, so only its validators
    tell them apart; the server checks them (If-Match, If-Unmodified-Since), and where
    it ignores If-Match its answer's ETag gives it away."""
    first, second = tensors(), {k: v + 1 for k, v in tensors().items()}
    etag, modified = validators.startswith("etag"), validators == "last-modified"

    def ignoring(handler: _Handler, file: File) -> bool:
        del handler.headers["If-Match"]
        handler.serve(file)
        return True

    trick = ignoring if "ignoring" in validators else None
    put = {"etag": etag, "last_modified": modified, "trick": trick}
    url = server.put("model.safetensors", save(first), modified=1e9, **put)  # type: ignore[arg-type]
    tree = lazyckpt.open(url)
    np.testing.assert_array_equal(tree["layer"]["0"]["w"].get(), first["layer.0.w"])
    server.put("model.safetensors", save(second), modified=2e9, **put)  # type: ignore[arg-type]
    raised(
        outcome(lambda: tree["layer"]["1"]["w"].get()),
        lazyckpt.CheckpointChangedError,
        r"model.safetensors changed since it was opened \((the server says so \(HTTP 412|its "
        r"ETag was)",
    )
    sent = server.requests("model.safetensors")[-1].headers
    assert ("If-Match" in sent) == etag and ("If-Unmodified-Since" in sent) == modified


def test_a_file_without_validators_is_refused_or_read_with_a_warning(
    server: HostileServer,
) -> None:
    values = tensors()
    url = server.put("model.safetensors", save(values), etag=False, last_modified=False)
    raised(
        outcome(lambda: lazyckpt.open(url)),
        lazyckpt.StorageAccessError,
        r"model.safetensors: the server gives neither an ETag nor a Last-Modified date.*"
        r"network_options\(unversioned='warn'\)",
    )
    with lazyckpt.network_options(unversioned="warn"):
        with pytest.warns(lazyckpt.UnversionedWarning, match="could not be detected"):
            tree = lazyckpt.open(url)
        np.testing.assert_array_equal(tree["layer"]["3"]["w"].get(), values["layer.3.w"])


def test_a_file_deleted_after_open_is_a_change(server: HostileServer) -> None:
    url = server.put("model.safetensors", save(tensors()))
    tree = lazyckpt.open(url)
    del server.files["model.safetensors"]
    for read in (lambda: tree["layer"]["1"]["w"].get(), lambda: lazyckpt.load(tree)):
        raised(
            outcome(read),
            lazyckpt.CheckpointChangedError,
            r"model.safetensors changed since it was opened \(it is gone \(HTTP 404\)\)",
        )


# -- 5. short and lying headers ------------------------------------------------------


def test_headers_longer_than_the_file_or_cut_short_are_clear_errors(
    server: HostileServer,
) -> None:
    data = save(tensors(count=2))
    declared = len(data) + 1000
    cases = {
        # A header declared longer than the whole file.
        "long.safetensors": (declared.to_bytes(8, "little") + data[8:], None),
        # A header of 100 KiB, whose second read (past the first 64 KiB) is cut short.
        "cut.safetensors": (_padded_header(100 << 10), _cut_after_first_read),
    }
    for name, (body, trick) in cases.items():
        url = server.put(name, body, trick=trick)
        raised(
            outcome(lambda url=url: lazyckpt.open(url)),  # type: ignore[misc]
            lazyckpt.CorruptCheckpointError,
            rf"{name} (holds \d+ bytes, but its header declares \d+ bytes of header|holds "
            r"\d+ bytes, fewer than the \d+ needed)",
        )


def _padded_header(size: int) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    header += " " * (size - len(header))
    return size.to_bytes(8, "little") + header.encode() + bytes(8)


def _cut_after_first_read(handler: _Handler, file: File) -> bool:
    if handler.headers.get("Range", "").startswith("bytes=0-"):
        return False
    start = int(handler.headers["Range"][6:].split("-")[0])
    body = file.data[start : start + 100]
    last = start + len(body) - 1
    handler.answer(
        206,
        {**handler.validators(file), "Content-Range": f"bytes {start}-{last}/{start + 100}"},
        body,
    )
    return True


# -- 7. redirects --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("location", "match"),
    [
        ("http://[::1", r"redirected to 'http://\[::1', which is not a URL"),
        ("ftp://127.0.0.1/model.safetensors", r"follows redirects to http:// and https://"),
        ("file:///etc/passwd", r"follows redirects to http:// and https://"),
        ("/etc/passwd", r"no such file|does not exist|not a safetensors"),
    ],
)
def test_redirects_lead_to_http_only(server: HostileServer, location: str, match: str) -> None:
    def redirect(handler: _Handler, file: File) -> bool:
        handler.answer(302, {"Location": location}, b"")
        return True

    url = server.put("model.safetensors", b"", trick=redirect)
    found = outcome(lambda: lazyckpt.open(url))
    assert isinstance(found, lazyckpt.LazyckptError), repr(found)
    raised(found, type(found), match)
    if "://" in location:  # (a path is this server's own: asked for, a 404)
        assert [r.path for r in server.log if "passwd" in r.path] == []


# -- 8. a storm of failures ends the whole verb --------------------------------------


def test_a_storm_of_503_stops_every_read_at_the_first_that_fails_for_good(
    server: HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 tensors of 4 MiB, read in 1 MiB requests; after open every answer is a 503.
    The first read to spend its 3 attempts stops every other read of the burst, queued
    or waiting to retry: at most the reads in flight (16 connections) spend theirs.
    Before, reads went on in a second wave (138 requests and 7.6 s for 16 such tensors)."""
    options = lazyckpt.NetworkOptions(retries=3, connections=16, request_bytes=1 << 20)
    monkeypatch.setattr(network, "_OPTIONS", [options])
    values = tensors(count=12, rows=32768)
    storm = threading.Event()

    def failing(handler: _Handler, file: File) -> bool:
        if not storm.is_set():
            return False
        handler.answer(503, {"Retry-After": "0"}, b"busy")
        return True

    url = server.put("model.safetensors", save(values), trick=failing)
    tree = lazyckpt.open(url)
    storm.set()
    before = metrics.requests_made()
    raised(
        outcome(lambda: lazyckpt.load(tree)),
        lazyckpt.StorageAccessError,
        r"model.safetensors.*(kept failing \(HTTP 503\) after 3 attempts|another read of the "
        r"same files failed for good)",
    )
    time.sleep(1.0)  # what was still running when load raised has stopped since
    made = metrics.requests_made() - before
    assert made <= 16 * 3, f"{made} requests"


# -- 11. Retry-After as servers write it --------------------------------------------


@pytest.mark.parametrize(
    "after",
    ["²", "9" * 5000, "Wed, 21 Oct 2015 07:28:00 GMT", "Sun Nov  6 08:49:37 1994", "soon"],
)
def test_any_retry_after_is_read_or_ignored(server: HostileServer, after: str) -> None:
    values = tensors(count=1)
    failures = [1]

    def once(handler: _Handler, file: File) -> bool:
        if not failures or handler.headers.get("Range", "").startswith("bytes=0-"):
            return False
        failures.pop()
        handler.answer(503, {"Retry-After": after}, b"")
        return True

    tree = lazyckpt.open(server.put("model.safetensors", save(values), trick=once))
    found = outcome(lambda: tree["layer"]["0"]["w"].get())
    assert isinstance(found, np.ndarray), repr(found)
    np.testing.assert_array_equal(found, values["layer.0.w"])
    assert network.retry_after(after) in (None, 0.0)


def test_the_bound_of_a_read_is_what_the_guide_says() -> None:
    options: Any = lazyckpt.NetworkOptions()
    # 5 attempts of 30 s plus 1 MiB at 64 KiB/s, and at most 8 s between them.
    assert options.bound() == 5 * (30 + 16) + 4 * 8


# -- the Hub's API, asked through the same client --------------------------------------


def test_a_hub_whose_api_drips_never_ends_or_lies_is_bounded(
    server: HostileServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`hf://` resolves its revision with one request to the Hub's API; before, that
    went through huggingface_hub's client with no timeout, and a silent or dripping
    endpoint held `open` forever, an endless one grew it without bound."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    server.put("api/models/org/slow", b"", trick=_slow_headers)
    server.put("api/models/org/endless", b"", trick=_endless)
    server.put("api/models/org/lies", b'{"sha": "../../x", "siblings": [{"rfilename": 7}]}')
    api = r"\(the Hub's API at http://127.0.0.1:\d+\)"
    with lazyckpt.network_options(**QUICK):  # type: ignore[arg-type]
        slow = outcome(lambda: lazyckpt.open("hf://org/slow"))
    raised(
        slow,
        lazyckpt.StorageAccessError,
        rf"hf://org/slow {api}: .* \(no complete answer within [\d.]+ s",
    )
    raised(
        outcome(lambda: lazyckpt.open("hf://org/endless")),
        lazyckpt.TooLargeError,
        rf"hf://org/endless {api}: the answer holds more than {64 << 20} bytes",
    )
    raised(
        outcome(lambda: lazyckpt.open("hf://org/lies")),
        lazyckpt.StorageAccessError,
        rf"hf://org/lies {api}: the answer is not a repository's info",
    )


# -- what an adversarial review of the client found -----------------------------------


@pytest.mark.parametrize("protocol", ["HTTP/1.0", "HTTP/1.1, Connection: close"])
def test_servers_that_close_the_connection_after_each_answer(protocol: str) -> None:
    """An answer whose server closes the connection (HTTP/1.0, `Connection: close`)
    is read to its end: the socket stays open for the body after `http.client` lets
    go of the connection. Its body comes in two writes, past the first buffer."""
    values = tensors(count=2, rows=8192)  # 1 MiB each

    def closing(handler: _Handler, file: File) -> bool:
        if "close" not in protocol:
            return False
        wanted = handler.headers.get("Range", "")
        start, stop = (int(n) for n in wanted[6:].split("-"))
        stop = min(stop, len(file.data) - 1)
        body = file.data[start : stop + 1]
        handler.send_response(206)
        for name, value in handler.validators(file).items():
            handler.send_header(name, value)
        handler.send_header("Content-Range", f"bytes {start}-{stop}/{len(file.data)}")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(body[: len(body) // 2])
        handler.wfile.flush()
        time.sleep(0.05)
        handler.wfile.write(body[len(body) // 2 :])
        handler.close_connection = True
        return True

    with HostileServer(protocol=protocol.split(",")[0]) as server:
        tree = lazyckpt.open(server.put("model.safetensors", save(values), trick=closing))
        found = outcome(lambda: lazyckpt.load(tree))
        assert isinstance(found, dict), repr(found)
        np.testing.assert_array_equal(found["layer"]["1"]["w"], values["layer.1.w"])


@pytest.mark.parametrize("dropped", ["ETag", "Last-Modified"])
def test_an_answer_that_drops_a_validator_is_a_change(server: HostileServer, dropped: str) -> None:
    """Version B answers without the validator version A gave (and ignores If-Match):
    that is no proof of the same version, so it is a change, not values of B. (A size
    of `*` is no validator: RFC 9110's unknown complete length, read as such in
    tests/test_http_answers.py.)"""
    first = tensors(count=2, rows=1024)
    second = {k: v + 1 for k, v in first.items()}
    swapped = threading.Event()

    def without(handler: _Handler, file: File) -> bool:
        if not swapped.is_set():
            return False
        wanted = handler.headers.get("Range", "")
        start, stop = (int(n) for n in wanted[6:].split("-"))
        body = file.data[start : stop + 1]
        headers = handler.validators(file)
        headers.pop(dropped)
        headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{len(file.data)}"
        handler.answer(206, headers, body)
        return True

    url = server.put("model.safetensors", save(first), modified=1e9, trick=without)
    tree = lazyckpt.open(url)
    server.files["model.safetensors"].data = save(second)
    swapped.set()
    raised(
        outcome(lambda: lazyckpt.load(tree)),
        lazyckpt.CheckpointChangedError,
        rf"model.safetensors changed since it was opened \(its {dropped} was \S.*, the answer "
        r"gave none\)",
    )


def test_interim_answers_are_skipped(server: HostileServer) -> None:
    """`103 Early Hints` before the answer: skipped, not taken for the answer (which
    then answered the next request, another file's bytes for this one's)."""
    values = tensors(count=4, rows=1024)

    def hints(handler: _Handler, file: File) -> bool:
        handler.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
        handler.wfile.flush()
        time.sleep(0.05)
        return False  # then the answer, as usual

    files = {"a.safetensors": save(values)}
    index = {"metadata": {}, "weight_map": dict.fromkeys(values, "a.safetensors")}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    for name, data in files.items():
        server.put(f"m/{name}", data, trick=hints)
    found = outcome(lambda: lazyckpt.load(lazyckpt.open(f"{server.url}/m")))
    assert isinstance(found, dict), repr(found)
    np.testing.assert_array_equal(found["layer"]["3"]["w"], values["layer.3.w"])


def test_memory_grows_as_bytes_arrive_not_as_declared(server: HostileServer) -> None:
    """Four shards whose headers declare 100 MiB, and whose servers declare that many
    bytes of body, then send a byte a second: in a child process, the open holds about
    a MiB a read, not the 400 MiB declared (before: the declared size, at once)."""
    declared = 100 << 20
    head = declared.to_bytes(8, "little") + b"{" + b" " * ((64 << 10) - 9)

    def promise(handler: _Handler, file: File) -> bool:
        start, stop = (int(n) for n in handler.headers["Range"][6:].split("-"))
        if start == 0:  # the header's first 64 KiB, of a file as large as it says
            body = file.data[: stop + 1]
            headers = {**handler.validators(file)}
            headers["Content-Range"] = f"bytes 0-{len(body) - 1}/{8 + declared}"
            handler.answer(206, headers, body)
            return True
        lines = (
            f"HTTP/1.1 206 Partial Content\r\nContent-Length: {stop + 1 - start}\r\n"
            f"Content-Range: bytes {start}-{stop}/{8 + declared}\r\nETag: {file.etag}\r\n\r\n"
        )
        handler.drip(lines.encode())
        return True

    shards = [f"s{i}.safetensors" for i in range(4)]
    for shard in shards:
        server.put(f"m/{shard}", head, trick=promise)
    index = {"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}}
    server.put("m/model.safetensors.index.json", json.dumps(index).encode())
    (grown,) = _grown_in_child(
        f"threading.Thread(target=lazyckpt.open, args=({server.url + '/m'!r},), daemon=True)"
        ".start()\n"
        "time.sleep(4)\n"
    )
    assert int(grown) < 48 << 20, f"grew by {int(grown) >> 20} MiB"


def test_a_stalled_server_holds_up_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 shards on a server that drips every answer keep 16 reads waiting on it; a
    model on another server opens and loads meanwhile (before, its reads queued
    behind the stalled ones, on one pool of 16 threads)."""
    monkeypatch.setattr(network, "_OPTIONS", [lazyckpt.NetworkOptions(timeout=30, retries=1)])
    values = tensors(count=2)
    with HostileServer() as stalled, HostileServer() as healthy:
        shards = [f"s{i}.safetensors" for i in range(20)]
        for shard in shards:
            stalled.put(f"m/{shard}", b"", trick=_slow_headers)
        index = {"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}}
        stalled.put("m/model.safetensors.index.json", json.dumps(index).encode())
        waiting = threading.Thread(
            target=outcome, args=(lambda: lazyckpt.open(f"{stalled.url}/m"),), daemon=True
        )
        waiting.start()
        while len(stalled.log) < 16 and waiting.is_alive():
            time.sleep(0.05)
        found = outcome(
            lambda: lazyckpt.load(lazyckpt.open(healthy.put("model.safetensors", save(values))))
        )
        assert waiting.is_alive(), "the stalled open ended first: nothing was held up"
        assert isinstance(found, dict), repr(found)
        np.testing.assert_array_equal(found["layer"]["1"]["w"], values["layer.1.w"])


def test_a_definite_failure_stops_no_other_read(server: HostileServer) -> None:
    """A 403 for one file is its own answer: a read of another file of the same open,
    waiting to retry a 503, goes on and succeeds (a server that failed every attempt
    stops the rest: test_a_storm_of_503_...)."""
    values = tensors(count=2, rows=1024)
    retried = threading.Event()

    def forbidden(handler: _Handler, file: File) -> bool:
        if handler.headers.get("Range", "").startswith("bytes=0-"):
            return False
        retried.wait(5)
        handler.answer(403, {}, b"no")
        return True

    def busy_once(handler: _Handler, file: File) -> bool:
        if handler.headers.get("Range", "").startswith("bytes=0-") or retried.is_set():
            return False
        handler.answer(503, {"Retry-After": "1"}, b"busy")
        retried.set()
        return True

    names = {"layer.0.w": "a.safetensors", "layer.1.w": "b.safetensors"}
    server.put("m/a.safetensors", save({"layer.0.w": values["layer.0.w"]}), trick=forbidden)
    server.put("m/b.safetensors", save({"layer.1.w": values["layer.1.w"]}), trick=busy_once)
    server.put("m/model.safetensors.index.json", json.dumps({"weight_map": names}).encode())
    tree = lazyckpt.open(f"{server.url}/m")
    results: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: results.update(a=outcome(tree["layer"]["0"]["w"].get))),
        threading.Thread(target=lambda: results.update(b=outcome(tree["layer"]["1"]["w"].get))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG)
    raised(results["a"], lazyckpt.StorageAccessError, r"a.safetensors: access denied")
    assert isinstance(results["b"], np.ndarray), repr(results["b"])


def test_options_set_in_two_threads_are_put_back_each_its_own() -> None:
    before = network.options()
    first = lazyckpt.network_options(timeout=5)
    first.__enter__()
    second = lazyckpt.network_options(retries=2)
    second.__enter__()
    first.__exit__(None, None, None)  # the first block ends while the second goes on
    assert (network.options().timeout, network.options().retries) == (before.timeout, 2)
    second.__exit__(None, None, None)
    assert network.options() == before


def test_urls_and_options_lazyckpt_cannot_use_are_clear_errors(server: HostileServer) -> None:
    raised(
        outcome(lambda: lazyckpt.open("http://[::1/m.safetensors")),
        lazyckpt.StorageAccessError,
        r"http://\[::1/m.safetensors: not a URL lazyckpt can ask for",
    )
    with pytest.raises(lazyckpt.LazyTypeError, match=r"timeout=\.\.\.\) takes seconds from 0\.1"):
        lazyckpt.network_options(timeout=1e10)

    def beyond(handler: _Handler, file: File) -> bool:
        handler.answer(206, {**handler.validators(file), "Content-Range": "bytes 0-0/0"}, b"x")
        return True

    raised(
        outcome(lambda: lazyckpt.open(server.put("model.safetensors", b"x", trick=beyond))),
        lazyckpt.StorageAccessError,
        r"Content-Range 'bytes 0-0/0', which ends past the file's size",
    )


def test_where_a_plain_url_redirects_is_asked_again_at_each_open(
    server: HostileServer,
) -> None:
    """`/latest` redirects to a version; a later open follows where it leads then."""
    one, two = tensors(count=1), {k: v + 1 for k, v in tensors(count=1).items()}
    server.put("v1.safetensors", save(one))
    server.put("v2.safetensors", save(two))
    target = ["v1.safetensors"]

    def latest(handler: _Handler, file: File) -> bool:
        handler.answer(307, {"Location": f"/{target[0]}"}, b"")
        return True

    url = server.put("latest.safetensors", b"", trick=latest)
    np.testing.assert_array_equal(lazyckpt.open(url)["layer"]["0"]["w"].get(), one["layer.0.w"])
    target[0] = "v2.safetensors"
    np.testing.assert_array_equal(lazyckpt.open(url)["layer"]["0"]["w"].get(), two["layer.0.w"])


@pytest.mark.parametrize(
    "sent",
    [
        b"\x1b]0;PWNED\x07\x1b[2J\x1b[31mEVIL @evil.example\r\n\r\n",
        b"\x00\x00\x80?\x00@\x00\x00\x40\x40\x00\r\n\r\n",  # (an HTTP/0.9 body: no status)
    ],
    ids=["escapes and an @", "raw bytes"],
)
def test_what_a_server_sends_is_escaped_in_messages(server: HostileServer, sent: bytes) -> None:
    """A status line of control characters cannot retitle the terminal or forge a line,
    and an '@' in it cannot make the URL scrubber hide the host before it: shown as
    `repr` shows them, the '@' as \\x40."""

    def hostile(handler: _Handler, file: File) -> bool:
        handler.wfile.write(sent)
        handler.close_connection = True
        return True

    url = server.put("model.safetensors", b"", trick=hostile)
    host = url.split("/")[2]
    with lazyckpt.network_options(**QUICK):  # type: ignore[arg-type]
        found = raised(
            outcome(lambda: lazyckpt.open(url)),
            lazyckpt.StorageAccessError,
            rf"^{re.escape(url)}: http://{re.escape(host)} could not be reached or kept failing "
            r"\(\w+: '.*\\x40.*'\) after 2 attempts",
        )
    assert not re.search(r"[\x00-\x1f\x7f]", str(found)), str(found)


def test_a_416_for_bytes_the_file_holds_is_no_truncation(server: HostileServer) -> None:
    """A 416 whose `bytes */SIZE` says the range asked for is there contradicts itself:
    the server's fault, not a file shorter than its header."""
    values = tensors(count=1, rows=64)
    data = save(values)

    def refusing(handler: _Handler, file: File) -> bool:
        if handler.headers.get("Range", "").startswith("bytes=0-"):
            return False  # (the header, at open)
        handler.answer(416, {"Content-Range": f"bytes */{len(data)}"}, b"")
        return True

    tree = lazyckpt.open(server.put("model.safetensors", data, trick=refusing))
    raised(
        outcome(lambda: lazyckpt.load(tree)),
        lazyckpt.StorageAccessError,
        rf"model.safetensors: the server refused bytes \d+ on as out of range \(HTTP 416\), yet "
        rf"says the file holds {len(data)} bytes; it does not serve byte ranges correctly",
    )
