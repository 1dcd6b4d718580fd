"""`polar loop --async`: the staleness rule and utilisation as plain functions, and one real async loop on the toy
task (the real runner, mitmdump, the local engine on the tiny model, `polar train` in its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polar_cli.rollout.async_loop import busy_fraction, group_versions, select_groups

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "toy_task" / "agent.py"


def test_groups_within_the_bound_are_kept_and_staler_ones_dropped_whole() -> None:
    versions = {"fresh": ["3", "3"], "one-behind": ["2", "3"], "two-behind": ["1", "3", "3"], "untagged": ["3", None]}
    chosen = select_groups(versions, current=3, max_staleness=1)
    assert chosen.kept == ["fresh", "one-behind"]
    assert chosen.stale == {"two-behind": 2}  # one old call is enough: the group goes whole
    assert chosen.untagged == ["untagged"]
    assert select_groups(versions, current=3, max_staleness=0).kept == ["fresh"]
    assert select_groups(versions, current=3, max_staleness=2).kept == ["fresh", "one-behind", "two-behind"]


def test_the_staleness_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="newer than 1"):
        select_groups({"g": ["2"]}, current=1, max_staleness=1)  # a version the trainer has not made yet
    with pytest.raises(ValueError, match="0 or more"):
        select_groups({"g": ["0"]}, current=0, max_staleness=-1)
    assert select_groups({"g": ["v1"]}, current=1, max_staleness=5).untagged == ["g"]  # not a version number


def test_busy_fraction_counts_overlaps_once_and_clips_to_the_window() -> None:
    assert busy_fraction([(0, 4), (2, 6)], 0, 10) == pytest.approx(0.6)
    assert busy_fraction([(-5, 2), (8, 20)], 0, 10) == pytest.approx(0.4)
    assert busy_fraction([(1, 2)], 3, 3) == 0.0
    assert busy_fraction([], 0, 10) == 0.0


def test_async_loop_trains_while_rolling_out_and_drops_groups_past_the_bound(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    # The toy task's question, but a random reward: two 4-token answers of the tiny model often score the same
    # fraction of capitals (nothing to train, no new version); the loop's mechanics are what is tested here.
    task = {
        "id": "shout-0",
        "instruction": "what is the capital of france",
        "reward_file": "reward.txt",
        "verify": "python3 -c 'import random; print(random.random())' > reward.txt",
    }
    tasks.write_text(json.dumps(task) + "\n")
    out = tmp_path / "loop"
    harness = f"cmd:{sys.executable} {AGENT} --turns 1 --max-tokens 4 {{instruction}}"
    # --max-staleness 0: batch 1 starts the moment batch 0 ends, before training 0 can have made version 1, so it is
    # sampled by version 0 and is one version behind when step 1 trains version 1: dropped, deterministically.
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", harness, "--model",
           str(tiny_model_dir), "--iterations", "3", "--out", str(out), "--samples", "2", "--no-progress", "--async",
           "--max-staleness", "0", "--lr", "1e-3", "--eot-token-id", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    batches, steps, summary = state["batches"], state["steps"], state["summary"]
    assert [s["status"] for s in steps] == ["trained", "trained"] and [s["version"] for s in steps] == [0, 1]

    # Overlap: batch 1 ran while training 0 ran.
    b1, t0 = batches[1], steps[0]
    assert b1["version"] == 0 and b1["started_at"] < t0["ended_at"] and b1["ended_at"] > t0["started_at"]
    # The bound: batch 1 (version 0) was dropped by step 1 (version 1), not trained on.
    assert b1["step"] == 1 and b1["dropped_groups"] == {"shout-0": 1}
    assert 1 not in steps[1]["batches"] and steps[1]["groups_dropped"] >= 1 and summary["groups_dropped"] >= 1
    assert all(batches[i]["version"] == 1 for i in steps[1]["batches"])

    # The store: each batch's calls carry the version that sampled them, and versions rise across the run.
    tagged = [sorted({v for vs in group_versions(b["shards"]).values() for v in vs}) for b in batches]
    assert tagged == [[str(b["version"])] for b in batches]
    versions = [b["version"] for b in batches]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 2 == summary["final_version"]

    # Utilisation, per step and for the run, is in loop.json and printed.
    for record in (*steps, summary):
        assert 0.0 < record["rollout_util"] <= 1.0 and 0.0 < record["trainer_util"] <= 1.0
    assert "rollout busy" in done.stdout and "trainer busy" in done.stdout

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)  # complete: nothing to redo
    assert again.returncode == 0 and json.loads((out / "loop.json").read_text())["batches"] == batches
    sync = subprocess.run([c for c in cmd if c != "--async"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert sync.returncode == 2 and "holds an async loop" in sync.stderr


def test_async_refuses_an_unknown_engine_and_drain(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "instruction": "hi", "verify": "true"}) + "\n")
    base = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", "cmd:true", "--model",
            str(tiny_model_dir), "--iterations", "2", "--out", str(tmp_path / "o"), "--async"]  # fmt: skip
    for engine in ("sglang", "sglang:gpu1:30000", "tgi"):  # sglang needs the URL of a running server
        bad = subprocess.run([*base, "--engine", engine], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "local, vllm or sglang:URL" in bad.stderr, bad.stderr
    drain = subprocess.run([*base, "--drain", "later"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert drain.returncode == 2 and "wait, cut or keep" in drain.stderr
    assert not (tmp_path / "o").exists()


def test_http_engine_specs_tag_the_calls_the_engine_does_not_tag() -> None:
    """``vllm:URL?weight_version=V``: vLLM reports no version, so the proxy's spec carries the one the loop pushed;
    an engine's own tag (SGLang's meta_info) wins over the spec's."""
    from polar_addon.engines import make_engine
    from polar_addon.engines.openai_compat import parse_chat_response
    from polar_addon.engines.spec import EngineSpec

    engine = make_engine("vllm:http://127.0.0.1:9?weight_version=4", timeout_s=5)
    assert (engine.url, engine.weight_version) == ("http://127.0.0.1:9", "4")  # type: ignore[attr-defined]
    assert make_engine("sglang:http://h:1", timeout_s=5).weight_version is None  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="weight_version"):
        EngineSpec.parse("vllm:http://h:1?version=4")
    answer = {"model": "m", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "finish_reason": "stop",
              "message": {"role": "assistant", "content": "x"}, "token_ids": [5],
              "logprobs": {"content": [{"token": "x", "logprob": -0.5}]}}]}  # fmt: skip
    untagged = parse_chat_response(answer)
    assert untagged.to_completion(engine="vllm:u", default_model="m", default_weight_version="4").weight_version == "4"
    assert untagged.to_completion(engine="vllm:u", default_model="m").weight_version is None
    tagged = parse_chat_response({**answer, "metadata": {"weight_version": "7"}})
    assert tagged.to_completion(engine="sglang:u", default_model="m", default_weight_version="4").weight_version == "7"
    # An SGLang server never given a version reports "default": the operator's tag says more.
    unset = parse_chat_response({**answer, "metadata": {"weight_version": "default"}})
    assert unset.to_completion(engine="sglang:u", default_model="m", default_weight_version="4").weight_version == "4"
    assert unset.to_completion(engine="sglang:u", default_model="m").weight_version == "default"


