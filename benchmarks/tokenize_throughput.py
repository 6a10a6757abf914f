"""How fast ``p2p-spes data tokenize`` turns JSONL into shards, and how much memory its processes hold.

    python -m benchmarks.tokenize_throughput                    # 1 GiB of JSONL, 2 workers: ~10 min on 2 cores
    python -m benchmarks.tokenize_throughput --size-mb 50 --variant 50mb

Writes a synthetic JSONL corpus of ``--size-mb`` MiB into a temporary directory (``--work-dir`` to keep it
elsewhere), then tokenizes it with the function ``p2p-spes data tokenize`` calls (``tokenize_files``) and the
embedded tokenizer, with ``--workers`` processes. The documents are spans of whole lines cut from the
embedded corpus' documents (the reStructuredText sources of the Python documentation), of a length drawn
around 4 KiB, chosen by a seeded generator: text that tokenizes like the corpus, the same for a seed.

Measured: wall time of the tokenization alone (MiB of input per second, tokens per second), and the
resident memory of the whole process tree while it runs: a thread reads VmRSS in ``/proc/<pid>/status``
of this process and of every descendant (the encoding workers) every 0.2 s and keeps the largest sum,
the largest parent and the largest worker (shared pages count in each process: the sum can only
overstate). ``ru_maxrss`` of this process (over its whole life, corpus generation included) and of its
reaped children are reported beside it; the children's overstates a worker, since Linux keeps a process's
peak across exec, and a spawned worker starts as a fork of this process. The issue's target: tokenizing 1 GB of JSONL stays under 2 GB resident. Writes
``benchmarks/results/tokenize_throughput/<variant>.json`` (``--variant``, default ``main``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from p2p_spes.corpus import embedded_corpus_files, embedded_tokenizer_path
from p2p_spes.text_inputs import iter_documents
from p2p_spes.tokenization import tokenize_files

MIB = 1 << 20
TARGET_INPUT_GB = 1
TARGET_RSS_GIB = 2
INTERVAL = 0.2


def corpus_documents() -> list[list[str]]:
    """The embedded corpus' documents (both splits), each as its lines."""
    docs = [
        text.splitlines(keepends=True) for path in embedded_corpus_files().values() for text in iter_documents(path)
    ]
    return [d for d in docs if d]


def write_corpus(path: Path, size_mb: float, seed: int) -> dict[str, int]:
    """A JSONL file of at least ``size_mb`` MiB of documents cut from the embedded corpus by ``seed``."""
    rng = random.Random(seed)
    source = corpus_documents()
    limit = int(size_mb * MIB)
    written = documents = chars = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < limit:
            lines = source[rng.randrange(len(source))]
            want = int(rng.lognormvariate(8.3, 0.8))  # median ~4 KiB of text
            start = rng.randrange(len(lines))
            end, size = start, 0
            while end < len(lines) and size < want:
                size += len(lines[end])
                end += 1
            text = "".join(lines[start:end])
            line = json.dumps({"id": documents, "text": text}, ensure_ascii=False) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
            documents += 1
            chars += len(text)
    return {"bytes": written, "documents": documents, "text_chars": chars}


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):  # the process ended between the listing and the read
        pass
    return 0


