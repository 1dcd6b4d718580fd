"""Unit tests of token id packing and the engine's id text (issue 29 mutation round)."""

from __future__ import annotations

import array
import struct

import pytest

from polar_addon.token_ids import INT32_MAX, IdText, pack_token_ids

# --- pack_token_ids --------------------------------------------------------------------------------------------


def test_ids_pack_as_native_int32() -> None:
    assert INT32_MAX == 2_147_483_647
    assert pack_token_ids([1, -2, INT32_MAX, -INT32_MAX - 1], "ids") == struct.pack(
        "=4i", 1, -2, INT32_MAX, -INT32_MAX - 1
    )
    assert pack_token_ids([], "ids") == b""
    assert pack_token_ids((5,), "ids") == (5).to_bytes(4, "little" if struct.pack("=i", 1)[0] else "big")


def test_an_int32_array_and_an_id_text_pack_as_they_are() -> None:
    assert pack_token_ids(array.array("i", [3, 4]), "ids") == struct.pack("=2i", 3, 4)
    assert pack_token_ids(array.array("q", [3, 4]), "ids") == struct.pack("=2i", 3, 4)  # repacked as int32
    assert pack_token_ids(IdText(b"3,4"), "ids") == struct.pack("=2i", 3, 4)


@pytest.mark.parametrize("bad", [INT32_MAX + 1, -INT32_MAX - 2])
def test_an_id_past_int32_is_a_value_error_naming_the_field(bad: int) -> None:
    with pytest.raises(ValueError, match=r"^prompt_ids holds a token id outside int32: ") as info:
        pack_token_ids([1, bad], "prompt_ids")
    assert not isinstance(info.value, TypeError)
    assert isinstance(info.value.__cause__, struct.error)


@pytest.mark.parametrize("bad", [1.0, "7", None])
def test_a_non_integer_id_is_a_type_error_naming_the_field(bad: object) -> None:
    with pytest.raises(TypeError, match=r"^output_ids must hold integers: .*not an integer") as info:
        pack_token_ids([1, bad], "output_ids")  # type: ignore[list-item]
    assert isinstance(info.value.__cause__, struct.error)


# --- IdText ----------------------------------------------------------------------------------------------------


def test_id_text_reads_its_ids_lazily_and_once() -> None:
    text = IdText(bytearray(b"17,4,93"))
    assert type(text.text) is bytes and text.text == b"17,4,93"
    assert len(text) == 3
    assert text._ids is None  # nothing parsed yet
    ids = text.ids()
    assert ids.typecode == "i" and list(ids) == [17, 4, 93]
    assert text.ids() is ids
    assert text.tobytes() == struct.pack("=3i", 17, 4, 93)
    assert (text[0], text[-1], list(text[1:])) == (17, 93, [4, 93])
    assert list(iter(text)) == [17, 4, 93]
    assert repr(text) == "IdText(3 ids)"


def test_one_id_and_no_ids() -> None:
    one = IdText(b"0")
    assert (len(one), list(one)) == (1, [0])
    empty = IdText(b"")
    assert (len(empty), list(empty), empty.tobytes()) == (0, [], b"")
    assert repr(empty) == "IdText(0 ids)"


@pytest.mark.parametrize(
    "bad", [b",1", b"1,", b",", b"1,,2", b"1,2,,3", b"-1", b"1 2", b"[1,2]", b"1.5", b"a", b"1,2/", b"9:"]
)
def test_anything_but_digits_and_single_commas_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError, match="^not a compact JSON array of non-negative integers$"):
        IdText(bad)
    assert IdText.parse(bad) is None


def test_parse_returns_the_id_text_when_it_is_valid() -> None:
    parsed = IdText.parse(b"1,22,333")
    assert isinstance(parsed, IdText) and list(parsed) == [1, 22, 333]


@pytest.mark.parametrize("text", [b"2147483648", b"1,99999999999999999999999"])
def test_an_id_past_int32_is_refused_when_read(text: bytes) -> None:
    ids = IdText(text)  # the syntax is fine: the value is checked on first use
    with pytest.raises(ValueError, match="^a token id does not fit int32$"):
        ids.ids()
    with pytest.raises(ValueError, match="^a token id does not fit int32$"):
        pack_token_ids(ids, "ids")


def test_the_largest_int32_id_is_read() -> None:
    assert list(IdText(b"0,2147483647")) == [0, INT32_MAX]


def test_equality_with_id_text_and_id_sequences() -> None:
    text = IdText(b"5,6")
    assert text == IdText(b"5,6")
    assert text != IdText(b"5,7")
    assert text == [5, 6] and text == (5, 6) and text == array.array("i", [5, 6])
    assert text != [5, 6, 7] and text != [5] and text != [6, 5]
    assert IdText(b"") == [] and IdText(b"") != [0]
    assert text.__eq__("5,6") is NotImplemented
    assert text != "5,6"
    with pytest.raises(TypeError):
        hash(text)


def test_comparing_with_a_list_of_another_length_does_not_parse_the_text() -> None:
    text = IdText(b"2147483648")  # parsing it would raise
    assert text != [1, 2]


def test_only_a_signed_int32_array_skips_the_check() -> None:
    # An unsigned array holds ids past int32 that its raw bytes would carry in as negative ids.
    with pytest.raises(ValueError, match="^ids holds a token id outside int32: "):
        pack_token_ids(array.array("I", [1, INT32_MAX + 1]), "ids")
    assert pack_token_ids(array.array("I", [1, INT32_MAX]), "ids") == struct.pack("=2i", 1, INT32_MAX)
