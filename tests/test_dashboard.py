"""`polar dashboard`: the snapshot of hand-made loop, rollout and store directories (half-written files included),
the read-only Starlette app, and the page in headless Chromium while a real `polar rollout` runs."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from build_helpers import AgentSim, Turn, coding_turns, tool_loop

with warnings.catch_warnings():  # Starlette 1.10 would have httpx2 under its TestClient; httpx works the same
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from polar_addon.store import TraceStore
from polar_cli.dashboard import snapshot as snap
from polar_cli.dashboard.server import create_app
from polar_cli.dashboard_cmd import is_loopback
from polar_cli.rollout.progress_file import PROGRESS_FILE, progress_file
from polar_cli.rollout.session import RolloutProgress
from tests.support.prereq import missing
from tests.support.proxy import REPO

# Agent-controlled strings: a session id, harness, tool name and error reason that are markup.
HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"
HOSTILE_TOOL = "</script><script>document.title='pwned'</script>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of two sessions: a hostile one (id, harness, tool name, reason) and a plain one; a rollout's report
    directory under rollouts/ with its live progress file."""
    root = tmp_path_factory.mktemp("dash") / "store"
    hostile = AgentSim(HOSTILE, harness=HOSTILE)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    tool_loop(hostile, messages, [Turn(tool_calls=[(HOSTILE_TOOL, {"x": HOSTILE})]), Turn(content="done")])
    plain = AgentSim("plain-1", harness="pi")
    tool_loop(plain, messages, coding_turns(3))

    async def write() -> None:
        async with TraceStore(str(root)) as trace_store:
            for record in hostile.records + plain.records:
                await trace_store.append(record)
            await trace_store.session_update(
                HOSTILE, status="error", task_id=HOSTILE, group_id=HOSTILE, metadata={"reason": HOSTILE}
            )
            await trace_store.session_update("plain-1", status="completed", task_id="t", group_id="t")
            await trace_store.add_reward("plain-1", 0.5)

    asyncio.run(write())
    progress = RolloutProgress(total=4)
    progress.stages.update({"done": 2, "agent": 2})
    progress.statuses.update({"completed": 1, "error": 1})
    progress.group_rewards.update({"t": [0.5], HOSTILE: []})
    progress.errors.append((HOSTILE, HOSTILE))
    with progress_file(root / "rollouts" / "r1", progress):
        pass
    return root


# -- the snapshot ----------------------------------------------------------------------------------------------------


def test_store_snapshot(store: Path) -> None:
    got = snap.snapshot(store)
    assert got["kind"] == "store" and got["problems"] == []
    assert {s["session_id"]: (s["status"], s["reward"]) for s in got["sessions"]} == {
        HOSTILE: ("error", None),
        "plain-1": ("completed", 0.5),
    }
    (run,) = got["runs"]
    assert run["name"] == "rollouts/r1" and not run["running"] and run["total"] == 4
    assert got["totals"] == {"stages": {"done": 2, "agent": 2}, "statuses": {"completed": 1, "error": 1}}
    assert run["groups"]["t"]["mean"] == 0.5 and run["groups"]["t"]["n"] == 1
    assert run["groups"][HOSTILE]["n"] == 0 and run["errors"] == [[HOSTILE, HOSTILE]]
    assert set(got["harnesses"]) == {"pi", HOSTILE.split()[0]}
    assert got["harnesses"]["pi"]["sessions"] == 1 and got["harnesses"]["pi"]["merge_rate"] > 0
    engine = got["engine"]
    assert engine["calls"] == 5 and engine["tokens"] > 0
    json.dumps(got, allow_nan=False)  # JSON-able as it is, no NaN


