"""``p2p-spes data tokenize``: every input format streamed into a version-2 token directory (shards by split,
the tokenizer's files, the manifest), the token dtype, the validation split, the tokenizer from a directory or
the local Hugging Face cache, the embedded corpus' cache, and the errors that say what to fix."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import gzip
import hashlib
import json
import lzma
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from p2p_spes import corpus, text_inputs
from p2p_spes.cli import main as cli_main
from p2p_spes.corpus import embedded_tokenizer_path, prepare_embedded_data
from p2p_spes.data_manifest import MANIFEST_VERSION, Manifest, read_manifest
from p2p_spes.errors import DataError
from p2p_spes.text_inputs import document_position
from p2p_spes.tokenization import tokenize_files
from p2p_spes.tokenizer_files import load_tokenizer, tokenizer_fingerprint

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _doc(i: int) -> str:
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(20 + i % 13)]
    return f"Document {i}: " + " ".join(words) + (" \u00e9t\u00e9 \U0001f600\n\tend" if i % 5 == 0 else ".")


def _lines(docs, **extra) -> str:
    return "".join(json.dumps({"text": d, **extra}) + "\n" for d in docs)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_tokenizer_path())


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """One file of every supported format, ten documents each; the files sort in the order a, b, c, ..."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.jsonl").write_text(_lines(_doc(i) for i in range(10)) + "\n", encoding="utf-8")
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write(_lines(_doc(i) for i in range(10, 20)))
    with lzma.open(root / "c.jsonl.xz", "wt", encoding="utf-8") as stream:
        stream.write(_lines(_doc(i) for i in range(20, 30)))
    # two zstd frames in one file: a reader that stops after the first frame would lose documents
    frames = [_lines(_doc(i) for i in range(30, 35)), _lines(_doc(i) for i in range(35, 40))]
    (root / "d.jsonl.zst").write_bytes(b"".join(zstandard.ZstdCompressor().compress(f.encode()) for f in frames))
    with gzip.open(root / "e.json.gz", "wt", encoding="utf-8") as stream:  # Dolma: id, text, source, metadata
        for i in range(40, 50):
            record = {"id": str(i), "text": _doc(i), "source": "test", "added": "2024", "metadata": {"n": i}}
            stream.write(json.dumps(record) + "\n")
    pq.write_table(pa.table({"text": [_doc(i) for i in range(50, 60)], "n": list(range(10))}), root / "f.parquet")
    (root / "g.txt").write_text(_doc(60), encoding="utf-8")
    return root


ALL_FILES = ("a.jsonl", "b.jsonl.gz", "c.jsonl.xz", "d.jsonl.zst", "e.json.gz", "f.parquet", "g.txt")


@pytest.fixture(scope="module")
def tokenized(corpus_dir, tmp_path_factory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("tokens") / "one_worker"
    manifest = tokenize_files(
        [str(corpus_dir / "*")], embedded_tokenizer_path(), out, num_workers=1, shard_tokens=1000, progress=False
    )
    return out, manifest


def stream(out: Path, manifest: Manifest, split: str = "train") -> list[int]:
    """The split's tokens, shard after shard, each shard checked against its manifest entry."""
    tokens: list[int] = []
    for shard in manifest.shards(split):
        data = (out / shard.path).read_bytes()
        assert len(data) == shard.bytes and hashlib.sha256(data).hexdigest() == shard.sha256
        ids = np.frombuffer(data, dtype=manifest.token_dtype)
        assert 0 < len(ids) == shard.num_tokens and ids.max() == shard.max_token_id
        tokens.extend(ids.tolist())
    return tokens


def documents(out: Path, manifest: Manifest, tokenizer, split: str = "train") -> list[str]:
    """The split's documents: its tokens cut at every EOS, decoded."""
    docs, current = [], []
    tokens = stream(out, manifest, split)
    assert tokens[-1] == tokenizer.eos_token_id
    for token in tokens:
        if token == tokenizer.eos_token_id:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return docs


def tokenize(inputs, out, **kw) -> Manifest:
    kw = {"num_workers": 1, "progress": False, **kw}
    return tokenize_files([str(i) for i in inputs], kw.pop("tokenizer", embedded_tokenizer_path()), out, **kw)


# The token directory


def test_every_format_is_read_in_order_into_a_version_2_directory(tokenized, corpus_dir, tokenizer):
    out, manifest = tokenized
    assert read_manifest(out) == manifest and manifest.version == MANIFEST_VERSION
    assert manifest.dtype == "uint16" and manifest.token_dtype == np.dtype("<u2")  # 8192 ids fit
    assert manifest.tokenizer.vocab_size == len(tokenizer) == 8192
    assert manifest.tokenizer.eos_token_id == tokenizer.eos_token_id
    assert manifest.tokenizer.fingerprint == tokenizer_fingerprint(tokenizer)
    assert manifest.sources == tuple(str(corpus_dir / n) for n in ALL_FILES)
    assert list(manifest.splits) == ["train"] and manifest.num_documents == {"train": 61}
    assert len(manifest.shards()) > 1 and all(s.num_tokens <= 1000 for s in manifest.shards())
    assert [s.path for s in manifest.shards()] == [f"train/shard_{i:05d}.bin" for i in range(len(manifest.shards()))]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "tokenizer", "train"]
    assert sorted(p.name for p in (out / "train").iterdir()) == [s.path.split("/")[1] for s in manifest.shards()]
    assert documents(out, manifest, tokenizer) == [_doc(i) for i in range(61)]
    assert len(stream(out, manifest)) == manifest.num_tokens()


