"""`polar eval`: a rollout (every `polar rollout` option) read as an evaluation: pass@1 and pass@k per task and
overall with standard errors, failure causes, calls and tokens per session (polar_cli/eval); ``eval-report.json``
next to the rollout's summary, and a table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.rollout.config import RolloutSettings, make_run_id
from polar_cli.settings import SettingsError, cli_fields, command, option
from polar_cli.settings import manifest as settings_manifest

EVAL_REPORT = "eval-report.json"


@dataclass
class EvalSettings(RolloutSettings):
    """`polar eval`'s command line: `polar rollout`'s options (the same fields, inherited) and its own."""

    k: list[int] = option(
        default_factory=list,
        flags=("--k",),
        help="The k of pass@k, repeatable (default: 1 and --samples). Each k at most --samples.",
    )
    pass_threshold: float = option(1.0, help="A session passes when its reward is at least this.")
    eval_report: Path | None = option(
        None, help=f"Where the JSON report goes (default: {EVAL_REPORT} in the report directory)."
    )

    def ks(self) -> list[int]:
        ks = sorted(set(self.k or [1, self.samples]))
        bad = [k for k in ks if not 1 <= k <= self.samples]
        if bad:
            raise SettingsError(f"pass@k needs 1 <= k <= --samples ({self.samples}); got {bad}", "k")
        return ks


@command
def eval_tasks(settings: EvalSettings) -> None:
    """Evaluate a harness (and the model behind it) on a task set: SAMPLES sessions per task as `polar rollout`
    runs them, then pass@1 and pass@k (the unbiased estimator of the HumanEval paper, per task, averaged over tasks)
    with standard errors over tasks, the failure cause of every session (wrong, verifier error, harness failed,
    timeout, context overflow; infrastructure errors are masked, left out of n), and, with --out (the trace store),
    calls, tokens and tool-call parse failures per session. Writes eval-report.json and prints a table."""
    from rich.console import Console

    from polar_cli.eval.report import build_report, read_call_stats, render
    from polar_cli.rollout_cmd import EXIT_ALL_FAILED, rollout

    s = settings
    ks = s.ks()
    if s.report_dir is None:
        s.report_dir = Path("polar-evals") / make_run_id(s.seed)
    try:
        rollout(**{f.name: getattr(s, f.name) for f in cli_fields(RolloutSettings)})
    except typer.Exit as exc:
        if exc.exit_code != EXIT_ALL_FAILED:  # every session failing is a result (pass@k 0), not an error
            raise
    summary_path = s.report_dir / "rollout-summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    results = summary["session_results"]
    calls = None
    if s.out:
        try:
            calls = read_call_stats(s.out, [r["session_id"] for r in results])
        except (OSError, ValueError) as exc:
            typer.echo(f"warning: no call statistics from the store {s.out}: {exc}", err=True)
    report = build_report(results, ks, s.pass_threshold, calls)
    document = {
        **report.to_json(), "settings": settings_manifest(s), "rollout_summary": str(summary_path),
        "task_set_hash": summary.get("task_set_hash"),
    }  # fmt: skip
    from polar_cli.rollout.redact import control_tokens, write_json

    path = s.eval_report or s.report_dir / EVAL_REPORT
    write_json(path, document, control_tokens(s.out, s.confdir, s.control_token))
    Console().print(render(report))
    overall = ", ".join(
        f"pass@{k} {'-' if e.mean is None else f'{e.mean:.3f}'}" + (f" ± {e.se:.3f}" if e.se is not None else "")
        for k, e in report.overall.items()
    )
    per_session = ""
    if report.turns is not None and report.turns.mean is not None and report.tokens and report.tokens.mean is not None:
        per_session = f"; {report.turns.mean:.1f} calls and {report.tokens.mean:.0f} tokens per session"
    typer.echo(f"polar eval: {len(report.tasks)} tasks, {len(results)} sessions: {overall}{per_session}; report {path}")
    if not any(t.n for t in report.tasks):
        typer.echo("error: no session was scored (every one an infrastructure error: see the causes)", err=True)
        raise typer.Exit(EXIT_ALL_FAILED)
