"""The error hierarchy: one base class, each subclass also a matching builtin."""

from __future__ import annotations

import functools
import json
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from lazyckpt._display import as_given


class LazyckptError(Exception):
    """Base class of every error lazyckpt raises on purpose."""

    __module__ = "lazyckpt"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Paths as the user gave them (`hf://org/name@1a2b3c4`, not the URL it was
        # resolved to), and URLs without their query strings (a signature), whatever
        # made the message: `lazyckpt._display`.
        super().__init__(*(as_given(a) if isinstance(a, str) else a for a in args), **kwargs)


class CheckpointNotFoundError(LazyckptError, FileNotFoundError):
    """A path, step or item that was asked for does not exist."""

    __module__ = "lazyckpt"


class NotACheckpointError(LazyckptError, ValueError):
    """A path exists but holds no Orbax checkpoint lazyckpt can read."""

    __module__ = "lazyckpt"


class UnfinishedCheckpointError(LazyckptError, ValueError):
    """A save that never committed (a `*.orbax-checkpoint-tmp*` folder, or a sharded
    safetensors model without its index)."""

    __module__ = "lazyckpt"


class CorruptCheckpointError(LazyckptError, ValueError):
    """Checkpoint files are present but damaged or inconsistent."""

    __module__ = "lazyckpt"


class ShardingError(LazyckptError, ValueError):
    """A sharding cannot lay out an array (shape not divisible, unknown mesh axis)."""

    __module__ = "lazyckpt"


class TreeMismatchError(LazyckptError, ValueError):
    """A shardings or target tree does not match the checkpoint tree."""

    __module__ = "lazyckpt"


class LazyIndexError(LazyckptError, IndexError):
    """An index is out of range or malformed for a LazyArray."""

    __module__ = "lazyckpt"


class UnsupportedCheckpointError(LazyckptError, ValueError):
    """A checkpoint, or a leaf in it, uses a form lazyckpt does not read."""

    __module__ = "lazyckpt"


class UnsafePickleError(LazyckptError, ValueError):
    """A pickle names a global that is not a tensor, storage, dtype or plain container:
    refused before anything in it ran."""

    __module__ = "lazyckpt"


class NoMatchError(LazyckptError, KeyError):
    """A path pattern or predicate selected nothing."""

    __module__ = "lazyckpt"

    def __str__(self) -> str:
        # KeyError quotes its message; show it as written.
        return str(self.args[0]) if self.args else ""


class LazyTypeError(LazyckptError, TypeError):
    """An operation that the array's type does not support (casting PRNG keys)."""

    __module__ = "lazyckpt"


class CheckpointExistsError(LazyckptError, FileExistsError):
    """A save would replace an existing checkpoint (or other folder) without leave."""

    __module__ = "lazyckpt"


class UnsavableError(LazyckptError, TypeError):
    """A tree holds a leaf or a key that an Orbax checkpoint cannot represent."""

    __module__ = "lazyckpt"


class StorageAccessError(LazyckptError, PermissionError):
    """Storage refused a request: no credentials, rejected ones, access denied, a
    read-only folder, or a service that cannot be reached."""

    __module__ = "lazyckpt"


class TooLargeError(LazyckptError, MemoryError):
    """A read whose result, or whose stored chunk, cannot fit in this machine's memory."""

    __module__ = "lazyckpt"


class CheckpointChangedError(LazyckptError, RuntimeError):
    """The checkpoint was replaced (overwritten, deleted) after it was opened."""

    __module__ = "lazyckpt"


class CheckpointWriteError(LazyckptError, OSError):
    """Writing a checkpoint failed in the file system (no space left, an I/O error);
    nothing was published."""

    __module__ = "lazyckpt"


class RenameError(LazyckptError, ValueError):
    """Rename rules that cannot be applied: a bad pattern, or two leaves sent to one
    key path."""

    __module__ = "lazyckpt"


class MissingExtraError(LazyckptError, ImportError):
    """A feature needs an optional dependency that is not installed (the message says
    which extra to install: `lazyckpt[progress]`, `lazyckpt[notebook]`...)."""

    __module__ = "lazyckpt"


class SizeError(LazyckptError, ValueError):
    """A size (`memory_budget`, `max_shard_size`, `chunk_bytes`) that is neither a
    number of bytes nor a number with a unit (`"256MiB"`, `"5GB"`)."""

    __module__ = "lazyckpt"


class ArgumentError(LazyckptError, ValueError):
    """An argument a verb cannot take, named with what it takes: `stats(bins=0)`,
    `summary(depth=-1)`, `StatsTable.plot('bogus')`."""

    __module__ = "lazyckpt"


class QuantizationError(LazyckptError, ValueError):
    """Quantized tensors that do not fit their convention: a scale without its weight,
    shapes that disagree with the block size, dtypes that hold no codes."""

    __module__ = "lazyckpt"


class LeftoverWarning(UserWarning):
    """A save succeeded but left the checkpoint it replaced behind."""

    __module__ = "lazyckpt"


class LostProcessWarning(UserWarning):
    """A job of several processes published its checkpoint whole, and a process was
    lost after it (its last agreement could not be made): check that process's log."""

    __module__ = "lazyckpt"


class OverBudgetWarning(UserWarning):
    """A read held more host memory than its `memory_budget` allows, and why: a shard
    bound for an accelerator that holds values the device would change if it were
    assembled there in pieces, sent whole from the host instead."""

    __module__ = "lazyckpt"


class SingleDeviceWarning(UserWarning):
    """`saved_shardings(mesh)` met arrays saved from one device: they have no
    sharding to reuse, so they are replicated on every device of the mesh."""

    __module__ = "lazyckpt"


class UnversionedWarning(UserWarning):
    """A file over HTTP is read although its server gives neither an ETag nor a
    Last-Modified date: a change between two reads cannot be detected
    (`network_options(unversioned="warn")`)."""

    __module__ = "lazyckpt"


class ProgramCacheWarning(UserWarning):
    """The folder of compiled programs (`LAZYCKPT_CACHE_DIR`) is not used, because
    another account could have put code in it, or it holds files the cache did not
    write: each process compiles its programs again."""

    __module__ = "lazyckpt"


class InferredStructureWarning(UserWarning):
    """The tree was rebuilt from array names alone, so some structure may be lost."""

    __module__ = "lazyckpt"


class CarriedFilesWarning(UserWarning):
    """`convert` carried a Hugging Face folder's `config.json` that may not describe
    the converted weights (`select=`, `rename=` or `transform=` changed their names),
    or left a file of the folder behind (too large to be a config or tokenizer)."""

    __module__ = "lazyckpt"


def json_or_corrupt(where: str, text: str | bytes, remedy: str) -> Any:
    """`text` parsed as JSON; else a `CorruptCheckpointError` naming `where` (the
    file), what is wrong, and `remedy` (what to do)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, depth
        raise CorruptCheckpointError(
            f"{where} is not valid JSON ({str(error)[:200]}); {remedy}"
        ) from error


def error_class(name: str) -> type[LazyckptError]:
    """The lazyckpt error class called `name` (another process's error, told by its
    name), or `LazyckptError` where no lazyckpt error is called so."""
    found = globals().get(name)
    return found if isinstance(found, type) and issubclass(found, LazyckptError) else LazyckptError


_WITHIN = ("lazyckpt", "jax", "contextlib")


def warn(message: str, category: type[Warning]) -> None:
    """Warn, pointing at the caller's own line: the first frame outside lazyckpt, and
    outside what calls lazyckpt back (jax's tree functions, contextlib's decorators);
    paths in `message` as the user gave them (`lazyckpt._display.as_given`)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: warn's caller
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_WITHIN):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(as_given(message), category, stacklevel=level)


_F = TypeVar("_F", bound=Callable[..., object])


def renamed(**new_names: str) -> Callable[[_F], _F]:
    """Accept a keyword argument under its old name, with a DeprecationWarning:
    `@renamed(which="select")` keeps `load(tree, which=...)` working."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            for old, new in new_names.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got both {old}= and {new}=; use {new}=")
                warn(
                    f"{fn.__name__}({old}=...) is now {fn.__name__}({new}=...)", DeprecationWarning
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
