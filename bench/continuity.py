"""Token continuity off vs on, one run: traces per session, training tokens, off-policy tokens and build time.

The same sessions run twice through a real mitmdump + polar addon (``polar_tito=off``, then ``on``): multi-turn
tool-using sessions from the official openai and anthropic SDKs on the scripted engine with Qwen3's chat template
(which drops earlier think blocks at a new user turn; Chat Completions clients also drop the reasoning they were
sent). Each store is built with ``--retokenized merge`` (the default: re-tokenized turns merged off-policy) and
``break``. Off-policy tokens: sampled tokens of calls whose place in their trace is not the prompt they were
sampled after.

    .venv/bin/python bench/continuity.py --sessions 4 --user-turns 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from polar_addon.store import read_records  # noqa: E402
from tests.support.proxy import run_mitmdump  # noqa: E402
from tests.support.tito_sessions import (  # noqa: E402
    anthropic_session, build, figures, openai_session, qwen3_model, write_script,
)


def capture(script: Path, out: Path, tito: str, sessions: int, user_turns: int) -> None:
    with run_mitmdump(f"scripted:{script}", out, options={"polar_tito": tito, "polar_shard_seconds": "0.2"}) as proxy:
        for i in range(sessions):
            drive = openai_session if i % 2 == 0 else anthropic_session
            drive(proxy, f"s{i}", user_turns=user_turns)


def measure(out: Path, merge: bool) -> dict[str, float]:
    started = time.perf_counter()
    records, traces = build(out, merge_retokenized=merge)
    seconds = time.perf_counter() - started
    per_session = figures(records, traces)
    n = len(per_session)
    return {
        "calls": len(records),
        "traces per session": sum(f.traces for f in per_session.values()) / n,
        "training tokens": sum(f.trainable_tokens for f in per_session.values()),
        "off-policy tokens": sum(f.off_policy_tokens for f in per_session.values()),
        "build seconds": seconds,
        "continuity prompts": sum(r.prompt_source == "continuity" for r in read_records(str(out))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny")
    parser.add_argument("--sessions", type=int, default=4, help="sessions per side (openai and anthropic alternate)")
    parser.add_argument("--user-turns", type=int, default=3, help="user questions per session (3 model calls each)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = write_script(qwen3_model(args.model_dir, root), root / "script.json")
        for tito in ("off", "on"):
            capture(script, root / tito, tito, args.sessions, args.user_turns)
        columns = {
            "off, merge": measure(root / "off", True),
            "off, break": measure(root / "off", False),
            "on, merge": measure(root / "on", True),
            "on, break": measure(root / "on", False),
        }
    names = list(columns)
    print(f"{args.sessions} sessions x {args.user_turns} user turns (3 calls each), scripted engine, Qwen3 template")
    print(f"{'':22}" + "".join(f"{n:>14}" for n in names))
    for row in next(iter(columns.values())):
        cells = "".join(f"{columns[n][row]:>14.3f}" if row == "build seconds" else f"{columns[n][row]:>14g}" for n in names)
        print(f"{row:22}{cells}")


if __name__ == "__main__":
    main()
