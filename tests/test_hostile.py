"""Hostile and damaged checkpoints: every case ends in a result or a `LazyckptError`,
never a crash, a hang, a raw exception or unbounded memory.

The cases run in one child process (`tests/hostile_child.py`) with a memory limit and
a timeout, so that an abort, a memory bomb or a blocking read fails the test instead of
taking the test run down with it. Inputs are real checkpoints written by
orbax-checkpoint and then damaged the way a bad copy, a bad disk or a hostile sender
would.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
import pytest

import lazyckpt
from lazyckpt._engine.memory import physical_memory
from lazyckpt._text import human_bytes
from tests.helpers import expect, orbax_manager_save, orbax_save, run_cases

ROOT = Path(__file__).parent.parent


def _folder_checkpoint(path: Path, tree: Any, **options: Any) -> Path:
    return orbax_save(path, tree, use_ocdbt=False, **options)


def _edit_json(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _metadata_only(path: Path, entries: dict[str, Any]) -> Path:
    """A PyTree folder of nothing but a `_METADATA` holding `entries`."""
    path.mkdir(parents=True)
    (path / "_METADATA").write_text(json.dumps({"tree_metadata": entries, "use_ocdbt": False}))
    return path


def _entry(keys: list[tuple[str, int]], value_type: str = "None") -> dict[str, Any]:
    return {
        "key_metadata": [{"key": k, "key_type": t} for k, t in keys],
        "value_metadata": {"value_type": value_type, "skip_deserialize": True},
    }


def _msgpack_chain(depth: int, leaf: bytes = b"\x01") -> bytes:
    """msgpack for {"k": {"k": ... leaf}} nested `depth` maps deep."""
    return b"\x81\xa1k" * depth + leaf


def test_declared_sizes_larger_than_memory(tmp_path: Path) -> None:
    """A zarr header edited to declare [10**15] elements (in one chunk, or in 64-element
    chunks) or 10**6 x 10**6: refused before anything is allocated."""
    cases: list[dict[str, Any]] = []
    expected = {}
    for name, shape, chunks in (
        ("one_chunk", [10**15], [10**15]),
        ("small_chunks", [10**15], [64]),
        ("square", [10**6, 10**6], [10**6, 10**6]),
    ):
        value = np.arange(8, dtype=np.float32) if len(shape) == 1 else np.ones((2, 2), np.float32)
        item = _folder_checkpoint(tmp_path / name, {"w": value})

        def edit(
            meta: dict[str, Any], shape: list[int] = shape, chunks: list[int] = chunks
        ) -> None:
            meta.update(shape=shape, chunks=chunks)

        _edit_json(item / "w" / ".zarray", edit)
        for do in ("open", "summary", "get", "get_slice", "load", "stats", "show"):
            case: dict[str, Any] = {"name": f"{name}:{do}", "path": str(item), "do": do}
            if do == "show":
                case["args"] = ["w[0:4]"]
            cases.append(case)
        expected.update(
            {
                f"{name}:open": "ok",
                f"{name}:summary": "ok",
                f"{name}:get": "lazyckpt:TooLargeError",
                f"{name}:load": "lazyckpt:TooLargeError",
                f"{name}:get_slice": "lazyckpt:",
                f"{name}:stats": "lazyckpt:",
                f"{name}:show": "lazyckpt:",
            }
        )
    outcomes = run_cases(cases, tmp_path)
    expect(outcomes, expected)
    assert "needs 3.6 PiB, more than this machine's memory" in outcomes["one_chunk:get"]
    assert (
        "read a slice of it, or stream it with lazyckpt.iter_blocks" in outcomes["one_chunk:load"]
    )


def test_arrays_larger_than_memory_together_are_refused_before_any_allocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four arrays (zarr headers edited), each a third of this machine's memory and
    swap: each fits, the four do not, and `load` refuses them, naming the sizes,
    before it allocates any (it raised a raw OSError from the first allocation past
    the child's memory limit; without one, the kernel kills the process). An array
    that fits the machine but not the process's limit: `TooLargeError` naming it."""
    capacity = physical_memory()
    count = capacity // 3 // 4 + 1
    item = _folder_checkpoint(
        tmp_path / "four", {f"w{i}": np.arange(8, dtype=np.float32) for i in range(4)}
    )
    one = _folder_checkpoint(tmp_path / "one", {"w": np.arange(8, dtype=np.float32)})
    for zarray, shape in [*((item / f"w{i}" / ".zarray", count) for i in range(4)),
                          (one / "w" / ".zarray", 1 << 29)]:  # fmt: skip

        def edit(meta: dict[str, Any], shape: int = shape) -> None:
            meta.update(shape=[shape], chunks=[1 << 22])

        _edit_json(zarray, edit)
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))  # (the child's limit: 1 GiB more)
    cases = [
        {"name": "four", "path": str(item), "do": "load"},
        {"name": "one", "path": str(one), "do": "load"},
        {"name": "get", "path": str(one), "do": "get"},
    ]
    outcomes = run_cases(cases, tmp_path)
    expect(outcomes, dict.fromkeys(("four", "one", "get"), "lazyckpt:TooLargeError"))
    size = re.escape(human_bytes(4 * count * 4))
    assert re.match(
        rf"lazyckpt:TooLargeError: lazyckpt load: the 4 arrays to read need {size} in all, "
        r"more than this machine's memory and swap \(.*\); the largest: w0 \(.*\), w1",
        outcomes["four"],
    ), outcomes["four"]
    for name in ("one", "get"):
        assert outcomes[name].startswith(
            "lazyckpt:TooLargeError: w: a result of shape (536870912,) (float32) needs 2.0 GiB"
        ), outcomes[name]


