"""Token id sequences in the forms the capture path moves them: lists, int32 bytes, and engine JSON text.

The prompt is nearly all of an engine's answer: 32k ids for a 32k-token context. Parsing it into Python
ints, packing those for the journal and freeing them later cost ~1.4 ms of proxy latency at 32k, more than
the rest of the proxy's own work. So an HTTP engine's prompt ids stay the JSON text the engine wrote
(:class:`IdText`): its syntax is checked in a few C passes on the way in, the journal stores the text as it
is, and the shard writer parses it, off the latency path.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

INT32_MAX = 2**31 - 1
_COMMA, _ZERO = ord(","), ord("0")


def pack_token_ids(ids: Sequence[int], name: str) -> bytes:
    """Token ids as native int32 bytes; TypeError/ValueError unless every id is an int32 integer.

    struct checks and packs in C, so this is also the cheapest full validation of a long id list:
    array.array("i", ids) takes ~2x longer and a per-element type check ~1.5x.
    """
    if isinstance(ids, IdText):
        return ids.tobytes()
    if isinstance(ids, array.array) and ids.typecode == "i":
        return ids.tobytes()
    try:
        return struct.pack(f"={len(ids)}i", *ids)
    except struct.error as exc:
        if "not an integer" in str(exc):
            raise TypeError(f"{name} must hold integers: {exc}") from exc
        raise ValueError(f"{name} holds a token id outside int32: {exc}") from exc


class IdText(Sequence[int]):
    """Non-negative token ids as compact JSON array text without the brackets (``17,4,93``).

    Construction checks the syntax in a few vectorized passes (digits and commas only, no empty element)
    and counts the ids; the values are parsed on first use, which also rejects an id past int32
    (ValueError; no tokenizer has 2^31 tokens, so the capture path does not pay to look for one).
    """

    __slots__ = ("text", "_count", "_ids")

    def __init__(self, text: bytes) -> None:
        chars = np.frombuffer(text, np.uint8)  # numpy rather than bytes.translate/count: 6x faster here
        is_comma = chars == _COMMA
        commas = int(np.count_nonzero(is_comma))
        non_digits = int(np.count_nonzero((chars - _ZERO) > 9))  # uint8 wraps below "0"
        if (
            non_digits != commas
            or text.startswith(b",")
            or text.endswith(b",")
            or (commas > 1 and bool(np.any(is_comma[1:] & is_comma[:-1])))
        ):
            raise ValueError("not a compact JSON array of non-negative integers")
        self.text = bytes(text)
        self._count = commas + 1 if text else 0
        self._ids: array.array | None = None

    @classmethod
    def parse(cls, text: bytes) -> IdText | None:
        try:
            return cls(text)
        except ValueError:
            return None

    def ids(self) -> array.array:
        """The ids as an int32 array; ValueError if one does not fit int32."""
        if self._ids is None:
            ids = array.array("i")
            if self._count:
                values = np.fromstring(self.text, dtype=np.int64, sep=",")  # saturates past int64
                if values.size != self._count or values.max() > INT32_MAX:
                    raise ValueError("a token id does not fit int32")
                ids.frombytes(values.astype(np.int32).tobytes())
            self._ids = ids
        return self._ids

    def tobytes(self) -> bytes:
        return self.ids().tobytes()

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: Any) -> Any:
        return self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdText):
            return self.text == other.text
        if isinstance(other, (list, tuple, array.array)):
            return len(other) == self._count and list(self.ids()) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"IdText({self._count} ids)"
