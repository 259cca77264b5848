"""PyTorch's `torch.save` files, opened without torch: the zip format and the legacy
one, Hugging Face's sharded `pytorch_model.bin`, and hostile pickles refused unrun.

The files under tests/fixtures/torch were written by torch itself
(`tests/fixtures/torch/make.py`, versions in VERSIONS.txt); each tensor's bytes as
torch read them back are in `state_expected.npz`, and what torch.load gives for the
views (conjugate, negative, expanded, overlapping...) in `views_expected.npz`."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import lazyckpt
from tests.helpers import expect, run_cases

FIXTURES = Path(__file__).parent / "fixtures" / "torch"
DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _expected(folder: Path) -> dict[str, np.ndarray]:
    """torch's own values of `state()`, from the bytes it wrote out beside the files."""
    shapes = json.loads((folder / "state_expected.json").read_text())
    raw = np.load(folder / "state_expected.npz")
    out = {}
    for name, (shape, dtype) in shapes.items():
        out[name] = raw[name].view(DTYPES.get(dtype, np.dtype(dtype))).reshape(shape)
    return out


def _check_state(path: Path, expected: dict[str, np.ndarray]) -> None:
    tree = lazyckpt.open(path)
    assert sorted(tree) == sorted(expected)
    for name, want in expected.items():
        array = tree[name]
        assert isinstance(array, lazyckpt.LazyArray), name
        assert (array.shape, array.dtype) == (want.shape, want.dtype), name
        got = np.asarray(array.get())
        assert got.tobytes() == want.tobytes(), name


def _loaded(folder: Path, stem: str) -> dict[str, Any]:
    """What torch.load read from `stem`.pt (make.py's `loaded`): each tensor's values,
    float4 pairs as their two codes (low nibble first, as safetensors' F4), and each
    Python complex value."""
    shapes = json.loads((folder / f"{stem}_expected.json").read_text())
    raw = np.load(folder / f"{stem}_expected.npz")
    out: dict[str, Any] = {}
    for name, (shape, dtype) in shapes.items():
        if dtype == "complex":
            out[name] = complex(raw[name].view(np.complex128)[0])
        elif dtype == "float4_e2m1fn_x2":
            pairs = raw[name].reshape(shape)
            codes = np.stack([pairs & 0x0F, pairs >> 4], axis=-1).reshape(*shape[:-1], -1)
            out[name] = codes.view(ml_dtypes.float4_e2m1fn)
        else:
            out[name] = raw[name].view(DTYPES.get(dtype, np.dtype(dtype))).reshape(shape)
    return out


def _check_loaded(path: Path, expected: dict[str, Any]) -> None:
    tree = lazyckpt.open(path)
    assert sorted(tree) == sorted(expected)
    for name, want in expected.items():
        found = tree[name]
        if isinstance(want, complex):  # (NaN parts compared by their bits)
            assert type(found) is complex, name
            assert np.array([found]).tobytes() == np.array([want]).tobytes(), name
            continue
        assert (found.shape, found.dtype) == (want.shape, want.dtype), name
        assert np.asarray(found.get()).tobytes() == want.tobytes(), name
        for index in ((slice(1, None),), (Ellipsis, -1), (Ellipsis, slice(None, None, -2))):
            if want.ndim:
                assert np.asarray(found[index].get()).tobytes() == want[index].tobytes(), name


@pytest.mark.parametrize("stem", ["views", "views_legacy"])
def test_views_read_as_torch_load_gives_them(stem: str) -> None:
    # Conjugate and negative bits (x.conj(), x.conj().imag, torch._neg_view, and
    # metadata {'neg': False}, which torch sets too), a dtype in the backward hooks'
    # place (torch takes the storage's), expanded tensors (stride 0), unfold's
    # windows and other overlapping or interleaved strides, float4 pairs, Python
    # complex values: as torch.load gives them, whole and sliced.
    _check_loaded(FIXTURES / f"{stem}.pt", _loaded(FIXTURES, stem))


def test_views_read_only_the_elements_they_repeat() -> None:
    tree = lazyckpt.open(FIXTURES / "views.pt")
    with lazyckpt.measure() as cost:
        lazyckpt.load(tree["expanded"])  # (4, 3) of 3 stored elements
    assert cost.bytes_read == 3 * 4
    with lazyckpt.measure() as cost:
        lazyckpt.load(tree["windows"][:, 0])  # the first of each window: 7 elements
    assert cost.bytes_read == 7 * 4


