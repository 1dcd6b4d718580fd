"""The agent under training must not choose how it is sampled (polar's own attack, issue 23's "at least 10 of your
own design"). Through a rollout's proxy an agent can send any temperature, top_p, top_k, min_p or seed. One greedy
or top-p call makes `polar train` refuse the whole batch (a mixture of temperatures, greedy or truncated samples:
polar_cli.train.dataset), so a single derailed sample would stop training for every group; a fixed seed collapses a
group's samples into one (no advantage, nothing learned: the policy hides its failures from the gradient).

A fixed-sampling gateway (``polar_sampling=fixed``, what `polar rollout` starts) samples every call with its own
defaults, records those, and keeps what the client asked for only as information."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from polar_addon.capture import Identity
from polar_addon.engines import EnginePool
from polar_addon.engines.local import LocalEngine
from polar_addon.gateway import Gateway, GatewayConfig, IncomingCall
from polar_addon.store import TraceStore, read_records
from polar_cli.build.output import read_traces
from polar_cli.train.dataset import check_untruncated, resolve_temperature

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
    return IncomingCall(
        method="POST",
        path=path,
        headers={},
        body=orjson.dumps(body),
        identity=Identity(session_id=session, source="header"),
    )


def _capture(model: Path, out: Path, fixed: bool, api: str) -> list:
    async def main() -> None:
        gateway = Gateway(
            EnginePool([LocalEngine(str(model))]), TraceStore(str(out)), GatewayConfig(sampling_fixed=fixed)
        )
        for i, sampling in enumerate(HOSTILE):
            if api == "anthropic":
                sampling = {k: v for k, v in sampling.items() if k != "seed"}  # no seed in Anthropic's API
            assert (await gateway.handle(_call(f"s-{i}", api, **sampling))).status == 200
        await gateway.close()

    asyncio.run(main())
    return sorted(read_records(str(out)), key=lambda r: r.session_id)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_fixed_sampling_proxy_samples_every_call_with_its_own_parameters(
    tiny_model_dir: Path, tmp_path: Path, api: str
) -> None:
    records = _capture(tiny_model_dir, tmp_path / "fixed", fixed=True, api=api)
    assert len(records) == len(HOSTILE)
    assert {(r.temperature, r.top_p, r.top_k, r.min_p) for r in records} == {(1.0, 1.0, 0, 0.0)}
    # Control: the same calls through a client-sampling proxy (plain capture) keep what the client asked, which is
    # what `polar train` refuses (greedy, truncated, mixed): the probe would have fired.
    honoured = _capture(tiny_model_dir, tmp_path / "client", fixed=False, api=api)
    assert {r.temperature for r in honoured} >= {0.0, 1.7}
    assert any(r.top_p == 0.3 or r.top_k == 1 for r in honoured)


ATTACK = (
    r"""
for params in '"temperature": 0' '"temperature": 0.05, "top_p": 0.3' '"top_k": 1, "seed": 7' '"temperature": 1.7'; do
  curl -s --max-time 60 -H "Authorization: Bearer $OPENAI_API_KEY" -H 'content-type: application/json' \
    -d "{\"model\": \"policy\", \"max_tokens\": 4, $params, """
    r"""\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}" \
    "$OPENAI_BASE_URL/chat/completions" > /dev/null
done
echo sent
"""
)


@pytest.mark.skipif(
    not (shutil.which("bwrap") and shutil.which("socat") and shutil.which("curl")),
    reason="bubblewrap/socat/curl missing (make sandbox)",
)
def test_a_rollouts_agent_cannot_choose_its_sampling_and_training_takes_its_traces(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "attack.sh").write_text(ATTACK)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "instruction": "x", "verify": "true"}) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "rollout", "tasks.jsonl",
         "--harness", f"cmd:sh {tmp_path / 'attack.sh'}",
         "--runtime", "bwrap", "--engine", f"local:{tiny_model_dir}", "--out", "store", "--seed", "2",
         "--confdir", str(tmp_path / "conf"), "--set", "polar_shard_seconds=0.2", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    records = read_records(str(tmp_path / "store"))
    assert len(records) == 4
    assert {(r.temperature, r.top_p, r.top_k, r.min_p) for r in records} == {(1.0, 1.0, 0, 0.0)}
    built = tmp_path / "built"
    assert (
        subprocess.run(
            [sys.executable, "-m", "polar_cli.app", "build", "store", "--out", str(built)],
            cwd=tmp_path,
            capture_output=True,
            timeout=300,
        ).returncode
        == 0
    )
    traces = read_traces(built)
    check_untruncated(traces)  # `polar train`'s refusals: none fires
    assert resolve_temperature(traces, None) == 1.0
