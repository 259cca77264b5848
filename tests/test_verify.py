"""`verify` and checksummed writes: damage is found and named by key path, never
silently decoded into wrong values, for checkpoints lazyckpt writes."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from lazyckpt._cli.main import main
from tests.helpers import orbax_save

FLIPS = 200


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """lazyckpt's own checkpoint: a 2 MiB chunk (decoded by lazyckpt), a 256 KiB one
    (read by tensorstore) and a scalar."""
    rng = np.random.default_rng(5)
    tree = {
        "big": rng.standard_normal((512, 1024)).astype(np.float32),
        "small": rng.standard_normal((256, 256)).astype(np.float32),
        "step": np.int64(7),
    }
    path = tmp_path_factory.mktemp("written") / "ckpt"
    lazyckpt.save(path, tree, chunk_bytes=2 << 20)
    return path, tree


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "d").iterdir() if p.is_file())


def test_orbax_restores_checksummed_chunks(written: tuple[Path, dict[str, Any]]) -> None:
    import orbax.checkpoint as ocp

    path, tree = written
    meta = json.loads(lazyckpt.open(path)["big"].stored.store.read_keys(["big/zarr.json"])[0])
    inner = meta["codecs"][0]["configuration"]["codecs"]
    assert {"name": "zstd", "configuration": {"level": 1, "checksum": True}} in inner
    restored = ocp.PyTreeCheckpointer().restore(path)
    for key in ("big", "small"):
        np.testing.assert_array_equal(restored[key], tree[key])


def test_bit_flips_in_lazyckpt_data_are_errors_never_wrong_values(
    written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Every single-bit flip in the data files either changes nothing read (a bit
    the decoders ignore) or is reported: by `verify` as damage under the array's key
    path, and by `load` as CorruptCheckpointError. (Without checksums, 138 of 200
    flips decoded to wrong values with no error.)"""
    path, tree = written
    files = _data_files(path)
    sizes = [f.stat().st_size for f in files]
    pick = random.Random(11)
    outcomes = {"reported": 0, "harmless": 0}
    for _ in range(FLIPS):
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(path, work)
        (i,) = pick.choices(range(len(files)), weights=sizes)
        target = work / "d" / files[i].name
        data = bytearray(target.read_bytes())
        data[pick.randrange(len(data))] ^= 1 << pick.randrange(8)
        target.write_bytes(bytes(data))
        try:
            lazy = lazyckpt.open(work)
        except lazyckpt.CorruptCheckpointError:
            outcomes["reported"] += 1  # the flip hit the b-tree: open says so
            continue
        result = lazyckpt.verify(lazy, progress=False)
        try:
            loaded = lazyckpt.load(lazy)
        except lazyckpt.CorruptCheckpointError as error:
            assert not result.ok, f"load found damage verify missed: {error}"
            assert {d.key for d in result.damaged} <= set(tree)
            outcomes["reported"] += 1
            continue
        for key, want in tree.items():
            np.testing.assert_array_equal(loaded[key], want, err_msg=f"silent damage in {key}")
        assert result.ok, result
        outcomes["harmless"] += 1
    assert outcomes["reported"] > FLIPS // 2, outcomes


def test_verify_reports_every_damaged_array_and_goes_on(tmp_path: Path) -> None:
    """An Orbax checkpoint without OCDBT: one chunk file deleted, one truncated, one
    with a flipped bit. The first two are damage named by key path; the flip is not
    detectable (Orbax writes no checksums), and the report says which arrays those are."""
    rng = np.random.default_rng(1)
    tree = {
        "layers": [{"w": rng.standard_normal((512, 1024)).astype(np.float32)} for _ in range(3)],
        "bias": np.ones(8, np.float32),
    }
    path = orbax_save(tmp_path / "ckpt", tree, use_ocdbt=False)
    (path / "layers.0.w" / "0.0").unlink()
    chunk = path / "layers.1.w" / "0.0"
    chunk.write_bytes(chunk.read_bytes()[:-100])
    chunk = path / "layers.2.w" / "0.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))

    result = lazyckpt.verify(lazyckpt.open(path), progress=False)
    assert not result.ok and (result.arrays, result.chunks) == (4, 3)  # 3 chunks are there
    assert [d.key for d in result.damaged] == ["layers/0/w", "layers/1/w"]
    assert (
        result.damaged[0].problem
        == "chunk [0, 0] (stored as 'layers.0.w/0.0') is missing from the store"
    )
    assert "chunk [0, 0]" in result.damaged[1].problem
    assert result.unchecked == ["bias", "layers/0/w", "layers/1/w", "layers/2/w"]
    text = str(result)
    assert text.startswith("4 arrays, 3 chunks, 4.0 MiB decoded: 2 damaged\n  layers/0/w: ")
    assert "4 of the arrays carry no checksums" in text
    # A selection verifies only what it names.
    assert lazyckpt.verify(lazyckpt.open(path), "layers/2/**", progress=False).ok


