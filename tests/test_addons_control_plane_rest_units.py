"""Issue 29: what the control plane's option help texts state as fact (shown by ``mitmdump --options`` and the
generated reference) stays true of the plane: where a generated token goes and its mode, the session modes each
explained under their own names, the claim syntax and the registration route they name. Each fact is read out of the
help and checked against the behaviour, never the whole text against a literal."""

from __future__ import annotations

import asyncio
import os
import re
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
from mitmproxy import http
from mitmproxy.test import taddons, tflow, tutils

from polar_addon import identity
from polar_addon.addons import ControlPlaneAddon, Shared
from polar_addon.control import ControlPlane

TOKEN = "k" * 24


class _CaptureOptions:
    """The capture addon's options the control plane reads."""

    def load(self, loader) -> None:
        loader.add_option("polar_out", str, "shards", "Where shards go.")
        loader.add_option("polar_sampling", str, "client", "Whose sampling.")


def _help(name: str) -> str:
    with taddons.context(_CaptureOptions(), ControlPlaneAddon(Shared())) as tctx:
        return tctx.options._options[name].help


def test_the_token_help_states_where_the_generated_token_goes_and_its_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    addon = ControlPlaneAddon(Shared(gateway=SimpleNamespace(store=None, pool=SimpleNamespace(release=print))))
    with taddons.context(_CaptureOptions(), addon) as tctx:
        tctx.configure(addon, polar_out=str(out))
        (generated,) = [p for p in out.iterdir() if p.read_text().strip() == addon.shared.control.token]
        mode = stat.S_IMODE(os.stat(generated).st_mode)
    where = f"<polar_out>/{generated.relative_to(out)}"
    assert f"(default: generated into {where}, mode {mode:04o})" in _help("polar_control_token")


def test_the_sessions_help_explains_each_mode_under_its_own_name() -> None:
    text = _help("polar_sessions")
    with taddons.context(_CaptureOptions(), ControlPlaneAddon(Shared())) as tctx:
        modes = tctx.options._options["polar_sessions"].choices
    assert modes == identity.SESSION_MODES
    # Each mode introduced by its exact (case-sensitive) option value: `--set polar_sessions=<that>`.
    assert [m for m in modes if re.search(rf"(^|[\s.]){re.escape(m)}: ", text)] == list(modes)


def test_the_claims_the_sessions_help_names_are_the_ones_read() -> None:
    text = _help("polar_sessions")
    (key_claim,) = re.findall(r"(\S+=)\.\.\.", text)  # the API-key claim, e.g. polar:session=...
    claimed = identity.from_headers({"authorization": f"Bearer {key_claim}s1"})
    assert claimed is not None and claimed.session_id == "s1" and claimed.source == "api_key"
    (header_prefix,) = re.findall(r"(\S+)\* headers", text)  # header names are case-insensitive on the wire
    claimed = identity.from_headers({f"{header_prefix.lower()}session": "s2"})
    assert claimed is not None and claimed.session_id == "s2" and claimed.source == "header"


class _Store:
    async def add_reward(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("no reward in this test")


def test_the_registration_route_the_sessions_help_names_registers_a_session() -> None:
    # The route as written (a path and a method are case-sensitive), its session id a placeholder.
    ((method, route),) = re.findall(r"\((\S+) (/\S+) (?i:with the control token)\)", _help("polar_sessions"))
    path = re.sub(r"/id/", "/s9/", route, flags=re.IGNORECASE)
    shared = Shared(control=ControlPlane(_Store(), TOKEN))  # type: ignore[arg-type]
    request = tutils.treq(
        host="polar.local",
        port=443,
        method=method.encode(),
        scheme=b"https",
        path=path.encode(),
        headers=http.Headers([(b"authorization", f"Bearer {TOKEN}".encode())]),
        content=b'{"task": "t1"}',
    )
    flow = tflow.tflow(req=request)
    asyncio.run(ControlPlaneAddon(shared).request(flow))
    assert flow.response is not None and flow.response.status_code == 200
    answer = orjson.loads(flow.response.content)
    assert answer["session_id"] == "s9" and answer["secret"]
