"""The CLI's helper modules on their own: settings declared once (the generated parameters, the flag a refusal names,
the manifest), `--set` and `--runtime-option` items, the STORE argument, terminal-safe text, the mitmdump command line
and its process handling (on fake processes), the view page's pieces (on stand-in records and chains), and the tiny
model's checks and build (on a stand-in torch and transformers). No proxy, no engine, no model."""

from __future__ import annotations

import dataclasses
import inspect
import math
import signal
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import typer

from polar_cli import mitm, set_option, settings, terminal, tiny_model, view
from polar_cli.settings import SettingsError, option, reuse
from polar_cli.store_arg import existing_store

# --- settings ------------------------------------------------------------------------------------------------------


def _check(value: Any) -> Any:
    return value


@dataclasses.dataclass
class Full:
    """Every declaration a field can carry, none at its default."""

    path: Path = option(argument=True, help="Where.", show_default=False, callback=_check)
    name_of_it: str = option(help="", flags=("-n", "--name", "--other"))
    toggle: bool = option(True, flags=(" --toggle/--no-toggle",), help="On.")
    count: int = option(2, min=1, help="How many.", envvar="FULL_COUNT")
    tags: list[str] = option(default_factory=lambda: ["a"], flags=("-t",), help="Tags.")
    token: str | None = option(None, secret=True, help="Secret.")
    hidden: int = option(5, cli=False, help="Library only.")
    plain: int = 9


def test_option_records_every_declaration_and_its_default_or_factory() -> None:
    path, name, toggle, count, tags, token, hidden, plain = dataclasses.fields(Full)
    assert settings.spec(path) == settings.Spec("Where.", (), True, True, False, None, None, False, _check)
    assert settings.spec(count) == settings.Spec("How many.", (), False, True, False, "FULL_COUNT", 1, True, None)
    assert settings.spec(token) == settings.Spec("Secret.", (), secret=True)
    assert settings.spec(hidden) == settings.Spec("Library only.", cli=False)
    assert settings.spec(plain) is None
    assert path.default is dataclasses.MISSING and path.default_factory is dataclasses.MISSING  # required
    assert count.default == 2 and tags.default is dataclasses.MISSING and tags.default_factory() == ["a"]
    assert settings.spec(name).flags == ("-n", "--name", "--other")  # a tuple whatever sequence was given
    assert [f.name for f in settings.cli_fields(Full)] == ["path", "name_of_it", "toggle", "count", "tags", "token"]


def test_an_option_declared_bare_is_a_required_plain_cli_option() -> None:
    # Called here, not in a class body at import: what option() does now is what is checked.
    bare = option()
    assert settings.spec(bare) == settings.Spec("", (), False, True, False, None, None, True, None)
    assert bare.default is dataclasses.MISSING and bare.default_factory is dataclasses.MISSING
    assert option(3).default == 3 and option(default_factory=list).default_factory is list


def test_a_reused_field_copies_every_declaration_and_the_default_unless_changed() -> None:
    @dataclasses.dataclass
    class Again:
        path: Path = reuse(Full, "path")
        count: int = reuse(Full, "count", default=4, help="More.")
        tags: list[str] = reuse(Full, "tags")
        token: str | None = reuse(Full, "token", default_factory=lambda: "t")
        hidden: int = reuse(Full, "hidden")

    fields = {f.name: f for f in dataclasses.fields(Again)}
    original = {f.name: f for f in dataclasses.fields(Full)}
    for name in ("path", "tags", "hidden"):
        assert settings.spec(fields[name]) == settings.spec(original[name]), name
    assert settings.spec(fields["count"]) == dataclasses.replace(settings.spec(original["count"]), help="More.")
    assert fields["count"].default == 4 and fields["hidden"].default == 5
    assert fields["path"].default is dataclasses.MISSING and fields["path"].default_factory is dataclasses.MISSING
    assert fields["tags"].default_factory() == ["a"] and fields["tags"].default is dataclasses.MISSING
    assert fields["token"].default_factory() == "t" and fields["token"].default is dataclasses.MISSING
    # A plain default given for a field that had a factory replaces the factory.
    plain_default = reuse(Full, "tags", default=("b",))
    assert plain_default.default == ("b",) and plain_default.default_factory is dataclasses.MISSING
    with pytest.raises(AssertionError, match="Full.plain is no option"):
        reuse(Full, "plain")


def test_a_field_is_named_by_its_first_long_flag_or_its_dashed_name() -> None:
    assert settings.flag(Full, "path") == "PATH"  # an argument: its metavar
    assert settings.flag(Full, "plain") == "PLAIN"  # no declaration: the name as a metavar
    assert settings.flag(Full, "name_of_it") == "--name"  # the first long flag, after a short one
    assert settings.flag(Full, "toggle") == "--toggle"  # a boolean pair: its on flag
    assert settings.flag(Full, "count") == "--count"
    assert settings.flag(Full, "tags") == "--tags"  # only a short flag: the field's own
    assert settings.flag(Full, "hidden") == "--hidden"

    @dataclasses.dataclass
    class Dashed:
        max_count_of_it: int = option(1, flags=("-m",))

    assert settings.flag(Dashed, "max_count_of_it") == "--max-count-of-it"


