import base64

import pytest

from polar_addon import identity
from polar_addon.canonical import PolarError


def basic(user: str, password: str | None = None) -> str:
    raw = user if password is None else f"{user}:{password}"
    return "Basic " + base64.b64encode(raw.encode()).decode()


def test_proxy_credentials_win_over_headers_and_keys():
    ident = identity.resolve(
        basic("sess-1", "task=t1;group=g1;sample=3"),
        {"x-polar-session": "hdr", "authorization": "Bearer polar:key"},
        "conn",
    )
    assert (ident.session_id, ident.task_id, ident.group_id, ident.sample_index, ident.source) == (
        "sess-1",
        "t1",
        "g1",
        3,
        "proxy_auth",
    )


def test_proxy_user_alone_and_percent_encoding():
    ident = identity.resolve(basic("my%3Asession"), {}, "conn")
    assert ident.session_id == "my:session" and ident.task_id is None


def test_headers_then_api_key():
    ident = identity.resolve(None, {"x-polar-session": "h", "x-polar-group": "g", "x-polar-sample": "0"}, "c")
    assert (ident.session_id, ident.group_id, ident.sample_index, ident.source) == ("h", "g", 0, "header")
    ident = identity.resolve(None, {"x-api-key": "polar:session=s9;task=t"}, "c")
    assert (ident.session_id, ident.task_id, ident.source) == ("s9", "t", "api_key")
    ident = identity.resolve(None, {"authorization": "Bearer polar:plain"}, "c")
    assert ident.session_id == "plain"


def test_ordinary_api_keys_are_never_an_identity():
    ident = identity.resolve(
        None, {"authorization": "Bearer sk-secret", "x-api-key": "sk-ant-secret"}, "0123456789abcdef"
    )
    assert ident.source == "generated" and ident.session_id == "anon-0123456789ab"
    assert "secret" not in ident.session_id


@pytest.mark.parametrize("bad", ["session=s;colour=red", "session=s;sample=x"])
def test_bad_fields_are_a_clear_400(bad):
    with pytest.raises(PolarError) as info:
        identity.resolve(None, {"authorization": f"Bearer polar:{bad}"}, "c")
    assert info.value.status == 400 and "polar identity" in info.value.message


@pytest.mark.parametrize("header", ["authorization", "x-api-key", "x-goog-api-key"])
def test_each_provider_key_header_carries_a_polar_identity(header):
    """OpenAI clients send Authorization: Bearer, Anthropic x-api-key, Gemini x-goog-api-key."""
    value = "Bearer polar:session=k1;group=g" if header == "authorization" else "polar:session=k1;group=g"
    ident = identity.resolve(None, {header: value}, "conn")
    assert (ident.session_id, ident.group_id, ident.source) == ("k1", "g", "api_key")


def test_an_authorization_header_without_bearer_is_no_key():
    ident = identity.resolve(None, {"authorization": "polar:s1"}, "0123456789abcdef")
    assert ident.source == "generated"


@pytest.mark.parametrize("value", ["Digest polar", "Bearer abc", "Basicpolar"])
def test_a_non_basic_proxy_authorization_is_ignored(value):
    ident = identity.resolve(value, {"x-polar-session": "hdr"}, "conn")
    assert (ident.session_id, ident.source) == ("hdr", "header")


@pytest.mark.parametrize("token", ["%%%not-base64", base64.b64encode(b"\xff\xfe:x").decode()])
def test_a_malformed_basic_proxy_authorization_is_a_clear_400(token):
    with pytest.raises(PolarError) as info:
        identity.resolve(f"Basic {token}", {"x-polar-session": "hdr"}, "conn")
    assert info.value.status == 400 and info.value.kind == "invalid_request"
    assert "Proxy-Authorization" in info.value.message


def test_basic_scheme_is_case_insensitive_and_an_empty_user_takes_the_password_session():
    ident = identity.resolve("basic " + base64.b64encode(b":session=p1;sample=2").decode(), {}, "conn")
    assert (ident.session_id, ident.sample_index, ident.source) == ("p1", 2, "proxy_auth")


