"""Weight files that are neither Orbax nor safetensors, opened lazily: PyTorch's
`torch.save` files (`pytorch_model.bin`, sharded with `pytorch_model.bin.index.json`;
`consolidated.00.pth`; `*.pt`), flax's msgpack (`flax_model.msgpack`) and NumPy's
`.npy` / `.npz`. A file is known by its first bytes; a name that says another format
is refused (`kinds`).

Each tensor is a `LazyArray` over the bytes where the file keeps it (`arrays`), read
by range like a safetensors tensor. Names nest as the writers meant them: a state
dict's dotted names by `.` (`model.layers.0.mlp.up_proj.weight`, as its safetensors
form), an `.npz`'s flattened names by `/` (big_vision's `params/img/...`), and the
keys of nested dicts as they are.

A leaf is named by its keys as text; where two leaves would share a name, the file is
refused naming both, never read with one left out (format notes, Names that collide):
keys `1` and `"1"` of one map, a dotted key and nested keys that spell it
(`{"a.b": x, "a": {"b": y}}`), and names of which one nests inside the other (`a` and
`a.b`: these open with `flat=True`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lazyckpt._array.nesting import PathClash, nested
from lazyckpt._errors import (
    CorruptCheckpointError,
    LazyckptError,
    NotACheckpointError,
    UnsupportedCheckpointError,
)
from lazyckpt._safetensors.format import parse_index
from lazyckpt._safetensors.read import check_plain
from lazyckpt._storage import paths
from lazyckpt._storage.folders import Site, hub_listed, register
from lazyckpt._storage.kvstore import Store, from_one_generation
from lazyckpt._weights import flax_msgpack, kinds, npy, zips
from lazyckpt._weights import torch as torch_files
from lazyckpt._weights.arrays import Stacked
from lazyckpt._weights.files import File
from lazyckpt._weights.unpickle import DType, Tensor

SUFFIXES = (".bin", ".pt", ".pth", ".npz", ".npy", ".msgpack")
"""The names of the files this package reads (a name without a suffix, by its content)."""
INDEXES = ("pytorch_model.bin.index.json", "flax_model.msgpack.index.json")
SINGLES = ("pytorch_model.bin", "flax_model.msgpack")
_HEAD = 1 << 16
_LIMIT = 64 << 20


def is_weights(path: str) -> bool:
    """Whether `path` is a weight file of these formats, or a folder of them."""
    if path.endswith(SUFFIXES) and paths.isfile(path):
        return True
    if paths.is_web(path) and not hub_listed(path):
        return _probed(path)  # (at each open: its files may have changed)
    if not paths.isdir(path):
        return False
    names = paths.listdir(path)
    return "_METADATA" not in names and any(_weight_name(name) for name in names)


def _probed(folder: str) -> bool:
    """Whether a folder over plain HTTP, which lists nothing, serves a model of these
    formats: a Hugging Face index (and the shards it names) or a single model file,
    then registered as its files."""
    names: tuple[str, ...] = ()
    for index in INDEXES:
        file = paths.join(folder, index)
        text = paths.read_text(file, _LIMIT)
        if text is not None:
            names = (index, *sorted(set(parse_index(file, text)[0].values())))
            break
    else:
        names = next(((s,) for s in SINGLES if paths.isfile(paths.join(folder, s))), ())
    if names:
        register(folder, Site(names, asked=(*names, *INDEXES, *SINGLES)))
    return bool(names)


def _weight_name(name: str) -> bool:
    return name.endswith(SUFFIXES) or name in INDEXES


def open_weights(path: str, *, flat: bool = False, keep_tied: bool = False) -> Any:
    """The tensors at `path` (a file, or a folder of them) as a tree of LazyArrays, or
    flat by name; with `keep_tied`, a Hugging Face model's tied names too."""
    folder, files, weight_map = _files(path)
    read = lambda generation: _read(folder, files, weight_map, generation, path, keep_tied)  # noqa: E731
    entries = from_one_generation(folder, read, files)
    by_name: dict[str, Any] = {}
    for _, leaf, name in entries:
        if name in by_name:  # (by name, not by leaf: two equal values are two leaves)
            raise UnsupportedCheckpointError(
                f"{path}: two leaves are named {name!r}: a key with a '.' or '/' in it and "
                "nested keys (or two files of one stem) spell the same name, and lazyckpt "
                "names each leaf by its key path as text; load the file with the library "
                "that wrote it and save them under distinct keys"
            )
        by_name[name] = leaf
    if flat:
        return by_name
    try:
        return nested(entries)
    except PathClash as clash:
        raise UnsupportedCheckpointError(
            f"{path}: names {clash.first!r} and {clash.second!r} cannot both be nested (one "
            "is a prefix of the other); open it with flat=True"
        ) from None


