"""Multi-turn tool-using sessions of the five real harness CLIs (``.harness``) through one real mitmdump, with
token continuity off or on, and what their build gives: shared by tests/test_harness_continuity.py and
``bench/continuity.py --harnesses``.

Each harness runs as ``polar rollout``'s preset runs it (its own config, environment and command line), on a copy
of a swe_mini task, against the scripted engine (a tiny random model never calls a tool) replaying that harness's
own fix (``examples/swe_mini/scripts/HARNESS.json``: its own tool names and argument shapes) with a think block on
every turn, rendered with Qwen3's chat template (which drops think blocks before the last user query). Codex uses
its default provider through the forward proxy, so it speaks Responses over its WebSocket; the others use the
reverse listener. The session's *main chain* is its calls with the system prompt and tools most of its calls have;
anything else (Claude Code's title call, Qwen Code's side calls) is a side call, counted on its own.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_addon.capture import CaptureRecord
from polar_cli.build.roles import captured_role, role_kind
from polar_cli.mitm import REPO
from polar_cli.rollout.harnesses.base import SessionContext
from polar_cli.trace import Trace
from tests.support import proxy
from tests.support.proxy import SharedProxy
from tests.support.tito_sessions import build, off_policy_tokens, sampled_tokens_are_trained

SWE_MINI = REPO / "examples" / "swe_mini"
# short name -> preset name (polar_cli.rollout.harnesses)
HARNESSES = {"claude": "claude-code", "codex": "codex", "qwen": "qwen-code", "pi": "pi", "gemini": "gemini-cli"}


def model_name(short: str) -> str:
    return f"tito-{short}"


def _task(preset: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the harness's swe_mini script, its task)."""
    script = json.loads((SWE_MINI / "scripts" / f"{preset}.json").read_text())
    tasks = [json.loads(line) for line in (SWE_MINI / "tasks.jsonl").read_text().splitlines()]
    (task,) = [t for t in tasks if t["id"] == script["task"]]
    return script, task


