"""Quantized weights as computed views: values worked out from the stored codes and
their scales as a read asks for them, box by box.

- `BlockScaled`: each element times the scale of its block, as FP8 releases store
  them (DeepSeek-V3's `weight` in float8_e4m3fn with `weight_scale_inv`, one float32
  scale per 128x128 block, edge blocks cut short).
- `MXFP4`: OCP microscaling FP4, as gpt-oss stores it: `_blocks` `[..., G, 16]`
  bytes of two E2M1 codes each (low nibble first), `_scales` `[..., G]` E8M0
  exponents (`2**(s - 127)`, 255 is NaN), read as `[..., G * 32]`.
- `PackedFP4`: safetensors' `F4` tensors, two E2M1 codes per byte (low nibble
  first), read one code per element as `float4_e2m1fn`.

A box of the view needs only the codes of its elements and the scales of the blocks
they fall in (`inputs`): a row slice of a block-scaled weight reads its rows and one
row of scales per block of rows. Values are worked out in float32 (an FP8 value times
its float32 scale, rounded once to float32, as the releases' own dequantizers do; an
E2M1 code times a power of two, exactly), in pieces of at most `PIECE` elements, then
cast to the view's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from lazyckpt._array.compose import Computed, Part, view_chunks
from lazyckpt._array.geometry import Box

PIECE = 1 << 18
"""The most elements worked out at once (float32 temporaries of 1 MiB each)."""

CODES = 32
"""FP4 codes per MXFP4 block: 16 bytes, two codes each."""

# E2M1 values by code (sign, two exponent bits, one mantissa bit), and the two values
# of each byte of packed codes, low nibble first.
_E2M1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
_E2M1_PAIRS = np.stack([_E2M1[np.arange(256) & 0x0F], _E2M1[np.arange(256) >> 4]], axis=1)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen(eq=False)
class BlockScaled(Computed):
    """`values * scales`, each scale covering a block of `block` elements: element
    `i` (an index per dimension) has scale `scales[i // block]`."""

    values: Part
    scales: Part
    block: tuple[int, ...]

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.values, self.scales)

    @property
    def chunks(self) -> tuple[int, ...]:
        # Whole blocks, so that a cell's scales are not read by its neighbours too;
        # along a dimension with one scale, the codes' own chunks.
        inner = view_chunks(self.values)
        return tuple(
            c if s == 1 else max(1, min(n, math.lcm(c, b)))
            for c, b, n, s in zip(inner, self.block, self.shape, self.scales.shape, strict=True)
        )

    def inputs(self, box: Box) -> tuple[Box, ...]:
        scales = tuple(
            (low // b, _ceil(high, b)) for (low, high), b in zip(box, self.block, strict=True)
        )
        return box, scales

    def compute(self, box: Box, values: Sequence[np.ndarray], out: np.ndarray) -> None:
        codes, scales = values
        scales = scales.astype(np.float32, copy=False)
        for index in pieces(codes.shape, PIECE):
            product = _as_float32(codes[index])
            product *= self._spread(scales, box, index)
            _store(product, self.dtype, out, index)

    def _spread(self, scales: np.ndarray, box: Box, index: tuple[slice, ...]) -> np.ndarray:
        """The scales of the elements of `index` (a piece of `box`), each repeated over
        the elements of its block; of size 1 along a dimension where the piece lies in
        one block (broadcast against the piece)."""
        spread = scales
        for d, ((low, _), b, at) in enumerate(zip(box, self.block, index, strict=True)):
            first, last = low + at.start, low + at.stop  # the piece along d, in the node
            start, stop = first // b - low // b, _ceil(last, b) - low // b
            spread = spread[(slice(None),) * d + (slice(start, stop),)]
            if stop - start > 1:
                skip = first - first // b * b
                spread = np.repeat(spread, b, axis=d)[
                    (slice(None),) * d + (slice(skip, skip + last - first),)
                ]
        return spread

    def describe(self) -> str:
        return (
            f"dequantized from {self.values.dtype} with {self.scales.dtype} scales "
            f"per {'x'.join(map(str, self.block))} block"
        )


@attrs.frozen(eq=False)
class MXFP4(Computed):
    """OCP MXFP4: blocks of 32 E2M1 codes sharing one E8M0 scale, the last dimension
    of the view running through the blocks in order. `blocks` holds the codes as
    bytes `[..., G, 16]` (two per byte, low nibble first) or as `float4_e2m1fn`
    `[..., G, 32]`; `scales` is `[..., G]`, as bytes or `float8_e8m0fnu`."""

    blocks: Part
    scales: Part

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.blocks, self.scales)

    @property
    def packed(self) -> bool:
        """Whether `blocks` holds two codes per byte."""
        return self.blocks.dtype == np.uint8

    @property
    def chunks(self) -> tuple[int, ...]:
        inner = view_chunks(self.blocks)
        whole = inner[-1] == self.blocks.shape[-1]
        return (*inner[:-2], CODES * inner[-2] if whole else CODES)

    def inputs(self, box: Box) -> tuple[Box, ...]:
        *prefix, (low, high) = box
        groups = (low // CODES, _ceil(high, CODES))
        return (*prefix, groups, (0, self.blocks.shape[-1])), (*prefix, groups)

    def compute(self, box: Box, values: Sequence[np.ndarray], out: np.ndarray) -> None:
        blocks, scales = values
        low = box[-1][0]
        skip = low - low // CODES * CODES  # codes of the first block before the box
        width = out.shape[-1]
        for index in pieces(scales.shape, PIECE // CODES):
            codes = blocks[index]
            decoded = (
                np.take(_E2M1_PAIRS, codes, axis=0) if self.packed else _as_float32(codes)
            ).reshape(*codes.shape[:-1], CODES)
            decoded *= _exponents(scales[index])[..., None]
            flat = decoded.reshape(*decoded.shape[:-2], -1)
            first = index[-1].start * CODES - skip
            start, stop = max(first, 0), min(first + flat.shape[-1], width)
            if start < stop:
                cut = flat[..., start - first : stop - first]
                _store(cut, self.dtype, out, (*index[:-1], slice(start, stop)))

    def describe(self) -> str:
        return f"dequantized from MXFP4 ({self.blocks.dtype} blocks, {self.scales.dtype} scales)"


@attrs.frozen(eq=False)
class PackedFP4(Computed):
    """An `F4` tensor of safetensors: `packed` bytes `[..., n // 2]`, two E2M1 codes
    each, low nibble first, read as `float4_e2m1fn` `[..., n]`."""

    packed: Part

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.packed,)

    @property
    def chunks(self) -> tuple[int, ...]:
        inner = view_chunks(self.packed)
        return (*inner[:-1], 2 * inner[-1])

    def inputs(self, box: Box) -> tuple[Box, ...]:
        *prefix, (low, high) = box
        return ((*prefix, (low // 2, _ceil(high, 2))),)

    def compute(self, box: Box, values: Sequence[np.ndarray], out: np.ndarray) -> None:
        low, high = box[-1]
        start = low % 2
        codes = _unpacked(values[0])[..., start : start + high - low]
        out[...] = codes.view(ml_dtypes.float4_e2m1fn)

    def describe(self) -> str:
        return "FP4 codes unpacked, two per byte"


def _as_float32(codes: np.ndarray) -> np.ndarray[Any, np.dtype[np.float32]]:
    """`codes` as a new float32 array: through a table of the 256 values where they
    are one byte each (twice as fast as NumPy's cast of the float8 types)."""
    if codes.dtype.itemsize == 1 and codes.dtype != np.bool_:
        table = np.arange(256, dtype=np.uint8).view(codes.dtype).astype(np.float32)
        return np.take(table, codes.view(np.uint8))
    return codes.astype(np.float32)


def _store(values: np.ndarray, dtype: np.dtype[Any], out: np.ndarray, index: Any) -> None:
    """`out[index] = values` rounded to `dtype` (the view's), then to `out`'s dtype."""
    if out.dtype != dtype:
        values = values.astype(dtype)
    np.copyto(out[index], values, casting="unsafe")


def _unpacked(packed: np.ndarray) -> np.ndarray:
    """Bytes `[..., k]` as their 4-bit codes `[..., 2k]`, low nibble first."""
    codes = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    np.bitwise_and(packed, 0x0F, out=codes[..., 0::2])
    np.right_shift(packed, 4, out=codes[..., 1::2])
    return codes


def _exponents(scales: np.ndarray) -> np.ndarray[Any, np.dtype[np.float32]]:
    """E8M0 scales (bytes or `float8_e8m0fnu`) as float32 powers of two; 255 is NaN."""
    as_e8m0 = scales.view(ml_dtypes.float8_e8m0fnu) if scales.dtype == np.uint8 else scales
    return as_e8m0.astype(np.float32)


def pieces(shape: Sequence[int], limit: int) -> Iterator[tuple[slice, ...]]:
    """Indices that cut an array of `shape` into boxes of at most `limit` elements
    (or one element more than a row where a row is larger), along its leading
    dimensions."""
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    if inner <= limit or len(shape) == 1:
        step = max(1, limit // max(inner, 1))
        for i in range(0, shape[0], step):
            yield (slice(i, min(i + step, shape[0])), *(slice(0, n) for n in shape[1:]))
        return
    for i in range(shape[0]):
        for rest in pieces(shape[1:], limit):
            yield (slice(i, i + 1), *rest)
