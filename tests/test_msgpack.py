"""The legacy msgpack `checkpoint` decoder, checked against the real `msgpack` package and
orbax's own flax-format writer and reader (`orbax.checkpoint.msgpack_utils`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._orbax.msgpack import MAX_DEPTH, decode

WHERE = "ckpt/checkpoint"
DAMAGED = "; the file is damaged, copy the checkpoint again"


def flax_pack(tree: Any) -> bytes:
    """Encode `tree` as flax does, written out here rather than imported from orbax."""

    def ext(x: Any) -> msgpack.ExtType:
        if isinstance(x, np.ndarray):
            payload = msgpack.packb([list(x.shape), x.dtype.name, x.tobytes()])
            return msgpack.ExtType(1, payload)
        if isinstance(x, np.generic):
            payload = msgpack.packb([[], x.dtype.name, x.tobytes()])
            return msgpack.ExtType(3, payload)
        if isinstance(x, complex):
            return msgpack.ExtType(2, msgpack.packb([x.real, x.imag]))
        if isinstance(x, tuple):
            return msgpack.ExtType(4, msgpack.packb(list(x), default=ext, strict_types=True))
        raise TypeError(type(x))

    return msgpack.packb(tree, default=ext, strict_types=True)


def orbax_pack(tree: Any) -> bytes:
    from orbax.checkpoint import msgpack_utils

    return msgpack_utils.msgpack_serialize(tree)


def orbax_unpack(data: bytes) -> Any:
    from orbax.checkpoint import msgpack_utils

    return msgpack_utils.msgpack_restore(data)


def assert_same(got: Any, want: Any) -> None:
    """Equal values of exactly the same types; arrays compared bit for bit."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    elif isinstance(want, np.ndarray | np.generic):
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want


def corrupt(message: str) -> Any:
    """`pytest.raises` for a CorruptCheckpointError whose message starts with `message`."""
    return pytest.raises(CorruptCheckpointError, match="^" + re.escape(f"{WHERE}: {message}"))


# --- every msgpack format family ------------------------------------------------------

FAMILIES = [
    (0, 0x00),  # positive fixint
    (127, 0x7F),
    (-1, 0xFF),  # negative fixint
    (-32, 0xE0),
    (128, 0xCC),  # uint8..64
    (2**8, 0xCD),
    (2**16, 0xCE),
    (2**32, 0xCF),
    (2**64 - 1, 0xCF),
    (-33, 0xD0),  # int8..64
    (-(2**7) - 1, 0xD1),
    (-(2**15) - 1, 0xD2),
    (-(2**31) - 1, 0xD3),
    (-(2**63), 0xD3),
    (0.1, 0xCB),  # float64
    (float("inf"), 0xCB),
    (float("nan"), 0xCB),
    ("", 0xA0),  # fixstr
    ("héllo ✓" * 3 + "!", 0xBF),
    ("s" * 32, 0xD9),  # str8/16/32
    ("s" * 2**8, 0xDA),
    ("s" * 2**16, 0xDB),
    (b"", 0xC4),  # bin8/16/32
    (b"\x00\xff" * 2**7, 0xC5),
    (b"b" * 2**16, 0xC6),
    ([], 0x90),  # fixarray
    (list(range(15)), 0x9F),
    (list(range(16)), 0xDC),  # array16/32
    ([None] * 2**16, 0xDD),
    ({}, 0x80),  # fixmap
    ({str(i): i for i in range(15)}, 0x8F),
    ({str(i): [i] for i in range(16)}, 0xDE),  # map16/32
    ({str(i): i for i in range(2**16)}, 0xDF),
    (None, 0xC0),
    (True, 0xC3),
    (False, 0xC2),
]


@pytest.mark.parametrize(("value", "first_byte"), FAMILIES, ids=lambda v: repr(v)[:20])
def test_every_format_family_decodes_as_msgpack_encoded_it(value: Any, first_byte: int) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    assert data[0] == first_byte
    assert_same(decode(data, where=WHERE), value)
    assert_same(decode(data, where=WHERE), msgpack.unpackb(data, strict_map_key=False))


