"""`polar loop`'s engine across iterations (``loop._Engine``) and its held-out eval (``loop._evaluate``), in seconds.

The engine: which server is started with which arguments, when a new policy is a push (and what it records), what a
failed start or push leaves behind, the versions in the specs the proxies get, and the check that a vLLM server
really serves the policy its calls are tagged with. ``polar_cli.serving``'s entry points, ``GET /v1/models`` and the
clock are fakes; ``_Engine`` and ``served_root`` are the real code.

The eval: where it runs, what its rollout is asked for (held-out tasks, samples, seed, run id, proxy options), what it
writes (summary, report, progress file, all redacted), what it returns for loop.json, and an interrupted or killed
eval. ``run_rollout``, the engine, the writer-gone wait, the store's call statistics and the clock are fakes;
``_evaluate``, the progress file, the redaction and the scoring are the real code. The real ones run in test_loop.py,
test_loop_eval.py and the vLLM push tests (minutes each).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from polar_addon.store.status import SessionStatus
from polar_cli import serving
from polar_cli.eval.report import CallStats
from polar_cli.rollout import loop, loop_eval
from polar_cli.rollout.loop import LoopConfig, _Engine, _evaluate, served_root
from polar_cli.rollout.runner import RolloutInterrupted, RolloutResult
from polar_cli.rollout.session import SessionResult
from polar_cli.rollout.tasks import Task, task_set_hash

TASKS = [Task(id="t1", instruction="one")]
EVALS = [Task(id="e1", instruction="held out one"), Task(id="e2", instruction="held out two")]
TOKEN = "ctl-" + "5" * 40  # the proxy's control token: never in a file the eval writes
URL = "http://127.0.0.1:8123"
NO_CAUSE = dict.fromkeys(
    ("passed", "wrong", "verifier_error", "harness_failed", "timeout", "context_overflow", "infrastructure"), 0
)


def config(tmp_path: Path, **more: Any) -> LoopConfig:
    settings: dict[str, Any] = {"tasks": TASKS, "harness": "cmd:true", "model": tmp_path / "model", "iterations": 4}
    return LoopConfig(out=tmp_path / "out", **{**settings, **more})


# -- the engine ------------------------------------------------------------------------------------------------------


class Serving:
    """``polar_cli.serving`` as the loop's engine calls it, every call recorded; the model each port's state names."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 50.0
        self.calls: list[tuple[Any, ...]] = []
        self.said: list[str] = []
        self.held: dict[int, str] = {}  # port -> the model its state file names
        self.started: dict[int, serving.ManagedServer] = {}  # port -> the server started there (its push mode)
        self.fail: dict[str, Exception] = {}  # "serve" / "reload" -> raised by the next such call
        self.models: Any = None  # what GET /v1/models answers (None: nothing answers)
        monkeypatch.setattr(serving, "serve_vllm", self.serve_vllm)
        monkeypatch.setattr(serving, "reload_engine", self.reload_engine)
        monkeypatch.setattr(serving, "load_state", self.load_state)
        monkeypatch.setattr(serving, "label_version", self.label_version)
        monkeypatch.setattr(serving, "stop_engine", self.stop_engine)
        monkeypatch.setattr(httpx, "get", self.get)
        monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=lambda: self.now))
        monkeypatch.setattr(loop, "_free_port", lambda: 4999)

    def serve_vllm(self, model: str, **options: Any) -> serving.ManagedServer:
        self.calls.append(("serve", model, options))
        self.now += 20.0
        if "serve" in self.fail:
            raise self.fail.pop("serve")
        port = options["port"]
        self.held[port] = model
        self.started[port] = serving.ManagedServer(
            kind="vllm", port=port, model=model, served_model_name=options["served_model_name"], command=[],
            model_arg=0, env={}, log="", push=options["push"], lora_rank=options["lora_rank"],
        )  # fmt: skip
        return replace(self.started[port])

    def reload_engine(self, spec: str, checkpoint: Path, **options: Any) -> str:
        self.calls.append(("reload", spec, checkpoint, options))
        if "reload" in self.fail:
            self.now += 100.0
            raise self.fail.pop("reload")
        self.now += 2.5
        if spec.startswith("vllm:"):
            port = int(spec.split("?")[0].rsplit(":", 1)[1])
            self.held[port] = str(checkpoint)
            if self.started[port].push == "adapter":
                self.started[port].adapter = str(checkpoint / "adapter")
        return "reloaded"

    def load_state(self, state_dir: Path, port: int) -> serving.ManagedServer:
        self.calls.append(("state", state_dir, port))
        return replace(self.started[port], model=self.held[port])

    def label_version(self, url: str, version: str) -> None:
        self.calls.append(("label", url, version))

    def stop_engine(self, url: str, *, state_dir: Path) -> tuple[Any, bool]:
        self.calls.append(("stop", url, state_dir))
        return None, True

    def get(self, url: str, timeout: float) -> Any:
        self.calls.append(("get", url, timeout))
        if self.models is None:
            raise httpx.ConnectError("connection refused")
        return SimpleNamespace(json=lambda: self.models)


