"""How freely the proxy's event loop turns while the in-process local engine generates.

The local engine generates in a worker thread; the loop should keep serving other calls. Prints the
rate of 5 ms ticks of a ticker coroutine while idle and while three 64-token generations run, and
their ratio (1.0: generation costs the loop nothing; near 0: it blocks the loop).

    .venv/bin/python bench/engine_loop.py [--model models/tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_addon.canonical import CanonicalRequest, SamplingParams  # noqa: E402
from polar_addon.engines.local import LocalEngine  # noqa: E402


async def _tick_rate(until: asyncio.Future | float) -> float:
    ticks, start = 0, time.monotonic()
    while (not until.done()) if isinstance(until, asyncio.Future) else time.monotonic() - start < until:
        await asyncio.sleep(0.005)
        ticks += 1
    return ticks / (time.monotonic() - start)


async def main(model: str) -> None:
    engine = LocalEngine(model)

    def request(seed: int) -> CanonicalRequest:
        return CanonicalRequest(
            api="openai_chat",
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            sampling=SamplingParams(temperature=1.0, max_tokens=64, seed=seed),
        )

    await engine.complete(request(0))  # load the model outside the measurement
    idle = await _tick_rate(1.0)
    generating = asyncio.ensure_future(asyncio.gather(*(engine.complete(request(s)) for s in range(3))))
    busy = await _tick_rate(generating)
    print(f"{'loop ticks/s idle':32s} {idle:10.1f}")
    print(f"{'loop ticks/s while generating':32s} {busy:10.1f}")
    print(f"{'ratio (generating / idle)':32s} {busy / idle:10.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    asyncio.run(main(parser.parse_args().model))
