"""The inputs of ``data tokenize`` (JSON lines, Parquet, plain text, saved datasets) read into documents.

Apart from the encoding so that reading needs no tokenizer, and so that which split a document goes to
is decided in one place, by its text alone (the same for any file order and worker count).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import lzma
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_spes.errors import DataError

SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.zst", ".json.gz", ".parquet", ".txt")
DATASET = "dataset"  # the kind of an input that is a directory written by `datasets`' save_to_disk
TRAIN, VALIDATION = "train", "validation"

_BATCH_DOCUMENTS = 256
_BATCH_CHARS = 1 << 20
_TXT_PIECE_CHARS = 1 << 20  # a .txt file is read and tokenized in pieces of about this many characters
_ROWS = 1024  # rows of a Parquet or Arrow batch turned into Python strings at once
_SPLIT_SALT = b"p2p-spes-validation:"


@dataclass(frozen=True)
class Source:
    """One input: a file and its format (a suffix of SUPPORTED_SUFFIXES), or a saved dataset directory."""

    path: Path
    kind: str


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


def routed_pieces(sources: list[Source], field: str, split: str, fraction: float) -> Iterator[tuple[str, str, bool]]:
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
    for _, text, end in routed_pieces([source], field, TRAIN, 0.0):
        parts.append(text)
        if end:
            yield "".join(parts)
            parts = []


Batch = list[tuple[str, bool]]


def document_batches(pieces: Iterator[tuple[str, str, bool]]) -> Iterator[tuple[str, Batch]]:
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
