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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt._cli.main import main
from tests.helpers import orbax_save, stored_chunk_bytes

LAYERS = 4
DIM, HIDDEN = 64, 256  # chunks of tens of KiB: stored as data files, not inside OCDBT nodes


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, DIM, rngs=rngs)

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


HF = {"up": "up_proj", "down": "down_proj"}


def to_hugging_face(scanned: Any) -> dict[str, Any]:
    """Scanned `blocks/{up,down}/{kernel,bias}` as per-layer Hugging Face names,
    `model/layers/{i}/mlp/{up,down}_proj/{weight,bias}`, weights `(out, in)`."""
    layers = lazyckpt.unstack_layers(scanned, "blocks")["blocks"]
    return {
        "model": {
            "layers": {
                i: {
                    "mlp": {
                        HF[name]: {"weight": block[name]["kernel"].T, "bias": block[name]["bias"]}
                        for name in HF
                    }
                }
                for i, block in layers.items()
            }
        }
    }


def from_hugging_face(per_layer: Any) -> dict[str, Any]:
    """The inverse: per-layer Hugging Face names stacked back into scanned arrays."""
    layers = per_layer["model"]["layers"]
    blocks = {
        i: {
            name: {"kernel": layer["mlp"][hf]["weight"].T, "bias": layer["mlp"][hf]["bias"]}
            for name, hf in HF.items()
        }
        for i, layer in layers.items()
    }
    return lazyckpt.stack_layers({"blocks": blocks}, "blocks")


@pytest.mark.parametrize("to", ["safetensors", "orbax"])
def test_a_scanned_nnx_model_converted_and_back_bit_for_bit(
    tmp_path: Path, mesh: jax.sharding.Mesh, count_bytes: Callable[[], Any], to: str
) -> None:
    scanned = Scanned(nnx.Rngs(0))
    x = jnp.linspace(-1, 1, 2 * DIM).reshape(2, DIM)
    expected = scanned(x)
    params = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    # Kernels sharded along their last dimension: every stored chunk holds layers.
    kernels = NamedSharding(mesh, P(None, None, "x"))
    on_mesh = jax.tree.map(
        lambda a: jax.device_put(a, kernels if a.ndim == 3 else NamedSharding(mesh, P())), params
    )
    source = orbax_save(tmp_path / "scanned", on_mesh)
    original = lazyckpt.open(source)
    assert original["blocks"]["up"]["kernel"].chunks[0] > 1
    stored = sum(stored_chunk_bytes(source, leaf) for _, leaf in lazyckpt.leaves(original))

    converted = to_hugging_face(lazyckpt.open(source))
    destination = tmp_path / ("layers.safetensors" if to == "safetensors" else "layers")
    with count_bytes() as read:
        out = lazyckpt.save(destination, converted)
    # Each stored chunk read once, though each chunk holds several layers' views (read
    # apart, each would read it again). Small chunks may live inside OCDBT's b-tree
    # nodes, read by open; what is over is what writing reads back of its own files.
    assert 0.95 * stored <= read[0] <= stored + (64 << 10)

    per_layer = lazyckpt.open(out)
    weight = per_layer["model"]["layers"]["2"]["mlp"]["up_proj"]["weight"]
    assert weight.shape == (HIDDEN, DIM)
    np.testing.assert_array_equal(weight.get(), np.asarray(params["blocks"]["up"]["kernel"])[2].T)

    # Stacked back, saved by lazyckpt and restored by Orbax: the original, bit for bit.
    back = lazyckpt.save(tmp_path / "back", from_hugging_face(per_layer))
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(back)
    for (path, want), (other, got) in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree_util.tree_leaves_with_path(restored),
        strict=True,
    ):
        assert jax.tree_util.keystr(path) == jax.tree_util.keystr(other)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # The unrolled model, restored from the per-layer names, computes the same.
    layers = per_layer["model"]["layers"]
    unrolled_tree = {
        "blocks": {
            i: {
                name: {"kernel": layer["mlp"][hf]["weight"].T, "bias": layer["mlp"][hf]["bias"]}
                for name, hf in HF.items()
            }
            for i, layer in layers.items()
        }
    }
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Unrolled(nnx.Rngs(1))))
    state = lazyckpt.device_put(unrolled_tree, abstract, partial=True)
    unrolled = nnx.merge(graphdef, state)
    # Equal up to float rounding: XLA fuses the scanned and the unrolled loop apart.
    np.testing.assert_allclose(np.asarray(unrolled(x)), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_the_command_line_converts_with_a_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scanned = Scanned(nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    source = orbax_save(tmp_path / "scanned", params)
    script = tmp_path / "to_hf.py"
    script.write_text(
        "def convert(tree):\n"
        "    layers = tree['blocks'].items()\n"
        "    return {'layers': {i: {'up': b['up']['kernel'].T} for i, b in layers}}\n"
    )
    rules = tmp_path / "rules.txt"
    rules.write_text("# per-layer names\n^layers/(\\d+)/up$  model/layers/\\1/up_proj\n")
    out = tmp_path / "model.safetensors"
    command = ["convert", str(source), str(out), "--select", "blocks/up/kernel"]
    command += ["--unstack", "blocks", "--script", str(script), "--rename-file", str(rules)]
    assert main([*command, "--quiet"]) == 0
    tree = lazyckpt.open(out)
    assert sorted(tree["model"]["layers"]) == [str(i) for i in range(LAYERS)]
    np.testing.assert_array_equal(
        tree["model"]["layers"]["1"]["up_proj"].get(),
        np.asarray(params["blocks"]["up"]["kernel"])[1].T,
    )
    capsys.readouterr()
    bad = tmp_path / "bad.txt"
    bad.write_text("only-one-field\n")
    assert main(["convert", str(source), str(tmp_path / "x"), "--rename-file", str(bad)]) != 0
    expected = f"--rename-file {bad}, line 1: expected 'PATTERN REPLACEMENT', found 1 fields"
    assert expected in capsys.readouterr().err


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
