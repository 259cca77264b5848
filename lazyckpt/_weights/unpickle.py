"""PyTorch's pickles read without running them and without torch.

`torch.save` pickles the saved object with each tensor as a call of
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
backward_hooks, metadata)` and each storage as a persistent id (`("storage",
FloatStorage, key, location, numel)`). This unpickler resolves only the globals of
that documented shape (the tensor and parameter rebuilds, storage types, dtypes,
`torch.Size`, `OrderedDict`, Python's `complex`, plain containers) to lazyckpt's own
stand-ins, which record where each tensor's elements are, each argument taken from
its own place as torch takes it. Any other global is refused by name before anything runs: pickle calls only
what `find_class` returns, and here that is never a callable of the file's choosing.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from lazyckpt._errors import CorruptCheckpointError, UnsafePickleError, UnsupportedCheckpointError
from lazyckpt._weights.guarded import Guarded

PICKLE_LIMIT = 256 << 20
"""The largest pickle read: a pickle holds names and shapes, never tensor data."""

DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "bool": np.dtype("?"),
    "complex64": np.dtype("<c8"),
    "complex128": np.dtype("<c16"),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
    "float4_e2m1fn_x2": np.dtype("u1"),  # two FP4 codes a byte: read as its bytes
}
_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
}
_STORAGES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "UntypedStorage": "uint8",
}


@attrs.frozen
class DType:
    """A torch dtype named in the pickle (`torch.float8_e4m3fn`)."""

    name: str

    @property
    def numpy(self) -> np.dtype[Any]:
        return DTYPES[self.name]


@attrs.frozen
class StorageType:
    """A storage class (`torch.FloatStorage`), which says its elements' dtype."""

    dtype: DType


@attrs.frozen
class Storage:
    """A storage of the file: its key (`data/<key>` in a zip), element dtype and count."""

    key: str
    dtype: DType
    numel: int


@attrs.frozen
class Tensor:
    """Where a tensor's elements are: `offset`, `shape` and `stride` in elements of
    `dtype` within `storage`; `conj` and `neg`, its conjugate and negative bits (a
    view whose values torch conjugates or negates as they are read)."""

    storage: Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType
    conj: bool = False
    neg: bool = False


_MAX_COUNT = 1 << 62
"""The largest element offset or count read (no file holds 2**62 elements)."""


def _ints(value: object, what: str) -> tuple[int, ...]:
    # Messages name types, never values: a pickle's memo can make a value whose text
    # is exponentially larger than the file.
    if (
        not isinstance(value, tuple | list)
        or len(value) > _MAX_RANK
        or not all(type(v) is int and 0 <= v < _MAX_COUNT for v in value)
    ):
        raise ValueError(f"a {what} (a {type(value).__name__}) that is not a tuple of sizes")
    return tuple(value)


def _rebuild_tensor(storage: object, offset: object, size: object, stride: object) -> Tensor:
    """`torch._utils._rebuild_tensor`: elements of the storage's dtype."""
    return _located(storage, offset, size, stride)


def _rebuild_tensor_v2(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    _requires_grad: object,
    _backward_hooks: object,
    metadata: object = None,
) -> Tensor:
    """`torch._utils._rebuild_tensor_v2`: elements of the storage's dtype, whatever
    the other arguments hold, and the bits its metadata sets."""
    return _located(storage, offset, size, stride, metadata=metadata)


def _rebuild_tensor_v3(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    _requires_grad: object,
    _backward_hooks: object,
    dtype: object,
    metadata: object = None,
) -> Tensor:
    """`torch._utils._rebuild_tensor_v3`: elements of its own dtype argument (the
    dtypes without a storage class: float8, uint16...)."""
    if not isinstance(dtype, DType):
        # (torch would take its default dtype, a setting of the process loading it)
        raise ValueError(f"_rebuild_tensor_v3 with a {type(dtype).__name__} as its dtype")
    return _located(storage, offset, size, stride, dtype, metadata)


def _located(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    dtype: DType | None = None,
    metadata: object = None,
) -> Tensor:
    if not isinstance(storage, Storage) or type(offset) is not int:
        raise ValueError(
            f"a tensor of a {type(storage).__name__} at an offset of {type(offset).__name__}"
        )
    if not 0 <= offset < _MAX_COUNT:
        raise ValueError(f"a tensor at an offset outside 0 to 2**62 ({offset.bit_length()} bits)")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise ValueError(f"a size of {len(shape)} and a stride of {len(strides)} dimensions")
    conj, neg = _bits(metadata)
    return Tensor(storage, offset, shape, strides, dtype or storage.dtype, conj, neg)


def _bits(metadata: object) -> tuple[bool, bool]:
    """The conjugate and negative bits that `metadata` sets. As torch: none where it
    is empty, each where its key is there, whatever its value (`{'neg': False}` sets
    it), other keys ignored."""
    if not metadata:
        return False, False
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise ValueError(f"tensor metadata of a {type(metadata).__name__}, not names and bits")
    return "conj" in metadata, "neg" in metadata


