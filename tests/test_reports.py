"""Reports that fold runs of numbered siblings (`layer_{0..25}`, `layers/{0..3}`) into
one line: restoring onto a target that does not fit, `diff`, and selections that match
nothing; and what `summary` and `saved_shardings` say of a checkpoint saved from one
device. The checkpoints are written by the real orbax-checkpoint."""

from __future__ import annotations

import re
import warnings
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
from lazyckpt import NoMatchError, SingleDeviceWarning, TreeMismatchError
from lazyckpt._cli.main import main
from lazyckpt._text import fold
from tests.helpers import orbax_save

LAYERS = 26


def _gemma_layer() -> dict[str, Any]:
    """The leaves of one Gemma layer, as gemma's Flax code names them (small)."""
    return {
        "attn": {
            "q_einsum": {"w": np.zeros((2, 8, 4), np.float32)},
            "kv_einsum": {"w": np.zeros((2, 1, 8, 4), np.float32)},
            "attn_vec_einsum": {"w": np.zeros((2, 4, 8), np.float32)},
        },
        "mlp": {
            "gating_einsum": np.zeros((2, 8, 16), np.float32),
            "linear": np.zeros((16, 8), np.float32),
        },
        "pre_attention_norm": {"scale": np.zeros(8, np.float32)},
        "pre_ffw_norm": {"scale": np.zeros(8, np.float32)},
    }


def _gemma(layers: int) -> dict[str, Any]:
    return {
        "transformer": {
            "embedder": {"input_embedding": np.zeros((32, 8), np.float32)},
            **{f"layer_{i}": _gemma_layer() for i in range(layers)},
            "final_norm": {"scale": np.zeros(8, np.float32)},
        }
    }


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma-style checkpoint with layers 0..24: the target's layer_25 is missing."""
    return orbax_save(tmp_path_factory.mktemp("gemma") / "ckpt", _gemma(LAYERS - 1))


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _report(tree: Any, target: Any) -> list[str]:
    with pytest.raises(TreeMismatchError) as caught:
        lazyckpt.load(tree, like=target)
    return str(caught.value).splitlines()


def test_a_missing_gemma_layer_takes_one_line(gemma: Path) -> None:
    lines = _report(lazyckpt.open(gemma), _abstract(_gemma(LAYERS)))
    assert lines == [
        "the target does not match the checkpoint: 7 target leaves missing from the checkpoint",
        "  missing from the checkpoint: transformer/layer_25/{attn/..., mlp/..., "
        "pre_attention_norm/scale, pre_ffw_norm/scale}  7 leaves",
        "to restore anyway: missing='keep' (or a function of path and target leaf) fills the rest",
    ]
    # The other way round: the checkpoint's extra layers, folded into one line.
    lines = _report(lazyckpt.open(gemma), _abstract(_gemma(LAYERS - 4)))
    assert lines[1] == (
        "  not in the target: transformer/layer_{22..24}/{attn/..., mlp/..., "
        "pre_attention_norm/scale, pre_ffw_norm/scale}  7 leaves"
    )
    assert len(lines) == 3


