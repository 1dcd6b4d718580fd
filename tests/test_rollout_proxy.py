"""The rollout's own proxy is the sandboxes' only way out: it answers model calls and the verifier's control posts,
and refuses everything else (a proxy-only sandbox could otherwise reach any host through its pass-through)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import httpx

from polar_cli.rollout.proxy import start_proxy


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
