"""Prefix merging: a session's calls become chains, each chain one token stream (polar.md §1.3, §2.5).

Grouping is the strict token-prefix rule: a call joins the chain whose last prompt is a prefix
of its prompt, the longest such prompt winning (ties: the most recently extended chain whose
merge succeeds); otherwise it opens a chain. Only server-tokenized prompts are compared, never
the sampled ids, so a re-tokenized sampled turn never decides grouping.

Merging a chain r_1..r_K gives ``completion = a_1 u_1 a_2 u_2 ... a_K`` after the prompt p_1:
``a_m`` are r_m's sampled ids (loss mask 1, the engine's logprobs) and ``u_m`` the interstitial
tokens of r_{m+1}'s canonical prompt. The tail ``t_m = p_{m+1}[len(p_m):]`` starts with the
template's re-rendered copy of a_m, closed by the end-of-turn token e; u_m is what follows the
first e in t_m, or starts at that e when a_m did not end with e (a length-capped turn, or one ended
by another stop token such as Qwen's ``<|endoftext|>``), so the turn still closes. The proxy's token
continuation closes such a turn the same way (polar_addon.continuity.delta: the template's e and glue
after the sampled ids), so there the copy is a_m itself and the chain is exact; e and its glue are
context, masked like any interstitial.

Unlike Polar, which merges whatever follows the first e, the copy is checked against a_m: a
copy with other text (a dropped think block, a re-serialized tool call) means the model
sampled a_{m+1} after a context other than p_1 a_1 u_1 ... and merging would train it against
the wrong context, so the chain breaks there and r_{m+1} starts a new chain. A copy with the
same text in other token ids (re-tokenization) is merged, as the paper does, and counted; with
``merge_retokenized=False`` it breaks the chain too (cause ``retokenized``), since a_{m+1} was
sampled after the re-tokenized copy, not after a_m's sampled ids, so a merged trace is slightly
off-policy for every later turn. A break never drops calls: every usable call is in exactly one chain.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from polar_addon.capture import CaptureRecord
from polar_cli.build.breaks import (
    Break,
    BreakCause,
    Conversation,
    Decode,
    Relation,
    as_compaction,
    classify_rerendered_turn,
    relate_new_chain,
    sub_agent_break,
)

# prompt_source of a call whose prompt is the previous prompt + sampled ids + a delta (polar_addon.continuity).
CONTINUITY_PROMPT = "continuity"
# Finish reasons where the model emitted its end-of-turn token itself.
NATURAL_STOPS = frozenset({"stop", "tool_calls", "stop_sequence", "end_turn"})


def unusable_reason(record: CaptureRecord) -> str | None:
    """Why a record cannot be training data (None: it can)."""
    if record.status != "ok":
        return "failed call"
    if not record.prompt_ids:
        return "no prompt token ids"
    if len(record.logprobs) != len(record.response_ids):
        return "logprobs and response ids differ in length"
    return None


def _natural_stop(record: CaptureRecord) -> bool:
    """The model ended the turn with a stop token (not a stop string, not a length cap)."""
    return (
        unusable_reason(record) is None
        and record.finish_reason in NATURAL_STOPS
        and record.matched_stop is None
        and bool(record.response_ids)
    )


def detect_eot(records: Iterable[CaptureRecord], *, confirmed_only: bool = False) -> int | None:
    """The end-of-turn token: the last sampled token of the first naturally stopped call (Polar's
    rule), preferring one that also closes a turn in that call's prompt: a model with several stop
    tokens (Qwen's ``<|endoftext|>`` beside ``<|im_end|>``) may end a turn with one the template
    never writes. With ``confirmed_only`` such an unconfirmed stop token is not returned. A call
    stopped by a stop *string* is skipped: its last token is text. A continuity prompt holds earlier turns' sampled
    ids verbatim, such a stop token included, so it cannot confirm one: a prompt the template rendered in full (the
    session's first call's) must hold it.
    """
    records = list(records)
    rendered = [r.prompt_ids for r in records if r.prompt_source != CONTINUITY_PROMPT]
    fallback = None
    for record in records:
        if _natural_stop(record):
            last = record.response_ids[-1]
            if record.prompt_source != CONTINUITY_PROMPT:
                confirmed = last in record.prompt_ids
            else:
                confirmed = any(last in prompt for prompt in rendered)
            if confirmed:
                return last
            if fallback is None:
                fallback = last
    return None if confirmed_only else fallback


@dataclass(frozen=True)
class Segment:
    kind: str  # "sampled" (loss mask 1) or "interstitial" (loss mask 0)
    call: int  # index in RecordChain.records: the call that sampled it / whose prompt it comes from
    start: int  # [start, end) in the completion
    end: int


@dataclass
class Merged:
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    segments: list[Segment]


@dataclass
class RecordChain:
    """A session's captured calls that merge into one trace, each prompt extending the one before
    (the proxy's live counterpart is polar_addon.continuity.chains.ChainTip)."""

    index: int  # creation order within the session
    records: list[CaptureRecord]
    # interstitials[m] goes between records[m] and records[m + 1]
    interstitials: list[list[int]] = field(default_factory=list)
    start: Break | None = None  # why this chain exists beside earlier ones (None: the first)
    end: Break | None = None  # why its conversation continued in another chain (None: it did not)
    related: int | None = None  # the earlier chain it broke from (or branched off)
    continued_by: int | None = None  # the chain that carried this one's conversation on
    retokenized: int = 0  # merges where the next prompt re-tokenized a sampled turn

    @property
    def tip(self) -> CaptureRecord:
        return self.records[-1]

    @property
    def prompt_ids(self) -> list[int]:
        return self.records[0].prompt_ids

    def merge(self) -> Merged:
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        segments: list[Segment] = []
        for m, record in enumerate(self.records):
            a = record.response_ids
            if a:
                segments.append(Segment("sampled", m, len(ids), len(ids) + len(a)))
                ids.extend(a)
                mask.extend([1] * len(a))
                logprobs.extend(record.logprobs)
            if m < len(self.interstitials) and self.interstitials[m]:
                u = self.interstitials[m]
                segments.append(Segment("interstitial", m + 1, len(ids), len(ids) + len(u)))
                ids.extend(u)
                mask.extend([0] * len(u))
                logprobs.extend([0.0] * len(u))
        return Merged(ids, mask, logprobs, segments)


@dataclass(frozen=True)
class Join:
    interstitial: list[int]
    retokenized: bool


def _is_prefix(prefix: Sequence[int], seq: Sequence[int]) -> bool:
    n = len(prefix)
    if n > len(seq) or (n and prefix[n - 1] != seq[n - 1]):
        return False
    return seq[:n] == prefix


def join(
    prev: CaptureRecord,
    nxt: CaptureRecord,
    eot: int | None,
    decode: Decode | None,
    *,
    merge_retokenized: bool = True,
) -> Join | Break:
    """Merge ``nxt`` after ``prev`` (whose prompt is a prefix of ``nxt``'s), or say why not.

    ``merge_retokenized`` False: a re-tokenized copy of ``prev``'s turn is a break, not a merge.
    """
    tail = nxt.prompt_ids[len(prev.prompt_ids) :]
    if not tail:
        return Break(
            BreakCause.OTHER,
            f"call {nxt.seq} re-sent call {prev.seq}'s prompt unchanged (a retry or a parallel sample)",
        )
    for name in ("temperature", "top_p", "top_k", "min_p"):
        # One trace carries one set of sampling parameters.
        before, after = getattr(prev, name), getattr(nxt, name)
        if before != after:
            return Break(BreakCause.OTHER, f"sampling {name} changed from {before} to {after} at call {nxt.seq}")
    if eot is None:
        return Break(BreakCause.OTHER, "end-of-turn token unknown (no naturally stopped call); pass it explicitly")
    try:
        k = tail.index(eot)
    except ValueError:
        return Break(BreakCause.OTHER, f"no end-of-turn token in call {nxt.seq}'s prompt after call {prev.seq}'s")
    sampled = prev.response_ids
    closed = bool(sampled) and sampled[-1] == eot
    copy, interstitial = (tail[: k + 1], tail[k + 1 :]) if closed else (tail[:k], tail[k:])
    if copy == sampled:
        return Join(interstitial, retokenized=False)
    if not closed and _natural_stop(prev) and copy == sampled[:-1]:
        return Break(
            BreakCause.TEMPLATE_RERENDER,
            f"call {prev.seq} ended its turn with stop token {sampled[-1]}; the template closed it with {eot}",
        )
    brk = classify_rerendered_turn(prev, nxt, copy, decode)
    if brk is not None:
        return brk
    if not merge_retokenized:
        return Break(
            BreakCause.RETOKENIZED,
            f"call {nxt.seq}'s prompt re-tokenized call {prev.seq}'s sampled turn (same text, {len(copy)} tokens "
            f"instead of {len(sampled)}); not merged, so call {nxt.seq} keeps the context it was sampled in",
        )
    return Join(interstitial, retokenized=True)


def _new_chain(chains: list[RecordChain], record: CaptureRecord, brk: Break | None, related: int | None) -> RecordChain:
    chain = RecordChain(index=len(chains), records=[record], start=brk, related=related)
    chains.append(chain)
    return chain


def reconstruct_session(
    records: Sequence[CaptureRecord],
    *,
    eot: int | None,
    decode: Decode | None = None,
    merge_retokenized: bool = True,
) -> list[RecordChain]:
    """Split one session's usable records (in seq order) into merged chains with break causes.

    ``merge_retokenized`` False breaks a chain where the paper would merge a re-tokenized turn.
    """
    chains: list[RecordChain] = []
    by_continuation: list[tuple[RecordChain, Relation]] = []
    parsed: dict[str, Conversation] = {}
    for record in records:
        extendable = [c for c in chains if _is_prefix(c.tip.prompt_ids, record.prompt_ids)]
        if extendable:
            longest = max(len(c.tip.prompt_ids) for c in extendable)
            tied = sorted(
                (c for c in extendable if len(c.tip.prompt_ids) == longest),
                key=lambda c: c.tip.seq,
                reverse=True,
            )
            first_break: tuple[RecordChain, Break] | None = None
            for chain in tied:
                outcome = join(chain.tip, record, eot, decode, merge_retokenized=merge_retokenized)
                if isinstance(outcome, Join):
                    chain.records.append(record)
                    chain.interstitials.append(outcome.interstitial)
                    chain.retokenized += outcome.retokenized
                    break
                first_break = first_break or (chain, outcome)
            else:
                assert first_break is not None
                _new_chain(chains, record, as_compaction(record, first_break[1]), first_break[0].index)
            continue
        if not chains:
            _new_chain(chains, record, None, None)
            continue
        relation = relate_new_chain(record, [c.tip for c in chains], decode, parsed)
        chain = _new_chain(chains, record, relation.brk, relation.related)
        if relation.decide_by_continuation:
            by_continuation.append((chain, relation))

    for chain, relation in by_continuation:
        parent = chains[relation.related]  # type: ignore[index]
        later = [r.seq for r in parent.records if r.seq > chain.records[0].seq]
        if later:
            chain.start = sub_agent_break(later[0])

    # A chain's conversation moved on to the first later chain that broke from it, unless the
    # chain itself carried on afterwards (then the later one is a branch, not a continuation).
    for chain in chains:
        if chain.start is None or chain.related is None or chain.start.cause == BreakCause.SUB_AGENT:
            continue
        parent = chains[chain.related]
        if parent.end is None and parent.tip.seq < chain.records[0].seq:
            parent.end = chain.start
            parent.continued_by = chain.index
    return chains
