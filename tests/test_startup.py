"""Opening, walking and reading a checkpoint never import jax: `lazyckpt inspect` and
`lazyckpt show` answer without waiting for its import, for every format, on disk and
over HTTP; verbs that need jax import it when used, and work on trees opened before.

Each case runs in a fresh interpreter: this one imported jax with the conftest. The
tree walk that spares jax's import is checked against `jax.tree_util` here."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import flax.serialization
import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save, save_file

import lazyckpt
from lazyckpt._array import tree as walk
from tests.helpers import orbax_save
from tests.hub_server import HubServer
from tests.test_legacy import _legacy_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TORCH = ROOT / "tests" / "fixtures" / "torch"
JAX = ("jax", "jaxlib")

# `inspect` and `show KEY[0:2]` through the console script's entry point, then a last
# line: what each returned, and the jax modules imported.
_INSPECT_AND_SHOW = """
import json, sys
from lazyckpt._cli.main import main
path, key = sys.argv[1:]
codes = [main(["inspect", path]), main(["show", path, key + "[0:2]"])]
jax = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))
print(json.dumps({"codes": codes, "jax": jax}))
"""


def _child(script: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The output lines of `script` run by a fresh interpreter in the repository."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def _inspect_and_show(path: str, key: str, env: dict[str, str] | None = None) -> str:
    """What `inspect` and `show` print, once the child is known to import no jax."""
    *printed, last = _child(_INSPECT_AND_SHOW, path, key, env=env)
    assert json.loads(last) == {"codes": [0, 0], "jax": []}
    return "\n".join(printed)


def _shown(values: np.ndarray) -> str:
    """`values` as `show` prints them."""
    with np.printoptions(threshold=200, edgeitems=4, linewidth=100):
        return str(values)


W = np.arange(64, dtype=np.float32).reshape(8, 8)


class Case(NamedTuple):
    path: str
    key: str
    listed: tuple[str, ...]  # what `inspect` must print
    rows: np.ndarray  # the values at `key[0:2]`


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory, mesh: jax.sharding.Mesh) -> dict[str, Case]:
    """Checkpoints of every format that lazyckpt reads, each written by its own writer."""
    folder = tmp_path_factory.mktemp("startup")
    sharded = jax.device_put(W, NamedSharding(mesh, P("x", "y")))
    state = {"params": {"w": sharded, "b": np.ones(8, np.float32)}, "step": 3}
    orbax = {
        "orbax-ocdbt": orbax_save(folder / "ocdbt", state),
        "orbax-zarr3": orbax_save(folder / "zarr3", state, zarr3=True),
        "orbax-zarr": orbax_save(folder / "zarr", state, use_ocdbt=False),
    }
    listed = ("params/", "w", "float32[8,8]", "P('x', 'y')")
    found = {name: Case(str(path), "params/w", listed, W[:2]) for name, path in orbax.items()}
    legacy = _legacy_checkpoint(folder / "legacy", {"params": {"w": W}, "step": 3}, set())
    found["orbax-legacy-msgpack"] = Case(str(legacy), "params/w", ("float32[8,8]",), W[:2])
    embed = np.arange(12, dtype=np.float32).reshape(3, 4)
    save_file({"model.embed.weight": embed}, folder / "model.safetensors")
    found["safetensors"] = Case(
        str(folder / "model.safetensors"),
        "model.embed.weight",
        ("embed", "float32[3,4]"),
        embed[:2],
    )
    np.savez(folder / "arrays.npz", w=W, b=np.ones(3))
    found["npz"] = Case(str(folder / "arrays.npz"), "w", ("float32[8,8]",), W[:2])
    (folder / "flax_model.msgpack").write_bytes(flax.serialization.to_bytes({"params": {"w": W}}))
    found["flax-msgpack"] = Case(
        str(folder / "flax_model.msgpack"), "params/w", ("float32[8,8]",), W[:2]
    )
    torch_wrote = np.load(TORCH / "state_expected.npz")["float32"].view(np.float32).reshape(6, 8)
    found["torch-pt"] = Case(str(TORCH / "state.pt"), "float32", ("float32[6,8]",), torch_wrote[:2])
    gpt2 = lazyckpt.open(TORCH / "gpt2_bin")["transformer"]["h"]["0"]["attn"]["c_attn"]["weight"]
    found["torch-bin-folder"] = Case(
        str(TORCH / "gpt2_bin"),
        "transformer/h/0/attn/c_attn/weight",
        ("c_attn", f"float32[{','.join(map(str, gpt2.shape))}]"),
        gpt2[:2].get(),
    )
    return found


@pytest.mark.parametrize(
    "name",
    [
        "orbax-ocdbt",
        "orbax-zarr3",
        "orbax-zarr",
        "orbax-legacy-msgpack",
        "safetensors",
        "npz",
        "flax-msgpack",
        "torch-pt",
        "torch-bin-folder",
    ],
)
def test_inspect_and_show_import_no_jax(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    printed = _inspect_and_show(case.path, case.key)
    for text in case.listed:
        assert text in printed, (text, printed)
    assert f"shape={case.rows.shape}" in printed and _shown(case.rows) in printed, printed


def test_remote_checkpoints_inspect_and_show_without_jax(hub: HubServer, tmp_path: Path) -> None:
    embed = np.arange(12, dtype=np.float32).reshape(3, 4)
    model = save({"model.embed.weight": embed})
    hub.commit("org/model", {"model.safetensors": model, "config.json": b"{}"})
    local = orbax_save(tmp_path / "ckpt", {"params": {"w": W}, "step": 3})
    files = {
        f"ckpt/{file.relative_to(local).as_posix()}": file.read_bytes()
        for file in sorted(local.rglob("*"))
        if file.is_file()
    }
    hub.commit("org/jax", files)
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_TOKEN_PATH": str(tmp_path / "no-token"),
    }
    for path, key, listed, rows in [
        ("hf://org/model", "model.embed.weight", "float32[3,4]", embed[:2]),
        ("hf://org/jax/ckpt", "params/w", "float32[8,8]", W[:2]),
        (
            hub.add_plain_file("m/model.safetensors", model),
            "model/embed/weight",
            "float32[3,4]",
            embed[:2],
        ),
    ]:
        printed = _inspect_and_show(path, key, env)
        assert listed in printed and _shown(rows) in printed, (path, printed)


@pytest.mark.parametrize("name", ["orbax-ocdbt", "safetensors"])
def test_the_import_profile_has_no_jax(cases: dict[str, Case], name: str) -> None:
    command = ["-X", "importtime", "-m", "lazyckpt._cli.main", "inspect", cases[name].path]
    result = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "lazyckpt._lazy" in imported  # (the profile is the run's)
    assert not [name for name in imported if name.split(".")[0] in JAX]
    # (an Orbax checkpoint is read through tensorstore; a local safetensors file is not)
    tensorstore = [name for name in imported if name.split(".")[0] == "tensorstore"]
    assert bool(tensorstore) == name.startswith("orbax"), tensorstore


# A local file's open and summary, in a fresh process: the modules of tensorstore and jax
# imported by then, and after, its values read through `get()` and `load`.
_OPEN_AND_SUMMARY = """
import json, re, sys
import lazyckpt
path, key = sys.argv[1:]
tree = lazyckpt.open(path)
print(lazyckpt.summary(tree))
first = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorstore", "jax", "jaxlib"))
array, loaded = tree, lazyckpt.load(tree)
for part in re.split("[./]", key):  # (safetensors' names nest on their dots)
    array, loaded = array[part], loaded[part]
