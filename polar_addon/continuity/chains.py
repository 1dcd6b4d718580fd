"""Token-in/token-out across turns ("TITO"): what each session's engine prompt was, so its next prompt
can be that prompt + the sampled ids + only the new messages' tokens (polar_addon.continuity.delta).

Plain bookkeeping, no I/O: the gateway remembers a :class:`ChainTip` after every ok call and asks
:func:`plan_prompt` for the next call's prompt. A session keeps a few chains (a harness interleaves
side calls, e.g. Claude Code's title and quota calls with their own system prompt, which must not end
the main chain). Memory is bounded (least recently used sessions are forgotten): a forgotten session,
like every session after a proxy restart, gets a full render and a new chain, never a wrong prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from polar_addon.canonical import AssistantMessage, CanonicalRequest
from polar_addon.continuity.check import Continues, check_continuity, plain_history
from polar_addon.continuity.delta import DeltaPrompt, NoDelta
from polar_addon.engines import Engine, TokenInputEngine, takes_token_input

MAX_SESSIONS = 10_000
CHAINS_PER_SESSION = 4

CONTINUITY = "continuity"
FRESH = "fresh"
# prompt_reason of a fresh call that had nothing to continue.
FIRST_CALL = "first_call"
STATE_LOST = "state_lost"  # the history holds assistant turns this proxy has no tokens of (restart, eviction)
TITO_OFF = "tito_off"
NO_TOKEN_INPUT = "no_token_input"  # the engine takes no token prompt (polar_tito=auto)
NO_DELTA = "no_delta"

# Computes the continuation prompt with the engine's tokenizer and template (Engine.continuation).
Continuation = Callable[..., DeltaPrompt | NoDelta]


@dataclass(frozen=True)
class ChainTip:
    """The last call of a session's token chain, all the proxy keeps of it: the request as sent on, what polar
    returned, and its exact tokens (a build reconstructs whole chains from the store: build.prefix_merging)."""

    request: CanonicalRequest
    returned: AssistantMessage
    prompt_ids: Sequence[int]
    sampled_ids: Sequence[int]
    finish_reason: str
    engine: str
    matched_stop: str | None = None  # the stop string that ended the turn: its text never reached the harness

    @cached_property
    def history_plain(self) -> bool:
        """check.plain_history of the request's messages, found once for every later call it is checked against."""
        return plain_history(self.request.messages)


@dataclass(frozen=True)
class PromptPlan:
    prompt_ids: list[int] | None  # None: the engine renders the request in full
    source: str  # CONTINUITY | FRESH
    reason: str  # why fresh (a DivergeReason, NO_DELTA: ..., FIRST_CALL, ...); "continues" otherwise
    continued: ChainTip | None = None  # the chain this call continues


def _has_assistant_turn(request: CanonicalRequest) -> bool:
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in request.messages)


def judge(chains: Sequence[ChainTip], request: CanonicalRequest, engine: str) -> list[Continues | str]:
    """Per chain (newest first): the :class:`Continues` verdict when ``request`` continues it, else why not.
    Plain comparisons, cheap enough for the event loop; only a continuation needs the tokenizer."""
    verdicts: list[Continues | str] = []
    for chain in chains:
        if chain.engine != engine:
            verdicts.append("engine_changed")
            continue
        verdict = check_continuity(chain.request, chain.returned, request, previous_plain=chain.history_plain)
        verdicts.append(verdict if isinstance(verdict, Continues) else verdict.reason.value)
    return verdicts


def plan_prompt(
    chains: Sequence[ChainTip],
    request: CanonicalRequest,
    engine: str,
    continuation: Continuation,
    verdicts: Sequence[Continues | str] | None = None,
) -> PromptPlan:
    """The prompt of ``request``: a continuation of the newest chain it continues, else a fresh render and why.

    ``chains`` newest first; ``verdicts``: :func:`judge`'s of them, when the caller already has them. The reason of
    a fresh call is the newest chain's: that is the one a linear session continues.
    """
    if not chains:
        return PromptPlan(None, FRESH, STATE_LOST if _has_assistant_turn(request) else FIRST_CALL)
    if verdicts is None:
        verdicts = judge(chains, request, engine)
    reason: str | None = None
    for chain, verdict in zip(chains, verdicts):
        if isinstance(verdict, Continues):
            at = len(chain.request.messages)
            delta = continuation(
                prompt_ids=chain.prompt_ids,
                sampled_ids=chain.sampled_ids,
                history=request.messages[: at + 1],
                new_messages=verdict.new_messages,
                tools=request.tools,
                enable_thinking=request.enable_thinking,
                # A turn cut by length or ended by another stop token continues, closed by the template.
                finish_reason=chain.finish_reason,
                matched_stop=chain.matched_stop,
            )
            if isinstance(delta, DeltaPrompt):
                return PromptPlan(delta.prompt_ids, CONTINUITY, "continues", chain)
            found = f"{NO_DELTA}: {delta.reason}"
        else:
            found = verdict
        reason = reason or found
    return PromptPlan(None, FRESH, reason or FIRST_CALL)


class TitoStore:
    """Chains per session, bounded; most recently used session last."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, chains_per_session: int = CHAINS_PER_SESSION) -> None:
        self.max_sessions = max_sessions
        self.chains_per_session = chains_per_session
        self._sessions: OrderedDict[str, list[ChainTip]] = OrderedDict()

    def chains(self, session: str) -> list[ChainTip]:
        """Newest first."""
        chains = self._sessions.get(session)
        if chains is None:
            return []
        self._sessions.move_to_end(session)
        return list(chains)

    def remember(self, session: str, chain: ChainTip, *, replaces: ChainTip | None = None) -> None:
        """``chain`` as the newest of ``session``; it replaces the chain it continued."""
        chains = [c for c in self._sessions.pop(session, []) if c is not replaces]
        chains.insert(0, chain)
        self._sessions[session] = chains[: self.chains_per_session]
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def forget(self, session: str) -> None:
        self._sessions.pop(session, None)

    def __len__(self) -> int:
        return len(self._sessions)


def tito_mode(value: str) -> str:
    """``polar_tito``: auto (on for engines that take token input), on (the same, and say so for those that
    cannot), off."""
    mode = value.strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"polar_tito must be auto, on or off, not {value!r}")
    return mode


def token_input_engine(engine: Engine, mode: str) -> TokenInputEngine | None:
    """The tito gate, the one place it is decided: ``engine`` as a token-input engine when continuity applies to
    its calls (it takes token input and ``polar_tito`` is not off), else None (every call rendered in full, no
    chain remembered)."""
    if mode == "off" or not takes_token_input(engine):
        return None
    return engine