def test_float4_pairs_read_as_their_safetensors_form(tmp_path: Path) -> None:
    # The safetensors library writes torch's float4_e2m1fn_x2 bytes as F4, its shape
    # in codes: from the bytes torch.load gave, both files read the same codes.
    import safetensors

    shape = json.loads((FIXTURES / "views_expected.json").read_text())["float4"][0]
    raw = np.load(FIXTURES / "views_expected.npz")["float4"]
    path = tmp_path / "f4.safetensors"
    spec = safetensors.TensorSpec(
        dtype="float4_e2m1fn_x2", shape=shape, data_ptr=raw.ctypes.data, data_len=raw.nbytes
    )
    safetensors.serialize_file({"w": spec}, str(path))
    f4 = lazyckpt.open(path)["w"]
    pairs = lazyckpt.open(FIXTURES / "views.pt")["float4"]
    assert (f4.shape, f4.dtype) == (pairs.shape, pairs.dtype)
    assert np.asarray(f4.get()).tobytes() == np.asarray(pairs.get()).tobytes()


@pytest.mark.parametrize("name", ["state.pt", "state_legacy.pt", "state_legacy_p4.pt"])
def test_every_layout_and_dtype_reads_as_torch_wrote_it(name: str) -> None:
    # Shared storages (tied, rows at an offset), a transposed and a permuted tensor,
    # strided slices (qkv split, w[::2, 1::3]), a Parameter, 0-d, empty, bfloat16,
    # float8, unsigned and complex: in the zip format and the legacy one.
    _check_state(FIXTURES / name, _expected(FIXTURES))


def test_views_of_a_strided_tensor_read_only_their_rows() -> None:
    tree = lazyckpt.open(FIXTURES / "state.pt")
    want = _expected(FIXTURES)
    for name in ("transposed", "every_other", "k", "permuted", "stepped", "channels_last"):
        array = tree[name]
        np.testing.assert_array_equal(array[1:3].get(), want[name][1:3])
        np.testing.assert_array_equal(array[..., -1].get(), want[name][..., -1])


def test_a_training_checkpoint_nests_by_its_keys_and_keeps_plain_values() -> None:
    tree = lazyckpt.open(FIXTURES / "checkpoint.pth")
    assert tree["model"]["0"]["weight"].shape == (8, 4)
    assert tree["optimizer"]["state"]["0"]["exp_avg"].shape == (8, 4)
    assert tree["optimizer"]["param_groups"]["0"]["lr"] == 0.001
    assert (tree["epoch"], tree["best_loss"], tree["name"]) == (3, 0.25, "run-7")
    flat = lazyckpt.open(FIXTURES / "checkpoint.pth", flat=True)
    assert flat["model.2.bias"].shape == (2,)
    params = lazyckpt.select(tree, "model/**")
    assert sorted(dict(lazyckpt.leaves(params))) == [
        "model/0/bias",
        "model/0/weight",
        "model/2/bias",
        "model/2/weight",
    ]


def test_a_sharded_bin_folder_opens_as_its_safetensors_form() -> None:
    # transformers saved the same model both ways; the tied lm_head.weight is in the
    # .bin index and files, and left out of safetensors: it opens as the latter.
    bin_tree = lazyckpt.open(FIXTURES / "gpt2_bin", flat=True)
    reference = load_file(FIXTURES / "gpt2_safetensors" / "model.safetensors")
    assert sorted(bin_tree) == sorted(reference)
    for name, want in reference.items():
        np.testing.assert_array_equal(bin_tree[name].get(), want, err_msg=name)
    nested = lazyckpt.open(FIXTURES / "gpt2_bin")
    assert nested["transformer"]["h"]["1"]["attn"]["c_attn"]["weight"].shape == (32, 96)


def test_a_few_rows_read_a_few_rows() -> None:
    wte = lazyckpt.open(FIXTURES / "gpt2_bin")["transformer"]["wte"]["weight"]
    with lazyckpt.measure() as cost:
        rows = lazyckpt.load(wte[10:13])
    assert cost.bytes_read == 3 * 32 * 4
    reference = load_file(FIXTURES / "gpt2_safetensors" / "model.safetensors")
    np.testing.assert_array_equal(rows, reference["transformer.wte.weight"][10:13])
    transposed = lazyckpt.open(FIXTURES / "state.pt")["transposed"]  # (8, 6), rows strided
    with lazyckpt.measure() as cost:
        lazyckpt.load(transposed[:, 2])  # one stored row of the (6, 8) storage
    assert cost.bytes_read == 8 * 4


