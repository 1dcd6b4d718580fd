"""polar_cli.rollout.cpus beyond tests/test_loop_cpus.py: the CPUs a set is checked against are this process's own
(a loop already pinned cannot hand out CPUs it left), ``pin_self`` moves only the child it runs in, and the loop's
affinity comes back even when what ran pinned failed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from polar_cli.rollout.cpus import check_cpus, pin_self, pinned

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")

AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


@pytest.fixture
def cpus() -> Iterator[tuple[int, int]]:
    """Two CPUs of this process; its affinity and init's are put back whatever a test did."""
    mine, inits = os.sched_getaffinity(0), os.sched_getaffinity(1)
    first, second = sorted(mine)[:2]
    try:
        yield first, second
    finally:
        os.sched_setaffinity(0, mine)
        if os.sched_getaffinity(1) != inits:  # only a broken pin_self or pinned moves another process
            os.sched_setaffinity(1, inits)
            pytest.fail("init's affinity was changed")


def test_cpus_are_checked_against_this_process_not_another(cpus: tuple[int, int]) -> None:
    first, second = cpus
    with pinned(frozenset({first})):
        check_cpus(frozenset({first}), "rollout CPUs")
        with pytest.raises(ValueError) as err:
            check_cpus(frozenset({first, second}), "train CPUs")
        assert str(err.value) == f"train CPUs [{second}] are not among this process's CPUs [{first}]"


def _child(preexec=None) -> list[int]:  # noqa: ANN001
    done = subprocess.run([sys.executable, "-c", AFFINITY], capture_output=True, text=True, preexec_fn=preexec)
    return [int(cpu) for cpu in done.stdout.strip(" []\n").split(",")]


def test_pin_self_moves_the_child_it_runs_in(cpus: tuple[int, int]) -> None:
    first, second = cpus
    before = sorted(os.sched_getaffinity(0))
    assert _child(lambda: pin_self(frozenset({second}))) == [second]
    assert _child(lambda: pin_self(None)) == before  # no set: the parent's
    assert sorted(os.sched_getaffinity(0)) == before  # the parent never moved
    # In this process too (where mutmut sees it run): only this process moves, and None moves nothing.
    pin_self(None)
    assert sorted(os.sched_getaffinity(0)) == before
    pin_self(frozenset({first}))
    assert os.sched_getaffinity(0) == {first}


def test_the_affinity_comes_back_when_the_pinned_work_fails(cpus: tuple[int, int]) -> None:
    first, _ = cpus
    before = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError, match="^boom$"):
        with pinned(frozenset({first})):
            assert os.sched_getaffinity(0) == {first}
            raise RuntimeError("boom")
    assert os.sched_getaffinity(0) == before
