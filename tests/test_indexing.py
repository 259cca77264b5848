"""Slicing composes lazily and `get` reads exactly the stored chunks a view touches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import lazyckpt
from lazyckpt import LazyIndexError
from lazyckpt._array.selection import Range
from tests.helpers import stored_chunk_bytes

INDEXES = [
    (slice(None),),
    (3,),
    (-1, slice(None, None, -1)),
    (slice(2, 11, 3), slice(1, None, 2)),
    (slice(None, None, -2), 5),
    (Ellipsis, 0),
    (None, slice(4, 8), None, Ellipsis),
    (slice(5, 5),),
    (slice(100, 200), slice(None)),
    (slice(-3, None), slice(None, 2)),
]


@pytest.mark.parametrize("index", INDEXES, ids=repr)
def test_indexing_matches_numpy(saved: tuple[Path, dict[str, Any]], index: Any) -> None:
    path, tree = saved
    kernel = lazyckpt.open(path)["params"]["dense"]["kernel"]
    want = np.asarray(tree["params"]["dense"]["kernel"])[index]
    view = kernel[index]
    assert view.shape == want.shape
    np.testing.assert_array_equal(view.get(), want)


def test_chained_indexing_composes(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    embed = lazyckpt.open(path)["params"]["embed"]
    want = np.asarray(tree["params"]["embed"])
    view = embed[::-1][3:20:2][None][:, ::3, -1]
    np.testing.assert_array_equal(view.get(), want[::-1][3:20:2][None][:, ::3, -1])
    assert view.dtype == want.dtype


def test_astype_casts_while_reading(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    kernel = np.asarray(tree["params"]["dense"]["kernel"])
    as_bf16 = lazy["params"]["dense"]["kernel"][:4].astype(jnp.bfloat16)
    assert as_bf16.dtype == jnp.bfloat16 and as_bf16.nbytes == 4 * 128 * 2
    np.testing.assert_array_equal(as_bf16.get(), kernel[:4].astype(jnp.bfloat16))
    mask = lazy["opt_state"]["mask"].astype(np.int8).get()
    np.testing.assert_array_equal(mask, np.asarray(tree["opt_state"]["mask"]).astype(np.int8))


def test_zero_d_arrays(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    scalar = lazyckpt.open(path)["scalar_array"]
    assert scalar.shape == () and scalar.size == 1 and scalar.chunks == ()
    assert scalar.get() == np.float32(3.5) and scalar.get().shape == ()
    assert scalar[...].get() == 3.5 and scalar[None].get().shape == (1,)
    with pytest.raises(LazyIndexError, match=r"scalar_array .*0-dimensional but 1 were given"):
        scalar[0]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ((64,), r"index 64 is out of range for a dimension of size 64"),
        (
            (0, -129),
            r"index -129 is out of range for a dimension of size 128; use an index in "
            r"\[-128, 128\)",
        ),
        ((0, 0, 0), r"too many indices: the array is 2-dimensional but 3 were given"),
        ((..., ...), r"an index can only have a single ellipsis"),
        ((1.5,), r"unsupported index 1.5"),
    ],
)
def test_bad_indexes_name_the_array(saved: tuple[Path, Any], index: Any, message: str) -> None:
    kernel = lazyckpt.open(saved[0])["params"]["dense"]["kernel"]
    with pytest.raises(
        LazyIndexError, match=r"^params/dense/kernel \(shape \(64, 128\)\): " + message
    ):
        kernel[index]
    assert issubclass(LazyIndexError, IndexError)


@pytest.mark.parametrize(
    "index",
    [
        np.array([1, 2]),
        np.array([True] * 63 + [False]),
        np.zeros((2, 2), np.int32),
        np.array([], np.int64),
        jnp.array([0, 1]),
        jnp.array([True] * 64),
        (0, np.array([0, 1])),
        [3, -1, 3],
        (slice(None), [127, 0]),
    ],
    ids=repr,
)
def test_array_indexes_pick_as_numpy_does(saved: tuple[Path, Any], index: Any) -> None:
    path, tree = saved
    kernel = lazyckpt.open(path)["params"]["dense"]["kernel"]
    plain = lambda i: np.asarray(i) if hasattr(i, "shape") else i  # noqa: E731 - jax to NumPy
    want = np.asarray(tree["params"]["dense"]["kernel"])[
        tuple(map(plain, index)) if isinstance(index, tuple) else plain(index)
    ]
    assert kernel[index].shape == want.shape
    np.testing.assert_array_equal(kernel[index].get(), want)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (np.array(True), r"a 0-d boolean index"),
        (np.array(1.0), r"unsupported index an array of shape \(\) and dtype float64"),
        (np.array([0.0, 1.0]), r"an index array of dtype float64"),
        ([0, 64], r"index 64 is out of bounds for axis 0 of size 64"),
        ((slice(None), [-129]), r"index -129 is out of bounds for axis 1 of size 128"),
        (np.ones(63, bool), r"a boolean mask of shape \(63,\) for axes 0 to 0, of shape \(64,\)"),
        (([0, 1], [0, 1, 2]), r"index arrays of shapes \(2,\), \(3,\) do not broadcast"),
    ],
    ids=repr,
)
def test_bad_array_indexes_name_the_array_and_axis(
    saved: tuple[Path, Any], index: Any, message: str
) -> None:
    kernel = lazyckpt.open(saved[0])["params"]["dense"]["kernel"]
    with pytest.raises(
        LazyIndexError, match=r"^params/dense/kernel \(shape \(64, 128\)\): " + message
    ):
        kernel[index]


@pytest.mark.parametrize(
    "index",
    [
        np.array(3),
        np.array(-1, np.int8),
        np.uint16(5),
        jnp.array(2),
        (np.array(1), slice(np.array(2), jnp.array(9), np.int64(3))),
    ],
    ids=repr,
)
def test_zero_d_integer_arrays_index_as_ints(
    saved: tuple[Path, dict[str, Any]], index: Any
) -> None:
    path, tree = saved
    kernel = lazyckpt.open(path)["params"]["dense"]["kernel"]
    want = np.asarray(tree["params"]["dense"]["kernel"])[index]
    assert kernel[index].shape == want.shape
    np.testing.assert_array_equal(kernel[index].get(), want)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (slice(0, 4, 0), r"a slice's step is 0; use a step other than 0"),
        (slice(1.5, None), r"unsupported slice bound 1.5 of type float; a slice's start, stop"),
        (slice(np.array([1]), 4), r"unsupported slice bound an array of shape \(1,\)"),
    ],
    ids=repr,
)
def test_bad_slices_name_the_array(saved: tuple[Path, Any], index: Any, message: str) -> None:
    kernel = lazyckpt.open(saved[0])["params"]["dense"]["kernel"]
    with pytest.raises(
        LazyIndexError, match=r"^params/dense/kernel \(shape \(64, 128\)\): " + message
    ):
        kernel[index]


@pytest.mark.parametrize(
    "index",
    [(slice(0, 4), slice(0, 4)), (5, slice(None)), (slice(None, None, 16), 7), (slice(3, 40), 70)],
    ids=repr,
)
def test_slice_reads_only_its_chunks(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any, index: Any
) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    kernel = lazy["params"]["dense"]["kernel"]
    view = kernel[index]
    expected = stored_chunk_bytes(path, view)
    with count_bytes() as read:
        value = view.get()
    np.testing.assert_array_equal(value, np.asarray(tree["params"]["dense"]["kernel"])[index])
    assert read[0] == expected
    whole = stored_chunk_bytes(path, kernel)
    assert read[0] < whole


def test_selection_records_the_composed_ranges() -> None:
    from lazyckpt._array.geometry import bounds
    from lazyckpt._array.selection import Selection

    selection = Selection.full((10, 6))[2:9:3][::-1, 4]
    assert selection.stored == (Range(8, -3, 3), 4)
    assert selection.shape == (3,)
    assert bounds(selection) == ((2, 9), (4, 5))
