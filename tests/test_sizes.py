"""Sizes as numbers or text, the same in every verb and on the command line: KB, MB,
GB, TB are powers of 1000 (as huggingface_hub and transformers), KiB, MiB, GiB, TiB
powers of 1024; a bad size is a `SizeError` naming the argument, before any work."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyckptError, SizeError
from lazyckpt._cli.main import main, parse_size
from lazyckpt._safetensors.write import DEFAULT_SHARD_BYTES
from lazyckpt._sizes import optional_size, size_argument
from tests.helpers import orbax_save

ACCEPTED = (
    "write bytes (268435456) or a number with a unit: KB, MB, GB, TB (powers of 1000, "
    "as huggingface_hub and transformers) or KiB, MiB, GiB, TiB (powers of 1024)"
)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (4096, 4096),
        (np.int64(4096), 4096),
        ("4096", 4096),
        (" 4096 ", 4096),
        ("1_000_000", 10**6),
        ("512B", 512),
        ("512 b", 512),
        ("1kB", 10**3),
        ("1KB", 10**3),
        ("5MB", 5 * 10**6),
        ("5 MB", 5 * 10**6),
        ("5mb", 5 * 10**6),
        ("5Gb", 5 * 10**9),  # bytes, as huggingface_hub reads it (transformers: bits)
        ("5GB", 5 * 10**9),
        ("2TB", 2 * 10**12),
        ("1KiB", 2**10),
        ("1kib", 2**10),
        ("256MiB", 256 * 2**20),
        ("256 MIB", 256 * 2**20),
        ("5GiB", 5 * 2**30),
        ("1TiB", 2**40),
        ("1.5GiB", 3 * 2**29),
        ("1.5GB", 1_500_000_000),
        ("4.35MB", 4_350_000),  # exact: 4.35 * 10**6 in floats is 4349999.999...
        ("0.0015KB", 1),  # 1.5 bytes, rounded down
        ("1.0001KiB", 1024),  # 1024.1024 bytes, rounded down
    ],
)
def test_sizes_read_as_bytes(given: object, expected: int) -> None:
    assert size_argument("memory_budget", given) == expected


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        ("", ""),
        ("   ", ""),
        ("-1", ""),
        ("+1", ""),
        ("1XB", ""),
        ("MB", ""),
        ("1e9", ""),
        ("1,000", ""),
        ("1__000", ""),
        ("256 MiBs", ""),
        ("5 M B", ""),
        ("\u0665MB", ""),  # an Arabic-Indic 5: ASCII digits only
        ("\u0661\u0662MB", ""),  # Arabic-Indic 12, which int() would read
        ("\u00b2GB", ""),  # a superscript 2, which str.isdigit() takes
        ("5\u212aB", ""),  # a Kelvin sign, which str.lower() makes a k
        ("5G", "G alone is ambiguous; "),
        ("64k", "K alone is ambiguous; "),
        ("1.5", "bytes are whole; "),
        ("1.5B", "bytes are whole; "),
        ("0", "a size is at least 1 byte; "),
        ("0.0001KB", "a size is at least 1 byte; "),
        (0, "a size is at least 1 byte; "),
        (-1, "a size is at least 1 byte; "),
        (True, ""),
        (False, ""),
        (None, ""),
        (1.5, ""),
        ([4096], ""),
    ],
)
def test_bad_sizes_name_the_argument_and_the_forms(given: object, reason: str) -> None:
    with pytest.raises(SizeError) as raised:
        size_argument("max_shard_size", given)
    assert str(raised.value) == f"max_shard_size={given!r} is not a size: {reason}{ACCEPTED}"
    assert isinstance(raised.value, LazyckptError) and isinstance(raised.value, ValueError)


TOO_LARGE = r"more than 2\*\*64 bytes \(16 EiB\), which no machine or file holds; write bytes"


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("9" * 5000 + "GB", r"'9{59}\.\.\. \(5004 characters\)"),  # int() refuses 4300 digits
        ("1" + "0" * 5000, r"'10{58}\.\.\. \(5003 characters\)"),
        ("1_" * 3000 + "1 KiB", r"'(1_){29}1\.\.\. \(6007 characters\)"),
        ("9" * 21 + "B", "'9{21}B'"),
        ("18446744073709551617", "'18446744073709551617'"),  # 2**64 + 1
        ("16777217TiB", "'16777217TiB'"),
        (str(10**30), f"'{10**30}'"),
        (10**30, str(10**30)),
        (2**64 + 1, str(2**64 + 1)),
        (10**5000, r"\(an int of 16610 bits\)"),  # whose repr() raises
    ],
    ids=[
        "5000-digits-GB",
        "5001-digits",
        "3001-digits-underscored",
        "21-digits",
        "2**64+1",
        "2**64+2**40-TiB",
        "10**30-text",
        "10**30",
        "2**64+1-int",
        "10**5000",
    ],
)
def test_sizes_past_16_eib_are_refused_by_their_first_digits(given: object, shown: str) -> None:
    with pytest.raises(SizeError, match=rf"^memory_budget={shown} is not a size: {TOO_LARGE}"):
        size_argument("memory_budget", given)


@pytest.mark.parametrize("given", ["18446744073709551616", 2**64, "16777216TiB", "0" * 59 + "1"])
def test_sizes_up_to_16_eib_are_read(given: object) -> None:
    assert size_argument("memory_budget", given) == (1 if given == "0" * 59 + "1" else 2**64)


def test_a_size_of_thousands_of_digits_is_refused_by_its_length() -> None:
    with pytest.raises(
        SizeError,
        match=r"^chunk_bytes='1\.9{57}\.\.\. \(5006 characters\) is not a size: 5001 digits, "
        r"more than the 60 a size can need; write bytes",
    ):
        size_argument("chunk_bytes", "1." + "9" * 5000 + "GB")
    with pytest.raises(
        SizeError, match=r"^memory_budget=\(an int of 16610 bits\) is not a size: a "
    ):
        size_argument("memory_budget", -(10**5000))


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("memory_budget", lambda tree, out: lazyckpt.load(tree, memory_budget="9" * 5000 + "GB")),
        ("chunk_bytes", lambda tree, out: lazyckpt.save(out, tree, chunk_bytes="9" * 5000 + "GB")),
        (
            "max_shard_size",
            lambda tree, out: lazyckpt.save(
                out, tree, format="safetensors", max_shard_size="9" * 5000 + "GB"
            ),
        ),
        ("chunk_bytes", lambda tree, out: lazyckpt.save(out, tree, chunk_bytes=10**30)),
    ],
)
def test_verbs_refuse_a_huge_size_naming_the_argument(
    checkpoint: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
    argument: str,
    call: Callable[[Any, Path], object],
) -> None:
    with pytest.raises(SizeError, match=rf"^{argument}=.* is not a size: {TOO_LARGE}"):
        call(lazyckpt.open(checkpoint[0]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_whole_float_is_refused_with_its_bytes() -> None:
    with pytest.raises(SizeError, match=r"^max_shard_size=5000000000.0 is not a size: a float; "
                       r"write bytes \(5000000000\) or"):  # fmt: skip
        size_argument("max_shard_size", 5e9)


def test_none_stands_for_the_default_only_where_there_is_one(tmp_path: Path) -> None:
    assert optional_size("memory_budget", None) is None
    assert optional_size("memory_budget", "1MiB") == 2**20
    with pytest.raises(SizeError, match=r"^chunk_bytes=None is not a size"):
        lazyckpt.save(tmp_path / "out", {"w": np.zeros(4)}, chunk_bytes=None)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tree = {
        "w": rng.standard_normal((128, 64), dtype=np.float32),
        "b": np.arange(64, dtype=np.int32),
    }
    return orbax_save(tmp_path / "ckpt", tree), tree


def test_load_with_a_budget_as_text_equals_load(
    checkpoint: tuple[Path, dict[str, np.ndarray]],
) -> None:
    tree = lazyckpt.open(checkpoint[0])
    by_text = lazyckpt.load(tree, memory_budget="1MiB")
    plain = lazyckpt.load(tree)
    for key in ("w", "b"):
        np.testing.assert_array_equal(by_text[key], plain[key])
        np.testing.assert_array_equal(by_text[key], checkpoint[1][key])


def test_every_verb_takes_a_budget_as_text(
    checkpoint: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    tree = lazyckpt.open(checkpoint[0])
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
    placed = lazyckpt.device_put(tree["w"], sharding, memory_budget="64KiB")
    np.testing.assert_array_equal(np.asarray(placed), checkpoint[1]["w"])
    blocks = list(lazyckpt.iter_blocks(tree, memory_budget="64 KB"))
    assert sum(values.size for _, _, values in blocks) == 128 * 64 + 64
    assert lazyckpt.stats(tree, memory_budget="64KiB")["b"].max == 63
    assert lazyckpt.verify(tree, memory_budget="1MB").ok
    assert not lazyckpt.diff(tree, checkpoint[0], values=True, memory_budget="64KiB")
    out = lazyckpt.convert(checkpoint[0], tmp_path / "out", memory_budget="64KiB")
    np.testing.assert_array_equal(lazyckpt.load(lazyckpt.open(out))["w"], checkpoint[1]["w"])


VERBS: dict[str, Callable[[Any, Path], object]] = {
    "load": lambda tree, _: lazyckpt.load(tree, memory_budget="64 KiBs"),
    "device_put": lambda tree, _: lazyckpt.device_put(
        tree, jax.devices()[0], memory_budget="64 KiBs"
    ),
    "iter_blocks": lambda tree, _: list(lazyckpt.iter_blocks(tree, memory_budget="64 KiBs")),
    "stats": lambda tree, _: lazyckpt.stats(tree, memory_budget="64 KiBs"),
    "verify": lambda tree, _: lazyckpt.verify(tree, memory_budget="64 KiBs"),
    "diff": lambda tree, _: lazyckpt.diff(tree, tree, values=True, memory_budget="64 KiBs"),
    "save": lambda tree, out: lazyckpt.save(out, tree, memory_budget="64 KiBs"),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_refuses_a_bad_budget_and_reads_nothing(
    verb: str,
    checkpoint: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
    count_bytes: Any,
) -> None:
    tree = lazyckpt.open(checkpoint[0])
    with count_bytes() as read, pytest.raises(SizeError, match=r"^memory_budget='64 KiBs' is not"):
        VERBS[verb](tree, tmp_path / "out")
    assert read[0] == 0
    assert not (tmp_path / "out").exists()


def _file_tensors(folder: Path) -> dict[str, dict[str, int]]:
    """Each .safetensors file's tensors and their bytes, from the file's own header."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        data = file.read_bytes()
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        out[file.name] = {
            name: entry["data_offsets"][1] - entry["data_offsets"][0]
            for name, entry in header.items()
            if name != "__metadata__"
        }
    return out


