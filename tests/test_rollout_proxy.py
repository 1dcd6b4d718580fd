"""The rollout's own proxy is the sandboxes' only way out: it answers model calls and the verifier's control posts,
and refuses everything else (a proxy-only sandbox could otherwise reach any host through its pass-through)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from polar_cli.rollout.proxy import ControlError, ExternalProxy, proxy_sessions_mode, start_proxy
from tests.support.proxy import SharedProxy, shared_proxy


def test_the_rollouts_proxy_refuses_non_model_traffic_but_serves_models_and_control(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [{"content": "hi"}]}))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    reached: list[bool] = []
    threading.Thread(target=lambda: (listener.accept(), reached.append(True)), daemon=True).start()
    with start_proxy(
        f"scripted:{script}", str(tmp_path / "store"), confdir=tmp_path / "conf", log_dir=tmp_path
    ) as proxy:
        forward = f"http://127.0.0.1:{proxy.endpoints.forward_port}"
        with httpx.Client(proxy=forward, timeout=60) as client:
            other = client.get(f"http://127.0.0.1:{listener.getsockname()[1]}/")
            assert other.status_code == 403 and b"polar_block_other" in other.content
            registered = client.post(
                "http://polar.local/sessions/s1/register",
                json={"task": "t", "group": "t", "sample": 0},
                headers={"authorization": f"Bearer {proxy.control_token}"},
            )
            assert registered.status_code == 200, registered.text
            secret = registered.json()["secret"]
            model = client.post(
                "http://api.openai.com/v1/chat/completions",
                headers={"authorization": f"Bearer polar:{secret}"},
                json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
            )
            assert model.status_code == 200, model.text
            # A claimed identity is refused: the rollout's proxy takes sessions from registrations only.
            claimed = client.post(
                "http://api.openai.com/v1/chat/completions",
                headers={"authorization": "Bearer polar:s1"},
                json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
            )
            assert claimed.status_code == 403, claimed.text
            control = client.post(
                "http://polar.local/sessions/s1/reward",
                json={"value": 1.0},
                headers={"authorization": f"Bearer {proxy.control_token}"},
            )
            assert control.status_code == 200, control.text
    listener.close()
    assert not reached


def _sampling_of(forward: int, token: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get("http://polar.local/sessions", proxy=f"http://127.0.0.1:{forward}", headers=headers, timeout=60)


def test_rollout_refuses_a_proxy_that_lets_the_policy_choose_its_sampling_unless_trusted(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`polar rollout --proxy` on a registered, closed proxy left at polar_sampling=client (`polar proxy`'s
    default): the harness would choose its own temperature. The proxy says its mode on the control plane (with the
    token only); the rollout refuses it before any session, naming the fix, unless the agents are trusted."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "hi"}]}))
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "instruction": "x", "verify": "true"}) + "\n")
    closed = {"polar_sessions": "registered", "polar_block_other": "true"}
    with (
        shared_proxy(script, tmp_path / "client-shards", closed) as client_mode,
        shared_proxy(script, tmp_path / "fixed-shards", {**closed, "polar_sampling": "fixed"}) as fixed_mode,
    ):
        assert _sampling_of(client_mode.forward, None).status_code == 401
        assert _sampling_of(client_mode.forward, "x" * 32).status_code == 401
        said = _sampling_of(client_mode.forward, client_mode.control_token)
        assert said.json() == {"ok": True, "sessions": "registered", "sampling": "client"}, said.text
        assert _sampling_of(fixed_mode.forward, fixed_mode.control_token).json()["sampling"] == "fixed"

        def external(proxy: SharedProxy, trusted: bool = False) -> ExternalProxy:
            forward, reverse = f"http://127.0.0.1:{proxy.forward}", f"http://127.0.0.1:{proxy.reverse}"
            return ExternalProxy(forward, proxy.control_token, reverse, proxy.ca, trust_claimed=trusted)

        with pytest.raises(ControlError, match=r"runs polar_sampling=client.*--set polar_sampling=fixed"):
            proxy_sessions_mode(external(client_mode))
        capsys.readouterr()
        assert proxy_sessions_mode(external(client_mode, trusted=True)) == "registered"
        assert "WARNING" in capsys.readouterr().err
        assert proxy_sessions_mode(external(fixed_mode)) == "registered"
        assert capsys.readouterr().err == ""

        if not (shutil.which("bwrap") and shutil.which("socat")):
            pytest.skip("bubblewrap/socat missing (make sandbox): the CLI refusal is not run")
        refused = subprocess.run(
            [sys.executable, "-m", "polar_cli.app", "rollout", "tasks.jsonl", "--harness", "cmd:true",
             "--runtime", "bwrap", "--network", "proxy-only", "--proxy", f"http://127.0.0.1:{client_mode.forward}",
             "--reverse-url", f"http://127.0.0.1:{client_mode.reverse}", "--control-token", client_mode.control_token,
             "--confdir", str(client_mode.ca.parent), "--report-dir", "report", "--no-progress"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "polar_sampling=client" in refused.stderr and "--set polar_sampling=fixed" in refused.stderr
    assert not (tmp_path / "report" / "rollout-summary.json").exists()
    assert [p for p in (tmp_path / "client-shards").rglob("*.parquet")] == []