@pytest.mark.parametrize(
    "proxy_password,api_key",
    [("session=s;hunter2-xyz", None), ("sample=hunter2-xyz", None), (None, "polar:session=s;hunter2=1")],
)
def test_errors_never_quote_the_credentials(proxy_password, api_key):
    header = proxy_password and "Basic " + base64.b64encode(f"user:{proxy_password}".encode()).decode()
    with pytest.raises(PolarError) as info:
        identity.resolve(header, {"x-api-key": api_key} if api_key else {}, "c")
    assert info.value.status == 400 and "hunter2" not in info.value.message


def test_values_keep_their_own_separators():
    """Only the first '=' splits a field and the first ':' splits the proxy credentials."""
    # Session ids cannot hold '=' (they match [A-Za-z0-9][A-Za-z0-9_.:-]{0,127}); task ids can.
    ident = identity.resolve(None, {"x-api-key": "polar:session=a:b;task=t=1:2"}, "c")
    assert (ident.session_id, ident.task_id) == ("a:b", "t=1:2")
    ident = identity.resolve(basic("s1", "task=t:1;group=g"), {}, "c")
    assert (ident.session_id, ident.task_id, ident.group_id) == ("s1", "t:1", "g")


def test_an_empty_sample_is_no_sample_and_every_header_field_is_read():
    assert identity.resolve(None, {"x-api-key": "polar:session=s;sample="}, "c").sample_index is None
    ident = identity.resolve(
        None, {"x-polar-session": "h", "x-polar-task": "t", "x-polar-group": "g", "x-polar-sample": "4"}, "c"
    )
    assert (ident.task_id, ident.group_id, ident.sample_index) == ("t", "g", 4)


def test_only_a_bearer_authorization_is_read_as_a_key():
    # Seven characters before "polar:" that are not "Bearer ": still not a key.
    assert identity.resolve(None, {"authorization": "Token: polar:s1"}, "0123456789abcdef").source == "generated"
    assert identity.resolve(None, {"authorization": "bearer polar:s1"}, "c").session_id == "s1"


def test_extra_spaces_after_basic_are_tolerated():
    ident = identity.resolve("Basic  " + base64.b64encode(b"s2:").decode() + " ", {}, "c")
    assert (ident.session_id, ident.source) == ("s2", "proxy_auth")


@pytest.mark.parametrize("key", ["polar:session=s;colour=red", "polar:session=s;sample=x"])
def test_identity_errors_are_invalid_requests(key):
    with pytest.raises(PolarError) as info:
        identity.resolve(None, {"x-api-key": key}, "c")
    assert (info.value.status, info.value.kind) == (400, "invalid_request")


def _refusal(headers: dict[str, str], auth: str | None = None) -> str:
    with pytest.raises(PolarError) as err:
        identity.resolve(auth, headers, "c")
    return err.value.message


def test_labels_are_at_most_256_printable_characters():
    assert identity.resolve(None, {"x-polar-session": "h", "x-polar-task": "a" * 256}, "c").task_id == "a" * 256
    for field, value in (("task", "a" * 257), ("group", "g\x01")):
        assert _refusal({"x-polar-session": "h", f"x-polar-{field}": value}) == (
            f"polar identity: {field} must be at most 256 printable characters"
        )


def test_the_sample_index_bound_and_the_exact_refusals():
    assert (
        identity.resolve(None, {"x-polar-session": "h", "x-polar-sample": "2147483647"}, "c").sample_index == 2**31 - 1
    )
    assert _refusal({"x-polar-session": "h", "x-polar-sample": "2147483648"}) == (
        "polar identity: sample must be an integer from 0 to 2147483647"
    )
    assert _refusal({"x-polar-session": "-bad"}) == (
        "polar identity: session id must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
    )
    assert _refusal({"x-api-key": "polar:session=s;colour=red"}) == (
        "polar identity: cannot read the session fields (key=value pairs joined by ';', keys: session, task, group, "
        "sample)"
    )
