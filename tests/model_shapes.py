"""Published models' metadata at full size, with sparse data: the tree a user of that
model opens, written in seconds and taking a few MB of disk.

`deepseek_v3` writes DeepSeek-V3's 163 safetensors shards and their index with the
names, shapes and dtypes of its config (hidden 7168, 61 layers of which the first 3
are dense, 256 routed experts and 1 shared expert, FP8 weights in 128x128 blocks with
their `weight_scale_inv`, and the multi-token-prediction layer 61): 91,991 tensors,
689 GB as files that hold only their headers.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

HIDDEN = 7168
VOCAB = 129280
LAYERS = 61
DENSE_LAYERS = 3
EXPERTS = 256
FILES = 163

_SIZES = {"BF16": 2, "F8_E4M3": 1, "F32": 4}


def _fp8(name: str, rows: int, cols: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    yield f"{name}.weight", "F8_E4M3", (rows, cols)
    yield f"{name}.weight_scale_inv", "F32", (math.ceil(rows / 128), math.ceil(cols / 128))


def _mlp(prefix: str, inner: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    yield from _fp8(f"{prefix}.down_proj", HIDDEN, inner)
    yield from _fp8(f"{prefix}.gate_proj", inner, HIDDEN)
    yield from _fp8(f"{prefix}.up_proj", inner, HIDDEN)


def _layer(i: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    at = f"model.layers.{i}"
    yield f"{at}.input_layernorm.weight", "BF16", (HIDDEN,)
    yield f"{at}.post_attention_layernorm.weight", "BF16", (HIDDEN,)
    attn = f"{at}.self_attn"
    yield from _fp8(f"{attn}.q_a_proj", 1536, HIDDEN)
    yield f"{attn}.q_a_layernorm.weight", "BF16", (1536,)
    yield from _fp8(f"{attn}.q_b_proj", 128 * 192, 1536)
    yield from _fp8(f"{attn}.kv_a_proj_with_mqa", 512 + 64, HIDDEN)
    yield f"{attn}.kv_a_layernorm.weight", "BF16", (512,)
    yield from _fp8(f"{attn}.kv_b_proj", 128 * 256, 512)
    yield from _fp8(f"{attn}.o_proj", HIDDEN, 128 * 128)
    if i < DENSE_LAYERS:
        yield from _mlp(f"{at}.mlp", 18432)
        return
    yield f"{at}.mlp.gate.weight", "BF16", (EXPERTS, HIDDEN)
    yield f"{at}.mlp.gate.e_score_correction_bias", "F32", (EXPERTS,)
    yield from _mlp(f"{at}.mlp.shared_experts", 2048)
    for expert in range(EXPERTS):
        yield from _mlp(f"{at}.mlp.experts.{expert}", 2048)
    if i == LAYERS:  # the multi-token-prediction module
        yield f"{at}.embed_tokens.weight", "BF16", (VOCAB, HIDDEN)
        yield f"{at}.enorm.weight", "BF16", (HIDDEN,)
        yield f"{at}.hnorm.weight", "BF16", (HIDDEN,)
        yield f"{at}.eh_proj.weight", "BF16", (HIDDEN, 2 * HIDDEN)
        yield f"{at}.shared_head.norm.weight", "BF16", (HIDDEN,)
        yield f"{at}.shared_head.head.weight", "BF16", (VOCAB, HIDDEN)


def deepseek_v3_tensors() -> list[tuple[str, str, tuple[int, ...]]]:
    """`(name, safetensors dtype, shape)` of every tensor, in the shards' order."""
    out: list[tuple[str, str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN))
    ]
    for i in range(LAYERS + 1):
        out.extend(_layer(i))
    out.append(("model.norm.weight", "BF16", (HIDDEN,)))
    out.append(("lm_head.weight", "BF16", (VOCAB, HIDDEN)))
    return out


def deepseek_v3(folder: Path) -> Path:
    """Write the model's shards (headers, then a hole of their data's size) and index
    into `folder`; return it."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = deepseek_v3_tensors()
    sizes = [math.prod(shape) * _SIZES[dtype] for _, dtype, shape in tensors]
    total = sum(sizes)
    shards: list[list[int]] = [[] for _ in range(FILES)]
    start = 0
    for i, size in enumerate(sizes):  # by bytes, as transformers cuts shards
        shards[min(FILES - 1, start * FILES // total)].append(i)
        start += size
    weight_map = {}
    for number, members in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{FILES:06d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for i in members:
            tensor, dtype, shape = tensors[i]
            header[tensor] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + sizes[i]],
            }
            weight_map[tensor] = name
            offset += sizes[i]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path = folder / name
        with path.open("wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
        os.truncate(path, 8 + len(text) + offset)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder
