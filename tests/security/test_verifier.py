"""Issue 23, attacks 2, 5 and 11, on real `polar rollout` runs: the agent (tests/security/verifier_attacker.sh, a
``cmd:`` harness) attacks its verifier through the code it leaves for the verifier to run, and its own status by
failing loudly; through a real mitmdump + polar addon with the scripted engine.

- The reward comes from the verifier only: a reward.json the tested code forged, a reward.txt linked to a host
  file, a 4 GiB reward file, a writer left rewriting reward.txt, lines appended to the running test.sh: each scores
  0, never 1 (bwrap; the left-behind writer on oci too).
- Failure is a reward, not a mask: exit 1, `kill -9 $$` and a silent harness are ``failed`` (reward 0, stored
  ``agent_error``, trainable in `polar build`); the summary gives each group's mask rate.
- A relative ``reward_file`` works on bwrap; a Harbor task on ``local`` is refused before any session runs.
Plus the pure reading of reward files (verify.py): booleans, NaN, huge numbers, links, size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_addon.store import read_sessions
from polar_cli.build.output import read_traces
from polar_cli.rollout.proxy import StartedProxy
from polar_cli.rollout.runtimes.base import TOOLS_HOST
from polar_cli.rollout.verify import (
    NoReward,
    file_rewards,
    guard_left,
    harbor_rewards,
    parse_reward_json,
    read_reward_file,
)
from tests.support.attacks import store_of
from tests.support.oci_image import build_harness_image, build_test_image
from tests.support.proxy import REPO
from tests.support.shards import wait_for_shards

ATTACKER = Path(__file__).with_name("verifier_attacker.sh")
HARNESS = f"cmd:sh {ATTACKER} {{instruction}}"
# tests/test.sh shapes: one writes a 0 when the tests fail, the other writes only on success (both common).
ZERO_ELSE = (
    "sh ./solution.sh 2>/dev/null\n"
    "if [ -f passed ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
)
ONLY_ON_PASS = "sh ./solution.sh 2>/dev/null\n[ -f passed ] && echo 1 > /logs/verifier/reward.txt\nexit 0\n"
# The same "write only on success" shape around tests that import the code under test (as pytest does), with and
# without polar-untrusted; both write reward.json too, so it counts (Task.reward_json).
PASSED = "echo 1 > /logs/verifier/reward.txt && echo '{\"reward\": 1}' > /logs/verifier/reward.json\nexit 0\n"
UNTRUSTED = f"PYTHONPATH=/tests polar-untrusted python3 -m unittest -q test_solution && {PASSED}"
UNGUARDED = f"PYTHONPATH=/tests python3 -m unittest -q test_solution && {PASSED}"
ATTACK_OF = {"forge-unguarded": "forge-untrusted"}  # task -> the attacker's mode, where they differ
TEST_SOLUTION = (
    "import unittest\n\nimport solution\n\n\nclass Answer(unittest.TestCase):\n"
    "    def test_answer(self):\n        self.assertEqual(solution.answer(), 42)\n"
)


def _rollout(proxy: StartedProxy, root: Path, tasks: Path, *extra: str, seed: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "polar_cli.app",
        "rollout",
        str(tasks),
        "--harness",
        HARNESS,
        "--proxy",
        f"http://127.0.0.1:{proxy.endpoints.forward_port}",
        "--reverse-url",
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
        "--confdir",
        str(Path(proxy.endpoints.ca).parent),
        "--report-dir",
        str(root / "report"),
        "--seed",
        str(seed),
        "--no-progress",
        "--concurrency",
        "4",
        *extra,
    ]
    return subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "POLAR_CONTROL_TOKEN": proxy.control_token},
    )


def _by_task(root: Path) -> dict[str, dict]:
    summary = json.loads((root / "report" / "rollout-summary.json").read_text())
    return {s["task_id"]: s for s in summary["session_results"]}


def _host_secret(root: Path) -> Path:
    """A numeric host file the sandbox never sees: what a link followed on the host would turn into reward 1."""
    secret = root / "host-secret.txt"
    secret.write_text("1\n")
    return secret


def _harbor_task(root: Path, name: str, instruction: str, test_sh: str, base: str = "python:3.11-slim") -> None:
    task = root / name
    (task / "environment" / "app").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 60.0\n')
    (task / "instruction.md").write_text(instruction + "\n")
    (task / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\nCOPY app/ /app/\n")
    (task / "environment" / "app" / "README").write_text("start\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\ncd /app\n" + test_sh)
    (task / "tests" / "test_solution.py").write_text(TEST_SOLUTION)


@pytest.fixture(scope="module")
def harbor_run(proxy: StartedProxy, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One `polar rollout --runtime bwrap` over a Harbor task per attack (and an honest one)."""
    root = tmp_path_factory.mktemp("harbor-attacks")
    secret = _host_secret(root)
    tasks = root / "harbor"
    for mode, test_sh in (
        ("honest", ZERO_ELSE),
        ("forge-json", ZERO_ELSE),
        ("background", ZERO_ELSE),
        ("append-tests", ZERO_ELSE),
        ("link-txt", ONLY_ON_PASS),
        ("huge-txt", ONLY_ON_PASS),
        ("forge-untrusted", UNTRUSTED),
        ("honest-untrusted", UNTRUSTED),
        ("forge-unguarded", UNGUARDED),
    ):
        _harbor_task(tasks, mode, f"MODE={ATTACK_OF.get(mode, mode)} {secret}", test_sh)
    done = _rollout(proxy, root, tasks, "--runtime", "bwrap", seed=2320)
    assert done.returncode == 0, done.stdout + done.stderr
    return _by_task(root)


