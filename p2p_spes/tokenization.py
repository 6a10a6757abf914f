"""Turn text into a token directory (manifest version 2) that any peer can fetch, check and train on.

``tokenize_files`` reads JSON lines (plain, gzip, xz or zstd; Dolma's ``.json.gz`` too), Parquet, plain
text and Hugging Face datasets saved with ``save_to_disk``, always streamed in bounded memory, and writes

    OUT/tokenizer/...            the tokenizer's files, so a peer can fetch the tokenizer with the data
    OUT/train/shard_00000.bin    flat little-endian arrays, uint16 when the vocabulary fits, else uint32
    OUT/validation/shard_...     when a validation split is made (held-out files, or a hashed fraction)
    OUT/manifest.json            written last: every file's size and SHA-256, and the data fingerprint

so that training can ``numpy.memmap`` the shards without parsing, and a corrupt shard or another
tokenizer is caught before a run wastes GPU time on it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import itertools
import json
import lzma
import multiprocessing
import os
import re
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from p2p_spes.data_manifest import (
    DTYPES,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ShardEntry,
    TokenizerInfo,
    token_dtype_for,
    write_manifest,
)
from p2p_spes.errors import DataError

SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.zst", ".json.gz", ".parquet", ".txt")
DATASET = "dataset"  # the kind of an input that is a directory written by `datasets`' save_to_disk
TRAIN, VALIDATION = "train", "validation"
TOKENIZER_DIR = "tokenizer"
# the files a Hugging Face tokenizer directory may hold (save_pretrained's, and the vocabularies of
# the common tokenizer classes); a tokenizer's own `vocab_files_names` are added to them
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)

_BATCH_DOCUMENTS = 256
_BATCH_CHARS = 1 << 20
_TXT_PIECE_CHARS = 1 << 20  # a .txt file is read and tokenized in pieces of about this many characters
_ROWS = 1024  # rows of a Parquet or Arrow batch turned into Python strings at once
_HASH_CHUNK = 1 << 22
_SPLIT_SALT = b"p2p-spes-validation:"
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class Source:
    """One input: a file and its format (a suffix of SUPPORTED_SUFFIXES), or a saved dataset directory."""

    path: Path
    kind: str


def shard_name(index: int) -> str:
    """Name of the index-th shard, zero-padded so that lexical order is shard order."""
    return f"shard_{index:05d}.bin"


def input_format(path: Path) -> str:
    """The supported suffix a file name ends with, or DataError listing the supported ones."""
    name = path.name.lower()
    for suffix in SUPPORTED_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise DataError(
        f"{path}: unsupported file type; supported suffixes are {', '.join(SUPPORTED_SUFFIXES)}, "
        "and a directory written by a Hugging Face dataset's save_to_disk"
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: cannot read ({error}); is the dataset directory complete?") from None


def dataset_source(directory: Path, split: str | None = None) -> Source:
    """The dataset a ``save_to_disk`` directory holds: itself, or one split of a DatasetDict (default train)."""
    if (directory / "dataset_dict.json").is_file():
        splits = _read_json(directory / "dataset_dict.json").get("splits", [])
        chosen = split or TRAIN
        if chosen not in splits:
            raise DataError(
                f"{directory} is a DatasetDict with the splits {', '.join(map(str, splits)) or '(none)'}, not "
                f"{chosen!r}; choose one with --split NAME, or give a split's directory ({directory}/NAME)"
            )
        directory = directory / chosen
    if not (directory / "state.json").is_file():
        raise DataError(
            f"{directory} is a directory but not a Hugging Face dataset saved with save_to_disk (it has no "
            f"state.json or dataset_dict.json); to tokenize files in it, give a glob such as '{directory}/**/*.jsonl'"
        )
    return Source(directory, DATASET)


def expand_inputs(patterns: list[str], split: str | None = None) -> list[Source]:
    """Paths, glob patterns (recursive ``**`` allowed) and dataset directories, as a de-duplicated list.

    Each pattern's matches are sorted; a pattern that names a directory is a saved dataset (``split``
    picks a DatasetDict's split). Every file's format is checked here, before anything is tokenized.
    """
    if not patterns:
        raise DataError("no input files given: pass one or more paths or glob patterns")
    sources: list[Source] = []
    seen: set[str] = set()
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if os.path.isdir(expanded):
            found = [dataset_source(Path(expanded), split)]
        else:
            matches = sorted(m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(
                    f"input pattern {pattern!r} matches no files; check the path "
                    "(quote it so that the shell does not expand it)"
                )
            found = [Source(Path(m), input_format(Path(m))) for m in matches]
        for source in found:
            key = os.path.abspath(source.path)
            if key not in seen:
                seen.add(key)
                sources.append(source)
    return sources


# -- reading documents ------------------------------------------------------------------------------


def _field_error(path: Path, where: str, field: str, detail: str) -> DataError:
    return DataError(f"{path}, {where}: {detail}; choose the text field with --field (currently --field {field})")


def _jsonl_documents(path: Path, stream: io.TextIOBase, field: str) -> Iterator[str]:
    for line_number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path}, line {line_number}: not valid JSON ({error.msg}); each "
                "line of a .jsonl file must be one JSON object"
            ) from None
        if not isinstance(record, dict) or field not in record:
            raise _field_error(path, f"line {line_number}", field, f"record has no field {field!r}")
        text = record[field]
        if not isinstance(text, str):
            raise _field_error(
                path, f"line {line_number}", field, f"field {field!r} is {type(text).__name__}, not a string"
            )
        yield text


def _open_zstd(path: Path) -> io.TextIOBase:
    import zstandard

    raw = open(path, "rb")  # noqa: SIM115 (closed with the text stream that wraps it)
    # read_across_frames: a file of several frames (zstd of concatenated parts) is read whole;
    # max_window_size: files written with --long (windows up to 2 GiB) are read too
    reader = zstandard.ZstdDecompressor(max_window_size=1 << 31).stream_reader(
        raw, read_across_frames=True, closefd=True
    )
    return io.TextIOWrapper(reader, encoding="utf-8")


def _open_jsonl(path: Path, kind: str) -> io.TextIOBase:
    """A text stream of JSON lines; Dolma's ``.json.gz`` documents are gzip'd JSON lines too."""
    if kind == ".jsonl.zst":
        return _open_zstd(path)
    opener = {".jsonl": open, ".jsonl.gz": gzip.open, ".json.gz": gzip.open, ".jsonl.xz": lzma.open}[kind]
    return opener(path, "rt", encoding="utf-8")


def _column_documents(path: Path, batches: Iterator[Any], names: list[str], field: str, where: str) -> Iterator[str]:
    """The strings of column ``field`` of Arrow record batches, ``_ROWS`` rows at a time."""
    if field not in names:
        raise _field_error(path, where, field, f"no column {field!r} (columns: {', '.join(names)})")
    row = 0
    for batch in batches:
        column = batch.column(names.index(field))
        for offset in range(0, len(column), _ROWS):
            for text in column.slice(offset, _ROWS).to_pylist():
                row += 1
                if not isinstance(text, str):
                    raise _field_error(
                        path, f"row {row}", field, f"column {field!r} is {type(text).__name__}, not a string"
                    )
                yield text


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # any failure of the parser: not a Parquet file, or a damaged one
        raise DataError(f"{path}: cannot read as Parquet ({error})") from None
    names = parquet.schema_arrow.names
    if field not in names:
        raise _field_error(path, "schema", field, f"no column {field!r} (columns: {', '.join(names)})")
    yield from _column_documents(path, parquet.iter_batches(columns=[field], batch_size=_ROWS), [field], field, "")


def _dataset_files(directory: Path) -> list[Path]:
    """The Arrow files of a saved dataset, in the order its state.json lists them."""
    state = _read_json(directory / "state.json")
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if listed:
        files = [directory / str(entry.get("filename", "")) for entry in listed if isinstance(entry, dict)]
    else:
        files = sorted(directory.glob("data-*.arrow"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise DataError(
            f"{directory}: the saved dataset's Arrow files {', '.join(missing) or '(data-*.arrow)'} are missing; "
            "save it again with save_to_disk"
        )
    return files


def _arrow_batches(path: Path) -> tuple[list[str], Iterator[Any]]:
    """The column names and record batches of an Arrow IPC file (stream format, as datasets writes it)."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        return reader.schema.names, (reader.get_batch(i) for i in range(reader.num_record_batches))
    return reader.schema.names, iter(reader)


