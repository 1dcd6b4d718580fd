"""`polar dashboard`: a read-only web page of a loop, rollout or store, updated live (the shell over
polar_cli.dashboard)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

import typer

from polar_cli.settings import SettingsError, command, option

DEFAULT_PORT = 8321


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


@dataclass
class DashboardSettings:
    """`polar dashboard`'s command line."""

    path: Path = option(
        argument=True,
        help="A loop's --out (loop.json), a rollout's report directory (rollout-manifest.json) or a store "
        "(calls/, sessions/; its rollouts' reports under rollouts/). It may hold nothing yet, or not exist: "
        "the page fills once the run begins.",
    )
    host: str = option("127.0.0.1", help="Address to listen on: a loopback address unless --allow-remote.")
    port: int = option(DEFAULT_PORT, help="Port to listen on (0: any free port, printed).", min=0)
    allow_remote: bool = option(
        False,
        help="Allow a --host other than loopback. The page has no login and shows every prompt, output and error "
        "captured (the agent's and the task's text): anyone who can reach the port reads them.",
    )

    def validate(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise SettingsError(f"{self.path} is no directory", "path")
        if not self.allow_remote and not is_loopback(self.host):
            raise SettingsError(f"{self.host} is not a loopback address: add --allow-remote to serve it", "host")


@command
def dashboard(settings: DashboardSettings) -> None:
    """Serve a live, read-only dashboard of a loop, rollout or store on http://127.0.0.1:8321: sessions by stage and
    status, rewards per group and iteration (± SE), pass@k, merge rate and break causes per harness, engine latency
    and tokens/s, and each session's traces (the `polar view` page). Only GET; bound to loopback by default."""
    try:
        import uvicorn

        from polar_cli.dashboard.server import LOOPBACK_HOSTS, create_app
    except ImportError as exc:  # the `dashboard` extra
        raise typer.BadParameter(f"{exc}: pip install 'polar[dashboard]'") from exc

    settings.validate()
    s = settings
    # Our own socket: its port is known (and printed) before uvicorn serves, --port 0 included.
    sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((s.host, s.port))
    except OSError as exc:
        sock.close()
        raise SettingsError(f"cannot listen on {s.host}:{s.port}: {exc}", "port") from exc
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    typer.echo(f"polar dashboard of {s.path} on http://{shown}:{port}/ (Ctrl-C stops it)")
    # Remote: reached by whatever name the network gives this machine (the user chose to expose it). Loopback: its
    # usual names and the address it was given, as a browser writes it (`shown`; a repeat of a name is harmless).
    hosts = ["*"] if s.allow_remote else [*LOOPBACK_HOSTS, shown]
    app = create_app(s.path.resolve(), hosts=hosts)
    # An open page's event stream never ends by itself: on Ctrl-C the streams end at their next poll (a second),
    # so uvicorn's graceful shutdown finishes; the timeout is for a stream stuck on a slow client.
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    board = app.state.dashboard

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            board.close_streams()
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    Server(config).run(sockets=[sock])


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)
