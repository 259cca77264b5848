"""`lazyckpt.dequantize`: FP8 block-scaled and MXFP4 weights, written by the safetensors
library as the releases store them, read as lazy views of their dense values and
checked against NumPy references computed from the conventions' definitions."""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import lazyckpt
from lazyckpt._engine import raw
from lazyckpt._storage import metrics

Counter = Callable[[], contextlib.AbstractContextManager[list[int]]]
BF16 = np.dtype(jnp.bfloat16)
E2M1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def fp8_reference(weight: np.ndarray, scale: np.ndarray, block: tuple[int, ...]) -> np.ndarray:
    """`float(weight) * scale` of its block, in float32 (edge blocks cut short)."""
    expanded = scale.astype(np.float32)
    for d, b in enumerate(block):
        expanded = np.repeat(expanded, b, axis=d)
    return weight.astype(np.float32) * expanded[tuple(slice(0, n) for n in weight.shape)]


def mxfp4_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """32 E2M1 codes per block (low nibble first) times `2 ** (scale - 127)`."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    power = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)
    return (E2M1[codes] * power[..., None]).reshape(*blocks.shape[:-2], -1)


def fp8_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.normal(0, 2, size=shape).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)


def write_model(folder: Path, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> Path:
    """A Hugging Face model folder: two shards, their index, and `config.json`."""
    folder.mkdir(parents=True)
    names = list(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half]}
    shards["model-00002-of-00002.safetensors"] = names[half:]
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(folder / shard))
        weight_map.update(dict.fromkeys(members, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# A DeepSeek-style MoE layer: experts stored apart, FP8 weights with 128x128 block
# scales, shapes that are not multiples of the block; a dense norm.
EXPERTS, HIDDEN, INTER = 3, 300, 200


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}
    for e in range(EXPERTS):
        for name, shape in (("gate_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
            prefix = f"model.layers.0.mlp.experts.{e}.{name}"
            tensors[f"{prefix}.weight"] = fp8_values(rng, shape)
            scale_shape = tuple(math.ceil(n / 128) for n in shape)
            tensors[f"{prefix}.weight_scale_inv"] = rng.uniform(0.01, 2, scale_shape).astype(
                np.float32
            )
    tensors["model.layers.0.input_layernorm.weight"] = rng.normal(size=HIDDEN).astype(BF16)
    config = {
        "model_type": "deepseek_v3",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    return write_model(tmp_path_factory.mktemp("ds") / "model", tensors, config), tensors


def expert_reference(tensors: dict[str, np.ndarray], e: int, name: str) -> np.ndarray:
    prefix = f"model.layers.0.mlp.experts.{e}.{name}"
    return fp8_reference(
        tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_inv"], (128, 128)
    )


# A gpt-oss-style MoE: MXFP4 blocks [E, rows, G, 16] with E8M0 scales [E, rows, G].
MX_SHAPE = (4, 40, 3)


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": rng.integers(
            0, 256, (*MX_SHAPE, 16), dtype=np.uint8
        ),
        "model.layers.0.mlp.experts.gate_up_proj_scales": rng.integers(
            118, 136, MX_SHAPE, dtype=np.uint8
        ),
        "model.layers.0.mlp.experts.gate_up_proj_bias": rng.normal(size=MX_SHAPE[:2]).astype(BF16),
    }
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    return write_model(tmp_path_factory.mktemp("oss") / "model", tensors, config), tensors


def mx_reference(tensors: dict[str, np.ndarray]) -> np.ndarray:
    prefix = "model.layers.0.mlp.experts.gate_up_proj"
    return mxfp4_reference(tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"])


def test_dequantize_names_the_dense_weights_and_reads_nothing(
    deepseek: tuple[Path, dict[str, np.ndarray]],
    gptoss: tuple[Path, dict[str, np.ndarray]],
    count_bytes: Counter,
) -> None:
    with count_bytes() as read:
        dense = lazyckpt.dequantize(lazyckpt.open(deepseek[0]))
        mx = lazyckpt.dequantize(lazyckpt.open(gptoss[0]))
    expert = dense["model"]["layers"]["0"]["mlp"]["experts"]["1"]
    assert sorted(expert["gate_proj"]) == ["weight"]  # the scale is gone
    weight = expert["gate_proj"]["weight"]
    assert (weight.shape, weight.dtype, weight.key) == (
        (INTER, HIDDEN),
        BF16,
        "model/layers/0/mlp/experts/1/gate_proj/weight",
    )
    assert "per 128x128 block" in repr(weight)
    experts = mx["model"]["layers"]["0"]["mlp"]["experts"]
    assert list(experts) == ["gate_up_proj", "gate_up_proj_bias"]
    assert experts["gate_up_proj"].shape == (*MX_SHAPE[:2], MX_SHAPE[2] * 32)
    # Only the headers, config.json and the index were read, before and during this.
    assert read[0] < 4096
    shapes = jax.eval_shape(lambda w: w @ w.T, weight)
    assert (shapes.shape, shapes.dtype) == ((INTER, INTER), BF16)


def test_values_equal_the_reference_through_every_read(
    deepseek: tuple[Path, dict[str, np.ndarray]], gptoss: tuple[Path, dict[str, np.ndarray]]
) -> None:
    dense = lazyckpt.dequantize(lazyckpt.open(deepseek[0]), dtype=np.float32)
    experts = dense["model"]["layers"]["0"]["mlp"]["experts"]
    for e in range(EXPERTS):
        for name in ("gate_proj", "down_proj"):
            want = expert_reference(deepseek[1], e, name)
            np.testing.assert_array_equal(experts[str(e)][name]["weight"].get(), want)
    loaded = lazyckpt.load(dense)["model"]["layers"]["0"]
    np.testing.assert_array_equal(
        loaded["mlp"]["experts"]["2"]["down_proj"]["weight"],
        expert_reference(deepseek[1], 2, "down_proj"),
    )
    np.testing.assert_array_equal(
        loaded["input_layernorm"]["weight"], deepseek[1]["model.layers.0.input_layernorm.weight"]
    )
    mx = lazyckpt.dequantize(lazyckpt.open(gptoss[0]))
    view = mx["model"]["layers"]["0"]["mlp"]["experts"]["gate_up_proj"]
    want = mx_reference(gptoss[1]).astype(BF16)
    np.testing.assert_array_equal(view.get(), want)
    np.testing.assert_array_equal(lazyckpt.load(view), want)


def test_bfloat16_is_the_float32_value_rounded_once(
    deepseek: tuple[Path, dict[str, np.ndarray]],
) -> None:
    weight = lazyckpt.dequantize(lazyckpt.open(deepseek[0]))["model"]["layers"]["0"]["mlp"][
        "experts"
    ]["0"]["gate_proj"]["weight"]
    want = expert_reference(deepseek[1], 0, "gate_proj").astype(BF16)
    np.testing.assert_array_equal(weight.get(), want)
    # A cast of the bfloat16 view rounds through bfloat16, as NumPy's would.
    np.testing.assert_array_equal(
        weight.astype(np.float32)[::3, ::-7].get(), want.astype(np.float32)[::3, ::-7]
    )


def test_device_put_onto_a_2x4_mesh_reads_each_devices_blocks(
    deepseek: tuple[Path, dict[str, np.ndarray]], gptoss: tuple[Path, dict[str, np.ndarray]]
) -> None:
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    dense = lazyckpt.dequantize(lazyckpt.open(deepseek[0]))["model"]["layers"]["0"]["mlp"]
    weight = dense["experts"]["1"]["gate_proj"]["weight"]  # (200, 300): 2 x 4 shards
    placed = lazyckpt.device_put(weight, NamedSharding(mesh, P("x", "y")))
    want = expert_reference(deepseek[1], 1, "gate_proj").astype(BF16)
    np.testing.assert_array_equal(np.asarray(placed), want)
    assert placed.sharding.shard_shape(weight.shape) == (100, 75)
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    mx = lazyckpt.dequantize(lazyckpt.open(gptoss[0]))["model"]["layers"]["0"]["mlp"]["experts"]
    placed = lazyckpt.device_put(mx["gate_up_proj"], NamedSharding(mesh, P("x", "y")))
    np.testing.assert_array_equal(np.asarray(placed), mx_reference(gptoss[1]).astype(BF16))


def test_each_device_reads_its_own_codes(
    deepseek: tuple[Path, dict[str, np.ndarray]], count_bytes: Counter
) -> None:
    """Onto 8 devices, each device's shard reads its codes and the scales of the
    blocks it falls in; shards that share a scale share its read, so every stored
    byte is read once."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    dense = lazyckpt.dequantize(lazyckpt.open(deepseek[0]))
    weight = dense["model"]["layers"]["0"]["mlp"]["experts"]["2"]["down_proj"]["weight"]
    with count_bytes() as read:
        placed = lazyckpt.device_put(weight, NamedSharding(mesh, P("x", "y")))
    assert read[0] == HIDDEN * INTER + 3 * 2 * 4  # the (300, 200) codes and 3x2 scales
    want = expert_reference(deepseek[1], 2, "down_proj").astype(BF16)
    np.testing.assert_array_equal(np.asarray(placed), want)


