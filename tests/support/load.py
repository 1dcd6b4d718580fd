"""Many concurrent agent sessions through a real mitmdump, checked against what the shards hold.

Each session is a chat loop whose every user message names the session and the turn, so a record stored
under the wrong session (mixed up), twice (duplicated) or not at all (lost) shows when the shards are read
back. Used by the load test and by ``bench/reliability.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from polar_addon.store import read_records


@dataclass
class LoadResult:
    sessions: int
    turns: int
    answered: int
    lost: int
    duplicated: int
    mixed_up: int
    failed_calls: int
    seconds: float
    peak_rss_mb: float
    engine_peak_rss_mb: float = 0.0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    transport_errors: list[str] = field(default_factory=list)


class PeakRss:
    """Peak resident memory of a process and its children, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self.process.memory_info().rss + sum(
                    c.memory_info().rss for c in self.process.children(recursive=True)
                )
            except psutil.Error:
                rss = 0
            self.peak = max(self.peak, rss)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _session(
    http: httpx.AsyncClient, url: str, sid: str, turns: int, max_tokens: int, transport_errors: list[str]
) -> int:
    messages = [{"role": "system", "content": "be brief"}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{sid} turn {turn}"})
        for _ in range(5):
            try:
                response = await http.post(
                    f"{url}/v1/chat/completions",
                    json={"model": "tiny", "messages": messages, "max_tokens": max_tokens},
                    headers={"x-polar-session": sid, "authorization": "Bearer sk-load-secret"},
                )
            except httpx.TransportError as exc:
                # Retried as an agent would; counted, and a retry of a call that was in fact answered shows
                # up as a duplicate in check_store.
                transport_errors.append(f"{sid} turn {turn}: {type(exc).__name__}")
                await asyncio.sleep(0.1)
                continue
            if response.status_code == 200:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{sid} turn {turn}: no answer after 5 tries ({transport_errors[-3:]})")
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"] or ""})
    return turns


def run_load(
    url: str,
    pid: int,
    out: Path,
    sessions: int = 64,
    turns: int = 20,
    max_tokens: int = 8,
    engine_pid: int | None = None,
) -> LoadResult:
    """Drive ``sessions`` x ``turns`` calls through the proxy at ``url`` (process ``pid``); the caller stops the
    proxy afterwards and then calls :func:`check_store`. ``engine_pid``: an engine process whose peak RSS
    (with its children) is reported too."""

    transport_errors: list[str] = []

    async def main() -> int:
        limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            done = await asyncio.gather(
                *(_session(http, url, f"load-{i:03d}", turns, max_tokens, transport_errors) for i in range(sessions))
            )
        return sum(done)

    t0 = time.monotonic()
    with PeakRss(pid) as rss, PeakRss(engine_pid or pid) as engine_rss:
        answered = asyncio.run(main())
    return LoadResult(
        sessions,
        turns,
        answered,
        0,
        0,
        0,
        0,
        time.monotonic() - t0,
        rss.peak / 2**20,
        engine_rss.peak / 2**20 if engine_pid else 0.0,
        transport_errors=transport_errors,
    )


def check_store(result: LoadResult, out: Path) -> LoadResult:
    """Fill in lost / duplicated / mixed-up from the shards (read after the proxy stopped).

    A call is known by the session and turn its last user message names. A failed call (the client
    retries it) keeps its own record and seq, so the answered turns of a session must hold increasing seqs,
    not seqs equal to the turn."""
    seen: Counter = Counter()
    mixed = failed = 0
    reasons: Counter = Counter()
    seqs: dict[str, list[tuple[int, int]]] = {}
    for record in read_records(str(out)):
        if record.status != "ok":
            failed += 1
            reasons[(record.error or record.status)[:120]] += 1
            continue
        last_user = [m for m in record.messages if m["role"] == "user"][-1]["content"]
        sid, _, turn = last_user.partition(" turn ")
        if sid != record.session_id:
            mixed += 1
        seen[(sid, int(turn))] += 1
        seqs.setdefault(record.session_id, []).append((int(turn), record.seq))
    for pairs in seqs.values():
        order = [seq for _, seq in sorted(pairs)]
        mixed += sum(1 for a, b in zip(order, order[1:]) if b <= a)
    expected = {(f"load-{i:03d}", t) for i in range(result.sessions) for t in range(result.turns)}
    result.lost = len(expected - set(seen))
    result.duplicated = sum(n - 1 for n in seen.values() if n > 1)
    result.mixed_up = mixed
    result.failed_calls = failed
    result.failure_reasons = dict(reasons)
    return result
