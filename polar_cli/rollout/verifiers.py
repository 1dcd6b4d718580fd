"""How a session's outcome becomes rewards: one strategy per kind of task, chosen once from the :class:`Task`.

- :class:`ExitCodeVerifier`: the verify command's exit code (0: reward 1, else 0).
- :class:`RewardFileVerifier`: the task's ``reward_file``, which the verify command writes in the workspace (a float,
  or a flat JSON object of name -> number).
- :class:`HarborVerifier`: Harbor's ``/logs/verifier/reward.json`` / ``reward.txt``, its tests at ``/tests``
  (read-only), the harness's stdout at ``/logs/agent/stdout.txt`` (read-only).

Each says where its files go in the verifier's sandbox, what to clear or bring out around the verify command, and
what the finished command means (:meth:`Verifier.decide`). The session runner
(:class:`polar_cli.rollout.session.SessionRunner`) does the rest, the same for all: a fresh sandbox of the task, its
setup, the agent's patch, the command (under the guard where the sandbox has its own pid namespace), the stop. The
reading itself, and the threat model behind it, is :mod:`polar_cli.rollout.verify`.
"""

from __future__ import annotations

import asyncio
import posixpath
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from polar_cli.rollout.runtimes.base import ExecResult, Sandbox
from polar_cli.rollout.tasks import Task
from polar_cli.rollout.verify import NoReward, file_rewards, guard_left, harbor_rewards, read_reward_file

HARBOR_AGENT_DIR = "/logs/agent"  # Harbor's agent log directory (harbor/models/trial/paths.py)
AGENT_OUTPUT_NAME = "stdout.txt"
_HOME_AGENT_DIR = ".polar-agent"  # under the verifier's HOME, for tasks that are not Harbor's


@dataclass
class VerifyLayout:
    """One verify attempt's files on the host, and how they are bound into its sandbox."""

    dir: Path  # the attempt's directory (fresh per attempt)
    agent_logs: Path  # the directory holding the harness's stdout
    binds: dict[str, Path] = field(default_factory=dict)
    read_only_binds: dict[str, Path] = field(default_factory=dict)


class Verifier:
    """The part of verification that depends on the task's kind. Subclasses give :meth:`rewards`; the rest has the
    defaults of a verify command that runs in the task's workspace."""

    def __init__(self, task: Task) -> None:
        self.task = task

    async def layout(self, vdir: Path, home: Path) -> VerifyLayout:
        """The attempt's files: the harness's stdout in a directory of the verifier's own sandbox that the agent's
        patch never touches (its fresh HOME: every runtime brings HOME in, local included)."""
        agent_logs = home / _HOME_AGENT_DIR
        agent_logs.mkdir()
        return VerifyLayout(vdir, agent_logs)

    def agent_dir(self, sandbox: Sandbox) -> str:
        """Where :meth:`layout`'s ``agent_logs`` is inside ``sandbox``."""
        return f"{sandbox.home.rstrip('/')}/{_HOME_AGENT_DIR}"

    async def before(self, sandbox: Sandbox) -> None:
        """Just before the verify command (setup and patch applied): clear what the agent could have planted."""

    async def collect(self, sandbox: Sandbox, layout: VerifyLayout) -> None:
        """Just after the verify command, before the sandbox stops: bring out what :meth:`rewards` reads."""

    def decide(
        self, done: ExecResult, guarded: bool, layout: VerifyLayout, host_workspace: Path | None
    ) -> dict[str, float]:
        """The verifier's rewards, read once its sandbox stopped (``host_workspace``: its workspace on the host, where
        the runtime used one in place). Raises NoReward when the session scores 0 for a reason the code under test
        could have caused."""
        if done.timed_out:
            # The agent's patch made the tests hang: the policy's failure, scored like any failing test.
            raise NoReward(f"the verifier ran past its {self.task.verify_timeout_s:g} s timeout")
        left = guard_left(done.stdout) if guarded else None
        if left:
            raise NoReward(left)
        return self.rewards(done, layout, host_workspace)

    def rewards(self, done: ExecResult, layout: VerifyLayout, host_workspace: Path | None) -> dict[str, float]:
        raise NotImplementedError


