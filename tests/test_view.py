"""`polar view`: the HTML page of one session, checked as markup and as headless Chromium renders it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
from build_helpers import AgentSim, Turn, coding_turns, decode, tiny_tokenizer, tool_loop, tool_result
from typer.testing import CliRunner

from polar_addon.store import TraceStore
from polar_cli.app import app
from polar_cli.build import SessionInfo, build_session, detect_eot
from polar_cli.view import render_session
from tests.support.prereq import missing

SYSTEM = {"role": "system", "content": "You are a coding agent."}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Dom(HTMLParser):
    """Elements as (tag, attrs, text) with text gathered from all descendants."""

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str], list[str]]] = []
        self._open: list[int] = []
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}, []))
        if tag not in ("meta", "input", "br", "img", "link"):
            self._open.append(len(self.elements) - 1)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self.elements[self._open.pop()][0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for i in self._open:
            self.elements[i][2].append(data)

    def find(self, cls: str | None = None, **attrs: str) -> list[tuple[str, dict[str, str], str]]:
        found = []
        for tag, a, text in self.elements:
            if cls is not None and not set(cls.split()) <= set(a.get("class", "").split()):
                continue
            if all(a.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                found.append((tag, a, "".join(text)))
        return found


def _session() -> tuple[AgentSim, SessionInfo]:
    sim = AgentSim("view-1")
    main = [SYSTEM, {"role": "user", "content": "Fix the parser."}]
    turns = coding_turns(3)
    turns[1].retokenize = True
    spawn = sim.call(main, turns[0])
    tool_loop(
        sim,
        [{"role": "system", "content": "You are a search sub-agent."}, {"role": "user", "content": "find it"}],
        coding_turns(2),
    )
    main = main + [sim.sent_back(spawn), tool_result(spawn, "output of read_file #0")]
    sim.call(main, Turn(content="x"), status="failed")
    main = tool_loop(sim, main, turns[1:2])
    tool_loop(sim, [SYSTEM, {"role": "user", "content": "Summary so far: parser fixed. Continue."}], coding_turns(2))
    return sim, SessionInfo("view-1", task_id="t1", status="completed", reward=1.0, harness="claude_code")


def _page(tokenizer: object | None) -> tuple[str, AgentSim]:
    sim, info = _session()
    built = build_session("view-1", sim.records, info, eot_token_id=detect_eot(sim.records), decode=decode)
    return render_session(built, sim.records, info, tokenizer=tokenizer), sim


def test_page_structure_tokens_and_breaks() -> None:
    markup, sim = _page(tiny_tokenizer())
    dom = Dom(markup)
    ok = [r for r in sim.records if r.status == "ok"]
    chains = dom.find("chain")
    assert len(chains) == 3
    sampled = dom.find("t s")
    assert len(sampled) == sum(len(r.response_ids) for r in ok)
    assert [int(a["data-id"]) for _, a, _ in sampled][: len(ok[0].response_ids)] == ok[0].response_ids
    assert [float(a["data-lp"]) for _, a, _ in sampled][: len(ok[0].response_ids)] == pytest.approx(
        ok[0].logprobs, abs=1e-5
    )
    assert all(a["style"].startswith("background:hsl(") for _, a, _ in sampled)
    masked = [a for _, a, _ in dom.find("t m") if "data-id" in a]
    assert masked and all("data-lp" not in a for a in masked)
    # Token text joins back to the decoded turn.
    first_turn = dom.find("turn sampled", data_call=str(ok[0].seq))[0][2]
    assert decode(ok[0].response_ids) in first_turn.replace("↵\n", "\n")
    # Breaks and chain starts are marked with their causes.
    assert [a["data-cause"] for _, a, _ in dom.find("start")] == ["sub_agent", "rewritten_history"]
    [(_, _, text)] = dom.find("break", data_cause="rewritten_history")
    assert "continues in chain 2" in text
    [failed] = [r for r in sim.records if r.status != "ok"]
    assert dom.find("break", data_failed=str(failed.seq))
    # Tool calls and tool results readable.
    assert {t for _, _, t in dom.find("name")} >= {"read_file", "bash"}
    assert any("output of read_file #0" in t for _, _, t in dom.find("tool-result"))
    # Self-contained: nothing to fetch.
    assert "<link" not in markup and " src=" not in markup and "http://" not in markup and "https://" not in markup


def test_without_tokenizer_tokens_are_ids() -> None:
    markup, sim = _page(None)
    dom = Dom(markup)
    first = [t for _, _, t in dom.find("t s")][:5]
    assert first == [f"{i} " for i in sim.records[0].response_ids[:5]]
    assert "token ids shown (no tokenizer)" in markup


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_polar_view_in_headless_chromium(tmp_path: Path) -> None:
    if CHROMIUM is None:
        missing("chromium not installed (make browser)")
    sim, _ = _session()
    store = tmp_path / "store"
    tok_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok_dir)

    async def write() -> None:
        async with TraceStore(str(store)) as trace_store:
            for record in sim.records:
                await trace_store.append(record)
            await trace_store.session_update("view-1", status="completed", task_id="t1")
            await trace_store.add_reward("view-1", 1.0)

    asyncio.run(write())
    page = tmp_path / "trace.html"
    result = CliRunner().invoke(
        app, ["view", str(store), "--session", "view-1", "-o", str(page), "--tokenizer", str(tok_dir)]
    )
    assert result.exit_code == 0, result.output

    dumped = _chromium("--dump-dom", page.as_uri(), profile=tmp_path / "p1")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = Dom(dumped.stdout)
    assert dom.find(None, data_ready="1"), "the page's script did not run"
    static = Dom(page.read_text())
    summaries = dom.find("chain-summary")
    sections = static.find("chain")
    assert len(summaries) == len(sections) == 3
    counts = defaultdict(int)
    for _, attrs, _ in summaries:
        counts["s"] += int(attrs["data-sampled"])
        counts["m"] += int(attrs["data-masked"])
    tokens = [(a["class"], a) for _, a, _ in static.find("t") if "data-id" in a]
    assert counts["s"] == sum(c == "t s" for c, _ in tokens) and counts["m"] == sum(c == "t m" for c, _ in tokens)
    assert all("mean logprob" in text for _, _, text in summaries)

    shot = tmp_path / "trace.png"
    taken = _chromium(f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri(), profile=tmp_path / "p2")
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2400)
    pixels = list(image.get_flattened_data())
    colored = sum(1 for r, g, b in pixels if max(r, g, b) - min(r, g, b) > 40)  # logprob-colored tokens
    stripes = sum(1 for p in pixels if p in ((217, 217, 217), (236, 236, 236)))  # masked tokens
    assert colored > 2000 and stripes > 2000, (colored, stripes)
