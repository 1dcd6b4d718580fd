"""polar's mitmproxy addons, one per concern, in the order their hooks must run:

- :class:`BodyLimits` (polar_max_body_mb, polar_client_inflight_mb, polar_body_timeout): bounds every body polar
  reads, and puts a counted flow back as its client sent it before anyone looks at it;
- :class:`InterceptionScope` (polar_hosts, polar_block_other): which flows are model calls; the rest passes
  through or is refused;
- :class:`Capture` (polar_engine, polar_out, sampling, token continuity, shards): the gateway, answering model calls;
- :class:`ControlPlaneAddon` (polar_sessions, polar_control_token): rewards, statuses and registrations; configured
  after Capture, whose store it writes to;
- :class:`ParkedReplies`: last, hands the answer of a flow already pointed at the loopback relay to the client.

They share one :class:`Shared` object (gateway, control plane, body budget, loopback servers).
"""

from __future__ import annotations

from polar_addon.addons.body_limits import BodyLimits
from polar_addon.addons.capture import Capture
from polar_addon.addons.control_plane import ControlPlaneAddon
from polar_addon.addons.replies import ParkedReplies
from polar_addon.addons.scope import InterceptionScope
from polar_addon.addons.shared import Shared

__all__ = [
    "BodyLimits",
    "Capture",
    "ControlPlaneAddon",
    "InterceptionScope",
    "ParkedReplies",
    "Shared",
    "polar_addons",
]


def polar_addons(shared: Shared | None = None) -> list[object]:
    """A fresh set of polar's addons sharing ``shared`` (a new one by default), in hook order."""
    shared = shared or Shared()
    return [
        BodyLimits(shared),
        InterceptionScope(shared),
        Capture(shared),
        ControlPlaneAddon(shared),
        ParkedReplies(shared),
    ]
