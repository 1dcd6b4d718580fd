"""The agent under training must not choose how it is sampled (polar's own attack, issue 23's "at least 10 of your
own design"). Through a rollout's proxy an agent can send any temperature, top_p, top_k, min_p or seed. One greedy
or top-p call makes `polar train` refuse the whole batch (a mixture of temperatures, greedy or truncated samples:
polar_cli.train.dataset), so a single derailed sample would stop training for every group; a fixed seed collapses a
group's samples into one (no advantage, nothing learned: the policy hides its failures from the gradient).

A fixed-sampling gateway (``polar_sampling=fixed``, what `polar rollout` starts) samples every call with its own
defaults, records those, and keeps what the client asked for only as information."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from polar_addon.capture import Identity
from polar_addon.engines import EnginePool
from polar_addon.engines.local import LocalEngine
from polar_addon.gateway import Gateway, GatewayConfig, IncomingCall
from polar_addon.store import TraceStore, read_records

MESSAGES = [{"role": "user", "content": "Say something."}]
HOSTILE = [
    {"temperature": 0},
    {"temperature": 0.05, "top_p": 0.3},
    {"top_k": 1},
    {"seed": 7, "temperature": 1.7},
]


def _call(session: str, api: str, **sampling) -> IncomingCall:
    if api == "anthropic":
        body = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES, **sampling}
        path = "/v1/messages"
    else:
        body = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES, **sampling}
        path = "/v1/chat/completions"
    return IncomingCall(method="POST", path=path, headers={}, body=orjson.dumps(body),
                        identity=Identity(session_id=session, source="header"))


def _capture(model: Path, out: Path, fixed: bool, api: str) -> list:
    async def main() -> None:
        gateway = Gateway(EnginePool([LocalEngine(str(model))]), TraceStore(str(out)), GatewayConfig(sampling_fixed=fixed))
        for i, sampling in enumerate(HOSTILE):
            if api == "anthropic":
                sampling = {k: v for k, v in sampling.items() if k != "seed"}  # no seed in Anthropic's API
            assert (await gateway.handle(_call(f"s-{i}", api, **sampling))).status == 200
        await gateway.close()

    asyncio.run(main())
    return sorted(read_records(str(out)), key=lambda r: r.session_id)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_fixed_sampling_proxy_samples_every_call_with_its_own_parameters(tiny_model_dir: Path, tmp_path: Path,
                                                                           api: str) -> None:
    records = _capture(tiny_model_dir, tmp_path / "fixed", fixed=True, api=api)
    assert len(records) == len(HOSTILE)
    assert {(r.temperature, r.top_p, r.top_k, r.min_p) for r in records} == {(1.0, 1.0, 0, 0.0)}
    # Control: the same calls through a client-sampling proxy (plain capture) keep what the client asked, which is
    # what `polar train` refuses (greedy, truncated, mixed): the probe would have fired.
    honoured = _capture(tiny_model_dir, tmp_path / "client", fixed=False, api=api)
    assert {r.temperature for r in honoured} >= {0.0, 1.7}
    assert any(r.top_p == 0.3 or r.top_k == 1 for r in honoured)
