"""Hostile input, faults and load against polar, as one table (issue 11).

    .venv/bin/python bench/reliability.py            # ~ the test suite's budget
    .venv/bin/python bench/reliability.py --long     # 10x the fuzzing examples
    .venv/bin/python bench/reliability.py --sessions 64 --turns 20
    .venv/bin/python bench/reliability.py --vllm --load-only   # the load against vLLM CPU too (minutes)
    .venv/bin/python bench/reliability.py --attacks-only      # only the attacker table (tests/security, minutes)

Everything runs for real: the gateway in-process with the scripted engine (tiny model's tokenizer, template
and logprobs) and a real TraceStore; a real mitmdump in reverse mode in front of a fake upstream that records
whatever reaches it; engine processes that hang, answer garbage or die; 64 concurrent sessions through
mitmdump, against the scripted engine and (``--vllm``) against the tiny model on vLLM CPU. Rows marked
"must be 0" are the invariants.

The attacker table runs ``tests/security`` (each test is one attack by the agent under training, as a real
`polar rollout` with an attacker script in the agent's place where the attack needs one) and prints attacks tried /
blocked per class: a test that passes is an attack blocked, one that fails an attack that got through.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from polar_addon import identity  # noqa: E402
from polar_addon.canonical import PolarError  # noqa: E402
from polar_addon.capture import Identity  # noqa: E402
from polar_addon.engines import EnginePool  # noqa: E402
from polar_addon.gateway import FullReply, Gateway, GatewayConfig, IncomingCall  # noqa: E402
from polar_addon.store import TraceStore, read_records  # noqa: E402
from polar_addon.store.validate import validate_store  # noqa: E402
from polar_cli.serving import serve_vllm, stop_process  # noqa: E402
from tests.support.hostile import (  # noqa: E402
    PATHS,
    RecordingUpstream,
    hang_up_mid_stream,
    hostile_body,
    hostile_identity,
    is_provider_error,
    triggers,
    valid_body,
    write_script,
)
from tests.support.load import LoadResult, check_store, run_load  # noqa: E402
from tests.support.proxy import free_port, run_mitmdump, wait_for_port  # noqa: E402
from tests.test_reliability_proxy import ENGINE_SERVER  # noqa: E402

SECRET = "sk-reliability-secret-0123456789"
SETTINGS = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


class Counts(logging.Handler):
    """Counts polar's log lines that mean 'an exception was caught' (translator or internal)."""

    def __init__(self) -> None:
        super().__init__()
        self.internal = 0
        self.translator = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "unexpected error" in message:
            self.internal += 1
        elif "could not read a request" in message:
            self.translator += 1


