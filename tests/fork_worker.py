"""Reads in forked children: `python -m tests.fork_worker FOLDER (used | fresh)`.

FOLDER holds `ckpt` (an Orbax checkpoint) and `model.safetensors`, both with an array
`w`, also served over HTTP from here. With `used`, this process reads them all through
lazyckpt first (tensorstore starts its threads), then forks a child per case; with
`fresh`, it forks before reading anything. For each case this prints one JSON line,
`{"name", "outcome"}`: what the child printed (`ok`, `lazyckpt:<Error>: <message>`,
`other:<Error>: <message>`), or `killed by signal N`, or `hung` (killed after 60 s).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import lazyckpt
from tests.hostile_server import HostileServer

_HUNG = 60.0


def _cases(folder: Path, url: str, opened: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    def read(tree: Any) -> None:
        np.testing.assert_array_equal(tree["w"][:3].get(), np.arange(3, dtype=np.float32))

    return {
        "orbax over HTTP, opened before the fork": lambda: read(opened["web_orbax"]),
        "orbax over HTTP, opened after": lambda: read(lazyckpt.open(f"{url}/ckpt")),
        "orbax on disk, opened before the fork": lambda: read(opened["orbax"]),
        "orbax on disk, opened after": lambda: read(lazyckpt.open(folder / "ckpt")),
        "orbax saved": lambda: lazyckpt.save(folder / f"saved_{os.getpid()}", {"x": np.ones(2)}),
        "safetensors on disk, opened before the fork": lambda: read(opened["safetensors"]),
        "safetensors on disk, opened before the fork, loaded": lambda: lazyckpt.load(
            opened["safetensors"]
        ),
        "safetensors over HTTP, opened before the fork": lambda: read(opened["web_safetensors"]),
        "safetensors over HTTP, opened after": lambda: read(
            lazyckpt.open(f"{url}/model.safetensors")
        ),
        "safetensors saved": lambda: lazyckpt.save(
            folder / f"saved_{os.getpid()}.safetensors", {"x": np.ones(2)}, format="safetensors"
        ),
    }


def _in_child(case: Callable[[], Any]) -> str:
    try:
        case()
    except lazyckpt.LazyckptError as error:
        return f"lazyckpt:{type(error).__name__}: {error}"
    except BaseException as error:  # noqa: BLE001 - what the test checks for
        return f"other:{type(error).__name__}: {error}"
    return "ok"


def _outcome(name: str, case: Callable[[], Any]) -> str:
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(reader)
        os.write(writer, _in_child(case).encode())
        os._exit(0)
    os.close(writer)
    end = time.monotonic() + _HUNG
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0:
        if time.monotonic() > end:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            return "hung"
        time.sleep(0.05)
    with os.fdopen(reader, "rb") as said:
        text = said.read().decode()
    if os.WIFSIGNALED(done[1]):
        return f"killed by signal {os.WTERMSIG(done[1])}"
    return text


def main(folder: Path, mode: str) -> None:
    with HostileServer() as server:
        for path in folder.rglob("*"):
            if path.is_file():
                server.put(str(path.relative_to(folder)), path.read_bytes())
        opened: dict[str, Any] = {}
        if mode == "used":
            opened = {
                "orbax": lazyckpt.open(folder / "ckpt"),
                "web_orbax": lazyckpt.open(f"{server.url}/ckpt"),
                "safetensors": lazyckpt.open(folder / "model.safetensors"),
                "web_safetensors": lazyckpt.open(f"{server.url}/model.safetensors"),
            }
            for tree in opened.values():
                lazyckpt.load(tree)
        for name, case in _cases(folder, server.url, opened).items():
            if mode == "fresh" and "before the fork" in name:
                continue
            print(json.dumps({"name": name, "outcome": _outcome(name, case)}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
