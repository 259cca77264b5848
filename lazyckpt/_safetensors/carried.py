"""The files of a Hugging Face model folder that `convert` carries with its weights.

`from_pretrained` needs more than the weights: `config.json`, the generation config,
the tokenizer's files, a chat template, the model's own code. `convert` carries
those, chosen by an allow-list (a full git clone of a Hub repository also holds
other formats' weights, hundreds of megabytes each: ONNX, TensorFlow, Rust, Core
ML), each file read whole before anything is written (so that a conversion in place
reads them before replacing them) and written into the checkpoint before it is
published (`lazyckpt._storage.publish.write_files`), so that the weights and these
files appear together or not at all. `config.json` is edited where the conversion
changed what it describes (`edited_config`).
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
from typing import Any

from lazyckpt._errors import CarriedFilesWarning, LazyckptError, StorageAccessError, warn
from lazyckpt._storage import paths
from lazyckpt._text import human_bytes

CARRIED_FOLDER = "huggingface"
"""Where an Orbax checkpoint converted from a Hugging Face folder keeps the folder's
other files: a subfolder, which Orbax's restore never reads."""

MAX_CARRIED_BYTES = 64 * 2**20
"""The largest file carried (each is held in memory once): the largest tokenizers
(`tokenizer.json` of a 256k vocabulary) are about 35 MB. A larger file is left
behind with a `CarriedFilesWarning`."""

CARRIED_PATTERNS = (
    "*.json",  # config, generation_config, tokenizer_config, preprocessor_config, ...
    "tokenizer*",  # tokenizer.json, tokenizer.model, tokenizer_config.json
    "*.model",  # sentencepiece (spiece.model, sentencepiece.bpe.model)
    "*.tiktoken",
    "*.jinja",  # chat templates
    "merges.txt",
    "vocab.*",
    "*.py",  # a trust_remote_code model's code, which config.json's auto_map names
    "README.md",
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY.md",
)
"""The files carried (`fnmatch` patterns, case-sensitive as the Hub's names are);
not a model's index (`*.index.json`), which the writer makes anew, nor hidden files.
Any other `*.txt` is left behind: `merges.txt` and `vocab.txt` are the tokenizers'
own, and other text files (a clone's `training_args.txt`, notes) are no part of
what `from_pretrained` reads."""

_NOT_CARRIED = ("*.index.json",)
_WEIGHTS = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".npz", ".npy",
    ".gguf", ".onnx", ".pkl", ".pickle",
)  # fmt: skip
_ORBAX_FILES = {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "commit_success.txt"}


def is_carried(name: str) -> bool:
    """Whether a file named `name` in a model folder is one `convert` carries."""
    if name.startswith("."):  # (hidden: `.gitattributes`, an editor's `.x.json.swp`)
        return False
    return any(fnmatch.fnmatchcase(name, p) for p in CARRIED_PATTERNS) and not any(
        fnmatch.fnmatchcase(name, p) for p in _NOT_CARRIED
    )