def _random_reward_loop(tmp_path: Path, model: Path, out: Path, iterations: int, *extra: str) -> list[str]:
    """``polar loop --async`` on one task whose reward is random (two 4-token answers of the tiny model often score
    the same fraction of capitals: nothing to train, no new version); the loop's mechanics are what is tested."""
    tasks = tmp_path / "tasks.jsonl"
    task = {
        "id": "shout-0",
        "instruction": "what is the capital of france",
        "reward_file": "reward.txt",
        "verify": "python3 -c 'import random; print(random.random())' > reward.txt",
    }
    tasks.write_text(json.dumps(task) + "\n")
    harness = f"cmd:{sys.executable} {AGENT} --turns 1 --max-tokens 4 {{instruction}}"
    return [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", harness, "--model", str(model),
            "--iterations", str(iterations), "--out", str(out), "--samples", "2", "--no-progress", "--async",
            "--lr", "1e-3", "--eot-token-id", "2", *extra]  # fmt: skip


def _check_pushed_versions(state: dict, engine: str) -> None:
    """Every batch's calls carry the version that sampled them; the one push of a 2-iteration loop drained (the
    batch in flight ended before the engine was touched, the next batch started after it served the new version)."""
    batches, steps, pushes = state["batches"], state["steps"], state["pushes"]
    assert [s["status"] for s in steps] == ["trained"]
    tagged = [sorted({v for vs in group_versions(b["shards"]).values() for v in vs}) for b in batches]
    assert tagged == [[str(b["version"])] for b in batches] and batches[-1]["version"] == 1 and batches[-1]["final"]
    (push,) = pushes
    assert push["version"] == 1 and push["engine"] == engine and push["checkpoint"] == steps[0]["checkpoint"]
    loading = push["loaded_at"] - push["reload_s"]
    before = [b for b in batches if b["version"] == 0]
    assert all(b["ended_at"] <= loading for b in before)  # drain wait: the old batches finished on the old weights
    assert batches[-1]["started_at"] >= push["loaded_at"]  # new sessions waited for the new weights
    assert push["drain_s"] >= push["reload_s"] > 0 and state["summary"]["drain_s"] == [push["drain_s"]]


