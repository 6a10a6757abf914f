"""Group averaging: deadline-bounded all-reduce among the peers that show up, over hivemind's DHT and
libp2p streams.

One module per layer, as in hivemind's own ``averaging`` package: ``matchmaking`` forms a group
(``membership`` computes it from the records, ``roles`` says who reduces for it), ``allreduce`` runs an
attempt and its retries (``grid_allreduce`` and ``grid`` for large groups),
``reducer`` and ``part_client`` are the two sides of a part's exchange, ``transport`` frames tensors on a
stream, ``compression`` encodes them and ``aggregation`` combines contributions. Nothing here knows about
the model, the trainer or the swarm's rounds; the swarm drives it through the names below.
"""

from p2p_spes.averaging.aggregation import Aggregator, build_aggregator, weighted_mean
from p2p_spes.averaging.allreduce import HOLD, Attempt, GroupAllReduce, GroupResult
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.error_feedback import ErrorFeedback
from p2p_spes.averaging.matchmaking import DECISION_LAG
from p2p_spes.averaging.membership import Base, arrival_delays, longest_wait
from p2p_spes.averaging.transport import (
    TransportError,
    TruncatedStream,
    collect_tensors,
    pack,
    parse_tensor,
    serialize_parts,
    tensor_digest,
    unpack,
)

__all__ = [
    "DECISION_LAG",
    "HOLD",
    "Aggregator",
    "Attempt",
    "Base",
    "Codec",
    "ErrorFeedback",
    "GroupAllReduce",
    "GroupResult",
    "TransportError",
    "TruncatedStream",
    "arrival_delays",
    "build_aggregator",
    "collect_tensors",
    "longest_wait",
    "pack",
    "parse_tensor",
    "serialize_parts",
    "tensor_digest",
    "unpack",
    "weighted_mean",
]
