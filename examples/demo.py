"""`make demo`: the capture loop end to end on this machine, no GPU, no network.

1. starts ``mitmdump -s polar_addon/addon.py`` with the in-process ``local`` engine on the tiny model;
2. runs the example agent (official openai SDK, streaming, with a tool) for a few sessions through
   ``HTTPS_PROXY`` — the agent itself knows nothing about polar;
3. each session's "verifier" posts a reward through the proxy (``POST http://polar.local/sessions/ID/reward``)
   with the proxy's control token, which the agent never sees;
4. prints what the shards hold (``polar shards inspect``) and builds trajectories (``polar build``, ``polar stats``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from polar_cli.mitm import run_mitmdump

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tiny"
OUT = REPO / "runs" / "demo"
SESSIONS = 4


def polar(*args: str) -> None:
    print(f"\n$ polar {' '.join(args)}", flush=True)
    subprocess.run([str(Path(sys.executable).parent / "polar"), *args], check=True, cwd=REPO)


def main() -> None:
    if not (MODEL / "config.json").exists():
        sys.exit(f"{MODEL} missing: run `make model` (make demo does it for you)")
    shutil.rmtree(OUT, ignore_errors=True)
    shards = OUT / "shards"
    options = {"polar_max_tokens": "24", "polar_shard_seconds": "1"}
    with run_mitmdump(f"local:{MODEL}", shards, options=options) as proxy:
        print(f"mitmdump + polar addon listening on {proxy.url} (CA: {proxy.ca})", flush=True)
        for i in range(SESSIONS):
            session = f"demo-{i}"
            env = {**os.environ, "HTTPS_PROXY": proxy.proxy_url(session), "SSL_CERT_FILE": str(proxy.ca)}
            agent = [
                sys.executable,
                str(REPO / "examples" / "calculator_agent.py"),
                f"What is {i} + {i + 3}?",
                "--turns",
                "3",
                "--max-tokens",
                "24",
            ]
            result = subprocess.run(agent, env=env, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                sys.exit(f"agent failed:\n{result.stdout}\n{result.stderr}\n{proxy.logs()[-3000:]}")
            print(f"session {session}: agent finished {result.stdout.strip()}", flush=True)
            # The verifier speaks through the same proxy; the control token, not the session, authorizes it.
            with httpx.Client(proxy=proxy.url, headers=proxy.control_headers()) as verifier:
                reward = float(i % 2)
                verifier.post(
                    f"http://polar.local/sessions/{session}/reward", json={"value": reward}
                ).raise_for_status()
                verifier.post(
                    f"http://polar.local/sessions/{session}/status", json={"status": "completed"}
                ).raise_for_status()
    polar("shards", "inspect", str(shards))
    polar("shards", "validate", str(shards))
    polar("build", str(shards), "-o", str(OUT / "traces"), "--tokenizer", str(MODEL))
    polar("stats", str(shards), "--tokenizer", str(MODEL))
    print(f"\nshards in {shards}, traces in {OUT / 'traces'}")


if __name__ == "__main__":
    main()
