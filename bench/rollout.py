"""The READY buffer's worth: sessions per minute with it on and off when a task's setup takes seconds (issue 9).

    .venv/bin/python bench/rollout.py                      # 12 sessions per side, setup `sleep 2`, 2 RUN slots
    .venv/bin/python bench/rollout.py --sessions 24 --setup-s 5 --concurrency 4

Both sides run for real, one after the other against one mitmdump + polar addon (the scripted engine on the tiny
model): the local runtime, the `cmd:` preset running tests/support/rollout_agent.py (the official openai SDK, one
tool call and a final answer), the verifier in a fresh sandbox. READY off (``ready=0``): each RUN slot prepares its
own session (sandbox, workspace copy, setup) and then runs it. READY on (``ready=concurrency``): INIT workers
prepare sessions while the slots run harnesses, so a free slot starts at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from polar_cli.rollout.proxy import ExternalProxy, start_proxy  # noqa: E402
from polar_cli.rollout.runner import RolloutConfig, run_rollout  # noqa: E402
from polar_cli.rollout.tasks import load_tasks  # noqa: E402

AGENT = REPO / "tests" / "support" / "rollout_agent.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=12, help="sessions per side (tasks x samples)")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--setup-s", type=float, default=2.0, help="seconds the task's setup takes")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="polar-bench-rollout-") as tmp:
        root = Path(tmp)
        (root / "ws").mkdir()
        (root / "ws" / "README").write_text("bench\n")
        turns = [{"content": "", "tool_calls": [{"type": "function", "function": {
                     "name": "write_file", "arguments": {"path": "answer.txt", "content": "42"}}}]},
                 {"content": "done"}]  # fmt: skip
        (root / "script.json").write_text(json.dumps({"model_dir": str(args.model_dir.resolve()), "turns": turns}))
        tasks_file = root / "tasks.jsonl"
        groups = max(1, args.sessions // args.samples)
        tasks_file.write_text("".join(json.dumps({
            "id": f"t{i}", "instruction": "Write the answer.", "workspace": "ws", "setup": f"sleep {args.setup_s}",
            "verify": 'test "$(cat answer.txt)" = 42'}) + "\n" for i in range(groups)))  # fmt: skip
        tasks = load_tasks(tasks_file)
        with start_proxy(
            f"scripted:{root / 'script.json'}", str(root / "store"), confdir=root / "conf", log_dir=root
        ) as proxy:
            external = ExternalProxy(
                f"http://127.0.0.1:{proxy.endpoints.forward_port}",
                proxy.control_token,
                f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
                proxy.endpoints.ca,
            )
            rates = {}
            for label, ready in (("READY off", 0), ("READY on", args.concurrency)):
                config = RolloutConfig(
                    tasks=tasks,
                    harness=f"cmd:{sys.executable} {AGENT} {{instruction}}",
                    samples=args.samples,
                    proxy=external,
                    concurrency=args.concurrency,
                    ready=ready,
                    run_id=f"bench-{ready}",
                )
                result = asyncio.run(run_rollout(config))
                summary = result.summary()
                if summary["statuses"]["completed"] != len(result.sessions):
                    raise SystemExit(f"{label}: not every session completed: {summary['statuses']}")
                rates[label] = summary["sessions_per_minute"]
                print(
                    f"{label:10s} {len(result.sessions)} sessions in {summary['seconds']:6.1f} s: "
                    f"{rates[label]:6.1f} sessions/min (setup {args.setup_s:g} s, {args.concurrency} RUN slots)"
                )
    print(f"READY on / off: {rates['READY on'] / rates['READY off']:.2f}x sessions per minute")


if __name__ == "__main__":
    main()
