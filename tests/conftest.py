"""Session-wide fixtures shared by every test module.

- ``tiny_model_dir`` (session): a directory holding the tiny random Qwen3 model and its tokenizer
  (``polar_cli.tiny_model.build_tiny_model``), built once per test session (~7 s) into a temp dir. Its
  generation_config.json carries Qwen3's sampling defaults (T=0.6, top_p 0.95, top_k 20), which vLLM applies
  to a request that leaves them out: a direct vLLM call must send every sampling parameter explicitly.
- ``vllm_server`` (session, tests using it must be marked ``@pytest.mark.vllm``): a real vLLM CPU
  server (``.venv-vllm``) serving that model as ``VLLM_MODEL_NAME``; yields its base URL
  ``http://127.0.0.1:PORT`` (append ``/v1`` for OpenAI clients). Started on first use (~60-75 s),
  stopped at session end. It runs with ``--enable-auto-tool-choice --tool-call-parser hermes`` and
  ``--logprobs-mode processed_logprobs``, so reported logprobs are log_softmax(logits / T).
- ``vllm_small_window_server`` (module scope: stopped after the module that uses it; ``@pytest.mark.vllm``): the
  same with ``--max-model-len 20480`` (``VLLM_SMALL_WINDOW``) and ``--enforce-eager``, for harness sessions that
  meet a real engine's window (tests/test_long_sessions_vllm.py).

Parallel runs (``make test`` runs ``pytest -n 2 --dist loadgroup``): ``pytest_collection_modifyitems`` puts each
test in an xdist group, so an expensive fixture starts in one worker only: every test using ``vllm_server`` in one
group, ``vllm_small_window_server`` in another, the podman and Ray modules each in one, and every other test in its
module's group (module-scoped fixtures, e.g. a module's proxy, start once).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _pytest.nodeid import NodeId

from tests.support.prereq import missing

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_MODEL_NAME = "tiny"
VLLM_START_TIMEOUT_S = 300.0


# Modules that share host-global state (podman's image tags and storage, a local Ray cluster's ports): one
# worker runs all of them.
_SHARED_STATE_GROUPS = {
    "test_rollout_sandbox.py": "podman",
    "test_rollout_presets.py": "podman",
    "test_rollout_ray.py": "ray",
}


def xdist_group_of(item: pytest.Item) -> str:
    """The one xdist group ``item`` runs in: keyed on its fixture closure, so a new test using an engine joins
    that engine's worker without a marker."""
    fixtures = set(item.fixturenames)
    if "vllm_small_window_server" in fixtures:
        return "vllm-8k"
    if "vllm_server" in fixtures:
        return "vllm"
    module = item.path.name
    return _SHARED_STATE_GROUPS.get(module, module)


# Seconds per test (setup + call + teardown, shared fixture starts included) measured by a full two-worker run with
# POLAR_RECORD_DURATIONS=tests/durations.json, only to order the groups for two workers: the longest first, so the
# short ones fill in at the end (xdist's default order, by number of tests, would leave a 2-test Ray group or a
# 1-test training run to last). A test the file does not know yet gets a rough estimate.
DURATIONS = Path(__file__).with_name("durations.json")
_START_COST_S = {
    "vllm": 75.0,
    "vllm-8k": 110.0,
    "ray": 120.0,
    "podman": 60.0,
    "test_tito_vllm_sessions.py": 45.0,  # its own vLLM server (the ending model)
    "test_async_loop.py": 150.0,
}  # four loops with trainings, one on its own vLLM (restarted once)


def _cost_estimate_s(item: pytest.Item) -> float:
    if any(item.get_closest_marker(m) for m in ("vllm", "harness", "slow")):
        return 20.0
    return 5.0 if "tiny_model_dir" in item.fixturenames else 0.2


def _measured_durations() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def _plain_nodeid(nodeid: str) -> str:
    """The node id without the ``@group`` suffix this conftest appends (groups are ``[\\w.-]+``)."""
    head, at, tail = nodeid.rpartition("@")
    return head if at and tail and all(c.isalnum() or c in "._-" for c in tail) else nodeid


