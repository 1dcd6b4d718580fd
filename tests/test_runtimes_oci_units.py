"""Issue 29: the oci runtime's boundary as the engine's arguments, with the engine faked: exactly what ``podman run``
binds (read-only or writable), the uid map that keeps container root off host root, the network it joins, the
limits, what each ``exec`` passes, and the refusals (a docker daemon whose container root is host root, missing
mounts). No container is started here."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from polar_cli.rollout.runtimes import confine, oci
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable, SandboxSpec
from polar_cli.rollout.runtimes.oci import OciRuntime, OciSandbox

PODMAN = "/opt/test/podman"
PATH = "/opt/polar/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MIB = 2**20


def _runtime(monkeypatch: pytest.MonkeyPatch, root: bool = True, **options: object) -> OciRuntime:
    monkeypatch.setattr(oci.os, "geteuid", lambda: 0 if root else 1000)
    options.setdefault("binary", PODMAN)
    options.setdefault("oci_runtime", "runc")
    return OciRuntime(**options)  # type: ignore[arg-type]


def _spec(tmp_path: Path, **fields: object) -> SandboxSpec:
    ca = tmp_path / "confdir" / "mitmproxy-ca-cert.pem"
    ca.parent.mkdir(exist_ok=True)
    ca.write_text("cert")
    base: dict = dict(
        name="sess-1",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        proxy=ProxyEndpoints(forward_port=8080, reverse_port=8081, ca=ca),
        image="img:1",
        network="host",
        pids=None,
    )
    return SandboxSpec(**{**base, **fields})


class Engine:
    """A fake engine CLI: what each call asked, and its answers by subcommand."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], Path | None]] = []
        self.answers: dict[str, tuple[int, str]] = {}

    async def __call__(self, *args: str, cwd: Path | None = None) -> tuple[int, str]:
        self.calls.append((args, cwd))
        key = " ".join(args[:2]) if " ".join(args[:2]) in self.answers else args[0]
        return self.answers.get(key, (0, ""))

    def called(self, first: str) -> list[tuple[str, ...]]:
        return [args for args, _ in self.calls if args[0] == first]


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Engine:
    fake = Engine()
    monkeypatch.setattr(OciRuntime, "_run", lambda self, *args, cwd=None: fake(*args, cwd=cwd))
    return fake


# --- the runtime's options --------------------------------------------------------------------------------------


def test_root_podman_maps_container_root_to_an_unprivileged_range(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _runtime(monkeypatch)
    assert runtime.host_uid == confine.DEFAULT_HOST_UID
    assert runtime._userns_flags() == [
        "--uidmap",
        f"0:{confine.DEFAULT_HOST_UID}:65536",
        "--gidmap",
        f"0:{confine.DEFAULT_HOST_UID}:65536",
    ]
    assert _runtime(monkeypatch, host_uid=0).host_uid == 0
    # Rootless podman maps to the invoking user itself; docker maps nothing per container.
    assert _runtime(monkeypatch, root=False).host_uid is None
    assert _runtime(monkeypatch, root=False)._userns_flags() == []
    assert _runtime(monkeypatch, engine="docker").host_uid is None
    for root, engine in ((False, "podman"), (True, "docker")):
        with pytest.raises(ValueError) as refused:
            _runtime(monkeypatch, root=root, engine=engine, host_uid=5)
        assert str(refused.value) == (
            "oci runtime: host_uid needs podman run by root (docker maps no uids per container; "
            "rootless podman maps the container to the invoking user)"
        )


def test_engine_options_and_their_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="^oci runtime: engine must be podman or docker, not 'lxc'$"):
        _runtime(monkeypatch, engine="lxc")
    monkeypatch.setattr(oci.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeUnavailable, match=r"^oci runtime: no docker binary \(`make sandbox` installs podman"):
        _runtime(monkeypatch, engine="docker", binary=None)
    monkeypatch.setattr(oci.shutil, "which", lambda name: f"/usr/bin/{name}")
    podman = _runtime(monkeypatch, binary=None, oci_runtime=None, disk_mb="5", disk_files="6", image="base:1")
    assert (podman.engine, podman.binary, podman.oci_runtime) == ("podman", "/usr/bin/podman", "runc")
    assert (podman.disk_mb, podman.disk_files, podman.image, podman.default_network) == (5, 6, "base:1", "proxy-only")
    assert (podman.scratch_dir, podman.built, podman.build_locks, podman.engine_checked) == (None, {}, {}, False)
    docker = _runtime(monkeypatch, engine="docker", oci_runtime=None, scratch_dir="/s")
    assert (docker.oci_runtime, docker.default_network, docker.scratch_dir) == ("", "host", Path("/s"))
    assert (docker.disk_mb, docker.disk_files, docker.image, docker.trust_root) == (4096, 200_000, None, False)
    monkeypatch.setattr(oci.shutil, "which", lambda name: None if name == "runc" else f"/usr/bin/{name}")
    assert _runtime(monkeypatch, binary=None, oci_runtime=None).oci_runtime == ""
    assert oci.make(binary=PODMAN, engine="podman").binary == PODMAN


