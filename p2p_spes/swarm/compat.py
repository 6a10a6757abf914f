"""What peers must share to train together, checked before a peer sends anything: the model (its
fingerprint), the data (its fingerprint: the tokenizer and every shard) and how sync rounds are encoded
(the protocol and the codec). A peer that differs is refused
with a sentence naming the difference and the fix."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2p_spes.averaging.compression import Codec
from p2p_spes.errors import SwarmError

if TYPE_CHECKING:
    from p2p_spes.config_swarm import SwarmConfig

log = logging.getLogger(__name__)
SYNC_PROTOCOL = 2  # 1: groups average weights; 2: pseudo-gradients through a codec (compression.py)


def describe_difference(ours: dict, theirs: dict) -> str:
    """The model-defining settings in which two configs differ, as ``section.key: ours X, run's Y``."""
    diffs = []
    for section in sorted(set(ours) | set(theirs)):
        a, b = ours.get(section, {}), theirs.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{section}.{key}: ours {a.get(key)!r}, run's {b.get(key)!r}")
    return "; ".join(diffs) or "fingerprints differ"


def sync_settings(
    compression: Any,
    topk_fraction: Any,
    topk_result_fraction: Any = None,
    expert_sync_rounds: Any = 1,
    max_steps: Any = None,
    topk_lone_fraction: Any = None,
    lone_compression: Any = None,
) -> dict[str, Any]:
    """What peers must share to average together: the protocol (pseudo-gradients since version 2),
    the codec and the rounds that average the experts; the top-k shares only matter to ``topk`` and
    ``sparse`` (the result's and a lone holder's share or codec only to topk, when set, and the experts' cadence only when it is not
    every round, so that peers which predate them still match the defaults). With the experts averaged
    every K > 1 rounds the run's last step is shared too: the last round averages them whatever its
    number, and a peer that saw another last round would wait in expert groups nobody else opens."""
    out = {"protocol": SYNC_PROTOCOL, "compression": compression}
    if expert_sync_rounds not in (None, 1):
        out["expert_sync_rounds"] = expert_sync_rounds
        out["max_steps"] = max_steps
    if compression == "sparse":
        out["topk_fraction"] = topk_fraction
    if compression == "topk":
        out["topk_fraction"] = topk_fraction
        if topk_result_fraction is not None:
            out["topk_result_fraction"] = topk_result_fraction
        if topk_lone_fraction is not None:
            out["topk_lone_fraction"] = topk_lone_fraction
        if lone_compression is not None:
            out["lone_compression"] = lone_compression
    return out


def sync_settings_of(sw: SwarmConfig, max_steps: int) -> dict[str, Any]:
    """:func:`sync_settings` of this peer's swarm config."""
    return sync_settings(
        sw.compression,
        sw.topk_fraction,
        sw.topk_result_fraction,
        sw.expert_sync_rounds,
        max_steps,
        sw.topk_lone_fraction,
        sw.lone_compression,
    )


def codec_of(sw: SwarmConfig) -> Codec:
    """The codec this peer's swarm config names, with every share it sets."""
    lone = {"lone_fraction": sw.topk_lone_fraction, "lone_compression": sw.lone_compression}
    return Codec(sw.compression, sw.topk_fraction, sw.topk_result_fraction, **lone)


def describe_sync(settings: Any) -> str:
    if not isinstance(settings, dict) or settings.get("protocol") != SYNC_PROTOCOL:
        return "an older p2p-spes (it averages weights, not pseudo-gradients: upgrade every peer)"
    keys = ("topk_fraction", "topk_result_fraction", "topk_lone_fraction", "lone_compression")
    keys += ("expert_sync_rounds", "max_steps")
    extra = "".join(f" ({k} {settings[k]})" for k in keys if k in settings)
    return f"compression {settings.get('compression')}{extra}"


@dataclass(frozen=True)
class RunView:
    """What the run's peers published: their model records and their run configs, by peer."""

    records: dict[str, Any]
    run_configs: dict[str, Any]


