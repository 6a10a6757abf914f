"""DHT keys and record schemas of a run. Every key starts with the run id.

Each peer writes its records under its owner subkey (``Identity.owner``, see ``dht/identity.py``),
so they are signed with its key and nobody else can overwrite them. Every value also carries the
writer's ``peer_id``; :func:`signed_values` keeps a record only if that id is the one derived from
the key in the subkey, so a peer cannot speak in another's name even under its own key. The
fixed keys (peers, model, published run config) also have pydantic schemas that every DHT of the
run checks (hivemind ``SchemaValidator``); a reader still checks each field's type before use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey

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


class RunSchema(pydantic.BaseModel):
    """Keys ``{run_id}_peers``, ``{run_id}_model`` and ``{run_id}_run_config``: signed subkeys only."""

    peers: dict[BytesWithPublicKey, PeerValue]
    model: dict[BytesWithPublicKey, ModelValue]
    run_config: dict[BytesWithPublicKey, RunConfigValue]


def peers_key(run_id: str) -> str:
    """Subkey per peer: that peer's status (experts held, step, round, loss, ...)."""
    return f"{run_id}_peers"


def config_key(run_id: str) -> str:
    """Subkey per peer: the model fingerprint and model-defining config it trains."""
    return f"{run_id}_model"


def run_config_key(run_id: str) -> str:
    """Subkey per publisher: the full run config, its hash and the model fingerprint."""
    return f"{run_id}_run_config"


def group_key(run_id: str, round_no: int, group: str) -> str:
    """Subkey per peer: who joined averaging group ``group`` of round ``round_no``."""
    return f"{run_id}.round{round_no}.{group}"


def version_key(run_id: str, round_no: int) -> str:
    """Subkey per peer: digests of the shared parameters and experts it holds after a round."""
    return f"{run_id}.round{round_no}.versions"


def finite_or_none(value: Any) -> Any:
    """NaN/inf become None: they break equality checks in schema validation and JSON output."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass
class PeerRecord:
    peer_id: str
    experts: list[int]
    step: int
    round: int
    fingerprint: str
    maddrs: list[str]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_value(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id, "experts": self.experts, "step": self.step, "round": self.round,
            "fingerprint": self.fingerprint, "maddrs": self.maddrs,
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
        return cls(peer_id, list(value["experts"]), value["step"], value["round"], value["fingerprint"],
                   [str(m) for m in value["maddrs"]], extra)


def signed_values(result: Any) -> dict[str, dict[str, Any]]:
    """``{peer_id: value}`` of a dictionary key, keeping only records written by the peer they name.

    ``result`` is what ``DHT.get`` returns. The DHT has already checked each signature against the
    key in the subkey; here the subkey's key must also derive the ``peer_id`` inside the value.
    """
    from dht.identity import peer_id_of_owner

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