def test_deep_trees_cost_linear_work(tmp_path: Path) -> None:
    """`_METADATA` key paths and legacy msgpack maps hundreds to thousands of levels
    deep: up to 512 open like any tree (Orbax restores depth 511); deeper ones are a
    clear error, in time and memory linear in the file's size."""
    cases: list[dict[str, Any]] = []
    for depth in (511, 1000, 40_000):
        keys = [(f"k{i}", 2) for i in range(depth)]
        item = _metadata_only(tmp_path / f"metadata_{depth}", {"x": _entry(keys)})
        cases.append({"name": f"metadata:{depth}", "path": str(item), "do": "summary"})
    for depth in (300, 511, 600):
        item = tmp_path / f"msgpack_{depth}"
        item.mkdir()
        (item / "checkpoint").write_bytes(_msgpack_chain(depth))
        cases.append({"name": f"msgpack:{depth}", "path": str(item), "do": "load"})
    # 300 KB of 500-deep maps, side by side.
    wide = tmp_path / "msgpack_wide"
    wide.mkdir()
    count = 150
    body = b"".join(b"\xa4" + f"{i:04d}".encode() + _msgpack_chain(500) for i in range(count))
    (wide / "checkpoint").write_bytes(b"\xde" + struct.pack(">H", count) + body)
    cases.append({"name": "msgpack:wide", "path": str(wide), "do": "summary"})
    outcomes = run_cases(cases, tmp_path)
    expect(
        outcomes,
        {
            "metadata:511": "ok",
            "metadata:1000": "lazyckpt:CorruptCheckpointError",
            "metadata:40000": "lazyckpt:CorruptCheckpointError",
            "msgpack:300": "ok",
            "msgpack:511": "ok",
            "msgpack:600": "lazyckpt:CorruptCheckpointError",
            "msgpack:wide": "ok",
        },
    )
    assert "deeper than the 512 levels" in outcomes["metadata:40000"]


def _chain(leaf: Any, depth: int) -> Any:
    """`leaf` under `depth` nested dicts, each keyed `n`."""
    for _ in range(depth):
        leaf = {"n": leaf}
    return leaf


_DEEP_VERBS: dict[str, Any] = {
    "select": lambda tree, target, folder: lazyckpt.select(tree, "n/**"),
    "leaves": lambda tree, target, folder: list(lazyckpt.leaves(tree)),
    "load": lambda tree, target, folder: lazyckpt.load(tree),
    "device_put": lambda tree, target, folder: lazyckpt.device_put(tree, target),
    "iter_blocks": lambda tree, target, folder: list(lazyckpt.iter_blocks(tree)),
    "stats": lambda tree, target, folder: lazyckpt.stats(tree),
    "diff": lambda tree, target, folder: lazyckpt.diff(tree, tree, values=True),
    "verify": lambda tree, target, folder: lazyckpt.verify(tree),
    "rename": lambda tree, target, folder: lazyckpt.rename(tree, [("^n/", "m/")]),
    "dequantize": lambda tree, target, folder: lazyckpt.dequantize(tree),
    "save": lambda tree, target, folder: lazyckpt.save(folder / "orbax", tree),
    "save_safetensors": lambda tree, target, folder: lazyckpt.save(
        folder / "safetensors", tree, format="safetensors"
    ),
}


@pytest.mark.parametrize("verb", list(_DEEP_VERBS))
def test_trees_deeper_than_checkpoints_nest_are_refused_by_name(verb: str, tmp_path: Path) -> None:
    """A tree of LazyArrays as deep as a checkpoint's may be (512 levels) goes through
    every verb; nesting it 3,000 levels deep is a clear error, never a RecursionError
    (nor jax's SystemError, nor its spent recursion depth after a walk with `is_leaf`,
    which broke every later call)."""
    lazyckpt.save(tmp_path / "source", {"w": np.arange(6, dtype=np.float32)})
    leaf = lazyckpt.open(tmp_path / "source")["w"]
    target = jax.ShapeDtypeStruct((6,), np.float32)
    do = _DEEP_VERBS[verb]
    (tmp_path / "512").mkdir()
    do(_chain(leaf, 512), _chain(target, 512), tmp_path / "512")
    (tmp_path / "3000").mkdir()
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=r"^n/n/n/n/\.\.\./n/n \(513 keys\): the tree nests deeper there than the 512 "
        r"levels lazyckpt walks",
    ):
        do(_chain(leaf, 3000), _chain(target, 3000), tmp_path / "3000")
    assert lazyckpt.select(_chain(leaf, 2), "n/**")  # (and later calls still work)


@pytest.fixture
def sharded(tmp_path: Path, mesh: Any) -> Path:
    """A small OCDBT checkpoint with a sharded array, a string and typed PRNG keys."""
    tree = {
        "w": jax.device_put(
            np.arange(64, dtype=np.float32).reshape(8, 8),
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y")),
        ),
        "name": "run",
        "key": jax.random.key(1),
    }
    return orbax_save(tmp_path / "good", tree)


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target, symlinks=True)
    return target


