"""The addon's options are its interface (``--set polar_...``, the docs generated from ``addons``): splitting it into
one addon per concern must not rename, drop or re-default any of them."""

from __future__ import annotations

from mitmproxy.test import taddons

from polar_addon.addon import addons
from polar_addon.addons import BodyLimits, Capture, ControlPlaneAddon, InterceptionScope, ParkedReplies

OPTIONS = {
    "polar_block_other": False,
    "polar_body_timeout": "60",
    "polar_client_inflight_mb": 256,
    "polar_control_token": "",
    "polar_durability": "fsync",
    "polar_engine": "",
    "polar_engine_timeout": "900",
    "polar_hosts": [],
    "polar_keepalive": "5",
    "polar_max_body_mb": 16,
    "polar_max_tokens": 0,
    "polar_min_p": "0.0",
    "polar_out": "shards",
    "polar_sampling": "client",
    "polar_sessions": "claimed",
    "polar_shard_records": 512,
    "polar_shard_seconds": "30",
    "polar_temperature": "1.0",
    "polar_tito": "auto",
    "polar_tokenizer": "",
    "polar_tool_parser": "hermes",
    "polar_top_k": 0,
    "polar_top_p": "1.0",
}
CHOICES = {
    "polar_durability": ["fsync", "write"],
    "polar_sampling": ["client", "fixed"],
    "polar_sessions": ["claimed", "registered"],
}


def test_the_entry_points_addons_register_exactly_the_polar_options_with_their_defaults() -> None:
    with taddons.context(*addons) as tctx:
        options = {name: o for name, o in tctx.options._options.items() if name.startswith("polar_")}
        assert {name: o.default for name, o in options.items()} == OPTIONS
        assert {name: list(o.choices) for name, o in options.items() if o.choices} == CHOICES
        assert all(o.help.strip() for o in options.values())


def test_one_addon_per_concern_in_hook_order_sharing_one_object() -> None:
    assert [type(a) for a in addons] == [BodyLimits, InterceptionScope, Capture, ControlPlaneAddon, ParkedReplies]
    assert len({id(a.shared) for a in addons}) == 1
