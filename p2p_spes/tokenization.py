"""Turn text files into flat uint32 token shards plus a manifest that later runs can verify.

Shards are plain little-endian uint32 arrays so that training can `numpy.memmap` them without
parsing; the manifest records sizes, checksums and the tokenizer's fingerprint so a corrupt
shard or a mismatched tokenizer is caught before a run wastes GPU time on it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import lzma
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from p2p_spes.errors import DataError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "p2p-spes-tokens"
MANIFEST_VERSION = 1
TOKEN_DTYPE = np.dtype("<u4")
SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".parquet", ".txt")

_BATCH_DOCUMENTS = 256
_BATCH_CHARS = 1 << 20
_HASH_CHUNK = 1 << 22


def shard_name(index: int) -> str:
    """Name of the index-th shard, zero-padded so that lexical order is shard order."""
    return f"shard_{index:05d}.bin"


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Expand glob patterns (recursive `**` allowed) into a sorted, de-duplicated file list."""
    if not patterns:
        raise DataError("no input files given: pass one or more paths or glob patterns")
    files: list[Path] = []
    seen: set[str] = set()
    for pattern in patterns:
        matches = sorted(m for m in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(m))
        if not matches:
            raise DataError(
                f"input pattern {pattern!r} matches no files; check the path "
                "(quote it so that the shell does not expand it)"
            )
        for match in matches:
            key = os.path.abspath(match)
            if key not in seen:
                seen.add(key)
                files.append(Path(match))
    return files


def input_format(path: Path) -> str:
    """The supported suffix a file name ends with, or DataError listing the supported ones."""
    name = path.name.lower()
    for suffix in SUPPORTED_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise DataError(f"{path}: unsupported file type; supported suffixes are {', '.join(SUPPORTED_SUFFIXES)}")


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


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:
        raise DataError(f"{path}: cannot read as Parquet ({error})") from None
    if field not in parquet.schema_arrow.names:
        raise _field_error(
            path, "schema", field, f"no column {field!r} (columns: {', '.join(parquet.schema_arrow.names)})"
        )
    row = 0
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise _field_error(
                    path, f"row {row}", field, f"column {field!r} is {type(text).__name__}, not a string"
                )
            yield text


def iter_documents(path: Path, field: str = "text") -> Iterator[str]:
    """Yield the documents of one file in file order; malformed input raises DataError."""
    suffix = input_format(path)
    try:
        if suffix == ".parquet":
            yield from _parquet_documents(path, field)
        elif suffix == ".txt":
            yield path.read_text(encoding="utf-8")
        else:
            opener = {".jsonl": open, ".jsonl.gz": gzip.open, ".jsonl.xz": lzma.open}[suffix]
            with opener(path, "rt", encoding="utf-8") as stream:
                yield from _jsonl_documents(path, stream, field)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (OSError, EOFError, lzma.LZMAError) as error:
        raise DataError(f"{path}: cannot read ({error})") from None


def load_tokenizer(tokenizer: str | Path) -> Any:
    """Load a local Hugging Face tokenizer directory, refusing hub names and EOS-less tokenizers."""
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise DataError(
            f"tokenizer {str(tokenizer)!r} is not a local directory with tokenizer.json; give the "
            "path of a tokenizer directory (for example the embedded one, or one saved with "
            "`AutoTokenizer.from_pretrained(name).save_pretrained(dir)` on a machine with "
            "internet access)"
        )
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:
        raise DataError(
            f"tokenizer directory {path} cannot be loaded ({error}); it must hold "
            "tokenizer.json (and tokenizer_config.json) as written by "
            "save_pretrained"
        ) from None
    if loaded.eos_token_id is None:
        raise DataError(
            f'tokenizer {path} has no eos_token; set "eos_token" in its '
            "tokenizer_config.json, it is appended after every document"
        )
    return loaded


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the sorted vocabulary, so that two tokenizers that map ids differently differ."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_info(tokenizer: Any, name_or_path: str | Path) -> dict[str, Any]:
    """The manifest's description of a tokenizer."""
    return {
        "name_or_path": str(name_or_path),
        "vocab_size": len(tokenizer),
        "eos_token_id": int(tokenizer.eos_token_id),
        "fingerprint": tokenizer_fingerprint(tokenizer),
    }


