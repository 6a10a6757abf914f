"""The embedded corpus and tokenizer, their builder, and the cached tokenization of them."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import io
import json
import lzma
import tarfile
from pathlib import Path

import pytest

from p2p_spes import corpus
from p2p_spes.corpus import (
    build_assets,
    embedded_corpus_files,
    embedded_tokenizer_path,
    split_of,
)
from p2p_spes.errors import DataError

SAMPLES = [
    "def f(x):\n\treturn x ** 2  # squared\n",
    "  leading spaces, trailing spaces  ",
    "Unicode: \u00e9t\u00e9, \u4e2d\u6587, \U0001f600, \u00a0non-breaking\r\n",
    ".. note::\n\n   The :func:`open` function <|endoftext|> is not special in text.\n",
    "",
]


def test_assets_exist_and_are_small():
    files = [p for p in corpus.ASSETS_DIR.rglob("*") if p.is_file()]
    names = {p.relative_to(corpus.ASSETS_DIR).as_posix() for p in files}
    assert {
        "corpus/train.jsonl.xz",
        "corpus/validation.jsonl.xz",
        "corpus/LICENSE",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    } <= names
    assert sum(p.stat().st_size for p in files) <= 5 * 1024 * 1024
    licence = (corpus.ASSETS_DIR / "corpus" / "LICENSE").read_text()
    assert "python3.11-doc" in licence and "PSF License" in licence and "PYTHON SOFTWARE FOUNDATION" in licence


def test_embedded_tokenizer_loads_offline_and_round_trips():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_path())
    assert len(tokenizer) == 8192
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id is not None
    for text in SAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert len(tokenizer("import os\nprint(os.getcwd())")["input_ids"]) < 12


def test_embedded_corpus_splits_are_disjoint_and_stable():
    sources = {}
    for split, path in embedded_corpus_files().items():
        with lzma.open(path, "rt", encoding="utf-8") as stream:
            records = [json.loads(line) for line in stream]
        assert all(set(r) == {"text", "source"} and r["text"] for r in records)
        assert all(split_of(r["source"], 0.05) == split for r in records)
        sources[split] = {r["source"] for r in records}
    assert not sources["train"] & sources["validation"]
    assert 10 <= len(sources["validation"]) <= 0.1 * len(sources["train"])
    assert "library/os.rst.txt" in sources["train"] | sources["validation"]


def test_cache_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("P2P_SPES_CACHE", str(tmp_path / "cache"))
    assert corpus.default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("P2P_SPES_CACHE")
    assert corpus.default_cache_dir() == Path.home() / ".cache" / "p2p-spes"


def _documents() -> dict[str, str]:
    return {
        f"library/mod{i}.rst.txt": f"Module {i}\n========\n\n.. function:: f{i}(x)\n\n   Returns x.\n" * 3
        for i in range(12)
    }


def _check_built(out: Path, counts: dict[str, int], documents: int) -> None:
    from transformers import AutoTokenizer

    assert counts["train"] + counts["validation"] == documents and min(counts.values()) > 0
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert 256 < len(tokenizer) <= 300 and tokenizer.eos_token == "<|endoftext|>"
    text = "Module 7 \u00e9"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert "LICENCE TEXT" in (out / "corpus" / "LICENSE").read_text()


def test_build_from_a_directory(tmp_path):
    sources = tmp_path / "src" / "usr" / "share" / "doc" / "python3.11" / "html" / "_sources"
    for name, text in _documents().items():
        (sources / name).parent.mkdir(parents=True, exist_ok=True)
        (sources / name).write_text(text)
    (sources / "license.rst.txt").write_text("LICENCE TEXT")
    counts = build_assets(tmp_path / "src", tmp_path / "out", vocab_size=300, validation_fraction=0.3)
    _check_built(tmp_path / "out", counts, len(_documents()) + 1)


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _ar(members: dict[str, bytes]) -> bytes:
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


def test_build_from_a_deb(tmp_path):
    data = {f"./usr/share/doc/python3.11/html/_sources/{name}": text.encode() for name, text in _documents().items()}
    data["./usr/share/doc/python3.11-doc/copyright"] = b"LICENCE TEXT"
    deb = tmp_path / "python3.11-doc_3.11.2_all.deb"
    deb.write_bytes(
        _ar(
            {
                "debian-binary": b"2.0\n",
                "control.tar.xz": _tar_xz({"./control": b"Package: python3.11-doc\nVersion: 9.9\n"}),
                "data.tar.xz": _tar_xz(data),
            }
        )
    )
    counts = build_assets(deb, tmp_path / "out", vocab_size=300, validation_fraction=0.3)
    _check_built(tmp_path / "out", counts, len(_documents()))
    assert "python3.11-doc, version 9.9" in (tmp_path / "out" / "corpus" / "LICENSE").read_text()


def test_build_refuses_sources_without_documents_or_licence(tmp_path):
    (tmp_path / "empty" / "_sources").mkdir(parents=True)
    with pytest.raises(DataError, match="no \\*\\.rst\\.txt documents found"):
        build_assets(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="expected exactly one _sources directory"):
        build_assets(tmp_path / "plain", tmp_path / "out")
    (tmp_path / "nolicence" / "_sources").mkdir(parents=True)
    (tmp_path / "nolicence" / "_sources" / "a.rst.txt").write_text("text")
    with pytest.raises(DataError, match="no licence text"):
        build_assets(tmp_path / "nolicence", tmp_path / "out")
