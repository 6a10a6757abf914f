"""Read token shards safely and cut them into training windows that peers never share.

A `TokenDataset` refuses anything that would silently train on garbage (truncated or corrupt
shards, data of another dtype, ids the model cannot embed, a different tokenizer), and says how
to fix it. Windows are `seq_len + 1` consecutive tokens at stride `seq_len` inside one shard:
they never cross a shard boundary, so at most `seq_len` tokens per shard go unused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2p_spes.data_manifest import MANIFEST_NAME, RETOKENIZE, Manifest, ShardEntry, read_manifest
from p2p_spes.errors import DataError
from p2p_spes.tokenizer_files import file_sha256, load_tokenizer, tokenizer_fingerprint

_MAX_CHUNK = 1 << 24


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise DataError(message)


def _check_shard_size(path: Path, entry: ShardEntry, dtype: np.dtype) -> None:
    size = path.stat().st_size
    if size == 0 or entry.num_tokens == 0:
        raise DataError(
            f"shard {path} is empty ({size} bytes, {entry.num_tokens} tokens in the "
            f"manifest); delete the directory and {RETOKENIZE}"
        )
    if size != entry.bytes:
        other = {2: "uint32", 4: "uint16"}[dtype.itemsize]
        hint = f" (it looks like {other} data)" if size == entry.num_tokens * (6 - dtype.itemsize) else ""
        raise DataError(
            f"shard {path} is truncated or overwritten: {size} bytes, but the manifest says "
            f"{entry.num_tokens} {dtype.name} tokens ({entry.bytes} bytes){hint}; fetch or copy it again, or "
            f"{RETOKENIZE}"
        )


def _data_max(tokens: np.ndarray) -> int:
    return max(int(tokens[i : i + _MAX_CHUNK].max()) for i in range(0, tokens.size, _MAX_CHUNK))


class TokenDataset:
    """Read-only view of one split of a token directory (manifest.json + shards), validated on open.

    ``split`` picks the manifest's ``train`` or ``validation`` shards; ``only`` (shard paths) keeps
    a subset, the shards of one data partition that a peer fetched. ``vocab_size`` is the model's
    embedding size: any id at or above it is refused. ``tokenizer`` (a local directory) must be the
    one the shards were made with. ``verify`` also checksums every shard (unless ``hashed``: the
    fetcher has just checked them) and scans it for its real largest id, which reads the data once.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        split: str = "train",
        only: list[str] | None = None,
        vocab_size: int | None = None,
        tokenizer: str | Path | None = None,
        verify: bool = True,
        manifest: Manifest | None = None,
        hashed: bool = False,
    ) -> None:
        self.path = Path(path)
        self.manifest = manifest if manifest is not None else read_manifest(self.path)
        self.split = split
        info = self.manifest.tokenizer
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        if vocab_size is not None:
            self._check_id(info.eos_token_id, vocab_size, self.path / MANIFEST_NAME, "EOS id")
        entries = self.manifest.shards(split)
        if only is not None:
            wanted = set(only)
            unknown = wanted - {e.path for e in entries}
            _require(not unknown, f"{self.path}: no {split} shard(s) {sorted(unknown)} in its manifest")
            entries = tuple(e for e in entries if e.path in wanted)
        _require(len(entries) > 0, f"{self.path}: no {split} shards selected")
        self.entries = entries
        dtype = self.manifest.token_dtype
        self.shards: list[np.ndarray] = []
        for entry in entries:
            shard_path = self.path / entry.path
            _require(
                shard_path.is_file(),
                f"shard {shard_path} listed in {self.path / MANIFEST_NAME} is missing; copy the whole "
                f"directory again or {RETOKENIZE}",
            )
            _check_shard_size(shard_path, entry, dtype)
            if vocab_size is not None:
                self._check_id(entry.max_token_id, vocab_size, shard_path, "manifest's max_token_id")
            if verify and not hashed:
                digest = file_sha256(shard_path)
                _require(
                    digest == entry.sha256,
                    f"shard {shard_path} fails its checksum (sha256 {digest[:16]}..., manifest "
                    f"{entry.sha256[:16]}...): the file is corrupt; copy it again or {RETOKENIZE}",
                )
            tokens = np.memmap(shard_path, dtype=dtype, mode="r")
            if verify and vocab_size is not None:
                self._check_id(_data_max(tokens), vocab_size, shard_path, "data")
            self.shards.append(tokens)
        self._window_starts: dict[int, np.ndarray] = {}

    @staticmethod
    def _check_id(token_id: int, vocab_size: int, where: Path, what: str) -> None:
        if token_id >= vocab_size:
            raise DataError(
                f"{where}: token id {token_id} ({what}) is out of range for the "
                f"model vocab of {vocab_size}; set model.vocab_size to at least the "
                "tokenizer's vocab size, or tokenize with the model's tokenizer"
            )

    def _check_tokenizer(self, tokenizer: str | Path) -> None:
        expected = self.manifest.tokenizer
        loaded = load_tokenizer(tokenizer)
        actual = (tokenizer_fingerprint(loaded), len(loaded))
        if actual != (expected.fingerprint, expected.vocab_size):
            raise DataError(
                f"{self.path / MANIFEST_NAME}: the shards were made with tokenizer "
                f"{expected.name_or_path!r} (vocab {expected.vocab_size}, fingerprint "
                f"{expected.fingerprint[:12]}), not {str(tokenizer)!r} (vocab "
                f"{actual[1]}, fingerprint {actual[0][:12]}); use the "
                f"same tokenizer, or {RETOKENIZE}"
            )

    @property
    def num_tokens(self) -> int:
        """Total tokens over all shards."""
        return sum(int(s.size) for s in self.shards)

    @property
    def vocab_size(self) -> int:
        """Vocab size of the tokenizer the shards were made with."""
        return self.manifest.tokenizer.vocab_size

    @property
    def eos_token_id(self) -> int:
        """The id appended after every document."""
        return self.manifest.tokenizer.eos_token_id

    def _starts(self, seq_len: int) -> np.ndarray:
        """Cumulative window counts per shard (length shards + 1)."""
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        if seq_len not in self._window_starts:
            counts = [max(0, (int(s.size) - 1) // seq_len) for s in self.shards]
            self._window_starts[seq_len] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return self._window_starts[seq_len]

    def num_windows(self, seq_len: int) -> int:
        """Windows of `seq_len + 1` tokens at stride `seq_len`; DataError if there are none."""
        count = int(self._starts(seq_len)[-1])
        if count == 0:
            raise DataError(
                f"{self.path} has {self.num_tokens} tokens in "
                f"{len(self.shards)} shard(s), too few for one window of "
                f"{seq_len + 1} tokens; add data or lower the sequence length"
            )
        return count

    def windows(self, indices: np.ndarray | list[int], seq_len: int) -> np.ndarray:
        """The windows with these global indices, as an int64 array (len(indices), seq_len + 1)."""
        starts = self._starts(seq_len)
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= starts[-1]):
            raise IndexError(f"window index out of range [0, {int(starts[-1])})")
        shard_ids = np.searchsorted(starts, indices, side="right") - 1
        out = np.empty((indices.size, seq_len + 1), dtype=np.int64)
        for row, (index, shard) in enumerate(zip(indices.tolist(), shard_ids.tolist(), strict=True)):
            offset = (index - int(starts[shard])) * seq_len
            out[row] = self.shards[shard][offset : offset + seq_len + 1]
        return out


def _to_tensors(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(windows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class BatchLoader:
    """Deterministic, resumable batches of windows, disjoint across peers.

    Each epoch shuffles all window indices with a generator seeded by (seed, epoch); peer p
    takes positions p, p + P, p + 2P, ... of that permutation, truncated to an equal count
    `windows_per_epoch` for every peer (the at most P - 1 leftover windows change each epoch).
    A batch that reaches the end of an epoch continues in the next one. With ``shared=True`` every
    peer reads the whole permutation, seeded by (seed, epoch, peer): the same windows in different
    orders (``data.partition: shared``).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        peer_index: int = 0,
        num_peers: int = 1,
        shared: bool = False,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}")
        if num_peers < 1 or not 0 <= peer_index < num_peers:
            raise DataError(
                f"peer_index must be in [0, num_peers), got peer_index {peer_index} with num_peers {num_peers}"
            )
        self.dataset = dataset
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.peer_index = peer_index
        self.num_peers = num_peers
        self.shared = shared
        self.total_windows = dataset.num_windows(seq_len)
        if self.total_windows < num_peers:
            raise DataError(
                f"{dataset.path} has {self.total_windows} windows of {seq_len + 1} "
                f"tokens, fewer than the {num_peers} peers; add data or lower the "
                "sequence length"
            )
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None

    @property
    def windows_per_epoch(self) -> int:
        """Windows this peer sees per epoch (the same for every peer)."""
        return self.total_windows if self.shared else self.total_windows // self.num_peers

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self.shared:
                self._order = np.random.default_rng([self.seed, self.epoch, self.peer_index]).permutation(
                    self.total_windows
                )
            else:
                permutation = np.random.default_rng([self.seed, self.epoch]).permutation(self.total_windows)
                self._order = permutation[self.peer_index :: self.num_peers][: self.windows_per_epoch]
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both LongTensor (batch_size, seq_len), targets shifted by one."""
        picked: list[np.ndarray] = []
        needed = self.batch_size
        while needed:
            order = self._epoch_order()
            take = min(needed, self.windows_per_epoch - self.position)
            picked.append(order[self.position : self.position + take])
            self.position += take
            needed -= take
            if self.position == self.windows_per_epoch:
                self.epoch += 1
                self.position = 0
                self._order = None
        return _to_tensors(self.dataset.windows(np.concatenate(picked), self.seq_len))

    def state_dict(self) -> dict[str, int]:
        """Plain ints (JSON-serialisable) from which `load_state_dict` resumes exactly."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "total_windows": self.total_windows,
            "peer_index": self.peer_index,
            "num_peers": self.num_peers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch and position.

        The seed, sequence length and data must match; otherwise the saved position would point
        into a different order, so DataError. If the peer layout changed (elastic membership),
        the epoch is kept and the position is clamped into this peer's slice.
        """
        missing = {"epoch", "position", "seed", "seq_len", "total_windows"} - set(state)
        if missing:
            raise DataError(
                f"loader state lacks {', '.join(sorted(missing))}; it was not written by BatchLoader.state_dict"
            )
        for key in ("seed", "seq_len", "total_windows"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"loader state has {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; resume with the same data, "
                    "sequence length and data seed, or start the data order afresh"
                )
        self.epoch = int(state["epoch"])
        self.position = min(int(state["position"]), self.windows_per_epoch - 1)
        self._order = None


def validation_batches(
    dataset: TokenDataset, seq_len: int, batch_size: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first windows in order, as up to `max_batches` batches, so validation is comparable.

    With fewer than `batch_size` windows in all, a single smaller batch holds them.
    """
    if batch_size < 1 or max_batches < 1:
        raise DataError(f"batch_size and max_batches must be at least 1, got {batch_size} and {max_batches}")
    total = dataset.num_windows(seq_len)
    if total < batch_size:
        return [_to_tensors(dataset.windows(np.arange(total), seq_len))]
    count = min(max_batches, total // batch_size)
    return [
        _to_tensors(dataset.windows(np.arange(i * batch_size, (i + 1) * batch_size), seq_len)) for i in range(count)
    ]
