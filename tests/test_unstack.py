"""Per-layer views of scanned (stacked) layers: `lazyckpt.unstack` and `squeeze` are
views like any slice, so a scanned Flax NNX model becomes per-layer safetensors with
Hugging Face style names, reading each stored chunk once, and loads into the unrolled
model, whose forward pass equals the scanned one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lazyckpt
from tests.helpers import orbax_save, stored_chunk_bytes

LAYERS = 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(x)))


class Scanned(nnx.Module):
    """Layers made with `nnx.vmap` and run with `nnx.scan`: parameters `(layers, ...)`."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return step(x, self.blocks)


class Unrolled(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def per_layer(stacked: dict[str, Any]) -> dict[str, Any]:
    """`blocks/{name}/{param}` of shape `(layers, ...)` as `model/layers/{i}/{name}/{param}`."""
    return {
        "model": {
            "layers": {
                str(i): {
                    name: {param: lazyckpt.unstack(array)[i] for param, array in params.items()}
                    for name, params in stacked["blocks"].items()
                }
                for i in range(LAYERS)
            }
        }
    }


def test_a_scanned_nnx_model_becomes_per_layer_safetensors(tmp_path: Path) -> None:
    scanned = Scanned(nnx.Rngs(0))
    x = jnp.linspace(-1, 1, 32).reshape(2, 16)
    expected = scanned(x)
    path = orbax_save(tmp_path / "scanned", nnx.to_pure_dict(nnx.state(scanned, nnx.Param)))
    out = lazyckpt.save(tmp_path / "layers.safetensors", per_layer(lazyckpt.open(path)))
    tree = lazyckpt.open(out)
    assert tree["model"]["layers"]["2"]["up"]["kernel"].shape == (16, 32)
    back = lazyckpt.rename(tree, [(r"^model/layers/", "blocks/")])
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Unrolled(nnx.Rngs(1))))
    state = lazyckpt.device_put(back, abstract, partial=True)
    unrolled = nnx.merge(graphdef, state)
    np.testing.assert_allclose(np.asarray(unrolled(x)), np.asarray(expected), rtol=1e-6)


def test_one_layer_of_a_stack_reads_only_its_chunks(
    tmp_path: Path, count_bytes: Callable[[], Any]
) -> None:
    stacked = np.random.default_rng(0).standard_normal((8, 256, 256), dtype=np.float32)
    path = lazyckpt.save(tmp_path / "stacked", {"w": stacked}, chunk_bytes=256 << 10)
    lazy = lazyckpt.open(path)["w"]
    assert lazy.chunks == (1, 256, 256)
    layers = lazyckpt.unstack(lazy)
    with count_bytes() as read:
        np.testing.assert_array_equal(layers[3].get(), stacked[3])
    assert read[0] == stored_chunk_bytes(Path(path), layers[3])
    with count_bytes() as read:
        out = lazyckpt.save(
            tmp_path / "layers.safetensors", {str(i): v for i, v in enumerate(layers)}
        )
    assert read[0] <= stored_chunk_bytes(Path(path), lazy) + (64 << 10)  # each chunk once
    assert np.array_equal(lazyckpt.load(lazyckpt.open(out)["5"]), stacked[5])
    columns = lazyckpt.unstack(lazy[:2], axis=-1)
    assert len(columns) == 256 and columns[7].shape == (2, 256)
    np.testing.assert_array_equal(columns[7].get(), stacked[:2, :, 7])


def test_squeeze_and_unstack_errors(tmp_path: Path) -> None:
    path = lazyckpt.save(tmp_path / "c", {"w": np.arange(12.0).reshape(1, 3, 4)})
    w = lazyckpt.open(path)["w"]
    assert w.squeeze().shape == (3, 4) and w[:, :1].squeeze(axis=(0, -2)).shape == (4,)
    np.testing.assert_array_equal(
        w[:, None, 1:2].squeeze().get(), np.arange(12.0).reshape(1, 3, 4)[0, 1:2, :].squeeze()
    )
    with pytest.raises(
        lazyckpt.LazyIndexError,
        match=r"w \(shape \(1, 3, 4\)\): cannot squeeze axis 1, which is of size 3",
    ):
        w.squeeze(1)
    with pytest.raises(lazyckpt.LazyIndexError, match=r"no axis 3 to unstack"):
        lazyckpt.unstack(w, axis=3)
