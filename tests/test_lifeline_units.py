"""polar_cli.lifeline: the exact lines polar sends its guardian, when a guardian is (re)started and when nothing is
sent, and the guardian itself (a real process): when its pipe closes it SIGKILLs every group still tied, spares the
untied ones, runs every cleanup command still registered and none that was cancelled, and a Ctrl-C does not stop it
(the killed-process tests cover a SIGKILLed polar; these take milliseconds)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_cli import lifeline


class FakePipe:
    def __init__(self, close_error: Exception | None = None) -> None:
        self.lines: list[str] = []
        self.flushed = 0
        self.closed = False
        self.close_error = close_error

    def write(self, text: str) -> None:
        self.lines.append(text)

    def flush(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        if self.close_error is not None:
            raise self.close_error
        self.closed = True


class FakeGuardian:
    def __init__(self, **pipe: Exception | None) -> None:
        self.stdin = FakePipe(**pipe)
        self.exit_code: int | None = None
        self.waited: list[float] = []
        self.wait_error: Exception | None = None

    def poll(self) -> int | None:
        return self.exit_code

    def wait(self, timeout: float) -> int:
        self.waited.append(timeout)
        if self.wait_error is not None:
            raise self.wait_error
        return 0


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict, FakeGuardian]]:
    """No guardian yet; each one lifeline starts is a FakeGuardian, recorded with its argv and options."""
    made: list[tuple[list[str], dict, FakeGuardian]] = []

    def popen(argv: list[str], **options: object) -> FakeGuardian:
        guardian = FakeGuardian()
        made.append((argv, options, guardian))
        return guardian

    monkeypatch.setattr(lifeline.subprocess, "Popen", popen)
    monkeypatch.setattr(lifeline, "_guardian", None)
    monkeypatch.setattr(lifeline, "_owner", 0)
    monkeypatch.setattr(lifeline, "_next_key", 0)
    return made


def test_the_first_registration_starts_one_guardian_in_its_own_session(started: list) -> None:
    lifeline.tie(123)
    assert len(started) == 1
    argv, options, guardian = started[0]
    assert argv == [sys.executable, "-S", "-I", "-c", lifeline._GUARDIAN]
    assert options == {
        "stdin": subprocess.PIPE,
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        "start_new_session": True,
        "text": True,
    }
    assert lifeline._guardian is guardian and lifeline._owner == os.getpid()
    assert guardian.stdin.lines == ["+g 123\n"] and guardian.stdin.flushed == 1


def test_each_registration_is_one_line_flushed_at_once(started: list) -> None:
    lifeline.tie(10)
    lifeline.untie(10)
    first = lifeline.on_death(["podman", "rm", "-f", "box one"])
    second = lifeline.on_death(("true",))
    lifeline.cancel(first)
    assert (first, second) == ("1", "2")
    guardian = started[0][2]
    assert guardian.stdin.lines == [
        "+g 10\n",
        "-g 10\n",
        '+c 1 ["podman", "rm", "-f", "box one"]\n',
        '+c 2 ["true"]\n',
        "-c 1\n",
    ]
    assert guardian.stdin.flushed == 5 and len(started) == 1


def test_nothing_is_started_or_sent_to_forget_what_was_never_registered(started: list) -> None:
    lifeline.untie(10)
    lifeline.cancel("1")
    assert started == [] and lifeline._guardian is None


def test_a_forked_child_never_writes_into_its_parents_guardian(started: list, monkeypatch: pytest.MonkeyPatch) -> None:
    lifeline.tie(1)
    parents = started[0][2]
    monkeypatch.setattr(lifeline, "_owner", os.getpid() + 1)  # as in a child forked after the tie
    lifeline.untie(1)
    lifeline.cancel("1")
    assert parents.stdin.lines == ["+g 1\n"]  # the parent's registrations stand
    lifeline.tie(2)  # the child's own registration: its own guardian
    assert len(started) == 2 and started[1][2].stdin.lines == ["+g 2\n"]
    assert parents.stdin.lines == ["+g 1\n"] and lifeline._owner == os.getpid()


def test_a_guardian_that_exited_is_replaced(started: list) -> None:
    lifeline.tie(1)
    started[0][2].exit_code = 0
    lifeline.tie(2)
    assert len(started) == 2 and started[1][2].stdin.lines == ["+g 2\n"]
    lifeline.tie(3)
    assert len(started) == 2 and started[1][2].stdin.lines == ["+g 2\n", "+g 3\n"]


def test_a_normal_exit_closes_the_pipe_and_waits_for_the_guardian(
    started: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    lifeline._close()  # none started: nothing to do
    lifeline.tie(1)
    guardian = started[0][2]
    lifeline._close()
    assert guardian.stdin.closed and guardian.waited == [5]
    # Not this process's guardian (a forked child exiting): left alone.
    other = FakeGuardian()
    monkeypatch.setattr(lifeline, "_guardian", other)
    monkeypatch.setattr(lifeline, "_owner", os.getpid() + 1)
    lifeline._close()
    assert not other.stdin.closed and other.waited == []


@pytest.mark.parametrize(
    ("close_error", "wait_error"),
    [(OSError("broken pipe"), None), (None, subprocess.TimeoutExpired("guardian", 5))],
)
def test_a_normal_exit_never_fails_on_the_guardian(
    monkeypatch: pytest.MonkeyPatch, close_error: Exception | None, wait_error: Exception | None
) -> None:
    guardian = FakeGuardian(close_error=close_error)
    guardian.wait_error = wait_error
    monkeypatch.setattr(lifeline, "_guardian", guardian)
    monkeypatch.setattr(lifeline, "_owner", os.getpid())
    lifeline._close()
    assert guardian.waited == ([] if close_error else [5])


# --- the real guardian ----------------------------------------------------------------------------------------------


def _group() -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", "sleep 30 & exec sleep 30"], start_new_session=True)


def _members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _until(check, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def _end(*groups: subprocess.Popen) -> None:
    for proc in groups:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_the_guardian_kills_what_is_still_tied_and_runs_what_is_still_registered(tmp_path: Path) -> None:
    tied, untied, gone = _group(), _group(), _group()
    _end(gone)  # a group already gone does not stop the others
    ran, cancelled = tmp_path / "ran", tmp_path / "cancelled"
    guardian = subprocess.Popen(
        [sys.executable, "-S", "-I", "-c", lifeline._GUARDIAN], stdin=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert _until(lambda: len(_members(tied.pid)) == 2 and len(_members(untied.pid)) == 2)
        assert guardian.stdin is not None
        guardian.stdin.write(
            f"+g {gone.pid}\n+g {tied.pid}\n+g {untied.pid}\n-g {untied.pid}\n"
            '+c 1 ["/nonexistent/command"]\n'
            f'+c 2 ["sh", "-c", "echo ran > {ran}"]\n'
            f'+c 3 ["sh", "-c", "echo ran > {cancelled}"]\n'
            "-c 3\n-c 9\n"
        )
        guardian.stdin.flush()
        time.sleep(0.2)  # the lines are read before the Ctrl-C
        os.killpg(guardian.pid, signal.SIGINT)  # a Ctrl-C of the terminal does not stop it
        time.sleep(0.1)
        assert guardian.poll() is None
        assert _members(tied.pid)  # nothing killed while polar lives
        guardian.stdin.close()
        assert guardian.wait(timeout=10) == 0
        assert _until(lambda: not _members(tied.pid))  # the whole group, the leader's child too
        assert len(_members(untied.pid)) == 2
        assert ran.read_text() == "ran\n" and not cancelled.exists()
    finally:
        guardian.kill()
        guardian.wait()
        _end(tied, untied)


def test_a_tie_through_this_process_lasts_until_it_closes_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifeline, "_guardian", None)
    monkeypatch.setattr(lifeline, "_owner", 0)
    tied, untied = _group(), _group()
    try:
        lifeline.tie(tied.pid)
        lifeline.tie(untied.pid)
        lifeline.untie(untied.pid)
        guardian = lifeline._guardian
        assert guardian is not None and os.getsid(guardian.pid) == guardian.pid  # a Ctrl-C does not reach it
        time.sleep(0.1)
        assert len(_members(tied.pid)) == 2
        lifeline._close()  # as this process's end closes when it dies
        assert guardian.poll() == 0  # waited for
        assert _until(lambda: not _members(tied.pid))
        assert len(_members(untied.pid)) == 2
    finally:
        _end(tied, untied)
