"""kill -9 of a real mitmdump under 64 concurrent sessions x 20 turns, several times, at moments chosen under load.

Clients keep going across the kills (a call cut by a kill is retried against the restarted proxy). At the
end, what the clients received is compared against what the shards hold: every answered call is stored
exactly once, under its own session; what else is stored can only be a call cut by a kill (persisted, then
killed before its answer left), never more of those than the client made attempts.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import orjson
import pytest

from polar_addon.store import read_records
from polar_addon.store.validate import validate_store
from tests.support.proxy import run_mitmdump

SESSIONS = 64
TURNS = 20
KILLS = 3


def _answer(message: dict) -> tuple:
    return (message.get("content"), tuple(c["function"]["name"] for c in message.get("tool_calls") or []))


def _stored_answer(response_json: str) -> tuple | None:
    message = orjson.loads(response_json)
    if message is None:
        return None  # a failed call
    return (message.get("content"), tuple(c["name"] for c in message.get("tool_calls") or []))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_kill9_of_mitmdump_under_load_loses_and_duplicates_nothing(vllm_server: str, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    rng = random.Random(4242)
    received: dict[tuple[str, int], tuple] = {}
    attempts: Counter = Counter()
    current: dict[str, str | None] = {"url": None}
    all_done = threading.Event()
    kill_log: list[str] = []

    t0 = time.monotonic()

    def controller() -> None:
        for round_ in range(KILLS + 1):
            last = round_ == KILLS
            with run_mitmdump(
                f"vllm:{vllm_server}",
                out,
                mode="reverse:https://api.openai.com",
                options={"polar_shard_records": "64", "polar_shard_seconds": "2"},
            ) as proxy:
                current["url"] = proxy.url
                if last:
                    all_done.wait(timeout=900)
                    current["url"] = None
                    continue  # leaving the block stops mitmdump gracefully (SIGINT): shards flushed
                start = len(received)
                target = start + rng.randrange(30, 200)
                while len(received) < target and not all_done.is_set():
                    all_done.wait(0.01)
                current["url"] = None
                os.killpg(proxy.process.pid, signal.SIGKILL)
                proxy.process.wait()
                kill_log.append(f"kill {round_ + 1} after {len(received)} answers at {time.monotonic() - t0:.0f}s")

    async def client(http: httpx.AsyncClient, i: int) -> None:
        sid = f"sess-{i:02d}"
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{sid} begins"}]
        for turn in range(TURNS):
            while True:
                url = current["url"]
                if url is None:
                    await asyncio.sleep(0.05)
                    continue
                attempts[(sid, turn)] += 1
                try:
                    response = await http.post(
                        f"{url}/v1/chat/completions",
                        json={"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 1.0},
                        headers={"x-polar-session": sid, "authorization": "Bearer sk-test"},
                    )
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
                    continue
                if response.status_code != 200:
                    await asyncio.sleep(0.1)
                    continue
                break
            message = response.json()["choices"][0]["message"]
            received[(sid, turn)] = _answer(message)
            messages = messages + [
                {"role": "assistant", "content": message.get("content") or ""},
                {"role": "user", "content": f"{sid} result {turn}"},
            ]

    async def clients() -> None:
        limits = httpx.Limits(max_connections=SESSIONS, max_keepalive_connections=SESSIONS)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            await asyncio.gather(*(client(http, i) for i in range(SESSIONS)))
        all_done.set()

    thread = threading.Thread(target=controller, daemon=True)
    thread.start()
    try:
        asyncio.run(clients())
    finally:
        all_done.set()
        thread.join(timeout=120)
    assert len(kill_log) == KILLS, kill_log
    assert len(received) == SESSIONS * TURNS

    assert validate_store(str(out)) == []
    records = read_records(str(out))
    assert len({r.record_id for r in records}) == len(records)
    by_turn: dict[tuple[str, int], list] = defaultdict(list)
    for record in records:
        messages = orjson.loads(record.messages_json)
        assert messages[1]["content"] == f"{record.session_id} begins", "record under the wrong session"
        by_turn[(record.session_id, (len(messages) - 2) // 2)].append(record)
    lost, extra = [], 0
    for key, answer in received.items():
        stored = by_turn.get(key, [])
        ok = [r for r in stored if r.status == "ok"]
        matches = [r for r in ok if _stored_answer(r.response_json) == answer]
        if len(matches) != 1:
            lost.append((key, len(matches)))
        assert len(stored) <= attempts[key], f"{key}: {len(stored)} records for {attempts[key]} attempts"
        extra += len(stored) - len(matches)
    assert lost == [], lost[:10]
    # Answered calls come back in the order they were made, per session.
    for i in range(SESSIONS):
        sid = f"sess-{i:02d}"
        seqs = [
            next(r.seq for r in by_turn[(sid, t)] if _stored_answer(r.response_json) == received[(sid, t)])
            for t in range(TURNS)
        ]
        assert seqs == sorted(seqs)
    failures = Counter(r.error for r in records if r.status != "ok")
    print(
        f"{'; '.join(kill_log)}; {len(records)} records, "
        f"{extra} not answered (cut by a kill or failed: {dict(failures)})"
    )
