"""Where the caller puts arrays: a saved partition spec on a new mesh, and the
shardings, devices and partition specs a target may name.

Placing takes jax, which the caller's mesh, shardings or devices have imported: this
module imports it only when it makes a sharding, so that reading to host never does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias, TypeGuard

from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import ShardingError, SingleDeviceWarning, warn
from lazyckpt._lazy import LazyArray

if TYPE_CHECKING:
    import jax
    from jax.sharding import AbstractMesh, Mesh, PartitionSpec, Sharding


def saved_shardings(
    mesh: Mesh, *, fallback: PartitionSpec | None = None
) -> Callable[[str, LazyArray], jax.sharding.Sharding]:
    """Shardings that reuse each array's saved partition spec on the caller's `mesh`.

    Pass the result to `lazyckpt.device_put`. Arrays saved without a `NamedSharding`
    (numpy arrays, single-device arrays) get `fallback`, replicated by default. A
    checkpoint saved from one device has no sharding to reuse: without `fallback`,
    the first array saved from one device raises a `SingleDeviceWarning` (pass your
    own shardings to shard such arrays; scalars, and meshes of one device, are
    replicated without a word).

    >>> mesh = jax.make_mesh((8,), ("x",))     # no "y" axis: P('x', 'y') cannot apply
    >>> tree = lazyckpt.open(path)
    >>> lazyckpt.device_put(tree["params"], lazyckpt.saved_shardings(mesh))
    Traceback (most recent call last):
    ...
    lazyckpt.ShardingError: params/w: the saved partition spec P('x', 'y') uses mesh axes ['y'] that the given mesh (axes ['x']) lacks; name the mesh axes as saved, or pass explicit shardings
    """
    from jax.sharding import NamedSharding, PartitionSpec

    default = NamedSharding(mesh, fallback if fallback is not None else PartitionSpec())
    warned = fallback is not None  # the caller chose what such arrays get

    def choose(path: str, array: LazyArray) -> jax.sharding.Sharding:
        nonlocal warned
        saved = array.sharding
        # (A scalar, an optimizer's step count, is replicated whatever it was saved
        # from; so is everything on a mesh of one device.)
        single = saved is not None and saved.kind == "SingleDeviceSharding"
        if saved is not None and single and not warned and array.ndim and mesh.size > 1:
            warned = True
            warn(
                f"{_location(array)}{path} was saved from one device ({saved.device}), so "
                "it has no sharding to reuse: saved_shardings(mesh) replicates it, and any "
                f"other array saved so, on all {mesh.size} devices of the mesh; to shard "
                "them, pass your own shardings (a NamedSharding or PartitionSpec per array, "
                "or saved_shardings(mesh, fallback=PartitionSpec(...)))",
                SingleDeviceWarning,
            )
        if saved is None or saved.kind != "NamedSharding":
            return default
        try:
            return saved.on(mesh)
        except ShardingError as error:
            raise ShardingError(f"{path}: {error}") from None

    return choose


def _location(array: LazyArray) -> str:
    """The checkpoint `array` was opened from, as a prefix to its key path."""
    stored = array.sources[0].stored
    return f"{stored.store.location}: " if isinstance(stored, StoredArray) else ""


PlacementSpec: TypeAlias = "Sharding | jax.Device | PartitionSpec"
"""What a caller may name as an array's place: a Sharding, one Device, or a
PartitionSpec on the current (or given) mesh."""


def is_placement_spec(value: object) -> TypeGuard[PlacementSpec]:
    """Whether `value` is a `PlacementSpec`: a jax object, which cannot exist before jax is
    imported."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(
        value, jax.sharding.Sharding | jax.Device | jax.sharding.PartitionSpec
    )


def resolve(where: str, wanted: PlacementSpec | None, mesh: Mesh | None) -> Sharding:
    """The concrete sharding that `wanted` names for the array at `where`.

    A Device means that device alone; a PartitionSpec, or a NamedSharding on an
    `AbstractMesh` (what `jax.eval_shape` and `nnx.eval_shape` give under
    `jax.set_mesh`), is laid out on `mesh`, else on the mesh set by `jax.set_mesh`;
    None means the default device, as `jax.device_put(x)` does.
    """
    import jax
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    if wanted is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(wanted, jax.Device):
        return jax.sharding.SingleDeviceSharding(wanted)
    if isinstance(wanted, PartitionSpec):
        return _named(where, _concrete_mesh(where, mesh, None), wanted, None)
    if isinstance(wanted, NamedSharding) and isinstance(wanted.mesh, AbstractMesh):
        concrete = _concrete_mesh(where, mesh, wanted.mesh)
        return _named(where, concrete, wanted.spec, wanted.memory_kind)
    return wanted


def _named(where: str, mesh: Mesh, spec: PartitionSpec, memory_kind: str | None) -> Sharding:
    """`spec` on `mesh`; a spec that names an axis the mesh lacks (or one twice) is a
    ShardingError that says which."""
    from jax.sharding import NamedSharding

    try:
        return NamedSharding(mesh, spec, memory_kind=memory_kind)
    except Exception as error:  # noqa: BLE001 - ValueError, or jax's DuplicateSpecError
        raise ShardingError(
            f"{where or 'the target'}: {spec} does not fit the mesh, whose axes are "
            f"{dict(mesh.shape)} ({error}); name only those axes, each once, or pass "
            "mesh= with the axes the spec names"
        ) from None


def _concrete_mesh(where: str, mesh: Mesh | None, abstract: AbstractMesh | None) -> Mesh:
    """`mesh`, or the mesh of `jax.set_mesh`; it must have the abstract mesh's axes."""
    import jax
    from jax.sharding import Mesh

    found = mesh if mesh is not None else jax.sharding.get_mesh()
    what = (
        f"a NamedSharding on an AbstractMesh {dict(abstract.shape)}"
        if abstract is not None
        else "a PartitionSpec"
    )
    if not isinstance(found, Mesh) or found.empty:
        raise ShardingError(
            f"{where or 'the target'}: {what} names no devices; pass mesh=jax.make_mesh(...) "
            "or call inside `with jax.set_mesh(mesh):`"
        )
    if abstract is not None and dict(found.shape) != dict(abstract.shape):
        raise ShardingError(
            f"{where or 'the target'}: {what} needs a mesh with those axes, but the mesh "
            f"given is {dict(found.shape)}; pass mesh= with the same axis names and sizes"
        )
    return found
