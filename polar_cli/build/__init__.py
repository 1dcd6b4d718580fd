"""Trajectory reconstruction: captured calls -> training traces (pure; no store, no I/O).

``build_traces(records, sessions, strategy)`` takes ``CaptureRecord``s (any order) and
``SessionInfo``s and returns ``Trace`` rows plus reconstruction stats. ``prefix_merging``
(default) merges each session's calls into chains (``prefix_merging.py``); ``per_request`` makes
one trace per call. Stats always come from the chain analysis, so a per_request build still says
how well the same calls would merge. What a build reads from a store besides its records (the sessions, a
tokenizer) is read by ``inputs.py``, for `polar build` and `polar train` alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import groupby

from polar_addon.call_roles import DEFAULT_TRAINED_ROLES, CallRole
from polar_addon.capture import CaptureRecord
from polar_cli.build.breaks import Break, BreakCause, Decode
from polar_cli.build.per_request import per_request_trace
from polar_cli.build.prefix_merging import RecordChain, detect_eot, reconstruct_session, unusable_reason
from polar_cli.build.rewards import RewardDecision, SessionInfo, decide_reward, untrained_role
from polar_cli.build.roles import chain_role, role_kind, session_roles
from polar_cli.build.stats import BuildReport, BuildStats, harness_name
from polar_cli.build.traces import make_trace
from polar_cli.trace import Trace

STRATEGIES = ("prefix_merging", "per_request")

__all__ = [
    "STRATEGIES",
    "Break",
    "BreakCause",
    "BuildReport",
    "BuildResult",
    "BuildStats",
    "RecordChain",
    "SessionBuild",
    "SessionInfo",
    "build_session",
    "build_traces",
    "detect_eot",
    "iter_session_builds",
]


@dataclass
class SessionBuild:
    session_id: str
    harness: str
    chains: list[RecordChain]
    traces: list[Trace]
    stats: BuildStats
    eot_token_id: int | None


@dataclass
class BuildResult:
    traces: list[Trace]
    report: BuildReport
    eot_token_id: int | None


def chain_trace(
    chain: RecordChain,
    session: SessionInfo | None,
    harness: str,
    decision: RewardDecision,
    role: str,
    untrained_calls: Collection[int] = (),
) -> Trace:
    """``untrained_calls``: indices in the chain of calls whose sampled tokens stay out of the loss (an auxiliary
    call inside an agent chain, when auxiliary calls are not trained)."""
    merged = chain.merge()
    if untrained_calls:
        for segment in merged.segments:
            if segment.kind == "sampled" and segment.call in untrained_calls:
                merged.loss_mask[segment.start : segment.end] = [0] * (segment.end - segment.start)
    first = chain.records[0]
    return make_trace(
        trace_id=f"{first.session_id}:c{chain.index}",
        session_id=first.session_id,
        session=session,
        harness=harness,
        chain_index=chain.index,
        records=chain.records,
        completion_ids=merged.completion_ids,
        loss_mask=merged.loss_mask,
        logprobs=merged.logprobs,
        decision=decision,
        break_cause=chain.end.cause.value if chain.end else None,
        role=role,
    )


def build_session(
    session_id: str,
    records: list[CaptureRecord],
    session: SessionInfo | None,
    *,
    strategy: str = "prefix_merging",
    eot_token_id: int | None,
    decode: Decode | None = None,
    broadcast_rewards: bool = False,
    merge_retokenized: bool = True,
    roles: Collection[str] = DEFAULT_TRAINED_ROLES,
    tool_call_reward: float = 0.0,
) -> SessionBuild:
    """One session's records (sorted by seq) -> its chains, traces and stats.

    ``roles``: which calls are trained (polar_addon.call_roles; `polar build --roles`). Traces of other roles are
    built (inspection, SFT-style use) but not trainable; a discarded call is left out of reconstruction unless
    trained, so the retry that replaced it continues its chain. ``tool_call_reward``: the shaped reward of
    rewards.decide_reward (`--tool-call-reward`).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    call_roles = session_roles(records)
    unusable = Counter(reason for r in records if (reason := unusable_reason(r)) is not None)
    role_of = {r.record_id: role.role for r, role in zip(records, call_roles)}
    answered = [r for r in records if unusable_reason(r) is None]
    keep_discarded = CallRole.DISCARDED.value in roles
    usable = [r for r in answered if keep_discarded or role_of[r.record_id] != CallRole.DISCARDED.value]
    harness = harness_name(session.harness if session else None, next((r.harness for r in records if r.harness), None))
    chains = reconstruct_session(usable, eot=eot_token_id, decode=decode, merge_retokenized=merge_retokenized)
    if strategy == "prefix_merging":
        traces = []
        decisions = []
        for chain in chains:
            of_calls = [role_of[r.record_id] for r in chain.records]
            role = chain_role(of_calls)
            decision = decide_reward(
                session, chain.records, per_request=False, broadcast=False, tool_call_reward=tool_call_reward
            )
            decision = untrained_role(decision, role, roles)
            # A trained chain keeps its untrained calls' context but not their tokens in the loss; an untrained
            # chain keeps its mask (inspection and SFT-style use read it), and trainable says it is not trained.
            untrained = [m for m, call in enumerate(of_calls) if call not in roles] if role in roles else []
            traces.append(chain_trace(chain, session, harness, decision, role, untrained))
            decisions.append(decision)
    else:
        decisions = [
            untrained_role(
                decide_reward(
                    session, [r], per_request=True, broadcast=broadcast_rewards, tool_call_reward=tool_call_reward
                ),
                role_of[r.record_id],
                roles,
            )
            for r in usable
        ]
        traces = [per_request_trace(r, session, harness, d, role_of[r.record_id]) for r, d in zip(usable, decisions)]
    stats = BuildStats(
        sessions=1,
        calls=len(usable),
        roles=dict(Counter(role_kind(role) for role in call_roles)),
        mixed_role_chains=sum(len({role_of[r.record_id] for r in c.records}) > 1 for c in chains),
        calls_unusable=dict(unusable),
        chains_total=len(chains),
        chains_full=sum(c.end is None for c in chains),
        chains_truncated=sum(c.end is not None for c in chains),
        calls_merged=len(usable) - len(chains),
        retokenized_merges=sum(c.retokenized for c in chains),
        breaks=dict(Counter(c.start.cause.value for c in chains if c.start is not None)),
        traces=len(traces),
        traces_trainable=sum(t.trainable for t in traces),
        reward_reasons=dict(Counter(d.reason for d in decisions)),
        # How the proxy answered: every answered call, a retried one too (only reconstruction leaves it out).
        prompt_sources=dict(Counter(r.prompt_source for r in answered if r.prompt_source)),
        fresh_reasons=dict(
            Counter(r.prompt_reason for r in answered if r.prompt_source == "fresh" and r.prompt_reason)
        ),
        parse_failed_calls=sum(bool(r.parse_failures) for r in answered),
        tool_call_parsers=dict(Counter(r.tool_call_parser for r in answered if r.tool_call_parser)),
        prompt_tokens=sum(len(t.prompt_ids) for t in traces),
        completion_tokens=sum(len(t.completion_ids) for t in traces),
        trainable_tokens=sum(sum(t.loss_mask) for t in traces if t.trainable),
    )
    return SessionBuild(session_id, harness, chains, traces, stats, eot_token_id)