def _descendants(root: int) -> list[int]:
    """Every live process under ``root``, from the parent pid in each ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class TreeSampler:
    """Resident memory of this process and its descendants, sampled every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self.samples = 0
        self.peak_tree_kib = self.peak_parent_kib = self.peak_worker_kib = 0
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> None:
        me = os.getpid()
        parent = _rss_kib(me)
        workers = [_rss_kib(pid) for pid in _descendants(me)]
        self.samples += 1
        self.peak_parent_kib = max(self.peak_parent_kib, parent)
        self.peak_worker_kib = max(self.peak_worker_kib, *workers, 0)
        self.peak_tree_kib = max(self.peak_tree_kib, parent + sum(workers))
        self.max_processes = max(self.max_processes, 1 + len(workers))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def measure(size_mb: float, workers: int, work_dir: Path, seed: int = 0, shard_tokens: int = 2**26) -> dict[str, Any]:
    """Generate the corpus in ``work_dir``, tokenize it, and return what was measured."""
    work_dir.mkdir(parents=True, exist_ok=True)
    corpus, out = work_dir / "corpus.jsonl", work_dir / "tokens"
    start = time.perf_counter()
    generated = write_corpus(corpus, size_mb, seed)
    generation_s = time.perf_counter() - start
    sampler = TreeSampler()
    sampler.start()
    try:
        start = time.perf_counter()
        manifest = tokenize_files(
            [str(corpus)],
            embedded_tokenizer_path(),
            out,
            num_workers=workers,
            shard_tokens=shard_tokens,
            progress=False,
        )
        seconds = time.perf_counter() - start
    finally:
        sampler.stop()
    tokens = manifest.num_tokens()
    peak_tree_mib = sampler.peak_tree_kib / 1024
    return {
        "size_mb": size_mb,
        "seed": seed,
        "workers": workers,
        "input_bytes": generated["bytes"],
        "text_chars": generated["text_chars"],
        "documents": manifest.num_documents["train"],
        "tokens": tokens,
        "dtype": manifest.dtype,
        "shards": len(manifest.shards()),
        "generation_seconds": round(generation_s, 2),
        "seconds": round(seconds, 2),
        "mb_per_s": generated["bytes"] / MIB / seconds,
        "tokens_per_s": tokens / seconds,
        "memory": {
            "peak_rss_tree_mib": peak_tree_mib,
            "peak_rss_parent_mib": sampler.peak_parent_kib / 1024,
            "peak_rss_worker_mib": sampler.peak_worker_kib / 1024,
            "max_processes": sampler.max_processes,
            "samples": sampler.samples,
            "interval_s": sampler.interval,
            "ru_maxrss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "ru_maxrss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        },
        "target": {
            "input_gb": TARGET_INPUT_GB,
            "rss_limit_gib": TARGET_RSS_GIB,
            "peak_rss_tree_within": peak_tree_mib < TARGET_RSS_GIB * 1024,
        },
        "data_fingerprint": manifest.fingerprint,
    }


def table(r: dict[str, Any]) -> Table:
    m = r["memory"]
    out = Table(title=f"tokenize {r['input_bytes'] / MIB:,.0f} MiB of JSONL with {r['workers']} workers")
    for column in ("what", "value"):
        out.add_column(column)
    rows = [
        ("documents / tokens", f"{r['documents']:,} / {r['tokens']:,} ({r['dtype']}, {r['shards']} shards)"),
        ("tokenize time", f"{r['seconds']:.1f} s (corpus written in {r['generation_seconds']:.1f} s)"),
        ("input throughput", f"{r['mb_per_s']:.2f} MiB/s"),
        ("token throughput", f"{r['tokens_per_s']:,.0f} tokens/s"),
        ("peak RSS, process tree", f"{m['peak_rss_tree_mib']:,.0f} MiB ({m['max_processes']} processes)"),
        ("peak RSS, parent / one worker", f"{m['peak_rss_parent_mib']:,.0f} / {m['peak_rss_worker_mib']:,.0f} MiB"),
        ("ru_maxrss self / children", f"{m['ru_maxrss_self_mib']:,.0f} / {m['ru_maxrss_children_mib']:,.0f} MiB"),
        (
            f"tree under {r['target']['rss_limit_gib']} GiB",
            f"{'yes' if r['target']['peak_rss_tree_within'] else 'NO'} ({m['samples']} samples)",
        ),
    ]
    for row in rows:
        out.add_row(*row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024, help="MiB of JSONL to generate (default 1024)")
    parser.add_argument("--workers", type=int, default=2, help="tokenizer processes (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated corpus")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="keep the corpus and shards here (default: a temp dir)"
    )
    results.add_variant(parser)
    args = parser.parse_args(argv)
    run = results.start("tokenize_throughput", args.variant, seeds=[args.seed], argv=argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="tokenize-throughput-"))
    try:
        measured = measure(args.size_mb, args.workers, work_dir, args.seed)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    Console().print(table(measured))
    print(f"wrote {run.write(measured)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
