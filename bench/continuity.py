"""Token continuity off vs on, one run: traces per session, training tokens, off-policy tokens and build time.

The same sessions run twice through a real mitmdump + polar addon (``polar_tito=off``, then ``on``): multi-turn
tool-using sessions from the official openai and anthropic SDKs on the scripted engine with Qwen3's chat template
(which drops earlier think blocks at a new user turn; Chat Completions clients also drop the reasoning they were
sent). Each store is built with ``--retokenized merge`` (the default: re-tokenized turns merged off-policy) and
``break``. Off-policy tokens: sampled tokens of calls whose place in their trace is not the prompt they were
sampled after.

    .venv/bin/python bench/continuity.py --sessions 4 --user-turns 3

``--harnesses claude,codex,qwen,pi,gemini`` runs the real harness CLIs (``make harnesses``) instead, through one
mitmdump per side (tests/support/harness_tito.py): each fixes its swe_mini task in a tool loop on the scripted
engine (its own tool names; a think block on every turn; Qwen3's template), then resumes that conversation with a
second user turn (``claude --continue``, ``codex exec resume --last``, ``qwen --continue``, ``pi --continue``,
``gemini --resume latest``). Per harness and side: calls, continuity prompts, the main chain's calls and traces
(``merge`` and ``break``), side calls (their own system prompt or tools) and their traces, off-policy tokens, and
whether every main-chain trace trains exactly the sampled ids.

    .venv/bin/python bench/continuity.py --harnesses claude,codex,qwen,pi,gemini

``--vllm``: the same comparison on real vLLM CPU (started here, as `polar engine serve` does) serving the ending
model (tests/support/ending_model.py: the tiny model made to end its turns, Qwen3's chat template, stored in bf16),
chat sessions (no tool calls: a random model makes none) from both SDKs at T=0.6, and two more rows: the first-step
importance ratios exp(trainer logprob - vLLM logprob) over every trainable token (the trainer's fp32 forward, TRL's
log-softmax of logits / T, against vLLM's processed logprobs), and how many calls' stored prompt ids are the ones
vLLM itself reported (read by a recording forwarder between the proxy and vLLM). ``--serve-dtype`` picks how vLLM
computes (float32, bfloat16 or both, one server each).

    .venv/bin/python bench/continuity.py --vllm --sessions 4 --user-turns 4 --serve-dtype float32,bfloat16
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
    anthropic_session,
    build,
    figures,
    openai_session,
    qwen3_model,
    write_script,
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


def harness_table(model_dir: Path, harnesses: list[str]) -> None:
    from tests.support.harness_tito import (
        HARNESSES,
        harness_figures,
        run_harness,
        session_id,
        shared_proxy,
        write_script,
    )

    unknown = [h for h in harnesses if h not in HARNESSES]
    if unknown:
        raise SystemExit(f"unknown harness {unknown}; use {','.join(HARNESSES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = write_script(qwen3_model(model_dir, root), root, harnesses)
        for tito in ("off", "on"):
            out = root / f"shards-{tito}"
            with shared_proxy(script, out, tito) as proxy:
                for short in harnesses:
                    for follow_up in (False, True):
                        result = run_harness(short, proxy, root, tito, follow_up=follow_up)
                        if result.returncode != 0:
                            raise SystemExit(f"{short} exited {result.returncode}: {result.stderr[-2000:]}")
            for short in harnesses:
                merged, _ = harness_figures(out, session_id(short, tito), merge_retokenized=True)
                broken, _ = harness_figures(out, session_id(short, tito), merge_retokenized=False)
                rows.append((short, tito, merged, broken))
    header = (
        "harness",
        "tito",
        "calls",
        "contin.",
        "main",
        "main tr.",
        "main tr.",
        "side",
        "side tr.",
        "trainable",
        "off-pol.",
        "exact",
        "fresh main calls after the first (prompt_reason)",
    )
    print("real harness CLIs, 2 user turns each (the second a resumed conversation), scripted engine, Qwen3 template")
    print(
        "main tr.: traces holding the main chain, with --retokenized merge / break; off-pol.: off-policy tokens (merge)"
    )
    print(f"{header[0]:8}{header[1]:5}" + "".join(f"{h:>10}" for h in header[2:12]) + f"  {header[12]}")
    print(
        f"{'':13}"
        + "".join(f"{h:>10}" for h in ("", "", "calls", "merge", "break", "calls", "", "tokens", "tokens", ""))
    )
    for short, tito, merged, broken in rows:
        cells = (
            merged.calls,
            merged.continuity,
            merged.main_calls,
            merged.main_traces,
            broken.main_traces,
            merged.side_calls,
            merged.side_traces,
            merged.trainable_tokens,
            merged.off_policy_tokens,
            "yes" if merged.exact and broken.exact else "NO",
        )
        reasons = ", ".join(f"{k} x{v}" for k, v in sorted(merged.reasons.items())) or "-"
        print(f"{short:8}{tito:5}" + "".join(f"{c:>10}" for c in cells) + f"  {reasons}")


def vllm_columns(model: Path, root: Path, serve_dtype: str, sessions: int, user_turns: int) -> dict[str, dict]:
    from polar_cli.mitm import free_port
    from polar_cli.serving import serve_vllm, stop_process
    from tests.support.slow_forwarder import slow_forwarder
    from tests.support.tito_vllm import anthropic_chat, engine_answers, first_step_ratios, openai_chat, trainer_logprobs

    logprobs = trainer_logprobs(model)
    server = serve_vllm(
        str(model),
        port=free_port(),
        served_model_name="tiny",
        state_dir=root / "engines",
        dtype=serve_dtype,
        max_model_len=4096,
        extra_args=["--enforce-eager"],
        kvcache_gib="1",
    )
    columns: dict[str, dict] = {}
    try:
        for tito in ("off", "on"):
            out, exchanges = root / f"{serve_dtype}-{tito}", []
            options = {"polar_tito": tito, "polar_tokenizer": str(model), "polar_shard_seconds": "0.2"}
            with slow_forwarder(server.url, 0.0, record=exchanges) as forwarder:
                with run_mitmdump(f"vllm:{forwarder}", out, options=options) as proxy:
                    for i in range(sessions):
                        if i % 2 == 0:
                            openai_chat(proxy, f"s{i}", user_turns=user_turns, seed=100 * i)
                        else:
                            anthropic_chat(proxy, f"s{i}", user_turns=user_turns)
            records = sorted(read_records(str(out)), key=lambda r: r.started_at)
            saw = sum(list(r.prompt_ids) == a[0] for r, a in zip(records, engine_answers(exchanges)))
            for merge in (True, False):
                column = measure(out, merge)
                ratios = first_step_ratios(build(out, merge_retokenized=merge)[1], logprobs)
                column.update(
                    {
                        "prompt ids = vLLM's": saw,
                        "ratio min": ratios.min,
                        "ratio max": ratios.max,
                        "mean |ratio - 1|": ratios.mean_abs_dev,
                    }
                )
                columns[f"{tito}, {'merge' if merge else 'break'}"] = column
    finally:
        stop_process(server)
    return columns


def print_table(title: str, columns: dict[str, dict]) -> None:
    names = list(columns)
    print(title)
    print(f"{'':22}" + "".join(f"{n:>14}" for n in names))
    for row in next(iter(columns.values())):
        values = [columns[n][row] for n in names]
        if row == "build seconds":
            cells = "".join(f"{v:>14.3f}" for v in values)
        elif row.startswith("ratio"):
            cells = "".join(f"{v:>14.7f}" for v in values)
        elif row.startswith("mean"):
            cells = "".join(f"{v:>14.2e}" for v in values)
        else:
            cells = "".join(f"{v:>14g}" for v in values)
        print(f"{row:22}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny")
    parser.add_argument("--sessions", type=int, default=4, help="sessions per side (openai and anthropic alternate)")
    parser.add_argument("--user-turns", type=int, default=3, help="user questions per session (3 model calls each)")
    parser.add_argument(
        "--harnesses",
        default="",
        help="comma-separated real harness CLIs instead of the SDK sessions: claude,codex,qwen,pi,gemini",
    )
    parser.add_argument("--vllm", action="store_true", help="real vLLM CPU and the ending model instead of the script")
    parser.add_argument("--serve-dtype", default="float32", help="--vllm: float32, bfloat16, or both comma-separated")
    args = parser.parse_args()
    if args.harnesses:
        harness_table(args.model_dir, [h for h in args.harnesses.split(",") if h])
        return
    if args.vllm:
        from tests.support.ending_model import build_ending_model

        with tempfile.TemporaryDirectory() as tmp:
            model = build_ending_model(Path(tmp) / "ending", dtype="bfloat16")
            for dtype in args.serve_dtype.split(","):
                columns = vllm_columns(model, Path(tmp), dtype, args.sessions, args.user_turns)
                print_table(
                    f"{args.sessions} sessions x {args.user_turns} user turns (1 call each), vLLM CPU "
                    f"--dtype {dtype}, ending model (bf16 weights), T={0.6}",
                    columns,
                )
        return
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
    print_table(
        f"{args.sessions} sessions x {args.user_turns} user turns (3 calls each), scripted engine, Qwen3 template",
        columns,
    )


if __name__ == "__main__":
    main()
