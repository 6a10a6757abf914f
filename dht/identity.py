"""One RSA key per peer: its libp2p identity (so its peer id and multiaddr) and the key that signs its records.

hivemind's ``RSASignatureValidator`` protects a DHT record whose subkey holds the writer's public
key marker (``[owner:ssh-rsa ...]``): only the holder of that key can write it. Signing with the
same RSA key that libp2p derives the peer id from binds the two, so a reader recovers the writer's
peer id from the marker alone (:func:`peer_id_of_owner`) and nobody can publish records in another
peer's name.

This module only reads and makes key files and derives peer ids; it imports nothing else of
``dht``, so the record readers (``dht/records.py``) and the allow-list check (``dht/auth.py``) can
use it. The validators every DHT of a run installs are in ``dht/validators.py``; the DHT itself is
started by ``dht/node.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_spes.errors import SwarmError


@dataclass
class Identity:
    """A peer's private key file, the key itself, and what others see of it."""

    path: str
    private_key: RSAPrivateKey
    peer_id: str
    created: bool  # generated just now (so no other peer can be using it)
    temporary: bool  # lives in a temp directory made for this process; removed by :meth:`discard`

    @cached_property
    def owner(self) -> bytes:
        """The subkey marker under which this peer writes its own records."""
        return RSASignatureValidator(self.private_key).local_public_key

    def discard(self) -> None:
        """Remove a temporary key file (the running daemon has read it already)."""
        if self.temporary:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def load_identity(path: str | os.PathLike | None) -> Identity:
    """Read the libp2p RSA key at ``path``, creating it if missing; ``None`` makes a throwaway one."""
    temporary = path is None
    if temporary:
        path = os.path.join(tempfile.mkdtemp(prefix="p2p-spes-id-"), "identity.key")
    path = str(path)
    created = not os.path.exists(path)
    if created:
        parent = Path(path).parent
        if not parent.is_dir():
            raise SwarmError(f"identity file {path}: directory {parent} does not exist; create it or pick another path")
        P2P.generate_identity(path)
    try:
        proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if proto.key_type != crypto_pb2.RSA:
            raise ValueError(f"key type {proto.key_type} is not RSA")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": proto.data})  # hivemind's own (un)pickling of a DER key
    except Exception as exc:
        raise SwarmError(
            f"identity file {path} is not a libp2p RSA private key ({exc}); delete it to make a new identity "
            "(the peer id will change) or point --identity at the right file"
        ) from None
    return Identity(path, key, _peer_id_of_public_key(key.get_public_key()), created, temporary)


def _peer_id_of_public_key(public_key: RSAPublicKey) -> str:
    """libp2p's peer id of an RSA key: base58 of the sha2-256 multihash of its protobuf encoding."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


@lru_cache(maxsize=4096)
def peer_id_of_owner(subkey: bytes) -> str | None:
    """The peer id whose key is in an ``[owner:...]`` subkey, or None if the subkey holds no valid key."""
    if not isinstance(subkey, bytes):
        return None
    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)
    if len(found) != 1:
        return None
    try:
        return _peer_id_of_public_key(RSAPublicKey.from_bytes(found[0]))
    except Exception:
        return None
