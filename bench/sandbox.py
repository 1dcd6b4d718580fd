"""What a sandbox costs per session: start, one exec, stop, for each runtime side by side (ratios against local).

    .venv/bin/python bench/sandbox.py [--repeat 10] [--oci-repeat 3]

A session does one start, a few execs (setup, the harness, patch extraction; its verifier one more start) and one
stop, so start + exec + stop is the per-session overhead over a harness run of minutes. oci rows need podman (and
build a small image from the host's binaries first, not timed); proxy-only rows include the socat bridges.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_cli.rollout.runtimes import bwrap, local, oci  # noqa: E402
from polar_cli.rollout.runtimes.base import ProxyEndpoints, Runtime, SandboxSpec  # noqa: E402


async def measure(runtime: Runtime, network: str, repeat: int, root: Path, ends: ProxyEndpoints) -> dict[str, float]:
    starts, execs, stops = [], [], []
    for i in range(repeat):
        ws, home = root / f"{runtime.name}-{network}-{i}" / "ws", root / f"{runtime.name}-{network}-{i}" / "home"
        ws.mkdir(parents=True)
        home.mkdir()
        (ws / "file").write_text("x")  # a non-empty workspace, bound (oci binds only a non-empty one)
        spec = SandboxSpec(name=f"bench-{i}", workspace=ws, home=home, proxy=ends, network=network)
        t0 = time.perf_counter()
        box = await runtime.start(spec)
        t1 = time.perf_counter()
        result = await box.exec(["true"])
        t2 = time.perf_counter()
        await box.stop()
        t3 = time.perf_counter()
        assert result.exit_code == 0, result
        starts.append(t1 - t0)
        execs.append(t2 - t1)
        stops.append(t3 - t2)
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    return {"start": ms(starts), "exec": ms(execs), "stop": ms(stops)}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--oci-repeat", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="polar-bench-sandbox-"))
    ca = root / "ca.pem"
    ca.write_text("bench\n")
    ends = ProxyEndpoints(18080, 18081, ca)  # the bridge connects lazily: no proxy needs to listen
    rows: list[tuple[str, dict[str, float]]] = [
        ("local (host)", await measure(local.make(), "host", args.repeat, root, ends)),
        ("bwrap host", await measure(bwrap.make(), "host", args.repeat, root, ends)),
        ("bwrap proxy-only", await measure(bwrap.make(), "proxy-only", args.repeat, root, ends)),
    ]
    try:
        from tests.support.oci_image import build_test_image

        image = build_test_image()
        rows.append(("podman none", await measure(oci.make(image=image), "none", args.oci_repeat, root, ends)))
        rows.append(
            ("podman proxy-only", await measure(oci.make(image=image), "proxy-only", args.oci_repeat, root, ends))
        )
    except Exception as exc:  # no podman here: the table still compares the rest
        print(f"(oci skipped: {exc})")
    base = rows[0][1]
    base_total = sum(base.values())
    print(f"{'runtime':<20}{'start ms':>10}{'exec ms':>10}{'stop ms':>10}{'total ms':>10}{'x local':>9}")
    for name, r in rows:
        total = sum(r.values())
        print(
            f"{name:<20}{r['start']:>10.1f}{r['exec']:>10.1f}{r['stop']:>10.1f}{total:>10.1f}{total / base_total:>9.1f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
