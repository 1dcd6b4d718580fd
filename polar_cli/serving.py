"""The policy's engine servers: start a vLLM server (``polar engine serve``), stop it, and point a running engine at
new weights after a training step (``polar engine reload``, and ``polar loop`` on each push).

- ``sglang:URL``: SGLang loads a checkpoint in place (``SGLangEngine.update_weights``,
  ``POST /update_weights_from_disk``); in-flight requests finish first.
- ``vllm:URL``: a server started by ``polar engine serve --push in-place`` (``polar loop``'s default) loads the
  checkpoint in place: vLLM's own ``reload_weights`` (the worker's in-place reload from a weights path, which runs
  on its CPU backend too) through its ``/collective_rpc`` development endpoint, then ``/reset_prefix_cache`` so no
  KV computed by the old weights is reused; a fraction of a second where a restart takes ~30-50 s on 2 cores. Any
  failure there falls back to the restart. A server started with ``--push restart`` (the default of ``polar engine
  serve``: the development endpoints stay off) is restarted with the checkpoint, on the same port and under the
  same served model name (clients keep working). What was started is remembered in a small state file per port
  (pid, process start time, command line, push mode), so ``reload`` and ``stop`` find it from another shell.
- ``vllm:URL`` started by ``polar engine serve --push adapter``: the server keeps its base model and each push swaps
  its LoRA adapter for the checkpoint's ``adapter/`` (what ``polar train --lora-r`` saves), served under
  ``NAME-adapter`` (the engine spec's ``model=``); megabytes, not the model, and any embeddings.
- ``local:DIR``: the in-process engine reloads with ``LocalEngine.reload``; from the command line
  that engine lives inside the proxy, so the proxy is restarted with ``polar_engine=local:CKPT``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import orjson

from polar_addon.engines.spec import EngineSpec

# In the working directory, not the home: a checkout (or a test) keeps its engines to itself.
DEFAULT_STATE_DIR = Path(os.environ.get("POLAR_STATE_DIR", Path(".polar") / "engines"))
# vLLM's CPU backend sizes its memory from these; its defaults (0.92 of all memory) fail on a shared 24 GiB box.
CPU_MEMORY_FRACTION = "0.2"
CPU_KVCACHE_GIB = "2"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
PUSH_MODES = ("restart", "in-place", "adapter")
# `polar train --lora-r` saves the LoRA adapter here in its checkpoint, beside the merged weights.
ADAPTER_DIR = "adapter"
# The ranks vLLM 0.32 accepts as --max-lora-rank (config/lora.py MaxLoRARanks); an adapter of any rank up to it loads.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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
    # "in-place": started with vLLM's development endpoints (VLLM_SERVER_DEV_MODE), so reloads need no restart;
    # "adapter": the same, serving its base model plus one LoRA adapter that each push replaces.
    push: str = "restart"
    lora_rank: int = 0  # push "adapter": the largest adapter rank it loads (its --max-lora-rank)
    adapter: str | None = None  # push "adapter": the adapter directory it serves now (None: the base alone)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def adapter_name(self) -> str:
        """The name the adapter is served under (vLLM refuses an adapter named as its base)."""
        return f"{self.served_model_name}-adapter"

    @property
    def spec(self) -> str:
        """The engine spec a proxy samples this server's policy with: its adapter once one is loaded."""
        return f"{self.kind}:{self.url}" + (f"?model={self.adapter_name}" if self.adapter else "")


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


class NotManaged(EngineError):
    """No state file for the port: the engine there (if any) was not started by `polar engine serve`."""


def load_state(state_dir: Path, port: int) -> ManagedServer:
    path = state_path(state_dir, port)
    if not path.is_file():
        raise NotManaged(f"no engine on port {port} was started by `polar engine serve` (no {path.resolve()})")
    return ManagedServer(**orjson.loads(path.read_bytes()))


