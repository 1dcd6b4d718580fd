"""``polar loop --rollout-cpus / --train-cpus``: the CPU lists parse as Linux writes them, a set this process cannot
use is refused before anything starts, and real child processes land where they should: what the loop starts while
pinned inherits the rollout set, a `polar train` started with ``train_preexec`` runs on the train set, and the
loop's own affinity comes back afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from polar_cli.rollout.cpus import check_cpus, parse_cpus, pinned
from polar_cli.rollout.loop import train_preexec

AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4,6-7", {0, 1, 4, 6, 7}), (" 2 , 1 ", {1, 2}), ("3-3", {3})],
)
def test_cpu_lists_parse_as_linux_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == frozenset(cpus)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "CPU list '': '' is not a CPU number or a range such as 0-3"),
        ("a", "CPU list 'a': 'a' is not a CPU number or a range such as 0-3"),
        ("1-", "CPU list '1-': '1-' is not a CPU number or a range such as 0-3"),
        ("-1", "CPU list '-1': '-1' is not a CPU number or a range such as 0-3"),
        ("0,,1", "CPU list '0,,1': '' is not a CPU number or a range such as 0-3"),
        ("3-1", "CPU list '3-1': the range '3-1' runs backwards"),
    ],
)
def test_a_malformed_cpu_list_is_refused_with_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_cpus(text)
    assert str(err.value) == why


def test_cpus_this_process_cannot_use_are_refused() -> None:
    allowed = os.sched_getaffinity(0)
    check_cpus(None, "CPUs")
    check_cpus(frozenset(allowed), "CPUs")
    outside = max(allowed) + 1
    with pytest.raises(ValueError) as err:
        check_cpus(frozenset({min(allowed), outside}), "train CPUs")
    assert str(err.value) == f"train CPUs [{outside}] are not among this process's CPUs {sorted(allowed)}"


def _child(preexec=None) -> list[int]:  # noqa: ANN001
    done = subprocess.run([sys.executable, "-c", AFFINITY], capture_output=True, text=True, preexec_fn=preexec)
    return eval(done.stdout)  # noqa: S307 (our own child's print of a list of ints)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_children_land_on_their_sides_set_and_the_loops_affinity_comes_back() -> None:
    before = os.sched_getaffinity(0)
    first, second = sorted(before)[:2]
    with pinned(frozenset({first})):
        assert os.sched_getaffinity(0) == {first}
        assert _child() == [first]  # vLLM, mitmdump, a harness: started by the pinned loop
        assert _child(train_preexec(frozenset({second}))) == [second]  # a polar train
        assert _child(train_preexec(None)) == [first]  # no train set: it shares the loop's
    assert os.sched_getaffinity(0) == before
    with pinned(None):
        assert os.sched_getaffinity(0) == before
