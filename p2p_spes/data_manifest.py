"""What a token directory holds, as one typed manifest, and the fingerprint that names the data.

A manifest lists every file a peer needs to train on a run's data (the tokenizer's files, the
train and validation shards) with its size and SHA-256, so that a peer can fetch any of them from
any source and check it, and so that two peers can tell in one string comparison whether they
train on the same tokens. Version 2 is written by ``p2p-spes data tokenize``; version 1 (one
directory per split, uint32 shards, no tokenizer files) is still read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from p2p_spes.errors import DataError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "p2p-spes-tokens"
MANIFEST_VERSION = 2
SPLITS = ("train", "validation")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
RETOKENIZE = "re-create it with `p2p-spes data tokenize --input ... --tokenizer ... --out DIR`"


def token_dtype_for(vocab_size: int) -> str:
    """uint16 where every id fits (half the disk and download), uint32 otherwise."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class FileEntry:
    """One file of a token directory: its path relative to the manifest, bytes and SHA-256."""

    path: str
    bytes: int
    sha256: str

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class ShardEntry(FileEntry):
    """A token shard: a flat little-endian array of ``num_tokens`` ids, the largest ``max_token_id``."""

    num_tokens: int = 0
    max_token_id: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "num_tokens": self.num_tokens, "max_token_id": self.max_token_id}


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer the shards were made with; ``files`` (version 2) let a peer fetch it."""

    name_or_path: str
    vocab_size: int
    eos_token_id: int
    fingerprint: str
    files: tuple[FileEntry, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "name_or_path": self.name_or_path,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "fingerprint": self.fingerprint,
            "files": [f.as_dict() for f in self.files],
        }


@dataclass(frozen=True)
class Manifest:
    """A token directory's manifest: the tokenizer, the dtype and each split's shards."""

    dtype: str
    tokenizer: TokenizerInfo
    splits: dict[str, tuple[ShardEntry, ...]]
    num_documents: dict[str, int] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    version: int = MANIFEST_VERSION

    @property
    def token_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    def shards(self, split: str = "train") -> tuple[ShardEntry, ...]:
        """The shards of ``split``, or DataError naming the splits there are."""
        if split not in self.splits:
            raise DataError(
                f"the data has no {split!r} split (it has {', '.join(self.splits) or 'none'}); "
                "tokenize a held-out split with --validation-input FILES or --validation-fraction F"
            )
        return self.splits[split]

    def num_tokens(self, split: str = "train") -> int:
        return sum(s.num_tokens for s in self.shards(split))

    def files(self) -> list[FileEntry]:
        """Every file a peer needs for the whole data: tokenizer files, then the shards by split."""
        return [*self.tokenizer.files, *(s for split in self.splits.values() for s in split)]

    @property
    def fingerprint(self) -> str:
        """SHA-256 over what the tokens are: dtype, tokenizer and every shard's digest by split.

        Paths, sources and document counts are left out, so the same tokens copied elsewhere keep
        their fingerprint, and any other tokenizer or shard gives another.
        """
        content = {
            "dtype": self.dtype,
            "tokenizer": [self.tokenizer.fingerprint, self.tokenizer.vocab_size, self.tokenizer.eos_token_id],
            "splits": {
                name: [[s.sha256, s.num_tokens] for s in shards] for name, shards in sorted(self.splits.items())
            },
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "dtype": self.dtype,
            "tokenizer": self.tokenizer.as_dict(),
            "splits": {name: [s.as_dict() for s in shards] for name, shards in self.splits.items()},
            "num_documents": dict(self.num_documents),
            "num_tokens": {name: self.num_tokens(name) for name in self.splits},
            "sources": list(self.sources),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1) + "\n"


def combined_fingerprint(train: Manifest, validation: Manifest) -> str:
    """The fingerprint of data whose splits come from two directories (``data.train`` and ``data.validation``)."""
    if train is validation:
        return train.fingerprint
    return hashlib.sha256(f"{train.fingerprint}:{validation.fingerprint}".encode()).hexdigest()


def _require(condition: bool, where: str, detail: str) -> None:
    if not condition:
        raise DataError(f"{where}: {detail}; {RETOKENIZE}")


def _safe_path(text: Any, where: str) -> str:
    """A relative POSIX path inside the directory: a manifest may not point anywhere else."""
    ok = isinstance(text, str) and text and "\\" not in text
    path = PurePosixPath(text) if ok else None
    _require(
        path is not None and not path.is_absolute() and ".." not in path.parts and len(path.parts) <= 2,
        where,
        f"file path {text!r} is not a relative path inside the directory",
    )
    return str(path)


def _int(record: dict, key: str, where: str) -> int:
    value = record.get(key)
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, where, f"{key} is {value!r}")
    return value


def _digest(record: dict, where: str) -> str:
    value = record.get("sha256")
    _require(
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value),
        where,
        f"sha256 is {value!r}",
    )
    return value


def _shard(record: Any, where: str, itemsize: int, version: int) -> ShardEntry:
    _require(isinstance(record, dict), where, "a shard entry is not an object")
    num_tokens = _int(record, "num_tokens", where)
    if version == 1:
        path, size = _safe_path(record.get("file"), where), num_tokens * itemsize
        _require("/" not in path, where, f"file path {path!r} is not in the directory")
    else:
        path, size = _safe_path(record.get("path"), where), _int(record, "bytes", where)
    _require(
        size == num_tokens * itemsize,
        where,
        f"shard {path} is said to be {size} bytes, not {num_tokens} tokens of {itemsize} bytes",
    )
    return ShardEntry(path, size, _digest(record, where), num_tokens, _int(record, "max_token_id", where))


def parse_manifest(data: Any, where: str) -> Manifest:
    """A Manifest from its decoded JSON (version 1 or 2), or DataError saying what is wrong and how to fix it."""
    _require(
        isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT, where, f"not a {MANIFEST_FORMAT} manifest"
    )
    version, dtype = data.get("version"), data.get("dtype")
    _require(
        (version == 1 and dtype == "uint32") or (version == MANIFEST_VERSION and dtype in DTYPES),
        where,
        f"version {version!r} with dtype {dtype!r}: this p2p-spes reads version 1 (uint32) and version "
        f"{MANIFEST_VERSION} (uint16 or uint32) manifests",
    )
    itemsize = DTYPES[dtype].itemsize
    info = data.get("tokenizer")
    _require(isinstance(info, dict), where, "no tokenizer description")
    fingerprint = info.get("fingerprint")
    _require(isinstance(fingerprint, str) and fingerprint, where, "the tokenizer has no fingerprint")
    files = info.get("files", [])
    _require(isinstance(files, list), where, "tokenizer.files is not a list")
    tokenizer = TokenizerInfo(
        name_or_path=str(info.get("name_or_path", "")),
        vocab_size=_int(info, "vocab_size", where),
        eos_token_id=_int(info, "eos_token_id", where),
        fingerprint=fingerprint,
        files=tuple(
            FileEntry(_safe_path(f.get("path"), where), _int(f, "bytes", where), _digest(f, where))
            for f in files
            if _is_dict(f, where)
        ),
    )
    if version == 1:
        raw_splits = {"train": data.get("shards")}
        documents = {"train": data.get("num_documents", 0)}
    else:
        raw_splits = data.get("splits")
        _require(isinstance(raw_splits, dict) and "train" in raw_splits, where, "no train split")
        documents = data.get("num_documents", {})
    splits: dict[str, tuple[ShardEntry, ...]] = {}
    for name, shards in raw_splits.items():
        _require(isinstance(shards, list) and shards, where, f"split {name!r} lists no shards")
        splits[name] = tuple(_shard(s, f"{where}, split {name}", itemsize, version) for s in shards)
    paths = [f.path for f in tokenizer.files] + [s.path for shards in splits.values() for s in shards]
    _require(len(paths) == len(set(paths)), where, "a file is listed twice")
    return Manifest(
        dtype=dtype,
        tokenizer=tokenizer,
        splits=splits,
        num_documents={k: int(v) for k, v in documents.items()} if isinstance(documents, dict) else {},
        sources=tuple(str(s) for s in data.get("sources", [])),
        version=version,
    )


def _is_dict(record: Any, where: str) -> bool:
    _require(isinstance(record, dict), where, "a tokenizer file entry is not an object")
    return True


def decode_manifest(raw: bytes, where: str) -> Manifest:
    """Parse a manifest's bytes (as read from disk or fetched from a URL or a peer)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{where} is not valid JSON ({error}); {RETOKENIZE}") from None
    return parse_manifest(data, where)


def read_manifest(root: str | Path) -> Manifest:
    """The manifest of the token directory ``root``, or DataError naming what is missing."""
    root = Path(root)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise DataError(f"token directory {root} does not exist; {RETOKENIZE}")
    if not path.is_file():
        raise DataError(f"{path} is missing, so {root} is not a finished token directory; {RETOKENIZE}")
    return decode_manifest(path.read_bytes(), str(path))


def write_manifest(root: Path, manifest: Manifest) -> Path:
    """Write ``root/manifest.json`` atomically (a reader never sees half of it)."""
    path = root / MANIFEST_NAME
    tmp = root / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(manifest.to_json(), encoding="utf-8")
    tmp.replace(path)
    return path