async def _answer(gateway: Gateway, api: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    try:
        ident = identity.resolve(None, headers, "conn") if headers else Identity(session_id="fuzz", source="header")
    except PolarError as err:
        reply = gateway.error_reply("POST", PATHS[api], err)
        return reply.status, reply.body
    reply = await gateway.handle(
        IncomingCall(method="POST", path=PATHS[api], headers=headers, body=body, identity=ident)
    )
    if isinstance(reply, FullReply):
        return reply.status, reply.body
    return reply.status, b"".join([c async for c in reply.chunks])


def _fuzz_api(
    api: str, gateway: Gateway, loop: asyncio.AbstractEventLoop, examples: int, counts: Counts
) -> dict[str, int]:
    """One translator's row (its own function so the hypothesis closures bind this api's stats and body)."""
    stats: Counter = Counter()
    before = (counts.internal, counts.translator)

    def one(status: int, answer: bytes, api_shape: str) -> None:
        stats["tried"] += 1
        if status == 200:
            stats["ok"] += 1
        elif 400 <= status < 500 and is_provider_error(api_shape, status, answer):
            stats["4xx"] += 1
        else:
            stats["bad answer"] += 1
        try:
            gateway.store.check_writable()
        except Exception:
            stats["store stopped"] += 1

    if api == "identity":
        body = orjson.dumps(valid_body("anthropic_messages"))

        @settings(max_examples=examples, **SETTINGS)
        @given(headers=hostile_identity())
        def run_identity(headers: dict) -> None:
            one(
                *loop.run_until_complete(_answer(gateway, "anthropic_messages", body, headers)),
                "anthropic_messages",
            )

        run_identity()
    else:

        @settings(max_examples=examples, **SETTINGS)
        @given(body=hostile_body(api))
        def run_body(body: bytes) -> None:
            one(*loop.run_until_complete(_answer(gateway, api, body, {})), api)

        run_body()
    for trigger in (t for t in triggers() if t.api == api and not t.headers):
        body = trigger.encoded()
        one(*loop.run_until_complete(_answer(gateway, api, body, {})), api)
    stats["crashes"] = counts.internal - before[0]
    stats["translator exceptions -> 400"] = counts.translator - before[1]
    return dict(stats)


def fuzz_gateway(engine: str, out: Path, examples: int, counts: Counts) -> dict[str, dict[str, int]]:
    loop = asyncio.new_event_loop()
    gateway = Gateway(
        EnginePool.from_spec(engine),
        TraceStore(str(out), shard_max_records=64, shard_max_seconds=0.5),
        GatewayConfig(max_body_bytes=1 << 20),
    )
    rows: dict[str, dict[str, int]] = {}
    try:
        for api in [*PATHS, "identity"]:
            rows[api] = _fuzz_api(api, gateway, loop, examples, counts)
        status, _ = loop.run_until_complete(
            _answer(gateway, "openai_chat", orjson.dumps(valid_body("openai_chat")), {})
        )
        rows["_after"] = {"status": status}
    finally:
        loop.run_until_complete(gateway.close())
        loop.close()
    return rows


def through_mitmdump(engine: str, out: Path, examples: int) -> dict[str, int]:
    stats: Counter = Counter()
    with (
        RecordingUpstream() as upstream,
        run_mitmdump(
            engine,
            out,
            mode=f"reverse:http://127.0.0.1:{upstream.port}",
            options={"polar_shard_seconds": "0.5", "polar_max_body_mb": "1"},
        ) as proxy,
    ):

        def post(api: str, body: bytes, headers: dict) -> httpx.Response:
            return httpx.post(
                proxy.url + PATHS[api],
                content=body,
                timeout=120,
                headers={"content-type": "application/json", "authorization": f"Bearer {SECRET}", **headers},
            )

        for trigger in triggers():
            body = trigger.encoded()
            r = post(trigger.api, body, trigger.headers)
            stats["triggers"] += 1
            stats["triggers answered as expected"] += r.status_code == trigger.expect

        @settings(max_examples=examples, **SETTINGS)
        @given(api=st.sampled_from(list(PATHS)), data=st.data())
        def fuzz(api: str, data: st.DataObject) -> None:
            r = post(api, data.draw(hostile_body(api)), {"x-polar-session": "fuzz"})
            stats["fuzzed"] += 1
            stats["5xx"] += r.status_code >= 500

        fuzz()
        stats["after"] = post(
            "openai_chat", orjson.dumps(valid_body("openai_chat")), {"x-polar-session": "after"}
        ).status_code
        logs = proxy.logs()
    stats["leaked upstream"] = len(upstream.requests)
    stats["secrets in logs"] = logs.count(SECRET)
    stats["secrets in shards"] = sum(
        SECRET in (r.messages_json + (r.error or "") + (r.harness or "")) for r in read_records(str(out))
    )
    stats["quarantined"] = sum("quarantined" in p for p in validate_store(str(out)))
    return dict(stats)


def faults(tmp: Path, model: Path) -> list[tuple[str, bool, str]]:
    results = []
    for mode, expected in (("hang", {504}), ("not_json", {502}), ("no_ids", {502}), ("die", {503, 502})):
        port = free_port()
        server = subprocess.Popen([sys.executable, "-c", ENGINE_SERVER, mode, str(port)], start_new_session=True)
        out = tmp / f"fault-{mode}"
        try:
            wait_for_port(port, 30, server)
            with run_mitmdump(
                f"vllm:http://127.0.0.1:{port}",
                out,
                mode="reverse:https://api.anthropic.com",
                options={"polar_engine_timeout": "2", "polar_shard_seconds": "0.2"},
            ) as proxy:
                r = httpx.post(
                    proxy.url + "/v1/messages",
                    content=orjson.dumps(valid_body("anthropic_messages")),
                    timeout=60,
                    headers={"content-type": "application/json", "x-polar-session": "fault"},
                )
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        records = read_records(str(out))
        ok = (
            r.status_code in expected
            and is_provider_error("anthropic_messages", r.status_code, r.content)
            and len(records) == 1
            and records[0].status == "failed"
            and not records[0].response_ids
        )
        results.append((f"engine {mode}", ok, f"{r.status_code}, recorded {[x.status for x in records]}"))
    # A client hanging up mid-stream, three times, then a normal call.
    out = tmp / "fault-disconnect"
    slow = write_script(tmp / "slow.json", model, latency_s=1.5)
    with run_mitmdump(
        slow,
        out,
        mode="reverse:https://api.openai.com",
        options={"polar_keepalive": "0.2", "polar_shard_seconds": "0.2"},
    ) as proxy:
        hang_up_mid_stream(proxy.url, out)
        after = httpx.post(
            proxy.url + "/v1/chat/completions",
            json=valid_body("openai_chat"),
            headers={"x-polar-session": "after"},
            timeout=60,
        )
    records = read_records(str(out))
    ok = after.status_code == 200 and [r.seq for r in records if r.session_id == "cut"] == [0, 1, 2]
    results.append(("client disconnects mid-stream x3", ok, f"next call {after.status_code}"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="10x the fuzzing examples")
    parser.add_argument("--examples", type=int, default=60, help="hypothesis examples per translator (in-process)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="run the load against vLLM CPU (.venv-vllm) as well")
    parser.add_argument("--load-only", action="store_true", help="skip the fuzzing and the faults")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each load call")
    parser.add_argument("--skip-attacks", action="store_true", help="skip the attacker table (tests/security)")
    parser.add_argument("--attacks-only", action="store_true", help="only the attacker table")
    args = parser.parse_args()
    if args.attacks_only:
        _print_attacks(attacks())
        return
    examples = args.examples * (10 if args.long else 1)
    counts = Counts()
    logging.getLogger("polar").addHandler(counts)
    logging.getLogger("polar").setLevel(logging.INFO)
    logging.getLogger("polar").propagate = False
    model = REPO / "models" / "tiny"
    with tempfile.TemporaryDirectory(prefix="polar-reliability-") as tmp_name:
        tmp = Path(tmp_name)
        engine = write_script(tmp / "script.json", model)
        fuzz = proxy = None
        fault_rows: list[tuple[str, bool, str]] = []
        t_fuzz = 0.0
        if not args.load_only:
            t0 = time.monotonic()
            fuzz = fuzz_gateway(engine, tmp / "gateway", examples, counts)
            t_fuzz = time.monotonic() - t0
            proxy = through_mitmdump(engine, tmp / "mitm", max(20, examples // 2))
            fault_rows = faults(tmp, model)
        loads: list[tuple[str, LoadResult]] = []
        if not args.skip_load:
            loads.append(("scripted engine", _load(engine, tmp / "load", args)))
        if args.vllm:
            loads.append(("vLLM CPU, tiny model", _load_vllm(model, tmp, args)))

    if fuzz is not None and proxy is not None:
        _print_fuzz(fuzz, proxy, fault_rows, examples, t_fuzz, args.long)
    rows = []
    for name, load in loads:
        rows += [
            (
                f"load: {load.sessions} sessions x {load.turns} turns ({name})",
                f"{load.answered} answered in {load.seconds:.0f} s",
                f"{load.answered / load.seconds:.1f} calls/s",
            ),
            (
                "  records lost / duplicated / mixed up",
                f"{load.lost} / {load.duplicated} / {load.mixed_up}",
                "must be 0",
            ),
            (
                "  calls that failed (retried by the client; recorded as failed)",
                load.failed_calls,
                "; ".join(f"{n}x {why}" for why, n in load.failure_reasons.items())[:200],
            ),
            (
                "  connections lost (retried by the client)",
                len(load.transport_errors),
                "; ".join(load.transport_errors[:3]),
            ),
            ("  peak RSS of mitmdump under load", f"{load.peak_rss_mb:.0f} MiB", ""),
        ]
        if load.engine_peak_rss_mb:
            rows.append(
                ("  peak RSS of the engine (vLLM and its engine core)", f"{load.engine_peak_rss_mb:.0f} MiB", "")
            )
    _print_rows(rows)
    if not (args.skip_attacks or args.load_only):
        _print_attacks(attacks())


def attacks() -> dict[str, Counter]:
    """tests/security run once: per attack class (its test module), attacks tried, blocked and not run."""
    with tempfile.TemporaryDirectory(prefix="polar-attacks-") as tmp:
        report = Path(tmp) / "junit.xml"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "tests/security"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if not report.exists():
            raise SystemExit("tests/security did not run (no junit report)")
        classes: dict[str, Counter] = {}
        for case in ET.parse(report).iter("testcase"):
            name = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("test_").replace("_", " ")
            row = classes.setdefault(name, Counter())
            row["tried"] += 1
            if case.find("skipped") is not None:
                row["not run"] += 1
            elif case.find("failure") is None and case.find("error") is None:
                row["blocked"] += 1
        return classes


def _print_attacks(classes: dict[str, Counter]) -> None:
    print(f"\n{'attack class (tests/security)':<34}{'tried':>7}{'blocked':>9}{'got through':>13}{'not run':>9}")
    for name, row in sorted(classes.items()):
        through = row["tried"] - row["blocked"] - row["not run"]
        print(f"{name:<34}{row['tried']:>7}{row['blocked']:>9}{through:>13}{row['not run']:>9}")
    total = sum(classes.values(), Counter())
    print(
        f"{'all':<34}{total['tried']:>7}{total['blocked']:>9}{total['tried'] - total['blocked'] - total['not run']:>13}"
        f"{total['not run']:>9}   (got through: must be 0)"
    )


def _load(engine: str, out: Path, args: argparse.Namespace, engine_pid: int | None = None) -> LoadResult:
    with run_mitmdump(
        engine,
        out,
        mode="reverse:https://api.openai.com",
        options={"polar_shard_records": "128", "polar_shard_seconds": "1"},
    ) as p:
        load = run_load(p.url, p.process.pid, out, args.sessions, args.turns, args.max_tokens, engine_pid)
        if load.transport_errors:
            print(
                "mitmdump's log around lost connections:\n"
                + "\n".join(line for line in p.logs().splitlines() if "error" in line.lower())[-3000:]
            )
    return check_store(load, out)


def _load_vllm(model: Path, tmp: Path, args: argparse.Namespace) -> LoadResult:
    """The same load through mitmdump with the tiny model on a real vLLM CPU server (started as `polar engine
    serve` starts it)."""
    port = free_port()
    server = serve_vllm(
        str(model),
        port=port,
        served_model_name="tiny",
        state_dir=tmp / "engine-state",
        dtype="float32",
        max_model_len=4096,
    )
    try:
        return _load(f"vllm:http://127.0.0.1:{port}", tmp / "load-vllm", args, engine_pid=server.pid)
    finally:
        stop_process(server)


def _print_rows(rows: list[tuple[str, object, str]]) -> None:
    if not rows:
        return
    width = max(len(r[0]) for r in rows) + 2
    for name, value, note in rows:
        print(f"{name:<{width}}{value!s:>24}   {note}")


def _print_fuzz(
    fuzz: dict, proxy: dict, fault_rows: list[tuple[str, bool, str]], examples: int, t_fuzz: float, long: bool
) -> None:
    print(
        f"\npolar reliability ({'long' if long else 'default'} mode; "
        f"{examples} fuzzed bodies per translator in-process, "
        f"{t_fuzz:.0f} s)\n"
    )
    print(
        f"{'translator':<22}{'tried':>7}{'ok':>6}{'4xx':>6}{'bad answer':>12}"
        f"{'crashes':>9}{'store stopped':>15}{'exc->400':>10}"
    )
    for api, row in fuzz.items():
        if api.startswith("_"):
            continue
        print(
            f"{api:<22}{row.get('tried', 0):>7}{row.get('ok', 0):>6}{row.get('4xx', 0):>6}"
            f"{row.get('bad answer', 0):>12}{row.get('crashes', 0):>9}{row.get('store stopped', 0):>15}"
            f"{row.get('translator exceptions -> 400', 0):>10}"
        )
    crashes = sum(r.get("crashes", 0) for k, r in fuzz.items() if not k.startswith("_"))
    stopping = sum(r.get("store stopped", 0) for k, r in fuzz.items() if not k.startswith("_"))
    print()
    rows = [
        (
            "hostile inputs tried (in-process, all translators + identity)",
            sum(r.get("tried", 0) for k, r in fuzz.items() if not k.startswith("_")),
            "",
        ),
        ("crashes (internal errors)", crashes, "must be 0"),
        ("store-stopping inputs", stopping + proxy["quarantined"], "must be 0"),
        ("valid call after the fuzzing", fuzz["_after"]["status"], "200"),
        (
            "known triggers through mitmdump answered as expected",
            f"{proxy['triggers answered as expected']}/{proxy['triggers']}",
            "",
        ),
        ("fuzzed bodies through mitmdump (5xx among them)", f"{proxy['fuzzed']} ({proxy['5xx']})", ""),
        ("flows leaked upstream", proxy["leaked upstream"], "must be 0"),
        ("secrets found in shards and logs", proxy["secrets in shards"] + proxy["secrets in logs"], "must be 0"),
        ("faults injected / survived", f"{len(fault_rows)} / {sum(ok for _, ok, _ in fault_rows)}", ""),
    ]
    rows += [(f"  {name}", "survived" if ok else "FAILED", detail) for name, ok, detail in fault_rows]
    _print_rows(rows)


if __name__ == "__main__":
    main()
