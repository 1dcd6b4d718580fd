"""Stored rows and journal entries built the way the trace store builds them, for tests that forge shards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polar_addon.capture import CaptureRecord
from polar_addon.store.compaction import Tip, encode_call
from polar_addon.store.entries import call_entry, decode_entry


def stored_row(record: CaptureRecord, seq: int, tips: Sequence[Tip] = ()) -> tuple[dict[str, Any], Tip | None]:
    """The shard row of ``record`` as call ``seq`` of its session, compacted against ``tips``."""
    _, journaled = decode_entry(call_entry(record, seq))
    return encode_call(journaled, tips)  # type: ignore[arg-type]