def test_half_written_and_missing_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert snap.snapshot(tmp_path / "absent")["kind"] is None  # started before the rollout: an empty page
    (run / PROGRESS_FILE).write_text('{"total": 3, "stages": {"ag')  # torn by a writer without os.replace
    got = snap.snapshot(run)
    assert got["kind"] == "run" and got["runs"][0]["total"] is None and got["sessions"] == []
    assert got["engine"] is None and got["problems"] == []
    # A store whose shards are not there yet (journal only; a hidden temp shard) reads as empty, and one whose
    # shard is not Parquet says so without failing the page.
    shards = run / "shards"
    (shards / "_journal" / "w-1").mkdir(parents=True)
    (shards / "calls").mkdir()
    (shards / "calls" / ".tmp-1.parquet").write_bytes(b"PAR1 half")
    (run / "rollout-manifest.json").write_text(json.dumps({"store": str(shards)}))
    got = snap.snapshot(run)
    assert got["sessions"] == [] and got["problems"] == [] and got["engine"]["calls"] == 0
    (shards / "calls" / "1-w-0.parquet").write_bytes(b"not parquet")
    got = snap.snapshot(run)
    assert len(got["problems"]) == 1 and "1-w-0.parquet" in got["problems"][0]


def test_loop_snapshot_aggregates_every_iteration(tmp_path: Path, store: Path) -> None:
    loop = tmp_path / "loop"
    for name in ("iter-000", "iter-001", "eval/iter-000"):
        (loop / name).mkdir(parents=True)
    shutil.copytree(store, loop / "iter-000" / "shards", ignore=shutil.ignore_patterns("rollouts"))
    shutil.copytree(store, loop / "iter-001" / "shards", ignore=shutil.ignore_patterns("rollouts"))
    (loop / "iter-001" / "rollout-summary.json").write_text(
        json.dumps({"statuses": {"completed": 2, "failed": 0, "error": 0}, "groups": {"g": {"rewards": [0.0, 1.0]}}})
    )
    state = {
        "iterations": [{"iteration": 0, "reward_mean": 0.25, "reward_se": 0.1, "train": {"status": "ok"}},
                       {"iteration": 1, "reward_mean": float("nan"), "reward_se": None}, "junk"],
        "evals": [{"iteration": 0, "overall": {"pass@1": {"mean": 0.5, "se": 0.2}, "pass@2": {"mean": 0.7}}}],
    }  # fmt: skip
    with progress_file(loop / "iter-000", RolloutProgress(total=3)):
        pass
    # Before loop.json (written after the first iteration): a loop by its first rollout's progress file.
    early = snap.snapshot(loop)
    assert early["kind"] == "loop" and early["loop"] == {"iterations": [], "evals": []}
    assert [r["total"] for r in early["runs"] if r["name"] == "iter-000"] == [3]
    (loop / "loop.json").write_text(json.dumps(state))
    got = snap.snapshot(loop)
    assert got["kind"] == "loop"
    assert sorted(r["name"] for r in got["runs"]) == ["eval/iter-000", "iter-000", "iter-001"]
    [it0, it1] = got["loop"]["iterations"]
    assert (it0["reward_mean"], it0["train"], it1["reward_mean"]) == (0.25, "ok", None)
    assert got["loop"]["evals"][0]["pass"]["pass@1"] == {"mean": 0.5, "se": 0.2}
    ended = next(r for r in got["runs"] if r["name"] == "iter-001")
    assert ended["statuses"] == {"completed": 2} and ended["reward"]["n"] == 2
    # Two iterations' stores, one page: every session of both, merge stats summed.
    assert len(got["sessions"]) == 4 and {s["store"] for s in got["sessions"]} == {
        str(loop / "iter-000" / "shards"), str(loop / "iter-001" / "shards")}  # fmt: skip
    assert got["harnesses"]["pi"]["sessions"] == 2 and got["engine"]["calls"] == 10


def test_a_store_is_read_again_only_once_it_changed(store: Path, tmp_path: Path, monkeypatch) -> None:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    reads: list[str] = []
    read_store = snap.read_store
    monkeypatch.setattr(snap, "read_store", lambda s: reads.append(s) or read_store(s))
    board = snap.Snapshotter(copy)
    first = board.snapshot()
    assert board.snapshot() == first and len(reads) == 1
    before = snap.fingerprint(copy)

    async def more() -> None:
        async with TraceStore(str(copy)) as trace_store:
            await trace_store.add_reward("plain-1", 1.0)

    asyncio.run(more())
    assert snap.fingerprint(copy) != before
    assert {s["session_id"]: s["reward"] for s in board.snapshot()["sessions"]}["plain-1"] == 1.0 and len(reads) == 2


