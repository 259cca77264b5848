"""NumPy's `.npy` / `.npz` files (big_vision's checkpoints) and flax's msgpack
(`flax.serialization.to_bytes`, Hugging Face's `flax_model.msgpack`), opened lazily,
each written here by its own writer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn

import lazyckpt

RNG = np.random.default_rng(0)


def _big_vision() -> dict[str, Any]:
    """A flattened parameter dict as big_vision saves it: `/`-separated names."""
    return {
        "params/img/embedding/kernel": RNG.standard_normal((4, 4, 3, 16), dtype=np.float32),
        "params/img/embedding/bias": RNG.standard_normal(16, dtype=np.float32),
        "params/img/Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel": RNG.standard_normal(
            (16, 64), dtype=np.float32
        ),
        "params/txt/Embed_0/embedding": RNG.standard_normal((300, 16)).astype(np.float16),
        "params/t": np.array(10.0, dtype=np.float32),
        "params/fortran": np.asfortranarray(RNG.standard_normal((5, 7, 3))),
        "params/mask": RNG.integers(0, 2, 33).astype(bool),
        "params/ids": RNG.integers(-9, 9, (3, 4)).astype(np.int8),
        "params/empty": np.zeros((0, 3), np.float32),
        "params/big_endian": np.arange(12, dtype=">i8").reshape(3, 4),
        "params/big_endian_t": np.arange(6, dtype=">f4").reshape(2, 3).T,
    }


@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_an_npz_of_flattened_names_nests_like_orbax_keys(tmp_path: Path, compressed: bool) -> None:
    arrays = _big_vision()
    path = tmp_path / "params.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    tree = lazyckpt.open(path)
    assert tree["params"]["img"]["embedding"]["kernel"].shape == (4, 4, 3, 16)
    flat = lazyckpt.open(path, flat=True)
    assert sorted(flat) == sorted(arrays)
    for name, want in arrays.items():
        got = flat[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype.newbyteorder("=")), name
        np.testing.assert_array_equal(got.get(), want, err_msg=name)
        if want.ndim:
            np.testing.assert_array_equal(got[-2:].get(), want[-2:], err_msg=name)


def test_rows_of_a_stored_npz_member_read_those_rows(tmp_path: Path) -> None:
    embedding = RNG.standard_normal((4096, 64), dtype=np.float32)
    path = tmp_path / "params.npz"
    arrays: dict[str, Any] = {"params/embedding": embedding}
    np.savez(path, **arrays)
    array = lazyckpt.open(path)["params"]["embedding"]
    with lazyckpt.measure() as cost:
        rows = lazyckpt.load(array[100:103])
    np.testing.assert_array_equal(rows, embedding[100:103])
    assert cost.bytes_read == 3 * 64 * 4


def test_a_compressed_npz_streams_each_member_once_within_the_budget(tmp_path: Path) -> None:
    # 8 MiB that inflate from a deflate stream: saved again with a 1 MiB budget, in
    # order, each compressed byte is read once (no restart from the stream's start).
    big = np.repeat(RNG.standard_normal((64, 1024), dtype=np.float32), 32, axis=0)
    path = tmp_path / "params.npz"
    arrays: dict[str, Any] = {"params/big": big, "params/small": np.arange(5)}
    np.savez_compressed(path, **arrays)
    packed = path.stat().st_size
    tree = lazyckpt.open(path)
    with lazyckpt.measure() as cost:
        lazyckpt.save(tmp_path / "out.safetensors", tree, memory_budget="1MiB")
    assert cost.bytes_read <= packed * 1.05
    saved = lazyckpt.open(tmp_path / "out.safetensors")
    np.testing.assert_array_equal(saved["params"]["big"].get(), big)
    # A read out of order (the end, then the start) still gives the right rows.
    array = lazyckpt.open(path)["params"]["big"]
    np.testing.assert_array_equal(array[-3:].get(), big[-3:])
    np.testing.assert_array_equal(array[:3].get(), big[:3])


def test_a_whole_deflated_member_is_inflated_once(tmp_path: Path) -> None:
    # tensorstore asks for its 16 chunks together, in any order: one pass serves all.
    values = RNG.standard_normal((2048, 2048), dtype=np.float32)  # 16 MiB, incompressible
    path = tmp_path / "params.npz"
    np.savez_compressed(path, w=values)
    array = lazyckpt.open(path)["w"]
    with lazyckpt.measure() as cost:
        np.testing.assert_array_equal(array.get(), values)
    assert cost.bytes_read <= path.stat().st_size * 2  # (10x before: a restart a chunk)


def test_a_single_npy_file_opens_as_one_array(tmp_path: Path) -> None:
    values = RNG.standard_normal((6, 5), dtype=np.float32).T  # Fortran order on disk
    np.save(tmp_path / "w.npy", values)
    tree = lazyckpt.open(tmp_path / "w.npy")
    np.testing.assert_array_equal(tree["w"].get(), values)


def test_object_arrays_are_refused_by_name_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "objects.npz"
    np.savez(path, fine=np.arange(3), bad=np.array([{"x": 1}, None], dtype=object))
    with pytest.raises(lazyckpt.UnsafePickleError, match=r"objects\.npz.*bad\.npy.*allow_pickle"):
        lazyckpt.open(path)


def test_damaged_npy_headers_say_what_is_wrong(tmp_path: Path) -> None:
    np.save(tmp_path / "w.npy", np.arange(100, dtype=np.int64))
    data = (tmp_path / "w.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:-8])
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"cut\.npy.*too short"):
        lazyckpt.open(tmp_path / "cut.npy")
    (tmp_path / "bad.npy").write_bytes(data[:10] + b"{'descr': __import__('os')" + data[36:])
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"bad\.npy.*header"):
        lazyckpt.open(tmp_path / "bad.npy")


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(32, name="up")(x)
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(4, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, name="down")(x)


def _flax_state() -> dict[str, Any]:
    params = _Model().init(jax.random.key(0), jnp.ones((1, 16)))
    return {
        **params,
        "step": np.int64(7),
        "scale": np.float32(0.5),
        "fp8": np.arange(8, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn),
        "name": "run",
        "complex": 1 + 2j,
    }


def test_flax_msgpack_opens_lazily_with_flax_s_own_values(tmp_path: Path) -> None:
    state = _flax_state()
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(flax.serialization.to_bytes(state))
    reference = flax.serialization.msgpack_restore(path.read_bytes())
    tree = lazyckpt.open(path)
    kernel = tree["params"]["up"]["kernel"]
    assert (kernel.shape, kernel.dtype) == ((16, 32), np.float32)
    assert tree["params"]["down"]["kernel"].dtype == ml_dtypes.bfloat16
    assert (tree["step"], tree["scale"], tree["name"], tree["complex"]) == (7, 0.5, "run", 1 + 2j)
    for name, want in lazyckpt.leaves(reference):
        got = dict(lazyckpt.leaves(tree))[name]
        if isinstance(got, lazyckpt.LazyArray):
            np.testing.assert_array_equal(got.get(), want, err_msg=name)
    with lazyckpt.measure() as cost:
        row = lazyckpt.load(kernel[3])
    np.testing.assert_array_equal(row, reference["params"]["up"]["kernel"][3])
    assert cost.bytes_read == 32 * 4


def test_flax_s_chunked_arrays_join_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # flax splits arrays over MAX_CHUNK_SIZE bytes into flat pieces; a smaller limit
    # makes its own writer split this one.
    monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 1000)
    table = RNG.standard_normal((50, 30), dtype=np.float32)
    path = tmp_path / "big.msgpack"
    path.write_bytes(flax.serialization.to_bytes({"embed": table, "b": np.ones(3)}))
    assert b"__msgpack_chunked_array__" in path.read_bytes()
    tree = lazyckpt.open(path)
    assert tree["embed"].shape == (50, 30)
    np.testing.assert_array_equal(tree["embed"].get(), table)
    np.testing.assert_array_equal(tree["embed"][17:19, 5].get(), table[17:19, 5])


def test_damaged_msgpack_says_where(tmp_path: Path) -> None:
    data = flax.serialization.to_bytes({"w": np.arange(100, dtype=np.float32)})
    (tmp_path / "cut.msgpack").write_bytes(data[:-50])
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"cut\.msgpack"):
        lazyckpt.open(tmp_path / "cut.msgpack")


@pytest.mark.parametrize("parts", [[None, 1.0], ["1", "2"], [[1], [2]], [True, 1.0]])
def test_a_complex_of_parts_that_are_not_numbers_is_damaged(tmp_path: Path, parts: Any) -> None:
    """flax writes a complex as the msgpack of `[real, imag]`; anything else there is
    a damaged file, said so by name (flax's own reader fails on it too)."""
    import msgpack

    data = msgpack.packb({"a": msgpack.ExtType(2, msgpack.packb(parts))})
    (tmp_path / "bad.msgpack").write_bytes(data)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"bad\.msgpack: msgpack complex"):
        lazyckpt.open(tmp_path / "bad.msgpack")