def test_malformed_metadata_files_are_clear_errors(sharded: Path, tmp_path: Path) -> None:
    cases: list[dict[str, Any]] = []
    expected = {}

    def case(name: str, damage: Any, want: str, do: str = "load") -> None:
        item = _copy(sharded, tmp_path / name)
        damage(item)
        cases.append({"name": name, "path": str(item), "do": do})
        expected[name] = want

    corrupt = "lazyckpt:CorruptCheckpointError"
    for file in ("_METADATA", "_sharding", "_strings.json"):
        case(f"latin1 {file}", lambda p, f=file: (p / f).write_bytes(b'{"\xff": 1}'), corrupt)
    for top in ("[]", "null", "3"):
        case(f"_sharding {top}", lambda p, t=top: (p / "_sharding").write_text(t), corrupt)
    case("_strings truncated", lambda p: (p / "_strings.json").write_text('{"na'), corrupt)
    case("_strings deep", lambda p: (p / "_strings.json").write_text("[" * 100_000), corrupt)

    def sharding_entry(edit: Any) -> Any:
        def damage(item: Path) -> None:
            table = json.loads((item / "_sharding").read_text())
            for key, text in table.items():
                entry = json.loads(text)
                if entry.get("sharding_type") == "NamedSharding":
                    edit(entry)
                    table[key] = json.dumps(entry)
            (item / "_sharding").write_text(json.dumps(table))

        return damage

    case("mesh of other rank", sharding_entry(lambda e: e.update(shape=[4, 2, 1])), corrupt)
    case("unknown axis", sharding_entry(lambda e: e.update(partition_spec=["x", "zz"])), corrupt)
    case("empty mesh axis", sharding_entry(lambda e: e.update(shape=[0, 2])), corrupt)

    def key_impl(item: Path) -> None:
        for file in (item / "array_metadatas").iterdir():
            text = file.read_text().replace("threefry2x32", "no_such_impl")
            file.write_text(text)

    case("unknown PRNG impl", key_impl, "lazyckpt:UnsupportedCheckpointError", do="open")
    outcomes = run_cases(cases, tmp_path)
    expect(outcomes, expected)
    assert "_strings.json is not valid JSON" in outcomes["_strings truncated"]
    assert "not UTF-8 text" in outcomes["latin1 _METADATA"]


def test_a_saved_device_name_is_ascii_and_read_in_linear_time(tmp_path: Path) -> None:
    """A `_sharding` entry's device (`cpu:3`, where an array saved from one device is
    restored when the target names no sharding): Unicode digits are no id (`cpu:\u0665`
    was device 5), 5,000 digits are a CorruptCheckpointError naming the file (int()
    raised its raw ValueError), and a long run of digits before the id costs linear
    time (the search for the last number was quadratic: hours for these 2 MB)."""
    value = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[3])
    saved = orbax_save(tmp_path / "saved", {"w": value})
    cases = [{"name": "as saved", "path": str(saved), "do": "device_put"}]
    for name, device in (
        ("unicode", "cpu:\u0665"),
        ("5000 digits", "cpu:" + "9" * 5000),
        ("long run", "cpu:" + "7" * 2_000_000 + ":1"),
    ):
        item = _copy(saved, tmp_path / name)
        table = json.loads((item / "_sharding").read_text())
        entry = {**json.loads(table["dw=="]), "device_str": device}
        (item / "_sharding").write_text(json.dumps({"dw==": json.dumps(entry)}))
        cases.append({"name": name, "path": str(item), "do": "device_put"})
    outcomes = run_cases(cases, tmp_path, timeout=120)
    corrupt = "lazyckpt:CorruptCheckpointError"
    expect(outcomes, {"as saved": "ok: cpu:3", "unicode": corrupt, "5000 digits": corrupt})
    assert outcomes["long run"] == "ok: cpu:1"
    assert "_sharding: the entry for 'w' is malformed" in outcomes["unicode"]
    assert (
        "device 'cpu:9999" in outcomes["5000 digits"] and "9" * 100 not in outcomes["5000 digits"]
    )


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_zarr_sizes_are_json_integers_as_tensorstore_reads_them(
    tmp_path: Path, zarr3: bool
) -> None:
    """A shape edited to `["\u0668"]` (an Arabic-Indic 8), `["8"]`, `[true]` or `[8.5]`:
    tensorstore refuses each, and so does `open`, naming the file (int() read them
    as 8, 8, 1 and 8); `[8.0]`, which tensorstore takes, opens and reads."""
    value = np.arange(8, dtype=np.float32)
    saved = orbax_save(tmp_path / "saved", {"w": value}, zarr3=zarr3, use_ocdbt=False)
    header = "zarr.json" if zarr3 else ".zarray"
    for name, shape in (("arabic", ["\u0668"]), ("text", ["8"]), ("bool", [True]), ("half", [8.5])):
        item = _copy(saved, tmp_path / name)
        meta = json.loads((item / "w" / header).read_text())
        (item / "w" / header).write_text(json.dumps({**meta, "shape": shape}))
        with pytest.raises(
            lazyckpt.CorruptCheckpointError,
            match=rf"w/{re.escape(header)}'? is malformed \(shape .{{3,12}} is not a list of integers",
        ):
            lazyckpt.open(item)
    meta = json.loads((saved / "w" / header).read_text())
    (saved / "w" / header).write_text(json.dumps({**meta, "shape": [8.0]}))
    np.testing.assert_array_equal(lazyckpt.open(saved)["w"].get(), value)