def test_progress_file_is_whole_current_and_redacted(tmp_path: Path, monkeypatch) -> None:
    import polar_cli.rollout.progress_file as progress_module

    monkeypatch.setattr(progress_module, "INTERVAL_S", 0.02)
    token = "tok-" + "x" * 28
    progress = RolloutProgress(total=2)
    path = tmp_path / "r" / PROGRESS_FILE
    with progress_file(tmp_path / "r", progress, lambda: [token]):
        first = json.loads(path.read_text())
        progress.stages["done"] += 1
        progress.errors.append(("s1", f"the agent printed {token}"))
        deadline = time.monotonic() + 10
        while json.loads(path.read_text())["stages"] != {"done": 1} and time.monotonic() < deadline:
            time.sleep(0.02)  # the writer thread's next write, while the block still runs
        during = json.loads(path.read_text())
    last = json.loads(path.read_text())
    assert (first["total"], first["stages"], first["final"]) == (2, {}, False)
    assert during["stages"] == {"done": 1} and not during["final"]
    assert last["final"] and token not in path.read_text() and "the agent printed" in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == [PROGRESS_FILE]  # no temporary file left


# -- the app ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(store: Path) -> Iterator[TestClient]:
    with TestClient(create_app(store, poll_s=0.05, max_events=1), base_url="http://127.0.0.1:8321") as c:
        yield c


def test_only_get(client: TestClient) -> None:
    from urllib.parse import quote

    paths = ["/", "/static/dashboard.js", "/api/snapshot", "/events", f"/session/{quote(HOSTILE, safe='')}"]
    for path in paths:
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            assert client.request(method, path).status_code == 405, (method, path)
    assert client.get("/static/../snapshot.py").status_code == 404
    assert client.get("/nothing").status_code == 404