def test_a_local_engine_is_a_spec_per_policy_with_its_version_and_never_a_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    cfg = config(tmp_path)
    engine = _Engine(cfg, tmp_path / "state")
    assert (engine.config, engine.state_dir, engine.kind, engine.keep) == (cfg, tmp_path / "state", "local", False)
    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    assert engine.spec(model, s.said.append, 0) == f"local:{model}?weight_version=0"
    assert engine.serving == (model, 0)
    assert engine.spec(ckpt, s.said.append) == f"local:{ckpt}"  # no version: no tag
    assert engine.serving == (ckpt, None)
    assert engine.spec(ckpt, s.said.append, 12) == f"local:{ckpt}?weight_version=12"
    # The proxy loads the local engine: nothing is started, pushed, said or stopped here.
    engine.close()
    assert (engine.pushes, s.said, s.calls, engine.server) == ([], [], [], None)


def test_vllm_starts_once_on_the_first_policy_and_each_new_policy_or_version_is_a_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    state = tmp_path / "state"
    cfg = config(
        tmp_path, engine="vllm", vllm_port=8123, served_model_name="pol", vllm_args=("--max-model-len", "64"),
        train_args=("--lora-r", "8"),  # a LoRA training whose merged checkpoints are pushed: no adapter server
    )  # fmt: skip
    engine = _Engine(cfg, state)
    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    assert engine.spec(model, s.said.append, 0) == f"vllm:{URL}?weight_version=0"
    started = {
        "port": 8123, "served_model_name": "pol", "state_dir": state, "extra_args": ["--max-model-len", "64"],
        "dtype": "auto", "tie": True, "push": "in-place", "lora_rank": 0,
    }  # fmt: skip
    assert s.calls == [("serve", str(model), started), ("state", state, 8123)]
    assert type(s.calls[0][2]["extra_args"]) is list
    assert (s.said, engine.pushes, engine.serving) == ([f"starting vLLM on {model}"], [], (model, 0))
    # The same policy at the same version: nothing loaded, only the state read again (it names the policy).
    assert engine.spec(model, s.said.append, 0) == f"vllm:{URL}?weight_version=0"
    assert s.calls[2:] == [("state", state, 8123)] and len(s.said) == 1 and engine.pushes == []
    # A new checkpoint: loaded into the running server; the push is timed from the call (2.5 s of fake reload).
    assert engine.spec(ckpt, s.said.append, 1) == f"vllm:{URL}?weight_version=1"
    reload = {"state_dir": state, "tie": True, "weight_version": "1", "keep": False}
    assert s.calls[3:] == [("reload", f"vllm:{URL}", ckpt, reload), ("state", state, 8123)]
    assert s.said[1:] == [f"reloading vLLM with {ckpt} as version 1"]
    assert engine.pushes == [{"version": 1, "checkpoint": str(ckpt), "reload_s": 2.5}]
    assert engine.serving == (ckpt, 1)
    # The same checkpoint under another version is loaded again (its calls must carry the new version).
    assert engine.spec(ckpt, s.said.append, 2) == f"vllm:{URL}?weight_version=2"
    assert s.calls[5] == ("reload", f"vllm:{URL}", ckpt, {**reload, "weight_version": "2"})
    assert [p["version"] for p in engine.pushes] == [1, 2]
    # No version: no tag, and the reload labels none.
    assert engine.spec(model, s.said.append) == f"vllm:{URL}"
    assert s.calls[7] == ("reload", f"vllm:{URL}", model, {**reload, "weight_version": None})
    assert engine.pushes[-1] == {"version": None, "checkpoint": str(model), "reload_s": 2.5}
    assert not [c for c in s.calls if c[0] in ("label", "get")]  # no keep: no label; in place: no GET
    engine.close()
    assert s.calls[-1] == ("stop", URL, state) and engine.server is None
    engine.close()  # stopped once only
    assert [c[0] for c in s.calls].count("stop") == 1
    # A resumed loop's engine starts on its newest policy itself (whole checkpoints): no second load.
    s2 = Serving(monkeypatch)
    assert _Engine(cfg, state).spec(ckpt, s2.said.append, 3) == f"vllm:{URL}?weight_version=3"
    assert [c[:2] for c in s2.calls] == [("serve", str(ckpt)), ("state", state)]