@pytest.mark.parametrize(
    ("given", "trusted"),
    [(True, True), ("true", True), ("TRUE", True), ("1", True), ("yes", True), (False, False), ("no", False),
     ("0", False), ("", False), ("false", False)],
)  # fmt: skip
def test_trust_root_is_only_a_clear_yes(monkeypatch: pytest.MonkeyPatch, given: object, trusted: bool) -> None:
    assert _runtime(monkeypatch, engine="docker", trust_root=given).trust_root is trusted


def test_engine_flags_raise_the_limits_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", "--ulimit", f"fsize={3 * MIB}"]
    assert _runtime(monkeypatch, disk_mb=3)._engine_flags() == ["--runtime", "runc", *flags]
    assert _runtime(monkeypatch, disk_mb=3, oci_runtime="")._engine_flags() == flags


# --- docker as host root ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("said", "trust", "refused"),
    [
        ('["name=seccomp,profile=builtin"]', False, True),
        ('["name=seccomp,profile=builtin","name=rootless"]', False, False),
        ('["name=apparmor","name=userns"]', False, False),
        ('["name=userns,remap=default"]', False, False),
        ('["name=seccomp,name=rootless"]', False, False),
        ("null", False, True),
        ("", False, True),
        ('["name=seccomp"]', True, False),
    ],
)
def test_a_docker_daemon_running_containers_as_host_root_is_refused_unless_trusted(
    monkeypatch: pytest.MonkeyPatch, engine: Engine, said: str, trust: bool, refused: bool
) -> None:
    runtime = _runtime(monkeypatch, engine="docker", trust_root=trust)
    engine.answers["info"] = (0, f"WARNING: no swap limit support\n{said}\n" if said else "")
    if refused:
        with pytest.raises(RuntimeUnavailable, match=r"^oci runtime: this docker daemon runs containers as host root"):
            asyncio.run(runtime.check_engine())
        assert not runtime.engine_checked
    else:
        asyncio.run(runtime.check_engine())
        asyncio.run(runtime.check_engine())
        assert runtime.engine_checked
    assert engine.called("info")[0] == ("info", "--format", "{{json .SecurityOptions}}")
    assert len(engine.called("info")) == 1