def served_names(url: str) -> list[str] | None:
    """The model names a server on ``url`` serves, or None when nothing answers there."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=2.0)
        return [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def port_of(url: str) -> int:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.port is None:
        raise EngineError(f"{url!r} has no port")
    return parsed.port


# --- vLLM -------------------------------------------------------------------------------------------


def vllm_python() -> str:
    """The vLLM venv's interpreter when the repo has one (machine.md), else this interpreter."""
    candidate = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
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
    tool_call_parser: str = "hermes",
    memory_fraction: str | None = None,
) -> tuple[list[str], int]:
    """The server argv and the index of the model path in it. ``extra_args`` win over polar's own flags."""
    extra = list(extra_args or [])
    given = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    cmd = [
        python or vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", served_model_name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
    ]  # fmt: skip
    wanted = [
        # Harnesses send tools: without a parser vLLM answers tool calls as plain text.
        ("--enable-auto-tool-choice", None),
        ("--tool-call-parser", tool_call_parser),
        # The trainer's importance ratios need log_softmax(logits / T), not raw logprobs.
        ("--logprobs-mode", "processed_logprobs"),
        # Never the model's generation_config.json sampling defaults: captures must be sampled as requested.
        ("--generation-config", "vllm"),
        ("--max-model-len", str(max_model_len) if max_model_len else None),
        ("--gpu-memory-utilization", memory_fraction),
    ]
    for flag, value in wanted:
        if flag in given or (value is None and flag != "--enable-auto-tool-choice"):
            continue
        cmd += [flag] if value is None else [flag, value]
    return cmd + extra, cmd.index("--model") + 1


def on_cpu() -> bool:
    """No NVIDIA device here: vLLM's CPU build then needs its memory sized (see CPU_MEMORY_FRACTION)."""
    return not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES")


def _launch(server: ManagedServer, tie: bool = False) -> None:
    """``tie``: the server dies with this process, however it dies (``polar_cli.lifeline``), e.g. one ``polar loop``
    started; without it the server outlives its ``polar engine serve`` on purpose."""
    with open(server.log, "ab") as log:
        # Own process group: vLLM forks an engine-core process that must stop with it.
        proc = subprocess.Popen(
            server.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **server.env},
            start_new_session=True,
        )  # fmt: skip
    if tie:
        from polar_cli import lifeline

        lifeline.tie(proc.pid)
    server.pid = proc.pid
    server.start_time = _proc_start_time(proc.pid) or 0