def test_a_failed_start_or_push_changes_nothing_and_the_next_spec_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    engine = _Engine(config(tmp_path, engine="vllm", vllm_port=8123), tmp_path / "state")
    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    s.fail["serve"] = serving.EngineError("vLLM did not become ready")
    with pytest.raises(serving.EngineError, match="^vLLM did not become ready$"):
        engine.spec(model, s.said.append, 0)
    assert (engine.server, engine.serving, engine.pushes) == (None, None, [])
    assert engine.spec(model, s.said.append, 0) == f"vllm:{URL}?weight_version=0"  # started this time
    assert s.said == [f"starting vLLM on {model}"] * 2 and engine.pushes == []
    s.fail["reload"] = serving.EngineError("the reload failed")
    with pytest.raises(serving.EngineError, match="^the reload failed$"):
        engine.spec(ckpt, s.said.append, 1)
    # Not a push: the engine still serves the old policy, as far as the loop knows.
    assert (engine.serving, engine.pushes) == ((model, 0), [])
    assert engine.spec(ckpt, s.said.append, 1) == f"vllm:{URL}?weight_version=1"
    # Retried, and timed from the retry only (the failed try's 100 s are not in it).
    assert [c[0] for c in s.calls].count("reload") == 2
    assert engine.pushes == [{"version": 1, "checkpoint": str(ckpt), "reload_s": 2.5}]
    assert s.said[2:] == [f"reloading vLLM with {ckpt} as version 1"] * 2


def test_an_in_place_server_whose_state_names_another_model_refuses_the_version_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    engine = _Engine(config(tmp_path, engine="vllm", vllm_port=8123), tmp_path / "state")
    model = tmp_path / "model"
    (tmp_path / "sub").mkdir()
    engine.spec(model, s.said.append, 0)
    s.held[8123] = "/elsewhere/ckpt"  # a reload that loaded something else (or failed half way)
    with pytest.raises(RuntimeError) as refused:
        engine.spec(model, s.said.append, 0)
    assert str(refused.value) == (
        f"vLLM on {URL} serves /elsewhere/ckpt, not {model}: its calls cannot be tagged version 0"
    )
    # The same directory however it is written: the state's path, or the policy's, not resolved.
    s.held[8123] = str(tmp_path / "sub" / ".." / "model")
    assert engine.spec(model, s.said.append, 0) == f"vllm:{URL}?weight_version=0"
    s.held[8123] = str(model)
    assert engine.spec(tmp_path / "sub" / ".." / "model", s.said.append, 0) == f"vllm:{URL}?weight_version=0"


