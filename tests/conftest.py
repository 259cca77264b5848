"""Shared fixtures: reference checkpoints written by orbax, byte counters, a reader double.

The root conftest.py fakes the 8 CPU devices before jax starts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import settings
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lazyckpt._storage.metrics import bytes_read
from tests.helpers import CREDENTIALS, ZARR_FORMATS, orbax_save, reference_tree, refuse_data_reads

# The scripts that wrote the fixtures need their writers (torch), which are not test
# dependencies; `--doctest-modules` would import them.
collect_ignore = ["fixtures"]

# The same examples on every run, so that a run on a clean machine tries what the last
# one did (one clean-clone run met hypothesis's "inconsistent data generation" in a
# test whose draws depend only on earlier draws, not reproduced since). To explore new
# examples: LAZYCKPT_HYPOTHESIS=explore pytest tests/test_properties.py.
settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("LAZYCKPT_HYPOTHESIS", "fixed"))


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """A small OCDBT checkpoint whose chunk data lives in ocdbt.process_0/d/."""
    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal((64, 64), dtype=np.float32), "b": {"c": np.arange(3)}}
    return orbax_save(tmp_path / "small", tree)


@pytest.fixture(scope="session")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("x", "y"))


@pytest.fixture(scope="session", params=ZARR_FORMATS)
def saved(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    mesh: jax.sharding.Mesh,
) -> tuple[Path, dict[str, Any]]:
    """The reference tree saved by orbax (zarr v2 and zarr3, OCDBT), and the tree."""
    tree = reference_tree(mesh)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    orbax_save(path, tree, zarr3=request.param == "zarr3")
    return path, tree


@pytest.fixture
def count_bytes() -> Callable[[], contextlib.AbstractContextManager[list[int]]]:
    """A context manager whose list holds, after the block, the bytes it read."""

    @contextlib.contextmanager
    def counting() -> Iterator[list[int]]:
        result: list[int] = []
        before = bytes_read()
        yield result
        result.append(bytes_read() - before)

    return counting


@pytest.fixture
def no_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of array data in the test fails it."""
    refuse_data_reads(monkeypatch)


@pytest.fixture(scope="session")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """256 MiB in 4 float32 arrays, saved by orbax from 2 devices: 8 chunks of 32 MiB."""
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("d",))
    rng = np.random.default_rng(3)
    tree = {
        f"layer_{i}": jax.device_put(
            rng.standard_normal((4096, 4096), dtype=np.float32), NamedSharding(mesh, P("d"))
        )
        for i in range(4)
    }
    return orbax_save(tmp_path_factory.mktemp("wide") / "ckpt", tree)


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1 with a bucket `ckpts`; its endpoint in the
    environment, as users set it."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        with pytest.MonkeyPatch.context() as env:
            for key, value in CREDENTIALS.items():
                env.setenv(key, value)
            env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
            client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
            client.create_bucket(Bucket="ckpts")
            yield client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    """A Google Cloud Storage emulator on 127.0.0.1 with a bucket `ckpts`; tensorstore's
    gcs driver pointed at it the way its own tests do."""
    server_module = pytest.importorskip("gcp_storage_emulator.server")
    server = server_module.create_server("127.0.0.1", 0, in_memory=True, default_bucket="ckpts")
    server.start()
    port = server._api._httpd.server_port
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{port}")
            env.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "lazyckpt-test")
            yield "gs://ckpts"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """docs/tutorial.ipynb run from top to bottom in a real Jupyter kernel (once a
    session: the notebook test and the browser test read its outputs)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(Path(__file__).parent.parent / "docs" / "tutorial.ipynb", as_version=4)
    folder = tmp_path_factory.mktemp("tutorial")
    env_flags = os.environ.pop("XLA_FLAGS", None)  # the notebook sets its own
    try:
        client = nbclient.NotebookClient(
            notebook,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(folder)}},
        )
        client.execute()
    finally:
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    return notebook


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A loopback Hugging Face Hub (`tests/hub_server.py`) that `huggingface_hub` and
    `hf://` paths talk to, with an empty cache and no token. `huggingface_hub` reads
    HF_ENDPOINT at import, into two constants, so both are patched here."""
    constants = pytest.importorskip("huggingface_hub.constants")
    from tests.hub_server import HubServer

    with HubServer(tmp_path / "hub", valid_tokens={"member", "stranger"}) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        template = server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        yield server