def test_keys_and_dtypes_lazyckpt_cannot_read(tmp_path: Path) -> None:
    cases: list[dict[str, Any]] = []
    superscript = _metadata_only(tmp_path / "superscript", {"x": _entry([("l", 2), ("²", 1)])})
    cases.append({"name": "superscript index", "path": str(superscript), "do": "open"})
    for dtype in ("|S4", "|V8"):
        item = _folder_checkpoint(tmp_path / dtype.strip("|"), {"w": np.zeros(4, np.float32)})
        _edit_json(item / "w" / ".zarray", lambda m, d=dtype: m.update(dtype=d))
        cases.append({"name": f"zarr {dtype}", "path": str(item), "do": "open"})
    dates = tmp_path / "dates"
    dates.mkdir()
    payload = b"\x93\x91\x02\xaedatetime64[ns]\xc4\x10" + bytes(16)
    (dates / "checkpoint").write_bytes(b"\x81\xa1d\xc7" + bytes([len(payload), 1]) + payload)
    cases.append({"name": "msgpack datetime64", "path": str(dates), "do": "open"})
    outcomes = run_cases(cases, tmp_path)
    expect(
        outcomes,
        {
            "superscript index": "lazyckpt:CorruptCheckpointError",
            "zarr |S4": "lazyckpt:UnsupportedCheckpointError",
            "zarr |V8": "lazyckpt:UnsupportedCheckpointError",
            "msgpack datetime64": "lazyckpt:UnsupportedCheckpointError",
        },
    )
    assert "declares dtype '|S4', which lazyckpt does not read" in outcomes["zarr |S4"]


def test_devices_fifos_and_links_out_of_the_folder(sharded: Path, tmp_path: Path) -> None:
    cases: list[dict[str, Any]] = []
    expected = {}
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text('{"name": "not yours"}')
    for file in ("_METADATA", "_sharding"):
        for target in ("/dev/zero", "/dev/urandom"):
            item = _copy(sharded, tmp_path / f"{file}-{target.rsplit('/', 1)[1]}")
            (item / file).unlink()
            (item / file).symlink_to(target)
            name = f"{file} -> {target}"
            cases.append({"name": name, "path": str(item), "do": "open"})
            cases.append(
                {
                    "name": name + " allowed",
                    "path": str(item),
                    "do": "open",
                    "kwargs": {"allow_outside_links": True},
                }
            )
            expected[name] = "lazyckpt:NotACheckpointError"
            expected[name + " allowed"] = "lazyckpt:CorruptCheckpointError"
        fifo = _copy(sharded, tmp_path / f"{file}-fifo")
        (fifo / file).unlink()
        os.mkfifo(fifo / file)
        cases.append({"name": f"{file} fifo", "path": str(fifo), "do": "open"})
        expected[f"{file} fifo"] = "lazyckpt:CorruptCheckpointError"
    legacy = tmp_path / "msgpack-zero"
    legacy.mkdir()
    (legacy / "checkpoint").symlink_to("/dev/zero")
    cases.append(
        {
            "name": "checkpoint -> /dev/zero",
            "path": str(legacy),
            "do": "open",
            "kwargs": {"allow_outside_links": True},
        }
    )
    expected["checkpoint -> /dev/zero"] = "lazyckpt:CorruptCheckpointError"
    strings = _copy(sharded, tmp_path / "strings-out")
    (strings / "_strings.json").unlink()
    (strings / "_strings.json").symlink_to(outside / "secret.json")
    cases.append({"name": "_strings.json out", "path": str(strings), "do": "open"})
    cases.append(
        {
            "name": "_strings.json out, allowed",
            "path": str(strings),
            "do": "open",
            "kwargs": {"allow_outside_links": True},
        }
    )
    expected["_strings.json out"] = "lazyckpt:NotACheckpointError"
    expected["_strings.json out, allowed"] = "ok"
    folders = _folder_checkpoint(tmp_path / "folders", {"w": np.arange(4.0), "v": np.ones(2)})
    os.rename(folders / "w", outside / "w")
    (folders / "w").symlink_to(outside / "w")
    cases.append({"name": "array folder out", "path": str(folders), "do": "load"})
    expected["array folder out"] = "lazyckpt:NotACheckpointError"
    inside = _folder_checkpoint(tmp_path / "inside", {"w": np.arange(4.0)})
    os.rename(inside / "w", inside / "w-real")
    (inside / "w").symlink_to(inside / "w-real")
    cases.append({"name": "link inside the folder", "path": str(inside), "do": "load"})
    expected["link inside the folder"] = "ok"
    outcomes = run_cases(cases, tmp_path, timeout=180)
    expect(outcomes, expected)
    assert (
        "is not a regular file (a character device)" in outcomes["_METADATA -> /dev/zero allowed"]
    )
    assert "is not a regular file (a FIFO)" in outcomes["_METADATA fifo"]
    assert "allow_outside_links=True" in outcomes["array folder out"]