def test_a_restart_mode_server_is_asked_what_it_serves_on_a_free_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    state = tmp_path / "state"
    engine = _Engine(config(tmp_path, engine="vllm", vllm_push="restart"), state)
    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    free = "http://127.0.0.1:4999"
    s.models = {"data": [{"id": "policy", "root": str(model)}]}
    assert engine.spec(model, s.said.append, 0) == f"vllm:{free}?weight_version=0"
    assert s.calls[0][2]["port"] == 4999 and s.calls[0][2]["push"] == "restart"
    assert s.calls[0][2]["served_model_name"] == "policy" and s.calls[0][2]["extra_args"] == []
    # Restarted servers name the model they started on: asked over HTTP, never through the state file.
    assert s.calls[1:] == [("get", f"{free}/v1/models", 5.0)]
    with pytest.raises(RuntimeError) as refused:  # it says it still serves the model after the push
        engine.spec(ckpt, s.said.append, 1)
    assert str(refused.value) == f"vLLM on {free} serves {model}, not {ckpt}: its calls cannot be tagged version 1"
    assert s.calls[2][0] == "reload" and s.calls[2][3]["keep"] is False
    # A server that says nothing (no answer) is taken at its word that the push worked.
    s.models = None
    assert engine.spec(ckpt, s.said.append, 1) == f"vllm:{free}?weight_version=1"
    assert "state" not in [c[0] for c in s.calls]


def test_a_keep_engine_labels_its_first_version_and_asks_for_version_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    state = tmp_path / "state"
    engine = _Engine(config(tmp_path, engine="vllm", vllm_port=8123), state, keep=True)
    assert engine.keep is True
    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    assert engine.spec(model, s.said.append, 0) == f"vllm:{URL}?weight_version=0&versions=spans"
    assert [c[0] for c in s.calls] == ["serve", "label", "state"] and s.calls[1] == ("label", URL, "0")
    assert engine.spec(ckpt, s.said.append, 3) == f"vllm:{URL}?weight_version=3&versions=spans"
    assert s.calls[3] == ("reload", f"vllm:{URL}", ckpt, {"state_dir": state, "tie": True, "weight_version": "3",
                                                           "keep": True})  # fmt: skip
    assert engine.spec(model, s.said.append) == f"vllm:{URL}?versions=spans"
    assert [c[0] for c in s.calls].count("label") == 1  # pushes are labelled by the reload itself
    # Started without a version: nothing to label.
    s2 = Serving(monkeypatch)
    assert _Engine(config(tmp_path, engine="vllm", vllm_port=8123), state, keep=True).spec(model, s2.said.append) == (
        f"vllm:{URL}?versions=spans"
    )
    assert [c[0] for c in s2.calls] == ["serve", "state"]


