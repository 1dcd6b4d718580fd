"""`polar loop --eval`: held-out pass@k of the base and of each pushed policy in loop.json, scored by `polar eval`'s
code, drawn in loop-curves.png, its sessions in a store no training reads (a real loop: the runner, mitmdump, the
local engine on the tiny model, `polar train`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from polar_cli.eval.report import build_report
from polar_cli.rollout.loop_eval import eval_due, eval_ks, loop_entry
from polar_cli.train.plots import loop_points

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "toy_task" / "agent.py"
# The verifier sees the agent's files; sample.txt makes a session's outcome depend on its sample index only, so the
# random model's answers cannot move pass@k: the figures below are exact.
HARNESS = f"cmd:{sys.executable} {AGENT} --turns 1 --max-tokens 4 {{instruction}} && echo {{sample}} > sample.txt"
SAMPLE_ZERO = 'test "$(cat sample.txt)" = 0'


def _write(path: Path, tasks: list[dict]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def _session_ids(store: Path) -> set[str]:
    from polar_addon.store.reader import read_table

    return set(read_table(str(store), columns=["session_id"]).column("session_id").to_pylist())


def test_the_schedule_is_the_base_every_nth_and_the_last() -> None:
    assert [i for i in range(7) if eval_due(i, 7, 3)] == [0, 3, 6]
    assert [i for i in range(6) if eval_due(i, 6, 4)] == [0, 4, 5]
    assert [i for i in range(3) if eval_due(i, 3, 1)] == [0, 1, 2]
    assert eval_ks(1) == [1] and eval_ks(4) == [1, 4]
    with pytest.raises(ValueError, match="at least 1"):
        eval_due(0, 2, 0)


def test_a_loop_entry_holds_pass_at_k_its_se_and_the_causes() -> None:
    results = [
        {"session_id": f"s{t}{k}", "task_id": t, "sample": k, "status": status, "reward": reward, "reason": None}
        for t, outcomes in {
            "a": [("completed", 1.0)] * 2,
            "b": [("completed", 0.0), ("timeout", None)],
            "c": [("completed", 1.0), ("error", None)],
        }.items()  # fmt: skip
        for k, (status, reward) in enumerate(outcomes)
    ]
    entry = loop_entry(build_report(results, eval_ks(2)), 3, "ckpt", 2, 1.5)
    # a: 2/2; b: 0/2; c: 1/1 (the infrastructure error masked: out of n, so c has no pass@2)
    assert entry["pass@1"] == pytest.approx(2 / 3) and entry["pass@1_se"] == pytest.approx(
        math.sqrt(1 / 3) / math.sqrt(3)
    )
    assert entry["overall"]["pass@2"] == {"mean": 0.5, "se": 0.5, "tasks": 2}
    assert (entry["tasks"], entry["scored_tasks"], entry["sessions"], entry["scored_sessions"]) == (3, 3, 6, 5)
    assert entry["causes"] == {"passed": 3, "wrong": 1, "verifier_error": 0, "harness_failed": 0, "timeout": 1,
                               "context_overflow": 0, "infrastructure": 1}  # fmt: skip
    assert (entry["iteration"], entry["policy"], entry["version"]) == (3, "ckpt", 2)
    points = loop_points([{"iteration": 0, "reward_mean": 0.25, "reward_se": 0.1}], [entry])
    assert points == {"train reward": [(0, 0.25, 0.1)], "held-out pass@1": [(3, 2 / 3, entry["pass@1_se"])],
                      "held-out pass@2": [(3, 0.5, 0.5)]}  # fmt: skip


def test_loop_eval_records_the_base_and_each_pushed_policy_and_never_trains_on_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    train = _write(tmp_path / "train.jsonl", [{"id": "train-0", "instruction": "say hi", "verify": SAMPLE_ZERO}])
    heldout = _write(tmp_path / "heldout.jsonl", [
        {"id": "pass", "instruction": "say yes", "verify": "true"},
        {"id": "fail", "instruction": "say no", "verify": "false"},
        {"id": "half", "instruction": "say maybe", "verify": SAMPLE_ZERO},
    ])  # fmt: skip
    out = tmp_path / "loop"
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(train), "--harness", HARNESS, "--model",
           str(tiny_model_dir), "--iterations", "2", "--out", str(out), "--samples", "2", "--no-progress",
           "--eval", str(heldout), "--eval-every", "1", "--eval-samples", "2",
           "--lr", "1e-3", "--eot-token-id", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    it0, it1 = state["iterations"]
    assert it0["train"]["status"] == "trained"  # sample 0 passes, sample 1 fails: a group to learn from
    assert it0["train"]["shards"] == [str(out / "iter-000" / "shards")]
    checkpoint = str(out / "iter-000" / "checkpoint")
    assert it1["policy"] == checkpoint

    base, pushed = state["evals"]
    assert (base["iteration"], base["version"], base["policy"]) == (0, 0, str(tiny_model_dir))
    assert (pushed["iteration"], pushed["version"], pushed["policy"]) == (1, 1, checkpoint)
    for entry in (base, pushed):
        # per task pass@1: 1, 0, 1/2; pass@2: 1, 0, 1 (the unbiased estimator: 1 - C(1,2)/C(2,2) for c = 1)
        assert entry["pass@1"] == 0.5 and entry["pass@1_se"] == pytest.approx(math.sqrt(0.25 / 3))
        assert entry["overall"]["pass@2"]["mean"] == pytest.approx(2 / 3)
        assert (entry["tasks"], entry["sessions"], entry["scored_sessions"]) == (3, 6, 6)
        assert entry["causes"]["passed"] == 3 and entry["causes"]["wrong"] == 3
        report = json.loads(Path(entry["report"]).read_text())  # polar eval's own report document
        assert {t["task_id"]: t["pass@1"] for t in report["tasks"]} == {"pass": 1.0, "fail": 0.0, "half": 0.5}
    said = " ".join(done.stdout.split())  # rich wraps at the terminal's width
    assert "held-out eval, iteration 1 (version 1): pass@1 0.500 ± 0.289, pass@2 0.667" in said
    assert "held-out pass@1 0.500 (iteration 0) -> 0.500 (iteration 1): +0.000" in said

    png = Path(state["curves"])
    assert png == out / "loop-curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The eval sessions live in their own stores, and the training build (polar train's own loading of the shards
    # the training was given) never sees one.
    eval_sessions = _session_ids(out / "eval" / "iter-000" / "shards") | _session_ids(
        out / "eval" / "iter-001" / "shards"
    )
    assert len(eval_sessions) == 12 and all(s.startswith(("ev000-", "ev001-")) for s in eval_sessions)
    for i in (0, 1):
        assert not _session_ids(out / f"iter-{i:03d}" / "shards") & eval_sessions
    from polar_cli.train.dataset import load_traces

    traces = load_traces([Path(p) for p in it0["train"]["shards"]], "prefix_merging", tokenizer=tiny_model_dir)
    assert traces and {t.session_id for t in traces}.isdisjoint(eval_sessions)
    assert {t.task_id for t in traces} == {"train-0"}

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)  # done: nothing re-run
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "loop.json").read_text())["evals"] == state["evals"]


def test_loop_eval_options_are_refused_where_they_cannot_apply(tiny_model_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from polar_cli.app import app

    tasks = _write(tmp_path / "t.jsonl", [{"id": "t", "instruction": "x", "verify": "true"}])
    base = ["loop", str(tasks), "--harness", "cmd:true", "--model", str(tiny_model_dir), "--iterations", "2",
            "--out", str(tmp_path / "o")]  # fmt: skip
    for extra, said in (
        (["--eval", str(tasks), "--async"], "--eval runs with the synchronous loop only"),
        (["--eval-every", "2"], "needs --eval"),
        (["--eval-samples", "3"], "needs --eval"),
        (["--eval", str(tasks), "--eval-set", "novalue"], "'novalue' is not KEY=VALUE"),
    ):
        refused = CliRunner().invoke(app, [*base, *extra])
        assert refused.exit_code == 2 and said in " ".join(refused.output.replace("│", " ").split()), refused.output
    assert not (tmp_path / "o" / "loop.json").exists()