def _parameter(data: object, *_: object) -> object:
    return data


_REBUILDS = (_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3, _parameter)


def _from_type(function: object, _type: object, args: object, _state: object) -> object:
    if function not in _REBUILDS or not isinstance(args, tuple):
        raise ValueError(f"a tensor subclass rebuilt by a {type(function).__name__}")
    return function(*args)


def _ordered_dict(*args: object) -> collections.OrderedDict[Any, Any]:
    # torch pickles an OrderedDict empty, its items set after (checked there).
    if args:
        raise ValueError("an OrderedDict rebuilt from arguments")
    return collections.OrderedDict()


def _size(*args: object) -> tuple[int, ...]:
    return _ints(args[0] if args else (), "torch.Size")


def _encode(text: object, encoding: object = "latin1") -> bytes:
    # Protocol 2 pickles bytes as `_codecs.encode(text, "latin1")`: short values
    # (a state's `_metadata`), never a copy per reference of a large one.
    if not isinstance(text, str) or encoding != "latin1" or len(text) > 1 << 16:
        raise ValueError("_codecs.encode of anything but short latin1 text")
    return text.encode("latin1")


def _device(*args: object) -> str:
    if len(args) > 2 or not all(type(a) in (str, int) and len(str(a)) < 64 for a in args):
        raise ValueError("a torch.device of other than a short name and an index")
    return ":".join(str(a) for a in args)


def _complex(real: object = 0.0, imag: object = 0.0) -> complex:
    """`builtins.complex`, which torch's weights-only loader allows: a Python complex
    value from its real and imaginary parts (how Python pickles one)."""
    if not isinstance(real, int | float) or not isinstance(imag, int | float):
        raise ValueError("builtins.complex of other than a real and an imaginary part")
    return complex(real, imag)  # (an int over a float's range raises OverflowError)


_LAYOUTS = frozenset(
    f"torch.{name}"
    for name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")
) | {"torch._mkldnn", "torch.jagged"}


def _layout(name: object) -> str:
    """`torch.serialization._get_layout`, a `torch.layout` value (`torch.strided`)
    saved as a value: read as its name, as a `torch.device` is."""
    if name not in _LAYOUTS:
        raise ValueError("torch.serialization._get_layout of other than a layout's name")
    return str(name)


class _Marker:
    """A class named only as a tensor subclass's type (`torch.nn.Parameter`)."""


_GLOBALS: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type,
    ("torch.tensor", "_rebuild_from_type_v2"): _from_type,
    ("torch.nn.parameter", "Parameter"): _Marker,
    ("torch", "Tensor"): _Marker,
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("collections", "OrderedDict"): _ordered_dict,
    ("_codecs", "encode"): _encode,
    ("torch.serialization", "_get_layout"): _layout,
    ("builtins", "complex"): _complex,
    ("__builtin__", "complex"): _complex,  # (protocol 2, torch.save's, names it so)
}


_UNREAD_CONTAINERS = {("builtins", "set"), ("__builtin__", "set"), ("collections", "Counter")}
"""Containers torch's weights-only loader allows that lazyckpt's trees do not hold."""
_UNREAD_DTYPES = ("complex32", "chalf", "bits", "qint", "quint", "uint1", "int1", "int2")
"""torch dtypes that lazyckpt does not read (their names start so)."""
_MAX_RANK = 64
_ENCODED = 16 << 20