def _dataset_documents(directory: Path, field: str) -> Iterator[str]:
    for path in _dataset_files(directory):
        names, batches = _arrow_batches(path)
        yield from _column_documents(path, batches, names, field, "schema")


def _txt_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """A .txt file as one document, in pieces of about ``_TXT_PIECE_CHARS`` cut at line ends (a line longer
    than that is cut inside); the flag is True on the last piece, the one the EOS follows."""
    limit = _TXT_PIECE_CHARS
    held: str | None = None
    with open(path, encoding="utf-8") as stream:
        lines: list[str] = []
        size = 0
        while line := stream.readline(limit):
            lines.append(line)
            size += len(line)
            if size >= limit:
                if held is not None:
                    yield held, False
                held, lines, size = "".join(lines), [], 0
        if lines:
            if held is not None:
                yield held, False
            held = "".join(lines)
    if held:
        yield held, True


def _text_position(digest: Any) -> float:
    return int.from_bytes(digest.digest()[:8], "big") / 2**64


def document_position(text: str) -> float:
    """Where a document falls in [0, 1): below the validation fraction, it goes to validation."""
    digest = hashlib.sha256(_SPLIT_SALT)
    digest.update(text.encode("utf-8"))
    return _text_position(digest)


def _txt_position(path: Path) -> float:
    """``document_position`` of a whole .txt file, read in pieces (the file never sits in memory)."""
    digest = hashlib.sha256(_SPLIT_SALT)
    for piece, _ in _txt_pieces(path):
        digest.update(piece.encode("utf-8"))
    return _text_position(digest)


