"""Checkpoints in object storage: a real S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save

import lazyckpt
from tests.helpers import (
    CREDENTIALS,
    assert_tree_equal,
    handler_save,
    host_value,
    orbax_manager_save,
    orbax_save,
)

boto3 = pytest.importorskip("boto3")

DENIED = r"access denied \(.*\); the credentials lack permission for this bucket or prefix"


@contextlib.contextmanager
def guarded_server(free_requests: int = 4) -> Iterator[str]:
    """A moto server in its own process that checks credentials and IAM policies
    after its first `free_requests` requests (moto reads that setting once, at import)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(free_requests)}
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as server:
        try:
            deadline = time.monotonic() + 60
            while True:
                with socket.socket() as client:
                    if client.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto server did not start")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.kill()
            server.wait(timeout=60)


def upload(client: Any, folder: Path, prefix: str) -> str:
    for path in folder.rglob("*"):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(folder).as_posix()}"
            client.put_object(Bucket="ckpts", Key=key, Body=path.read_bytes())
    return f"s3://ckpts/{prefix}"


def requests_made() -> int:
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/http/request_started"):
        return sum(int(v.get("value", 0)) for v in metric["values"])
    return 0


def test_open_slice_and_place_a_checkpoint_from_s3(
    s3: Any, saved: tuple[Path, dict[str, Any]], mesh: Any
) -> None:
    path, tree = saved
    url = upload(s3, path, f"ref-{path.parent.name}")
    opened = lazyckpt.open(url)
    assert opened["params"]["dense"]["kernel"].sharding.spec == P("x", "y")
    assert_tree_equal(lazyckpt.load(opened), jax.tree.map(host_value, tree))
    kernel = np.asarray(tree["params"]["dense"]["kernel"])
    np.testing.assert_array_equal(
        opened["params"]["dense"]["kernel"][3:9, ::7].get(), kernel[3:9, ::7]
    )
    placed = lazyckpt.device_put(opened["params"], lazyckpt.saved_shardings(mesh))
    np.testing.assert_array_equal(placed["dense"]["kernel"], kernel)


def test_large_chunks_decode_through_byte_ranges_of_the_bucket(
    s3: Any, tmp_path: Path, count_bytes: Any
) -> None:
    """A 4 MiB NumPy array in one chunk (orbax's default) is decoded by lazyckpt from
    ranged GETs: a few rows near the start read only a prefix of the object."""
    from lazyckpt._engine import decode as _decode

    value = np.random.default_rng(4).standard_normal((1024, 1024)).astype(np.float32)
    url = upload(s3, orbax_save(tmp_path / "one", {"w": value}), "one-chunk")
    lazy = lazyckpt.open(url)["w"]
    assert _decode.decodes(lazy.stored)
    np.testing.assert_array_equal(lazyckpt.load(lazy), value)
    with count_bytes() as read:
        rows = lazyckpt.load(lazy[10:20], memory_budget=1 << 20)
    np.testing.assert_array_equal(rows, value[10:20])
    assert read[0] < value.nbytes // 4
    mesh = jax.make_mesh((8,), ("d",))
    placed = lazyckpt.device_put(lazy, NamedSharding(mesh, P(None, "d")))
    np.testing.assert_array_equal(np.asarray(placed), value)