def test_page_is_self_contained_and_locked_down(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    js = client.get("/static/dashboard.js")
    assert js.headers["content-type"].startswith("text/javascript")
    # Nothing fetched from elsewhere; no data reaches markup through innerHTML.
    for text in (page.text, js.text, client.get("/static/dashboard.css").text):
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    assert "innerHTML" not in js.text and "insertAdjacentHTML" not in js.text and "document.write" not in js.text


def test_snapshot_is_json(client: TestClient) -> None:
    got = client.get("/api/snapshot")
    assert got.headers["content-type"] == "application/json"
    assert HOSTILE in {s["session_id"] for s in got.json()["sessions"]}


def test_events_push_snapshots(client: TestClient) -> None:
    with client.stream("GET", "/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        text = "".join(stream.iter_text())  # max_events=1: the stream ends after the first
    events = [e for e in text.split("\n\n") if e.startswith("event: snapshot")]
    assert len(events) >= 1
    data = json.loads(events[0].split("data: ", 1)[1])
    assert data["kind"] == "store" and "\n" not in events[0].split("data: ", 1)[1]


def test_open_pages_share_one_snapshot_per_change(store: Path, tmp_path: Path) -> None:
    from polar_cli.dashboard.server import Dashboard

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    board = Dashboard(copy)

    async def twice() -> tuple[dict, dict, dict]:
        first, again = await board.snapshot(), await board.snapshot()
        (copy / "rollouts" / "r1" / PROGRESS_FILE).write_text(json.dumps({"total": 9}))
        return first, again, await board.snapshot()

    first, again, changed = asyncio.run(twice())
    assert again is first and changed["runs"][0]["total"] == 9


def test_session_page_is_polar_view(client: TestClient) -> None:
    from urllib.parse import quote

    page = client.get(f"/session/{quote(HOSTILE, safe='')}")
    assert page.status_code == 200, page.text
    assert HOSTILE not in page.text and HOSTILE_TOOL not in page.text  # escaped wherever it shows
    assert "&lt;img src=x" in page.text and 'class="chain"' in page.text
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
    assert client.get("/session/plain-1").status_code == 200
    missing_page = client.get("/session/nope")
    assert missing_page.status_code == 404 and missing_page.headers["content-type"].startswith("text/plain")


def test_loopback_only_unless_allowed(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from polar_cli.app import app

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    refused = CliRunner().invoke(app, ["dashboard", str(tmp_path), "--host", "0.0.0.0"])
    assert refused.exit_code == 2 and "--allow-remote" in refused.output


# -- the page in a browser, during a real rollout ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Page:
    """One Chromium tab driven over the DevTools protocol (aiohttp's websocket client; no extra package)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._id = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        await self.ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=30)
            if message.get("id") == self._id:
                assert "error" not in message, message
                return message["result"]

    async def value(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")


async def until_page(page: Page, condition: str, limit: float = 60) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if await page.value(f"!!({condition})"):
            return True
        await asyncio.sleep(0.25)
    return False


READ = """JSON.stringify({
  updates: Number(document.body.dataset.updates || 0),
  statuses: Object.fromEntries([...document.querySelectorAll('#statuses .chip')].map(
    c => [c.dataset.status, Number(c.dataset.count)])),
  stages: Object.fromEntries([...document.querySelectorAll('#stages .chip')].map(
    c => [c.dataset.stage, Number(c.dataset.count)])),
  sessions: document.querySelectorAll('#sessions tbody a').length,
  cells: [...document.querySelectorAll('#sessions td, #runs td, #group-chart text, #group-chart title')]
    .map(td => td.textContent),
  images: document.querySelectorAll('img').length,
  marker: window.polarMarker || null,
  title: document.title,
})"""


def test_live_page_during_a_rollout(tiny_model_dir: Path, tmp_path: Path) -> None:
    if CHROMIUM is None:
        missing("chromium not installed (make browser)")
    import aiohttp

    tasks = tmp_path / "tasks.jsonl"
    toy = [json.loads(line) for line in (REPO / "examples/toy_task/tasks.jsonl").read_text().splitlines()
           if line.startswith("{")]  # fmt: skip
    tasks.write_text("".join(json.dumps(t) + "\n" for t in [*toy[:3], {**toy[0], "id": HOSTILE}]))
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "PARIS"}]}))
    store = tmp_path / "store"
    agent = f"cmd:{sys.executable} {REPO / 'examples/toy_task/agent.py'} {{instruction}}"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    dashboard = subprocess.Popen(
        [sys.executable, "-m", "polar_cli.app", "dashboard", str(store), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    rollout = chromium = None
    try:
        assert f"127.0.0.1:{port}" in (dashboard.stdout.readline() if dashboard.stdout else "")
        # Started before the rollout: the page waits for the store, then follows it.
        rollout = subprocess.Popen(
            [sys.executable, "-m", "polar_cli.app", "rollout", str(tasks), "--harness", agent, "--samples", "2",
             "--concurrency", "1", "--engine", f"scripted:{script}", "--out", str(store), "--runtime", "local",
             "--trust-agent", "--seed", "7", "--confdir", str(tmp_path / "conf"), "--no-progress",
             "--set", "polar_shard_seconds=0.2"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        profile = tmp_path / "profile"
        chromium = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "--window-size=1280,1600", f"http://127.0.0.1:{port}/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (profile / "DevToolsActivePort").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        devtools = int((profile / "DevToolsActivePort").read_text().split()[0])

        async def drive() -> tuple[dict, dict, bytes]:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{devtools}/json/list") as listing:
                    target = next(t for t in await listing.json() if t["type"] == "page")
                async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    page = Page(ws)
                    # A loaded machine may still be fetching the page: READ needs its body.
                    assert await until_page(
                        page, "document.readyState === 'complete' && document.getElementById('statuses')"
                    )

                    async def read() -> dict:
                        return json.loads(await page.value(READ))

                    async def until(check, what: str, limit: float = 180) -> dict:
                        end = time.monotonic() + limit
                        while time.monotonic() < end:
                            got = await read()
                            if check(got):
                                return got
                            await asyncio.sleep(0.25)
                        pytest.fail(f"{what}: {got}; rollout: {rollout.poll()}")

                    total = lambda r: sum(r["statuses"].values())  # noqa: E731
                    first = await until(lambda r: 0 < total(r) < 8, "a first session finished, not all")
                    await page.value("window.polarMarker = 'same page'")  # a reload would lose it
                    second = await until(lambda r: total(r) > total(first), "more sessions finished")
                    last = await until(lambda r: total(r) == 8 and r["sessions"] == 8, "the rollout's end")
                    shot = await page.call("Page.captureScreenshot", format="png")
                    # A session's link: polar view's page, its script allowed by the policy's hash (it marks ready).
                    link = await page.value(
                        "[...document.querySelectorAll('#sessions tbody tr')].find(tr => tr.cells[1].textContent"
                        f" === {json.dumps(HOSTILE)}).querySelector('a').href"
                    )
                    await page.call("Page.navigate", url=link)
                    trace = await until_page(page, "document.body && document.body.dataset.ready === '1'")
                    sampled = await page.value("document.querySelectorAll('.t.s').length")
                    return (
                        first,
                        second | {"last": last, "trace": trace, "sampled": sampled},
                        base64.b64decode(shot["data"]),
                    )

        first, second, png = asyncio.run(drive())
        rollout.wait(timeout=120)  # its summary and manifest, after the last session's counts
        dashboard.send_signal(signal.SIGINT)  # Ctrl-C with the page still open: its event stream holds nothing up
        dashboard.wait(timeout=20)
    finally:
        for proc in (chromium, rollout, dashboard):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in (chromium, rollout, dashboard):
            if proc is not None:
                proc.wait(timeout=60)
    assert rollout.returncode == 0, rollout.stdout.read() if rollout.stdout else ""
    said = dashboard.stdout.read() if dashboard.stdout else ""
    assert dashboard.returncode in (0, 130) and "Traceback" not in said, (dashboard.returncode, said)  # 130: SIGINT
    last, trace, sampled = second.pop("last"), second.pop("trace"), second.pop("sampled")
    assert trace and sampled > 0, (trace, sampled)
    # Updated in place: more counts, more pushed snapshots, the same document (the marker survived).
    assert second["updates"] > first["updates"] and last["marker"] == second["marker"] == "same page", (first, second)
    assert sum(second["statuses"].values()) > sum(first["statuses"].values())
    assert last["statuses"] == {"completed": 8} and last["stages"].get("done") == 8
    # The hostile task id (the group and task of two sessions) is text on the page, never an element.
    assert HOSTILE in last["cells"] and last["images"] == 0 and last["title"] == "polar dashboard", last
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("127.0.0.1:8321", 200),
        ("localhost:8321", 200),
        ("[::1]:8321", 200),
        ("LOCALHOST", 200),
        ("attacker.example:8321", 400),  # a page whose name was made to resolve to 127.0.0.1 (DNS rebinding)
        ("127.0.0.1.attacker.example", 400),
        ("[::2]:8321", 400),
    ],
)
def test_a_loopback_dashboard_answers_only_its_loopback_names(store: Path, host: str, status: int) -> None:
    """A browser page from elsewhere that rebinds its own name to 127.0.0.1 sends its own name as Host: refused, so
    it cannot read the prompts and outputs the dashboard shows."""
    with TestClient(create_app(store, max_events=1), base_url="http://127.0.0.1:8321") as c:
        for path in ("/", "/api/snapshot", "/session/x"):
            answer = c.get(path, headers={"host": host})
            assert answer.status_code == (status if status == 400 else answer.status_code), (path, host)
            if status == 400:
                assert answer.text == "Invalid host header"
        assert c.get("/api/snapshot", headers={"host": host}).status_code == status


def test_a_dashboard_served_beyond_loopback_answers_any_name(store: Path) -> None:
    with TestClient(create_app(store, max_events=1, hosts=["*"]), base_url="http://box.lan:8321") as c:
        assert c.get("/api/snapshot").status_code == 200
