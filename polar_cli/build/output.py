"""A built trace dataset on disk: ``OUT/part-NNNNN.parquet`` (TRACE_SCHEMA, zstd) + ``OUT/.build_stats.json``.

The stats file is hidden because ``datasets.load_dataset("parquet", data_dir=OUT)`` reads every
visible file as Parquet; hidden names are skipped by it and by ``pyarrow.dataset``. Each part is
written under a hidden temporary name and renamed when complete, so a reader never sees half a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from polar_cli.build.stats import BuildReport
from polar_cli.trace import Trace, table_to_traces, traces_to_table

STATS_FILE = ".build_stats.json"


class TraceWriter:
    def __init__(self, out_dir: str | Path, *, rows_per_file: int = 1024) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rows_per_file = rows_per_file
        self._buffer: list[Trace] = []
        self.files: list[Path] = []
        self.rows = 0

    def write(self, traces: list[Trace]) -> None:
        self._buffer.extend(traces)
        while len(self._buffer) >= self.rows_per_file:
            self._flush(self._buffer[: self.rows_per_file])
            self._buffer = self._buffer[self.rows_per_file :]

    def close(self, report: BuildReport, meta: dict[str, Any]) -> None:
        if self._buffer or not self.files:  # an empty build still yields a readable (empty) dataset
            self._flush(self._buffer)
            self._buffer = []
        data = {**meta, "files": [p.name for p in self.files], "rows": self.rows, **report.to_dict()}
        _atomic_write(self.out_dir / STATS_FILE, orjson.dumps(data, option=orjson.OPT_INDENT_2))

    def _flush(self, traces: list[Trace]) -> None:
        path = self.out_dir / f"part-{len(self.files):05d}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(traces_to_table(traces), tmp, compression="zstd")
        os.replace(tmp, path)
        self.files.append(path)
        self.rows += len(traces)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_traces(out_dir: str | Path) -> list[Trace]:
    files = sorted(Path(out_dir).glob("part-*.parquet"))
    return [t for f in files for t in table_to_traces(pq.read_table(f))]


def read_build_stats(out_dir: str | Path) -> dict[str, Any]:
    return orjson.loads((Path(out_dir) / STATS_FILE).read_bytes())
