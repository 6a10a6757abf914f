"""The small corpus and tokenizer shipped inside the package, and the builder that makes them.

They let a fresh install train, validate and test end to end with no download: the
reStructuredText sources of the Python 3.11 documentation (PSF licence), split into train and
validation by a hash of each file's path, and a byte-level BPE tokenizer trained on the train
split. Build them with `python -m p2p_spes.corpus build --source DIR_OR_DEB --out p2p_spes/assets`.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import lzma
import os
import shutil
import sys
import tarfile
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from p2p_spes.data_manifest import MANIFEST_VERSION, read_manifest
from p2p_spes.errors import DataError
from p2p_spes.tokenization import tokenize_files

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
SPLITS = ("train", "validation")
EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VALIDATION_FRACTION = 0.05
DOC_SUFFIX = ".rst.txt"
SOURCES_DIR = "_sources"
CACHE_ENV = "P2P_SPES_CACHE"
_REBUILD_HINT = (
    "reinstall p2p-spes, or rebuild the assets with `python -m p2p_spes.corpus build "
    "--source python3.11-doc.deb --out p2p_spes/assets`"
)


@dataclass
class CorpusSource:
    """Documents read from a documentation tree, with the licence that covers them."""

    documents: dict[str, str]
    licence: str
    origin: str


def _ar_members(data: bytes, path: Path) -> Iterator[tuple[str, bytes]]:
    """Members of a Debian package, which is an `ar` archive of tarballs."""
    if not data.startswith(b"!<arch>\n"):
        raise DataError(f"{path}: not a Debian package (no ar header)")
    offset = 8
    while offset + 60 <= len(data):
        header = data[offset : offset + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        offset += 60
        yield name, data[offset : offset + size]
        offset += size + (size % 2)


def _open_member_tar(members: dict[str, bytes], prefix: str, path: Path) -> tarfile.TarFile:
    for name, payload in members.items():
        if name.startswith(prefix):
            try:
                return tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")
            except tarfile.TarError:
                raise DataError(
                    f"{path}: cannot open {name} (zstd-compressed packages are not "
                    "supported); extract it with `dpkg-deb -x` and pass the "
                    "directory instead"
                ) from None
    raise DataError(f"{path}: Debian package has no {prefix}* member")


def _control_field(control: tarfile.TarFile, field: str) -> str:
    for member in control.getmembers():
        if member.isfile() and member.name.lstrip("./") == "control":
            for line in control.extractfile(member).read().decode("utf-8").splitlines():
                if line.startswith(f"{field}:"):
                    return line.split(":", 1)[1].strip()
    return "unknown"


def _relative_doc_path(name: str) -> str | None:
    marker = f"/{SOURCES_DIR}/"
    name = "/" + name.lstrip("./")
    if marker not in name or not name.endswith(DOC_SUFFIX):
        return None
    return name.split(marker, 1)[1]


def read_deb(path: Path) -> CorpusSource:
    """Read the reST sources and the Debian copyright file straight from a .deb."""
    members = dict(_ar_members(path.read_bytes(), path))
    control = _open_member_tar(members, "control.tar", path)
    origin = f"the Debian package {_control_field(control, 'Package')}, version {_control_field(control, 'Version')}"
    documents: dict[str, str] = {}
    licence = ""
    with _open_member_tar(members, "data.tar", path) as data:
        for member in data.getmembers():
            if not member.isfile():
                continue
            relative = _relative_doc_path(member.name)
            if relative is not None:
                documents[relative] = data.extractfile(member).read().decode("utf-8")
            elif member.name.endswith("-doc/copyright"):
                licence = data.extractfile(member).read().decode("utf-8")
    return CorpusSource(documents, licence, origin)


def _find_sources_root(root: Path) -> Path:
    if root.name == SOURCES_DIR or any(root.glob(f"*{DOC_SUFFIX}")):
        return root
    candidates = sorted(p for p in root.rglob(SOURCES_DIR) if p.is_dir())
    if len(candidates) != 1:
        raise DataError(
            f"{root}: expected exactly one {SOURCES_DIR} directory of *{DOC_SUFFIX} "
            f"files, found {len(candidates)}; pass that directory as --source"
        )
    return candidates[0]


def read_directory(root: Path) -> CorpusSource:
    """Read the reST sources from an extracted package (or a bare `_sources` directory)."""
    sources = _find_sources_root(root)
    documents = {
        p.relative_to(sources).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(sources.rglob(f"*{DOC_SUFFIX}"))
        if p.is_file()
    }
    copyrights = sorted(root.glob("usr/share/doc/*-doc/copyright"))
    if copyrights:
        licence = copyrights[0].read_text(encoding="utf-8")
    elif (sources / f"license{DOC_SUFFIX}").is_file():
        licence = (sources / f"license{DOC_SUFFIX}").read_text(encoding="utf-8")
    else:
        licence = ""
    return CorpusSource(documents, licence, f"the directory {root.name}")


def read_source(source: Path) -> CorpusSource:
    """Read a documentation source given as a .deb file or a directory."""
    if source.is_dir():
        corpus = read_directory(source)
    elif source.is_file() and source.suffix == ".deb":
        corpus = read_deb(source)
    else:
        raise DataError(f"{source}: --source must be a .deb file or a directory")
    if not corpus.documents:
        raise DataError(f"{source}: no *{DOC_SUFFIX} documents found")
    if not corpus.licence:
        raise DataError(
            f"{source}: no licence text found (a *-doc/copyright file or "
            f"license{DOC_SUFFIX}); the corpus cannot be redistributed without it"
        )
    return corpus


def split_of(relative_path: str, validation_fraction: float) -> str:
    """Stable train/validation assignment from a hash of the path, independent of file order."""
    digest = hashlib.sha256(f"p2p-spes-split:{relative_path}".encode()).digest()
    position = int.from_bytes(digest[:8], "big") / 2**64
    return "validation" if position < validation_fraction else "train"


def _write_jsonl_xz(path: Path, records: list[dict[str, str]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as stream:
        for record in records:
            stream.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _licence_text(corpus: CorpusSource, counts: dict[str, int]) -> str:
    paragraphs = [
        (
            "train.jsonl.xz and validation.jsonl.xz hold, unmodified, the reStructuredText sources of "
            f"the Python 3.11 documentation (html/_sources/*{DOC_SUFFIX}) taken from {corpus.origin}, "
            f"one JSON object per file ({counts['train']} train, {counts['validation']} validation "
            "documents). The tokenizer in ../tokenizer was trained on train.jsonl.xz."
        ),
        (
            "Python and its documentation are Copyright (c) 2001-2023 Python Software Foundation, "
            "(c) 2000 BeOpen.com, (c) 1995-2000 Corporation for National Research Initiatives, "
            "(c) 1991-1995 Stichting Mathematisch Centrum. They are distributed under the PSF License "
            "Agreement; the licence text shipped with the package follows."
        ),
    ]
    title = "Embedded corpus of p2p-spes"
    header = "\n\n".join([f"{title}\n{'=' * len(title)}"] + [textwrap.fill(p, 78) for p in paragraphs])
    return f"{header}\n\n{'-' * 78}\n\n{corpus.licence}"


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE (lossless on any text) and save it as a Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
    }
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def build_assets(
    source: Path,
    out: Path,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> dict[str, int]:
    """Write the corpus splits, their licence and the tokenizer under `out`; return split sizes."""
    if not 0 < validation_fraction < 1:
        raise DataError(f"--validation-fraction must be in (0, 1), got {validation_fraction}")
    corpus = read_source(source)
    records: dict[str, list[dict[str, str]]] = {split: [] for split in SPLITS}
    for relative in sorted(corpus.documents):
        split = split_of(relative, validation_fraction)
        records[split].append({"text": corpus.documents[relative], "source": relative})
    counts = {split: len(records[split]) for split in SPLITS}
    if min(counts.values()) == 0:
        raise DataError(
            f"{source}: too few documents to split ({counts}); use more documents or change --validation-fraction"
        )
    corpus_dir = out / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        _write_jsonl_xz(corpus_dir / f"{split}.jsonl.xz", records[split])
    (corpus_dir / "LICENSE").write_text(_licence_text(corpus, counts), encoding="utf-8")
    train_tokenizer([r["text"] for r in records["train"]], out / "tokenizer", vocab_size)
    return counts


def embedded_tokenizer_path() -> Path:
    """Directory of the embedded tokenizer, loadable with `AutoTokenizer.from_pretrained`."""
    path = ASSETS_DIR / "tokenizer"
    if not (path / "tokenizer.json").is_file():
        raise DataError(f"embedded tokenizer missing at {path}; {_REBUILD_HINT}")
    return path


def embedded_corpus_files() -> dict[str, Path]:
    """The embedded corpus as {split: .jsonl.xz file}."""
    files = {split: ASSETS_DIR / "corpus" / f"{split}.jsonl.xz" for split in SPLITS}
    for path in files.values():
        if not path.is_file():
            raise DataError(f"embedded corpus file missing at {path}; {_REBUILD_HINT}")
    return files


def embedded_assets_key() -> str:
    """Hash of every embedded asset and the token format, so any change re-tokenizes."""

    digest = hashlib.sha256(f"p2p-spes-tokens-v{MANIFEST_VERSION}".encode())
    tokenizer_dir = embedded_tokenizer_path()
    paths = sorted(embedded_corpus_files().values()) + sorted(tokenizer_dir.iterdir())
    for path in paths:
        if path.is_file():
            digest.update(f"\0{path.relative_to(ASSETS_DIR).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """`$P2P_SPES_CACHE`, else ~/.cache/p2p-spes."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "p2p-spes"


