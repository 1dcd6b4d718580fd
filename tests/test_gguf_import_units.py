"""polar_cli.gguf_import's parts on their own: wheel RECORDs and members, the streamed concatenation and its refusals,
the size and hash checks at their limits, the GGUF header read, the conversion's calls on a stand-in transformers, the
import's order of checks and its all-or-nothing move into place, and the provenance record (no torch, no model)."""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import types
import zipfile
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from polar_cli.gguf_import import convert, importer, parts, provenance
from polar_cli.gguf_import.importer import ImportRequest, import_gguf
from polar_cli.gguf_import.parts import Digest, ImportRefused, PartDigest, Source


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def _zip(path: Path, files: dict[str, bytes], record: str | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, content in files.items():
            wheel.writestr(name, content)
        if record is not None:
            wheel.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


# --- parts: sources ------------------------------------------------------------------------------------------------


def test_a_source_is_labelled_by_its_path_and_member() -> None:
    assert Source(Path("/w/a.whl"), "p/data.bin").label == "/w/a.whl!p/data.bin"
    assert Source(Path("/w/a.gguf")).label == "/w/a.gguf"


def test_record_hashes_read_every_sha256_line_of_the_record_only(tmp_path: Path) -> None:
    comma = b"data with a comma in its name"
    record = (
        f"pkg/a,b.bin,sha256={_b64(comma)},{len(comma)}\n"  # a comma in the path: the fields are split from the right
        f"pkg/md5.bin,md5=abc,3\n"  # no sha256: not vouched for
        f"pkg/short.bin,sha256={_b64(b'x')}\n"  # two fields only: no size, not a RECORD line
        "pkg-1.0.dist-info/RECORD,,\n"
    )
    path = _zip(
        tmp_path / "pkg-1.0-py3-none-any.whl", {"pkg/a,b.bin": comma, "other/RECORD": b"pkg/x,sha256=AA,1"}, record
    )
    with zipfile.ZipFile(path) as wheel:
        assert parts._record_hashes(wheel) == {"pkg/a,b.bin": hashlib.sha256(comma).hexdigest()}


def test_the_wheel_data_member_is_the_one_file_that_is_not_code_text_licence_or_metadata(tmp_path: Path) -> None:
    files = {
        "pkg/": b"",
        "pkg/__init__.py": b"",
        "pkg/mod.PYC": b"",
        "pkg/stubs.pyi": b"",
        "pkg/py.typed": b"",
        "pkg/NOTES.TXT": b"",
        "pkg/README.md": b"",
        "pkg/LICENSE": b"",
        "pkg/LICENSE-APACHE.rst": b"",
        "pkg-1.0.dist-info/WHEEL": b"",
        "pkg/model.gguf": b"GGUF",
    }
    wheel = _zip(tmp_path / "pkg.whl", files, f"pkg/model.gguf,sha256={_b64(b'GGUF')},4\n")
    assert parts.wheel_source(wheel) == Source(wheel, "pkg/model.gguf", hashlib.sha256(b"GGUF").hexdigest())
    # A named member need not be the data file; one the RECORD does not list has no hash to check.
    assert parts.wheel_source(wheel, "pkg/README.md") == Source(wheel, "pkg/README.md", None)
    with pytest.raises(ImportRefused, match=r"pkg\.whl: no member pkg/$"):
        parts.wheel_source(wheel, "pkg/")  # a directory entry is no member

    empty = _zip(tmp_path / "empty.whl", {"pkg/__init__.py": b""})
    with pytest.raises(ImportRefused, match=r"empty\.whl: expected one data file in the wheel, found none$"):
        parts.wheel_source(empty)
    two = _zip(tmp_path / "two.whl", {"pkg/a.bin": b"a", "pkg/b.bin": b"b"})
    with pytest.raises(ImportRefused, match=r"found \['pkg/a\.bin', 'pkg/b\.bin'\]$"):
        parts.wheel_source(two)


def test_sources_keep_their_order_and_only_a_whl_suffix_is_read_as_a_wheel(tmp_path: Path) -> None:
    zipped = _zip(tmp_path / "looks.zip", {"pkg/a.bin": b"a", "pkg/b.bin": b"b"})  # a zip by another name: a file
    wheel = _zip(tmp_path / "w.whl", {"pkg/a.bin": b"a"})
    plain = tmp_path / "p.bin"
    plain.write_bytes(b"p")
    assert parts.resolve_sources([zipped, wheel, plain]) == [Source(zipped), Source(wheel, "pkg/a.bin"), Source(plain)]
    with pytest.raises(ImportRefused, match=f"^{tmp_path}: no such file$"):
        parts.resolve_sources([plain, tmp_path])  # a directory is not a part
    with pytest.raises(ImportRefused, match="^no source given$"):
        parts.resolve_sources([])


# --- parts: the stream ---------------------------------------------------------------------------------------------


def test_reading_a_wheel_member_closes_the_wheel_with_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _zip(tmp_path / "w.whl", {"pkg/a.bin": b"abc"})
    closed: list[bool] = []
    real_close = zipfile.ZipFile.close

    def close(self: zipfile.ZipFile) -> None:
        closed.append(True)
        real_close(self)

    monkeypatch.setattr(zipfile.ZipFile, "close", close)
    stream = parts._open(Source(wheel, "pkg/a.bin"))
    assert stream.read() == b"abc" and closed == []
    stream.close()
    assert closed == [True]


def test_the_digest_counts_every_byte_of_each_part_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts, "CHUNK", 3)  # a part of 7 bytes is three reads, the last one short
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"GGUF123")
    b.write_bytes(b"")
    wheel = _zip(tmp_path / "w.whl", {"pkg/c.bin": b"xyz"}, f"pkg/c.bin,sha256={_b64(b'xyz')},3\n")
    sources = [Source(a), Source(b), parts.wheel_source(wheel)]
    digest = parts.concatenate(sources, None)
    assert digest == Digest(
        10,
        hashlib.sha256(b"GGUF123xyz").hexdigest(),
        (
            PartDigest(sources[0], 7, hashlib.sha256(b"GGUF123").hexdigest()),
            PartDigest(sources[1], 0, hashlib.sha256(b"").hexdigest()),
            PartDigest(sources[2], 3, hashlib.sha256(b"xyz").hexdigest()),
        ),
    )
    dest = tmp_path / "out.gguf"
    assert parts.concatenate(sources, dest) == digest and dest.read_bytes() == b"GGUF123xyz"
    # Read in bounded chunks, never a whole part at once (a part can be gigabytes).
    assert list(parts._chunks(sources[0])) == [b"GGU", b"F12", b"3"]
    assert list(parts._chunks(sources[2])) == [b"xyz"]


