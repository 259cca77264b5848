"""lazyckpt: open JAX checkpoints lazily, read only what you ask for.

>>> tree = lazyckpt.open(path)                       # reads metadata only
>>> tree["params"]["w"]
LazyArray('params/w', shape=(8, 8), dtype=float32, chunks=(2, 4), sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P('x', 'y')))
>>> params = lazyckpt.select(tree, "params/**")       # no I/O; opt_state is never read
>>> mesh = jax.make_mesh((2, 4), ("x", "y"))          # a different mesh than saved
>>> placed = lazyckpt.device_put(params, lazyckpt.saved_shardings(mesh))
>>> placed["params"]["w"].sharding.shard_shape((8, 8))
(4, 2)
>>> lazyckpt.load(tree["params"]["w"][1, :4])         # reads one stored chunk
array([ 8.,  9., 10., 11.], dtype=float32)
"""

__version__ = "0.2.0"

import importlib
from typing import TYPE_CHECKING

from lazyckpt._errors import (
    ArgumentError,
    CarriedFilesWarning,
    CheckpointChangedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    InferredStructureWarning,
    LazyckptError,
    LazyIndexError,
    LazyTypeError,
    LeftoverWarning,
    LostProcessWarning,
    MissingExtraError,
    NoMatchError,
    NotACheckpointError,
    OverBudgetWarning,
    ProgramCacheWarning,
    QuantizationError,
    RenameError,
    ShardingError,
    SingleDeviceWarning,
    SizeError,
    StorageAccessError,
    TooLargeError,
    TreeMismatchError,
    UnfinishedCheckpointError,
    UnsafePickleError,
    UnsavableError,
    UnsupportedCheckpointError,
    UnversionedWarning,
)

if TYPE_CHECKING:
    from lazyckpt._array.sharding import SavedSharding
    from lazyckpt._array.tree import leaves, select
    from lazyckpt._convert.convert import convert
    from lazyckpt._convert.plan import ConversionPlan
    from lazyckpt._dequantize import dequantize, dequantize_fp8, dequantize_mxfp4
    from lazyckpt._device_put import device_put
    from lazyckpt._engine.memory import malloc_tuning
    from lazyckpt._explore.diff import Diff, diff
    from lazyckpt._explore.stats import Stats, StatsTable, stats
    from lazyckpt._explore.summary import summary
    from lazyckpt._explore.verify import Verification, verify
    from lazyckpt._lazy import LazyArray
    from lazyckpt._measure import ReadCost, measure
    from lazyckpt._open import open  # noqa: A004 - the library's main verb
    from lazyckpt._orbax.layout import items, steps
    from lazyckpt._placement.saved import saved_shardings
    from lazyckpt._read import iter_blocks, load
    from lazyckpt._rename import rename
    from lazyckpt._safetensors.read import metadata as safetensors_metadata
    from lazyckpt._save import save
    from lazyckpt._storage.network import NetworkOptions, network_options
    from lazyckpt._surgery import concat, stack, stack_layers, take, unstack, unstack_layers

# Everything but the errors is imported on first use (PEP 562): `import lazyckpt`, and so
# `lazyckpt --help`, does not wait seconds for jax. Keep this table and the imports above as one.
_LAZY: dict[str, tuple[str, str]] = {
    "ConversionPlan": ("lazyckpt._convert.plan", "ConversionPlan"),
    "Diff": ("lazyckpt._explore.diff", "Diff"),
    "LazyArray": ("lazyckpt._lazy", "LazyArray"),
    "NetworkOptions": ("lazyckpt._storage.network", "NetworkOptions"),
    "ReadCost": ("lazyckpt._measure", "ReadCost"),
    "SavedSharding": ("lazyckpt._array.sharding", "SavedSharding"),
    "Stats": ("lazyckpt._explore.stats", "Stats"),
    "StatsTable": ("lazyckpt._explore.stats", "StatsTable"),
    "Verification": ("lazyckpt._explore.verify", "Verification"),
    "concat": ("lazyckpt._surgery", "concat"),
    "convert": ("lazyckpt._convert.convert", "convert"),
    "dequantize": ("lazyckpt._dequantize", "dequantize"),
    "dequantize_fp8": ("lazyckpt._dequantize", "dequantize_fp8"),
    "dequantize_mxfp4": ("lazyckpt._dequantize", "dequantize_mxfp4"),
    "device_put": ("lazyckpt._device_put", "device_put"),
    "diff": ("lazyckpt._explore.diff", "diff"),
    "items": ("lazyckpt._orbax.layout", "items"),
    "iter_blocks": ("lazyckpt._read", "iter_blocks"),
    "leaves": ("lazyckpt._array.tree", "leaves"),
    "load": ("lazyckpt._read", "load"),
    "malloc_tuning": ("lazyckpt._engine.memory", "malloc_tuning"),
    "measure": ("lazyckpt._measure", "measure"),
    "network_options": ("lazyckpt._storage.network", "network_options"),
    "open": ("lazyckpt._open", "open"),
    "rename": ("lazyckpt._rename", "rename"),
    "safetensors_metadata": ("lazyckpt._safetensors.read", "metadata"),
    "save": ("lazyckpt._save", "save"),
    "saved_shardings": ("lazyckpt._placement.saved", "saved_shardings"),
    "select": ("lazyckpt._array.tree", "select"),
    "stack": ("lazyckpt._surgery", "stack"),
    "stack_layers": ("lazyckpt._surgery", "stack_layers"),
    "stats": ("lazyckpt._explore.stats", "stats"),
    "steps": ("lazyckpt._orbax.layout", "steps"),
    "summary": ("lazyckpt._explore.summary", "summary"),
    "take": ("lazyckpt._surgery", "take"),
    "unstack": ("lazyckpt._surgery", "unstack"),
    "unstack_layers": ("lazyckpt._surgery", "unstack_layers"),
    "verify": ("lazyckpt._explore.verify", "verify"),
}


if not TYPE_CHECKING:  # a module __getattr__ would hide misspelt names from type checkers

    def __getattr__(name: str) -> object:
        if name not in _LAZY:
            raise AttributeError(f"module 'lazyckpt' has no attribute {name!r}")
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later uses skip __getattr__
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ArgumentError",
    "CarriedFilesWarning",
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "ConversionPlan",
    "CorruptCheckpointError",
    "Diff",
    "InferredStructureWarning",
    "LazyArray",
    "LazyIndexError",
    "LazyTypeError",
    "LazyckptError",
    "LeftoverWarning",
    "LostProcessWarning",
    "MissingExtraError",
    "NetworkOptions",
    "NoMatchError",
    "NotACheckpointError",
    "OverBudgetWarning",
    "ProgramCacheWarning",
    "QuantizationError",
    "ReadCost",
    "RenameError",
    "SavedSharding",
    "ShardingError",
    "SingleDeviceWarning",
    "SizeError",
    "Stats",
    "StatsTable",
    "StorageAccessError",
    "TooLargeError",
    "TreeMismatchError",
    "UnfinishedCheckpointError",
    "UnsafePickleError",
    "UnsavableError",
    "UnsupportedCheckpointError",
    "UnversionedWarning",
    "Verification",
    "__version__",
    "concat",
    "convert",
    "dequantize",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "device_put",
    "diff",
    "items",
    "iter_blocks",
    "leaves",
    "load",
    "malloc_tuning",
    "measure",
    "network_options",
    "open",
    "rename",
    "safetensors_metadata",
    "save",
    "saved_shardings",
    "select",
    "stack",
    "stack_layers",
    "stats",
    "steps",
    "summary",
    "take",
    "unstack",
    "unstack_layers",
    "verify",
]