def _read_errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa
    import zstandard

    return (OSError, EOFError, lzma.LZMAError, zstandard.ZstdError, pa.ArrowException)


def _pieces(source: Source, field: str) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) of one input in order; empty documents are left out."""
    if source.kind == ".txt":
        yield from _txt_pieces(source.path)
        return
    if source.kind == ".parquet":
        documents = _parquet_documents(source.path, field)
    elif source.kind == DATASET:
        documents = _dataset_documents(source.path, field)
    else:
        documents = None
    if documents is not None:
        yield from ((text, True) for text in documents if text)
        return
    with _open_jsonl(source.path, source.kind) as stream:
        yield from ((text, True) for text in _jsonl_documents(source.path, stream, field) if text)


def _routed(sources: list[Source], field: str, split: str, fraction: float) -> Iterator[tuple[str, str, bool]]:
    """(split, text, ends a document) over ``sources``; with a fraction, each document goes to
    validation when its hash falls below it (the same for any file order and worker count)."""
    errors = _read_errors()
    for source in sources:
        try:
            if fraction and source.kind == ".txt":
                target = VALIDATION if _txt_position(source.path) < fraction else TRAIN
                for text, end in _pieces(source, field):
                    yield target, text, end
            elif fraction:
                for text, end in _pieces(source, field):
                    yield VALIDATION if document_position(text) < fraction else TRAIN, text, end
            else:
                for text, end in _pieces(source, field):
                    yield split, text, end
        except UnicodeDecodeError as error:
            raise DataError(f"{source.path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
        except DataError:
            raise
        except errors as error:
            raise DataError(f"{source.path}: cannot read ({error})") from None


def iter_documents(path: Path, field: str = "text") -> Iterator[str]:
    """The documents of one file or saved dataset directory, in order (a .txt file whole: for tests and tools)."""
    source = dataset_source(path) if path.is_dir() else Source(path, input_format(path))
    parts: list[str] = []
    for _, text, end in _routed([source], field, TRAIN, 0.0):
        parts.append(text)
        if end:
            yield "".join(parts)
            parts = []


Batch = list[tuple[str, bool]]


def _batches(pieces: Iterator[tuple[str, str, bool]]) -> Iterator[tuple[str, Batch]]:
    """Pieces grouped by split into batches of at most ``_BATCH_DOCUMENTS`` pieces or about ``_BATCH_CHARS``."""
    open_batches: dict[str, tuple[Batch, int]] = {}
    for split, text, end in pieces:
        batch, chars = open_batches.get(split, ([], 0))
        batch.append((text, end))
        chars += len(text)
        if len(batch) >= _BATCH_DOCUMENTS or chars >= _BATCH_CHARS:
            open_batches.pop(split, None)
            yield split, batch
        else:
            open_batches[split] = (batch, chars)
    for split in (TRAIN, VALIDATION):
        if split in open_batches:
            yield split, open_batches[split][0]


# -- tokenizers -------------------------------------------------------------------------------------


def _cache_hint(name: str) -> str:
    return (
        f"download it on a machine with internet access with `hf download {name}` (`huggingface-cli download "
        f"{name}` with an older huggingface_hub) and copy the Hugging Face cache here, or save it with "
        "`AutoTokenizer.from_pretrained(name).save_pretrained(DIR)` and pass DIR"
    )


def tokenizer_directory(tokenizer: str | Path) -> Path:
    """The directory of a tokenizer given as a local directory or as a hub name already in the local
    Hugging Face cache; never the network. DataError says how to get one that is missing."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    name = str(tokenizer)
    if path.exists() or not _HUB_NAME.fullmatch(name) or name.startswith("."):
        raise DataError(
            f"tokenizer {name!r} is not a local directory with tokenizer.json; give the "
            "path of a tokenizer directory (for example the embedded one, or one saved with "
            "`AutoTokenizer.from_pretrained(name).save_pretrained(dir)` on a machine with "
            "internet access), or the name of one in the local Hugging Face cache"
        )
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, or a name the hub library refuses: not in the cache either way
        raise DataError(
            f"tokenizer {name!r} is not a local directory, and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); nothing is downloaded here: {_cache_hint(name)}"
        ) from None