def _group(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


def pytest_itemcollected(item: pytest.Item) -> None:
    # Here, not in pytest_collection_modifyitems: xdist's worker reads the markers into the node ids in that hook.
    if item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):
        return  # a serial run keeps pytest's own order
    measured = _measured_durations()
    cost: dict[str, float] = {}
    for item in items:
        group = _group(item)
        known = measured.get(_plain_nodeid(item.nodeid))
        start = 0.0 if measured else _START_COST_S.get(group, 0.0)  # measured figures include the starts
        cost[group] = cost.get(group, start) + (known if known is not None else _cost_estimate_s(item))
    items.sort(key=lambda item: -cost[_group(item)])  # stable: a group keeps its own order
    for item in items:
        # xdist 3.8 names the group in the node id by setting ``item._nodeid``, which pytest 9.2 no longer reads
        # (its node id lives in ``_id``): without this every test is its own unit and the groups mean nothing.
        suffix = f"@{_group(item)}"
        if not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts background commands with SIGINT ignored, and that survives exec: a suite run
    # as `make test &` would hand every child (`polar proxy`, mitmdump) an ignored SIGINT, and each graceful stop the
    # tests make would wait out its grace and SIGKILL. The tests stop things as a terminal's Ctrl-C would.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_recorded: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("POLAR_RECORD_DURATIONS"):  # the controller sees every worker's reports
        key = _plain_nodeid(report.nodeid)
        _recorded[key] = _recorded.get(key, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("POLAR_RECORD_DURATIONS")
    if out and _recorded and not hasattr(session.config, "workerinput"):
        Path(out).write_text(json.dumps({k: round(v, 2) for k, v in sorted(_recorded.items())}, indent=0) + "\n")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from polar_cli.tiny_model import build_tiny_model

    prebuilt = os.environ.get("POLAR_TEST_TINY_MODEL")
    if prebuilt:  # bench/mutation.py: one build for thousands of short test sessions
        return Path(prebuilt)
    # Qwen3's sampling defaults in generation_config.json, as real checkpoints have them: an engine
    # falling back to them (instead of what polar records) shows in every vLLM test.
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", generation_defaults="qwen3")


# Qwen3's switch: with enable_thinking false the generation prompt opens an empty think block.
THINKING_SWITCH = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
)


@pytest.fixture(scope="session")
def thinking_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that reads ``enable_thinking`` the way Qwen3's does."""
    import shutil

    out = tmp_path_factory.mktemp("models") / "tiny-thinking"
    shutil.copytree(tiny_model_dir, out)
    template = out / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING_SWITCH)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm"), ["--max-model-len", "100000"]) as url:
        yield url


VLLM_SMALL_WINDOW = 20480


@pytest.fixture(scope="module")
def vllm_small_window_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second vLLM server with a 20k ``--max-model-len``, above every harness's own first prompt: the harnesses
    run past a real engine's own window (its refusals, its counts). ``--enforce-eager`` skips the compile step on
    CPU; a 20k window of the tiny model needs little KV cache."""
    with _vllm(
        tiny_model_dir,
        tmp_path_factory.mktemp("vllm-small-window"),
        ["--max-model-len", str(VLLM_SMALL_WINDOW), "--enforce-eager"],
        kv_cache_gib=1,
    ) as url:
        yield url


@contextlib.contextmanager
def _vllm(model_dir: Path, log_dir: Path, extra_args: list[str], kv_cache_gib: int = 2) -> Iterator[str]:
    if not VLLM_PYTHON.exists():
        missing(f"vLLM CPU venv missing ({VLLM_PYTHON}); run `make engine`")
    port = free_port()
    log_path = log_dir / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", VLLM_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--gpu-memory-utilization", "0.2", "--dtype", "float32",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--logprobs-mode", "processed_logprobs", *extra_args,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        # Own process group: vLLM forks an engine-core process that must stop with it.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready after {VLLM_START_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    # Whatever of the group is still alive (the engine-core child, a hung server) goes now.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="session")
def sglang_protocol():
    """SGLang 0.5.23's own protocol classes, for the contract server that stands in for SGLang (no GPU here)."""
    from tests.support.sglang_contract_server import ContractUnavailable, load_protocol

    try:
        return load_protocol()
    except ContractUnavailable as exc:
        # Never a silent skip: `make test` fetches the wheel first (`make sglang-contract`).
        pytest.fail(f"SGLang 0.5.23 protocol unavailable ({exc}); run `make sglang-contract`")


@pytest.fixture(scope="session")
def reference_logprobs(tiny_model_dir: Path):
    """``fn(prompt_ids, response_ids, temperature) -> list[float]``: log_softmax(logits / T) of
    ``response_ids`` from one plain transformers forward pass over prompt + response (fp32), the
    value a trainer recomputes. Independent of the engines' own code."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def compute(prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
        ids = torch.tensor([list(prompt_ids) + list(response_ids)])
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0].float()
        scale = temperature if temperature > 0 else 1.0
        logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1] / scale, dim=-1)
        return logprobs.gather(1, torch.tensor(response_ids)[:, None])[:, 0].tolist()

    return compute
