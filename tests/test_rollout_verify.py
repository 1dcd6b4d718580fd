"""What a verifier's run means as rewards (polar_cli.rollout.verify), pure: the exact messages a user reads (each
names the file it is about), the bounds exactly at their limits, the reward file read on the host without following
a link, the guard's verdict and the verifier's env."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from polar_cli.rollout import verify
from polar_cli.rollout.verify import (
    GUARD_CLEAN,
    GUARD_LEFT,
    NoReward,
    VerifierError,
    file_rewards,
    guard_left,
    harbor_rewards,
    outcome,
    parse_reward_json,
    parse_reward_text,
    read_reward_file,
    resolve_env,
)

TXT, JSON = "/logs/verifier/reward.txt", "/logs/verifier/reward.json"
RANGE = "is not a finite number within +-1e+06"


def _no_reward(call, *args, **kwargs) -> str:
    with pytest.raises(NoReward) as info:
        call(*args, **kwargs)
    return str(info.value)


# ---- reward text and JSON -------------------------------------------------------------------------------------


def test_reward_text_messages_name_the_file() -> None:
    assert _no_reward(parse_reward_text, " \n", "r.txt") == "r.txt is empty"
    long = "x" * 100
    assert _no_reward(parse_reward_text, f" {long}\n", "r.txt") == f"r.txt is not a number: {'x' * 80!r}"
    assert _no_reward(parse_reward_text, "nan", "r.txt") == f"r.txt: reward nan {RANGE}"
    assert _no_reward(parse_reward_text, "-inf", "r.txt") == f"r.txt: reward -inf {RANGE}"
    assert _no_reward(parse_reward_text, "1000001", "r.txt") == f"r.txt: reward 1000001.0 {RANGE}"
    assert parse_reward_text(" 0.25\n", "r.txt") == 0.25


def test_a_reward_exactly_at_the_limit_is_accepted() -> None:
    assert parse_reward_text("1000000", "r") == 1e6
    assert parse_reward_text("-1e6", "r") == -1e6
    assert parse_reward_json('{"a": 1000000}', "j") == {"a": 1e6}


def test_reward_json_messages_name_the_file_and_the_entry() -> None:
    assert _no_reward(parse_reward_json, "  ", "j.json") == "j.json is empty"
    assert _no_reward(parse_reward_json, "{", "j.json").startswith("j.json is not valid JSON (")
    assert _no_reward(parse_reward_json, "[1]", "j.json") == "j.json must be a JSON object of name -> number"
    assert _no_reward(parse_reward_json, '{"a": 1e400}', "j.json") == f"j.json['a']: reward inf {RANGE}"
    assert _no_reward(parse_reward_json, '{"b": -2000000}', "j.json") == f"j.json['b']: reward -2000000.0 {RANGE}"


def test_json_deeper_than_the_parser_allows_is_no_reward() -> None:
    assert _no_reward(parse_reward_json, "[" * 100_000 + "]" * 100_000, "deep.json") == "deep.json is nested too deeply"


def test_an_integer_beyond_any_float_is_cut_in_the_message() -> None:
    huge = "1" + "0" * 400
    message = _no_reward(parse_reward_json, f'{{"big": {huge}}}', "j.json")
    assert message == f"j.json['big']: reward {huge[:40]}... {RANGE}"


def test_reward_json_ignores_booleans_strings_and_non_numbers() -> None:
    assert parse_reward_json('{"a": true, "b": "1", "c": null, "d": [1], "e": 0.5, "f": 2}', "j") == {
        "e": 0.5,
        "f": 2.0,
    }


# ---- outcome ---------------------------------------------------------------------------------------------------


def test_outcome_messages() -> None:
    assert _no_reward(outcome, {}, "w") == "w: no numeric reward in it"
    message = _no_reward(outcome, {"ok": 1.0, "bad name": 0.0, "": 0.0}, "w")
    assert message == f"w: reward names ['bad name', ''] do not match {verify.REWARD_NAME.pattern}"


def test_outcome_is_the_mean_only_without_a_reward_key() -> None:
    assert outcome({"a": 1.0, "b": 0.0}, "w") == {"reward": 0.5, "a": 1.0, "b": 0.0}
    given = {"a": 1.0, "reward": 0.25, "b": 0.0}
    result = outcome(given, "w")
    assert result == given and list(result) == ["a", "reward", "b"]  # kept as the verifier wrote it
    assert outcome({"REWARD": 1.0, "x": 0.0}, "w") == {"reward": 0.5, "REWARD": 1.0, "x": 0.0}


# ---- harbor_rewards --------------------------------------------------------------------------------------------


def test_harbor_messages_name_the_file_they_are_about() -> None:
    assert _no_reward(harbor_rewards, "[]", None, honour_json=True) == f"{JSON} must be a JSON object of name -> number"
    assert _no_reward(harbor_rewards, "{}", None, honour_json=True) == f"{JSON}: no numeric reward in it"
    assert _no_reward(harbor_rewards, '{"a b": 1}', None, honour_json=True).startswith(f"{JSON}: reward names ['a b']")
    assert _no_reward(harbor_rewards, None, "oops", honour_json=False) == f"{TXT} is not a number: 'oops'"
    assert _no_reward(harbor_rewards, None, "nan", honour_json=True) == f"{TXT}: reward nan {RANGE}"


def test_reward_txt_fills_a_missing_reward_and_a_bad_one_is_skipped() -> None:
    assert harbor_rewards('{"a": 1}', "0.5", honour_json=True) == {"a": 1.0, "reward": 0.5}
    assert harbor_rewards('{"a": 1}', "oops", honour_json=True) == {"reward": 1.0, "a": 1.0}
    assert harbor_rewards('{"reward": 0.1}', "0.9", honour_json=True) == {"reward": 0.1}


def test_reward_txt_that_fills_the_reward_is_checked_as_reward_txt(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = verify.parse_reward_text

    def spy(text: str, where: str) -> float:
        seen.append(where)
        return real(text, where)

    monkeypatch.setattr(verify, "parse_reward_text", spy)
    harbor_rewards('{"a": 1}', "0.5", honour_json=True)
    harbor_rewards(None, "0.5", honour_json=True)
    assert seen == [TXT, TXT]


def test_no_reward_file_messages_and_the_ignored_note() -> None:
    assert _no_reward(harbor_rewards, None, None, honour_json=True) == (
        "the verifier wrote neither /logs/verifier/reward.txt nor reward.json"
    )
    assert (
        _no_reward(harbor_rewards, None, None, honour_json=False) == "the verifier wrote no /logs/verifier/reward.txt"
    )
    assert _no_reward(harbor_rewards, '{"reward": 1}', None, honour_json=False) == (
        "the verifier wrote no /logs/verifier/reward.txt"
        " (the reward.json there is ignored: the task's tests never write one)"
    )
    assert harbor_rewards('{"reward": 1}', "0", honour_json=False) == {"reward": 0.0}


# ---- file_rewards ----------------------------------------------------------------------------------------------


def test_file_rewards_json_or_float_with_the_files_name() -> None:
    assert file_rewards(' {"a": 1, "b": 0}\n', "out/r") == {"reward": 0.5, "a": 1.0, "b": 0.0}
    assert file_rewards(" 0.75\n", "out/r") == {"reward": 0.75}
    assert _no_reward(file_rewards, "{}", "out/r") == "out/r: no numeric reward in it"
    assert _no_reward(file_rewards, '{"a": ', "out/r").startswith("out/r is not valid JSON (")
    assert _no_reward(file_rewards, '{"a": 1e400}', "out/r") == f"out/r['a']: reward inf {RANGE}"
    assert _no_reward(file_rewards, "[1]", "out/r") == "out/r is not a number: '[1]'"
    assert _no_reward(file_rewards, "inf", "out/r") == f"out/r: reward inf {RANGE}"
    assert _no_reward(file_rewards, "", "out/r") == "out/r is empty"


# ---- read_reward_file ------------------------------------------------------------------------------------------


def test_a_path_outside_the_root_is_a_programming_error() -> None:
    for bad in ("/etc/passwd", "../x", "a/../b", ""):
        with pytest.raises(ValueError) as info:
            read_reward_file(Path("/"), bad)
        assert not isinstance(info.value, NoReward)
        assert str(info.value) == f"{bad!r}: a reward file is a relative path without '..'"


def test_reward_files_at_one_two_and_three_components(tmp_path: Path) -> None:
    (tmp_path / "r.txt").write_text("1\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "r.txt").write_text("2\n")
    (tmp_path / "a" / "b" / "r.txt").write_text("3\n")
    assert read_reward_file(tmp_path, "r.txt") == "1\n"
    assert read_reward_file(tmp_path, "a/r.txt") == "2\n"
    assert read_reward_file(tmp_path, "a/b/r.txt") == "3\n"
    assert read_reward_file(tmp_path, "missing") is None
    assert read_reward_file(tmp_path, "nodir/r.txt") is None
    assert read_reward_file(tmp_path, "a/b/missing") is None


def test_a_link_or_a_file_at_any_directory_component_is_no_reward(tmp_path: Path) -> None:
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "sub" / "r.txt").write_text("1")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "sublink").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "real" / "file").write_text("not a directory")
    assert read_reward_file(tmp_path, "real/sub/r.txt") == "1"
    assert (
        _no_reward(read_reward_file, tmp_path, "link/sub/r.txt") == "link/sub/r.txt: link is not a directory (a link?)"
    )
    assert _no_reward(read_reward_file, tmp_path, "real/sublink/r.txt") == (
        "real/sublink/r.txt: sublink is not a directory (a link?)"
    )
    assert _no_reward(read_reward_file, tmp_path, "real/file/r.txt") == (
        "real/file/r.txt: file is not a directory (a link?)"
    )


def test_the_last_component_must_be_a_regular_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("0.99")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "link").symlink_to(secret)
    (tmp_path / "out" / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "out" / "dir").mkdir()
    os.mkfifo(tmp_path / "out" / "pipe")
    what = "is not a regular file (a link, a directory, a pipe or a device)"
    for name in ("link", "dangling", "dir", "pipe"):
        assert _no_reward(read_reward_file, tmp_path, f"out/{name}") == f"out/{name} {what}"


def test_the_size_bound_exactly_at_the_limit_and_one_byte_over(tmp_path: Path) -> None:
    (tmp_path / "at").write_bytes(b"7" * 100)
    (tmp_path / "over").write_bytes(b"7" * 101)
    assert read_reward_file(tmp_path, "at", limit=100) == "7" * 100
    assert _no_reward(read_reward_file, tmp_path, "over", limit=100) == (
        "over is 101 bytes, over the 100 a reward file may have"
    )
    limit = verify.REWARD_FILE_LIMIT
    (tmp_path / "big").write_bytes(b"1" + b" " * (limit - 1))
    assert read_reward_file(tmp_path, "big") == "1" + " " * (limit - 1)
    (tmp_path / "bigger").write_bytes(b"1" + b" " * limit)
    assert _no_reward(read_reward_file, tmp_path, "bigger") == (
        f"bigger is {limit + 1} bytes, over the {limit} a reward file may have"
    )


def test_bytes_that_are_not_utf8_are_replaced(tmp_path: Path) -> None:
    (tmp_path / "r").write_bytes(b"1\xff\xfe")
    assert read_reward_file(tmp_path, "r") == "1\ufffd\ufffd"
    assert read_reward_file(tmp_path, "r") is not None


def _after_stat(monkeypatch: pytest.MonkeyPatch, then) -> None:
    """Run ``then`` right after read_reward_file's stat of the last component (a swap racing the check)."""
    real = os.stat

    def stat(*args, **kwargs):
        result = real(*args, **kwargs)
        if kwargs.get("dir_fd") is not None:
            replaced = then(result)
            return result if replaced is None else replaced
        return result

    monkeypatch.setattr(verify.os, "stat", stat)


