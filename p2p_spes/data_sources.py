"""Where a run's data files can be read from: the URL the run names, or peers that hold them.

A source answers two questions: the manifest's bytes, and a file's bytes from an offset (so that a
download cut short resumes where it stopped). Sources do not check what they return; the fetcher
checks every file against the manifest's size and SHA-256, so a source that serves a wrong or
corrupt file costs a retry, never a shard trained on. Peer sources live with the swarm
(``swarm/data_server.py``); this module knows no network but HTTP and the local disk.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from p2p_spes.data_manifest import MANIFEST_NAME
from p2p_spes.errors import DataError

CHUNK_BYTES = 1 << 19
MAX_MANIFEST_BYTES = 64 << 20


class SourceError(DataError):
    """A source could not give a file (unreachable, refused, cut short): try another one."""


class Source(Protocol):
    """Something that serves a token directory's files by their path in the manifest."""

    name: str
    fingerprint: str | None  # the data it says it holds (a peer), or None (the URL the run names)

    def manifest(self) -> bytes:
        """The manifest's bytes."""

    def read(self, path: str, offset: int) -> Iterator[bytes]:
        """The bytes of ``path`` from ``offset`` on, in chunks; SourceError if it cannot."""


def is_remote(location: str) -> bool:
    return urllib.parse.urlsplit(location).scheme in ("http", "https")


def local_root(location: str) -> Path | None:
    """The directory a ``file://`` URL or a path names (the manifest's directory), or None for a remote URL."""
    parts = urllib.parse.urlsplit(location)
    if parts.scheme in ("http", "https"):
        return None
    if parts.scheme == "file":
        path = Path(urllib.request.url2pathname(parts.path))
    elif parts.scheme == "" or len(parts.scheme) == 1:  # a path (a Windows drive letter parses as a scheme)
        path = Path(location).expanduser()
    else:
        raise DataError(
            f"data.manifest {location!r}: unsupported scheme {parts.scheme!r}; give an http://, https:// or "
            "file:// URL, or a path"
        )
    return path.parent if path.name == MANIFEST_NAME else path


class UrlSource:
    """A token directory served over HTTP(S) (``python -m http.server`` in it suffices).

    A download cut short resumes with a Range request; from a server that ignores it (``http.server``
    does) the bytes we have are read again and dropped, so a resumed file is never spliced wrongly.
    """

    def __init__(self, location: str, timeout: float = 30.0) -> None:
        self.base = location[: -len(MANIFEST_NAME)] if location.endswith(MANIFEST_NAME) else location.rstrip("/") + "/"
        self.name = urllib.parse.urlsplit(self.base).netloc or self.base
        self.fingerprint = None
        self.timeout = timeout

    def _open(self, path: str, offset: int = 0):
        request = urllib.request.Request(self.base + urllib.parse.quote(path))
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            raise SourceError(f"{self.base}{path}: HTTP {error.code} {error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise SourceError(f"{self.base}{path}: cannot connect ({reason})") from None

    def manifest(self) -> bytes:
        with self._open(MANIFEST_NAME) as response:
            raw = response.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise SourceError(f"{self.base}{MANIFEST_NAME} is larger than {MAX_MANIFEST_BYTES >> 20} MiB")
        return raw

    def read(self, path: str, offset: int) -> Iterator[bytes]:
        response = self._open(path, offset)
        with response:
            try:
                skip = offset if response.status != 206 else 0  # a server without Range support sends it all
                while skip > 0:
                    dropped = response.read(min(CHUNK_BYTES, skip))
                    if not dropped:
                        raise SourceError(f"{self.base}{path}: shorter than the {offset} bytes we already have")
                    skip -= len(dropped)
                while chunk := response.read(CHUNK_BYTES):
                    yield chunk
            except (OSError, urllib.error.URLError) as error:
                raise SourceError(f"{self.base}{path}: cut short ({error})") from None


class DirectorySource:
    """A token directory on this machine (a path or ``file://`` URL), read in place."""

    def __init__(self, root: Path, fingerprint: str | None = None) -> None:
        """``fingerprint``: the data the directory is known to hold (a cache), checked when its manifest is read."""
        self.root = Path(root)
        self.name = str(self.root)
        self.fingerprint = fingerprint

    def manifest(self) -> bytes:
        path = self.root / MANIFEST_NAME
        if not path.is_file():
            raise SourceError(f"{path} does not exist; point data.manifest at a directory written by `data tokenize`")
        return path.read_bytes()

    def read(self, path: str, offset: int) -> Iterator[bytes]:
        try:
            with open(self.root / path, "rb") as stream:
                stream.seek(offset)
                while chunk := stream.read(CHUNK_BYTES):
                    yield chunk
        except OSError as error:
            raise SourceError(f"{self.root / path}: {error.strerror or error}") from None


def origin_source(location: str) -> Source:
    """The source a ``data.manifest`` value names."""
    root = local_root(location)
    return UrlSource(location) if root is None else DirectorySource(root)
