"""The ``oci`` runtime: each session in a podman (default) or docker container, for tasks that bring an image
(``spec.image``, or ``spec.dockerfile`` built once per distinct build context and base images, cached by content
hash). The build pulls a base image only when it is missing: offline, load it first under the full name its
``FROM`` resolves to (``python:3.11-slim`` is ``docker.io/library/python:3.11-slim``).

One long-lived container per sandbox (its pid 1 a shell that sleeps); :meth:`OciSandbox.exec` is ``podman exec``,
so setup, harness and patch extraction share the container's filesystem and processes. The workspace is bound at
``spec.workdir`` (default ``/workspace``) unless the host directory is empty: then the image's own directory there
is kept (a Harbor task's image carries its repository) and ``download`` brings results out. HOME is bound at
``/home/polar``, ``spec.binds`` at their paths (``spec.read_only_binds`` read-only), ``spec.read_only`` read-only
at their own paths (host binaries need the image to carry their libraries: node from the host runs only in a glibc
image like the host's), the proxy's CA certificate (only that file) read-only.

Limits: ``spec.cpus``, ``memory_mb``, ``pids`` become ``--cpus``, ``--memory``, ``--pids-limit`` (enforced by the
engine's cgroup; an exec during which the memory limit killed a process says so, ``ExecResult.oom_killed``, from
the container's cgroup ``oom_kill`` count, else the engine's ``State.OOMKilled``). The container runs as the
image's user (root, usually) with the engine's default capabilities and ``no-new-privileges`` (setuid binaries
gain nothing). No host root: podman run by root maps the container's uids 0..65535 to the host's ``host_uid``..
(default :data:`confine.DEFAULT_HOST_UID`, ids of no account; ``--uidmap``/``--gidmap``), so container root
reads no root-only host file bound in and owns nothing on the host.
The bound writable directories (workspace, HOME, ``spec.binds``) are handed to the container user's host uid
before each exec (the runner writes there as root between execs), and their setuid/setgid bits are cleared when
the sandbox stops. The image's own files keep their owners inside (root-owned stays root-owned, mapped).
Rootless podman maps the container to the invoking user already. Docker has no per-container uid map (only the
daemon's ``userns-remap``): rootful docker's container root is host root, restricted by capabilities, seccomp and
the mount namespace, so a root-only file bound in is readable and what it writes to a bound directory is root's:
such a daemon is refused (``docker info``'s security options name neither rootless nor userns) unless the runtime
option ``trust_root`` accepts it.

Network: ``host`` (``--network host``), ``none``, and ``proxy-only`` (podman only): the container's network
namespace has a loopback only, with socat listening on the proxy's ports and relaying to the host through Unix
sockets (:mod:`bridge`), so any image works, with or without socat. The container joins a namespace that polar
prepares, or, with mapped uids, gets its own (``--network none``: a namespace it must own, for the engine sets
its sysctls from inside) which the bridge's socats then join from the host (``nsenter``) before the first exec.
Docker cannot join a prepared namespace: use podman, or ``network="host"``.

Timeouts and ``cancel`` kill every process in the container but its pid 1 (a session runs one command at a time;
a daemon started by setup dies too).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from polar_cli import lifeline
from polar_cli.rollout.runtimes import cgroups, confine, disk
from polar_cli.rollout.runtimes.archive import extract_contained
from polar_cli.rollout.runtimes.base import (
    ISOLATED_CA,
    ISOLATED_HOME,
    TOOLS_DIR,
    TOOLS_HOST,
    ExecResult,
    IsolatedSandbox,
    Runtime,
    RuntimeUnavailable,
    SandboxSpec,
)
from polar_cli.rollout.runtimes.bridge import BRIDGE_SCRIPT, bridge_env, kill_group, start_host_bridges, stop_processes
from polar_cli.rollout.runtimes.bwrap import find_bwrap
from polar_cli.rollout.runtimes.output import BoundedOutput, communicate

HOME = ISOLATED_HOME
WORKSPACE = "/workspace"
CA_INSIDE = ISOLATED_CA
PATH = f"{TOOLS_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# pid 1: sleeps until the container is removed; exits at once on SIGTERM.
INIT = 'trap "exit 0" TERM; while :; do sleep 3600 & wait $!; done'
# Kills everything but pid 1 and itself (kill -1 spares both).
KILL_ALL = "kill -9 -1 2>/dev/null; exit 0"
# How many container uids (and gids) a root podman maps to the host: 0..65535, every id an image's files commonly use.
MAPPED_IDS = 65536


def from_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines name (flags such as ``--platform`` skipped; a name that is an
    earlier stage is kept: inspecting it finds nothing, which changes nothing)."""
    images = []
    for line in dockerfile.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].upper() == "FROM":
            names = [w for w in words[1:] if not w.startswith("--")]
            if names:
                images.append(names[0])
    return images


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_file(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """``env`` as an engine ``--env-file`` (one ``NAME=value`` a line, taken literally by podman and docker) and the
    ``-e`` arguments of what such a file cannot hold: a value with a line break would end its line and start another
    variable of the value's choosing, and a name the file format would read differently (a ``#`` comment, spaces)."""
    lines, inline = [], []
    for key, value in env.items():
        if ENV_NAME.fullmatch(key) and "\n" not in value and "\r" not in value:
            lines.append(f"{key}={value}\n")
        else:
            inline += ["-e", f"{key}={value}"]
    return "".join(lines), inline


class OciSandbox(IsolatedSandbox):
    def __init__(
        self,
        runtime: OciRuntime,
        spec: SandboxSpec,
        container: str,
        scratch: Path,
        helpers: list[asyncio.subprocess.Process],
    ):
        super().__init__(spec)
        self.runtime = runtime
        self.container = container
        self.lifeline_key: str | None = None  # lifeline.on_death's removal of the container
        self.scratch = scratch
        self.helpers = helpers  # host-side bridge socats and the network-namespace holder
        self.workspace = spec.workdir or WORKSPACE
        self.host_workspace: Path | None = None  # set by start when the host directory is bound
        self.owner: tuple[int, int] | None = None  # the container user's host uid and gid, when uids are mapped
        self.memory_cgroup: Path | None = None  # the container's memory cgroup on the host (its OOM kill count)

    async def oom_kills(self) -> int:
        """How many processes the container's memory limit has killed so far: its cgroup's count where the host
        shows it, else 1 when the engine says the container was OOM-killed."""
        if self.memory_cgroup is not None:
            return cgroups.oom_kills(self.memory_cgroup)
        code, out = await self.runtime._run("inspect", "--format", "{{.State.OOMKilled}}", self.container)
        return 1 if code == 0 and out.strip() == "true" else 0

    async def _cli(
        self,
        *args: str,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        bounded: bool = False,
        since: int | None = None,
    ) -> tuple[int, bytes, bytes, bool, bool, str | None]:
        """One engine CLI call; returns (exit code, stdout, stderr, timed out, cancelled, the disk bound's line when it
        killed the call). ``bounded``: keep only a head and a tail of each stream (:mod:`output`) and watch the disk
        bound (:mod:`disk`), for what the agent controls. ``since``: the cancel count
        when the caller began (a cancel after it stops this call), else now's."""
        cancels = self.cancels if since is None else since
        proc = await asyncio.create_subprocess_exec(
            self.runtime.binary,
            *args,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        lifeline.tie(proc.pid)
        self.running.add(proc)
        if self.cancels != cancels:
            await self._kill_inside()
            kill_group(proc)
        timed_out = False
        out, err = BoundedOutput.pair(bounded)
        reading = asyncio.ensure_future(communicate(proc, stdin, out, err))
        killing: list[asyncio.Future] = []

        def over_disk() -> None:  # the container's processes, not only the engine's client
            killing.append(asyncio.ensure_future(self._kill_inside()))
            kill_group(proc)

        # What the agent runs (bounded execs) is watched against the disk bound; the runner's own calls are not.
        watching = (
            asyncio.ensure_future(disk.watch(self.writable, self.runtime.disk_mb, over_disk, self.runtime.disk_files))
            if bounded
            else None
        )
        try:
            try:
                await asyncio.wait_for(asyncio.shield(reading), timeout_s)
            except TimeoutError:
                timed_out = True
                await self._kill_inside()
                kill_group(proc)
                await reading
        except BaseException:
            kill_group(proc)
            reading.cancel()
            await asyncio.shield(self._kill_inside())
            raise
        finally:
            self.running.discard(proc)
            lifeline.untie(proc.pid)
            if watching is not None:
                watching.cancel()
        for kill in killing:
            await kill
        over = watching.result() if watching is not None and watching.done() and not watching.cancelled() else None
        code = proc.returncode if proc.returncode is not None else -1
        return code, out.data(), err.data() + (over or "").encode(), timed_out, self.cancels != cancels, over

    async def _kill_inside(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            self.runtime.binary,
            "exec",
            self.container,
            "/bin/sh",
            "-c",
            KILL_ALL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await proc.wait()

    def writable(self) -> list[Path]:
        """The host directories bound writable inside."""
        bound = [self.host_workspace] if self.host_workspace is not None else []
        return [*bound, Path(self.spec.home), *(Path(p) for p in self.spec.binds.values())]

    async def hand_over(self) -> None:
        """The writable directories to the container user's host uid (mapped uids only): the runner writes there as
        root between execs (HOME's harness config, the verifier's patch), which the mapped user could not change."""
        if self.owner is not None:
            await confine.hand_over_all(self.writable(), *self.owner)

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        if self.stopped:
            raise RuntimeError(f"sandbox {self.spec.name} is stopped")
        cancels = self.cancels  # a cancel while the directories are handed over stops this exec too
        await self.hand_over()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        ooms = await self.oom_kills() if self.spec.memory_mb else 0
        args = ["exec", "-w", cwd or self.workspace]
        if stdin is not None:
            args.append("-i")
        text, inline = env_file({"HOME": HOME, "TMPDIR": "/tmp", **self.spec.env, **(env or {})})
        # The environment (the session's proxy credentials among it) in a file only this user reads, not on the
        # engine client's command line, which every process on the host can list. (The scratch dir is start's.)
        env_path = self.scratch / f"env-{uuid.uuid4().hex}"
        fd = os.open(env_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        try:
            code, out, err, timed_out, cancelled, over = await self._cli(
                *args, "--env-file", str(env_path), *inline, self.container, *argv,
                stdin=stdin, timeout_s=timeout_s, bounded=True, since=cancels,
            )  # fmt: skip
        finally:
            env_path.unlink(missing_ok=True)
        return ExecResult(
            -1 if timed_out or cancelled else code,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            timed_out,
            cancelled,
            oom_killed=bool(self.spec.memory_mb) and await self.oom_kills() > ooms,
            limit="disk" if over else None,
        )

    async def upload(self, local: Path, remote: str) -> None:
        remote = posixpath.normpath(remote)
        parent = posixpath.dirname(remote) or "/"
        mkdir = await self.exec(["mkdir", "-p", parent], cwd="/")
        if mkdir.exit_code != 0:
            raise OSError(f"upload to {remote} in sandbox {self.spec.name} failed: {mkdir.stderr}")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(Path(local), arcname=posixpath.basename(remote))
        # `cp - CONTAINER:DIR` unpacks a tar stream; the engine resolves DIR inside the container's root.
        code, _, err, _, _, _ = await self._cli("cp", "-", f"{self.container}:{parent}", stdin=buffer.getvalue())
        if code != 0:
            raise OSError(f"upload to {remote} in sandbox {self.spec.name} failed: {err.decode(errors='replace')}")

    async def download(self, remote: str, local: Path) -> None:
        remote = posixpath.normpath(remote)
        code, out, err, _, _, _ = await self._cli("cp", f"{self.container}:{remote}", "-")
        if code != 0:
            message = err.decode(errors="replace")
            if "no such file" in message.lower() or "not found" in message.lower():
                raise FileNotFoundError(f"{remote} does not exist in sandbox {self.spec.name}")
            raise OSError(f"download of {remote} from sandbox {self.spec.name} failed: {message}")
        extract_contained(out, posixpath.basename(remote), Path(local))

    async def cancel(self) -> None:
        self.cancels += 1
        if not self.running:
            return
        await self._kill_inside()
        for proc in list(self.running):
            kill_group(proc)
        # A killed `exec` client can have started its process inside after the first sweep.
        await self._kill_inside()

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for proc in list(self.running):
            kill_group(proc)
        remove = ["rm", "-f", "-t", "0"] if self.runtime.engine == "podman" else ["rm", "-f"]  # docker rm has no -t
        proc = await asyncio.create_subprocess_exec(
            self.runtime.binary, *remove, self.container, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        await proc.wait()
        if self.lifeline_key:
            lifeline.cancel(self.lifeline_key)
        await stop_processes(self.helpers)
        await confine.strip_setid_all(self.writable())  # the container is gone
        shutil.rmtree(self.scratch, ignore_errors=True)


class OciRuntime(Runtime):
    name = "oci"

    def __init__(
        self,
        engine: str = "podman",
        binary: str | None = None,
        image: str | None = None,
        oci_runtime: str | None = None,
        scratch_dir: Path | str | None = None,
        host_uid: int | None = None,
        trust_root: bool | str = False,
        disk_mb: int = disk.DEFAULT_DISK_MB,
        disk_files: int = disk.DEFAULT_MAX_ENTRIES,
    ):
        if engine not in ("podman", "docker"):
            raise ValueError(f"oci runtime: engine must be podman or docker, not {engine!r}")
        maps = engine == "podman" and os.geteuid() == 0
        if host_uid is not None and not maps:
            raise ValueError(
                "oci runtime: host_uid needs podman run by root (docker maps no uids per container; "
                "rootless podman maps the container to the invoking user)"
            )
        # The first host uid (and gid) of the container's mapped range; None: the engine's own mapping.
        self.host_uid = (confine.DEFAULT_HOST_UID if host_uid is None else host_uid) if maps else None
        found = binary or shutil.which(engine)
        if not found:
            raise RuntimeUnavailable(f"oci runtime: no {engine} binary (`make sandbox` installs podman and runc)")
        self.engine = engine
        self.binary = found
        # The disk bound of the bound host directories (workspace, HOME, binds): RLIMIT_FSIZE per container and
        # disk.watch per exec. The container's own writable layer (an image's workdir) has only the per-file part.
        self.disk_mb = int(disk_mb)
        self.disk_files = int(disk_files)
        # What the runtime can enforce: docker cannot join polar's proxy-only namespace.
        self.default_network = "proxy-only" if engine == "podman" else "host"
        self.image = image  # used when a spec names neither an image nor a Dockerfile
        # crun 1.8 (Debian 12's podman default) refuses a hybrid cgroup v1/v2 layout; runc works everywhere.
        if oci_runtime is None:
            oci_runtime = "runc" if engine == "podman" and shutil.which("runc") else ""
        self.oci_runtime = oci_runtime
        self.scratch_dir = Path(scratch_dir) if scratch_dir else None
        self.built: dict[str, str] = {}
        self.build_locks: dict[str, asyncio.Lock] = {}
        # Whether the user accepts a docker daemon whose container root is host root (a runtime option: the CLI
        # passes it as a string).
        self.trust_root = trust_root is True or str(trust_root).lower() in ("1", "true", "yes")
        self.engine_checked = False

    async def check_engine(self) -> None:
        """Once per runtime: refuse docker whose daemon maps container root to host root (rootful, without
        ``userns-remap``) unless ``trust_root``. Rootless docker and userns-remap say so in ``SecurityOptions``
        (``name=rootless``, ``name=userns``); podman maps uids itself."""
        if self.engine_checked or self.engine != "docker":
            return
        code, out = await self._run("info", "--format", "{{json .SecurityOptions}}")
        if code != 0:
            raise RuntimeUnavailable(f"oci runtime: `docker info` failed (is the daemon running?): {out[-2000:]}")
        try:
            options = json.loads(out.strip().splitlines()[-1]) if out.strip() else []
        except json.JSONDecodeError:
            raise RuntimeUnavailable(
                f"oci runtime: `docker info` said {out[-500:]!r}, not its security options"
            ) from None
        names = {part for option in options or [] for part in str(option).split(",")}
        if not names & {"name=rootless", "name=userns"} and not self.trust_root:
            raise RuntimeUnavailable(
                "oci runtime: this docker daemon runs containers as host root (neither rootless nor userns-remap: "
                f"its security options are {options}): container root would own every bound directory and read "
                "any root-only file bound in. Use podman (engine=podman), rootless docker or userns-remap, or "
                "accept it with the runtime option trust_root=true"
            )
        self.engine_checked = True

    def _engine_flags(self) -> list[str]:
        flags = ["--runtime", self.oci_runtime] if self.oci_runtime else []
        # Without CAP_SYS_RESOURCE in its namespace podman cannot raise the default limits; set them explicitly.
        fsize = self.disk_mb * 2**20
        return flags + ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", "--ulimit", f"fsize={fsize}"]

    def _userns_flags(self) -> list[str]:
        if self.host_uid is None:
            return []
        return ["--uidmap", f"0:{self.host_uid}:{MAPPED_IDS}", "--gidmap", f"0:{self.host_uid}:{MAPPED_IDS}"]

    async def _pid(self, container: str) -> int:
        """The host pid of the container's pid 1."""
        code, out = await self._run("inspect", "--format", "{{.State.Pid}}", container)
        if code != 0 or not out.strip().isdigit():
            raise RuntimeUnavailable(f"oci runtime: inspecting container {container} failed: {out[-4000:]}")
        return int(out)

    async def _run(self, *args: str, cwd: Path | None = None) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            self.binary, *args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd
        )
        out, _ = await proc.communicate()
        return proc.returncode, out.decode(errors="replace")

    async def image_for(self, spec: SandboxSpec) -> str:
        """The spec's image, building ``spec.dockerfile`` once per distinct build context and base images (content
        hash tag)."""
        if spec.dockerfile is None:
            image = spec.image or self.image
            if not image:
                raise RuntimeUnavailable(f"oci runtime: task {spec.name} names no image nor Dockerfile")
            return image
        dockerfile = Path(spec.dockerfile)
        context = dockerfile.parent
        digest = hashlib.sha256()
        for path in sorted(p for p in context.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(context)).encode() + b"\0" + path.read_bytes() + b"\0")
        # The base images too: an offline user who loads a new `python:3.11-slim` gets a rebuild, not the old one.
        for base in from_images(dockerfile.read_text(errors="replace")):
            code, image_id = await self._run("image", "inspect", "--format", "{{.Id}}", base)
            digest.update(base.encode() + b"\0" + (image_id.strip().encode() if code == 0 else b"") + b"\0")
        tag = f"localhost/polar-task:{digest.hexdigest()[:16]}"
        lock = self.build_locks.setdefault(tag, asyncio.Lock())
        async with lock:
            if tag in self.built:
                return tag
            code, _ = await self._run("image", "inspect", tag)
            if code != 0:
                build = ["build", "-t", tag, "-f", str(dockerfile)]
                if self.engine == "podman":
                    build += self._engine_flags()
                code, log = await self._run(*build, str(context))
                if code != 0:
                    raise RuntimeUnavailable(
                        f"oci runtime: building {dockerfile} failed (offline? load its base "
                        f"image under its full name, e.g. docker.io/library/python:3.11-slim):"
                        f"\n{log[-4000:]}"
                    )
            self.built[tag] = tag
            return tag

    async def start(self, spec: SandboxSpec) -> OciSandbox:
        await self.check_engine()
        if spec.network not in ("host", "proxy-only", "none"):
            raise ValueError(f"oci runtime: unknown network mode {spec.network!r}")
        if spec.network == "proxy-only" and self.engine != "podman":
            raise RuntimeUnavailable(
                "oci runtime: proxy-only needs podman (docker cannot join a prepared network "
                "namespace); use engine=podman or network=host"
            )
        if not Path(spec.proxy.ca).is_file():
            raise RuntimeUnavailable(f"oci runtime: the proxy's CA certificate {spec.proxy.ca} does not exist")
        missing = [str(p) for p in spec.read_only if not Path(p).exists()]
        if missing:
            raise RuntimeUnavailable(f"oci runtime: read-only paths to mount do not exist: {', '.join(missing)}")
        image = await self.image_for(spec)
        for path in (spec.workspace, spec.home, *spec.binds.values()):
            Path(path).mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name)[:40]
        container = f"polar-{safe}-{uuid.uuid4().hex[:8]}"
        scratch = Path(tempfile.mkdtemp(prefix=f"polar-oci-{safe}-", dir=self.scratch_dir))
        helpers: list[asyncio.subprocess.Process] = []
        sandbox = OciSandbox(self, spec, container, scratch, helpers)
        # The container lives under the engine's own daemon/conmon, outside our process groups: removed by the
        # lifeline if polar dies without stopping it.
        remove = ["rm", "-f", "-t", "0"] if self.engine == "podman" else ["rm", "-f"]  # docker rm has no -t
        sandbox.lifeline_key = lifeline.on_death([self.binary, *remove, container])
        try:
            network = spec.network
            if network == "proxy-only":
                helpers += await start_host_bridges(spec.proxy, scratch / "sockets")
                if self.host_uid is None:
                    holder, pid = await self._network_holder(spec, scratch / "sockets")
                    helpers.append(holder)
                    network = f"ns:/proc/{pid}/ns/net"
                else:  # bridged into the container's own namespace once it runs
                    network = "none"
            bind_workspace = any(Path(spec.workspace).iterdir())
            args = [
                "run",
                "-d",
                "--name",
                container,
                *self._engine_flags(),
                *self._userns_flags(),
                "--network",
                network,
                "--hostname",
                "polar",
                "-w",
                sandbox.workspace if bind_workspace else "/",
                # a setuid binary of the image (or one the agent makes) gains nothing
                "--security-opt",
                "no-new-privileges",
                "-e",
                f"HOME={HOME}",
                "-e",
                f"PATH={PATH}",
                "-v",
                f"{spec.home}:{HOME}",
                "-v",
                f"{spec.proxy.ca}:{CA_INSIDE}:ro",
                "-v",
                f"{TOOLS_HOST}:{TOOLS_DIR}:ro",
            ]
            if bind_workspace:
                args += ["-v", f"{spec.workspace}:{sandbox.workspace}"]
                sandbox.host_workspace = Path(spec.workspace)
            for path in spec.read_only:
                args += ["-v", f"{Path(path).resolve()}:{Path(path).absolute()}:ro"]
            for inside, host in spec.binds.items():
                args += ["-v", f"{host}:{posixpath.normpath(inside)}"]
            for inside, host in spec.read_only_binds.items():
                args += ["-v", f"{host}:{posixpath.normpath(inside)}:ro"]
            if spec.cpus:
                args += ["--cpus", str(spec.cpus)]
            if spec.memory_mb:  # swap included: the same bound for memory and memory + swap
                args += ["--memory", f"{spec.memory_mb}m", "--memory-swap", f"{spec.memory_mb}m"]
            if spec.pids:
                args += ["--pids-limit", str(spec.pids)]
            args += ["--entrypoint", "/bin/sh", image, "-c", INIT]
            # In the sandbox's scratch dir: the container's monitor (conmon) inherits the cwd and, on cgroup v1,
            # drops its "oom" marker file there when the memory limit kills a process.
            code, log = await self._run(*args, cwd=scratch)
            if code != 0:
                raise RuntimeUnavailable(f"oci runtime: starting a container of {image} failed:\n{log[-4000:]}")
            pid = await self._pid(container)
            sandbox.memory_cgroup = cgroups.memory_dir_of(pid)
            if self.host_uid is not None:
                sandbox.owner = owner_of(pid)
                if spec.network == "proxy-only":
                    holder, _ = await self._network_holder(spec, scratch / "sockets", join=f"/proc/{pid}/ns/net")
                    helpers.append(holder)
            if not bind_workspace:  # the image's own directory, which an image's WORKDIR does not always create
                made = await sandbox.exec(["mkdir", "-p", sandbox.workspace], cwd="/")
                if made.exit_code != 0:
                    raise RuntimeUnavailable(f"oci runtime: no {sandbox.workspace} in {image}: {made.stderr}")
        except BaseException:
            await sandbox.stop()
            raise
        return sandbox

    async def _network_holder(
        self, spec: SandboxSpec, sockets: Path, join: str | None = None
    ) -> tuple[asyncio.subprocess.Process, int]:
        """A process in whose network namespace the bridge listens on the proxy's ports: a fresh one (bwrap brings
        its loopback up) that the container then joins, or the container's own, ``join`` (nsenter; podman's
        ``none`` brings the loopback up). Host filesystem and pid namespace, so the socats reach the host's sockets
        and the namespace is /proc/PID/ns/net."""
        tail = ["--", "/bin/sh", "-c", BRIDGE_SCRIPT, "bridge", "/bin/sh", "-c", "echo $$; exec sleep infinity"]
        if join is not None:
            nsenter = shutil.which("nsenter")
            if not nsenter or not shutil.which("socat"):
                raise RuntimeUnavailable("oci runtime: proxy-only needs nsenter and socat on the host (`make sandbox`)")
            argv = [nsenter, f"--net={join}", *tail]
        else:
            bwrap = find_bwrap()
            if not bwrap or not shutil.which("socat"):
                raise RuntimeUnavailable("oci runtime: proxy-only needs bwrap and socat on the host (`make sandbox`)")
            argv = [
                bwrap,
                "--bind",
                "/",
                "/",
                "--dev-bind",
                "/dev",
                "/dev",
                "--unshare-net",
                "--die-with-parent",
                *tail,
            ]
            if os.geteuid() != 0:
                argv[1:1] = ["--unshare-user"]
        holder = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "POLAR_BRIDGE": bridge_env(spec.proxy, str(sockets))},
            start_new_session=True,
        )
        lifeline.tie(holder.pid)  # untied by stop_processes with the other helpers
        try:
            line = await asyncio.wait_for(holder.stdout.readline(), 15)
            return holder, int(line)
        except (TimeoutError, ValueError):
            kill_group(holder)
            err = (await holder.stderr.read()).decode(errors="replace")
            raise RuntimeUnavailable(f"oci runtime: the proxy-only network namespace did not start: {err}") from None


def owner_of(pid: int) -> tuple[int, int]:
    """The host uid and gid process ``pid`` runs as (real ids), from the kernel: the container's pid 1 runs as the
    image's user, whose name only the image's own /etc/passwd may resolve."""
    ids = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid"):
            ids[key] = int(value.split()[0])
    return ids["Uid"], ids["Gid"]


def make(**options) -> OciRuntime:
    """``--runtime oci``; options: ``engine`` (podman|docker), ``binary``, ``image`` (default image),
    ``oci_runtime`` (podman's --runtime, default runc when installed), ``scratch_dir``, ``host_uid`` (podman run by
    root only: the host uid container root maps to, the next 65535 following), ``trust_root`` (accept a docker
    daemon whose container root is host root: refused without it), ``disk_mb`` (default 4096) and ``disk_files``
    (default 200000): the disk bound of the bound host directories (:mod:`disk`; the image's own layer gets the
    per-file limit only)."""
    return OciRuntime(**options)