def load_tokenizer(tokenizer: str | Path) -> Any:
    """Load a Hugging Face tokenizer from a local directory or the local cache, refusing EOS-less ones."""
    path = tokenizer_directory(tokenizer)
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # any failure of transformers' loader names the directory and what it needs
        raise DataError(
            f"tokenizer directory {path} cannot be loaded ({error}); it must hold "
            "tokenizer.json (and tokenizer_config.json) as written by "
            "save_pretrained"
        ) from None
    if loaded.eos_token_id is None:
        raise DataError(
            f'tokenizer {tokenizer} has no eos_token; set "eos_token" in its '
            "tokenizer_config.json, it is appended after every document"
        )
    return loaded


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the sorted vocabulary, so that two tokenizers that map ids differently differ."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_info(tokenizer: Any, name_or_path: str | Path, files: tuple[FileEntry, ...] = ()) -> TokenizerInfo:
    """The manifest's description of a tokenizer (and of its copied files)."""
    return TokenizerInfo(
        name_or_path=str(name_or_path),
        vocab_size=len(tokenizer),
        eos_token_id=int(tokenizer.eos_token_id),
        fingerprint=tokenizer_fingerprint(tokenizer),
        files=files,
    )


def _same_tokenizer(directory: Path, loaded: Any) -> bool:
    from transformers import AutoTokenizer

    try:
        copy = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception:  # a copy transformers cannot load is not the tokenizer
        return False
    return (len(copy), copy.eos_token_id, tokenizer_fingerprint(copy)) == (
        len(loaded),
        loaded.eos_token_id,
        tokenizer_fingerprint(loaded),
    )