def test_a_part_unlike_its_record_is_named_with_both_hashes_and_the_file_removed(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.write_bytes(b"GGUF")
    expected = hashlib.sha256(b"other").hexdigest()
    bad = Source(_zip(tmp_path / "w.whl", {"pkg/c.bin": b"xyz"}), "pkg/c.bin", expected)
    dest = tmp_path / "out.gguf"
    message = f"{bad.label}: sha256 {hashlib.sha256(b'xyz').hexdigest()} differs from its wheel's RECORD ({expected})"
    with pytest.raises(ImportRefused) as refused:
        parts.concatenate([Source(good), bad], dest)
    assert str(refused.value) == message and not dest.exists()
    with pytest.raises(ImportRefused):
        parts.concatenate([bad], None)  # checked without a destination too
    # A matching RECORD passes.
    assert parts.concatenate([Source(bad.path, bad.member, hashlib.sha256(b"xyz").hexdigest())], None).size == 3


def test_verify_compares_size_and_hash_exactly_and_skips_what_is_not_given() -> None:
    digest = Digest(1234, "ab" * 32, ())
    parts.verify(digest)
    parts.verify(digest, size=1234, sha256="AB" * 32)
    with pytest.raises(ImportRefused) as refused:
        parts.verify(digest, size=1235)
    assert str(refused.value) == "the parts hold 1,234 bytes, expected 1,235"
    with pytest.raises(ImportRefused):
        parts.verify(digest, size=1233)
    with pytest.raises(ImportRefused) as refused:
        parts.verify(digest, sha256="CD" * 32)
    assert str(refused.value) == f"the parts' sha256 is {'ab' * 32}, expected {'cd' * 32}"


def test_the_magic_is_the_first_four_bytes(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_bytes(b"GGUF\x03")
    bad.write_bytes(b"xGGUF")
    parts.check_magic(good)
    with pytest.raises(ImportRefused) as refused:
        parts.check_magic(bad)
    assert str(refused.value) == f"{bad}: not a GGUF file (starts with b'xGGU'); are the parts in order?"


def test_a_sha256_is_exactly_64_hex_digits() -> None:
    assert parts.is_sha256("0123456789abcdefABCDEF" + "0" * 42)
    assert not parts.is_sha256("a" * 63) and not parts.is_sha256("a" * 65)
    assert not parts.is_sha256("g" + "a" * 63) and not parts.is_sha256("a" * 63 + " ")
    assert not parts.is_sha256("X" * 64) and not parts.is_sha256("0x" + "a" * 62)


def test_staging_copies_a_wheel_member_and_refuses_what_the_disk_cannot_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"GGUF" + b"\x00" * 4000  # compresses: the member's size is its uncompressed one
    wheel = _zip(tmp_path / "w.whl", {"pkg/m.gguf": data})
    source = parts.wheel_source(wheel)
    staged, digest = parts.stage([source], tmp_path / "work" / "deep")
    assert staged == tmp_path / "work" / "deep" / "model.gguf" and staged.read_bytes() == data
    assert digest.size == len(data)
    staged, _ = parts.stage([source], tmp_path / "work" / "deep")  # staged again where a file already lies
    assert staged.read_bytes() == data

    plain = tmp_path / "p.bin"
    plain.write_bytes(b"12345")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(parts.shutil, "disk_usage", lambda path: usage(0, 0, len(data) + 5))
    staged, _ = parts.stage([source, Source(plain)], tmp_path / "exact")  # exactly the room needed is enough
    assert staged.stat().st_size == len(data) + 5
    monkeypatch.setattr(parts.shutil, "disk_usage", lambda path: usage(0, 0, len(data) + 4))
    with pytest.raises(ImportRefused) as refused:
        parts.stage([source, Source(plain)], tmp_path / "full")
    assert str(refused.value) == f"{tmp_path / 'full'}: {len(data) + 5:,} bytes needed for the concatenated file, " + (
        f"{len(data) + 4:,} free"
    )
    assert not (tmp_path / "full" / "model.gguf").exists()


# --- convert -------------------------------------------------------------------------------------------------------


def test_the_header_gives_identity_sampling_keys_and_tensor_types(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_basename("base")
    writer.add_size_label("1M")
    writer.add_file_type(1)
    writer.add_sampling_temp(0.25)
    writer.add_sampling_top_k(7)
    writer.add_sampling_top_p(0.5)
    writer.add_sampling_min_p(0.125)
    writer.add_sampling_penalty_repeat(1.5)
    writer.add_string("general.unrelated", "not recorded")
    writer.add_tensor("a", np.zeros((2, 2), np.float16))
    writer.add_tensor("b", np.zeros(3, np.float32))
    writer.add_tensor("c", np.zeros(3, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = convert.gguf_metadata(path)
    assert metadata == {
        "general.architecture": "llama",
        "general.name": "tiny",
        "general.basename": "base",
        "general.size_label": "1M",
        "general.file_type": 1,
        "general.sampling.temp": 0.25,
        "general.sampling.top_k": 7,
        "general.sampling.top_p": 0.5,
        "general.sampling.min_p": 0.125,
        "general.sampling.penalty_repeat": 1.5,
        "tensors": 3,
        "tensor_types": {"F16": 1, "F32": 2},
    }
    assert type(metadata["general.sampling.top_k"]) is int and list(metadata["tensor_types"]) == ["F16", "F32"]


def test_generation_pairs_split_at_the_first_equals_and_read_json_else_text() -> None:
    assert convert.parse_generation([" top_k =20", "stop=a=b", "flag=true", "empty="]) == {
        "top_k": 20, "stop": "a=b", "flag": True, "empty": ""
    }  # fmt: skip
    assert convert.parse_generation([]) == {}
    for bad in ("=0.7", "  =1", "temperature"):
        with pytest.raises(ValueError) as refused:
            convert.parse_generation(["top_k=1", bad])
        assert str(refused.value) == f"{bad!r}: expected KEY=VALUE, e.g. temperature=0.7"


def test_every_gguf_sampling_key_names_its_generation_field_and_only_sampling_implies_do_sample() -> None:
    metadata = {
        "general.sampling.temp": 0.1,
        "general.sampling.top_k": 2,
        "general.sampling.top_p": 0.3,
        "general.sampling.min_p": 0.4,
        "general.sampling.penalty_repeat": 1.5,
        "general.name": "not sampling",
    }
    values, origin = convert.generation_defaults(metadata, {})
    assert values == {
        "temperature": 0.1, "top_k": 2, "top_p": 0.3, "min_p": 0.4, "repetition_penalty": 1.5, "do_sample": True
    }  # fmt: skip
    assert origin == {
        "temperature": "gguf general.sampling.temp",
        "top_k": "gguf general.sampling.top_k",
        "top_p": "gguf general.sampling.top_p",
        "min_p": "gguf general.sampling.min_p",
        "repetition_penalty": "gguf general.sampling.penalty_repeat",
        "do_sample": "implied by the sampling parameters",
    }
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        assert convert.generation_defaults({}, {name: 1})[0] == {name: 1, "do_sample": True}
    assert convert.generation_defaults({}, {"max_new_tokens": 5}) == (
        {"max_new_tokens": 5},
        {"max_new_tokens": "stated (--generation)"},
    )
    assert convert.generation_defaults({}, {}) == ({}, {})


class _Tensor:
    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n


def _fake_transformers(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[Any, ...]], *, tied: Any) -> Any:
    """A stand-in for torch and transformers that records what convert asks of them."""

    class GgufConfig:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

    class Model:
        def __init__(self) -> None:
            self.generation_config = types.SimpleNamespace(_from_model_config=True)
            self.config = types.SimpleNamespace(tie_word_embeddings=tied, _model_name_or_path="from gguf")

        def parameters(self) -> list[_Tensor]:
            return [_Tensor(3), _Tensor(4)]

        def save_pretrained(self, out: Path) -> None:
            calls.append(("save model", out, out.is_dir(), vars(self.config).copy()))

    class Tokenizer:
        def save_pretrained(self, out: Path) -> None:
            calls.append(("save tokenizer", out))

    model = Model()

    def tokenizer_from(folder: str, **kwargs: Any) -> Tokenizer:
        calls.append(("tokenizer", folder, kwargs))
        return Tokenizer()

    def model_from(folder: str, **kwargs: Any) -> Model:
        calls.append(("model", folder, kwargs["gguf_file"], kwargs["dtype"], kwargs["quantization_config"].kwargs))
        return model

    torch = types.ModuleType("torch")
    torch.bfloat16, torch.float16, torch.float32 = "torch.bf16", "torch.f16", "torch.f32"  # type: ignore[attr-defined]
    transformers = types.ModuleType("transformers")
    transformers.GgufConfig = GgufConfig  # type: ignore[attr-defined]
    transformers.AutoTokenizer = types.SimpleNamespace(from_pretrained=tokenizer_from)  # type: ignore[attr-defined]
    transformers.AutoModelForCausalLM = types.SimpleNamespace(from_pretrained=model_from)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    return model


def test_convert_loads_dequantized_in_the_dtype_and_saves_model_tokenizer_and_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    model = _fake_transformers(monkeypatch, calls, tied=1)
    out = tmp_path / "a" / "hf"
    done = convert.convert(
        tmp_path / "m.gguf", out, dtype="float16", generation={"top_p": 0.8}, metadata={"general.sampling.temp": 0.5}
    )
    assert calls == [
        ("tokenizer", str(tmp_path), {"gguf_file": "m.gguf"}),
        ("model", str(tmp_path), "m.gguf", "torch.f16", {"dequantize": True}),
        ("save model", out, True, {"tie_word_embeddings": 1}),  # the loader's model name is not saved
        ("save tokenizer", out),
    ]
    assert vars(model.generation_config) == {
        "_from_model_config": False, "temperature": 0.5, "top_p": 0.8, "do_sample": True
    }  # fmt: skip
    assert done == convert.Converted(
        parameters=7,
        tie_word_embeddings=True,
        generation_defaults={"temperature": 0.5, "top_p": 0.8, "do_sample": True},
        generation_defaults_from={
            "temperature": "gguf general.sampling.temp",
            "top_p": "stated (--generation)",
            "do_sample": "implied by the sampling parameters",
        },
    )


def test_convert_without_defaults_leaves_the_generation_config_as_derived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    model = _fake_transformers(monkeypatch, calls, tied=0)
    model.config.__dict__.pop("_model_name_or_path")  # a loader that names nothing: nothing to drop
    done = convert.convert(tmp_path / "m.gguf", tmp_path / "hf", dtype="bfloat16", generation={}, metadata={})
    assert vars(model.generation_config) == {"_from_model_config": True}
    assert calls[1][3] == "torch.bf16" and done.tie_word_embeddings is False and done.generation_defaults == {}
    convert.convert(tmp_path / "m.gguf", tmp_path / "hf", dtype="float32", generation={}, metadata={})
    assert calls[-3][3] == "torch.f32"
    with pytest.raises(ValueError) as refused:
        convert.convert(tmp_path / "m.gguf", tmp_path / "x", dtype="int8", generation={}, metadata={})
    assert str(refused.value) == "dtype 'int8': use one of bfloat16, float16, float32"
    assert not (tmp_path / "x").exists()


def test_versions_name_the_libraries_that_converted() -> None:
    from importlib.metadata import version

    assert convert.versions() == {
        name: version(name) for name in ("transformers", "gguf", "torch", "safetensors", "tokenizers")
    }


# --- provenance ----------------------------------------------------------------------------------------------------


def test_sources_are_recorded_with_their_wheel_and_whether_its_record_vouched() -> None:
    digest = Digest(
        5,
        "00" * 32,
        (
            PartDigest(Source(Path("/d/a.bin")), 2, "aa" * 32),
            PartDigest(Source(Path("/d/w.whl"), "p/b.bin", "bb" * 32), 3, "bb" * 32),
        ),
    )
    assert provenance.sources_of(digest) == [
        {"path": "/d/a.bin", "file": "a.bin", "member": None, "size": 2, "sha256": "aa" * 32,
         "wheel_record_checked": False},
        {"path": "/d/w.whl", "file": "w.whl", "member": "p/b.bin", "size": 3, "sha256": "bb" * 32,
         "wheel_record_checked": True},
    ]  # fmt: skip


def _record(**changes: Any) -> provenance.Provenance:
    fields: dict[str, Any] = dict(
        name="m", sources=[], gguf_size=1, gguf_sha256="ab" * 32, expected_sha256=None, gguf_metadata={},
        dtype="bfloat16", generation_defaults={}, generation_defaults_from={}, versions={}, parameters=7,
    )  # fmt: skip
    return provenance.Provenance(**(fields | changes))


def test_the_record_is_written_in_field_order_and_read_back_or_none(tmp_path: Path) -> None:
    record = _record(notes=["n"], created="2026-01-01T00:00:00+00:00")
    path = provenance.write(record, tmp_path)
    assert path == tmp_path / "polar-provenance.json" and path.read_text().endswith("}\n")
    assert list(json.loads(path.read_text())) == [
        "name", "sources", "gguf_size", "gguf_sha256", "expected_sha256", "gguf_metadata", "dtype",
        "generation_defaults", "generation_defaults_from", "versions", "parameters", "licence", "upstream", "notes",
        "created",
    ]  # fmt: skip
    assert path.read_text().startswith('{\n  "name": "m",')  # indented for people
    assert provenance.read(tmp_path)["notes"] == ["n"]  # type: ignore[index]
    path.write_text("{not json")
    assert provenance.read(tmp_path) is None
    assert provenance.read(tmp_path / "absent") is None
    created = _record().created
    assert len(created) == 25 and created.endswith("+00:00") and created[10] == "T"  # seconds, UTC


def _finished(out: Path, record: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in (*provenance.MODEL_FILES, "model-00001-of-00002.safetensors"):
        (out / name).write_text("{}")
    (out / provenance.PROVENANCE).write_text(json.dumps(record))


@pytest.mark.parametrize("missing", provenance.MODEL_FILES)
def test_an_import_missing_any_model_file_is_not_finished(tmp_path: Path, missing: str) -> None:
    _finished(tmp_path, {"gguf_sha256": "ab" * 32, "sources": []})
    assert provenance.already_imported(tmp_path, "ab" * 32, [])
    (tmp_path / missing).unlink()
    assert not provenance.already_imported(tmp_path, "ab" * 32, [])


def test_without_a_sha256_the_same_files_in_the_same_order_are_the_same_import(tmp_path: Path) -> None:
    _finished(tmp_path, {"gguf_sha256": "ab" * 32, "sources": [{"file": "a"}, {"file": "b"}]})
    assert provenance.already_imported(tmp_path, None, ["a", "b"])
    assert not provenance.already_imported(tmp_path, None, ["b", "a"])
    assert not provenance.already_imported(tmp_path, None, ["a"])
    assert not provenance.already_imported(tmp_path, "AB" * 31 + "CD", ["a", "b"])  # a hash decides when given
    _finished(tmp_path / "nosources", {"gguf_sha256": "ab" * 32})
    assert provenance.already_imported(tmp_path / "nosources", None, [])
    assert not provenance.already_imported(tmp_path / "nosources", "cd" * 32, [])
    _finished(tmp_path / "nohash", {"sources": []})
    assert not provenance.already_imported(tmp_path / "nohash", "ab" * 32, [])


# --- importer ------------------------------------------------------------------------------------------------------


def _fake_conversion(monkeypatch: pytest.MonkeyPatch, seen: list[Any]) -> None:
    def gguf_metadata(path: Path) -> dict[str, Any]:
        seen.append(("metadata", path.read_bytes()))
        return {"general.architecture": "qwen2"}

    def fake_convert(gguf: Path, out: Path, **kwargs: Any) -> convert.Converted:
        seen.append(("convert", gguf.read_bytes(), out, kwargs))
        out.mkdir(parents=True)
        for name in (*provenance.MODEL_FILES, "model.safetensors"):
            (out / name).write_text("{}")
        return convert.Converted(11, False, {"top_k": 2}, {"top_k": "stated (--generation)"})

    monkeypatch.setattr(convert, "gguf_metadata", gguf_metadata)
    monkeypatch.setattr(convert, "convert", fake_convert)
    monkeypatch.setattr(convert, "versions", lambda: {"gguf": "test"})


def _parts(tmp_path: Path) -> tuple[list[Path], bytes]:
    a, b = tmp_path / "src" / "a.bin", tmp_path / "src" / "b.bin"
    a.parent.mkdir()
    a.write_bytes(b"GGUF-first-")
    b.write_bytes(b"second")
    return [a, b], b"GGUF-first-second"


def test_an_import_stages_checks_converts_records_and_moves_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    _fake_conversion(monkeypatch, seen)
    sources, whole = _parts(tmp_path)
    sha = hashlib.sha256(whole).hexdigest()
    out = tmp_path / "models" / "m"
    request = ImportRequest(
        sources=sources, out=out, name="m", sha256=sha.upper(), size=len(whole), dtype="float16",
        generation={"top_k": 2}, licence="MIT", upstream="org/m", notes=["a note"],
    )  # fmt: skip
    result = import_gguf(request)
    work = tmp_path / "models" / ".m.partial"
    assert seen == [
        ("metadata", whole),
        (
            "convert",
            whole,
            work / "hf",
            {"dtype": "float16", "generation": {"top_k": 2}, "metadata": {"general.architecture": "qwen2"}},
        ),
    ]
    assert not work.exists() and sorted(p.name for p in out.parent.iterdir()) == ["m"]
    assert result.out == out and result.skipped is False and result.record == provenance.read(out)
    record = result.record
    assert record is not None
    created = record.pop("created")
    assert isinstance(created, str)
    assert record == {
        "name": "m",
        "sources": [
            {"path": str(sources[0]), "file": "a.bin", "member": None, "size": 11,
             "sha256": hashlib.sha256(b"GGUF-first-").hexdigest(), "wheel_record_checked": False},
            {"path": str(sources[1]), "file": "b.bin", "member": None, "size": 6,
             "sha256": hashlib.sha256(b"second").hexdigest(), "wheel_record_checked": False},
        ],
        "gguf_size": len(whole),
        "gguf_sha256": sha,
        "expected_sha256": sha,
        "gguf_metadata": {"general.architecture": "qwen2"},
        "dtype": "float16",
        "generation_defaults": {"top_k": 2},
        "generation_defaults_from": {"top_k": "stated (--generation)"},
        "versions": {"gguf": "test"},
        "parameters": 11,
        "licence": "MIT",
        "upstream": "org/m",
        "notes": ["a note"],
    }  # fmt: skip

    # The same checkpoint again: nothing read (the sources may even be gone).
    for source in sources:
        source.unlink()
    again = import_gguf(request)
    assert (
        again.out == out
        and again.skipped is True
        and again.record == result.record | {"created": created}
        and len(seen) == 2
    )


def test_the_same_files_are_recognised_without_a_hash_and_force_imports_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    _fake_conversion(monkeypatch, seen)
    sources, _ = _parts(tmp_path)
    out = tmp_path / "m"
    first = import_gguf(ImportRequest(sources=sources, out=out, name="m"))
    assert first.record is not None and first.record["expected_sha256"] is None and first.record["dtype"] == "bfloat16"
    assert import_gguf(ImportRequest(sources=sources, out=out, name="m")).skipped
    assert len(seen) == 2
    # The same file names with another expected hash are another checkpoint: read again (and refused here).
    with pytest.raises(ImportRefused, match="sha256 is"):
        import_gguf(ImportRequest(sources=sources, out=out, name="m", sha256="0" * 64))
    (out / "stale.txt").write_text("from the earlier import")
    forced = import_gguf(ImportRequest(sources=sources, out=out, name="m2", force=True))
    assert forced.skipped is False and forced.record["name"] == "m2" and len(seen) == 4  # type: ignore[index]
    assert not (out / "stale.txt").exists()  # replaced whole, not written over
    with pytest.raises(ImportRefused, match="not a GGUF file"):  # another order is another file: read, refused
        import_gguf(ImportRequest(sources=sources[::-1], out=out, name="m3"))


def test_refusals_come_before_anything_is_read_or_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    _fake_conversion(monkeypatch, seen)
    sources, whole = _parts(tmp_path)
    out = tmp_path / "m"
    for sha, said in (("a" * 63, f"--sha256 {'a' * 63!r} is not 64 hex digits"),):
        with pytest.raises(ImportRefused) as refused:
            import_gguf(ImportRequest(sources=sources, out=out, name="m", sha256=sha))
        assert str(refused.value) == said
    with pytest.raises(ImportRefused) as refused:
        import_gguf(ImportRequest(sources=sources, out=out, name="m", dtype="int4"))
    assert str(refused.value) == "dtype 'int4': use one of bfloat16, float16, float32"

    out.mkdir()
    (out / "mine.txt").write_text("not a model")
    with pytest.raises(ImportRefused) as refused:
        import_gguf(ImportRequest(sources=sources, out=out, name="m", force=True))
    assert str(refused.value) == f"{out} exists and holds no polar import: give an empty or new --out"
    file_out = tmp_path / "file-out"
    file_out.write_text("x")
    with pytest.raises(ImportRefused, match="holds no polar import"):
        import_gguf(ImportRequest(sources=sources, out=file_out, name="m"))

    with pytest.raises(ImportRefused, match="sha256 is"):
        import_gguf(ImportRequest(sources=sources, out=tmp_path / "n", name="m", sha256="0" * 64))
    with pytest.raises(ImportRefused, match="not a GGUF file"):
        import_gguf(ImportRequest(sources=sources[::-1], out=tmp_path / "n", name="m"))
    assert seen == [] and sorted(p.name for p in tmp_path.iterdir()) == ["file-out", "m", "src"]  # no staging left

    empty = tmp_path / "empty"
    empty.mkdir()
    assert import_gguf(ImportRequest(sources=sources, out=empty, name="m", size=len(whole))).skipped is False


def test_a_failed_conversion_leaves_out_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    _fake_conversion(monkeypatch, seen)
    sources, _ = _parts(tmp_path)
    out = tmp_path / "m"
    import_gguf(ImportRequest(sources=sources, out=out, name="first"))
    before = sorted(p.name for p in out.iterdir())

    def broken(gguf: Path, out: Path, **kwargs: Any) -> convert.Converted:
        out.mkdir(parents=True)
        (out / "config.json").write_text("half")
        raise RuntimeError("loader failed")

    monkeypatch.setattr(convert, "convert", broken)
    with pytest.raises(RuntimeError, match="loader failed"):
        import_gguf(ImportRequest(sources=sources, out=out, name="second", force=True))
    assert sorted(p.name for p in out.iterdir()) == before and provenance.read(out)["name"] == "first"  # type: ignore[index]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "src"]


def test_a_leftover_staging_folder_is_cleared_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    _fake_conversion(monkeypatch, seen)
    sources, _ = _parts(tmp_path)
    leftover = tmp_path / ".m.partial" / "hf"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("from a killed import")
    assert import_gguf(ImportRequest(sources=sources, out=tmp_path / "m", name="m")).skipped is False
    assert (tmp_path / "m" / "config.json").read_text() == "{}"


def test_models_dir_ignores_an_empty_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(importer.MODELS_DIR_ENV, "")
    assert importer.models_dir() == Path.home() / ".cache" / "polar" / "models"
    assert importer.MODELS_DIR_ENV == "POLAR_MODELS_DIR"