def _files(path: str) -> tuple[str, tuple[str, ...], dict[str, str] | None]:
    """The folder, the files to read (an index first), and the index's weight map."""
    if not paths.isdir(path):
        check_plain(path)
        return paths.dirname(path), (paths.basename(path),), None
    names = paths.listdir(path)
    for index in INDEXES:
        if index in names:
            file = paths.join(path, index)
            text = paths.read_text(file, _LIMIT)
            if text is None:
                raise CorruptCheckpointError(f"{file} cannot be read")
            weight_map, _ = parse_index(file, text)
            shards = sorted(set(weight_map.values()))
            missing = [shard for shard in shards if shard not in names]
            if missing:
                raise CorruptCheckpointError(
                    f"{file} names shards that are not in the folder: {missing[:5]}; "
                    "download or copy the model again"
                )
            for shard in shards:
                check_plain(paths.join(path, shard))
            return path, (index, *shards), weight_map
    for single in SINGLES:
        if single in names:
            check_plain(paths.join(path, single))
            return path, (single,), None
    found = sorted(name for name in names if name.endswith(SUFFIXES))
    if not found:
        raise NotACheckpointError(f"{path} holds no weight files ({', '.join(SUFFIXES)})")
    for name in found:
        check_plain(paths.join(path, name))
    return path, tuple(found), None


Entry = tuple[tuple[str, ...], object, str]


def _read(
    folder: str,
    files: tuple[str, ...],
    weight_map: dict[str, str] | None,
    generation: tuple[object, ...],
    path: str,
    keep_tied: bool,
) -> list[Entry]:
    store = Store.open(folder, ocdbt=False, generation=generation, files=files)
    shards = [name for name in files if name not in INDEXES]
    several = weight_map is None and len(shards) > 1
    # A Hugging Face model saves a tied weight (lm_head.weight, the embedding's
    # storage) under both names in .bin, once in safetensors: open it as the latter,
    # unless asked for every name.
    model = weight_map is not None or files == ("pytorch_model.bin",)
    tied: set[str] | None = set() if model and not keep_tied else None
    entries: list[Entry] = []
    for shard in shards:
        file = File(store, shard, paths.join(folder, shard))
        placed = _placed(weight_map, shard)
        for parts, leaf, name in _entries(file, tied, placed):
            if not placed(name):
                continue  # the index places it elsewhere (or nowhere), as transformers does
            if several:  # files without an index (consolidated.00.pth, ...): by file
                stem = shard.rsplit(".", 1)[0]
                parts, name = (stem, *parts), f"{stem}/{name}"
            entries.append((parts, leaf, name))
    if weight_map is not None:
        named = {name for _, _, name in entries} | (tied or set())
        missing = [name for name in weight_map if name not in named]
        if missing:
            raise CorruptCheckpointError(
                f"{path}: its index places {missing[:3]} ({len(missing)} in all) in shards "
                "that do not hold them; download or copy the model again"
            )
    return entries


def _placed(weight_map: dict[str, str] | None, shard: str) -> Callable[[str], bool]:
    """Whether the index (if any) places a name in `shard`."""
    if weight_map is None:
        return lambda name: True
    return lambda name: weight_map.get(name) == shard