def _write_tokenizer_files(out: Path, source: Path, loaded: Any) -> tuple[FileEntry, ...]:
    """Copy the tokenizer's files to ``out/tokenizer`` (save_pretrained's instead when the copies do not
    load as the same tokenizer) and return their entries; other files there are removed."""
    target = out / TOKENIZER_DIR
    target.mkdir(parents=True, exist_ok=True)
    if target.resolve() != source.resolve():  # re-tokenizing with OUT/tokenizer itself leaves it as it is
        names = sorted({*TOKENIZER_FILES, *(getattr(loaded, "vocab_files_names", None) or {}).values()})
        _clear(target)
        for name in names:
            if (source / name).is_file():
                tmp = target / f".{name}.tmp"
                shutil.copyfile(source / name, tmp)
                os.replace(tmp, target / name)
        if not _same_tokenizer(target, loaded):
            _clear(target)
            loaded.save_pretrained(str(target))
            if not _same_tokenizer(target, loaded):
                raise DataError(
                    f"the tokenizer {source} does not load back the same from its own files (copied or saved "
                    f"with save_pretrained to {target}); save it with save_pretrained and pass that directory"
                )
    return tuple(
        FileEntry(f"{TOKENIZER_DIR}/{path.name}", path.stat().st_size, file_sha256(path))
        for path in sorted(target.iterdir())
        if path.is_file() and not path.name.startswith(".")
    )


