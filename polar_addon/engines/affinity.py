"""Which engine serves which session: sticky assignment, and engines that fail taken out.

Plain bookkeeping over engine indices (no I/O; the clock is passed in), so the rules are tested directly:

- A session's first call goes to the live engine with the fewest sessions (the lowest index on a tie); every
  later call of the session goes to the same engine. Its prefix cache stays warm, and its tokens stay one
  engine's (one set of weights, later its continuity state).
- An engine is taken out at once when nothing listens at its address (connection refused), or after
  ``max_strikes`` faults in a row (unreachable, HTTP 5xx other than busy). Its sessions are lost: each later
  call of theirs is refused, never moved to another engine mid-session. New sessions go to the live engines.
- A taken-out engine takes new sessions again ``revive_after_s`` later, on probation: one fault takes it out
  again (an engine restarted by ``polar engine reload``, or brought back by its operator, rejoins).
- A pool of one engine takes nothing out: there is nowhere else for a session to go, and an engine restart
  is an outage its calls ride out (they fail until it is back), as before there were pools.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# A session forgotten here (idle while this many others started) only loses its engine affinity.
MAX_SESSIONS = 100_000
MAX_STRIKES = 3
REVIVE_AFTER_S = 60.0


class SessionLost(Exception):
    """The session's engine was taken out: the session cannot go on (it is never moved mid-session)."""

    def __init__(self, engine: int) -> None:
        super().__init__(engine)
        self.engine = engine


class NoLiveEngine(Exception):
    """Every engine is taken out and none is due back yet."""


@dataclass
class _Engine:
    sessions: int = 0
    strikes: int = 0
    out_since: float | None = None  # when it was taken out; None while live


class Affinity:
    def __init__(
        self,
        engines: int,
        *,
        max_strikes: int = MAX_STRIKES,
        revive_after_s: float = REVIVE_AFTER_S,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        if engines < 1:
            raise ValueError("at least one engine is required")
        if max_strikes < 1:
            raise ValueError("max_strikes must be at least 1")
        self.max_strikes = max_strikes
        self.revive_after_s = revive_after_s
        self.max_sessions = max_sessions
        self._engines = [_Engine() for _ in range(engines)]
        # Most recently used last; sessions are released when they end, or forgotten oldest first.
        self._by_session: OrderedDict[str, int] = OrderedDict()
        self._lost: OrderedDict[str, int] = OrderedDict()  # session -> the engine taken out under it

    def engine_for(self, session: str, now: float) -> int:
        """The engine index serving ``session``; a new session is assigned one. Raises SessionLost, NoLiveEngine."""
        index = self._by_session.get(session)
        if index is not None:
            self._by_session.move_to_end(session)
            return index
        lost = self._lost.get(session)
        if lost is not None:
            raise SessionLost(lost)
        ready = [
            i for i, e in enumerate(self._engines) if e.out_since is None or now - e.out_since >= self.revive_after_s
        ]
        if not ready:
            raise NoLiveEngine()
        index = min(ready, key=lambda i: (self._engines[i].sessions, i))
        engine = self._engines[index]
        if engine.out_since is not None:
            engine.out_since, engine.strikes = None, self.max_strikes - 1  # on probation: one fault and it is out
        engine.sessions += 1
        self._by_session[session] = index
        while len(self._by_session) > self.max_sessions:
            self.release(next(iter(self._by_session)))
        return index

    def succeeded(self, index: int) -> None:
        self._engines[index].strikes = 0

    def failed(self, index: int, now: float, *, refused: bool = False) -> list[str] | None:
        """Count a fault of engine ``index``: None while it stays in, the sessions lost when this takes it out."""
        engine = self._engines[index]
        if engine.out_since is not None or len(self._engines) == 1:
            return None
        engine.strikes = self.max_strikes if refused else engine.strikes + 1
        if engine.strikes < self.max_strikes:
            return None
        engine.out_since, engine.sessions = now, 0
        lost = [s for s, i in self._by_session.items() if i == index]
        for session in lost:
            del self._by_session[session]
            self._lost[session] = index
        while len(self._lost) > self.max_sessions:
            self._lost.popitem(last=False)
        return lost

    def release(self, session: str) -> None:
        """The session ended: its slot is free (a lost session is forgotten)."""
        index = self._by_session.pop(session, None)
        if index is not None:
            self._engines[index].sessions -= 1
        self._lost.pop(session, None)

    def is_out(self, index: int) -> bool:
        return self._engines[index].out_since is not None

    def load(self) -> list[int]:
        """Sessions per engine."""
        return [e.sessions for e in self._engines]

    def __len__(self) -> int:
        return len(self._by_session)