def test_a_dtype_lazyckpt_does_not_read_is_refused_with_those_it_reads(tmp_path: Path) -> None:
    data = flax.serialization.to_bytes({"a": np.arange(4, dtype=ml_dtypes.int4)})
    (tmp_path / "int4.msgpack").write_bytes(data)
    with pytest.raises(lazyckpt.UnsupportedCheckpointError) as caught:
        lazyckpt.open(tmp_path / "int4.msgpack")
    message = str(caught.value)
    assert "'int4'" in message and "it reads bfloat16, bool" in message
    assert "float8_e4m3fn," in message and "float8_e3m4" not in message


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_converting_an_npz_stays_within_the_memory_budget(tmp_path: Path, compressed: bool) -> None:
    """96 MiB in three 32 MiB members to safetensors at a 16 MiB budget, in a fresh
    process: it grew by 8 MiB (stored) and 45-48 MiB (deflated: the inflater keeps its
    last 4 MiB) here; holding one member whole would take 32 MiB more."""
    from tests.helpers import rss_probe

    rng = np.random.default_rng(0)
    arrays: dict[str, Any] = {
        f"params/layer_{i}/kernel": rng.standard_normal((8192, 1024), dtype=np.float32)
        for i in range(3)
    }
    path = tmp_path / "params.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    budget = 16 << 20
    out = tmp_path / "out"
    probe = rss_probe(path, "export", budget, str(out))
    assert probe["peak"] < budget + (48 << 20), probe
    saved = lazyckpt.open(out, flat=True)
    for name, want in arrays.items():
        np.testing.assert_array_equal(saved[name.replace("/", ".")][-5:].get(), want[-5:])