def test_the_refusal_names_the_daemons_options(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    engine.answers["info"] = (0, '["name=seccomp,profile=builtin"]')
    with pytest.raises(RuntimeUnavailable) as refused:
        asyncio.run(_runtime(monkeypatch, engine="docker").check_engine())
    assert str(refused.value) == (
        "oci runtime: this docker daemon runs containers as host root (neither rootless nor userns-remap: its "
        "security options are ['name=seccomp,profile=builtin']): container root would own every bound directory "
        "and read any root-only file bound in. Use podman (engine=podman), rootless docker or userns-remap, or "
        "accept it with the runtime option trust_root=true"
    )


def test_docker_info_failing_or_saying_nonsense_is_the_runtimes_failure(
    monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    runtime = _runtime(monkeypatch, engine="docker", trust_root=True)
    engine.answers["info"] = (1, "x" * 3000 + "Cannot connect to the Docker daemon")
    with pytest.raises(RuntimeUnavailable) as failed:
        asyncio.run(runtime.check_engine())
    assert str(failed.value) == (
        "oci runtime: `docker info` failed (is the daemon running?): "
        + "x" * 1965
        + "Cannot connect to the Docker daemon"
    )
    engine.answers["info"] = (0, "y" * 600 + "{not json")
    with pytest.raises(RuntimeUnavailable) as failed:
        asyncio.run(runtime.check_engine())
    assert (
        str(failed.value) == f"oci runtime: `docker info` said {('y' * 491 + '{not json')!r}, not its security options"
    )


def test_podman_needs_no_daemon_check(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    asyncio.run(_runtime(monkeypatch).check_engine())
    assert engine.calls == []


# --- images -----------------------------------------------------------------------------------------------------


def test_from_images_names_every_stages_base() -> None:
    dockerfile = "\n".join(
        [
            "# FROM commented",
            "FROM --platform=linux/amd64 python:3.11-slim AS build",
            "RUN echo FROM nothing",
            "  from   alpine:3",
            "FROM",
            "FROM --platform=linux/arm64",
            "FROM build",
        ]
    )
    assert oci.from_images(dockerfile) == ["python:3.11-slim", "alpine:3", "build"]


def test_a_spec_without_a_dockerfile_takes_its_image_or_the_runtimes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    runtime = _runtime(monkeypatch, image="default:1")
    assert asyncio.run(runtime.image_for(_spec(tmp_path))) == "img:1"
    assert asyncio.run(runtime.image_for(_spec(tmp_path, image=None))) == "default:1"
    with pytest.raises(RuntimeUnavailable, match="^oci runtime: task sess-1 names no image nor Dockerfile$"):
        asyncio.run(_runtime(monkeypatch).image_for(_spec(tmp_path, image=None)))
    assert engine.calls == []


def _context(tmp_path: Path, text: str = "FROM base:1\nRUN true\n") -> Path:
    context = tmp_path / "ctx"
    (context / "sub").mkdir(parents=True, exist_ok=True)
    (context / "Dockerfile").write_text(text)
    (context / "sub" / "file").write_text("a")
    return context / "Dockerfile"


def _expected_tag(dockerfile: Path, bases: dict[str, str]) -> str:
    """The build cache's key: every file of the context by relative path and content, then each base image's id."""
    digest = hashlib.sha256()
    for path in sorted(p for p in dockerfile.parent.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(dockerfile.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    for base, image_id in bases.items():
        digest.update(base.encode() + b"\0" + image_id.encode() + b"\0")
    return f"localhost/polar-task:{digest.hexdigest()[:16]}"


def test_a_dockerfile_is_built_once_per_context_and_base_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    runtime = _runtime(monkeypatch, disk_mb=2)
    dockerfile = _context(tmp_path)
    engine.answers["image inspect"] = (1, "no such image")
    engine.answers["image"] = (1, "")
    tag = asyncio.run(runtime.image_for(_spec(tmp_path, dockerfile=dockerfile)))
    assert tag == _expected_tag(dockerfile, {"base:1": ""})
    assert [args for args, _ in engine.calls] == [
        ("image", "inspect", "--format", "{{.Id}}", "base:1"),
        ("image", "inspect", tag),
        ("build", "-t", tag, "-f", str(dockerfile), *runtime._engine_flags(), str(dockerfile.parent)),
    ]
    assert runtime.built == {tag: tag}
    engine.calls.clear()
    assert asyncio.run(runtime.image_for(_spec(tmp_path, dockerfile=dockerfile))) == tag
    assert [args[0] for args, _ in engine.calls] == ["image"]  # only the base's id: no inspect of the tag, no build
    # A new base image under the same name: a new tag, not the old build.
    engine.answers["image inspect"] = (0, "sha256:new\n")
    new = asyncio.run(runtime.image_for(_spec(tmp_path, dockerfile=dockerfile)))
    assert new == _expected_tag(dockerfile, {"base:1": "sha256:new"}) != tag


def test_an_image_already_there_is_not_rebuilt_and_docker_builds_without_podman_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    dockerfile = _context(tmp_path, "FROM a\nFROM b\n")
    tag = asyncio.run(_runtime(monkeypatch).image_for(_spec(tmp_path, dockerfile=dockerfile)))
    assert tag == _expected_tag(dockerfile, {"a": "", "b": ""})
    assert engine.called("build") == []
    engine.answers["image"] = (1, "")
    docker = _runtime(monkeypatch, engine="docker")
    asyncio.run(docker.image_for(_spec(tmp_path, dockerfile=dockerfile)))
    assert engine.called("build") == [("build", "-t", tag, "-f", str(dockerfile), str(dockerfile.parent))]


def test_a_dockerfile_that_is_no_utf8_still_names_its_bases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    dockerfile = _context(tmp_path)
    dockerfile.write_bytes(b"# caf\xe9\nFROM base:2\n")
    asyncio.run(_runtime(monkeypatch).image_for(_spec(tmp_path, dockerfile=dockerfile)))
    assert engine.calls[0][0] == ("image", "inspect", "--format", "{{.Id}}", "base:2")


def test_distinct_images_build_side_by_side_and_one_image_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds of different contexts do not wait for each other; concurrent sessions of one context share its
    build."""
    runtime = _runtime(monkeypatch)
    first, second = _context(tmp_path / "a", "FROM a\n"), _context(tmp_path / "b", "FROM b\n")
    builds: list[str] = []

    async def scenario() -> list[str]:
        both_building = asyncio.Event()

        async def run(*args: str, cwd: Path | None = None) -> tuple[int, str]:
            if args[:2] == ("image", "inspect") and args[2] != "--format":
                return 1, ""
            if args[0] == "build":
                builds.append(args[-1])
                if len(builds) == 2:
                    both_building.set()
                await asyncio.wait_for(both_building.wait(), 2)  # each build waits until the other has begun
            return 0, ""

        monkeypatch.setattr(runtime, "_run", run)
        return await asyncio.gather(
            runtime.image_for(_spec(tmp_path, dockerfile=first)),
            runtime.image_for(_spec(tmp_path, dockerfile=second)),
            runtime.image_for(_spec(tmp_path, dockerfile=first)),
        )

    tags = asyncio.run(scenario())
    assert tags[0] == tags[2] != tags[1]
    assert sorted(builds) == sorted([str(first.parent), str(second.parent)])


def test_a_failed_build_says_how_to_work_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    dockerfile = _context(tmp_path)
    engine.answers["image"] = (1, "")
    engine.answers["build"] = (125, "z" * 5000 + "pull access denied")
    with pytest.raises(RuntimeUnavailable) as failed:
        asyncio.run(_runtime(monkeypatch).image_for(_spec(tmp_path, dockerfile=dockerfile)))
    assert str(failed.value) == (
        f"oci runtime: building {dockerfile} failed (offline? load its base image under its full name, e.g. "
        "docker.io/library/python:3.11-slim):\n" + "z" * 3982 + "pull access denied"
    )


# --- podman run: the container's boundary -----------------------------------------------------------------------


@pytest.fixture
def starting(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> dict:
    """start() with the engine, the bridge, the namespace holder and the kernel's answers faked."""
    asked: dict = {"bridges": [], "holders": [], "deaths": [], "execs": [], "owner": (2_000_000_000, 2_000_000_000)}
    monkeypatch.setattr(oci.uuid, "uuid4", lambda: SimpleNamespace(hex="0123456789abcdef"))
    monkeypatch.setattr(oci.lifeline, "on_death", lambda argv: asked["deaths"].append(argv) or "death-key")
    monkeypatch.setattr(oci.lifeline, "cancel", lambda key: None)
    monkeypatch.setattr(oci.cgroups, "memory_dir_of", lambda pid: Path(f"/cg/{pid}"))
    asked["owners"] = []
    monkeypatch.setattr(oci, "owner_of", lambda pid: asked["owners"].append(pid) or asked["owner"])
    engine.answers["inspect"] = (0, "4321\n")

    async def bridges(proxy: ProxyEndpoints, sockets: Path) -> list:
        asked["bridges"].append((proxy, sockets))
        return ["socat"]

    async def holder(self: OciRuntime, spec: SandboxSpec, sockets: Path, join: str | None = None) -> tuple:
        asked["holders"].append((sockets, join))
        assert spec is asked["spec"]
        return "holder", 999

    async def cli(self: OciSandbox, *args: str, **kwargs: object) -> tuple:
        asked["execs"].append((args, kwargs))
        if "--env-file" in args:  # read while the exec runs: it is gone after
            env_path = Path(args[args.index("--env-file") + 1])
            asked.setdefault("env_files", []).append((env_path, env_path.stat().st_mode & 0o777, env_path.read_text()))
        return asked.get("exec", (0, b"", b"", False, False, None))

    async def stop(self: OciSandbox) -> None:
        asked["stopped"] = True

    monkeypatch.setattr(oci, "start_host_bridges", bridges)
    monkeypatch.setattr(OciRuntime, "_network_holder", holder)
    monkeypatch.setattr(OciSandbox, "_cli", cli)
    monkeypatch.setattr(OciSandbox, "stop", stop)
    return asked


def _run_args(engine: Engine) -> list[str]:
    (args,) = engine.called("run")
    return list(args)


def test_a_root_podman_container_is_exactly_its_mounts_uid_map_and_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine, starting: dict
) -> None:
    runtime = _runtime(monkeypatch, host_uid=300000, disk_mb=8, scratch_dir=tmp_path)
    real = tmp_path / "node-real"
    real.mkdir()
    (tmp_path / "node").symlink_to(real)
    spec = _spec(
        tmp_path,
        name="a b/c" + "d" * 40,
        read_only=[tmp_path / "node"],
        binds={"/logs/verifier/": tmp_path / "new" / "logs"},
        read_only_binds={"/tests/": tmp_path / "tests"},
        cpus=1.5,
        memory_mb=64,
        pids=100,
    )
    spec.workspace.mkdir()
    (spec.workspace / "repo.py").write_text("")
    sandbox = asyncio.run(runtime.start(spec))
    container = "polar-a_b_c" + "d" * 35 + "-01234567"  # the name cut at 40 characters
    assert sandbox.container == container
    assert _run_args(engine) == [
        "run", "-d", "--name", container,
        "--runtime", "runc",
        "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", "--ulimit", f"fsize={8 * MIB}",
        "--uidmap", "0:300000:65536", "--gidmap", "0:300000:65536",
        "--network", "host", "--hostname", "polar", "-w", "/workspace",
        "--security-opt", "no-new-privileges",
        "-e", "HOME=/home/polar", "-e", f"PATH={PATH}",
        "-v", f"{spec.home}:/home/polar",
        # Only the CA's certificate: its confdir holds the private key.
        "-v", f"{spec.proxy.ca}:/run/polar/mitmproxy-ca-cert.pem:ro",
        "-v", f"{oci.TOOLS_HOST}:/opt/polar/bin:ro",
        "-v", f"{spec.workspace}:/workspace",
        "-v", f"{real}:{tmp_path / 'node'}:ro",
        "-v", f"{tmp_path / 'new' / 'logs'}:/logs/verifier",
        # The verifier's tests: read-only, the code under test cannot rewrite them.
        "-v", f"{tmp_path / 'tests'}:/tests:ro",
        "--cpus", "1.5", "--memory", "64m", "--memory-swap", "64m", "--pids-limit", "100",
        "--entrypoint", "/bin/sh", "img:1", "-c", oci.INIT,
    ]  # fmt: skip
    ((_, cwd),) = [(args, cwd) for args, cwd in engine.calls if args[0] == "run"]
    assert cwd == sandbox.scratch and sandbox.scratch.parent == tmp_path
    assert sandbox.scratch.name.startswith("polar-oci-a_b_c" + "d" * 35 + "-")
    assert sandbox.runtime is runtime and sandbox.spec is spec
    assert engine.called("inspect") == [("inspect", "--format", "{{.State.Pid}}", container)]
    assert starting["deaths"] == [[PODMAN, "rm", "-f", "-t", "0", container]]
    assert sandbox.lifeline_key == "death-key"
    assert sandbox.memory_cgroup == Path("/cg/4321") and sandbox.owner == (2_000_000_000, 2_000_000_000)
    assert sandbox.host_workspace == spec.workspace
    assert (tmp_path / "new" / "logs").is_dir() and spec.home.is_dir()
    assert starting["owners"] == [4321]
    assert starting["bridges"] == starting["holders"] == starting["execs"] == []


def test_an_empty_workspace_keeps_the_images_directory_unbound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine, starting: dict
) -> None:
    runtime = _runtime(monkeypatch, root=False, scratch_dir=tmp_path, oci_runtime="")
    spec = _spec(tmp_path, workdir="/app", network="none")
    sandbox = asyncio.run(runtime.start(spec))
    args = _run_args(engine)
    assert args[args.index("--network") + 1] == "none"
    assert args[args.index("-w") + 1] == "/"
    assert not any(a.endswith(":/app") for a in args) and "--uidmap" not in args
    assert not {"--cpus", "--memory", "--memory-swap", "--pids-limit", "--runtime"} & set(args)
    assert sandbox.host_workspace is None and sandbox.owner is None and sandbox.workspace == "/app"
    # The image's own directory is made inside (a WORKDIR does not always exist).
    ((cli_args, kwargs),) = starting["execs"]
    assert cli_args[-4:] == (sandbox.container, "mkdir", "-p", "/app")
    assert cli_args[:3] == ("exec", "-w", "/")
    starting["exec"] = (1, b"", b"read-only file system", False, False, None)
    with pytest.raises(RuntimeUnavailable, match="^oci runtime: no /app in img:1: read-only file system$"):
        asyncio.run(runtime.start(spec))
    assert starting["stopped"]


def test_proxy_only_rootless_joins_a_prepared_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine, starting: dict
) -> None:
    runtime = _runtime(monkeypatch, root=False, scratch_dir=tmp_path)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f").write_text("")
    starting["spec"] = _spec(tmp_path, network="proxy-only")
    sandbox = asyncio.run(runtime.start(starting["spec"]))
    args = _run_args(engine)
    assert args[args.index("--network") + 1] == "ns:/proc/999/ns/net"
    assert starting["bridges"] == [(sandbox.spec.proxy, sandbox.scratch / "sockets")]
    assert starting["holders"] == [(sandbox.scratch / "sockets", None)]
    assert sandbox.helpers == ["socat", "holder"]


def test_proxy_only_with_mapped_uids_bridges_into_the_containers_own_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine, starting: dict
) -> None:
    runtime = _runtime(monkeypatch, scratch_dir=tmp_path)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f").write_text("")
    starting["spec"] = _spec(tmp_path, network="proxy-only")
    sandbox = asyncio.run(runtime.start(starting["spec"]))
    args = _run_args(engine)
    assert args[args.index("--network") + 1] == "none"
    assert starting["holders"] == [(sandbox.scratch / "sockets", "/proc/4321/ns/net")]
    assert sandbox.helpers == ["socat", "holder"]


def test_start_refuses_what_it_cannot_enforce_or_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine, starting: dict
) -> None:
    runtime = _runtime(monkeypatch, scratch_dir=tmp_path)
    with pytest.raises(ValueError, match="^oci runtime: unknown network mode 'bridge'$"):
        asyncio.run(runtime.start(_spec(tmp_path, network="bridge")))
    docker = _runtime(monkeypatch, engine="docker", trust_root=True, scratch_dir=tmp_path)
    engine.answers["info"] = (0, "[]")
    with pytest.raises(RuntimeUnavailable) as refused:
        asyncio.run(docker.start(_spec(tmp_path, network="proxy-only")))
    assert str(refused.value) == (
        "oci runtime: proxy-only needs podman (docker cannot join a prepared network namespace); use engine=podman "
        "or network=host"
    )
    spec = _spec(tmp_path)
    spec.proxy.ca.unlink()
    with pytest.raises(RuntimeUnavailable, match=f"^oci runtime: the proxy's CA certificate {spec.proxy.ca} does not"):
        asyncio.run(runtime.start(spec))
    (tmp_path / "there").mkdir()
    with pytest.raises(
        RuntimeUnavailable,
        match=f"^oci runtime: read-only paths to mount do not exist: {tmp_path}/gone, {tmp_path}/gone2$",
    ):
        asyncio.run(
            runtime.start(_spec(tmp_path, read_only=[tmp_path / "gone", tmp_path / "there", tmp_path / "gone2"]))
        )
    with pytest.raises(RuntimeUnavailable, match="CA certificate"):
        asyncio.run(runtime.start(_spec(tmp_path, proxy=ProxyEndpoints(1, 2, tmp_path))))
    assert engine.called("run") == [] and starting["deaths"] == []


