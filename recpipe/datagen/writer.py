"""Parquet with fixed settings, and datasets that appear whole or not at all.

Byte-identical output for the same seed and scale needs every writer setting pinned (compression,
row-group size, dictionary columns, statistics); pyarrow writes no timestamps into the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from recpipe import schema
from recpipe.errors import UsageError
from recpipe.filemodes import dir_mode
from recpipe.files import check_creatable, link_target, missing_dirs, remove_empty, swap_dir

MANIFEST_NAME = "manifest.json"
DATASET_FILES: tuple[str, ...] = (*schema.TABLE_FILES.values(), MANIFEST_NAME)
ROW_GROUP_ROWS = 1 << 17


def arrow_schema(table: schema.Table) -> pa.Schema:
    return pa.schema([pa.field(c.name, pa.from_numpy_dtype(c.dtype)) for c in table.columns])


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes what passes through, so no second read of the file is needed."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._f = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.sha = hashlib.sha256()
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.sha.update(mv)
        self._f.write(mv)
        self._pos += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        super().close()  # flushes first
        self._f.close()


class TableFile:
    """One Parquet file written in row groups with every setting that affects the bytes pinned.

    Dictionary encoding only for categoricals with few values: for floats and ids it is tried, then
    abandoned page by page, which costs time for nothing. ``sha256`` is ready after the ``with``.
    """

    def __init__(self, path: Path, table: schema.Table) -> None:
        self.path = path
        self.table = table
        self.sha256 = ""
        self._sink: _HashingFile | None = None
        self._writer: pq.ParquetWriter | None = None

    def __enter__(self) -> TableFile:
        table = self.table
        dict_cols = [c.name for c in table.columns
                     if c.kind is schema.Kind.CATEGORICAL and c.cardinality <= 1 << 16]
        encoding = {}
        if table is schema.INTERACTIONS:
            dict_cols = ["label"]
            encoding = {"timestamp": "DELTA_BINARY_PACKED"}  # sorted: a fifth of the plain size, as fast
        self._sink = _HashingFile(self.path)
        self._writer = pq.ParquetWriter(
            self._sink, arrow_schema(table), compression="snappy", use_dictionary=dict_cols,
            column_encoding=encoding or None, write_statistics=True, version="2.6", data_page_version="1.0",
            store_schema=True,
        )
        return self

    def write(self, data: pa.Table) -> None:
        assert self._writer is not None, "TableFile.write outside its with-block"
        self._writer.write_table(data, row_group_size=ROW_GROUP_ROWS)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            if self._sink is not None:
                self._sink.close()
                self.sha256 = self._sink.sha.hexdigest()


def _is_dataset_manifest(path: Path) -> bool:
    """Whether ``path`` is the manifest ``recpipe synth-data`` writes (any schema version): the mark
    that the files beside it are a dataset of ours, which ``--force`` may replace."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "schema_version" in manifest and isinstance(manifest.get("sha256"), dict)


class DatasetDir:
    """Write a dataset into a hidden temporary sibling of ``out`` and move it into place on success.

    ``out`` must not hold a dataset unless ``force``; a directory holding anything but dataset files is
    never replaced (we would delete someone's files). The old dataset is removed only after the new
    one is complete, and an exception leaves ``out`` as it was.
    """

    def __init__(self, out: Path, force: bool) -> None:
        self.out = link_target(out)
        self.force = force
        self.tmp: Path | None = None
        #: the parents of ``out`` that ``__enter__`` made (deepest first): removed again if left empty on failure
        self.made: list[Path] = []
        self._check()

    def _check(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise UsageError(f"{out} exists and is not a directory")
        if out.is_dir():
            entries = sorted(p.name for p in out.iterdir())
            foreign = [e for e in entries if e not in DATASET_FILES or (out / e).is_symlink() or not (out / e).is_file()]
            if foreign:
                raise UsageError(f"{out} holds files that are not part of a dataset ({', '.join(foreign[:3])}); "
                                 "choose a new or empty directory")
            if entries and not _is_dataset_manifest(out / MANIFEST_NAME):
                raise UsageError(f"{out} holds {', '.join(entries[:3])} but no recpipe dataset manifest: not "
                                 "replacing files that may not be ours; choose a new or empty directory")
            if entries and not self.force:
                raise UsageError(f"{out} already holds a dataset; pass --force to replace it")
        existing = out.absolute().parent  # missing parents are created, like mkdir -p
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise UsageError(f"cannot write {out}: {existing} is not a directory")
        try:
            check_creatable(existing)  # permission bits say nothing to root, nor of /proc
        except UsageError as e:
            raise UsageError(f"cannot write {out}: {e}") from None

    def __enter__(self) -> Path:
        parent = self.out.absolute().parent
        self.made = missing_dirs(parent)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=parent))
        except OSError as e:
            remove_empty(self.made)
            raise UsageError(f"cannot write {self.out}: {e.strerror or e}") from None
        return self.tmp

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.tmp is None:
            return
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            remove_empty(self.made)
            return
        try:
            self._commit(self.tmp)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            remove_empty(self.made)
            raise

    def _commit(self, tmp: Path) -> None:
        out = self.out
        os.chmod(tmp, dir_mode())  # mkdtemp makes it 0700
        if out.exists():
            self._check()  # still ours to replace (nothing foreign appeared meanwhile)
        swap_dir(tmp, out)
