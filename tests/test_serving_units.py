"""polar_cli.serving without vLLM: the server's argv, the state files, the root cause of a failed start, processes
started and stopped (plain ``sleep``/``sh``), and how a push reaches a running server, against a fake HTTP server
that records every request. What an operator depends on: a reload that paused generation always resumes it, a
failed keep reload never falls back to a restart (that would drop the running requests), and a prefix cache reset
that answers ``success: false`` fails the reload."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlparse

import httpx
import orjson
import pytest

from polar_cli import serving
from polar_cli.serving import (
    EngineError,
    InPlaceRefused,
    ManagedServer,
    NotManaged,
    _proc_start_time,
    failure_report,
    in_place_refusal,
    is_running,
    last_line,
    load_state,
    port_of,
    reload_engine,
    reload_vllm_in_place,
    root_cause,
    save_state,
    served_names,
    state_path,
    vllm_command,
)

REAL_SLEEP = time.sleep  # tests replace serving's naps (time.sleep) while the fake engine runs

# --- a fake engine --------------------------------------------------------------------------------------------------


@dataclass
class FakeEngine:
    """Records (method, path, query, json body) of each request; answers from ``answers`` (path -> status, body)."""

    url: str = ""
    seen: list[tuple[str, str, dict[str, str], object]] = field(default_factory=list)
    answers: dict[str, tuple[int, object]] = field(default_factory=dict)
    models: list[str] = field(default_factory=lambda: ["tiny"])
    delays: dict[str, float] = field(default_factory=dict)  # path -> seconds before answering

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.seen]


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    fake = FakeEngine()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            fake.seen.append((method, url.path, dict(parse_qsl(url.query)), json.loads(raw) if raw else None))
            if url.path in fake.delays:
                REAL_SLEEP(fake.delays[url.path])
            if method == "GET" and url.path == "/v1/models":
                status, body = 200, {"object": "list", "data": [{"id": m} for m in fake.models]}
            else:
                status, body = fake.answers.get(url.path, (200, {}))
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out first (a delayed answer)

        def do_GET(self) -> None:  # noqa: N802
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _checkpoint(tmp_path: Path, name: str = "ckpt", tied: bool | None = False) -> Path:
    path = tmp_path / name
    path.mkdir()
    config: dict = {"model_type": "qwen3"}
    if tied is not None:
        config["tie_word_embeddings"] = tied
    (path / "config.json").write_text(json.dumps(config))
    return path


def _managed(tmp_path: Path, port: int, *, push: str = "in-place", running: bool = True) -> ManagedServer:
    """A state file for ``port`` whose pid is this test process (running) or no process at all."""
    server = ManagedServer(
        kind="vllm",
        port=port,
        model="/old",
        served_model_name="tiny",
        command=["py", "-m", "vllm", "--model", "/old"],
        model_arg=4,
        env={},
        log=str(tmp_path / f"engine-{port}.log"),
        pid=os.getpid() if running else 0,
        start_time=(_proc_start_time(os.getpid()) or 0) if running else 0,
        history=["/old"],
        push=push,
    )
    save_state(server, tmp_path / "state")
    return server


# --- process bookkeeping --------------------------------------------------------------------------------------------


def test_the_start_time_is_field_22_of_proc_stat_even_when_the_command_name_holds_parentheses(tmp_path: Path) -> None:
    own = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    assert _proc_start_time(os.getpid()) == int(own[19])
    # A command named "a) b c d": a split at the first ")" would read the wrong field.
    odd = tmp_path / "a) b c d"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", odd)
    proc = subprocess.Popen([str(odd), "30"])
    try:
        for _ in range(200):  # until exec has renamed the process
            if "a) b c d" in Path(f"/proc/{proc.pid}/stat").read_text():
                break
            time.sleep(0.01)
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert _proc_start_time(proc.pid) == int(fields[19]) > 0
    finally:
        proc.kill()
        proc.wait()
    assert _proc_start_time(proc.pid) is None  # reaped: no /proc entry


def test_a_zombie_is_not_running(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    for _ in range(500):
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.01)
    start = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    try:
        assert _proc_start_time(proc.pid) is None
        assert not is_running(_server(tmp_path, pid=proc.pid, start_time=start))
    finally:
        proc.wait()


def _server(tmp_path: Path, **fields: object) -> ManagedServer:
    base: dict = dict(
        kind="vllm",
        port=8123,
        model="/m",
        served_model_name="tiny",
        command=["py", "--model", "/m"],
        model_arg=2,
        env={"A": "1"},
        log=str(tmp_path / "engine.log"),
    )
    return ManagedServer(**{**base, **fields})


def test_running_means_the_same_pid_and_the_same_start_time(tmp_path: Path) -> None:
    me, started = os.getpid(), _proc_start_time(os.getpid())
    assert is_running(_server(tmp_path, pid=me, start_time=started))
    assert not is_running(_server(tmp_path, pid=me, start_time=started + 1))  # a recycled pid
    assert not is_running(_server(tmp_path, pid=0, start_time=0))  # never started
    # pid 1 exists: only "pid > 0" tells a real pid 1 from "never started"
    assert is_running(_server(tmp_path, pid=1, start_time=_proc_start_time(1)))


def test_a_server_names_its_url_and_spec(tmp_path: Path) -> None:
    server = _server(tmp_path, port=8011)
    assert server.url == "http://127.0.0.1:8011"
    assert server.spec == "vllm:http://127.0.0.1:8011"


def test_the_state_file_round_trips_indented_and_is_written_aside_then_renamed(tmp_path: Path) -> None:
    server = _server(tmp_path, pid=42, start_time=7, weight_version="3", history=["/a", "/m"], push="in-place")
    state_dir = tmp_path / "deep" / "state"  # made on the way
    path = save_state(server, state_dir)
    assert path == state_dir / "engine-8123.json" == state_path(state_dir, 8123)
    assert sorted(p.name for p in state_dir.iterdir()) == ["engine-8123.json"]  # no .tmp left
    assert path.read_bytes() == orjson.dumps(
        {
            "kind": "vllm",
            "port": 8123,
            "model": "/m",
            "served_model_name": "tiny",
            "command": ["py", "--model", "/m"],
            "model_arg": 2,
            "env": {"A": "1"},
            "log": server.log,
            "pid": 42,
            "start_time": 7,
            "weight_version": "3",
            "history": ["/a", "/m"],
            "push": "in-place",
            "lora_rank": 0,
            "adapter": None,
        },
        option=orjson.OPT_INDENT_2,
    )
    assert load_state(state_dir, 8123) == server
    server.pid = 43
    save_state(server, state_dir)  # overwritten in place
    assert load_state(state_dir, 8123).pid == 43


def test_a_port_without_a_state_file_is_not_managed(tmp_path: Path) -> None:
    with pytest.raises(NotManaged) as err:
        load_state(tmp_path, 8124)
    assert str(err.value) == (
        f"no engine on port 8124 was started by `polar engine serve` (no {(tmp_path / 'engine-8124.json').resolve()})"
    )
    (tmp_path / "engine-8124.json").mkdir()  # not a file either
    with pytest.raises(NotManaged):
        load_state(tmp_path, 8124)


def test_served_names_lists_the_models_or_says_nothing_answers(engine: FakeEngine) -> None:
    engine.models = ["tiny", "other"]
    assert served_names(engine.url) == ["tiny", "other"]
    assert served_names(engine.url + "/") == ["tiny", "other"]
    assert engine.seen[-1][:2] == ("GET", "/v1/models")
    assert served_names(engine.url + "/X") is None  # a path is kept: /X/v1/models lists nothing
    with socket_closed() as url:
        assert served_names(url) is None


def test_served_names_of_an_odd_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[httpx.Response] = []
    asked: list[tuple[str, object]] = []

    def fake_get(url: str, timeout: float) -> httpx.Response:
        asked.append((url, timeout))
        return answers.pop(0)

    monkeypatch.setattr(serving.httpx, "get", fake_get)
    answers.append(httpx.Response(404, json={"data": [{"id": "x"}]}))
    assert served_names("http://h:1/") == []  # something answers, serving nothing
    assert asked == [("http://h:1/v1/models", 2.0)]
    for body in (b"not json", b'{"object": "list"}', b'{"data": [{"name": "x"}]}', b'{"data": 3}'):
        answers.append(httpx.Response(200, content=body))
        assert served_names("http://h:1") is None, body


class socket_closed:  # noqa: N801 (a context manager read like a clause)
    """A URL on a port nothing listens on."""

    def __enter__(self) -> str:
        from tests.conftest import free_port

        return f"http://127.0.0.1:{free_port()}"

    def __exit__(self, *exc: object) -> None:
        pass


def test_port_of_a_url_or_host_port() -> None:
    assert port_of("http://127.0.0.1:8000") == 8000
    assert port_of("127.0.0.1:8001") == 8001
    assert port_of("https://h:443/x") == 443
    with pytest.raises(EngineError) as err:
        port_of("http://h")
    assert str(err.value) == "'http://h' has no port"


# --- vLLM's argv ----------------------------------------------------------------------------------------------------


def test_vllm_argv_is_exact_with_the_defaults() -> None:
    cmd, model_arg = vllm_command("/m", 8000, "tiny", python="py")
    assert cmd == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", "8000", "--dtype", "auto",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
    ]  # fmt: skip
    assert model_arg == 4


def test_vllm_argv_with_every_option_and_extra_flags_winning() -> None:
    cmd, model_arg = vllm_command(
        "/m", 8001, "pol", python="py", dtype="bfloat16", max_model_len=4096, tool_call_parser="qwen3_coder",
        memory_fraction="0.3", extra_args=["--generation-config=auto", "--enable-auto-tool-choice", "--seed", "1"],
    )  # fmt: skip
    assert cmd == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--served-model-name", "pol",
        "--host", "127.0.0.1", "--port", "8001", "--dtype", "bfloat16",
        "--tool-call-parser", "qwen3_coder", "--logprobs-mode", "processed_logprobs",
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.3",
        "--generation-config=auto", "--enable-auto-tool-choice", "--seed", "1",
    ]  # fmt: skip
    assert model_arg == 4
    # The flag is what comes before the first "=": a value may hold one.
    cmd, _ = vllm_command("/m", 8001, "pol", python="py", extra_args=["--generation-config=/cfg/a=b"])
    assert cmd.count("--generation-config") == 0 and cmd[-1] == "--generation-config=/cfg/a=b"
    # A value that is not a flag is no flag of the user's: polar's own stays.
    cmd, _ = vllm_command("/m", 8001, "pol", python="py", extra_args=["x--dtype"])
    assert cmd.count("--enable-auto-tool-choice") == 1 and cmd[-1] == "x--dtype"
    assert vllm_command("/m", 1, "n")[0][0] == serving.vllm_python()


def test_on_cpu_unless_a_gpu_is_there_or_named(monkeypatch: pytest.MonkeyPatch) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("a GPU machine")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert serving.on_cpu() is True
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert serving.on_cpu() is True
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert serving.on_cpu() is False
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    devices = {"/dev/nvidia0"}  # an NVIDIA device node alone says GPU

    class FakePath(type(Path())):
        def exists(self, **kwargs: object) -> bool:
            return str(self) in devices

    monkeypatch.setattr(serving, "Path", FakePath)
    assert serving.on_cpu() is False
    devices.clear()
    assert serving.on_cpu() is True


# --- logs -----------------------------------------------------------------------------------------------------------


def test_the_last_line_is_the_last_non_blank_one_of_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "log"
    assert last_line(str(log)) == ""  # no log yet
    log.write_text("first\n  second  \n\n   \n")
    assert last_line(str(log)) == "second"
    log.write_text("\n \n")
    assert last_line(str(log)) == ""
    log.write_text("first\n" + "y" * 5000)  # only the last 4000 characters are read
    assert last_line(str(log)) == "y" * 4000
    log.write_bytes(b"ok \xff\n")  # not UTF-8: replaced, never an error
    assert last_line(str(log)) == "ok \ufffd"


@pytest.mark.parametrize(
    ("log", "cause"),
    [
        ("INFO fine\nValueError: bad size\nRuntimeError: later\n", "ValueError: bad size"),
        ("x\n  torch.OutOfMemoryError: CUDA out of memory\n", "torch.OutOfMemoryError: CUDA out of memory"),
        ("KeyboardInterrupt\n", "KeyboardInterrupt"),
        ("SystemExit: 2\n", "SystemExit: 2"),
        ("MyException raised\n", "MyException raised"),
        ("valueError: lower case is no exception line\n", None),
        ("ValueErrors: not the word\n", None),
        ("RuntimeError: Engine core initialization failed. See root cause above.\n", None),
        ("Traceback (most recent call last):\nKeyError: 'x'\n", "KeyError: 'x'"),
        # No exception line: the first ERROR line, then the first line naming an error, wrappers skipped
        (
            "INFO a\n(pid=1) ERROR 11-30 [core.py] EngineCore failed to start.\n(pid=1) ERROR boom\n",
            "(pid=1) ERROR boom",
        ),
        ("INFO a\nERRORS are not ERROR\n", "ERRORS are not ERROR"),
        ("INFO a\n(pid=3) raised OSError while loading\n(pid=3) ERROR x\n", "(pid=3) ERROR x"),
        ("INFO a\n(pid=3) raised OSError while loading\n", "(pid=3) raised OSError while loading"),
        ("INFO a\n(pid=3) SomeException here\n", "(pid=3) SomeException here"),
        ("INFO a\n(pid=3) Error alone\nerror lower\nXERROR\n", None),
        ("(pid=3) ValueError in Traceback\n", None),
        ("", None),
    ],
)
def test_root_cause_is_the_first_line_that_names_what_went_wrong(log: str, cause: str | None) -> None:
    assert root_cause(log) == cause


def test_a_failure_report_has_the_cause_then_the_last_15_lines(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    lines = [f"line {i}" for i in range(20)]
    lines[2] = "ValueError: no memory"
    log.write_text("\n".join(lines) + "\n")
    tail = "\n".join(lines[5:])
    assert failure_report(str(log)) == f"ValueError: no memory\n(full log: {log}; last lines:)\n{tail}"
    log.write_text("INFO fine\n")
    assert failure_report(str(log)) == f"(full log: {log}; last lines:)\nINFO fine"
    assert failure_report(str(tmp_path / "none")) == f"(full log: {tmp_path / 'none'}; last lines:)\n"


# --- processes ------------------------------------------------------------------------------------------------------


def _wait_for(check, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_launch_starts_the_command_in_its_own_session_with_its_env_and_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tied: list[int] = []
    monkeypatch.setattr("polar_cli.lifeline.tie", tied.append)
    monkeypatch.setenv("POLAR_TEST_INHERITED", "yes")
    log = tmp_path / "engine.log"
    log.write_text("before\n")  # appended to, never truncated
    server = _server(
        tmp_path,
        command=["sh", "-c", 'echo "$POLAR_TEST_ENV $POLAR_TEST_INHERITED"; echo err >&2; exec sleep 30'],
        env={"POLAR_TEST_ENV": "set"},
    )
    serving._launch(server)
    try:
        assert server.pid > 0 and server.start_time == _proc_start_time(server.pid)
        assert os.getsid(server.pid) == server.pid  # a Ctrl-C of polar does not reach it
        assert _wait_for(lambda: log.read_text() == "before\nset yes\nerr\n")
        assert tied == []  # outlives this process unless tied
    finally:
        serving.stop_process(server, timeout_s=5)
    server = _server(tmp_path, command=["sleep", "30"])
    serving._launch(server, tie=True)
    try:
        assert tied == [server.pid]
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        os.waitpid(server.pid, 0)


def test_stop_process_ends_the_whole_group_politely_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    untied: list[int] = []
    monkeypatch.setattr("polar_cli.lifeline.untie", untied.append)
    marker = tmp_path / "term"
    # The leader exits on SIGTERM and leaves a child in the group: SIGKILL of the group ends it.
    server = _server(tmp_path, command=["sh", "-c", f"trap 'echo term > {marker}; exit 0' TERM; sleep 30 & wait"])
    serving._launch(server)
    assert _wait_for(lambda: len(_group(server.pid)) == 2)
    started = time.monotonic()
    serving.stop_process(server, timeout_s=5)
    assert time.monotonic() - started < 4  # not waited out: it went at the SIGTERM
    assert marker.read_text() == "term\n"
    assert not is_running(server) and _wait_for(lambda: not _group(server.pid))
    assert untied == [server.pid]


def test_stop_process_kills_a_server_that_ignores_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("polar_cli.lifeline.untie", lambda pid: None)
    server = _server(tmp_path, command=["sh", "-c", "trap '' TERM; echo ready; exec sleep 30"])
    serving._launch(server)
    assert _wait_for(lambda: "ready" in Path(server.log).read_text())
    started = time.monotonic()
    serving.stop_process(server, timeout_s=0.5)
    assert 0.4 < time.monotonic() - started < 4
    assert _wait_for(lambda: not is_running(server))  # SIGKILLed (a zombie until reaped)
    _reap_now(server.pid)


def _reap_now(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def test_stop_process_of_a_server_not_running_signals_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(serving.os, "killpg", lambda pid, sig: sent.append((pid, sig)))
    serving.stop_process(_server(tmp_path, pid=os.getpid(), start_time=1))  # a recycled pid: not ours
    assert sent == []


def _group(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def test_wait_ready_returns_once_the_name_is_served(
    tmp_path: Path, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    naps: list[float] = []
    progress: list[tuple[float, str]] = []
    engine.models = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        assert len(naps) <= 2, "still waiting after the name was served"
        engine.models = ["other"] if len(naps) == 1 else ["other", "tiny"]

    monkeypatch.setattr(serving.time, "sleep", nap)
    Path(tmp_path / "engine.log").write_text("loading\nstill loading\n")
    server = _server(tmp_path, port=engine.port, pid=os.getpid(), start_time=_proc_start_time(os.getpid()))
    serving.wait_ready(server, timeout_s=60, progress=lambda s, line: progress.append((s, line)))
    assert naps == [1.0, 1.0]
    assert [line for _, line in progress] == ["still loading", "still loading"]
    assert all(0 <= s < 60 for s, _ in progress)
    serving.wait_ready(server, timeout_s=60)  # served at once: no nap, no progress needed
    assert naps == [1.0, 1.0]


def test_wait_ready_fails_at_once_when_the_server_died_and_after_the_timeout(
    tmp_path: Path, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    Path(tmp_path / "engine.log").write_text("ValueError: bad flag\n")
    dead = _server(tmp_path, port=engine.port, pid=0)
    with pytest.raises(EngineError) as err:
        serving.wait_ready(dead, timeout_s=60)
    assert str(err.value) == f"engine on port {engine.port} exited: {failure_report(dead.log)}"
    assert engine.seen == []
    engine.models = ["other"]
    real_sleep = time.sleep
    monkeypatch.setattr(serving.time, "sleep", lambda s: real_sleep(0.05))
    alive = _server(tmp_path, port=engine.port, pid=os.getpid(), start_time=_proc_start_time(os.getpid()))
    started = time.monotonic()
    with pytest.raises(EngineError) as err:
        serving.wait_ready(alive, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 3
    assert str(err.value) == f"engine on port {engine.port} not ready after 0 s: {failure_report(dead.log)}"


# --- serve, restart, stop -------------------------------------------------------------------------------------------


@pytest.fixture
def no_process(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """serve/restart without a process: what was launched, waited on and stopped."""
    calls: list[tuple[str, object]] = []

    def launch(server: ManagedServer, tie: bool = False) -> None:
        calls.append(("launch", (list(server.command), tie)))
        server.pid, server.start_time = 4242, 99

    monkeypatch.setattr(serving, "_launch", launch)
    monkeypatch.setattr(
        serving, "wait_ready", lambda server, timeout, progress: calls.append(("wait", server.port, timeout, progress))
    )
    monkeypatch.setattr(serving, "stop_process", lambda server: calls.append(("stop", server.pid)))
    monkeypatch.setattr(serving, "on_cpu", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return calls


def test_serve_starts_a_sized_server_and_remembers_it(
    tmp_path: Path, no_process: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _checkpoint(tmp_path, "m1")
    state = tmp_path / "state"
    with socket_closed() as url:
        port = port_of(url)
    (state).mkdir()
    Path(state / f"engine-{port}.log").write_text("an earlier start's failure\n")
    server = serving.serve_vllm(str(model), port=port, state_dir=state, python="py", ready_timeout_s=12, progress=print)
    assert server.served_model_name == "m1" and server.model == str(model) == server.history[0]
    assert server.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert server.command == vllm_command(str(model), port, "m1", python="py", memory_fraction="0.2")[0]
    assert server.push == "restart" and "VLLM_SERVER_DEV_MODE" not in server.env
    assert server.log == str((state / f"engine-{port}.log").resolve())
    assert not Path(server.log).exists()  # the earlier start's log is gone: the root cause is this start's
    assert no_process == [("launch", (server.command, False)), ("wait", port, 12, print)]
    assert load_state(state, port) == server
    assert (server.kind, server.spec, server.model_arg) == ("vllm", f"vllm:http://127.0.0.1:{port}", 4)
    assert (server.pid, server.start_time) == (4242, 99)


def test_serve_in_place_turns_on_the_development_and_scale_out_endpoints(
    tmp_path: Path, no_process: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _checkpoint(tmp_path, "m1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    with socket_closed() as url:
        port = port_of(url)
    server = serving.serve_vllm(
        str(model), port=port, state_dir=tmp_path / "s", python="py", push="in-place", served_model_name="pol",
        env={"X": "1"}, memory_fraction="0.5", tie=True,
    )  # fmt: skip
    assert server.env == {"X": "1", "VLLM_CPU_KVCACHE_SPACE": "5", "VLLM_SERVER_DEV_MODE": "1"}
    assert server.served_model_name == "pol" and server.push == "in-place"
    assert server.command[-1] == "--enable-scale-out" and server.command.count("--enable-scale-out") == 1
    assert "--gpu-memory-utilization 0.5" in " ".join(server.command)
    assert no_process[0] == ("launch", (server.command, True))
    server = serving.serve_vllm(
        str(model), port=port + 1 if port < 65535 else port - 1, state_dir=tmp_path / "t", python="py",
        push="in-place", extra_args=["--enable-scale-out"], kvcache_gib="7",
    )  # fmt: skip
    assert server.command.count("--enable-scale-out") == 1
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == "7"


def test_serve_passes_its_options_to_vllm_and_makes_its_state_dir(tmp_path: Path, no_process: list) -> None:
    model = _checkpoint(tmp_path, "m1")
    with socket_closed() as url:
        port = port_of(url)
    state = tmp_path / "a" / "b" / "state"  # made with its parents
    server = serving.serve_vllm(
        str(model), port=port, state_dir=state, python="py", dtype="bfloat16", max_model_len=4096,
        tool_call_parser="qwen3_coder", extra_args=["--seed", "1"],
    )  # fmt: skip
    assert server.command == vllm_command(
        str(model), port, "m1", python="py", dtype="bfloat16", max_model_len=4096, tool_call_parser="qwen3_coder",
        memory_fraction="0.2", extra_args=["--seed", "1"],
    )[0]  # fmt: skip
    assert state_path(state, port).is_file()


def test_serve_on_a_gpu_sizes_nothing_unless_asked(
    tmp_path: Path, no_process: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "on_cpu", lambda: False)
    model = _checkpoint(tmp_path, "m1")
    with socket_closed() as url:
        port = port_of(url)
    server = serving.serve_vllm(str(model), port=port, state_dir=tmp_path / "a", python="py")
    assert server.env == {} and "--gpu-memory-utilization" not in server.command
    server = serving.serve_vllm(str(model), port=port, state_dir=tmp_path / "b", python="py", kvcache_gib="3")
    assert server.env == {"VLLM_CPU_KVCACHE_SPACE": "3"}


def test_serve_refuses_before_starting_anything(
    tmp_path: Path, no_process: list, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _checkpoint(tmp_path, "m1")
    with pytest.raises(EngineError) as err:
        serving.serve_vllm(str(model), port=1, state_dir=tmp_path, push="keep")
    assert str(err.value) == "push must be one of restart, in-place, adapter, not 'keep'"
    _managed(tmp_path, engine.port)
    with pytest.raises(EngineError) as err:
        serving.serve_vllm(str(model), port=engine.port, state_dir=tmp_path / "state")
    assert str(err.value) == f"an engine started by polar already serves port {engine.port} (stop it first)"
    with pytest.raises(EngineError) as err:  # its state says stopped, but something answers there
        _managed(tmp_path, engine.port, running=False)
        serving.serve_vllm(str(model), port=engine.port, state_dir=tmp_path / "state")
    assert str(err.value) == (f"something already answers on port {engine.port}: stop it or pick another --port")
    with socket_closed() as url:
        with pytest.raises(EngineError) as err:
            serving.serve_vllm(str(tmp_path), port=port_of(url), state_dir=tmp_path / "state")
    assert str(err.value) == f"{tmp_path} is not a model directory (no config.json)"
    assert no_process == []


def test_a_serve_that_never_gets_ready_is_stopped_and_forgotten(
    tmp_path: Path, no_process: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(server: ManagedServer, timeout: float, progress: object) -> None:
        state_path(tmp_path / "s", server.port).unlink()  # a `polar engine stop` from another shell meanwhile
        raise EngineError("not ready")

    monkeypatch.setattr(serving, "wait_ready", never)
    model = _checkpoint(tmp_path, "m1")
    with socket_closed() as url:
        port = port_of(url)
    with pytest.raises(EngineError, match="^not ready$"):
        serving.serve_vllm(str(model), port=port, state_dir=tmp_path / "s")
    assert no_process[-1] == ("stop", 4242)
    assert not state_path(tmp_path / "s", port).exists()


def test_restart_swaps_the_model_on_the_same_port_and_name(tmp_path: Path, no_process: list) -> None:
    old = _managed(tmp_path, 8130, push="restart")
    server = serving.restart_vllm(
        "http://127.0.0.1:8130", "/new", state_dir=tmp_path / "state", weight_version="4", ready_timeout_s=9,
        progress=print, tie=True,
    )  # fmt: skip
    assert server.command == ["py", "-m", "vllm", "--model", "/new"]
    assert (server.model, server.weight_version, server.history) == ("/new", "4", ["/old", "/new"])
    assert no_process == [("stop", old.pid), ("launch", (server.command, True)), ("wait", 8130, 9, print)]
    assert load_state(tmp_path / "state", 8130) == server
    assert Path(old.log).read_text() == "\n--- polar engine reload: /new\n"
    no_process.clear()
    server = serving.restart_vllm("http://127.0.0.1:8130", "/newer", state_dir=tmp_path / "state")
    assert no_process[1:] == [("launch", (server.command, False)), ("wait", 8130, serving.READY_TIMEOUT_S, None)]
    assert server.history == ["/old", "/new", "/newer"] and server.weight_version is None


def test_restart_of_an_engine_polar_did_not_start_says_what_to_do(tmp_path: Path, no_process: list) -> None:
    with socket_closed() as url:
        with pytest.raises(NotManaged) as err:
            serving.restart_vllm(url, "/new", state_dir=tmp_path)
    port = port_of(url)
    assert str(err.value) == (
        f"no engine on port {port} was started by `polar engine serve` (no {(tmp_path / f'engine-{port}.json')}): "
        f"nothing answers on {url} either. Start one that reload can restart: "
        f"`polar engine serve /new --port {port}`"
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert no_process == []


def test_restart_advice_for_a_foreign_server(tmp_path: Path, engine: FakeEngine) -> None:
    advice = serving._restart_advice(engine.url, "/ck", tmp_path)
    assert advice == (
        f"{engine.url} serves ['tiny'] but was started some other way, so polar cannot restart it. Either restart it "
        f"yourself with `--model /ck --served-model-name tiny` (same flags otherwise), or stop it and "
        f"let polar manage it: `polar engine serve /ck --port {engine.port} --served-model-name tiny` "
        f"(later reloads then work; if it was started by `polar engine serve` from another directory, pass "
        f"that directory's --state-dir, here {tmp_path.resolve()})"
    )
    engine.models = []
    assert "serves [] but" in serving._restart_advice(engine.url, "/ck", tmp_path)
    assert "--served-model-name NAME" in serving._restart_advice(engine.url, "/ck", tmp_path)


def test_stop_engine_stops_and_forgets(tmp_path: Path, no_process: list, monkeypatch: pytest.MonkeyPatch) -> None:
    _managed(tmp_path, 8131)
    server, running = serving.stop_engine("http://127.0.0.1:8131", state_dir=tmp_path / "state")
    assert (server.port, running) == (8131, True)
    assert no_process == [("stop", os.getpid())]
    assert not state_path(tmp_path / "state", 8131).exists()
    _managed(tmp_path, 8131, running=False)
    assert serving.stop_engine("127.0.0.1:8131", state_dir=tmp_path / "state")[1] is False
    _managed(tmp_path, 8131)
    # Two stops at once: the other one removed the state first; this one still ends quietly.
    monkeypatch.setattr(serving, "stop_process", lambda server: state_path(tmp_path / "state", 8131).unlink())
    assert serving.stop_engine("127.0.0.1:8131", state_dir=tmp_path / "state")[1] is True
    with pytest.raises(NotManaged) as err:
        serving.stop_engine("127.0.0.1:8131", state_dir=tmp_path / "state")
    assert str(err.value) == (
        "no engine started by `polar engine serve` is known on port 8131 "
        f"(already stopped, or its state is in another --state-dir than {(tmp_path / 'state').resolve()})"
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__


# --- in place -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"tie_word_embeddings": False}, None),
        ({"tie_word_embeddings": True}, "tied embeddings, which vLLM's in-place reload leaves half loaded"),
        ({}, "tied embeddings, which vLLM's in-place reload leaves half loaded"),  # transformers' default
        ({"text_config": {"tie_word_embeddings": False}}, None),
        (
            {"text_config": {"tie_word_embeddings": True}},
            "tied embeddings, which vLLM's in-place reload leaves half loaded",
        ),
        ({"text_config": {}}, "tied embeddings, which vLLM's in-place reload leaves half loaded"),
        ({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}}, None),
        ({"text_config": "x"}, "tied embeddings, which vLLM's in-place reload leaves half loaded"),
    ],
)
def test_in_place_refusal_of_tied_embeddings(tmp_path: Path, config: dict, refusal: str | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert in_place_refusal(tmp_path) == refusal


def test_in_place_refusal_of_an_unreadable_config(tmp_path: Path) -> None:
    assert in_place_refusal(tmp_path) == "its config.json cannot be read"
    (tmp_path / "config.json").write_text("{not json")
    assert in_place_refusal(tmp_path) == "its config.json cannot be read"


@pytest.fixture
def timeouts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """The timeout of every POST (the real request still goes to the fake engine)."""
    seen: list[tuple[str, object]] = []
    real, real_client = httpx.post, httpx.Client.post

    def post(url: str, **kwargs: object) -> httpx.Response:
        seen.append((urlparse(url).path, kwargs.get("timeout")))
        return real(url, **kwargs)

    def client_post(client: httpx.Client, url: str, **kwargs: object) -> httpx.Response:
        seen.append((urlparse(url).path, kwargs.get("timeout")))
        return real_client(client, url, **kwargs)

    monkeypatch.setattr(serving.httpx, "post", post)
    monkeypatch.setattr(serving.httpx.Client, "post", client_post)
    return seen


RPC = {"method": "reload_weights", "kwargs": {"weights_path": "", "is_checkpoint_format": True}}


def _rpc(checkpoint: Path) -> dict:
    return {**RPC, "kwargs": {**RPC["kwargs"], "weights_path": str(checkpoint)}}


def test_an_in_place_reload_loads_resets_and_labels(
    tmp_path: Path, engine: FakeEngine, timeouts: list[tuple[str, object]]
) -> None:
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, engine.port)
    server = reload_vllm_in_place(engine.url, str(ckpt), state_dir=tmp_path / "state", weight_version="5", timeout_s=7)
    assert engine.seen == [
        ("POST", "/collective_rpc", {}, _rpc(ckpt)),
        ("POST", "/reset_prefix_cache", {"reset_running_requests": "false"}, None),
        ("POST", "/update_weight_version", {}, {"new_version": "5"}),
    ]
    assert timeouts == [("/collective_rpc", 7), ("/reset_prefix_cache", 7), ("/update_weight_version", 7)]
    assert (server.model, server.weight_version, server.history) == (str(ckpt), "5", ["/old", str(ckpt)])
    assert load_state(tmp_path / "state", engine.port) == server
    assert Path(server.log).read_text() == f"\n--- polar engine reload: {ckpt} (in place)\n"


def test_a_keep_reload_pauses_keeping_requests_preempts_them_and_always_resumes(
    tmp_path: Path, engine: FakeEngine, timeouts: list[tuple[str, object]]
) -> None:
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, engine.port)
    engine.answers["/reset_prefix_cache"] = (200, {"success": True})
    server = reload_vllm_in_place(
        engine.url, str(ckpt), state_dir=tmp_path / "state", weight_version="6", timeout_s=8, keep=True
    )
    assert engine.seen == [
        ("POST", "/pause", {"mode": "keep"}, None),
        ("POST", "/collective_rpc", {}, _rpc(ckpt)),
        ("POST", "/reset_prefix_cache", {"reset_running_requests": "true"}, None),
        ("POST", "/update_weight_version", {}, {"new_version": "6"}),
        ("POST", "/resume", {}, None),
    ]
    assert [t for _, t in timeouts] == [8] * 5
    assert Path(server.log).read_text() == f"\n--- polar engine reload: {ckpt} (in place, requests kept)\n"
    assert load_state(tmp_path / "state", engine.port).weight_version == "6"


@pytest.mark.parametrize("failing", [None, "/collective_rpc"])
def test_a_push_makes_its_calls_through_one_client_and_closes_it(
    tmp_path: Path, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, failing: str | None
) -> None:
    # A client per call built an SSL context each time, inside the window a keep push holds the engine paused.
    made: list[httpx.Client] = []

    class Recorded(httpx.Client):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(serving.httpx, "Client", Recorded)
    monkeypatch.setattr(serving.httpx, "post", lambda *a, **k: pytest.fail("a call outside the push's client"))
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, engine.port)
    if failing:
        engine.answers[failing] = (500, {"error": "boom"})
    try:
        reload_vllm_in_place(engine.url, str(ckpt), state_dir=tmp_path / "state", weight_version="6", keep=True)
    except EngineError:
        assert failing
    assert len(engine.paths()) == (3 if failing else 5) and engine.paths()[-1] == "/resume"
    assert len(made) == 1 and made[0].is_closed


def test_without_a_version_the_server_keeps_its_label(tmp_path: Path, engine: FakeEngine) -> None:
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, engine.port)
    server = reload_vllm_in_place(engine.url, str(ckpt), state_dir=tmp_path / "state", keep=True)
    assert engine.paths() == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert server.weight_version is None


@pytest.mark.parametrize("failing", ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version"])
def test_a_failed_keep_reload_still_resumes_and_records_what_was_loaded(
    tmp_path: Path, engine: FakeEngine, failing: str
) -> None:
    ckpt = _checkpoint(tmp_path)
    before = _managed(tmp_path, engine.port)
    engine.answers[failing] = (500, b"boom " + b"x" * 400)
    with pytest.raises(EngineError) as err:
        reload_vllm_in_place(engine.url, str(ckpt), state_dir=tmp_path / "state", weight_version="6", keep=True)
    message = str(err.value)
    assert message.startswith(f"vLLM on {engine.url} could not reload {ckpt} in place: Server error '500 ")
    assert message.endswith(" boom " + "x" * 295)  # the answer's first 300 characters
    assert isinstance(err.value.__cause__, httpx.HTTPStatusError)
    assert engine.paths()[-1] == "/resume" and engine.paths().count("/resume") == 1
    assert engine.paths()[-2] == failing
    if failing == "/collective_rpc":
        assert load_state(tmp_path / "state", engine.port) == before  # still the old weights
        assert not Path(before.log).exists()
    else:
        _loaded_without_a_version(tmp_path, engine, ckpt)


def _loaded_without_a_version(tmp_path: Path, engine: FakeEngine, ckpt: Path) -> None:
    """A reload that failed after the workers loaded the checkpoint: the state names the checkpoint (what the server
    holds), with no version (its label may still be the old one, so what it samples has no known version)."""
    after = load_state(tmp_path / "state", engine.port)
    assert (after.model, after.weight_version, after.history) == (str(ckpt), None, ["/old", str(ckpt)])
    assert Path(after.log).read_text() == (
        f"\n--- polar engine reload: {ckpt} (in place; the weights loaded, then the reload failed: no version)\n"
    )


def test_a_prefix_cache_kept_fails_the_reload_and_still_resumes(tmp_path: Path, engine: FakeEngine) -> None:
    ckpt = _checkpoint(tmp_path)
    before = _managed(tmp_path, engine.port)
    engine.answers["/reset_prefix_cache"] = (200, {"success": False})
    with pytest.raises(EngineError) as err:
        reload_vllm_in_place(engine.url, str(ckpt), state_dir=tmp_path / "state", weight_version="6", keep=True)
    assert str(err.value) == f"vLLM on {engine.url} kept its prefix cache of the old weights (blocks still held)"
    assert engine.paths() == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]  # never labelled
    assert before.model == "/old"
    _loaded_without_a_version(tmp_path, engine, ckpt)


@pytest.mark.parametrize(
    ("answer", "resumed"),
    [
        ((400, b"bad mode"), False),  # refused: nothing was paused
        ((500, b"Failed to pause generation"), True),  # failed inside the engine: it may be paused
        ("timeout", True),  # the answer was lost: it may be paused
    ],
)
def test_a_pause_that_may_have_paused_is_resumed(
    tmp_path: Path, engine: FakeEngine, answer: tuple[int, bytes] | str, resumed: bool
) -> None:
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, engine.port)
    if answer == "timeout":
        engine.delays["/pause"] = 1.0
    else:
        engine.answers["/pause"] = answer
    with pytest.raises(EngineError) as err:
        reload_vllm_in_place(engine.url, str(ckpt), state_dir=tmp_path / "state", keep=True, timeout_s=0.3)
    assert str(err.value).startswith(f"vLLM on {engine.url} could not reload {ckpt} in place: ")
    if answer != "timeout":
        assert str(err.value).endswith(
            f"/pause?mode=keep'\nFor more information check: "
            f"https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/{answer[0]} "
            f"{answer[1].decode()}"
        )
    assert engine.paths() == (["/pause", "/resume"] if resumed else ["/pause"])  # nothing else sent
    assert load_state(tmp_path / "state", engine.port).model == "/old"


def test_a_failed_resume_fails_the_reload(tmp_path: Path, engine: FakeEngine) -> None:
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, engine.port)
    engine.answers = {"/resume": (500, b"stuck")}
    with pytest.raises(EngineError) as err:
        reload_vllm_in_place(engine.url, str(ckpt), state_dir=tmp_path / "state", keep=True)
    assert str(err.value).startswith(f"vLLM on {engine.url} did not resume after the reload: Server error '500 ")
    assert isinstance(err.value.__cause__, httpx.HTTPStatusError)
    assert engine.paths() == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    _loaded_without_a_version(tmp_path, engine, ckpt)  # loaded, but never labelled as the version asked


def test_an_unreachable_server_fails_the_reload(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    with socket_closed() as url:
        _managed(tmp_path, port_of(url))
        with pytest.raises(EngineError) as err:
            reload_vllm_in_place(url, str(ckpt), state_dir=tmp_path / "state")
    assert isinstance(err.value.__cause__, httpx.ConnectError)
    # No answer, so no answer's text after the error.
    assert str(err.value) == f"vLLM on {url} could not reload {ckpt} in place: {err.value.__cause__} "


def test_in_place_refusals(tmp_path: Path, engine: FakeEngine) -> None:
    _managed(tmp_path, engine.port, push="restart")
    with pytest.raises(InPlaceRefused) as err:
        reload_vllm_in_place(engine.url, str(_checkpoint(tmp_path)), state_dir=tmp_path / "state")
    assert str(err.value) == f"{engine.url} was started with --push restart: it has no in-place reload"
    _managed(tmp_path, engine.port)
    with pytest.raises(InPlaceRefused) as err:
        reload_vllm_in_place(engine.url, str(_checkpoint(tmp_path, "tied", tied=True)), state_dir=tmp_path / "state")
    assert str(err.value) == "tied embeddings, which vLLM's in-place reload leaves half loaded"
    assert engine.seen == []


def test_label_version(engine: FakeEngine, timeouts: list[tuple[str, object]]) -> None:
    serving.label_version(engine.url, "9")
    assert engine.seen == [("POST", "/update_weight_version", {}, {"new_version": "9"})]
    assert timeouts == [("/update_weight_version", 60.0)]
    engine.answers["/update_weight_version"] = (404, {})
    with pytest.raises(httpx.HTTPStatusError):
        serving.label_version(engine.url, "9")


# --- reload_engine: which way a push goes ---------------------------------------------------------------------------


@pytest.fixture
def ways(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """reload_engine's two ways for vLLM, recorded; ``ways["in_place_error"]`` makes the in-place one fail."""
    calls: dict[str, list] = {"in_place": [], "restart": [], "in_place_error": []}

    def in_place(url: str, checkpoint: str, **kwargs: object) -> ManagedServer:
        calls["in_place"].append((url, checkpoint, kwargs))
        if calls["in_place_error"]:
            raise calls["in_place_error"][0]
        return _server(Path("/tmp"), port=port_of(url), served_model_name="pol")

    def restart(url: str, checkpoint: str, **kwargs: object) -> ManagedServer:
        calls["restart"].append((url, checkpoint, kwargs))
        return _server(Path("/tmp"), port=port_of(url), served_model_name="pol", pid=77)

    monkeypatch.setattr(serving, "reload_vllm_in_place", in_place)
    monkeypatch.setattr(serving, "restart_vllm", restart)
    return calls