def test_a_container_that_does_not_start_is_stopped_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine, starting: dict
) -> None:
    docker = _runtime(monkeypatch, engine="docker", trust_root=True, scratch_dir=tmp_path)
    engine.answers["info"] = (0, "[]")
    engine.answers["run"] = (125, "q" * 5000 + "no such image")
    with pytest.raises(RuntimeUnavailable) as failed:
        asyncio.run(docker.start(_spec(tmp_path)))
    assert str(failed.value) == "oci runtime: starting a container of img:1 failed:\n" + "q" * 3987 + "no such image"
    assert starting["stopped"]
    # docker rm has no -t; docker maps no uids.
    assert starting["deaths"][0][:3] == [PODMAN, "rm", "-f"] and len(starting["deaths"][0]) == 4
    assert "--uidmap" not in _run_args(engine)


def test_the_container_pid_comes_from_inspect_or_the_start_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    runtime = _runtime(monkeypatch)
    engine.answers["inspect"] = (0, "812\n")
    assert asyncio.run(runtime._pid("c1")) == 812
    engine.answers["inspect"] = (1, "e" * 4500 + "gone")
    with pytest.raises(RuntimeUnavailable) as failed:
        asyncio.run(runtime._pid("c1"))
    assert str(failed.value) == "oci runtime: inspecting container c1 failed: " + "e" * 3996 + "gone"
    for answer in ((1, "12"), (0, "no pid"), (0, "")):
        engine.answers["inspect"] = answer
        with pytest.raises(RuntimeUnavailable, match=f"^oci runtime: inspecting container c1 failed: {answer[1]}$"):
            asyncio.run(runtime._pid("c1"))