def test_the_tokenizer_files_are_copied_and_load_as_the_same_tokenizer(tokenized, tokenizer):
    from transformers import AutoTokenizer

    out, manifest = tokenized
    files = {f.path: f for f in manifest.tokenizer.files}
    assert set(files) == {f"tokenizer/{p.name}" for p in embedded_tokenizer_path().iterdir()}
    for entry in files.values():
        data = (out / entry.path).read_bytes()
        assert len(data) == entry.bytes and hashlib.sha256(data).hexdigest() == entry.sha256
        assert data == (embedded_tokenizer_path() / entry.path.split("/")[1]).read_bytes()
    copy = AutoTokenizer.from_pretrained(out / "tokenizer", local_files_only=True)
    assert tokenizer_fingerprint(copy) == manifest.tokenizer.fingerprint and copy.eos_token_id == tokenizer.eos_token_id
    assert manifest.files() == [*manifest.tokenizer.files, *manifest.shards()]


def test_worker_count_does_not_change_the_output(tokenized, corpus_dir, tmp_path):
    out, manifest = tokenized
    manifest_2 = tokenize([corpus_dir / "*.*"], tmp_path, num_workers=2, shard_tokens=1000)
    assert manifest_2.splits == manifest.splits and manifest_2.fingerprint == manifest.fingerprint
    for shard in manifest.shards():
        assert (tmp_path / shard.path).read_bytes() == (out / shard.path).read_bytes()


def test_retokenizing_into_a_used_directory_removes_stale_files(corpus_dir, tmp_path):
    tokenize([corpus_dir / "a.jsonl"], tmp_path, shard_tokens=50, validation_inputs=[str(corpus_dir / "g.txt")])
    (tmp_path / "shard_00000.bin").write_bytes(b"\0" * 8)  # the version-1 layout kept its shards at the top
    (tmp_path / "tokenizer" / "old.json").write_text("{}")
    manifest = tokenize([corpus_dir / "g.txt"], tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        ["manifest.json", "train/shard_00000.bin", *(f.path for f in manifest.tokenizer.files)]
    )
    assert manifest.num_documents == {"train": 1} and list(manifest.splits) == ["train"]
    assert not (tmp_path / "validation").exists()


def test_recursive_glob(tmp_path):
    nested = tmp_path / "x" / "y"
    nested.mkdir(parents=True)
    (nested / "e.txt").write_text("nested document")
    manifest = tokenize([tmp_path / "**" / "*.txt"], tmp_path / "out")
    assert manifest.sources == (str(nested / "e.txt"),)


def test_a_tokenizer_of_more_than_65536_ids_gives_uint32_shards(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "<eos>": 70_001}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]").save_pretrained(
        tmp_path / "big"
    )
    (tmp_path / "doc.txt").write_text("w1 w69999 w65536 nonsense")
    manifest = tokenize([tmp_path / "doc.txt"], tmp_path / "out", tokenizer=tmp_path / "big")
    assert manifest.dtype == "uint32" and manifest.tokenizer.vocab_size == 70_002
    assert stream(tmp_path / "out", manifest) == [1, 69_999, 65_536, 70_000, 70_001]