@pytest.mark.parametrize("to", ["safetensors", "orbax"])
def test_convert_a_bin_folder_streams_to_what_transformers_wrote(tmp_path: Path, to: str) -> None:
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lazyckpt._cli.main",
            "convert",
            str(FIXTURES / "gpt2_bin"),
            str(out),
            "--to",
            to,
            "--memory-budget",
            "64KiB",
        ],
        check=True,
        capture_output=True,
    )
    converted = lazyckpt.open(out, flat=True)
    reference = load_file(FIXTURES / "gpt2_safetensors" / "model.safetensors")
    names = {name.replace("/", "."): leaf for name, leaf in lazyckpt.leaves(converted)}
    assert sorted(names) == sorted(reference)
    for name, want in reference.items():
        np.testing.assert_array_equal(names[name].get(), want, err_msg=name)
    if to == "safetensors":  # the safetensors library reads lazyckpt's file as its own
        assert sorted(load_file(out / "model.safetensors")) == sorted(reference)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (a heavy, optional check)")
def test_fixtures_regenerate_and_transformers_loads_the_conversion(tmp_path: Path) -> None:
    # With torch installed: what torch writes today reads as torch reads it, and
    # transformers loads the converted safetensors model with the same logits.
    subprocess.run(
        [sys.executable, str(FIXTURES / "make.py"), str(tmp_path)], check=True, capture_output=True
    )
    for name in ("state.pt", "state_legacy.pt", "state_legacy_p4.pt"):
        _check_state(tmp_path / name, _expected(tmp_path))
    for stem in ("views", "views_legacy"):
        _check_loaded(tmp_path / f"{stem}.pt", _loaded(tmp_path, stem))
    lazyckpt.convert(tmp_path / "gpt2_bin", tmp_path / "st", to="safetensors")
    shutil.copy(tmp_path / "gpt2_bin" / "config.json", tmp_path / "st")
    import torch  # type: ignore[import-not-found, unused-ignore]
    from transformers import GPT2LMHeadModel  # type: ignore[import-not-found, unused-ignore]

    ids = torch.arange(12)[None] % 96
    before = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2_bin").eval()(ids).logits
    after = GPT2LMHeadModel.from_pretrained(tmp_path / "st").eval()(ids).logits
    assert torch.equal(before, after)


