"""Rollouts for the toy task: mitmdump + polar addon + local engine, the agent, and a verifier.

A *group* is one question asked ``samples`` times (the GRPO group); each sample is one session.
The verifier scores the agent's replies (the text it received, as any verifier would) and posts
the reward through the proxy with the proxy's control token (the agent never sees it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from polar_cli.mitm import run_mitmdump

HERE = Path(__file__).resolve().parent
QUESTIONS = [
    "what is the capital of france",
    "name a color of the sky",
    "which animal barks",
    "what do bees make",
    "how many legs has a spider",
    "what is frozen water called",
    "name a planet",
    "what do cows drink",
]


def shout_score(replies: list[str]) -> float:
    """Fraction of the letters the agent wrote that are capitals (0 when it wrote no letter)."""
    letters = [c for reply in replies for c in reply if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


@dataclass
class Session:
    session_id: str
    group_id: str
    question: str
    replies: list[str]
    reward: float


def api_key(session_id: str, group_id: str, sample: int) -> str:
    return f"polar:session={session_id};group={group_id};task={group_id};sample={sample}"


def collect(
    model_dir: Path,
    shards: Path,
    *,
    tag: str,
    groups: int,
    samples: int,
    turns: int = 2,
    max_tokens: int = 16,
    temperature: float = 1.0,
    concurrency: int = 4,
) -> list[Session]:
    """Run ``groups x samples`` agent sessions through the proxy; shards are sealed on return."""
    shards.parent.mkdir(parents=True, exist_ok=True)
    episodes = []
    for g in range(groups):
        question = QUESTIONS[g % len(QUESTIONS)]
        group_id = f"{tag}-g{g}"
        for s in range(samples):
            session_id = f"{group_id}-s{s}"
            episodes.append({"id": session_id, "group": group_id, "api_key": api_key(session_id, group_id, s),
                             "question": question})  # fmt: skip
    episodes_file = shards.parent / "episodes.jsonl"
    episodes_file.write_text("".join(json.dumps(e) + "\n" for e in episodes))

    options = {"polar_shard_seconds": "1"}
    with run_mitmdump(f"local:{model_dir}", shards, options=options) as proxy:
        env = {**os.environ, "HTTPS_PROXY": proxy.url, "SSL_CERT_FILE": str(proxy.ca)}
        agent = [sys.executable, str(HERE / "agent.py"), str(episodes_file), "--turns", str(turns),
                 "--max-tokens", str(max_tokens), "--temperature", str(temperature),
                 "--concurrency", str(concurrency)]  # fmt: skip
        done = subprocess.run(agent, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"agent failed:\n{done.stderr[-3000:]}\n{proxy.logs()[-3000:]}")
        replies = {r["id"]: r["replies"] for r in map(json.loads, done.stdout.splitlines())}
        sessions = []
        with httpx.Client(proxy=proxy.url, headers=proxy.control_headers(), timeout=60) as verifier:
            for e in episodes:
                reward = shout_score(replies[e["id"]])
                base = f"http://polar.local/sessions/{e['id']}"
                verifier.post(f"{base}/reward", json={"value": reward}).raise_for_status()
                verifier.post(f"{base}/status", json={"status": "completed"}).raise_for_status()
                sessions.append(Session(e["id"], e["group"], e["question"], replies[e["id"]], reward))
    return sessions


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return mean, se
