"""Python's pickle opcodes run one by one, in Python, with those that could cost more
than the pickle's size, or change an object the caller made, checked first: what a
torch pickle's reader (`unpickle`) builds on. Which globals a pickle may name is the
subclass's `find_class`."""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any, ClassVar


def _scalar_key(key: object) -> bool:
    """A key a state dict uses: a number, or a name of at most 1,024 characters. (A
    tuple's hash takes exponential time where its parts share, which a pickle's memo
    allows, and each long key again becomes a key path's parts.)"""
    return isinstance(key, int | float | bool | type(None)) or (
        isinstance(key, str) and len(key) <= 1024
    )


class Guarded(pickle._Unpickler):
    """Python's own unpickler (its opcodes one by one, in Python), with the opcodes
    that could cost more than the pickle's size, or change an object lazyckpt made,
    checked first: dict keys and set items must be scalars, and BUILD (an object's
    state set after it is made) applies only to an `OrderedDict`, whose attributes
    (a state dict's `_metadata`) are dropped. `path` names the file in errors."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # (the values since the last mark)

    def __init__(self, stream: io.BytesIO, path: str) -> None:
        super().__init__(stream)
        self.path = path

    def _keys(self, keys: Any) -> None:
        if not all(_scalar_key(k) for k in keys):
            raise ValueError("a dict key or set item that is not a plain value")

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
    ):
        dispatch[_opcode[0]] = locals()[_name]
