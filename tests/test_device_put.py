"""`device_put` reads each device's shard for exactly its index, replicas once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyArray, ShardingError, TreeMismatchError
from lazyckpt._device.collective import _parts
from tests.helpers import chunked_save, stored_chunk_bytes


def _assert_placed(array: jax.Array, sharding: jax.sharding.Sharding, want: np.ndarray) -> None:
    """The array has `sharding`, and every device holds exactly its shard of `want`."""
    assert isinstance(array, jax.Array)
    assert array.sharding == sharding
    assert array.dtype == want.dtype and array.shape == want.shape
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_one_sharding_for_a_tree_mixing_sharded_and_replicated(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    mesh = jax.make_mesh((8,), ("d",))
    replicated = NamedSharding(mesh, P())
    placed = lazyckpt.device_put(lazy, replicated)
    for key, want in lazyckpt.leaves(tree):
        got = dict(lazyckpt.leaves(placed))[key]
        if isinstance(want, jax.Array | np.ndarray):
            _assert_placed(got, replicated, np.asarray(want))
        else:
            assert got == want
    assert placed["empty"] == {} and placed["nothing"] is None


def test_saved_partition_specs_on_a_new_mesh(saved: tuple[Path, dict[str, Any]]) -> None:
    """P('x', 'y'), P('x', None), P(None, ('x', 'y')) and P() arrays in one call."""
    path, tree = saved
    lazy = lazyckpt.open(path)
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    arrays = lazyckpt.select(lazy, lambda _, leaf: isinstance(leaf, LazyArray))
    placed = lazyckpt.device_put(arrays, lazyckpt.saved_shardings(mesh))
    for key, want in lazyckpt.leaves(
        lazyckpt.select(tree, lambda k, _: k in dict(lazyckpt.leaves(arrays)))
    ):
        lazy_leaf = dict(lazyckpt.leaves(arrays))[key]
        spec = lazy_leaf.sharding.spec if lazy_leaf.sharding is not None else P()
        _assert_placed(
            dict(lazyckpt.leaves(placed))[key], NamedSharding(mesh, spec), np.asarray(want)
        )


def test_prefix_tree_of_shardings_with_untouched_subtree(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any
) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    rows = NamedSharding(mesh, P("x"))
    shardings = {
        "params": {"dense": rows, "embed": rows, "layers": NamedSharding(mesh, P())},
        "opt_state": None,  # left lazy: never read
    }
    sub = {"params": lazy["params"], "opt_state": lazy["opt_state"]}
    with count_bytes() as read:
        placed = lazyckpt.device_put(sub, shardings)
    assert isinstance(placed["opt_state"]["mu"], LazyArray)
    kernel = tree["params"]["dense"]["kernel"]
    _assert_placed(placed["params"]["dense"]["kernel"], rows, np.asarray(kernel))
    _assert_placed(
        placed["params"]["layers"][1]["w"],
        NamedSharding(mesh, P()),
        np.asarray(tree["params"]["layers"][1]["w"]),
    )
    mu_bytes = stored_chunk_bytes(path, lazy["opt_state"]["mu"])
    assert read[0] < stored_chunk_bytes(path, lazy["params"]["dense"]["kernel"]) + mu_bytes


def test_callable_gets_path_and_array(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    seen = []
    device = jax.devices()[3]

    def choose(key: str, array: LazyArray) -> jax.sharding.Sharding:
        seen.append((key, array.shape))
        return SingleDeviceSharding(device)

    placed = lazyckpt.device_put(lazy["params"]["layers"], choose)
    assert seen == [("params/layers/0/w", (8, 8)), ("params/layers/1/w", (8, 8))]
    assert placed[0]["w"].devices() == {device}
    np.testing.assert_array_equal(placed[0]["w"], np.asarray(tree["params"]["layers"][0]["w"]))


def test_abstract_target_sets_sharding_and_dtype(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    kernel = tree["params"]["dense"]["kernel"]
    target = {
        "kernel": jax.ShapeDtypeStruct(
            kernel.shape, jnp.bfloat16, sharding=NamedSharding(mesh, P("y", "x"))
        ),
    }
    placed = lazyckpt.device_put({"kernel": lazy["params"]["dense"]["kernel"]}, target)
    _assert_placed(
        placed["kernel"], target["kernel"].sharding, np.asarray(kernel).astype(jnp.bfloat16)
    )


def test_single_lazy_array_and_sliced_view(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    kernel = lazyckpt.open(path)["params"]["dense"]["kernel"]
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharding = NamedSharding(mesh, P("b", "a"))
    placed = lazyckpt.device_put(kernel[8:24, ::2], sharding)
    _assert_placed(placed, sharding, np.asarray(tree["params"]["dense"]["kernel"])[8:24, ::2])


def test_zero_d_and_bool_arrays(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    mesh = jax.make_mesh((8,), ("d",))
    placed = lazyckpt.device_put(
        {"s": lazy["scalar_array"], "m": lazy["opt_state"]["mask"]},
        {"s": NamedSharding(mesh, P()), "m": NamedSharding(mesh, P(None, "d"))},
    )
    assert placed["s"].shape == () and float(placed["s"]) == 3.5
    _assert_placed(
        placed["m"], NamedSharding(mesh, P(None, "d")), np.asarray(tree["opt_state"]["mask"])
    )


def test_aligned_sharding_reads_each_stored_chunk_once(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any
) -> None:
    path, _ = saved
    kernel = lazyckpt.open(path)["params"]["dense"]["kernel"]
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    with count_bytes() as read:
        lazyckpt.device_put(kernel, kernel.sharding.on(mesh))
    assert read[0] == stored_chunk_bytes(path, kernel)


def test_replicated_array_is_read_once_not_once_per_device(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any
) -> None:
    path, tree = saved
    mu = lazyckpt.open(path)["opt_state"]["mu"]
    mesh = jax.make_mesh((8,), ("d",))
    with count_bytes() as read:
        placed = lazyckpt.device_put(mu, NamedSharding(mesh, P()))
    assert len(placed.addressable_shards) == 8
    assert read[0] == stored_chunk_bytes(path, mu)  # not 8x
    _assert_placed(placed, NamedSharding(mesh, P()), np.asarray(tree["opt_state"]["mu"]))


def test_sharding_that_does_not_divide_the_shape(saved: tuple[Path, Any]) -> None:
    kernel = lazyckpt.open(saved[0])["params"]["dense"]["kernel"]
    mesh = jax.make_mesh((8,), ("d",))
    with pytest.raises(
        ShardingError,
        match=r"params/dense/kernel: the sharding cannot lay out an "
        r"array of shape \(5, 128\): .*partitioned 8 times.*choose a sharding whose mesh axes divide",
    ):
        lazyckpt.device_put(kernel[:5], NamedSharding(mesh, P("d")))
    assert issubclass(ShardingError, ValueError)


def test_small_whole_array_on_a_sharding_that_does_not_divide_it(
    saved: tuple[Path, Any],
) -> None:
    """A small whole array (read in a batch with others) on a sharding that cannot lay
    it out: a ShardingError naming it, before anything is read."""
    lazy = lazyckpt.open(saved[0])["params"]["dense"]["kernel"]
    assert lazy.shape[0] % 3 and lazy.nbytes <= 1 << 20
    sharding = NamedSharding(jax.make_mesh((3,), ("d",), devices=jax.devices()[:3]), P("d"))
    with pytest.raises(ShardingError, match="params/dense/kernel: the sharding cannot lay out"):
        lazyckpt.device_put(lazy, sharding)


def test_shardings_tree_that_does_not_match(saved: tuple[Path, Any]) -> None:
    lazy = lazyckpt.open(saved[0])
    mesh = jax.make_mesh((8,), ("d",))
    replicated = NamedSharding(mesh, P())
    with pytest.raises(
        TreeMismatchError,
        match=r"^the target does not match the checkpoint: 1 target leaf missing from the "
        r"checkpoint, 1 checkpoint leaf not in the target\n"
        r"  missing from the checkpoint: bais  NamedSharding\n"
        r"  not in the target: bias  float32\[8\]\n"
        r"to restore anyway: partial=True restores only what the target names; missing='keep'",
    ):
        lazyckpt.device_put(lazy["params"]["dense"], {"kernel": replicated, "bais": replicated})
    with pytest.raises(
        TreeMismatchError,
        match=r"1 target leaf missing from the checkpoint\n"
        r"  missing from the checkpoint: params/layers/2  NamedSharding\n",
    ):
        lazyckpt.device_put(
            lazy,
            {
                **dict.fromkeys(lazy),
                "params": {"dense": None, "embed": None, "layers": [replicated] * 3},
            },
        )
    with pytest.raises(
        TreeMismatchError,
        match=r"1 shape differs\n  shape: params/dense/kernel  target \(64, 64\), "
        r"checkpoint \(64, 128\)$",
    ):
        lazyckpt.device_put(
            lazy["params"]["dense"]["kernel"],
            jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=replicated),
        )
    with pytest.raises(
        TreeMismatchError,
        match=r"1 leaf of another kind\n  kind: bias  target 'replicated', checkpoint "
        r"float32\[8\]$",
    ):
        lazyckpt.device_put(lazy["params"]["dense"], {"kernel": replicated, "bias": "replicated"})


def test_saved_shardings_needs_matching_axis_names(saved: tuple[Path, Any]) -> None:
    lazy = lazyckpt.open(saved[0])
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(
        ShardingError,
        match=r"params/dense/kernel: the saved partition spec "
        r"P\('x', 'y'\) uses mesh axes \['x', 'y'\] that the given mesh",
    ):
        lazyckpt.device_put(lazy["params"]["dense"], lazyckpt.saved_shardings(mesh))


def test_broadcast_parts_follow_the_stored_chunks(tmp_path: Path) -> None:
    """`device_put(..., broadcast=True)` cuts each region into one part per replica
    along stored chunk boundaries: the parts are disjoint, cover the region, and share
    no chunk, so that each chunk is read by one process."""
    value = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    w = lazyckpt.open(chunked_save(zarr3=False)(tmp_path / "ckpt", {"w": value}))["w"]
    rows = w.chunks[0]
    assert 1 < rows < 64, w.chunks
    for region in (((0, 64), (0, 16)), ((8, 40), (4, 12)), ((3, 61), (0, 16))):
        for count in (1, 2, 3, 4, 8, 16):
            parts = _parts(w, region, count)
            assert len(parts) == count
            spans = [p for p in parts if p is not None]
            assert all(p[1] == region[1] for p in spans)  # cut along the rows only
            edges = [edge for p in spans for edge in p[0]]
            assert edges[0] == region[0][0] and edges[-1] == region[0][1]
            assert all(a == b for a, b in zip(edges[1:-1:2], edges[2::2], strict=True))
            assert all(edge % rows == 0 for edge in edges[1:-1])  # on chunk boundaries
    stacked = lazyckpt.stack([w, w])  # a composed view: cut evenly
    assert [p[1] for p in _parts(stacked, ((0, 2), (0, 64), (0, 16)), 2) if p] == [
        (0, 32),
        (32, 64),
    ]


def test_broadcast_in_one_process_reads_as_without(saved: tuple[Path, Any]) -> None:
    """With one process nothing is shared between processes: broadcast=True places
    every array as device_put does without it."""
    lazy = lazyckpt.open(saved[0])["params"]
    sharding = NamedSharding(jax.make_mesh((4, 2), ("data", "model")), P(None, "model"))
    kernel = lazy["dense"]["kernel"]
    placed = lazyckpt.device_put(kernel, sharding, broadcast=True)
    assert placed.sharding == sharding
    np.testing.assert_array_equal(np.asarray(placed), kernel.get())


def test_views_jax_has_no_type_for_are_refused_before_any_read(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view cast to text, dates or records loads to NumPy; placing it on a device
    is refused by key before a byte is read (jax's own error names no key, after the
    read). A cast to Python objects is refused where it is asked for: reads fill
    buffers of values, which cannot hold references."""
    from tests.helpers import refuse_data_reads

    a = lazyckpt.open(small)["a"]
    assert lazyckpt.load(a[:1, :2].astype("U8")).dtype == np.dtype("U8")
    for dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4, np.complex64):
        assert lazyckpt.device_put(a.astype(dtype), jax.devices()[0]).dtype == dtype
    refuse_data_reads(monkeypatch)
    for dtype in ("U8", "S4", "datetime64[s]", "V4"):
        with pytest.raises(
            lazyckpt.LazyTypeError,
            match=r"^a: dtype .*, which jax cannot place on cpu devices \(jax arrays hold numbers and booleans\); load it to NumPy",
        ):
            lazyckpt.device_put({"a": a.astype(dtype)}, jax.devices()[0])
    # Narrow floats of ml_dtypes that jax has no type for, or cannot place on CPU
    # devices, are refused alike, with jax's own reason (those it places are placed, above).
    for dtype, reason in (
        (ml_dtypes.float8_e5m3fnu, "TypeError: Dtype float8_e5m3fnu is not a valid JAX array"),
        (ml_dtypes.float6_e2m3fn, "JaxRuntimeError: INVALID_ARGUMENT"),
    ):
        with pytest.raises(lazyckpt.LazyTypeError, match=rf"on cpu devices \({reason}"):
            lazyckpt.device_put({"a": a.astype(dtype)}, jax.devices()[0])
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=r"^a: astype\(object\): a LazyArray reads values, not Python objects; read it first",
    ):
        a.astype(object)
    with pytest.raises(lazyckpt.LazyTypeError, match=r"^a: astype\(object\)"):
        lazyckpt.load(lazyckpt.open(small), like={"a": np.empty((64, 64), object)}, partial=True)