def _scored(session: dict) -> tuple[str, float | None]:
    return session["status"], session["reward"]


def test_an_honest_harbor_session_is_rewarded(harbor_run: dict[str, dict]) -> None:
    assert _scored(harbor_run["honest"]) == ("completed", 1.0), harbor_run["honest"]["reason"]


def test_a_reward_json_forged_by_the_tested_code_is_ignored(harbor_run: dict[str, dict]) -> None:
    """The task's tests never write reward.json, so only reward.txt (test.sh's 0) counts."""
    assert _scored(harbor_run["forge-json"]) == ("completed", 0.0), harbor_run["forge-json"]["reason"]


def test_a_reward_txt_linked_to_a_host_file_is_not_followed(harbor_run: dict[str, dict]) -> None:
    session = harbor_run["link-txt"]
    assert _scored(session) == ("completed", 0.0), session["reason"]
    assert "not a regular file" in session["reason"]


def test_a_huge_reward_file_is_refused_by_its_size(harbor_run: dict[str, dict]) -> None:
    session = harbor_run["huge-txt"]
    assert _scored(session) == ("completed", 0.0), session["reason"]
    assert f"{4 * 2**30} bytes, over the 65536" in session["reason"]


def test_a_writer_left_by_the_tested_code_voids_the_reward(harbor_run: dict[str, dict]) -> None:
    """A loop rewriting reward.txt with 1 races test.sh's 0 and outlives it: found alive at the end, scored 0."""
    session = harbor_run["background"]
    assert _scored(session) == ("completed", 0.0), session["reason"]
    assert "left running past the verifier" in session["reason"]


def test_the_running_test_sh_cannot_be_extended(harbor_run: dict[str, dict]) -> None:
    """/tests is read-only: the line appended for bash to run after test.sh's own never lands."""
    assert _scored(harbor_run["append-tests"]) == ("completed", 0.0), harbor_run["append-tests"]["reason"]


def test_the_tested_code_cannot_write_the_reward_under_polar_untrusted(harbor_run: dict[str, dict]) -> None:
    """test.sh writes the reward only when the tests pass; the code they import writes reward.txt and reward.json
    itself (directly, through /proc, renamed or linked from /tmp, from a child) and fails them: under
    polar-untrusted none of it lands, so no reward file is there and the session scores 0."""
    session = harbor_run["forge-untrusted"]
    assert _scored(session) == ("completed", 0.0), session["reason"]
    assert "wrote neither /logs/verifier/reward.txt nor reward.json" in session["reason"]