@pytest.mark.parametrize(("max_shard_size", "per_file"), [("1MB", 2), ("1MiB", 3)])
def test_max_shard_size_as_text_shards_as_transformers(
    tmp_path: Path, max_shard_size: str, per_file: int
) -> None:
    """Six tensors of 340,000 bytes: three pass 10^6 bytes but not 2^20, so "1MB"
    gives three files of two, "1MiB" two of three. Saved through `convert`, from an
    Orbax checkpoint written by Orbax."""
    rng = np.random.default_rng(1)
    tree = {f"t{i}": rng.standard_normal(85_000, dtype=np.float32) for i in range(6)}
    source = orbax_save(tmp_path / "ckpt", tree)
    out = Path(
        lazyckpt.convert(
            source, tmp_path / "model", to="safetensors", max_shard_size=max_shard_size
        )
    )
    files = _file_tensors(out)
    assert len(files) == 6 // per_file
    assert all(len(tensors) == per_file for tensors in files.values())
    limit = size_argument("max_shard_size", max_shard_size)
    assert all(sum(tensors.values()) <= limit for tensors in files.values())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 340_000
    assert index["weight_map"] == {
        name: file for file, tensors in files.items() for name in tensors
    }
    loaded = lazyckpt.load(lazyckpt.open(out))
    for name, values in tree.items():
        np.testing.assert_array_equal(loaded[name], values)


