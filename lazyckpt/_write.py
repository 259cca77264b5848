"""A writer of Orbax PyTree checkpoints (OCDBT + zarr3) for in-memory arrays.

Used by `lazyckpt demo` to make a checkpoint without orbax. It writes what Orbax
writes: `_METADATA`, `_sharding`, `_strings.json`, one zarr3 array per leaf in one
OCDBT database, each shard of a `jax.Array` as its own chunk, replicas once.
The checkpoint is built in a temporary folder and renamed into place when complete.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.sharding import NamedSharding, SingleDeviceSharding

from lazyckpt._errors import LazyckptError
from lazyckpt._tree import keystr, walk

_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def write_checkpoint(path: str | os.PathLike[str], tree: Any) -> str:
    """Write `tree` (dicts and lists of arrays, scalars and strings) to `path`."""
    final = os.path.abspath(os.fspath(path))
    if os.path.exists(final):
        raise LazyckptError(f"{final} already exists; choose a new path or delete it first")
    tmp = final + _TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tree_metadata: dict[str, Any] = {}
    shardings: dict[str, str] = {}
    strings: dict[str, Any] = {}
    kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": tmp + "/"}}
    writes = []
    for key_path, value in walk(tree, empty_containers=True):
        path_str = keystr(key_path)
        name = ".".join(str(k) for k in key_path)
        keys = [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in key_path]
        entry: dict[str, Any] = {"skip_deserialize": False}
        if isinstance(value, str):
            entry["value_type"] = "string"
            strings[name] = value
        elif value is None or (isinstance(value, dict | list | tuple) and not value):
            kinds = {type(None): "None", dict: "Dict", list: "List", tuple: "Tuple"}
            entry = {"value_type": kinds[type(value)], "skip_deserialize": True}
        elif isinstance(value, jax.Array):
            entry["value_type"] = "jax.Array"
            shard_shape = value.sharding.shard_shape(value.shape)
            entry["write_shape"] = list(shard_shape)
            shardings[base64.urlsafe_b64encode(name.encode()).decode()] = _sharding_json(value)
            writes.extend(_write_jax(kvstore, name, value, shard_shape))
        elif isinstance(value, bool | int | float | np.generic):
            entry["value_type"] = "scalar"
            writes.extend(_write_numpy(kvstore, name, np.asarray(value)))
        elif isinstance(value, np.ndarray):
            entry["value_type"] = "np.ndarray"
            writes.extend(_write_numpy(kvstore, name, value))
        else:
            raise LazyckptError(f"{path_str}: cannot save a {type(value).__name__}")
        tree_metadata[str(tuple(str(k) for k in key_path))] = {
            "key_metadata": keys,
            "value_metadata": entry,
        }
    for future in writes:
        future.result()
    _write_json(
        tmp,
        "_METADATA",
        {
            "tree_metadata": tree_metadata,
            "use_ocdbt": True,
            "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        },
    )
    _write_json(tmp, "_sharding", shardings)
    if strings:
        _write_json(tmp, "_strings.json", _nest_strings(strings))
    os.rename(tmp, final)
    return final


def _zarr3(
    kvstore: dict[str, Any],
    name: str,
    array_shape: tuple[int, ...],
    chunks: tuple[int, ...],
    dtype: np.dtype[Any],
) -> ts.TensorStore:
    spec = {
        "driver": "zarr3",
        "kvstore": {**kvstore, "path": f"{name}/"},
        "metadata": {
            "shape": list(array_shape),
            "data_type": ts.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "zstd", "configuration": {"level": 1}},
            ],
        },
        "create": True,
    }
    return ts.open(spec).result()


def _write_jax(
    kvstore: dict[str, Any], name: str, value: jax.Array, shard_shape: tuple[int, ...]
) -> list[ts.WriteFutures]:
    chunks = tuple(max(n, 1) for n in shard_shape) if shard_shape else ()
    store = _zarr3(kvstore, name, value.shape, chunks, np.dtype(value.dtype))
    written = set()
    futures = []
    for shard in value.addressable_shards:
        key = tuple(s.indices(n) for s, n in zip(shard.index, value.shape, strict=True))
        if key in written:
            continue
        written.add(key)
        futures.append(store[shard.index].write(np.asarray(shard.data)))
    return futures


def _write_numpy(kvstore: dict[str, Any], name: str, value: np.ndarray) -> list[ts.WriteFutures]:
    chunks = tuple(max(n, 1) for n in value.shape)
    store = _zarr3(kvstore, name, value.shape, chunks, value.dtype)
    return [store.write(value)]


def _sharding_json(value: jax.Array) -> str:
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        spec = [list(e) if isinstance(e, tuple) else e for e in sharding.spec]
        return json.dumps(
            {
                "sharding_type": "NamedSharding",
                "shape": [int(n) for n in mesh.devices.shape],
                "axis_names": list(mesh.axis_names),
                "partition_spec": spec,
                "device_mesh": {
                    "mesh": np.vectorize(lambda d: {"id": d.id}, otypes=[object])(
                        mesh.devices
                    ).tolist()
                },
            }
        )
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(device)})
    return ""


def _nest_strings(strings: dict[str, str]) -> dict[str, Any]:
    # Orbax stores strings under the JSON pointer "/" + name, so "/" nests (spec §5).
    nested: dict[str, Any] = {}
    for name, value in strings.items():
        *parents, last = name.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def _write_json(directory: str, name: str, data: Any) -> None:
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        json.dump(data, f)
