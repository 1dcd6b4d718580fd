"""Point a running engine at new weights after a training step.

- ``sglang:URL``: SGLang loads a checkpoint in place (``SGLangEngine.update_weights``,
  ``POST /update_weights_from_disk``); in-flight requests finish first.
- ``vllm:URL``: vLLM has no in-place load from disk, so a server started by ``polar engine
  serve`` is restarted with the checkpoint, on the same port and under the same served model
  name (clients keep working). What was started is remembered in a small state file per port
  (pid, process start time, command line), so ``reload`` and ``stop`` find it from another shell.
- ``local:DIR``: the in-process engine reloads with ``LocalEngine.reload``; from the command line
  that engine lives inside the proxy, so the proxy is restarted with ``polar_engine=local:CKPT``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import orjson

DEFAULT_STATE_DIR = Path(os.environ.get("POLAR_STATE_DIR", Path.home() / ".polar" / "engines"))
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


class EngineError(RuntimeError):
    pass


@dataclass
class ManagedServer:
    kind: str  # "vllm"
    port: int
    model: str
    served_model_name: str
    command: list[str]  # argv with the model path at index ``model_arg``
    model_arg: int
    env: dict[str, str]
    log: str
    pid: int = 0
    start_time: int = 0  # /proc/PID/stat field 22: tells our process from a recycled pid
    weight_version: str | None = None
    history: list[str] = field(default_factory=list)  # every model this port served, oldest first

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.url}"


# --- process bookkeeping --------------------------------------------------------------------------


def _proc_start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; fields after the closing parenthesis are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_running(server: ManagedServer) -> bool:
    return server.pid > 0 and _proc_start_time(server.pid) == server.start_time


def state_path(state_dir: Path, port: int) -> Path:
    return state_dir / f"engine-{port}.json"


def save_state(server: ManagedServer, state_dir: Path) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_path(state_dir, server.port)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(asdict(server), option=orjson.OPT_INDENT_2))
    tmp.replace(path)
    return path


def load_state(state_dir: Path, port: int) -> ManagedServer:
    path = state_path(state_dir, port)
    if not path.is_file():
        raise EngineError(
            f"no engine on port {port} was started by `polar engine serve` (no {path}); "
            "restart it yourself with the checkpoint as its model"
        )
    return ManagedServer(**orjson.loads(path.read_bytes()))


def port_of(url: str) -> int:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.port is None:
        raise EngineError(f"{url!r} has no port")
    return parsed.port


# --- vLLM -------------------------------------------------------------------------------------------


def vllm_python() -> str:
    """The vLLM venv's interpreter when the repo has one (machine.md), else this interpreter."""
    candidate = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def vllm_command(
    model: str,
    port: int,
    served_model_name: str,
    *,
    python: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    extra_args: list[str] | None = None,
) -> tuple[list[str], int]:
    """The server argv and the index of the model path in it."""
    cmd = [
        python or vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", served_model_name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        # The trainer's importance ratios need log_softmax(logits / T), not raw logprobs.
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args or []), cmd.index("--model") + 1


def _launch(server: ManagedServer) -> None:
    with open(server.log, "ab") as log:
        # Own process group: vLLM forks an engine-core process that must stop with it.
        proc = subprocess.Popen(
            server.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **server.env},
            start_new_session=True,
        )  # fmt: skip
    server.pid = proc.pid
    server.start_time = _proc_start_time(proc.pid) or 0


def wait_ready(server: ManagedServer, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until ``GET /v1/models`` lists the served name; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_running(server):
            raise EngineError(f"engine on port {server.port} exited; log tail:\n{_tail(server.log)}")
        try:
            r = httpx.get(f"{server.url}/v1/models", timeout=2.0)
            if r.status_code == 200 and any(m.get("id") == server.served_model_name for m in r.json()["data"]):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise EngineError(f"engine on port {server.port} not ready after {timeout_s:.0f} s; log tail:\n{_tail(server.log)}")


def _tail(path: str, n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def stop_process(server: ManagedServer, timeout_s: float = STOP_TIMEOUT_S) -> None:
    if not is_running(server):
        return
    os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while is_running(server) and time.monotonic() < deadline:
        _reap(server.pid)
        time.sleep(0.2)
    try:
        os.killpg(server.pid, signal.SIGKILL)  # whatever of the group is left (the engine-core child)
    except ProcessLookupError:
        pass
    _reap(server.pid)


def _reap(pid: int) -> None:
    # Only a process this interpreter started is our child; from another shell init reaps it.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def serve_vllm(
    model: str,
    *,
    port: int,
    served_model_name: str | None = None,
    state_dir: Path = DEFAULT_STATE_DIR,
    python: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> ManagedServer:
    path = state_path(state_dir, port)
    if path.is_file() and is_running(load_state(state_dir, port)):
        raise EngineError(f"an engine started by polar already serves port {port} (stop it first)")
    name = served_model_name or Path(model).name
    command, model_arg = vllm_command(
        model, port, name, python=python, dtype=dtype, max_model_len=max_model_len, extra_args=extra_args
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    server = ManagedServer(
        kind="vllm", port=port, model=model, served_model_name=name, command=command, model_arg=model_arg,
        env=dict(env or {}), log=str(state_dir / f"engine-{port}.log"), history=[model],
    )  # fmt: skip
    _launch(server)
    save_state(server, state_dir)
    try:
        wait_ready(server, ready_timeout_s)
    except EngineError:
        stop_process(server)
        raise
    return server


def restart_vllm(
    url: str,
    checkpoint: str,
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    weight_version: str | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> ManagedServer:
    server = load_state(state_dir, port_of(url))
    stop_process(server)
    server.command[server.model_arg] = checkpoint
    server.model = checkpoint
    server.weight_version = weight_version
    server.history.append(checkpoint)
    _launch(server)
    save_state(server, state_dir)
    wait_ready(server, ready_timeout_s)
    return server


def stop_engine(url: str, *, state_dir: Path = DEFAULT_STATE_DIR) -> ManagedServer:
    server = load_state(state_dir, port_of(url))
    stop_process(server)
    state_path(state_dir, server.port).unlink(missing_ok=True)
    return server


# --- one entry point --------------------------------------------------------------------------------


def reload_engine(
    spec: str,
    checkpoint: Path,
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    weight_version: str | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> str:
    """Make the engine named by ``spec`` serve ``checkpoint``; returns a line saying what was done."""
    if not (checkpoint / "config.json").is_file():
        raise EngineError(f"{checkpoint} is not a model checkpoint (no config.json)")
    kind, _, target = spec.strip().partition(":")
    ckpt = str(checkpoint.resolve())
    if kind == "sglang":
        from polar_addon.engines.sglang import SGLangEngine

        async def update() -> dict:
            engine = SGLangEngine(target, timeout_s=timeout_s)
            try:
                return await engine.update_weights(ckpt, weight_version)
            finally:
                await engine.close()

        answer = asyncio.run(update())
        return f"sglang {target}: loaded {ckpt} in place ({answer.get('message', 'ok')})"
    if kind == "vllm":
        server = restart_vllm(
            target, ckpt, state_dir=state_dir, weight_version=weight_version, ready_timeout_s=timeout_s
        )
        return f"vllm {server.url}: restarted as {server.served_model_name!r} with {ckpt} (pid {server.pid})"
    if kind == "local":
        raise EngineError(
            "the local engine runs inside the proxy process: restart the proxy with "
            f"--set polar_engine=local:{ckpt} (in Python, LocalEngine.reload does it in place)"
        )
    raise EngineError(f"unknown engine kind {kind!r} in {spec!r}: use sglang:URL, vllm:URL or local:DIR")
