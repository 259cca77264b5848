"""Zip archives made hostile byte by byte (`np.savez` files and `torch.save` ones share
the reader): each reads as np.load reads it, bit for bit, or is refused by name."""

from __future__ import annotations

import io
import shutil
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

import lazyckpt

FIXTURES = Path(__file__).parent / "fixtures" / "torch"
_END = struct.Struct("<4s4H2LH")


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def _entries(raw: bytes, offset: int, size: int) -> list[tuple[str, bytes]]:
    """The central directory's entries at `offset`, each with its name."""
    out, at = [], offset
    while at < offset + size:
        name_length, extra_length, comment_length = struct.unpack_from("<3H", raw, at + 28)
        stop = at + 46 + name_length + extra_length + comment_length
        out.append((raw[at + 46 : at + 46 + name_length].decode(), raw[at:stop]))
        at = stop
    return out


def _hidden_directory(path: Path, name: str, decoy: bytes) -> None:
    """Add a second member `name` holding `decoy` to the archive at `path`, listed by a
    second directory in the zip comment whose end record is followed by two bytes:
    its comment does not run to the file's end, but np.load and torch, scanning back
    for the last end record, read the second directory and so the decoy."""
    with warnings.catch_warnings(), zipfile.ZipFile(path, "a") as archive:
        warnings.simplefilter("ignore")  # (zipfile warns that it writes a name again)
        archive.writestr(name, decoy)
    raw = path.read_bytes()
    _, _, _, _, count, size, offset, _ = _END.unpack_from(raw, raw.rfind(b"PK\x05\x06"))
    names, entries = zip(*_entries(raw, offset, size), strict=True)
    first = names.index(name)
    real = b"".join(entries[:-1])  # (the decoy's entry is the last)
    alt = b"".join(entries[:first] + entries[first + 1 :])
    alt_at = offset + len(real) + _END.size
    fake = _END.pack(b"PK\x05\x06", 0, 0, count - 1, count - 1, len(alt), alt_at, 0)
    comment = alt + fake + b"\x00\x00"
    end = _END.pack(b"PK\x05\x06", 0, 0, count - 1, count - 1, len(real), offset, len(comment))
    path.write_bytes(raw[:offset] + real + end + comment)


def test_a_directory_hidden_in_the_zip_comment_is_refused_npz(tmp_path: Path) -> None:
    path = tmp_path / "hidden.npz"
    np.savez(path, x=np.arange(4.0), y=np.ones(2))
    _hidden_directory(path, "x.npy", _npy(np.full(4, 9.0)))
    with zipfile.ZipFile(path) as archive:  # (what np.load reads: the decoy)
        assert archive.read("x.npy") == _npy(np.full(4, 9.0))
    np.testing.assert_array_equal(np.load(path)["x"], np.full(4, 9.0))
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"hidden\.npz: its zip comment "):
        lazyckpt.open(path)


def test_a_directory_hidden_in_the_zip_comment_is_refused_torch(tmp_path: Path) -> None:
    path = tmp_path / "hidden.pt"
    shutil.copy(FIXTURES / "views.pt", path)
    with zipfile.ZipFile(path) as archive:
        stored = archive.read("views/data/0")
    _hidden_directory(path, "views/data/0", stored[::-1])  # (torch.load reads the decoy)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="second end record"):
        lazyckpt.open(path)


def test_a_member_name_with_a_nul_byte_is_refused(tmp_path: Path) -> None:
    # zipfile cuts a name at its first NUL: np.load reads "x.npy\0.npy" as "x".
    path = tmp_path / "nul.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", _npy(np.arange(3.0)))
        archive.writestr("x.npy_.npy", _npy(np.full(3, 9.0)))
    path.write_bytes(path.read_bytes().replace(b"x.npy_.npy", b"x.npy\x00.npy"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (zipfile warns of the name listed twice)
        np.testing.assert_array_equal(np.load(path)["x"], np.full(3, 9.0))
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"'x\.npy\\x00\.npy' holds a NUL"):
        lazyckpt.open(path)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_deflated_member_failing_its_crc_is_refused(tmp_path: Path) -> None:
    # Random words, which deflate keeps as stored blocks: a flipped bit is a wrong
    # value, which only the CRC-32 shows.
    path = tmp_path / "flipped.npz"
    np.savez_compressed(path, x=np.random.default_rng(0).integers(0, 2**32, 100_000, np.uint32))
    _flip(path, path.stat().st_size // 2)
    with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        np.load(path)["x"]
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"'x\.npy': its bytes have the CRC"):
        lazyckpt.open(path)["x"].get()
    found = lazyckpt.verify(path, progress=False)
    assert [d.key for d in found.damaged] == ["x"] and "CRC-32" in found.damaged[0].problem
    assert found.unchecked == []


def _middle(path: Path, name: str) -> int:
    """The middle of member `name`'s data (which starts after its local header's
    name and extra field)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    name_length, extra_length = struct.unpack_from(
        "<2H", path.read_bytes(), info.header_offset + 26
    )
    return info.header_offset + 30 + name_length + extra_length + info.file_size // 2


@pytest.mark.parametrize("source", ["npz", "torch"])
def test_verify_checks_a_stored_member_s_crc(tmp_path: Path, source: str) -> None:
    path = tmp_path / f"flipped.{'npz' if source == 'npz' else 'pt'}"
    if source == "npz":
        np.savez(path, x=np.arange(1000.0), y=np.ones(3))
        member = "x.npy"
    else:
        shutil.copy(FIXTURES / "views.pt", path)
        member = "views/data/0"
    _flip(path, _middle(path, member))
    if source == "npz":
        with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
            np.load(path)["x"]
    found = lazyckpt.verify(path, progress=False)
    assert found.damaged and found.fine and found.unchecked == []
    for damage in found.damaged:
        assert f"zip member {member!r}: its bytes have the CRC-32" in damage.problem
    if source == "npz":
        assert ([d.key for d in found.damaged], found.fine) == (["x"], ["y"])


def test_a_deflated_member_s_crc_is_checked_after_reads_out_of_order(tmp_path: Path) -> None:
    # Reads behind the stream inflate again from a kept copy, in pieces that need not
    # meet where the CRC-32 so far ends: the check still reaches the member's end.
    path = tmp_path / "flipped.npz"
    words = np.random.default_rng(1).integers(0, 2**32, 3 << 20, np.uint32)  # (12 MiB)
    np.savez_compressed(path, x=words)
    _flip(path, path.stat().st_size // 3)
    array = lazyckpt.open(path)["x"]
    n = words.size
    for at in (n * 3 // 4, n * 7 // 16):  # (9 MiB in, then back to 5.25 MiB: a kept copy)
        array[at : at + 8].get()  # (before the end: nothing to check yet)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="its bytes have the CRC-32"):
        array[n - 8 :].get()
