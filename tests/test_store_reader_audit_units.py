"""store.reader's copied-shard rule (issue 29 audit): what is warned and what is read when nothing was copied."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from polar_addon.store import read_records
from tests.test_store_copied_shard import _store


def test_a_store_with_no_copies_reads_every_call_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, written = _store(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="polar_addon.store.reader"):
        read = read_records(str(store))
    assert sorted(r.record_id for r in read) == sorted(r.record_id for r in written)
    assert caplog.records == []


def test_the_copies_warning_is_one_exact_line_naming_the_store_and_the_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, _ = _store(tmp_path)
    shard = next(store.glob("calls/*.parquet"))
    shutil.copy(shard, shard.with_name(shard.stem + "-copy.parquet"))
    with caplog.at_level(logging.WARNING, logger="polar_addon.store.reader"):
        read_records(str(store))
    assert [r.getMessage() for r in caplog.records] == [
        f"{store}: 6 call rows are stored more than once (a shard copied under a second name?); each is read once"
    ]
