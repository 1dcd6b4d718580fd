"""Bounded capture of a sandboxed command's stdout/stderr, shared by every runtime's ``exec``.

The agent controls what its harness prints: a runtime that collected all of it in memory let one session print
1 GB and grow the runner by 3 GB (and write a 1 GB ``harness.log``). Output is streamed instead, keeping only a
head and a tail of each stream; the text says how many bytes were dropped between them.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field

HEAD_BYTES = 1024 * 1024
TAIL_BYTES = 1024 * 1024
CHUNK_BYTES = 64 * 1024


@dataclass
class BoundedOutput:
    """The first ``head`` and the last ``tail`` bytes of a stream, and how many it had in all."""

    head: int = HEAD_BYTES
    tail: int = TAIL_BYTES
    total: int = field(default=0, init=False)
    _head: bytearray = field(default_factory=bytearray, init=False, repr=False)
    _tail: bytearray = field(default_factory=bytearray, init=False, repr=False)

    @classmethod
    def pair(cls, bounded: bool) -> tuple[BoundedOutput, BoundedOutput]:
        """Captures for stdout and stderr: bounded (an agent's output), else whole (an archive the runner unpacks)."""
        return (cls(), cls()) if bounded else (cls.whole(), cls.whole())

    @classmethod
    def whole(cls) -> BoundedOutput:
        """Everything (an archive the runner unpacks itself, never an agent's free-form output)."""
        return cls(head=sys.maxsize, tail=0)

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            # Trimmed in batches: cutting on every chunk would copy the tail once per 64 KiB read.
            if len(self._tail) > 2 * self.tail:
                del self._tail[: len(self._tail) - self.tail]

    @property
    def dropped(self) -> int:
        return self.total - len(self._head) - min(len(self._tail), self.tail)

    def data(self) -> bytes:
        """The head, a line saying how many bytes were dropped (when some were), the tail."""
        tail = bytes(self._tail[-self.tail :]) if self.tail else b""
        if not self.dropped:
            return bytes(self._head) + tail
        marker = (
            f"\n[polar: {self.dropped} bytes of output dropped here; kept the first {len(self._head)} and the "
            f"last {len(tail)}]\n"
        )
        return bytes(self._head) + marker.encode() + tail

    def text(self) -> str:
        return self.data().decode("utf-8", "replace")


async def drain(stream: asyncio.StreamReader | None, into: BoundedOutput) -> None:
    """Read ``stream`` to its end into ``into``."""
    if stream is None:
        return
    while chunk := await stream.read(CHUNK_BYTES):
        into.feed(chunk)


async def feed_stdin(proc: asyncio.subprocess.Process, data: bytes | None) -> None:
    """Write ``data`` to the process's stdin and close it; a process that exits without reading it is fine."""
    if data is None or proc.stdin is None:
        return
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        proc.stdin.close()


async def communicate(
    proc: asyncio.subprocess.Process, stdin: bytes | None, out: BoundedOutput, err: BoundedOutput
) -> None:
    """``Process.communicate`` with bounded capture: fills ``out``/``err`` as the process writes (so a caller that
    cancels this on a timeout keeps what came so far) and returns once both streams closed and the process ended."""
    await asyncio.gather(feed_stdin(proc, stdin), drain(proc.stdout, out), drain(proc.stderr, err))
    await proc.wait()
