"""Session affinity across several engines (polar_addon.engines.affinity): sticky, least-loaded for new
sessions, and an engine that fails is taken out with its sessions lost, never moved."""

from __future__ import annotations

import pytest

from polar_addon.canonical import EngineFault, PolarError
from polar_addon.engines import EnginePool
from polar_addon.engines.affinity import Affinity, NoLiveEngine, SessionLost


def test_sessions_stick_and_new_ones_go_to_the_least_loaded_engine() -> None:
    a = Affinity(3)
    first = [a.engine_for(f"s{i}", 0.0) for i in range(6)]
    assert first == [0, 1, 2, 0, 1, 2]
    assert [a.engine_for(f"s{i}", 1.0) for i in range(6)] == first  # sticky
    a.release("s0")
    a.release("s3")
    assert a.load() == [0, 2, 2]
    assert a.engine_for("new", 2.0) == 0


def test_refused_engine_is_out_at_once_and_only_its_sessions_are_lost() -> None:
    a = Affinity(2)
    assert [a.engine_for(s, 0.0) for s in ("a", "b", "c", "d")] == [0, 1, 0, 1]
    assert a.failed(1, 5.0, refused=True) == ["b", "d"]
    assert a.is_out(1) and not a.is_out(0)
    for session in ("b", "d"):
        with pytest.raises(SessionLost) as lost:
            a.engine_for(session, 6.0)
        assert lost.value.engine == 1
    assert a.engine_for("a", 6.0) == 0 and a.engine_for("c", 6.0) == 0
    assert [a.engine_for(f"new{i}", 6.0) for i in range(3)] == [0, 0, 0]  # new sessions only go to live engines
    assert a.failed(1, 7.0) is None  # already out: nothing more is lost


def test_faults_in_a_row_take_an_engine_out_and_a_success_resets_the_count() -> None:
    a = Affinity(2, max_strikes=3)
    a.engine_for("x", 0.0)  # engine 0
    assert a.failed(0, 1.0) is None and a.failed(0, 1.0) is None
    a.succeeded(0)
    assert a.failed(0, 2.0) is None and a.failed(0, 2.0) is None
    assert a.failed(0, 3.0) == ["x"]


def test_an_engine_out_takes_new_sessions_again_after_a_while_on_probation() -> None:
    a = Affinity(2, revive_after_s=60.0)
    a.engine_for("old", 0.0)
    assert a.failed(0, 10.0, refused=True) == ["old"]
    assert a.engine_for("s1", 69.0) == 1 and a.engine_for("s2", 69.0) == 1
    assert a.engine_for("s3", 70.0) == 0  # due back, and the least loaded
    assert not a.is_out(0)
    assert a.failed(0, 71.0) == ["s3"]  # on probation: one fault and it is out again
    with pytest.raises(SessionLost):
        a.engine_for("old", 200.0)  # a lost session stays lost when its engine comes back


def test_every_engine_out_refuses_new_sessions() -> None:
    a = Affinity(2, revive_after_s=60.0)
    a.failed(0, 0.0, refused=True)
    a.failed(1, 0.0, refused=True)
    with pytest.raises(NoLiveEngine):
        a.engine_for("s", 30.0)


def test_a_single_engine_is_never_taken_out() -> None:
    a = Affinity(1, max_strikes=1)
    a.engine_for("s", 0.0)
    assert a.failed(0, 1.0, refused=True) is None
    assert a.engine_for("s", 2.0) == 0


def test_ended_and_forgotten_sessions_free_their_slot() -> None:
    a = Affinity(2, max_sessions=2)
    for s in ("a", "b", "c"):
        a.engine_for(s, 0.0)
    assert len(a) == 2 and sum(a.load()) == 2  # "a" forgotten, oldest first
    a.failed(1, 1.0, refused=True)  # "b" lost
    a.release("b")  # its end is posted: forgotten, a new session of that name is a new session
    assert a.engine_for("b", 2.0) == 0


class Named:
    def __init__(self, name: str) -> None:
        self.name = name


def test_pool_counts_only_the_engines_own_faults_and_words_errors_for_clients() -> None:
    e0, e1 = Named("sglang:http://10.0.0.1:30000"), Named("sglang:http://10.0.0.2:30000")
    pool = EnginePool([e0, e1], max_strikes=1)  # type: ignore[list-item]
    assert [pool.for_session(s).name for s in ("a", "b")] == [e0.name, e1.name]
    # Busy, timeouts and bad requests are not the engine dying.
    for err in (
        PolarError(503, "overloaded", "busy"),
        PolarError(504, "timeout", "slow"),
        PolarError(400, "invalid_request", "x"),
    ):
        assert pool.failed(e1, err) == []
    assert pool.for_session("b") is e1
    assert pool.failed(e1, EngineFault(502, "api_error", "engine error 500: boom")) == ["b"]
    with pytest.raises(PolarError) as err:
        pool.for_session("b")
    assert (err.value.status, err.value.kind) == (502, "api_error")
    assert "10.0.0.2" not in err.value.message  # clients never learn where the engine lives
    assert pool.for_session("c") is e0
