"""The context window an engine serves, read from its spec, so each session's harness budgets by it (compaction,
output caps) when the user gives no ``--context-window``.

- ``local:DIR`` (and a scripted engine's ``model_dir``): the model's ``max_position_embeddings``, lowered by
  ``?max_len=N`` (the script's ``max_len``), as :class:`polar_addon.engines.local.LocalEngine` serves it;
- ``vllm:URL`` / ``sglang:URL``: the ``max_model_len`` their ``/v1/models`` reports (vLLM's ``--max-model-len``);
- a comma-separated pool: the smallest known window (a session may land on any engine).

Unknown (a server that does not answer or report it, a model without the field): None, and the harness keeps its
own default.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from polar_addon.engines.local import served_window as served_window_of
from polar_addon.engines.spec import EngineSpec
from polar_cli.mitm import REPO


def model_window(model_dir: Path) -> int | None:
    """``max_position_embeddings`` of a model directory's config (its text model's, for a multimodal one)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config")):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _local_path(target: str) -> Path:
    # The proxy runs mitmdump from the repository, so a relative model path there resolves against it too.
    path = Path(target).expanduser()
    return path if path.is_absolute() or path.exists() else REPO / path


def served_window(url: str, timeout_s: float = 5.0) -> int | None:
    """``max_model_len`` of the first model an OpenAI-compatible server lists on ``/v1/models``."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s)
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for model in models:
        value = model.get("max_model_len") if isinstance(model, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def engine_window(spec: str) -> int | None:
    """The window ``spec`` (a ``polar_engine`` value) serves; None when it cannot be told."""
    windows = []
    for one in spec.split(","):
        try:
            parsed = EngineSpec.parse(one)
        except ValueError:
            continue  # the proxy refuses such a spec itself
        window: int | None = None
        if parsed.kind == "local":
            window = served_window_of(model_window(_local_path(parsed.target)), parsed.max_len)
        elif parsed.kind == "scripted":
            script = _local_path(parsed.target)
            try:
                data = json.loads(script.read_text())
                model_dir = Path(data["model_dir"])
            except (OSError, ValueError, KeyError, TypeError):
                data, model_dir = {}, None
            if model_dir is not None:
                try:  # read as the scripted engine reads it; one it cannot read says nothing here
                    max_len = int(data.get("max_len") or 0)
                except (TypeError, ValueError):
                    max_len = 0
                window = served_window_of(
                    model_window(model_dir if model_dir.is_absolute() else script.parent / model_dir), max_len
                )
        elif parsed.kind in ("vllm", "sglang"):
            window = served_window(parsed.target)
        if window:
            windows.append(window)
    return min(windows) if windows else None
