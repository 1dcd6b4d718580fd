"""Stored traces -> training rows: advantages, temperature check, length clipping, step partitions.

Everything here is plain Python over ``Trace`` records; the trainer only pads what it gets.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from polar_addon.call_roles import DEFAULT_TRAINED_ROLES
from polar_cli.trace import LATER_TRACE_COLUMNS, TRACE_SCHEMA, Trace, table_to_traces
from polar_cli.train.advantages import group_key, session_advantages

# A captured logprob is log p <= 0; engines round, so allow a hair above zero.
_LOGPROB_SLACK = 1e-4


@dataclass
class TrainRow:
    trace_id: str
    session_id: str
    group_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    advantage: float
    session_reward: float
    # 1 / (trainable rows of the session): summing it over a step's rows counts each session once.
    session_weight: float
    clipped: bool = False  # the completion was cut to fit max_length

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TrainData:
    rows: list[TrainRow]
    groups: list[list[int]]  # row indices of each GRPO group, groups in sorted key order
    group_keys: list[str]
    temperature: float
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def max_completion_length(self) -> int:
        return max((len(r.completion_ids) for r in self.rows), default=1)


class NothingToTrain(ValueError):
    """Every trace was dropped (e.g. all rewards of every group equal): no gradient to take."""


class TruncatedSampling(ValueError):
    """Traces sampled with top-p / top-k / min-p: the trainer's full-softmax logprob is not the behaviour policy's."""


def check_untruncated(traces: Sequence[Trace]) -> None:
    """Refuse trainable traces sampled from a truncated distribution.

    The trainer recomputes log_softmax(logits / T) over the whole vocabulary; under truncation the
    behaviour policy is that distribution renormalised over the kept tokens (vLLM's processed
    logprobs report exactly that), so every importance ratio and PPO clip would be off.
    """
    bad = [t for t in traces if t.trainable and t.truncated_sampling]
    if not bad:
        return
    sessions = len({t.session_id for t in bad})
    example = bad[0]
    raise TruncatedSampling(
        f"{len(bad)} trainable traces (of {sum(t.trainable for t in traces)}, {sessions} sessions) were sampled "
        f"with truncation (e.g. {example.trace_id}: top_p={example.top_p}, top_k={example.top_k}, "
        f"min_p={example.min_p}); the trainer recomputes the untruncated softmax, so their importance ratios "
        "would be wrong. Capture them again with top_p=1, top_k=0 and min_p=0: leave them unset in the "
        "client (polar's defaults polar_top_p=1, polar_top_k=0, polar_min_p=0 apply) or set them so."
    )


def explain_nothing_to_train(
    traces: Sequence[Trace], stats: dict[str, int], *, unrewarded_per_request: bool = False
) -> str:
    """Why no row is left, counted, each with what to do about it."""
    reasons: list[str] = []
    untrainable: dict[str, set[str]] = {}
    for t in traces:
        if not t.trainable:
            untrainable.setdefault(t.status, set()).add(t.session_id)
    side_only = {t.session_id for t in traces if t.role not in (None, "agent")} - {
        t.session_id for t in traces if t.role in (None, "agent")
    }
    side_only &= untrainable.get("completed", set())
    if side_only:
        untrainable["completed"] -= side_only
        reasons.append(
            f"{len(side_only)} sessions hold only auxiliary or discarded calls (titles, classifiers, retries), which "
            "are not trained unless --roles names them (e.g. --roles agent,auxiliary)"
        )
    running = len(untrainable.pop("running", ()))
    if running:
        reasons.append(
            f"{running} sessions still running: post a reward (`polar reward STORE --session S --value V`, which "
            "marks the session completed) or a status (`--status completed|timeout|agent_error|error`)"
        )
    errored = len(untrainable.pop("error", ()))
    if errored:
        reasons.append(f"{errored} sessions ended in an infrastructure error (status error): never training data")
    rest = sum(len(v) for v in untrainable.values())
    if rest:
        if unrewarded_per_request:
            reasons.append(f"{rest} sessions give per_request traces without a reward: pass --broadcast-rewards")
        else:
            reasons.append(
                f"{rest} sessions have no outcome reward (or no session row): post one with "
                "`polar reward STORE --session S --value V`"
            )
    if stats.get("zero_advantage"):
        groups: dict[str, set[float]] = {}
        for t in traces:
            if t.trainable:
                groups.setdefault(group_key(t), set()).add(float(t.reward))
        flat = sum(1 for rewards in groups.values() if len(rewards) == 1)
        reasons.append(
            f"{stats['zero_advantage']} traces in {flat} groups have zero advantage: all sessions of the group got "
            "the same reward; GRPO needs several sessions per group (the same group id in their "
            "credentials) with different rewards"
        )
    if stats.get("overlong_prompt"):
        reasons.append(
            f"{stats['overlong_prompt']} traces have a prompt of --max-length tokens or more: raise --max-length"
        )
    if stats.get("no_trainable_tokens"):
        reasons.append(f"{stats['no_trainable_tokens']} traces have no sampled token left to train on")
    if not traces:
        reasons.append("the input holds no trace (no ok call was captured)")
    return "; ".join(reasons) or f"every trace was dropped ({stats})"


class TemperatureMismatch(ValueError):
    """Training at another temperature than the capture would make every importance ratio wrong."""


def resolve_temperature(traces: Sequence[Trace], requested: float | None) -> float:
    """The one sampling temperature of the trainable traces; refuse mixtures and mismatches."""
    seen = sorted({float(t.temperature) for t in traces if t.trainable})
    if not seen:
        raise NothingToTrain(f"no trainable traces: {explain_nothing_to_train(traces, {})}")
    if len(seen) > 1:
        raise TemperatureMismatch(
            f"traces were sampled at several temperatures {seen}; the trainer scales logits by one "
            "temperature, so train each temperature's traces separately"
        )
    captured = seen[0]
    if captured <= 0:
        raise TemperatureMismatch(
            f"traces were sampled greedily (temperature {captured}); greedy samples have no usable "
            "behaviour logprobs for importance sampling"
        )
    if requested is not None and not math.isclose(requested, captured, rel_tol=0, abs_tol=1e-9):
        raise TemperatureMismatch(
            f"--temperature {requested} differs from the capture temperature {captured}: the importance "
            "ratios would compare log-softmax at two temperatures. Drop --temperature or pass the capture value."
        )
    return captured


def _check_logprobs(trace: Trace) -> None:
    for i, (m, lp) in enumerate(zip(trace.loss_mask, trace.behavior_logprobs, strict=True)):
        if m and (lp is None or not math.isfinite(lp) or lp > _LOGPROB_SLACK):
            raise ValueError(
                f"trace {trace.trace_id}: trainable token {i} has behaviour logprob {lp!r}; "
                "every loss-mask-1 token needs the engine's finite logprob"
            )


def clip_to_length(trace: Trace, max_length: int) -> tuple[list[int], list[int], list[float], bool] | None:
    """Cut the completion to a causal prefix so prompt + completion <= max_length.

    The prompt is never left-trimmed: that would change every later token's context and so
    invalidate the behaviour logprobs. A prompt that alone reaches max_length cannot be trained.
    """
    budget = max_length - len(trace.prompt_ids)
    if budget <= 0:
        return None
    n = len(trace.completion_ids)
    if n <= budget:
        return list(trace.completion_ids), list(trace.loss_mask), list(trace.behavior_logprobs), False
    return (
        list(trace.completion_ids[:budget]),
        list(trace.loss_mask[:budget]),
        list(trace.behavior_logprobs[:budget]),
        True,
    )


def prepare_rows(
    traces: Iterable[Trace],
    *,
    max_length: int,
    scale_rewards: str = "group",
    drop_zero_advantage: bool = True,
    temperature: float | None = None,
) -> TrainData:
    traces = list(traces)
    temp = resolve_temperature(traces, temperature)
    check_untruncated(traces)
    advantages = session_advantages(traces, scale_rewards)
    stats = dict(
        traces=len(traces),
        untrainable=0,
        overlong_prompt=0,
        no_trainable_tokens=0,
        zero_advantage=0,
        clipped=0,
        rows=0,
    )
    kept: list[tuple[Trace, tuple[list[int], list[int], list[float], bool]]] = []
    for trace in sorted(traces, key=lambda t: (group_key(t), t.session_id, t.chain_index, t.trace_id)):
        if not trace.trainable:
            stats["untrainable"] += 1
            continue
        _check_logprobs(trace)
        clipped = clip_to_length(trace, max_length)
        if clipped is None:
            stats["overlong_prompt"] += 1
            continue
        if not any(clipped[1]):
            stats["no_trainable_tokens"] += 1
            continue
        if drop_zero_advantage and advantages[trace.session_id].of(trace.reward) == 0.0:
            stats["zero_advantage"] += 1
            continue
        kept.append((trace, clipped))

    rows_per_session: dict[str, int] = {}
    for trace, _ in kept:
        rows_per_session[trace.session_id] = rows_per_session.get(trace.session_id, 0) + 1

    rows: list[TrainRow] = []
    group_index: dict[str, int] = {}
    groups: list[list[int]] = []
    for trace, (ids, mask, logprobs, was_clipped) in kept:
        sa = advantages[trace.session_id]
        rows.append(
            TrainRow(
                trace_id=trace.trace_id,
                session_id=trace.session_id,
                group_id=sa.group_id,
                prompt_ids=list(trace.prompt_ids),
                completion_ids=ids,
                loss_mask=[int(m) for m in mask],
                behavior_logprobs=[float(x) for x in logprobs],
                advantage=sa.of(trace.reward),
                session_reward=sa.reward,
                session_weight=1.0 / rows_per_session[trace.session_id],
                clipped=was_clipped,
            )
        )
        stats["clipped"] += int(was_clipped)
        if sa.group_id not in group_index:
            group_index[sa.group_id] = len(groups)
            groups.append([])
        groups[group_index[sa.group_id]].append(len(rows) - 1)
    stats["rows"] = len(rows)
    stats["groups"] = len(groups)
    stats["sessions"] = len(rows_per_session)
    return TrainData(rows=rows, groups=groups, group_keys=list(group_index), temperature=temp, stats=stats)


def partition_rows(lengths: Sequence[int], bins: int) -> list[list[int]]:
    """Split row indices into ``bins`` lists of equal size (ceil(n / bins) slots, the last ones may
    stay empty) and near-equal token totals: longest row first, into the lightest bin with room.

    Deterministic, so every process computes the same split of a step and takes its own share.
    Equal sizes matter because TRL gathers per-row metrics across processes, which needs every
    process to hold the same number of rows at each micro-step; empty slots become zero-weight rows.
    """
    capacity = max(1, math.ceil(len(lengths) / bins))
    loads = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min((k for k in range(bins) if len(out[k]) < capacity), key=lambda k: (loads[k], k))
        out[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in out]


def length_buckets(lengths: Sequence[int], max_waste: float = 0.1, max_tokens: int = 0) -> list[list[int]]:
    """Group row indices so that padding each group to its longest row wastes at most
    ``max_waste`` x its real tokens and, when ``max_tokens`` > 0, the padded group holds at most that
    many tokens (a longer row forms a group of its own): longest first, a row joins the open group
    while both hold.

    A micro-batch of short-prompt/long-completion (merged) and long-prompt (per-request) traces
    would otherwise be padded to the longest of all; each group is one forward pass, so the
    budget bounds the activations a backward keeps.
    """
    out: list[list[int]] = []
    width = real = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        padded = width * (len(out[-1]) + 1) if out else 0
        if (
            out
            and padded - (real + lengths[i]) <= max_waste * (real + lengths[i])
            and (max_tokens <= 0 or padded <= max_tokens)
        ):
            out[-1].append(i)
            real += lengths[i]
            continue
        out.append([i])
        width = real = lengths[i]
    return out


# --- input detection ------------------------------------------------------------------------------

_TRACE_COLUMNS = {"trace_id", "prompt_ids", "completion_ids", "loss_mask", "behavior_logprobs"}


def parquet_files(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(p.rglob("*.parquet")))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist")
    return files


def is_trace_dataset(paths: Sequence[Path]) -> bool:
    """True when the Parquet files hold built traces (TRACE_SCHEMA), False for raw capture shards."""
    files = parquet_files(paths)
    if not files:
        return False
    kinds = {_TRACE_COLUMNS <= set(pq.read_schema(f).names) for f in files}
    if len(kinds) > 1:
        raise ValueError("inputs mix built traces and raw capture shards; pass one kind")
    return kinds.pop()


def read_trace_dataset(paths: Sequence[Path]) -> list[Trace]:
    files = parquet_files(paths)
    traces: list[Trace] = []
    for f in files:
        table = pq.read_table(f)
        missing = [n for n in TRACE_SCHEMA.names if n not in table.column_names and n not in LATER_TRACE_COLUMNS]
        if missing:
            raise ValueError(f"{f}: trace dataset lacks columns {missing}")
        for name in LATER_TRACE_COLUMNS:
            if name not in table.column_names:
                table = table.append_column(
                    TRACE_SCHEMA.field(name), pa.nulls(len(table), TRACE_SCHEMA.field(name).type)
                )
        traces.extend(table_to_traces(table.select(TRACE_SCHEMA.names)))
    return traces


def load_traces(
    paths: Sequence[Path],
    strategy: str,
    *,
    tokenizer: Path | str | None = None,
    broadcast_rewards: bool = False,
    eot_token_id: int | None = None,
    merge_retokenized: bool = True,
    roles: Collection[str] = DEFAULT_TRAINED_ROLES,
    tool_call_reward: float = 0.0,
) -> list[Trace]:
    """Traces from a built dataset, or built on the fly from a raw trace store with `polar build`'s code.

    ``tokenizer`` (the model being trained) lets the build tell a re-tokenized turn from a
    template re-render; ``broadcast_rewards``, ``eot_token_id``, ``merge_retokenized``, ``roles`` and
    ``tool_call_reward`` are `polar build`'s options (a built dataset carries the rewards it was built with).
    """
    if is_trace_dataset(paths):
        return read_trace_dataset(paths)
    if len(paths) != 1:
        raise ValueError("raw capture shards are read from one trace-store directory (the proxy's polar_out)")
    from polar_addon.store import iter_records
    from polar_addon.store.reader import require_store

    require_store(str(paths[0]))  # StoreNotFound: a typo is an error, not "nothing to train"
    from polar_cli.build import iter_session_builds
    from polar_cli.build.inputs import find_tokenizer, session_infos, tokenizer_eot

    store = str(paths[0])
    tok, _ = find_tokenizer(Path(tokenizer) if tokenizer else None, store)
    sessions = session_infos(store)
    traces: list[Trace] = []
    # The same calls `polar build` makes, so training sees exactly the traces it would write.
    for built in iter_session_builds(
        iter_records(store),
        sessions,
        strategy,
        eot_token_id=eot_token_id,
        decode=None if tok is None else tok.decode,
        broadcast_rewards=broadcast_rewards,
        merge_retokenized=merge_retokenized,
        roles=roles,
        tool_call_reward=tool_call_reward,
        fallback_eot_token_id=tokenizer_eot(tok),  # closes turns when no captured call stopped by itself
    ):
        traces.extend(built.traces)
    return traces
