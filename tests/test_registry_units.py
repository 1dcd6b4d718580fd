"""The name -> module lookup behind `--harness` and `--runtime` (polar_cli.rollout.registry), on a package made for
each test: which modules are entries, and each refusal of a name in its exact words."""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_cli.rollout.registry import find_make, modules_with_make

_fresh = itertools.count()


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path, Path]]:
    """A package on sys.path: ``(its name, its directory, a second directory on its __path__)``."""
    name = f"polar_registry_probe_{next(_fresh)}"
    root = tmp_path / name
    more = tmp_path / "more"
    root.mkdir()
    more.mkdir()
    (root / "__init__.py").write_text(f"__path__.append({str(more)!r})\n")
    for module, body in {
        "alpha": "def make(arg=None):\n    return ('alpha', arg)\n",
        "beta": "HELPER = 1\n",  # a helper module: no make
        "_private": "def make(arg=None):\n    return 'private'\n",
        "skipped": "def make(arg=None):\n    return 'skipped'\n",
        "nullmake": "make = None\n",
        "broken": "import polar_registry_no_such_dependency\n\ndef make(arg=None):\n    return 'broken'\n",
    }.items():
        (root / f"{module}.py").write_text(body)
    (more / "zulu.py").write_text("def make(arg=None):\n    return 'zulu'\n")
    (root / "nested").mkdir()  # a subpackage: its modules are importable as nested.inner, but are no entries
    (root / "nested" / "__init__.py").write_text("")
    (root / "nested" / "inner.py").write_text("def make(arg=None):\n    return 'inner'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name, root, more
    for key in [k for k in sys.modules if k == name or k.startswith(f"{name}.")]:
        del sys.modules[key]


def test_the_entries_are_the_modules_with_a_make_sorted_over_every_directory(
    package: tuple[str, Path, Path],
) -> None:
    name, root, more = package
    (root / "broken.py").unlink()  # importing it would fail: modules_with_make imports every candidate
    # The second directory is listed first: its zulu comes first unless the names are sorted.
    assert modules_with_make(name, [str(more), str(root)], {"skipped"}) == ["alpha", "nullmake", "zulu"]
    assert modules_with_make(name, [str(root)], set()) == ["alpha", "nullmake", "skipped"]
    assert modules_with_make(name, [str(root)], {"alpha", "skipped"}) == ["nullmake"]


def test_find_make_returns_the_full_name_and_the_make(package: tuple[str, Path, Path]) -> None:
    name, _, _ = package
    full, make = find_make(name, "alpha", set(), lambda: "unknown", "not an entry")
    assert full == f"{name}.alpha" and make("x") == ("alpha", "x")
    full, make = find_make(name, "zulu", set(), lambda: "unknown", "not an entry")
    assert (full, make()) == (f"{name}.zulu", "zulu")


@pytest.mark.parametrize("module", ["no_such_module", "skipped", "nested.inner", "al-pha", "alpha.beta", ""])
def test_an_unknown_skipped_or_malformed_name_is_refused_with_the_callers_words(
    package: tuple[str, Path, Path], module: str
) -> None:
    name, _, _ = package
    with pytest.raises(ValueError) as refused:
        find_make(name, module, {"skipped"}, lambda: f"unknown thing {module!r}; available: alpha", "x")
    assert str(refused.value) == f"unknown thing {module!r}; available: alpha"
    if module == "no_such_module":  # the import's own error is no part of what the user reads
        assert refused.value.__cause__ is None and refused.value.__suppress_context__
    else:  # refused before any import is tried
        assert refused.value.__context__ is None


def test_a_module_without_make_is_named_with_the_callers_words(package: tuple[str, Path, Path]) -> None:
    name, _, _ = package
    for module in ("beta", "nullmake"):
        with pytest.raises(ValueError) as refused:
            find_make(name, module, set(), lambda: "unknown", "has no make(arg) function: not a preset")
        assert str(refused.value) == f"{name}.{module} has no make(arg) function: not a preset"


def test_a_missing_dependency_inside_an_existing_module_propagates_as_it_is(package: tuple[str, Path, Path]) -> None:
    name, _, _ = package
    with pytest.raises(ModuleNotFoundError) as missing:
        find_make(name, "broken", set(), lambda: "unknown", "x")
    assert missing.value.name == "polar_registry_no_such_dependency"
