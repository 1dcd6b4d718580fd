"""The store on an S3-compatible object store: a real moto server on loopback (its own venv, `make s3`).

The journal stays local (object stores cannot fsync an append); shards are uploaded. An outage of the
endpoint is simulated with a loopback TCP relay in front of moto that can be stopped and restarted.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_addon.store import StorageUnavailable, TraceStore, journal, read_records, read_sessions
from polar_addon.store.entries import call_entry
from polar_addon.store.validate import validate_store
from polar_cli.app import app
from tests.support.s3 import AWS_ENV, free_port, moto_server, new_bucket, s3_uri
from tests.test_store_basic import Agent, assert_same


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    with moto_server() as port:
        yield port


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)


_free_port = free_port
_bucket = new_bucket
_uri = s3_uri


class Relay:
    """A loopback TCP relay to moto; stop() makes the endpoint refuse connections like a dead server."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = _free_port()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._conns.clear()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_s3_round_trip_validate_inspect_and_reward(moto_port: int, tmp_path: Path) -> None:
    uri = _uri(_bucket(moto_port), moto_port)
    rng = random.Random(21)
    sent = []

    async def main() -> None:
        async with TraceStore(uri, shard_max_records=7, journal_dir=str(tmp_path / "journal")) as store:

            async def drive(agent: Agent) -> None:
                await store.session_update(agent.session_id, status="running", harness="codex")
                for _ in range(8):
                    record = agent.next_call()
                    await store.append(record)
                    sent.append(record)
                await store.session_update(agent.session_id, status="completed")

            await asyncio.gather(*(drive(Agent(f"s{i}", rng)) for i in range(4)))

    asyncio.run(main())
    assert not list((tmp_path / "journal").rglob("*.wal"))
    assert_same(read_records(uri), sent)
    assert validate_store(uri) == []

    runner = CliRunner()
    result = runner.invoke(
        app, ["reward", uri, "--session", "s2", "--value", "0.75", "--journal-dir", str(tmp_path / "cli-journal")]
    )
    assert result.exit_code == 0, result.output
    assert {s.session_id: s.reward for s in read_sessions(uri)}["s2"] == 0.75
    result = runner.invoke(app, ["shards", "inspect", uri], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "calls ok" in result.output and "32" in result.output and "completed" in result.output
    result = runner.invoke(app, ["shards", "validate", uri])
    assert result.exit_code == 0, result.output


def test_s3_store_replays_a_dead_writers_local_journal(moto_port: int, tmp_path: Path) -> None:
    from polar_addon.capture import CaptureRecord, new_record_id

    uri = _uri(_bucket(moto_port), moto_port)
    writer = tmp_path / "journal" / "w-0badc0de"
    writer.mkdir(parents=True)
    (writer / "lock").touch()
    records = [
        CaptureRecord(
            record_id=new_record_id(),
            session_id="s",
            seq=seq,
            api="openai_chat",
            status="ok",
            prompt_ids=[seq, 1],
            response_ids=[2],
            logprobs=[-0.5],
        )
        for seq in range(3)
    ]
    segment = writer / f"{journal.new_segment_name('0badc0de', 1)}{journal.SEGMENT_SUFFIX}"
    entries = b"".join(journal.frame(call_entry(r, r.seq)) for r in records)
    segment.write_bytes(journal.MAGIC + entries + b"\x07\x00")

    TraceStore(uri, journal_dir=str(tmp_path / "journal")).close()
    assert not segment.exists()
    assert [r.record_id for r in read_records(uri)] == [r.record_id for r in records]
    assert validate_store(uri) == []


@pytest.mark.timeout(240)
def test_s3_outage_refuses_then_recovers_with_nothing_lost(moto_port: int, tmp_path: Path) -> None:
    relay = Relay(moto_port)
    relay.start()
    bucket = _bucket(moto_port)
    uri = _uri(bucket, relay.port)
    rng = random.Random(22)
    agent = Agent("s", rng)
    acknowledged = []

    async def main() -> None:
        async with TraceStore(uri, shard_max_records=3, journal_dir=str(tmp_path / "journal")) as store:
            for _ in range(4):
                record = agent.next_call()
                await store.append(record)
                acknowledged.append(record)
            relay.stop()
            # Appends go to the local journal until a shard upload fails; then the store refuses.
            deadline = time.monotonic() + 120
            while True:
                assert time.monotonic() < deadline, "the store never noticed the outage"
                record = agent.next_call()
                try:
                    await store.append(record)
                    acknowledged.append(record)
                except StorageUnavailable as exc:
                    assert "cannot write shards" in exc.reason
                    break
                await asyncio.sleep(0.05)
            relay.start()
            deadline = time.monotonic() + 120
            while True:
                try:
                    store.check_writable()
                    break
                except StorageUnavailable:
                    assert time.monotonic() < deadline, "the store never recovered"
                    await asyncio.sleep(0.2)
            for _ in range(4):
                record = agent.next_call()
                await store.append(record)
                acknowledged.append(record)

    try:
        asyncio.run(main())
    finally:
        relay.stop()
    direct = _uri(bucket, moto_port)
    stored = read_records(direct)
    assert [r.record_id for r in stored] == [r.record_id for r in acknowledged]
    assert [r.seq for r in stored] == list(range(len(acknowledged)))
    assert validate_store(direct) == []
