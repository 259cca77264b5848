"""A fuzzer over the metadata files of real checkpoints: every mutation ends in a
result or a `LazyckptError`, never a raw exception, a crash, a hang or a memory bomb.

Mutations are seeded, so a failure names its case and reruns identically. Each run
mutates `FUZZ_CASES` copies (`LAZYCKPT_FUZZ_CASES` for more, `LAZYCKPT_FUZZ_SEED` for
other ones): JSON files are edited structurally (a value replaced by one from a
hostile pool: huge, negative or fractional numbers, wrong types, escapes, deep
nesting), binary files byte-wise (flips, truncation, insertions). Cases run in one
child process under a memory limit and a timeout (`tests/hostile_child.py`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from tests.helpers import orbax_save, run_cases

FUZZ_CASES = int(os.environ.get("LAZYCKPT_FUZZ_CASES", "400"))
SEED = int(os.environ.get("LAZYCKPT_FUZZ_SEED", "20261201"))
ACTIONS = ["open", "summary", "load", "get_slice", "stats", "verify", "inspect"]

_HOSTILE: list[Any] = [
    None,
    True,
    0,
    -1,
    1.5,
    2**63,
    -(2**63) - 1,
    10**15,
    10**400,
    "",
    "\x1b]0;x\x07",
    "../../etc",
    "/dev/zero",
    "NaN",
    "0xZZ",
    "float32",
    "<f8",
    "|V8",
    "threefry2x32",
    [],
    [10**15, 64],
    [0, 2],
    [-3],
    ["x", "y", "z"],
    {},
    {"name": "zstd"},
    {"name": "bytes", "configuration": {"endian": "big"}},
]


_DEEP = "@deep@"  # replaced by nested lists in the written text (too deep for json.dumps)


def _deep_text(text: str, pick: random.Random) -> str:
    depth = pick.choice([50, 2000, 100_000])
    return text.replace(f'"{_DEEP}"', "[" * depth + "1" + "]" * depth)


def _mutate_json(value: Any, pick: random.Random) -> Any:
    """`value` with one node (anywhere in it) replaced, deleted or duplicated."""
    nodes: list[tuple[Any, Any]] = []  # (container, key)
    todo = [value]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            nodes.extend((node, k) for k in node)
            todo.extend(node.values())
        elif isinstance(node, list):
            nodes.extend((node, i) for i in range(len(node)))
            todo.extend(node)
    if not nodes:
        return pick.choice(_HOSTILE)
    container, key = pick.choice(nodes)
    move = pick.random()
    if move < 0.1 and isinstance(container, dict):
        del container[key]
    elif move < 0.2:
        container[key] = _DEEP
    elif move < 0.3 and isinstance(container[key], str):
        # Nested JSON strings (_sharding entries, key metadata): mutate inside them.
        try:
            inner = json.loads(container[key])
        except (ValueError, RecursionError):
            inner = None
        if isinstance(inner, dict | list):
            container[key] = json.dumps(_mutate_json(inner, pick))
        else:
            container[key] = container[key] + pick.choice(["\x00", "²", "é"])
    elif move < 0.35 and isinstance(container, dict):
        container[pick.choice(["", "..", "\x1b[2J", "a/b"])] = container[key]
    else:
        container[key] = pick.choice(_HOSTILE)
    return value


def _mutate_bytes(data: bytes, pick: random.Random) -> bytes:
    out = bytearray(data)
    move = pick.random()
    if not out or move < 0.2:
        return bytes(out[: pick.randrange(len(out) + 1)])
    if move < 0.6:
        for _ in range(pick.choice([1, 1, 2, 8])):
            out[pick.randrange(len(out))] ^= 1 << pick.randrange(8)
    elif move < 0.8:
        at = pick.randrange(len(out) + 1)
        out[at:at] = pick.randbytes(pick.choice([1, 4, 64]))
    else:
        at = pick.randrange(len(out))
        out[at : at + 8] = pick.choice([b"\xff" * 8, b"\x00" * 8, b"\x7f\xff\xff\xff"])
    return bytes(out)


def _write_mutation(file: Path, pick: random.Random) -> str:
    data = file.read_bytes()
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):  # a file mutated twice may be too deep already
        parsed = None
    if parsed is not None and pick.random() < 0.8:
        mutated = _mutate_json(parsed, pick)
        file.write_text(_deep_text(json.dumps(mutated), pick))
        return "json"
    file.write_bytes(_mutate_bytes(data, pick))
    return "bytes"


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory, mesh: Any) -> list[Path]:
    """Checkpoints as Orbax writes them: OCDBT with zarr2 and zarr3, a folder per
    array, each with a sharded array, a replicated one, a string, a scalar and keys."""
    tree = {
        "params": {
            "w": jax.device_put(
                np.arange(64, dtype=np.float32).reshape(8, 8),
                jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y")),
            ),
            "b": np.ones(5, np.float16),
        },
        "name": "run",
        "step": 3,
        "key": jax.random.key(1),
        "layers": [np.full((4, 4), i, np.int32) for i in range(2)],
    }
    root = tmp_path_factory.mktemp("fuzz-bases")
    return [
        orbax_save(root / "ocdbt-zarr2", tree),
        orbax_save(root / "ocdbt-zarr3", tree, zarr3=True),
        orbax_save(root / "folders", tree, use_ocdbt=False),
    ]


def _metadata_files(base: Path) -> list[Path]:
    """Every file but chunk data: JSON metadata, manifests, b-tree nodes."""
    out = []
    for file in sorted(base.rglob("*")):
        if not file.is_file():
            continue
        name = file.name
        if name.startswith((".", "_")) or name.endswith(".json") or "manifest" in name:
            out.append(file)
        elif file.parent.name == "d" and file.parent.parent == base:
            out.append(file)  # the OCDBT root's b-tree nodes (data lives in ocdbt.process_*)
    return out


def test_mutated_metadata_never_escapes_as_a_raw_error(bases: list[Path], tmp_path: Path) -> None:
    pick = random.Random(SEED)
    cases = []
    for n in range(FUZZ_CASES):
        base = pick.choice(bases)
        files = _metadata_files(base)
        work = tmp_path / f"case{n}"
        shutil.copytree(base, work)
        chosen = [pick.choice(files) for _ in range(pick.choice([1, 1, 1, 2]))]
        kinds = [_write_mutation(work / f.relative_to(base), pick) for f in chosen]
        where = ", ".join(
            f"{f.relative_to(base)} ({k})" for f, k in zip(chosen, kinds, strict=True)
        )
        cases.append(
            {"name": f"{n}: {base.name}: {where}", "path": str(work), "do": pick.choice(ACTIONS)}
        )
    outcomes = run_cases(cases, tmp_path, timeout=600)
    raw = {
        name: outcome
        for name, outcome in outcomes.items()
        if not outcome.startswith(("ok", "lazyckpt:"))
    }
    assert not raw, json.dumps(raw, indent=1)
    assert len(outcomes) == FUZZ_CASES
    errors = sum(outcome.startswith("lazyckpt:") for outcome in outcomes.values())
    assert errors > FUZZ_CASES // 4  # the mutations do damage: most are caught as such
