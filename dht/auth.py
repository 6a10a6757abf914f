"""Private runs: who may write a run's DHT records and talk to its peers.

A run is open by default: anyone with the model can join. ``swarm.secret_file`` (a shared secret)
and/or ``swarm.allowed_peers`` (peer ids, i.e. public keys) make it private:

* **Records.** :class:`RunAuthValidator` sits in every DHT of the run next to the RSA signature
  check. With an allow-list, a record is valid only if the key that signed it (the owner marker in
  its subkey) belongs to an allowed peer. With a secret, every record also carries an HMAC over its
  key, subkey, value and expiry; without the secret nobody can make one. hivemind checks both when
  a record is stored and when it is read back, so an outsider can neither write nor fake a record.
* **Key space.** With a secret, every DHT key and RPC name of the run lives under
  ``{run_id}-{tag}``, ``tag`` derived from the secret: an outsider does not even find the keys.
* **RPCs.** hivemind's averaging RPCs have no authorization of their own; ours check the caller.
  libp2p authenticates the caller's peer id on every stream, and a peer may fetch state or join a
  group only if it is allowed (allow-list) or has a valid record in the run (secret), which it can
  only have written with the secret.

Of ``dht`` it uses only ``dht/identity.py`` (the peer id behind a record's owner subkey); the validator is
installed with the others by ``dht/validators.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from dht.identity import peer_id_of_owner
from p2p_spes.errors import ConfigError

_TAG = re.compile(rb"\[hmac:([0-9a-f]{64})\]$")
SECRET_ENV = "P2P_SPES_SECRET"


@dataclass(frozen=True)
class RunAuth:
    """The private-run settings of one peer: the shared secret (bytes) and the allowed peer ids."""

    secret: bytes | None = None
    allowed: frozenset[str] = frozenset()

    @property
    def private(self) -> bool:
        return self.secret is not None or bool(self.allowed)

    def keyspace(self, run_id: str) -> str:
        """Where the run's keys and RPC names live: the run id, or a secret-derived name under it."""
        if self.secret is None:
            return run_id
        return f"{run_id}-{hmac.new(self.secret, run_id.encode(), hashlib.sha256).hexdigest()[:16]}"

    def validators(self) -> list[RecordValidatorBase]:
        return [RunAuthValidator(self)] if self.private else []

    def admits(self, peer_id: str, known_members: Iterable[str] = ()) -> bool:
        """May ``peer_id`` (authenticated by libp2p) use our RPCs? ``known_members`` are peers with a
        valid record in the run, which proves they hold the secret."""
        if not self.private:
            return True
        if self.allowed and peer_id not in self.allowed:
            return False
        return self.secret is None or peer_id in set(known_members)


def load_auth(secret_file: str | None, allowed_peers: Iterable[str]) -> RunAuth:
    """Read the secret from ``secret_file`` (or the ``P2P_SPES_SECRET`` environment variable)."""
    secret: bytes | None = None
    if secret_file:
        path = Path(secret_file)
        if not path.is_file():
            raise ConfigError(
                f"swarm.secret_file {secret_file}: no such file; create one with e.g. "
                "`openssl rand -hex 32 > run.secret` and give the same file to every peer"
            )
        secret = path.read_bytes().strip()
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV].encode().strip()
    if secret is not None and len(secret) < 16:
        raise ConfigError("the run secret is shorter than 16 bytes; use e.g. `openssl rand -hex 32`")
    return RunAuth(secret, frozenset(allowed_peers))


class RunAuthValidator(RecordValidatorBase):
    """Refuses records of peers outside the allow-list, and records without the secret's HMAC."""

    def __init__(self, auth: RunAuth) -> None:
        self.auth = auth

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        message = b"\0".join([record.key, record.subkey or b"", value, struct.pack(">d", record.expiration_time)])
        return hmac.new(self.auth.secret, message, hashlib.sha256).hexdigest().encode()

    def validate(self, record: DHTRecord) -> bool:
        if self.auth.allowed and peer_id_of_owner(record.subkey) not in self.auth.allowed:
            return False
        if self.auth.secret is not None:
            found = _TAG.search(record.value)
            if found is None:
                return False
            return hmac.compare_digest(found.group(1), self._mac(record, record.value[: found.start()]))
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.auth.secret is None:
            return record.value
        return record.value + b"[hmac:" + self._mac(record, record.value) + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        found = _TAG.search(record.value) if self.auth.secret is not None else None
        return record.value[: found.start()] if found else record.value

    @property
    def priority(self) -> int:
        return 5  # signed after the schema check's view of the value, before the RSA signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
