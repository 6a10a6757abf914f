"""Errors that tell the user what went wrong and how to fix it. They share one root,
:class:`P2PSpesError`, so a caller can tell the project's own errors from a library's; each also keeps
the built-in base it had (``ValueError`` or ``RuntimeError``)."""


class P2PSpesError(Exception):
    """Any error p2p-spes raises on purpose; its message names the problem and the fix."""


class ConfigError(P2PSpesError, ValueError):
    """A configuration file or override is malformed, mistyped or impossible."""


class DataError(P2PSpesError, ValueError):
    """A data shard, manifest, corpus or tokenizer cannot be used as given."""


class CheckpointError(P2PSpesError, ValueError):
    """A directory is not a usable checkpoint for this run."""


class BackendError(P2PSpesError, RuntimeError):
    """An MoE backend was requested that cannot run here."""


class SwarmError(P2PSpesError, RuntimeError):
    """The peer cannot join or stay in the run (unreachable bootstrap, different model, ...)."""


class ResidencyError(P2PSpesError, ValueError):
    """An operation needs expert weights that this peer does not hold (partial residency)."""