def test_a_file_swapped_after_its_check_is_no_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "r").write_text("0")
    (tmp_path / "other").write_text("1")
    _after_stat(monkeypatch, lambda _: os.replace(tmp_path / "other", tmp_path / "r"))
    assert _no_reward(read_reward_file, tmp_path, "r") == "r changed while it was read"


def test_a_link_swapped_in_after_the_check_is_never_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("0.99")
    (tmp_path / "r").symlink_to(secret)
    # The check is fooled into seeing the host file itself: only O_NOFOLLOW on the open stands between them.
    _after_stat(monkeypatch, lambda _: os.stat(secret))
    with pytest.raises((OSError, NoReward)):
        read_reward_file(tmp_path, "r")


def test_a_pipe_swapped_in_after_the_check_does_not_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "r").write_text("0")

    def swap(_):
        os.unlink(tmp_path / "r")
        os.mkfifo(tmp_path / "r")

    _after_stat(monkeypatch, swap)

    def hung(*_):
        raise TimeoutError("the open of a pipe blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        assert _no_reward(read_reward_file, tmp_path, "r") == "r changed while it was read"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _grow_after_stat(monkeypatch: pytest.MonkeyPatch, path: Path, to: int) -> None:
    def grow(_) -> None:
        path.write_bytes(b"9" * to)

    _after_stat(monkeypatch, grow)


def test_a_file_that_grew_after_its_check_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r"
    path.write_text("0")
    _grow_after_stat(monkeypatch, path, 10_000)
    assert _no_reward(read_reward_file, tmp_path, "r", limit=100) == "r grew over the 100 bytes a reward file may have"


def test_short_reads_are_joined_and_the_bound_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_read = os.read
    returned: list[int] = []

    def one_byte(fd: int, n: int) -> bytes:
        chunk = real_read(fd, min(n, 1))
        returned.append(len(chunk))
        return chunk

    monkeypatch.setattr(verify.os, "read", one_byte)
    (tmp_path / "at").write_bytes(b"0123456789")
    assert read_reward_file(tmp_path, "at", limit=10) == "0123456789"
    path = tmp_path / "grows"
    path.write_text("0")
    _grow_after_stat(monkeypatch, path, 10_000)
    returned.clear()
    assert (
        _no_reward(read_reward_file, tmp_path, "grows", limit=10)
        == "grows grew over the 10 bytes a reward file may have"
    )
    assert sum(returned) == 11


def test_a_growing_file_is_never_read_past_the_limit_plus_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_read = os.read
    returned: list[int] = []

    def short_first(fd: int, n: int) -> bytes:
        chunk = real_read(fd, min(n, 3) if not returned else n)
        returned.append(len(chunk))
        return chunk

    monkeypatch.setattr(verify.os, "read", short_first)
    path = tmp_path / "grows"
    path.write_text("0")
    _grow_after_stat(monkeypatch, path, 10_000)
    assert (
        _no_reward(read_reward_file, tmp_path, "grows", limit=100)
        == "grows grew over the 100 bytes a reward file may have"
    )
    assert sum(returned) == 101


# ---- guard_left ------------------------------------------------------------------------------------------------


def test_the_guard_verdict() -> None:
    assert guard_left(f"output\n{GUARD_CLEAN}\n") is None
    assert guard_left(f"a\nb\n{GUARD_LEFT} 12 13\n") == (
        "processes were left running past the verifier (pids 12 13): any could have rewritten its reward"
    )
    pids = " " + " ".join(str(1000 + i) for i in range(100))
    assert guard_left(f"a\nb\n{GUARD_LEFT}{pids}\n\n") == (
        f"processes were left running past the verifier (pids{pids[:200]}): any could have rewritten its reward"
    )
    silent = "the verifier's guard did not report (its output was cut or it was killed)"
    assert guard_left("a\nb\n") == silent
    assert guard_left(f"{GUARD_CLEAN} but not at the end") == silent


def test_only_the_guards_own_last_line_counts() -> None:
    silent = "the verifier's guard did not report (its output was cut or it was killed)"
    for after in ("  ", "X", "XX", "more"):
        assert guard_left(f"out\n{GUARD_LEFT} 5\n{after}\n") == silent, after
    assert guard_left(f"x\n{GUARD_LEFT} 5\n{GUARD_CLEAN}\n") is None


# ---- resolve_env -----------------------------------------------------------------------------------------------


def test_resolve_env_defaults_and_missing_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_TEST_SET", "from-host")
    monkeypatch.delenv("POLAR_TEST_UNSET", raising=False)
    monkeypatch.delenv("fallback", raising=False)
    assert resolve_env(
        {
            "A": "${POLAR_TEST_SET}",
            "B": "${POLAR_TEST_SET:-fallback}",
            "C": "x${POLAR_TEST_UNSET:-fallback}y",
            "D": "${POLAR_TEST_UNSET:-}",
            "E": "plain $POLAR_TEST_SET",
        }
    ) == {"A": "from-host", "B": "from-host", "C": "xfallbacky", "D": "", "E": "plain $POLAR_TEST_SET"}
    with pytest.raises(VerifierError) as info:
        resolve_env({"K": "${POLAR_TEST_UNSET}"})
    assert str(info.value) == "the verifier's env needs ${POLAR_TEST_UNSET}, which is not set"