def test_item_names_stay_inside_the_step(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    import lazyckpt

    root = orbax_manager_save(
        tmp_path / "run", {1: {"state": ocp.args.StandardSave({"w": np.zeros(2)})}}
    )
    for item in ("/etc", "../..", "..", "a/b", ""):
        with pytest.raises(
            lazyckpt.NotACheckpointError,
            match=r"is not an item name: items are folders directly inside a step folder",
        ) as caught:
            lazyckpt.open(root, item=item)
        assert "passwd" not in str(caught.value)


def test_every_write_loop_survives_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`os.pwrite` may write less than asked (Linux moves at most 0x7ffff000 bytes per
    call): a file system that writes 5 bytes per call still gets every byte."""
    from safetensors import safe_open

    streamed = np.arange(600.0).reshape(6, 100)
    lazy = lazyckpt.open(lazyckpt.save(tmp_path / "source", {"c": streamed}))["c"]
    values = {
        "a": np.arange(1000, dtype=np.float32).reshape(10, 100),
        "b": np.arange(7, dtype=np.int8),
    }
    real, asked = os.pwrite, []

    def short(fd: int, data: Any, offset: int) -> int:
        asked.append(len(data))
        return real(fd, memoryview(data).cast("B")[:5], offset)

    monkeypatch.setattr(os, "pwrite", short)
    out = lazyckpt.save(tmp_path / "m.safetensors", {**values, "c": lazy})
    monkeypatch.undo()
    assert max(asked) > 5  # the writes really were cut short
    with safe_open(out, "np") as opened:
        for name, want in {**values, "c": streamed}.items():
            np.testing.assert_array_equal(opened.get_tensor(name), want)


@pytest.mark.large
def test_a_tensor_over_2_gib_round_trips_as_safetensors(tmp_path: Path) -> None:
    if not os.environ.get("LAZYCKPT_LARGE"):
        pytest.skip("writes 2 GiB: run with LAZYCKPT_LARGE=1 pytest -m large")
    size = (1 << 31) + 4096
    tail = (np.arange(4096) % 251 + 1).astype(np.uint8)
    big = np.zeros(size, np.uint8)
    big[-4096:] = tail
    path = lazyckpt.save(tmp_path / "big.safetensors", {"x": big})
    del big
    np.testing.assert_array_equal(lazyckpt.open(path)["x"][-4096:].get(), tail)


def test_shards_without_their_index_are_unfinished(tmp_path: Path) -> None:
    """A sharded save killed before its index (in a bucket, shard by shard) leaves
    shard files alone: never opened as a smaller, complete-looking model."""
    tensors = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(4)}
    folder = Path(
        lazyckpt.save(tmp_path / "model", tensors, format="safetensors", max_shard_size=20_000)
    )
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    (folder / "model.safetensors.index.json").unlink()
    for name in shards[1:]:
        (folder / name).unlink()  # the first shard alone, as a killed upload leaves it
    with pytest.raises(lazyckpt.UnfinishedCheckpointError, match=r"no model\.safetensors\.index"):
        lazyckpt.open(folder)


def test_overwrite_replaces_only_a_model_it_can_prove(tmp_path: Path) -> None:
    """By content, not by name: a stray `.safetensors` file does not make a folder a
    model, a text file named `*.safetensors` is no model, and a model folder keeps
    everything but its model files."""
    from safetensors.numpy import save_file

    new = {"w": np.arange(6, dtype=np.float32)}
    stray = tmp_path / "stray"
    (stray / "photos").mkdir(parents=True)
    (stray / "notes.txt").write_text("mine")
    (stray / "photos" / "1.jpg").write_bytes(b"\xff\xd8")
    save_file({"x": np.ones(2, np.float32)}, str(stray / "x.safetensors"))
    text = tmp_path / "notes.safetensors"
    text.write_text("not a model")
    cases: list[tuple[Path, Literal["orbax", "safetensors"]]] = [
        (stray, "safetensors"),
        (stray, "orbax"),
        (text, "safetensors"),
    ]
    for target, kind in cases:
        with pytest.raises(lazyckpt.CheckpointExistsError, match=r"does not look like|is not a"):
            lazyckpt.save(target, new, format=kind, overwrite=True)
    assert (stray / "notes.txt").read_text() == "mine" and (stray / "photos" / "1.jpg").exists()
    assert text.read_text() == "not a model"

    model = tmp_path / "model"  # as `save_pretrained` leaves it, sharded
    old = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(4)}
    lazyckpt.save(model, old, format="safetensors", max_shard_size=20_000)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer").mkdir()
    (model / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(lazyckpt.CheckpointExistsError, match="does not look like"):
        lazyckpt.save(model, new, overwrite=True)  # an Orbax save replaces no model
    lazyckpt.save(model, new, format="safetensors", overwrite=True)
    assert sorted(p.name for p in model.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer",
    ]
    assert (model / "config.json").read_text() == '{"model_type": "llama"}'
    assert (model / "tokenizer" / "tokenizer.json").read_text() == "{}"
    np.testing.assert_array_equal(lazyckpt.load(lazyckpt.open(model))["w"], new["w"])


def test_fifos_anywhere_are_refused_not_waited_on(sharded: Path, tmp_path: Path) -> None:
    """Every file any path reads must be plain: a FIFO in place of an OCDBT data file, a
    zarr chunk or a safetensors file once blocked `open` or `load` forever."""
    from safetensors.numpy import save_file

    cases: list[dict[str, Any]] = []
    data = _copy(sharded, tmp_path / "ocdbt-data")
    victim = max(
        (p for p in data.rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    victim.unlink()
    os.mkfifo(victim)
    chunk = _folder_checkpoint(tmp_path / "chunk", {"w": np.arange(4.0)})
    (chunk / "w" / "0").unlink()
    os.mkfifo(chunk / "w" / "0")
    single = tmp_path / "fifo.safetensors"
    os.mkfifo(single)
    folder = tmp_path / "model"
    folder.mkdir()
    os.mkfifo(folder / "model.safetensors")
    sharded_model = Path(
        lazyckpt.save(
            tmp_path / "sharded-model",
            {f"w{i}": np.ones((64, 64), np.float32) for i in range(3)},
            format="safetensors",
            max_shard_size=20_000,
        )
    )
    shard = sorted(sharded_model.glob("model-*.safetensors"))[-1]
    shard.unlink()
    os.mkfifo(shard)
    save_file({"x": np.ones(2, np.float32)}, str(tmp_path / "real.safetensors"))
    for name, path in (
        ("ocdbt data file", data),
        ("zarr chunk", chunk),
        ("safetensors file", single),
        ("model.safetensors", folder),
        ("safetensors shard", sharded_model),
    ):
        for do in ("open", "load"):
            cases.append({"name": f"{name}:{do}", "path": str(path), "do": do})
    outcomes = run_cases(cases, tmp_path, timeout=120)
    expect(outcomes, {case["name"]: "lazyckpt:CorruptCheckpointError" for case in cases})
    assert "is not a regular file" in outcomes["ocdbt data file:open"]


def test_a_sequence_index_of_thousands_of_digits_is_a_clear_error(tmp_path: Path) -> None:
    item = _metadata_only(tmp_path / "ckpt", {"x": _entry([("9" * 5000, 1)])})
    with pytest.raises(
        lazyckpt.CorruptCheckpointError,
        match=r"_METADATA: entry x has key '9{60}' of key_type 1; expected 1 \(sequence index\)",
    ):
        lazyckpt.open(item)


TREE_CHUNKS = (("small", "0"), ("big", "0.0"), ("mid", "3.0"))


def test_fifos_put_in_place_after_open_are_refused_not_waited_on(tmp_path: Path, mesh: Any) -> None:
    """A chunk file, an OCDBT data file or its b-tree's node replaced by a FIFO after
    `open`: `load` and `get` refuse it, naming it, through each way an array is read
    (a small one in a batch, a large chunk decoded by lazyckpt, chunks read by
    tensorstore's zarr driver), where tensorstore's blocking `open` of it hung."""
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("x", "y")))
    tree = {
        "small": np.arange(64, dtype=np.float32),  # read with others, in one batch
        "big": np.ones((512, 1024), np.float32),  # one 2 MiB chunk: lazyckpt decodes it
        "mid": jax.device_put(np.ones((1024, 512), np.float32), rows),  # 256 KiB chunks
    }
    folder = _folder_checkpoint(tmp_path / "folder", tree)
    ocdbt = orbax_save(tmp_path / "ocdbt", tree)
    # The largest data file (big's chunk), and the b-tree's node beside the manifest;
    # in a folder, a chunk of the array read.
    data = max(ocdbt.glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    node = next(ocdbt.glob("d/*"))
    victims = [
        *((folder, f"{key}/{chunk}", [key]) for key, chunk in TREE_CHUNKS),
        *((ocdbt, str(p.relative_to(ocdbt)), sorted(tree)) for p in (data, node)),
    ]
    cases: list[dict[str, Any]] = []
    for source, victim, keys in victims:
        for do, key in [("load", ""), *(("get", key) for key in keys)]:
            copy = _copy(source, tmp_path / f"case{len(cases)}")
            cases.append(
                {
                    "name": f"{source.name} {victim}:{do} {key}",
                    "path": str(copy),
                    "do": f"{do}_after_fifo",
                    "victim": victim,
                    "key": key,
                }
            )
    outcomes = run_cases(cases, tmp_path, timeout=120)
    expect(outcomes, {case["name"]: "lazyckpt:CorruptCheckpointError" for case in cases})
    for case in cases:
        assert (
            f"{case['path']}/{case['victim']} is not a regular file (a FIFO)"
            in (outcomes[case["name"]])
        )


def _safetensors_file(path: Path, header: dict[str, Any], data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    ("entry", "error", "message"),
    [
        ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, "Corrupt", "expected a name"),
        ({"dtype": {"x": 1}, "shape": [1], "data_offsets": [0, 4]}, "Corrupt", "expected a name"),
        ({"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}, "Corrupt", "more bytes"),
        (
            {"dtype": "F32", "shape": [10**15, 10**15, 0], "data_offsets": [0, 0]},
            "Corrupt",
            "more bytes",
        ),
        ({"dtype": "F32", "shape": [1] * 40, "data_offsets": [0, 4]}, "Unsupported", "at most 32"),
    ],
)
def test_crafted_safetensors_declarations_are_clear_errors(
    tmp_path: Path, entry: dict[str, Any], error: str, message: str
) -> None:
    path = _safetensors_file(tmp_path / "x.safetensors", {"a": entry}, bytes(8))
    with pytest.raises(getattr(lazyckpt, f"{error}CheckpointError"), match=message):
        lazyckpt.load(lazyckpt.open(path))


def test_edge_safetensors_that_are_valid_or_refused_cleanly(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    # A zero-size tensor at offset 0 listed after one at [0, 8): valid, whatever the order.
    empty_last = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
    }
    path = _safetensors_file(tmp_path / "e.safetensors", empty_last, bytes(8))
    assert {k: v.shape for k, v in load_file(path).items()} == {"a": (2,), "b": (0,)}
    assert {k: v.shape for k, v in lazyckpt.load(lazyckpt.open(path)).items()} == {
        "a": (2,),
        "b": (0,),
    }
    for metadata in (5, "abc"):
        model = Path(
            lazyckpt.save(tmp_path / f"m{metadata}", {"w": np.ones(2)}, format="safetensors")
        )
        index = {"metadata": metadata, "weight_map": {"w": "model.safetensors"}}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(lazyckpt.CorruptCheckpointError, match="expected an object"):
            lazyckpt.open(model)
    with pytest.raises(lazyckpt.UnsavableError, match="maps strings to strings"):
        lazyckpt.save(tmp_path / "s.safetensors", {"w": np.ones(2)}, metadata={"step": 3})  # type: ignore[dict-item]
    assert not (tmp_path / "s.safetensors").exists()
    with pytest.raises(lazyckpt.UnsavableError, match="lone surrogate"):
        lazyckpt.save(tmp_path / "o", {"w\ud800": np.ones(2)})
    odd = _safetensors_file(  # the valid JSON escape \ud800: a name no UTF-8 holds
        tmp_path / "odd.safetensors",
        {"w\ud800": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}},
        np.ones(2).tobytes(),
    )
    for command in ("inspect", "stats"):
        done = subprocess.run(
            [sys.executable, "-m", "lazyckpt._cli.main", command, str(odd)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0 and "w\\ud800" in done.stdout, done.stderr


def test_safetensors_names_of_many_parts_cost_linear_work(tmp_path: Path) -> None:
    """Nesting by `.` once took time quadratic in a name's parts (42 s for one name of
    100,000) and, past about 1,000 parts, a tree jax and `summary` cannot walk."""
    from safetensors.numpy import save_file

    cases: list[dict[str, Any]] = []
    expected = {}
    for parts in (512, 990, 100_000):
        path = tmp_path / f"{parts}.safetensors"
        save_file({".".join(["a"] * parts): np.ones(2, np.float32)}, str(path))
        for do in ("open", "summary", "load", "stats"):
            cases.append({"name": f"{parts}:{do}", "path": str(path), "do": do})
            expected[f"{parts}:{do}"] = "ok" if parts <= 512 else "lazyckpt:CorruptCheckpointError"
        cases.append(
            {"name": f"{parts}:flat", "path": str(path), "do": "load", "kwargs": {"flat": True}}
        )
        expected[f"{parts}:flat"] = "ok"
    many = tmp_path / "many.safetensors"
    names = {".".join([f"n{i}", *["b"] * 400]): np.ones(1, np.float32) for i in range(2000)}
    save_file(names, str(many))
    cases.append({"name": "2000 names of 401 parts", "path": str(many), "do": "open"})
    expected["2000 names of 401 parts"] = "ok"
    outcomes = run_cases(cases, tmp_path, timeout=120)
    expect(outcomes, expected)
    assert "open it with flat=True" in outcomes["100000:open"]


def test_legacy_msgpack_work_is_bounded_by_its_key_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 300 KB `checkpoint` file of 490 nested maps over 300,000 leaves once took 78 s
    and 2.9 GB to open: the leaves times the key-path length is bounded, and counted
    before the key paths are built (once 1.2 GB before the refusal: a raw MemoryError
    within 1 GiB)."""
    monkeypatch.setenv("HOSTILE_MEMORY", str(768 << 20))
    cases = []
    for name, leaves in (("amplified", 300_000), ("fine", 1_000)):
        folder = tmp_path / name
        folder.mkdir()
        nils = b"\xdd" + struct.pack(">I", leaves) + b"\xc0" * leaves  # array32 of None
        (folder / "checkpoint").write_bytes(_msgpack_chain(490, nils))
        cases.append({"name": name, "path": str(folder), "do": "open"})
    outcomes = run_cases(cases, tmp_path, timeout=120)
    expect(outcomes, {"amplified": "lazyckpt:CorruptCheckpointError", "fine": "ok"})
    assert "more than any checkpoint's tree needs" in outcomes["amplified"]


def test_a_tiny_budget_streams_a_big_chunk_in_few_plans(tmp_path: Path) -> None:
    """`iter_blocks` of an 8 MiB chunk at `memory_budget=64` (its docstring's value)
    once planned a million bands up front: 1.3 GiB and 55 s before the first block."""
    values = np.random.default_rng(0).standard_normal((1024, 2048)).astype(np.float32)
    lazy = lazyckpt.open(orbax_save(tmp_path / "c", {"x": values}))["x"]
    assert lazy.chunks == values.shape  # one chunk, decoded by lazyckpt

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before, blocks, grown = rss(), 0, 0
    out = np.empty_like(values)
    for _, index, block in lazyckpt.iter_blocks(lazy, memory_budget=64):
        grown = max(grown, rss() - before)
        out[index] = block
        blocks += 1
    np.testing.assert_array_equal(out, values)
    assert blocks <= values.nbytes // (64 << 10)  # blocks of at least 64 KiB
    assert grown < 64 << 20


@pytest.mark.slow
def test_millions_of_tiny_chunks_are_read_in_bounded_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header declaring 2 million one-element chunks (all missing: fill values) once
    ended in std::bad_alloc and SIGABRT: tensorstore keeps state per chunk of a read, and
    one block spanned them all. Blocks now span at most 65,536 chunks, and reads in
    flight count their chunks against the budget."""
    import shutil

    cases = []
    for zarr3 in (False, True):
        item = orbax_save(
            tmp_path / f"zarr{2 + zarr3}", {"w": np.arange(8.0)}, use_ocdbt=False, zarr3=zarr3
        )
        header = item / "w" / ("zarr.json" if zarr3 else ".zarray")
        meta = json.loads(header.read_text())
        meta["shape"] = [2_000_000]
        if zarr3:
            meta["chunk_grid"]["configuration"]["chunk_shape"] = [1]
            for codec in meta.get("codecs", []):
                if codec.get("name") == "sharding_indexed":
                    codec["configuration"]["chunk_shape"] = [1]
        else:
            meta["chunks"] = [1]
        header.write_text(json.dumps(meta))
        for entry in (item / "w").iterdir():
            if entry.name not in (".zarray", "zarr.json"):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        _edit_json(
            item / "_METADATA", lambda m: m.update(store_array_data_equal_to_fill_value=False)
        )
        cases.append({"name": f"zarr{2 + zarr3}", "path": str(item), "do": "load"})
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    expect(run_cases(cases, tmp_path, timeout=300), {"zarr2": "ok", "zarr3": "ok"})


def test_overwrite_proves_orbax_checkpoints_by_content_too(tmp_path: Path) -> None:
    """A TensorFlow-style folder (a text file named `checkpoint`) or an empty
    `_CHECKPOINT_METADATA` is no Orbax checkpoint: an Orbax overwrite refuses it."""
    from safetensors.numpy import save_file

    new = {"w": np.arange(3.0)}
    for name, content in (
        ("checkpoint", "model_checkpoint_path: ckpt-1\n"),
        ("_CHECKPOINT_METADATA", ""),
    ):
        folder = tmp_path / name.strip("_").lower()
        folder.mkdir()
        (folder / name).write_text(content)
        (folder / "notes.txt").write_text("mine")
        with pytest.raises(lazyckpt.CheckpointExistsError, match="does not look like"):
            lazyckpt.save(folder, new, overwrite=True)
        assert (folder / "notes.txt").read_text() == "mine"
    real = lazyckpt.save(tmp_path / "real", {"v": np.ones(2)})
    lazyckpt.save(real, new, overwrite=True)
    assert list(lazyckpt.open(real)) == ["w"]
    # A model folder's own shards, whatever their names, go with it; a stray shard-named
    # adapter beside model.safetensors does not stop it from opening.
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {}
    for i in (1, 2):
        shard = f"weights-0000{i}-of-00002.safetensors"
        save_file({f"t{i}": np.ones(2, np.float32)}, str(model / shard))
        weight_map[f"t{i}"] = shard
    index = {"metadata": {}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    lazyckpt.save(model, new, format="safetensors", overwrite=True)
    assert sorted(p.name for p in model.iterdir()) == ["model.safetensors"]
    save_file({"a": np.ones(1, np.float32)}, str(model / "adapter-00001-of-00001.safetensors"))
    assert list(lazyckpt.open(model)) == ["w"]
    with pytest.raises(lazyckpt.UnsavableError, match="lone surrogate"):
        lazyckpt.save(tmp_path / "s.safetensors", {"w\ud800": np.ones(2)})


def _forked(folder: Path, mode: str) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.fork_worker", str(folder), mode],
        capture_output=True,
        text=True,
        timeout=900,  # (a hang guard: each child is killed after 60 s)
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {r["name"]: r["outcome"] for r in map(json.loads, done.stdout.splitlines())}


def test_a_child_forked_after_tensorstore_ran_is_told_not_killed(tmp_path: Path) -> None:
    """tensorstore aborts a process forked after its threads started at the child's
    next read through it ("fork() use detected"), and lazyckpt's own thread pools were
    the parent's: a child reading Orbax (over HTTP, through the relay, too) was killed,
    and one reading safetensors hung. Reads through tensorstore are refused by name in
    such a child; what lazyckpt reads itself (safetensors, on disk and over HTTP) works
    there. A child forked before any read reads everything."""
    lazyckpt.save(tmp_path / "ckpt", {"w": np.arange(8, dtype=np.float32)})
    lazyckpt.save(
        tmp_path / "model.safetensors", {"w": np.arange(8, dtype=np.float32)}, format="safetensors"
    )
    refused = (
        "lazyckpt:StorageAccessError: .*: not read or written in this process, a fork of one "
        "in which tensorstore had started its threads: .* start this process with "
        "multiprocessing's 'spawn' or 'forkserver' method"
    )
    outcomes = _forked(tmp_path, "used")
    for name, outcome in outcomes.items():
        if name.startswith("orbax"):
            assert re.match(refused, outcome), (name, outcome)
        else:
            assert outcome == "ok", (name, outcome)
    assert len(outcomes) == 10
    fresh = _forked(tmp_path, "fresh")
    assert fresh == dict.fromkeys(fresh, "ok") and len(fresh) == 5, fresh
