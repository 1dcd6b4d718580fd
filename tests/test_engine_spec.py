"""The engine spec ``KIND:TARGET?KEY=VALUE`` (polar_addon.engines.spec): parsed in one place, hostile input refused
with a message naming the spec, and ``str`` giving back the spec it was parsed from."""

from __future__ import annotations

import pytest

from polar_addon.engines import EnginePool, make_engine
from polar_addon.engines.spec import EngineSpec
from polar_cli.rollout.loop import engine_kind
from polar_cli.rollout.window import engine_window


@pytest.mark.parametrize(
    ("text", "kind", "target", "params"),
    [
        ("vllm:http://127.0.0.1:8000", "vllm", "http://127.0.0.1:8000", {}),
        ("sglang:http://gpu1:30000?weight_version=3", "sglang", "http://gpu1:30000", {"weight_version": "3"}),
        ("vllm:https://u@h:1/v1/x:y?weight_version=a:b", "vllm", "https://u@h:1/v1/x:y", {"weight_version": "a:b"}),
        ("local:m/tiny?max_len=64&weight_version=2", "local", "m/tiny", {"max_len": "64", "weight_version": "2"}),
        ("local:/m?weight_version=v?1", "local", "/m", {"weight_version": "v?1"}),  # options start at the first ?
        ("  scripted:/tmp/run.json  ", "scripted", "/tmp/run.json", {}),
        ("local:/m?&max_len=8&", "local", "/m", {"max_len": "8"}),  # empty parts are nothing
        ("local:/m?weight_version=", "local", "/m", {"weight_version": ""}),
    ],
)  # fmt: skip
def test_a_spec_parses_into_kind_target_and_params(text: str, kind: str, target: str, params: dict) -> None:
    spec = EngineSpec.parse(text)
    assert (spec.kind, spec.target, spec.params) == (kind, target, params)
    assert EngineSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "text", ["vllm:http://127.0.0.1:8000", "sglang:http://h:1?weight_version=3", "local:m?max_len=64&weight_version=2"]
)
def test_str_gives_back_the_spec(text: str) -> None:
    assert str(EngineSpec.parse(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "must look like KIND:TARGET"),
        ("   ", "must look like KIND:TARGET"),
        ("vllm", "must look like KIND:TARGET"),
        ("vllm:", "must look like KIND:TARGET"),
        (":http://h:1", "must look like KIND:TARGET"),  # no kind
        ("http://h:1", "unknown engine kind 'http'"),  # a bare URL: its scheme is no kind
        ("tgi:http://h:1", "unknown engine kind 'tgi'"),
        ("VLLM:http://h:1", "unknown engine kind 'VLLM'"),
        ("vllm:?weight_version=3", "empty target"),
        ("local:/m?max_len=1&max_len=2", "'max_len' is given twice"),
        ("vllm:http://h:1?weight_version=1&weight_version=1", "'weight_version' is given twice"),
        (
            "vllm:http://h:1?version=4",
            r"unknown option\(s\) \['version'\] \(vllm takes weight_version, versions, model\)",
        ),
        ("vllm:http://h:1?max_len=4", r"unknown option\(s\) \['max_len'\]"),
        ("local:/m?version=3", r"local takes max_len, weight_version"),
        ("scripted:/s.json?weight_version=1", "scripted takes no options"),
        ("local:/m?max_len", "'max_len' must look like KEY=VALUE"),
        ("local:/m?=3", "'=3' must look like KEY=VALUE"),
        ("local:/m?max_len=-1", "max_len must be a whole number"),
        ("local:/m?max_len=big", "max_len must be a whole number"),
    ],
)
def test_a_malformed_spec_is_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        EngineSpec.parse(text)
    assert repr(text) in str(refused.value)  # the message names the spec the user wrote


def test_a_pool_spec_is_its_comma_separated_specs() -> None:
    specs = EngineSpec.parse_list("vllm:http://a:1, sglang:http://b:2?weight_version=7,")
    assert [str(s) for s in specs] == ["vllm:http://a:1", "sglang:http://b:2?weight_version=7"]
    with pytest.raises(ValueError, match="unknown engine kind 'x'"):
        EngineSpec.parse_list("vllm:http://a:1,x:y")
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool.from_spec(" , ")


def test_with_params_sets_and_drops_options() -> None:
    spec = EngineSpec.parse("local:/m?max_len=8")
    assert str(spec.with_params(weight_version="3")) == "local:/m?max_len=8&weight_version=3"
    assert str(spec.with_params(max_len=None)) == "local:/m"
    assert (spec.max_len, spec.weight_version) == (8, None)
    assert EngineSpec.parse("local:/m").max_len == 0


def test_every_reader_of_a_spec_refuses_what_the_parser_refuses() -> None:
    with pytest.raises(ValueError, match="must look like KIND:TARGET"):
        make_engine("vllm", timeout_s=1)
    with pytest.raises(ValueError, match="unknown engine kind"):
        make_engine("tgi:http://h:1", timeout_s=1)
    engine = make_engine("vllm:http://127.0.0.1:9?weight_version=4", timeout_s=1)
    assert (engine.name, engine.weight_version) == ("vllm:http://127.0.0.1:9", "4")  # type: ignore[attr-defined]
    assert engine_window("tgi:http://h:1,vllm:?weight_version=1") is None  # the proxy refuses those itself
    assert engine_kind("sglang:http://h:1?weight_version=2") == "sglang"
    for bad in ("sglang:h:1", "sglang", "tgi:http://h:1", "sglang:http://h:1?version=2"):
        with pytest.raises(ValueError, match="--engine must be"):
            engine_kind(bad)
