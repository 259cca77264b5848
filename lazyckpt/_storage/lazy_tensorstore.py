"""`ts`, the tensorstore module imported when first used: opening a local safetensors,
torch or NumPy file and its `summary` read no byte through tensorstore, so the modules on
that path take `ts` from here instead of importing tensorstore when they are imported."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ts"]


class _OnFirstUse:
    """Stands for the tensorstore module: its first attribute read imports it and copies
    its names in, so that later reads are plain attribute reads."""

    def __getattr__(self, name: str) -> Any:
        module = importlib.import_module("tensorstore")
        vars(self).update(vars(module))
        return getattr(module, name)  # (a submodule imported since, `ts.ocdbt`, comes here)


if TYPE_CHECKING:
    import tensorstore as ts
else:
    ts = _OnFirstUse()
