"""`convert` in every process of a `jax.distributed` job (2 and 4 processes on
127.0.0.1, gloo): each process converts its share, the result is the one a single
process writes, each stored byte is read once across the job, and a failure in one
process fails every process and publishes nothing.

Each job runs every conversion below in one start of its workers
(`tests/fleet_worker.py`), which are killed on timeout, so the suite never hangs.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import lazyckpt
from lazyckpt._orbax.metadata import process_folder

ROOT = Path(__file__).parent.parent
TIMEOUT = 300
SHARD = "40KB"  # (the plain model's tensors make several files of it)
NO_SPACE = "injected: No space left on device"


def _folder(path: Path, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> Path:
    """A Hugging Face model folder: two shards written by `safetensors`, their index,
    and `config.json`."""
    path.mkdir(parents=True)
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(path / shard))
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _plain() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    out = {"model.embed_tokens.weight": rng.standard_normal((128, 64), dtype=np.float32)}
    for i in range(6):
        out[f"model.layers.{i}.attn.weight"] = rng.standard_normal((64, 96), dtype=np.float32)
        out[f"model.layers.{i}.norm.weight"] = rng.standard_normal(96).astype(bf16)
    out["lm_head.weight"] = rng.standard_normal((128, 64), dtype=np.float32)
    return out


def _fp8() -> dict[str, np.ndarray]:
    """A DeepSeek-style layer: FP8 weights with 128x128 block scales (shapes that are
    not multiples of the block), and a dense norm."""
    rng = np.random.default_rng(1)
    out = {}
    for e in range(3):
        for name, shape in (("gate_proj", (200, 300)), ("down_proj", (300, 200))):
            prefix = f"model.layers.0.mlp.experts.{e}.{name}"
            values = rng.normal(0, 2, size=shape).astype(np.float32)
            out[f"{prefix}.weight"] = values.astype(ml_dtypes.float8_e4m3fn)
            scales = tuple(math.ceil(n / 128) for n in shape)
            out[f"{prefix}.weight_scale_inv"] = rng.uniform(0.01, 2, scales).astype(np.float32)
    out["model.layers.0.input_layernorm.weight"] = rng.normal(size=300).astype(ml_dtypes.bfloat16)
    return out


FP8_CONFIG = {
    "model_type": "deepseek_v3",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
SELECT = ["model/layers/**"]
RENAME = [["^model/layers/", "blocks/"]]
# name: (source, convert's keywords, the process whose writing fails and where)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
    "orbax": ("plain", {"progress": True}, None),
    "safetensors": ("plain", {"to": "safetensors", "max_shard_size": SHARD}, None),
    "dequantized": (
        "fp8",
        {"to": "safetensors", "dequantize": True, "max_shard_size": "100KB"},
        None,
    ),
    "selected": ("plain", {"select": SELECT, "rename": RENAME}, None),
    # One array, larger than a share: divided by its rows of chunks.
    "large": ("plain", {"select": "model/embed_tokens/weight", "chunk_bytes": "4KB"}, None),
    "one.safetensors": ("plain", {}, None),  # (one file: process 0 writes it)
    "fails_orbax": ("plain", {}, {"process": 1, "where": "orbax"}),
    "fails_safetensors": (
        "plain",
        {"to": "safetensors", "max_shard_size": SHARD},
        {"process": 1, "where": "safetensors"},
    ),
    # A transform adds a jax.Array leaf (`tests/fleet_worker.py`: `add_jax_leaf`).
    "jax_leaf": ("plain", {"add_jax_leaf": True}, None),
    "global_jax_leaf": ("plain", {"add_jax_leaf": "global"}, None),
    # Dequantized to Orbax, one weight larger than a share: parts of its chunk rows.
    "dequantized_orbax": ("fp8_tall", {"dequantize": True, "chunk_bytes": "16KB"}, None),
    # Process 1 divides the work otherwise than the others.
    "division_orbax": ("plain", {}, {"process": 1, "where": "division"}),
    "division_safetensors": (
        "plain",
        {"to": "safetensors", "max_shard_size": SHARD},
        {"process": 1, "where": "division"},
    ),
    # Process 1 writes its safetensors files where process 0 cannot see them.
    "unshared": (
        "plain",
        {"to": "safetensors", "max_shard_size": SHARD},
        {"process": 1, "where": "unshared"},
    ),
    # (last: process 1's copy of the source is missing, so it fails opening it)
    "fails_opening": ("plain", {}, {"process": 1, "where": "source"}),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("fleet_sources")
    plain, fp8, tall = _plain(), _fp8(), _fp8_tall()
    return {
        "plain": (_folder(root / "plain", plain, {"model_type": "llama"}), plain),
        "fp8": (_folder(root / "fp8", fp8, FP8_CONFIG), fp8),
        "fp8_tall": (_folder(root / "fp8_tall", tall, FP8_CONFIG), tall),
    }


def _fp8_tall() -> dict[str, np.ndarray]:
    """An FP8 weight of 8 rows of 128x128 scale blocks, larger than a share, beside
    three smaller ones (one not a whole number of blocks)."""
    rng = np.random.default_rng(2)
    out = {}
    shapes = {"w": (1024, 256), "u": (256, 256), "v": (200, 256), "x": (256, 300)}
    for name, shape in shapes.items():
        values = rng.normal(0, 2, size=shape).astype(np.float32)
        out[f"model.{name}.weight"] = values.astype(ml_dtypes.float8_e4m3fn)
        scales = tuple(math.ceil(n / 128) for n in shape)
        out[f"model.{name}.weight_scale_inv"] = rng.uniform(0.01, 2, scales).astype(np.float32)
    return out


def _convert_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A case's keywords for `convert` in this process (`add_jax_leaf` as the worker
    does it)."""
    out = {k: v for k, v in kwargs.items() if k != "add_jax_leaf"}
    if kwargs.get("add_jax_leaf") is True:
        out["transform"] = lambda tree: {**tree, "extra": jnp.arange(8.0)}
    return out


