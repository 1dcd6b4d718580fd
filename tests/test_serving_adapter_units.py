"""`polar engine serve --push adapter` without vLLM: the server it starts (runtime LoRA loading, a rank vLLM
accepts), which checkpoints' adapters it loads in place and which it refuses (none saved, a rank above the
server's, trained over another base: an adapter over the wrong base is another policy), the requests a push makes
against a fake server (the adapter loaded in place under its own name, the prefix cache dropped, the version set,
generation always resumed), the spec proxies then sample it with, and the restart that keeps the base."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from polar_cli import serving
from polar_cli.serving import (
    ADAPTER_DIR,
    EngineError,
    InPlaceRefused,
    ManagedServer,
    _proc_start_time,
    adapter_refusal,
    load_state,
    max_lora_rank,
    port_of,
    reload_engine,
    reload_vllm_in_place,
    restart_vllm,
    save_state,
)
from tests import test_serving_units as units
from tests.test_serving_units import FakeEngine, _checkpoint, socket_closed

# The fake engine, the launch-free serve and the POST timeouts of the serving units.
engine, no_process, timeouts = units.engine, units.no_process, units.timeouts


def _adapter_checkpoint(tmp_path: Path, base: Path, name: str = "ckpt", rank: int = 8) -> Path:
    ckpt = _checkpoint(tmp_path, name)
    (ckpt / ADAPTER_DIR).mkdir()
    config = {"r": rank, "lora_alpha": 2 * rank, "base_model_name_or_path": str(base), "peft_type": "LORA"}
    (ckpt / ADAPTER_DIR / "adapter_config.json").write_text(json.dumps(config))
    return ckpt


def _adapter_server(tmp_path: Path, port: int, base: Path, rank: int = 8, running: bool = True) -> ManagedServer:
    server = ManagedServer(
        kind="vllm", port=port, model=str(base), served_model_name="pol",
        command=["py", "-m", "vllm", "--model", str(base), "--enable-lora"], model_arg=4, env={},
        log=str(tmp_path / f"engine-{port}.log"), pid=os.getpid() if running else 0,
        start_time=(_proc_start_time(os.getpid()) or 0) if running else 0, history=[str(base)], push="adapter",
        lora_rank=rank,
    )  # fmt: skip
    save_state(server, tmp_path / "state")
    return server


def test_vllm_is_asked_for_the_smallest_lora_rank_it_accepts_that_fits() -> None:
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 300, 320, 321, 512)] == [
        1, 8, 8, 16, 16, 32, 320, 320, 512, 512,
    ]  # fmt: skip
    with pytest.raises(EngineError, match="^vLLM loads LoRA adapters of rank up to 512, not 513$"):
        max_lora_rank(513)


def test_serve_adapter_turns_on_runtime_lora_loading_and_the_in_place_endpoints(
    tmp_path: Path, no_process: list
) -> None:
    model = _checkpoint(tmp_path, "m1")
    with socket_closed() as url:
        port = port_of(url)
    server = serving.serve_vllm(
        str(model), port=port, state_dir=tmp_path / "s", python="py", push="adapter", lora_rank=12,
        served_model_name="pol", extra_args=["--max-loras", "2"],
    )  # fmt: skip
    assert server.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and server.env["VLLM_SERVER_DEV_MODE"] == "1"
    tail = server.command[-8:]
    # polar's LoRA flags come before the user's, whose --max-loras then wins (argparse keeps the last).
    assert tail == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1", "--max-loras", "2",
                    "--enable-scale-out"]  # fmt: skip
    assert (server.push, server.lora_rank, server.adapter) == ("adapter", 16, None)
    assert server.spec == f"vllm:http://127.0.0.1:{port}"  # the base until an adapter is loaded
    assert load_state(tmp_path / "s", port) == server
    with pytest.raises(EngineError, match=r"^--push adapter needs the rank of the LoRA adapters it will load"):
        serving.serve_vllm(str(model), port=port, state_dir=tmp_path / "t", python="py", push="adapter")
    rank_one = serving.serve_vllm(
        str(model), port=port, state_dir=tmp_path / "v", python="py", push="adapter", lora_rank=1
    )
    assert rank_one.lora_rank == 1 and "--max-lora-rank 1 " in " ".join(rank_one.command)
    # Other push modes record no rank (an in-place server loads whole checkpoints).
    server = serving.serve_vllm(
        str(model), port=port, state_dir=tmp_path / "u", python="py", push="in-place", lora_rank=8
    )
    assert server.lora_rank == 0 and "--enable-lora" not in server.command


def test_an_adapter_is_refused_without_one_above_the_rank_or_over_another_base(tmp_path: Path) -> None:
    base = _checkpoint(tmp_path, "base")
    server = _adapter_server(tmp_path, 8200, base, rank=16)
    assert adapter_refusal(_adapter_checkpoint(tmp_path, base, "ok", rank=16), server) is None
    # The base named by another spelling of the same directory is the same base.
    assert adapter_refusal(_adapter_checkpoint(tmp_path, base / ".." / "base", "dots"), server) is None
    plain = _checkpoint(tmp_path, "plain")
    assert adapter_refusal(plain, server) == (
        f"it holds no LoRA adapter (`polar train --lora-r` saves one in {plain / ADAPTER_DIR})"
    )
    high = _adapter_checkpoint(tmp_path, base, "high", rank=17)
    assert adapter_refusal(high, server) == "its adapter's rank 17 is above the server's --max-lora-rank 16"
    other = _checkpoint(tmp_path, "other")
    moved = _adapter_checkpoint(tmp_path, other, "moved")
    assert adapter_refusal(moved, server) == (
        f"its adapter was trained on {other}, but the server's base model is {base}"
    )
    unnamed = _adapter_checkpoint(tmp_path, base, "unnamed")
    config = json.loads((unnamed / ADAPTER_DIR / "adapter_config.json").read_text())
    del config["base_model_name_or_path"]
    (unnamed / ADAPTER_DIR / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_refusal(unnamed, server) == (
        f"its adapter was trained on None, but the server's base model is {base}"
    )
    (unnamed / ADAPTER_DIR / "adapter_config.json").write_text("{not json")
    assert adapter_refusal(unnamed, server).startswith("it holds no LoRA adapter")


def test_an_adapter_push_swaps_the_adapter_resets_and_labels(
    tmp_path: Path, engine: FakeEngine, timeouts: list
) -> None:
    base = _checkpoint(tmp_path, "base")
    _adapter_server(tmp_path, engine.port, base)
    first, second = _adapter_checkpoint(tmp_path, base, "first"), _adapter_checkpoint(tmp_path, base, "second")
    server = reload_vllm_in_place(engine.url, str(first), state_dir=tmp_path / "state", weight_version="1", timeout_s=9)
    load = {"lora_name": "pol-adapter", "lora_path": str(first / ADAPTER_DIR)}
    # The first adapter: nothing to unload. Never load_inplace (vLLM would re-read it from disk at every step).
    assert engine.seen == [
        ("POST", "/v1/load_lora_adapter", {}, load),
        ("POST", "/reset_prefix_cache", {"reset_running_requests": "false"}, None),
        ("POST", "/update_weight_version", {}, {"new_version": "1"}),
    ]
    assert [t for _, t in timeouts] == [9] * 3
    assert (server.adapter, server.model, server.weight_version) == (str(first / ADAPTER_DIR), str(first), "1")
    assert server.command[server.model_arg] == str(base)  # the base stays
    assert server.spec == f"vllm:{engine.url}?model=pol-adapter"
    assert load_state(tmp_path / "state", engine.port) == server
    assert Path(server.log).read_text() == f"\n--- polar engine reload: {first} (in place: its adapter)\n"
    engine.seen.clear()
    server = reload_vllm_in_place(engine.url, str(second), state_dir=tmp_path / "state", weight_version="2")
    assert engine.paths() == ["/v1/unload_lora_adapter", "/v1/load_lora_adapter", "/reset_prefix_cache",
                              "/update_weight_version"]  # fmt: skip
    assert engine.seen[0][3] == {"lora_name": "pol-adapter"}
    assert engine.seen[1][3] == {"lora_name": "pol-adapter", "lora_path": str(second / ADAPTER_DIR)}
    assert (server.adapter, server.weight_version) == (str(second / ADAPTER_DIR), "2")
    # An adapter the server lost (404 on the unload) is simply loaded.
    engine.seen.clear()
    engine.answers["/v1/unload_lora_adapter"] = (404, {"error": {"message": "cannot be found"}})
    reload_vllm_in_place(engine.url, str(first), state_dir=tmp_path / "state")
    assert engine.paths() == ["/v1/unload_lora_adapter", "/v1/load_lora_adapter", "/reset_prefix_cache"]
    assert load_state(tmp_path / "state", engine.port).adapter == str(first / ADAPTER_DIR)


def test_an_adapter_push_with_requests_kept_is_refused_before_any_request(tmp_path: Path, engine: FakeEngine) -> None:
    base = _checkpoint(tmp_path, "base")
    _adapter_server(tmp_path, engine.port, base)
    with pytest.raises(InPlaceRefused, match=r"^requests running on a LoRA adapter cannot go on with another"):
        reload_vllm_in_place(
            engine.url, str(_adapter_checkpoint(tmp_path, base)), state_dir=tmp_path / "state", keep=True
        )
    assert engine.seen == []
    # An adapter that would be refused anyway says why it is refused first.
    with pytest.raises(InPlaceRefused, match="holds no LoRA adapter"):
        reload_vllm_in_place(engine.url, str(_checkpoint(tmp_path, "plain")), state_dir=tmp_path / "state", keep=True)


def test_a_refused_adapter_makes_no_request_and_a_failed_swap_leaves_the_base_alone(
    tmp_path: Path, engine: FakeEngine
) -> None:
    base = _checkpoint(tmp_path, "base")
    _adapter_server(tmp_path, engine.port, base)
    first = _adapter_checkpoint(tmp_path, base, "first")
    reload_vllm_in_place(engine.url, str(first), state_dir=tmp_path / "state", weight_version="1")
    engine.seen.clear()
    with pytest.raises(InPlaceRefused, match="holds no LoRA adapter"):
        reload_vllm_in_place(engine.url, str(_checkpoint(tmp_path, "plain")), state_dir=tmp_path / "state")
    assert engine.seen == []
    engine.answers["/v1/load_lora_adapter"] = (400, {"error": {"message": "bad adapter"}})
    second = _adapter_checkpoint(tmp_path, base, "second")
    with pytest.raises(EngineError, match="(?s)could not reload .* in place: .*bad adapter"):
        reload_vllm_in_place(engine.url, str(second), state_dir=tmp_path / "state", weight_version="2")
    assert engine.paths() == ["/v1/unload_lora_adapter", "/v1/load_lora_adapter"]
    state = load_state(tmp_path / "state", engine.port)
    # The old adapter was unloaded: the base alone answers, under its own name, with no known version.
    assert (state.adapter, state.model, state.weight_version) == (None, str(base), None)
    assert state.spec == f"vllm:{engine.url}"
    assert (
        Path(state.log)
        .read_text()
        .endswith(f"--- polar engine reload: {base} (its adapter unloaded, the next one not loaded)\n")
    )
    # A failed unload (not a 404) leaves the old adapter as it was.
    engine.answers["/v1/unload_lora_adapter"] = (500, {})
    engine.answers.pop("/v1/load_lora_adapter")
    reload_vllm_in_place(engine.url, str(first), state_dir=tmp_path / "state")  # no adapter: no unload
    engine.seen.clear()
    with pytest.raises(EngineError, match="500"):
        reload_vllm_in_place(engine.url, str(second), state_dir=tmp_path / "state")
    assert engine.paths() == ["/v1/unload_lora_adapter"]
    state = load_state(tmp_path / "state", engine.port)
    assert (state.adapter, state.model) == (str(first / ADAPTER_DIR), str(first))


def test_reload_engine_loads_an_adapter_and_names_the_spec_that_samples_it(tmp_path: Path, engine: FakeEngine) -> None:
    base = _checkpoint(tmp_path, "base")
    _adapter_server(tmp_path, engine.port, base)
    ckpt = _adapter_checkpoint(tmp_path, base)
    line = reload_engine(f"vllm:{engine.url}", ckpt, state_dir=tmp_path / "state")
    assert line == (
        f"vllm {engine.url}: loaded {ckpt.resolve()}'s adapter in place as 'pol-adapter'; proxies sample its "
        f"adapter with --engine 'vllm:{engine.url}?model=pol-adapter'"
    )
    line = reload_engine(f"vllm:{engine.url}", ckpt, state_dir=tmp_path / "state", weight_version="4")
    assert line.endswith(
        f"; proxies tag its calls with --engine 'vllm:{engine.url}?model=pol-adapter&weight_version=4'"
    )


def test_a_failed_adapter_push_restarts_on_the_base_with_the_adapter_or_on_a_checkpoint_without_one(
    tmp_path: Path, engine: FakeEngine, no_process: list
) -> None:
    base = _checkpoint(tmp_path, "base")
    _adapter_server(tmp_path, engine.port, base)
    ckpt = _adapter_checkpoint(tmp_path, base)
    engine.answers["/v1/load_lora_adapter"] = (500, {})
    line = reload_engine(f"vllm:{engine.url}", ckpt, state_dir=tmp_path / "state")
    adapter = str(ckpt.resolve() / ADAPTER_DIR)
    assert line.startswith(
        f"vllm {engine.url}: restarted as 'pol' with {ckpt.resolve()}'s adapter as 'pol-adapter' (pid 4242) "
        "(the in-place reload failed, so it was restarted:"
    )
    state = load_state(tmp_path / "state", engine.port)
    assert state.command == ["py", "-m", "vllm", "--model", str(base), "--enable-lora", "--lora-modules",
                             f"pol-adapter={adapter}"]  # fmt: skip
    assert (state.adapter, state.model) == (adapter, str(ckpt.resolve()))
    # The next restart replaces the adapter loaded at start; a checkpoint with none is served whole instead.
    state.pid, state.start_time = os.getpid(), _proc_start_time(os.getpid())  # running again
    save_state(state, tmp_path / "state")
    plain = _checkpoint(tmp_path, "plain")
    line = reload_engine(f"vllm:{engine.url}", plain, state_dir=tmp_path / "state")
    assert "(not in place: it holds no LoRA adapter" in line
    state = load_state(tmp_path / "state", engine.port)
    assert state.command == ["py", "-m", "vllm", "--model", str(plain.resolve()), "--enable-lora"]
    assert state.adapter is None and state.spec == f"vllm:{engine.url}"
    # A requests-kept push never restarts.
    with pytest.raises(InPlaceRefused):
        reload_engine(f"vllm:{engine.url}", plain, state_dir=tmp_path / "state", keep=True)


def test_a_restart_removes_any_adapter_given_at_start(tmp_path: Path, no_process: list) -> None:
    base = _checkpoint(tmp_path, "base")
    server = _adapter_server(tmp_path, 8201, base)
    server.command += ["--lora-modules=x=/y", "--seed", "1", "--lora-modules", "a=/b", "--max-loras", "1"]
    save_state(server, tmp_path / "state")
    restarted = restart_vllm(server.url, "/c", state_dir=tmp_path / "state", adapter="/c/adapter")
    assert restarted.command == ["py", "-m", "vllm", "--model", str(base), "--enable-lora", "--seed", "1",
                                 "--max-loras", "1", "--lora-modules", "pol-adapter=/c/adapter"]  # fmt: skip
    assert Path(restarted.log).read_text() == "\n--- polar engine reload: /c (restarted with its adapter /c/adapter)\n"
    restarted = restart_vllm(server.url, "/d", state_dir=tmp_path / "state")
    assert Path(restarted.log).read_text().endswith("\n--- polar engine reload: /d\n")


def test_a_load_or_reload_answered_404_fails_the_push(tmp_path: Path, engine: FakeEngine) -> None:
    base = _checkpoint(tmp_path, "base")
    _adapter_server(tmp_path, engine.port, base)
    engine.answers["/v1/load_lora_adapter"] = (404, {"error": {"message": "not found"}})
    with pytest.raises(EngineError, match="404"):
        reload_vllm_in_place(engine.url, str(_adapter_checkpoint(tmp_path, base)), state_dir=tmp_path / "state")
    assert load_state(tmp_path / "state", engine.port).adapter is None
    server = _adapter_server(tmp_path, engine.port, base)
    server.push = "in-place"
    save_state(server, tmp_path / "state")
    engine.answers["/collective_rpc"] = (404, {})
    with pytest.raises(EngineError, match="404"):
        reload_vllm_in_place(engine.url, str(_checkpoint(tmp_path, "whole")), state_dir=tmp_path / "state")
    assert load_state(tmp_path / "state", engine.port).model == str(base)  # nothing loaded


def test_a_spec_naming_the_model_asks_the_server_for_it_and_no_one_which_it_serves() -> None:
    import asyncio

    from polar_addon.engines import make_engine
    from polar_addon.engines.spec import EngineSpec

    assert EngineSpec.parse("vllm:http://h:1?model=pol-adapter&weight_version=2").model == "pol-adapter"
    assert EngineSpec.parse("vllm:http://h:1?model=").model is None  # empty: the first the server lists
    assert EngineSpec.parse("vllm:http://h:1").model is None
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['model'\] \(sglang takes weight_version\)"):
        EngineSpec.parse("sglang:http://h:1?model=x")

    async def name(spec: str) -> str:
        engine = make_engine(spec, timeout_s=1)
        try:
            return await engine.served_model()
        finally:
            await engine.close()

    # Port 1 answers nothing: the name comes from the spec, not from /v1/models.
    assert asyncio.run(name("vllm:http://127.0.0.1:1?model=pol-adapter")) == "pol-adapter"


def test_a_server_that_never_answers_leaves_no_state_and_an_unknown_one_says_where_it_looked(
    tmp_path: Path, no_process: list, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _checkpoint(tmp_path, "m1")
    with socket_closed() as url:
        port = port_of(url)

    def never(server: ManagedServer, timeout: float, progress: object) -> None:
        raise EngineError("not ready")

    monkeypatch.setattr(serving, "wait_ready", never)
    with pytest.raises(EngineError, match="^not ready$"):
        serving.serve_vllm(str(model), port=port, state_dir=tmp_path / "s", python="py", push="adapter", lora_rank=8)
    assert list((tmp_path / "s").iterdir()) == []  # the state of a server that never answered is gone
    # A server polar did not start (the fake engine answers): the advice names the state directory looked in.
    with pytest.raises(serving.NotManaged) as refused:
        restart_vllm(engine.url, "/c", state_dir=tmp_path / "s")
    assert str(refused.value).endswith(f"pass that directory's --state-dir, here {(tmp_path / 's').resolve()})")
