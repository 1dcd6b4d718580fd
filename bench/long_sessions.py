"""Long sessions on a real vLLM window, by hand: every harness runs past its compaction threshold and compacts by
its own mechanism, or meets a prompt past vLLM's window, against one vLLM CPU server with ``--max-model-len
20480`` (tests/conftest.py's ``vllm_small_window_server``, started here) behind a real mitmdump.

Claude Code, Codex and Pi run in the suite (tests/test_long_sessions_vllm.py); this adds Qwen Code, Gemini CLI and
the forced overflows, which would take the suite past its time budget, and prints, per scenario, whether it held,
its wall time, and (from the run's own printout) each call and the trace starts.

    PYTHONPATH=. flock /tmp/polar-heavy.lock nice -n 10 .venv/bin/python bench/long_sessions.py [NAME ...]
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

import orjson

from tests.conftest import VLLM_SMALL_WINDOW, _vllm
from tests.test_long_sessions_vllm import WORD, compacted_once, refused, vllm_run

# one token of four characters: Gemini CLI's estimate of a resumed history (a token per 4 characters) is right
THE = " the"

QWEN_TRIM = (
    ".qwen/settings.json",
    {
        "tools": {
            "approvalMode": "yolo",
            "core": ["run_shell_command"],
            "exclude": ["tool_search", "agent", "task_stop", "send_message", "skill"],
        }
    },
)


def qwen_code(vllm_small_window_server: str, tmp_path: Path) -> None:
    """Qwen Code (its preset: ``contextWindowSize`` = 20,480; it compresses past 70 % of it, 14,336) with a short
    system prompt and one tool: a first ``qwen -p`` past that is answered; ``qwen -p --continue`` compresses first
    with its own prompt, answers on the snapshot and exits 0."""
    from polar_cli.rollout.harnesses.qwen_code import QwenCode

    preset = QwenCode()
    short = ["--system-prompt", "You are a counting agent."]
    results, records, logs = vllm_run(
        preset,
        tmp_path,
        vllm_small_window_server,
        "qwen-20k",
        lambda ctx: [
            preset.command("Remember this:" + WORD * 2600, ctx) + short,
            preset.command("Go on.", ctx) + short + ["--continue"],
        ],
        mode="reverse:https://api.openai.com",
        settings=QWEN_TRIM,
    )
    assert 14_336 < len(records[0].prompt_ids) < VLLM_SMALL_WINDOW
    compacted_once(records, results, "qwen-code", None, side_calls=1)


def gemini_cli(vllm_small_window_server: str, tmp_path: Path) -> None:
    """Gemini CLI (its preset: compress at half the served window, 10,240 tokens) with a short system prompt and
    one tool: a first ``gemini -p`` past that is answered; ``gemini --resume latest -p`` has a history it may split
    (a user message, an answer) and counts it by its own estimate (4 characters a token), compresses first with
    its own prompt, answers and exits 0."""
    from polar_cli.rollout.harnesses.gemini_cli import GeminiCli

    preset = GeminiCli()
    system = tmp_path / "system.md"
    system.write_text("You are a counting agent. Run commands with run_shell_command.\n")
    results, records, logs = vllm_run(
        preset,
        tmp_path,
        vllm_small_window_server,
        "gemini-20k",
        lambda ctx: [
            preset.command("Remember this:" + THE * 11_000, ctx),
            preset.command("Go on.", ctx) + ["--resume", "latest"],
        ],
        mode="reverse:https://generativelanguage.googleapis.com",
        settings=(".gemini/settings.json", {"tools": {"core": ["run_shell_command"]}}),
        extra_env={"GEMINI_SYSTEM_MD": str(system)},
    )
    assert 10_240 < len(records[0].prompt_ids) < VLLM_SMALL_WINDOW
    compacted_once(records, results, "gemini-cli", None)


# --- a forced overflow: a prompt past vLLM's window ------------------------------------------------------


def claude_code_overflow(vllm_small_window_server: str, tmp_path: Path) -> None:
    """Claude Code with its own system prompt and tools and a ~22k-token instruction: told the window by its preset,
    it estimates the prompt past its blocking limit and ends before sending anything, exit 1; without the window
    (the harness's own 200k) vLLM refuses the call and Claude Code ends on polar's "prompt is too long"."""
    from polar_cli.rollout.harnesses.claude_code import ClaudeCode

    preset = ClaudeCode()
    (result,), records, logs = vllm_run(
        preset,
        tmp_path,
        vllm_small_window_server,
        "cc-over",
        lambda ctx: [preset.command("Summarise this text:" + WORD * 11_000, ctx)],
        mode="reverse:https://api.anthropic.com",
    )
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    assert records == []
    answer = orjson.loads(result.stdout)
    assert (answer["is_error"], answer["result"], answer["terminal_reason"]) == (
        True,
        "Prompt is too long",
        "blocking_limit",
    )
    (home := tmp_path / "unwindowed").mkdir()
    (result,), records, logs = vllm_run(
        preset,
        home,
        vllm_small_window_server,
        "cc-over-unwindowed",
        lambda ctx: [preset.command("Summarise this text:" + WORD * 11_000, ctx)],
        mode="reverse:https://api.anthropic.com",
        window=None,
    )
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    (call,) = records
    prompt_tokens = refused(call)
    answer = orjson.loads(result.stdout)
    assert (answer["is_error"], answer["terminal_reason"]) == (True, "prompt_too_long")
    # It reads polar's "prompt is too long: N tokens > M maximum" (N: vLLM's count of the whole prompt).
    said = answer["result"].replace(",", "")
    assert said.startswith(
        f"Prompt is too long · the request is ~{prompt_tokens} tokens (limit {VLLM_SMALL_WINDOW})"
    ), said


def codex_overflow(vllm_small_window_server: str, tmp_path: Path) -> None:
    """Codex on its default provider with an instruction that takes its ~15k-token first prompt past vLLM's window:
    the streamed ``response.failed`` / ``context_length_exceeded`` ends the run with its own message, exit 1."""
    from polar_cli.rollout.harnesses.codex import Codex

    preset = Codex()
    (result,), records, logs = vllm_run(
        preset,
        tmp_path,
        vllm_small_window_server,
        "codex-over",
        lambda ctx: [preset.command("Read this:" + WORD * 3000, ctx)],
        mode=None,
    )
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    (call,) = records
    assert call.api == "openai_responses" and refused(call) > VLLM_SMALL_WINDOW
    assert "ERROR: Codex ran out of room in the model's context window." in result.stderr, result.stderr[-1500:]


SCENARIOS = {
    "qwen-code": qwen_code,
    "gemini-cli": gemini_cli,
    "claude-code-overflow": claude_code_overflow,
    "codex-overflow": codex_overflow,
}


def main(names: list[str]) -> int:
    from polar_cli.tiny_model import build_tiny_model

    chosen = names or list(SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="polar-long-sessions-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny", generation_defaults="qwen3")
        started = time.monotonic()
        with _vllm(model, root, ["--max-model-len", str(VLLM_SMALL_WINDOW), "--enforce-eager"], kv_cache_gib=1) as url:
            print(f"vLLM --max-model-len {VLLM_SMALL_WINDOW} up in {time.monotonic() - started:.0f} s", flush=True)
            figures = []
            for name in chosen:
                (root / name).mkdir()
                t0 = time.monotonic()
                try:
                    SCENARIOS[name](url, root / name)
                    verdict = "held"
                except Exception:  # noqa: BLE001 - a by-hand report: print it and go on to the next scenario
                    traceback.print_exc()
                    verdict = "FAILED"
                figures.append((name, verdict, time.monotonic() - t0))
    for name, verdict, seconds in figures:
        print(f"{name:24} {verdict:7} {seconds:6.1f} s")
    return 0 if all(v == "held" for _, v, _ in figures) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
