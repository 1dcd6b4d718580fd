"""The engine window a rollout budgets by (polar_cli.rollout.window) and what a rollout's files never show
(polar_cli.rollout.redact): plain functions, a throwaway HTTP server, no engine."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from polar_cli.mitm import REPO
from polar_cli.rollout import window
from polar_cli.rollout.redact import REDACTED, control_tokens, redact, redact_value, write_json
from polar_cli.rollout.window import engine_window, model_window, served_window


def _model(directory: Path, config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --- model_window ---------------------------------------------------------------------------------------------


def test_model_window_reads_the_config_or_its_text_model(tmp_path: Path) -> None:
    assert model_window(_model(tmp_path / "a", {"max_position_embeddings": 4096})) == 4096
    # A multimodal model: its text model's window (the top level has none, or an unusable one).
    assert model_window(_model(tmp_path / "b", {"text_config": {"max_position_embeddings": 8192}})) == 8192
    both = {"max_position_embeddings": 0, "text_config": {"max_position_embeddings": 1000}}
    assert model_window(_model(tmp_path / "c", both)) == 1000
    assert model_window(_model(tmp_path / "d", {"max_position_embeddings": 1, "text_config": {}})) == 1
    # Unknown: no such field, a non-number, a negative one, a null text_config, no config, no JSON.
    for name, config in [
        ("e", {}),
        ("f", {"max_position_embeddings": "4096"}),
        ("g", {"max_position_embeddings": -1, "text_config": None}),
        ("h", {"max_position_embeddings": 2.5e3}),
    ]:
        assert model_window(_model(tmp_path / name, config)) is None, config
    assert model_window(tmp_path / "missing") is None
    (tmp_path / "i").mkdir()
    (tmp_path / "i" / "config.json").write_text("{not json")
    assert model_window(tmp_path / "i") is None


# --- served_window: a real server -----------------------------------------------------------------------------


class _Models(BaseHTTPRequestHandler):
    body: bytes = b"{}"
    paths: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.paths.append(self.path)
        if self.path != "/v1/models":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Models]]]:
    handler = type("Handler", (_Models,), {"paths": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_served_window_is_the_first_listed_models_length(server: tuple[str, type[_Models]]) -> None:
    url, handler = server
    handler.body = json.dumps(
        {"data": ["not a model", {"id": "a"}, {"max_model_len": 0}, {"max_model_len": "9"}, {"max_model_len": 32768},
                  {"max_model_len": 4096}]}
    ).encode()  # fmt: skip
    assert served_window(url) == 32768
    handler.body = b'{"data": [{"max_model_len": 1}]}'  # the smallest window is still one
    assert served_window(url) == 1
    handler.body = json.dumps({"data": [{"max_model_len": 32768}]}).encode()
    # A trailing slash on the URL is not a second one in the path (the server answers 404 on //v1/models).
    assert served_window(url + "/") == 32768
    assert handler.paths == ["/v1/models"] * 3
    assert engine_window(f"vllm:{url}") == 32768
    assert engine_window(f"sglang:{url}") == 32768


@pytest.mark.parametrize(
    "body",
    [b'{"data": null}', b'{"data": [{"max_model_len": -5}]}', b"{}", b"[1, 2]", b"not json", b'{"data": [null]}'],
)
def test_a_server_that_reports_no_window_says_unknown(server: tuple[str, type[_Models]], body: bytes) -> None:
    url, handler = server
    handler.body = body
    assert served_window(url) is None
    assert engine_window(f"vllm:{url}") is None


def test_a_server_that_is_not_there_says_unknown_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, object]] = []

    def refused(url: str, timeout: float) -> httpx.Response:
        asked.append((url, timeout))
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(window.httpx, "get", refused)
    assert engine_window("vllm:http://gpu1:8000/") is None
    assert engine_window("sglang:http://gpu-BOX/") is None
    # A rollout's start waits at most 5 s on a server that does not answer; only the URL's slashes are trimmed.
    assert asked == [("http://gpu1:8000/v1/models", 5.0), ("http://gpu-BOX/v1/models", 5.0)]


# --- engine_window: local, scripted, pools --------------------------------------------------------------------


def test_local_and_scripted_windows_and_pools(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", {"max_position_embeddings": 4096})
    assert engine_window(f"local:{model}") == 4096
    assert engine_window(f"local:{model}?max_len=100") == 100
    assert engine_window(f"local:{model}?max_len=9000") == 4096  # max_len only lowers
    # A script's model_dir: relative to the script's directory, or absolute; its max_len lowers it.
    (tmp_path / "scripts").mkdir()
    _model(tmp_path / "scripts" / "rel", {"max_position_embeddings": 2048})
    script = tmp_path / "scripts" / "run.json"
    script.write_text(json.dumps({"model_dir": "rel"}))
    assert engine_window(f"scripted:{script}") == 2048
    script.write_text(json.dumps({"model_dir": str(model), "max_len": 512}))
    assert engine_window(f"scripted:{script}") == 512
    script.write_text(json.dumps({"model_dir": str(model), "max_len": None}))
    assert engine_window(f"scripted:{script}") == 4096
    # A pool: the smallest known window; unknown ones and specs the proxy refuses are skipped, not the end.
    pool = f"local:{tmp_path / 'none'},bogus,local:{model}?max_len=300,local:{model}?max_len=200,local:{model}"
    assert engine_window(pool) == 200
    assert engine_window(f"nope:x,local:{model}") == 4096
    assert engine_window(f"local:{tmp_path / 'none'}") is None


@pytest.mark.parametrize(
    "content", ["{not json", "[1]", '{"turns": []}', '{"model_dir": null}', '{"model_dir": 5}', None]
)
def test_a_script_without_a_usable_model_dir_says_unknown(tmp_path: Path, content: str | None) -> None:
    script = tmp_path / "run.json"
    if content is not None:
        script.write_text(content)
    assert engine_window(f"scripted:{script}") is None


def test_a_relative_model_path_is_the_working_directorys_else_the_repositorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _model(tmp_path / "here", {"max_position_embeddings": 777})
    assert engine_window("local:here") == 777
    assert window._local_path("here") == Path("here")
    assert window._local_path("no/such/model") == REPO / "no/such/model"
    assert window._local_path(str(tmp_path / "gone")) == tmp_path / "gone"  # absolute: as given
    monkeypatch.setenv("HOME", str(tmp_path))
    assert engine_window("local:~/here") == 777


# --- redact ---------------------------------------------------------------------------------------------------


def test_known_secrets_are_replaced_whole_longest_first() -> None:
    assert redact("key=abcdef;", ["abc", "abcdef"]) == f"key={REDACTED};"
    assert redact("key=abcdef;", ["abcdef", "abc"]) == f"key={REDACTED};"
    # By length, not by text: "zz" sorts after "aazzbb" but is inside it.
    assert redact("aazzbb", ["zz", "aazzbb"]) == REDACTED
    # None and "" are no secrets (replacing "" would put the marker between every character).
    assert redact("plain text", [None, ""]) == "plain text"
    assert redact("a tok and tok", iter(["tok"])) == f"a {REDACTED} and {REDACTED}"


@pytest.mark.parametrize(
    ("text", "clean"),
    [
        ("Authorization: Bearer abc.def", f"Authorization: Bearer {REDACTED}"),
        ("authorization: BEARER\tx1", f"authorization: BEARER\t{REDACTED}"),
        ('{"h": "Bearer abc", "n": 1}', f'{{"h": "Bearer {REDACTED}", "n": 1}}'),
        ("Bearer a,b;c 'd'", f"Bearer {REDACTED},b;c 'd'"),
        ("xbearer abc", "xbearer abc"),  # a word ending in bearer is no Authorization header
        ("Bearer", "Bearer"),
        ("KEY=polar:psk-abcdefghijklmnop", f"KEY=polar:{REDACTED}"),
        ("polar:secret/path@host 'polar:q'", f"polar:{REDACTED}/path@host 'polar:{REDACTED}'"),
        ("[polar: 12 bytes of output dropped here]", "[polar: 12 bytes of output dropped here]"),
        ("apolar:x", "apolar:x"),
        ("a bare psk-ABCDEFGH.", f"a bare psk-{REDACTED}."),
        ("psk-a_b-c9z0!", f"psk-{REDACTED}!"),
        ("psk-ABCDEFG is too short", "psk-ABCDEFG is too short"),
        ("https://user:pa55@host/x", f"https://user:{REDACTED}@host/x"),
        ("git+ssh://u:p@h", f"git+ssh://u:{REDACTED}@h"),
        ("x-y.z://:p@h", f"x-y.z://:{REDACTED}@h"),
        ("http://host:8080/path a@b", "http://host:8080/path a@b"),
        ("ssh://user@host", "ssh://user@host"),
        ("http://polar.local/sessions/x/reward", "http://polar.local/sessions/x/reward"),
        ("9http://u:p@h", "9http://u:p@h"),
        ('"http://u:p@h"', f'"http://u:{REDACTED}@h"'),
    ],
)
def test_credential_shaped_strings_are_redacted(text: str, clean: str) -> None:
    assert redact(text) == clean


def test_a_proxy_url_carrying_a_session_secret_shows_neither() -> None:
    assert redact("HTTPS_PROXY=http://polar:psk-QWERTYUIOPASDF@127.0.0.1:8080") == (
        f"HTTPS_PROXY=http://polar:{REDACTED}@127.0.0.1:8080"
    )


def test_redact_value_redacts_every_string_keys_included() -> None:
    value = {"tok": ["tok", ("a tok", 3)], "n": None, "x": 1.5, "ok": True, "nested": {"k": "Bearer z"}}
    # A generator of secrets is read once for the whole value, not used up by its first string.
    assert redact_value(value, (s for s in ["tok"])) == {
        REDACTED: [REDACTED, [f"a {REDACTED}", 3]],
        "n": None,
        "x": 1.5,
        "ok": True,
        "nested": {"k": f"Bearer {REDACTED}"},
    }
    assert redact_value("Bearer q") == f"Bearer {REDACTED}"
    assert redact_value(7) == 7


def test_write_json_writes_indented_redacted_json(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    write_json(path, {"cmd": "run --token s3cr3t", "args": ["psk-ABCDEFGHIJ"]}, ["s3cr3t"])
    assert path.read_text() == ('{\n  "cmd": "run --token <redacted>",\n  "args": [\n    "psk-<redacted>"\n  ]\n}\n')
    write_json(path, ["Bearer x"])
    assert path.read_text() == '[\n  "Bearer <redacted>"\n]\n'


def test_control_tokens_are_the_given_one_and_the_started_proxys(tmp_path: Path) -> None:
    store, confdir = tmp_path / "store", tmp_path / "conf"
    store.mkdir()
    confdir.mkdir()
    assert control_tokens(None, confdir, None) == []
    assert control_tokens(str(store), confdir, "given") == ["given"]  # no token file yet
    (store / ".control-token").write_text("  from-file\n")
    assert control_tokens(str(store), confdir, "given") == ["given", "from-file"]
    assert control_tokens(str(store), confdir, "") == ["from-file"]
    assert control_tokens(None, confdir, "given") == ["given"]
    (store / ".control-token").write_text("\n")
    assert control_tokens(str(store), confdir, None) == []  # an empty file holds no token
    # A remote store: the started proxy kept its token in mitmproxy's confdir.
    (confdir / "polar-control-token").write_text("remote-tok")
    assert control_tokens("s3://bucket/run", confdir, None) == ["remote-tok"]


@pytest.mark.parametrize(
    "config", ["[1, 2]", '"text"', '{"text_config": [1]}', '{"text_config": "x", "max_position_embeddings": "9"}']
)
def test_a_malformed_model_config_says_unknown_instead_of_crashing(tmp_path: Path, config: str) -> None:
    (tmp_path / "config.json").write_text(config)
    assert engine_window(f"local:{tmp_path}") is None


@pytest.mark.parametrize(("max_len", "window"), [('"1000"', 1000), ('"x"', 4096), ("[]", 4096), ("1000", 1000)])
def test_a_scripts_max_len_is_read_as_the_scripted_engine_reads_it(tmp_path: Path, max_len: str, window: int) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    script = tmp_path / "run.json"
    script.write_text(f'{{"model_dir": "{tmp_path}", "max_len": {max_len}}}')
    assert engine_window(f"scripted:{script}") == window