@pytest.fixture(scope="module")
def references(
    sources: dict[str, tuple[Path, dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Each conversion made by this (single) process."""
    root = tmp_path_factory.mktemp("fleet_references")
    out = {}
    for name, (source, kwargs, fail) in CASES.items():
        if fail is None and kwargs.get("add_jax_leaf") != "global":
            with warnings.catch_warnings():  # (select= and rename= and config.json)
                warnings.simplefilter("ignore", lazyckpt.CarriedFilesWarning)
                out[name] = Path(
                    lazyckpt.convert(sources[source][0], root / name, **_convert_kwargs(kwargs))
                )
    return out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _results(out: str) -> list[dict[str, Any]]:
    """The JSON lines a worker printed (gloo's logging may share their lines)."""
    decoder, results = json.JSONDecoder(), []
    start = out.find('{"do": ')
    while start != -1:
        result, end = decoder.raw_decode(out, start)
        results.append(result)
        start = out.find('{"do": ', end)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def job(
    request: pytest.FixtureRequest,
    sources: dict[str, tuple[Path, dict[str, Any]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[int, Path, dict[str, list[dict[str, Any]]]]:
    """Every case converted by `count` processes: (count, the destinations' folder,
    {case: each process's result})."""
    count = int(request.param)
    root = tmp_path_factory.mktemp(f"fleet_{count}")
    steps = [
        {
            "source": str(sources[source][0]),
            "destination": str(root / name),
            "kwargs": {k: v for k, v in kwargs.items() if k != "add_jax_leaf"},
            "fail": fail,
            "add_jax_leaf": kwargs.get("add_jax_leaf", False),
        }
        for name, (source, kwargs, fail) in CASES.items()
    ]
    port = _free_port()
    workers = []
    for process in range(count):
        config = {"process": process, "processes": count, "port": port, "steps": steps}
        workers.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.fleet_worker", json.dumps(config)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=TIMEOUT)
            if worker.returncode != 0:
                raise AssertionError(f"worker failed ({worker.returncode}):\n{err[-3000:]}")
            outputs.append([{**result, "stderr": err} for result in _results(out)])
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate(timeout=60)
    by_case = {name: [output[i] for output in outputs] for i, name in enumerate(CASES)}
    return count, root, by_case


def _succeeded(results: list[dict[str, Any]]) -> None:
    assert [r["error"] for r in results] == [None] * len(results), results


def _same_files(got: Path, want: Path) -> None:
    """The same file names, each byte for byte."""
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
    for path in want.iterdir():
        assert (got / path.name).read_bytes() == path.read_bytes(), path.name


def _same_arrays(got: Path, want: Path) -> None:
    """The same tree, each array bit for bit."""
    mine, theirs = (
        dict(lazyckpt.leaves(lazyckpt.open(got))),
        dict(lazyckpt.leaves(lazyckpt.open(want))),
    )
    assert sorted(mine) == sorted(theirs)
    for key, leaf in theirs.items():
        value, expected = mine[key].get(), leaf.get()
        assert value.dtype == expected.dtype and value.tobytes() == expected.tobytes(), key


def _writers(checkpoint: Path, count: int) -> list[int]:
    """The processes whose OCDBT database in `checkpoint` holds chunk data."""
    return [
        i
        for i in range(count)
        if any(p.stat().st_size > 0 for p in (checkpoint / process_folder(i)).glob("d/*"))
    ]


def test_orbax_destination_is_divided_among_the_processes_and_equals_one_process(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], references: dict[str, Path]
) -> None:
    count, root, results = job
    _succeeded(results["orbax"])
    _same_arrays(root / "orbax", references["orbax"])
    assert _writers(root / "orbax", count) == list(range(count))  # every process wrote
    assert (root / "orbax" / "huggingface" / "config.json").is_file()  # carried, once
    # Each process's bar counts its own bytes, and says the job's.
    for process, result in enumerate(results["orbax"]):
        label = f"lazyckpt convert (process {process} of {count}: "
        assert label in result["stderr"] and "of the job's 209.1 KiB)" in result["stderr"]


def test_safetensors_folder_has_the_single_process_files_and_index(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], references: dict[str, Path]
) -> None:
    _, root, results = job
    _succeeded(results["safetensors"])
    assert len(list(references["safetensors"].glob("*.safetensors"))) >= 4
    _same_files(root / "safetensors", references["safetensors"])


def test_dequantizing_convert_writes_the_single_process_files(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], references: dict[str, Path]
) -> None:
    _, root, results = job
    _succeeded(results["dequantized"])
    assert len(list(references["dequantized"].glob("*.safetensors"))) >= 2
    _same_files(root / "dequantized", references["dequantized"])  # config.json fitted too


def test_selected_and_renamed_convert_equals_one_process(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], references: dict[str, Path]
) -> None:
    count, root, results = job
    _succeeded(results["selected"])
    _same_arrays(root / "selected", references["selected"])
    assert sorted(lazyckpt.open(root / "selected")) == ["blocks"]
    assert _writers(root / "selected", count) == list(range(count))


def test_an_array_larger_than_a_share_is_divided_by_its_chunks(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], references: dict[str, Path]
) -> None:
    count, root, results = job
    _succeeded(results["large"])
    _same_arrays(root / "large", references["large"])
    (key, leaf), *others = lazyckpt.leaves(lazyckpt.open(root / "large"))
    assert not others and leaf.chunks[0] * count < leaf.shape[0], (key, leaf)
    assert _writers(root / "large", count) == list(range(count))  # each wrote some rows
    import orbax.checkpoint as ocp  # (Orbax restores what they wrote together)

    restored = ocp.PyTreeCheckpointer().restore(str(root / "large"))
    np.testing.assert_array_equal(restored["model"]["embed_tokens"]["weight"], leaf.get())


def test_one_safetensors_file_is_written_by_process_0_as_one_process_writes_it(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]],
    references: dict[str, Path],
    sources: dict[str, tuple[Path, dict[str, Any]]],
) -> None:
    _, root, results = job
    _succeeded(results["one.safetensors"])
    assert (root / "one.safetensors").read_bytes() == references["one.safetensors"].read_bytes()
    stored = sum(t.nbytes for t in sources["plain"][1].values())
    shares = [r["direct"] - r["opened"] for r in results["one.safetensors"]]
    assert shares == [stored] + [0] * (len(shares) - 1), shares