def test_a_running_in_place_server_is_reloaded_in_place(tmp_path: Path, ways: dict[str, list]) -> None:
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, 8140)
    line = reload_engine(
        "vllm:http://127.0.0.1:8140?weight_version=3", ckpt, state_dir=tmp_path / "state", weight_version="4",
        timeout_s=5, keep=True,
    )  # fmt: skip
    assert line == (
        f"vllm http://127.0.0.1:8140: loaded {ckpt.resolve()} in place as 'pol'; proxies tag its calls with "
        "--engine 'vllm:http://127.0.0.1:8140?weight_version=4'"
    )
    assert ways["in_place"] == [
        (
            "http://127.0.0.1:8140",
            str(ckpt.resolve()),
            {"state_dir": tmp_path / "state", "weight_version": "4", "timeout_s": 5, "keep": True},
        )
    ]
    assert ways["restart"] == []
    line = reload_engine("vllm:http://127.0.0.1:8140", ckpt, state_dir=tmp_path / "state")
    assert line == f"vllm http://127.0.0.1:8140: loaded {ckpt.resolve()} in place as 'pol'"
    assert ways["in_place"][-1][2] == {
        "state_dir": tmp_path / "state", "weight_version": None, "timeout_s": serving.READY_TIMEOUT_S, "keep": False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (InPlaceRefused("tied"), " (not in place: tied)"),
        (EngineError("rpc 500"), " (the in-place reload failed, so it was restarted: rpc 500)"),
    ],
)
def test_a_failed_in_place_reload_falls_back_to_a_restart_unless_requests_are_kept(
    tmp_path: Path, ways: dict[str, list], error: EngineError, why: str
) -> None:
    ckpt = _checkpoint(tmp_path)
    _managed(tmp_path, 8141)
    ways["in_place_error"].append(error)
    progress = print
    line = reload_engine(
        "vllm:http://127.0.0.1:8141", ckpt, state_dir=tmp_path / "state", weight_version="2", timeout_s=6,
        progress=progress, tie=True,
    )  # fmt: skip
    assert line == (
        f"vllm http://127.0.0.1:8141: restarted as 'pol' with {ckpt.resolve()} (pid 77){why}; proxies tag its calls "
        "with --engine 'vllm:http://127.0.0.1:8141?weight_version=2'"
    )
    assert ways["restart"] == [
        (
            "http://127.0.0.1:8141",
            str(ckpt.resolve()),
            {"state_dir": tmp_path / "state", "weight_version": "2", "ready_timeout_s": 6, "progress": progress,
             "tie": True, "adapter": None},
        )
    ]  # fmt: skip
    # Requests kept: a restart would drop them, so the failure is the answer.
    ways["restart"].clear()
    with pytest.raises(type(error)) as err:
        reload_engine("vllm:http://127.0.0.1:8141", ckpt, state_dir=tmp_path / "state", keep=True)
    assert err.value is error
    assert ways["restart"] == []