def test_mismatches_fold_by_layer_but_never_across_kinds(gemma: Path) -> None:
    """Shapes that differ alike fold with their detail; a detail that differs along the
    run is listed by layer; a dtype mismatch at one layer stays its own line."""
    target = _abstract(_gemma(LAYERS - 1))
    for i in range(LAYERS - 1):
        mlp = target["transformer"][f"layer_{i}"]["mlp"]
        mlp["linear"] = jax.ShapeDtypeStruct((16, 9 if i < 13 else 10), np.float32)
        attn = target["transformer"][f"layer_{i}"]["attn"]
        attn["q_einsum"]["w"] = jax.ShapeDtypeStruct((2, 8, 5), np.float32)
    target["transformer"]["layer_3"]["mlp"]["gating_einsum"] = jax.ShapeDtypeStruct(
        (2, 8, 16), np.int8
    )
    del target["transformer"]["layer_7"]["mlp"]["linear"]
    lines = _report(lazyckpt.open(gemma), target)
    assert lines == [
        "the target does not match the checkpoint: 1 checkpoint leaf not in the target, "
        "49 shapes differ, 1 dtype needs a lossy cast",
        "  not in the target: transformer/layer_7/mlp/linear  float32[16,8]",
        "  shape: transformer/layer_{0..24}/attn/q_einsum/w  target (2, 8, 5), "
        "checkpoint (2, 8, 4)",
        "  shape: transformer/layer_{0..6,8..24}/mlp/linear  target varies: (16, 9) at "
        "0..6,8..12; (16, 10) at 13..24, checkpoint (16, 8)",
        "  lossy cast: transformer/layer_3/mlp/gating_einsum  target int8, checkpoint float32",
        "to restore anyway: partial=True restores only what the target names; "
        "lossy_casts=True allows casts that may change values",
    ]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = nnx.Linear(4, 4, rngs=rngs)
        self.mlp = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)


