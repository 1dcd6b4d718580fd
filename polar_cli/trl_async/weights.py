"""TRL's ``WeightTransferProtocol`` over polar's engine push: the trainer's weights become a checkpoint directory,
and the worker's next batch is served from it.

TRL streams ``(name, tensor)`` pairs under the base checkpoint's parameter names; they are written as one
``model.safetensors`` beside a copy of the base model's config and tokenizer files, so the directory is an ordinary
Hugging Face checkpoint that every polar engine loads: the embedded engine (a new proxy on ``local:DIR``), vLLM (a
restart on it, ``polar engine reload``), SGLang (``update_weights_from_disk``, in place). Parameters TRL does not
send (frozen ones) are copied from the base checkpoint, so the directory is always whole.

The version a checkpoint is served as is the one TRL names right after the send (``update_model_version``), not a
count kept here: TRL restores its version when it resumes from a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def base_weights(model: Path) -> dict[str, Path]:
    """Parameter name -> the base checkpoint's safetensors file that holds it."""
    where: dict[str, Path] = {}
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                where[name] = file
    return where


def write_checkpoint(base: Path, dest: Path, tensors: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
    """``dest``: the base model's non-weight files and every sent tensor (plus any the base holds that were not
    sent) as ``model.safetensors``, written under a temporary name and renamed whole. Returns the names sent."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in base.iterdir():
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(file, tmp / file.name)
    state = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors}
    sent = list(state)
    by_file: dict[Path, list[str]] = {}
    for name, file in base_weights(base).items():
        if name not in state:
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                state[name] = f.get_tensor(name)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return sent


class PolarWeightTransfer:
    """Checkpoints in ``out/weights/sync-NNNN``; the newest waits as ``pending`` until TRL names its version.

    ``pause`` holds the worker's next batch (a batch in flight finishes on the weights it started with: its calls
    carry that version, so nothing is mislabelled); the hold ends when TRL names the new version. ``keep`` bounds
    the directories kept on disk; the one a batch may still be serving is never removed.
    """

    def __init__(self, base: Path, out: Path, keep: int = 3) -> None:
        self.base, self.dir, self.keep = Path(base), Path(out) / "weights", keep
        self.syncing = threading.Event()
        self.pending: Path | None = None
        self.sends = 0
        self.in_use: set[Path] = set()
        self._lock = threading.Lock()

    def init_weight_transfer(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def pause(self) -> None:
        self.syncing.set()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.sends += 1
        dest = self.dir / f"sync-{self.sends:04d}"
        write_checkpoint(self.base, dest, iterator)
        with self._lock:
            self.pending = dest
        self._prune()

    def resume(self) -> None:
        """Nothing yet: the worker starts on the new weights once TRL has named their version."""

    def take_pending(self) -> Path | None:
        with self._lock:
            pending, self.pending = self.pending, None
        return pending

    def destroy(self) -> None:
        self.syncing.clear()

    def _prune(self) -> None:
        syncs = sorted(self.dir.glob("sync-*"))
        for old in syncs[: max(0, len(syncs) - self.keep)]:
            if old not in self.in_use and old != self.pending:
                shutil.rmtree(old, ignore_errors=True)