@pytest.mark.parametrize("state", ["none", "restart", "stopped"])
def test_keep_refuses_a_server_that_cannot_reload_in_place(tmp_path: Path, ways: dict[str, list], state: str) -> None:
    ckpt = _checkpoint(tmp_path)
    if state != "none":
        _managed(tmp_path, 8142, push="in-place" if state == "stopped" else "restart", running=state != "restart")
        if state == "stopped":
            _managed(tmp_path, 8142, running=False)
    with pytest.raises(InPlaceRefused) as err:
        reload_engine("vllm:http://127.0.0.1:8142", ckpt, state_dir=tmp_path / "state", keep=True)
    assert (
        str(err.value) == "http://127.0.0.1:8142 is not a running vLLM server started with --push in-place or adapter"
    )
    assert ways == {"in_place": [], "restart": [], "in_place_error": []}


@pytest.mark.parametrize("state", ["none", "restart", "stopped"])
def test_without_keep_a_server_that_cannot_reload_in_place_is_restarted(
    tmp_path: Path, ways: dict[str, list], state: str
) -> None:
    ckpt = _checkpoint(tmp_path)
    if state != "none":
        _managed(tmp_path, 8143, push="restart" if state == "restart" else "in-place", running=state == "restart")
    line = reload_engine("vllm:http://127.0.0.1:8143", ckpt, state_dir=tmp_path / "state")
    assert line == f"vllm http://127.0.0.1:8143: restarted as 'pol' with {ckpt.resolve()} (pid 77)"
    assert ways["in_place"] == [] and len(ways["restart"]) == 1
    assert ways["restart"][0][2]["tie"] is False  # outlives this shell's `polar engine reload`


