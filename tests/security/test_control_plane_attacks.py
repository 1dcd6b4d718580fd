"""The agent tries to post its own reward (issue 23's "blocked today, and must stay so"): every route to the proxy's
control plane without the control token, and every place the token could be found, tried by an attacker script in
the agent's place in a real `polar rollout --runtime bwrap` (proxy-only), on the scripted engine. The task's verifier
always scores 0, so any reward above 0 in the store is a reward the agent gave itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ATTACK = r"""
rev="${OPENAI_BASE_URL%/v1}"
sid="$POLAR_SESSION"
sib="${sid%-*}-1"
body='{"value": 1.0}'
# One honest model call first, so the session has a trace whose reward the attacks below try to raise.
curl -s --max-time 60 -H "Authorization: Bearer $OPENAI_API_KEY" -H 'content-type: application/json' \
  -d '{"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}' "$rev/v1/chat/completions"
echo
try() {  # name, curl args...: print the HTTP code (000: no connection)
  name="$1"; shift
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$@")
  echo "ROUTE $name $code"
}
try forward-plain -x "$HTTPS_PROXY" -d "$body" "http://polar.local/sessions/$sid/reward"
try forward-session-key -x "$HTTPS_PROXY" -H "Authorization: Bearer $OPENAI_API_KEY" -d "$body" "http://polar.local/sessions/$sid/reward"
try forward-tls -x "$HTTPS_PROXY" --cacert "$SSL_CERT_FILE" -d "$body" "https://polar.local/sessions/$sid/reward"
try provider-host -x "$HTTPS_PROXY" --cacert "$SSL_CERT_FILE" -H "Authorization: Bearer $OPENAI_API_KEY" -d "$body" "https://api.openai.com/sessions/$sid/reward"
try reverse -d "$body" "$rev/sessions/$sid/reward"
try reverse-host-header -H "Host: polar.local" -d "$body" "$rev/sessions/$sid/reward"
try reverse-session-key -H "Authorization: Bearer $OPENAI_API_KEY" -d "$body" "$rev/sessions/$sid/reward"
try status-post -x "$HTTPS_PROXY" -d '{"status": "completed"}' "http://polar.local/sessions/$sid/status"
try sibling -x "$HTTPS_PROXY" -d "$body" "http://polar.local/sessions/$sib/reward"
# The token itself: in the environment, any process's command line, any file named like it.
found=""
env | grep -qi control && found="$found env"
# ([c] and [o]: the pattern must not match grep's own command line, which cat reads too)
cat /proc/*/cmdline 2>/dev/null | tr '\0' ' ' | grep -q 'polar_[c]ontrol_token\|polar_[o]ut' && found="$found cmdline"
find / -xdev \( -name '.control-token' -o -name 'polar-control-token' \) 2>/dev/null | grep -q . && found="$found file"
echo "TOKEN-FOUND:${found:-none}"
"""


def _polar(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "polar_cli.app", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
    )


@pytest.mark.skipif(
    not (shutil.which("bwrap") and shutil.which("socat") and shutil.which("curl")),
    reason="bubblewrap/socat/curl missing (make sandbox)",
)
def test_no_route_to_the_control_plane_lets_the_agent_reward_itself(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "attack.sh").write_text(ATTACK)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "zero", "instruction": "x", "verify": "false"}) + "\n")
    script = tmp_path / "script.json"
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "hi"}]}))
    done = _polar(
        "rollout",
        "tasks.jsonl",
        "--harness",
        f"cmd:sh {tmp_path / 'attack.sh'}",
        "--samples",
        "2",
        "--runtime",
        "bwrap",
        "--engine",
        f"scripted:{script}",
        "--out",
        "store",
        "--seed",
        "5",
        "--confdir",
        str(tmp_path / "conf"),
        "--set",
        "polar_shard_seconds=0.2",
        "--no-progress",
        cwd=tmp_path,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    logs = sorted((tmp_path / "store" / "rollouts" / "r5").rglob("harness.log"))
    assert len(logs) == 2, done.stdout + done.stderr
    for log in logs:
        text = log.read_text()
        routes = dict(line.split()[1:3] for line in text.splitlines() if line.startswith("ROUTE "))
        assert len(routes) == 9, text
        assert not [r for r, code in routes.items() if code.startswith("2")], f"a reward post got through: {routes}"
        assert "TOKEN-FOUND:none" in text, text
    built = tmp_path / "built"
    assert _polar("build", "store", "--out", str(built), cwd=tmp_path).returncode == 0
    from polar_cli.build.output import read_traces

    rewards = {t.session_id: t.reward for t in read_traces(built)}
    assert rewards and set(rewards.values()) == {0.0}, rewards
