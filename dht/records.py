"""What a run's DHT records hold: their value schemas and typed readers. Key names are in ``dht/keys.py``.

Each peer writes its records under its owner subkey (``Identity.owner``, see ``dht/identity.py``),
so they are signed with its key and nobody else can overwrite them. Every value also carries the
writer's ``peer_id``; :func:`signed_values` keeps a record only if that id is the one derived from
the key in the subkey, so a peer cannot speak in another's name even under its own key. The
fixed keys (peers, model, published run config) also have pydantic schemas (:class:`RunSchema`)
that every DHT of the run checks (hivemind ``SchemaValidator``, installed by ``dht/validators.py``);
a reader still checks each field's type before use (:meth:`PeerRecord.from_value`). A per-round key
(``version_key``) names a new DHT key every round, which a static schema cannot cover: its schema
(:class:`VersionValue`) is checked by the reader, :meth:`VersionRecord.from_value`.

Of ``dht`` this module uses only ``dht/identity.py`` (the peer id behind an owner subkey); it also
re-exports the key names of ``dht/keys.py`` for importers that take them from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey

from dht.identity import peer_id_of_owner

# Re-exported so that importing the key names from here works; new code imports them from dht.keys.
from dht.keys import config_key, group_key, peers_key, run_config_key, version_key  # noqa: F401

PEER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "experts": list,
    "step": int,
    "round": int,
    "fingerprint": str,
    "maddrs": list,
}


class _Signed(pydantic.BaseModel):
    peer_id: pydantic.StrictStr

    class Config:
        extra = pydantic.Extra.allow


class PeerValue(_Signed):
    """A peer's status; extra fields (loss, tokens/s, bytes, device, ...) are free-form."""

    experts: list[pydantic.StrictInt]
    step: pydantic.StrictInt
    round: pydantic.StrictInt
    fingerprint: pydantic.StrictStr
    maddrs: list[pydantic.StrictStr]


class ModelValue(_Signed):
    """The model a peer trains: its fingerprint and the model-defining config."""

    fingerprint: pydantic.StrictStr
    model: dict[pydantic.StrictStr, Any]


class RunConfigValue(_Signed):
    """The run's config as its publisher trains it, with the SHA-256 of its canonical JSON."""

    config: dict[pydantic.StrictStr, Any]
    hash: pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
    fingerprint: pydantic.StrictStr
    time: pydantic.StrictFloat


# An expert's index as a dict key on the wire, where the swarm writes it as a string: "0", "17", never "017" or "-1".
ExpertKey = pydantic.constr(strict=True, regex=r"^(0|[1-9][0-9]*)$")


class VersionValue(_Signed):
    """What a peer holds after a sync round (``version_key``): digests of its shared parameters, of the
    experts it trains and of the frozen copies it keeps of experts nobody trains. ``ok``: its shared
    group averaged this round. Not in :class:`RunSchema` (the key changes every round): checked by
    :meth:`VersionRecord.from_value`.
    """

    ok: pydantic.StrictBool
    shared: pydantic.StrictStr
    experts: dict[ExpertKey, pydantic.StrictStr]
    copies: dict[ExpertKey, pydantic.StrictStr] = {}
    n: pydantic.conint(strict=True, ge=0) = 0  # members of the group whose shared result it holds (0: none)
    # experts it trains whose group failed this round: it kept its own values, which its group did not agree on
    failed: list[ExpertKey] = []


class RunSchema(pydantic.BaseModel):
    """Keys ``{run_id}_peers``, ``{run_id}_model`` and ``{run_id}_run_config``: signed subkeys only.

    hivemind's ``SchemaValidator`` names a field's key ``{prefix}_{field}``, so the field names are the
    suffixes of :func:`~dht.keys.peers_key`, :func:`~dht.keys.config_key` and :func:`~dht.keys.run_config_key`.
    """

    peers: dict[BytesWithPublicKey, PeerValue]
    model: dict[BytesWithPublicKey, ModelValue]
    run_config: dict[BytesWithPublicKey, RunConfigValue]