def test_parameters_carry_defaults_flags_help_bounds_envvars_and_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    params = {p.name: p for p in settings.parameters(Full)}
    assert list(params) == ["path", "name_of_it", "toggle", "count", "tags", "token"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert params["count"].annotation is int and params["token"].annotation == str | None
    path = params["path"].default
    assert isinstance(path, typer.models.ArgumentInfo) and not isinstance(path, typer.models.OptionInfo)
    assert (path.default, path.help, path.show_default, path.callback) == (..., "Where.", False, _check)
    name = params["name_of_it"].default
    assert isinstance(name, typer.models.OptionInfo)
    assert (name.default, name.param_decls, name.help, name.show_default) == (
        ...,
        ("-n", "--name", "--other"),
        None,
        True,
    )
    assert (name.envvar, name.min, name.callback) == (None, None, None)
    count = params["count"].default
    assert (count.default, count.min, count.envvar, count.show_envvar, count.help) == (
        2,
        1,
        "FULL_COUNT",
        True,
        "How many.",
    )
    assert params["tags"].default.default == ["a"] and params["tags"].default.param_decls == ("-t",)
    assert params["token"].default.default is None and params["token"].default.min is None

    @dataclasses.dataclass
    class Optional:
        where: Path = option(Path("here"), argument=True, help="Where.")

    (where,) = settings.parameters(Optional)
    assert isinstance(where.default, typer.models.ArgumentInfo) and where.default.default == Path("here")


def test_a_command_takes_the_settings_fields_in_the_settings_parameter_place() -> None:
    seen: list[Any] = []

    def run(ctx: typer.Context, config: Full, *, verbose: bool = False, untyped=None) -> str:  # noqa: ANN001
        """Run it."""
        seen.append((ctx, config, verbose))
        if config.count > 2:
            raise SettingsError("too many", "count")
        if config.count == 0:
            raise SettingsError("not a field's fault")
        return "done"

    callback = settings.command(run)
    names = list(inspect.signature(callback).parameters)
    assert names == ["ctx", "path", "name_of_it", "toggle", "count", "tags", "token", "verbose", "untyped"]
    assert {p.kind for p in inspect.signature(callback).parameters.values()} == {inspect.Parameter.KEYWORD_ONLY}
    assert (callback.__name__, callback.__qualname__, callback.__doc__, callback.__module__) == (
        "run", run.__qualname__, "Run it.", __name__
    )  # fmt: skip
    assert callback.__annotations__["ctx"] is typer.Context and callback.__annotations__["verbose"] is bool
    assert callback.__annotations__["count"] is int and "config" not in callback.__annotations__
    assert callback.__annotations__["untyped"] is inspect.Parameter.empty  # unannotated stays so, not None

    values = dict(path=Path("p"), name_of_it="n", toggle=False, count=1, tags=["x"], token=None)
    assert callback(ctx="C", verbose=True, **values) == "done"
    assert seen == [("C", Full(**values), True)]
    with pytest.raises(typer.BadParameter) as refused:
        callback(ctx="C", **(values | {"count": 3}))
    assert str(refused.value) == "too many" and refused.value.param_hint == "--count"
    assert isinstance(refused.value.__cause__, SettingsError)
    with pytest.raises(typer.BadParameter) as refused:
        callback(ctx="C", **(values | {"count": 0}))
    assert refused.value.param_hint is None

    def clash(config: Full, count: int = 0) -> None: ...

    with pytest.raises(TypeError) as refused_clash:
        settings.command(clash)
    assert str(refused_clash.value) == "clash: parameters ['count'] are also fields of Full"


def test_the_manifest_is_json_values_with_secrets_redacted() -> None:
    from polar_cli.rollout.redact import REDACTED

    @dataclasses.dataclass
    class Run:
        out: Path = option(help="")
        key: str | None = option(None, secret=True, help="")
        other_key: str | None = option(None, secret=True, help="")
        pairs: tuple[Path, ...] = option((), help="")
        nested: dict[Any, Any] = option(default_factory=dict, help="")
        plain: str = "x"

    run = Run(Path("/o"), "k", None, (Path("/a"), Path("/b")), {1: [Path("/c"), (2,)], "d": {"e": Path("/f")}})
    assert settings.manifest(run) == {
        "out": "/o",
        "key": REDACTED,
        "other_key": None,
        "pairs": ["/a", "/b"],
        "nested": {"1": ["/c", [2]], "d": {"e": "/f"}},
        "plain": "x",
    }


# --- set_option ----------------------------------------------------------------------------------------------------


def test_set_items_split_at_the_first_equals_and_need_a_key() -> None:
    assert set_option.set_options(["a=1", "b=x=y", "c=", "a=2"]) == {"a": "2", "b": "x=y", "c": ""}
    assert set_option.set_options([]) == {}
    for bad in ("novalue", "=1"):
        with pytest.raises(ValueError) as refused:
            set_option.set_options(["ok=1", bad])
        assert str(refused.value) == f"{bad!r} is not KEY=VALUE"
    with pytest.raises(typer.BadParameter) as usage:
        set_option.parse_set_options(["x"])
    assert str(usage.value) == "'x' is not KEY=VALUE" and usage.value.param_hint == "--set"
    assert set_option.parse_set_options(["k=v"]) == {"k": "v"}


def test_runtime_options_read_json_values_and_keep_the_rest_as_text() -> None:
    parsed = set_option.runtime_options(["disk_mb=8192", "trust=true", "r=0.5", "x=a=b", 's="q"', "l=[1]", "e="])
    assert parsed == {"disk_mb": 8192, "trust": True, "r": 0.5, "x": "a=b", "s": "q", "l": [1], "e": ""}
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        set_option.runtime_options(["bad"])


# --- store_arg -----------------------------------------------------------------------------------------------------


def test_the_store_argument_is_a_store_or_a_usage_error_saying_why(tmp_path: Path) -> None:
    with pytest.raises(typer.BadParameter) as refused:
        existing_store(str(tmp_path / "absent"))
    assert (
        str(refused.value) == f"no trace store at {tmp_path / 'absent'}: it does not exist (give the proxy's polar_out)"
    )
    assert isinstance(refused.value.__cause__, FileNotFoundError)
    with pytest.raises(typer.BadParameter, match="holds none of calls/"):
        existing_store(str(tmp_path))
    (tmp_path / "calls").mkdir()
    assert existing_store(str(tmp_path)) == str(tmp_path)


# --- terminal ------------------------------------------------------------------------------------------------------


def test_every_control_and_reordering_character_is_shown_escaped_and_nothing_else() -> None:
    unsafe = {
        "\x00": "\\x00", "\n": "\\n", "\x1b": "\\x1b", "\x1f": "\\x1f", "\x7f": "\\x7f", "\x80": "\\x80",
        "\x9f": "\\x9f", "\u200e": "\\u200e", "\u200f": "\\u200f", "\u202a": "\\u202a", "\u202e": "\\u202e",
        "\u2066": "\\u2066", "\u2069": "\\u2069",
    }  # fmt: skip
    for char, shown in unsafe.items():
        assert terminal.printable(f"a{char}b") == f"a{shown}b", repr(char)
    safe = " ~\xa0\xff\u200d\u2010\u2029\u202f\u2065\u206a\u0100é→"
    assert terminal.printable(safe) == safe
    assert terminal.printable(42) == "42" and terminal.printable(None) == "None"
    assert terminal.markup_safe("[red]\x1b[0m") == "\\[red]\\x1b[0m"


# --- mitm ----------------------------------------------------------------------------------------------------------


def test_the_mitmdump_command_line_for_each_combination() -> None:
    exe, addon = str(mitm.MITMDUMP), str(mitm.ADDON)
    assert mitm.MITMDUMP.name == "mitmdump" and mitm.MITMDUMP.parent == Path(sys.executable).parent
    assert mitm.ADDON.name == "addon.py" and mitm.ADDON.parent.name == "polar_addon" and mitm.ADDON.is_file()
    assert mitm.mitmdump_command("vllm", Path("/out"), port=8080) == [
        exe, "--listen-host", "127.0.0.1", "--listen-port", "8080",
        "--set", "termlog_verbosity=warn", "--set", "flow_detail=0",
        "-s", addon, "--set", "polar_engine=vllm", "--set", "polar_out=/out",
    ]  # fmt: skip
    assert mitm.mitmdump_command(
        "e",
        "s3://b/o",
        port=None,
        listen_host="0.0.0.0",
        modes=["regular@1", "reverse:https://x@2"],
        confdir="/c",
        options={"a": "1", "b": "2"},
        quiet=False,
    ) == [
        exe, "--listen-host", "0.0.0.0", "--set", "confdir=/c", "--mode", "regular@1", "--mode", "reverse:https://x@2",
        "-s", addon, "--set", "polar_engine=e", "--set", "polar_out=s3://b/o", "--set", "a=1", "--set", "b=2",
    ]  # fmt: skip
    assert mitm.mitmdump_command("e", "/o", port=0, options={"a": "1"}, addon=False, quiet=False) == [
        exe, "--listen-host", "127.0.0.1", "--listen-port", "0"
    ]  # fmt: skip


def test_a_proxy_knows_its_urls_ca_logs_and_control_token(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"ok \xff")
    (tmp_path / "out").mkdir()
    proxy = mitm.Proxy(8123, tmp_path / "conf", tmp_path / "out", log, process=None)  # type: ignore[arg-type]
    assert proxy.url == "http://127.0.0.1:8123"
    assert proxy.ca == tmp_path / "conf" / "mitmproxy-ca-cert.pem"
    assert proxy.proxy_url() == proxy.url and proxy.proxy_url("") == proxy.url
    assert proxy.proxy_url("s1") == "http://s1@127.0.0.1:8123"
    assert proxy.logs() == "ok \ufffd"
    from polar_addon.control import token_file

    token_file(str(proxy.out), str(proxy.confdir)).write_text("tok\n")
    assert proxy.control_token == "tok" and proxy.control_headers() == {"authorization": "Bearer tok"}


def test_a_free_port_is_one_that_can_be_bound() -> None:
    port = mitm.free_port()
    assert 1024 <= port < 65536  # one the kernel picked, never a fixed or privileged one
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


class _Process:
    """A stand-in Popen: running until ``exit_at`` polls, or for ever."""

    def __init__(self, returncode: int | None = None, *, hangs: bool = False, pid: int = 4242) -> None:
        self.returncode = returncode
        self.hangs = hangs
        self.pid = pid
        self.waits: list[float | None] = []

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        if self.hangs and timeout is not None:
            raise subprocess.TimeoutExpired("mitmdump", timeout)
        self.returncode = -9 if self.hangs else 0
        return self.returncode


def test_waiting_for_a_port_returns_once_it_listens_and_says_why_it_gave_up(tmp_path: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        mitm.wait_for_port(server.getsockname()[1], 5.0, _Process(None))  # type: ignore[arg-type]
    port = mitm.free_port()
    log = tmp_path / "log"
    log.write_text("Error: address in use")
    with pytest.raises(RuntimeError) as died:
        mitm.wait_for_port(port, 5.0, _Process(3), log)  # type: ignore[arg-type]
    assert str(died.value) == "process exited with 3:\nError: address in use"
    with pytest.raises(RuntimeError) as died:
        mitm.wait_for_port(port, 5.0, _Process(1))  # type: ignore[arg-type]
    assert str(died.value) == "process exited with 1:\n"
    with pytest.raises(TimeoutError) as late:
        mitm.wait_for_port(port, 0.3)
    assert str(late.value) == f"nothing listening on 127.0.0.1:{port} after 0.3s"


def test_waiting_retries_until_a_late_listener_appears() -> None:
    port = mitm.free_port()
    server = socket.socket()
    started = threading.Timer(0.3, lambda: (server.bind(("127.0.0.1", port)), server.listen()))
    started.start()
    try:
        mitm.wait_for_port(port, 5.0)
    finally:
        started.join()
        server.close()


def test_stopping_mitmdump_interrupts_its_group_then_kills_it_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(mitm.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    graceful = _Process(None)
    assert mitm.stop_mitmdump(graceful, grace_s=7) == 0  # type: ignore[arg-type]
    assert sent == [(4242, signal.SIGINT)] and graceful.waits == [7]
    sent.clear()
    stuck = _Process(None, hangs=True)
    assert mitm.stop_mitmdump(stuck) == -9  # type: ignore[arg-type]
    assert sent == [(4242, signal.SIGINT), (4242, signal.SIGKILL)] and stuck.waits == [60.0, None]
    sent.clear()
    done = _Process(5)
    assert mitm.stop_mitmdump(done) == 0 and sent == [] and done.waits == [None]  # type: ignore[arg-type]


def test_run_mitmdump_starts_in_its_own_session_ties_it_and_always_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polar_cli import lifeline

    events: list[Any] = []
    process = _Process(None, pid=777)

    def popen(cmd: list[str], **kwargs: Any) -> _Process:
        events.append(
            ("popen", cmd, kwargs["cwd"], kwargs["start_new_session"], kwargs["stderr"], kwargs["stdout"].name)
        )
        return process

    monkeypatch.setattr(mitm, "free_port", lambda: 9999)
    monkeypatch.setattr(mitm.subprocess, "Popen", popen)
    monkeypatch.setattr(mitm, "wait_for_port", lambda *a: events.append(("wait", *a)))
    monkeypatch.setattr(mitm, "stop_mitmdump", lambda p, grace_s: events.append(("stop", p, grace_s)))
    monkeypatch.setattr(lifeline, "tie", lambda pid: events.append(("tie", pid)))
    monkeypatch.setattr(lifeline, "untie", lambda pid: events.append(("untie", pid)))
    out = tmp_path / "run" / "out"
    out.parent.mkdir()
    log = tmp_path / "run" / "mitmdump-9999.log"
    with mitm.run_mitmdump("vllm", out, mode="regular", options={"k": "v"}, timeout=3.0) as proxy:
        assert (proxy.port, proxy.confdir, proxy.out, proxy.log, proxy.process) == (
            9999, tmp_path / "run" / "mitmproxy-conf", out, log, process
        )  # fmt: skip
        assert proxy.confdir.is_dir()
        events.append("body")
    cmd = mitm.mitmdump_command(
        "vllm", out, port=9999, modes=["regular"], confdir=tmp_path / "run" / "mitmproxy-conf", options={"k": "v"}
    )
    assert events == [
        ("popen", cmd, mitm.REPO, True, subprocess.STDOUT, str(log)),
        ("tie", 777),
        ("wait", 9999, 3.0, process, log),
        "body",
        ("stop", process, 30),
        ("untie", 777),
    ]

    events.clear()
    confdir = tmp_path / "given" / "conf"
    with pytest.raises(KeyError):
        with mitm.run_mitmdump("e", out, confdir=confdir, addon=False):
            raise KeyError("the caller failed")
    assert events[0][1] == mitm.mitmdump_command("e", out, port=9999, confdir=confdir, addon=False)
    assert confdir.is_dir() and events[2] == ("wait", 9999, 120.0, process, log)
    assert events[-2:] == [("stop", process, 30), ("untie", 777)]


# --- view ----------------------------------------------------------------------------------------------------------


def test_a_logprob_is_coloured_by_its_probability_and_a_non_number_is_grey() -> None:
    assert view.logprob_color(0.0) == "hsl(120,75%,82%)"
    assert view.logprob_color(0.5) == "hsl(120,75%,82%)"  # above 0 (rounding): clipped to p = 1
    assert view.logprob_color(math.log(0.5)) == "hsl(60,75%,82%)"
    assert view.logprob_color(math.log(0.25)) == "hsl(30,75%,82%)"
    assert view.logprob_color(-50.0) == view.logprob_color(-1e9) == "hsl(0,75%,82%)"
    for bad in (math.nan, math.inf, -math.inf):
        assert view.logprob_color(bad) == "hsl(0,0%,80%)"


class _Tokenizer:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def decode(self, ids: list[int]) -> str:
        self.calls.append(ids)
        return "".join({1: "a", 2: "\n", 3: "<b>"}.get(i, "?") for i in ids)


def test_pieces_decode_each_token_once_and_show_newlines() -> None:
    tokenizer = _Tokenizer()
    pieces = view._Pieces(tokenizer)
    assert [pieces(2), pieces(1), pieces(2)] == ["↵\n", "a", "↵\n"]
    assert tokenizer.calls == [[2], [1]]  # cached
    assert pieces.text((1, 2, 3)) == "a\n<b>" and tokenizer.calls[-1] == [1, 2, 3]
    bare = view._Pieces(None)
    assert bare(7) == "7 " and bare.text([7, 8]) == "7 8" and bare.text([]) == ""


def test_tokens_are_spans_sampled_with_their_logprob_or_masked() -> None:
    pieces = view._Pieces(_Tokenizer())
    assert view._tokens([3, 1], None, pieces) == (
        '<span class="t m" data-id="3">&lt;b&gt;</span><span class="t m" data-id="1">a</span>'
    )
    lp = math.log(0.5)
    assert view._tokens([1, 3], [0.0, lp], pieces) == (
        '<span class="t s" data-id="1" data-lp="0" style="background:hsl(120,75%,82%)">a</span>'
        f'<span class="t s" data-id="3" data-lp="{lp:.6g}" style="background:hsl(60,75%,82%)">&lt;b&gt;</span>'
    )
    assert view._esc("\"<&>'") == "&quot;&lt;&amp;&gt;&#x27;"


def test_message_texts_json_arguments_and_content_parts() -> None:
    assert view._pretty_json('{"a":[1]}') == '{\n  "a": [\n    1\n  ]\n}'
    assert view._pretty_json("not {json") == "not {json"
    assert view._content_text([{"type": "text", "text": "a"}, {"type": "image"}, "b"]) == "a\n\nb"
    assert view._content_text(None) == "" and view._content_text(5) == "5" and view._content_text([]) == ""


def _record(**fields: Any) -> Any:
    base = dict(seq=0, messages=[], response_message=None, prompt_ids=[], finish_reason="stop", status="ok", error=None)
    return types.SimpleNamespace(**(base | fields))


def test_the_sampled_message_shows_reasoning_text_and_each_tool_call() -> None:
    assert view._sampled_message(_record()) == ""
    assert view._sampled_message(_record(response_message={"content": "", "tool_calls": None})) == ""
    message = {
        "reasoning": "think <x>",
        "content": "say",
        "tool_calls": [{"name": "bash", "id": "c1", "arguments": '{"cmd":"ls"}'}, {"name": "noargs"}],
    }
    assert view._sampled_message(_record(response_message=message)) == (
        '<div class="msg">'
        '<div class="reasoning"><span class="role">reasoning</span><pre>think &lt;x&gt;</pre></div>'
        '<div class="content"><span class="role">assistant</span><pre>say</pre></div>'
        '<div class="tool-call"><span class="role">tool call</span> <span class="name">bash</span>'
        ' <span class="call-id">c1</span><pre>{\n  &quot;cmd&quot;: &quot;ls&quot;\n}</pre></div>'
        '<div class="tool-call"><span class="role">tool call</span> <span class="name">noargs</span>'
        ' <span class="call-id"></span><pre></pre></div>'
        "</div>"
    )


def test_an_interstitial_shows_the_messages_added_after_the_previous_turn() -> None:
    prev = _record(messages=[{"role": "user", "content": "q"}])
    nxt = _record(
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "the sampled turn"},
            {"role": "tool", "tool_call_id": "c1", "content": [{"text": "out"}]},
            {"role": "user", "content": "<more>"},
            {"content": None},
        ]
    )
    assert view._interstitial_messages(prev, nxt) == (
        '<div class="msg">'
        '<div class="tool-result"><span class="role">tool result c1</span><pre>out</pre></div>'
        '<div class="user"><span class="role">user</span><pre>&lt;more&gt;</pre></div>'
        '<div class="?"><span class="role">?</span><pre></pre></div>'
        "</div>"
    )
    assert view._interstitial_messages(prev, _record(messages=prev.messages + [{"role": "assistant"}])) == ""


class _Cause:
    def __init__(self, value: str) -> None:
        self.value = value


def _chain(*, start: Any = None, end: Any = None, related: Any = None, continued_by: Any = None) -> Any:
    first = _record(seq=4, messages=[{"role": "user", "content": "q"}], prompt_ids=[1, 2], finish_reason="tool_calls")
    second = _record(
        seq=6,
        messages=[{"role": "user", "content": "q"}, {"role": "assistant"}, {"role": "tool", "content": "r"}],
        response_message={"content": "end"},
    )
    segments = [
        types.SimpleNamespace(kind="sampled", call=0, start=0, end=2),
        types.SimpleNamespace(kind="interstitial", call=1, start=2, end=3),
        types.SimpleNamespace(kind="sampled", call=1, start=3, end=4),
    ]
    merged = types.SimpleNamespace(segments=segments, completion_ids=[1, 3, 2, 1], logprobs=[0.0, -1.0, None, -2.0])
    return types.SimpleNamespace(
        index=2,
        records=[first, second],
        merge=lambda: merged,
        start=start,
        end=end,
        related=related,
        continued_by=continued_by,
        tip=second,
    )


def test_a_chain_section_marks_its_turns_its_reward_and_where_it_started_and_broke(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[Any] = []

    def decide(session: Any, records: Any, *, per_request: bool, broadcast: bool) -> str:
        asked.append(("decide", session, [r.seq for r in records], per_request, broadcast))
        return "decision"

    def untrained(decision: Any, role: str, trained: Any) -> Any:
        asked.append(("role", decision, role, trained))
        return types.SimpleNamespace(trainable=role == "agent", reason="role <sub>", reward=0.25)

    monkeypatch.setattr(view, "decide_reward", decide)
    monkeypatch.setattr(view, "untrained_role", untrained)
    pieces = view._Pieces(_Tokenizer())
    chain = _chain(
        start=types.SimpleNamespace(cause=_Cause("sub_agent"), detail="spawned <here>"),
        related=0,
        end=types.SimpleNamespace(cause=_Cause("rewritten_history"), detail="edited"),
        continued_by=3,
    )
    html = view._chain_section(chain, "SESSION", pieces, "agent")
    assert asked == [
        ("decide", "SESSION", [4, 6], False, False),
        ("role", "decision", "agent", view.DEFAULT_TRAINED_ROLES),
    ]
    expected = [
        '<section class="chain" id="chain-2" data-chain="2" data-calls="2" data-role="agent"'
        ' data-break="rewritten_history">',
        "<h2>Chain 2 · agent · 2 calls merged (calls 4, 6) · reward 0.25 · trainable</h2>",
        '<div class="chain-summary"></div>',
        '<div class="start" data-cause="sub_agent">started beside earlier chains (from chain 0): '
        "<b>sub_agent</b>: spawned &lt;here&gt;</div>",
        # The prompt as decoded text, not piece by piece.
        '<details class="prompt"><summary>prompt: 2 tokens (call 4, 1 messages)</summary><pre>a\n</pre></details>',
        '<div class="turn sampled" data-call="4"><div class="turn-head">call 4 · sampled 2 tokens · finish tool_calls'
        f' · loss mask 1</div><div class="toks">{view._tokens([1, 3], [0.0, -1.0], pieces)}</div></div>',
        '<div class="turn inter" data-call="6"><div class="turn-head">interstitial: 1 tokens of call 6\'s prompt'
        f' · loss mask 0</div><div class="toks">{view._tokens([2], None, pieces)}</div>'
        '<div class="msg"><div class="tool-result"><span class="role">tool result </span><pre>r</pre></div></div>'
        "</div>",
        '<div class="turn sampled" data-call="6"><div class="turn-head">call 6 · sampled 1 tokens · finish stop'
        f' · loss mask 1</div><div class="toks">{view._tokens([1], [-2.0], pieces)}</div>'
        '<div class="msg"><div class="content"><span class="role">assistant</span><pre>end</pre></div></div></div>',
        '<div class="break" data-cause="rewritten_history">break after call 6: <b>rewritten_history</b>: edited'
        "; the conversation continues in chain 3</div>",
        "</section>",
    ]
    assert html == "\n".join(expected)

    plain = view._chain_section(_chain(), None, pieces, "aux")
    assert '<section class="chain" id="chain-2" data-chain="2" data-calls="2" data-role="aux">' in plain
    assert '· reward 0.25 · <span class="untrainable">not trainable (role &lt;sub&gt;)</span></h2>' in plain
    assert 'class="start"' not in plain and 'class="break"' not in plain and "data-break" not in plain
    one = _chain(start=types.SimpleNamespace(cause=_Cause("c"), detail="d"), end=types.SimpleNamespace(
        cause=_Cause("e"), detail="f"))  # fmt: skip
    one.records = one.records[:1]
    one.merge = lambda: types.SimpleNamespace(segments=[], completion_ids=[], logprobs=[])
    single = view._chain_section(one, None, pieces, "agent")
    assert "· 1 call merged (calls 4) ·" in single
    assert "started beside earlier chains: <b>c</b>" in single and "<b>e</b>: f</div>" in single


def test_the_page_holds_the_session_its_failed_calls_and_one_section_per_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    sections: list[Any] = []
    monkeypatch.setattr(
        view,
        "_chain_section",
        lambda chain, session, pieces, role: sections.append((chain, session, pieces.tokenizer, role)) or f"[{chain}]",
    )
    stats = types.SimpleNamespace(
        calls=3, chains_total=2, chains_truncated=1, merge_rate=0.5, retokenized_merges=0
    )  # fmt: skip
    built = types.SimpleNamespace(
        session_id="s<1>",
        stats=stats,
        harness="codex",
        eot_token_id=None,
        chains=["c0", "c1"],
        traces=[types.SimpleNamespace(role=None), types.SimpleNamespace(role="auxiliary")],
    )
    records = [_record(seq=1), _record(seq=2, status="failed", error="boom <x>"), _record(seq=3, status="error")]
    session = types.SimpleNamespace(task_id="t", group_id="g", sample_index=0, status="completed", reward=1.0)
    page = view.render_session(built, records, session)
    assert sections == [("c0", session, None, "agent"), ("c1", session, None, "auxiliary")]
    assert page.startswith(
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>polar trace · s&lt;1&gt;</title><style>'
    )
    assert page.endswith(f"<script>{view._JS}</script></body></html>\n")
    assert '<header><h1>Session s&lt;1&gt;</h1><div class="meta">' in page
    meta = page.split('<div class="meta">')[1].split("</div>")[0]
    assert meta == (
        "<span>task <b>t</b></span><span>group <b>g</b></span><span>sample <b>0</b></span>"
        "<span>harness <b>codex</b></span>"
        "<span>status <b>completed</b></span><span>reward <b>1.0</b></span><span>calls <b>3 ok, 2 failed</b></span>"
        "<span>chains <b>2 (1 cut)</b></span><span>merge rate <b>50.0%</b></span>"
        "<span>re-tokenized merges <b>0</b></span>"
    )
    assert (
        '<div class="legend">sampled token, by p = exp(logprob): '
        '<span class="sw" style="background:hsl(120,75%,82%)"></span>p=1 '
        '<span class="sw" style="background:hsl(60,75%,82%)"></span>p=0.5 '
        '<span class="sw" style="background:hsl(0,75%,82%)"></span>p≈0 · '
        '<span class="sw t m"></span>interstitial (loss mask 0) · token ids shown (no tokenizer)</div></header>'
    ) in page
    assert (
        '<main><div class="break" data-failed="2">call 2 failed and is not training data: boom &lt;x&gt;</div>'
        '<div class="break" data-failed="3">call 3 failed and is not training data: None</div>[c0]\n[c1]</main>\n'
        '<div id="info">hover a token to see its id, logprob and loss mask</div>'
    ) in page

    sections.clear()
    built.eot_token_id = 7
    tokenizer = _Tokenizer()
    page = view.render_session(built, records[:1], None, tokenizer=tokenizer)
    assert sections[0][1:3] == (None, tokenizer)
    meta = page.split('<div class="meta">')[1].split("</div>")[0]
    assert meta == (
        "<span>harness <b>codex</b></span><span>status <b>no session row</b></span>"
        "<span>calls <b>3 ok, 0 failed</b></span><span>chains <b>2 (1 cut)</b></span>"
        "<span>merge rate <b>50.0%</b></span><span>re-tokenized merges <b>0</b></span>"
        "<span>end-of-turn id <b>7</b></span>"
    )
    assert '<label><input type="checkbox" id="show-ids"> show token ids</label></div>' in page
    assert "data-failed" not in page


# --- tiny_model ----------------------------------------------------------------------------------------------------


def test_the_tiny_model_refuses_unknown_defaults_and_sizes_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were the refusal gone, the build would stop here at once instead of training a tokenizer.
    monkeypatch.setattr(tiny_model, "build_tokenizer", lambda: pytest.fail("built despite the refusal"))
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    with pytest.raises(ValueError) as refused:
        tiny_model.build_tiny_model(tmp_path / "m", generation_defaults="llama")
    assert str(refused.value) == "generation_defaults must be one of ['none', 'qwen3'], got 'llama'"
    with pytest.raises(ValueError) as refused:
        tiny_model.build_tiny_model(tmp_path / "m", size="huge")
    assert str(refused.value) == "size must be one of ['0.5b', 'small', 'tiny'], got 'huge'"
    assert not (tmp_path / "m").exists()


def test_the_training_text_is_the_stdlib_sources_in_order_up_to_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, text in (("b.py", "bbbb"), ("a.py", "aa"), ("c.py", "cccccc"), ("d.txt", "not python"), ("e.py", "e")):
        (tmp_path / name).write_text(text)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "z.py").write_text("nested: not read")
    monkeypatch.setattr(tiny_model.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert tiny_model._training_text(6) == ["aa", "bbbb"]  # the cap reached exactly: stop
    assert tiny_model._training_text(7) == ["aa", "bbbb", "cccccc"]  # one past: the next file is read whole
    assert tiny_model._training_text() == ["aa", "bbbb", "cccccc", "e"]
    (tmp_path / "a.py").write_bytes(b"a\xffa")
    assert tiny_model._training_text(1) == ["aa"]  # undecodable bytes are dropped, not fatal


def test_the_real_training_text_is_capped_at_three_million_characters() -> None:
    texts = tiny_model._training_text()
    assert 3_000_000 <= sum(map(len, texts)) < 3_000_000 + max(map(len, texts))
    assert sum(map(len, texts[:-1])) < 3_000_000


class _FakeModel:
    def __init__(self, config: Any, log: list[Any]) -> None:
        self.config, self.log = config, log

    def to(self, dtype: Any) -> _FakeModel:
        self.log.append(("to", dtype))
        return self

    def save_pretrained(self, out: Path, *, safe_serialization: bool) -> None:
        self.log.append(("save", out, safe_serialization, vars(self.generation_config)))


def test_the_tiny_model_is_built_from_its_shape_tokenizer_and_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[Any] = []
    ids = {"<|im_end|>": 11, "<|endoftext|>": 10}

    class Tokenizer(types.SimpleNamespace):
        def __len__(self) -> int:
            return 321

    tokenizer = Tokenizer(
        convert_tokens_to_ids=ids.__getitem__, save_pretrained=lambda out: log.append(("tokenizer", out))
    )
    monkeypatch.setattr(tiny_model, "build_tokenizer", lambda: tokenizer)
    torch = types.ModuleType("torch")
    torch.manual_seed = lambda seed: log.append(("seed", seed))  # type: ignore[attr-defined]
    torch.float32, torch.bfloat16 = "f32", "bf16"  # type: ignore[attr-defined]
    transformers = types.ModuleType("transformers")
    transformers.Qwen3Config = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    transformers.Qwen3ForCausalLM = lambda config: _FakeModel(config, log)  # type: ignore[attr-defined]
    transformers.GenerationConfig = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "transformers", transformers)

    out = tmp_path / "a" / "tiny"
    assert tiny_model.build_tiny_model(str(out), seed=3, max_position_embeddings=64, generation_defaults="qwen3",
                                       dtype="bfloat16", size="small") == out  # fmt: skip
    assert log[0] == ("seed", 3) and log[1] == ("to", "bf16")
    save = log[2]
    assert save[:3] == ("save", out, True)
    assert save[3] == {
        "eos_token_id": [11, 10], "pad_token_id": 10, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20
    }  # fmt: skip
    assert log[3:] == [("tokenizer", out)]
    assert (out / "chat_template.jinja").read_text() == tiny_model.CHAT_TEMPLATE
    assert (out / "polar_tiny_model.json").read_text() == '{"seed": 3, "vocab_size": 321, "size": "small"}'

    configs: list[Any] = []
    transformers.Qwen3ForCausalLM = lambda config: configs.append(config) or _FakeModel(config, log)  # type: ignore[attr-defined]
    log.clear()
    tiny_model.build_tiny_model(tmp_path / "b")
    assert vars(configs[0]) == {
        "vocab_size": 321, **tiny_model.SIZES["tiny"], "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "eos_token_id": 11, "pad_token_id": 10, "bos_token_id": None, "torch_dtype": "float32",
    }  # fmt: skip
    assert (
        log[0] == ("seed", 0)
        and log[1] == ("to", "f32")
        and log[2][3] == {"eos_token_id": [11, 10], "pad_token_id": 10}
    )
    assert '"seed": 0' in (tmp_path / "b" / "polar_tiny_model.json").read_text()
    tiny_model.build_tiny_model(tmp_path / "b", seed=1)  # built again over an earlier build
    assert '"seed": 1' in (tmp_path / "b" / "polar_tiny_model.json").read_text()


def test_untying_copies_the_embedding_into_its_own_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    class Tensor:
        def __init__(self, value: str) -> None:
            self.value = value

        def clone(self) -> Tensor:
            return Tensor(self.value + " (copy)")

    stored: dict[str, Any] = {}
    saved: list[Any] = []
    module = types.ModuleType("safetensors.torch")
    module.load_file = lambda path: stored[path]  # type: ignore[attr-defined]
    module.save_file = lambda weights, path, metadata: saved.append((dict(weights), path, metadata))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "safetensors.torch", module)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "hidden_size": 8}))
    (model / "model.safetensors").write_text("weights")
    (model / "tokenizer.json").write_text("{}")
    dest = tmp_path / "untied"
    embed = Tensor("E")
    stored[str(dest / "model.safetensors")] = {"model.embed_tokens.weight": embed, "x": Tensor("X")}
    assert tiny_model.untie_embeddings(model, dest) == dest
    assert json.loads((dest / "config.json").read_text()) == {"tie_word_embeddings": False, "hidden_size": 8}
    assert (dest / "config.json").read_text().startswith('{\n  "tie_word_embeddings"')
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True  # the source is kept
    assert (dest / "tokenizer.json").exists()
    ((weights, path, metadata),) = saved
    assert path == str(dest / "model.safetensors") and metadata == {"format": "pt"}
    assert weights["lm_head.weight"].value == "E (copy)" and weights["model.embed_tokens.weight"] is embed
    assert set(weights) == {"model.embed_tokens.weight", "x", "lm_head.weight"}