def carriable(source: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """The folder and names of the files to carry from `source`, a local folder: a
    Hugging Face model folder's that `is_carried` accepts, or those an Orbax
    checkpoint keeps in `CARRIED_FOLDER`. Top-level regular files only, each at most
    `MAX_CARRIED_BYTES`; no link that leads out of the folder, except, in a Hub
    cache's snapshot folder (`snapshot_download`'s), one into that repository's
    `blobs/`, where the cache keeps the files its links name."""
    text = os.fspath(source)
    if paths.is_remote(text) or not os.path.isdir(text):
        return "", []
    folder = os.path.realpath(text)
    names = os.listdir(folder)
    if CARRIED_FOLDER in names and _ORBAX_FILES & set(names):
        folder = os.path.join(folder, CARRIED_FOLDER)
        names = os.listdir(folder)
    elif _ORBAX_FILES & set(names) or not any(name.endswith(_WEIGHTS) for name in names):
        return "", []  # (an Orbax checkpoint's own files, or no model folder)
    blobs = _cache_blobs(folder)
    kept = []
    for name in sorted(names):
        if not is_carried(name):
            continue
        real = os.path.realpath(os.path.join(folder, name))
        inside = os.path.dirname(real) == folder or (
            blobs is not None and os.path.dirname(real) == blobs
        )
        if not inside or not os.path.isfile(real):
            continue
        size = os.path.getsize(real)
        if size > MAX_CARRIED_BYTES:
            warn(
                f"{os.path.join(text, name)} ({human_bytes(size)}) is not carried: larger "
                f"than {human_bytes(MAX_CARRIED_BYTES)}, no config or tokenizer file is as "
                "large. Copy it beside the converted weights yourself if it is needed",
                CarriedFilesWarning,
            )
            continue
        kept.append(name)
    return folder, kept


def _cache_blobs(folder: str) -> str | None:
    """`<repo>/blobs` when `folder` (resolved) is `<repo>/snapshots/<revision>` of a
    Hugging Face cache, else None."""
    snapshots = os.path.dirname(folder)
    if os.path.basename(snapshots) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return blobs if os.path.isdir(blobs) and not os.path.islink(blobs) else None


def read_carried(folder: str, names: list[str]) -> dict[str, bytes]:
    """The contents of the files `names` of `folder`, read now (before anything is
    written: a conversion in place replaces them)."""
    out = {}
    for name in names:
        where = os.path.join(folder, name)
        try:
            with open(where, "rb") as file:
                data = file.read(MAX_CARRIED_BYTES + 1)
        except OSError as error:
            kind = StorageAccessError if error.errno in (errno.EACCES, errno.EPERM) else None
            message = (
                f"{where}: cannot read it to carry it with the converted weights "
                f"({error.strerror}); nothing was written. Make it readable, or move it "
                "out of the folder"
            )
            raise (kind or LazyckptError)(message) from None
        if len(data) > MAX_CARRIED_BYTES:
            raise LazyckptError(
                f"{where} grew past {human_bytes(MAX_CARRIED_BYTES)} while the conversion "
                "read it; nothing was written. Convert again once it no longer changes"
            )
        out[name] = data
    return out


def edited_config(data: bytes, *, dequantized: bool, dtype: str | None) -> bytes:
    """`config.json` (`data`) fitted to weights that were
    dequantized (no `quantization_config`) or cast to `dtype` (its `torch_dtype`, or
    `dtype` as transformers 5 names it: whichever the source used); keys in their
    order, indented as transformers writes. Unchanged if neither applies, or if it is
    not a JSON object (then `from_pretrained` refuses it as it would the source)."""
    if not dequantized and dtype is None:
        return data
    try:
        config: Any = json.loads(data)
    except (ValueError, RecursionError):
        return data
    if not isinstance(config, dict):
        return data
    if dequantized:
        config.pop("quantization_config", None)
    if dtype is not None:
        keys = [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]
        for key in keys:
            config[key] = dtype
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()


def config_mismatch(options: list[str]) -> None:
    """Warn that a carried `config.json` may not describe weights whose names
    `options` (`select=`, `rename=`, `transform=`) changed."""
    warn(
        f"{' and '.join(options)} changed the set of tensor names, and config.json was "
        "carried unchanged: it may not describe the converted weights (their layers, "
        "their names). Check it before from_pretrained, or edit it to fit",
        CarriedFilesWarning,
    )


def carried_to(final: str, orbax: bool) -> str | None:
    """Where the carried files go, relative to the checkpoint: beside the weights of a
    safetensors model folder, in `CARRIED_FOLDER` of an Orbax checkpoint; nowhere for
    one `.safetensors` file."""
    if orbax:
        return CARRIED_FOLDER
    return None if final.endswith(".safetensors") else ""


def remote_model_folder(source: str | os.PathLike[str]) -> bool:
    """Whether `source` is a remote folder with a `config.json`, whose files
    `convert` does not carry."""
    text = os.fspath(source)
    if not (paths.is_remote(text) or text.startswith("hf://")) or text.endswith(_WEIGHTS):
        return False
    try:
        return paths.isfile(paths.join(paths.normalize(text), "config.json"))
    except LazyckptError:
        return False
