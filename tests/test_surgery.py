"""Lazy surgery (stack, concat, transpose, reshape, unstack, squeeze) against NumPy.

Random programs of these operations, slicing and casts over arrays saved by Orbax
with different chunk grids (sharded, one chunk, decoded by lazyckpt or read by
tensorstore), read every way a view is read: `get`, `load`, `device_put` with a
sharding, `iter_blocks` at a small budget; and byte counts that show each stored
chunk is read once and nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt._storage.metrics import bytes_read
from tests.helpers import orbax_save

# Casts drawn by the programs: rounding (float16, bfloat16), wrapping (int8, uint8,
# int16) and widening ones, so that a lost intermediate cast shows in the values.
CASTS = [np.float32, np.float16, jnp.bfloat16, np.float64, np.int32, np.int16, np.int8, np.uint8]
# Transposes and casts twice as often: their interplay is where values were lost.
OPS = ["index", "T", "transpose", "transpose", "reshape", "stack", "concat", "astype", "astype"]
# Several thousand once by hand: LAZYCKPT_SURGERY_EXAMPLES=5000 LAZYCKPT_HYPOTHESIS=explore
EXAMPLES = int(os.environ.get("LAZYCKPT_SURGERY_EXAMPLES", "150"))

# One shape, four ways of storing it, so that any two can be stacked or concatenated.
SHAPE = (8, 6, 4)


@pytest.fixture(scope="module")
def parts(mesh: jax.sharding.Mesh, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    rng = np.random.default_rng(17)
    values = {
        "sharded": rng.standard_normal(SHAPE).astype(np.float32),
        "rows": rng.standard_normal(SHAPE).astype(np.float32),
        "ints": rng.integers(-100, 100, SHAPE).astype(np.int32),
        "numpy": rng.standard_normal(SHAPE).astype(np.float32),
        # Big enough (1.5 MiB in one chunk) for lazyckpt's own decoder.
        "big": rng.standard_normal((384, 1024)).astype(np.float32),
        **{f"layer{i}": rng.standard_normal((32, 256)).astype(np.float32) for i in range(3)},
    }
    tree = {
        "sharded": jax.device_put(values["sharded"], NamedSharding(mesh, P("x", "y"))),
        "rows": jax.device_put(values["rows"], NamedSharding(mesh, P(None, None, "y"))),
        "ints": jax.device_put(values["ints"], NamedSharding(mesh, P("y"))),
        "numpy": values["numpy"],
        "big": values["big"],
        # Chunks of 8 KiB: large enough not to live inside OCDBT's b-tree nodes.
        **{
            f"layer{i}": jax.device_put(values[f"layer{i}"], NamedSharding(mesh, P("x")))
            for i in range(3)
        },
    }
    path = orbax_save(tmp_path_factory.mktemp("surgery") / "ckpt", tree)
    return {"lazy": lazyckpt.open(path), "numpy": values, "path": path}


def _factorized(size: int, draw: Callable[[Any], Any]) -> tuple[int, ...]:
    """A random shape of `size` elements, 1 to 4 dimensions."""
    factors, n, p = [], size, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    ndim = draw(st.integers(1, 4))
    dims = [1] * ndim
    for f in factors:
        dims[draw(st.integers(0, ndim - 1))] *= f
    return tuple(dims)


def _program(data: st.DataObject, parts: dict[str, Any]) -> tuple[Any, np.ndarray]:
    """A random composition, built on LazyArrays and NumPy side by side (no reads)."""
    names = ["sharded", "rows", "ints", "numpy"]
    pick = data.draw(st.sampled_from(names))
    lazy, want = parts["lazy"][pick], parts["numpy"][pick]
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(OPS))
        if op == "index" and want.size:
            index = data.draw(
                hnp.basic_indices(want.shape, allow_newaxis=True, allow_ellipsis=True)
            )
            lazy, want = lazy[index], want[index]
        elif op == "T":
            lazy, want = lazy.T, want.T
        elif op == "transpose" and want.ndim:
            perm = data.draw(st.permutations(range(want.ndim)))
            lazy, want = lazy.transpose(*perm), want.transpose(*perm)
        elif op == "reshape" and want.size:
            shape = _factorized(want.size, data.draw)
            lazy, want = lazy.reshape(shape), want.reshape(shape)
        elif op in ("stack", "concat") and want.ndim:
            # Another array of the same shape: a different stored array, or the same
            # one read another way (reversed), which shares its chunks.
            other_name = data.draw(st.sampled_from(names))
            other, other_want = parts["lazy"][other_name], parts["numpy"][other_name]
            if other.shape != lazy.shape:
                other, other_want = lazy[::-1], want[::-1]
            axis = data.draw(st.integers(-want.ndim, want.ndim - 1))
            if op == "stack":
                lazy = lazyckpt.stack([lazy, other], axis=axis)
                want = np.stack([want, other_want], axis=axis)
            else:
                cut = data.draw(st.integers(0, want.shape[axis]))
                head = (slice(None),) * (axis % want.ndim) + (slice(0, cut),)
                lazy = lazyckpt.concat([lazy, other[head]], axis=axis)
                want = np.concatenate([want, other_want[head]], axis=axis)
        elif op == "astype":
            dtype = np.dtype(data.draw(st.sampled_from(CASTS)))
            if _defined(want, dtype):
                lazy, want = lazy.astype(dtype), want.astype(dtype)
        assert lazy.shape == want.shape and lazy.dtype == want.dtype, op
    return lazy, want


def _defined(values: np.ndarray, dtype: np.dtype[Any]) -> bool:
    """Whether NumPy defines the cast of `values` to `dtype`: C leaves a float out of
    an integer type's range (NaN, negative to unsigned) undefined."""
    if values.dtype.kind in "biu" or dtype.kind not in "iu" or not values.size:
        return True  # bfloat16 is kind "V": a float, checked below
    wide = values.astype(np.float64)
    info = np.iinfo(dtype)
    return bool(np.isfinite(wide).all() and wide.min() > info.min - 1 and wide.max() < info.max + 1)


