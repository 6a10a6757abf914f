"""A tokenizer as files: found locally (a directory or the Hugging Face cache, never the network), loaded,
fingerprinted, and copied into a token directory with their hashes, so that a peer fetches and checks the
tokenizer with the data. ``file_sha256`` is the streamed hash of every file a manifest lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from p2p_spes.data_manifest import FileEntry, TokenizerInfo
from p2p_spes.errors import DataError

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

_HASH_CHUNK = 1 << 22
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


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


def write_tokenizer_files(out: Path, source: Path, loaded: Any) -> tuple[FileEntry, ...]:
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


def file_sha256(path: Path) -> str:
    """Streamed SHA-256 of a file, so multi-GB shards are not read into memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
