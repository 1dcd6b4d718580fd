"""Where shards live (polar_addon.store.shards): a store URI's root, which files are complete shards or quarantine
files, atomic local writes that leave no temp file, the same on a remote filesystem, the Parquet encoding
choices and the output probe."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_addon.store.shards import CALLS, REWARDS, SCHEMAS, SESSIONS, Output, fsync_dir


def _calls(n: int = 2) -> pa.Table:
    rows = [
        {
            "record_id": f"r{i}",
            "session_id": "s",
            "seq": i,
            "harness": "h/1",
            "prompt_ref": None,
            "prompt_tail": [1, 2],
            "response_ids": [3],
            "logprobs": [-0.5],
        }
        for i in range(n)
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMAS[CALLS])


def test_a_local_uri_is_an_absolute_directory_and_a_remote_one_has_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Output.local_root("out") == str(tmp_path / "out")
    assert Output.local_root("~/out") == str(tmp_path / "home" / "out")
    assert Output.local_root("file:///data/out") == "/data/out"
    assert Output.local_root("file://~/out") == str(tmp_path / "home" / "out")
    assert Output.local_root("/data/./out/") == "/data/out"
    assert Output.local_root("s3://bucket/out") is None
    assert Output.local_root("mock:///bucket") is None


def test_from_uri_keeps_the_uri_and_strips_a_remote_roots_trailing_slash(tmp_path: Path) -> None:
    local = Output.from_uri(f"file://{tmp_path}/out")
    assert (local.uri, local.root, local.local) == (f"file://{tmp_path}/out", f"{tmp_path}/out", True)
    assert type(local.fs).__name__ == "LocalFileSystem"
    remote = Output.from_uri("mock:///bucket/prefix/")
    assert (remote.uri, remote.root, remote.local) == ("mock:///bucket/prefix/", "bucket/prefix", False)
    assert remote.kind_dir(CALLS) == "bucket/prefix/calls"
    assert remote.shard_path(REWARDS, "0001") == "bucket/prefix/rewards/0001.parquet"
    assert remote.quarantine_path("0001") == "bucket/prefix/_quarantine/0001.jsonl"


def test_only_complete_visible_parquet_files_are_shards_oldest_first(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path))
    assert out.list_shards(CALLS) == []  # no calls/ yet
    calls = tmp_path / "calls"
    calls.mkdir()
    for name in ("0002-b.parquet", "0001-a.parquet", ".0003-c.parquet.tmp", ".0004.parquet", "_0005.parquet", "x.json"):
        (calls / name).write_bytes(b"")
    (calls / "0006-dir.parquet").mkdir()
    assert out.list_shards(CALLS) == [str(calls / "0001-a.parquet"), str(calls / "0002-b.parquet")]
    assert out.list_shards(SESSIONS) == []
    assert out.exists(str(calls)) and out.exists(str(calls / "x.json")) and not out.exists(str(tmp_path / "nope"))


def test_a_local_shard_appears_whole_under_its_name_with_no_temp_file_left(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path / "out"))
    path = out.write_shard(CALLS, "0001-w", _calls())
    assert path == str(tmp_path / "out" / "calls" / "0001-w.parquet")
    assert sorted(os.listdir(tmp_path / "out" / "calls")) == ["0001-w.parquet"]
    table = pq.read_table(path)
    assert table.equals(_calls()) and table.schema.metadata == {b"polar.store.format": b"1"}
    # Written again (a retried conversion): replaced, not appended to.
    out.write_shard(CALLS, "0001-w", _calls(1))
    assert pq.read_table(path).num_rows == 1 and sorted(os.listdir(tmp_path / "out" / "calls")) == ["0001-w.parquet"]


def test_repeating_strings_are_dictionary_encoded_and_only_the_lookup_columns_have_statistics(tmp_path: Path) -> None:
    path = Output.from_uri(str(tmp_path)).write_shard(CALLS, "0001", _calls())
    meta = pq.ParquetFile(path).metadata
    columns = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i) for i in range(meta.num_columns)}
    assert columns["harness"].compression == "ZSTD"
    assert "RLE_DICTIONARY" in columns["harness"].encodings and "RLE_DICTIONARY" in columns["session_id"].encodings
    for unique in ("record_id", "prompt_ref"):
        assert "RLE_DICTIONARY" not in columns[unique].encodings, unique
    with_stats = sorted(name for name, c in columns.items() if c.is_stats_set)
    assert with_stats == ["record_id", "seq", "session_id"]
    assert (columns["seq"].statistics.min, columns["seq"].statistics.max) == (0, 1)
    # A table without some dictionary column (an older layout) is written too.
    rewards = pa.Table.from_pylist([{"reward_id": "r", "session_id": "s", "value": 1.0}], schema=SCHEMAS[REWARDS])
    assert pq.read_table(Output.from_uri(str(tmp_path)).write_shard(REWARDS, "0001", rewards)).equals(rewards)


def test_a_stale_temp_file_is_removed_and_a_missing_one_is_no_error(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path))
    (tmp_path / "calls").mkdir()
    stale = tmp_path / "calls" / ".0001.parquet.tmp"
    stale.write_bytes(b"half")
    (tmp_path / "calls" / ".0002.parquet.tmp").write_bytes(b"another")
    out.remove_stale_tmp(CALLS, "0001")
    assert not stale.exists() and (tmp_path / "calls" / ".0002.parquet.tmp").exists()
    out.remove_stale_tmp(CALLS, "0001")
    out.remove_stale_tmp(SESSIONS, "0001")  # no sessions/ at all


def test_quarantine_files_are_written_whole_and_listed_oldest_first(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path))
    assert out.list_quarantine() == []
    out.write_quarantine("0002", b'{"entry":1}\n')
    out.write_quarantine("0001", b'{"entry":0}\n')
    directory = tmp_path / "_quarantine"
    (directory / ".0003.jsonl.tmp").write_bytes(b"")
    (directory / ".0004.jsonl").write_bytes(b"")
    (directory / "notes.txt").write_bytes(b"")
    (directory / "0005.jsonl").mkdir()
    assert out.list_quarantine() == [str(directory / "0001.jsonl"), str(directory / "0002.jsonl")]
    assert (directory / "0002.jsonl").read_bytes() == b'{"entry":1}\n'
    assert not (directory / ".0002.jsonl.tmp").exists()


def test_a_remote_store_writes_shards_and_quarantine_straight_to_their_keys() -> None:
    out = Output.from_uri("mock:///bucket/prefix")
    assert not out.exists("bucket/prefix/calls")
    path = out.write_shard(CALLS, "0001", _calls())
    assert path == "bucket/prefix/calls/0001.parquet" and out.list_shards(CALLS) == [path]
    assert pq.read_table(path, filesystem=out.fs).equals(_calls())
    out.remove_stale_tmp(CALLS, "0001")  # nothing to remove on an object store
    assert out.list_shards(CALLS) == [path]
    out.write_quarantine("0001", b"line\n")
    assert out.list_quarantine() == ["bucket/prefix/_quarantine/0001.jsonl"]
    with out.fs.open_input_stream("bucket/prefix/_quarantine/0001.jsonl") as f:
        assert f.read() == b"line\n"
    out.probe()
    assert [i.base_name for i in out.fs.get_file_info(_selector("bucket/prefix"))] == ["_quarantine", "calls"]


def test_a_fresh_remote_store_creates_its_prefix_for_a_quarantine_file_or_the_probe() -> None:
    out = Output.from_uri("mock:///bucket/deep/prefix")
    out.write_quarantine("0001", b"line\n")
    assert out.list_quarantine() == ["bucket/deep/prefix/_quarantine/0001.jsonl"]
    fresh = Output.from_uri("mock:///bucket/other/prefix")
    fresh.probe()
    assert fresh.exists("bucket/other/prefix") and fresh.list_shards(CALLS) == []


def test_a_write_that_fails_midway_leaves_only_a_hidden_temp_file_beside_the_shards(
    tmp_path: Path, monkeypatch
) -> None:
    """Readers skip it and the next conversion removes it: it must be in the kind's directory, under the hidden
    name, never the final one."""
    from polar_addon.store import shards

    def torn(table: pa.Table, sink) -> None:
        sink.write(b"PAR1 half a shard")
        raise OSError("disk gone")

    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(shards, "_write_parquet", torn)
    out = Output.from_uri(str(tmp_path / "out"))
    with pytest.raises(OSError, match="disk gone"):
        out.write_shard(CALLS, "0001", _calls())
    assert os.listdir(tmp_path / "out" / "calls") == [".0001.parquet.tmp"] and os.listdir(workdir) == []
    assert out.list_shards(CALLS) == []
    out.remove_stale_tmp(CALLS, "0001")
    assert os.listdir(tmp_path / "out" / "calls") == []
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("fsync failed")))
    with pytest.raises(OSError, match="fsync failed"):
        out.write_quarantine("0002", b"line\n")
    assert os.listdir(tmp_path / "out" / "_quarantine") == [".0002.jsonl.tmp"] and os.listdir(workdir) == []
    assert out.list_quarantine() == []


def _selector(path: str):
    import pyarrow.fs as pafs

    return pafs.FileSelector(path)


def test_the_probe_creates_the_output_leaves_nothing_and_fails_where_nothing_can_be_written(tmp_path: Path) -> None:
    out = Output.from_uri(str(tmp_path / "new" / "out"))
    out.probe()
    assert os.listdir(tmp_path / "new" / "out") == []
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        Output.from_uri(str(tmp_path / "file" / "out")).probe()
    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o500)
    if os.geteuid() != 0:
        with pytest.raises(PermissionError):
            Output.from_uri(str(readonly)).probe()


def test_fsync_dir_takes_directories_only_and_closes_what_it_opens(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError):
        fsync_dir(str(tmp_path / "f"))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        fsync_dir(str(tmp_path))
    assert len(os.listdir("/proc/self/fd")) == before
