"""polar's mitmproxy addons, the entry point mitmproxy loads:

    mitmdump --listen-host 127.0.0.1 -s polar_addon/addon.py --set polar_engine=... --set polar_out=DIR

mitmproxy glue only, one addon per concern (polar_addon.addons): body limits, interception scope, capture (the
gateway, polar_addon.gateway, answering model calls), the control plane, and parked replies. ``addons`` below is
what mitmproxy loads; the options of each are registered in its ``load``.

Regular mode: the harness sets ``HTTPS_PROXY=http://SESSION@127.0.0.1:8080`` and trusts
mitmproxy's CA. Reverse mode (``--mode reverse:https://api.anthropic.com``): the harness's base URL
points at mitmdump; every request on a model route is ours whatever the reverse target.
"""

from __future__ import annotations

from polar_addon.addons import polar_addons

addons = polar_addons()