def _clear(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file() or path.is_symlink():
            path.unlink()


# what the backend must encode as transformers does before workers use it alone
_PROBES = (
    "Hello, world! This is a test.",
    "  leading and trailing spaces  \n\n\tindented\r\nwindows line",
    "Unicode: \u00e9t\u00e9, \u4e2d\u6587, \U0001f600, \u00a0non-breaking",
    "def f(x):\n    return x ** 2  # squared\n",
    "1234567890 3.14159 0xdeadbeef",
)


def _encoder_spec(loaded: Any, directory: Path) -> tuple:
    """How workers encode: with the ``tokenizers`` backend alone (light, fast to start) when it gives the
    same ids as the transformers tokenizer on probes, else with the transformers tokenizer itself."""
    backend = getattr(loaded, "backend_tokenizer", None) if getattr(loaded, "is_fast", False) else None
    if backend is not None:
        spec = ("backend", backend.to_str(), bool(getattr(loaded, "split_special_tokens", False)))
        probes = [*_PROBES, f"text {loaded.eos_token} more text"]
        expected = loaded(probes, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        if _make_encoder(spec)(probes) == [list(ids) for ids in expected]:
            return spec
    return ("transformers", str(directory))


def _make_encoder(spec: tuple) -> Callable[[list[str]], list[list[int]]]:
    if spec[0] == "backend":
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(spec[1])
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = spec[2]
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # ids without offsets: faster
        return lambda texts: [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
    loaded = load_tokenizer(spec[1])
    return lambda texts: loaded(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)[
        "input_ids"
    ]


def _encode(encode: Callable[[list[str]], list[list[int]]], batch: Batch, eos: int, dtype: str) -> np.ndarray:
    encoded = encode([text for text, _ in batch])
    total = sum(len(ids) for ids in encoded) + sum(end for _, end in batch)
    out = np.empty(total, dtype=np.uint32)
    position = 0
    for ids, (_, end) in zip(encoded, batch, strict=True):
        out[position : position + len(ids)] = ids
        position += len(ids)
        if end:
            out[position] = eos
            position += 1
    if dtype == "uint16":
        if out.size and int(out.max()) > 0xFFFF:
            raise DataError(
                f"token id {int(out.max())} does not fit the uint16 shards chosen for a vocabulary of at most "
                "65536; the tokenizer's ids go past its length"
            )
        return out.astype(DTYPES[dtype])
    return out


_worker: tuple[Callable[[list[str]], list[list[int]]], int, str] | None = None


def _init_worker(spec: tuple, eos: int, dtype: str) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker = (_make_encoder(spec), eos, dtype)


def _encode_in_worker(batch: Batch) -> np.ndarray:
    encode, eos, dtype = _worker
    return _encode(encode, batch, eos, dtype)


def _token_arrays(
    batches: Iterator[tuple[str, Batch]], spec: tuple, eos: int, dtype: str, num_workers: int
) -> Iterator[tuple[str, int, np.ndarray]]:
    """(split, documents ended, tokens) per batch in input order, however many workers encode them."""
    if num_workers == 1:
        encode = _make_encoder(spec)
        for split, batch in batches:
            yield split, sum(end for _, end in batch), _encode(encode, batch, eos, dtype)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_init_worker, initargs=(spec, eos, dtype)
    ) as pool:
        pending: deque[tuple[str, int, Future]] = deque()
        for split, batch in batches:
            pending.append((split, sum(end for _, end in batch), pool.submit(_encode_in_worker, batch)))
            if len(pending) >= 4 * num_workers:
                split, count, future = pending.popleft()
                yield split, count, future.result()
        while pending:
            split, count, future = pending.popleft()
            yield split, count, future.result()


# -- writing ----------------------------------------------------------------------------------------


class _ShardWriter:
    """Split a split's token stream into shards of at most ``shard_tokens``, each renamed into place."""

    def __init__(self, root: Path, split: str, shard_tokens: int, dtype: str) -> None:
        self.split = split
        self.out_dir = root / split
        self.shard_tokens = shard_tokens
        self.itemsize = DTYPES[dtype].itemsize
        self.shards: list[ShardEntry] = []
        self._file: io.BufferedWriter | None = None
        self._tmp: Path | None = None
        self._count = 0
        self._max = 0
        self._hash = hashlib.sha256()

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._file is None:
                self._open()
            take = min(tokens.size, self.shard_tokens - self._count)
            chunk = tokens[:take]
            data = chunk.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            self._max = max(self._max, int(chunk.max()))
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._close()

    def finish(self) -> tuple[ShardEntry, ...]:
        if self._file is not None:
            self._close()
        return tuple(self.shards)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._file = None

    def _open(self) -> None:
        name = shard_name(len(self.shards))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = self.out_dir / f".{name}.{os.getpid()}.tmp"
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (open across calls; closed by finish()/abort())
        self._count, self._max, self._hash = 0, 0, hashlib.sha256()

    def _close(self) -> None:
        name = shard_name(len(self.shards))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp, self.out_dir / name)
        self.shards.append(
            ShardEntry(
                path=f"{self.split}/{name}",
                bytes=self._count * self.itemsize,
                sha256=self._hash.hexdigest(),
                num_tokens=self._count,
                max_token_id=self._max,
            )
        )


_SHARD_GLOB = "shard_[0-9][0-9][0-9][0-9][0-9].bin"


def _remove_stale_shards(out: Path, splits: dict[str, tuple[ShardEntry, ...]]) -> None:
    """Shards no split of the new manifest lists: of an earlier, longer run, or of the version-1 layout."""
    keep = {entry.path for shards in splits.values() for entry in shards}
    for directory in (out, out / TRAIN, out / VALIDATION):
        for stale in directory.glob(_SHARD_GLOB):
            if stale.relative_to(out).as_posix() not in keep:
                stale.unlink()
    for split in (TRAIN, VALIDATION):
        if split not in splits and (out / split).is_dir() and not any((out / split).iterdir()):
            (out / split).rmdir()


def _check_split_sizes(
    documents: dict[str, int], train: list[Source], validation: list[Source] | None, fraction: float
) -> None:
    if documents[TRAIN] == 0:
        if fraction and documents[VALIDATION]:
            raise DataError(
                f"--validation-fraction {fraction} put all {documents[VALIDATION]} documents into the validation "
                "split and none into train; give a smaller fraction or more documents"
            )
        raise DataError(f"no non-empty documents in {', '.join(str(s.path) for s in train)}")
    if validation is not None and documents[VALIDATION] == 0:
        raise DataError(f"no non-empty documents in the validation inputs {', '.join(str(s.path) for s in validation)}")
    if fraction and documents[VALIDATION] == 0:
        raise DataError(
            f"--validation-fraction {fraction} put none of the {documents[TRAIN]} documents into the validation "
            "split (too few documents for that fraction); give a larger fraction or more documents, or "
            "held-out files with --validation-input FILES"
        )


def tokenize_files(
    inputs: list[str],
    tokenizer: str | Path,
    out_dir: str | Path,
    *,
    validation_inputs: list[str] | None = None,
    validation_fraction: float = 0.0,
    num_workers: int = 2,
    shard_tokens: int = 2**26,
    field: str = "text",
    split: str | None = None,
    progress: bool = True,
) -> Manifest:
    """Tokenize ``inputs`` (and a validation split) into the token directory ``out_dir``; return its manifest.

    Documents are read in sorted file order and encoded in order-preserving batches, so the shards are
    byte-identical for any ``num_workers``. Empty documents are skipped; every other document is
    followed by the tokenizer's EOS token. ``validation_inputs`` are tokenized as the validation split;
    else ``validation_fraction`` sends each document whose text hashes below it to validation.
    ``split`` picks the split of a DatasetDict directory (default train).
    """
    if num_workers < 1:
        raise DataError(f"num_workers must be at least 1, got {num_workers}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    if not 0 <= validation_fraction < 1:
        raise DataError(f"--validation-fraction must be in [0, 1), got {validation_fraction}")
    if validation_inputs and validation_fraction:
        raise DataError(
            "give held-out files with --validation-input or a fraction with --validation-fraction, not both"
        )
    train_sources = expand_inputs(inputs, split)
    validation_sources = expand_inputs(validation_inputs, split) if validation_inputs else None
    directory = tokenizer_directory(tokenizer)
    loaded = load_tokenizer(directory)
    dtype = token_dtype_for(len(loaded))
    eos = int(loaded.eos_token_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # the directory is unfinished until the manifest is back
    files = _write_tokenizer_files(out, directory, loaded)
    spec = _encoder_spec(loaded, directory)

    pieces = _routed(train_sources, field, TRAIN, validation_fraction)
    if validation_sources is not None:
        pieces = itertools.chain(pieces, _routed(validation_sources, field, VALIDATION, 0.0))
    writers = {name: _ShardWriter(out, name, shard_tokens, dtype) for name in (TRAIN, VALIDATION)}
    documents = {TRAIN: 0, VALIDATION: 0}
    tokens_written = 0
    with tqdm(desc="tokenizing", unit="doc", disable=not progress) as bar:
        try:
            for name, count, tokens in _token_arrays(_batches(pieces), spec, eos, dtype, num_workers):
                writers[name].write(tokens)
                documents[name] += count
                tokens_written += int(tokens.size)
                bar.update(count)
                bar.set_postfix(tokens=tokens_written, refresh=False)
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
    splits = {name: writer.finish() for name, writer in writers.items()}
    _check_split_sizes(documents, train_sources, validation_sources, validation_fraction)
    splits = {name: shards for name, shards in splits.items() if shards}
    manifest = Manifest(
        dtype=dtype,
        tokenizer=tokenizer_info(loaded, tokenizer, files),
        splits=splits,
        num_documents={name: documents[name] for name in splits},
        sources=tuple(str(s.path) for s in [*train_sources, *(validation_sources or [])]),
    )
    _remove_stale_shards(out, splits)
    write_manifest(out, manifest)
    return manifest


def file_sha256(path: Path) -> str:
    """Streamed SHA-256 of a file, so multi-GB shards are not read into memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