def test_float32_decodes_to_the_same_python_float_as_msgpack() -> None:
    data = msgpack.packb(0.1, use_single_float=True)
    assert data[0] == 0xCA
    assert decode(data, where=WHERE) == struct.unpack(">f", struct.pack(">f", 0.1))[0]


def test_bin_map_keys_become_str_and_other_keys_stay() -> None:
    data = msgpack.packb({b"bytes": 1, "str": 2, 3: 4, None: 5}, use_bin_type=True)
    assert decode(data, where=WHERE) == {"bytes": 1, "str": 2, 3: 4, None: 5}


def tuple_payload(size: int) -> bytes:
    """A msgpack array of exactly `size` bytes: a tuple ext's payload."""
    if size == 1:
        return b"\x90"
    if size == 2:
        return b"\x91\x07"
    if size - 3 < 2**16:
        return b"\xdc" + (size - 3).to_bytes(2, "big") + bytes(size - 3)
    return b"\xdd" + (size - 5).to_bytes(4, "big") + bytes(size - 5)


@pytest.mark.parametrize(
    ("size", "first_byte"),
    [
        (1, 0xD4),
        (2, 0xD5),
        (4, 0xD6),
        (8, 0xD7),
        (16, 0xD8),
        (3, 0xC7),
        (300, 0xC8),
        (70_000, 0xC9),
    ],
)
def test_every_ext_family_decodes(size: int, first_byte: int) -> None:
    data = msgpack.packb([msgpack.ExtType(4, tuple_payload(size)), "after"])
    assert data[1] == first_byte
    assert_same(decode(data, where=WHERE), orbax_unpack(data))


# --- flax's extension types, from orbax's writer and a hand-written one -----------------


def flax_tree() -> dict[str, Any]:
    return {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bf16": np.linspace(-2, 2, 5).astype(jnp.bfloat16),
        "i64": np.array([[-(2**63), 2**63 - 1]]),
        "bool": np.array([True, False]),
        "c64": np.array([1 + 2j], np.complex64),
        "empty": np.zeros((0, 3), np.int8),
        "scalar0d": np.array(7, np.uint16),
        "npscalars": [np.int8(3), np.float32(1.5), np.bool_(True), np.float16(2)],
        "complex": 1.5 - 2j,
        "tuple": (1, "two", (3.0, None), np.ones(2, np.int32)),
        "placeholder": "PLACEHOLDER://params.w",
        "empties": [{}, [], ()],
    }


@pytest.mark.parametrize("pack", [orbax_pack, flax_pack])
def test_flax_extension_types_decode_like_orbax(pack: Any) -> None:
    data = pack(flax_tree())
    got = decode(data, where=WHERE)
    assert_same(got, flax_tree())
    assert_same(got, orbax_unpack(data))


def test_arrays_are_writable_copies() -> None:
    array = decode(flax_pack(np.arange(4, dtype=np.int32)), where=WHERE)
    assert array.flags.writeable and array.flags.owndata
    array[0] = 9


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "int4"])
def test_dtypes_numpy_lacks_by_name_come_from_tensorstore(name: str) -> None:
    import tensorstore as ts

    dtype = np.dtype(ts.dtype(name).numpy_dtype)
    want = np.arange(4).astype(dtype)
    payload = msgpack.packb([[4], name.encode(), want.tobytes()])  # dtype name as bin
    assert_same(decode(msgpack.packb(msgpack.ExtType(1, payload)), where=WHERE), want)


def test_a_checkpoint_file_written_by_orbax_msgpack_handler(tmp_path: Path) -> None:
    from etils import epath
    from orbax.checkpoint import aggregate_handlers

    tree = {"a": np.arange(3.0), "b": {"c": [1, 2.5], "s": "x"}, "n": None}
    path = tmp_path / "checkpoint"

    async def save() -> None:
        future = await aggregate_handlers.MsgpackHandler().serialize(epath.Path(path), tree)
        future.result()

    asyncio.run(save())
    assert_same(decode(path.read_bytes(), where=str(path)), tree)