@pytest.mark.parametrize("case", ["fails_orbax", "fails_safetensors"])
def test_a_failure_in_one_process_fails_every_process_and_publishes_nothing(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], case: str
) -> None:
    _, root, results = job
    for result in results[case]:
        error = result["error"]
        assert error is not None and "process 1 failed" in error, result
        assert NO_SPACE in error, result
    assert not (root / case).exists()
    # (nor anything left beside it: the temporary folder went too)
    assert not [p.name for p in root.iterdir() if p.name.startswith(case)]


@pytest.mark.parametrize("case", ["orbax", "safetensors", "dequantized", "selected", "large"])
def test_bytes_read_across_the_job_equal_the_stored_bytes(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]],
    sources: dict[str, tuple[Path, dict[str, Any]]],
    case: str,
) -> None:
    """Each process reads the headers (as `open` does) and its share of the tensors'
    bytes: together, every stored byte once. Its share is not empty."""
    count, _, results = job
    _succeeded(results[case])
    source, kwargs, _ = CASES[case]
    tensors = sources[source][1]
    prefix = {"selected": "model.layers.", "large": "model.embed_tokens."}.get(case, "")
    converted = [name for name in tensors if name.startswith(prefix)]
    stored = sum(tensors[name].nbytes for name in converted)
    # Bytes read from the source's files (a local safetensors source is read without
    # tensorstore; an Orbax destination's own b-tree reads are tensorstore's).
    shares = [r["direct"] - r["opened"] for r in results[case]]
    print(f"{case}, {count} processes: read {shares} of the stored {stored} bytes")
    assert sum(shares) == stored, shares
    assert all(share > 0 for share in shares), shares
    if kwargs.get("to") == "safetensors":  # (nothing else read: all that measure() saw)
        assert sum(r["measured"] - r["opened"] for r in results[case]) == stored


