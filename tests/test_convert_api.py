"""`convert` as a program calls it: its result travels (pickle, copy), its rename
options match `rename`'s and their refusals name the option where it was called
(keyword or flag), safetensors metadata means the same from the API and the command
line, and a train state's leaves that are no arrays are named all at once."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import lazyckpt
from lazyckpt._cli.main import main
from tests.helpers import orbax_save


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A Hugging Face model folder: weights, and a config that conversions carry."""
    folder = tmp_path / "model"
    folder.mkdir()
    save_file(
        {"model.embed.weight": np.arange(8, dtype=np.float32).reshape(2, 4)},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    return folder


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "np") as file:
        return dict(file.metadata() or {})


def _names(path: Path) -> list[str]:
    with safe_open(str(path), "np") as file:
        return sorted(file.keys())


def test_the_result_of_convert_survives_pickle_and_copy(model_folder: Path, tmp_path: Path) -> None:
    out = lazyckpt.convert(model_folder, tmp_path / "copy", to="safetensors")
    assert out.carried == ("config.json",)
    # (pickle is how a ProcessPoolExecutor sends a result back)
    copies = [
        pickle.loads(pickle.dumps(out, protocol)) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)
    ]
    copies += [copy.copy(out), copy.deepcopy(out)]
    for again in copies:
        assert type(again) is type(out)
        assert again == out and again.carried == ("config.json",)
        assert str(again) == str(out)


def test_safetensors_metadata_keeps_format_pt_beside_the_callers_keys(
    model_folder: Path, tmp_path: Path
) -> None:
    converted = lazyckpt.convert(model_folder, tmp_path / "c.safetensors", metadata={"step": "3"})
    # (transformers refuses a file whose metadata has no format)
    assert _metadata(Path(converted)) == {"format": "pt", "step": "3"}
    tree = {"w": np.ones((4, 4), np.float32), "b": np.ones(4, np.float32)}
    saved = lazyckpt.save(tmp_path / "s.safetensors", tree, metadata={"step": "3"})
    assert _metadata(Path(saved)) == {"format": "pt", "step": "3"}
    # A sharded folder: every file, and the index, say so.
    sharded = Path(
        lazyckpt.save(
            tmp_path / "sharded", tree, format="safetensors", metadata={}, max_shard_size=64
        )
    )
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) == 2
    assert all(_metadata(file) == {"format": "pt"} for file in files)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert index["metadata"]["format"] == "pt"
    # A format the caller sets is kept, as is the default without metadata.
    own = lazyckpt.save(tmp_path / "np.safetensors", tree, metadata={"format": "np"})
    assert _metadata(Path(own)) == {"format": "np"}
    assert _metadata(Path(lazyckpt.save(tmp_path / "plain.safetensors", tree))) == {"format": "pt"}


def test_convert_passes_rename_missing_ok_and_dotted_and_names_them(
    model_folder: Path, tmp_path: Path
) -> None:
    rules = [("^nothing/", "x/")]
    with pytest.raises(lazyckpt.RenameError, match=r"pass rename_missing_ok=True") as caught:
        lazyckpt.convert(model_folder, tmp_path / "refused.safetensors", rename=rules)
    assert "pass missing_ok=True" not in str(caught.value)
    kept = lazyckpt.convert(
        model_folder, tmp_path / "kept.safetensors", rename=rules, rename_missing_ok=True
    )
    assert _names(Path(kept)) == ["model.embed.weight"]
    # Dotted: the rule sees `model.embed.weight`, not `model/embed/weight`.
    dotted = [(r"^model\.embed\.", "transformer.wte.")]
    moved = lazyckpt.convert(
        model_folder, tmp_path / "moved.safetensors", rename=dotted, rename_dotted=True
    )
    assert _names(Path(moved)) == ["transformer.wte.weight"]


def test_cli_convert_takes_rename_missing_ok_and_dotted_and_names_the_flag(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = tmp_path / "refused.safetensors"
    rule = ["--rename", "^nothing/", "x/"]
    assert main(["convert", str(model_folder), str(refused), *rule]) == 1
    message = capsys.readouterr().err
    assert "--rename-missing-ok" in message and "missing_ok=True" not in message, message
    assert not refused.exists()
    kept = tmp_path / "kept.safetensors"
    assert main(["convert", str(model_folder), str(kept), *rule, "--rename-missing-ok"]) == 0
    assert _names(kept) == ["model.embed.weight"]
    moved = tmp_path / "moved.safetensors"
    dotted = ["--rename", r"^model\.embed\.", "transformer.wte.", "--rename-dotted"]
    assert main(["convert", str(model_folder), str(moved), *dotted]) == 0
    assert _names(moved) == ["transformer.wte.weight"]


@pytest.fixture
def train_state(tmp_path: Path) -> Path:
    """A train state with leaves that are no arrays: a step, a run name, and a float
    per layer."""
    layers = {str(i): {"w": np.ones(2, np.float32), "scale": 0.5} for i in range(4)}
    state = {"params": {"layers": layers}, "step": 1000, "name": "run"}
    return orbax_save(tmp_path / "state", state)


def test_every_leaf_that_is_no_array_is_named_at_once_with_its_select_flag(
    train_state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "params.safetensors"
    with pytest.raises(lazyckpt.UnsavableError) as caught:
        lazyckpt.convert(train_state, out)
    message = str(caught.value)
    assert "6 leaves hold no array" in message, message
    assert "params/layers/{0..3}/scale (4 floats)" in message, message
    assert "step (the int 1000)" in message and "name (the str 'run')" in message, message
    flags = "--select '!name' --select '!params/layers/{0..3}/scale' --select '!step'"
    assert flags in message and "--metadata KEY=VALUE" in message, message
    assert "select=['!name', '!params/layers/{0..3}/scale', '!step']" in message, message
    assert not out.exists()
    # The flags it names are the ones that work.
    args = ["convert", str(train_state), str(out), *flags.replace("'", "").split()]
    assert main([*args, "--metadata", "step=1000"]) == 0, capsys.readouterr().err
    assert _names(out) == [f"params.layers.{i}.w" for i in range(4)]
    assert _metadata(out) == {"format": "pt", "step": "1000"}
