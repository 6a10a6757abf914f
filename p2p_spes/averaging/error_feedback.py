"""What a peer's compressed messages dropped, kept and sent later (error feedback)."""

from __future__ import annotations

import torch

from p2p_spes.averaging.compression import Codec


class ErrorFeedback:
    """What each peer's messages dropped, per group uid, added to its next message.

    ``compensate`` returns the value to send (input plus residual); ``settle`` keeps what the sent
    message dropped, once the group succeeded. After a failure nothing changes: the next
    pseudo-gradient is measured from the same anchor, so it still holds everything the failed
    message carried. Lossless codecs keep nothing. Residuals live on the CPU in fp32: one copy of
    the values this peer sends.

    ``decay`` (the ``sparse`` codec's, below 1) shrinks the residual each time it is sent again: a
    coordinate a peer keeps failing to send is one the others outvote, and without decay it would
    grow until it went out stale, many rounds after the update it came from.
    """

    def __init__(self, codec: Codec, decay: float | None = None) -> None:
        """``decay``: in place of the codec's (``swarm.feedback_decay``)."""
        self.codec = codec
        self.decay = codec.feedback_decay if decay is None else decay
        self.residual: dict[str, torch.Tensor] = {}

    def compensate(self, uid: str, x: torch.Tensor) -> torch.Tensor:
        r = self.residual.get(uid)
        if r is None or r.shape != x.shape:
            return x
        return x + r if self.decay == 1.0 else x + self.decay * r

    def settle(self, uid: str, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """``sent`` went out and the receivers decoded ``decoded``: keep the difference for next time."""
        if not self.codec.lossless:
            self.residual[uid] = sent - decoded

    def drop(self, uid: str) -> None:
        """Forget ``uid``'s residual (its anchor was replaced: what it held is relative to another)."""
        self.residual.pop(uid, None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.residual.values())