@pytest.mark.parametrize("name", ["aggregate_all", "aggregate_some"])
def test_orbax_testdata_checkpoints(name: str) -> None:
    import orbax.checkpoint

    path = Path(orbax.checkpoint.__file__).parent / "testing" / f"{name}.checkpoint" / "checkpoint"
    data = path.read_bytes()
    assert_same(decode(data, where=str(path)), orbax_unpack(data))


def test_chunked_arrays_are_reassembled(monkeypatch: pytest.MonkeyPatch) -> None:
    from orbax.checkpoint import msgpack_utils

    monkeypatch.setattr(msgpack_utils, "MAX_CHUNK_SIZE", 64)  # chunk at 64 bytes, not 1 GiB
    tree = {"big": np.arange(60, dtype=np.float32).reshape(3, 4, 5), "small": np.ones(2)}
    data = orbax_pack(tree)
    assert data.count(msgpack.packb("__msgpack_chunked_array__")) == 1
    assert_same(decode(data, where=WHERE), tree)


def test_a_chunked_array_anywhere_is_reassembled() -> None:
    chunked = {
        "__msgpack_chunked_array__": True,
        "shape": {"0": 2, "1": 3},
        "chunks": {"0": np.arange(4.0), "1": np.arange(4.0, 6.0)},
    }
    assert_same(decode(flax_pack([chunked]), where=WHERE), [np.arange(6.0).reshape(2, 3)])


# --- property tests ---------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary()
    | st.complex_numbers(allow_nan=False)
    | st.integers(-128, 127).map(np.int8)
    | st.floats(width=32).map(np.float32)
)
arrays = st.one_of(
    *(
        hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
        for dtype in (np.float32, np.int8, np.bool_, np.complex64)
    )
) | hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=2)).map(
    lambda a: a.astype(jnp.bfloat16)
)
trees = st.recursive(
    scalars | arrays,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(trees)
def test_random_trees_round_trip(tree: Any) -> None:
    assert_same(decode(flax_pack(tree), where=WHERE), tree)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), trees, max_size=4))
def test_random_trees_decode_like_orbax(tree: dict[str, Any]) -> None:
    data = orbax_pack(tree)
    assert_same(decode(data, where=WHERE), orbax_unpack(data))


@settings(max_examples=300, deadline=None)
@given(trees, st.data())
def test_damaged_bytes_raise_only_corrupt_checkpoint_error(tree: Any, data: st.DataObject) -> None:
    encoded = bytearray(flax_pack(tree))
    for _ in range(data.draw(st.integers(1, 3))):
        encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(encoded), where=WHERE)
    except CorruptCheckpointError as e:
        assert str(e).startswith(f"{WHERE}: msgpack data ")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_corrupt_checkpoint_error(data: bytes) -> None:
    with contextlib.suppress(CorruptCheckpointError):  # anything else fails the test
        decode(data, where=WHERE)


def test_every_truncation_is_reported() -> None:
    data = flax_pack(flax_tree())
    for end in range(len(data)):
        with corrupt("msgpack data is truncated at byte "):
            decode(data[:end], where=WHERE)


def test_ten_thousand_entries() -> None:
    tree = {f"layer_{i}": {"w": np.full(3, i, np.float32), "step": i} for i in range(10_000)}
    assert_same(decode(flax_pack(tree), where=WHERE), tree)


# --- one test per safety rule -----------------------------------------------------------


def test_truncated_str() -> None:
    data = msgpack.packb("x" * 300)[:5]
    with corrupt(
        "msgpack data is truncated at byte 3: a str of 300 bytes was declared but only 2 remain"
        + DAMAGED
    ):
        decode(data, where=WHERE)


def test_truncated_header_and_empty_input() -> None:
    with corrupt("msgpack data is truncated at byte 1: a uint16 needs 2 bytes but only 1 remain"):
        decode(b"\xcd\x01", where=WHERE)
    with corrupt("msgpack data is truncated at byte 0: expected another value but the data ended"):
        decode(b"", where=WHERE)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xdb\xff\xff\xff\xff" + b"abc", "a str of 4294967295 bytes was declared but only 3"),
        (b"\xc6\xff\xff\xff\xff" + b"abc", "a bin of 4294967295 bytes was declared but only 3"),
        (b"\xc9\xff\xff\xff\xff\x01" + b"abc", "an ext payload of 4294967295 bytes was declared"),
        (b"\xdd\xff\xff\xff\xff\xc0", "an array of 4294967295 items was declared but only 1"),
        (b"\xdf\xff\xff\xff\xff\xc0\xc0", "a map of 4294967295 items was declared but only 2"),
    ],
)
def test_huge_declared_length_raises_before_allocating(data: bytes, message: str) -> None:
    with corrupt("msgpack data is truncated at byte ") as error:
        decode(data, where=WHERE)
    assert message in str(error.value)


