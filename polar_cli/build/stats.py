"""Reconstruction health: how well a build merged, and why it did not merge more.

- ``chains_total``: chains over all sessions; ``chains_full`` ended with their conversation,
  ``chains_truncated`` were cut by a break (their conversation went on in another chain).
- ``calls_merged``: calls appended to an existing chain (calls - chains); ``merge_rate`` =
  calls_merged / calls. A session of T calls that is one chain scores (T - 1) / T.
- ``breaks``: every chain beyond a session's first, by cause (``breaks.BreakCause``);
  sub-agents count here although they cut no chain.
- ``retokenized_merges``: merges where the next prompt re-tokenized a sampled turn (same text,
  other ids), merged as the paper does; the drift that remains inside merged traces.
- Token counts: what a trainer processes (prompt + completion per trace) and what it learns
  from (loss-mask-1 tokens of trainable traces).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from polar_cli.build.breaks import BreakCause


@dataclass
class BuildStats:
    sessions: int = 0
    calls: int = 0  # usable calls
    calls_unusable: dict[str, int] = field(default_factory=dict)  # reason -> count
    chains_total: int = 0
    chains_full: int = 0
    chains_truncated: int = 0
    calls_merged: int = 0
    retokenized_merges: int = 0
    breaks: dict[str, int] = field(default_factory=dict)  # cause -> count
    traces: int = 0
    traces_trainable: int = 0
    reward_reasons: dict[str, int] = field(default_factory=dict)  # decision reason -> traces
    prompt_tokens: int = 0
    completion_tokens: int = 0
    trainable_tokens: int = 0

    @property
    def merge_rate(self) -> float:
        return self.calls_merged / self.calls if self.calls else 0.0

    @property
    def processed_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: "BuildStats") -> None:
        for name, value in vars(other).items():
            if isinstance(value, dict):
                mine = Counter(getattr(self, name))
                mine.update(value)
                setattr(self, name, dict(sorted(mine.items())))
            else:
                setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["merge_rate"] = self.merge_rate
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildStats":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class BuildReport:
    """Stats for the whole build and for each harness."""

    total: BuildStats = field(default_factory=BuildStats)
    by_harness: dict[str, BuildStats] = field(default_factory=dict)

    def add(self, harness: str, stats: BuildStats) -> None:
        self.total.add(stats)
        self.by_harness.setdefault(harness, BuildStats()).add(stats)

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total.to_dict(),
            "by_harness": {h: s.to_dict() for h, s in sorted(self.by_harness.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildReport":
        return cls(
            total=BuildStats.from_dict(data["total"]),
            by_harness={h: BuildStats.from_dict(s) for h, s in data["by_harness"].items()},
        )


def harness_name(session_harness: str | None, user_agent: str | None) -> str:
    """A short harness label: the session row's harness, else the User-Agent's product token."""
    if session_harness:
        return session_harness
    if user_agent:
        return user_agent.split()[0].split("/")[0] or "unknown"
    return "unknown"


def report_table(report: BuildReport, title: str = "Reconstruction") -> "Any":
    """A rich Table: one row per harness plus the total, break causes as columns."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("harness", "sessions", "calls", "chains", "full", "truncated", "merge rate", "retokenized"):
        table.add_column(column, justify="left" if column == "harness" else "right")
    causes = [c.value for c in BreakCause]
    for cause in causes:
        table.add_column(f"break: {cause}", justify="right")
    table.add_column("traces (trainable)", justify="right")
    table.add_column("tokens processed / trained", justify="right")

    def row(name: str, s: BuildStats, style: str | None = None) -> None:
        table.add_row(
            name,
            str(s.sessions),
            str(s.calls),
            str(s.chains_total),
            str(s.chains_full),
            str(s.chains_truncated),
            f"{s.merge_rate:.1%}",
            str(s.retokenized_merges),
            *(str(s.breaks.get(c, 0)) for c in causes),
            f"{s.traces} ({s.traces_trainable})",
            f"{s.processed_tokens:,} / {s.trainable_tokens:,}",
            style=style,
        )

    for name, stats in sorted(report.by_harness.items()):
        row(name, stats)
    if len(report.by_harness) != 1:
        row("total", report.total, style="bold")
    return table
