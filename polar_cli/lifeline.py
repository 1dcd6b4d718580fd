"""Children that must not outlive this process, even when it dies by SIGKILL.

polar starts its mitmdump, harness sandboxes and vLLM servers in their own process sessions (``start_new_session``)
so that a Ctrl-C reaches only polar, which then stops them in order (the proxy seals its open shard). A SIGKILL gives
polar no such chance, and a child in its own session outlives it: a leftover proxy could still write shards into
the directory the next run uses. ``PR_SET_PDEATHSIG`` does not cover this: it fires when the *thread* that forked
the child exits (asyncio's ``to_thread`` workers come and go) and reaches only that one process, not its group.

So one guardian process per polar process (started on first use, in its own session so a Ctrl-C does not reach it)
reads the registrations on a pipe whose only write end is held by this process. When this process dies, however it
dies, the kernel closes that end; the guardian reads EOF, SIGKILLs every process group still registered and runs
every cleanup command still registered (``podman rm -f`` of a container), then exits. A normal stop unregisters
first, so the guardian never touches a group whose leader was already reaped (its id could be reused).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

# The guardian: no imports beyond the standard library's smallest (it starts in ~20 ms with -S -I).
_GUARDIAN = r"""
import json, os, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups, commands = set(), {}
for line in sys.stdin:
    op, _, arg = line.rstrip("\n").partition(" ")
    if op == "+g": groups.add(int(arg))
    elif op == "-g": groups.discard(int(arg))
    elif op == "+c":
        key, _, argv = arg.partition(" ")
        commands[key] = json.loads(argv)
    elif op == "-c": commands.pop(arg, None)
for pgid in groups:
    try: os.killpg(pgid, signal.SIGKILL)
    except OSError: pass
for argv in commands.values():
    try: subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        timeout=60)
    except (OSError, subprocess.SubprocessError): pass
"""

_lock = threading.Lock()
_guardian: subprocess.Popen | None = None
_owner = 0  # the pid that started the guardian: a forked child must not write into its parent's pipe
_next_key = 0


def _send(line: str) -> None:
    global _guardian, _owner
    with _lock:
        if _guardian is None or _owner != os.getpid() or _guardian.poll() is not None:
            _guardian = subprocess.Popen([sys.executable, "-S", "-I", "-c", _GUARDIAN], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True, text=True)  # fmt: skip
            _owner = os.getpid()
        assert _guardian.stdin is not None
        _guardian.stdin.write(line + "\n")
        _guardian.stdin.flush()


def tie(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a child started with ``start_new_session=True``: its pid) if this process dies
    before ``untie(pgid)``."""
    _send(f"+g {pgid}")


def untie(pgid: int) -> None:
    """The group was stopped normally (call before reaping its leader): the guardian forgets it."""
    if _guardian is not None and _owner == os.getpid():
        _send(f"-g {pgid}")


def on_death(argv: Sequence[str]) -> str:
    """Run ``argv`` if this process dies before ``cancel(key)`` of the key returned (e.g. remove a container that
    lives outside any of our process groups)."""
    global _next_key
    with _lock:
        _next_key += 1
        key = str(_next_key)
    _send(f"+c {key} {json.dumps(list(argv))}")
    return key


def cancel(key: str) -> None:
    if _guardian is not None and _owner == os.getpid():
        _send(f"-c {key}")


def _close() -> None:
    # A normal exit: everything was stopped and untied; closing the pipe lets the guardian exit now.
    if _guardian is not None and _owner == os.getpid() and _guardian.stdin is not None:
        try:
            _guardian.stdin.close()
            _guardian.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


atexit.register(_close)