def test_without_polar_untrusted_the_same_code_forges_its_reward(harbor_run: dict[str, dict]) -> None:
    """The control: the attack above is real (the reason polar-untrusted exists)."""
    assert _scored(harbor_run["forge-unguarded"]) == ("completed", 1.0), harbor_run["forge-unguarded"]["reason"]


def test_an_honest_solution_passes_through_polar_untrusted(harbor_run: dict[str, dict]) -> None:
    """It writes its workspace, /tmp and HOME under polar-untrusted; the tests pass and test.sh's reward counts."""
    session = harbor_run["honest-untrusted"]
    assert _scored(session) == ("completed", 1.0), session["reason"]


def test_a_harbor_task_on_local_is_refused_before_any_session_runs(proxy: StartedProxy, tmp_path: Path) -> None:
    tasks = tmp_path / "harbor"
    _harbor_task(tasks, "honest", "MODE=honest", ZERO_ELSE)
    done = _rollout(proxy, tmp_path, tasks, "--runtime", "local", "--trust-agent", seed=2321)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "use --runtime bwrap or --runtime oci" in done.stderr
    assert not (tmp_path / "report" / "logs" / "sessions").exists()  # no harness ran


@pytest.fixture(scope="module")
def jsonl_run(proxy: StartedProxy, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("jsonl-attacks")
    secret = _host_secret(root)
    (root / "ws").mkdir()
    (root / "ws" / "README").write_text("the task\n")
    tasks = [
        {"id": "exit1", "instruction": "MODE=exit1", "verify": "true"},
        {"id": "kill9", "instruction": "MODE=kill9", "verify": "true"},
        {"id": "silent", "instruction": "MODE=silent", "verify": "true"},  # the verifier would pass it: 1.0
        {"id": "honest", "instruction": "MODE=honest", "verify": "test -f passed"},
        {"id": "honest-fail", "instruction": "MODE=honest-fail", "verify": 'test "$(cat answer.txt)" = 42'},
        {
            "id": "relative",
            "instruction": "MODE=honest",
            "reward_file": "out/reward.txt",
            "verify": "mkdir -p out && echo 0.25 > out/reward.txt",
        },
        {
            "id": "link-file",
            "instruction": f"MODE=link-file {secret}",
            "reward_file": "reward.txt",
            "verify": "sh ./solution.sh; true",
        },
    ]
    path = root / "tasks.jsonl"
    path.write_text("".join(json.dumps({"workspace": "ws", **t}) + "\n" for t in tasks))
    done = _rollout(proxy, root, path, "--runtime", "bwrap", seed=2322)
    assert done.returncode == 0, done.stdout + done.stderr
    return root, _by_task(root)


def test_failing_loudly_is_failed_with_reward_0_never_masked(
    jsonl_run: tuple[Path, dict[str, dict]], proxy: StartedProxy
) -> None:
    root, sessions = jsonl_run
    for task in ("exit1", "kill9", "silent"):
        assert _scored(sessions[task]) == ("failed", 0.0), (task, sessions[task]["reason"])
    assert sessions["exit1"]["exit_code"] == 1 and sessions["kill9"]["exit_code"] not in (0, None)
    assert "produced nothing" in sessions["silent"]["reason"]
    # Their honest sibling that exits 0 scores the same 0: failing loudly pays nothing more.
    assert _scored(sessions["honest-fail"]) == ("completed", 0.0)
    assert _scored(sessions["honest"]) == ("completed", 1.0)
    summary = json.loads((root / "report" / "rollout-summary.json").read_text())
    assert summary["statuses"]["failed"] == 3 and summary["mask_rate"] == 0.0
    assert summary["groups"]["kill9"] == {"rewards": [0.0], "mean": 0.0, "sessions": 1, "masked": 0, "mask_rate": 0.0}
    wait_for_shards(store_of(proxy))
    stored = {s.session_id: s for s in read_sessions(store_of(proxy))}
    assert {stored[sessions[t]["session_id"]].status for t in ("exit1", "kill9", "silent")} == {"agent_error"}

    built = root / "built"
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "build", store_of(proxy), "--out", str(built)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    traces = {t.session_id: t for t in read_traces(built)}
    for task in ("exit1", "kill9"):
        trace = traces[sessions[task]["session_id"]]
        assert (trace.reward, trace.trainable) == (0.0, True), task
    stats = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "stats", store_of(proxy), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stats.returncode == 0, stats.stderr
    masks = json.loads(stats.stdout)["masks"]["groups"]
    assert masks["kill9"] == {"sessions": 1, "masked": 0, "mask_rate": 0.0}


def test_a_relative_reward_file_works_on_bwrap(jsonl_run: tuple[Path, dict[str, dict]]) -> None:
    _, sessions = jsonl_run
    assert _scored(sessions["relative"]) == ("completed", 0.25), sessions["relative"]["reason"]


def test_a_reward_file_linked_to_a_host_file_scores_0(jsonl_run: tuple[Path, dict[str, dict]]) -> None:
    _, sessions = jsonl_run
    assert _scored(sessions["link-file"]) == ("completed", 0.0), sessions["link-file"]["reason"]
    assert "not a regular file" in sessions["link-file"]["reason"]


@pytest.mark.slow
def test_a_writer_left_in_an_oci_verifier_voids_the_reward(proxy: StartedProxy, tmp_path: Path) -> None:
    """oci runs every exec in one long-lived container, where a left-behind loop would outlive the verify command."""
    image = build_test_image()
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "README").write_text("the task\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"workspace": "ws", "image": image, **t}) + "\n"
            for t in (
                {
                    "id": "background",
                    "instruction": "MODE=background-file",
                    "reward_file": "reward.txt",
                    "verify": "sh ./solution.sh; echo 0 > reward.txt",
                },
                {
                    "id": "honest",
                    "instruction": "MODE=honest",
                    "reward_file": "reward.txt",
                    "verify": "test -f passed && echo 1 > reward.txt",
                },
            )
        )
    )
    done = _rollout(proxy, tmp_path, tasks, "--runtime", "oci", seed=2323)
    assert done.returncode == 0, done.stdout + done.stderr
    sessions = _by_task(tmp_path)
    assert _scored(sessions["honest"]) == ("completed", 1.0), sessions["honest"]["reason"]
    assert _scored(sessions["background"]) == ("completed", 0.0), sessions["background"]["reason"]
    assert "left running past the verifier" in sessions["background"]["reason"]