def _reassembled(lazy: Any, budget: int) -> np.ndarray:
    out = np.full(lazy.shape, 0, lazy.dtype)
    seen = np.zeros(lazy.shape, np.int32)
    for _, index, values in lazyckpt.iter_blocks(lazy, memory_budget=budget):
        out[index] = values
        seen[index] += 1
    assert (seen == 1).all(), "every element is in exactly one block"
    return out


@pytest.fixture(scope="module")
def safetensors_parts(
    parts: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The same values as `parts`, in a safetensors file: raw bytes that reads place
    straight into their results."""
    values = {name: parts["numpy"][name] for name in ("sharded", "rows", "ints", "numpy")}
    path = lazyckpt.save(tmp_path_factory.mktemp("raw") / "parts.safetensors", values)
    return {"lazy": lazyckpt.open(path), "numpy": values}


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_compositions_match_numpy(parts: dict[str, Any], data: st.DataObject) -> None:
    _check_program(*_program(data, parts), data)


@settings(max_examples=EXAMPLES // 3, deadline=None)
@given(data=st.data())
def test_compositions_of_safetensors_match_numpy(
    safetensors_parts: dict[str, Any], data: st.DataObject
) -> None:
    """A stack of transposes of safetensors tensors once loaded wrong values: raw reads
    wrote C-order bytes into a transposed view of the stack's buffer."""
    _check_program(*_program(data, safetensors_parts), data)


def _check_program(lazy: Any, want: np.ndarray, data: st.DataObject) -> None:
    reader = data.draw(st.sampled_from(["get", "load", "blocks", "device_put"]))
    budget = data.draw(st.sampled_from([64, 1 << 10, 1 << 20]))
    jax.eval_shape(lambda x: x, lazy)  # shapes and dtypes alone
    if reader == "get":
        got = lazy.get()
    elif reader == "load":
        got = lazyckpt.load({"x": lazy}, memory_budget=budget)["x"]
    elif reader == "blocks":
        got = _reassembled(lazy, budget)
    else:
        mesh = jax.make_mesh((2, 4), ("a", "b"))
        spec: list[str | None] = [None] * lazy.ndim
        for axis, name, size in ((0, "a", 2), (lazy.ndim - 1, "b", 4)):
            if lazy.ndim > axis >= 0 and lazy.shape[axis] % size == 0 and spec[axis] is None:
                spec[axis] = name
        got = np.asarray(lazyckpt.device_put(lazy, NamedSharding(mesh, P(*spec))))
        want = want.astype(jax.dtypes.canonicalize_dtype(want.dtype))  # jax without x64
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_compositions_of_a_decoded_chunk(parts: dict[str, Any], data: st.DataObject) -> None:
    """The same operations on an array lazyckpt decodes itself (one 1.5 MiB chunk)."""
    lazy, want = parts["lazy"]["big"], parts["numpy"]["big"]
    rows = data.draw(st.integers(1, 48))
    start = data.draw(st.integers(0, 384 - rows))
    lazy, want = lazy[start : start + rows], want[start : start + rows]
    choice = data.draw(st.sampled_from(["T", "reshape", "stack", "unstack"]))
    if choice == "T":
        lazy, want = lazy.T, want.T
    elif choice == "reshape":
        shape = (rows * 4, 256)
        lazy, want = lazy.reshape(shape)[:, 7:200], want.reshape(shape)[:, 7:200]
    elif choice == "stack":
        lazy = lazyckpt.stack([lazy, lazy.astype(np.float16)], axis=1)
        want = np.stack([want, want.astype(np.float16)], axis=1)
    else:
        lazy = lazyckpt.stack(lazyckpt.unstack(lazy, 1)[::3], axis=0)
        want = np.stack(list(np.moveaxis(want, 1, 0))[::3], axis=0)
    reader = data.draw(st.sampled_from(["get", "blocks"]))
    got = lazy.get() if reader == "get" else _reassembled(lazy, 1 << 20)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_strided_streams_decode_each_chunk_once(parts: dict[str, Any], data: st.DataObject) -> None:
    """Streaming a strided view (`x[::-1]`, `x[:, ::2]`, ...) of an array lazyckpt decodes
    once re-decoded its chunk for every block: 62x the stored bytes at a 1 MiB budget."""
    lazy, want = parts["lazy"]["big"], parts["numpy"]["big"]
    index = data.draw(hnp.basic_indices(want.shape, allow_newaxis=True, allow_ellipsis=True))
    budget = data.draw(st.sampled_from([64 << 10, 1 << 20, 8 << 20]))
    view = lazy[index]
    before = bytes_read()
    lazy.get()
    stored = bytes_read() - before
    before = bytes_read()
    got = _reassembled(view, budget) if view.size else view.get()
    read = bytes_read() - before
    np.testing.assert_array_equal(got, want[index])
    assert read <= stored * 1.05  # each stored chunk once, whatever the budget and stride
    total = lazyckpt.stats({"v": view}, memory_budget=budget)["v"] if view.size else None
    if total is not None:
        assert total.mean is not None
        assert np.isclose(total.mean, want[index].astype(np.float64).mean(), rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_strided_and_reshaped_saves_decode_each_chunk_once(
    parts: dict[str, Any], data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Saving a strided view or a reshape of one large stored chunk, into the new
    checkpoint's chunk grid, once decoded the chunk again for every block or cell:
    2.6x the stored bytes for an Orbax save of `x[::-1]`, 135x for a safetensors save
    of a reshape at a 64 KiB budget."""
    lazy, want = parts["lazy"]["big"], parts["numpy"]["big"]
    if data.draw(st.booleans(), label="reshape"):
        shape = data.draw(
            st.sampled_from(
                [
                    *[(96, -1), (768, -1), (6144, -1), (1, 384, 1024), (1, -1)],
                    *[(384, 1, 1024), (1, 1, 6144, 64), (-1,)],
                ]
            )
        )
        index: Any = shape
        view, value = lazy.reshape(shape), want.reshape(shape)
    else:
        index = data.draw(hnp.basic_indices(want.shape, allow_newaxis=True, allow_ellipsis=True))
        view, value = lazy[index], want[index]
    assume(view.size > 0)
    budget = data.draw(st.sampled_from([64 << 10, 1 << 20]))
    form = data.draw(st.sampled_from(["orbax", "safetensors"]))
    chunk_bytes = data.draw(st.sampled_from([16 << 10, 256 << 10, 4 << 20]))
    before = bytes_read()
    lazy.get()
    stored = bytes_read() - before
    folder = tmp_path_factory.mktemp("strided-save")
    before = bytes_read()
    if form == "orbax":
        saved = lazyckpt.save(
            folder / "out", {"v": view}, memory_budget=budget, chunk_bytes=chunk_bytes
        )
    else:
        saved = lazyckpt.save(
            folder / "out", {"v": view}, memory_budget=budget, format="safetensors"
        )
    read = bytes_read() - before
    assert read <= stored * 1.05, (index, read / stored)
    np.testing.assert_array_equal(lazyckpt.open(saved)["v"].get(), value)


def test_views_index_into_their_parts(parts: dict[str, Any]) -> None:
    a, b = parts["lazy"]["sharded"], parts["lazy"]["rows"]
    stacked = lazyckpt.stack([a, b])
    assert stacked[1] is b or stacked[1] == b
    assert stacked[0, 2:].sources == (a[2:],)
    assert [s.key for s in stacked.sources] == ["sharded", "rows"]
    assert lazyckpt.concat([a, b], axis=1)[:, 6:].sources == (b,)
    assert a == a.T.T
    assert a.reshape(48, 4).reshape(SHAPE) == a
    assert "stack of 2 along axis 0" in repr(stacked)
    assert stacked.key == "stack(sharded, rows)"
    assert lazyckpt.unstack(stacked)[0] == a


def test_bad_surgery_is_a_clear_error(parts: dict[str, Any]) -> None:
    a, big = parts["lazy"]["sharded"], parts["lazy"]["big"]
    with pytest.raises(
        lazyckpt.LazyIndexError,
        match=r"stack needs arrays of one shape, found sharded \(8, 6, 4\), big \(384, 1024\)",
    ):
        lazyckpt.stack([a, big])
    with pytest.raises(
        lazyckpt.LazyIndexError, match=r"concat along axis 0 needs shapes that differ only there"
    ):
        lazyckpt.concat([a, big])
    with pytest.raises(
        lazyckpt.LazyIndexError,
        match=r"sharded: cannot reshape an array of shape \(8, 6, 4\) \(192 elements\) into \(5, -1\)",
    ):
        a.reshape(5, -1)
    with pytest.raises(lazyckpt.LazyIndexError, match=r"axes \(0, 0, 1\) are not a permutation"):
        a.transpose(0, 0, 1)
    with pytest.raises(lazyckpt.LazyTypeError, match="stack takes LazyArrays, found ndarray"):
        lazyckpt.stack([a, np.zeros(SHAPE)])  # type: ignore[list-item]
    with pytest.raises(lazyckpt.LazyIndexError, match="needs at least one"):
        lazyckpt.concat([])


def test_one_layer_of_a_stack_reads_only_its_chunks(
    parts: dict[str, Any], count_bytes: Callable[[], Any]
) -> None:
    # A fresh open for every count: tensorstore caches what an open has read.
    def stacked() -> Any:
        lazy = lazyckpt.open(parts["path"])
        return lazyckpt.stack([lazy["layer0"], lazy["layer1"], lazy["layer2"]])

    layer, view = lazyckpt.open(parts["path"])["layer1"], stacked()
    with count_bytes() as alone:
        layer[2:5].get()
    with count_bytes() as via_stack:
        view[1, 2:5].get()
    assert via_stack == alone and alone[0] > 0
    # The whole stack reads each part once: what reading the parts one by one reads.
    # (One element read first through each open: after an open that walked the OCDBT
    # b-tree itself, tensorstore's driver reads the tree's node once more, on its first
    # read, and these counts compare chunks.)
    opened = [lazyckpt.open(parts["path"])[f"layer{i}"] for i in range(3)]
    view = stacked()
    for array in [*opened, *view.sources]:
        array[(0,) * array.ndim].get()
    with count_bytes() as each:
        for array in opened:
            array.get()
    with count_bytes() as whole:
        lazyckpt.load(view.T)
    assert whole == each


def test_parts_sharing_a_stored_array_read_its_chunks_once(
    parts: dict[str, Any], count_bytes: Callable[[], Any]
) -> None:
    def rebuilt() -> Any:
        # unstack then stack back, transposed and cut in halves: one read of the chunk.
        big = lazyckpt.open(parts["path"])["big"]
        return lazyckpt.concat(
            [lazyckpt.stack(lazyckpt.unstack(big[:192]), axis=1), big[192:].T], axis=1
        )

    big, view = lazyckpt.open(parts["path"])["big"], rebuilt()
    with count_bytes() as once:
        big.get()
    mesh = jax.make_mesh((8,), ("d",))
    with count_bytes() as placed:
        result = lazyckpt.device_put(view, NamedSharding(mesh, P("d")))
    assert placed == once and once[0] > 0
    np.testing.assert_array_equal(np.asarray(result), parts["numpy"]["big"].T)
    view = rebuilt()
    with count_bytes() as loaded:
        lazyckpt.load(view)
    assert loaded == once


def test_a_stream_of_bands_reads_each_chunk_once(
    parts: dict[str, Any], count_bytes: Callable[[], Any]
) -> None:
    """A chunk larger than a block streams in bands from one decode: the bytes read
    are the chunk's, not a window more per band (the size check reads a header)."""
    big = lazyckpt.open(parts["path"])["big"]
    with count_bytes() as once:
        big.get()
    big = lazyckpt.open(parts["path"])["big"]
    with count_bytes() as streamed:
        blocks = list(lazyckpt.iter_blocks(big, memory_budget=1 << 20))
    assert len(blocks) > 4  # bands of the 1.5 MiB chunk
    assert once[0] <= streamed[0] <= once[0] + 128


def test_every_verb_takes_composed_views(parts: dict[str, Any], tmp_path: Any) -> None:
    lazy, values = parts["lazy"], parts["numpy"]
    layers = [lazy[f"layer{i}"] for i in range(3)]
    tree = {
        "stacked": lazyckpt.stack(layers).transpose(1, 0, 2),
        "fused": lazyckpt.concat(layers, axis=1).reshape(32, 3, 256),
        "half": lazy["big"][:100].T.astype(np.float16),
    }
    want = {
        "stacked": np.stack([values[f"layer{i}"] for i in range(3)]).transpose(1, 0, 2),
        "fused": np.concatenate([values[f"layer{i}"] for i in range(3)], axis=1).reshape(
            32, 3, 256
        ),
        "half": values["big"][:100].T.astype(np.float16),
    }
    shapes = jax.eval_shape(lambda t: t, tree)
    assert {k: (v.shape, v.dtype) for k, v in shapes.items()} == {
        k: (v.shape, v.dtype) for k, v in want.items()
    }
    stats = lazyckpt.stats(tree, memory_budget=1 << 20)
    for key, expected in want.items():
        assert stats[key].max == pytest.approx(float(expected.max()))
    summary = str(lazyckpt.summary(tree))
    assert "stacked" in summary and "fused" in summary
    assert lazyckpt.verify(tree).ok
    saved = lazyckpt.open(lazyckpt.save(tmp_path / "saved", tree, chunk_bytes=16 << 10))
    assert not lazyckpt.diff(tree, saved, values=True)
    for key, expected in want.items():
        np.testing.assert_array_equal(saved[key].get(), expected)


def test_casts_through_a_rounding_dtype_round_as_numpy(tmp_path: Any) -> None:
    # int64 to float64 is "safe" for NumPy but rounds: float32(float64(x)) is not
    # float32(x) for these, so the intermediate cast must be kept.
    a = np.array([2**60 + 2**36 + 1, 2**53 + 1, -(2**53) - 1, 7], dtype=np.int64)
    x = lazyckpt.open(lazyckpt.save(tmp_path / "c", {"a": a}))["a"]
    for chain in [(np.float64, np.float32), (np.float16, np.float32), (np.int8, np.int64)]:
        lazy, want = x, a
        for dtype in chain:
            with np.errstate(over="ignore", invalid="ignore"):
                lazy, want = lazy.astype(dtype), want.astype(dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            np.testing.assert_array_equal(lazy.get(), want)
    assert x.astype(np.int32).astype(np.float64).stored is not x.stored  # kept
    assert x[:2].astype(np.float64).astype(np.float32).stored is not x.stored
    small = lazyckpt.open(lazyckpt.save(tmp_path / "d", {"b": a.astype(np.int32)}))["b"]
    assert small.astype(np.float64).astype(np.float32).stored is small.stored  # exact


@pytest.mark.parametrize(
    ("name", "casts"),
    [
        ("ints", ("uint8", "int16")),
        ("sharded", ("float16", "float32")),
        ("sharded", ("int8", "float32")),
    ],
)
def test_a_cast_between_transposes_is_kept(
    parts: dict[str, Any], name: str, casts: tuple[str, str]
) -> None:
    # Composing the two transposes once built one node in the middle dtype over the
    # un-cast part: the wrap to uint8 (or float16's rounding) was lost.
    lazy, values = parts["lazy"][name], parts["numpy"][name]
    view = lazy.transpose(1, 0, 2).astype(casts[0]).transpose(0, 2, 1).astype(casts[1])
    want = values.transpose(1, 0, 2).astype(casts[0]).transpose(0, 2, 1).astype(casts[1])
    np.testing.assert_array_equal(view.get(), want)
    np.testing.assert_array_equal(lazyckpt.load(view), want)
    np.testing.assert_array_equal(_reassembled(view, 1 << 10), want)


def test_concatenating_along_a_new_axis_streams(parts: dict[str, Any]) -> None:
    x = parts["lazy"]["sharded"][:, None, 2]
    want = parts["numpy"]["sharded"][:, None, 2]
    joined = lazyckpt.concat([x, x[::-1]], axis=1)
    expected = np.concatenate([want, want[::-1]], axis=1)
    np.testing.assert_array_equal(_reassembled(joined, 64), expected)
    np.testing.assert_array_equal(joined.get(), expected)


def test_empty_slices_with_negative_steps_stay_empty(parts: dict[str, Any]) -> None:
    x, w = parts["lazy"]["sharded"], parts["numpy"]["sharded"]
    cases = [
        (lazyckpt.stack([x, x])[0, -100::-1], np.stack([w, w])[0, -100::-1]),
        (
            x.astype("float16").astype("float32")[-100::-1],
            w.astype("float16").astype("float32")[-100::-1],
        ),
        (lazyckpt.concat([x, x])[3, -100::-1], np.concatenate([w, w])[3, -100::-1]),
        (x.transpose(1, 0, 2)[:, 0, -100::-1], w.transpose(1, 0, 2)[:, 0, -100::-1]),
    ]
    for lazy, want in cases:
        assert lazy.shape == want.shape
        np.testing.assert_array_equal(lazy.get(), want)


def test_a_strided_reshape_reads_no_box_around_it(tmp_path: Any) -> None:
    import tracemalloc

    a = np.arange(2 << 20, dtype=np.int32).reshape(512, 4096)  # 8 MiB in 1 MiB chunks
    x = lazyckpt.open(lazyckpt.save(tmp_path / "c", {"a": a}, chunk_bytes=1 << 20))["a"]
    tracemalloc.start()
    try:
        # (a budget of its own: the default grows with the cores, and with it the
        # windows that the chunks' stored bytes are read through, whatever the view)
        got = lazyckpt.load(x.reshape(-1)[::4096], memory_budget="2MiB")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, a.reshape(-1)[::4096])
    assert peak < 6 << 20  # the 8 MiB box around the 2 KiB view is not allocated
    view, want = x.reshape(4096, 512)[::-3][:, ::5], a.reshape(4096, 512)[::-3][:, ::5]
    np.testing.assert_array_equal(_reassembled(view, 256 << 10), want)


def test_layer_helpers_refuse_what_they_cannot_do(parts: dict[str, Any]) -> None:
    w = parts["lazy"]["layer0"]
    with pytest.raises(lazyckpt.NoMatchError, match="unstack_layers: no arrays under 'blocks'"):
        lazyckpt.unstack_layers({"params": {"w": w}}, "blocks")
    with pytest.raises(lazyckpt.NoMatchError, match="stack_layers: no arrays under 'layers'"):
        lazyckpt.stack_layers({"layers": {"w": w}}, "layers")
    with pytest.raises(lazyckpt.LazyIndexError, match="layers/01 and layers/1 are both layer 1"):
        lazyckpt.stack_layers({"layers": {"1": w, "01": w, "0": w}}, "layers")
    with pytest.raises(lazyckpt.LazyIndexError, match=r"layers/\{i\}/w: layers \[1\] of 0..2"):
        lazyckpt.stack_layers({"layers": {"0": {"w": w}, "2": {"w": w}}}, "layers")


def test_layer_numbers_are_ascii_and_bounded(parts: dict[str, Any]) -> None:
    """`"\u0661"` (Arabic-Indic one) names no layer (it was stacked as layer 1); a number
    of 5,000 digits is a clear error (int() raised its raw ValueError), and one of
    10**17 names the missing layers without listing all of them (it built a set of
    10**17 ints)."""
    w = parts["lazy"]["layer0"]
    out = lazyckpt.stack_layers({"layers": {"0": {"w": w}, "\u0661": {"w": w}}}, "layers")["layers"]
    assert out["w"].shape == (1, *w.shape) and out["\u0661"]["w"] is w
    with pytest.raises(
        lazyckpt.LazyIndexError, match=r"^layers/9{20}\.\.\.: a layer number of 5000 digits"
    ):
        lazyckpt.stack_layers({"layers": {"0": w, "9" * 5000: w}}, "layers")
    huge = {"0": {"w": w}, str(10**17): {"w": w}}
    with pytest.raises(
        lazyckpt.LazyIndexError, match=r"layers \[1, 2, 3, 4, 5, 6, 7, 8\] of 0..10{17}"
    ):
        lazyckpt.stack_layers({"layers": huge}, "layers")


def test_strided_views_of_one_stored_array_read_it_once(
    parts: dict[str, Any], count_bytes: Callable[[], Any]
) -> None:
    big, want = lazyckpt.open(parts["path"])["big"], parts["numpy"]["big"]
    with count_bytes() as once:
        big.get()
    for make, expected in [
        (lambda x: lazyckpt.stack([x, x[::-1]]), np.stack([want, want[::-1]])),
        (lambda x: lazyckpt.concat([x[::2], x[1::2]]), np.concatenate([want[::2], want[1::2]])),
        (lambda x: lazyckpt.stack([x[::-1]] * 3).T, np.stack([want[::-1]] * 3).T),
    ]:
        view = make(lazyckpt.open(parts["path"])["big"])
        with count_bytes() as read:
            got = lazyckpt.load(view)
        assert read == once
        np.testing.assert_array_equal(got, expected)
