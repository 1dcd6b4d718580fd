"""A task set: JSONL task lines or Harbor (Terminal-Bench) task directories, one :class:`Task` each."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Task:
    """One verifiable task. Paths are absolute on the host.

    ``workspace``: the directory the agent starts in (copied per session), or None with ``repo`` (+ ``revision``)
    to clone. ``setup``/``verify`` are shell commands run inside the session's sandbox, in the workspace;
    ``verify`` exits 0 for reward 1.0, else 0.0, unless it writes a reward file (``reward_file``: a float, or
    a flat JSON object name -> number whose ``reward`` entry, else mean, is the reward). ``tests_dir`` (Harbor)
    is uploaded to ``/tests`` for the verifier only, never shown to the agent.
    """

    id: str
    instruction: str
    workspace: Path | None = None
    repo: str | None = None
    revision: str | None = None
    setup: str | None = None
    verify: str | None = None
    reward_file: str | None = None
    tests_dir: Path | None = None
    agent_timeout_s: float = 600.0
    verify_timeout_s: float = 300.0
    setup_timeout_s: float = 300.0
    image: str | None = None  # an OCI image name, for the oci runtime
    dockerfile: Path | None = None  # environment/Dockerfile (Harbor), built by the oci runtime
    workdir: str | None = None  # where the workspace is inside an image (Harbor [environment] workdir)
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = "jsonl"  # "jsonl" | "harbor"