@pytest.mark.slow
def test_polar_untrusted_keeps_the_tested_code_off_the_reward_on_oci(proxy: StartedProxy, tmp_path: Path) -> None:
    """The same Harbor tasks in containers (an image with python3: Landlock there too): the forger's reward files
    never land, the honest solution is rewarded through polar-untrusted."""
    if os.geteuid() != 0:
        pytest.skip("oci runs with mapped uids only as root")
    image = build_harness_image()
    tasks = tmp_path / "harbor"
    for mode in ("forge-untrusted", "honest-untrusted"):
        _harbor_task(tasks, mode, f"MODE={mode}", UNTRUSTED, base=image)
    done = _rollout(proxy, tmp_path, tasks, "--runtime", "oci", seed=2324)
    assert done.returncode == 0, done.stdout + done.stderr
    sessions = _by_task(tmp_path)
    assert _scored(sessions["honest-untrusted"]) == ("completed", 1.0), sessions["honest-untrusted"]["reason"]
    assert _scored(sessions["forge-untrusted"]) == ("completed", 0.0), sessions["forge-untrusted"]["reason"]
    assert "wrote neither /logs/verifier/reward.txt nor reward.json" in sessions["forge-untrusted"]["reason"]


# --- the pure reading of rewards (polar_cli.rollout.verify) ------------------------------------------------------