def test_save_takes_max_shard_size_as_text(tmp_path: Path) -> None:
    tensors = {f"t{i}": np.full(85_000, i, dtype=np.float32) for i in range(6)}
    out = Path(lazyckpt.save(tmp_path / "m", tensors, format="safetensors", max_shard_size="1MB"))
    assert [len(t) for t in _file_tensors(out).values()] == [2, 2, 2]


def test_chunk_bytes_as_text_sets_the_stored_chunks(tmp_path: Path) -> None:
    value = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)  # 32 KiB
    by_text = lazyckpt.save(tmp_path / "text", {"w": value}, chunk_bytes="4KiB")
    by_int = lazyckpt.save(tmp_path / "int", {"w": value}, chunk_bytes=4096)
    written = lazyckpt.open(by_text)["w"]
    assert written.chunks == (16, 64) == lazyckpt.open(by_int)["w"].chunks  # 4096 bytes
    np.testing.assert_array_equal(written.get(), value)
    decimal = lazyckpt.save(tmp_path / "decimal", {"w": value}, chunk_bytes="4KB")
    assert lazyckpt.open(decimal)["w"].chunks == (8, 64)  # 4000 bytes hold 15 rows: 8 tile


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("chunk_bytes", lambda src, dst: lazyckpt.convert(src, dst, chunk_bytes="4 KiBs")),
        ("max_shard_size", lambda src, dst: lazyckpt.convert(src, dst, max_shard_size="1XB")),
        ("memory_budget", lambda src, dst: lazyckpt.convert(src, dst, memory_budget=-1)),
        ("chunk_bytes", lambda src, dst: lazyckpt.save(dst, {"w": np.ones(4)}, chunk_bytes="")),
        (
            "max_shard_size",
            lambda src, dst: lazyckpt.save(
                dst, {"w": np.ones(4)}, format="safetensors", max_shard_size="5G"
            ),
        ),
    ],
)
def test_a_bad_size_fails_before_anything_is_opened_or_written(
    tmp_path: Path, argument: str, call: Callable[[Path, Path], object]
) -> None:
    """The source does not exist: the size is refused before it is opened."""
    with pytest.raises(SizeError, match=rf"^{argument}="):
        call(tmp_path / "no-such-source", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_cli_sizes_read_as_the_api_reads_them() -> None:
    assert parse_size("5GB") == 5_000_000_000 == DEFAULT_SHARD_BYTES
    assert parse_size("5GiB") == 5 * 2**30
    assert parse_size("256MiB") == 256 * 2**20
    assert parse_size("4096") == 4096


@pytest.mark.parametrize(
    ("flag", "command"),
    [
        ("--memory-budget", ["stats", "{src}", "--memory-budget", "256 MiBs"]),
        ("--memory-budget", ["verify", "{src}", "--memory-budget", "0"]),
        ("--chunk-bytes", ["convert", "{src}", "{dst}", "--chunk-bytes", "4M"]),
        ("--max-shard-size", ["convert", "{src}", "{dst}", "--max-shard-size", "1XB"]),
    ],
)
def test_cli_bad_size_is_a_usage_error_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, command: list[str]
) -> None:
    argv = [a.format(src=tmp_path / "src", dst=tmp_path / "dst") for a in command]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: {argv[-1]!r} is not a size: " in err
    assert "KiB, MiB, GiB, TiB (powers of 1024)" in err
    assert list(tmp_path.iterdir()) == []


def test_cli_huge_size_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["stats", str(tmp_path / "src"), "--memory-budget", "9" * 5000])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --memory-budget: '999" in err
    assert "(5002 characters) is not a size: more than 2**64 bytes (16 EiB)" in err


def test_cli_convert_shards_at_a_decimal_max_shard_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {f"t{i}": np.full(85_000, i, dtype=np.float32) for i in range(6)}
    source = lazyckpt.save(tmp_path / "src", tensors)
    argv = ["convert", source, str(tmp_path / "model"), "--to", "safetensors", "--quiet"]
    assert main([*argv, "--max-shard-size", "1MB"]) == 0
    assert [len(t) for t in _file_tensors(tmp_path / "model").values()] == [2, 2, 2]
    assert main([*argv, "--overwrite"]) == 0  # the default, 5GB: one file
    assert list(_file_tensors(tmp_path / "model")) == ["model.safetensors"]
    capsys.readouterr()