def test_reload_refuses_what_is_no_checkpoint_or_no_engine_it_can_reload(tmp_path: Path, ways: dict) -> None:
    with pytest.raises(EngineError) as err:
        reload_engine("vllm:http://127.0.0.1:8144", tmp_path, state_dir=tmp_path)
    assert str(err.value) == f"{tmp_path} is not a model checkpoint (no config.json)"
    ckpt = _checkpoint(tmp_path)
    with pytest.raises(EngineError) as err:
        reload_engine("nope:x", ckpt, state_dir=tmp_path)
    assert str(err.value).startswith("unknown engine kind 'nope' in 'nope:x': use ")
    with pytest.raises(EngineError) as err:
        reload_engine(f"local:{tmp_path}", ckpt, state_dir=tmp_path)
    assert str(err.value) == (
        "the local engine runs inside the proxy process: restart the proxy with "
        f"--set polar_engine=local:{ckpt.resolve()} (in Python, LocalEngine.reload does it in place)"
    )
    from polar_addon.engines.spec import OPTIONS

    other = next(kind for kind in OPTIONS if kind not in ("sglang", "vllm", "local"))
    with pytest.raises(EngineError) as err:
        reload_engine(f"{other}:http://h:1", ckpt, state_dir=tmp_path)
    assert str(err.value) == (
        f"a {other} engine cannot load new weights ({other + ':http://h:1'!r}): use sglang:URL, vllm:URL or local:DIR"
    )
    assert ways == {"in_place": [], "restart": [], "in_place_error": []}


