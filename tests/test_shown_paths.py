"""Paths shown as the user gave them (`lazyckpt._display`): an `hf://` path as
`hf://ORG/NAME@1a2b3c4`, never the `resolve/` URL or the cache folder it is read from,
and no URL's query string (a signature), in the command line's output, errors,
warnings and reprs; against the loopback Hub of tests/hub_server.py. And the command
line's help, which names every form a path argument takes."""

from __future__ import annotations

import argparse
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

import lazyckpt
from lazyckpt._cli.main import _parser, main
from lazyckpt._display import as_given, hub_name
from lazyckpt._errors import warn
from lazyckpt._storage import paths
from tests.hub_server import HubServer

hh = pytest.importorskip("huggingface_hub")
constants = pytest.importorskip("huggingface_hub.constants")

SHORT = "[0-9a-f]{7}"
WEIGHTS = {"w": np.arange(16, dtype=np.float32).reshape(4, 4)}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`lazyckpt ARGS`: its exit status, output and error output."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def never_resolved(text: str, cache: Path | None = None) -> None:
    """`text` shows no URL the Hub resolved to, and no folder of the cache."""
    assert "http://" not in text and "/resolve/" not in text and "/cdn/" not in text, text
    assert cache is None or str(cache) not in text, text


def test_inspect_heads_its_output_with_the_hf_path(
    hub: HubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    sha = hub.commit("org/name", {"model.safetensors": save(WEIGHTS)})
    code, out, err = cli(capsys, "inspect", "hf://org/name")
    assert code == 0, err
    assert out.splitlines()[0] == f"hf://org/name@{sha[:7]}: 1 array, 64 B"
    never_resolved(out + err)
    code, out, err = cli(capsys, "inspect", "--json", "hf://org/name@main")
    assert code == 0, err
    assert json.loads(out)["path"] == f"hf://org/name@{sha[:7]}"
    never_resolved(out + err)


def test_errors_on_a_hub_model_name_its_hf_path(
    hub: HubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged file and a missing key, named by the file's path in the repository."""
    index = {"metadata": {}, "weight_map": {"w": "model-1.safetensors", "b": "model-1.safetensors"}}
    sha = hub.commit(
        "org/name",
        {
            "sub/model.safetensors": b"\x05\x00\x00\x00\x00\x00\x00\x00{}xxx",
            "model-1.safetensors": save(WEIGHTS),
            "model.safetensors.index.json": json.dumps(index).encode(),
        },
    )
    at = f"hf://org/name@{sha[:7]}"
    with pytest.raises(
        lazyckpt.CorruptCheckpointError,
        match=rf"^{re.escape(at)}/sub/model\.safetensors: the header is not valid JSON",
    ):
        lazyckpt.open("hf://org/name/sub")
    with pytest.raises(
        lazyckpt.CorruptCheckpointError,
        match=rf"^{re.escape(at)}/model\.safetensors\.index\.json places \['b'\] \(1 in all\) "
        "in shards whose headers do not hold them",
    ):
        lazyckpt.open("hf://org/name")
    code, out, err = cli(capsys, "inspect", "hf://org/name/sub")
    assert code == 1
    assert err.startswith(f"lazyckpt: error: {at}/sub/model.safetensors: the header")
    never_resolved(out + err)


def test_a_cached_model_shows_its_hf_path(
    hub: HubServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Read from the cache's snapshot folder, online or offline: named as on the Hub."""
    sha = hub.commit("org/name", {"model.safetensors": save(WEIGHTS)})
    hh.snapshot_download("org/name")
    cache = tmp_path / "cache"
    for offline in (False, True):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        assert paths.normalize("hf://org/name").startswith(str(cache))  # (read from disk)
        code, out, err = cli(capsys, "inspect", "hf://org/name")
        assert code == 0, err
        assert out.splitlines()[0] == f"hf://org/name@{sha[:7]}: 1 array, 64 B"
        never_resolved(out + err, cache)
        stored = lazyckpt.open("hf://org/name")["w"].stored
        assert f"file='hf://org/name@{sha[:7]}/model.safetensors'" in repr(stored)


def test_a_signed_cdn_address_is_never_shown(hub: HubServer) -> None:
    """The Hub redirects each file to a signed address at its CDN: a failure there
    names the file by its hf:// path, not by that address or its signature."""
    hub.cdn_query = "X-Amz-Signature=cdnsecret&Expires=1"
    sha = hub.commit("org/name", {"model.safetensors": save(WEIGHTS)})
    tree = lazyckpt.open("hf://org/name")
    assert f"file='hf://org/name@{sha[:7]}/model.safetensors'" in repr(tree["w"].stored)
    hub.fail_next(10, 500, path_prefix="/cdn/")
    with (
        lazyckpt.network_options(retries=2),
        pytest.raises(lazyckpt.StorageAccessError) as raised,
    ):
        tree["w"].get()
    message = str(raised.value)
    assert message.startswith(f"hf://org/name@{sha[:7]}/model.safetensors (org/name at main")
    assert "could not be reached or kept failing (HTTP 500)" in message
    assert "cdnsecret" not in message and "/cdn/" not in message and "/resolve/" not in message


def test_a_query_string_the_user_gave_is_never_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not in warnings or the command line's output: `?...` stands for it (errors:
    tests/test_url_secrets.py)."""
    with HubServer(tmp_path / "hub") as plain:
        plain.plain_validators = ()  # (a warning that names the URL)
        url = plain.add_plain_file("m/model.safetensors", save(WEIGHTS))
        given = f"{url}?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=secret"
        with (
            lazyckpt.network_options(unversioned="warn"),
            pytest.warns(lazyckpt.UnversionedWarning) as warned,
        ):
            tree = lazyckpt.open(given)
        shown = [repr(tree["w"].stored), *(str(w.message) for w in warned)]
        assert all(f"{url}?..." in text for text in shown), shown
        assert not [t for t in shown if "secret" in t or "AKIAEXAMPLE" in t], shown
        with lazyckpt.network_options(unversioned="warn"), warnings.catch_warnings():
            warnings.simplefilter("always")  # (shown as the command line shows them)
            code, out, err = cli(capsys, "inspect", given)
        assert code == 0, err
        assert "lazyckpt: warning:" in err and out.startswith(f"{url}?...: 1 array")
        assert "secret" not in out + err and "AKIAEXAMPLE" not in out + err


def test_every_repository_kind_and_file_inside_is_shown_by_its_hf_path(hub: HubServer) -> None:
    """What `hub` registers for a commit of a dataset: its `resolve/` URL and its
    snapshot folder, and the files in them; warnings too."""
    from lazyckpt._storage.http import hub as hub_paths

    sha = "c0ffee" * 6 + "abcd"
    hub_paths._name(hh, "dataset", "org/data", sha)
    shown = f"hf://datasets/org/data@{sha[:7]}"
    assert hub_name("datasets/", "org/data", sha) == shown
    url = f"{hub.endpoint}/datasets/org/data/resolve/{sha}"
    snapshot = os.path.join(constants.HF_HUB_CACHE, "datasets--org--data", "snapshots", sha)
    for place in (url, snapshot):
        assert (
            as_given(f"{place}/sub/x.safetensors: damaged") == f"{shown}/sub/x.safetensors: damaged"
        )
        assert as_given(f"{place}0: not ours") == f"{place}0: not ours"  # (another name)
    with pytest.warns(UserWarning, match=rf"^{re.escape(shown)}/sub/x\.safetensors: note$"):
        warn(f"{url}/sub/x.safetensors: note", UserWarning)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://h/x.bin?sig=secret: gone", "https://h/x.bin?...: gone"),
        ("'https://h/x.bin?a=1,2&sig=secret', which", "'https://h/x.bin?...', which"),
        ("https://user:pw@h/x#token=secret.", "https://...@h/x#...."),
        ("http://user:p@ss@h:81/x: refused", "http://...@h:81/x: refused"),
        ("http://a@b:c@d@h/x?q=1", "http://...@h/x?..."),
        ("https://h/x.bin?...: shown twice", "https://h/x.bin?...: shown twice"),
        ("s3://bucket/a@b and a question?", "s3://bucket/a@b and a question?"),
        ("http://user:se|cr3t@h/m: 1 array", "http://...@h/m: 1 array"),
        ("http://user:se cr3t@h/m: 1 array", "http://...@h/m: 1 array"),
        ('http://u:a"b^c{d}e\\f<g>h`i@h/m: 1', "http://...@h/m: 1"),
        ("http://user:se\ncr3t\t@h/m: 1 array", "http://...@h/m: 1 array"),
        ("http://user:se/cr3t@h/m", "http://...@h/m"),
        ('https://h/x.bin?sig=a|b"c<d>: 1 array', "https://h/x.bin?...: 1 array"),
        ('"https://h/x.bin?sig=a", said', '"https://h/x.bin?...", said'),
        (
            "http://h/m (a raw '@') and hf://org/m@c0ffee0",
            "http://h/m (a raw '@') and hf://org/m@c0ffee0",
        ),
        ("/local/path?name", "/local/path?name"),
    ],
)
def test_urls_are_shown_without_what_may_be_a_secret(text: str, expected: str) -> None:
    assert as_given(text) == expected
    assert as_given(expected) == expected


def _arguments() -> dict[tuple[str, str], str]:
    """The help of each positional argument (and `demo --keep`), by command."""
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not action.option_strings or action.dest == "keep":
                found[(name, action.dest)] = action.help or ""
    return found


def test_every_path_argument_names_the_forms_it_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    arguments = _arguments()
    read = [key for key in arguments if key[1] in ("path", "first", "second")]
    assert len(read) == 7  # inspect, show, stats, verify, convert; diff's two
    for key in read:
        for form in ("Orbax", "safetensors", "PyTorch", "NumPy", "flax", "Local", "s3://"):
            assert form in arguments[key], (key, form)
        for form in ("gs://", "hf://ORG/NAME[@REV]", "https://"):
            assert form in arguments[key], (key, form)
    written = arguments[("convert", "destination")]
    for form in ("Orbax", "safetensors", "Local", "s3://", "gs://", "hf://", "https://"):
        assert form in written, form
    assert "read only" in written
    assert "local folder" in arguments[("demo", "keep")]
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    shown: Any = " ".join(capsys.readouterr().out.split())
    assert "hf://ORG/NAME[@REV][/PATH] or https://" in shown and "safetensors" in shown
