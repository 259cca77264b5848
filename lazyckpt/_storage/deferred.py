"""What lets `open` of a local safetensors, torch or NumPy file, and its `summary`, import
no tensorstore (`lazy_tensorstore`): a local folder's kvstore and context, made at the
first read through tensorstore, and reads that lazyckpt answers at once, on the caller's
thread, for the headers that `open` parses."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import attrs

from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.per_process import tensorstore_io

T = TypeVar("T")
U = TypeVar("U")

# The OCDBT b-tree and inline zarr metadata are read once and kept in this pool, so
# that opening arrays after `open` does not read them again. Chunk data goes through
# the default pool, which caches nothing: a read returns bytes straight from storage.
_METADATA_CACHE_BYTES = 64 << 20


def new_context() -> ts.Context:
    """The tensorstore context of one checkpoint's reads."""
    return ts.Context(
        {
            "cache_pool#metadata": {"total_bytes_limit": _METADATA_CACHE_BYTES},
            # More decode tasks than cores, so that reading and decoding overlap;
            # memory stays bounded by the read engine's budget.
            "data_copy_concurrency": {"limit": max(8, 2 * (os.cpu_count() or 1))},
        }
    )


class DeferredKvStore:
    """A local folder's tensorstore kvstore, opened (with its `context`) at the first
    use of any of its attributes; until then, tensorstore is not imported."""

    def __init__(self, location: str, spec: dict[str, Any]) -> None:
        self.location, self.spec = location, spec

    @functools.cached_property
    def context(self) -> ts.Context:
        return new_context()

    @functools.cached_property
    def opened(self) -> ts.KvStore:
        tensorstore_io(self.location)
        return ts.KvStore.open(self.spec, context=self.context).result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opened, name)


@attrs.frozen
class Answered(Generic[T]):
    """A read's outcome, known already (`answer`): `result()` as a future's."""

    value: Any = None
    error: Exception | None = None

    def result(self) -> T:
        if self.error is not None:
            raise self.error
        return cast(T, self.value)


def answer(
    read: Callable[[], T],
    fn: Callable[[T], U],
    on_error: Callable[[Exception], Exception] | None = None,
) -> Answered[U]:
    """`futures.then` of a read made at once: `fn` of what `read()` returns; a failure of
    `read` as `on_error` turns it, one of `fn` as raised."""
    try:
        result = read()
    except Exception as error:  # noqa: BLE001 - handed to whoever asks for the result
        return Answered(error=on_error(error) if on_error else error)
    try:
        return Answered(fn(result))
    except Exception as error:  # noqa: BLE001 - handed to whoever asks for the result
        return Answered(error=error)