def test_views_of_one_tensor_are_written_by_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two leaves reading the same bytes of a file (a tied embedding's two names, rows
    of one tensor that overlap) go to one process, so the bytes are read once, while a
    tensor of its own goes to the other."""
    from lazyckpt._convert import fleet
    from lazyckpt._storage import multihost

    rng = np.random.default_rng(0)
    tensors = {
        "embed": rng.standard_normal((64, 32), np.float32),
        "other": rng.standard_normal((64, 32), np.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    tree = lazyckpt.open(tmp_path / "model.safetensors")
    embed, other = tree["embed"], tree["other"]
    monkeypatch.setattr(multihost, "count", lambda: 2)
    # (apart, the least loaded process after `other` and `embed` would take `embed[:8]`)
    units = [([other], other.nbytes), ([embed], embed.nbytes), ([embed[:8]], 8 * 32 * 4)]
    owners = fleet.divide(units)
    assert owners[1] == owners[2] != owners[0], owners


def test_a_process_that_cannot_open_the_source_fails_every_process_at_once(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]],
) -> None:
    """Before any process waits on the others for what it writes, a failure to open
    or reshape the tree (this process's copy of the source is missing) is agreed:
    every process raises naming process 1 and its error, instead of waiting on it
    until the job's own timeout."""
    _, root, results = job
    for result in results["fails_opening"]:
        error = result["error"]
        assert error is not None and "process 1 failed" in error, result
        assert "opening" in error and "-missing" in error, result
    assert not (root / "fails_opening").exists()


def test_a_jax_array_leaf_is_written_once_by_process_0(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], references: dict[str, Path]
) -> None:
    """A transform's jax.Array leaf (each process holds it on its own device) is
    written as a NumPy leaf is, by process 0: the checkpoint is one process's."""
    _, root, results = job
    _succeeded(results["jax_leaf"])
    _same_arrays(root / "jax_leaf", references["jax_leaf"])
    extra = lazyckpt.open(root / "jax_leaf")["extra"].get()
    np.testing.assert_array_equal(extra, np.arange(8.0, dtype=extra.dtype))


def test_a_jax_array_sharded_across_the_processes_is_refused_on_every_process(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]],
) -> None:
    _, root, results = job
    for result in results["global_jax_leaf"]:
        error = result["error"]
        assert error is not None and error.startswith("ShardingError"), result
        assert "extra is a jax.Array sharded across the processes" in error, result
    assert not (root / "global_jax_leaf").exists()


