"""A real S3-compatible server for the tests: moto on loopback, from its own venv (`make s3`)."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.prereq import missing

REPO = Path(__file__).resolve().parents[2]
MOTO = REPO / ".venv-s3" / "bin" / "moto_server"
# What a client of the moto server needs (moto takes any key; no instance metadata lookups).
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "polar-test",
    "AWS_SECRET_ACCESS_KEY": "polar-test",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server() -> Iterator[int]:
    """A moto server on a free loopback port (its port), stopped on exit."""
    if not MOTO.exists():
        missing("needs the moto S3 server venv: run `make s3` (creates .venv-s3 with moto[server])")
    port = free_port()
    proc = subprocess.Popen(
        [str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def new_bucket(port: int) -> str:
    name = f"polar-{random.randrange(1 << 30):x}"
    assert httpx.put(f"http://127.0.0.1:{port}/{name}").status_code == 200
    return name


def s3_uri(bucket: str, port: int, prefix: str = "run") -> str:
    return f"s3://{bucket}/{prefix}?endpoint_override=127.0.0.1:{port}&scheme=http"