def test_steps_items_and_unfinished_steps_in_a_bucket(s3: Any, tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    root = orbax_manager_save(
        tmp_path / "run",
        {step: {"state": ocp.args.StandardSave({"w": np.full(3, step)})} for step in (1, 2, 3)},
    )
    url = upload(s3, root, "run")
    # Step 3 lost its commit marker: on object storage it is unfinished.
    s3.delete_object(Bucket="ckpts", Key="run/ckpt_000003/commit_success.txt")
    assert lazyckpt.steps(url) == [1, 2]
    assert lazyckpt.items(url) == {"state": "pytree"}
    assert lazyckpt.open(url)["w"].get().tolist() == [2, 2, 2]
    assert lazyckpt.open(url, step=1)["w"].get().tolist() == [1, 1, 1]
    with pytest.raises(
        lazyckpt.UnfinishedCheckpointError, match=r"ckpt_000003/state has no commit_success\.txt"
    ):
        lazyckpt.open(f"{url}/ckpt_000003")


def test_open_of_1000_arrays_takes_a_few_requests(s3: Any, tmp_path: Path) -> None:
    """The number of requests does not grow with the number of arrays (OCDBT)."""
    counts = {}
    for arrays in (10, 1000):
        tree = {f"layer_{i:02d}": {f"p{j:02d}": np.full(4, j, np.float32) for j in range(arrays // 10)}
                for i in range(10)}  # fmt: skip
        url = upload(s3, orbax_save(tmp_path / f"n{arrays}", tree, zarr3=True), f"many/{arrays}")
        before = requests_made()
        opened = lazyckpt.open(url)
        counts[arrays] = requests_made() - before
        assert sum(1 for _ in lazyckpt.leaves(opened)) == arrays
    # (13: the OCDBT manifest's header, its bytes, and its last byte with one past it,
    # which must not be there)
    assert counts[1000] <= 13, counts
    assert counts[1000] <= counts[10] + 2, counts


def test_reads_with_keys_in_the_environment_print_nothing_on_stderr(
    s3: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set (which the default chain
    takes first), tensorstore's other credential providers are not built: in a home
    without ~/.aws they printed five error lines at every open ("Failed to open file.
    path:'~/.aws/config'")."""
    monkeypatch.setenv("HOME", str(tmp_path))
    s3.put_object(Bucket="ckpts", Key="quiet/model.safetensors", Body=save({"w": np.ones(4)}))
    capfd.readouterr()
    tree = lazyckpt.open("s3://ckpts/quiet/model.safetensors")
    np.testing.assert_array_equal(tree["w"].get(), np.ones(4))
    assert capfd.readouterr().err == ""


def test_credentials_the_caller_names_are_not_overridden_by_environment_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keys in the environment are asked for alone only where storage_options name no
    credentials: a profile or anonymous access chosen in them (at the top, or in their
    `context`) had been replaced by the environment's keys, reading as another
    identity."""
    from lazyckpt._storage import bucket

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    named = {"type": "profile", "profile": "prod"}
    for options, expected in (
        (None, {"type": "environment"}),
        ({"aws_credentials": named}, named),
        ({"context": {"aws_credentials": {"type": "anonymous"}}}, None),
    ):
        with bucket.session(options):
            assert bucket.bucket_spec("s3://ckpts/run").get("aws_credentials") == expected


def test_save_and_convert_to_a_bucket(s3: Any, saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    name = f"saved-{path.parent.name}"
    url = lazyckpt.save(f"s3://ckpts/{name}", {"w": np.arange(12.0).reshape(3, 4), "note": "hi"})
    assert url == f"s3://ckpts/{name}"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpts", Prefix=f"{name}/")["Contents"]]
    assert f"{name}/commit_success.txt" in keys and f"{name}/manifest.ocdbt" in keys
    back = lazyckpt.open(url)
    assert back["note"] == "hi"
    np.testing.assert_array_equal(back["w"].get(), np.arange(12.0).reshape(3, 4))
    with pytest.raises(
        lazyckpt.CheckpointExistsError, match=r"already exists \(\d+ entries\); pass overwrite=True"
    ):
        lazyckpt.save(url, {"w": np.zeros(2)})
    lazyckpt.save(url, {"v": np.ones(2)}, overwrite=True)
    assert list(lazyckpt.open(url)) == ["v"]
    # Local to bucket, and bucket to local.
    remote = lazyckpt.convert(path, f"s3://ckpts/{name}-16", select="params/**", dtype="float16")
    local = lazyckpt.convert(remote, path.parent / "from-s3")
    kernel = np.asarray(tree["params"]["dense"]["kernel"]).astype(np.float16)
    np.testing.assert_array_equal(lazyckpt.open(local)["params"]["dense"]["kernel"].get(), kernel)


def test_a_model_overwritten_in_a_bucket_keeps_its_other_files(s3: Any) -> None:
    old = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(4)}
    url = lazyckpt.save("s3://ckpts/hf-model", old, format="safetensors", max_shard_size=20_000)
    s3.put_object(Bucket="ckpts", Key="hf-model/config.json", Body=b'{"model_type": "llama"}')
    s3.put_object(Bucket="ckpts", Key="notes.safetensors", Body=b"not a model")
    with pytest.raises(lazyckpt.CheckpointExistsError, match="is not a safetensors file"):
        lazyckpt.save("s3://ckpts/notes.safetensors", {"w": np.ones(2)}, overwrite=True)
    assert s3.get_object(Bucket="ckpts", Key="notes.safetensors")["Body"].read() == b"not a model"
    lazyckpt.save(url, {"w": np.arange(3.0)}, format="safetensors", overwrite=True)
    listed = s3.list_objects_v2(Bucket="ckpts", Prefix="hf-model/")["Contents"]
    assert sorted(o["Key"] for o in listed) == [
        "hf-model/config.json",
        "hf-model/model.safetensors",
    ]
    config = s3.get_object(Bucket="ckpts", Key="hf-model/config.json")["Body"].read()
    assert config == b'{"model_type": "llama"}'
    np.testing.assert_array_equal(lazyckpt.open(url)["w"].get(), np.arange(3.0))


def test_missing_bucket_and_path_say_which(s3: Any) -> None:
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="the bucket 'nope' does not exist"):
        lazyckpt.open("s3://nope/ckpt")
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="does not exist; check the"):
        lazyckpt.open("s3://ckpts/no/such/prefix")


def test_missing_credentials_say_so(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_METADATA", "commit_success.txt"):
        s3.put_object(Bucket="ckpts", Key=f"creds/{name}", Body=b"{}")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a cloud's IMDS
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.aws/credentials either
    with pytest.raises(lazyckpt.StorageAccessError, match="no credentials were found"):
        lazyckpt.open("s3://ckpts/creds")


def test_rejected_credentials_and_access_denied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a server that checks credentials and IAM policies."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with guarded_server() as endpoint:
        admin = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        admin_s3 = boto3.client("s3", **admin)
        admin_s3.create_bucket(Bucket="guarded")
        admin_s3.put_object(Bucket="guarded", Key="ckpt/_METADATA", Body=b"{}")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]  # and no policy
        options = {"endpoint": endpoint, "region": "us-east-1"}
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        with pytest.raises(lazyckpt.StorageAccessError, match=DENIED):
            lazyckpt.open("s3://guarded/ckpt", storage_options=options)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEY000000000")
        with pytest.raises(lazyckpt.StorageAccessError, match="rejected the credentials"):
            lazyckpt.open("s3://guarded/ckpt", storage_options=options)


def test_an_overwrite_without_permission_to_write_keeps_the_old_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Credentials that may read, list and delete but not write: the overwrite stops
    before deleting anything."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    old = Path(lazyckpt.save(tmp_path / "old", {"w": np.arange(3.0)}))
    files = sum(1 for path in old.rglob("*") if path.is_file())
    # The administrator's requests: the bucket, the upload, the user, policy and key.
    with guarded_server(free_requests=files + 4) as endpoint:
        admin = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        admin_s3 = boto3.client("s3", **admin)
        admin_s3.create_bucket(Bucket="ckpts")
        upload(admin_s3, old, "old")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="deleter")
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": ["s3:GetObject", "s3:ListBucket", "s3:DeleteObject"],
                    "Resource": ["arn:aws:s3:::ckpts", "arn:aws:s3:::ckpts/*"],
                }
            ],
        }
        iam.put_user_policy(
            UserName="deleter", PolicyName="no-put", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName="deleter")["AccessKey"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        options = {"endpoint": endpoint, "region": "us-east-1"}
        with pytest.raises(lazyckpt.StorageAccessError, match=DENIED):
            lazyckpt.save(
                "s3://ckpts/old", {"w": np.zeros(3)}, overwrite=True, storage_options=options
            )
        # Every file of the old checkpoint is still there, byte for byte, fetched by
        # name: GetObject on `ckpts/*` means the same to every server, while moto's
        # evaluation of prefixed listings changed between releases.
        user = boto3.client(
            "s3",
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key=key["SecretAccessKey"],
            **admin,
        )
        for path in old.rglob("*"):
            if path.is_file():
                name = f"old/{path.relative_to(old).as_posix()}"
                assert user.get_object(Bucket="ckpts", Key=name)["Body"].read() == path.read_bytes()


def test_a_dead_endpoint_is_a_clear_error_within_a_minute(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    options = {"endpoint": f"http://127.0.0.1:{port}", "region": "us-east-1", "retries": 3}
    for call in (
        lambda: lazyckpt.open("s3://ckpts/run", storage_options=options),
        lambda: lazyckpt.save("s3://ckpts/new", {"w": np.zeros(2)}, storage_options=options),
    ):
        start = time.monotonic()
        with pytest.raises(lazyckpt.StorageAccessError, match=r"could not be reached"):
            call()
        assert time.monotonic() - start < 60


@pytest.mark.parametrize(
    "retries",
    ["3", True, 2.5, 0, "9" * 5000, 10**5000, None],
    ids=["str", "bool", "float", "zero", "5000 digits", "huge int", "None"],
)
def test_retries_that_are_no_count_of_attempts_are_a_clear_error(retries: object) -> None:
    """storage_options['retries'] is an int from 1 to 100, refused before any request
    (int() took '3', True and 2.5, made 0 one attempt, and a string of 5,000 digits
    ended as a storage request that failed with int()'s own message)."""
    options = {"endpoint": "http://127.0.0.1:9", "region": "us-east-1", "retries": retries}
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=r"^storage_options\['retries'\] takes the attempts at a storage request, an int "
        r"from 1 to 100, not .{1,90}; pass storage_options=\{'retries': 6\} or leave it out$",
    ):
        lazyckpt.open("s3://ckpts/run", storage_options=options)


def test_sharded_jax_arrays_save_to_a_bucket(s3: Any, mesh: Any) -> None:
    value = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    sharded = jax.device_put(value, NamedSharding(mesh, P("x", "y")))
    url = lazyckpt.save("s3://ckpts/sharded", {"w": sharded})
    lazy = lazyckpt.open(url)["w"]
    assert lazy.sharding.spec == P("x", "y")
    np.testing.assert_array_equal(lazy.get(), value)


def test_cli_on_a_bucket(s3: Any, saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    url = upload(s3, path, f"cli-{path.parent.name}")
    result = subprocess.run(
        [sys.executable, "-m", "lazyckpt._cli.main", "inspect", url, "--select", "params/dense"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"{url}: 2 arrays, 32.0 KiB"
    shown = subprocess.run(
        [sys.executable, "-m", "lazyckpt._cli.main", "show", url, "params/dense/bias[2:5]"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.stdout.splitlines()[-1] == "[2. 3. 4.]"


def test_open_and_slice_on_gcs(gcs: str, tmp_path: Path, mesh: Any) -> None:
    """gs:// through tensorstore's gcs driver. The emulator's object generations are
    not ones tensorstore's OCDBT driver accepts ("Malformed StorageGeneration"), so
    this uses Orbax's folder-per-array layout; OCDBT and saves on gs:// go through the
    same code as on s3:// but are not exercised here."""
    value = np.arange(96 * 8, dtype=np.float32).reshape(96, 8)
    tree = {"w": jax.device_put(value, NamedSharding(mesh, P("x"))), "step": 4}
    path = handler_save(use_ocdbt=False)(tmp_path / "ckpt", tree)
    bucket = ts.KvStore.open({"driver": "gcs", "bucket": "ckpts"}).result()
    for file in path.rglob("*"):
        if file.is_file():
            bucket.write(f"plain/{file.relative_to(path).as_posix()}", file.read_bytes()).result()
    opened = lazyckpt.open(f"{gcs}/plain")
    assert opened["step"] == 4 and opened["w"].sharding.spec == P("x")
    np.testing.assert_array_equal(opened["w"][30:50:3].get(), value[30:50:3])
    np.testing.assert_array_equal(lazyckpt.load(opened)["w"], value)


def test_a_bucket_checkpoint_converted_onto_itself(s3: Any) -> None:
    """An overwrite in a bucket is staged, so the tree may read from what it replaces."""
    url = lazyckpt.save("s3://ckpts/inplace", {"w": np.arange(6.0)})
    lazyckpt.convert(url, url, dtype="float16", overwrite=True)
    back = lazyckpt.open(url)["w"]
    assert back.dtype == np.float16
    np.testing.assert_array_equal(back.get(), np.arange(6.0, dtype=np.float16))
    model = lazyckpt.save("s3://ckpts/inplace-st", {"w": np.arange(6.0)}, format="safetensors")
    lazyckpt.convert(model, model, dtype="bfloat16", to="safetensors", overwrite=True)
    assert str(lazyckpt.open(model)["w"].dtype) == "bfloat16"
    listed = s3.list_objects_v2(Bucket="ckpts", Prefix="inplace")["Contents"]
    assert not [o["Key"] for o in listed if ".orbax-checkpoint-tmp" in o["Key"]]


def test_shards_left_without_their_index_can_be_saved_over(s3: Any) -> None:
    """What a copy step that failed before the index leaves: shards, no index. It
    does not open, and a save over it replaces it (the shards all parse)."""
    old = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(4)}
    url = lazyckpt.save("s3://ckpts/no-index", old, format="safetensors", max_shard_size=20_000)
    s3.delete_object(Bucket="ckpts", Key="no-index/model.safetensors.index.json")
    with pytest.raises(lazyckpt.UnfinishedCheckpointError):
        lazyckpt.open(url)
    lazyckpt.save(url, {"w": np.arange(3.0)}, format="safetensors", overwrite=True)
    np.testing.assert_array_equal(lazyckpt.open(url)["w"].get(), np.arange(3.0))
    s3.put_object(Bucket="ckpts", Key="fake/model-00001-of-00002.safetensors", Body=b"text")
    with pytest.raises(lazyckpt.CheckpointExistsError, match="does not look like"):
        lazyckpt.save("s3://ckpts/fake", {"w": np.ones(2)}, format="safetensors", overwrite=True)


_KILLED_OVERWRITE = """
import os, sys
import numpy as np
import lazyckpt
from lazyckpt._storage.bucket import BucketFolders

url, form, at, copying = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "copying"
write, counted = BucketFolders.write_bytes, []

def killed(self, path, data):
    if not copying or counted or path.endswith(".lazyckpt-overwrite"):
        counted.append(path)
    # The `at`-th upload, or with `copying` the `at`-th after the overwrite marker's.
    if len(counted) == at + copying:
        os._exit(9)  # as a SIGKILL: no clean-up runs
    write(self, path, data)

BucketFolders.write_bytes = killed
new = {f"w{i}": np.full((64, 64), 100 + i, np.float32) for i in range(4)}
shards = {"max_shard_size": 20_000} if form == "safetensors" else {}
lazyckpt.save(url, new, format=form, overwrite=True, **shards)
"""


def _killed_overwrite(
    s3: Any, url: str, form: Literal["orbax", "safetensors"], at: int, *, copying: bool
) -> dict[str, np.ndarray]:
    """Save an old checkpoint at `url`, then run an overwrite of it in a child process
    that kills itself at its `at`-th upload (see `_KILLED_OVERWRITE`); the old tree."""
    old = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(4)}
    shards: dict[str, Any] = {"max_shard_size": 20_000} if form == "safetensors" else {}
    lazyckpt.save(url, old, format=form, **shards)
    if copying:  # a file of the model folder that the overwrite keeps
        s3.put_object(Bucket="ckpts", Key=f"{url.split('/', 3)[3]}/config.json", Body=b"{}")
    where = "copying" if copying else "uploading"
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_OVERWRITE, url, form, str(at), where],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 9, done.stderr[-2000:]
    return old


@pytest.mark.parametrize(("form", "at"), [("safetensors", 3), ("safetensors", 6), ("orbax", 2)])
def test_an_overwrite_killed_in_a_bucket_keeps_the_old_checkpoint(
    s3: Any, form: Literal["orbax", "safetensors"], at: int
) -> None:
    """Killed at its `at`-th upload (the first is a write probe): after its first
    shard, before its index, after its data. The old model still opens whole, and the
    next overwrite succeeds."""
    url = f"s3://ckpts/killed-{form}-{at}"
    old = _killed_overwrite(s3, url, form, at, copying=False)
    assert_tree_equal(lazyckpt.load(lazyckpt.open(url)), old)
    staged = s3.list_objects_v2(Bucket="ckpts", Prefix=f"killed-{form}-{at}.orbax-checkpoint-tmp")
    assert staged["KeyCount"] > 0  # what the killed save wrote, never read
    new = {"w0": np.ones((8, 8), np.float32)}
    lazyckpt.save(url, new, format=form, overwrite=True)
    assert_tree_equal(lazyckpt.load(lazyckpt.open(url)), new)
    # The next save removed the killed one's staging: its process is gone.
    staged = s3.list_objects_v2(Bucket="ckpts", Prefix=f"killed-{form}-{at}.orbax-checkpoint-tmp")
    assert staged["KeyCount"] == 0


@pytest.mark.parametrize(("form", "at"), [("safetensors", 1), ("safetensors", 5), ("orbax", 2)])
def test_an_overwrite_killed_while_copying_in_says_where_the_new_one_is(
    s3: Any, form: Literal["orbax", "safetensors"], at: int
) -> None:
    """Killed after the old checkpoint was deleted, while the staged new one was being
    copied in: open says where the complete new one is, and a save over it works."""
    url = f"s3://ckpts/swap-{form}-{at}"
    _killed_overwrite(s3, url, form, at, copying=True)
    with pytest.raises(
        lazyckpt.UnfinishedCheckpointError,
        match=r"interrupted while it copied the new checkpoint in; the complete new "
        r"checkpoint is at s3://ckpts/swap-.*\.orbax-checkpoint-tmp-lazyckpt-",
    ):
        lazyckpt.open(url)
    new = {"w0": np.ones((8, 8), np.float32)}
    lazyckpt.save(url, new, format=form, overwrite=True)
    assert_tree_equal(lazyckpt.load(lazyckpt.open(url)), new)
    keys = [
        o["Key"] for o in s3.list_objects_v2(Bucket="ckpts", Prefix=f"swap-{form}-{at}")["Contents"]
    ]
    assert not [k for k in keys if "lazyckpt-overwrite" in k or "orbax-checkpoint-tmp" in k], keys


def test_urls_that_leave_the_bucket_are_refused(s3: Any) -> None:
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="would leave the bucket"):
        lazyckpt.save("s3://ckpts/../other/x", {"w": np.zeros(2)})
    with pytest.raises(lazyckpt.LazyckptError, match="mark unfinished saves"):
        lazyckpt.save("s3://ckpts/x.orbax-checkpoint-tmp", {"w": np.zeros(2)})


def test_a_bucket_checkpoint_overwritten_after_open_says_so(s3: Any) -> None:
    url = lazyckpt.save("s3://ckpts/replaced", {"w": np.arange(6.0), "note": "old"})
    lazy = lazyckpt.open(url)
    lazyckpt.save(url, {"w": np.arange(6.0) + 1, "note": "new"}, overwrite=True)
    for read in (lambda: lazy["w"].get(), lambda: lazyckpt.load(lazy)):
        with pytest.raises(
            lazyckpt.CheckpointChangedError,
            match=r"replaced was overwritten or changed since it was opened",
        ):
            read()
    reopened = lazyckpt.open(url)
    assert reopened["note"] == "new" and reopened["w"].get().tolist() == [1, 2, 3, 4, 5, 6]


def test_a_bucket_root_opens_saves_and_refuses_an_overwrite_up_front(s3: Any) -> None:
    """A bucket's root (`s3://BUCKET`) is a folder like any other, but nothing lies
    beside it: no overwrite marker is looked for there (`s3://BUCKET.lazyckpt-overwrite`
    names another bucket), and an overwrite, which stages beside, is refused before
    anything is written."""
    s3.create_bucket(Bucket="bare")
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match=r"^s3://bare does not exist"):
        lazyckpt.open("s3://bare")
    assert lazyckpt.save("s3://bare", {"w": np.arange(3.0)}) == "s3://bare"
    np.testing.assert_array_equal(lazyckpt.open("s3://bare/")["w"].get(), np.arange(3.0))
    with pytest.raises(lazyckpt.CheckpointExistsError, match=r"already exists"):
        lazyckpt.save("s3://bare", {"w": np.zeros(3)})
    with pytest.raises(
        lazyckpt.CheckpointExistsError,
        match=r"^s3://bare: the bucket's root holds a checkpoint, .*save to a folder in the "
        r"bucket \(s3://bare/NAME\), or delete the bucket's objects",
    ):
        lazyckpt.save("s3://bare", {"w": np.zeros(3)}, overwrite=True)
    np.testing.assert_array_equal(lazyckpt.open("s3://bare")["w"].get(), np.arange(3.0))
    s3.put_object(Bucket="bare", Key="_METADATA", Body=b"not json")
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"^s3://bare/_METADATA"):
        lazyckpt.open("s3://bare")


@pytest.mark.parametrize(
    ("url", "options", "found"),
    [
        ("s3://ckpts/run", {"regoin": "us-east-1"}, r"extra members: \"regoin\""),
        ("s3://ckpts/run", {"endpoint": 5}, r"endpoint=5 \(a str\)"),
        ("s3://ckpts/run", {"endpoint": "localhost:9000"}, r"an http:// or https:// URL"),
        ("s3://ckpts/run", {"requester_pays": "yes"}, r"requester_pays"),
        ("s3://ckpts/run", {"bucket": "other"}, r"\['bucket'\], which the URL gives"),
        ("gs://ckpts/run", {"endpoint": "http://127.0.0.1:9"}, r"extra members: \"endpoint\""),
    ],
)
def test_mistyped_bucket_options_are_refused_before_any_request(
    url: str, options: dict[str, object], found: str
) -> None:
    """As an https:// URL's are: a typo or a wrong type, at once, naming what a
    bucket's storage_options take (tensorstore refused them only at the first
    request, as a failed storage request)."""
    scheme = url.split(":", 1)[0]
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=rf"^{scheme}://ckpts/run: storage_options for {scheme}:// take \[.*'retries'\] and "
        rf"tensorstore's .* kvstore options \(.*\), not .*{found}.*; fix or remove that option$",
    ):
        lazyckpt.open(url, storage_options=options)


def test_a_bucket_name_that_cannot_be_one_is_named(s3: Any) -> None:
    with pytest.raises(
        lazyckpt.CheckpointNotFoundError,
        match=r"^s3://Bad_Bucket!/x: 'Bad_Bucket!' is not a bucket's name \(.*\); check the URL",
    ):
        lazyckpt.open("s3://Bad_Bucket!/x")