@dataclass(frozen=True)
class Ours:
    """What this peer would publish: its model fingerprint and settings, sync settings and config hash,
    and the fingerprints of its data and of the tokenizer that made it."""

    fingerprint: str
    model: dict[str, Any]
    sync: dict[str, Any]
    config_hash: str
    data: str | None = None
    tokenizer: str | None = None


def describe_data(value: dict) -> str:
    return f"data {str(value.get('data'))[:16]} (tokenizer {str(value.get('tokenizer'))[:16]})"


def check_data(run_id: str, peer_id: str, records: dict[str, Any], ours: Ours) -> None:
    """Raise :class:`SwarmError` if a peer of the run trains on other data or with another tokenizer."""
    if ours.data is None:
        return
    for peer, value in records.items():
        if peer == peer_id or not isinstance(value, dict) or value.get("data") in (None, ours.data):
            continue
        what = "another tokenizer" if value.get("tokenizer") != ours.tokenizer else "other data (other shards)"
        raise SwarmError(
            f"run {run_id!r} trains on {what} than this peer (peer {peer}): {describe_data(value)} there, "
            f"{describe_data({'data': ours.data, 'tokenizer': ours.tokenizer})} here. A run's peers must read the "
            "same tokens: join with --config-from-swarm (it names the run's data.manifest), set data.manifest as "
            "the run does and leave data.tokenizer unset, or pick another --run-id"
        )


def model_records(view: RunView, ours: Ours) -> dict[str, Any]:
    """Every peer's model record, those only known from a published run config included."""
    records = dict(view.records)
    for peer, value in view.run_configs.items():
        published = value.get("config") if isinstance(value.get("config"), dict) else {}
        moe = published.get("moe") if isinstance(published.get("moe"), dict) else {}
        swarm = published.get("swarm") if isinstance(published.get("swarm"), dict) else {}
        train = published.get("train") if isinstance(published.get("train"), dict) else {}
        records.setdefault(
            peer,
            {
                "fingerprint": value.get("fingerprint"),
                "model": {"model": published.get("model", {}), "moe": {k: moe.get(k) for k in ours.model["moe"]}},
                "sync": sync_settings(
                    swarm.get("compression"),
                    swarm.get("topk_fraction"),
                    swarm.get("topk_result_fraction"),
                    swarm.get("expert_sync_rounds"),
                    train.get("max_steps"),
                    swarm.get("topk_lone_fraction"),
                    swarm.get("lone_compression"),
                ),
            },
        )
    return records


def check_run(run_id: str, peer_id: str, view: RunView, ours: Ours) -> None:
    """Raise :class:`SwarmError` if the run trains another model or encodes its rounds otherwise; warn
    if its config differs from ours in other settings."""
    records = model_records(view, ours)
    for peer, value in records.items():
        if isinstance(value, dict) and value.get("fingerprint") != ours.fingerprint:
            theirs = value.get("model") if isinstance(value.get("model"), dict) else {}
            raise SwarmError(
                f"run {run_id!r} trains a different model than this config (peer {peer}): "
                f"{describe_difference(ours.model, theirs)}. Join with --config-from-swarm to use the run's config, "
                "or pick another --run-id"
            )
    check_data(run_id, peer_id, records, ours)
    for peer, value in records.items():
        other = value.get("sync") if isinstance(value, dict) else None
        if peer != peer_id and other != ours.sync:
            raise SwarmError(
                f"run {run_id!r} encodes its sync rounds differently than this config (peer {peer}): "
                f"{describe_sync(other)} there, {describe_sync(ours.sync)} here. swarm.compression and "
                "swarm.topk_fraction (and topk_result_fraction, topk_lone_fraction, lone_compression, "
                "expert_sync_rounds with train.max_steps) are run-wide: set them as the run does, or join with "
                "--config-from-swarm"
            )
    theirs = {v.get("hash") for p, v in view.run_configs.items() if p != peer_id}
    if theirs and ours.config_hash not in theirs:
        log.warning(
            "this config (hash %s) differs from the one the run publishes (%s) in settings other than "
            "the model; join with --config-from-swarm to train with the run's",
            ours.config_hash[:16],
            ", ".join(h[:16] for h in sorted(h for h in theirs if isinstance(h, str))),
        )