class _Call:
    """Pickles as a call of `function(*args)`: what a hostile file hides in a pickle."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.function, self.args


def _torch_zip(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


def _legacy(path: Path, payload: bytes) -> Path:
    head = io.BytesIO()
    for value in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(value, head, protocol=2)
    path.write_bytes(head.getvalue() + payload + pickle.dumps([], protocol=2))
    return path


@pytest.mark.parametrize("form", [_torch_zip, _legacy], ids=["zip", "legacy"])
@pytest.mark.parametrize(
    ("function", "shown"),
    [
        (os.system, "posix.system"),
        (eval, "builtins.eval"),
        (subprocess.Popen, "subprocess.Popen"),
        (shutil.rmtree, "shutil.rmtree"),
    ],
    ids=["os.system", "eval", "subprocess", "rmtree"],
)
@pytest.mark.parametrize("protocol", [2, 4])
def test_a_hostile_pickle_is_refused_and_never_runs(
    tmp_path: Path, form: Any, function: Any, shown: str, protocol: int
) -> None:
    marker = tmp_path / "ran"
    victim = tmp_path / "victim"
    victim.mkdir()
    args = {
        "posix.system": (f"touch {marker}",),
        "builtins.eval": (f"open({str(marker)!r}, 'w')",),
        "subprocess.Popen": (["touch", str(marker)],),
        "shutil.rmtree": (str(victim),),
    }[shown]
    # The call hides inside a state dict, after a plain tensor-free entry.
    payload = pickle.dumps({"fine": 1, "w": _Call(function, *args)}, protocol=protocol)
    path = form(tmp_path / "model.bin", payload)
    with pytest.raises(lazyckpt.UnsafePickleError, match=rf"model\.bin.*{shown.split('.')[-1]}"):
        lazyckpt.open(path)
    assert not marker.exists() and victim.exists()


def test_a_whole_module_saved_with_torch_save_is_refused_by_name(tmp_path: Path) -> None:
    # torch.save(model) pickles the module's class as a global, then its state.
    payload = b"\x80\x02ctorch.nn.modules.linear\nLinear\n)\x81}b."
    path = _torch_zip(tmp_path / "model.pt", payload)
    with pytest.raises(lazyckpt.UnsafePickleError, match=r"torch\.nn\.modules\.linear\.Linear"):
        lazyckpt.open(path)


def test_damaged_and_foreign_files_say_what_is_wrong(tmp_path: Path) -> None:
    data = (FIXTURES / "state.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"cut\.pt.*zip end record"):
        lazyckpt.open(cut)
    legacy = (FIXTURES / "state_legacy.pt").read_bytes()
    short = tmp_path / "short.pt"
    short.write_bytes(legacy[:-10])
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"short\.pt.*too short"):
        lazyckpt.open(short)
    repacked = tmp_path / "repacked.pt"
    with (
        zipfile.ZipFile(FIXTURES / "state.pt") as source,
        zipfile.ZipFile(repacked, "w", zipfile.ZIP_DEFLATED) as target,
    ):
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match=r"repacked\.pt.*compressed"):
        lazyckpt.open(repacked)
    script = tmp_path / "script.pt"
    with zipfile.ZipFile(script, "w") as archive:
        archive.writestr("m/data.pkl", pickle.dumps({}))
        archive.writestr("m/constants.pkl", pickle.dumps(()))
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match="TorchScript"):
        lazyckpt.open(script)
    other = tmp_path / "notes.bin"
    other.write_bytes(b"hello, this is not a checkpoint")
    with pytest.raises(lazyckpt.NotACheckpointError, match=r"notes\.bin"):
        lazyckpt.open(other)


def _bin_files() -> dict[str, bytes]:
    folder = FIXTURES / "gpt2_bin"
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _check_gpt2(tree: Any) -> None:
    reference = load_file(FIXTURES / "gpt2_safetensors" / "model.safetensors")
    flat = {name.replace("/", "."): leaf for name, leaf in lazyckpt.leaves(tree)}
    assert sorted(flat) == sorted(reference)
    np.testing.assert_array_equal(
        flat["transformer.h.1.mlp.c_fc.weight"][3:5].get(),
        reference["transformer.h.1.mlp.c_fc.weight"][3:5],
    )
    loaded = lazyckpt.load(tree)
    for name, want in reference.items():
        np.testing.assert_array_equal(
            dict(lazyckpt.leaves(loaded))[name.replace(".", "/")], want, err_msg=name
        )


def test_a_bin_model_opens_with_every_name_torch_load_shows() -> None:
    # keep_tied=True: lm_head.weight too, a view of the embedding's bytes.
    shown = json.loads((FIXTURES / "gpt2_bin_keys.json").read_text())
    tree = lazyckpt.open(FIXTURES / "gpt2_bin", flat=True, keep_tied=True)
    assert sorted(tree) == sorted(name for names in shown.values() for name in names)
    np.testing.assert_array_equal(
        tree["lm_head.weight"].get(), tree["transformer.wte.weight"].get()
    )
    single = lazyckpt.open(
        FIXTURES / "gpt2_bin" / "pytorch_model-00001-of-00003.bin", flat=True, keep_tied=True
    )
    assert list(single) == shown["pytorch_model-00001-of-00003.bin"]


def test_a_tied_name_is_kept_where_the_index_leaves_out_its_partner(tmp_path: Path) -> None:
    # The index lists lm_head.weight but not the embedding it is tied to, which comes
    # first in the shard: transformers loads lm_head.weight, so it is no tie to drop.
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "gpt2_bin", folder)
    index_path = folder / "pytorch_model.bin.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["transformer.wte.weight"]
    index_path.write_text(json.dumps(index))
    tree = lazyckpt.open(folder, flat=True)
    assert sorted(tree) == sorted(index["weight_map"])
    embedding = lazyckpt.open(FIXTURES / "gpt2_bin", flat=True)["transformer.wte.weight"]
    np.testing.assert_array_equal(tree["lm_head.weight"].get(), embedding.get())


def test_a_bin_model_on_the_hub_and_over_plain_https(hub: Any) -> None:
    files = _bin_files()
    # A repository with both forms reads safetensors; one with .bin only reads that.
    hub.commit("org/gpt2-bin", files)
    hub.clear_log()
    tree = lazyckpt.open("hf://org/gpt2-bin")
    _check_gpt2(tree)
    assert "config.json" not in {e.path.rsplit("/", 1)[-1] for e in hub.log}
    single = lazyckpt.open("hf://org/gpt2-bin/pytorch_model-00003-of-00003.bin", flat=True)
    assert "transformer.ln_f.weight" in single
    for name, data in files.items():
        hub.add_plain_file(f"plain/{name}", data)
    _check_gpt2(lazyckpt.open(hub.plain_url("plain")))
    hub.add_plain_file("one/state.pt", (FIXTURES / "state.pt").read_bytes())
    remote = lazyckpt.open(hub.plain_url("one/state.pt"))
    want = _expected(FIXTURES)
    np.testing.assert_array_equal(remote["every_other"].get(), want["every_other"])


def test_a_bin_model_in_a_bucket(s3: Any, tmp_path: Path) -> None:
    for name, data in _bin_files().items():
        s3.put_object(Bucket="ckpts", Key=f"gpt2-bin/{name}", Body=data)
    s3.put_object(Bucket="ckpts", Key="legacy.pt", Body=(FIXTURES / "state_legacy.pt").read_bytes())
    _check_gpt2(lazyckpt.open("s3://ckpts/gpt2-bin"))
    want = _expected(FIXTURES)
    remote = lazyckpt.open("s3://ckpts/legacy.pt")
    np.testing.assert_array_equal(remote["permuted"].get(), want["permuted"])


def test_every_verb_works_on_a_bin_model(tmp_path: Path) -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tree = lazyckpt.open(FIXTURES / "gpt2_bin")
    reference = lazyckpt.open(FIXTURES / "gpt2_safetensors")
    assert not lazyckpt.diff(tree, reference, values=True)
    blocks = lazyckpt.select(tree, "transformer/h/*/mlp/**")
    stacked = lazyckpt.stack_layers(blocks, "transformer/h")
    fc = stacked["transformer"]["h"]["mlp"]["c_fc"]["weight"]
    assert fc.shape == (2, 32, 128)
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = lazyckpt.device_put(fc, NamedSharding(mesh, P(None, "x", "y")))
    want = np.stack(
        [reference["transformer"]["h"][str(i)]["mlp"]["c_fc"]["weight"].get() for i in range(2)]
    )
    np.testing.assert_array_equal(np.asarray(placed), want)
    table = lazyckpt.stats(tree, "transformer/wte/**", memory_budget="4KiB")
    wte = reference["transformer"]["wte"]["weight"].get()
    assert table["transformer/wte/weight"].min == pytest.approx(float(wte.min()))
    assert table["transformer/wte/weight"].max == pytest.approx(float(wte.max()))
    cast = lazyckpt.convert(FIXTURES / "gpt2_bin", tmp_path / "bf16", to="orbax", dtype="bfloat16")
    half = lazyckpt.open(cast)
    assert half["transformer"]["wte"]["weight"].dtype == ml_dtypes.bfloat16
    fp8 = lazyckpt.open(FIXTURES / "state.pt")["float8_e4m3fn"]
    scale = lazyckpt.open(FIXTURES / "state.pt")["scalar"]
    values = lazyckpt.dequantize_fp8(
        fp8[None], scale[None, None], block_size=(1, 8), dtype=np.float32
    )
    np.testing.assert_allclose(
        values.get()[0], np.asarray(fp8.get(), np.float32) * 2.5, rtol=0, atol=0
    )


def test_a_small_bin_shard_on_the_hub_opens_in_one_read(hub: Any) -> None:
    # Its first 64 KiB hold all of a small shard: the pickle, the zip directory and
    # every local header come from that one ranged read (a large shard adds its
    # end, then its storages' local headers, read at once).
    hub.commit("org/gpt2-bin", _bin_files())
    hub.clear_log()
    lazyckpt.open("hf://org/gpt2-bin")
    reads: dict[str, int] = {}
    for e in hub.log:
        if e.status == 206:
            name = e.path.rsplit("/", 1)[-1]
            reads[name] = reads.get(name, 0) + 1
    shards = [f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
    assert reads == dict.fromkeys(shards, 1)


def _shared(depth: int) -> bytes:
    """A pickle whose list holds the one before it twice, `depth` times: 2**depth
    leaves from a few hundred bytes (the memo lets a pickle refer to a value again)."""
    out = b"\x80\x02K\x01q\x00"  # the int 1, memo 0
    for i in range(depth):
        out += b"]q%c(h%ch%ce" % (i + 1, i, i)  # [memo i, memo i] as memo i + 1
    return out + b"."


@pytest.mark.parametrize(
    ("payload", "error", "match"),
    [
        (_shared(40), lazyckpt.CorruptCheckpointError, "repeats or holds itself"),
        (
            b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x80\x85R.",  # (2 GiB of zeros)
            lazyckpt.CorruptCheckpointError,
            "a bytearray of other than bytes",
        ),
        # BUILD that would set attributes on an object lazyckpt made.
        (
            b"\x80\x02ctorch\nSize\n)R}X\x01\x00\x00\x00xK\x01sb.",
            lazyckpt.CorruptCheckpointError,
            "state set on",
        ),
        # A dict keyed by nested tuples: hashing them is where the time would go.
        (
            b"\x80\x02}(K\x01K\x02\x86K\x03\x85\x86K\x00u.",
            lazyckpt.CorruptCheckpointError,
            "not a plain value",
        ),
        # A size of -1 would read the bytes before its storage.
        (
            b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00"
            b"storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQK\x00J"
            b"\xff\xff\xff\xff\x85K\x01\x85\x89)tRs.",
            lazyckpt.CorruptCheckpointError,
            "not a tuple of sizes",
        ),
    ],
    ids=["shared-lists", "bytearray", "build", "tuple-keys", "negative-size"],
)
def test_hostile_pickles_fail_fast_and_clearly(
    tmp_path: Path, payload: bytes, error: type[Exception], match: str
) -> None:
    path = _torch_zip(tmp_path / "model.bin", payload)
    with zipfile.ZipFile(path, "a") as archive:  # the storage the last one names
        archive.writestr("archive/data/0", b"\x00" * 16)
    with pytest.raises(error, match=match):
        lazyckpt.open(path)


def test_files_that_are_no_weight_file_say_so(tmp_path: Path) -> None:
    plain = tmp_path / "notes.pt"
    plain.write_bytes(pickle.dumps({"not": "a tensor file"}, protocol=4))
    with pytest.raises(lazyckpt.NotACheckpointError, match=r"notes\.pt"):
        lazyckpt.open(plain)
    (tmp_path / "junk.bin").write_bytes(b"\x80" + b"\xff" * 100)
    with pytest.raises(lazyckpt.NotACheckpointError, match=r"junk\.bin"):
        lazyckpt.open(tmp_path / "junk.bin")


def test_two_entries_of_one_name_are_refused(tmp_path: Path) -> None:
    # {"a.b": 1, "a": {"b": 2}}: both are the name "a.b", flat or nested.
    payload = pickle.dumps({"a.b": 1, "a": {"b": 2}}, protocol=2)
    path = _torch_zip(tmp_path / "twice.pt", payload)
    for flat in (False, True):
        with pytest.raises(
            lazyckpt.UnsupportedCheckpointError, match=r"two leaves are named 'a\.b'"
        ):
            lazyckpt.open(path, flat=flat)


def test_a_legacy_pickle_larger_than_the_first_read() -> None:
    tree = lazyckpt.open(FIXTURES / "many_legacy.pt", flat=True)
    assert len(tree) == 1200
    np.testing.assert_array_equal(tree["model.layers.1199.mlp.up_proj.weight"].get(), [1199, 1199])


def test_a_memoized_dag_in_a_device_name_fails_fast(tmp_path: Path) -> None:
    # torch.device(x) where x is a list holding the one before it twice, 30 deep:
    # printing it would take 2**30 steps.
    payload = _shared(30)[:-1] + b"\x85q\x7fctorch\ndevice\nh\x7fR."
    path = _torch_zip(tmp_path / "device.pt", payload)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"torch\.device"):
        lazyckpt.open(path)


def _body(value: Any) -> bytes:
    """`value`'s protocol 2 pickle without its header, memo and STOP: a piece of
    another pickle."""
    return pickletools.optimize(pickle.dumps(value, protocol=2))[2:-1]


_FALSE_AND_HOOKS = b"\x89ccollections\nOrderedDict\n)R"  # requires_grad, backward_hooks


def _rebuilt(
    after: bytes,
    *,
    function: str = "_rebuild_tensor_v2",
    kind: str = "FloatStorage",
    numel: int = 6,
    offset: int = 0,
    size: tuple[int, ...] = (6,),
    stride: tuple[int, ...] = (1,),
) -> bytes:
    """A torch pickle of `{"x": torch._utils.FUNCTION(storage, offset, size, stride,
    ...)}`, `after` the arguments after the stride, pickled; its storage `numel`
    elements of `kind`, key '0'."""
    storage = b"(X\x07\x00\x00\x00storagectorch\n%s\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu"
    pid = storage % kind.encode() + _body(numel) + b"tQ"
    arguments = pid + _body(offset) + _body(size) + _body(stride) + after
    call = b"ctorch._utils\n%s\n(%stR" % (function.encode(), arguments)
    return b"\x80\x02}X\x01\x00\x00\x00x" + call + b"s."


def _case(name: str, payload: bytes, stored: int, error: type[Exception], match: str) -> Any:
    return pytest.param(payload, stored, error, match, id=name)


@pytest.mark.parametrize(
    ("payload", "stored", "error", "match"),
    [
        _case(
            "neg-bool",
            _rebuilt(_FALSE_AND_HOOKS + _body({"neg": True}), kind="BoolStorage"),
            6,
            lazyckpt.UnsupportedCheckpointError,
            r"'x' is a negative view of bool, which torch\.load returns but cannot read",
        ),
        _case(
            "conj-float",
            _rebuilt(_FALSE_AND_HOOKS + _body({"conj": True})),
            24,
            lazyckpt.CorruptCheckpointError,
            r"'x' has its conjugate bit set but holds float32",
        ),
        _case(
            "metadata-list",
            _rebuilt(_FALSE_AND_HOOKS + _body([1])),
            24,
            lazyckpt.CorruptCheckpointError,
            "tensor metadata of a list",
        ),
        _case(  # torch would take its default dtype
            "v3-without-dtype",
            _rebuilt(_FALSE_AND_HOOKS + b"N", function="_rebuild_tensor_v3"),
            24,
            lazyckpt.CorruptCheckpointError,
            "_rebuild_tensor_v3 with a NoneType as its dtype",
        ),
        _case(
            "v2-too-few",
            _rebuilt(b"\x89"),
            24,
            lazyckpt.CorruptCheckpointError,
            r"_rebuild_tensor_v2\(\) missing 1 required positional argument: '_backward_hooks'",
        ),
        _case(
            "float4-0d",
            _rebuilt(
                _FALSE_AND_HOOKS + b"ctorch\nfloat4_e2m1fn_x2\n",
                function="_rebuild_tensor_v3",
                kind="UntypedStorage",
                numel=1,
                size=(),
                stride=(),
            ),
            1,
            lazyckpt.UnsupportedCheckpointError,
            r"'x' is a 0-d float4_e2m1fn_x2 .*\.reshape\(1\)",
        ),
        _case(
            "offset-5000-digits",
            _rebuilt(_FALSE_AND_HOOKS, offset=10**5000),
            24,
            lazyckpt.CorruptCheckpointError,
            "an integer of more than 1024 bits",
        ),
        _case(
            "offset-over-2**62",
            _rebuilt(_FALSE_AND_HOOKS, offset=1 << 1000),
            24,
            lazyckpt.CorruptCheckpointError,
            r"offset outside 0 to 2\*\*62 \(1001 bits\)",
        ),
        _case(
            "numel-5000-digits",
            _rebuilt(_FALSE_AND_HOOKS, numel=10**5000),
            24,
            lazyckpt.CorruptCheckpointError,
            "an integer of more than 1024 bits",
        ),
        _case(
            "numel-over-2**62",
            _rebuilt(_FALSE_AND_HOOKS, numel=1 << 1000),
            24,
            lazyckpt.CorruptCheckpointError,
            r"storage '0' of a count of elements outside 0 to 2\*\*62",
        ),
        _case(  # windows of windows: 20,000 views at least
            "stacked-views",
            _rebuilt(_FALSE_AND_HOOKS, numel=40_000, size=(20_000, 20_000), stride=(1, 1)),
            160_000,
            lazyckpt.UnsupportedCheckpointError,
            r"'x' .* overlaps or interleaves its dimensions, .* at most 16384 in a file",
        ),
    ],
)
def test_tensors_torch_refuses_or_cannot_read_are_refused_by_name(
    tmp_path: Path, payload: bytes, stored: int, error: type[Exception], match: str
) -> None:
    path = _torch_zip(tmp_path / "model.pt", payload)
    with zipfile.ZipFile(path, "a") as archive:  # the storage its pickle names
        archive.writestr("archive/data/0", b"\x00" * stored)
    with pytest.raises(error, match=match):
        lazyckpt.open(path)


def test_a_zip_that_lists_a_member_twice_is_refused(tmp_path: Path) -> None:
    # Which of the two is the member, zip readers guess differently: Python's zipfile
    # reads the last, torch one or the other, as its sorted index finds it.
    path = tmp_path / "twice.pt"
    shutil.copy(FIXTURES / "views.pt", path)
    with warnings.catch_warnings(), zipfile.ZipFile(path, "a") as archive:
        warnings.simplefilter("ignore")  # (zipfile warns that it writes a name again)
        archive.writestr("views/data/0", archive.read("views/data/0")[::-1])
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"lists 'views/data/0' twice"):
        lazyckpt.open(path)


def test_an_end_record_in_the_zip_comment_is_refused(tmp_path: Path) -> None:
    # A record of no members as the comment: read as the archive's end, the file
    # would open as an empty tree (torch finds no data.pkl in it and refuses it).
    path = tmp_path / "comment.pt"
    shutil.copy(FIXTURES / "state.pt", path)
    with zipfile.ZipFile(path, "a") as archive:
        archive.comment = b"PK\x05\x06" + bytes(18)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="comment holds a second end record"):
        lazyckpt.open(path)


def test_int_keys_of_one_hash_are_refused_in_linear_time(tmp_path: Path) -> None:
    # Python hashes ints modulo 2**61 - 1: 400,000 keys k * (2**61 - 1) share a hash,
    # and a dict of them takes 400,000**2 / 2 steps (20 minutes). The time limit
    # only catches that blowup; refused, they take a few seconds with the start.
    prime = (1 << 61) - 1
    keys = (pickle.encode_long(k * prime) for k in range(1, 400_001))
    items = b"".join(b"\x8a%c%sK\x00" % (len(key), key) for key in keys)
    path = _torch_zip(tmp_path / "keys.pt", b"\x80\x02}(" + items + b"u.")
    outcomes = run_cases([{"name": "keys", "path": str(path), "do": "open"}], tmp_path, 180)
    expect(outcomes, {"keys": "lazyckpt:CorruptCheckpointError"})
    assert "an int wider than 64 bits" in outcomes["keys"]


def _members_zip(
    path: Path, payload: bytes, members: dict[str, bytes], pickle_name: str = "data.pkl"
) -> Path:
    """A torch zip of the pickle `payload` and `members` (names under `archive/`)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"archive/{pickle_name}", payload)
        for name, data in members.items():
            archive.writestr(f"archive/{name}", data)
        archive.writestr("archive/version", "3\n")
    return path