def test_a_hugging_face_flax_folder_opens_its_msgpack(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    state = _flax_state()
    (folder / "flax_model.msgpack").write_bytes(flax.serialization.to_bytes(state))
    (folder / "config.json").write_text('{"model_type": "toy"}')
    tree = lazyckpt.open(folder)
    np.testing.assert_array_equal(
        tree["params"]["up"]["kernel"].get(), state["params"]["up"]["kernel"]
    )


def test_threads_reading_one_deflated_member_get_its_bytes(tmp_path: Path) -> None:
    import concurrent.futures

    values = RNG.standard_normal((1024, 2048), dtype=np.float32)  # 8 MiB, 2 marks
    path = tmp_path / "params.npz"
    np.savez_compressed(path, w=values)
    array = lazyckpt.open(path)["w"]
    cuts = [(slice(a, a + 97), 7 * (a % 5)) for a in range(0, 1000, 61)]

    def read(cut: tuple[slice, int]) -> bool:
        return bool(np.array_equal(array[cut[0], cut[1]].get(), values[cut[0], cut[1]]))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert all(pool.map(read, cuts[::-1] + cuts))


def test_a_member_that_inflates_far_past_its_last_input_reads_whole(tmp_path: Path) -> None:
    # 64 MiB of zeros deflate to 64 KiB: the last of the input leaves zlib holding
    # output that only more calls with no input drain.
    path = tmp_path / "zeros.npz"
    np.savez_compressed(path, x=np.zeros(2**24, "f4"))
    want = np.load(path)["x"]
    array = lazyckpt.open(path)["x"]
    assert array.get().tobytes() == want.tobytes()
    assert array[-3:].get().tobytes() == want[-3:].tobytes()


def test_a_deflated_member_cut_short_is_damaged_not_a_hang(tmp_path: Path) -> None:
    # A deflate stream flushed halfway and cut there: valid up to its end, which
    # comes before the size the archive declares.
    import io
    import zipfile
    import zlib

    values = np.zeros(2**20, "f4")
    member = io.BytesIO()
    np.lib.format.write_array(member, values)
    data = member.getvalue()
    squeeze = zlib.compressobj(6, zlib.DEFLATED, -15)
    cut = squeeze.compress(data[: len(data) // 2]) + squeeze.flush(zlib.Z_SYNC_FLUSH)
    path = tmp_path / "cut.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("x.npy", cut)
    raw = bytearray(path.read_bytes())
    for signature, method_at, size_at in ((b"PK\x03\x04", 8, 22), (b"PK\x01\x02", 10, 24)):
        at = raw.index(signature)  # (deflated, and as long as the array)
        raw[at + method_at : at + method_at + 2] = zipfile.ZIP_DEFLATED.to_bytes(2, "little")
        raw[at + size_at : at + size_at + 4] = len(data).to_bytes(4, "little")
    path.write_bytes(raw)
    array = lazyckpt.open(path)["x"]
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"cut\.npz.*'x\.npy'.*data ends at"):
        array.get()


@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_an_npz_of_no_arrays_opens_as_an_empty_tree(tmp_path: Path, compressed: bool) -> None:
    path = tmp_path / "empty.npz"
    (np.savez_compressed if compressed else np.savez)(path)
    assert np.load(path).files == []
    assert lazyckpt.open(path) == {}
    assert lazyckpt.open(path, flat=True) == {}


@pytest.mark.parametrize("kind", ["npy", "npz", "npz_compressed"])
def test_a_header_over_numpy_s_limit_says_so_and_how_numpy_reads_it(
    tmp_path: Path, kind: str
) -> None:
    # 4,000 named fields: numpy writes a version 2.0 header of 90 KB, which np.load
    # refuses too unless its max_header_size is raised.
    values = np.zeros(2, [(f"field_{i}", "<f4") for i in range(4000)])
    path = tmp_path / f"wide.{kind[:3]}"
    with pytest.warns(UserWarning, match="format 2.0"):
        if kind == "npy":
            np.save(path, values)
        else:
            (np.savez_compressed if kind.endswith("compressed") else np.savez)(path, w=values)
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match=path.name) as refused:
        lazyckpt.open(path)
    found = re.search(
        r"header is ([\d,]+) bytes, over the 10,000 .*max_header_size=(\d+)\)", str(refused.value)
    )
    assert found is not None, refused.value
    assert int(found[1].replace(",", "")) == int(found[2]) > 10_000
    # The limit the message gives is the one np.load needs (an npz's file closed after).
    with pytest.raises(ValueError, match="max_header_size"):
        _np_load(path, "w")
    loaded = _np_load(path, "w", max_header_size=int(found[2]))
    assert loaded.tobytes() == values.tobytes()


def _np_load(path: Path, key: str, **options: Any) -> np.ndarray:
    """What np.load reads from an .npy file, or from `key` of an .npz, which it closes."""
    if path.suffix == ".npy":
        return np.asarray(np.load(path, **options))
    with np.load(path, **options) as archive:
        return np.asarray(archive[key])


LONG_DOUBLE = np.dtype(np.longdouble).itemsize > 8
needs_long_double = pytest.mark.skipif(
    not LONG_DOUBLE, reason="NumPy's long double is a double on this machine"
)


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """`got` (native byte order) has `want`'s values bit for bit."""
    native = want.astype(want.dtype.newbyteorder("="))
    assert (got.shape, got.dtype) == (native.shape, native.dtype)
    assert got.tobytes() == np.ascontiguousarray(native).tobytes()


@needs_long_double
@pytest.mark.parametrize("where", ["npy", "npy_fortran", "npy_big_endian", "npz", "npz_compressed"])
def test_long_doubles_read_as_np_load_reads_them(tmp_path: Path, where: str) -> None:
    # float128 and complex256: tensorstore has no such type, so their bytes are read
    # and viewed as the type on the host.
    values = RNG.standard_normal((300, 70)).astype(np.longdouble) / 3
    arrays: dict[str, Any] = {
        "x": np.asfortranarray(values) if where == "npy_fortran" else values,
        "c": (values[:5] + 1j * values[5:10]).astype(np.clongdouble),
        "s": np.longdouble(1) / 3,
    }
    if where == "npy_big_endian":
        arrays = {"x": values.astype(">f16"), "c": arrays["c"].astype(">c32")}
    if where.startswith("npz"):
        arrays["fortran"] = np.asfortranarray(values[:, :9])
    if where.startswith("npy"):
        for name, value in arrays.items():
            np.save(tmp_path / f"{name}.npy", value)
        opened = {name: lazyckpt.open(tmp_path / f"{name}.npy")[name] for name in arrays}
        loaded = {name: np.load(tmp_path / f"{name}.npy") for name in arrays}
    else:
        path = tmp_path / "params.npz"
        (np.savez_compressed if where.endswith("compressed") else np.savez)(path, **arrays)
        opened, loaded = lazyckpt.open(path), dict(np.load(path))
    for name, want in loaded.items():
        array = opened[name]
        assert array.dtype == want.dtype.newbyteorder("="), name
        _same(array.get(), want)
        _same(lazyckpt.load(array), want)
    _same(opened["x"][100:103, 5:9].get(), loaded["x"][100:103, 5:9])
    _same(opened["x"].T[4].get(), loaded["x"].T[4])
    _same(opened["c"][::2].get(), loaded["c"][::2])
    if where == "npy":  # a row of a stored array reads that row
        with lazyckpt.measure() as cost:
            lazyckpt.load(opened["x"][7])
        assert cost.bytes_read == 70 * 16


@needs_long_double
def test_long_doubles_in_flax_msgpack_read_as_flax_restores_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = RNG.standard_normal((50, 30)).astype(np.longdouble) / 3
    state = {
        "x": values,
        "c": (values[:4] + 1j * values[4:8]).astype(np.clongdouble),
        "s": np.longdouble(1) / 3,
    }
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(flax.serialization.to_bytes(state))
    monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 1000)  # flax splits it
    (tmp_path / "chunked.msgpack").write_bytes(flax.serialization.to_bytes({"x": values}))
    for file in (path, tmp_path / "chunked.msgpack"):
        restored = flax.serialization.msgpack_restore(file.read_bytes())
        tree = lazyckpt.open(file)
        for name, want in restored.items():
            got = tree[name].get() if name != "s" else np.asarray(tree[name])
            _same(got, np.asarray(want))
        _same(tree["x"][17:19, 5].get(), restored["x"][17:19, 5])