class Model(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([Block(rngs) for _ in range(layers)])


def test_a_missing_nnx_list_layer_takes_one_line(tmp_path: Path) -> None:
    state = nnx.state(Model(12, nnx.Rngs(0)))
    path = orbax_save(tmp_path / "ckpt", state)
    abstract = nnx.state(nnx.eval_shape(lambda: Model(14, nnx.Rngs(0))))
    lines = _report(lazyckpt.open(path), abstract)
    assert lines[1] == (
        "  missing from the checkpoint: layers/{12,13}/{attn/..., mlp/..., norm/...}  6 leaves"
    )
    assert len(lines) == 3 and lines[0].endswith("12 target leaves missing from the checkpoint")


def test_fold_keeps_what_differs() -> None:
    lines = [(f"blocks.{i}.w", "f32[8]") for i in (0, 1, 2, 3, 5, 6, 7, 9)]
    assert [str(f) for f in fold(lines)] == ["blocks.{0..3,5..7,9}.w  f32[8]"]
    # Experts within layers fold twice; a leading zero is a name, not a number.
    nested = [(f"layers/{i}/experts/{j}", "") for i in range(4) for j in range(8)]
    assert [f.path for f in fold([*nested, ("layer_01", ""), ("layer_02", "")])] == [
        "layers/{0..3}/experts/{0..7}",
        "layer_01",
        "layer_02",
    ]
    # Without `vary` (diff's reports), lines whose details differ stay apart.
    differing = [(f"w{i}", f"max abs {i}") for i in range(4)]
    assert len(fold(differing, vary=False)) == 4
    assert [str(f) for f in fold(differing)] == ["w{0..3}  varies (4 values)"]
    assert fold([(f"l{i}", "x") for i in range(0, 40, 2)])[0].path == "l{0..38..2}"
    scattered = [(f"l{i * i}", "x") for i in range(10)]
    assert fold(scattered)[0].path == "l{0,1,4,9,16,25,36,...(10 in all)}"


def test_diff_and_no_match_fold_layers(gemma: Path, tmp_path: Path) -> None:
    fewer = orbax_save(tmp_path / "fewer", _gemma(LAYERS - 4))
    text = str(lazyckpt.diff(gemma, fewer)).splitlines()
    assert text[0] == "21 removed, 156 equal (metadata only)"
    assert text[1:] == [
        "- transformer/layer_{22..24}/attn/attn_vec_einsum/w  float32[2,4,8]",
        "- transformer/layer_{22..24}/attn/kv_einsum/w  float32[2,1,8,4]",
        "- transformer/layer_{22..24}/attn/q_einsum/w  float32[2,8,4]",
        "- transformer/layer_{22..24}/mlp/gating_einsum  float32[2,8,16]",
        "- transformer/layer_{22..24}/mlp/linear  float32[16,8]",
        "- transformer/layer_{22..24}/pre_attention_norm/scale  float32[8]",
        "- transformer/layer_{22..24}/pre_ffw_norm/scale  float32[8]",
    ]
    with pytest.raises(NoMatchError, match=r"its paths look like \[.*'transformer/layer_\{0\.\."):
        lazyckpt.select(lazyckpt.open(gemma), "params/**")


ONE_DEVICE = (
    "saved from one device (cpu:0): there is no sharding to reuse, saved_shardings(mesh) "
    "would replicate every array; pass your own shardings"
)


def test_a_single_device_save_says_it_has_no_sharding_to_reuse(
    tmp_path: Path, mesh: jax.sharding.Mesh, capsys: Any
) -> None:
    """Orbax saves of arrays on one device, and on a mesh: `summary` and `inspect`
    say so of the first, and `saved_shardings(mesh)` warns, once, for it alone."""
    device = jax.devices()[0]
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    single = orbax_save(
        tmp_path / "single",
        {"w": jax.device_put(value, device), "b": jnp.zeros(3), "n": np.arange(3)},
    )
    sharded = orbax_save(
        tmp_path / "sharded",
        {"w": jax.device_put(value, NamedSharding(mesh, P("x"))), "n": np.arange(3)},
    )
    lazy = lazyckpt.open(single)
    assert str(lazyckpt.summary(lazy)).splitlines()[-1] == ONE_DEVICE
    assert ONE_DEVICE in lazyckpt.summary(lazy)._repr_html_()
    assert main(["inspect", str(single)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ONE_DEVICE
    with pytest.warns(SingleDeviceWarning) as caught:
        placed = lazyckpt.device_put(lazy, lazyckpt.saved_shardings(mesh))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert re.match(
        rf"{re.escape(str(single))}: (w|b) was saved from one device \(cpu:0\), so it has no "
        r"sharding to reuse: saved_shardings\(mesh\) replicates it, and any other array "
        r"saved so, on all 8 devices of the mesh; to shard them, pass your own shardings",
        message,
    ), message
    assert caught[0].filename == __file__  # points at the caller's line
    assert placed["w"].sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(np.asarray(placed["w"]), value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Asked for: the fallback is what such arrays get, without a warning.
        chosen = lazyckpt.device_put(
            {"w": lazy["w"]}, lazyckpt.saved_shardings(mesh, fallback=P("x"))
        )
        assert chosen["w"].sharding == NamedSharding(mesh, P("x"))
        # A sharded save: its specs are reused, numpy arrays replicated as documented.
        opened = lazyckpt.open(sharded)
        placed = lazyckpt.device_put(opened, lazyckpt.saved_shardings(mesh))
        assert placed["w"].sharding == NamedSharding(mesh, P("x"))
        assert "one device" not in str(lazyckpt.summary(opened))


def test_only_ascii_numbers_fold() -> None:
    # (an Arabic-Indic or fullwidth three is text, not the number 3: two keys, two lines)
    lines = fold([("layer_\u0663/w", ""), ("layer_3/w", ""), ("layer_\uff13/w", "")])
    assert sorted(line.path for line in lines) == ["layer_3/w", "layer_\u0663/w", "layer_\uff13/w"]
    huge = "9" * 5000  # (beyond what int() reads: folded as text, not a crash)
    assert [line.path for line in fold([(f"a/{huge}/w", ""), ("a/1/w", "")])]


def test_a_sharded_save_warns_of_none_of_its_scalars(tmp_path: Path) -> None:
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    tree = {
        "params": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("x"))),
        "count": jnp.zeros((), jnp.int32),  # (optax's, on one device)
    }
    lazy = lazyckpt.open(orbax_save(tmp_path / "ckpt", tree))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SingleDeviceWarning)
        placed = lazyckpt.device_put(lazy, lazyckpt.saved_shardings(mesh))
    assert placed["params"].sharding.spec == P("x") and int(placed["count"]) == 0