def iter_session_builds(
    records: Iterable[CaptureRecord],
    sessions: Mapping[str, SessionInfo],
    strategy: str = "prefix_merging",
    *,
    eot_token_id: int | None = None,
    decode: Decode | None = None,
    broadcast_rewards: bool = False,
    fallback_eot_token_id: int | None = None,
    merge_retokenized: bool = True,
    roles: Collection[str] = DEFAULT_TRAINED_ROLES,
    tool_call_reward: float = 0.0,
) -> Iterator[SessionBuild]:
    """Build sessions from records sorted by (session_id, seq), one session in memory at a time.

    With ``eot_token_id`` None the end-of-turn token is the last sampled token of the first
    naturally stopped call in that order whose prompt also holds it (the template closes turns
    with it); sessions read before it is known wait for it. Failing that, ``fallback_eot_token_id``
    (e.g. the tokenizer's eos token), then any natural stop token seen, is used.
    """
    eot = eot_token_id
    waiting: list[tuple[str, list[CaptureRecord]]] = []

    def built(session_id: str, group: list[CaptureRecord]) -> SessionBuild:
        return build_session(
            session_id,
            group,
            sessions.get(session_id),
            strategy=strategy,
            eot_token_id=eot,
            decode=decode,
            broadcast_rewards=broadcast_rewards,
            merge_retokenized=merge_retokenized,
            roles=roles,
            tool_call_reward=tool_call_reward,
        )

    unconfirmed: int | None = None
    for session_id, records_of in groupby(records, key=lambda r: r.session_id):
        group = list(records_of)
        if eot is None:
            eot = detect_eot(group, confirmed_only=True)
            if eot is None:
                unconfirmed = unconfirmed if unconfirmed is not None else detect_eot(group)
                waiting.append((session_id, group))
                continue
        for waiting_id, waiting_group in waiting:
            yield built(waiting_id, waiting_group)
        waiting = []
        yield built(session_id, group)
    if eot is None:
        eot = fallback_eot_token_id if fallback_eot_token_id is not None else unconfirmed
    for waiting_id, waiting_group in waiting:
        yield built(waiting_id, waiting_group)


def build_traces(
    records: Iterable[CaptureRecord],
    sessions: Mapping[str, SessionInfo] | Iterable[SessionInfo],
    strategy: str = "prefix_merging",
    *,
    eot_token_id: int | None = None,
    decode: Decode | None = None,
    broadcast_rewards: bool = False,
    merge_retokenized: bool = True,
    roles: Collection[str] = DEFAULT_TRAINED_ROLES,
    tool_call_reward: float = 0.0,
) -> BuildResult:
    """Build every session's traces from records in any order. ``eot_token_id`` None: detected.

    ``decode`` (token ids -> text, e.g. a tokenizer's ``decode``) lets break classification tell
    a re-tokenization (merged) from a template re-render (a break); without it such mismatches
    break the chain with cause ``other``. ``merge_retokenized`` False breaks the chain at a
    re-tokenization too (cause ``retokenized``): no merged turn then follows a context other than
    the one it was sampled after, at the price of shorter traces.
    """
    by_id = sessions if isinstance(sessions, Mapping) else {s.session_id: s for s in sessions}
    ordered = sorted(records, key=lambda r: (r.session_id, r.seq))
    traces: list[Trace] = []
    report = BuildReport()
    eot = eot_token_id
    for built in iter_session_builds(
        ordered,
        by_id,
        strategy,
        eot_token_id=eot_token_id,
        decode=decode,
        broadcast_rewards=broadcast_rewards,
        merge_retokenized=merge_retokenized,
        roles=roles,
        tool_call_reward=tool_call_reward,
    ):
        traces.extend(built.traces)
        report.add(built.harness, built.stats)
        eot = built.eot_token_id
    return BuildResult(traces, report, eot)