rows = array[0:2].get()
table = lazyckpt.stats(tree)  # (statistics need NumPy alone)
print(json.dumps({"imported": first, "rows": rows.tolist(), "loaded": loaded[:2].tolist(),
                  "stats_jax": "jax" in sys.modules, "stats": len(table)}))
"""


@pytest.mark.parametrize("name", ["safetensors", "npz", "torch-pt", "torch-bin-folder"])
def test_a_local_open_and_summary_import_neither_tensorstore_nor_jax_nor_stats_jax(
    cases: dict[str, Case], name: str
) -> None:
    case = cases[name]
    *printed, last = _child(_OPEN_AND_SUMMARY, case.path, case.key)
    found = json.loads(last)
    assert found["imported"] == [], found["imported"]
    assert case.listed[0] in "\n".join(printed)
    assert found["rows"] == found["loaded"] == case.rows.tolist()
    assert found["stats"] >= 1 and not found["stats_jax"], found


# Opens, walks and reads without jax, then imports it: the verbs that need it take the
# tree opened before.
_JAX_LATER = """
import sys
import numpy as np
import lazyckpt
tree = lazyckpt.open(sys.argv[1])
loaded = lazyckpt.load(tree)
row = tree["params"]["w"][1].get()
print("jax" in sys.modules, sorted(path for path, _ in lazyckpt.leaves(lazyckpt.select(tree, "params"))))
import jax
mesh = jax.make_mesh((4, 2), ("x", "y"))
placed = lazyckpt.device_put(tree["params"], lazyckpt.saved_shardings(mesh))
w = placed["w"]
print(type(w).__name__, w.sharding.spec, np.array_equal(np.asarray(w), loaded["params"]["w"]))
print(np.array_equal(row, loaded["params"]["w"][1]), jax.eval_shape(lambda x: x.sum(), tree["params"]["w"]))
"""


def test_verbs_that_need_jax_work_on_a_tree_opened_without_it(cases: dict[str, Case]) -> None:
    lines = _child(_JAX_LATER, cases["orbax-ocdbt"].path)
    assert lines == [
        "False ['params/b', 'params/w']",
        "ArrayImpl P('x', 'y') True",
        "True ShapeDtypeStruct(shape=(), dtype=float32)",
    ]


# Plain containers are walked without jax; a container jax registers itself (here a
# NamedTuple) is jax's to take apart, and imports it.
_WALKS = """
import collections, sys, typing
from lazyckpt._array import tree as walk
plain = {"b": [1, (2, None)], "a": {"z": 3, "y": [None, []]}}
print(walk.flatten(plain), walk.map_leaves(str, plain), "jax" in sys.modules)
Pair = typing.NamedTuple("Pair", [("second", object), ("first", object)])
print(walk.flatten([Pair(1, 2), collections.OrderedDict(b=3, a=4)]), "jax" in sys.modules)
"""


def test_plain_containers_are_walked_without_jax_and_others_by_jax() -> None:
    lines = _child(_WALKS)
    assert lines == [
        "[(('a', 'z'), 3), (('b', 0), 1), (('b', 1, 0), 2)] "
        "{'a': {'y': [None, []], 'z': '3'}, 'b': ['1', ('2', None)]} False",
        "[((0, 'second'), 1), ((0, 'first'), 2), ((1, 'b'), 3), ((1, 'a'), 4)] True",
    ]


class _Pair(NamedTuple):
    second: Any
    first: Any


_leaves = st.one_of(st.integers(-3, 3), st.text("ab", max_size=2), st.none())
_trees = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", max_size=2), children, max_size=3),
        st.dictionaries(st.integers(0, 5), children, max_size=3),
        st.dictionaries(st.text("abc", max_size=2), children, max_size=3).map(
            collections.OrderedDict
        ),
        st.tuples(children, children).map(lambda pair: _Pair(*pair)),
    ),
    max_leaves=12,
)


@given(_trees)
def test_the_walk_is_jax_s(tree: Any) -> None:
    """Every walk gives what `jax.tree_util` gives: leaves and key paths in its order,
    nodes rebuilt as their own types, None an empty subtree (or, asked, a leaf)."""
    tu = jax.tree_util
    flat = [(walk.path_of(path), leaf) for path, leaf in tu.tree_flatten_with_path(tree)[0]]
    assert walk.flatten(tree) == flat
    assert walk.leaf_values(tree) == tu.tree_leaves(tree)
    assert repr(walk.map_leaves(lambda x: [x], tree)) == repr(tu.tree_map(lambda x: [x], tree))
    mapped = walk.map_with_path(lambda path, x: (path, x), tree, none_is_leaf=True)
    want = tu.tree_map_with_path(
        lambda path, x: (walk.path_of(path), x), tree, is_leaf=lambda x: x is None
    )
    assert repr(mapped) == repr(want)
    kids = walk.children(tree)
    one_level, _ = tu.tree_flatten_with_path(tree, is_leaf=lambda child: child is not tree)
    if kids is None:
        assert tree is not None and one_level == [((), tree)]
        return
    assert [walk.key_of(path[0]) for path, _ in one_level] == [
        key if isinstance(key, str | int) else str(key) for key, _ in kids
    ]
    new = [("new", i) for i in range(len(kids))]
    structure = tu.tree_structure(tree, is_leaf=lambda child: child is not tree)
    assert repr(walk.rebuild(tree, new)) == repr(tu.tree_unflatten(structure, new))


def test_dtype_checks_without_jax_agree_with_jax_numpy() -> None:
    """ml_dtypes' `float8_e5m2` claims NumPy's kind 'f' while its type is no
    `np.floating` (review of issue 41): every ml_dtypes type is filed as jax files it."""
    import jax.numpy as jnp
    import ml_dtypes

    from lazyckpt._array.dtypes import issubdtype

    known = [np.dtype(getattr(jnp, name)) for name in dir(ml_dtypes)
             if name.startswith(("float", "bfloat", "int", "uint")) and hasattr(jnp, name)]  # fmt: skip
    known += [np.dtype(t) for t in (np.float32, np.int8, np.uint16, np.bool_, np.complex64)]
    assert np.dtype(jnp.float8_e5m2) in known
    for dtype in known:
        for category in (np.floating, np.integer, np.signedinteger, np.unsignedinteger):
            assert issubdtype(dtype, category) == jnp.issubdtype(dtype, category), (dtype, category)


def test_an_e5m2_array_restores_into_a_float16_target(tmp_path: Path) -> None:
    import ml_dtypes

    scales = np.array([[2.0, 0.5]], np.float32).astype(ml_dtypes.float8_e5m2)
    save_file({"scale": scales}, str(tmp_path / "m.safetensors"))
    opened = lazyckpt.open(tmp_path / "m.safetensors")
    out = lazyckpt.load(opened, like={"scale": np.zeros((1, 2), np.float16)})
    assert out["scale"].dtype == np.float16 and out["scale"].tolist() == [[2.0, 0.5]]