_FLOATS = np.array([1.5, -2.0, 3.25, 4.0, 0.5, 8.0], np.float32)


@pytest.mark.parametrize(
    "members",
    [
        {"byteorder": b"little", "DATA/0": _FLOATS[::-1].tobytes(), "data/0": _FLOATS.tobytes()},
        {"byteorder": b"little", "data/0": _FLOATS.tobytes(), "Data/0": _FLOATS[::-1].tobytes()},
        {"byteorder": b"little", "BYTEORDER": b"big", "data/0": _FLOATS.tobytes()},
    ],
    ids=["data-upper-first", "data-upper-last", "byteorder"],
)
def test_names_torch_does_not_tell_apart_by_case_are_refused(
    tmp_path: Path, members: dict[str, bytes]
) -> None:
    # torch looks members up ignoring ASCII case (miniz) and reads one of the two as
    # its sorted index finds it: torch 2.13 reads the decoy of the first.
    path = _members_zip(tmp_path / "case.pt", _rebuilt(_FALSE_AND_HOOKS), members)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="does not tell apart"):
        lazyckpt.open(path)


def test_members_are_found_ignoring_case_as_torch_finds_them(tmp_path: Path) -> None:
    # torch 2.13 reads `BYTEORDER: big` as the byte order, `DATA/0` as storage 0 and
    # `DATA.PKL` as the pickle.
    members = {"BYTEORDER": b"big", "DATA/0": _FLOATS.astype(">f4").tobytes()}
    path = _members_zip(tmp_path / "upper.pt", _rebuilt(_FALSE_AND_HOOKS), members, "DATA.PKL")
    assert lazyckpt.open(path)["x"].get().tobytes() == _FLOATS.tobytes()


