"""Dequantizing an FP8 MoE release into stacked bf16 experts: lazyckpt against NumPy + Orbax.

    python benchmarks/bench_dequantize.py [--gib G] [--repeat N] [--budget-mib N] [--data DIR]

The source is a synthetic DeepSeek-style FP8 Hugging Face folder (`--gib`, default 2):
per layer 32 experts whose `gate_proj`/`up_proj` (1408 x 2000) and `down_proj`
(2000 x 1408) are float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block
(edge blocks cut short: neither size is a multiple of 128), bf16 and float32 norms,
one shard per layer, `config.json` naming the block size. Both ways write an Orbax
checkpoint of `{"layers": {l: {"mlp": {proj: [E, out, in] bf16}, norms}}, "norm"}`.

- lazyckpt: `open`, `dequantize`, `stack` per layer and projection (all views),
  `save` within the budget.
- eager: `safetensors.numpy.load_file` every shard, dequantize and `np.stack` with
  NumPy, save with Orbax: what conversion scripts do today.

Each run is a fresh process; the ways alternate; time, bytes read and peak RSS above
the process's baseline; the outputs are compared once, with lazyckpt and with Orbax.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common import (
    GiB,
    MiB,
    fastest,
    fmt_bytes,
    fresh_dir,
    in_fresh_process,
    machine,
    measure,
    orbax_save,
    ratio,
    versions,
)

EXPERTS = 32
HIDDEN, INTERMEDIATE = 2000, 1408
BLOCK = 128
SHAPES = {
    "gate_proj": (INTERMEDIATE, HIDDEN),
    "up_proj": (INTERMEDIATE, HIDDEN),
    "down_proj": (HIDDEN, INTERMEDIATE),
}
LAYER_BYTES = EXPERTS * sum(out * in_ for out, in_ in SHAPES.values())  # one byte each


def layers_for(gib: float) -> int:
    return max(1, round(gib * GiB / LAYER_BYTES))


def shard_name(layer: int, layers: int) -> str:
    return f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"


def make_model(folder: Path, layers: int) -> None:
    """Write the FP8 model, one layer (about 260 MiB) in memory at a time."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        tensors = {
            f"{prefix}.input_layernorm.weight": rng.standard_normal(HIDDEN).astype(
                ml_dtypes.bfloat16
            ),
            f"{prefix}.post_attention_layernorm.weight": rng.standard_normal(
                HIDDEN, dtype=np.float32
            ),
        }
        if layer == layers - 1:
            tensors["model.norm.weight"] = rng.standard_normal(HIDDEN).astype(ml_dtypes.bfloat16)
        for expert in range(EXPERTS):
            for proj, (out, in_) in SHAPES.items():
                codes = rng.integers(0, 256, (out, in_), dtype=np.uint8)
                codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes
                name = f"{prefix}.mlp.experts.{expert}.{proj}"
                tensors[f"{name}.weight"] = codes.view(ml_dtypes.float8_e4m3fn)
                scales = (-(-out // BLOCK), -(-in_ // BLOCK))
                tensors[f"{name}.weight_scale_inv"] = rng.uniform(1e-4, 1e-2, scales).astype(
                    np.float32
                )
        shard = shard_name(layer, layers)
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": layers,
        "n_routed_experts": EXPERTS,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def stored_tensor_bytes(folder: Path) -> int:
    """The bytes of the tensors' data in the folder's shards, from their headers."""
    total = 0
    for shard in sorted(folder.glob("model-*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(
            end - start
            for name, entry in header.items()
            if name != "__metadata__"
            for start, end in [entry["data_offsets"]]
        )
    return total


def lazy_way(source: str, destination: str, budget: int) -> dict[str, Any]:
    import jax.numpy as jnp

    import lazyckpt

    fresh_dir(Path(destination))

    def run() -> None:
        model = lazyckpt.dequantize(lazyckpt.open(source), dtype=jnp.bfloat16)["model"]
        layers = {}
        for layer, block in model["layers"].items():
            experts = block["mlp"]["experts"]
            layers[layer] = {
                "mlp": {
                    proj: lazyckpt.stack([experts[str(e)][proj]["weight"] for e in range(EXPERTS)])
                    for proj in SHAPES
                },
                "input_layernorm": block["input_layernorm"]["weight"],
                "post_attention_layernorm": block["post_attention_layernorm"]["weight"],
            }
        tree = {"layers": layers, "norm": model["norm"]["weight"]}
        lazyckpt.save(destination, tree, memory_budget=budget, progress=False)

    from lazyckpt._storage.metrics import direct_bytes_read

    before = direct_bytes_read()
    out = measure(run)
    # The source's bytes alone: `bytes_read` also counts the Orbax writer (tensorstore's
    # OCDBT driver) reading back the b-tree nodes it is building.
    out["source_bytes"] = direct_bytes_read() - before
    return out


def eager_way(source: str, destination: str, layers: int) -> dict[str, Any]:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file

    def dequantize(weight: Any, scale: Any) -> Any:
        out, in_ = weight.shape
        blocks = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:out, :in_]
        return (weight.astype(np.float32) * blocks).astype(ml_dtypes.bfloat16)

    # safetensors 0.8 loads F8_E4M3 as `numpy.float8_e4m3fn`, which NumPy lacks: the
    # usual workaround is to lend it ml_dtypes' type.
    np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # type: ignore[attr-defined]
    fresh_dir(Path(destination))

    def run() -> None:
        tensors: dict[str, Any] = {}
        for shard in sorted(Path(source).glob("model-*.safetensors")):
            tensors.update(load_file(str(shard)))
        tree = {}
        for layer in range(layers):
            prefix = f"model.layers.{layer}"
            mlp = {}
            for proj in SHAPES:
                names = [f"{prefix}.mlp.experts.{e}.{proj}.weight" for e in range(EXPERTS)]
                mlp[proj] = np.stack(
                    [dequantize(tensors[n], tensors[n + "_scale_inv"]) for n in names]
                )
            tree[str(layer)] = {
                "mlp": mlp,
                "input_layernorm": tensors[f"{prefix}.input_layernorm.weight"],
                "post_attention_layernorm": tensors[f"{prefix}.post_attention_layernorm.weight"],
            }
        orbax_save(Path(destination), {"layers": tree, "norm": tensors["model.norm.weight"]})

    out = measure(run)
    out["bytes_read"] = sum(f.stat().st_size for f in Path(source).glob("model-*.safetensors"))
    out["source_bytes"] = out["bytes_read"]
    return out


def compare(lazy_out: str, eager_out: str, layers: int) -> dict[str, Any]:
    """Both outputs opened by lazyckpt, and lazyckpt's restored by Orbax, against each other."""
    import ml_dtypes
    import numpy as np
    import orbax.checkpoint as ocp

    import lazyckpt

    def same(a: Any, b: Any) -> bool:
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        )

    ours, theirs = lazyckpt.open(lazy_out), lazyckpt.open(eager_out)
    last = str(layers - 1)
    checks = {
        "layer 0 gate_proj expert 3": same(
            ours["layers"]["0"]["mlp"]["gate_proj"][3].get(),
            theirs["layers"]["0"]["mlp"]["gate_proj"][3].get(),
        ),
        f"layer {last} down_proj, all experts": same(
            ours["layers"][last]["mlp"]["down_proj"].get(),
            theirs["layers"][last]["mlp"]["down_proj"].get(),
        ),
        "norms": all(
            same(ours["layers"][last][n].get(), theirs["layers"][last][n].get())
            for n in ("input_layernorm", "post_attention_layernorm")
        )
        and same(ours["norm"].get(), theirs["norm"].get()),
    }
    layer = {proj: ocp.RestoreArgs(restore_type=np.ndarray) for proj in SHAPES}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            lazy_out,
            args=ocp.args.PyTreeRestore(
                item={"layers": {"0": {"mlp": dict.fromkeys(SHAPES, 0)}}},
                restore_args={"layers": {"0": {"mlp": layer}}},
                partial_restore=True,
            ),
        )
    checks["Orbax restore of lazyckpt's layer 0"] = all(
        restored["layers"]["0"]["mlp"][proj].dtype == ml_dtypes.bfloat16
        and same(restored["layers"]["0"]["mlp"][proj], theirs["layers"]["0"]["mlp"][proj].get())
        for proj in SHAPES
    )
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="FP8 weights to write, in GiB")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--data", default="/tmp/lazyckpt-bench-dequant", type=Path)
    args = parser.parse_args()
    budget = args.budget_mib * MiB
    layers = layers_for(args.gib)
    source = args.data / f"fp8_moe_{layers}x{EXPERTS}"
    if not (source / "config.json").exists():  # written last: the folder is complete
        in_fresh_process(_make, fresh_dir(source), layers)
    stored = stored_tensor_bytes(source)
    lazy_out, eager_out = str(args.data / "out_lazyckpt"), str(args.data / "out_eager")
    print(f"machine: {machine()}\nversions: {versions()}\nbudget: {args.budget_mib} MiB")
    print(
        f"source: {source}, {layers} layers x {EXPERTS} experts x 3 projections, float8_e4m3fn "
        f"with 128x128 float32 scales; {fmt_bytes(stored)} of tensors, "
        f"{fmt_bytes(2 * LAYER_BYTES * layers)} as bf16\n"
    )
    ours, theirs = [], []
    for _ in range(args.repeat):  # interleaved, so machine load falls on both alike
        theirs.append(in_fresh_process(eager_way, str(source), eager_out, layers))
        ours.append(in_fresh_process(lazy_way, str(source), lazy_out, budget))
    # The fastest run's time, and the worst peak of any run: the bound is on every run.
    rows = {
        "lazyckpt open+dequantize+stack+save": {
            **fastest(ours),
            "peak_above_baseline": max(r["peak_above_baseline"] for r in ours),
        },
        "eager load_file+NumPy+Orbax save": {
            **fastest(theirs),
            "peak_above_baseline": max(r["peak_above_baseline"] for r in theirs),
        },
    }
    print(
        "| way | time s | peak RSS MiB above baseline | bytes read (all) | of the source "
        "| source / stored |"
    )
    print("|---|---|---|---|---|---|")
    for way, r in rows.items():
        print(
            f"| {way} | {r['seconds']:.2f} | {r['peak_above_baseline'] / MiB:,.0f} | "
            f"{fmt_bytes(r['bytes_read'])} | {fmt_bytes(r['source_bytes'])} | "
            f"{r['source_bytes'] / stored:.4f}x |"
        )
    a, b = rows["eager load_file+NumPy+Orbax save"], rows["lazyckpt open+dequantize+stack+save"]
    limit = budget * 1.15
    print(
        f"\neager / lazyckpt: time {ratio(a['seconds'], b['seconds'])}, peak "
        f"{ratio(a['peak_above_baseline'], b['peak_above_baseline'])}; lazyckpt's peak "
        f"{'within' if b['peak_above_baseline'] <= limit else 'OVER'} budget + 15% "
        f"({fmt_bytes(limit)})"
    )
    checks = in_fresh_process(compare, lazy_out, eager_out, layers)
    for name, ok in checks.items():
        print(f"{name}: {'OK' if ok else 'MISMATCH'}")


def _make(folder: Path, layers: int) -> dict[str, Any]:
    make_model(folder, layers)
    return {}


if __name__ == "__main__":
    main()
