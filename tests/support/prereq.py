"""A missing prerequisite: a skip on a developer's machine, a failure in CI.

`make test` (what CI runs) builds every prerequisite first (engine, harnesses, s3, browser, sandbox,
sglang-contract), so there a missing one is a broken setup, and a skip would hide that the test never ran.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"prerequisite missing in CI (make test builds it): {reason}")
    pytest.skip(reason)