# Formats


def test_a_text_file_is_streamed_in_pieces_with_one_eos(tmp_path, tokenizer, monkeypatch):
    lines = [f"{i}: {_doc(i)}" if i % 7 else "" for i in range(400)]
    text = "\n".join(lines) + "\n" + "x" * 700 + " a line longer than a piece\n"
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(text_inputs, "_TXT_PIECE_CHARS", 500)
    pieces = list(text_inputs._txt_pieces(tmp_path / "big.txt"))
    assert len(pieces) > 50 and [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(len(p) <= 1000 for p, _ in pieces) and "".join(p for p, _ in pieces) == text
    assert all(p.endswith("\n") for p, _ in pieces[:-2])  # cut at line ends, but inside the one long line

    manifest = tokenize([tmp_path / "big.txt"], tmp_path / "out", shard_tokens=3000)
    tokens = stream(tmp_path / "out", manifest)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokens.count(tokenizer.eos_token_id) == 1 and tokens[-1] == tokenizer.eos_token_id
    assert abs(len(tokens) - 1 - len(whole)) <= 0.02 * len(whole)
    assert tokenizer.decode(tokens[:-1]) == text and manifest.num_documents == {"train": 1}


def test_a_saved_dataset_and_a_dataset_dict_are_read_by_record_batch(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets", reason="the datasets package (installed with the eval extra)")
    docs = [_doc(i) for i in range(30)]
    datasets.Dataset.from_dict({"text": docs, "n": list(range(30))}).save_to_disk(tmp_path / "ds")
    manifest = tokenize([tmp_path / "ds"], tmp_path / "out", num_workers=2)
    assert documents(tmp_path / "out", manifest, tokenizer) == docs
    assert manifest.sources == (str(tmp_path / "ds"),)

    splits = {"train": docs[:20], "test": docs[20:25], "validation": docs[25:]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"body": v}) for k, v in splits.items()}).save_to_disk(
        tmp_path / "dd"
    )
    manifest = tokenize(
        [tmp_path / "dd"], tmp_path / "dd-out", field="body", validation_inputs=[str(tmp_path / "dd" / "validation")]
    )
    assert documents(tmp_path / "dd-out", manifest, tokenizer) == splits["train"]
    assert documents(tmp_path / "dd-out", manifest, tokenizer, "validation") == splits["validation"]
    manifest = tokenize([tmp_path / "dd"], tmp_path / "test-out", field="body", split="test")
    assert documents(tmp_path / "test-out", manifest, tokenizer) == splits["test"]
    assert manifest.sources == (str(tmp_path / "dd" / "test"),)
    with pytest.raises(DataError, match=r"DatasetDict with the splits train, test, validation, not 'dev'.*--split"):
        tokenize([tmp_path / "dd"], tmp_path / "x", field="body", split="dev")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body\).*--field"):
        tokenize([tmp_path / "dd"], tmp_path / "x")


def test_an_arrow_stream_directory_without_datasets(tmp_path, tokenizer):
    """The layout save_to_disk writes, made with pyarrow alone: batches of a stream, in state.json's order."""
    root = tmp_path / "ds"
    root.mkdir()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for k, name in enumerate(names):
        with pa.ipc.new_stream(root / name, pa.schema([("text", pa.string())])) as writer:
            for b in range(3):
                writer.write_batch(pa.record_batch([[_doc(k * 30 + b * 10 + i) for i in range(10)]], names=["text"]))
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (root / "dataset_info.json").write_text("{}")
    manifest = tokenize([root], tmp_path / "out")
    assert documents(tmp_path / "out", manifest, tokenizer) == [_doc(i) for i in range(60)]


# The validation split