def _thinking(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The script's turns, each with a think block: Qwen3's template drops them from a re-rendered history."""
    return [{**turn, "reasoning_content": f"Step {i + 1}: decide what to do next."} for i, turn in enumerate(turns)]


def workspace(short: str, root: Path) -> Path:
    return root / f"ws-{short}"


def write_script(model_dir: Path, root: Path, harnesses: list[str]) -> Path:
    """One scripted engine for all harnesses: each model name replays its harness's turns in its workspace."""
    by_model = {}
    for short in harnesses:
        script, _ = _task(HARNESSES[short])
        text = json.dumps(_thinking(script["turns"])).replace("{workspace}", str(workspace(short, root)))
        by_model[model_name(short)] = json.loads(text)
    path = root / "harness-script.json"
    path.write_text(json.dumps({"model_dir": str(model_dir), "cycle": True, "by_model": by_model}))
    return path


@contextmanager
def shared_proxy(script: Path, out: Path, tito: str, options: dict[str, str] | None = None) -> Iterator[SharedProxy]:
    """The harnesses' shared mitmdump (tests/support/proxy.py) with ``polar_tito`` set."""
    with proxy.shared_proxy(script, out, {"polar_tito": tito, **(options or {})}) as started:
        yield started


def session_id(short: str, tito: str) -> str:
    return f"tito-{short}-{tito}"


# The second user turn: the harness resumes its own saved conversation and sends it whole, plus this question.
FOLLOW_UP = "Check the fix once more and say what you changed."


def resume(short: str, argv: list[str]) -> list[str]:
    """The preset's command line turned into one that continues the harness's last conversation."""
    if short == "claude":
        return [*argv, "--continue"]
    if short == "codex":  # codex exec [flags] resume --last PROMPT
        return [*argv[:-1], "resume", "--last", argv[-1]]
    if short == "qwen":
        return [*argv, "--continue"]
    if short == "pi":
        return [*argv[:-1], "--continue", argv[-1]]
    if short == "gemini":
        return [*argv, "--resume", "latest"]
    raise ValueError(short)


def run_harness(
    short: str, proxy: SharedProxy, root: Path, tito: str, *, follow_up: bool = False, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run the real CLI once on its task, in a fresh copy of the task's files (its HOME and working directory);
    ``follow_up``: instead resume that conversation with a second user turn."""
    preset_name = HARNESSES[short]
    preset = importlib.import_module(f"polar_cli.rollout.harnesses.{preset_name.replace('-', '_')}").make(None)
    _, task = _task(preset_name)
    home, work = root / f"home-{short}", workspace(short, root)
    if not follow_up:
        # HOME apart from the project, as a user has it: Gemini CLI and Qwen Code list the working directory into
        # their first message, and on resume list it again (their own state files there would change it).
        for path in (home, work):
            if path.exists():
                shutil.rmtree(path)
        home.mkdir(parents=True)
        shutil.copytree(SWE_MINI / task["workspace"], work)
    ctx = SessionContext(
        session_id=session_id(short, tito),
        task_id=task["id"],
        group_id=task["id"],
        sample=0,
        model=model_name(short),
        proxy_url=f"http://127.0.0.1:{proxy.forward}",
        reverse_url=f"http://127.0.0.1:{proxy.reverse}",
        ca_path=str(proxy.ca),
        home=str(home),
        workspace=str(work),
        secret=proxy.register(session_id(short, tito), task["id"], task["id"]),
    )
    preset.configure(home, ctx)
    base = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env = {**base, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **preset.env(ctx)}
    argv = resume(short, preset.command(FOLLOW_UP, ctx)) if follow_up else preset.command(task["instruction"], ctx)
    if short == "pi":  # keep Pi's session file, so that the follow-up can continue it
        argv = [a for a in argv if a != "--no-session"]
    return subprocess.run(
        argv, env=env, cwd=work, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _system(record: CaptureRecord) -> Any:
    first = record.messages[0] if record.messages else {}
    return first.get("content") if first.get("role") in ("system", "developer") else None


def main_chain(records: list[CaptureRecord]) -> list[CaptureRecord]:
    """The agent loop: the session's calls with the system prompt and tools most of its calls have (the first such
    group on a tie), in order. Side calls (a title, a memory sub-agent) bring their own."""
    ordered = sorted(records, key=lambda r: r.seq)
    groups: dict[str, list[CaptureRecord]] = {}
    for r in ordered:
        groups.setdefault(json.dumps([_system(r), r.tools], sort_keys=True), []).append(r)
    return max(groups.values(), key=len)


@dataclass
class HarnessFigures:
    calls: int
    continuity: int  # calls whose prompt came from continuity
    main_calls: int
    main_continuity: int  # main-chain calls after the first whose prompt came from continuity
    main_traces: int  # traces holding the main chain's calls
    side_calls: int
    side_traces: int
    trainable_tokens: int
    off_policy_tokens: int
    exact: bool  # every main-chain trace's trainable tokens are exactly its calls' sampled ids
    reasons: dict[str, int]  # prompt_reason of main-chain calls after the first that were rendered fresh
    main_roles: dict[str, int]  # the main chain's calls by role ("agent", "auxiliary: qwen-code memory", ...)
    side_roles: dict[str, int]  # the other calls by role


def harness_figures(out: Path, session: str, *, merge_retokenized: bool) -> tuple[HarnessFigures, list[Trace]]:
    records, traces = build(out, merge_retokenized=merge_retokenized)
    mine = [r for r in records if r.session_id == session and r.status == "ok"]
    main = main_chain(mine)
    main_ids = {r.record_id for r in main}
    by_id = {r.record_id: r for r in records}
    session_traces = [t for t in traces if t.session_id == session]
    main_traces = [t for t in session_traces if main_ids & set(t.record_ids)]
    reasons: dict[str, int] = {}
    for r in main[1:]:
        if r.prompt_source != "continuity":
            reasons[r.prompt_reason or "?"] = reasons.get(r.prompt_reason or "?", 0) + 1
    figures = HarnessFigures(
        calls=len(mine),
        continuity=sum(r.prompt_source == "continuity" for r in mine),
        main_calls=len(main),
        main_continuity=sum(r.prompt_source == "continuity" for r in main[1:]),
        main_traces=len(main_traces),
        side_calls=len(mine) - len(main),
        side_traces=len(session_traces) - len(main_traces),
        trainable_tokens=sum(sum(t.loss_mask) for t in session_traces),
        off_policy_tokens=sum(off_policy_tokens(t, by_id) for t in session_traces),
        exact=all(sampled_tokens_are_trained(t, by_id) for t in main_traces),
        reasons=reasons,
        main_roles=dict(Counter(role_kind(captured_role(r)) for r in main)),
        side_roles=dict(Counter(role_kind(captured_role(r)) for r in mine if r.record_id not in main_ids)),
    )
    return figures, main_traces
