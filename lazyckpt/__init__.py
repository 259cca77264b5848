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

__version__ = "0.1.0"

from lazyckpt._array.sharding import SavedSharding
from lazyckpt._array.tree import leaves, select
from lazyckpt._convert import convert
from lazyckpt._device_put import device_put
from lazyckpt._engine.memory import malloc_tuning
from lazyckpt._errors import (
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
    MissingExtraError,
    NoMatchError,
    NotACheckpointError,
    RenameError,
    ShardingError,
    SingleDeviceWarning,
    SizeError,
    StorageAccessError,
    TooLargeError,
    TreeMismatchError,
    UnfinishedCheckpointError,
    UnsavableError,
    UnsupportedCheckpointError,
)
from lazyckpt._explore.diff import Diff, diff
from lazyckpt._explore.stats import Stats, StatsTable, stats
from lazyckpt._explore.summary import summary
from lazyckpt._explore.verify import Verification, verify
from lazyckpt._lazy import LazyArray
from lazyckpt._open import open  # noqa: A004 - the library's main verb
from lazyckpt._orbax.layout import items, steps
from lazyckpt._placement import saved_shardings
from lazyckpt._read import iter_blocks, load
from lazyckpt._rename import rename
from lazyckpt._safetensors.read import metadata as safetensors_metadata
from lazyckpt._save import save
from lazyckpt._surgery import concat, stack, stack_layers, unstack, unstack_layers

__all__ = [
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "Diff",
    "InferredStructureWarning",
    "LazyArray",
    "LazyIndexError",
    "LazyTypeError",
    "LazyckptError",
    "LeftoverWarning",
    "MissingExtraError",
    "NoMatchError",
    "NotACheckpointError",
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
    "UnsavableError",
    "UnsupportedCheckpointError",
    "Verification",
    "__version__",
    "concat",
    "convert",
    "device_put",
    "diff",
    "items",
    "iter_blocks",
    "leaves",
    "load",
    "malloc_tuning",
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
    "unstack",
    "unstack_layers",
    "verify",
]
