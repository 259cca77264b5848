"""Hypothesis strategies for arrays as they are saved: shapes, dtypes, shardings."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DTYPES = [
    np.dtype(d)
    for d in (
        np.float32,
        np.float16,
        jnp.bfloat16,
        np.int8,
        np.uint8,
        np.int32,
        np.bool_,
        np.complex64,
    )
]
MESH_AXES = {"x": 4, "y": 2}

# Orbax refuses to save zero-size arrays; empty views are covered by indexing.
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=9)
dtypes = st.sampled_from(DTYPES)


def values(shape: tuple[int, ...], dtype: np.dtype[Any], seed: int) -> np.ndarray:
    """Random values of every kind the dtype holds (0-d results are arrays too)."""
    return np.asarray(_values(shape, dtype, np.random.default_rng(seed)))


def _values(shape: tuple[int, ...], dtype: np.dtype[Any], rng: np.random.Generator) -> Any:
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


@st.composite
def partition_specs(draw: st.DrawFn, shape: tuple[int, ...]) -> P:
    """A spec over the 4x2 ('x', 'y') mesh whose axes divide the dimensions they shard."""
    unused = list(MESH_AXES)
    entries: list[str | None] = []
    for n in shape:
        fits = [a for a in unused if n % MESH_AXES[a] == 0 and n > 0]
        entry = draw(st.sampled_from([None, *fits]))
        if entry is not None:
            unused.remove(entry)
        entries.append(entry)
    return P(*entries)


@st.composite
def saved_arrays(draw: st.DrawFn, mesh: jax.sharding.Mesh) -> tuple[np.ndarray, Any]:
    """A NumPy value, and the same value as saved (a sharded jax.Array or the ndarray)."""
    shape = draw(shapes)
    dtype = draw(dtypes)
    value = values(shape, dtype, draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        return value, value
    spec = draw(partition_specs(shape))
    return value, jax.device_put(value, NamedSharding(mesh, spec))