def test_async_loop_pushes_each_version_to_sglang_with_update_weights_from_disk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--engine sglang:URL against the SGLang contract server (SGLang needs a GPU): every push is a body SGLang's own
    UpdateWeightFromDiskReqInput accepts, and SGLang's weight_version comes back in every answer."""
    from polar_addon.engines.local import LocalEngine
    from tests.support.sglang_contract_server import SGLangContractServer

    out = tmp_path / "loop"
    with SGLangContractServer(LocalEngine(tiny_model_dir)) as server:
        cmd = _random_reward_loop(tmp_path, tiny_model_dir, out, 2, "--engine", f"sglang:{server.url}")
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        updates = [(u.model_path, u.weight_version) for u in server.weight_updates]
    state = json.loads((out / "loop.json").read_text())
    # The starting model as version 0 (whatever the server held before), then the checkpoint as version 1.
    assert updates == [(str(tiny_model_dir.resolve()), "0"), (state["steps"][0]["checkpoint"], "1")]
    _check_pushed_versions(state, "sglang")
    assert "sglang" in json.dumps(state["pushes"]) and "drain" in done.stdout + done.stderr


def test_sglang_reports_the_pushed_version_itself(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SGLang's weight_version passes through update_weights_from_disk into its answers: a proxy spec that says
    otherwise loses; an update SGLang's own class refuses (a version that is not a string) is an error."""
    import asyncio
    import shutil

    from polar_addon.canonical import CanonicalRequest, PolarError, SamplingParams
    from polar_addon.engines import make_engine
    from polar_addon.engines.local import LocalEngine
    from tests.support.sglang_contract_server import SGLangContractServer

    checkpoint = shutil.copytree(tiny_model_dir, tmp_path / "ckpt")
    request = CanonicalRequest(
        api="openai_chat",
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        sampling=SamplingParams(max_tokens=2, temperature=1.0),
    )

    async def scenario(url: str) -> tuple[str | None, str]:
        engine = make_engine(f"sglang:{url}?weight_version=9", timeout_s=60)
        try:
            await engine.update_weights(str(checkpoint), "5")  # type: ignore[attr-defined]
            after = await engine.complete(request)
            with pytest.raises(PolarError) as refused:
                await engine.update_weights(str(checkpoint), 6)  # type: ignore[attr-defined, arg-type]
            return after.weight_version, refused.value.message
        finally:
            await engine.close()

    with SGLangContractServer(LocalEngine(tiny_model_dir)) as server:
        version, refused = asyncio.run(scenario(server.url))
        assert [u.weight_version for u in server.weight_updates] == ["5"]  # the refused body never got through
    assert version == "5"
    assert "weight_version" in refused


@pytest.mark.vllm
def test_async_loop_on_vllm_restarts_it_between_batches_and_tags_every_call(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real vLLM CPU engine: started by the loop, restarted on the checkpoint (polar engine reload) only once
    the batch in flight finished; each batch's calls carry the version its server held; stopped at the end."""
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    out = tmp_path / "loop"
    cmd = _random_reward_loop(
        tmp_path,
        tiny_model_dir,
        out,
        2,
        "--engine",
        "vllm",
        "--vllm-arg=--enforce-eager",
        "--vllm-arg=--max-model-len=4096",
        "--vllm-arg=--dtype=float32",
    )
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    _check_pushed_versions(state, "vllm")
    log = (out / ".engines").glob("engine-*.log")
    assert any("polar engine reload: " + state["steps"][0]["checkpoint"] in p.read_text() for p in log)
    assert not list((out / ".engines").glob("engine-*.json"))  # stopped and forgotten
    print(
        f"async vLLM loop: {state['summary']['wall_s']:.0f} s, drain {state['pushes'][0]['drain_s']:.1f} s "
        f"(reload {state['pushes'][0]['reload_s']:.1f} s)"
    )


def test_a_cut_ends_the_running_sessions_as_masked_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Drain "cut": the rollout's stop event interrupts it as a signal would; sessions that ran are posted as error
    (masked from training), none stays running in the store."""
    import asyncio

    from polar_addon.store import read_sessions
    from polar_cli.rollout.runner import RolloutConfig, RolloutProgress, run_rollout
    from polar_cli.rollout.tasks import load_tasks

    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [{"content": "hi"}]}))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "hang", "instruction": "MODE=hang", "verify": "true"}) + "\n")
    agent = REPO / "tests" / "support" / "rollout_agent.py"
    store = tmp_path / "store"
    progress = RolloutProgress()

    async def cut_once_running() -> object:
        stop = asyncio.Event()
        config = RolloutConfig(tasks=load_tasks(tasks), harness=f"cmd:{sys.executable} {agent} {{instruction}}",
                               samples=2, concurrency=1, engine=f"scripted:{script}", out=str(store),
                               confdir=tmp_path / "conf", logs_dir=tmp_path / "logs", progress=progress, stop=stop,
                               stop_on_signals=False, proxy_options={"polar_shard_seconds": "0.2"},
                               runtime="local", trust_agent=True)  # fmt: skip
        rollout = asyncio.create_task(run_rollout(config))
        while progress.stages.get("run", 0) < 1 and not rollout.done():
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        stop.set()
        return await asyncio.wait_for(rollout, 120)

    result = asyncio.run(cut_once_running())
    assert result.interrupted == "stop"
    assert sorted((s.status, s.ran) for s in result.sessions) == [("cancelled", False), ("cancelled", True)]
    (ran,) = [s for s in result.sessions if s.ran]
    stored = {s.session_id: s for s in read_sessions(str(store))}
    assert stored[ran.session_id].status == "error" and stored[ran.session_id].metadata.get("cancelled") is True


def test_a_local_engine_spec_tags_its_calls_with_a_weight_version(tmp_path: Path) -> None:
    from polar_addon.engines import make_engine
    from polar_addon.engines.spec import EngineSpec

    engine = make_engine(f"local:{tmp_path}?weight_version=3&max_len=64", timeout_s=10)
    assert engine.weight_version == "3" and engine.max_len_override == 64  # type: ignore[attr-defined]
    assert make_engine(f"local:{tmp_path}", timeout_s=10).weight_version is None  # type: ignore[attr-defined]
    local = EngineSpec.parse(f"local:{tmp_path}?weight_version=3")
    assert (local.target, local.max_len) == (str(tmp_path), 0)
    with pytest.raises(ValueError, match="weight_version"):
        EngineSpec.parse(f"local:{tmp_path}?version=3")


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line holds ``text`` (this test's own tmp path: only processes this test started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def _trainers(out: Path) -> list[int]:
    """``polar train`` processes training into ``out``."""
    found = []
    for pid in _processes_mentioning(str(out)):
        try:
            if " train " in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_killed_async_loop_resumes_from_its_last_finished_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL mid-run (after the first training, while the second trains on a batch), then the same command:
    the run goes on from version 1 (not 0), every recorded step and batch is kept as it was, no batch is trained
    twice, the batch in flight is redone in a fresh directory, and the killed run's training died with it."""
    import os
    import signal
    import time

    out = tmp_path / "loop"
    cmd = _random_reward_loop(tmp_path, tiny_model_dir, out, 3, "--max-staleness", "1")
    state_file = out / "loop.json"
    killed = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        # Killed once step 1 has taken a batch (loop.json says so) and its polar train runs.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and killed.poll() is None:
            seen = json.loads(state_file.read_text()) if state_file.is_file() else {}
            if len(seen.get("steps", [])) == 1 and any(b["step"] == 1 for b in seen["batches"]) and _trainers(out):
                break
            time.sleep(0.1)
        assert killed.poll() is None, "the loop ended before it could be killed"
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        before = json.loads(state_file.read_text())
        taken_by_the_killed_step = [b["index"] for b in before["batches"] if b["step"] == 1]
        # Whether the kill caught a batch in flight (its directory made, not yet recorded): seen before the rerun,
        # which makes that directory itself when the kill came first.
        in_flight = (out / f"batch-{len(before['batches']):03d}").exists()
        # polar train dies with the loop (PR_SET_PDEATHSIG): nothing trains into out/train-NNN behind the resumed run.
        # It was killed within a poll of the training's start, which needs several seconds to import and train: one
        # still running 3 s later outlived the loop (a training that merely ended would take longer than that).
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and _trainers(out):
            time.sleep(0.1)
        assert not _trainers(out), "a training outlived the killed loop"

        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        for pid in _processes_mentioning(str(out)):  # the killed run's proxy and harnesses (their own sessions)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    after = json.loads(state_file.read_text())
    steps, batches = after["steps"], after["batches"]
    assert len(after["runs"]) == 2 and after["summary"]["complete"] and after["summary"]["runs"] == 2
    assert [s["step"] for s in steps] == [0, 1] and [s["version"] for s in steps] == [0, 1]
    assert all(s["status"] == "trained" for s in steps)
    # What the killed run finished is kept as it was: step 0 is not redone, its batches are not rerun.
    assert steps[0] == before["steps"][0]
    for old in before["batches"]:
        new = batches[old["index"]]
        assert {k: new[k] for k in ("shards", "started_at", "ended_at", "version")} == {
            k: old[k] for k in ("shards", "started_at", "ended_at", "version")
        }
    # No batch trained twice; each step's batches are exactly those marked with it.
    trained = [i for s in steps for i in s["batches"]]
    assert len(trained) == len(set(trained)) and [b["index"] for b in batches] == list(range(len(batches)))
    for s in steps:
        assert sorted(s["batches"]) == sorted(
            b["index"] for b in batches if b["step"] == s["step"] and not b["dropped_groups"]
        )
    # The batches the killed step had taken waited for the trainer again and the resumed step 1 trained them.
    assert len(before["steps"]) == 1 and taken_by_the_killed_step
    assert set(taken_by_the_killed_step) <= set(steps[1]["batches"])
    # The resumed run went on from version 1: its batches sampled step 0's checkpoint or later, never the model.
    resumed_at = after["runs"][1]["started_at"]
    fresh = [b for b in batches if b["started_at"] >= resumed_at]
    assert fresh and all(b["version"] >= 1 for b in fresh)
    assert all(b["policy"] == steps[0]["checkpoint"] for b in batches if b["version"] == 1)
    assert batches[-1]["final"] and batches[-1]["version"] == 2
    tagged = [sorted({v for vs in group_versions(b["shards"]).values() for v in vs}) for b in batches]
    assert tagged == [[str(b["version"])] for b in batches]
    # The batch the kill interrupted (if one ran) was redone in a new directory, never mixed with the old one.
    interrupted = len(before["batches"])
    if in_flight and interrupted < len(batches):
        assert batches[interrupted]["shards"] == str(out / f"batch-{interrupted:03d}-attempt2" / "shards")


def test_a_batch_without_weight_versions_stops_the_loop_instead_of_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls with no version cannot be bounded; as every later batch of that engine would be the same, the trainer
    stops the loop with the reason rather than waiting forever for a usable batch."""
    from polar_cli.rollout import async_loop
    from polar_cli.rollout.loop import LoopConfig

    config = LoopConfig(tasks=[], harness="cmd:true", model=tmp_path, iterations=2, out=tmp_path / "o", engine="vllm")
    loop = async_loop._AsyncLoop(config, 1, "wait", None, None)
    batch = async_loop.Batch(
        index=0,
        version=0,
        policy=str(tmp_path),
        shards=str(tmp_path / "s"),
        started_at=0.0,
        ended_at=1.0,
        sessions=2,
        statuses={},
        rewarded=2,
        reward_mean=0.5,
        reward_se=0.1,
    )
    monkeypatch.setattr(async_loop, "group_versions", lambda _store: {"g": ["0", None]})
    with pytest.raises(RuntimeError, match="carry no numeric weight_version"):
        loop._select(batch, 0, 0)
    monkeypatch.setattr(async_loop, "group_versions", lambda _store: {"g": ["0", "0"]})
    assert loop._select(batch, 0, 0) and batch.step == 0


def test_a_loop_killed_after_its_last_batch_is_summarised_on_rerun(tmp_path: Path) -> None:
    """Killed (SIGKILL) between recording the measuring batch and the final save, loop.json has no summary, or an
    earlier run's: the rerun has nothing to redo, and must still answer with the complete run's summary."""
    from dataclasses import asdict

    from polar_cli.rollout import async_loop
    from polar_cli.rollout.loop import LoopConfig, load_state, save_state

    model, checkpoint, out = tmp_path / "model", tmp_path / "o" / "train-000" / "checkpoint", tmp_path / "o"
    for d in (model, checkpoint):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    config = LoopConfig(tasks=[], harness="cmd:true", model=model, iterations=2, out=out, engine="local")

    def batch(index: int, version: int, final: bool) -> dict:
        return asdict(
            async_loop.Batch(
                index=index,
                version=version,
                policy=str(model),
                shards=str(out / "s"),
                started_at=10.0 * index,
                ended_at=10.0 * index + 5,
                sessions=2,
                statuses={},
                rewarded=2,
                reward_mean=0.25 + index / 4,
                reward_se=0.1,
                final=final,
                step=0 if index == 0 else None,
            )
        )

    step = asdict(
        async_loop.Step(
            step=0,
            version=0,
            batches=[0],
            groups_kept=1,
            groups_dropped=0,
            started_at=5.0,
            ended_at=9.0,
            status="trained",
            checkpoint=str(checkpoint),
            log=str(out / "l"),
        )
    )
    stale = {"wall_s": 3.0, "complete": False, "final_version": 0, "final_reward_mean": 0.25}
    for summary in (None, stale):
        save_state(
            out,
            {
                "mode": "async",
                "runs": [{"started_at": 0.0, "ended_at": 20.0}],
                "pushes": [],
                "batches": [batch(0, 0, False), batch(1, 1, True)],
                "steps": [step],
                **({"summary": summary} if summary else {}),
            },
        )
        state = async_loop.run_async_loop(config)
        assert state["summary"]["complete"] and state["summary"]["final_version"] == 1
        assert state["summary"]["final_reward_mean"] == 0.5
        assert load_state(out)["summary"] == state["summary"]
