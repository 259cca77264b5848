"""Saved shardings: what `_sharding` says about an array, usable without its devices."""

from __future__ import annotations

import base64
import functools
import json
import math
from typing import TYPE_CHECKING, Any

from lazyckpt._array.sharding import SavedSharding, SpecEntry, device_id, named_json, spec_str
from lazyckpt._errors import CorruptCheckpointError, json_or_corrupt

if TYPE_CHECKING:
    import jax


def sharding_entry(sharding: jax.sharding.Sharding) -> str:
    """The `_sharding` entry for a live sharding; "" (unknown) for kinds Orbax skips."""
    import jax  # (the sharding's own: opening a checkpoint never comes here)

    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = tuple(
            entry if entry is None or isinstance(entry, str) else tuple(entry)
            for entry in sharding.spec
        )
        ids = tuple(int(d.id) for d in mesh.devices.flat)
        return named_json(tuple(mesh.devices.shape), tuple(mesh.axis_names), spec, ids)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(device)})
    return ""


def _entry(value: object) -> SpecEntry:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value) if len(value) != 1 else value[0]
    raise ValueError(f"partition spec entry {value!r} is not null, a name or a list of names")


def _sizes(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(n) is int and n >= 1 for n in value):
        raise ValueError(f"{what} {value!r} is not a list of positive ints")
    return tuple(value)


@functools.lru_cache(maxsize=1024)
def parse_sharding(text: str) -> SavedSharding | None:
    """Parse one `_sharding` entry (a JSON string); None when it records nothing.

    Every field is checked here, so that a damaged entry fails when the checkpoint is
    opened, never later in a repr or a conversion. Cached: a checkpoint's arrays
    mostly share a handful of distinct entries.
    """
    if not text:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, found {type(data).__name__}")
    kind = data.get("sharding_type")
    if kind == "NamedSharding":
        shape = _sizes(data.get("shape"), "mesh shape")
        names = data.get("axis_names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"axis names {names!r} are not a list of names")
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(f"mesh shape {list(shape)} does not fit axis names {names}")
        spec = data.get("partition_spec", [])
        if not isinstance(spec, list):
            raise ValueError(f"partition spec {spec!r} is not a list")
        entries = tuple(_entry(e) for e in spec)
        used = [n for e in entries for n in ((e,) if isinstance(e, str) else e or ())]
        unknown = sorted(set(used) - set(names))
        if unknown or len(set(used)) != len(used):
            raise ValueError(
                f"partition spec {spec_str(entries)} names axes {unknown or used} that the "
                f"mesh {names} lacks or uses twice"
            )
        mesh = (data.get("device_mesh") or {}).get("mesh")
        ids = tuple(d["id"] for d in _flatten(mesh)) if mesh else ()
        if ids and (
            len(ids) != math.prod(shape)
            or len(set(ids)) != len(ids)
            or not all(type(i) is int and i >= 0 for i in ids)
        ):
            raise ValueError(f"device mesh of {len(ids)} ids does not fit mesh shape {list(shape)}")
        return SavedSharding(
            kind, mesh_shape=shape, axis_names=tuple(names), partition_spec=entries, device_ids=ids
        )
    if kind == "SingleDeviceSharding":
        return SavedSharding(kind, device=_device(data.get("device_str")))
    if not isinstance(kind, str):
        raise ValueError(f"sharding_type {kind!r} is not a string")
    return SavedSharding(kind, mesh_shape=_sizes(data.get("shape", []), "shape"))


def _device(value: object) -> str | None:
    """A saved device name, as JAX names devices: ASCII, its id the trailing number of
    1 to 18 digits (`cpu:0`, `TFRT_CPU_0`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"device {value!r} is not a string")
    if not value.isascii() or (device_id(value) is None and any(c.isdigit() for c in value)):
        raise ValueError(
            f"device {value[:60]!r} is no JAX device name (ASCII, ending in an id of 1 to "
            "18 digits: cpu:0, TFRT_CPU_0)"
        )
    return value


def _flatten(nested: object) -> list[Any]:
    if isinstance(nested, list):
        return [leaf for item in nested for leaf in _flatten(item)]
    return [nested]


def read_shardings(location: str, text: str | None, names: list[str]) -> dict[str, SavedSharding]:
    """Saved shardings by parameter name from the `_sharding` file's text."""
    if not text:
        return {}
    table = json_or_corrupt(
        f"{location}/_sharding",
        text,
        "delete the file to open the checkpoint without saved shardings",
    )
    if not isinstance(table, dict):
        raise CorruptCheckpointError(
            f"{location}/_sharding holds {type(table).__name__}, expected an object of "
            "entries by array name; delete the file to open the checkpoint without saved "
            "shardings"
        )
    found = {}
    for name in names:
        # Keys are base64 of the name since 2023-10; the raw name before that.
        key = base64.urlsafe_b64encode(name.encode()).decode()
        entry = table.get(key, table.get(name))
        if entry is None:
            continue
        try:
            sharding = parse_sharding(entry)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            raise CorruptCheckpointError(
                f"{location}/_sharding: the entry for {name!r} is malformed ({error!r}); "
                "delete the file to open the checkpoint without saved shardings"
            ) from error
        if sharding is not None:
            found[name] = sharding
    return found
