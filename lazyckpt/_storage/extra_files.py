"""Files written into a checkpoint beside its arrays, before it is published: the
Hugging Face folder's files (config, tokenizer) that `convert` carries."""

from __future__ import annotations

import os
from collections.abc import Mapping

from lazyckpt._storage import paths


def write_files(tmp: str, files: Mapping[str, bytes]) -> None:
    """Write `files` ({path relative to `tmp`: contents}) into the folder `tmp` that
    `publishing` yielded, so that they are published with the checkpoint or not at
    all: the files a conversion carries (`lazyckpt._safetensors.carried`)."""
    for name, data in files.items():
        target = paths.join(tmp, name)
        if paths.is_remote(tmp):
            paths.write_bytes(target, data)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as out:
                out.write(data)