# --- exec, upload, download: what the engine is asked ------------------------------------------------------------


def _sandbox(runtime: OciRuntime, spec: SandboxSpec, tmp_path: Path) -> OciSandbox:
    (tmp_path / "scratch").mkdir(exist_ok=True)  # start's mkdtemp
    return OciSandbox(runtime, spec, "ctr", tmp_path / "scratch", [])


def test_exec_passes_cwd_env_and_stdin_and_reports_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, starting: dict
) -> None:
    spec = _spec(tmp_path, env={"HOME": "/override", "A": "spec"})
    sandbox = _sandbox(_runtime(monkeypatch), spec, tmp_path)
    assert (sandbox.workspace, sandbox.home, sandbox.ca_path) == ("/workspace", "/home/polar", oci.CA_INSIDE)
    assert (sandbox.host_workspace, sandbox.owner, sandbox.memory_cgroup, sandbox.lifeline_key) == (None,) * 4
    starting["exec"] = (7, b"out\xff", b"err\xff", False, False, None)
    result = asyncio.run(sandbox.exec("echo hi", env={"A": "exec"}, stdin=b"in", timeout_s=3))
    ((args, kwargs),) = starting["execs"]
    env_path = tmp_path / "scratch" / "env-0123456789abcdef"
    assert list(args) == [
        "exec", "-w", "/workspace", "-i", "--env-file", str(env_path), "ctr", "/bin/sh", "-c", "echo hi",
    ]  # fmt: skip
    # The environment in a file only the runner reads (never on the engine client's command line), gone after.
    assert starting["env_files"] == [(env_path, 0o600, "HOME=/override\nTMPDIR=/tmp\nA=exec\n")]
    assert not env_path.exists()
    assert kwargs == {"stdin": b"in", "timeout_s": 3, "bounded": True, "since": 0}
    assert (result.exit_code, result.stdout, result.stderr, result.oom_killed, result.limit) == (
        7,
        "out\ufffd",
        "err\ufffd",
        False,
        None,
    )
    starting["execs"].clear()
    starting["exec"] = (137, b"", b"polar: disk", True, False, "polar: disk")
    result = asyncio.run(sandbox.exec(["ls", "-l"], cwd="/"))
    assert list(starting["execs"][0][0][:3]) == ["exec", "-w", "/"] and "-i" not in starting["execs"][0][0]
    assert list(starting["execs"][0][0][-3:]) == ["ctr", "ls", "-l"]
    assert (result.exit_code, result.timed_out, result.cancelled, result.limit) == (-1, True, False, "disk")
    starting["exec"] = (0, b"", b"", False, True, None)
    result = asyncio.run(sandbox.exec("x"))
    assert (result.exit_code, result.cancelled, result.timed_out) == (-1, True, False)
    sandbox.stopped = True
    with pytest.raises(RuntimeError, match="^sandbox sess-1 is stopped$"):
        asyncio.run(sandbox.exec("x"))


