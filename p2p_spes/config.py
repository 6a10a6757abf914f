"""Typed run configuration: YAML files and ``--set`` overrides become validated dataclasses.

Every key is checked against the dataclass fields, so a typo is an error naming the key and
the keys that exist, never a silently ignored setting. The sections are declared in
``config_sections.py`` and ``config_swarm.py``, each field with its doc and scope
(``config_fields.py``); the checks across fields are in ``config_checks.py``. Their names are
importable from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from p2p_spes.config_checks import validate
from p2p_spes.config_fields import Scope, field_scope
from p2p_spes.config_sections import DataConfig, ExpertsConfig, ModelConfig, MoEConfig, PeerConfig, TrainConfig
from p2p_spes.config_swarm import SwarmConfig
from p2p_spes.errors import ConfigError
from p2p_spes.placement import spes_block
from p2p_spes.typed_yaml import build, parse_override, set_nested

__all__ = [
    "CONFIG_DIR",
    "Config",
    "DataConfig",
    "ExpertsConfig",
    "MoEConfig",
    "ModelConfig",
    "PeerConfig",
    "Scope",
    "SwarmConfig",
    "TrainConfig",
    "load_config",
    "parse_override",
    "resolve_config_path",
    "scope_of",
    "sections",
    "settings_of_scope",
    "validate",
    "with_overrides",
]


def _shipped_configs() -> Path:
    """The shipped configs: inside the installed package (pyproject maps the checkout's ``configs/``
    to ``p2p_spes/configs`` in a wheel), else the checkout's own ``configs/``."""
    here = Path(__file__).resolve().parent
    return here / "configs" if (here / "configs").is_dir() else here.parent / "configs"


CONFIG_DIR = _shipped_configs()


@dataclass
class Config:
    """A run's whole configuration, one dataclass per section (one YAML mapping each)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    def model_defining(self) -> dict[str, Any]:
        """Every field of scope ``model`` by section: what peers must agree on to train one model."""
        out: dict[str, Any] = {}
        for section, name in settings_of_scope("model"):
            out.setdefault(section, {})[name] = getattr(getattr(self, section), name)
        return _to_plain(out)

    def model_fingerprint(self) -> str:
        """Hash of :meth:`model_defining`."""
        blob = json.dumps(self.model_defining(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def local_experts(self, partition: int | None = None) -> list[int]:
        """The experts this peer trains by the configured rule (``partition``: the data partition a
        swarm peer claimed; ``peer.index`` when training alone)."""
        if self.experts.placement == "explicit":
            return sorted(self.experts.local or [])
        if self.experts.placement == "coverage":
            raise ConfigError(
                "experts.placement=coverage is chosen by the swarm at join time; use `p2p-spes train --initial-peers`"
            )
        index = self.peer.index if partition is None else partition
        return spes_block(index, self.peer.count, self.moe.num_experts)

    def experts_per_partition(self, partition: int | None = None) -> int:
        """How many experts least-covered placement gives the peer of ``partition``: ``swarm.experts_per_peer``,
        else the partition's SPES block (partition 0's is the smallest), raised to ``swarm.replicas``' share."""
        if self.swarm.experts_per_peer:
            return self.swarm.experts_per_peer
        index = self.peer.index if partition is None else partition
        block = len(spes_block(index, self.peer.count, self.moe.num_experts))
        share = -(-self.moe.num_experts * self.swarm.replicas // self.peer.count)  # ceil(E x replicas / P)
        return block if self.swarm.replicas == 1 else min(self.moe.num_experts, max(block, share))


_SECTIONS: dict[str, type] = typing.get_type_hints(Config)  # section name -> its dataclass


def sections() -> dict[str, type]:
    """Each section's name and dataclass, in declaration order."""
    return dict(_SECTIONS)


def scope_of(section: str, name: str) -> Scope:
    """The scope of ``section.name`` (see :data:`Scope`); KeyError for a setting that does not exist."""
    for f in dataclasses.fields(_SECTIONS[section]):
        if f.name == name:
            return field_scope(f)
    raise KeyError(f"{section}.{name}")


def settings_of_scope(scope: Scope) -> list[tuple[str, str]]:
    """Every ``(section, name)`` of ``scope``, in declaration order."""
    return [
        (section, f.name)
        for section, cls in _SECTIONS.items()
        for f in dataclasses.fields(cls)
        if field_scope(f) == scope
    ]


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with ``--set``-style overrides applied and validated again."""
    return load_config(None, overrides, data=cfg.to_dict())


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, or the name of a shipped config (``tiny`` -> configs/tiny.yaml)."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    shipped = CONFIG_DIR / f"{path}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config file {path} not found; give a YAML path or a shipped config name ({names})")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    data: dict[str, Any] | None = None,
) -> Config:
    """Load a YAML config (or the defaults), apply ``--set`` overrides and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        file = resolve_config_path(path)
        try:
            raw = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: the top level must be a mapping of sections, got {type(raw).__name__}")
    if data:
        raw = _merge(raw, data)
    for text in overrides:
        key, value = parse_override(text)
        set_nested(raw, key, value)
    config = build(Config, raw, "")
    validate(config)
    return config


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
