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
from dataclasses import dataclass
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
                rss = self.process.memory_info().rss + sum(c.memory_info().rss for c in self.process.children(recursive=True))
            except psutil.Error:
                rss = 0
            self.peak = max(self.peak, rss)
            self._stop.wait(0.05)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _session(http: httpx.AsyncClient, url: str, sid: str, turns: int) -> int:
    messages = [{"role": "system", "content": "be brief"}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{sid} turn {turn}"})
        for _ in range(5):
            response = await http.post(f"{url}/v1/chat/completions",
                                       json={"model": "tiny", "messages": messages, "max_tokens": 8},
                                       headers={"x-polar-session": sid, "authorization": "Bearer sk-load-secret"})
            if response.status_code == 200:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{sid} turn {turn}: {response.status_code} {response.text[:200]}")
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"] or ""})
    return turns


def run_load(url: str, pid: int, out: Path, sessions: int = 64, turns: int = 20) -> LoadResult:
    """Drive ``sessions`` x ``turns`` calls through the proxy at ``url`` (process ``pid``); the caller stops the
    proxy afterwards and then calls :func:`check_store`."""

    async def main() -> int:
        limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            done = await asyncio.gather(*(_session(http, url, f"load-{i:03d}", turns) for i in range(sessions)))
        return sum(done)

    t0 = time.monotonic()
    with PeakRss(pid) as rss:
        answered = asyncio.run(main())
    return LoadResult(sessions, turns, answered, 0, 0, 0, 0, time.monotonic() - t0, rss.peak / 2**20)


def check_store(result: LoadResult, out: Path) -> LoadResult:
    """Fill in lost / duplicated / mixed-up from the shards (read after the proxy stopped)."""
    seen: Counter = Counter()
    mixed = failed = 0
    for record in read_records(str(out)):
        if record.status != "ok":
            failed += 1
            continue
        last_user = [m for m in record.messages if m["role"] == "user"][-1]["content"]
        sid, _, turn = last_user.partition(" turn ")
        if sid != record.session_id or int(turn) != record.seq:
            mixed += 1
        seen[(record.session_id, record.seq)] += 1
    expected = {(f"load-{i:03d}", t) for i in range(result.sessions) for t in range(result.turns)}
    result.lost = len(expected - set(seen))
    result.duplicated = sum(n - 1 for n in seen.values() if n > 1)
    result.mixed_up = mixed
    result.failed_calls = failed
    return result