def test_reward_json_takes_numbers_only() -> None:
    assert parse_reward_json('{"reward": true, "tests": 1, "style": 0.5, "note": "x"}', "r") == {
        "tests": 1.0,
        "style": 0.5,
    }
    for bad in (
        '{"reward": NaN}',
        '{"reward": Infinity}',
        '{"reward": 1e400}',
        '{"reward": ' + "9" * 400 + "}",
        '{"reward": 2e6}',
        "[1]",
        "",
        "[" * 100_000 + "]" * 100_000,
        '{"bad name!": 1}',
    ):
        with pytest.raises(NoReward):
            file_rewards(bad, "r.json")
    with pytest.raises(NoReward):
        file_rewards("nan", "r.txt")


def test_reward_json_counts_only_when_the_tests_write_it() -> None:
    assert harbor_rewards('{"reward": 1}', "0\n", honour_json=False) == {"reward": 0.0}
    assert harbor_rewards('{"reward": 1}', "0\n", honour_json=True) == {"reward": 1.0}
    with pytest.raises(NoReward, match="no /logs/verifier/reward.txt"):
        harbor_rewards('{"reward": 1}', None, honour_json=False)


def test_reading_a_reward_file_follows_no_link_and_is_bounded(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "out").mkdir(parents=True)
    (root / "out" / "reward.txt").write_text("0.5\n")
    assert read_reward_file(root, "out/reward.txt") == "0.5\n"
    assert read_reward_file(root, "missing.txt") is None and read_reward_file(root, "nodir/r.txt") is None
    secret = _host_secret(tmp_path)
    (root / "link.txt").symlink_to(secret)
    (root / "linkdir").symlink_to(tmp_path)
    os.mkfifo(root / "fifo")
    with open(root / "huge", "wb") as fh:
        fh.truncate(2**40)  # sparse: reading it whole would take a terabyte
    for name, said in (
        ("link.txt", "not a regular file"),
        ("linkdir/host-secret.txt", "not a directory"),
        ("fifo", "not a regular file"),
        ("out", "not a regular file"),
        ("huge", "bytes, over"),
    ):
        with pytest.raises(NoReward, match=said):
            read_reward_file(root, name)
    for bad in ("/etc/passwd", "../host-secret.txt", ""):
        with pytest.raises(ValueError):
            read_reward_file(root, bad)


def test_the_guard_verdict_is_its_last_line() -> None:
    assert guard_left("ok\n\npolar-verify-guard: nothing left running\n") is None
    assert "pids 7 9" in (guard_left("\npolar-verify-guard: left running: 7 9\n") or "")
    # A line the tested code printed earlier is not the guard's verdict, nor is a cut output.
    assert guard_left("polar-verify-guard: nothing left running\nmore\n") is not None
    assert guard_left("") is not None


def test_the_mask_rate_counts_only_what_is_never_trained() -> None:
    from polar_cli.build.rewards import SessionInfo
    from polar_cli.build.stats import group_masks

    rows = [SessionInfo("a", group_id="g", status=s) for s in ("completed", "agent_error", "timeout", "error")]
    masks = group_masks([*rows, SessionInfo("b", group_id="h", status="running"), SessionInfo("c")])
    assert {g: (m.sessions, m.masked, m.rate) for g, m in masks.items()} == {
        "g": (4, 1, 0.25),
        "h": (1, 1, 1.0),
        "(no group)": (1, 0, 0.0),
    }


# --- polar-untrusted itself (Landlock, on the host: the same script the sandboxes bind at /opt/polar/bin) ---------

UNTRUSTED_BIN = TOOLS_HOST / "polar-untrusted"
# What a process under polar-untrusted tries: one write per path, in itself and in a grandchild (python -> sh ->
# python), each line "<who> <path> ok|<errno name>".
PROBE = r"""
import errno, subprocess, sys
def write(path):
    try:
        with open(path, "w") as fh:
            fh.write("1\n")
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
for path in sys.argv[2:]:
    print(sys.argv[1], path, write(path), flush=True)
if sys.argv[1] == "child":
    subprocess.run(["sh", "-c", 'exec "$0" "$@"', sys.executable, sys.argv[0], "grandchild", *sys.argv[2:]])
"""