def _is_complete(target: Path) -> bool:
    """A finished token directory: its manifest reads, with both splits, and every file it lists is there
    with its size (checksums are left to the dataset that opens it)."""
    try:
        manifest = read_manifest(target)
        manifest.shards("validation")
    except DataError:
        return False
    for entry in manifest.files():
        path = target / entry.path
        if not path.is_file() or path.stat().st_size != entry.bytes:
            return False
    return True


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished cache into place; a concurrent writer that got there first wins."""
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if _is_complete(target):
            return
    stale = target.with_name(f".stale-{target.name}-{uuid.uuid4().hex}")
    try:
        os.rename(target, stale)
    except FileNotFoundError:
        pass
    os.rename(tmp, target)
    shutil.rmtree(stale, ignore_errors=True)


def prepare_embedded_data(cache_dir: Path | None = None, *, num_workers: int = 1, progress: bool = False) -> Path:
    """Tokenize the embedded corpus once into a cache keyed by the assets; return its token directory.

    The directory (manifest version 2) holds the train split, the embedded validation file as the
    validation split, and the tokenizer's files. Safe to call from several processes at once: each
    builds in its own temporary directory and renames it into place atomically, and a valid cache is
    reused without re-tokenizing. One worker is the default: the corpus is small, and in-process
    encoding already uses every core.
    """

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"embedded-{embedded_assets_key()[:16]}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    try:
        files = embedded_corpus_files()
        tokenize_files(
            [glob.escape(str(files["train"]))],
            embedded_tokenizer_path(),
            tmp,
            validation_inputs=[glob.escape(str(files["validation"]))],
            num_workers=num_workers,
            progress=progress,
        )
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m p2p_spes.corpus build --source DIR_OR_DEB --out DIR`."""
    parser = argparse.ArgumentParser(prog="python -m p2p_spes.corpus", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the embedded corpus and tokenizer")
    build.add_argument(
        "--source", type=Path, required=True, help="python3.11-doc .deb file, or a directory it was extracted to"
    )
    build.add_argument("--out", type=Path, default=ASSETS_DIR, help="assets directory to write")
    build.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    build.add_argument("--validation-fraction", type=float, default=DEFAULT_VALIDATION_FRACTION)
    args = parser.parse_args(argv)
    try:
        counts = build_assets(
            args.source, args.out, vocab_size=args.vocab_size, validation_fraction=args.validation_fraction
        )
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"wrote {counts['train']} train and {counts['validation']} validation documents and "
        f"a {args.vocab_size}-token tokenizer to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
