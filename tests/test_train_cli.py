"""`polar train` on a real capture: agent (openai SDK) -> mitmdump + polar addon + local engine -> shards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples" / "toy_task"))

from collect import collect  # noqa: E402


def polar(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1")
    return subprocess.run(
        [sys.executable, "-m", "polar_cli.app", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def capture(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shards = tmp_path_factory.mktemp("capture") / "shards"
    # 3 turns: 12 merges. Token continuity off, every call is rendered in full, and about half of them re-tokenize a
    # length-capped random turn (none: ~1e-3). With it on none would: the cut turn's ids continue the chain
    # (tests/test_tito_length_cut.py).
    sessions = collect(tiny_model_dir, shards, groups=2, samples=3, turns=3, max_tokens=8, tito="off")
    assert len({s.reward for s in sessions}) > 1  # the shout verifier gives varied rewards
    return shards


def first_log(out: Path) -> dict:
    return next(r for r in map(orjson.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r)


def test_train_from_raw_shards_and_from_a_built_dataset(capture: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    common = ["--model", str(tiny_model_dir), "--max-steps", "2", "--lr", "1e-3", "--eot-token-id", "2",
              "--no-progress"]  # fmt: skip
    raw = polar("train", str(capture), "--output", str(tmp_path / "raw"), *common)
    assert raw.returncode == 0, raw.stdout + raw.stderr
    assert "checkpoint:" in raw.stdout and (tmp_path / "raw" / "model.safetensors").is_file()
    assert "2 groups / 6 sessions" in raw.stderr.replace("\n", " ")

    # per_request traces are the calls exactly as the engine saw them: the first step is on-policy
    per_request = polar("train", str(capture), "--output", str(tmp_path / "pr"), "--strategy", "per_request",
                        "--broadcast-rewards", *common)  # fmt: skip
    assert per_request.returncode == 0, per_request.stderr
    log = first_log(tmp_path / "pr")
    assert 1 - 1e-4 < log["is_ratio/min"] <= log["is_ratio/max"] < 1 + 1e-4

    built = polar("build", str(capture), "--out", str(tmp_path / "traces"), "--tokenizer", str(tiny_model_dir),
                  "--eot-token-id", "2")  # fmt: skip
    assert built.returncode == 0, built.stderr
    from_dataset = polar("train", str(tmp_path / "traces"), "--output", str(tmp_path / "ds"), *common)
    assert from_dataset.returncode == 0, from_dataset.stderr
    # the same traces either way: same rows, same first-step loss
    assert first_log(tmp_path / "ds")["loss"] == pytest.approx(first_log(tmp_path / "raw")["loss"], abs=1e-6)
    assert first_log(tmp_path / "ds")["tokens/forward"] == first_log(tmp_path / "raw")["tokens/forward"]


def test_breaking_at_retokenized_turns_keeps_the_first_step_on_policy(
    capture: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Length-capped random samples rendered in full (token continuity off) often come back re-tokenized in the next
    prompt: merged, the later turns sit after ids they were not sampled after; broken there (the default), every
    trace is exact."""

    def totals(shards: Path, retokenized: str) -> dict:
        done = polar("stats", str(shards), "--tokenizer", str(tiny_model_dir), "--eot-token-id", "2",
                     "--retokenized", retokenized, "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        return orjson.loads(done.stdout)["total"]

    merged = totals(capture, "merge")
    for attempt in range(3):
        if merged["retokenized_merges"]:
            break
        # About 1 capture in 1000 has no re-tokenized turn at all: sample a new one rather than skip.
        capture = tmp_path / f"resample-{attempt}" / "shards"
        collect(tiny_model_dir, capture, groups=2, samples=3, turns=3, max_tokens=8, seed=attempt + 1, tito="off")
        merged = totals(capture, "merge")
    broken = totals(capture, "break")
    n = merged["retokenized_merges"]
    assert n > 0, "three captures without one re-tokenized turn"
    # (a merge build counts a re-tokenized *prompt* as a retokenized break already)
    assert broken["retokenized_merges"] == 0
    assert broken["breaks"].get("retokenized", 0) == merged["breaks"].get("retokenized", 0) + n
    assert broken["chains_total"] == merged["chains_total"] + n

    common = ["--model", str(tiny_model_dir), "--max-steps", "1", "--eot-token-id", "2", "--no-progress"]
    # break is the default
    strict = polar("train", str(capture), "--output", str(tmp_path / "break"), *common)
    assert strict.returncode == 0, strict.stderr
    assert f"traces {broken['chains_total']} ->" in " ".join(strict.stderr.split())
    log = first_log(tmp_path / "break")
    assert 1 - 1e-4 < log["is_ratio/min"] <= log["is_ratio/max"] < 1 + 1e-4
    # Control: the same calls merged (the opt-in) are measurably off-policy after a re-tokenization.
    loose = polar("train", str(capture), "--output", str(tmp_path / "merge"), "--retokenized", "merge", *common)
    assert loose.returncode == 0, loose.stderr
    log = first_log(tmp_path / "merge")
    assert max(1 - log["is_ratio/min"], log["is_ratio/max"] - 1) > 1e-3


def test_train_refuses_loudly(capture: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    base = ["--model", str(tiny_model_dir), "--output", str(tmp_path / "x"), "--no-progress"]
    mismatch = polar("train", str(capture), *base, "--temperature", "0.7")
    assert mismatch.returncode == 2
    assert "differs from the capture temperature 1.0" in " ".join(mismatch.stderr.split())
    untrainable = polar("train", str(capture), *base, "--strategy", "per_request")  # no --broadcast-rewards
    assert untrainable.returncode == 3  # nothing to train, with the reason and the fix
    assert "pass --broadcast-rewards" in " ".join(untrainable.stderr.split())
    bad_loss = polar("train", str(capture), *base, "--loss-type", "grpo")
    assert bad_loss.returncode == 2 and "--loss-type must be one of" in " ".join(bad_loss.stderr.split())
    bad_retokenized = polar("train", str(capture), *base, "--retokenized", "drop")
    assert bad_retokenized.returncode == 2 and "--retokenized must be merge or break" in " ".join(
        bad_retokenized.stderr.split()
    )
    assert not (tmp_path / "x" / "model.safetensors").exists()
