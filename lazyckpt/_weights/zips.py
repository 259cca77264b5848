"""Zip archives read by byte ranges: the central directory from the file's end, then
each member's local header, which says where its data starts. What `torch.save`
(`archive/data.pkl`, `archive/data/0`, ...) and `np.savez` (`name.npy`, ...) write.

Python's `zipfile` wants a seekable file and reads a member whole; here a member is a
span of the file (stored) or a deflate stream (compressed), and its data is read
later, by range, by the engine."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

import attrs

from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError
from lazyckpt._weights.files import File

MAGIC = b"PK\x03\x04"
EMPTY = b"PK\x05\x06"
"""How an archive of no members starts: its end record is all it holds (`np.savez`
of no arrays)."""
STORED, DEFLATED = 0, 8
_END = struct.Struct("<4s4H2LH")  # end of central directory
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory entry
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_TAIL = (1 << 16) + _END.size + _END64_LOCATOR.size
"""Enough of the end to hold the end records behind the longest comment."""
_MAX_MEMBERS = 1 << 20
_ENDS = (b"PK\x06\x06", b"PK\x05\x06")
_FIX = "the archive is damaged, download or copy it again"


@attrs.frozen
class Member:
    """One member: where its local header starts, how it is stored, its sizes, and
    where the archive's directory starts (no member's bytes lie past it)."""

    name: str
    header: int
    method: int
    packed: int
    size: int
    bound: int
    crc: int
    """The CRC-32 of its bytes (inflated), which np.load checks as it reads a member
    whole."""


@attrs.frozen
class Stored:
    """A stored (uncompressed) member of `file` whose data starts at `start`: what
    `verify` checks the CRC-32 of. Reads of a few of its bytes cannot: the CRC-32 is
    of the whole member."""

    file: File
    start: int
    member: Member

    def problem(self, piece: int) -> str | None:
        """What is wrong with the member's bytes, read `piece` bytes at a time: its
        CRC-32 is not its directory's, or it ends early; None where nothing is."""
        crc, at, stop = 0, self.start, self.start + self.member.packed
        while at < stop:
            end = min(at + piece, stop)
            crc = zlib.crc32(self.file.read(at, end, f"zip member {self.member.name!r}"), crc)
            at = end
        if crc != self.member.crc:
            return f"zip member {self.member.name!r}: {crc_mismatch(self.member, crc)}"
        return None


def crc_mismatch(member: Member, crc: int) -> str:
    """The finding that `member`'s bytes have the CRC-32 `crc`, not its directory's."""
    return (
        f"its bytes have the CRC-32 {crc:08x} where the archive's directory says "
        f"{member.crc:08x} (np.load refuses them too)"
    )


def members(file: File) -> dict[str, Member]:
    """The members of the zip archive `file`, by name, from its central directory."""
    tail = file.tail(_TAIL)
    at = tail.rfind(b"PK\x05\x06")
    while at >= 0 and at + _END.size + _comment(tail, at) != len(tail):
        at = tail.rfind(b"PK\x05\x06", 0, at)  # (the signature's bytes inside a comment)
    if at < 0:
        raise CorruptCheckpointError(
            f"{file.path}: no zip end record in its last {len(tail)} bytes; the file is "
            "truncated or not a zip archive, download or copy it again"
        )
    _one_end(file, tail, at)
    _, disk, _, _, count, size, offset, _ = _END.unpack_from(tail, at)
    before = at - _END64_LOCATOR.size
    # Where the tail starts in the file: the directory ends where the end records
    # begin (a zip writer puts nothing between), which a suffix read does not say.
    tail_start = offset + size - at
    if before >= 0 and tail[before : before + 4] == b"PK\x06\x07":
        _, _, where, _ = _END64_LOCATOR.unpack_from(tail, before)
        tail_start = where - before + _END64.size
        record = _slice(tail, where - tail_start, _END64.size)
        if record is None or record[:4] != b"PK\x06\x06":
            record = file.read(where, where + _END64.size, "its zip64 end record")
        sig, _, _, _, disk, _, _, count, size, offset = _END64.unpack(record)
        if sig != b"PK\x06\x06":
            raise CorruptCheckpointError(f"{file.path}: no zip64 end record at {where}; {_FIX}")
    if disk != 0:
        raise UnsupportedCheckpointError(
            f"{file.path} is one part of a zip archive split across files; join the parts "
            "into one archive first"
        )
    if count > _MAX_MEMBERS or size > count * (_ENTRY.size + 3 * (1 << 16)):
        raise CorruptCheckpointError(
            f"{file.path}: its zip directory declares {count} members in {size} bytes; {_FIX}"
        )
    # Mostly read with the end: taken from it where it starts with an entry and the
    # end records follow it.
    directory = _slice(tail, offset - tail_start, size + 4)
    if directory is None or directory[:4] != b"PK\x01\x02" or directory[-4:] not in _ENDS:
        directory = file.read(offset, offset + size + 4, "its zip directory")
    found: dict[str, Member] = {}
    for member in _entries(file, directory, count, offset):
        if found.setdefault(member.name, member) is not member:
            raise CorruptCheckpointError(
                f"{file.path}: its zip directory lists {member.name!r} twice, and which "
                "is the member is a guess that zip readers make differently; the archive "
                "is damaged or hostile, download or copy it again"
            )
    return found