def test_an_adapter_server_starts_on_the_starting_model_and_serves_each_policy_as_its_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    state = tmp_path / "state"
    train_args = ("--lr", "1e-5", "--lora-r", "16")
    cfg = config(tmp_path, engine="vllm", vllm_port=8123, vllm_push="adapter", served_model_name="pol",
                 train_args=train_args)  # fmt: skip
    engine = _Engine(cfg, state)
    model, ckpt = tmp_path / "model", tmp_path / "iter-000" / "checkpoint"
    # The first policy is the starting model: served as the base, no adapter asked for.
    assert engine.spec(model, s.said.append, 0) == f"vllm:{URL}?weight_version=0"
    assert s.calls[0] == ("serve", str(model), {
        "port": 8123, "served_model_name": "pol", "state_dir": state, "extra_args": [], "dtype": "auto",
        "tie": True, "push": "adapter", "lora_rank": 16,
    })  # fmt: skip
    assert s.calls[1:] == [("state", state, 8123)] and s.said == [f"starting vLLM on {model}"]
    # A trained policy: its adapter loaded over the base, and the proxies ask for the adapter by name.
    assert engine.spec(ckpt, s.said.append, 1) == f"vllm:{URL}?model=pol-adapter&weight_version=1"
    assert s.calls[2] == ("reload", f"vllm:{URL}", ckpt, {"state_dir": state, "tie": True, "weight_version": "1",
                                                           "keep": False})  # fmt: skip
    assert engine.pushes == [{"version": 1, "checkpoint": str(ckpt), "reload_s": 2.5}]
    # A resumed loop whose policy is trained: the server still starts on the starting model, then loads the
    # policy's adapter. That first load is no push, and the server is not labelled with the policy's version.
    s2 = Serving(monkeypatch)
    resumed = _Engine(cfg, state, keep=True)
    assert resumed.spec(ckpt, s2.said.append, 2) == f"vllm:{URL}?model=pol-adapter&weight_version=2&versions=spans"
    assert [c[0] for c in s2.calls] == ["serve", "reload", "state"] and s2.calls[0][1] == str(model)
    assert s2.calls[1][3] == {"state_dir": state, "tie": True, "weight_version": "2", "keep": True}
    assert s2.said == [f"starting vLLM on {model}", f"reloading vLLM with {ckpt} as version 2"]
    assert (resumed.pushes, resumed.serving) == ([], (ckpt, 2))


def test_sglang_loads_each_new_policy_in_place_and_its_first_load_is_no_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Serving(monkeypatch)
    state = tmp_path / "state"
    engine = _Engine(config(tmp_path, engine="sglang:http://10.0.0.1:30000"), state)
    assert engine.kind == "sglang"
    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    sg = "sglang:http://10.0.0.1:30000"
    assert engine.spec(model, s.said.append, 0) == f"{sg}?weight_version=0"
    assert s.calls == [("reload", sg, model, {"state_dir": state, "weight_version": "0"})]
    assert s.said == [f"loading {model} into SGLang http://10.0.0.1:30000 (update_weights_from_disk) as version 0"]
    assert (engine.pushes, engine.serving) == ([], (model, 0))
    assert engine.spec(model, s.said.append, 0) == f"{sg}?weight_version=0"
    assert len(s.calls) == 1 and len(s.said) == 1  # already serving it
    assert engine.spec(ckpt, s.said.append, 1) == f"{sg}?weight_version=1"
    assert engine.pushes == [{"version": 1, "checkpoint": str(ckpt), "reload_s": 2.5}]
    assert engine.spec(ckpt, s.said.append) == sg
    assert s.calls[-1] == ("reload", sg, ckpt, {"state_dir": state, "weight_version": None})
    assert s.said[-1] == f"loading {ckpt} into SGLang http://10.0.0.1:30000 (update_weights_from_disk) as version None"
    assert engine.pushes[-1] == {"version": None, "checkpoint": str(ckpt), "reload_s": 2.5}
    engine.close()  # a server the loop did not start is not stopped
    assert [c[0] for c in s.calls] == ["reload"] * 3


def test_served_root_reads_the_first_model_s_root_and_none_for_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Serving(monkeypatch)
    s.models = {"data": [{"id": "a", "root": "/m/a"}, {"id": "b", "root": "/m/b"}]}
    assert served_root("http://h:1/") == "/m/a"
    assert served_root("http://GPU-BOX/") == "/m/a"  # only the slash goes, never the host's last letters
    assert s.calls == [("get", "http://h:1/v1/models", 5.0), ("get", "http://GPU-BOX/v1/models", 5.0)]
    for answer in ({"data": [{"id": "a"}]}, {"data": [{"id": "a", "root": 7}]}, {"data": []}, {}, [], {"data": [3]}):
        s.models = answer
        assert served_root("http://h:1") is None, answer
    s.models = None  # nothing answers
    assert served_root("http://h:1") is None

    def not_json() -> Any:
        raise ValueError("not JSON")

    monkeypatch.setattr(httpx, "get", lambda url, timeout: SimpleNamespace(json=not_json))
    assert served_root("http://h:1") is None


