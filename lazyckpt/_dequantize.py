"""`dequantize`: quantized weights as lazy views of their dense values.

Two conventions of released checkpoints are found by their names and dtypes:

- **FP8, block-scaled** (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8): `X.weight` in a float8
  dtype beside `X.weight_scale_inv` (or `X.weight_scale`), one scale per block of the
  weight's last two dimensions, `weight_block_size` in `config.json`'s
  `quantization_config` (128x128 where there is none). Dense value: `weight * scale`.
- **MXFP4** (gpt-oss): `X_blocks` (bytes `[..., G, 16]`, or `float4_e2m1fn`
  `[..., G, 32]`) beside `X_scales` (`[..., G]`, E8M0). Dense value: `X`,
  `[..., G * 32]`.

`dequantize_fp8` and `dequantize_mxfp4` build one view from two LazyArrays, for
layouts the names do not tell (another block size, scale name or axis order).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._array import quant
from lazyckpt._array.compose import sources
from lazyckpt._array.dtypes import issubdtype, parsed
from lazyckpt._array.tree import children, fold_tree, rebuild
from lazyckpt._errors import QuantizationError, StorageAccessError, json_or_corrupt
from lazyckpt._lazy import LazyArray, composed
from lazyckpt._storage import paths

_CONFIG_LIMIT = 16 << 20
"""The most bytes of a `config.json` read: a larger one is refused as it streams."""
DEFAULT_BLOCK = (128, 128)
"""The FP8 block size where a model names none (DeepSeek-V3's, and every release's
so far)."""

_FP8_SCALES = ("_scale_inv", "_scale")
_MX_BLOCKS, _MX_SCALES = "_blocks", "_scales"


def dequantize_fp8(
    weight: LazyArray,
    scale: LazyArray,
    *,
    block_size: Sequence[int] = DEFAULT_BLOCK,
    dtype: DTypeLike = ml_dtypes.bfloat16,
) -> LazyArray:
    """The dense view of a block-scaled weight: `weight * scale` of its block, worked
    out in float32 as a read asks for it, then cast to `dtype`. Reads nothing.

    Args:
        weight: The stored values (float8, or any numeric dtype), `[..., out, in]`.
        scale: One scale per block (`weight_scale_inv` in DeepSeek's releases; it is
            multiplied, as they define it), of shape `ceil(weight.shape / block)`,
            or a single scale for the whole weight. Of any float dtype.
        block_size: The block's size along the weight's last dimensions (leading
            dimensions have a scale each), edge blocks cut short. A dimension
            with one scale is one block, whatever its size, and a dimension with
            a scale per element has blocks of 1 (per-channel scales, `[out, 1]`).
        dtype: The dtype of the view.

    A slice reads only its elements and the scales of the blocks they fall in:

    >>> tree = lazyckpt.open(fp8)
    >>> dense = lazyckpt.dequantize_fp8(tree["w"], tree["w_scale_inv"], block_size=(2, 4))
    >>> dense.shape, dense.dtype, dense[3, :5].get().tolist()
    ((5, 6), dtype(bfloat16), [6.0, 9.0, 12.0, 15.0, 24.0])
    """
    _check_arrays("dequantize_fp8", weight, scale)
    where = f"{weight.key} with {scale.key}"
    if not weight.ndim:
        raise QuantizationError(
            f"{where}: the weight is 0-d; a block-scaled weight has at least one dimension"
        )
    if scale.size == 1 and scale.ndim != weight.ndim:  # one scale for the whole weight
        scale = scale.reshape((1,) * weight.ndim)
    if scale.ndim != weight.ndim:
        raise QuantizationError(
            f"{where}: a {weight.ndim}-d weight of shape {weight.shape} needs a scale per "
            f"block with as many dimensions, found shape {scale.shape}; pass the "
            "weight's own scale (or one scale for the whole weight)"
        )
    given = _block(block_size, where)
    if len(given) > weight.ndim:
        raise QuantizationError(
            f"{where}: block_size={given} does not fit a weight of shape {weight.shape}; "
            "give one positive size per blocked (trailing) dimension"
        )
    block = [1] * (weight.ndim - len(given)) + list(given)
    for d, (n, s) in enumerate(zip(weight.shape, scale.shape, strict=True)):
        if s == 1:
            block[d] = max(n, 1)  # one block along it, however large
        elif s == n:
            block[d] = 1  # a scale per row (or column): per-channel scaling
        elif -(-n // block[d]) != s:
            raise QuantizationError(
                f"{where}: dimension {d} holds {n} values in blocks of {block[d]}, so "
                f"{-(-n // block[d])} scales, but the scale has {s} (shapes {weight.shape} "
                f"and {scale.shape}); pass the block size the model was quantized with "
                "(config.json's quantization_config.weight_block_size)"
            )
    if not issubdtype(scale.dtype, np.floating):
        raise QuantizationError(
            f"{where}: the scale is {scale.dtype}, expected a float dtype (float32, "
            "bfloat16, float8_e8m0fnu)"
        )
    out = _dtype(dtype, where)
    node = quant.BlockScaled(weight.shape, out, weight, scale, tuple(block))
    return composed(weight.path, node, out)


def dequantize_mxfp4(
    blocks: LazyArray, scales: LazyArray, *, dtype: DTypeLike = ml_dtypes.bfloat16
) -> LazyArray:
    """The dense view of MXFP4 weights: 32 E2M1 codes per block times their block's
    E8M0 scale (`2 ** (s - 127)`), read as `[..., G * 32]`. Reads nothing.

    Args:
        blocks: The codes: bytes `[..., G, 16]`, two codes each, low nibble first
            (gpt-oss's `_blocks`), or `float4_e2m1fn` `[..., G, 32]` (safetensors'
            `F4`).
        scales: `[..., G]`, bytes or `float8_e8m0fnu` (gpt-oss's `_scales`).
        dtype: The dtype of the view.

    >>> tree = lazyckpt.open(mx)
    >>> dense = lazyckpt.dequantize_mxfp4(tree["w_blocks"], tree["w_scales"])
    >>> dense.shape, dense[1, 30:34].get().tolist()
    ((2, 64), [-0.25, 1.0, 0.0, 3.0])
    """
    _check_arrays("dequantize_mxfp4", blocks, scales)
    where = f"{blocks.key} with {scales.key}"
    if not _is_mx_blocks(blocks):
        raise QuantizationError(
            f"{where}: MXFP4 blocks are uint8 [..., G, 16] or float4_e2m1fn [..., G, 32], "
            f"found {blocks.dtype} {list(blocks.shape)}"
        )
    if (
        scales.dtype not in (np.uint8, ml_dtypes.float8_e8m0fnu)
        or scales.shape != blocks.shape[:-1]
    ):
        raise QuantizationError(
            f"{where}: MXFP4 scales are uint8 or float8_e8m0fnu of the blocks' shape "
            f"without its last dimension, {list(blocks.shape[:-1])}; found {scales.dtype} "
            f"{list(scales.shape)}"
        )
    out = _dtype(dtype, where)
    shape = (*blocks.shape[:-2], blocks.shape[-2] * quant.CODES)
    return composed(_mx_path(blocks.path), quant.MXFP4(shape, out, blocks, scales), out)


def dequantize(
    tree: Any,
    *,
    dtype: DTypeLike = ml_dtypes.bfloat16,
    block_size: Sequence[int] | None = None,
) -> Any:
    """`tree` with each quantized weight replaced by the lazy view of its dense values,
    named as the model names the dense weight. Reads nothing (but a model folder's
    `config.json`).

    - FP8 block-scaled: `X.weight` (a float8 dtype, or int8 for symmetric W8A8) with
      `X.weight_scale_inv` (or `X.weight_scale`) becomes `X.weight`, the scale gone.
    - MXFP4: `X_blocks` with `X_scales` becomes `X`.

    Everything else is kept as it is. The views compose with slicing, `astype`,
    `stack`, `transpose` and every verb: a slice reads only its codes and their
    scales, and `save`, `convert` and `device_put` stream them within the budget.

    Args:
        tree: A lazy tree, nested by name parts as `open` gives a safetensors model, or
            flat by name.
        dtype: The dtype of the dense views (bfloat16, as the releases' own
            dequantizers give).
        block_size: The FP8 block size; by default `quantization_config`'s
            `weight_block_size` in the `config.json` beside the model's files, else
            128x128.

    >>> dense = lazyckpt.dequantize(lazyckpt.open(fp8), block_size=(2, 4))
    >>> sorted(dense), dense["w"]
    (['b', 'w'], LazyArray('w', shape=(5, 6), dtype=bfloat16, dequantized from float8_e4m3fn with float32 scales per 2x4 block, chunks=(5, 6)))
    """
    out = _dtype(dtype, "dequantize")
    block = None if block_size is None else _block(block_size, "dequantize")
    return _walk(tree, out, block, {})


Configs = dict[str, tuple[int, ...] | None]


def _walk(tree: Any, dtype: np.dtype[Any], block: tuple[int, ...] | None, configs: Configs) -> Any:
    def split(node: Any) -> list[tuple[Any, Any]] | None:
        # Dicts as opened: in the model's order, which a sort would lose.
        return list(node.items()) if type(node) is dict else children(node)

    def remade(node: Any, path: object, kids: list[tuple[Any, Any]]) -> Any:
        if type(node) is dict:
            return _pairs(dict(kids), dtype, block, configs)
        return rebuild(node, [kid for _, kid in kids])

    return fold_tree(tree, split, lambda path, leaf: leaf, remade)


def _pairs(
    kids: dict[Any, Any], dtype: np.dtype[Any], block: tuple[int, ...] | None, configs: Configs
) -> dict[Any, Any]:
    """A dict's children with each quantized pair replaced by its dense view, in the
    place of its first member."""
    arrays = {k: v for k, v in kids.items() if isinstance(k, str) and isinstance(v, LazyArray)}
    replaced: dict[str, tuple[str, LazyArray]] = {}  # by the key it takes the place of
    gone: set[str] = set()
    for key, array in arrays.items():
        scale_of = next((key[: -len(s)] for s in _FP8_SCALES if key.endswith(s)), None)
        if scale_of is not None and scale_of in arrays and _is_quantized(arrays[scale_of]):
            weight = arrays[scale_of]
            if scale_of + "_zero_point" in arrays:
                raise QuantizationError(
                    f"{weight.key} with {array.key}: a zero point beside them, so the "
                    "weight is quantized asymmetrically, which lazyckpt does not "
                    "dequantize; read the codes and do it with NumPy"
                )
            size = block or _block_size(weight, configs) or DEFAULT_BLOCK
            dense = dequantize_fp8(weight, array, block_size=size, dtype=dtype)
            replaced[scale_of] = (scale_of, dense)
            gone.add(key)
        elif key.endswith(_MX_BLOCKS) and (key[: -len(_MX_BLOCKS)] + _MX_SCALES) in arrays:
            base = key[: -len(_MX_BLOCKS)]
            if base in arrays:
                raise QuantizationError(
                    f"{array.key}: MXFP4 blocks beside a dense {base!r} of the same name; "
                    "rename one of them first (lazyckpt.rename)"
                )
            scales = arrays[base + _MX_SCALES]
            replaced[key] = (base, dequantize_mxfp4(array, scales, dtype=dtype))
            gone.add(base + _MX_SCALES)
        else:
            _check_unpaired(key, array, arrays)
    if not replaced:
        return kids
    result: dict[Any, Any] = {}
    for key, value in kids.items():
        if key in gone:
            continue
        if key in replaced:
            name, dense = replaced[key]
            result[name] = dense
        else:
            result[key] = value
    return result


def _check_unpaired(key: str, array: LazyArray, arrays: dict[str, LazyArray]) -> None:
    """A clear error for half of a quantized pair: MXFP4 blocks or scales alone, or a
    weight's scale (`X.weight_scale_inv`, a float array) without its weight."""
    if key.endswith(_MX_BLOCKS) and _is_mx_blocks(array):
        scales = array.key[: -len(_MX_BLOCKS)] + _MX_SCALES
        raise QuantizationError(
            f"{array.key}: MXFP4 blocks without their scales {scales!r} beside them; open "
            "the whole model folder, or pair them yourself with lazyckpt.dequantize_mxfp4"
        )
    if (
        key.endswith(_MX_SCALES)
        and key[: -len(_MX_SCALES)] + _MX_BLOCKS not in arrays
        and array.dtype in (np.uint8, ml_dtypes.float8_e8m0fnu)
    ):
        blocks = array.key[: -len(_MX_SCALES)] + _MX_BLOCKS
        raise QuantizationError(
            f"{array.key}: MXFP4 scales without their blocks {blocks!r} beside them; open "
            "the whole model folder, or pair them yourself with lazyckpt.dequantize_mxfp4"
        )
    suffix = next((s for s in _FP8_SCALES if key.endswith(s)), None)
    if (
        suffix is not None
        and key[: -len(suffix)].endswith("weight")
        and key[: -len(suffix)] not in arrays
        and issubdtype(array.dtype, np.floating)
    ):
        raise QuantizationError(
            f"{array.key}: a weight's scale without its weight "
            f"{array.key[: -len(suffix)]!r} beside it; open the whole model folder, or "
            "pair them yourself with lazyckpt.dequantize_fp8"
        )


def _is_mx_blocks(array: LazyArray) -> bool:
    width = {np.dtype(np.uint8): quant.CODES // 2, np.dtype(ml_dtypes.float4_e2m1fn): quant.CODES}
    return array.ndim >= 2 and width.get(np.dtype(array.dtype)) == array.shape[-1]


def _is_quantized(array: LazyArray) -> bool:
    """Whether a weight beside a scale holds codes: a float8 dtype (but the E8M0 of
    scales), or int8 (symmetric int8 quantization, W8A8)."""
    name = np.dtype(array.dtype).name
    return bool(name.startswith("float8") and name != "float8_e8m0fnu") or name == "int8"


def _block_size(weight: LazyArray, configs: Configs) -> tuple[int, ...] | None:
    """`weight_block_size` from the `config.json` beside the weight's file, if any
    (each folder's read once per call, in `configs`)."""
    plain = next(sources(weight))  # (a stacked weight: its first part's file)
    location = getattr(plain.stored, "store", None)
    folder = getattr(location, "location", None)
    if not isinstance(folder, str):
        return None
    if folder not in configs:
        configs[folder] = _configured(folder)
    return configs[folder]


def _configured(folder: str) -> tuple[int, ...] | None:
    file = paths.join(folder, "config.json")
    try:
        text = paths.read_text(file, _CONFIG_LIMIT)
    except StorageAccessError:
        return None  # (a bucket opened with credentials now gone): the default, checked by shape
    if text is None:
        return None
    config = json_or_corrupt(file, text, "fix or remove it")
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    size = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if size is None:
        return None
    if not (isinstance(size, list) and size and all(type(n) is int and n > 0 for n in size)):
        raise QuantizationError(
            f"{file}: quantization_config.weight_block_size is {str(size)[:60]}, expected "
            "a list of positive sizes such as [128, 128]; fix it, or pass block_size="
        )
    return tuple(size)


def _mx_path(path: tuple[str | int, ...]) -> tuple[str | int, ...]:
    last = path[-1] if path else ""
    if isinstance(last, str) and last.endswith(_MX_BLOCKS):
        return (*path[:-1], last[: -len(_MX_BLOCKS)])
    return path


def _check_arrays(operation: str, *arrays: object) -> None:
    for a in arrays:
        if not isinstance(a, LazyArray):
            raise QuantizationError(
                f"{operation} takes LazyArrays, found {type(a).__name__}; open the "
                "checkpoint with lazyckpt.open and pass its arrays"
            )
        a._composable(operation)


def _block(block_size: object, where: str) -> tuple[int, ...]:
    """`block_size` as a tuple of positive ints, or a clear error."""
    given: tuple[object, ...] = ()
    if isinstance(block_size, Iterable) and not isinstance(block_size, str):
        given = tuple(block_size)
    if not given or not all(isinstance(b, int | np.integer) and int(b) > 0 for b in given):
        raise QuantizationError(
            f"{where}: block_size={block_size!r}, expected positive sizes of the blocked "
            "(trailing) dimensions, such as (128, 128)"
        )
    return tuple(int(b) for b in given)  # type: ignore[call-overload]


def _dtype(dtype: DTypeLike, where: str) -> np.dtype[Any]:
    out = parsed(dtype)
    if out is None:
        raise QuantizationError(
            f"{where}: dtype={dtype!r} is not a dtype; dequantize to bfloat16, float16 or float32"
        )
    if not issubdtype(out, np.floating):
        raise QuantizationError(
            f"{where}: dtype={out} is not a floating-point dtype; dequantize to bfloat16, "
            "float16 or float32"
        )
    return out
