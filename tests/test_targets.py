"""Restoring onto the caller's own target: Flax NNX and Linen states, optax states,
equinox Modules and flax structs, as Orbax restores them, without a full-size target.

The checkpoints are written by real training code (Flax NNX with `nnx.Optimizer`,
Linen with `TrainState`) and Orbax's CheckpointManager; the references are Orbax's
own `StandardRestore` of the same abstract target.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyArray, ShardingError, TreeMismatchError
from tests.helpers import data_reads, orbax_save, refuse_data_reads, stored_chunk_bytes

WIDTH, LAYERS = 8, 12


def _auto_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


class Block(nnx.Module):
    def __init__(self, rngs: Any) -> None:
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.lin = nnx.Linear(WIDTH, WIDTH, kernel_init=kernel, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.drop(nnx.gelu(self.lin(self.norm(x))))


class Model(nnx.Module):
    """12 blocks in an nnx.List, each with Dropout (typed PRNG keys in the state)."""

    def __init__(self, rngs: Any) -> None:
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


class Stacked(nnx.Module):
    """The same blocks stacked with nnx.vmap and applied with nnx.scan."""

    def __init__(self, rngs: Any) -> None:
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(rngs: Any) -> Block:
            return Block(rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        out: jax.Array = step(x, self.layers)
        return out


def _train(model: Any, steps: int = 2) -> Any:
    """A few adamw steps with dropout on, so that nothing is at its initial value."""
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model: Any, optimizer: Any, x: jax.Array) -> None:
        grads = nnx.grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
        optimizer.update(model, grads)

    data = jax.random.normal(jax.random.key(7), (4, WIDTH))
    for _ in range(steps):
        step(model, optimizer, data)
    return optimizer


def _manager_save(root: Path, step: int, **items: Any) -> Path:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(root) as manager:
        args = {name: ocp.args.StandardSave(value) for name, value in items.items()}
        manager.save(step, args=ocp.args.Composite(**args))
    return root


def _orbax_restore(root: Path, step: int, item: str, target: Any) -> Any:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(root) as manager:
        args = ocp.args.Composite(**{item: ocp.args.StandardRestore(target)})
        return manager.restore(step, args=args)[item]


def _assert_same_leaves(actual: Any, expected: Any, *, shardings: bool = True) -> None:
    """Same structure, and leaf by leaf the same dtype, values and sharding."""
    # jaxlib ships no stub for PyTreeDef, so mypy cannot see its __eq__.
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)  # type: ignore[operator]
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(actual),
        jax.tree_util.tree_leaves(expected),
        strict=True,
    ):
        where = jax.tree_util.keystr(path)
        assert got.dtype == want.dtype and got.shape == want.shape, where
        if shardings:
            assert got.sharding == want.sharding, where
        if jnp.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=where)


@pytest.fixture(scope="module")
def nnx_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A trained NNX model and its optimizer, saved by a CheckpointManager (Composite
    of `state` and `optimizer`) from a 2x4 mesh."""
    mesh = _auto_mesh((2, 4))
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0, dropout=1))
        optimizer = _train(model)
    root = _manager_save(
        tmp_path_factory.mktemp("nnx") / "run",
        2,
        state=nnx.state(model),
        optimizer=nnx.state(optimizer),
    )
    return {"root": root, "model": model, "optimizer": optimizer, "mesh": mesh}


def test_nnx_state_restores_onto_its_abstract_state_as_orbax_does(
    nnx_run: dict[str, Any],
) -> None:
    root, mesh = nnx_run["root"], nnx_run["mesh"]
    graphdef, abstract = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0, dropout=1)), mesh)
    restored = lazyckpt.device_put(lazyckpt.open(root), abstract)
    assert type(restored) is type(abstract)
    _assert_same_leaves(restored, _orbax_restore(root, 2, "state", abstract))
    for got, want in zip(
        jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(abstract), strict=True
    ):
        assert got.sharding == want.sharding  # the target's, not the saved ones
    # The model itself: layer i gets layer i's weights (not '10' before '2'), and the
    # dropout keys and counts come back too, so even training-mode outputs agree.
    merged = nnx.merge(graphdef, restored)
    trained = nnx.clone(nnx_run["model"])
    x = jax.random.normal(jax.random.key(3), (4, WIDTH))
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(np.asarray(merged(x)), np.asarray(trained(x)))
        merged.eval()
        trained.eval()
        np.testing.assert_array_equal(np.asarray(merged(x)), np.asarray(trained(x)))