class ExitCodeVerifier(Verifier):
    """Reward 1 when the verify command exits 0, else 0."""

    def rewards(self, done: ExecResult, layout: VerifyLayout, host_workspace: Path | None) -> dict[str, float]:
        return {"reward": 1.0 if done.exit_code == 0 else 0.0}


class RewardFileVerifier(Verifier):
    """The rewards the verify command wrote to the task's ``reward_file`` (its exit code is not read)."""

    def __init__(self, task: Task) -> None:
        super().__init__(task)
        assert task.reward_file
        self.reward_file = task.reward_file

    async def before(self, sandbox: Sandbox) -> None:
        # A reward file the agent's patch planted must not pass for the verifier's.
        await sandbox.exec(["rm", "-rf", "--", self.reward_file], cwd=sandbox.workspace, timeout_s=60)

    async def collect(self, sandbox: Sandbox, layout: VerifyLayout) -> None:
        if sandbox.host_workspace is not None:  # read in place once the sandbox stopped
            return
        # An image's own workspace: copied out by the runtime before the stop.
        out = self._copied_out(layout)
        out.mkdir()
        try:
            await sandbox.download(self.reward_file, out / posixpath.basename(self.reward_file))
        except FileNotFoundError:
            pass

    def _copied_out(self, layout: VerifyLayout) -> Path:
        return layout.dir / "reward-out"

    def rewards(self, done: ExecResult, layout: VerifyLayout, host_workspace: Path | None) -> dict[str, float]:
        if host_workspace is not None:
            text = read_reward_file(host_workspace, self.reward_file)
        else:
            text = read_reward_file(self._copied_out(layout), posixpath.basename(self.reward_file))
        if text is None:
            raise NoReward(f"the verifier wrote no {self.reward_file}")
        return file_rewards(text, self.reward_file)


class HarborVerifier(Verifier):
    """A Harbor task: its tests at ``/tests``, its rewards in ``/logs/verifier`` (``reward.json`` honoured only when
    the task's tests mention it: :attr:`Task.reward_json`)."""

    async def layout(self, vdir: Path, home: Path) -> VerifyLayout:
        agent_logs = vdir / "logs-agent"
        agent_logs.mkdir()
        tests = vdir / "tests"
        assert self.task.tests_dir is not None
        await asyncio.to_thread(shutil.copytree, self.task.tests_dir, tests, symlinks=True)
        logs = self._logs(vdir)
        logs.mkdir()  # fresh per attempt: nothing of an earlier attempt passes for this one's reward
        # The code under test must rewrite neither the tests that score it nor the agent's answer they read.
        return VerifyLayout(vdir, agent_logs, {"/logs/verifier": logs}, {"/tests": tests, HARBOR_AGENT_DIR: agent_logs})

    def agent_dir(self, sandbox: Sandbox) -> str:
        return HARBOR_AGENT_DIR

    @staticmethod
    def _logs(vdir: Path) -> Path:
        return vdir / "logs-verifier"

    def rewards(self, done: ExecResult, layout: VerifyLayout, host_workspace: Path | None) -> dict[str, float]:
        logs = self._logs(layout.dir)
        reward_json = read_reward_file(logs, "reward.json") if self.task.reward_json else None
        return harbor_rewards(reward_json, read_reward_file(logs, "reward.txt"), honour_json=self.task.reward_json)


def verifier_for(task: Task) -> Verifier:
    """The strategy that verifies ``task``: Harbor's format first, then a reward file, else the exit code."""
    if task.format == "harbor":
        return HarborVerifier(task)
    if task.reward_file:
        return RewardFileVerifier(task)
    return ExitCodeVerifier(task)
