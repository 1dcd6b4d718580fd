"""How a session ended: one vocabulary for the store and the rollout runner.

The store records ``running`` (calls arrived, no end posted yet), ``completed``, ``timeout``, ``error`` and
``agent_error``. The runner's results (``SessionResult.status``, ``rollout-summary.json``) say ``completed``,
``failed``, ``timeout``, ``error`` and ``cancelled``; what it posts is each one's :attr:`SessionStatus.stored` (the
store names a failed harness ``agent_error`` and has no ``cancelled``: a cancelled session is posted as ``error``
with ``metadata.cancelled``, its trace being partial). Members are strings (``SessionStatus.FAILED == "failed"``),
so rows, JSON and comparisons with the stored strings stay as they were.
"""

from __future__ import annotations

from enum import StrEnum


class SessionStatus(StrEnum):
    RUNNING = "running"  # the store's only: no end posted yet
    COMPLETED = "completed"
    FAILED = "failed"  # the runner's name of the store's agent_error
    AGENT_ERROR = "agent_error"  # the store's only
    TIMEOUT = "timeout"
    ERROR = "error"
    CANCELLED = "cancelled"  # the runner's only (early stop, an interruption)

    @property
    def stored(self) -> SessionStatus:
        """What the store records for a session that ended so (its own statuses map to themselves)."""
        return _STORED_AS.get(self, self)

    @property
    def usable(self) -> bool:
        """A trainer learns from the session (with reward 0 for the policy's failures)."""
        return self in USABLE

    @property
    def rewarded(self) -> bool:
        """The runner knows the session's reward (``failed``: 0)."""
        return self in REWARDED

    @property
    def masked(self) -> bool:
        """Kept out of training: infrastructure, or cut short by the runner."""
        return self in MASKED


_STORED_AS = {SessionStatus.FAILED: SessionStatus.AGENT_ERROR, SessionStatus.CANCELLED: SessionStatus.ERROR}

# The runner's statuses, in the order a summary counts them.
RUNNER_STATUSES: tuple[SessionStatus, ...] = (
    SessionStatus.COMPLETED,
    SessionStatus.FAILED,
    SessionStatus.TIMEOUT,
    SessionStatus.ERROR,
    SessionStatus.CANCELLED,
)
# The store's statuses, in the order its errors list them.
STORED_STATUSES: tuple[SessionStatus, ...] = (
    SessionStatus.RUNNING,
    SessionStatus.COMPLETED,
    SessionStatus.TIMEOUT,
    SessionStatus.ERROR,
    SessionStatus.AGENT_ERROR,
)
USABLE = frozenset({SessionStatus.COMPLETED, SessionStatus.FAILED, SessionStatus.TIMEOUT})
REWARDED = frozenset({SessionStatus.COMPLETED, SessionStatus.FAILED})
MASKED = frozenset({SessionStatus.ERROR, SessionStatus.CANCELLED})
# What a trainer never trains, read from the store: infrastructure (the runner's cancels included) and sessions
# that never ended.
STORE_MASKED = frozenset({SessionStatus.ERROR, SessionStatus.RUNNING})
