"""`polar loop --engine vllm --vllm-push adapter`, its parts without vLLM: the rank the server is started for (polar
train's --lora-r among the loop's train options), what each training starts from (the starting model and the
policy's adapter, one adapter trained across iterations, since the server keeps the starting model), and the
command line's refusals before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_cli.app import app
from polar_cli.rollout.loop import LoopConfig, lora_rank, train_start
from polar_cli.rollout.tasks import Task


def test_the_rank_is_polar_trains_last_lora_r_in_either_spelling() -> None:
    assert lora_rank([]) == 0
    assert lora_rank(["--lr", "1e-5"]) == 0
    assert lora_rank(["--lora-r", "8"]) == 8
    assert lora_rank(["--lora-r=16", "--lr", "1"]) == 16
    assert lora_rank(["--lora-r", "4", "--lora-r=32"]) == 32  # the last wins, as polar train's parser says
    assert lora_rank(["--lora-alpha", "8", "--lora-r"]) == 0  # a dangling flag: polar train refuses it itself
    with pytest.raises(ValueError, match=r"^--train-arg --lora-r must be a whole number, not 'x'$"):
        lora_rank(["--lora-r", "x"])
    with pytest.raises(ValueError, match=r"^--train-arg --lora-r must be a whole number, not '8=9'$"):
        lora_rank(["--lora-r=8=9"])  # the whole value after the first '=', as polar train's parser reads it


def _config(tmp_path: Path, **kw: object) -> LoopConfig:
    task = Task(id="t", instruction="do")
    model = tmp_path / "start"
    return LoopConfig(tasks=[task], harness="cmd:true", model=model, iterations=2, out=tmp_path, **kw)  # type: ignore[arg-type]


def test_each_training_goes_on_from_the_policys_adapter_over_the_starting_model(tmp_path: Path) -> None:
    config = _config(tmp_path, engine="vllm", vllm_push="adapter")
    start = tmp_path / "start"
    assert train_start(config, start) == (start, [])  # the first training: a fresh adapter
    assert train_start(config, tmp_path / "x" / ".." / "start") == (tmp_path / "x" / ".." / "start", [])
    policy = tmp_path / "iter-000" / "checkpoint"
    assert train_start(config, policy) == (start, ["--lora-init", str(policy / "adapter")])
    # Whole checkpoints (in place, restart, another engine): each training starts from the policy itself.
    for other in (_config(tmp_path, engine="vllm", vllm_push="in-place"), _config(tmp_path, engine="local")):
        assert train_start(other, policy) == (policy, [])


def _refusal(tmp_path: Path, *extra: str) -> str:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t", "instruction": "do"}\n')
    base = ["loop", str(tasks), "--harness", "cmd:true", "--model", str(tmp_path), "--iterations", "2", "--out",
            str(tmp_path / "o")]  # fmt: skip
    refused = CliRunner().invoke(app, [*base, *extra])
    assert refused.exit_code == 2, refused.output
    assert not (tmp_path / "o").exists()  # refused before anything ran
    return " ".join(refused.output.replace("│", " ").split())


def test_the_command_line_refuses_an_adapter_push_without_an_adapter_and_a_lora_init_of_its_own(
    tmp_path: Path,
) -> None:
    said = _refusal(tmp_path, "--engine", "vllm", "--vllm-push", "adapter", "--", "--lr", "1e-5")
    assert "--vllm-push adapter pushes a LoRA adapter: pass polar train's --lora-r N after --" in said
    said = _refusal(tmp_path, "--engine", "vllm", "--", "--lora-r", "8", "--lora-init", "a")
    assert "polar loop sets --lora-init of each training itself" in said
    said = _refusal(tmp_path, "--engine", "vllm", "--vllm-push", "swap")
    assert "in-place, restart or adapter" in said


def test_the_async_loops_trainings_go_on_from_the_policys_adapter_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from tests.test_async_loop_scheduler_units import _bare_loop, _fake_train

    loop = _bare_loop(tmp_path, tasks=[], engine="vllm", vllm_push="adapter", train_args=("--lora-r", "8"))
    calls = _fake_train(monkeypatch, "import sys, os; os.makedirs(sys.argv[1])")
    policy = tmp_path / "out" / "train-000" / "checkpoint"
    idir = tmp_path / "out" / "train-001"
    idir.mkdir()
    assert asyncio.run(loop._train([], policy, 1, idir)) == "trained"
    assert calls == [
        (
            [],
            tmp_path / "model",
            idir / "checkpoint",
            ["--lora-init", str(policy / "adapter"), "--lora-r", "8", "--current-weight-version", "1",
             "--max-staleness", "2"],
        )
    ]  # fmt: skip


def test_a_loop_whose_policy_checkpoint_is_gone_refuses_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from tests.test_loop_orchestration_units import Harness

    h = Harness(tmp_path, monkeypatch)
    h.kill.add("it002")
    with pytest.raises(KeyboardInterrupt):
        h.run(3)
    checkpoint = h.it(1) / "checkpoint"
    assert (checkpoint / "config.json").is_file()  # the policy iteration 2 samples
    shutil.rmtree(checkpoint)
    h.kill.clear()
    h.log.clear()
    with pytest.raises(ValueError) as refused:
        h.run(3)
    assert str(refused.value) == (
        f"the policy's checkpoint {checkpoint} is gone: the loop in {h.out} cannot resume; use another --out"
    )
    assert [e[0] for e in h.log] == ["pinned"]  # refused before the engine or anything else started