def test_verify_command(written: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any) -> None:
    path, _ = written
    assert main(["verify", str(path), "--quiet"]) == 0
    assert capsys.readouterr().out == "2 arrays, 2 chunks, 2.2 MiB decoded: no damage found\n"
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    big = max(_data_files(damaged), key=lambda f: f.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 1
    big.write_bytes(bytes(data))
    assert main(["verify", str(damaged), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and [d["key"] for d in report["damaged"]] == ["big"]
    assert "checksum" in report["damaged"][0]["problem"] and report["unchecked"] == []


def test_verify_work_follows_what_is_stored(tmp_path: Path) -> None:
    """A header edited to declare 10**15 rows: verify lists what is stored, decodes
    that, and counts the missing chunks without visiting them (in a child process
    with a memory limit and a timeout). Sharded zarr3: a missing shard is named."""
    from tests.helpers import run_cases

    value = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    folders = orbax_save(tmp_path / "folders", {"w": value, "v": value}, use_ocdbt=False)
    header = folders / "w" / ".zarray"
    header.write_text(header.read_text().replace('"shape":[512', '"shape":[1000000000000000'))
    sharded = orbax_save(
        tmp_path / "sharded", {"w": np.zeros((8, 1024), np.float32)}, zarr3=True, use_ocdbt=False
    )
    meta = json.loads((sharded / "w" / "zarr.json").read_text())
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    cases = [
        {"name": "declared", "path": str(folders), "do": "verify"},
        {"name": "sharded", "path": str(sharded), "do": "verify"},
    ]
    (sharded / "w" / "c" / "0" / "0").unlink()
    outcomes = run_cases(cases, tmp_path, timeout=120)
    assert outcomes["declared"].startswith("ok: 2 arrays, 2 chunks, 4.0 MiB decoded: 1 damaged\n")
    missing = 10**15 // 512 - 1
    assert (
        f"  w: {missing} of its {missing + 1} chunks are missing from the store, "
        in (outcomes["declared"])
    )
    assert shard == [8, 1024]
    assert "w: shard [0, 0] (stored as 'w/c/0/0') is missing" in outcomes["sharded"]


@pytest.fixture(scope="module")
def ocdbt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCDBT checkpoint of five arrays, written by Orbax."""
    rng = np.random.default_rng(2)
    tree = {
        "layers": [{"w": rng.standard_normal((64, 64)).astype(np.float32)} for _ in range(4)],
        "bias": np.ones(8, np.float32),
    }
    return orbax_save(tmp_path_factory.mktemp("ocdbt") / "ckpt", tree)


def _damaged_copy(path: Path, tmp_path: Path, name: str, damage: Any) -> Path:
    work = Path(shutil.copytree(path, tmp_path / name))
    damage(work)
    return work


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _node_file(path: Path) -> Path:
    """The file holding the b-tree nodes: Orbax merges the per-process databases into
    the root's, whose `d/` holds the nodes; the values stay in `ocdbt.process_0/d/`.
    Found by trying: damage to this file, and to no other, stops `open`."""
    stopping = []
    for file in sorted(path.glob("**/d/*")):
        work = path.parent / "probe"
        shutil.rmtree(work, ignore_errors=True)
        _flip(Path(shutil.copytree(path, work)) / file.relative_to(path))
        try:
            lazyckpt.open(work)
        except lazyckpt.CorruptCheckpointError:
            stopping.append(file)
    shutil.rmtree(path.parent / "probe")
    assert len(stopping) == 1 and stopping[0].parent == path / "d", stopping
    return stopping[0]


ARRAYS = ["bias", "layers/0/w", "layers/1/w", "layers/2/w", "layers/3/w"]


@pytest.mark.parametrize(("damage", "why"), [(_flip, "b-tree node"), (_truncate, "not valid")])
def test_a_damaged_btree_node_ends_in_the_report(
    ocdbt: Path, tmp_path: Path, capsys: Any, damage: Any, why: str
) -> None:
    """The one b-tree node holds every key: the report names every array as not
    checked, with the reason in a line; the command prints it and exits with 1."""
    node = _node_file(ocdbt).relative_to(ocdbt)
    work = _damaged_copy(ocdbt, tmp_path, "work", lambda p: damage(p / node))
    result = lazyckpt.verify(work, progress=False)
    assert not result.ok and not result.opened and result.damaged == []
    assert [d.key for d in result.not_checked] == ARRAYS
    assert len({d.problem for d in result.not_checked}) == 1
    problem = result.not_checked[0].problem
    assert "\n" not in problem and why in problem and str(node.name) in problem
    lines = str(result).splitlines()
    assert lines == [
        "the checkpoint does not open: none of its 5 arrays was checked",
        f"  not checked: bias, layers/{{0..3}}/w: {problem}",
    ]
    selected = lazyckpt.verify(work, "layers/**", progress=False)
    assert [d.key for d in selected.not_checked] == ARRAYS[1:]
    capsys.readouterr()
    assert main(["verify", str(work), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == lines and err == ""
    assert main(["verify", str(work), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and not report["opened"]
    assert [d["key"] for d in report["not_checked"]] == ARRAYS


def test_damaged_values_are_named_and_the_rest_is_fine(
    ocdbt: Path, tmp_path: Path, capsys: Any
) -> None:
    """The values file of one array truncated, the others intact."""
    files = sorted((ocdbt / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)
    work = _damaged_copy(
        ocdbt, tmp_path, "work", lambda p: _truncate(p / files[-1].relative_to(ocdbt))
    )
    result = lazyckpt.verify(work, progress=False)
    damaged = [d.key for d in result.damaged]
    assert not result.ok and result.opened and damaged and not result.not_checked
    assert sorted(damaged + result.fine) == ARRAYS and "bias" in result.fine
    assert all("not valid for value of size" in d.problem for d in result.damaged)
    lines = str(result).splitlines()
    assert lines[0].endswith(f"decoded: {len(damaged)} damaged")
    assert lines[-2].startswith("  fine: bias")  # folded: layers/{0,1}/w
    assert main(["verify", str(work), "--quiet"]) == 1
    assert capsys.readouterr().out.splitlines() == lines


def test_a_checkpoint_that_does_not_open_is_one_entry(
    ocdbt: Path, tmp_path: Path, capsys: Any
) -> None:
    """Manifest gone: each array `_METADATA` lists is not checked; with `_METADATA`
    damaged too, the report is one entry for the whole checkpoint."""
    work = _damaged_copy(ocdbt, tmp_path, "work", lambda p: (p / "manifest.ocdbt").unlink())
    result = lazyckpt.verify(work, progress=False)
    assert [d.key for d in result.not_checked] == ARRAYS
    assert "manifest.ocdbt is missing" in result.not_checked[0].problem
    (work / "_METADATA").write_text("{")
    result = lazyckpt.verify(work, progress=False)
    assert (result.arrays, len(result.not_checked), result.opened) == (0, 1, False)
    assert str(result).splitlines() == [
        "the checkpoint does not open: nothing was checked",
        f"  not checked: (the checkpoint): {result.not_checked[0].problem}",
    ]
    assert "_METADATA is not valid JSON" in result.not_checked[0].problem
    assert main(["verify", str(work)]) == 1
    assert capsys.readouterr().err == ""


def test_stray_keys_that_look_like_chunks_are_not_chunks(tmp_path: Path, mesh: Any) -> None:
    """Keys tensorstore never reads as chunks: `00.0` (a copy of `0.0`) beside a
    chunk that went missing is no stand-in for it (it was counted as chunk [0, 0]
    again, and verify found no damage), and an OCDBT key of 5,000 digits is skipped
    (int() raised its raw ValueError)."""
    import jax
    import tensorstore as ts
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    value = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("x")))
    folders = orbax_save(tmp_path / "folders", {"w": value}, use_ocdbt=False)
    shutil.copy(folders / "w" / "0.0", folders / "w" / "00.0")
    (folders / "w" / "3.0").unlink()
    result = lazyckpt.verify(folders, progress=False)
    assert [d.key for d in result.damaged] == ["w"]
    assert "chunk [3, 0] (stored as 'w/3.0') is missing" in result.damaged[0].problem

    ocdbt = orbax_save(tmp_path / "ocdbt", {"w": np.arange(8, dtype=np.float32)})
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ocdbt}/"}).result()
    store.write("w/" + "9" * 5000, store.read("w/0").result().value).result()
    result = lazyckpt.verify(ocdbt, progress=False)
    assert result.ok and result.fine == ["w"]


FIXTURES = Path(__file__).parent / "fixtures" / "torch"


@pytest.mark.parametrize("kind", ["torch", "npz", "bin folder"])
def test_a_damaged_file_of_another_format_reports_what_open_met(
    tmp_path: Path, kind: str, capsys: Any
) -> None:
    """A truncated `torch.save` file, `.npz`, or shard of a `pytorch_model.bin` model:
    the report gives the damage `open` names, not that it is no Orbax checkpoint."""
    if kind == "torch":
        path = tmp_path / "state.pt"
        shutil.copy(FIXTURES / "state.pt", path)
        damaged = path
    elif kind == "npz":
        path = tmp_path / "arrays.npz"
        np.savez(path, w=np.arange(4096, dtype=np.float32))
        damaged = path
    else:
        path = tmp_path / "gpt2"
        shutil.copytree(FIXTURES / "gpt2_bin", path)
        damaged = path / "pytorch_model-00001-of-00003.bin"
    with damaged.open("r+b") as file:
        file.truncate(2000)
    with pytest.raises(lazyckpt.CorruptCheckpointError) as opening:
        lazyckpt.open(path)
    result = lazyckpt.verify(path, progress=False)
    assert (result.ok, result.opened) == (False, False)
    assert [(d.key, d.problem) for d in result.not_checked] == [
        ("(the checkpoint)", str(opening.value))
    ]
    assert f"{damaged}: no zip end record" in str(opening.value)
    assert main(["verify", str(path)]) == 1
    assert str(opening.value) in capsys.readouterr().out