# -- the held-out eval -----------------------------------------------------------------------------------------------


class Eval:
    """``_evaluate`` on a fake engine and rollout: each held-out task's sessions get the rewards in ``rewards``."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **more: Any) -> None:
        self.now = 1000.0
        self.log: list[tuple[Any, ...]] = []
        self.said: list[str] = []
        self.rollouts: list[Any] = []
        self.rewards = {"e1": [1.0, 0.0, 0.5], "e2": [0.0, 0.0, 0.0]}
        self.interrupt: str | None = None
        self.kill = False
        self.scratch = True  # whether the rollout leaves a work/ scratch directory (a Ray node's is on that node)
        self.failed: dict[str, str] = {}  # session id -> why it failed (the harness's output, the agent's to choose)
        settings: dict[str, Any] = {
            "samples": 2, "seed": 5, "eval_tasks": EVALS, "eval_samples": 3, "proxy_options": {"a": "1", "b": "2"},
            "eval_proxy_options": {"b": "3", "c": "4"},
        }  # fmt: skip
        self.config = config(tmp_path, **{**settings, **more})
        self.config.out.mkdir(parents=True)
        h = self

        class Engine:
            def spec(self, policy: Path, progress: Any, version: int | None = None) -> str:
                h.log.append(("spec", policy, version))
                progress(f"push of {policy}")
                h.now += 3.0  # the push: not part of the eval's time
                return f"fake:{policy}?weight_version={version}"

        self.engine = Engine()

        async def run_rollout(rollout: Any) -> RolloutResult:
            h.log.append(("rollout", rollout.run_id))
            h.rollouts.append(rollout)
            assert rollout.progress is not None
            if h.scratch:
                rollout.work_dir.mkdir(parents=True)  # the scratch a rollout leaves behind
            Path(rollout.out).mkdir(parents=True)
            (Path(rollout.out) / ".control-token").write_text(TOKEN + "\n")
            rollout.progress.errors.append(("s0", f"the harness printed {TOKEN}"))
            if h.kill:
                raise KeyboardInterrupt
            started = h.now
            h.now += 10.0
            sessions = [
                SessionResult(f"{rollout.run_id}-{t.id}-{n}", t.id, t.id, n, SessionStatus.COMPLETED, reward=r)
                for t in rollout.tasks
                for n, r in enumerate(h.rewards[t.id])
            ]
            for s in sessions:
                if s.session_id in h.failed:
                    s.status, s.reward, s.reason = SessionStatus.FAILED, None, h.failed[s.session_id]
            return RolloutResult(
                f"{rollout.run_id} {TOKEN}", sessions, started, h.now, rollout.out, 4096, 512, h.interrupt
            )

        def call_stats(store: str, session_ids: list[str]) -> dict[str, CallStats]:
            h.log.append(("call stats", store, list(session_ids)))
            return {s: CallStats(calls=2, tool_call_turns=1) for s in session_ids}

        def writer_gone(log_dir: Path) -> None:
            h.log.append(("writer gone", log_dir, sorted(p.name for p in log_dir.parent.glob("*"))))

        monkeypatch.setattr(loop, "run_rollout", run_rollout)
        monkeypatch.setattr(loop, "wait_writer_gone", writer_gone)
        monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=lambda: h.now))
        monkeypatch.setattr(loop_eval, "read_call_stats", call_stats)

    def run(self, i: int, policy: Path, version: int) -> dict[str, Any]:
        return _evaluate(self.config, i, policy, self.engine, self.said.append, version)  # type: ignore[arg-type]

    def edir(self, i: int) -> Path:
        return self.config.out / "eval" / f"iter-{i:03d}"


def files_under(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): p.read_text() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_eval_samples_the_held_out_tasks_on_the_policy_and_returns_its_loop_json_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Eval(tmp_path, monkeypatch)
    ckpt = tmp_path / "out" / "iter-001" / "checkpoint"
    edir = h.edir(2)
    entry = h.run(2, ckpt, 1)  # OUT/eval/ does not exist yet
    ids = [f"ev002-{t}-{n}" for t in ("e1", "e2") for n in range(3)]
    assert h.log == [
        ("writer gone", edir / "logs", []),
        ("spec", ckpt, 1),
        ("rollout", "ev002"),
        ("call stats", str(edir / "shards"), ids),
    ]
    assert h.said == [f"push of {ckpt}", f"iteration 2: held-out eval of 2 tasks x 3 samples on {ckpt}"]
    (r,) = h.rollouts
    assert (r.tasks, r.samples, r.seed, r.run_id, r.engine) == (EVALS, 3, 7, "ev002", f"fake:{ckpt}?weight_version=1")
    assert (r.out, r.logs_dir, r.work_dir) == (str(edir / "shards"), edir / "logs", edir / "work")
    assert r.proxy_options == {"a": "1", "b": "3", "c": "4"}  # the eval's options over the rollouts'
    assert (r.harness, r.model) == ("cmd:true", "policy")
    # threshold 1.0: e1 passes 1 of 3 (0.5 is wrong), e2 none; pass@3 is e1's 1 and e2's 0.
    assert {k: entry[k] for k in ("iteration", "policy", "version", "tasks", "scored_tasks", "sessions")} == {
        "iteration": 2, "policy": str(ckpt), "version": 1, "tasks": 2, "scored_tasks": 2, "sessions": 6,
    }  # fmt: skip
    assert entry["pass@1"] == pytest.approx(1 / 6) and entry["pass@1_se"] == pytest.approx(1 / 6)
    assert list(entry["overall"]) == ["pass@1", "pass@3"] and entry["overall"]["pass@3"]["mean"] == 0.5
    assert (entry["scored_sessions"], entry["causes"]) == (6, {**NO_CAUSE, "passed": 1, "wrong": 5})
    assert entry["seconds"] == 10.0  # the rollout's time, not the push's
    assert entry["report"] == str(edir / "eval-report.json")
    assert set(entry) == {
        "iteration", "policy", "version", "pass@1", "pass@1_se", "overall", "tasks", "scored_tasks", "sessions",
        "scored_sessions", "causes", "format", "seconds", "report",
    }  # fmt: skip
    # Its directory: the scratch gone, the summary, the report and the final progress file, never the token.
    files = files_under(edir)
    assert sorted(files) == [
        "eval-report.json", "rollout-progress.json", "rollout-summary.json", "shards/.control-token",
    ]  # fmt: skip
    assert all(TOKEN not in text for name, text in files.items() if name.endswith(".json"))
    summary = json.loads(files["rollout-summary.json"])
    assert summary["run_id"] == "ev002 <redacted>" and summary["store"] == str(edir / "shards")
    assert (summary["sessions"], summary["seconds"], summary["context_window"]) == (6, 10.0, 4096)
    progress = json.loads(files["rollout-progress.json"])
    assert progress["final"] is True and progress["errors"] == [["s0", "the harness printed <redacted>"]]
    report = json.loads(files["eval-report.json"])
    assert {k: report[k] for k in ("iteration", "policy", "version", "task_set_hash", "rollout_summary")} == {
        "iteration": 2, "policy": str(ckpt), "version": 1, "task_set_hash": task_set_hash(EVALS),
        "rollout_summary": str(edir / "rollout-summary.json"),
    }  # fmt: skip
    assert task_set_hash(EVALS) != task_set_hash(TASKS)
    assert (report["ks"], report["pass_threshold"], report["causes"]) == (
        [1, 3],
        1.0,
        {**NO_CAUSE, "passed": 1, "wrong": 5},
    )
    assert [s["session_id"] for s in report["sessions"]] == ids
    assert report["sessions"][0]["calls"]["calls"] == 2  # the store's call statistics are in it


def test_a_half_done_eval_is_redone_whole_with_the_rollouts_samples_options_and_a_lower_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Eval(tmp_path, monkeypatch, eval_samples=None, eval_proxy_options={}, eval_pass_threshold=0.5)
    h.rewards = {"e1": [1.0, 0.5], "e2": [0.25, 0.0]}
    h.failed = {"ev000-e2-1": f"exit 1: {TOKEN}"}  # the harness printed the token: its report shows it redacted
    edir = h.edir(0)
    (edir / "shards").mkdir(parents=True)
    (edir / "shards" / "old.parquet").write_text("a killed eval's shard")
    entry = h.run(0, tmp_path / "model", 0)
    assert h.log[0] == ("writer gone", edir / "logs", ["shards"])  # waited for before the old directory went
    assert not (edir / "shards" / "old.parquet").exists()
    (r,) = h.rollouts
    assert (r.samples, r.seed, r.run_id, r.proxy_options) == (2, 5, "ev000", {"a": "1", "b": "2"})
    assert h.said[1] == f"iteration 0: held-out eval of 2 tasks x 2 samples on {tmp_path / 'model'}"
    assert (entry["pass@1"], list(entry["overall"])) == (0.5, ["pass@1", "pass@2"])
    assert entry["causes"] == {**NO_CAUSE, "passed": 2, "wrong": 1, "harness_failed": 1}
    report = json.loads((edir / "eval-report.json").read_text())
    assert report["pass_threshold"] == 0.5
    assert [s["reason"] for s in report["sessions"]] == [None, None, None, "exit 1: <redacted>"]


def test_an_interrupted_eval_keeps_its_summary_and_writes_no_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Eval(tmp_path, monkeypatch)
    h.interrupt = "SIGTERM"
    edir = h.edir(1)
    with pytest.raises(RolloutInterrupted) as stopped:
        h.run(1, tmp_path / "model", 0)
    assert str(stopped.value) == f"iteration 1: held-out eval interrupted by SIGTERM (summary in {edir})"
    assert stopped.value.signal_name == "SIGTERM"
    assert sorted(files_under(edir)) == ["rollout-progress.json", "rollout-summary.json", "shards/.control-token"]
    assert json.loads((edir / "rollout-summary.json").read_text())["interrupted"] == "SIGTERM"


def test_a_killed_eval_still_removes_its_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Eval(tmp_path, monkeypatch)
    h.kill = True
    with pytest.raises(KeyboardInterrupt):
        h.run(1, tmp_path / "model", 0)
    assert sorted(files_under(h.edir(1))) == ["rollout-progress.json", "shards/.control-token"]
    assert not (h.edir(1) / "work").exists()


def test_a_ray_loop_evaluates_on_the_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from polar_cli.rollout import ray_backend

    h = Eval(tmp_path, monkeypatch, ray="10.0.0.1:6379", ray_resource="polar")
    h.scratch = False  # the sessions' scratch is on the nodes: none here to remove
    local = loop.run_rollout
    asked: list[Any] = []

    async def run_rollout_ray(rollout: Any, options: Any) -> RolloutResult:
        asked.append(options)
        return await local(rollout)

    async def refuse(rollout: Any) -> RolloutResult:
        raise AssertionError("a --ray loop ran an eval on this machine")

    monkeypatch.setattr(ray_backend, "run_rollout_ray", run_rollout_ray)
    monkeypatch.setattr(loop, "run_rollout", refuse)
    assert h.run(0, tmp_path / "model", 0)["sessions"] == 6
    assert asked == [ray_backend.RayOptions("10.0.0.1:6379", "polar")]