def test_an_exec_value_the_env_file_cannot_hold_is_passed_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, starting: dict
) -> None:
    sandbox = _sandbox(_runtime(monkeypatch), _spec(tmp_path), tmp_path)
    asyncio.run(sandbox.exec("true", env={"M": "a\nB=1", "OK": "1"}))
    ((args, _),) = starting["execs"]
    env_path = tmp_path / "scratch" / "env-0123456789abcdef"
    assert list(args) == [
        "exec", "-w", "/workspace", "--env-file", str(env_path), "-e", "M=a\nB=1", "ctr", "/bin/sh", "-c", "true",
    ]  # fmt: skip
    assert starting["env_files"][0][2] == "HOME=/home/polar\nTMPDIR=/tmp\nOK=1\n"


def test_an_exec_during_which_the_memory_limit_killed_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, starting: dict
) -> None:
    sandbox = _sandbox(_runtime(monkeypatch), _spec(tmp_path, memory_mb=64), tmp_path)
    counts = iter([2, 3, 3, 3])

    async def oom_kills() -> int:
        return next(counts)

    monkeypatch.setattr(sandbox, "oom_kills", oom_kills)
    assert asyncio.run(sandbox.exec("x")).oom_killed is True
    assert asyncio.run(sandbox.exec("x")).oom_killed is False
    # No memory limit: never asked, never OOM-killed by it.
    plain = _sandbox(_runtime(monkeypatch), _spec(tmp_path), tmp_path)
    monkeypatch.setattr(plain, "oom_kills", lambda: pytest.fail("asked without a memory limit"))
    assert asyncio.run(plain.exec("x")).oom_killed is False


