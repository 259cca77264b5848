"""Zarr v2 and v3 array metadata as Orbax writes it (format notes, Arrays), and its chunk codecs.

`parse_zarr` gives what reading needs: shape, dtype, the read-chunk shape, and, when
lazyckpt decodes the chunks itself (`lazyckpt._engine.decode`), their `Codec`: zstd or no
compression, C, F or transposed order, either byte order, and zarr3's
`sharding_indexed` shards with their index. Other codecs (blosc, gzip, a crc32c over
chunk data, filters) have no `Codec`, and tensorstore reads those arrays.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import attrs
import numpy as np

from lazyckpt._engine.stored import ChunkKeys, Codec, in_array
from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._text import shown

ZARR2_KEY, ZARR3_KEY = ".zarray", "zarr.json"


@attrs.frozen
class ZarrInfo:
    """What reading an array needs: its driver, shape, dtype and read-chunk shape, and
    the codec of its chunks when lazyckpt decodes them itself."""

    driver: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    chunks: tuple[int, ...]
    codec: Codec | None = None
    checksummed: bool = False
    """Whether each chunk's data carries a checksum that reading verifies (zstd's
    content checksum, crc32c, gzip's or zlib's): damage to it is then an error, not
    wrong values."""
    keys: ChunkKeys | None = None
    """Where its chunks are stored, when lazyckpt knows the key encoding."""


def metadata_key(name: str, zarr3: bool) -> str:
    """The store key of the zarr metadata of the array stored under `name`."""
    suffix = ZARR3_KEY if zarr3 else ZARR2_KEY
    return in_array(name, suffix)


MAX_RANK = 32  # tensorstore's
_MAX_BYTES = 1 << 62  # what an index can count (tensorstore's limit on a dimension)


class _Unreadable(Exception):
    """A well-formed array of a type lazyckpt does not read."""


def parse_zarr(where: str, key: str, raw: bytes) -> ZarrInfo:
    """Parse the zarr metadata stored at `key` (zarr v3 if `key` ends in zarr.json).

    Shapes and chunks are checked against what can exist (rank, sizes that fit an
    index), and dtypes against what can be read, before anything is read."""
    zarr3 = key.endswith(ZARR3_KEY)
    try:
        return _parse(raw, zarr3)
    except _Unreadable as error:
        raise UnsupportedCheckpointError(
            f"{where}: zarr metadata {key!r} declares {error}, which lazyckpt does not read "
            "(numbers, bools, bfloat16, float8 and int4 it does); the array cannot be read"
        ) from None
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        RecursionError,
        ArithmeticError,
    ) as error:
        raise CorruptCheckpointError(
            f"{where}: zarr metadata {key!r} is malformed ({error}); expected zarr "
            f"{'v3' if zarr3 else 'v2'} array metadata with non-negative shape, a dtype and "
            "one positive chunk size per dimension"
        ) from None


def _ints(values: object, what: str) -> tuple[int, ...]:
    """A list of JSON integers, as tensorstore takes them (`8` or `8.0`): int() would
    also take `"8"`, `"\u0668"`, `true` and `8.5`, which tensorstore refuses."""
    if not isinstance(values, list) or not all(
        (type(n) is int) or (type(n) is float and n.is_integer()) for n in values
    ):
        raise ValueError(f"{what} {shown(values)} is not a list of integers")
    return tuple(int(n) for n in values)


@functools.lru_cache(maxsize=4096)
def _parse(raw: bytes, zarr3: bool) -> ZarrInfo:
    # Cached: arrays of one shape and dtype have byte-identical metadata.
    meta = json.loads(raw)
    shape = _ints(meta["shape"], "shape")
    codec: Codec | None
    if zarr3:
        dtype = ts.dtype(meta["data_type"]).numpy_dtype
        chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
        codecs = meta.get("codecs") or []
        if codecs and codecs[0].get("name") == "sharding_indexed":
            # Reads go by the inner chunk of a shard, not the whole shard.
            chunks = codecs[0]["configuration"]["chunk_shape"]
        keys = chunk_keys(meta, zarr3)
        codec = _zarr3_codec(meta, len(shape), dtype, keys)
    else:
        name = meta["dtype"]
        stored = np.dtype(name) if name[:1] in "<>|=" else ts.dtype(name).numpy_dtype
        dtype = stored.newbyteorder("=") if stored.byteorder in "<>" else stored
        chunks = meta["chunks"]
        keys = chunk_keys(meta, zarr3)
        codec = _zarr2_codec(meta, len(shape), stored, keys)
    chunks = _ints(chunks, "chunks")
    if any(n < 0 for n in shape) or len(chunks) != len(shape) or any(n <= 0 for n in chunks):
        raise ValueError(f"shape {shape} with chunks {chunks}")
    if not readable(dtype):
        raise _Unreadable(f"dtype {dtype.str!r}")
    if len(shape) > MAX_RANK or any(
        math.prod(sizes) * dtype.itemsize >= _MAX_BYTES for sizes in (shape, chunks)
    ):
        raise ValueError(f"shape {shape} with chunks {chunks}, larger than any array can be")
    if (
        keys is not None
        and keys.shard is not None
        and (
            len(keys.shard) != len(chunks)
            or any(s % c for s, c in zip(keys.shard, chunks, strict=True))
        )
    ):
        raise ValueError(f"shard shape {keys.shard} is not a multiple of chunks {chunks}")
    checksummed = _checksummed(meta, zarr3)
    driver = "zarr3" if zarr3 else "zarr"
    return ZarrInfo(driver, shape, dtype, chunks, codec, checksummed, keys)


_CHECKED = ("crc32c", "gzip", "zlib")  # codecs whose decoding verifies a checksum


def _checksummed(meta: dict[str, Any], zarr3: bool) -> bool:
    """Whether the chunk data's codecs carry a checksum (a shard's index crc32c covers
    only the index, not the data)."""
    if not zarr3:
        compressor = meta.get("compressor") or {}
        name = compressor.get("id")
        return bool(name in _CHECKED or (name == "zstd" and compressor.get("checksum")))
    codecs = list(meta.get("codecs") or [])
    if codecs and codecs[0].get("name") == "sharding_indexed":
        codecs = list(codecs[0]["configuration"].get("codecs") or [])
    for codec in codecs:
        name = codec.get("name")
        if name in _CHECKED:
            return True
        if name == "zstd" and (codec.get("configuration") or {}).get("checksum"):
            return True
    return False


def readable(dtype: np.dtype[Any]) -> bool:
    """Numbers and bools, and ml_dtypes' types (bfloat16, float8, int4); not bytes,
    strings, dates, objects or records."""
    if dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        return False
    return dtype.kind in "biufc" or (dtype.kind == "V" and dtype.type is not np.void)


def _byteorder(dtype: np.dtype[Any]) -> str:
    if dtype.itemsize == 1 or dtype.byteorder == "|":
        return "|"
    if dtype.byteorder == "=":
        return "<" if np.little_endian else ">"
    return dtype.byteorder


def _plain(dtype: np.dtype[Any]) -> bool:
    """A dtype stored as its bytes, one element after another: numbers, bools, and the
    bfloat16 and float8 types of ml_dtypes (not the packed int4 and int2 types)."""
    if dtype.kind in "biufc":
        return True
    return dtype.fields is None and dtype.itemsize in (1, 2) and "float" in dtype.name


def chunk_keys(meta: dict[str, Any], zarr3: bool) -> ChunkKeys | None:
    """How the array's chunk keys are formed; None for encodings lazyckpt does not know
    (tensorstore still reads those)."""
    if not zarr3:
        separator = meta.get("dimension_separator") or "."
        if separator not in (".", "/"):
            raise ValueError(f"dimension_separator {separator!r} is neither '.' nor '/'")
        return ChunkKeys(separator)
    encoding = meta.get("chunk_key_encoding") or {"name": "default"}
    name = encoding.get("name", "default")
    if name not in ("default", "v2"):
        return None
    separator = (encoding.get("configuration") or {}).get(
        "separator", "/" if name == "default" else "."
    )
    if separator not in (".", "/"):
        raise ValueError(f"chunk key separator {separator!r} is neither '.' nor '/'")
    shard: tuple[int, ...] | None = None
    codecs = meta.get("codecs") or []
    if codecs and codecs[0].get("name") == "sharding_indexed":
        shard = _ints(meta["chunk_grid"]["configuration"]["chunk_shape"], "shard shape")
    return ChunkKeys(separator, "c/" if name == "default" else "", shard)


def _zarr2_codec(
    meta: dict[str, Any], ndim: int, dtype: np.dtype[Any], keys: ChunkKeys | None
) -> Codec | None:
    compressor = meta.get("compressor")
    if keys is None or meta.get("filters") or not _plain(dtype):
        return None
    if compressor is not None and compressor.get("id") != "zstd":
        return None
    order = tuple(range(ndim)) if meta.get("order", "C") == "C" else tuple(reversed(range(ndim)))
    fill = meta.get("fill_value")
    return Codec(
        zstd=compressor is not None,
        byteorder=_byteorder(dtype),
        order=order,
        keys=keys,
        fill=_fill(fill, dtype),
    )


def _zarr3_codec(
    meta: dict[str, Any], ndim: int, dtype: np.dtype[Any], keys: ChunkKeys | None
) -> Codec | None:
    codecs = list(meta.get("codecs") or [])
    if keys is None or not _plain(dtype):
        return None
    index: dict[str, Any] = {}
    if keys.shard is not None:
        config = codecs[0]["configuration"]
        index_codecs = [c.get("name") for c in config.get("index_codecs") or []]
        if index_codecs not in (["bytes"], ["bytes", "crc32c"]) or len(codecs) > 1:
            return None
        index_bytes = (config["index_codecs"][0].get("configuration") or {}).get("endian")
        index = {
            "index_at_end": config.get("index_location", "end") == "end",
            "index_byteorder": "<" if index_bytes in (None, "little") else ">",
            "index_checksum": index_codecs[-1] == "crc32c",
        }
        codecs = list(config.get("codecs") or [])
    order = tuple(range(ndim))
    if codecs and codecs[0].get("name") == "transpose":
        order = _ints(codecs.pop(0)["configuration"]["order"], "transpose order")
        if sorted(order) != list(range(ndim)):
            return None
    if not codecs or codecs[0].get("name") != "bytes":
        return None
    endian = (codecs.pop(0).get("configuration") or {}).get("endian", "little")
    names = [c.get("name") for c in codecs]
    if names not in ([], ["zstd"]):
        return None  # crc32c over the data, gzip, blosc...: tensorstore reads those
    byteorder = "|" if dtype.itemsize == 1 else ("<" if endian == "little" else ">")
    return Codec(
        zstd=names == ["zstd"],
        byteorder=byteorder,
        order=order,
        keys=keys,
        fill=_fill(meta.get("fill_value"), dtype),
        **index,
    )


def zarr3_spec(
    kvstore: dict[str, Any],
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    chunks: tuple[int, ...],
) -> dict[str, Any]:
    """A tensorstore spec creating the zarr3 array `name` as Orbax writes it, its
    chunks zstd-compressed with their content checksum."""
    codecs = [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "zstd", "configuration": {"level": 1, "checksum": True}},
    ]
    return {
        "driver": "zarr3",
        "kvstore": {**kvstore, "path": in_array(name, "")},
        "metadata": {
            "shape": list(shape),
            "data_type": ts.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default"},
            # As Orbax writes it: a shard holding exactly one chunk, with a checksummed index.
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(chunks),
                        "codecs": codecs,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                        "index_location": "end",
                    },
                }
            ],
        },
        "create": True,
        # Write every chunk, even all-zero ones: readers then treat a missing chunk
        # as damage (store_array_data_equal_to_fill_value in _METADATA).
        "store_data_equal_to_fill_value": True,
    }


def _fill(value: object, dtype: np.dtype[Any]) -> object:
    """The fill value as a scalar of `dtype`; null (zarr v2's default) is zero."""
    if value is None:
        return np.zeros((), dtype)[()]
    if isinstance(value, str):  # "NaN", "Infinity", "-Infinity", or zarr3's "0x..." bits
        special = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}
        if value in special:
            return np.array(special[value]).astype(dtype)[()]
        bits = np.array(int(value, 16), np.dtype(f"u{dtype.itemsize}"))
        return bits.view(dtype.newbyteorder("="))[()]
    if isinstance(value, list):  # complex
        return np.array(complex(value[0], value[1])).astype(dtype)[()]
    return np.array(value).astype(dtype)[()]
