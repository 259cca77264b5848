"""Saved shardings: how an array was laid out over devices when it was saved, as
plain data that needs none of those devices, and its placement on the caller's.

Reading one needs no jax: jax is imported only to place an array on devices (`on`,
`on_saved_devices`, `spec`), which the caller's mesh or devices have imported already.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import numpy as np

from lazyckpt._errors import LazyTypeError, ShardingError
from lazyckpt._text import ascii_int

if TYPE_CHECKING:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

SpecEntry = None | str | tuple[str, ...]


class _NotAJaxSharding(LazyTypeError, AttributeError):
    """A saved sharding asked for what only a jax Sharding has."""


@attrs.frozen
class SavedSharding:
    """The sharding an array had when it was saved, as the checkpoint records it.

    `kind` is the JAX class name (`NamedSharding`, `SingleDeviceSharding`, ...).
    For a `NamedSharding`, `mesh_shape`, `axis_names` and `partition_spec` describe
    the layout and `device_ids` the saved device order; for a `SingleDeviceSharding`,
    `device` names the saved device. Nothing here needs the saving devices.

    >>> s = SavedSharding("NamedSharding", mesh_shape=(4, 2), axis_names=("x", "y"),
    ...                   partition_spec=("x", None))
    >>> s.spec == jax.sharding.PartitionSpec("x", None)
    True
    >>> s
    NamedSharding(mesh={'x': 4, 'y': 2}, spec=P('x', None))
    """

    kind: str
    mesh_shape: tuple[int, ...] = ()
    axis_names: tuple[str, ...] = ()
    partition_spec: tuple[SpecEntry, ...] = ()
    device_ids: tuple[int, ...] = ()
    device: str | None = None

    def __getattr__(self, name: str) -> NoReturn:
        """What jax asks of an argument's sharding when it lowers a jitted function
        (`jax.jit(f).lower(lazy_tree)`: `_device_assignment`, `_is_concrete`...): a saved
        sharding is not a jax one. Raised as an AttributeError too, so that `hasattr`
        (treescope, `inspect`) says False as for any attribute a SavedSharding lacks."""
        if not name.startswith("_") or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise _NotAJaxSharding(
            f"a LazyArray's sharding is the one it was saved with ({self!r}), not a jax "
            "Sharding on this process's devices, so jax.jit(f).lower cannot take a "
            "LazyArray; give it jax.ShapeDtypeStruct(x.shape, x.dtype, "
            "sharding=x.sharding.on(mesh)) instead (jax.eval_shape takes LazyArrays as they are)"
        )

    @property
    def spec(self) -> PartitionSpec:
        """The saved partition spec as a `jax.sharding.PartitionSpec`."""
        from jax.sharding import PartitionSpec

        return PartitionSpec(*self.partition_spec)

    @property
    def mesh_axes(self) -> dict[str, int]:
        """Saved mesh axis name to size, in mesh order."""
        return dict(zip(self.axis_names, self.mesh_shape, strict=True))

    @property
    def is_replicated(self) -> bool:
        """Whether every device held the whole array."""
        return self.kind == "SingleDeviceSharding" or all(
            entry is None for entry in self.partition_spec
        )

    def on(self, mesh: Mesh) -> NamedSharding:
        """The saved partition spec on the caller's `mesh`, whose axis names must match."""
        missing = [
            name
            for entry in self.partition_spec
            for name in ((entry,) if isinstance(entry, str) else entry or ())
            if name not in mesh.axis_names
        ]
        if missing:
            raise ShardingError(
                f"the saved partition spec {spec_str(self.partition_spec)} uses mesh axes "
                f"{missing} that the given mesh (axes {list(mesh.axis_names)}) lacks; "
                "name the mesh axes as saved, or pass explicit shardings"
            )
        from jax.sharding import NamedSharding

        return NamedSharding(mesh, self.spec)

    def on_saved_devices(self) -> Sharding | None:
        """This sharding on the devices it was saved from, as Orbax restores an array
        whose target names no sharding; None unless this run has all of them."""
        import jax

        by_id = {device.id: device for device in jax.devices()}
        if self.kind == "NamedSharding" and self.device_ids:
            if not all(i in by_id for i in self.device_ids):
                return None
            devices = np.array([by_id[i] for i in self.device_ids]).reshape(self.mesh_shape)
            mesh = jax.sharding.Mesh(devices, self.axis_names)
            return jax.sharding.NamedSharding(mesh, self.spec)
        if self.kind == "SingleDeviceSharding" and self.device:
            number = device_id(self.device)
            device = by_id.get(number) if number is not None else None
            return jax.sharding.SingleDeviceSharding(device) if device is not None else None
        return None

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one device's shard of an array of `shape` under this sharding."""
        if self.kind != "NamedSharding":
            return shape
        sizes = self.mesh_axes
        out = []
        for dim, n in enumerate(shape):
            entry = self.partition_spec[dim] if dim < len(self.partition_spec) else None
            names = (entry,) if isinstance(entry, str) else entry or ()
            ways = math.prod(sizes[name] for name in names)
            out.append(-(-n // ways))
        return tuple(out)

    def to_json(self) -> str:
        """The JSON that records this sharding in a checkpoint's `_sharding` file, as
        Orbax writes it; "" (unknown) for kinds Orbax does not record."""
        if self.kind == "NamedSharding":
            return named_json(
                self.mesh_shape, self.axis_names, self.partition_spec, self.device_ids
            )
        if self.kind == "SingleDeviceSharding":
            return json.dumps({"sharding_type": self.kind, "device_str": self.device})
        return ""

    def __repr__(self) -> str:
        if self.kind == "NamedSharding":
            return f"NamedSharding(mesh={self.mesh_axes}, spec={spec_str(self.partition_spec)})"
        if self.kind == "SingleDeviceSharding":
            return f"SingleDeviceSharding(device={self.device!r})"
        if self.mesh_shape:
            return f"{self.kind}(shape={self.mesh_shape})"
        return f"{self.kind}()"


def saved_from_one_device(arrays: Iterable[object]) -> str | None:
    """The devices (`cpu:0`) of a single-device save: where every array among `arrays`
    whose sharding was recorded (a LazyArray's `sharding`) was saved from one device,
    so that there is no sharding to reuse; else None."""
    devices = set()
    for array in arrays:
        sharding = getattr(array, "sharding", None)
        if isinstance(sharding, SavedSharding):
            if sharding.kind != "SingleDeviceSharding":
                return None
            devices.add(sharding.device or "a device")
    return ", ".join(sorted(devices)) if devices else None


_LAST_NUMBER = re.compile(r"[^0-9]*([0-9]+)")


def device_id(device: str) -> int | None:
    """The id in a saved device name, its trailing number ("cpu:0" since jax 0.10,
    "TFRT_CPU_0" before); None without one of 1 to 18 ASCII digits.

    >>> device_id("cpu:3"), device_id("TFRT_CPU_12"), device_id("cpu:\u0663"), device_id("cpu")
    (3, 12, None, None)
    """
    # Matched on the reversed name from its start: linear, where a search for the last
    # number from each position takes quadratic time over a long run of digits.
    found = _LAST_NUMBER.match(device[::-1])
    return ascii_int(found[1][::-1]) if found else None


def spec_str(spec: tuple[SpecEntry, ...]) -> str:
    """A saved partition spec as JAX prints it: `P('x', None)`."""
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def named_json(
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    spec: tuple[SpecEntry, ...],
    device_ids: tuple[int, ...],
) -> str:
    entry: dict[str, Any] = {
        "sharding_type": "NamedSharding",
        "shape": list(mesh_shape),
        "axis_names": list(axis_names),
        "partition_spec": [list(e) if isinstance(e, tuple) else e for e in spec],
    }
    if device_ids:
        ids = [{"id": i} for i in device_ids]
        for size in reversed(mesh_shape[1:]):
            ids = [ids[i : i + size] for i in range(0, len(ids), size)]  # type: ignore[misc]
        entry["device_mesh"] = {"mesh": ids}
    return json.dumps(entry)
