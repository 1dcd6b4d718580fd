"""What a build reads from a trace store besides its records: the session rows as the builder sees them, and the
tokenizer that tells a re-tokenized sampled turn from a template re-render.

Shared by `polar build` (polar_cli.build_cmd) and `polar train`'s build on the fly (polar_cli.train.dataset), so
both build from the same inputs. The rest of polar_cli.build stays pure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_addon.engines.spec import EngineSpec
from polar_cli.build.rewards import SessionInfo

if TYPE_CHECKING:
    from polar_addon.store import SessionRecord

NO_TOKENIZER = (
    "no tokenizer: a re-tokenized sampled turn cannot be told from a template re-render, so both break "
    "their chain as 'other' (pass --tokenizer DIR)"
)


class NoTokenizerThere(ValueError):
    """The tokenizer directory given holds no tokenizer."""


def session_info(row: SessionRecord) -> SessionInfo:
    """A store session row as the builder sees it. A session nobody reported a status for is
    treated as completed: its outcome reward, if one was posted, decides."""
    return SessionInfo(
        session_id=row.session_id,
        task_id=row.task_id,
        group_id=row.group_id,
        sample_index=row.sample_index,
        harness=row.harness,
        status=row.status or "completed",
        reward=row.reward,
    )


def session_infos(store: str) -> dict[str, SessionInfo]:
    """Every session of ``store`` by id, as the builder sees it."""
    from polar_addon.store import read_sessions

    return {row.session_id: session_info(row) for row in read_sessions(store)}


def _tokenizer_candidates(store: str) -> list[str]:
    """The served model and the engine's target of the first ok call: a local engine's model directory."""
    from polar_addon.store import CALLS, read_table

    table = read_table(store, CALLS, columns=["status", "served_model", "engine"])
    for row in table.slice(0, 64).to_pylist():
        if row["status"] == "ok":
            try:
                engine_target = EngineSpec.parse(row["engine"] or "").target
            except ValueError:
                engine_target = ""  # an engine name that is no spec names no directory either
            return [c for c in (row["served_model"], engine_target) if c]
    return []


def find_tokenizer(tokenizer: Path | None, store: str) -> tuple[Any | None, str]:
    """A Hugging Face tokenizer and a line saying where it came from (or why there is none): ``tokenizer``, else the
    records' served model or local engine directory if it is a directory here.

    Raises NoTokenizerThere when ``tokenizer`` is given and holds none."""
    candidates = [str(tokenizer)] if tokenizer else _tokenizer_candidates(store)
    for candidate in candidates:
        if (Path(candidate) / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(candidate), f"tokenizer: {candidate}"
    if tokenizer:
        raise NoTokenizerThere(f"{tokenizer} holds no tokenizer (tokenizer_config.json)")
    return None, NO_TOKENIZER


def tokenizer_eot(tok: Any | None) -> int | None:
    """The tokenizer's eos token: the end-of-turn fallback when no captured call stopped by itself."""
    return tok.convert_tokens_to_ids(tok.eos_token) if tok is not None and tok.eos_token else None
