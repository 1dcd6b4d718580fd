"""`polar proxy`: mitmdump with the polar addon, a forward and a reverse listener on 127.0.0.1, and the exact
environment each harness needs to go through it.

One proxy serves every harness: CLIs that honour ``HTTPS_PROXY`` (Codex, and any Node CLI given mitmproxy's CA)
use the forward listener; CLIs and SDKs configured by a base URL use the reverse listener, where every request
on a model route is captured whatever the reverse target. The recipes below are the README's (tests check that
the README shows exactly :func:`recipes` with the default ports, and run them).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.set_option import parse_set_options
from polar_cli.settings import SettingsError, command, option

DEFAULT_PORT = 8080
DEFAULT_REVERSE = "https://api.openai.com"
DEFAULT_CONFDIR = "~/.mitmproxy"

# Placeholders: {fwd} and {rev} are the two listeners' ports, {ca} mitmproxy's CA certificate. $SESSION and $MODEL
# stay shell variables: set them per run (the session becomes the record's session_id, the model is any name).
RECIPES = """\
CA={ca}
SESSION=my-session MODEL=tiny
# Claude Code (base URL; its API client cannot use a proxy URL with credentials, so the session rides on the key)
ANTHROPIC_BASE_URL=http://127.0.0.1:{rev} ANTHROPIC_API_KEY=polar:$SESSION ANTHROPIC_MODEL=$MODEL \\
  ANTHROPIC_DEFAULT_HAIKU_MODEL=$MODEL ANTHROPIC_DEFAULT_SONNET_MODEL=$MODEL ANTHROPIC_DEFAULT_OPUS_MODEL=$MODEL \\
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 claude -p "list the files here"
# Codex (default provider and model, no config: its Responses WebSocket is answered by the proxy)
OPENAI_API_KEY=x HTTPS_PROXY=http://$SESSION@127.0.0.1:{fwd} CODEX_CA_CERTIFICATE=$CA SSL_CERT_FILE=$CA \\
  codex exec --skip-git-repo-check "list the files here"
# Qwen Code
OPENAI_BASE_URL=http://127.0.0.1:{rev}/v1 OPENAI_API_KEY=polar:$SESSION OPENAI_MODEL=$MODEL \\
  qwen --auth-type openai -p "list the files here"
# Gemini CLI
mkdir -p ~/.gemini &&
  echo '{{"security": {{"auth": {{"selectedType": "gemini-api-key"}}}}}}' > ~/.gemini/settings.json
GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:{rev} GEMINI_API_KEY=polar:$SESSION \\
  gemini --skip-trust -m $MODEL -p "list the files here"
# Pi (api: openai-completions, openai-responses, anthropic-messages or google-generative-ai)
mkdir -p ~/.pi/agent &&
  echo '{{"providers": {{"polar": {{"baseUrl": "http://127.0.0.1:{rev}/v1", "api": "openai-completions",
  "apiKey": "polar:'$SESSION'", "models": [{{"id": "'$MODEL'"}}]}}}}}}' > ~/.pi/agent/models.json
PI_OFFLINE=1 pi -p --provider polar --model $MODEL --no-session "list the files here"
# openai / anthropic / google-genai SDKs: base_url=http://127.0.0.1:{rev}/v1 (anthropic, google-genai: without /v1)
# and api_key=polar:SESSION; or, with no code change, the forward proxy:
HTTPS_PROXY=http://$SESSION@127.0.0.1:{fwd} SSL_CERT_FILE=$CA NODE_EXTRA_CA_CERTS=$CA \\
  OPENAI_API_KEY=x python your_agent.py
"""


def recipes(port: int = DEFAULT_PORT, reverse_port: int | None = None, ca: str | None = None) -> str:
    """The harness recipes for a proxy on ``port`` (forward) and ``reverse_port`` (reverse, default port + 1)."""
    return RECIPES.format(fwd=port, rev=reverse_port or port + 1, ca=ca or f"{DEFAULT_CONFDIR}/mitmproxy-ca-cert.pem")


def reward_recipe(port: int, out: str, confdir: Path, explicit_token: bool = False) -> str:
    """How the verifier side (never the agent) posts a reward: with the proxy's control token."""
    from polar_addon.control import token_file

    token = "$POLAR_CONTROL_TOKEN" if explicit_token else f"$(cat {token_file(out, str(confdir))})"
    return (
        "# Rewards, from the verifier side only (the agent must not be able to read the control token):\n"
        f"curl -x http://127.0.0.1:{port} http://polar.local/sessions/$SESSION/reward \\\n"
        f'  -H "Authorization: Bearer {token}" -d \'{{"value": 1.0}}\''
    )