def test_sglang_loads_in_place_and_closes_its_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []

    class FakeSGLang:
        answer: dict = {"message": "Succeeded to update"}

        def __init__(self, target: str, timeout_s: float) -> None:
            seen.append(("init", target, timeout_s))

        async def update_weights(self, path: str, version: str | None) -> dict:
            seen.append(("update", path, version))
            return FakeSGLang.answer

        async def close(self) -> None:
            seen.append("close")

    monkeypatch.setattr("polar_addon.engines.sglang.SGLangEngine", FakeSGLang)
    ckpt = _checkpoint(tmp_path)
    line = reload_engine("sglang:http://h:30000", ckpt, weight_version="8", timeout_s=3)
    assert line == f"sglang http://h:30000: loaded {ckpt.resolve()} in place (Succeeded to update)"
    assert seen == [("init", "http://h:30000", 3), ("update", str(ckpt.resolve()), "8"), "close"]
    FakeSGLang.answer = {}
    assert reload_engine("sglang:http://h:30000", ckpt).endswith(" in place (ok)")


def test_the_tag_hint_names_the_proxy_spec(tmp_path: Path) -> None:
    server = _server(tmp_path, port=8150)
    assert serving._tag_hint(server, None) == ""
    assert serving._tag_hint(server, "12") == (
        "; proxies tag its calls with --engine 'vllm:http://127.0.0.1:8150?weight_version=12'"
    )
