"""File contents on local disk, one file per id under a root folder. Writes go to a temporary name
and are renamed into place, so a reader never sees half a file and a crash leaves no partial one."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, Self

from server.ids import is_safe_id


class FileStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not is_safe_id(file_id):
            raise ValueError(f"not a storable file id: {file_id!r}")
        return self.root / file_id

    def writer(self, file_id: str) -> PendingFile:
        """An incremental writer for callers that receive bytes piecemeal (uploads)."""
        return PendingFile(self.path(file_id))

    def write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Stream `chunks` into the file for `file_id`; returns the bytes written."""
        with self.writer(file_id) as pending:
            for chunk in chunks:
                pending.write(chunk)
            pending.commit()
            return pending.bytes_written

    def open(self, file_id: str) -> BinaryIO:
        return self.path(file_id).open("rb")

    def exists(self, file_id: str) -> bool:
        return self.path(file_id).is_file()

    def size(self, file_id: str) -> int:
        return self.path(file_id).stat().st_size

    def delete(self, file_id: str) -> bool:
        """Remove the content; False when there was none."""
        try:
            self.path(file_id).unlink()
            return True
        except FileNotFoundError:
            return False


class PendingFile:
    """A file being written: `write()` appends, `commit()` renames it into place, and leaving the
    `with` block without commit removes it."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.tmp = final.with_name(f".{final.name}.{os.getpid()}.part")
        self._fh: BinaryIO | None = self.tmp.open("wb")
        self.bytes_written = 0

    def write(self, data: bytes) -> None:
        assert self._fh is not None, "write after commit/abort"
        self._fh.write(data)
        self.bytes_written += len(data)

    def commit(self) -> None:
        assert self._fh is not None
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
