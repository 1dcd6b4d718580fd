"""Check a store's ATIF export against Harbor's own models (vendored in tests/support/harbor_atif): for the preset
tests, which capture real harnesses' sessions, as for tests/test_export.py."""

from __future__ import annotations

import orjson

from polar_addon.store import iter_records
from polar_cli.build.inputs import session_infos
from polar_cli.export import session_trajectory
from tests.support.harbor_atif import Trajectory


def check_atif_export(store: str, session_ids: list[str] | None = None) -> dict[str, Trajectory]:
    """Every session of ``store`` (or those named) exported to ATIF, through JSON, validated by Harbor's models,
    each tool result paired with its call (none left to a system step), and Harbor's serialization equal to polar's
    (no field Harbor does not know, none it would drop). Returns the trajectories by session id."""
    sessions = session_infos(store)
    by_session: dict[str, list] = {}
    for record in iter_records(store, session_ids=session_ids):
        by_session.setdefault(record.session_id, []).append(record)
    out: dict[str, Trajectory] = {}
    for session_id, records in by_session.items():
        trajectory = session_trajectory(session_id, records, sessions.get(session_id))
        if trajectory is None:
            continue
        data = orjson.loads(orjson.dumps(trajectory))
        model = Trajectory.model_validate(data)
        assert model.to_json_dict() == data, session_id
        for part in [model, *(model.subagent_trajectories or [])]:
            orphans = [s.step_id for s in part.steps if s.source == "system" and s.observation is not None]
            assert not orphans, f"{session_id}: tool results answering no call at steps {orphans}"
        out[session_id] = model
    return out