def _entries(
    file: File, tied: set[str] | None = None, kept: Callable[[str], bool] = lambda name: True
) -> Iterator[Entry]:
    """Each tensor (and plain value) of one file: its key path, leaf and flat name.
    With `tied`, a torch tensor that is an earlier one again (the same elements of the
    same storage) is left out, its name added to `tied`, where the earlier one is
    `kept` (a name its index places in the file)."""
    file = file.knowing(_HEAD)
    head = file.known
    kinds.check_named(file.path, head)
    if head[:4] in (zips.MAGIC, zips.EMPTY):
        found = zips.members(file)
        if any(torch_files.fold(name).endswith("/data.pkl") for name in found):
            yield from _torch(file, torch_files.read_zip(file, found, head), tied, kept)
        else:
            for name, array in npy.open_npz(file, found, head).items():
                yield array.path, array, name  # type: ignore[misc]
    elif head[:6] == npy.MAGIC:
        name = file.key.rsplit(".", 1)[0]
        yield (name,), npy.open_npy(file, name, (name,)), name
    elif torch_files.is_legacy(head):
        yield from _torch(file, torch_files.read_legacy(file, head), tied, kept)
    elif flax_msgpack.is_msgpack_map(head):
        tree, end = flax_msgpack.read_flax(file)
        file.read(end - 1, end, "the end of its data")
        if file.read_short(end, 1):
            raise NotACheckpointError(
                f"{file.path} is not a flax msgpack file: bytes follow its map at byte {end} "
                "(flax writes one map and nothing after)"
            )
        if not tree:  # (`to_bytes({})`: no leaves, as `msgpack_restore` gives `{}`)
            return
        for parts, leaf in _walk(flax_msgpack.lazy_tree(file, tree), file.path):
            yield parts, leaf, "/".join(parts)
    else:
        raise NotACheckpointError(
            f"{file.path} is not a weight file lazyckpt reads: expected a torch.save file, "
            f"a .npy or .npz file or flax msgpack, found bytes {head[:8]!r}"
        )


def _torch(
    file: File, saved: torch_files.Saved, tied: set[str] | None, kept: Callable[[str], bool]
) -> Iterator[Entry]:
    seen: set[Tensor] = set()  # (the tensors of names kept)
    stacked = Stacked()
    for parts, leaf in _walk(saved.tree, file.path, split=True, limit=saved.nodes):
        name = ".".join(parts)
        if isinstance(leaf, Tensor):
            if tied is not None and leaf in seen:
                tied.add(name)
                continue
            if kept(name):
                seen.add(leaf)
            yield parts, torch_files.tensor(file, saved, leaf, name, parts, stacked), name
        elif isinstance(leaf, DType):  # a dtype saved as a value
            yield parts, leaf.numpy, name
        elif isinstance(leaf, _PLAIN):
            yield parts, leaf, name
        else:  # a bare storage, a class
            raise UnsupportedCheckpointError(
                f"{file.path}: {name!r} is a {type(leaf).__name__}, not a tensor or a plain "
                "value; lazyckpt reads tensors, numbers, strings and containers of them"
            )


_PLAIN = (str, int, float, complex, bool, bytes, type(None), dict, list, tuple)
_DEPTH = 64
"""The deepest a weight file's tree nests (state dicts nest a few levels)."""


def _walk(
    tree: Any, where: str, *, split: bool = False, limit: int = 1 << 62
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """The leaves of plain containers with their key paths, in order; a state dict's
    `.`-joined names split into their parts (`split`); empty containers are leaves.
    At most `limit` nodes: a pickle's memo lets a container hold another twice, so a
    small file can describe a tree too large to walk (or one that holds itself)."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        limit -= 1
        if limit < 0 or len(path) > _DEPTH:
            raise CorruptCheckpointError(
                f"{where}: its tree repeats or holds itself, or nests deeper than {_DEPTH} "
                "levels; the file is damaged or hostile, not a checkpoint"
            )
        children: list[tuple[tuple[str, ...], Any]] = []
        if isinstance(node, dict) and node:
            texts: dict[str, object] = {}
            for key, value in node.items():
                text = str(key)
                if text in texts:
                    raise _same_text(where, path, texts[text], key)
                texts[text] = key
                named = split and isinstance(key, str)
                children.append(((*path, *(key.split(".") if named else (text,))), value))
        elif isinstance(node, list | tuple) and node:
            children = [((*path, str(i)), value) for i, value in enumerate(node)]
        else:
            yield path or ("value",), node
        stack.extend(reversed(children))


def _same_text(where: str, path: tuple[str, ...], first: object, second: object) -> LazyckptError:
    """Two keys of one map that are one key once turned to text (`1` and `"1"`)."""
    at = f"of {'/'.join(path)!r}" if path else "at its top level"
    return UnsupportedCheckpointError(
        f"{where}: keys {first!r} ({type(first).__name__}) and {second!r} "
        f"({type(second).__name__}) {at} are both {str(first)!r} as text, and lazyckpt names "
        f"each leaf by its keys as text; load the file with the library that wrote it and "
        "save them under distinct keys"
    )
