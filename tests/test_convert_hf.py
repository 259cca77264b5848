"""Converting a Hugging Face model folder keeps what `from_pretrained` needs, and the
convert command line as a user meets it (issue 66).

Torch is not installed here, and transformers 5 has no Flax or NumPy model classes,
so no test builds the model itself: the folder stands in for `save_pretrained`'s
(its tensor names, `{"format": "pt"}` metadata, config, generation config and a
tokenizer with a chat template), and the converted folder is checked as
`from_pretrained` reads it: `AutoConfig`, `GenerationConfig` and `AutoTokenizer`
load from it, and its safetensors hold the source's tensors under the same names.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import lazyckpt
from lazyckpt._cli.main import main
from tests.helpers import orbax_save

transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
CARRIED = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


def _gpt2_weights(config: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT2LMHeadModel's state dict as `save_pretrained` writes it (the tied lm_head
    left out), with random values."""
    rng = np.random.default_rng(seed)
    d, v, p = config.n_embd, config.vocab_size, config.n_positions
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (v, d),
        "transformer.wpe.weight": (p, d),
    }
    for i in range(config.n_layer):
        h = f"transformer.h.{i}"
        shapes |= {
            f"{h}.ln_1.weight": (d,), f"{h}.ln_1.bias": (d,),
            f"{h}.attn.c_attn.weight": (d, 3 * d), f"{h}.attn.c_attn.bias": (3 * d,),
            f"{h}.attn.c_proj.weight": (d, d), f"{h}.attn.c_proj.bias": (d,),
            f"{h}.ln_2.weight": (d,), f"{h}.ln_2.bias": (d,),
            f"{h}.mlp.c_fc.weight": (d, 4 * d), f"{h}.mlp.c_fc.bias": (4 * d,),
            f"{h}.mlp.c_proj.weight": (4 * d, d), f"{h}.mlp.c_proj.bias": (d,),
        }  # fmt: skip
    shapes |= {"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.fixture
def pretrained(tmp_path: Path) -> Path:
    """A tiny GPT-2 folder as `save_pretrained` leaves it, with a tokenizer beside it
    (WordLevel, built offline) and a chat template; plus what must not be carried: a
    hidden file, another weights file and a link to a file outside the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    config.save_pretrained(folder)
    transformers.GenerationConfig(max_new_tokens=7, do_sample=False).save_pretrained(folder)
    vocab = {"[UNK]": 0, "<user>": 1, "hello": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", chat_template=CHAT_TEMPLATE
    ).save_pretrained(folder)
    save_file(_gpt2_weights(config), str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 the same weights, for torch")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (tmp_path / "secret.txt").write_text("outside the folder")
    os.symlink(tmp_path / "secret.txt", folder / "notes.txt")
    assert {p.name for p in folder.iterdir()} >= CARRIED
    return folder


def _loads_as_pretrained(folder: Path, source: Path, dtype: np.dtype[Any]) -> None:
    """What `from_pretrained` reads of `folder` is the source's: config, generation
    config, tokenizer with its chat template; the tensors by name, cast to `dtype`."""
    config = transformers.AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.n_layer, config.n_embd) == ("gpt2", 2, 32)
    assert transformers.GenerationConfig.from_pretrained(folder).max_new_tokens == 7
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer("hello world")["input_ids"] == [2, 3]
    with safe_open(str(folder / "model.safetensors"), "np") as file:
        assert file.metadata() == {"format": "pt"}  # (what transformers loads)
    written, expected = (
        load_file(str(folder / "model.safetensors")),
        load_file(str(source / "model.safetensors")),
    )
    assert written.keys() == expected.keys()
    for name, values in expected.items():
        assert written[name].dtype == dtype, name
        np.testing.assert_array_equal(written[name], values.astype(dtype), err_msg=name)


def test_hugging_face_folder_to_safetensors_carries_config_and_tokenizer(
    pretrained: Path, tmp_path: Path
) -> None:
    out = lazyckpt.convert(pretrained, tmp_path / "bf16", to="safetensors", dtype="bfloat16")
    assert {p.name for p in Path(out).iterdir()} >= CARRIED
    left = {".gitattributes", "notes.txt", "model.safetensors", "pytorch_model.bin"}
    assert set(out.carried) == {p.name for p in pretrained.iterdir()} - left
    assert set(out.carried) >= CARRIED
    assert {p.name for p in Path(out).iterdir()} == {"model.safetensors", *out.carried}
    _loads_as_pretrained(Path(out), pretrained, np.dtype(ml_dtypes.bfloat16))


def test_through_orbax_and_back_keeps_the_files_orbax_ignores(
    pretrained: Path, tmp_path: Path
) -> None:
    import orbax.checkpoint as ocp

    orbax = lazyckpt.convert(pretrained, tmp_path / "orbax")
    assert set(os.listdir(Path(orbax) / "huggingface")) >= CARRIED
    restored = ocp.StandardCheckpointer().restore(orbax)  # Orbax reads past them
    source = load_file(str(pretrained / "model.safetensors"))
    np.testing.assert_array_equal(
        restored["transformer"]["h"]["1"]["mlp"]["c_fc"]["weight"],
        source["transformer.h.1.mlp.c_fc.weight"],
    )
    back = lazyckpt.convert(orbax, tmp_path / "back", to="safetensors")
    assert set(back.carried) >= CARRIED
    assert not (Path(back) / "huggingface").exists()
    _loads_as_pretrained(Path(back), pretrained, np.dtype(np.float32))


def test_cli_convert_says_which_files_it_carried(
    pretrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(pretrained), str(tmp_path / "out"), "--to", "safetensors"]) == 0
    out = capsys.readouterr().out
    assert "carried" in out and "config.json" in out and "chat_template.jinja" in out
    plan = lazyckpt.convert(pretrained, tmp_path / "again", to="safetensors", dry_run=True)
    assert set(plan.carried) >= CARRIED and "would carry" in str(plan)


def test_max_shard_size_for_one_file_is_refused_by_name(pretrained: Path, tmp_path: Path) -> None:
    one = tmp_path / "one.safetensors"
    with pytest.raises(lazyckpt.ArgumentError, match=r"max_shard_size.*one \.safetensors file"):
        lazyckpt.convert(pretrained, one, max_shard_size="1MB")
    with pytest.raises(lazyckpt.ArgumentError, match=r"max_shard_size.*one \.safetensors file"):
        lazyckpt.save(one, {"w": np.ones(4, np.float32)}, max_shard_size="1MB")
    assert not one.exists()


@pytest.fixture
def train_state(tmp_path: Path) -> Path:
    """An Optax Adam train state with its step, saved by Orbax."""
    import jax.numpy as jnp
    import optax

    params = {"dense": {"kernel": jnp.ones((4, 2)), "bias": jnp.zeros(2)}}
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": 1000}
    return orbax_save(tmp_path / "state", state)


def test_cli_keeps_a_train_state_step_as_safetensors_metadata(
    train_state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "params.safetensors"
    assert main(["convert", str(train_state), str(out)]) == 1  # the step is no tensor
    message = capsys.readouterr().err
    assert "step" in message and "--metadata KEY=VALUE" in message
    args = [str(train_state), str(out), "--select", "params/**", "--metadata", "step=1000"]
    assert main(["convert", *args]) == 0
    with safe_open(str(out), "np") as file:
        assert file.metadata() == {"format": "pt", "step": "1000"}
        assert sorted(file.keys()) == ["params.dense.bias", "params.dense.kernel"]


def test_convert_progress_is_labelled_convert_and_counts_bytes_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = lazyckpt.save(tmp_path / "f32", {"w": np.ones((32, 32), np.float32)})  # 4 KiB
    capsys.readouterr()
    lazyckpt.convert(source, tmp_path / "bf16", dtype="bfloat16", progress=True)
    bar = capsys.readouterr().err
    # 2 KiB written (read and written together would be 6 KiB).
    assert "lazyckpt convert" in bar and "2.00k/2.00k" in bar, bar
    assert "lazyckpt save" not in bar


def test_traceback_after_the_verb_shows_the_traceback(tmp_path: Path) -> None:
    with pytest.raises(lazyckpt.LazyckptError):
        main(["inspect", str(tmp_path / "missing"), "--traceback"])


def test_cli_dry_run_onto_an_existing_destination_reports_the_plan(
    train_state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = lazyckpt.convert(train_state, tmp_path / "params", select="params/**")
    before = sorted(os.listdir(out))
    capsys.readouterr()
    assert main(["convert", str(train_state), out, "--select", "params/**", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "would write" in printed and "kernel" in printed
    assert "already exists" in printed and "--overwrite" in printed
    assert sorted(os.listdir(out)) == before
    assert json.loads((Path(out) / "_CHECKPOINT_METADATA").read_text())


def _no_space_for(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing a file named `name` fails as on a full disk (every other write passes)."""
    import builtins

    real = builtins.open

    def full(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(os.fspath(file)) == name and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)


def test_a_carried_file_that_fails_to_write_publishes_nothing(
    pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    with monkeypatch.context() as patched:
        _no_space_for("tokenizer.json", patched)
        with pytest.raises(
            lazyckpt.CheckpointWriteError, match=r"tokenizer\.json failed \(No space left"
        ):
            lazyckpt.convert(pretrained, out, to="safetensors")
    assert not out.exists()  # (not the weights alone, which a retry would refuse)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []
    done = lazyckpt.convert(pretrained, out, to="safetensors")  # the retry
    _loads_as_pretrained(Path(done), pretrained, np.dtype(np.float32))


def test_a_folder_converted_in_place_keeps_its_files_and_says_its_dtype(
    pretrained: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    shutil.copytree(pretrained, source, symlinks=True)
    out = lazyckpt.convert(
        pretrained, pretrained, dtype="bfloat16", to="safetensors", overwrite=True
    )
    assert set(out.carried) >= CARRIED
    _loads_as_pretrained(Path(out), source, np.dtype(ml_dtypes.bfloat16))
    config = json.loads((pretrained / "config.json").read_text())
    before = json.loads((source / "config.json").read_text())
    key = "dtype" if "dtype" in before else "torch_dtype"  # (as the source spelled it)
    assert config[key] == "bfloat16"
    assert list(config) == list(before) + ([] if key in before else [key])


def test_a_full_git_clone_carries_only_what_from_pretrained_reads(
    pretrained: Path, tmp_path: Path
) -> None:
    # Other formats' weights a Hub repository's clone holds (gpt2's), sparse.
    others = ["rust_model.ot", "64.tflite", "model.ckpt.data-00000-of-00001", "saved_model.pb"]
    others += ["model.onnx_data", "coreml.mlmodel"]
    for name in [*others, "huge_tokens.json"]:
        with open(pretrained / name, "wb") as file:
            file.truncate((300 if name != "huge_tokens.json" else 65) * 2**20)
    (pretrained / "merges.txt").write_text("#version: 0.2\n")
    (pretrained / "LICENSE").write_text("MIT\n")
    with pytest.warns(lazyckpt.CarriedFilesWarning, match=r"huge_tokens\.json \(65\.0 ?Mi?B\)"):
        out = lazyckpt.convert(pretrained, tmp_path / "out", to="safetensors")
    assert set(out.carried) == CARRIED | {"merges.txt", "LICENSE"}
    assert {p.name for p in Path(out).iterdir()} == {"model.safetensors", *out.carried}


def test_a_hub_cache_snapshot_carries_its_files(pretrained: Path, tmp_path: Path, hub: Any) -> None:
    import huggingface_hub as hh

    names = [*sorted(CARRIED), "model.safetensors"]
    hub.commit("org/gpt2", {name: (pretrained / name).read_bytes() for name in names})
    snapshot = Path(hh.snapshot_download("org/gpt2"))
    assert (snapshot / "config.json").is_symlink()  # (links into ../../blobs)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    os.symlink(outside, snapshot / "extra_config.json")  # a link elsewhere: not carried
    out = lazyckpt.convert(snapshot, tmp_path / "out", to="safetensors")
    assert set(out.carried) == CARRIED
    _loads_as_pretrained(Path(out), pretrained, np.dtype(np.float32))


def test_a_remote_model_folder_says_it_carries_nothing(
    pretrained: Path, tmp_path: Path, hub: Any
) -> None:
    names = [*sorted(CARRIED), "model.safetensors"]
    hub.commit("org/gpt2", {name: (pretrained / name).read_bytes() for name in names})
    with pytest.warns(lazyckpt.CarriedFilesWarning, match=r"hf://org/gpt2 .* not carried"):
        out = lazyckpt.convert("hf://org/gpt2", tmp_path / "out", to="safetensors")
    assert out.carried == () and not (Path(out) / "config.json").exists()


def test_a_dequantized_model_carries_a_config_without_quantization(tmp_path: Path) -> None:
    folder = tmp_path / "fp8"
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=10, dtype="bfloat16", quantization_config=fp8
    ).save_pretrained(folder)
    rng = np.random.default_rng(0)
    save_file(
        {
            "transformer.h.0.mlp.c_fc.weight": rng.normal(0, 1, (200, 300)).astype(
                ml_dtypes.float8_e4m3fn
            ),
            "transformer.h.0.mlp.c_fc.weight_scale_inv": np.full((2, 3), 0.5, np.float32),
        },
        str(folder / "model.safetensors"),
        {"format": "pt"},
    )
    before = json.loads((folder / "config.json").read_text())
    assert before["quantization_config"]["quant_method"] == "fp8"
    out = lazyckpt.convert(folder, tmp_path / "dense", dequantize=True, dtype="float32")
    text = (Path(out) / "huggingface" / "config.json").read_text()
    config = json.loads(text)
    key = "dtype" if "dtype" in before else "torch_dtype"
    assert "quantization_config" not in config and config[key] == "float32"
    assert list(config) == [k for k in before if k != "quantization_config"]
    assert text.startswith('{\n  "')  # (indented by 2, as transformers writes)
    back = lazyckpt.convert(out, tmp_path / "hf", to="safetensors")
    assert not hasattr(transformers.AutoConfig.from_pretrained(back), "quantization_config")
    assert hasattr(transformers.AutoConfig.from_pretrained(folder), "quantization_config")


@pytest.mark.parametrize(
    ("option", "value"),
    [("select", "transformer/h/0/**"), ("rename", [(r"^transformer/", "model/")])],
)
def test_select_or_rename_warns_that_the_config_may_not_fit(
    pretrained: Path, tmp_path: Path, option: str, value: Any
) -> None:
    with pytest.warns(lazyckpt.CarriedFilesWarning, match=rf"{option}= changed the set"):
        out = lazyckpt.convert(pretrained, tmp_path / "out", to="safetensors", **{option: value})
    assert "config.json" in out.carried