def test_oom_kills_read_the_cgroup_else_ask_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    sandbox = _sandbox(_runtime(monkeypatch), _spec(tmp_path), tmp_path)
    for said, count in (((0, "true\n"), 1), ((0, "false\n"), 0), ((1, "true"), 0)):
        engine.answers["inspect"] = said
        assert asyncio.run(sandbox.oom_kills()) == count
    assert engine.called("inspect")[0] == ("inspect", "--format", "{{.State.OOMKilled}}", "ctr")
    (tmp_path / "memory.events").write_text("low 0\noom 4\noom_kill 3\n")
    sandbox.memory_cgroup = tmp_path
    engine.calls.clear()
    assert asyncio.run(sandbox.oom_kills()) == 3 and engine.calls == []


def test_the_writable_directories_are_handed_to_the_container_users_uid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, starting: dict
) -> None:
    spec = _spec(tmp_path, binds={"/logs": tmp_path / "logs"}, read_only_binds={"/tests": tmp_path / "tests"})
    sandbox = _sandbox(_runtime(monkeypatch), spec, tmp_path)
    assert sandbox.writable() == [spec.home, tmp_path / "logs"]
    sandbox.host_workspace = spec.workspace
    assert sandbox.writable() == [spec.workspace, spec.home, tmp_path / "logs"]
    handed: list = []

    async def hand_over_all(roots: list[Path], uid: int, gid: int) -> None:
        handed.append((list(roots), uid, gid))

    monkeypatch.setattr(confine, "hand_over_all", hand_over_all)
    asyncio.run(sandbox.exec("x"))
    assert handed == []  # no uid map: the engine's own user owns them
    sandbox.owner = (5, 6)
    asyncio.run(sandbox.exec("x"))
    assert handed == [([spec.workspace, spec.home, tmp_path / "logs"], 5, 6)]