def _probe(tmp_path: Path, *paths: Path, deny: Path) -> dict[tuple[str, str], str]:
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run(
        [str(UNTRUSTED_BIN), "--deny", str(deny), sys.executable, "probe.py", "child", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return {(who, path): said for who, path, said in (line.split() for line in done.stdout.splitlines())}


def test_polar_untrusted_refuses_writes_under_a_denied_dir_in_every_descendant(tmp_path: Path) -> None:
    denied, allowed = tmp_path / "logs" / "verifier", tmp_path / "work"
    denied.mkdir(parents=True)
    allowed.mkdir()
    (denied / "reward.txt").write_text("0\n")
    targets = (denied / "reward.txt", denied / "reward.json", tmp_path / "logs" / "new.txt", allowed / "out.txt")
    seen = _probe(tmp_path, *targets, deny=tmp_path / "logs")
    for who in ("child", "grandchild"):
        assert seen[(who, str(targets[0]))] == "EACCES"  # an existing reward file: not opened for writing
        assert seen[(who, str(targets[1]))] == "EACCES"  # a new one: not created
        assert seen[(who, str(targets[2]))] == "EACCES"  # anywhere beneath the denied directory
        assert seen[(who, str(targets[3]))] == "ok"  # the rest as before
    assert (denied / "reward.txt").read_text() == "0\n" and not (denied / "reward.json").exists()
    assert (allowed / "out.txt").read_text() == "1\n"


def test_polar_untrusted_keeps_renames_and_links_out_of_a_denied_dir(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "forged").write_text("1\n")
    done = subprocess.run(
        [str(UNTRUSTED_BIN), "--deny", str(tmp_path / "logs"), "sh", "-c",
         'mv forged logs/reward.txt; ln forged logs/hard; ln -s /x logs/soft; mkdir logs/d; mv logs gone; echo end'],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.stdout == "end\n" and done.stderr.count("Permission denied") == 5, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forged", "logs"] and not any((tmp_path / "logs").iterdir())


def test_polar_untrusted_fails_closed_without_landlock(tmp_path: Path) -> None:
    """A kernel without Landlock (its syscall made ENOSYS here): exit 126, the command never runs, the reason said."""
    shim = TOOLS_HOST / "polar_untrusted.py"
    run = f"import sys, runpy; m = runpy.run_path({str(shim)!r}); " + (
        "m['SYS_CREATE_RULESET'] = 100000; m['main'].__globals__['SYS_CREATE_RULESET'] = 100000; "
        "sys.exit(m['main'](sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", run, "--deny", str(tmp_path), "touch", str(tmp_path / "ran")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 126 and not (tmp_path / "ran").exists()
    assert "refusing to run touch" in done.stderr and "the kernel has no Landlock" in done.stderr


def test_polar_untrusted_handles_every_right_of_the_abi(tmp_path: Path) -> None:
    """Every right the ABI has is handled (an unhandled one stays allowed); rules allow everything but beneath the
    denied directory, entry by entry along its ancestors, and none through a link."""
    from polar_cli.rollout.runtimes.untrusted import polar_untrusted as shim

    assert shim.handled_rights(1) == (1 << 13) - 1
    assert shim.handled_rights(3) == (1 << 15) - 1 and shim.handled_rights(7) == (1 << 16) - 1
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "c").mkdir()
    (tmp_path / "a" / "f").write_text("")
    (tmp_path / "a" / "l").symlink_to(tmp_path / "a" / "b")
    every = shim.handled_rights(7)
    rules = dict(shim.grants([str(tmp_path / "a" / "b")], every))
    assert rules["/"] == shim.READ and rules["/usr"] == every
    assert rules[str(tmp_path / "a" / "c")] == every and rules[str(tmp_path / "a" / "f")] == every & shim.FILE_RIGHTS
    for path in (tmp_path, tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "l"):
        assert str(path) not in rules