def wait_ready(
    server: ManagedServer, timeout_s: float = READY_TIMEOUT_S, progress: Callable[[float, str], None] | None = None
) -> None:
    """Until ``GET /v1/models`` lists the served name; fail early if the process died.

    ``progress(seconds waited, last log line)`` is called about once a second while waiting.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if not is_running(server):
            raise EngineError(f"engine on port {server.port} exited: {failure_report(server.log)}")
        names = served_names(server.url)
        if names and server.served_model_name in names:
            return
        if progress is not None:
            progress(time.monotonic() - started, last_line(server.log))
        time.sleep(1.0)
    raise EngineError(f"engine on port {server.port} not ready after {timeout_s:.0f} s: {failure_report(server.log)}")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def last_line(path: str) -> str:
    lines = [line for line in _read(path)[-4000:].splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


# An exception line of a Python traceback ("ValueError: ...", "torch.OutOfMemoryError: ...").
_EXCEPTION = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?.*$")
# Lines that only point elsewhere ("See root cause above", "Engine core initialization failed").
_WRAPPER = re.compile(r"root cause above|initialization failed|failed to start|Traceback", re.I)


def root_cause(log: str) -> str | None:
    """The first line of ``log`` that names what went wrong: vLLM's engine process raises first, then the API
    server wraps it in errors that only say "see above", so the first exception line (not the tail) is the cause."""
    lines = log.splitlines()
    for line in lines:
        if _EXCEPTION.match(line) and not _WRAPPER.search(line):
            return line.strip()
    for pattern in (r"\bERROR\b", r"\b[A-Z]\w*(?:Error|Exception)\b"):
        for line in lines:
            if re.search(pattern, line) and not _WRAPPER.search(line):
                return line.strip()
    return None


def failure_report(log_path: str) -> str:
    text = _read(log_path)
    cause = root_cause(text)
    tail = "\n".join(text.splitlines()[-15:])
    head = f"{cause}\n" if cause else ""
    return f"{head}(full log: {log_path}; last lines:)\n{tail}"


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
    from polar_cli import lifeline

    lifeline.untie(server.pid)  # a no-op unless this process tied it


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
    tool_call_parser: str = "hermes",
    memory_fraction: str | None = None,
    kvcache_gib: str | None = None,
    progress: Callable[[float, str], None] | None = None,
    tie: bool = False,
    push: str = "restart",
    lora_rank: int = 0,
) -> ManagedServer:
    """Start vLLM with the flags polar needs; on a machine without a GPU, sized for vLLM's CPU backend. ``tie``: the
    server dies with this process, also by SIGKILL and while it is still starting (a loop's engine). ``push``:
    ``in-place`` turns on vLLM's development endpoints (bound to 127.0.0.1 like the server) for in-place reloads;
    ``adapter`` those and vLLM's runtime LoRA loading, for adapters of rank up to ``lora_rank`` over ``model``."""
    if push not in PUSH_MODES:
        raise EngineError(f"push must be one of {', '.join(PUSH_MODES)}, not {push!r}")
    if push == "adapter" and lora_rank <= 0:
        raise EngineError("--push adapter needs the rank of the LoRA adapters it will load (--lora-rank)")
    path = state_path(state_dir, port)
    if path.is_file() and is_running(load_state(state_dir, port)):
        raise EngineError(f"an engine started by polar already serves port {port} (stop it first)")
    if served_names(f"http://127.0.0.1:{port}") is not None:
        raise EngineError(f"something already answers on port {port}: stop it or pick another --port")
    if not (Path(model) / "config.json").is_file():
        raise EngineError(f"{model} is not a model directory (no config.json)")
    model = str(Path(model).resolve())
    name = served_model_name or Path(model).name
    env = dict(env or {})
    if on_cpu():
        memory_fraction = memory_fraction or CPU_MEMORY_FRACTION
        env.setdefault(
            "VLLM_CPU_KVCACHE_SPACE", kvcache_gib or os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        )
    elif kvcache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = kvcache_gib
    if push in ("in-place", "adapter"):
        env["VLLM_SERVER_DEV_MODE"] = "1"
        # The scale-out endpoints report which weight version sampled each token (engines.vllm, versions=spans):
        # what lets a push land while requests run (reload_vllm_in_place with keep).
        if "--enable-scale-out" not in (extra_args or []):
            extra_args = [*(extra_args or []), "--enable-scale-out"]
    if push == "adapter":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
        lora_rank = max_lora_rank(lora_rank)
        # Before the extra args, which win (argparse keeps the last).
        extra_args = ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1", *(extra_args or [])]
    command, model_arg = vllm_command(
        model, port, name, python=python, dtype=dtype, max_model_len=max_model_len, extra_args=extra_args,
        tool_call_parser=tool_call_parser, memory_fraction=memory_fraction,
    )  # fmt: skip
    state_dir.mkdir(parents=True, exist_ok=True)
    server = ManagedServer(
        kind="vllm", port=port, model=model, served_model_name=name, command=command, model_arg=model_arg,
        env=env, log=str((state_dir / f"engine-{port}.log").resolve()), history=[model], push=push,
        lora_rank=lora_rank if push == "adapter" else 0,
    )  # fmt: skip
    Path(server.log).unlink(missing_ok=True)  # the root cause is searched from the top: this start's only
    _launch(server, tie)
    save_state(server, state_dir)
    try:
        wait_ready(server, ready_timeout_s, progress)
    except EngineError:
        stop_process(server)
        state_path(state_dir, port).unlink(missing_ok=True)
        raise
    return server


def restart_vllm(
    url: str,
    checkpoint: str,
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    weight_version: str | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    progress: Callable[[float, str], None] | None = None,
    tie: bool = False,
    adapter: str | None = None,
) -> ManagedServer:
    """Restart the server on ``checkpoint``; with ``adapter`` (a server started with --push adapter), on its base
    model with that adapter loaded at start (``--lora-modules``) instead."""
    try:
        server = load_state(state_dir, port_of(url))
    except NotManaged as exc:
        raise NotManaged(f"{exc}: {_restart_advice(url, checkpoint, state_dir)}") from None
    stop_process(server)
    command = _without_lora_modules(server.command)
    if adapter is None:
        command[server.model_arg] = checkpoint
    else:
        command += ["--lora-modules", f"{server.adapter_name}={adapter}"]
    server.command, server.adapter = command, adapter
    _loaded(server, checkpoint, weight_version, "" if adapter is None else f" (restarted with its adapter {adapter})")
    _launch(server, tie)
    save_state(server, state_dir)
    wait_ready(server, ready_timeout_s, progress)
    return server


def _without_lora_modules(command: list[str]) -> list[str]:
    """``command`` less the adapter a restart with one loaded at start (``--lora-modules NAME=PATH``)."""
    out: list[str] = []
    skip = False
    for arg in command:
        if skip:
            skip = False
        elif arg == "--lora-modules":
            skip = True
        elif not arg.startswith("--lora-modules="):
            out.append(arg)
    return out


def max_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that loads an adapter of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise EngineError(f"vLLM loads LoRA adapters of rank up to {VLLM_LORA_RANKS[-1]}, not {rank}")


def adapter_refusal(checkpoint: Path, server: ManagedServer) -> str | None:
    """Why ``server`` (started with --push adapter) cannot serve ``checkpoint``'s adapter in place, or None."""
    adapter = checkpoint / ADAPTER_DIR
    try:
        config = orjson.loads((adapter / "adapter_config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return f"it holds no LoRA adapter (`polar train --lora-r` saves one in {adapter})"
    rank = config.get("r")
    if not isinstance(rank, int) or rank > server.lora_rank:
        return f"its adapter's rank {rank} is above the server's --max-lora-rank {server.lora_rank}"
    # An adapter is a difference from the weights it was trained on: over another base it is another policy.
    trained_on, base = config.get("base_model_name_or_path"), server.command[server.model_arg]
    if not isinstance(trained_on, str) or Path(trained_on).resolve() != Path(base).resolve():
        return f"its adapter was trained on {trained_on}, but the server's base model is {base}"
    return None


def _loaded(server: ManagedServer, checkpoint: str, weight_version: str | None, how: str) -> None:
    """Record in ``server`` (and its log) that it now serves ``checkpoint``; the caller saves the state."""
    server.model = checkpoint
    server.weight_version = weight_version
    server.history.append(checkpoint)
    with open(server.log, "ab") as log:
        log.write(f"\n--- polar engine reload: {checkpoint}{how}\n".encode())


class InPlaceRefused(EngineError):
    """This checkpoint or server cannot be loaded in place (a restart can)."""


def in_place_refusal(checkpoint: Path) -> str | None:
    """Why vLLM cannot load ``checkpoint`` in place, or None. Tied input/output embeddings: vLLM 0.32's layerwise
    reload loads the embedding but fails on the tied LM head (``ParallelLMHead: Failed to load weights``), which then
    serves neither the old weights nor the new ones (measured: logprobs off by 0.8 nats on the tiny model)."""
    try:
        config = orjson.loads((checkpoint / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return "its config.json cannot be read"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    if tied:  # transformers' default is tied when the config does not say
        return "tied embeddings, which vLLM's in-place reload leaves half loaded"
    return None


def reload_vllm_in_place(
    url: str,
    checkpoint: str,
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    weight_version: str | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    keep: bool = False,
) -> ManagedServer:
    """Load ``checkpoint`` into the running server's workers (``reload_weights`` with a weights path), drop its
    prefix cache, and label what it samples from now on ``weight_version``.

    Without ``keep`` the caller makes sure no request is in flight. With ``keep``, requests may be running: generation
    is paused with ``mode=keep`` (requests stay queued), the weights reloaded, the running requests preempted by the
    cache reset (``reset_running_requests``: their prompt and the tokens sampled so far are recomputed by the new
    weights when they resume, so no token is sampled on KV of the old weights), the version set, and generation
    resumed: every token after the push is the new version's, and the scale-out endpoints say which are.

    A server started with --push adapter swaps its LoRA adapter for ``checkpoint``'s instead, the same steps around
    it, nothing in flight: the old adapter unloaded and the new one loaded under the same name (a fresh adapter id,
    read from disk once). Never ``load_inplace``: vLLM 0.32 then re-reads the adapter from disk at every decoding
    step of every request that names it (measured ~30% fewer tokens/s on the tiny model, far worse for a real
    adapter), and the requests running during such a load keep reloading the old adapter's path, so they would not
    go on with the new weights: a push of requests kept is refused for adapters."""
    server = load_state(state_dir, port_of(url))
    adapter = None
    if server.push == "adapter":
        names = {"lora_name": server.adapter_name}
        refusal = adapter_refusal(Path(checkpoint), server)
        if refusal is None and keep:
            refusal = (
                "requests running on a LoRA adapter cannot go on with another (vLLM 0.32): push with none in flight"
            )
        adapter = str(Path(checkpoint) / ADAPTER_DIR)
        # A 404 on the unload: the server holds no adapter under that name (none loaded yet, or lost).
        steps = [(f"{server.url}/v1/unload_lora_adapter", names, True)] if server.adapter else []
        steps.append((f"{server.url}/v1/load_lora_adapter", {**names, "lora_path": adapter}, False))
    elif server.push == "in-place":
        refusal = in_place_refusal(Path(checkpoint))
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": checkpoint, "is_checkpoint_format": True}}
        steps = [(f"{server.url}/collective_rpc", rpc, False)]
    else:
        raise InPlaceRefused(f"{server.url} was started with --push {server.push}: it has no in-place reload")
    if refusal is not None:
        raise InPlaceRefused(refusal)
    paused = loaded = unloaded = False
    # One client, one connection, for the whole push: a client per call builds an SSL context each time (~40 ms, more
    # on a core the running batch keeps busy), inside the window in which a keep push holds the engine paused.
    client = httpx.Client()
    try:
        try:
            if keep:
                # A pause that failed in the engine (500) or whose answer was lost (a timeout) may have paused it:
                # resume then too (resuming a running engine does nothing). Only a refusal (4xx) did nothing.
                paused = True
                pause = client.post(f"{server.url}/pause", params={"mode": "keep"}, timeout=timeout_s)
                paused = not pause.is_client_error
                pause.raise_for_status()
            for endpoint, body, missing_ok in steps:
                answer = client.post(endpoint, json=body, timeout=timeout_s)
                if not (missing_ok and answer.status_code == 404):
                    answer.raise_for_status()
                unloaded = unloaded or endpoint.endswith("/unload_lora_adapter")
            loaded = True
            server.adapter = adapter or server.adapter
            reset = client.post(
                f"{server.url}/reset_prefix_cache",
                params={"reset_running_requests": str(keep).lower()},
                timeout=timeout_s,
            )
            reset.raise_for_status()
            try:
                success = reset.json().get("success")
            except ValueError:  # an older vLLM answers 200 without a body: it says nothing either way
                success = None
            if success is False:
                raise EngineError(f"vLLM on {server.url} kept its prefix cache of the old weights (blocks still held)")
            if weight_version is not None:
                label_version(server.url, weight_version, timeout_s, client)
        except httpx.HTTPError as exc:
            detail = getattr(getattr(exc, "response", None), "text", "")[:300]
            raise EngineError(f"vLLM on {server.url} could not reload {checkpoint} in place: {exc} {detail}") from exc
        finally:
            try:
                if paused:
                    _resume(server.url, timeout_s, client)
            finally:
                client.close()
    except EngineError:
        if loaded:
            # The workers hold the checkpoint whatever failed after the load: the state names it, with no version
            # (the server's own label may still be the old version's, so what it samples has no known version).
            _loaded(server, checkpoint, None, " (in place; the weights loaded, then the reload failed: no version)")
            save_state(server, state_dir)
        elif unloaded:
            # The old adapter is gone and the new one did not load: the base alone answers, under its own name.
            server.adapter = None
            _loaded(server, server.command[server.model_arg], None, " (its adapter unloaded, the next one not loaded)")
            save_state(server, state_dir)
        raise
    how = " (in place, requests kept)" if keep else " (in place)"
    _loaded(server, checkpoint, weight_version, how if adapter is None else f"{how[:-1]}: its adapter)")
    save_state(server, state_dir)
    return server


def _resume(url: str, timeout_s: float, client: httpx.Client) -> None:
    """Generation goes on whatever the reload did: a server left paused would hang every request it holds."""
    try:
        client.post(f"{url}/resume", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        raise EngineError(f"vLLM on {url} did not resume after the reload: {exc}") from exc


def label_version(url: str, weight_version: str, timeout_s: float = 60.0, client: httpx.Client | None = None) -> None:
    """Tell a server with the development endpoints which weight version it holds: the scale-out endpoints report it
    for every token sampled from now on (vLLM's own ``default`` before anyone says). ``client``: the caller's, in a
    sequence of calls."""
    post = httpx.post if client is None else client.post
    answer = post(f"{url}/update_weight_version", json={"new_version": weight_version}, timeout=timeout_s)
    answer.raise_for_status()


def _restart_advice(url: str, checkpoint: str, state_dir: Path) -> str:
    """What to do about an engine polar cannot restart, with the exact commands."""
    port = port_of(url)
    names = served_names(url)
    if names is None:
        return (
            f"nothing answers on {url} either. Start one that reload can restart: "
            f"`polar engine serve {checkpoint} --port {port}`"
        )
    name = names[0] if names else "NAME"
    return (
        f"{url} serves {names} but was started some other way, so polar cannot restart it. Either restart it "
        f"yourself with `--model {checkpoint} --served-model-name {name}` (same flags otherwise), or stop it and "
        f"let polar manage it: `polar engine serve {checkpoint} --port {port} --served-model-name {name}` "
        f"(later reloads then work; if it was started by `polar engine serve` from another directory, pass "
        f"that directory's --state-dir, here {state_dir.resolve()})"
    )


def stop_engine(url: str, *, state_dir: Path = DEFAULT_STATE_DIR) -> tuple[ManagedServer, bool]:
    """Stop a served engine and forget it; (server, whether it was still running)."""
    try:
        server = load_state(state_dir, port_of(url))
    except NotManaged:
        raise NotManaged(
            f"no engine started by `polar engine serve` is known on port {port_of(url)} "
            f"(already stopped, or its state is in another --state-dir than {state_dir.resolve()})"
        ) from None
    running = is_running(server)
    stop_process(server)
    state_path(state_dir, server.port).unlink(missing_ok=True)
    return server, running


# --- one entry point --------------------------------------------------------------------------------


def reload_engine(
    spec: str,
    checkpoint: Path,
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    weight_version: str | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    progress: Callable[[float, str], None] | None = None,
    tie: bool = False,
    keep: bool = False,
) -> str:
    """Make the engine named by ``spec`` serve ``checkpoint``; returns a line saying what was done. ``keep``: requests
    may be running on a vLLM server and must survive (reload_vllm_in_place): no restart, which would drop them."""
    if not (checkpoint / "config.json").is_file():
        raise EngineError(f"{checkpoint} is not a model checkpoint (no config.json)")
    try:
        parsed = EngineSpec.parse(spec)  # a proxy's spec (URL?weight_version=V) names the same server
    except ValueError as exc:
        raise EngineError(str(exc)) from exc
    kind, target = parsed.kind, parsed.target
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
        fallback = ""
        try:
            managed = load_state(state_dir, port_of(target))
        except NotManaged:
            managed = None
        in_place = managed is not None and managed.push in ("in-place", "adapter") and is_running(managed)
        if keep and not in_place:
            raise InPlaceRefused(f"{target} is not a running vLLM server started with --push in-place or adapter")
        if in_place:
            try:
                server = reload_vllm_in_place(
                    target, ckpt, state_dir=state_dir, weight_version=weight_version, timeout_s=timeout_s, keep=keep
                )
                what = f"{ckpt}'s adapter" if server.push == "adapter" else ckpt
                name = server.adapter_name if server.push == "adapter" else server.served_model_name
                return f"vllm {server.url}: loaded {what} in place as {name!r}" + _tag_hint(server, weight_version)
            except InPlaceRefused as exc:
                if keep:
                    raise
                fallback = f" (not in place: {exc})"
            except EngineError as exc:
                if keep:
                    raise
                fallback = f" (the in-place reload failed, so it was restarted: {exc})"
        # A server of adapters keeps its base across a restart when the checkpoint's adapter fits it.
        adapter = None
        if managed is not None and managed.push == "adapter" and adapter_refusal(checkpoint, managed) is None:
            adapter = str(checkpoint.resolve() / ADAPTER_DIR)
        server = restart_vllm(
            target,
            ckpt,
            state_dir=state_dir,
            weight_version=weight_version,
            ready_timeout_s=timeout_s,
            progress=progress,
            tie=tie,
            adapter=adapter,
        )
        what = f"{ckpt}'s adapter as {server.adapter_name!r}" if adapter else ckpt
        line = f"vllm {server.url}: restarted as {server.served_model_name!r} with {what} (pid {server.pid})"
        return line + fallback + _tag_hint(server, weight_version)
    if kind == "local":
        raise EngineError(
            "the local engine runs inside the proxy process: restart the proxy with "
            f"--set polar_engine=local:{ckpt} (in Python, LocalEngine.reload does it in place)"
        )
    raise EngineError(f"a {kind} engine cannot load new weights ({spec!r}): use sglang:URL, vllm:URL or local:DIR")


def _tag_hint(server: ManagedServer, weight_version: str | None) -> str:
    # vLLM answers carry no version: a proxy tags them when its spec says which version the server holds. An
    # adapter is asked for by its name, which the spec says too.
    if weight_version is None and not server.adapter:
        return ""
    spec = EngineSpec.parse(server.spec).with_params(weight_version=weight_version)
    what = "tag its calls" if weight_version is not None else "sample its adapter"
    return f"; proxies {what} with --engine '{spec}'"
