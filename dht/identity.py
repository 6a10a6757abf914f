"""One RSA key per peer: its libp2p identity (so its peer id and multiaddr) and the key that signs its records.

hivemind's ``RSASignatureValidator`` protects a DHT record whose subkey holds the writer's public
key marker (``[owner:ssh-rsa ...]``): only the holder of that key can write it. Signing with the
same RSA key that libp2p derives the peer id from binds the two, so a reader recovers the writer's
peer id from the marker alone and nobody can publish records in another peer's name. Every DHT of a
run (peers, bootstrap, inspector) uses :func:`run_validators`, so all of them refuse forged records
and strip signatures the same way.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from dht.auth import RunAuth
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


def run_validators(identity: Identity | None, run_ids: Iterable[str] = (), auth: RunAuth | None = None
                   ) -> list[RecordValidatorBase]:
    """Signature check for every DHT of a run, plus the record schemas of ``run_ids`` and, for a
    private run, its ``auth`` check (``dht/auth.py``).

    ``identity`` None (a read-only inspector) gets a throwaway signing key: it validates, never writes.
    """
    from dht.records import RunSchema

    key = identity.private_key if identity is not None else RSAPrivateKey()
    validators: list[RecordValidatorBase] = [RSASignatureValidator(key)]
    validators += [SchemaValidator(RunSchema, allow_extra_keys=True, prefix=run_id) for run_id in run_ids]
    return validators + (auth.validators() if auth is not None else [])


def check_listen_ports(maddrs: Iterable[str]) -> None:
    """Fail early, and clearly, when a fixed TCP port we are to listen on is taken (p2pd's own error
    is a startup timeout that names nothing)."""
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or parts[4] in ("", "0"):
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((parts[2], int(parts[4])))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise SwarmError(
                        f"port {parts[4]} on {parts[2]} is in use by another process; stop it or listen on another "
                        f"port (--host-maddrs /{parts[1]}/{parts[2]}/tcp/PORT, or PORT 0 for any free one)"
                    ) from None


def start_dht(identity_path: str | None = None, run_ids: Sequence[str] = (), auth: RunAuth | None = None, **dht_kwargs):
    """A hivemind DHT whose peer id is ``identity_path``'s key and which signs and checks records.

    Returns ``(dht, identity)``; ``dht_kwargs`` go to ``hivemind.DHT`` (initial_peers, host_maddrs,
    client_mode, use_relay, ...).
    """
    import hivemind

    check_listen_ports(dht_kwargs.get("host_maddrs") or [])
    identity = load_identity(identity_path)
    try:
        dht = hivemind.DHT(
            start=True, identity_path=identity.path, record_validators=run_validators(identity, run_ids, auth),
            check_if_identity_free=not identity.created, **dht_kwargs,
        )
    finally:
        identity.discard()
    if dht.peer_id.to_base58() != identity.peer_id:
        dht.shutdown()
        raise SwarmError(f"the DHT came up as {dht.peer_id} instead of the identity's {identity.peer_id}")
    return dht, identity