@needs_long_double
def test_long_doubles_go_to_jax_and_checkpoints_only_cast(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.longdouble) / 3)
    array = lazyckpt.open(tmp_path / "x.npy")["x"]
    with pytest.raises(lazyckpt.LazyTypeError, match=r"x: dtype float128.*astype\('float64'\)"):
        lazyckpt.device_put({"x": array}, jax.devices()[0])
    with pytest.raises(lazyckpt.UnsavableError, match=r"x: an array of dtype float128.*astype"):
        lazyckpt.save(tmp_path / "ckpt", {"x": array})
    assert not (tmp_path / "ckpt").exists()
    cast = array.astype("float64")
    placed = lazyckpt.device_put({"x": cast}, jax.devices()[0])
    want = np.load(tmp_path / "x.npy").astype(np.float64)
    assert np.asarray(placed["x"]).tobytes() == want.astype(placed["x"].dtype).tobytes()
    lazyckpt.save(tmp_path / "ckpt", {"x": cast})
    _same(lazyckpt.open(tmp_path / "ckpt")["x"].get(), want)


def test_a_long_double_numpy_has_no_type_for_here_is_refused_by_name(tmp_path: Path) -> None:
    # A 12-byte long double (32-bit x86's): no machine has both that and another.
    other = "<f12" if np.dtype(np.longdouble).itemsize != 12 else "<f16"
    path = tmp_path / "other.npy"
    with path.open("wb") as file:
        header = {"descr": other, "fortran_order": False, "shape": (2,)}
        np.lib.format.write_array_header_1_0(file, header)
        file.write(bytes(2 * int(other[2:])))
    with pytest.raises(ValueError, match="not a valid dtype"):
        np.load(path)
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError,
        match=rf"other\.npy: dtype '{other}', a long double that NumPy has no type for",
    ):
        lazyckpt.open(path)


