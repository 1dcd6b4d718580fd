"""CPU sets for the loop's two sides (``polar loop --rollout-cpus / --train-cpus``): on one machine, rollouts (the
engine, the proxy, the harnesses) and the trainer otherwise share every core, and an async loop cannot overlap them.

The loop pins itself to the rollout set, so everything it starts inherits it (vLLM's CPU backend sizes and binds its
threads to the affinity it is given); each ``polar train`` is moved to the train set as it starts. Linux only."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def parse_cpus(text: str) -> frozenset[int]:
    """A Linux CPU list (``0-3,8,10-11``) as a set; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range such as 0-3")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"CPU list {text!r}: the range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def check_cpus(cpus: frozenset[int] | None, what: str) -> None:
    """Refuse a set this process may not run on (a typo would otherwise fail deep inside a child)."""
    if cpus is None:
        return
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"{what} {sorted(cpus - allowed)} are not among this process's CPUs {sorted(allowed)}")


@contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run this process (and what it starts meanwhile) on ``cpus``; the old affinity comes back after."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_self(cpus: frozenset[int] | None) -> None:
    """In a child before exec (``preexec_fn``): move it to ``cpus``."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