def _one_end(file: File, tail: bytes, at: int) -> None:
    """Refuse an end record at `at` that holds another record's signature in its
    comment, or lies in the comment of another one before it (its comment running to
    the file's end too): which directory is the archive's would be a guess. np.load
    and torch take the last signature they find scanning back from the end, whether
    its comment runs to the end or not, so a record hidden in a comment would give
    them another directory than this one."""
    after = tail.find(b"PK\x05\x06", at + 4)
    if after >= 0:
        raise CorruptCheckpointError(
            f"{file.path}: its zip comment holds a second end record, {len(tail) - after} "
            "bytes from its end, which zip readers (np.load, torch) take for the archive's "
            "end instead of the one before it; the file is hostile or damaged, download "
            "or copy it again"
        )
    before = tail.rfind(b"PK\x05\x06", 0, at)
    while before >= 0:
        if before + _END.size + _comment(tail, before) == len(tail):
            raise CorruptCheckpointError(
                f"{file.path}: its zip comment holds a second end record, {len(tail) - at} "
                "bytes from its end, which would hide the archive's directory; the file is "
                "hostile or damaged, download or copy it again"
            )
        before = tail.rfind(b"PK\x05\x06", 0, before)


def _slice(data: bytes, start: int, size: int) -> bytes | None:
    """`size` bytes of `data` from `start`, or None where they are not all in it."""
    if start < 0 or start + size > len(data):
        return None
    return data[start : start + size]


def _comment(tail: bytes, at: int) -> int:
    if at + _END.size > len(tail):
        return 1 << 20  # (cut short: no record fits here)
    return int(_END.unpack_from(tail, at)[-1])


def _entries(file: File, directory: bytes, count: int, bound: int) -> Iterable[Member]:
    at = 0
    for _ in range(count):
        if at + _ENTRY.size > len(directory) or directory[at : at + 4] != b"PK\x01\x02":
            raise CorruptCheckpointError(
                f"{file.path}: its zip directory ends early (at byte {at}); {_FIX}"
            )
        fields = _ENTRY.unpack_from(directory, at)
        flags, method, crc = fields[3], fields[4], fields[7]
        packed, size, name_length, extra_length, comment_length = fields[8:13]
        header = fields[16]
        start = at + _ENTRY.size
        raw_name = directory[start : start + name_length]
        extra = directory[start + name_length : start + name_length + extra_length]
        at = start + name_length + extra_length + comment_length
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        if "\x00" in name:
            # (Python's zipfile, np.load's, cuts a name at its first NUL; torch's
            # zip reader keeps the NUL: each reads another member by the name)
            raise CorruptCheckpointError(
                f"{file.path}: zip member name {name!r} holds a NUL byte, where zip "
                f"readers cut it or not (np.load reads it as {name.split(chr(0))[0]!r}); "
                "the archive is damaged or hostile, download or copy it again"
            )
        if flags & 0x1:
            raise UnsupportedCheckpointError(
                f"{file.path}: zip member {name!r} is encrypted; lazyckpt reads plain "
                "archives only, decrypt it first"
            )
        size, packed, header = _zip64(file, name, extra, size, packed, header)
        if header + packed > bound:
            raise CorruptCheckpointError(
                f"{file.path}: zip member {name!r} is declared at bytes {header} to "
                f"{header + packed}, past the archive's directory at {bound}; {_FIX}"
            )
        yield Member(name, header, method, packed, size, bound, crc)


def _zip64(
    file: File, name: str, extra: bytes, size: int, packed: int, header: int
) -> tuple[int, int, int]:
    """The sizes and offset, from the zip64 extra field where the entry says 0xFFFFFFFF."""
    full = 0xFFFFFFFF
    if full not in (size, packed, header):
        return size, packed, header
    at = 0
    while at + 4 <= len(extra):
        kind, length = struct.unpack_from("<2H", extra, at)
        if kind == 0x0001 and at + 4 + length <= len(extra):
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            out = []
            for value in (size, packed, header):
                out.append(values.pop(0) if value == full and values else value)
            return out[0], out[1], out[2]
        at += 4 + length
    raise CorruptCheckpointError(
        f"{file.path}: zip member {name!r} needs a zip64 field that it lacks; {_FIX}"
    )


def data_starts(
    file: File, found: Iterable[Member], *, extra: int = 0, head: bytes = b""
) -> dict[str, tuple[int, bytes]]:
    """Where each member's data starts, read from its local header, with the first
    `extra` bytes of its data (fewer where the member is shorter), all read
    concurrently: a `.npy` member's header comes with its local header. What lies in
    `head`, the file's first bytes as read already, is not read again."""
    chosen = list(found)
    slack = 4 + 64 + extra  # torch pads each local header to 64 bytes; the name follows
    spans = [
        (m.header, min(m.bound, m.header + _LOCAL.size + len(m.name.encode()) + slack))
        for m in chosen
    ]
    far = [span for span in spans if span[1] > len(head)]
    read = iter(file.reads(far, "a zip member's local header") if far else [])
    heads = [head[start:stop] if stop <= len(head) else next(read) for start, stop in spans]
    out: dict[str, tuple[int, bytes]] = {}
    for member, head in zip(chosen, heads, strict=True):
        if len(head) < _LOCAL.size or head[:4] != MAGIC:
            raise CorruptCheckpointError(
                f"{file.path}: zip member {member.name!r} has no local header at byte "
                f"{member.header}; {_FIX}"
            )
        *_, name_length, extra_length = _LOCAL.unpack_from(head)
        start = member.header + _LOCAL.size + name_length + extra_length
        skip = _LOCAL.size + name_length + extra_length
        wanted = min(extra, member.packed)
        if start + member.packed > member.bound:
            raise CorruptCheckpointError(
                f"{file.path}: zip member {member.name!r}'s data (bytes {start} to "
                f"{start + member.packed}) runs past the archive's directory; {_FIX}"
            )
        data = head[skip : skip + wanted]
        if len(data) < wanted:
            data = file.read(start, start + wanted, f"the start of zip member {member.name!r}")
        out[member.name] = (start, data)
    return out
