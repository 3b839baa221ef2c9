"""A PEFT adapter folder uploaded as one archive (zip, or tar: plain, gzip, bzip2 or xz): its two files, read in
memory, never extracted to disk.

The archive is untrusted input. Only ``adapter_config.json`` and ``adapter_model.safetensors`` are read, at the
archive's root or in one folder; every other regular file (PEFT's README.md, say) is skipped. Refused, each with a
message that says what to fix: more than ``MAX_MEMBERS`` entries, a name that is absolute, climbs out (``..``) or
holds a backslash or NUL, a link or device where a wanted file is, a wanted file twice, a file or the decompressed
stream over the byte limit (the read stops at the limit, so a decompression bomb costs at most that much).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
import zipfile
from pathlib import PurePosixPath

from patchserve.patches.peft_io import CONFIG_FILE, WEIGHTS_FILE, PeftImportError

MAX_MEMBERS = 64
_WANTED = (CONFIG_FILE, WEIGHTS_FILE)


class AdapterArchiveError(PeftImportError):
    """An uploaded adapter archive that is malformed or breaks a limit."""


class AdapterTooLargeError(AdapterArchiveError):
    """An uploaded adapter archive over the byte limit (decompressed)."""


def is_archive(data: bytes) -> bool:
    """Whether ``data`` starts like a zip or a (compressed) tar archive rather than a safetensors patch."""
    if data[:4] in (b"PK\x03\x04", b"PK\x05\x06") or data[:2] == b"\x1f\x8b" or data[:3] == b"BZh":
        return True
    return data[:6] == b"\xfd7zXZ\x00" or data[257:262] == b"ustar"


def _wanted(name: str) -> str | None:
    """Which wanted file ``name`` is (None: another file, skipped); an unsafe name is an error."""
    if not name or "\x00" in name or "\\" in name or name.startswith("/"):
        raise AdapterArchiveError(f"archive member {name!r} has an absolute or unsafe name")
    parts = PurePosixPath(name).parts
    if ".." in parts:
        raise AdapterArchiveError(f"archive member {name!r} climbs out of the archive (..)")
    if parts and parts[-1] in _WANTED and len(parts) <= 2:
        return parts[-1]
    return None


class _Capped(io.RawIOBase):
    """A reader that fails once more than ``limit`` bytes were read through it (a decompressed stream's cap)."""

    def __init__(self, raw: io.BufferedIOBase, limit: int) -> None:
        self.raw, self.limit, self.read_so_far = raw, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = self.raw.readinto(buffer)
        self.read_so_far += n or 0
        if self.read_so_far > self.limit:
            raise AdapterTooLargeError(f"the archive decompresses to more than {self.limit} bytes")
        return n or 0


def _store(found: dict[str, bytes], which: str, data: bytes, limit: int) -> None:
    if which in found:
        raise AdapterArchiveError(f"the archive holds {which} twice; pack one adapter folder")
    if len(data) > limit:
        raise AdapterTooLargeError(f"{which} is over {limit} bytes: not an adapter of this encoder")
    found[which] = data


def _from_zip(data: bytes, limit: int) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
        if len(members) > MAX_MEMBERS:
            raise AdapterArchiveError(f"the archive has {len(members)} entries, over the limit of {MAX_MEMBERS}")
        for info in members:
            which = _wanted(info.filename)
            if which is None or info.is_dir():
                continue
            if (info.external_attr >> 16) & 0o170000 not in (0, 0o100000):  # a link or device: not a regular file
                raise AdapterArchiveError(f"archive member {info.filename!r} is not a regular file")
            if info.file_size > limit:
                raise AdapterTooLargeError(f"{which} is over {limit} bytes: not an adapter of this encoder")
            with archive.open(info) as member:
                _store(found, which, member.read(limit + 1), limit)
    return found


def _from_tar(stream: io.BufferedIOBase, limit: int) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    with tarfile.open(fileobj=stream, mode="r|") as archive:  # streamed: never seeks, decompresses once
        for count, member in enumerate(archive, start=1):
            if count > MAX_MEMBERS:
                raise AdapterArchiveError(f"the archive has over {MAX_MEMBERS} entries")
            which = _wanted(member.name)
            if which is None:
                continue
            if not member.isfile():
                raise AdapterArchiveError(f"archive member {member.name!r} is not a regular file")
            if member.size > limit:
                raise AdapterTooLargeError(f"{which} is over {limit} bytes: not an adapter of this encoder")
            file = archive.extractfile(member)
            assert file is not None
            _store(found, which, file.read(limit + 1), limit)
    return found


def _tar_stream(data: bytes, limit: int) -> io.BufferedIOBase:
    """The tar bytes of ``data`` (decompressed where it is gzip, bzip2 or xz), capped at two files and headers."""
    body = io.BytesIO(data)
    raw: io.BufferedIOBase = body
    if data[:2] == b"\x1f\x8b":
        raw = gzip.GzipFile(fileobj=body)
    elif data[:3] == b"BZh":
        raw = bz2.BZ2File(body)
    elif data[:6] == b"\xfd7zXZ\x00":
        raw = lzma.LZMAFile(body)  # noqa: SIM115 (read by the caller, which the archive's reader closes)
    return io.BufferedReader(_Capped(raw, 2 * limit + 64 * 1024))


def adapter_files(data: bytes, *, limit: int) -> tuple[bytes, bytes]:
    """``(adapter_config.json, adapter_model.safetensors)`` from an uploaded archive; each at most ``limit`` bytes,
    and a compressed tar at most ``limit`` decompressed bytes in all."""
    try:
        found = _from_zip(data, limit) if data[:2] == b"PK" else _from_tar(_tar_stream(data, limit), limit)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise AdapterArchiveError(
            f"the archive cannot be read ({exc}); pack the adapter folder as .zip or .tar.gz"
        ) from exc
    missing = [name for name in _WANTED if name not in found]
    if missing:
        raise AdapterArchiveError(
            f"the archive has no {' or '.join(missing)}: pack the folder PEFT's save_pretrained wrote "
            "(with safe_serialization, the default)"
        )
    return found[CONFIG_FILE], found[WEIGHTS_FILE]
