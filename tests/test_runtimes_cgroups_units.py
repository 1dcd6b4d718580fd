"""Issue 29: a bwrap sandbox's cpu, memory and pids limits are files polar writes in a cgroup (v1 or v2), on a fake
cgroup tree here: the exact values written where, the controllers enabled, the sandbox's processes joining it
before they run anything, the OOM-kill count, and every process killed when the sandbox goes."""

from __future__ import annotations

import pathlib
import subprocess
import time
from pathlib import Path

import pytest

from polar_cli.rollout.runtimes import cgroups
from polar_cli.rollout.runtimes.cgroups import Cgroup

V1 = "12:pids:/user.slice\n4:memory:/Xbox/mem\n3:cpu,cpuacct:/box/cpu\n1:name=systemd:/init\n0::/\n"


@pytest.fixture
def proc_cgroup(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The text of /proc/self/cgroup and /proc/PID/cgroup, as the test sets it."""
    files: dict[str, str] = {}
    real = cgroups.Path

    def path(name: str) -> Path:
        if name in files:
            fake = real(files["dir"]) / name.strip("/").replace("/", "_")
            fake.write_text(files[name])
            return fake
        return real(name)

    monkeypatch.setattr(cgroups, "Path", path)
    return files


def test_own_paths_name_every_controller_of_each_line(tmp_path: Path, proc_cgroup: dict) -> None:
    proc_cgroup.update({"dir": str(tmp_path), "/proc/self/cgroup": V1 + "5:blkio:/a:b\n"})
    assert cgroups._own_paths() == {
        "pids": "/user.slice",
        "memory": "/Xbox/mem",
        "cpu": "/box/cpu",
        "cpuacct": "/box/cpu",
        "name=systemd": "/init",
        "": "/",
        "blkio": "/a:b",
    }


def test_own_paths_read_this_process() -> None:
    own = cgroups._own_paths()
    assert own and all(path.startswith("/") for path in own.values())


# --- memory_dir_of: where a container's OOM kills are counted ----------------------------------------------------


def test_memory_dir_of_a_v1_process_is_its_memory_controllers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proc_cgroup: dict
) -> None:
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    proc_cgroup.update({"dir": str(tmp_path), "/proc/42/cgroup": V1})
    assert cgroups.memory_dir_of(42) == tmp_path / "memory" / "Xbox" / "mem"
    # A memory controller mounted with another, and a path holding a colon.
    proc_cgroup["/proc/42/cgroup"] = "5:cpuacct,memory:/pod:1/ctr\n0::/\n"
    assert cgroups.memory_dir_of(42) == tmp_path / "memory" / "pod:1" / "ctr"


def test_memory_dir_of_a_v2_process_is_its_one_cgroup_and_none_without_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proc_cgroup: dict
) -> None:
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    proc_cgroup.update({"dir": str(tmp_path), "/proc/42/cgroup": "0::/X.slice/ctr\n"})
    assert cgroups.memory_dir_of(42) is None  # no unified hierarchy mounted there
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids")
    assert cgroups.memory_dir_of(42) == tmp_path / "X.slice" / "ctr"
    proc_cgroup["/proc/42/cgroup"] = "3:cpu:/x\n"
    assert cgroups.memory_dir_of(42) is None


def test_memory_dir_of_a_process_that_is_gone_is_unknown() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert cgroups.memory_dir_of(child.pid) is None


# --- oom_kills ----------------------------------------------------------------------------------------------------


def test_oom_kills_read_v2_events_then_v1_control(tmp_path: Path) -> None:
    assert cgroups.oom_kills(tmp_path) == 0
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cgroups.oom_kills(tmp_path) == 2
    # v2's file first; one without the count falls through to v1's.
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 5\n")
    assert cgroups.oom_kills(tmp_path) == 2
    (tmp_path / "memory.events").write_text("low 0\noom 5\noom_kill 4\noom_group_kill 1\n")
    assert cgroups.oom_kills(tmp_path) == 4
    (tmp_path / "memory.events").write_text("oom_kill x\n")
    (tmp_path / "memory.oom_control").write_text("oom_kill\n")
    assert cgroups.oom_kills(tmp_path) == 0
    (tmp_path / "memory.events").write_text("oom_kill 7 \n")
    assert cgroups.oom_kills(tmp_path) == 7


def test_a_cgroups_oom_kills_sum_its_directories(tmp_path: Path) -> None:
    for name, count in (("a", 1), ("b", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "memory.events").write_text(f"oom_kill {count}\n")
    assert Cgroup([tmp_path / "a", tmp_path / "b", tmp_path / "gone"]).oom_kills() == 4


# --- joining and killing ----------------------------------------------------------------------------------------


def test_wrap_joins_every_directory_before_the_command_runs(tmp_path: Path) -> None:
    dirs = [tmp_path / "cpu", tmp_path / "memory"]
    for d in dirs:
        d.mkdir()
        (d / "cgroup.procs").write_text("")
    argv = Cgroup(dirs).wrap(["sh", "-c", 'echo "$$ $0 $1"', "zero", "one"])
    assert argv == [
        "/bin/sh",
        "-c",
        cgroups._JOIN,
        "cgroup-join",
        str(dirs[0] / "cgroup.procs"),
        str(dirs[1] / "cgroup.procs"),
        "--",
        "sh",
        "-c",
        'echo "$$ $0 $1"',
        "zero",
        "one",
    ]
    pid, zero, one = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    assert (zero, one) == ("zero", "one")
    # The very process that runs the command (exec keeps the pid) was written to each cgroup first.
    assert [(d / "cgroup.procs").read_text() for d in dirs] == [f"{pid}\n", f"{pid}\n"]


def test_a_cgroup_that_cannot_be_joined_runs_nothing(tmp_path: Path) -> None:
    argv = Cgroup([tmp_path / "missing"]).wrap(["touch", str(tmp_path / "ran")])
    assert subprocess.run(argv, capture_output=True).returncode == 125
    assert not (tmp_path / "ran").exists()


def test_pids_are_every_directorys_members(tmp_path: Path) -> None:
    for name, pids in (("a", "1\n2\n"), ("b", "2\n3\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").write_text(pids)
    assert Cgroup([tmp_path / "a", tmp_path / "gone", tmp_path / "b"]).pids() == {1, 2, 3}


def test_kill_sigkills_the_members_until_the_cgroup_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    listed = [{c.pid for c in children} | {2**22 + 7}, {children[0].pid}, set()]  # one gone before its kill
    group = Cgroup([])
    monkeypatch.setattr(group, "pids", lambda: listed.pop(0) if listed else pytest.fail("read after it was empty"))
    began = time.monotonic()
    group.kill(timeout=5)
    assert time.monotonic() - began < 1
    assert [c.wait(timeout=5) for c in children] == [-9, -9]


def test_kill_gives_up_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    group = Cgroup([])
    reads: list[float] = []
    monkeypatch.setattr(group, "pids", lambda: reads.append(time.monotonic()) or {2**22 + 7})
    began = time.monotonic()
    group.kill(timeout=0.2)
    assert 0.2 <= time.monotonic() - began < 1.5
    assert len(reads) >= 2


def test_remove_kills_then_removes_each_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("")
    group = Cgroup([tmp_path / "busy", tmp_path / "gone", tmp_path / "a"])
    order: list[str] = []
    monkeypatch.setattr(group, "kill", lambda: order.append("kill"))
    real_rmdir = pathlib.Path.rmdir
    monkeypatch.setattr(pathlib.Path, "rmdir", lambda self: (order.append(self.name), real_rmdir(self))[1])
    group.remove()
    assert order == ["kill", "busy", "gone", "a"]
    assert not (tmp_path / "a").exists() and (tmp_path / "busy").exists()


# --- create: the limits' files ----------------------------------------------------------------------------------


def _v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"": "/Xpolar.slice", "memory": "/ignored"})
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids")
    (tmp_path / "Xpolar.slice").mkdir()
    return tmp_path / "Xpolar.slice"


def test_no_limit_asked_makes_no_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _v2(tmp_path, monkeypatch)
    assert cgroups.create("s", None, None, None) == (None, "no limits asked")
    assert cgroups.create("s", 0, 0, 0) == (None, "no limits asked")
    assert [p.name for p in (tmp_path / "Xpolar.slice").iterdir()] == []


def test_v2_enables_the_asked_controllers_and_writes_each_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = _v2(tmp_path, monkeypatch)
    group, why = cgroups.create("s1", 1.5, 64, 100)
    d = parent / "polar-s1"
    assert (group, why) == (Cgroup([d]), "")
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (d / "cpu.max").read_text() == "150000 100000"
    assert (d / "memory.max").read_text() == str(64 * 2**20)
    assert (d / "pids.max").read_text() == "100"
    # Only what is asked; an existing directory (a retried start) is reused.
    group, _ = cgroups.create("s1", None, 8, None)
    assert group == Cgroup([d])
    assert (parent / "cgroup.subtree_control").read_text() == "+memory"
    cgroups.create("s2", 0.25, None, None)
    assert (parent / "polar-s2" / "cpu.max").read_text() == "25000 100000"
    assert sorted(p.name for p in (parent / "polar-s2").iterdir()) == ["cpu.max"]


def test_v2_at_the_root_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {})
    (tmp_path / "cgroup.controllers").write_text("")
    group, _ = cgroups.create("s", None, None, 5)
    assert group == Cgroup([tmp_path / "polar-s"])
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+pids"


def test_v1_makes_one_directory_per_controller_under_polars_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"cpu": "/Xbox/cpu", "memory": "/box/mem", "": "/"})
    for controller, own in (("cpu", "Xbox/cpu"), ("memory", "box/mem"), ("pids", "")):
        (tmp_path / controller / own).mkdir(parents=True)
    group, why = cgroups.create("s1", 2, 3, 4)
    dirs = [tmp_path / "cpu" / "Xbox" / "cpu" / "polar-s1", tmp_path / "memory" / "box" / "mem" / "polar-s1"]
    dirs.append(tmp_path / "pids" / "polar-s1")
    assert (group, why) == (Cgroup(dirs), "")
    assert (dirs[0] / "cpu.cfs_period_us").read_text() == "100000"
    assert (dirs[0] / "cpu.cfs_quota_us").read_text() == "200000"
    assert (dirs[1] / "memory.limit_in_bytes").read_text() == str(3 * 2**20)
    assert (dirs[2] / "pids.max").read_text() == "4"
    assert [sorted(p.name for p in d.iterdir()) for d in dirs] == [
        ["cpu.cfs_period_us", "cpu.cfs_quota_us"],
        ["memory.limit_in_bytes"],
        ["pids.max"],
    ]
    group, _ = cgroups.create("s2", None, 3, None)
    assert group == Cgroup([tmp_path / "memory" / "box" / "mem" / "polar-s2"])
    assert not (tmp_path / "cpu" / "Xbox" / "cpu" / "polar-s2").exists()
    # A retried start finds its directories there.
    assert cgroups.create("s2", None, 5, None) == (group, "")
    assert (tmp_path / "memory" / "box" / "mem" / "polar-s2" / "memory.limit_in_bytes").read_text() == str(5 * 2**20)


def test_unwritable_cgroups_leave_nothing_and_say_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {})
    (tmp_path / "cpu").mkdir()  # no memory hierarchy: the second controller fails
    removed: list[Path] = []
    monkeypatch.setattr(pathlib.Path, "rmdir", lambda self: removed.append(self))
    group, why = cgroups.create("s", 1, 2, None)
    assert group is None
    assert why.startswith("cgroups not writable here ([Errno 2] No such file or directory: ")
    assert why.endswith(f"{tmp_path / 'memory' / 'polar-s'}')")
    assert removed == [tmp_path / "cpu" / "polar-s"]
    # v2 with a subtree_control it may not write.
    (tmp_path / "cgroup.controllers").write_text("")
    (tmp_path / "cgroup.subtree_control").mkdir()
    group, why = cgroups.create("t", 1, None, None)
    assert group is None and why.startswith("cgroups not writable here ([Errno 21] Is a directory")
    assert removed == [tmp_path / "cpu" / "polar-s"]
    assert not (tmp_path / "polar-t").exists()


def test_the_memory_limit_covers_swap_where_the_kernel_accounts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v2 ``memory.swap.max`` 0, v1 ``memory.memsw.limit_in_bytes`` = the memory limit (written after it: v1 refuses a
    memsw limit below the memory one). The kernel makes these files; where it has none there is no swap to bound."""
    parent = _v2(tmp_path, monkeypatch)
    (parent / "polar-s1").mkdir()
    (parent / "polar-s1" / "memory.swap.max").write_text("max")
    cgroups.create("s1", None, 64, None)
    assert (parent / "polar-s1" / "memory.swap.max").read_text() == "0"
    (parent / "polar-s2").mkdir()
    (parent / "polar-s2" / "memory.swap.max").write_text("max")
    cgroups.create("s2", 1, None, None)  # no memory limit asked: swap is left as it is
    assert (parent / "polar-s2" / "memory.swap.max").read_text() == "max"

    monkeypatch.setattr(cgroups, "ROOT", tmp_path / "v1")
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {})
    d = tmp_path / "v1" / "memory" / "polar-s3"
    d.mkdir(parents=True)
    (d / "memory.memsw.limit_in_bytes").write_text("9223372036854771712")
    order: list[str] = []
    real_write = pathlib.Path.write_text
    monkeypatch.setattr(
        pathlib.Path, "write_text", lambda self, text: order.append(self.name) or real_write(self, text)
    )
    assert cgroups.create("s3", None, 3, None) == (Cgroup([d]), "")
    assert (d / "memory.memsw.limit_in_bytes").read_text() == str(3 * 2**20)
    assert order == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
