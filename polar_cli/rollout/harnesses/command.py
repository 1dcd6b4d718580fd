"""``--harness cmd:'ANY COMMAND {instruction}'``: any program that talks to a model API, run once per session.

The command is a shell line; ``{instruction}`` becomes the task's instruction as one shell-quoted word (the runner
also puts it in ``$POLAR_INSTRUCTION``), and ``{model}``, ``{session}``, ``{task}``, ``{sample}``, ``{workspace}`` are
filled in the same way. The environment points every common client at polar: the openai, anthropic and google-genai
SDKs by base URL and a ``polar:`` API key that carries the session's secret, anything else by ``HTTPS_PROXY`` (with the
secret as proxy credentials) and mitmproxy's CA in the usual CA variables. ``POLAR_SESSION``, ``POLAR_TASK``,
``POLAR_GROUP`` and ``POLAR_SAMPLE`` are information only: the proxy takes the labels from the session's registration.

In a sandbox runtime the command sees only what the runtime shows it: every absolute host path the command names
is made visible read-only at the same path (a Python venv as a whole, with the installation it was made from, so
``/path/.venv/bin/python agent.py`` runs).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext

PLACEHOLDERS = ("instruction", "model", "session", "task", "sample", "workspace")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


class CommandPreset(HarnessPreset):
    name = "cmd"

    def __init__(self, template: str) -> None:
        if not template.strip():
            raise ValueError("cmd: needs a command, e.g. cmd:'python agent.py {instruction}'")
        self.template = template
        self.read_only = named_host_paths(template)

    def configure(self, home: Path, ctx: SessionContext) -> None:
        """A plain command has no config files of its own."""

    def env(self, ctx: SessionContext) -> dict[str, str]:
        key = ctx.api_key()
        return {
            "OPENAI_API_KEY": key, "ANTHROPIC_API_KEY": key, "GEMINI_API_KEY": key, "GOOGLE_API_KEY": key,
            "OPENAI_BASE_URL": f"{ctx.reverse_url}/v1", "ANTHROPIC_BASE_URL": ctx.reverse_url,
            "GOOGLE_GEMINI_BASE_URL": ctx.reverse_url,
            "OPENAI_MODEL": ctx.model, "ANTHROPIC_MODEL": ctx.model,
            "HTTPS_PROXY": ctx.forward_proxy_url(), "https_proxy": ctx.forward_proxy_url(),
            # The reverse listener is plain http on loopback: reached directly, never through the forward proxy.
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "SSL_CERT_FILE": ctx.ca_path, "NODE_EXTRA_CA_CERTS": ctx.ca_path, "REQUESTS_CA_BUNDLE": ctx.ca_path,
            "CURL_CA_BUNDLE": ctx.ca_path,
            "POLAR_SESSION": ctx.session_id, "POLAR_TASK": ctx.task_id, "POLAR_GROUP": ctx.group_id,
            "POLAR_SAMPLE": str(ctx.sample), "POLAR_MODEL": ctx.model,
        }  # fmt: skip

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        values = {
            "instruction": instruction,
            "model": ctx.model,
            "session": ctx.session_id,
            "task": ctx.task_id,
            "sample": str(ctx.sample),
            "workspace": ctx.workspace,
        }
        # One pass over the template: a value put in is never searched again, so an instruction that itself says
        # "{workspace}" or "{model}" arrives unchanged and still as one word.
        line = _PLACEHOLDER.sub(lambda match: shlex.quote(values[match.group(1)]), self.template)
        return ["sh", "-c", line]


def named_host_paths(template: str) -> tuple[Path, ...]:
    """The host files and directories an absolute path in ``template`` names: a venv's root for a path inside one
    (its interpreter needs ``pyvenv.cfg`` and ``lib/``), else the path itself."""
    try:
        words = shlex.split(template)
    except ValueError:
        words = template.split()
    paths: list[Path] = []
    for word in words:
        if not word.startswith("/"):
            continue
        path = Path(word)
        if not path.exists():
            continue
        venv = next((p for p in path.parents if (p / "pyvenv.cfg").is_file()), None)
        for chosen in (venv, _base_prefix(venv)) if venv else (path,):
            if chosen is not None and chosen not in paths:
                paths.append(chosen)
    return tuple(paths)


def _base_prefix(venv: Path) -> Path | None:
    """The Python installation a venv was made from (``home = PREFIX/bin`` in pyvenv.cfg), unless it is the
    system's own under /usr, which every sandbox shows already."""
    for line in (venv / "pyvenv.cfg").read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            prefix = Path(value.strip()).resolve().parent
            return None if prefix == Path("/usr") or Path("/usr") in prefix.parents else prefix
    return None


def make(arg: str | None = None) -> HarnessPreset:
    return CommandPreset(arg or "")