def test_upload_makes_the_parent_then_copies_a_tar_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, starting: dict
) -> None:
    sandbox = _sandbox(_runtime(monkeypatch), _spec(tmp_path), tmp_path)
    (tmp_path / "patch").write_text("diff")
    asyncio.run(sandbox.upload(tmp_path / "patch", "/workspace/a/../p.diff"))
    (mkdir, _), (cp, kwargs) = starting["execs"]
    assert list(mkdir[:3]) == ["exec", "-w", "/"] and list(mkdir[-4:]) == ["ctr", "mkdir", "-p", "/workspace"]
    assert cp == ("cp", "-", "ctr:/workspace")
    with tarfile.open(fileobj=io.BytesIO(kwargs["stdin"])) as tar:
        assert tar.getnames() == ["p.diff"]
    starting["execs"].clear()
    asyncio.run(sandbox.upload(tmp_path / "patch", "top"))
    assert starting["execs"][1][0] == ("cp", "-", "ctr:/")
    starting["exec"] = (1, b"", b"denied", False, False, None)
    with pytest.raises(OSError, match="^upload to /workspace/p in sandbox sess-1 failed: denied$"):
        asyncio.run(sandbox.upload(tmp_path / "patch", "/workspace/p"))


def test_upload_says_when_the_copy_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = _sandbox(_runtime(monkeypatch), _spec(tmp_path), tmp_path)
    answers = iter([(0, b"", b"", False, False, None), (125, b"", b"cp: no space\xff", False, False, None)])

    async def cli(*args: str, **kwargs: object) -> tuple:
        return next(answers)

    monkeypatch.setattr(sandbox, "_cli", cli)
    monkeypatch.setattr(sandbox, "hand_over", lambda: asyncio.sleep(0))
    (tmp_path / "patch").write_text("diff")
    with pytest.raises(OSError, match="^upload to /w/p in sandbox sess-1 failed: cp: no space\ufffd$"):
        asyncio.run(sandbox.upload(tmp_path / "patch", "/w/p"))


def test_download_copies_out_and_tells_a_missing_path_from_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, starting: dict
) -> None:
    sandbox = _sandbox(_runtime(monkeypatch), _spec(tmp_path), tmp_path)
    (tmp_path / "src").write_text("result")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(tmp_path / "src", arcname="out.txt")
    starting["exec"] = (0, buffer.getvalue(), b"", False, False, None)
    asyncio.run(sandbox.download("/workspace/x/../out.txt", tmp_path / "got"))
    assert starting["execs"][0][0] == ("cp", "ctr:/workspace/out.txt", "-")
    assert (tmp_path / "got").read_text() == "result"
    for message in ("Error: No such file or directory", "stat /w/out.txt: NOT FOUND"):
        starting["exec"] = (125, b"", message.encode(), False, False, None)
        with pytest.raises(FileNotFoundError, match="^/w/out.txt does not exist in sandbox sess-1$"):
            asyncio.run(sandbox.download("/w/out.txt", tmp_path / "x"))
    starting["exec"] = (125, b"", b"permission denied\xff", False, False, None)
    with pytest.raises(OSError, match="^download of /w/out.txt from sandbox sess-1 failed: permission denied\ufffd$"):
        asyncio.run(sandbox.download("/w/out.txt", tmp_path / "x"))


# --- the container user's host ids ------------------------------------------------------------------------------


def test_owner_of_reads_the_real_ids_from_the_kernel() -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a process's ids needs root")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; os.setresgid(5678, 8765, 8765); os.setresuid(1234, 4321, 4321); "
            "print(1, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"1\n"
        assert oci.owner_of(child.pid) == (1234, 5678)
    finally:
        child.kill()
        child.wait()


def test_the_env_file_holds_each_variable_literally_and_what_it_cannot_hold_goes_inline() -> None:
    text, inline = oci.env_file({"A": "x y  ", "B": '"q" #c', "C": "a=b", "D": "", "_E9": " lead"})
    assert (text, inline) == ('A=x y  \nB="q" #c\nC=a=b\nD=\n_E9= lead\n', [])
    # A line break in a value would start a variable of the value's choosing in the file (LD_PRELOAD=...).
    text, inline = oci.env_file({"OK": "1", "M": "a\nLD_PRELOAD=/workspace/x.so", "R": "a\r", "#N": "v", "S P": "v"})
    assert text == "OK=1\n"
    assert inline == ["-e", "M=a\nLD_PRELOAD=/workspace/x.so", "-e", "R=a\r", "-e", "#N=v", "-e", "S P=v"]
    assert oci.env_file({"9A": "v"}) == ("", ["-e", "9A=v"])
    assert oci.env_file({}) == ("", [])
