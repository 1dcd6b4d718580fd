"""`polar engine serve|reload|stop` and `polar train`'s argument checks: each failure says what happened and
what to do (no vLLM needed: the engine here is an interpreter without vLLM, or a plain HTTP server)."""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_cli.app import app
from polar_cli.serving import root_cause, vllm_command
from tests.conftest import free_port

runner = CliRunner()

VLLM_FAILURE_LOG = """\
INFO 11-30 14:01:02 [api_server.py:1] vLLM API server version 0.32.0
(EngineCore_DP0 pid=123) ERROR 11-30 14:01:09 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=123) Traceback (most recent call last):
(EngineCore_DP0 pid=123)   File "/x/vllm/v1/engine/core.py", line 699, in run_engine_core
ValueError: CPU memory utilization 0.92 > available memory 11.3 GiB of 24.0 GiB; lower --gpu-memory-utilization
Traceback (most recent call last):
  File "/x/vllm/entrypoints/openai/api_server.py", line 1, in <module>
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_root_cause_is_the_first_real_error_not_the_tail() -> None:
    assert root_cause(VLLM_FAILURE_LOG).startswith("ValueError: CPU memory utilization 0.92 > available")
    assert root_cause("INFO all good\n") is None


def test_serve_starts_vllm_with_the_flags_polar_needs() -> None:
    cmd, model_arg = vllm_command("/m", 8000, "tiny", python="py", memory_fraction="0.2")
    assert cmd[model_arg] == "/m"
    flags = " ".join(cmd)
    for expected in (
        "--enable-auto-tool-choice",
        "--tool-call-parser hermes",
        "--logprobs-mode processed_logprobs",
        "--generation-config vllm",
        "--gpu-memory-utilization 0.2",
    ):
        assert expected in flags
    # A flag the user passes wins over polar's own.
    cmd, _ = vllm_command("/m", 8000, "tiny", python="py", extra_args=["--tool-call-parser", "qwen3_coder"])
    assert cmd.count("--tool-call-parser") == 1 and cmd[-1] == "qwen3_coder"


def test_serve_failure_shows_the_root_cause(tiny_model_dir: Path, tmp_path: Path) -> None:
    # An interpreter without vLLM: the server dies at once, and the error says why.
    result = runner.invoke(
        app,
        [
            "engine",
            "serve",
            str(tiny_model_dir),
            "--port",
            str(free_port()),
            "--python",
            sys.executable,
            "--state-dir",
            str(tmp_path / "state"),
        ],
    )
    assert result.exit_code == 1
    # The first line of the error is the cause, before the log's tail.
    error = result.output[result.output.index("error:") :]
    assert "exited:" in error and "No module named 'vllm'" in error.split("(full log:")[0]
    assert not list((tmp_path / "state").glob("*.json"))  # nothing left to reload or stop


@pytest.fixture
def foreign_engine() -> Iterator[str]:
    """A server polar did not start, answering /v1/models like vLLM."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = b'{"object": "list", "data": [{"id": "tiny", "object": "model"}]}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_reload_of_an_engine_polar_did_not_start_says_what_to_do(
    foreign_engine: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    result = runner.invoke(
        app,
        ["engine", "reload", str(tiny_model_dir), "--engine", f"vllm:{foreign_engine}", "--state-dir", str(tmp_path)],
    )
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    port = foreign_engine.rsplit(":", 1)[1]
    assert "serves ['tiny'] but was started some other way" in text
    assert f"--model {tiny_model_dir.resolve()} --served-model-name tiny" in text
    assert f"polar engine serve {tiny_model_dir.resolve()} --port {port} --served-model-name tiny" in text
    # serve refuses a port that is taken instead of starting a server that cannot bind
    result = runner.invoke(app, ["engine", "serve", str(tiny_model_dir), "--port", port, "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and "already answers on port" in result.output


def test_stop_twice_says_it_is_already_stopped(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["engine", "stop", "--engine", "vllm:http://127.0.0.1:8123", "--state-dir", str(tmp_path)]
    )
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "already stopped" in text and "restart" not in text


def test_train_checks_model_and_output_before_loading_anything(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "calls").mkdir(parents=True)
    result = runner.invoke(
        app, ["train", str(store), "--model", "models/nope", "--output", str(tmp_path / "o")], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2 and "models/nope does not exist" in result.output, result.output
    assert "Traceback" not in result.output
    output = tmp_path / "ckpt"
    output.mkdir()
    (output / "config.json").write_text("{}")
    result = runner.invoke(
        app, ["train", str(store), "--model", str(tiny_model_dir), "--output", str(output)], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2 and "exists and is not empty (use --overwrite" in result.output, result.output
    assert (output / "config.json").read_text() == "{}"
