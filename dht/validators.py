"""The record validators every DHT of a run installs: peers, bootstraps and inspectors alike.

All of them refuse forged records and strip signatures the same way, because they all get their
validators from :func:`run_validators`: hivemind's RSA signature check (a record under an owner
subkey must be signed by that key, ``dht/identity.py``), the schemas of the run's fixed keys
(``dht/records.py``) and, for a private run, the allow-list and secret check (``dht/auth.py``).
Kept apart from starting a DHT (``dht/node.py``) so that the checks can be read and tested alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from dht.auth import RunAuth
from dht.identity import Identity
from dht.records import RunSchema


def run_validators(
    identity: Identity | None, run_ids: Iterable[str] = (), auth: RunAuth | None = None
) -> list[RecordValidatorBase]:
    """Signature check for every DHT of a run, plus the record schemas of ``run_ids`` and, for a
    private run, its ``auth`` check (``dht/auth.py``).

    ``identity`` None (a read-only inspector) gets a throwaway signing key: it validates, never writes.
    """
    key = identity.private_key if identity is not None else RSAPrivateKey()
    validators: list[RecordValidatorBase] = [RSASignatureValidator(key)]
    validators += [SchemaValidator(RunSchema, allow_extra_keys=True, prefix=run_id) for run_id in run_ids]
    return validators + (auth.validators() if auth is not None else [])