def test_a_byte_order_torch_refuses_is_refused(tmp_path: Path) -> None:
    members = {"byteorder": b"big\n", "data/0": _FLOATS.astype(">f4").tobytes()}
    path = _members_zip(tmp_path / "order.pt", _rebuilt(_FALSE_AND_HOOKS), members)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"byteorder member says b'big\\n'"):
        lazyckpt.open(path)


def test_a_big_endian_file_swaps_bytes_by_its_storage_s_elements(tmp_path: Path) -> None:
    # torch.load swaps a big-endian storage by its own elements, whatever the tensor's
    # dtype: none over bytes (torch 2.13 reads b"\0\1\0\2" as uint16 [256, 512]).
    uint16 = b"\x89ccollections\nOrderedDict\n)Rctorch\nuint16\n"
    data = struct.pack(">2H", 1, 2)
    over_bytes = _rebuilt(
        uint16 + b"N", function="_rebuild_tensor_v3", kind="UntypedStorage", numel=4, size=(2,)
    ).replace(b"ctorch\nUntypedStorage", b"ctorch.storage\nUntypedStorage")  # (as torch's)
    path = _members_zip(tmp_path / "bytes.pt", over_bytes, {"byteorder": b"big", "data/0": data})
    assert lazyckpt.open(path)["x"].get().tobytes() == data
    int8 = b"\x89ccollections\nOrderedDict\n)Rctorch\nint8\nN"
    over_floats = _rebuilt(int8, function="_rebuild_tensor_v3", numel=1, size=(4,))
    path = _members_zip(tmp_path / "i8.pt", over_floats, {"byteorder": b"big", "data/0": data})
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match="swaps its bytes in groups of 4"):
        lazyckpt.open(path)


@pytest.mark.parametrize("stem", ["values", "values_legacy"])
def test_bytearrays_and_layouts_read_as_bytes_and_names(stem: str) -> None:
    # torch.load gives bytearrays and torch.strided: lazyckpt their bytes and name.
    shown = json.loads((FIXTURES / f"{stem}_expected.json").read_text())
    tree = lazyckpt.open(FIXTURES / f"{stem}.pt")
    assert sorted(tree) == sorted(shown)
    assert tree["bytes"] == bytes.fromhex(shown["bytes"]) and tree["empty"] == b""
    assert tree["layout"] == shown["layout"]
    assert tree["w"].get().tolist() == shown["w"]
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError, match=r"holds a Python set .* as a list"
    ):
        lazyckpt.open(FIXTURES / f"{stem}_set.pt")