def test_an_empty_flax_msgpack_opens_as_an_empty_tree(tmp_path: Path) -> None:
    path = tmp_path / "empty.msgpack"
    path.write_bytes(flax.serialization.to_bytes({}))
    assert flax.serialization.msgpack_restore(path.read_bytes()) == {}
    assert lazyckpt.open(path) == {} and lazyckpt.open(path, flat=True) == {}


def test_npy_dtypes_lazyckpt_does_not_read_say_what_to_do(tmp_path: Path) -> None:
    """Strings are refused with np.load as the way; bfloat16, which numpy saves as raw
    void bytes, with float32 or safetensors."""
    np.save(tmp_path / "text.npy", np.array(["ab", "c"]))
    np.save(tmp_path / "bf16.npy", np.ones(3, ml_dtypes.bfloat16))
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match=r"'<U2'.*read it with np\.load"):
        lazyckpt.open(tmp_path / "text.npy")
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match=r"'<V2'.*save it as float32"):
        lazyckpt.open(tmp_path / "bf16.npy")


def test_a_msgpack_map_key_that_is_not_a_str_or_int_is_refused_not_called_damaged(
    tmp_path: Path,
) -> None:
    """flax's own reader takes a float key (msgpack allows one); lazyckpt, which names
    leaves by str and int keys, says so rather than calling the file damaged."""
    import msgpack

    (tmp_path / "float.msgpack").write_bytes(msgpack.packb({1.5: 1, "a": 2}))
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match=r"key of type float .* str"):
        lazyckpt.open(tmp_path / "float.msgpack")


def test_a_dtype_name_written_as_msgpack_bin_reads_as_flax_reads_it(tmp_path: Path) -> None:
    import msgpack

    values = np.arange(4, dtype=np.int8)
    payload = msgpack.packb([list(values.shape), b"int8", values.tobytes()])
    data = msgpack.packb({"w": msgpack.ExtType(1, payload)})
    (tmp_path / "bin.msgpack").write_bytes(data)
    want = flax.serialization.msgpack_restore(data)["w"]
    got = lazyckpt.open(tmp_path / "bin.msgpack")["w"].get()
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("descr", "dtype"), [("<d", np.float64), ("float32", np.float32), ("bool", np.bool_)]
)
def test_npy_dtypes_spelled_as_numpy_never_writes_read_as_np_load_reads_them(
    tmp_path: Path, descr: str, dtype: Any
) -> None:
    import struct

    values = np.arange(6).astype(dtype).reshape(2, 3)
    header = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': (2, 3), }}".encode()
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    path = tmp_path / "spelled.npy"
    path.write_bytes(
        b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + values.tobytes()
    )
    want = np.load(path)
    got = lazyckpt.open(path)["spelled"].get()
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
