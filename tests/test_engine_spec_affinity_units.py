"""Unit tests of the engine spec parser and the session/engine affinity bookkeeping (issue 29 mutation round)."""

from __future__ import annotations

import dataclasses

import pytest

from polar_addon.engines import affinity as affinity_module
from polar_addon.engines.affinity import Affinity, NoLiveEngine, SessionLost
from polar_addon.engines.spec import SHAPE, EngineSpec

# --- EngineSpec.parse ------------------------------------------------------------------------------------------


def test_a_spec_keeps_the_colons_of_its_url_target() -> None:
    spec = EngineSpec.parse(" vllm:http://h:8000?weight_version=3 ")
    assert (spec.kind, spec.target, spec.params) == ("vllm", "http://h:8000", {"weight_version": "3"})


@pytest.mark.parametrize("text", ["vllm", ":http://h", "vllm:", "  vllm:  "])
def test_a_spec_without_kind_colon_or_rest_is_refused_with_its_shape(text: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineSpec.parse(text)
    assert str(info.value) == f"engine spec {text!r} must look like {SHAPE}"


def test_an_unknown_kind_names_the_kinds_there_are() -> None:
    with pytest.raises(ValueError) as info:
        EngineSpec.parse("tgi:http://h")
    assert str(info.value) == "unknown engine kind 'tgi' in 'tgi:http://h': use sglang, vllm, local, scripted"


def test_an_empty_target_before_the_options_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        EngineSpec.parse("vllm:?weight_version=3")
    assert str(info.value) == f"engine spec 'vllm:?weight_version=3' has an empty target: it must look like {SHAPE}"


def test_empty_options_are_skipped_and_a_value_keeps_its_equals_signs() -> None:
    assert EngineSpec.parse("vllm:u?").params == {}
    spec = EngineSpec.parse("local:d?&weight_version=a=b&&max_len=8&")
    assert spec.params == {"weight_version": "a=b", "max_len": "8"}
    assert spec.target == "d"


@pytest.mark.parametrize("option", ["weight_version", "=3"])
def test_an_option_must_be_key_equals_value(option: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineSpec.parse(f"vllm:u?{option}")
    assert str(info.value) == f"engine spec 'vllm:u?{option}': option {option!r} must look like KEY=VALUE"


def test_an_option_given_twice_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        EngineSpec.parse("vllm:u?weight_version=3&weight_version=4")
    assert str(info.value) == (
        "engine spec 'vllm:u?weight_version=3&weight_version=4': option 'weight_version' is given twice"
    )


def test_an_empty_value_is_a_value() -> None:
    assert EngineSpec.parse("vllm:u?weight_version=").params == {"weight_version": ""}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm:u?max_len=3", "unknown option(s) ['max_len'] (vllm takes weight_version, versions, model)"),
        ("local:d?b=1&a=2", "unknown option(s) ['a', 'b'] (local takes max_len, weight_version)"),
        ("scripted:r.json?x=1", "unknown option(s) ['x'] (scripted takes no options)"),
    ],
)
def test_unknown_options_are_named_with_what_the_kind_takes(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineSpec.parse(text)
    assert str(info.value) == f"engine spec {text!r}: {message}"


@pytest.mark.parametrize("value", ["6x", "", "-1", "1.5"])
def test_max_len_must_be_a_whole_number(value: str) -> None:
    text = f"local:d?max_len={value}"
    with pytest.raises(ValueError) as info:
        EngineSpec.parse(text)
    assert str(info.value) == f"engine spec {text!r}: max_len must be a whole number of tokens, not {value!r}"


def test_max_len_and_weight_version_read_back() -> None:
    spec = EngineSpec.parse("local:d?max_len=64&weight_version=7")
    assert (spec.max_len, spec.weight_version) == (64, "7")
    bare = EngineSpec.parse("local:d")
    assert (bare.max_len, bare.weight_version, bare.params) == (0, None, {})
    assert EngineSpec.parse("local:d?max_len=0").max_len == 0


def test_parse_list_splits_on_commas_and_skips_blank_entries() -> None:
    specs = EngineSpec.parse_list(" vllm:http://a:1 , ,sglang:http://b:2?weight_version=2,")
    assert [(s.kind, s.target, s.params) for s in specs] == [
        ("vllm", "http://a:1", {}),
        ("sglang", "http://b:2", {"weight_version": "2"}),
    ]
    assert EngineSpec.parse_list("") == []
    with pytest.raises(ValueError, match="unknown engine kind 'x'"):
        EngineSpec.parse_list("vllm:u,x:y")


def test_with_params_sets_overrides_and_drops_options_without_touching_the_original() -> None:
    spec = EngineSpec.parse("local:d?max_len=64&weight_version=1")
    changed = spec.with_params(weight_version="2", max_len=None)
    assert changed.params == {"weight_version": "2"}
    assert (changed.kind, changed.target) == ("local", "d")
    assert spec.params == {"max_len": "64", "weight_version": "1"}
    assert spec.with_params().params == spec.params
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kind = "vllm"  # type: ignore[misc]


def test_a_spec_prints_back_as_it_parses() -> None:
    assert str(EngineSpec.parse("local:d?max_len=64&weight_version=3")) == "local:d?max_len=64&weight_version=3"
    assert str(EngineSpec.parse("vllm:http://h:8000")) == "vllm:http://h:8000"
    assert str(EngineSpec.parse("vllm:http://h:8000?")) == "vllm:http://h:8000"
    assert EngineSpec("vllm", "u").params == {}


# --- Affinity --------------------------------------------------------------------------------------------------


def test_the_pool_needs_an_engine_and_a_strike() -> None:
    with pytest.raises(ValueError, match="^at least one engine is required$"):
        Affinity(0)
    with pytest.raises(ValueError, match="^max_strikes must be at least 1$"):
        Affinity(2, max_strikes=0)
    one = Affinity(1, max_strikes=1)
    assert (one.max_strikes, one.load()) == (1, [0])


def test_the_defaults() -> None:
    pool = Affinity(2)
    assert (pool.max_strikes, pool.revive_after_s, pool.max_sessions) == (3, 60.0, 100_000)
    assert (affinity_module.MAX_STRIKES, affinity_module.REVIVE_AFTER_S, affinity_module.MAX_SESSIONS) == (
        3,
        60.0,
        100_000,
    )


def test_a_new_session_goes_to_the_least_loaded_engine_lowest_index_first_and_sticks() -> None:
    pool = Affinity(3)
    assert [pool.engine_for(s, 0.0) for s in "abcd"] == [0, 1, 2, 0]
    assert pool.load() == [2, 1, 1]
    pool.release("b")
    assert pool.load() == [2, 0, 1]
    assert pool.engine_for("e", 0.0) == 1
    assert pool.engine_for("a", 0.0) == 0  # a known session stays, whatever the load
    assert pool.load() == [2, 1, 1]
    assert len(pool) == 4


def test_release_of_an_unknown_session_changes_nothing() -> None:
    pool = Affinity(2)
    pool.engine_for("a", 0.0)
    pool.release("zzz")
    assert (pool.load(), len(pool)) == ([1, 0], 1)


def test_the_least_recently_used_session_is_forgotten_past_max_sessions() -> None:
    pool = Affinity(2, max_sessions=2)
    pool.engine_for("a", 0.0)  # engine 0
    pool.engine_for("b", 0.0)  # engine 1
    pool.engine_for("a", 0.0)  # a is now the most recently used
    assert pool.engine_for("c", 0.0) == 0
    assert len(pool) == 2
    assert pool.load() == [2, 0]  # b was forgotten, its slot freed
    assert pool.engine_for("b", 0.0) == 1  # b is new again
    assert pool.load() == [1, 1]  # and a was the oldest then


def test_faults_take_an_engine_out_at_max_strikes_and_a_success_resets_the_count() -> None:
    pool = Affinity(2, max_strikes=3)
    for session in "abc":
        pool.engine_for(session, 0.0)  # a, c -> 0; b -> 1
    assert pool.failed(0, 1.0) is None
    assert pool.failed(0, 1.0) is None
    pool.succeeded(0)
    assert pool.failed(0, 1.0) is None
    assert pool.failed(0, 1.0) is None
    assert not pool.is_out(0)
    assert pool.failed(0, 5.0) == ["a", "c"]
    assert pool.is_out(0) and not pool.is_out(1)
    assert pool.load() == [0, 1]
    assert len(pool) == 1
    assert pool.failed(0, 6.0) is None  # already out


def test_a_refused_connection_takes_an_engine_out_at_once() -> None:
    pool = Affinity(2, max_strikes=3)
    pool.engine_for("a", 0.0)
    assert pool.failed(0, 1.0, refused=True) == ["a"]
    assert pool.is_out(0)


def test_a_lost_session_is_refused_with_its_engine_until_released() -> None:
    pool = Affinity(2, max_strikes=1)
    pool.engine_for("a", 0.0)
    pool.engine_for("b", 0.0)
    assert pool.failed(1, 1.0) == ["b"]
    with pytest.raises(SessionLost) as info:
        pool.engine_for("b", 2.0)
    assert info.value.engine == 1 and info.value.args == (1,)
    pool.release("b")
    assert pool.engine_for("b", 2.0) == 0  # a new session now, on a live engine


def test_a_pool_of_one_engine_takes_nothing_out() -> None:
    pool = Affinity(1, max_strikes=1)
    pool.engine_for("a", 0.0)
    assert pool.failed(0, 1.0, refused=True) is None
    assert not pool.is_out(0)
    assert pool.engine_for("a", 2.0) == 0


def test_an_engine_comes_back_exactly_revive_after_s_later_on_probation() -> None:
    pool = Affinity(2, max_strikes=3, revive_after_s=60.0)
    pool.engine_for("a", 0.0)
    assert pool.failed(0, 100.0, refused=True) == ["a"]
    assert pool.engine_for("b", 159.9) == 1  # not yet: engine 0 has fewer sessions but is out
    assert pool.engine_for("c", 160.0) == 0  # due back at the limit
    assert not pool.is_out(0)
    assert pool.load() == [1, 1]
    assert pool.failed(0, 161.0) == ["c"]  # on probation: one fault takes it out again


def test_a_revived_engine_that_succeeds_leaves_probation() -> None:
    pool = Affinity(2, max_strikes=3, revive_after_s=10.0)
    pool.engine_for("a", 0.0)
    pool.failed(0, 0.0, refused=True)
    pool.engine_for("b", 0.0)  # engine 1
    assert pool.engine_for("c", 10.0) == 0
    pool.succeeded(0)
    assert pool.failed(0, 11.0) is None
    assert pool.failed(0, 11.0) is None
    assert pool.failed(0, 11.0) == ["c"]


def test_no_live_engine_when_every_engine_is_out_and_none_is_due() -> None:
    pool = Affinity(2, revive_after_s=30.0)
    pool.failed(0, 0.0, refused=True)
    pool.failed(1, 10.0, refused=True)
    with pytest.raises(NoLiveEngine):
        pool.engine_for("a", 29.0)
    assert pool.engine_for("a", 30.0) == 0  # the first one out is due first


def test_the_lost_sessions_remembered_are_capped_oldest_first() -> None:
    pool = Affinity(3, max_strikes=1, max_sessions=2)
    pool.engine_for("a", 0.0)  # 0
    pool.engine_for("b", 0.0)  # 1
    pool.failed(0, 1.0)
    pool.failed(1, 1.0)
    pool.engine_for("c", 2.0)  # 2
    pool.engine_for("d", 2.0)  # 2
    assert pool.failed(2, 3.0) == ["c", "d"]
    with pytest.raises(SessionLost):
        pool.engine_for("d", 4.0)
    with pytest.raises(SessionLost):
        pool.engine_for("c", 4.0)
    with pytest.raises(NoLiveEngine):  # a and b were forgotten: they are new sessions, with no engine to take them
        pool.engine_for("a", 4.0)
