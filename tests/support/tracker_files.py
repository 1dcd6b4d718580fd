"""Read what the trackers wrote back from their files: TensorBoard event files (tensorboard's own reader), a wandb
offline run's ``run-ID.wandb`` log (LevelDB log framing of wandb's protobuf records, read with wandb's own protos),
trackio's local SQLite database (its own storage class)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in the event files of ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """key -> {step: value} of the history rows of a wandb offline run directory."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out: dict[str, dict[int, float]] = {}
    pos, pending = WANDB_HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind not in (FULL, LAST):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                value = json.loads(item.value_json)
                if isinstance(value, (int, float)):
                    out.setdefault(key, {})[step] = float(value)
    return out


def trackio_logs(trackio_dir: Path, project: str, run: str) -> list[dict]:
    """The rows trackio's local database holds for ``run`` (each a dict of the metrics and its step)."""
    import sqlite3

    with sqlite3.connect(trackio_dir / f"{project}.db") as db:
        rows = db.execute("select step, metrics from metrics where run_name = ? order by id", (run,)).fetchall()
    return [{**json.loads(metrics), "step": step} for step, metrics in rows]