class _Unpickler(Guarded):
    def __init__(self, stream: io.BytesIO, path: str) -> None:
        super().__init__(stream, path)
        self.storages: dict[str, Storage] = {}
        self._encoded = 0

    def _encode(self, *args: object) -> bytes:
        """`_codecs.encode`, at most `_ENCODED` bytes in all: each call makes a copy,
        and a pickle can call it again and again on one memoized string."""
        out = _encode(*args)
        self._encoded += len(out)
        if self._encoded > _ENCODED:
            raise ValueError(f"more than {_ENCODED} bytes of encoded text")
        return out

    def _bytearray(self, data: object = b"") -> bytes:
        """`builtins.bytearray`, which torch's weights-only loader allows: read as the
        `bytes` it holds (lazyckpt's leaves are read, never written), counted with
        the encoded text (a pickle can copy one memoized value again and again)."""
        if not isinstance(data, bytes):
            raise ValueError("a bytearray of other than bytes")
        self._encoded += len(data)
        if self._encoded > _ENCODED:
            raise ValueError(f"more than {_ENCODED} bytes of encoded text")
        return data

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):
            return self._encode
        if module in ("builtins", "__builtin__") and name == "bytearray":
            return self._bytearray
        if (module, name) in _UNREAD_CONTAINERS:
            raise UnsupportedCheckpointError(
                f"{self.path} holds a Python {name} (its pickle names {module}.{name}), "
                "which torch.load reads but lazyckpt does not: its trees hold arrays, "
                "numbers, strings, bytes and dicts, lists and tuples of them. Load the "
                f"file with torch and save the {name} as a list or dict"
            )
        found = _GLOBALS.get((module, name))
        if found is not None:
            return found
        if module in ("torch", "torch.storage") and name in _STORAGES:
            return StorageType(DType(_STORAGES[name]))
        if module == "torch" and _ALIASES.get(name, name) in DTYPES:
            return DType(_ALIASES.get(name, name))
        if module == "torch" and name.startswith("Q") and name.endswith("Storage"):
            raise UnsupportedCheckpointError(
                f"{self.path} holds quantized tensors ({module}.{name}), which lazyckpt "
                "does not read; dequantize them with torch and save again"
            )
        if module == "torch" and name.startswith(_UNREAD_DTYPES):
            raise UnsupportedCheckpointError(
                f"{self.path} holds tensors of dtype torch.{name}, which lazyckpt does not "
                "read; convert them with torch (to float32, say) and save again"
            )
        if module.startswith("torch") and name.startswith("_rebuild_"):
            raise UnsupportedCheckpointError(
                f"{self.path} holds tensors rebuilt by {module}.{name} (sparse, quantized, "
                "meta, nested or subclass tensors), which lazyckpt does not read; save "
                "them as dense tensors (.to_dense(), .dequantize()) with torch"
            )
        raise UnsafePickleError(
            f"{self.path}: its pickle names the global {module}.{name}, which is not a "
            "tensor, storage, dtype or plain container; lazyckpt runs no pickle and "
            "refused it before anything ran. If you trust the file, load it with torch "
            "and save its tensors (a state dict) again"
        )

    def persistent_load(self, pid: Any) -> Storage:
        if not (
            isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] in ("storage", b"storage")
        ):
            kind = pid[0] if isinstance(pid, tuple) and pid else pid
            shown = repr(kind)[:40] if isinstance(kind, str | bytes) else type(kind).__name__
            raise UnsafePickleError(
                f"{self.path}: its pickle refers to a saved {shown}, not a storage (a "
                "whole nn.Module saved by torch.save(model)); save model.state_dict() instead"
            )
        _, kind, key, _location, numel, *view = pid
        if not isinstance(key, str | bytes) or len(key) > 256:
            raise ValueError(f"a storage key of type {type(key).__name__}")
        if view and view[0] is not None:
            raise UnsupportedCheckpointError(
                f"{self.path}: storage {key!r} is a view of another storage (legacy "
                "torch.save of storage slices), which lazyckpt does not read; load it "
                "with torch and save it again"
            )
        if not isinstance(kind, StorageType) or type(numel) is not int:
            raise ValueError(
                f"storage {key!r} of a {type(kind).__name__} and {type(numel).__name__} elements"
            )
        if not 0 <= numel < _MAX_COUNT:
            raise ValueError(
                f"storage {key!r} of a count of elements outside 0 to 2**62 "
                f"({numel.bit_length()} bits)"
            )
        key = key.decode("latin1") if isinstance(key, bytes) else key
        storage = self.storages.setdefault(key, Storage(key, kind.dtype, numel))
        return storage


def unpickle(stream: io.BytesIO, path: str) -> tuple[Any, dict[str, Storage]]:
    """The object the torch pickle at `stream`'s position holds, its tensors as
    `Tensor`s, and its storages by key; `stream` is left after it. `path` names the
    file in errors. Raises `Truncated` where the stream ends within it."""
    unpickler = _Unpickler(stream, path)
    return _loaded(unpickler, path), unpickler.storages


def plain(stream: io.BytesIO, path: str) -> Any:
    """The pickle at `stream`'s position, of plain values only (no global at all):
    the legacy format's magic number, version, system information and key list."""
    return _loaded(_Plain(stream, path), path)


class Truncated(Exception):
    """The data ended within a pickle: read more of the file and try again."""


def _loaded(unpickler: Guarded, path: str) -> Any:
    try:
        return unpickler.load()
    except (UnsafePickleError, UnsupportedCheckpointError):
        raise
    except EOFError:
        raise Truncated from None
    except pickle.UnpicklingError as error:
        if "truncated" in str(error):
            raise Truncated from None
        raise _damaged(path, error) from None
    except Exception as error:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise _damaged(path, error) from None


def _damaged(path: str, error: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: its pickle does not read as a torch state ({type(error).__name__}: "
        f"{str(error)[:200]}); the file is damaged or not written by torch.save"
    )


class _Plain(Guarded):
    """Plain values only: no global at all."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"{self.path}: its header pickle names the global {module}.{name}; a torch "
            "file's header holds plain values only, refused before anything ran"
        )
