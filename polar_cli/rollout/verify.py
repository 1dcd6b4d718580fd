"""What a verifier's run means as rewards (pure): an exit code, a reward file (a float, or a flat JSON object of
name -> number), or Harbor's ``/logs/verifier/reward.json`` / ``reward.txt`` pair, read the way harbor 0.25 reads them
(the JSON wins; its non-numeric entries are ignored; ``reward.txt`` fills a missing ``reward``) with one exception
below.

Threat model. The verifier runs the agent's solution (the code under test: ``tests/test.sh`` runs the agent's code,
a JSONL ``verify`` runs its tests on the agent's workspace), and that code runs as the verifier's own child, with its
uid and its mounts: whatever file the verifier may write, the tested code may write too, while the verifier runs.
polar cannot tell their writes apart for an unmodified task, so it narrows what counts:

- ``reward.json`` is honoured only when the task's own tests mention it (``Task.reward_json``); otherwise only
  ``reward.txt`` is read, so a ``{"reward": 1}`` the tested code drops next to it changes nothing.
- On a runtime with its own pid namespace (bwrap, oci) the verify command runs under :data:`VERIFY_GUARD`: when it
  exits, every other process is frozen and killed, and if the tested code left any running (one that could have
  written the reward after the verifier's last word) the session scores 0. The reward is read only once the
  verifier's sandbox is stopped. Each attempt gets fresh ``/logs`` directories, and ``/tests`` (and
  ``/logs/agent``) are read-only inside.
- A reward file is read on the host by :func:`read_reward_file`: no link followed at any component, a regular file
  only, at most :data:`REWARD_FILE_LIMIT` bytes, so a reward file cannot point the runner at a host file nor exhaust
  its memory.
- Anything wrong with the reward (missing, a link, a pipe, too large, not a number, NaN, out of range) raises
  :class:`NoReward`: the tested code could have caused it, so the session is scored 0, never masked (a masked
  failure would pay more than an honest one).

With ``polar-untrusted`` (on PATH at ``/opt/polar/bin`` in every bwrap and oci sandbox; the task's test.sh runs
the code under test through it: ``polar-untrusted python -m pytest ... && echo 1 > /logs/verifier/reward.txt``):
the code under test and every process it starts cannot write, create, rename, link or truncate anything under
``/logs`` (Landlock: inherited, irrevocable; nor can they ptrace the verifier's processes or change mounts), so the
reward files are written by the verifier alone, whatever the tested code does and whenever it does it. Without
python3 in an image it drops to uid 65534 as root (checked unable to write ``/logs``), else it refuses (exit 126:
nothing runs, the reward is 0, stderr says why), as it does on a kernel without Landlock. What it cannot guarantee:
the *verdict* the verifier derives from the tested code's process (pytest's exit status, its output) is only as
trustworthy as the test runner the tested code runs inside (code imported by pytest can ``os._exit(0)``); a verifier
that must not trust it runs the solution as a separate process under ``polar-untrusted`` and judges its output
itself, and runs nothing from the workspace after it.

Without ``polar-untrusted`` the tested code runs with the verifier's rights, and what is not blocked is: a reward
file it writes that the verifier's own last word does not overwrite (a test.sh that writes ``reward.txt`` only on
success: the tested code writes ``1`` itself, then fails the tests), a write *while the verifier still runs* by a
process that is gone before the verifier exits, and anything on ``local`` (no pid namespace of its own: no guard,
no ``polar-untrusted``). A verifier that itself leaves a process running (a server it started) scores 0 on bwrap
and oci.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from pathlib import Path, PurePosixPath

from polar_addon.store.rewards import REWARD_LIMIT, REWARD_NAME

REWARD_FILE_LIMIT = 64 * 1024  # bytes: a reward is a number or a small JSON object


class VerifierError(ValueError):
    """The verifier could not be run as its task says (an env var it needs is unset): infrastructure, masked."""


class NoReward(ValueError):
    """The verifier's run left no reward that can be read. The tested code runs with the verifier's rights and could
    have caused any of it, so the session scores 0 (the policy's failure), never an error."""


def parse_reward_text(text: str, where: str) -> float:
    if not text.strip():
        raise NoReward(f"{where} is empty")
    try:
        value = float(text.strip())
    except ValueError:
        raise NoReward(f"{where} is not a number: {text.strip()[:80]!r}") from None
    return _check(value, where)


def parse_reward_json(text: str, where: str) -> dict[str, float]:
    if not text.strip():
        raise NoReward(f"{where} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NoReward(f"{where} is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise NoReward(f"{where} is nested too deeply") from None
    if not isinstance(data, dict):
        raise NoReward(f"{where} must be a JSON object of name -> number")
    return {
        k: _check(v, f"{where}[{k!r}]")
        for k, v in data.items()
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _check(value: float, where: str) -> float:
    try:
        number = float(value)
    except OverflowError:  # a JSON integer beyond any float
        raise NoReward(
            f"{where}: reward {str(value)[:40]}... is not a finite number within +-{REWARD_LIMIT:g}"
        ) from None
    if not math.isfinite(number) or abs(number) > REWARD_LIMIT:
        raise NoReward(f"{where}: reward {number} is not a finite number within +-{REWARD_LIMIT:g}")
    return number


def outcome(rewards: dict[str, float], where: str) -> dict[str, float]:
    """``rewards`` with the outcome under ``reward`` (the mean of the named ones when the verifier gave none), and
    only names the store accepts."""
    if not rewards:
        raise NoReward(f"{where}: no numeric reward in it")
    bad = [name for name in rewards if not REWARD_NAME.fullmatch(name)]
    if bad:
        raise NoReward(f"{where}: reward names {bad} do not match {REWARD_NAME.pattern}")
    if "reward" not in rewards:
        rewards = {"reward": sum(rewards.values()) / len(rewards), **rewards}
    return rewards


def harbor_rewards(reward_json: str | None, reward_txt: str | None, *, honour_json: bool) -> dict[str, float]:
    """Harbor's rule: reward.json if present (reward.txt fills its ``reward``), else reward.txt, else no reward.
    Without ``honour_json`` (the task's tests never write reward.json) reward.json is ignored: only the tested
    code could have written it."""
    if reward_json is not None and honour_json:
        rewards = parse_reward_json(reward_json, "/logs/verifier/reward.json")
        if "reward" not in rewards and reward_txt is not None:
            try:
                rewards["reward"] = parse_reward_text(reward_txt, "/logs/verifier/reward.txt")
            except NoReward:
                pass
        return outcome(rewards, "/logs/verifier/reward.json")
    if reward_txt is not None:
        return {"reward": parse_reward_text(reward_txt, "/logs/verifier/reward.txt")}
    if honour_json:
        raise NoReward("the verifier wrote neither /logs/verifier/reward.txt nor reward.json")
    ignored = " (the reward.json there is ignored: the task's tests never write one)" if reward_json is not None else ""
    raise NoReward(f"the verifier wrote no /logs/verifier/reward.txt{ignored}")


def file_rewards(text: str, name: str) -> dict[str, float]:
    """A JSONL task's ``reward_file``: JSON when it parses as an object, else one float."""
    stripped = text.strip()
    if stripped.startswith("{"):
        return outcome(parse_reward_json(stripped, name), name)
    return {"reward": parse_reward_text(stripped, name)}


def read_reward_file(root: Path, relative: str, limit: int = REWARD_FILE_LIMIT) -> str | None:
    """The text of ``relative`` under the host directory ``root`` (the runner's own), None when it does not exist.
    Call it only once nothing in the sandbox runs. Every component is opened without following a link, the last
    must be a regular file of at most ``limit`` bytes; anything else is :class:`NoReward`."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise ValueError(f"{relative!r}: a reward file is a relative path without '..'")
    directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NoReward(f"{relative}: {part} is not a directory (a link?)") from None
                raise
            os.close(directory)
            directory = below
        try:
            info = os.stat(parts[-1], dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):
            raise NoReward(f"{relative} is not a regular file (a link, a directory, a pipe or a device)")
        if info.st_size > limit:
            raise NoReward(f"{relative} is {info.st_size} bytes, over the {limit} a reward file may have")
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=directory)
        try:
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino) or not stat.S_ISREG(opened.st_mode):
                raise NoReward(f"{relative} changed while it was read")
            data = b""
            while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
                data += chunk
        finally:
            os.close(fd)
        if len(data) > limit:
            raise NoReward(f"{relative} grew over the {limit} bytes a reward file may have")
        return data.decode("utf-8", errors="replace")
    finally:
        os.close(directory)


GUARD_CLEAN = "polar-verify-guard: nothing left running"
GUARD_LEFT = "polar-verify-guard: left running:"
# Runs the verify command ("$@") in a sandbox with its own pid namespace (NEVER on the host: ``kill -1`` there
# reaches every process of the user). Once the command exits, every other process is frozen, those that did not
# exist before it started (whatever the code under test left behind; zombies and children of the earlier ones
# aside) are named, and all are killed; the last line says which. Builtins only after the command: a child of its
# own would count as left behind.
VERIFY_GUARD = r"""
before=" "; for p in /proc/[0-9]*; do before="$before${p#/proc/} "; done
"$@"; rc=$?
kill -s STOP -- -1 2>/dev/null
left=""
for p in /proc/[0-9]*; do
  p=${p#/proc/}
  [ "$p" = "$$" ] && continue
  case "$before" in *" $p "*) continue;; esac
  read -r stat 2>/dev/null < "/proc/$p/stat" || continue
  rest=${stat##*) }
  [ "${rest%% *}" = Z ] && continue
  rest=${rest#* }; ppid=${rest%% *}
  # A child of a process that was there before (the proxy bridge's socat serving a connection) is not the
  # tested code's; orphans (parent 1) are.
  [ "$ppid" != 1 ] && [ "$ppid" != "$$" ] && case "$before" in *" $ppid "*) continue;; esac
  left="$left $p"
done
kill -s KILL -- -1 2>/dev/null
if [ -n "$left" ]; then printf '\n%s%s\n' "GUARD_LEFT" "$left"; else printf '\n%s\n' "GUARD_CLEAN"; fi
exit $rc
""".replace("GUARD_LEFT", GUARD_LEFT).replace("GUARD_CLEAN", GUARD_CLEAN)


def guard_left(stdout: str) -> str | None:
    """None when :data:`VERIFY_GUARD`'s last line says nothing was left running; else why the reward cannot be
    trusted. Its line is the last the sandbox printed: everything else there was dead before it."""
    if stdout.endswith(f"\n{GUARD_CLEAN}\n"):
        return None
    last = stdout.rstrip("\n").rsplit("\n", 1)[-1]
    if last.startswith(GUARD_LEFT):
        return (
            f"processes were left running past the verifier (pids{last[len(GUARD_LEFT) :][:200]}): any could have "
            "rewritten its reward"
        )
    return "the verifier's guard did not report (its output was cut or it was killed)"


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def resolve_env(template: dict[str, str]) -> dict[str, str]:
    """Harbor's ``[verifier] env``: ``${VAR}`` and ``${VAR:-default}`` from the host's environment."""

    def one(value: str) -> str:
        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise VerifierError(f"the verifier's env needs ${{{name}}}, which is not set")

        return _VAR.sub(sub, value)

    return {key: one(value) for key, value in template.items()}
