"""`accelerate launch` with 2 CPU processes (gloo DDP) trains exactly like one process (the multi-GPU path),
and `accelerate launch polar train STORE` trains on a captured store, each process on its own traces.

Plain SGD makes the update proportional to the gradient, so a wrong loss normalisation across
processes (e.g. a gradient twice too large) would show in the weights; Adam's first step would hide it.
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import torch

from polar_cli.trace import traces_to_table
from tests.support.train_traces import TraceFactory, two_group_specs

REPO = Path(__file__).resolve().parent.parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
COMMON = ["--max-steps", "2", "--lr", "0.05", "--optim", "sgd", "--weight-decay", "0", "--groups-per-step", "2",
          "--grad-accum", "2", "--no-progress", "--no-plot"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str]) -> str:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def logs(out: Path) -> list[dict]:
    return [r for r in map(orjson.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_two_cpu_processes_train_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    data = tmp_path / "traces"
    data.mkdir()
    traces = TraceFactory(tiny_model_dir, temperature=1.0, seed=3).traces(two_group_specs())
    pq.write_table(traces_to_table(traces), data / "part-0.parquet")
    # --clip-against start: each process scores its share of the traces with the starting weights and all gather
    # the table (the second step clips against it).
    train = ["-m", "polar_cli.app", "train", str(data), "--model", str(tiny_model_dir), "--clip-against", "start"]

    one = run([sys.executable, *train, "--output", str(tmp_path / "one"), *COMMON])
    two = run([
        # --multi_gpu picks accelerate's torchrun launcher; --cpu would start one process (it wants mpirun).
        str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        *train, "--output", str(tmp_path / "two"), *COMMON,
    ])  # fmt: skip
    assert "on 1 process" in one and "on 2 processes" in two

    a, b = logs(tmp_path / "one"), logs(tmp_path / "two")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", "reward", "tokens/trainable", "is_ratio/mean", "clip_ratio/region_mean"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key
    w1, w2, w0 = (load_file(p / "model.safetensors") for p in (tmp_path / "one", tmp_path / "two", tiny_model_dir))
    moved = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
    assert moved > 1e-3  # the step really changed the weights
    for k in w0:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_accelerate_launch_trains_a_captured_store_each_process_on_its_own_traces(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The multi-process path users run: `accelerate launch ... $(which polar) train SHARDS` on a real capture (the toy
    task's agent through mitmdump, as tests/test_train_cli.py builds it), 2 gloo processes."""
    sys.path.insert(0, str(REPO / "examples" / "toy_task"))
    from collect import collect

    shards = tmp_path / "capture" / "shards"
    collect(tiny_model_dir, shards, groups=2, samples=3, turns=2, max_tokens=8)
    out = tmp_path / "ckpt"
    logged = run([
        str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(Path(sys.executable).parent / "polar"), "train", str(shards), "--model", str(tiny_model_dir),
        "--output", str(out),
        "--max-steps", "2", "--groups-per-step", "2", "--grad-accum", "1", "--lr", "1e-3", "--eot-token-id", "2",
        "--keep-zero-advantage", "--no-progress", "--no-plot", "--verbose",
    ])  # fmt: skip
    assert "on 2 processes" in logged and f"checkpoint: {out}" in logged
    shares: dict[tuple[int, int], set[str]] = {}
    for rank, step, traces in re.findall(r"polar\.train: process (\d) of 2, step (\d+): traces (.*)", logged):
        shares[int(step), int(rank)] = set(traces.split())
    assert {step for step, _ in shares} == {0, 1}
    for step in (0, 1):
        mine, theirs = shares[step, 0], shares[step, 1]
        assert mine and theirs and not mine & theirs, (step, mine, theirs)  # each process its own share of the step
    steps = logs(out)
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)
    from safetensors.torch import load_file

    trained, start = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert max(float((trained[k] - start[k]).abs().max()) for k in start) > 0  # the checkpoint holds the update