def test_too_deep_nesting() -> None:
    decode(b"\x91" * MAX_DEPTH + b"\xc0", where=WHERE)  # the limit itself is fine
    with corrupt(f"msgpack data nests deeper than {MAX_DEPTH} levels at byte {MAX_DEPTH}"):
        decode(b"\x91" * 100_000 + b"\xc0", where=WHERE)
    with corrupt(f"msgpack data nests deeper than {MAX_DEPTH} levels"):
        decode(b"\x81\xa1k" * 100_000 + b"\xc0", where=WHERE)


def test_too_deep_tuples_are_not_a_recursion_error() -> None:
    data = msgpack.packb(None)
    for _ in range(2_000):
        data = msgpack.packb(msgpack.ExtType(4, b"\x91" + data))
    with corrupt(f"msgpack data nests deeper than {MAX_DEPTH} levels"):
        decode(data, where=WHERE)


def ndarray_ext(shape: Any, name: Any, raw: Any, code: int = 1) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb([shape, name, raw])))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            ndarray_ext([2, 2], "float32", bytes(12)),
            "shape (2, 2) of float32 needs 16 bytes, found 12",
        ),
        (
            ndarray_ext([-1], "int8", b""),
            "expected a shape of at most 64 non-negative ints, found [-1]",
        ),
        (ndarray_ext([True], "int8", b"\x00"), "non-negative ints, found [True]"),
        (ndarray_ext({"0": 1}, "int8", b"\x00"), "non-negative ints, found {b'0': 1}"),
        (
            ndarray_ext([1] * 65, "int8", b"\x00"),
            "expected a shape of at most 64 non-negative ints",
        ),
        (ndarray_ext([1], 8, b"\x00"), "expected a dtype name and bytes after the shape"),
        (ndarray_ext([1], "int8", [0]), "expected a dtype name and bytes after the shape"),
        (
            msgpack.packb(msgpack.ExtType(1, msgpack.packb([[1], "int8"]))),
            "expected [shape, dtype name, bytes], found [[1], ",
        ),
        (
            ndarray_ext([2], "int8", b"\x00\x00", code=3),
            "has a bad numpy scalar at byte 0: expected shape (), found (2,)",
        ),
    ],
)
def test_bad_ndarray_payload(data: bytes, message: str) -> None:
    with corrupt("msgpack data has a bad ") as error:
        decode(data, where=WHERE)
    assert message in str(error.value)
    assert str(error.value).endswith(DAMAGED)


@pytest.mark.parametrize("name", ["float33", "json", "f4,i4", "(2,)f4", "a"])
def test_unknown_dtype(name: str) -> None:
    with corrupt(
        f"msgpack data has an ndarray of unknown dtype at byte 0: expected a dtype name such as "
        f"'float32', found {name!r}; the file is damaged or was written by a newer writer"
    ):
        decode(ndarray_ext([1], name, b"\x00" * 8), where=WHERE)


@pytest.mark.parametrize("name", ["object", "str", "datetime64[ns]", "bytes160"])
def test_dtypes_numpy_has_and_lazyckpt_does_not_read(name: str) -> None:
    from lazyckpt import UnsupportedCheckpointError

    with pytest.raises(
        UnsupportedCheckpointError,
        match=rf"^{WHERE}: msgpack data has an ndarray of dtype {re.escape(repr(name))} at byte "
        r"0, which lazyckpt does not read \(numbers, bools, bfloat16, float8 and int4 it does\)$",
    ):
        decode(ndarray_ext([1], name, b"\x00" * 8), where=WHERE)


