"""Turn text into a token directory (manifest version 2) that any peer can fetch, check and train on.

``tokenize_files`` reads JSON lines (plain, gzip, xz or zstd; Dolma's ``.json.gz`` too), Parquet, plain
text and Hugging Face datasets saved with ``save_to_disk``, always streamed in bounded memory, and writes

    OUT/tokenizer/...            the tokenizer's files, so a peer can fetch the tokenizer with the data
    OUT/train/shard_00000.bin    flat little-endian arrays, uint16 when the vocabulary fits, else uint32
    OUT/validation/shard_...     when a validation split is made (held-out files, or a hashed fraction)
    OUT/manifest.json            written last: every file's size and SHA-256, and the data fingerprint

so that training can ``numpy.memmap`` the shards without parsing, and a corrupt shard or another
tokenizer is caught before a run wastes GPU time on it. The inputs are read by ``text_inputs``, the
tokenizer found and copied by ``tokenizer_files``; this module encodes (in workers) and writes the shards.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from p2p_spes.data_manifest import DTYPES, MANIFEST_NAME, Manifest, ShardEntry, token_dtype_for, write_manifest
from p2p_spes.errors import DataError
from p2p_spes.text_inputs import (
    TRAIN,
    VALIDATION,
    Batch,
    Source,
    document_batches,
    expand_inputs,
    routed_pieces,
)
from p2p_spes.tokenizer_files import load_tokenizer, tokenizer_directory, tokenizer_info, write_tokenizer_files


def shard_name(index: int) -> str:
    """Name of the index-th shard, zero-padded so that lexical order is shard order."""
    return f"shard_{index:05d}.bin"


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
    files = write_tokenizer_files(out, directory, loaded)
    spec = _encoder_spec(loaded, directory)

    pieces = routed_pieces(train_sources, field, TRAIN, validation_fraction)
    if validation_sources is not None:
        pieces = itertools.chain(pieces, routed_pieces(validation_sources, field, VALIDATION, 0.0))
    writers = {name: _ShardWriter(out, name, shard_tokens, dtype) for name in (TRAIN, VALIDATION)}
    documents = {TRAIN: 0, VALIDATION: 0}
    tokens_written = 0
    with tqdm(desc="tokenizing", unit="doc", disable=not progress) as bar:
        try:
            for name, count, tokens in _token_arrays(document_batches(pieces), spec, eos, dtype, num_workers):
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
