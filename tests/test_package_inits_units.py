"""The package ``__init__`` modules with logic of their own: ``--runtime NAME``'s lookup (polar_cli.rollout.runtimes),
which runtimes exist, how a name is spelled, each refusal in its exact words, and that ``make`` must give a Runtime.
(polar_addon.addons's set is tests/test_addon_entry_units.py's; the other package inits only re-export.)"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

import polar_addon.continuity
import polar_addon.store
import polar_cli.rollout
from polar_cli.rollout.runtimes import available_runtimes, get_runtime
from polar_cli.rollout.runtimes.base import Runtime
from polar_cli.rollout.runtimes.local import LocalRuntime

PACKAGE = "polar_cli.rollout.runtimes"


class Probe(Runtime):
    def __init__(self, **options: object) -> None:
        self.options = options

    async def start(self, spec):  # type: ignore[no-untyped-def]
        raise NotImplementedError


@pytest.fixture
def probe_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict]]]:
    """``fake_probe`` (a make giving a Runtime, recording its options) and ``not_one`` (a make giving a dict)."""
    made: list[tuple[str, dict]] = []

    def module(name: str, result: object) -> None:
        mod = types.ModuleType(f"{PACKAGE}.{name}")

        def make(**options: object) -> object:
            made.append((name, options))
            return result(**options) if callable(result) else result

        mod.make = make  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, mod.__name__, mod)

    module("fake_probe", Probe)
    module("not_one", {"a": 1})
    yield made


def test_the_runtimes_are_the_modules_with_a_make() -> None:
    # base, archive, bridge, confine... are helpers of the package, and untrusted/ holds the verifier's shim.
    assert available_runtimes() == ["bwrap", "local", "oci"]


def test_a_runtime_is_made_with_its_options_and_its_name_spelled_loosely(
    probe_modules: list[tuple[str, dict]],
) -> None:
    runtime = get_runtime(" fake-probe\n", disk_mb=5, other="x")
    assert isinstance(runtime, Probe) and runtime.options == {"disk_mb": 5, "other": "x"}
    assert probe_modules == [("fake_probe", {"disk_mb": 5, "other": "x"})]
    assert isinstance(get_runtime("fake_probe"), Probe)
    local = get_runtime("local", disk_mb=64)
    assert isinstance(local, LocalRuntime)


def test_a_make_that_gives_something_else_is_refused(probe_modules: list[tuple[str, dict]]) -> None:
    with pytest.raises(TypeError) as raised:
        get_runtime("not-one")
    assert str(raised.value) == f"{PACKAGE}.not_one.make returned dict, not a Runtime"
    assert probe_modules == [("not_one", {})]


@pytest.mark.parametrize("name", ["no-such", "base", "Local", "../local", "", "local.x"])
def test_an_unknown_runtime_is_named_with_the_available_ones(name: str) -> None:
    with pytest.raises(ValueError) as raised:
        get_runtime(name)
    assert str(raised.value) == f"unknown runtime {name!r}; available: bwrap, local, oci"


def test_a_helper_module_is_not_a_runtime() -> None:
    with pytest.raises(ValueError) as raised:
        get_runtime("archive")
    assert str(raised.value) == f"{PACKAGE}.archive has no make(**options) function: not a runtime"


def test_the_other_package_inits_hold_no_logic() -> None:
    """Their contents are docs and re-exports: a function appearing in them would need its own mutation entry."""
    for package in (polar_addon.continuity, polar_cli.rollout, polar_addon.store):
        own = [
            name
            for name, value in vars(package).items()
            if isinstance(value, (types.FunctionType, type)) and value.__module__ == package.__name__
        ]
        assert own == [], package.__name__
    assert all(hasattr(polar_addon.store, name) for name in polar_addon.store.__all__)