def _encode(tokenizer: Any, texts: list[str]) -> np.ndarray:
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    total = sum(len(ids) for ids in encoded) + len(encoded)
    out = np.empty(total, dtype=TOKEN_DTYPE)
    position = 0
    for ids in encoded:
        out[position : position + len(ids)] = ids
        position += len(ids)
        out[position] = eos
        position += 1
    return out


_worker_tokenizer: Any = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_in_worker(texts: list[str]) -> np.ndarray:
    return _encode(_worker_tokenizer, texts)


def _batches(files: list[Path], field: str) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for path in files:
        for text in iter_documents(path, field):
            if not text:
                continue
            batch.append(text)
            chars += len(text)
            if len(batch) >= _BATCH_DOCUMENTS or chars >= _BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


class _ShardWriter:
    """Split a token stream into shards of at most `shard_tokens`, each renamed into place."""

    def __init__(self, out_dir: Path, shard_tokens: int) -> None:
        self.out_dir = out_dir
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
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

    def finish(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._close()
        return self.shards

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._file = None

    def _open(self) -> None:
        name = shard_name(len(self.shards))
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
            {"file": name, "num_tokens": self._count, "sha256": self._hash.hexdigest(), "max_token_id": self._max}
        )


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _remove_stale_shards(out_dir: Path, keep: set[str]) -> None:
    for stale in out_dir.glob("shard_[0-9][0-9][0-9][0-9][0-9].bin"):
        if stale.name not in keep:
            stale.unlink()


def _token_arrays(
    batches: Iterator[list[str]], tokenizer: Any, tokenizer_path: Path, num_workers: int
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (documents, tokens) per batch in input order, however many workers encode them."""
    if num_workers == 1:
        for batch in batches:
            yield len(batch), _encode(tokenizer, batch)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_init_worker, initargs=(str(tokenizer_path),)
    ) as pool:
        pending: deque[tuple[int, Future]] = deque()
        for batch in batches:
            pending.append((len(batch), pool.submit(_encode_in_worker, batch)))
            if len(pending) >= 4 * num_workers:
                count, future = pending.popleft()
                yield count, future.result()
        while pending:
            count, future = pending.popleft()
            yield count, future.result()


def tokenize_files(
    inputs: list[str],
    tokenizer: str | Path,
    out_dir: str | Path,
    *,
    num_workers: int = 2,
    shard_tokens: int = 2**26,
    field: str = "text",
    progress: bool = True,
) -> dict:
    """Tokenize text files into uint32 shards in `out_dir` and return the written manifest.

    Documents are read in sorted file order and encoded in order-preserving batches, so the
    shards are byte-identical for any `num_workers`. Empty documents are skipped; every other
    document is followed by the tokenizer's EOS token.
    """
    if num_workers < 1:
        raise DataError(f"num_workers must be at least 1, got {num_workers}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    files = expand_inputs(inputs)
    for path in files:
        input_format(path)
    tokenizer_path = Path(tokenizer).expanduser()
    loaded = load_tokenizer(tokenizer_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)

    writer = _ShardWriter(out, shard_tokens)
    num_documents = 0
    num_tokens = 0
    with tqdm(desc="tokenizing", unit="doc", disable=not progress) as bar:
        try:
            for count, tokens in _token_arrays(_batches(files, field), loaded, tokenizer_path, num_workers):
                writer.write(tokens)
                num_documents += count
                num_tokens += int(tokens.size)
                bar.update(count)
                bar.set_postfix(tokens=num_tokens, refresh=False)
        except BaseException:
            writer.abort()
            raise
    shards = writer.finish()
    if num_documents == 0:
        raise DataError(f"no non-empty documents in {', '.join(map(str, files))}")
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "dtype": "uint32",
        "tokenizer": tokenizer_info(loaded, tokenizer),
        "num_documents": num_documents,
        "num_tokens": num_tokens,
        "shards": shards,
        "sources": [str(path) for path in files],
    }
    _remove_stale_shards(out, {shard["file"] for shard in shards})
    _write_json_atomic(out / MANIFEST_NAME, manifest)
    return manifest


def file_sha256(path: Path) -> str:
    """Streamed SHA-256 of a file, so multi-GB shards are not read into memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
