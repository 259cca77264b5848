"""Zarr v2 and v3 array metadata as Orbax writes it (spec §4.3)."""

from __future__ import annotations

import functools
import json
from typing import Any

import attrs
import numpy as np
import tensorstore as ts

from lazyckpt._errors import CorruptCheckpointError

ZARR2_KEY, ZARR3_KEY = ".zarray", "zarr.json"


@attrs.frozen
class ZarrInfo:
    """What reading an array needs: its driver, shape, dtype and read-chunk shape."""

    driver: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    chunks: tuple[int, ...]


def metadata_key(name: str, zarr3: bool) -> str:
    """The store key of the zarr metadata of the array stored under `name`."""
    suffix = ZARR3_KEY if zarr3 else ZARR2_KEY
    return f"{name}/{suffix}" if name else suffix


def parse_zarr(where: str, key: str, raw: bytes) -> ZarrInfo:
    """Parse the zarr metadata stored at `key` (zarr v3 if `key` ends in zarr.json)."""
    zarr3 = key.endswith(ZARR3_KEY)
    try:
        return _parse(raw, zarr3)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"{where}: zarr metadata {key!r} is malformed ({error}); expected zarr "
            f"{'v3' if zarr3 else 'v2'} array metadata with non-negative shape, a dtype and "
            "one positive chunk size per dimension"
        ) from None


@functools.lru_cache(maxsize=4096)
def _parse(raw: bytes, zarr3: bool) -> ZarrInfo:
    # Cached: arrays of one shape and dtype have byte-identical metadata.
    meta = json.loads(raw)
    shape = tuple(int(n) for n in meta["shape"])
    if zarr3:
        dtype = ts.dtype(meta["data_type"]).numpy_dtype
        chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
        codecs = meta.get("codecs") or []
        if codecs and codecs[0].get("name") == "sharding_indexed":
            # Reads go by the inner chunk of a shard, not the whole shard.
            chunks = codecs[0]["configuration"]["chunk_shape"]
    else:
        name = meta["dtype"]
        dtype = np.dtype(name) if name[:1] in "<>|=" else ts.dtype(name).numpy_dtype
        dtype = dtype.newbyteorder("=") if dtype.byteorder in "<>" else dtype
        chunks = meta["chunks"]
    chunks = tuple(int(n) for n in chunks)
    if any(n < 0 for n in shape) or len(chunks) != len(shape) or any(n <= 0 for n in chunks):
        raise ValueError(f"shape {shape} with chunks {chunks}")
    return ZarrInfo("zarr3" if zarr3 else "zarr", shape, dtype, chunks)
