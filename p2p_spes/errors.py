"""Errors that tell the user what went wrong and how to fix it."""


class ConfigError(ValueError):
    """A configuration file or override is malformed, mistyped or impossible."""


class DataError(ValueError):
    """A data shard, manifest, corpus or tokenizer cannot be used as given."""


class CheckpointError(ValueError):
    """A directory is not a usable checkpoint for this run."""


class BackendError(RuntimeError):
    """An MoE backend was requested that cannot run here."""


class SwarmError(RuntimeError):
    """The peer cannot join or stay in the run (unreachable bootstrap, different model, ...)."""


class ResidencyError(ValueError):
    """An operation needs expert weights that this peer does not hold (partial residency)."""