def test_a_dequantizing_convert_to_orbax_divided_by_rows_equals_one_process(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], references: dict[str, Path]
) -> None:
    """(The weight larger than a share goes in parts of its chunk rows, written by
    one process: each part of a dequantized weight reads all of its stored weight
    and scales.)"""
    count, root, results = job
    _succeeded(results["dequantized_orbax"])
    _same_arrays(root / "dequantized_orbax", references["dequantized_orbax"])
    assert _writers(root / "dequantized_orbax", count) == list(range(count))


@pytest.mark.parametrize("case", ["division_orbax", "division_safetensors"])
def test_processes_that_divide_the_work_differently_fail_and_publish_nothing(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]], case: str
) -> None:
    """(Process 1 gives each unit to the next process: each array would be written
    twice or not at all.)"""
    _, root, results = job
    for result in results[case]:
        error = result["error"]
        assert error is not None and error.startswith("TreeMismatchError"), result
        assert "disagree on the division of the work" in error and "[1]" in error, result
    assert not (root / case).exists()
    assert not [p.name for p in root.iterdir() if p.name.startswith(case)]


def test_safetensors_files_process_0_cannot_see_fail_every_process(
    job: tuple[int, Path, dict[str, list[dict[str, Any]]]],
) -> None:
    """Process 1 wrote its files elsewhere (not the shared file system): process 0
    names them instead of publishing a folder without them."""
    _, root, results = job
    for result in results["unshared"]:
        error = result["error"]
        assert error is not None and "process 0 failed" in error, result
        assert "same shared file system or bucket" in error, result
        assert ".safetensors" in error, result
    assert not (root / "unshared").exists()
    assert not [p.name for p in root.iterdir() if p.name.startswith("unshared")]


def test_layers_of_a_stacked_array_stored_in_chunks_are_divided_by_their_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stacked (8, 256, 256) Orbax array stored in (1, 32, 256) chunks, unstacked
    into 8 layer views: each layer reads its own chunks, so 4 processes get 2 layers
    each; views that share a stored chunk stay with one process."""
    from lazyckpt._convert import fleet
    from lazyckpt._storage import multihost

    rng = np.random.default_rng(0)
    stacked = rng.standard_normal((8, 256, 256), dtype=np.float32)
    lazyckpt.save(tmp_path / "ckpt", {"w": stacked}, chunk_bytes="32KiB", progress=False)
    w = lazyckpt.open(tmp_path / "ckpt")["w"]
    assert w.chunks == (1, 32, 256), w.chunks
    monkeypatch.setattr(multihost, "count", lambda: 4)
    owners = fleet.divide([([w[i]], w[i].nbytes) for i in range(8)])
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3], owners
    # w[0, :200] and w[0, 200:] share the chunk of rows 192..223: apart, the greedy
    # would give w[0, 200:] to the process w[1, :128] went to.
    monkeypatch.setattr(multihost, "count", lambda: 2)
    units = [([w[0, :200]], 200 * 1024), ([w[1, :128]], 128 * 1024), ([w[0, 200:]], 56 * 1024)]
    owners = fleet.divide(units)
    assert owners[0] == owners[2] != owners[1], owners


def test_an_interrupt_on_process_0_while_publishing_still_reaches_the_last_agreement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Process 0 interrupted (KeyboardInterrupt) while merging and publishing an Orbax
    save made together: it still tells the others (which wait on that agreement),
    then the interrupt goes on; nothing is published. (Process 1 is simulated: every
    collective sees its values equal to process 0's.)"""
    from lazyckpt._engine.scheduler import Scheduler
    from lazyckpt._orbax import write_together
    from lazyckpt._storage import multihost

    told: list[str] = []
    gather_text = multihost.gather_text

    def recorded(text: str) -> list[str]:
        told.append(text)
        return gather_text(text)

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(multihost, "count", lambda: 2)
    monkeypatch.setattr(multihost, "index", lambda: 0)
    monkeypatch.setattr(multihost, "broadcast_text", lambda text: text)
    monkeypatch.setattr(multihost, "_allgather", lambda values: np.stack([values, values]))
    monkeypatch.setattr(multihost, "gather_text", recorded)
    monkeypatch.setattr(write_together, "_merge", interrupted)
    final = str(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        write_together.save_together(final, [], Scheduler(None), False, lambda _: False, {})
    assert told == ["", "KeyboardInterrupt:"], told  # (the writing's, then publishing's)
    assert list(tmp_path.iterdir()) == []