def test_nnx_optimizer_state_and_params_only(
    nnx_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, mesh = nnx_run["root"], nnx_run["mesh"]

    def fresh() -> Any:
        return nnx.Optimizer(Model(nnx.Rngs(0, dropout=1)), optax.adamw(1e-2), wrt=nnx.Param)

    _, abstract_opt = nnx.get_abstract_model(fresh, mesh)
    restored = lazyckpt.device_put(lazyckpt.open(root, item="optimizer"), abstract_opt)
    _assert_same_leaves(restored, _orbax_restore(root, 2, "optimizer", abstract_opt))
    _assert_same_leaves(restored, nnx.state(nnx_run["optimizer"]), shardings=False)

    # Params only, onto another mesh: the dropout state is never read.
    other = _auto_mesh((4, 2))
    _, abstract = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0, dropout=1)), other)
    params = nnx.filter_state(abstract, nnx.Param)
    lazy = lazyckpt.open(root)
    opened = data_reads(monkeypatch)
    placed = lazyckpt.device_put(lazy, params, partial=True)
    assert sorted(set(opened)) == sorted(k for k, _ in lazyckpt.leaves(lazy) if "/drop/" not in k)
    assert type(placed) is type(params)
    kernel = placed["blocks"][3]["lin"]["kernel"][...]
    assert kernel.sharding == NamedSharding(other, P(None, "model"))
    want = nnx_run["model"].blocks[3].lin.kernel[...]
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(want))


def test_nnx_restore_to_one_device_and_to_host(nnx_run: dict[str, Any]) -> None:
    root, mesh = nnx_run["root"], nnx_run["mesh"]
    _, abstract = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0, dropout=1)), mesh)
    device = jax.devices()[5]
    one = lazyckpt.device_put(lazyckpt.open(root), jax.tree.map(lambda _: device, abstract))
    assert type(one) is type(abstract)
    assert {d for leaf in jax.tree_util.tree_leaves(one) for d in leaf.devices()} == {device}
    on_host = lazyckpt.load(lazyckpt.open(root), like=abstract)
    assert jax.tree_util.tree_structure(on_host) == jax.tree_util.tree_structure(abstract)  # type: ignore[operator]
    kernel = on_host["blocks"][11]["lin"]["kernel"].get_value()
    assert isinstance(kernel, np.ndarray)
    np.testing.assert_array_equal(kernel, np.asarray(nnx_run["model"].blocks[11].lin.kernel[...]))
    _assert_same_leaves(one, nnx.state(nnx_run["model"]), shardings=False)


def test_a_restored_nnx_state_saves_and_restores_again(
    nnx_run: dict[str, Any], tmp_path: Path
) -> None:
    """`save` walks an nnx.State like any pytree: Orbax's key paths, `value` levels."""
    root, mesh = nnx_run["root"], nnx_run["mesh"]
    _, abstract = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0, dropout=1)), mesh)
    restored = lazyckpt.device_put(lazyckpt.open(root), abstract)
    again = lazyckpt.save(tmp_path / "again", restored)
    assert not lazyckpt.diff(lazyckpt.open(again), lazyckpt.open(root), values=True)
    _assert_same_leaves(lazyckpt.device_put(lazyckpt.open(again), abstract), restored)


def test_nnx_pure_dict_target_with_int_keys(nnx_run: dict[str, Any]) -> None:
    """`to_pure_dict()` keys layers by int, the checkpoint by str: they match."""
    root, mesh = nnx_run["root"], nnx_run["mesh"]
    graphdef, abstract = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0, dropout=1)), mesh)
    pure = nnx.to_pure_dict(abstract)
    assert 0 in pure["blocks"]
    restored = lazyckpt.device_put(lazyckpt.open(root), pure)
    assert sorted(restored["blocks"]) == list(range(LAYERS))
    nnx.replace_by_pure_dict(abstract, restored)
    merged = nnx.merge(graphdef, abstract)
    merged.eval()
    trained = nnx.clone(nnx_run["model"])
    trained.eval()
    x = jnp.ones((2, WIDTH))
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(np.asarray(merged(x)), np.asarray(trained(x)))