@dataclass
class ProxySettings:
    """`polar proxy`'s command line."""

    engine: str = option(
        flags=("--engine", "-e"),
        help="sglang:URL, vllm:URL or local:MODEL_DIR; comma-separated for several "
        "engines: each session stays on one (the least loaded at its first call), and an "
        "engine that refuses connections or fails 3 calls in a row is taken out, its "
        "sessions ending as error, never moved.",
    )
    out: str = option(flags=("--out", "-o"), help="The trace store: a directory or a URI such as s3://bucket/prefix.")
    port: int = option(DEFAULT_PORT, help="Forward proxy port (HTTPS_PROXY).")
    reverse_port: int | None = option(None, help="Reverse proxy port for base URLs (default: PORT + 1).")
    reverse: str = option(
        DEFAULT_REVERSE, help="Reverse target for non-model paths (model routes are captured whatever it is)."
    )
    confdir: Path = option(Path(DEFAULT_CONFDIR), help="mitmproxy's configuration directory (its CA).")
    pass_through: bool = option(
        False,
        flags=("--pass-through",),
        help="Also relay non-model traffic: plain HTTP, TLS "
        "(untouched) and raw TCP to ANY host:port a client names, this machine's "
        "loopback services included, and the reverse listener's other paths to its "
        "target. Only for harnesses you trust, e.g. your own CLI that needs other "
        "hosts; `polar rollout --proxy` refuses such a proxy. Default: refused (403).",
    )
    set_options: list[str] = option(
        default_factory=list,
        flags=("--set",),
        help="Extra mitmdump option KEY=VALUE (repeatable), e.g. --set polar_max_tokens=512.",
    )

    @property
    def rport(self) -> int:
        """The reverse listener's port."""
        return self.reverse_port or self.port + 1

    def validate(self) -> None:
        if self.rport == self.port:
            raise SettingsError("the reverse port must differ from the forward port", "reverse_port")


@command
def proxy(settings: ProxySettings) -> None:
    """Run mitmdump with the polar addon on 127.0.0.1 (forward and reverse listeners) and print each harness's
    environment; Ctrl-C stops it (records already acknowledged are durable). Killed outright (SIGKILL), it takes
    mitmdump down with it: no proxy is left writing the store.

    Only model calls and polar's own control paths are answered; anything else a client sends through it is
    refused with a 403 (polar_block_other), so an agent given this proxy reaches nothing else through it, unless
    --pass-through."""
    from polar_cli import lifeline
    from polar_cli.mitm import mitmdump_command, stop_mitmdump, wait_for_port

    settings.validate()
    port, rport, out, reverse = settings.port, settings.rport, settings.out, settings.reverse
    block_other = "false" if settings.pass_through else "true"
    extra = {"flow_detail": "0", "polar_block_other": block_other, **parse_set_options(settings.set_options)}
    confdir = settings.confdir.expanduser()
    cmd = mitmdump_command(
        settings.engine,
        out,
        port=None,
        modes=[f"regular@{port}", f"reverse:{reverse}@{rport}"],
        confdir=confdir,
        options=extra,
        quiet=False,
    )
    # mitmdump's log goes to our stderr: stdout then carries only what polar prints (the recipes), never a log
    # line interleaved into it (two processes writing one pipe), and `polar proxy > recipes.txt` works.
    process = subprocess.Popen(cmd, start_new_session=True, stdout=sys.stderr)
    lifeline.tie(process.pid)  # even a SIGKILLed `polar proxy` leaves no mitmdump writing its store
    # Own session (so a terminal's Ctrl-C reaches mitmdump once, through us): a TERM to us must stop it too.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        # The local engine loads its model before mitmdump listens: wait as long as that may take.
        for p in (port, rport):
            wait_for_port(p, 600, process)
        typer.echo(
            f"\npolar proxy: forward http://127.0.0.1:{port}, reverse http://127.0.0.1:{rport} -> {reverse}; "
            f"records in {out}; {_traffic(extra['polar_block_other'])}. Point each harness at it (set SESSION "
            "and MODEL per run):\n"
        )
        typer.echo(recipes(port, rport, str(confdir / "mitmproxy-ca-cert.pem")))
        typer.echo(reward_recipe(port, out, confdir, explicit_token="polar_control_token" in extra))
        code = process.wait()
    except KeyboardInterrupt:
        code = stop_mitmdump(process)
    except (RuntimeError, TimeoutError) as exc:
        stop_mitmdump(process)
        typer.echo(f"error: mitmdump did not start: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        lifeline.untie(process.pid)
    raise typer.Exit(code)


def _traffic(block_other: str) -> str:
    if block_other == "false":  # mitmproxy's only spelling of a false boolean
        return "NON-MODEL TRAFFIC PASSES THROUGH (to any host, this machine's included)"
    return "non-model traffic refused (403)"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