def finite_or_none(value: Any) -> Any:
    """NaN/inf become None: they break equality checks in schema validation and JSON output."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass
class PeerRecord:
    """A peer's :class:`PeerValue` under ``peers_key(run_id)``; free-form fields are in ``extra``."""

    peer_id: str
    experts: list[int]
    step: int
    round: int
    fingerprint: str
    maddrs: list[str]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_value(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "experts": self.experts,
            "step": self.step,
            "round": self.round,
            "fingerprint": self.fingerprint,
            "maddrs": self.maddrs,
            **{k: finite_or_none(v) for k, v in self.extra.items()},
        }

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> PeerRecord | None:
        """Parse a record; None if a field is missing or of the wrong type."""
        if not isinstance(value, Mapping):
            return None
        for name, tp in PEER_FIELDS.items():
            if not isinstance(value.get(name), tp) or isinstance(value.get(name), bool):
                return None
        if not all(isinstance(e, int) for e in value["experts"]):
            return None
        extra = {k: v for k, v in value.items() if k not in PEER_FIELDS and k != "peer_id"}
        return cls(
            peer_id,
            list(value["experts"]),
            value["step"],
            value["round"],
            value["fingerprint"],
            [str(m) for m in value["maddrs"]],
            extra,
        )


@dataclass
class VersionRecord:
    """A peer's :class:`VersionValue` under ``version_key(run_id, round)``, with experts as ints."""

    peer_id: str
    ok: bool
    shared: str  # digest of its shared (non-expert) parameters
    experts: dict[int, str]  # expert it trains -> digest of its copy
    copies: dict[int, str] = field(default_factory=dict)  # expert nobody trains -> digest of its frozen copy
    # members of the group whose shared result it holds (0: none, or a peer of an earlier version): a peer
    # adopting that result knows how many of their records to expect
    group: int = 0
    # experts it trains whose group failed this round (it kept its own values): a frozen copy follows a
    # holder whose group succeeded when there is one, so every peer picks the version its group agreed on
    failed: frozenset[int] = frozenset()

    def to_value(self) -> dict[str, Any]:
        """The value to store (the wire format: expert indices as strings)."""
        value = {
            "peer_id": self.peer_id,
            "ok": self.ok,
            "shared": self.shared,
            "experts": {str(e): d for e, d in self.experts.items()},
            "copies": {str(e): d for e, d in self.copies.items()},
        }
        if self.group:
            value["n"] = self.group
        if self.failed:
            value["failed"] = [str(e) for e in sorted(self.failed)]
        return value

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> VersionRecord | None:
        """Parse a record (``peer_id`` is its checked writer, see :func:`signed_values`); None if malformed."""
        if not isinstance(value, Mapping):
            return None
        try:
            parsed = VersionValue.parse_obj({**value, "peer_id": peer_id})
        except pydantic.ValidationError:
            return None
        return cls(
            peer_id,
            parsed.ok,
            parsed.shared,
            {int(e): d for e, d in parsed.experts.items()},
            {int(e): d for e, d in parsed.copies.items()},
            parsed.n,
            frozenset(int(e) for e in parsed.failed),
        )


def signed_values(result: Any) -> dict[str, dict[str, Any]]:
    """``{peer_id: value}`` of a dictionary key, keeping only records written by the peer they name.

    ``result`` is what ``DHT.get`` returns. The DHT has already checked each signature against the
    key in the subkey; here the subkey's key must also derive the ``peer_id`` inside the value.
    """
    if result is None or not isinstance(getattr(result, "value", None), dict):
        return {}
    out = {}
    for subkey, item in result.value.items():
        value = getattr(item, "value", None)
        if not isinstance(value, dict):
            continue
        writer = peer_id_of_owner(subkey)
        if writer is not None and value.get("peer_id") == writer:
            out[writer] = value
    return out
