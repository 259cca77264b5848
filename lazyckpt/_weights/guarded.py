"""Python's pickle opcodes run one by one, in Python, with those that could cost more
than the pickle's size, or change an object the caller made, checked first: what a
torch pickle's reader (`unpickle`) builds on. Which globals a pickle may name is the
subclass's `find_class`."""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any, ClassVar

_INT_BITS = 1024
"""The widest int read: Python cannot print one of over 4,300 digits (14,000 bits)."""


_INT_KEYS = (-(1 << 63), 1 << 64)
"""The int keys read (int64 and uint64). Python hashes an int modulo 2**61 - 1, so
wider keys can all hash alike, and a dict of n such keys takes n**2 steps to build
(40,000 keys, 8 s); of these, at most 16 share a hash."""


def _scalar_key(key: object) -> bool:
    """A key a state dict uses: a number, or a name of at most 1,024 characters. (A
    tuple's hash takes exponential time where its parts share, which a pickle's memo
    allows, and each long key again becomes a key path's parts.)"""
    if isinstance(key, int):  # (and bool)
        return _INT_KEYS[0] <= key < _INT_KEYS[1]
    return isinstance(key, float | type(None)) or (isinstance(key, str) and len(key) <= 1024)


class Guarded(pickle._Unpickler):
    """Python's own unpickler (its opcodes one by one, in Python), with the opcodes
    that could cost more than the pickle's size, or change an object lazyckpt made,
    checked first: dict keys and set items must be scalars (ints within 64 bits),
    ints at most `_INT_BITS` wide, and BUILD (an object's state set after it is
    made) applies only to an `OrderedDict`, whose attributes (a state dict's
    `_metadata`) are dropped. `path` names the file in errors."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # (the values since the last mark)

    def __init__(self, stream: io.BytesIO, path: str) -> None:
        super().__init__(stream)
        self.path = path

    def _keys(self, keys: Any) -> None:
        if not all(_scalar_key(k) for k in keys):
            wide = any(isinstance(k, int) and not _scalar_key(k) for k in keys)
            raise ValueError(
                "a dict key or set item that is an int wider than 64 bits (many such "
                "keys can share one hash)"
                if wide
                else "a dict key or set item that is not a plain value"
            )

    def _bounded(self) -> None:
        """The int just read, refused where it is wider than `_INT_BITS`."""
        if self.stack[-1].bit_length() > _INT_BITS:
            raise ValueError(f"an integer of more than {_INT_BITS} bits")

    def load_int(self) -> None:
        pickle._Unpickler.load_int(self)  # type: ignore[attr-defined]
        self._bounded()

    def load_long(self) -> None:
        pickle._Unpickler.load_long(self)  # type: ignore[attr-defined]
        self._bounded()

    def load_long1(self) -> None:
        pickle._Unpickler.load_long1(self)  # type: ignore[attr-defined]
        self._bounded()

    def load_long4(self) -> None:
        pickle._Unpickler.load_long4(self)  # type: ignore[attr-defined]
        self._bounded()

    def load_setitem(self) -> None:
        self._keys([self.stack[-2]])
        pickle._Unpickler.load_setitem(self)  # type: ignore[attr-defined]

    def load_setitems(self) -> None:
        self._keys(self.stack[::2])  # (since the mark: this unpickler starts a new stack)
        pickle._Unpickler.load_setitems(self)  # type: ignore[attr-defined]

    def load_dict(self) -> None:
        self._keys(self.stack[::2])  # (since the mark: this unpickler starts a new stack)
        pickle._Unpickler.load_dict(self)  # type: ignore[attr-defined]

    def load_additems(self) -> None:
        self._keys(self.stack)
        pickle._Unpickler.load_additems(self)  # type: ignore[attr-defined]

    def load_frozenset(self) -> None:
        self._keys(self.stack)
        pickle._Unpickler.load_frozenset(self)  # type: ignore[attr-defined]

    def load_build(self) -> None:
        state = self.stack.pop()
        if type(self.stack[-1]) is not collections.OrderedDict or not isinstance(state, dict):
            raise ValueError(f"state set on a {type(self.stack[-1]).__name__}")
        del state  # (a state dict's `_metadata`: versions of its modules)

    for _opcode, _name in (
        (pickle.SETITEM, "load_setitem"),
        (pickle.SETITEMS, "load_setitems"),
        (pickle.DICT, "load_dict"),
        (pickle.ADDITEMS, "load_additems"),
        (pickle.FROZENSET, "load_frozenset"),
        (pickle.BUILD, "load_build"),
        (pickle.INT, "load_int"),
        (pickle.LONG, "load_long"),
        (pickle.LONG1, "load_long1"),
        (pickle.LONG4, "load_long4"),
    ):
        dispatch[_opcode[0]] = locals()[_name]
