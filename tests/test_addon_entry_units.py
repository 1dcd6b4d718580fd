"""The entry point mitmproxy loads (``mitmdump -s polar_addon/addon.py``) and the addon set it is made of: which addons,
in which order (mitmproxy runs each hook in list order), and the one object they share (the gateway the control plane
writes rewards through, the per-client body budget every addon draws from)."""

from __future__ import annotations

from pathlib import Path

from mitmproxy.addons import script

import polar_addon
from polar_addon.addons import BodyLimits, Capture, ControlPlaneAddon, InterceptionScope, ParkedReplies, polar_addons
from polar_addon.addons.shared import Shared

# Bodies are bounded before anyone reads them; the scope decides what is a model call before Capture answers it;
# the control plane is configured after Capture, whose store it writes; the parked replies go last, after Capture
# pointed a flow at the loopback relay in the same hook.
HOOK_ORDER = [BodyLimits, InterceptionScope, Capture, ControlPlaneAddon, ParkedReplies]


def test_the_addons_come_in_hook_order_and_share_the_object_given() -> None:
    shared = Shared()
    addons = polar_addons(shared)
    assert [type(a) for a in addons] == HOOK_ORDER
    assert all(a.shared is shared for a in addons)


def test_without_an_object_each_set_gets_its_own_fresh_one() -> None:
    first, second = polar_addons(), polar_addons(None)
    assert [type(a) for a in first] == [type(a) for a in second] == HOOK_ORDER
    (one,) = {id(a.shared) for a in first}
    (other,) = {id(a.shared) for a in second}
    assert one != other  # two proxies in one process never share a gateway or a body budget
    assert isinstance(first[0].shared, Shared) and first[0].shared.gateway is None and first[0].shared.control is None


def test_mitmproxy_loads_the_entry_script_with_one_fresh_set() -> None:
    entry = Path(polar_addon.__file__).with_name("addon.py")
    loaded = script.load_script(str(entry))
    assert loaded is not None
    assert [type(a) for a in loaded.addons] == HOOK_ORDER
    (shared,) = {id(a.shared) for a in loaded.addons}
    assert isinstance(loaded.addons[0].shared, Shared) and loaded.addons[0].shared.gateway is None
    again = script.load_script(str(entry))  # mitmproxy reloads a script it sees change: a new set, not the old one
    assert again is not None and {id(a.shared) for a in again.addons} != {shared}