def test_nnx_scanned_layers(tmp_path: Path) -> None:
    mesh = _auto_mesh((2, 4))
    with jax.set_mesh(mesh):
        model = Stacked(nnx.Rngs(0, dropout=1))
        _train(model, steps=1)
    root = _manager_save(tmp_path / "run", 1, state=nnx.state(model))
    lazy = lazyckpt.open(root)
    assert lazy["layers"]["lin"]["kernel"]["value"].shape == (LAYERS, WIDTH, WIDTH)
    graphdef, abstract = nnx.get_abstract_model(lambda: Stacked(nnx.Rngs(0, dropout=1)), mesh)
    restored = lazyckpt.device_put(lazy, abstract)
    _assert_same_leaves(restored, _orbax_restore(root, 1, "state", abstract))
    merged = nnx.merge(graphdef, restored)
    x = jnp.ones((2, WIDTH))
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(np.asarray(merged(x)), np.asarray(model(x)))


def test_abstract_mesh_shardings_resolve_against_the_current_or_given_mesh(
    nnx_run: dict[str, Any],
) -> None:
    root, mesh = nnx_run["root"], nnx_run["mesh"]
    with jax.set_mesh(mesh):
        abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0, dropout=1))))
    spec = jax.tree_util.tree_leaves(abstract)[3].sharding
    assert isinstance(spec.mesh, jax.sharding.AbstractMesh)
    lazy = lazyckpt.open(root)
    with pytest.raises(
        ShardingError,
        match=r"^blocks/0/drop/rngs/count/value: a NamedSharding on an AbstractMesh "
        r"\{'data': 2, 'model': 4\} names no devices; pass mesh=jax.make_mesh\(\.\.\.\) or "
        r"call inside `with jax.set_mesh\(mesh\):`$",
    ):
        lazyckpt.device_put(lazy, abstract)
    with pytest.raises(ShardingError, match=r"needs a mesh with those axes, but the mesh given"):
        lazyckpt.device_put(lazy, abstract, mesh=_auto_mesh((4, 2)))
    given = lazyckpt.device_put(lazy, abstract, mesh=mesh)
    with jax.set_mesh(mesh):
        current = lazyckpt.device_put(lazy, abstract)
    for a, b in zip(
        jax.tree_util.tree_leaves(given), jax.tree_util.tree_leaves(current), strict=True
    ):
        assert a.sharding == b.sharding and a.sharding.mesh == mesh
    kernel = given["blocks"][0]["lin"]["kernel"][...]
    assert kernel.sharding.spec == P(None, "model")