def test_ext_inside_an_ndarray_payload() -> None:
    nested = msgpack.ExtType(1, b"\x90")
    data = msgpack.packb(msgpack.ExtType(1, msgpack.packb([[1], "int8", nested])))
    at = data.index(msgpack.packb(nested))
    with corrupt(f"msgpack data has a nested ext at byte {at}: expected plain values"):
        decode(data, where=WHERE)


@pytest.mark.parametrize("code", [0, 5, 127, -1, -128])
def test_unknown_ext_code(code: int) -> None:
    fixext1 = b"\xd4" + code.to_bytes(1, "big", signed=True) + b"\xc0"  # msgpack refuses code < 0
    with corrupt(
        f"msgpack data has unknown ext code {code} at byte 1: expected 1 (ndarray), 2 (complex), "
        "3 (numpy scalar) or 4 (tuple); the file is damaged or was written by a newer writer"
    ):
        decode(b"\x91" + fixext1, where=WHERE)


def test_trailing_bytes() -> None:
    with corrupt(
        "msgpack data has 2 trailing bytes at byte 1: expected the data to end after one value"
    ):
        decode(msgpack.packb({}) + msgpack.packb(None) + b"\x00", where=WHERE)


@pytest.mark.parametrize(
    ("data", "found"),
    [
        (b"\x81\x90\xc0", "list"),  # {[]: None}
        (b"\x81\x80\xc0", "dict"),  # {{}: None}
        (b"\x81\x91\x01\xc0", "list"),
        (flax_pack([(1, [2])])[1:].join([b"\x81", b"\xc0"]), "tuple"),
        (flax_pack(np.zeros(1)).join([b"\x81", b"\xc0"]), "ndarray"),
    ],
)
def test_unhashable_map_key(data: bytes, found: str) -> None:
    with corrupt(f"msgpack data has a bad map key at byte 1: expected a str, found a {found}"):
        decode(data, where=WHERE)


def test_other_damage() -> None:
    with corrupt("msgpack data has byte 0xc1 at byte 1: msgpack never uses it"):
        decode(b"\x91\xc1", where=WHERE)
    with corrupt("msgpack data has a bad str at byte 1: expected UTF-8, found invalid start byte"):
        decode(b"\xa1\xff", where=WHERE)
    with corrupt("msgpack data has a bad complex at byte 0: expected [real, imag], found [1]"):
        decode(msgpack.packb(msgpack.ExtType(2, msgpack.packb([1]))), where=WHERE)
    with corrupt("msgpack data has a bad tuple at byte 0: expected an ext payload of exactly"):
        decode(msgpack.packb(msgpack.ExtType(4, msgpack.packb(1))), where=WHERE)
    # A tuple whose array runs past the end of its ext payload.
    with corrupt("msgpack data has a bad tuple at byte 1: expected an ext payload of exactly"):
        decode(msgpack.packb([msgpack.ExtType(4, b"\x92\x01"), 2]), where=WHERE)


@pytest.mark.parametrize(
    ("chunked", "message"),
    [
        (
            {"shape": {"0": 3}, "chunks": {"0": np.arange(2)}},
            "shape (3,) needs 3 elements, found 2",
        ),
        ({"shape": {"0": 2}, "chunks": {"1": np.arange(2)}}, 'expected "shape" and "chunks" maps'),
        ({"shape": {"0": 2}, "chunks": {}}, 'expected "shape" and "chunks" maps'),
        ({"shape": {"0": -2}, "chunks": {"0": np.arange(2)}}, 'expected "shape" and "chunks"'),
        ({"chunks": {"0": np.arange(2)}}, 'expected "shape" and "chunks" maps'),
        ({"shape": {"0": 2}, "chunks": {"0": [1, 2]}}, "expected chunks that are arrays of one"),
        (
            {"shape": {"0": 2}, "chunks": {"0": np.ones(1), "1": np.ones(1, np.int8)}},
            "expected chunks that are arrays of one dtype",
        ),
    ],
)
def test_bad_chunked_array(chunked: dict[str, Any], message: str) -> None:
    data = flax_pack({"__msgpack_chunked_array__": True, **chunked})
    with corrupt("msgpack data has a bad chunked array at byte 0: ") as error:
        decode(data, where=WHERE)
    assert message in str(error.value)