def test_the_tokenizer_is_byte_level_bpe_with_chatml_specials_and_plain_markup_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        tiny_model, "_training_text", lambda: [" ".join(f"def f{i}(a{i}, b): return a{i} + b" for i in range(300))]
    )
    tokenizer = tiny_model.build_tokenizer(vocab_size=300)
    vocab = tokenizer.get_vocab()
    assert [vocab[t] for t in tiny_model.SPECIAL_TOKENS] == [0, 1, 2]
    assert len(tokenizer) == 300 + len(tiny_model.MARKUP_TOKENS)  # the merges fill up to the size asked
    assert [vocab[t] for t in tiny_model.MARKUP_TOKENS] == list(range(len(tokenizer) - 6, len(tokenizer)))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token, tokenizer.unk_token) == (
        "<|im_end|>", "<|endoftext|>", None, None
    )  # fmt: skip
    assert set(tokenizer.all_special_tokens) == {"<|im_end|>", "<|endoftext|>"}  # markup is text a parser reads
    assert tokenizer.chat_template == tiny_model.CHAT_TEMPLATE
    # Every byte is in the alphabet (nothing is unknown) and no space is added in front.
    text = "x = \u00e9\u4e2d\U0001f600\t~<tool_call>{}</tool_call><|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and tokenizer.convert_ids_to_tokens(ids[0]) == "x"
    assert vocab["<tool_call>"] in ids and vocab["<|im_end|>"] == ids[-1]
    # Engines decode without the special tokens: the markup a tool-call parser reads must survive that.
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")
