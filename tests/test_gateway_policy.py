"""Traffic policy and small gateway contracts: passthrough vs block, body limits, and a deterministic
tiny model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from polar_cli.tiny_model import build_tiny_model
from tests.support.proxy import echo_server, run_mitmdump


@pytest.fixture()
def echo_url():
    with echo_server() as port:
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("block", [False, True])
def test_other_traffic_passes_through_unless_blocked(tiny_model_dir, tmp_path, echo_url, block):
    options = {"polar_block_other": str(block).lower()}
    with run_mitmdump(f"local:{tiny_model_dir}", tmp_path / "shards", options=options) as proxy:
        with httpx.Client(proxy=proxy.url) as client:
            # Even a model-looking path on a host that is not a provider is not ours.
            r = client.post(echo_url + "/v1/chat/completions", content=b"untouched bytes")
    if block:
        assert r.status_code == 403 and b"blocked" in r.content
    else:
        assert r.status_code == 200 and r.content == b"echo:untouched bytes"


def test_oversized_body_is_a_provider_shaped_413(tiny_model_dir, tmp_path):
    with run_mitmdump(
        f"local:{tiny_model_dir}",
        tmp_path / "shards",
        mode="reverse:https://api.anthropic.com",
        options={"polar_max_body_mb": "1"},
    ) as proxy:
        big = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        r = httpx.post(proxy.url + "/v1/messages", json=big, headers={"x-api-key": "polar:big"}, timeout=60)
    assert r.status_code == 413
    assert r.json()["type"] == "error" and "exceeds" in r.json()["error"]["message"]


def test_tiny_model_is_deterministic(tmp_path: Path):
    def digest(directory: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}

    a = digest(build_tiny_model(tmp_path / "a", seed=3))
    b = digest(build_tiny_model(tmp_path / "b", seed=3))
    c = digest(build_tiny_model(tmp_path / "c", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]


@pytest.mark.parametrize(
    "change",
    [
        {"polar_engine": "vllm:http://127.0.0.1:10"},
        {"polar_out": "other-shards"},
        {"polar_engine_timeout": "30"},
        {"polar_shard_records": 7},
    ],
)
def test_engine_and_output_options_cannot_change_while_running(tmp_path, change):
    """Only the per-call settings apply live; a new engine or output needs a restart (what was
    captured so far must not silently move to another store or engine)."""
    import asyncio

    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    from polar_addon.addons import Capture, polar_addons

    async def main() -> None:
        addons = polar_addons()
        (addon,) = [a for a in addons if isinstance(a, Capture)]
        with taddons.context(*addons) as tctx:
            # An HTTP engine: nothing is loaded or contacted at configure time.
            tctx.configure(addon, polar_engine="vllm:http://127.0.0.1:9", polar_out=str(tmp_path / "out"))
            gateway = addon.gateway
            assert gateway is not None and gateway.config.keepalive_s == 5.0
            tctx.configure(addon, polar_keepalive="0.5", polar_max_tokens=64)
            assert addon.gateway is gateway
            assert (gateway.config.keepalive_s, gateway.config.max_tokens_cap) == (0.5, 64)
            with pytest.raises(exceptions.OptionsError, match="cannot change while running"):
                tctx.configure(addon, **change)
            assert addon.gateway is gateway
            with pytest.raises(exceptions.OptionsError, match="polar_keepalive must be positive"):
                tctx.configure(addon, polar_keepalive="0")
            await gateway.close()

    asyncio.run(main())