def _many_docs(root: Path, count: int = 400) -> list[str]:
    docs = [f"{i}: {_doc(i)}" for i in range(count)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.jsonl").write_text(_lines(docs[: count // 2]))
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write(_lines(docs[count // 2 :]))
    return docs


def test_a_validation_fraction_splits_by_document_hash_for_any_worker_count_and_file_order(tmp_path, tokenizer):
    docs = _many_docs(tmp_path / "in")
    one = tokenize([tmp_path / "in" / "*"], tmp_path / "one", validation_fraction=0.25, shard_tokens=2000)
    two = tokenize(
        [tmp_path / "in" / "*"], tmp_path / "two", validation_fraction=0.25, shard_tokens=2000, num_workers=2
    )
    assert one.splits == two.splits and one.fingerprint == two.fingerprint
    for shard in one.files():
        assert (tmp_path / "one" / shard.path).read_bytes() == (tmp_path / "two" / shard.path).read_bytes()

    train, validation = (documents(tmp_path / "one", one, tokenizer, s) for s in ("train", "validation"))
    assert validation == [d for d in docs if document_position(d) < 0.25]
    assert train == [d for d in docs if document_position(d) >= 0.25]
    assert 60 <= len(validation) <= 140 and one.num_documents == {"train": len(train), "validation": len(validation)}
    assert read_manifest(tmp_path / "one").shards("validation")[0].path == "validation/shard_00000.bin"

    # the same documents in other files, in another order: the same documents go to validation
    (tmp_path / "swapped").mkdir()
    (tmp_path / "swapped" / "a.jsonl").write_text(_lines(reversed(docs)))
    swapped = tokenize([tmp_path / "swapped" / "a.jsonl"], tmp_path / "s", validation_fraction=0.25)
    assert sorted(documents(tmp_path / "s", swapped, tokenizer, "validation")) == sorted(validation)


def test_text_files_are_split_by_the_hash_of_their_whole_text(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(text_inputs, "_TXT_PIECE_CHARS", 64)
    texts = [f"file {i}\n" + "\n".join(_doc(i * 10 + j) for j in range(5)) for i in range(12)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i:02d}.txt").write_text(text)
    manifest = tokenize([tmp_path / "*.txt"], tmp_path / "out", validation_fraction=0.5)
    assert documents(tmp_path / "out", manifest, tokenizer, "validation") == [
        t for t in texts if document_position(t) < 0.5
    ]


def test_validation_inputs_make_the_validation_split(corpus_dir, tmp_path, tokenizer):
    manifest = tokenize([corpus_dir / "a.jsonl"], tmp_path, validation_inputs=[str(corpus_dir / "b.jsonl.gz")])
    assert list(manifest.splits) == ["train", "validation"]
    assert manifest.num_documents == {"train": 10, "validation": 10}
    assert documents(tmp_path, manifest, tokenizer, "validation") == [_doc(i) for i in range(10, 20)]
    assert manifest.sources == (str(corpus_dir / "a.jsonl"), str(corpus_dir / "b.jsonl.gz"))


def test_validation_options_are_checked(corpus_dir, tmp_path):
    a = corpus_dir / "a.jsonl"
    with pytest.raises(DataError, match="not both"):
        tokenize([a], tmp_path, validation_inputs=[str(a)], validation_fraction=0.1)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(DataError, match=r"--validation-fraction must be in \[0, 1\)"):
            tokenize([a], tmp_path, validation_fraction=bad)
    tiny = [d for d in (_doc(i) for i in range(100)) if document_position(d) >= 0.01][:3]
    (tmp_path / "tiny.jsonl").write_text(_lines(tiny))
    with pytest.raises(DataError, match=r"put none of the 3 documents into the validation split.*--validation-input"):
        tokenize([tmp_path / "tiny.jsonl"], tmp_path / "out", validation_fraction=0.01)
    assert not (tmp_path / "out" / "manifest.json").exists()
    (tmp_path / "empty.jsonl").write_text(_lines([""]))
    with pytest.raises(DataError, match=r"no non-empty documents in the validation inputs .*empty\.jsonl"):
        tokenize([a], tmp_path / "out", validation_inputs=[str(tmp_path / "empty.jsonl")])


# Tokenizers


def _fake_hub_cache(root: Path, repo: str) -> Path:
    """A Hugging Face cache holding ``repo`` as `hf download` leaves it: blobs, a snapshot of links, refs/main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / f"models--{repo.replace('/', '--')}"
    snapshot = base / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (base / "blobs").mkdir()
    files = {p.name: p.read_bytes() for p in embedded_tokenizer_path().iterdir()}
    files |= {"config.json": b"{}", "model.safetensors": b"\0" * 64}  # a model repo: not tokenizer files
    for name, data in files.items():
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_name_is_loaded_from_the_local_cache_only(corpus_dir, tmp_path, monkeypatch, tokenizer):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub_cache(tmp_path / "hub", "someone/tiny-tok")
    manifest = tokenize([corpus_dir / "g.txt"], tmp_path / "out", tokenizer="someone/tiny-tok")
    assert manifest.tokenizer.name_or_path == "someone/tiny-tok"
    assert manifest.tokenizer.fingerprint == tokenizer_fingerprint(tokenizer)
    assert sorted(f.path for f in manifest.tokenizer.files) == [
        "tokenizer/special_tokens_map.json",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ]
    assert not any(p.is_symlink() for p in (tmp_path / "out" / "tokenizer").iterdir())
    with pytest.raises(
        DataError,
        match=r"'someone/other' is not a local directory, and not in the local Hugging "
        r"Face cache .*hf download someone/other.*save_pretrained",
    ):
        tokenize([corpus_dir / "g.txt"], tmp_path / "out", tokenizer="someone/other")


def test_missing_tokenizer_path_says_it_must_be_local(corpus_dir, tmp_path):
    with pytest.raises(DataError, match="not a local directory with tokenizer.json.*save_pretrained"):
        tokenize([corpus_dir / "g.txt"], tmp_path / "out", tokenizer=tmp_path / "no-such-tokenizer")
    with pytest.raises(DataError, match="not a local directory"):
        tokenize([corpus_dir / "g.txt"], tmp_path / "out", tokenizer="Qwen/Qwen2.5-0.5B")


def test_tokenizer_without_eos_is_refused(corpus_dir, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((embedded_tokenizer_path() / "tokenizer.json").read_bytes())
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(DataError, match="has no eos_token"):
        tokenize([corpus_dir / "g.txt"], tmp_path / "out", tokenizer=tok)


# Errors that say what to fix


def test_nonexistent_glob_is_named(tmp_path):
    pattern = str(tmp_path / "nothing" / "*.jsonl")
    with pytest.raises(DataError, match=f"{re.escape(pattern)}' matches no files"):
        tokenize([pattern], tmp_path / "out")


def test_missing_field_names_file_line_and_option(tmp_path):
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(_lines(["fine"]).encode() + b'{"content": "no text"}\n'))
    with pytest.raises(DataError, match=r"bad\.jsonl\.zst, line 2: record has no field 'text'.*--field"):
        tokenize([path], tmp_path / "out")


def test_missing_parquet_column_names_the_option(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"content": ["a", "b"]}), path)
    with pytest.raises(DataError, match=r"bad\.parquet.*no column 'text'.*--field"):
        tokenize([path], tmp_path / "out")


def test_other_field_can_be_chosen(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({"content": "some text"}) + "\n")
    assert tokenize([path], tmp_path / "out", field="content").num_documents == {"train": 1}


def test_invalid_json_unknown_suffix_and_a_plain_directory(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match=r"broken\.jsonl, line 2: not valid JSON"):
        tokenize([tmp_path / "broken.jsonl"], tmp_path / "o")
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"data\.csv: unsupported file type.*\.jsonl\.zst.*\.json\.gz.*save_to_disk"):
        tokenize([tmp_path / "data.csv"], tmp_path / "o")
    (tmp_path / "plain").mkdir()
    with pytest.raises(
        DataError, match=r"plain is a directory but not a Hugging Face dataset.*'.*plain/\*\*/\*\.jsonl'"
    ):
        tokenize([tmp_path / "plain"], tmp_path / "o")


def test_undecodable_or_damaged_files_are_named(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 text"):
        tokenize([tmp_path / "latin1.txt"], tmp_path / "o")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(_lines(["a" * 1000]).encode())[:-20])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: cannot read"):
        tokenize([tmp_path / "cut.jsonl.gz"], tmp_path / "o")
    (tmp_path / "junk.jsonl.zst").write_bytes(b"not zstd at all")
    with pytest.raises(DataError, match=r"junk\.jsonl\.zst: cannot read"):
        tokenize([tmp_path / "junk.jsonl.zst"], tmp_path / "o")


# The command line and the embedded corpus


def test_the_command_prints_each_split_the_dtype_and_the_fingerprint(corpus_dir, tmp_path, capsys):
    args = ["data", "tokenize", "--input", str(corpus_dir / "a.jsonl"), str(corpus_dir / "e.json.gz")]
    args += ["--validation-input", str(corpus_dir / "g.txt"), "--tokenizer", str(embedded_tokenizer_path())]
    assert cli_main([*args, "--out", str(tmp_path / "out"), "--workers", "1", "--no-progress"]) == 0
    manifest = read_manifest(tmp_path / "out")
    out = capsys.readouterr().out
    assert f"train: {manifest.num_tokens():,} tokens, 20 documents, 1 shard;" in out
    assert f"validation: {manifest.num_tokens('validation'):,} tokens, 1 documents, 1 shard" in out
    assert "(uint16)" in out and str(tmp_path / "out") in out and manifest.fingerprint in out
    args = ["data", "tokenize", "--input", str(corpus_dir / "a.jsonl"), "--tokenizer", str(embedded_tokenizer_path())]
    assert cli_main([*args, "--out", str(tmp_path / "x"), "--validation-fraction", "2", "--no-progress"]) == 2
    assert "--validation-fraction must be in [0, 1)" in capsys.readouterr().err


def test_the_embedded_corpus_is_tokenized_once_into_one_directory(tmp_path, monkeypatch):
    root = prepare_embedded_data(tmp_path)
    assert root.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [root.name]
    manifest = read_manifest(root)
    assert manifest.dtype == "uint16" and list(manifest.splits) == ["train", "validation"]
    assert manifest.num_tokens() > 10 * manifest.num_tokens("validation") > 0
    assert manifest.sources == tuple(str(p) for p in corpus.embedded_corpus_files().values())
    assert corpus._is_complete(root)
    manifest_time = (root / "manifest.json").stat().st_mtime_ns

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(corpus, "tokenize_files", must_not_run)
    assert prepare_embedded_data(tmp_path) == root
    assert (root / "manifest.json").stat().st_mtime_ns == manifest_time

    shard = root / manifest.shards("validation")[0].path
    shard.write_bytes(shard.read_bytes()[:-2])  # a cut shard: the directory is not complete
    assert not corpus._is_complete(root)
    monkeypatch.undo()
    assert prepare_embedded_data(tmp_path) == root and corpus._is_complete(root)
    assert read_manifest(root) == manifest
    key = corpus.embedded_assets_key()
    monkeypatch.setattr(corpus, "MANIFEST_VERSION", 1)  # a cache of another manifest version is not reused
    assert corpus.embedded_assets_key() != key


def test_publish_keeps_the_first_complete_directory_and_replaces_a_broken_one(tmp_path):
    def token_dir(name: str) -> Path:
        (tmp_path / f"{name}.txt").write_text(f"{name} writer")
        tokenize([tmp_path / f"{name}.txt"], tmp_path / name, validation_inputs=[str(tmp_path / f"{name}.txt")])
        return tmp_path / name

    target = tmp_path / "embedded-key"
    corpus._publish(token_dir("first"), target)
    first = (target / "manifest.json").read_text()
    corpus._publish(token_dir("second"), target)
    assert (target / "manifest.json").read_text() == first and (tmp_path / "second").exists()
    (target / "manifest.json").unlink()
    corpus._publish(token_dir("third"), target)
    assert "third.txt" in (target / "manifest.json").read_text()


# The throughput benchmark


def test_the_throughput_benchmark_measures_speed_and_the_memory_of_every_process(tmp_path, monkeypatch, capsys):
    from benchmarks import tokenize_throughput
    from benchmarks.lab import results

    monkeypatch.setenv(results.ROOT_ENV, str(tmp_path / "results"))
    assert tokenize_throughput.main(["--size-mb", "3", "--workers", "2", "--variant", "test"]) == 0
    result = results.read(tmp_path / "results" / "tokenize_throughput" / "test.json")
    assert result.provenance["argv"][:3] == ["python", "-m", "benchmarks.tokenize_throughput"]
    r = result.payload
    assert r["input_bytes"] >= 3 << 20 and r["documents"] > 100 and r["tokens"] > r["documents"]
    assert r["mb_per_s"] > 0 and r["tokens_per_s"] > 0 and r["dtype"] == "uint16"
    m = r["memory"]
    assert m["samples"] >= 2 and m["max_processes"] >= 3  # the parent and both workers were seen
    assert m["peak_rss_tree_mib"] > m["peak_rss_parent_mib"] > 0 and m["peak_rss_worker_mib"] > 0
    assert m["ru_maxrss_self_mib"] > 0 and r["target"]["peak_rss_tree_within"] is True
    assert "tokens/s" in capsys.readouterr().out
