"""The journal's segment format on its own: checksums, torn tails, and a segment of another format version."""

from __future__ import annotations

import pytest

from polar_addon.store import journal


def _segment(payloads: list[bytes]) -> bytes:
    return journal.MAGIC + b"".join(journal.frame(p) for p in payloads)


def test_whole_segment_reads_back() -> None:
    payloads = [b"first", b"", b"third entry" * 40]
    assert journal.parse_segment(_segment(payloads)) == payloads


def test_a_checksum_failure_ends_the_valid_prefix() -> None:
    payloads = [b"alpha", b"bravo", b"charlie"]
    data = bytearray(_segment(payloads))
    # Flip one byte inside "bravo": same length, so only the xxh3 check can notice it.
    at = data.index(b"bravo") + 2
    data[at] ^= 0x01
    assert journal.parse_segment(bytes(data)) == [b"alpha"]


def test_a_corrupt_digest_ends_the_valid_prefix() -> None:
    data = bytearray(_segment([b"alpha", b"bravo"]))
    second = len(journal.MAGIC) + len(journal.frame(b"alpha"))
    data[second + 4] ^= 0xFF  # first byte of the second entry's digest
    assert journal.parse_segment(bytes(data)) == [b"alpha"]


def test_a_torn_last_entry_is_dropped() -> None:
    data = _segment([b"alpha", b"bravo"])
    for cut in range(1, len(journal.frame(b"bravo"))):
        assert journal.parse_segment(data[:-cut]) == [b"alpha"]


@pytest.mark.parametrize("magic", [b"PLRJ1\n", b"PLRJ3\n"])
def test_a_foreign_journal_version_is_refused_not_dropped(magic: bytes) -> None:
    data = magic + b"".join(journal.frame(p) for p in [b"alpha"])
    with pytest.raises(ValueError, match="format"):
        journal.parse_segment(data)


def test_bytes_that_are_no_journal_read_as_empty() -> None:
    assert journal.parse_segment(b"") == []
    assert journal.parse_segment(b"PLR") == []  # a segment whose header write never completed
    assert journal.parse_segment(b"not a journal at all") == []
