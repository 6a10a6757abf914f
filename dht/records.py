"""DHT keys and record schemas of a run. Every key starts with the run id.

Records are plain msgpack-able dicts (hivemind's DHT serializes values with msgpack); a reader
checks each field's type before using it, so a malformed record is skipped, not trusted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

PEER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "experts": list,
    "step": int,
    "round": int,
    "fingerprint": str,
    "maddrs": list,
}


def peers_key(run_id: str) -> str:
    """Subkey per peer id: that peer's status (experts held, step, round, loss, ...)."""
    return f"{run_id}.peers"


def config_key(run_id: str) -> str:
    """Subkey per peer id: the model fingerprint and model-defining config it trains."""
    return f"{run_id}.config"


def group_key(run_id: str, round_no: int, group: str) -> str:
    """Subkey per peer id: who joined averaging group ``group`` of round ``round_no``."""
    return f"{run_id}.round{round_no}.{group}"


def version_key(run_id: str, round_no: int) -> str:
    """Subkey per peer id: digests of the shared parameters and experts it holds after a round."""
    return f"{run_id}.round{round_no}.versions"


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
            "experts": self.experts, "step": self.step, "round": self.round,
            "fingerprint": self.fingerprint, "maddrs": self.maddrs, **self.extra,
        }

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> "PeerRecord | None":
        """Parse a record; None if a field is missing or of the wrong type."""
        if not isinstance(value, Mapping):
            return None
        for name, tp in PEER_FIELDS.items():
            if not isinstance(value.get(name), tp) or isinstance(value.get(name), bool):
                return None
        if not all(isinstance(e, int) for e in value["experts"]):
            return None
        extra = {k: v for k, v in value.items() if k not in PEER_FIELDS}
        return cls(peer_id, list(value["experts"]), value["step"], value["round"], value["fingerprint"],
                   [str(m) for m in value["maddrs"]], extra)


def subkey_values(result: Any) -> dict[str, Any]:
    """``{subkey: value}`` from what ``DHT.get`` returns for a dictionary key (or {} if absent)."""
    if result is None or not isinstance(getattr(result, "value", None), dict):
        return {}
    return {str(sub): item.value for sub, item in result.value.items() if hasattr(item, "value")}
