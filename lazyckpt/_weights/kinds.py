"""A weight file's format told by its first bytes: for a name that says none (flax's
`checkpoint_0`), and checked against a name that says one (a `.npy` holding a zip).

`open` reads a local file whose name has no suffix lazyckpt knows by what these
bytes say; a name that says one format over bytes of another is refused by name,
never read as the format its name claims.
"""

from __future__ import annotations

import re
import struct

from lazyckpt._errors import NotACheckpointError
from lazyckpt._safetensors.format import HEADER_LIMIT
from lazyckpt._storage import paths
from lazyckpt._storage.kvstore import Store
from lazyckpt._weights import flax_msgpack, npy, zips
from lazyckpt._weights import torch as torch_files
from lazyckpt._weights.files import File

HEAD = 64
"""Enough of a file to tell its format (a legacy torch file's pickled magic number
takes 15 bytes)."""

SAFETENSORS = "a safetensors file"
ZIP = "a zip archive (torch.save's or np.savez's)"
NPY = "a .npy file"
PICKLE = "a legacy torch.save file (a pickle)"
MSGPACK = "flax msgpack"

_NAMED: dict[str, tuple[str, ...]] = {
    ".safetensors": (SAFETENSORS,),
    ".npy": (NPY,),
    ".npz": (ZIP,),
    ".msgpack": (MSGPACK,),
    ".bin": (ZIP, PICKLE),  # (torch.save writes either, whatever the name)
    ".pt": (ZIP, PICKLE),
    ".pth": (ZIP, PICKLE),
}
_FLAX_STEP = re.compile(r"checkpoint_(\d+)")
"""The files flax's `checkpoints.save_checkpoint` writes (its default prefix)."""


def kind_of(head: bytes) -> str | None:
    """The format that a file's first bytes start, or None for none lazyckpt reads."""
    if head[:4] in (zips.MAGIC, zips.EMPTY):
        return ZIP
    if head[:6] == npy.MAGIC:
        return NPY
    if torch_files.is_legacy(head):
        return PICKLE
    # (before msgpack: a header's length can start with a byte of a msgpack map's)
    if len(head) > 8 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= HEADER_LIMIT:
        return SAFETENSORS
    if flax_msgpack.is_msgpack_map(head):
        return MSGPACK
    return None


def named(name: str) -> tuple[str, ...] | None:
    """The formats a file's name says it holds, or None where its suffix says none."""
    return next((kinds for suffix, kinds in _NAMED.items() if name.endswith(suffix)), None)


def check_named(path: str, head: bytes) -> None:
    """Refuse a file whose name says one format and whose first bytes another."""
    said, found = named(paths.basename(path)), kind_of(head)
    if said is None or found is None or found in said:
        return
    suffix = paths.basename(path).rsplit(".", 1)[-1]
    raise NotACheckpointError(
        f"{path} is named .{suffix}, for {' or '.join(said)}, but its first bytes are those "
        f"of {found}; lazyckpt reads a file as its name says. Rename it to what it holds "
        "(or give it a name without a suffix, which lazyckpt reads by its content)"
    )


def sniffed(path: str) -> str | None:
    """What the local file at `path` holds, by its first bytes: None for a folder, a
    remote path (a request more at each open) or bytes of no format lazyckpt reads."""
    if paths.is_remote(path) or not paths.isfile(path):
        return None
    return kind_of(_head(path))


def _head(path: str) -> bytes:
    folder, name = paths.dirname(path), paths.basename(path)
    return File(Store.open(folder, ocdbt=False, files=(name,)), name, path).head(HEAD)


def check_file(path: str) -> None:
    """`check_named` of the local file at `path` (remote files and folders pass)."""
    if not paths.is_remote(path) and paths.isfile(path):
        check_named(path, _head(path))


def flax_steps(folder: str) -> dict[int, str]:
    """The local files of flax's `save_checkpoint` in `folder` (`checkpoint_7`), by step;
    its folders (flax's Orbax checkpoints) are left to the Orbax reader, and a folder
    Orbax's reader also reads is told apart by `_orbax.layout.flax_files`."""
    if paths.is_remote(folder) or not paths.isdir(folder):
        return {}
    names = paths.listdir(folder)
    found = {}
    for name in names:
        match = _FLAX_STEP.fullmatch(name)
        if match and paths.isfile(paths.join(folder, name)):
            found[int(match.group(1))] = paths.join(folder, name)
    return found