@pytest.fixture(scope="module")
def linen_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Linen TrainState (adam: ScaleByAdamState and EmptyState) with a
    `nn.with_partitioning` kernel, trained a step, saved by a CheckpointManager."""
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            kernel = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            x = nn.relu(nn.Dense(16, kernel_init=kernel)(x))
            out: jax.Array = nn.Dense(4)(x)
            return out

    model = MLP()

    def create(rng: jax.Array) -> Any:
        params = model.init(rng, jnp.ones((1, 8)))["params"]
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-2)
        )

    mesh = _auto_mesh((2, 4))
    with jax.set_mesh(mesh):
        state = jax.jit(create)(jax.random.key(0))
        grads = jax.tree.map(jnp.ones_like, state.params)
        state = state.apply_gradients(grads=grads)
        abstract = jax.eval_shape(create, jax.random.key(0))
    root = _manager_save(tmp_path_factory.mktemp("linen") / "run", 1, state=state)
    return {"root": root, "state": state, "abstract": abstract, "mesh": mesh}


def test_linen_train_state_round_trip(linen_run: dict[str, Any]) -> None:
    import flax.linen as nn
    from flax.training import train_state

    root, abstract = linen_run["root"], linen_run["abstract"]
    restored = lazyckpt.device_put(lazyckpt.open(root), abstract, mesh=linen_run["mesh"])
    assert isinstance(restored, train_state.TrainState)
    assert type(restored.opt_state[0]).__name__ == "ScaleByAdamState"
    assert type(restored.opt_state[1]) is optax.EmptyState
    assert isinstance(restored.params["Dense_0"]["kernel"], nn.Partitioned)
    assert restored.apply_fn is abstract.apply_fn  # static fields come from the target
    # Orbax puts leaves whose target names no sharding where they were saved: so do we.
    with jax.set_mesh(linen_run["mesh"]):
        _assert_same_leaves(restored, _orbax_restore(root, 1, "state", abstract))
    _assert_same_leaves(restored, linen_run["state"], shardings=False)
    assert int(restored.step) == 1
    # An unboxed target matches the boxed checkpoint: the `value` level is optional.
    unboxed = abstract.replace(params=nn.meta.unbox(abstract.params))
    plain = lazyckpt.device_put(lazyckpt.open(root), unboxed, mesh=linen_run["mesh"])
    assert isinstance(plain.params["Dense_0"]["kernel"], jax.Array)
    np.testing.assert_array_equal(
        np.asarray(plain.params["Dense_0"]["kernel"]),
        np.asarray(linen_run["state"].params["Dense_0"]["kernel"].value),
    )
    host = lazyckpt.load(lazyckpt.open(root), like=abstract)
    assert isinstance(host, train_state.TrainState)
    assert isinstance(host.params["Dense_1"]["bias"], np.ndarray)


class Pair(NamedTuple):
    first: Any
    second: Any


def test_equinox_module_and_flax_struct_holding_lazy_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eqx = pytest.importorskip("equinox")
    from flax import struct

    @struct.dataclass
    class Holder:
        weights: Any
        pair: Any
        name: str = struct.field(pytree_node=False, default="holder")

    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    path = lazyckpt.save(tmp_path / "mlp", eqx.filter(mlp, eqx.is_array))
    layers = lazyckpt.open(path)["layers"]
    lazy_mlp = eqx.tree_at(
        lambda m: [leaf for layer in m.layers for leaf in (layer.weight, layer.bias)],
        mlp,
        [layers[i][name] for i in range(3) for name in ("weight", "bias")],
    )
    holder = Holder(weights=layers[0]["weight"], pair=Pair(layers[1]["bias"], layers[2]["bias"]))

    # Showing, selecting and abstract evaluation read nothing.
    refuse_data_reads(monkeypatch)
    assert str(lazyckpt.summary(lazy_mlp)).splitlines()[:4] == [
        "layers/           6 arrays             520 B",
        "  0/              Linear, 2 arrays     160 B",
        "    weight        float32[8,4]         128 B  single device  cpu:0",
        "    bias          float32[8]            32 B  single device  cpu:0",
    ]
    assert "final_activation  <function <lambda>>" in str(lazyckpt.summary(lazy_mlp))
    assert str(lazyckpt.summary(holder)).splitlines() == [
        "weights   float32[8,4]    128 B  single device  cpu:0",
        "pair/     Pair, 2 arrays   40 B",
        "  first   float32[8]       32 B  single device  cpu:0",
        "  second  float32[2]        8 B  single device  cpu:0",
        "saved from one device (cpu:0): there is no sharding to reuse, saved_shardings(mesh) "
        "would replicate every array; pass your own shardings",
    ]
    picked = lazyckpt.select(holder, "pair/**")
    assert isinstance(picked, Holder) and picked.weights is None
    assert isinstance(picked.pair, Pair)
    assert jax.eval_shape(lambda h: h.weights @ h.pair.first[:4], holder).shape == (8,)
    monkeypatch.undo()

    # Every verb materializes them, keeping the Module, struct and NamedTuple types.
    loaded = lazyckpt.load(lazy_mlp)
    assert isinstance(loaded, eqx.nn.MLP) and isinstance(loaded.layers[1].weight, np.ndarray)
    model = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, loaded)
    x = jnp.ones(4)
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(mlp(x)))
    mesh = jax.make_mesh((8,), ("d",))
    placed = lazyckpt.device_put(holder, NamedSharding(mesh, P()))
    assert isinstance(placed, Holder) and isinstance(placed.pair, Pair)
    assert isinstance(placed.pair.second, jax.Array) and placed.name == "holder"
    np.testing.assert_array_equal(np.asarray(placed.pair.second), np.asarray(mlp.layers[2].bias))
    stats = lazyckpt.stats(holder)
    assert list(stats) == ["weights", "pair/first", "pair/second"]  # paths in this tree
    assert stats["pair/second"].max == float(np.max(mlp.layers[2].bias))
    assert [key for key, _, _ in lazyckpt.iter_blocks(holder)] == list(stats)


@pytest.fixture
def typed(tmp_path: Path) -> Path:
    """Arrays of several dtypes, typed PRNG keys and a scalar, saved by orbax."""
    tree = {
        "w": np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4),
        "big": np.array([16_777_217, 3], np.int32),
        "key": jax.random.key(5),
        "step": 12,
    }
    return orbax_save(tmp_path / "typed", tree)


def test_casts_that_can_change_values_need_an_opt_in(typed: Path) -> None:
    lazy = lazyckpt.open(typed)
    sds = jax.ShapeDtypeStruct
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    key_type = jax.random.key(0).dtype
    target = {
        "w": sds((3, 4), jnp.int32, sharding=device),
        "big": sds((2,), jnp.float32, sharding=device),
        "key": sds((), key_type, sharding=device),
        "step": sds((), jnp.int8, sharding=device),
    }
    with pytest.raises(
        TreeMismatchError,
        match=r"^the target does not match the checkpoint: 2 dtypes need a lossy cast\n"
        r"  lossy cast: big  target float32, checkpoint int32\n"
        r"  lossy cast: w  target int32, checkpoint float32\n"
        r"to restore anyway: lossy_casts=True allows casts that may change values$",
    ):
        lazyckpt.device_put(lazy, target)
    restored = lazyckpt.device_put(lazy, target, lossy_casts=True)
    assert restored["w"].dtype == jnp.int32 and float(restored["big"][0]) == 16_777_216.0
    # Same key dtype: no cast at all. Python ints fit int8: kept exactly.
    np.testing.assert_array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(jax.random.key(5))
    )
    assert restored["step"].dtype == jnp.int8 and int(restored["step"]) == 12
    # Floating-point precision changes are the usual mixed-precision restore.
    half = lazyckpt.load(lazy, like={"w": np.zeros((3, 4), jnp.bfloat16)}, partial=True)
    assert half["w"].dtype == jnp.bfloat16


def test_keys_are_never_cast_and_come_as_their_data_where_the_target_asks(typed: Path) -> None:
    """Typed keys onto keys of another implementation, or onto floats: an error that
    offers no lossy cast (none would be made) but says what to give; onto uint32 key
    data of their shape (a legacy `PRNGKey` in the target): that data, exactly."""
    lazy = lazyckpt.open(typed)
    sds = jax.ShapeDtypeStruct
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rbg = jax.random.key(0, impl="rbg").dtype
    for target, lossy in ((sds((), rbg, sharding=device), True), (sds((), jnp.float32), False)):
        with pytest.raises(TreeMismatchError) as caught:
            lazyckpt.device_put(lazy, {"key": target}, partial=True, lossy_casts=lossy)
        lines = str(caught.value).splitlines()
        assert lines[0] == "the target does not match the checkpoint: 1 PRNG key of another type"
        assert lines[1].startswith("  key: key  target ") and "checkpoint key<fry>[]" in lines[1]
        assert "lossy_casts" not in str(caught.value) and "jax.random.key_data" in lines[-1]
    data = lazyckpt.device_put(lazy, {"key": sds((2,), jnp.uint32)}, partial=True)["key"]
    np.testing.assert_array_equal(data, jax.random.key_data(jax.random.key(5)))
    legacy = lazyckpt.load(lazy, like={"key": jax.random.PRNGKey(0)}, partial=True)["key"]
    np.testing.assert_array_equal(legacy, jax.random.key_data(jax.random.key(5)))
    with pytest.raises(TreeMismatchError, match=r"key: key  target uint32\[3\], checkpoint"):
        lazyckpt.device_put(lazy, {"key": sds((3,), jnp.uint32)}, partial=True)


def test_a_partition_spec_naming_an_axis_the_mesh_lacks_is_a_sharding_error(typed: Path) -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    for spec in (P("nope"), P("data", "data")):  # (an axis it lacks; one named twice)
        with pytest.raises(ShardingError, match=r"^w: (P|PartitionSpec)\(.* does not fit"):
            lazyckpt.device_put(lazyckpt.open(typed), {"w": spec}, mesh=mesh, partial=True)


def test_a_missing_argument_of_another_kind_is_refused_clearly(typed: Path) -> None:
    with pytest.raises(TreeMismatchError, match=r"^missing='zeros': expected 'error'"):
        lazyckpt.device_put(lazyckpt.open(typed), {}, missing=cast(Any, "zeros"))


def test_typed_key_target_over_raw_key_data(typed: Path) -> None:
    """Checkpoints that do not record the key implementation (written before
    array_metadatas/ existed, or with it removed) hold keys as their uint32 data; a
    typed-key target restores them as keys."""
    import shutil

    shutil.rmtree(typed / "array_metadatas")
    lazy = lazyckpt.open(typed)
    assert lazy["key"].dtype == np.uint32 and lazy["key"].shape == (2,)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=device)}
    restored = lazyckpt.device_put(lazy, target, partial=True)
    assert restored["key"].dtype == jax.random.key(0).dtype
    np.testing.assert_array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(jax.random.key(5))
    )


def test_one_short_report_for_every_difference(nnx_run: dict[str, Any]) -> None:
    root, mesh = nnx_run["root"], nnx_run["mesh"]
    _, abstract = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0, dropout=1)), mesh)
    lazy = lazyckpt.open(root)
    # Params only, without partial=True: what the target lacks is listed, folded by layer.
    with pytest.raises(TreeMismatchError) as caught:
        lazyckpt.device_put(lazy, nnx.filter_state(abstract, nnx.Param))
    assert str(caught.value).splitlines() == [
        "the target does not match the checkpoint: 24 checkpoint leaves not in the target",
        "  not in the target: blocks/{0..11}/drop/rngs/count/value  uint32[]",
        "  not in the target: blocks/{0..11}/drop/rngs/key/value  key<fry>[]",
        "to restore anyway: partial=True restores only what the target names",
    ]
    # A target nested one level deeper than the checkpoint: a hint names the prefix.
    with pytest.raises(
        TreeMismatchError,
        match=r"\n  hint: the checkpoint has the target's leaves under 'blocks/0' \(and 11 other "
        r"places\): pass tree\['blocks'\]\['0'\] as the tree\n",
    ):
        lazyckpt.device_put({"blocks": lazy["blocks"]}, abstract["blocks"][3], partial=True)
    # Many kinds at once, in at most ~20 lines, never a repr of the target.
    sds = jax.ShapeDtypeStruct
    wrong = jax.tree.map(lambda x: sds((*x.shape, 2), x.dtype, sharding=x.sharding), abstract)
    wrong["extra"] = {str(i): sds((1,), jnp.float32) for i in range(30)}
    with pytest.raises(TreeMismatchError) as caught:
        lazyckpt.device_put(lazy, wrong)
    lines = str(caught.value).splitlines()
    assert lines[0] == (
        "the target does not match the checkpoint: 30 target leaves missing from the "
        "checkpoint, 72 shapes differ"
    )
    assert lines[1] == "  missing from the checkpoint: extra/{0..29}  float32[1]"
    assert "  shape: blocks/{0..11}/lin/kernel/value  target (8, 8, 2), checkpoint (8, 8)" in lines
    assert len(lines) <= 24 and "State(" not in str(caught.value)
    assert lines[-1].startswith("to restore anyway: missing='keep'")


def test_missing_leaves_kept_or_filled_as_the_caller_chooses(typed: Path) -> None:
    lazy = lazyckpt.open(typed)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    fresh = jnp.full((5,), 7.0)
    target = {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32, sharding=device), "new": fresh}
    kept = lazyckpt.device_put(lazy, target, partial=True, missing="keep")
    assert kept["new"] is fresh and kept["w"].shape == (3, 4)
    seen = []

    def fill(path: str, leaf: Any) -> Any:
        seen.append(path)
        return jnp.zeros(leaf.shape, leaf.dtype)

    filled = lazyckpt.load(lazy, like=target, partial=True, missing=fill)
    assert seen == ["new"] and filled["new"].tolist() == [0.0] * 5
    assert isinstance(filled["w"], np.ndarray)
    with pytest.raises(TreeMismatchError, match=r"missing from the checkpoint: new  float32\[5\]"):
        lazyckpt.device_put(lazy, target, partial=True)


def test_restoring_onto_a_target_reads_each_needed_chunk_once(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any
) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    kernel = tree["params"]["dense"]["kernel"]
    target = {
        "params": {
            "dense": {
                "kernel": jax.ShapeDtypeStruct(
                    kernel.shape, kernel.dtype, sharding=NamedSharding(mesh, P("x", "y"))
                )
            },
            "layers": {0: {"w": NamedSharding(mesh, P())}},  # (held inline: no bytes)
        },
        "opt_state": {"mu": NamedSharding(mesh, P("x"))},
    }
    with count_bytes() as read:
        placed = lazyckpt.device_put(lazy, target, partial=True)
    needed = lazy["params"]["dense"]["kernel"], lazy["opt_state"]["mu"]
    assert read[0] == sum(stored_chunk_bytes(path, leaf) for leaf in needed)
    assert sorted(placed["params"]["layers"]) == [0]  # the target's int key
    np.testing.assert_array_equal(
        np.asarray(placed["params"]["dense"]["kernel"]), np.asarray(kernel)
    )


def test_target_leaves_of_every_kind(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    lazy = lazyckpt.open(path)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    device = jax.devices()[2]
    target = {
        "params": {
            "dense": {"kernel": P("x", None), "bias": device},
            "embed": np.zeros((32, 4), jnp.bfloat16),
            "layers": None,
        },
        "opt_state": NamedSharding(mesh, P()),
        "step": 0,
        "lr": 0.0,
        "name": "",
    }
    with jax.set_mesh(mesh):
        placed = lazyckpt.device_put(lazy, target, partial=True)
    assert placed["params"]["dense"]["kernel"].sharding == NamedSharding(mesh, P("x", None))
    assert placed["params"]["dense"]["bias"].devices() == {device}
    assert isinstance(placed["params"]["embed"], np.ndarray)  # a NumPy target: to host
    assert isinstance(placed["params"]["layers"][0]["w"], LazyArray)  # None: left as it is
    assert placed["opt_state"]["mu"].sharding == NamedSharding(mesh, P())
    assert (placed["step"], placed["lr"], placed["name"]) == (7, 0.25, "run-1")
    with pytest.raises(TreeMismatchError, match=r"kind: opt_state  the target leaf is a Mesh"):
        lazyckpt.device_put(lazy, {"opt_state": mesh}, partial=True)
    with pytest.raises(ShardingError, match=r"a PartitionSpec names no devices"):
        lazyckpt.device_put(lazy["params"]["dense"]["kernel"], P("x"))


def test_map_and_select_keep_node_types(saved: tuple[Path, dict[str, Any]]) -> None:
    lazy = lazyckpt.open(saved[0])
    pair = Pair(lazy["params"]["embed"], lazy["opt_state"]["mu"])
    loaded = lazyckpt.load(pair)
    assert type(loaded) is Pair and isinstance(loaded.first, np.ndarray)
    picked = lazyckpt.select(pair, "second")
    assert picked == Pair(None, lazy["opt_state"]["mu"])
    one = lazyckpt.device_put((pair, [pair]), jax.devices()[1])
    assert type(one[0]) is Pair and type(one[1][0]) is Pair
    assert one[1][0].second.devices() == {jax.devices()[1]}


def test_target_leaves_a_select_left_out_are_said_so(typed: Path) -> None:
    """A target leaf that the checkpoint holds but `select=` left out is not called
    missing from the checkpoint: the error names the selection."""
    lazy = lazyckpt.open(typed)
    target = {"w": np.zeros((3, 4), np.float32), "big": np.zeros(2, np.int32)}
    for restore in (
        lambda: lazyckpt.load(lazy, like=target, select="w", partial=True),
        lambda: lazyckpt.device_put(lazy, target, select="w", partial=True),
    ):
        with pytest.raises(TreeMismatchError) as caught:
            restore()
        assert str(caught.value).splitlines()[:2] == [
            "the target does not match the checkpoint: 1 target leaf left out by select=",
            "  left out by select=: big  int32[2]",
        ]
        assert "select= the leaves the target names too" in str(caught.value)
    with pytest.raises(TreeMismatchError, match=r"missing from the checkpoint: new"):
        lazyckpt.load(lazy, like={**target, "new": np.zeros(1)}, select=["w", "big"], partial=True)


def test_a_target_that_places_nothing_is_refused(typed: Path) -> None:
    """A target of None alone (what `eqx.partition(eqx.filter_eval_shape(...),
    eqx.is_array)` gives: a ShapeDtypeStruct is no array to equinox) would hand the
    LazyArrays back unread; load and device_put refuse it alike. Some None leaves
    still leave those leaves as they are."""
    eqx = pytest.importorskip("equinox")
    lazy = lazyckpt.open(typed)
    nones = {"w": None, "big": None, "key": None, "step": None}
    for target, found in (
        (nones, r"every leaf of the target \(4\) is None"),
        (None, "target=None"),
    ):
        with pytest.raises(
            TreeMismatchError,
            match=rf"^{found}: nothing would be placed, and 3 of the checkpoint's arrays would come back unread.*one Sharding for every array.*eqx\.is_array",
        ):
            lazyckpt.device_put(lazy, target)
    # Restoring only what a target names, where it names no array, hands none back.
    assert lazyckpt.device_put(lazy, {}, partial=True) == {}
    assert lazyckpt.device_put(lazy, {"step": None}, partial=True)["step"] == lazy["step"]
    assert lazyckpt.load(lazy, like={"step": None}, partial=True)["step"] == lazy["step"]
    with pytest.raises(
        TreeMismatchError, match=r"^every leaf .*nothing would be read.*load\(tree\) without like="
    ):
        lazyckpt.load(lazy, like=nones)

    # equinox's pitfall, and its fix.
    mlp = lambda: eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))  # noqa: E731
    path = lazyckpt.save(Path(typed).parent / "mlp", eqx.filter(mlp(), eqx.is_array))
    abstract = eqx.filter_eval_shape(mlp)
    with pytest.raises(TreeMismatchError, match=r"every leaf of the target \(6\) is None"):
        lazyckpt.device_put(lazyckpt.open(path), eqx.partition(abstract, eqx.is_array)[0])
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    placed = lazyckpt.device_put(lazyckpt.open(path), eqx.partition(abstract, is_abstract)[0])
    assert isinstance(placed.layers[1].bias, jax.Array)

    some = lazyckpt.device_put(lazy, {**nones, "big": jax.ShapeDtypeStruct((2,), np.int32)})
    assert isinstance(some["w"], LazyArray) and isinstance(some["big"], jax.Array)
    assert isinstance(
        lazyckpt.load(lazy, like={**nones, "w": np.zeros((3, 4)), "step": 0})["w"], np.ndarray
    )
    assert lazyckpt.device_put({"step": 3}, {"step": None}) == {"step": 3}  # (no array to place)


def test_leaves_of_other_kinds_on_either_side_are_reported_not_raised_raw(typed: Path) -> None:
    """A scalar against a PRNG key target, a ShapeDtypeStruct where the checkpoint's
    value should be (the two arguments swapped), each one line of the report."""
    lazy = lazyckpt.open(typed)
    with pytest.raises(TreeMismatchError, match=r"\n  kind: step  target key<fry>, checkpoint 12$"):
        lazyckpt.device_put(lazy, {"step": jax.random.key(0)}, partial=True)
    abstract = {
        "w": jax.ShapeDtypeStruct((3, 4), np.float32),
        "step": jax.ShapeDtypeStruct((), np.int32),
    }
    with pytest.raises(TreeMismatchError) as caught:
        lazyckpt.device_put(
            {"w": abstract["w"], "step": abstract["step"], "n": 0},
            {"w": lazy["w"], "n": 0},
            partial=True,
        )
    assert "kind: w  the target leaf is a LazyArray; expected a ShapeDtypeStruct" in str(
        caught.value
    )
    assert "LazyArrays go in the tree, the first argument" in str(caught.value)
    with pytest.raises(
        TreeMismatchError, match=r"\n  kind: step  target int64, checkpoint int32\[\]$"
    ):
        lazyckpt.device_put(abstract, {"step": 0}, partial=True)
    # A target that is one leaf gets no hint to pass some other leaf as the tree.
    with pytest.raises(TreeMismatchError) as caught:
        lazyckpt.device_put(lazy, jax.ShapeDtypeStruct((), np.int32))
    assert "missing from the checkpoint: (the root)  int32[]" in str(caught.value)
    assert "hint" not in str(caught.value)


def test_a_callable_target_must_take_a_key_and_an_array(typed: Path) -> None:
    """A Mesh and a dtype are callable, but are no function of (key, array)."""
    lazy = lazyckpt.open(typed)
    mesh = jax.make_mesh((8,), ("d",))
    for target, shown in (
        (mesh, r"Mesh\(axis_sizes=\(8,\).*\.\.\."),
        (jnp.bfloat16, ".*bfloat16.*"),
    ):
        with pytest.raises(
            lazyckpt.ArgumentError,
            match=rf"^target={shown} is callable, but not as a function \(key, lazy_array\) -> Sharding; pass one Sharding.*NamedSharding\(mesh, PartitionSpec\(\)\)",
        ):
            lazyckpt.device_put(lazy, target)
    placed = lazyckpt.device_put(lazy, lambda key, array: NamedSharding(mesh, P()))
    assert placed["w"].sharding == NamedSharding(mesh, P())


def test_scalars_a_target_cannot_hold_are_reported_not_raised_raw() -> None:
    """A Python int past the target's integers, or a complex value for a float, is a
    line of the report, whatever the warning filters: NumPy's OverflowError and
    ComplexWarning had come out raw (an error under `-W error`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for like in ({"seed": np.int64(0)}, {"seed": jax.ShapeDtypeStruct((), np.int32)}):
            with pytest.raises(TreeMismatchError, match=r"kind: seed .*1180591620717411303424"):
                lazyckpt.load({"seed": 2**70}, like=like)
        with pytest.raises(TreeMismatchError, match=r"lossy cast: c .*\(1\+2j\)"):
            lazyckpt.load({"c": 1 + 2j}, like={"c": np.float32(0)})
