"""Reconstruction health: how well a build merged, and why it did not merge more.

- ``chains_total``: chains over all sessions; ``chains_full`` ended with their conversation,
  ``chains_truncated`` were cut by a break (their conversation went on in another chain).
- ``calls_merged``: calls appended to an existing chain (calls - chains); ``merge_rate`` =
  calls_merged / calls. A session of T calls that is one chain scores (T - 1) / T.
- ``breaks``: every chain beyond a session's first, by cause (``breaks.BreakCause``);
  sub-agents count here although they cut no chain.
- ``retokenized_merges``: merges where the next prompt re-tokenized a sampled turn (same text,
  other ids), merged as the paper does (``--retokenized merge``, an opt-in); the off-policy drift inside merged
  traces. The default build (``--retokenized break``) does not merge them and counts each under ``breaks``.
- ``prompt_sources``: calls by where their engine prompt came from (``continuity``: the previous prompt
  and sampled ids plus the new messages' tokens; ``fresh``: a full render), and ``fresh_reasons``
  why a call was rendered fresh (polar_addon.continuity.chains); calls captured before polar recorded it
  count under neither.
- ``parse_failed_calls``: calls with a tool call polar's own parser could not read (``parse_failures``;
  their traces get reward 0 but stay trainable, polar_cli.build.rewards); calls the engine parsed count
  under ``reward_reasons`` only.
- ``tool_call_parsers``: calls with tool calls by who found them (``tool_call_parser``: ``engine``, a
  ``polar_tool_parser`` name, or the opt-in ``fenced_json`` fallback): how many turns relied on the fallback.
- ``roles``: every call (failed ones too) by its role (polar_addon.call_roles): ``agent``, ``auxiliary: KIND``
  (a harness's side job: ``claude-code title``, ``codex compaction``, ...) or ``discarded: failed|retried``;
  ``mixed_role_chains``: chains holding calls of more than one role (an auxiliary call the harness continued
  from; its sampled tokens stay out of the loss unless auxiliary calls are trained).
- Token counts: what a trainer processes (prompt + completion per trace) and what it learns
  from (loss-mask-1 tokens of trainable traces).
- Mask rate per group (:func:`group_masks`): sessions whose status keeps them out of training
  (``error``: infrastructure, the runner's cancels included; ``running``: never ended) over the
  group's sessions. The policy's own failures (``agent_error``, ``timeout``) are trained with
  reward 0 and are not masked: a rising mask rate is failures escaping their reward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from polar_addon.call_roles import ROLES, CallRole
from polar_addon.store.status import STORE_MASKED
from polar_cli.build.breaks import BreakCause
from polar_cli.build.rewards import SessionInfo

NO_GROUP = "(no group)"


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
    prompt_sources: dict[str, int] = field(default_factory=dict)  # continuity | fresh -> calls
    fresh_reasons: dict[str, int] = field(default_factory=dict)  # why fresh -> calls
    parse_failed_calls: int = 0  # calls whose parse_failures > 0
    tool_call_parsers: dict[str, int] = field(default_factory=dict)  # who found a call's tool calls -> calls
    roles: dict[str, int] = field(default_factory=dict)  # calls (failed ones too) by role and side job -> calls
    mixed_role_chains: int = 0  # chains holding calls of more than one role
    prompt_tokens: int = 0
    completion_tokens: int = 0
    trainable_tokens: int = 0

    @property
    def merge_rate(self) -> float:
        return self.calls_merged / self.calls if self.calls else 0.0

    @property
    def processed_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: BuildStats) -> None:
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
    def from_dict(cls, data: dict[str, Any]) -> BuildStats:
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
    def from_dict(cls, data: dict[str, Any]) -> BuildReport:
        return cls(
            total=BuildStats.from_dict(data["total"]),
            by_harness={h: BuildStats.from_dict(s) for h, s in data["by_harness"].items()},
        )


def harness_name(session_harness: str | None, user_agent: str | None) -> str:
    """A short harness label: the product token of the session's harness or the User-Agent
    ("claude-cli/2.1.197 (external, cli)" -> "claude-cli"; a preset name stays as it is)."""
    label = session_harness or user_agent
    if not label or not label.strip():
        return "unknown"
    return label.split()[0].split("/")[0] or "unknown"


def top_reasons(reasons: dict[str, int], n: int = 3) -> str:
    """The ``n`` most frequent reasons as "reason count, ..." (a NoDelta's detail cut to its kind)."""
    kinds: Counter[str] = Counter()
    for reason, count in reasons.items():
        kinds[reason.split(":", 1)[0]] += count
    ranked = sorted(kinds.items(), key=lambda item: (-item[1], item[0]))[:n]
    return ", ".join(f"{reason} {count}" for reason, count in ranked) or "-"


def role_counts(roles: dict[str, int]) -> str:
    """ "agent 12, auxiliary 3, discarded 1" from counts keyed ``role`` or ``role: kind``."""
    by_role: Counter[str] = Counter()
    for kind, count in roles.items():
        by_role[kind.split(":", 1)[0]] += count
    return ", ".join(f"{role} {by_role[role]}" for role in ROLES if by_role[role]) or "-"


def side_jobs(roles: dict[str, int], n: int = 4) -> str:
    """The most frequent auxiliary kinds ("claude-code title 2, qwen-code next_speaker 1")."""
    prefix = f"{CallRole.AUXILIARY.value}: "
    jobs = {kind[len(prefix) :]: count for kind, count in roles.items() if kind.startswith(prefix)}
    ranked = sorted(jobs.items(), key=lambda item: (-item[1], item[0]))[:n]
    return ", ".join(f"{job} {count}" for job, count in ranked) or "-"


def report_table(report: BuildReport, title: str = "Reconstruction") -> Any:
    """A rich Table: one column per harness plus the total, one row per figure."""
    from rich.table import Table

    from polar_cli.terminal import markup_safe

    columns = sorted(report.by_harness.items())
    if len(columns) != 1:
        columns.append(("total", report.total))
    table = Table(title=title)
    table.add_column("")
    for name, _ in columns:
        table.add_column(markup_safe(name), justify="right", style="bold" if name == "total" else None)

    def row(label: str, value: Any) -> None:
        table.add_row(label, *(value(s) for _, s in columns))

    row("sessions", lambda s: str(s.sessions))
    row("calls", lambda s: str(s.calls))
    row("unusable calls", lambda s: str(sum(s.calls_unusable.values())))
    row("chains", lambda s: str(s.chains_total))
    row("  fully merged", lambda s: str(s.chains_full))
    row("  truncated", lambda s: str(s.chains_truncated))
    row("merge rate", lambda s: f"{s.merge_rate:.1%}")
    row("re-tokenized merges", lambda s: str(s.retokenized_merges))
    for cause in BreakCause:
        row(f"break: {cause.value}", lambda s, c=cause.value: str(s.breaks.get(c, 0)))
    row("prompt: continuity", lambda s: str(s.prompt_sources.get("continuity", 0)))
    row("prompt: fresh", lambda s: str(s.prompt_sources.get("fresh", 0)))
    row("  top fresh reasons", lambda s: markup_safe(top_reasons(s.fresh_reasons)))
    row("failed tool-call parses", lambda s: str(s.parse_failed_calls))
    row("  tool calls found by", lambda s: markup_safe(top_reasons(s.tool_call_parsers)))
    row("calls by role", lambda s: markup_safe(role_counts(s.roles)))
    row("  side jobs", lambda s: markup_safe(side_jobs(s.roles)))
    row("traces (trainable)", lambda s: f"{s.traces} ({s.traces_trainable})")
    row("tokens processed", lambda s: f"{s.processed_tokens:,}")
    row("tokens trained", lambda s: f"{s.trainable_tokens:,}")
    return table


@dataclass(frozen=True)
class GroupMask:
    sessions: int
    masked: int

    @property
    def rate(self) -> float:
        return self.masked / self.sessions if self.sessions else 0.0


def group_masks(sessions: Iterable[SessionInfo]) -> dict[str, GroupMask]:
    """group -> its sessions and how many of them are masked (``STORE_MASKED``), groups sorted by name."""
    counts: dict[str, tuple[int, int]] = {}
    for info in sessions:
        group = info.group_id or NO_GROUP
        total, masked = counts.get(group, (0, 0))
        counts[group] = (total + 1, masked + (info.status in STORE_MASKED))
    return {group: GroupMask(total, masked) for group, (total, masked) in sorted(counts.items())}


def _total(masks: dict[str, GroupMask]) -> GroupMask:
    return GroupMask(sum(m.sessions for m in masks.values()), sum(m.masked for m in masks.values()))


def masks_to_dict(masks: dict[str, GroupMask]) -> dict[str, Any]:
    total = _total(masks)
    return {
        "mask_rate": total.rate,
        "masked": total.masked,
        "sessions": total.sessions,
        "groups": {g: {"sessions": m.sessions, "masked": m.masked, "mask_rate": m.rate} for g, m in masks.items()},
    }


def mask_table(masks: dict[str, GroupMask], limit: int = 20) -> Any:
    """A rich Table of the groups with the highest mask rates (at most ``limit``) and the total."""
    from rich.table import Table

    from polar_cli.terminal import markup_safe

    table = Table(title="Masked sessions (error or running: never trained)")
    for name in ("group", "sessions", "masked", "mask rate"):
        table.add_column(name, justify="left" if name == "group" else "right")
    ranked = sorted(masks.items(), key=lambda item: (-item[1].rate, item[0]))
    for group, mask in ranked[:limit]:
        table.add_row(markup_safe(group), str(mask.sessions), str(mask.masked), f"{mask.rate:.1%}")
    if len(ranked) > limit:
        table.add_row(f"... {len(ranked) - limit} more groups", "", "", "")
    total = _total(masks)
    table.add_row("total", str(total.sessions), str(total.masked), f"{total.rate:.1%}", style="bold")
    return table