def test_ten_rows_read_their_rows_and_one_row_of_scales(
    deepseek: tuple[Path, dict[str, np.ndarray]], count_bytes: Counter
) -> None:
    dense = lazyckpt.dequantize(lazyckpt.open(deepseek[0]))
    weight = dense["model"]["layers"]["0"]["mlp"]["experts"]["0"]["down_proj"]["weight"]
    with count_bytes() as read:
        rows = weight[130:140].get()
    # (300, 200) float8: 10 rows of 200 bytes, and the scales of row block 1: 2 floats.
    assert read[0] == 10 * INTER + 2 * 4
    want = expert_reference(deepseek[1], 0, "down_proj").astype(BF16)
    np.testing.assert_array_equal(rows, want[130:140])


def test_one_expert_reads_its_blocks_and_scales(
    gptoss: tuple[Path, dict[str, np.ndarray]], count_bytes: Counter
) -> None:
    mx = lazyckpt.dequantize(lazyckpt.open(gptoss[0]))
    view = mx["model"]["layers"]["0"]["mlp"]["experts"]["gate_up_proj"]
    with count_bytes() as read:
        expert = view[2].get()
    rows, groups = MX_SHAPE[1:]
    assert read[0] == rows * groups * 16 + rows * groups  # its blocks and its scales
    np.testing.assert_array_equal(expert, mx_reference(gptoss[1])[2].astype(BF16))


