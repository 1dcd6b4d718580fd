"""The verifier strategies' sandbox side (issue 29 audit): where each puts its files, what it clears before the verify
command and what it brings out after, on a recording fake sandbox (no runtime, no rollout)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes.base import ExecResult, Sandbox
from polar_cli.rollout.tasks import Task
from polar_cli.rollout.verifiers import (
    ExitCodeVerifier,
    HarborVerifier,
    RewardFileVerifier,
    Verifier,
    VerifyLayout,
    verifier_for,
)
from polar_cli.rollout.verify import NoReward


class _Sandbox(Sandbox):
    def __init__(self, home: str = "/home/polar", host_workspace: Path | None = None, missing: bool = False) -> None:
        self.workspace = "/work/space"
        self.home = home
        self.host_workspace = host_workspace
        self.missing = missing
        self.calls: list[tuple] = []

    async def exec(self, argv, *, cwd=None, env=None, timeout_s=None, stdin=None):  # type: ignore[override]
        self.calls.append(("exec", list(argv), cwd, timeout_s))
        return ExecResult(0, "", "")

    async def upload(self, local: Path, remote: str) -> None:
        self.calls.append(("upload", local, remote))

    async def download(self, remote: str, local: Path) -> None:
        self.calls.append(("download", remote, local))
        if self.missing:
            raise FileNotFoundError(remote)
        local.write_text("0.75")

    async def cancel(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def test_the_default_layout_puts_the_agents_stdout_under_the_verifiers_own_home(tmp_path: Path) -> None:
    vdir, home = tmp_path / "attempt", tmp_path / "home"
    vdir.mkdir()
    home.mkdir()
    layout = asyncio.run(ExitCodeVerifier(Task("t", "i")).layout(vdir, home))
    assert layout == VerifyLayout(vdir, home / ".polar-agent")
    assert (home / ".polar-agent").is_dir()
    assert layout.binds == {} and layout.read_only_binds == {}


def test_the_default_agent_dir_is_inside_the_sandboxs_home_with_or_without_a_trailing_slash() -> None:
    verifier = ExitCodeVerifier(Task("t", "i"))
    assert verifier.agent_dir(_Sandbox(home="/home/polar/")) == "/home/polar/.polar-agent"
    assert verifier.agent_dir(_Sandbox(home="/tmp/h")) == "/tmp/h/.polar-agent"
    assert verifier.agent_dir(_Sandbox(home="/srv/homeX")) == "/srv/homeX/.polar-agent"  # only slashes stripped


def test_harbors_layout_binds_fresh_logs_writable_and_the_tests_and_agent_log_read_only(tmp_path: Path) -> None:
    tests_dir = tmp_path / "task-tests"
    tests_dir.mkdir()
    (tests_dir / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (tests_dir / "outside").symlink_to("/etc/hostname")  # copied as the link it is, never followed
    vdir = tmp_path / "attempt"
    vdir.mkdir()
    verifier = HarborVerifier(Task("t", "i", format="harbor", tests_dir=tests_dir))
    layout = asyncio.run(verifier.layout(vdir, tmp_path / "unused-home"))
    assert layout == VerifyLayout(
        vdir,
        vdir / "logs-agent",
        {"/logs/verifier": vdir / "logs-verifier"},
        {"/tests": vdir / "tests", "/logs/agent": vdir / "logs-agent"},
    )
    assert (vdir / "logs-agent").is_dir() and list((vdir / "logs-verifier").iterdir()) == []
    assert (vdir / "tests" / "test.sh").read_text() == "echo 1 > /logs/verifier/reward.txt\n"
    assert (vdir / "tests" / "outside").is_symlink()
    assert str((vdir / "tests" / "outside").readlink()) == "/etc/hostname"
    assert not (tmp_path / "unused-home").exists()  # Harbor's agent log is not in HOME
    assert verifier.agent_dir(_Sandbox(home="/home/polar")) == "/logs/agent"


def test_a_reward_file_the_agent_planted_is_removed_in_the_workspace_before_the_verify_command() -> None:
    sandbox = _Sandbox()
    asyncio.run(RewardFileVerifier(Task("t", "i", reward_file="out/r.json")).before(sandbox))
    assert sandbox.calls == [("exec", ["rm", "-rf", "--", "out/r.json"], "/work/space", 60)]


def test_the_other_strategies_clear_and_bring_out_nothing(tmp_path: Path) -> None:
    sandbox = _Sandbox()
    layout = VerifyLayout(tmp_path, tmp_path)
    for verifier in (ExitCodeVerifier(Task("t", "i")), HarborVerifier(Task("t", "i", format="harbor"))):
        asyncio.run(verifier.before(sandbox))
        asyncio.run(verifier.collect(sandbox, layout))
    assert sandbox.calls == []
    with pytest.raises(NotImplementedError):
        Verifier(Task("t", "i")).rewards(ExecResult(0, "", ""), layout, None)


def test_a_reward_file_in_a_host_workspace_is_read_in_place_not_downloaded(tmp_path: Path) -> None:
    sandbox = _Sandbox(host_workspace=tmp_path / "ws")
    asyncio.run(
        RewardFileVerifier(Task("t", "i", reward_file="out/r.txt")).collect(sandbox, VerifyLayout(tmp_path, tmp_path))
    )
    assert sandbox.calls == [] and not (tmp_path / "reward-out").exists()


def test_a_reward_file_in_an_images_workspace_is_downloaded_by_its_name_and_read(tmp_path: Path) -> None:
    sandbox = _Sandbox()
    verifier = RewardFileVerifier(Task("t", "i", reward_file="out/r.txt"))
    layout = VerifyLayout(tmp_path, tmp_path)
    asyncio.run(verifier.collect(sandbox, layout))
    assert sandbox.calls == [("download", "out/r.txt", tmp_path / "reward-out" / "r.txt")]
    assert verifier.decide(ExecResult(3, "", ""), False, layout, None) == {"reward": 0.75}


def test_a_reward_file_the_verifier_never_wrote_is_no_reward_not_an_error(tmp_path: Path) -> None:
    sandbox = _Sandbox(missing=True)
    verifier = RewardFileVerifier(Task("t", "i", reward_file="r.txt"))
    layout = VerifyLayout(tmp_path, tmp_path)
    asyncio.run(verifier.collect(sandbox, layout))
    assert (tmp_path / "reward-out").is_dir()
    with pytest.raises(NoReward, match="^the verifier wrote no r.txt$"):
        verifier.decide(ExecResult(0, "", ""), False, layout, None)


def test_the_timeout_refusal_names_the_tasks_timeout_exactly(tmp_path: Path) -> None:
    layout = VerifyLayout(tmp_path, tmp_path)
    for timeout, text in ((7.5, "7.5"), (300.0, "300")):
        verifier = ExitCodeVerifier(Task("t", "i", verify_timeout_s=timeout))
        with pytest.raises(NoReward, match=rf"^the verifier ran past its {text} s timeout$"):
            verifier.decide(ExecResult(0, "", "", timed_out=True), False, layout, None)


def test_a_reward_file_verifier_needs_a_reward_file_and_harbor_wins_over_one(tmp_path: Path) -> None:
    with pytest.raises(AssertionError):
        RewardFileVerifier(Task("t", "i"))
    both = Task("t", "i", format="harbor", tests_dir=tmp_path, reward_file="r.txt")
    assert type(verifier_for(both)) is HarborVerifier
    # Each strategy keeps its task (the timeout refusal and Harbor's reward.json rule read it).
    for task in (both, Task("t", "i", reward_file="r.txt"), Task("t", "i")):
        assert verifier_for(task).task is task
    assert RewardFileVerifier(Task("t", "i", reward_file="a/b.json")).reward_file == "a/b.json"