def test_stacked_experts_save_to_orbax_within_the_budget_and_orbax_restores_them(
    deepseek: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe: experts stored apart, stacked `[E, out, in]` in bfloat16, saved as
    Orbax, each stored weight byte read once (a block of scales that two streamed
    blocks share is read by both: a few bytes); Orbax's own restore gives the
    reference."""
    source = lazyckpt.open(deepseek[0])
    dense = lazyckpt.dequantize(source)
    layer = dense["model"]["layers"]["0"]
    experts = layer["mlp"]["experts"]
    tree = {
        name: lazyckpt.stack([experts[str(e)][name]["weight"] for e in range(EXPERTS)])
        for name in ("gate_proj", "down_proj")
    }
    tree["norm"] = layer["input_layernorm"]["weight"]
    stored = sum(a.nbytes for a in deepseek[1].values())
    read: list[int] = []  # bytes of the source files (the destination's own reads aside)
    real = metrics.count_direct

    def counted(nbytes: int) -> None:
        read.append(nbytes)
        real(nbytes)

    monkeypatch.setattr(raw, "count_direct", counted)
    out = lazyckpt.save(tmp_path / "orbax", tree, memory_budget="64KiB", chunk_bytes="32KiB")
    assert stored <= sum(read) <= stored + 64 * 4
    restored = ocp.PyTreeCheckpointer().restore(out)
    for name in ("gate_proj", "down_proj"):
        want = np.stack([expert_reference(deepseek[1], e, name) for e in range(EXPERTS)])
        np.testing.assert_array_equal(np.asarray(restored[name]), want.astype(BF16))
    np.testing.assert_array_equal(
        np.asarray(restored["norm"]), deepseek[1]["model.layers.0.input_layernorm.weight"]
    )


def test_save_as_safetensors_then_reopen(
    gptoss: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    mx = lazyckpt.dequantize(lazyckpt.open(gptoss[0]), dtype=np.float32)
    out = lazyckpt.save(tmp_path / "dense.safetensors", mx, memory_budget="64KiB")
    back = safetensors.safe_open(out, "np")
    np.testing.assert_array_equal(
        back.get_tensor("model.layers.0.mlp.experts.gate_up_proj"), mx_reference(gptoss[1])
    )
    assert "model.layers.0.mlp.experts.gate_up_proj_scales" not in back.keys()  # noqa: SIM118


def test_iter_blocks_at_tiny_budgets_give_the_reference(
    deepseek: tuple[Path, dict[str, np.ndarray]], gptoss: tuple[Path, dict[str, np.ndarray]]
) -> None:
    dense = lazyckpt.dequantize(lazyckpt.open(deepseek[0]), dtype=np.float32)
    weight = dense["model"]["layers"]["0"]["mlp"]["experts"]["2"]["gate_proj"]["weight"]
    mx = lazyckpt.dequantize(lazyckpt.open(gptoss[0]), dtype=np.float32)
    view = mx["model"]["layers"]["0"]["mlp"]["experts"]["gate_up_proj"]
    for array, want in (
        (weight, expert_reference(deepseek[1], 2, "gate_proj")),
        (view, mx_reference(gptoss[1])),
        (view[1:3, ::-3, 5:90], mx_reference(gptoss[1])[1:3, ::-3, 5:90]),
    ):
        for budget in ("1KiB", "16KiB"):
            out = np.full(array.shape, np.nan, np.float32)
            count = 0
            for _, index, values in lazyckpt.iter_blocks(array, memory_budget=budget):
                out[index] = values
                count += 1
            np.testing.assert_array_equal(out, want)
            assert count > 1 or array is not weight  # (blocks hold 64 KiB at least)


def test_stats_diff_and_verify_read_the_dense_values(
    deepseek: tuple[Path, dict[str, np.ndarray]],
) -> None:
    dense = lazyckpt.dequantize(lazyckpt.open(deepseek[0]), dtype=np.float32)
    weight = dense["model"]["layers"]["0"]["mlp"]["experts"]["0"]["gate_proj"]["weight"]
    table = lazyckpt.stats({"w": weight}, memory_budget="4KiB")
    want = expert_reference(deepseek[1], 0, "gate_proj")
    assert table["w"].max == pytest.approx(float(want.max()))
    assert table["w"].mean == pytest.approx(float(want.mean()), rel=1e-5)
    other = lazyckpt.dequantize(lazyckpt.open(deepseek[0]), dtype=np.float32)
    assert not lazyckpt.diff(dense, other, values=True)
    assert lazyckpt.verify(dense).ok


def test_views_compose_with_stack_unstack_transpose_and_rename(
    gptoss: tuple[Path, dict[str, np.ndarray]],
) -> None:
    mx = lazyckpt.dequantize(lazyckpt.open(gptoss[0]))
    view = mx["model"]["layers"]["0"]["mlp"]["experts"]["gate_up_proj"]
    want = mx_reference(gptoss[1]).astype(BF16)
    # transformers' GptOssExperts holds gate_up_proj as [E, hidden, 2 * intermediate].
    np.testing.assert_array_equal(view.transpose(0, 2, 1).get(), want.transpose(0, 2, 1))
    parts = lazyckpt.unstack(view)
    np.testing.assert_array_equal(parts[3][7].get(), want[3, 7])
    again = lazyckpt.stack(parts[::-1], axis=1)
    np.testing.assert_array_equal(again[:, 1].get(), want[2])
    renamed = lazyckpt.rename(mx, [(r"gate_up_proj$", "w13")])
    leaf = renamed["model"]["layers"]["0"]["mlp"]["experts"]["w13"]
    np.testing.assert_array_equal(leaf.reshape(4, -1)[1, :50].get(), want.reshape(4, -1)[1, :50])


shape_and_block = st.integers(1, 3).flatmap(
    lambda ndim: st.tuples(
        st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim),
        st.lists(st.integers(1, 9), min_size=min(ndim, 2), max_size=min(ndim, 2)),
    )
)


@st.composite
def slices(draw: st.DrawFn, shape: list[int]) -> tuple[slice | int, ...]:
    index: list[slice | int] = []
    for n in shape:
        if draw(st.booleans()):
            index.append(draw(st.integers(-n, n - 1)))
            continue
        start = draw(st.none() | st.integers(-n, n))
        stop = draw(st.none() | st.integers(-n, n))
        step = draw(st.sampled_from([None, 1, 2, 3, -1, -2]))
        index.append(slice(start, stop, step))
    return tuple(index)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("prop")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=shape_and_block, data=st.data(), seed=st.integers(0, 2**16))
def test_any_slice_of_any_shape_equals_the_reference(
    scratch: Path, case: tuple[list[int], list[int]], data: st.DataObject, seed: int
) -> None:
    shape, given_block = case
    rng = np.random.default_rng(seed)
    block = (1,) * (len(shape) - len(given_block)) + tuple(given_block)
    weight = fp8_values(rng, tuple(shape))
    scale_shape = tuple(math.ceil(n / b) for n, b in zip(shape, block, strict=True))
    scale = rng.uniform(0.1, 3, scale_shape).astype(np.float32)
    blocks = rng.integers(0, 256, (*shape[:-1], math.ceil(shape[-1] / 4), 16), dtype=np.uint8)
    scales = rng.integers(110, 140, blocks.shape[:-1], dtype=np.uint8)
    file = scratch / f"{seed}-{'x'.join(map(str, shape))}-{'x'.join(map(str, block))}.safetensors"
    if not file.exists():
        save_file({"w": weight, "s": scale, "b": blocks, "e": scales}, str(file))
    tree = lazyckpt.open(file)
    fp8 = lazyckpt.dequantize_fp8(tree["w"], tree["s"], block_size=given_block, dtype=np.float32)
    mx = lazyckpt.dequantize_mxfp4(tree["b"], tree["e"], dtype=np.float32)
    want_fp8 = fp8_reference(weight, scale, block)
    want_mx = mxfp4_reference(blocks, scales)
    index = data.draw(slices(shape))
    np.testing.assert_array_equal(fp8[index].get(), want_fp8[index])
    mx_index = data.draw(slices(list(want_mx.shape)))
    np.testing.assert_array_equal(mx[mx_index].get(), want_mx[mx_index])


def test_block_size_comes_from_config_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    weight = fp8_values(rng, (70, 50))
    scale = rng.uniform(0.5, 2, (3, 2)).astype(np.float32)  # 32x32 blocks
    tensors = {"lm.weight": weight, "lm.weight_scale_inv": scale, "x.weight": weight}
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    folder = write_model(tmp_path / "m", tensors, config)
    dense = lazyckpt.dequantize(lazyckpt.open(folder), dtype=np.float32)
    np.testing.assert_array_equal(
        dense["lm"]["weight"].get(), fp8_reference(weight, scale, (32, 32))
    )
    assert dense["x"]["weight"].dtype == ml_dtypes.float8_e4m3fn  # no scale: kept as stored
    (folder / "config.json").write_text("{}")  # no block size: 128x128, which does not fit
    with pytest.raises(
        lazyckpt.QuantizationError, match=r"lm/weight with lm/weight_scale_inv.*128"
    ):
        lazyckpt.dequantize(lazyckpt.open(folder))


def test_a_flat_tree_and_per_tensor_and_per_channel_scales(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    weight = fp8_values(rng, (300, 7))
    channels = rng.uniform(0.5, 2, (300, 1)).astype(np.float32)
    tensors = {
        "a.weight": weight,
        "a.weight_scale": np.array([0.5], np.float32),
        "b.weight": weight,
        "b.weight_scale": channels,
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    flat = lazyckpt.dequantize(lazyckpt.open(path, flat=True), dtype=np.float32)
    assert list(flat) == ["a.weight", "b.weight"]
    np.testing.assert_array_equal(flat["a.weight"].get(), weight.astype(np.float32) * 0.5)
    np.testing.assert_array_equal(flat["b.weight"].get(), weight.astype(np.float32) * channels)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        (
            {
                "l.weight_scale_inv": np.ones((1, 1), np.float32),
                "k.weight": np.ones((2, 2), ml_dtypes.float8_e4m3fn),
            },
            r"l/weight_scale_inv: a weight's scale without its weight 'l/weight'",
        ),
        (
            {
                "l.weight": np.ones((300, 10), ml_dtypes.float8_e4m3fn),
                "l.weight_scale_inv": np.ones((2, 1), np.float32),
            },
            r"l/weight with l/weight_scale_inv: dimension 0 holds 300 values in blocks of 128, so 3 scales, but the scale has 2",
        ),
        (
            {"e.up_blocks": np.ones((2, 3, 16), np.uint8)},
            r"e/up_blocks: MXFP4 blocks without their scales 'e/up_scales'",
        ),
        (
            {
                "e.up_blocks": np.ones((2, 3, 16), np.uint8),
                "e.up_scales": np.ones((2, 4), np.uint8),
            },
            r"e/up_blocks with e/up_scales: MXFP4 scales are uint8 or float8_e8m0fnu .* \[2, 3\]; found uint8 \[2, 4\]",
        ),
    ],
)
def test_pairs_that_do_not_fit_name_both_tensors(
    tmp_path: Path, tensors: dict[str, np.ndarray], match: str
) -> None:
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(lazyckpt.QuantizationError, match=match):
        lazyckpt.dequantize(lazyckpt.open(path))


def test_array_level_functions_check_their_arguments(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    weight = np.ones((4, 6), ml_dtypes.float8_e4m3fn)
    save_file(
        {"w": weight, "s": np.ones((2, 2), np.float32), "i": np.ones((2, 2), np.int32)}, str(path)
    )
    tree = lazyckpt.open(path)
    with pytest.raises(lazyckpt.QuantizationError, match=r"block_size=\(2, 3, 4\) does not fit"):
        lazyckpt.dequantize_fp8(tree["w"], tree["s"], block_size=(2, 3, 4))
    with pytest.raises(lazyckpt.QuantizationError, match="the scale is int32, expected a float"):
        lazyckpt.dequantize_fp8(tree["w"], tree["i"], block_size=(2, 3))
    with pytest.raises(lazyckpt.QuantizationError, match="dtype=int8 is not a floating-point"):
        lazyckpt.dequantize_fp8(tree["w"], tree["s"], block_size=(2, 3), dtype=np.int8)
    with pytest.raises(lazyckpt.QuantizationError, match=r"dtype='f4,,' is not a dtype"):
        lazyckpt.dequantize_fp8(tree["w"], tree["s"], block_size=(2, 3), dtype="f4,,")
    with pytest.raises(
        lazyckpt.QuantizationError, match=r"MXFP4 blocks are uint8 \[\.\.\., G, 16\]"
    ):
        lazyckpt.dequantize_mxfp4(tree["w"], tree["s"])
    with pytest.raises(lazyckpt.QuantizationError, match="takes LazyArrays, found ndarray"):
        lazyckpt.dequantize_fp8(weight, tree["s"])  # type: ignore[arg-type]
    np.testing.assert_array_equal(
        lazyckpt.dequantize_fp8(tree["w"], tree["s"], block_size=(2, 3), dtype=np.float32).get(),
        np.ones((4, 6), np.float32),
    )


def test_a_bad_block_size_in_config_json_is_named(tmp_path: Path) -> None:
    tensors = {
        "l.weight": np.ones((4, 4), ml_dtypes.float8_e4m3fn),
        "l.weight_scale_inv": np.ones((1, 1), np.float32),
    }
    config = {"quantization_config": {"weight_block_size": [128, "x"]}}
    folder = write_model(tmp_path / "m", tensors, config)
    with pytest.raises(
        lazyckpt.QuantizationError,
        match=r"config.json: quantization_config.weight_block_size is \[128, 'x'\]",
    ):
        lazyckpt.dequantize(lazyckpt.open(folder))


def spec(dtype: str, shape: list[int], data: np.ndarray) -> Any:
    return safetensors.TensorSpec(
        dtype=dtype, shape=shape, data_ptr=data.ctypes.data, data_len=data.nbytes
    )


def test_f4_and_f8_e8m0_tensors_are_read_as_their_ml_dtypes(tmp_path: Path) -> None:
    """safetensors 0.8 writes torch's float4_e2m1fn_x2 (two codes a byte) as F4, with
    the shape in codes, and float8_e8m0fnu as F8_E8M0."""
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, (2, 3, 16), dtype=np.uint8)
    scales = rng.integers(120, 135, (2, 3), dtype=np.uint8)
    path = tmp_path / "mx.safetensors"
    safetensors.serialize_file(
        {
            "x_blocks": spec("float4_e2m1fn_x2", [2, 3, 16], packed),
            "x_scales": spec("float8_e8m0fnu", [2, 3], scales),
        },
        str(path),
    )
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert (header["x_blocks"]["dtype"], header["x_blocks"]["shape"]) == ("F4", [2, 3, 32])
    tree = lazyckpt.open(path)
    blocks = tree["x_blocks"]
    assert (blocks.shape, blocks.dtype) == ((2, 3, 32), np.dtype(ml_dtypes.float4_e2m1fn))
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(2, 3, 32)
    np.testing.assert_array_equal(blocks.get().view(np.uint8), codes)
    np.testing.assert_array_equal(blocks[1, ::-1, 3:8].get().view(np.uint8), codes[1, ::-1, 3:8])
    assert tree["x_scales"].dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
    dense = lazyckpt.dequantize(tree, dtype=np.float32)
    np.testing.assert_array_equal(dense["x"].get(), mxfp4_reference(packed, scales))
    with pytest.raises(
        lazyckpt.UnsavableError, match="x_blocks has dtype float4_e2m1fn, which safetensors packs"
    ):
        lazyckpt.save(tmp_path / "out.safetensors", tree)
    # Orbax stores them as they are, and Orbax restores them.
    out = lazyckpt.save(tmp_path / "orbax", tree)
    restored = ocp.PyTreeCheckpointer().restore(out)
    np.testing.assert_array_equal(np.asarray(restored["x_blocks"]).view(np.uint8), codes)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (
            {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
            r"'F6_E2M3' \(6-bit floats, packed four to three bytes\), which lazyckpt does not read",
        ),
        (
            {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]},
            r"shape \[2, 3\] of F4 has an odd last dimension",
        ),
        (
            {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 8]},
            r"shape \[2, 4\] of F4 takes 4 bytes, but its data_offsets span 8",
        ),
    ],
)
def test_packed_dtypes_that_cannot_be_read_are_named(
    tmp_path: Path, entry: dict[str, Any], match: str
) -> None:
    header = json.dumps({"t": entry}).encode()
    size = entry["data_offsets"][1]
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(size))
    with pytest.raises(
        (lazyckpt.UnsupportedCheckpointError, lazyckpt.CorruptCheckpointError), match=match
    ):
        lazyckpt.open(path)


def test_convert_dequantizes_from_the_command_line(
    deepseek: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    out = tmp_path / "dense"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lazyckpt._cli.main",
            "convert",
            str(deepseek[0]),
            str(out),
            "--dequantize",
            "--dtype",
            "bfloat16",
            "--to",
            "orbax",
            "--memory-budget",
            "64KiB",
            "--select",
            "model.layers.0.mlp.experts.1.**",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    restored = ocp.PyTreeCheckpointer().restore(out)
    weight = restored["model"]["layers"]["0"]["mlp"]["experts"]["1"]["down_proj"]["weight"]
    np.testing.assert_array_equal(
        np.asarray(weight), expert_reference(deepseek[1], 1, "down_proj").astype(BF16)
    )
    assert sorted(restored["model"]["layers"]["0"]["mlp"]["experts"]["1"]) == [
        "down_proj",
        "gate_proj",
    ]


def test_convert_dry_run_plans_the_dense_weights(
    gptoss: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, no_data_reads: None
) -> None:
    plan = lazyckpt.convert(
        gptoss[0], tmp_path / "out.safetensors", dequantize=True, dtype="float16", dry_run=True
    )
    by_name = {a.name: a for a in plan.arrays}
    dense = by_name["model.layers.0.mlp.experts.gate_up_proj"]
    assert (dense.dtype, dense.shape) == ("float16", (*MX_SHAPE[:2], MX_SHAPE[2] * 32))
    assert not any(name.endswith(("_blocks", "_scales")) for name in by_name)


def test_inspect_show_and_stats_dequantize_from_the_command_line(
    gptoss: tuple[Path, dict[str, np.ndarray]],
) -> None:
    def run(*args: str) -> str:
        command = [sys.executable, "-m", "lazyckpt._cli.main", *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout

    folder = str(gptoss[0])
    listing = run("inspect", folder, "--dequantize")
    assert re.search(r"^ *gate_up_proj +bfloat16\[4,40,96\]", listing, re.M)
    assert "_blocks" not in listing
    key = "model.layers.0.mlp.experts.gate_up_proj[1, 2, :4]"
    shown = run("show", folder, key, "--dequantize")
    want = mx_reference(gptoss[1])[1, 2, :4].astype(BF16)
    assert " ".join(f"{v:g}" for v in want.tolist()) in shown
    table = run("stats", folder, "--dequantize", "--select", "**/gate_up_proj")
    assert f"{float(mx_reference(gptoss[1]).max()):g}" in table


_PROBE = """
import gc, json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import lazyckpt

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

weight = lazyckpt.dequantize(lazyckpt.open(sys.argv[1]))["w"]
# Thread pools (the block workers too) and first-read state into the baseline.
lazyckpt.load(weight[:256], memory_budget="16MiB")
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
baseline = peak()
if sys.argv[2] == "load":
    kept = lazyckpt.load(weight, memory_budget="16MiB").nbytes
else:
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = lazyckpt.device_put(weight, NamedSharding(mesh, P("x", "y")), memory_budget="16MiB")
    kept = jax.block_until_ready(placed).nbytes
print(json.dumps({"peak": peak() - baseline, "kept": kept}))
"""


@pytest.mark.parametrize("verb", ["load", "device_put"])
def test_a_large_read_holds_its_result_and_a_few_blocks(tmp_path: Path, verb: str) -> None:
    """64 MiB of FP8 codes read as 128 MiB of bfloat16: the codes are read and computed
    block by block, never all held beside the result."""
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 0x7E, (4096, 16384), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.5, 2, (32, 128)).astype(np.float32)
    path = tmp_path / "big.safetensors"
    save_file({"w": codes, "w_scale_inv": scales}, str(path))
    command = [sys.executable, "-c", _PROBE, str(path), verb]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    probe = json.loads(result.stdout.splitlines()[-1])
    assert probe["kept"] == 128 << 20
    # The result, a block of 2 MiB in flight on each core with its codes and float32
    # pieces, and what the allocator keeps per thread: 28-35 MiB measured. With every
    # code held at once, 64 MiB more than that.
    assert probe["peak"] <= probe["kept"] + (48 << 20), probe


def test_int8_weights_half_pairs_and_bad_arguments(tmp_path: Path) -> None:
    """Symmetric int8 is dequantized, asymmetric (a zero point) refused; half an MXFP4
    pair, or one that does not fit, is named; bad arguments too."""
    rng = np.random.default_rng(6)
    path = tmp_path / "m.safetensors"
    int8 = rng.integers(-127, 128, (4, 6), dtype=np.int8)
    tensors: dict[str, np.ndarray] = {
        "q.weight": int8,
        "q.weight_scale": np.full((4, 1), 0.5, np.float32),
        "z.weight": int8,
        "z.weight_scale": np.ones((4, 1), np.float32),
        "z.weight_zero_point": np.zeros((4, 1), np.int8),
    }
    save_file(tensors, str(path))
    tree = lazyckpt.open(path)
    dense = lazyckpt.dequantize({"q": tree["q"]}, dtype=np.float32)  # symmetric int8 (W8A8)
    np.testing.assert_array_equal(dense["q"]["weight"].get(), int8.astype(np.float32) * 0.5)
    with pytest.raises(
        lazyckpt.QuantizationError, match="z/weight with z/weight_scale: a zero point"
    ):
        lazyckpt.dequantize(tree)
    odd = tmp_path / "odd.safetensors"
    save_file(
        {"m_blocks": np.ones((8, 5, 15), np.uint8), "m_scales": np.ones((8, 5), np.uint8)}, str(odd)
    )
    with pytest.raises(
        lazyckpt.QuantizationError, match=r"m_blocks with m_scales: MXFP4 blocks are uint8"
    ):
        lazyckpt.dequantize(lazyckpt.open(odd))
    alone = tmp_path / "alone.safetensors"
    save_file({"m_scales": np.ones((8, 5), np.uint8)}, str(alone))
    with pytest.raises(
        lazyckpt.QuantizationError, match="m_scales: MXFP4 scales without their blocks 'm_blocks'"
    ):
        lazyckpt.dequantize(lazyckpt.open(alone))
    for bad, match in (
        ({"dtype": "bogus"}, "dtype='bogus' is not a dtype"),
        ({"block_size": 16}, "block_size=16, expected positive sizes"),
        ({"block_size": (16.5, 16)}, r"block_size=\(16.5, 16\), expected"),
    ):
        with pytest.raises(lazyckpt.QuantizationError, match=match):
            lazyckpt.dequantize(tree, **bad)


def test_weights_stacked_before_dequantize_keep_their_config(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {}
    for e in range(2):
        tensors[f"e.{e}.weight"] = fp8_values(rng, (40, 40))
        tensors[f"e.{e}.weight_scale_inv"] = rng.uniform(0.5, 2, (3, 3)).astype(np.float32)
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    experts = lazyckpt.open(write_model(tmp_path / "m", tensors, config))["e"]
    stacked = {
        name: lazyckpt.stack([experts[str(e)][name] for e in range(2)])
        for name in ("weight", "weight_scale_inv")
    }
    dense = lazyckpt.dequantize(stacked, dtype=np.float32)["weight"]
    want = np.stack(
        [
            fp8_reference(tensors[f"e.{e}.weight"], tensors[f"e.{e}.weight_scale_inv"], (16, 16))
            for e in range(2)
        ]
    )
    np.testing.assert_array_equal(dense.get(), want)
