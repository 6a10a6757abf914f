"""SwiGLU expert weights stored so that only the local experts cost gradient and optimizer memory.

Why a storage of our own: a peer trains a few experts and keeps the others frozen (docs/method.md).

The checkpoint layout is MegaBlocks' (``w1``, ``v1``, ``w2``, each ``(E*F, H)``), but in memory the
local experts live in one ``nn.Parameter`` per matrix of shape ``(n, F, H)`` and the frozen experts
in a plain buffer. A fused ``(E*F, H)`` parameter with a gradient mask would still allocate
``E*F*H`` gradient and optimizer state; this layout allocates ``n*F*H``.

Tokens are sorted by *slot* (local experts first, then frozen ones), so each of the two groups is
one contiguous block that a grouped matmul (or a per-expert loop) handles without copying weights.

With ``resident_only`` (partial residency, ``swarm.residency: partial``) the experts that are not
local have no storage at all: their slot is -1 and the MoE layer skips tokens routed to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from p2p_spes.errors import ResidencyError

MATRICES = ("w1", "v1", "w2")


def uses_grouped_mm(kernel: str, d_model: int, ffn_dim: int, dtype: torch.dtype, on_cuda: bool) -> bool:
    """Whether ``kernel`` (``auto``, ``grouped_mm`` or ``loop``) runs ``torch._grouped_mm`` for these shapes.

    grouped_mm needs 16-byte aligned strides and a torch that has it; ``auto`` takes it on CUDA only,
    where it beats the per-expert loop. Otherwise the loop runs.
    """
    if kernel == "loop" or not hasattr(torch, "_grouped_mm"):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    aligned = (ffn_dim * size) % 16 == 0 and (d_model * size) % 16 == 0
    return aligned and (kernel == "grouped_mm" or on_cuda)


class SwiGLUExperts(nn.Module):
    """E SwiGLU experts, y_e(x) = (silu(x W1_e^T) * (x V1_e^T)) W2_e, split into local and frozen."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        ffn_dim: int,
        local_experts: Sequence[int] | None = None,
        kernel: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        resident_only: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.ffn_dim = num_experts, d_model, ffn_dim
        self.kernel = kernel
        self.resident_only = resident_only
        local = sorted(range(num_experts) if local_experts is None else set(local_experts))
        self._layout(local, device=device, dtype=dtype)

    def _layout(self, local: list[int], device=None, dtype=None) -> None:
        others = [e for e in range(self.num_experts) if e not in set(local)]
        frozen, absent = ([], others) if self.resident_only else (others, [])
        shape = (self.ffn_dim, self.d_model)
        for name in MATRICES:
            self.register_parameter(
                f"local_{name}", nn.Parameter(torch.empty(len(local), *shape, device=device, dtype=dtype))
            )
            self.register_buffer(
                f"frozen_{name}", torch.empty(len(frozen), *shape, device=device, dtype=dtype), persistent=False
            )
        slot = torch.full((self.num_experts,), -1, dtype=torch.long)
        slot[local] = torch.arange(len(local))
        slot[frozen] = torch.arange(len(local), len(local) + len(frozen))
        self.register_buffer("slot_of_expert", slot.to(device), persistent=False)
        self.local_ids, self.frozen_ids, self.absent_ids = local, frozen, absent

    @property
    def resident_ids(self) -> list[int]:
        """The experts with weights in memory here (all of them unless ``resident_only``)."""
        return sorted(self.local_ids + self.frozen_ids)

    @property
    def num_slots(self) -> int:
        return len(self.local_ids) + len(self.frozen_ids)

    @property
    def num_local(self) -> int:
        return len(self.local_ids)

    def stacked(self, name: str) -> torch.Tensor:
        """All experts' matrix ``name`` as (E, F, H) in expert order (a copy; for export and tests)."""
        if self.absent_ids:
            raise ResidencyError(
                f"experts {self.absent_ids} are not resident on this peer (swarm.residency: partial); "
                "export from a full peer or with `p2p-spes export --from-swarm`"
            )
        local, frozen = getattr(self, f"local_{name}"), getattr(self, f"frozen_{name}")
        out = torch.empty(self.num_experts, self.ffn_dim, self.d_model, device=local.device, dtype=local.dtype)
        out[self.local_ids] = local.detach()
        out[self.frozen_ids] = frozen
        return out

    @torch.no_grad()
    def load_stacked(self, name: str, value: torch.Tensor) -> None:
        """Overwrite matrix ``name`` of every expert from an (E, F, H) or (E*F, H) tensor."""
        value = value.reshape(self.num_experts, self.ffn_dim, self.d_model)
        getattr(self, f"local_{name}").copy_(value[self.local_ids])
        getattr(self, f"frozen_{name}").copy_(value[self.frozen_ids])

    @torch.no_grad()
    def load_resident(self, name: str, experts: Sequence[int], value: torch.Tensor) -> None:
        """Overwrite matrix ``name`` of ``experts`` (those resident here) from an (n, F, H) tensor."""
        value = value.reshape(len(experts), self.ffn_dim, self.d_model)
        for row, e in enumerate(experts):
            slot = int(self.slot_of_expert[e])
            if slot < 0:
                continue
            group, idx = ("local", slot) if slot < self.num_local else ("frozen", slot - self.num_local)
            getattr(self, f"{group}_{name}")[idx].copy_(value[row])

    def set_local_experts(self, local: Sequence[int]) -> None:
        """Re-split the experts; weights are kept. Optimizer state of the old parameters is lost.

        With ``resident_only`` an expert that becomes local here starts at zero: the caller must load
        it (the swarm downloads it from a holder).
        """
        held = self.resident_ids
        values = {name: self._resident_stack(name) for name in MATRICES}
        ref = self.local_w1 if self.num_local else self.frozen_w1
        self._layout(sorted(set(local)), device=ref.device, dtype=ref.dtype)
        for name in MATRICES:
            getattr(self, f"local_{name}").data.zero_()
            self.load_resident(name, held, values[name])

    def _resident_stack(self, name: str) -> torch.Tensor:
        held = self.resident_ids
        local, frozen = getattr(self, f"local_{name}"), getattr(self, f"frozen_{name}")
        out = torch.empty(len(held), self.ffn_dim, self.d_model, device=local.device, dtype=local.dtype)
        for row, e in enumerate(held):
            slot = int(self.slot_of_expert[e])
            out[row] = local.detach()[slot] if slot < self.num_local else frozen[slot - self.num_local]
        return out

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """Initialise every expert in expert order, so the weights do not depend on the split."""
        for name, s in (("w1", std), ("v1", std), ("w2", out_std)):
            full = torch.empty(self.num_experts, self.ffn_dim, self.d_model)
            nn.init.trunc_normal_(full, std=s, a=-3 * s, b=3 * s, generator=generator)
            self.load_stacked(name, full)

    # MegaBlocks checkpoint layout ------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.absent_ids:  # partial residency: the resident experts only, and which ones they are
            destination[prefix + "resident_experts"] = torch.tensor(self.resident_ids, dtype=torch.long)
            for name in MATRICES:
                destination[prefix + name] = self._resident_stack(name).reshape(-1, self.d_model)
            return
        for name in MATRICES:
            destination[prefix + name] = self.stacked(name).reshape(-1, self.d_model)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        expected = (self.num_experts * self.ffn_dim, self.d_model)
        held = state_dict.get(prefix + "resident_experts")
        if held is not None:  # written by a partial peer: only those experts are in it
            held = [int(e) for e in held.tolist()]
            expected = (len(held) * self.ffn_dim, self.d_model)
        for name in MATRICES:
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if tuple(value.shape) != expected:
                error_msgs.append(
                    f"size mismatch for {key}: checkpoint has {tuple(value.shape)}, model expects {expected}"
                )
                continue
            if held is not None:
                self.load_resident(name, held, value.to(self.local_w1.dtype))
            else:
                self.load_stacked(name, value.to(self.local_w1.dtype))
        if strict:
            own = {prefix + name for name in MATRICES} | {prefix + "resident_experts"}
            for key in state_dict:
                if key.startswith(prefix) and key not in own and "." not in key[len(prefix) :]:
                    unexpected_keys.append(key)

    # Compute -----------------------------------------------------------------------------------
    def _use_grouped_mm(self, x: torch.Tensor) -> bool:
        return uses_grouped_mm(self.kernel, self.d_model, self.ffn_dim, x.dtype, x.is_cuda)

    def forward(self, x_sorted: torch.Tensor, counts_per_slot: torch.Tensor) -> torch.Tensor:
        """Apply each expert to its contiguous block of ``x_sorted`` (rows ordered by slot)."""
        counts = counts_per_slot.tolist()
        if x_sorted.shape[0] == 0:
            return x_sorted.new_zeros(0, self.d_model)
        n_local_rows = sum(counts[: self.num_local])
        out = []
        for group, rows, cnt in (
            ("local", x_sorted[:n_local_rows], counts[: self.num_local]),
            ("frozen", x_sorted[n_local_rows:], counts[self.num_local :]),
        ):
            if rows.shape[0] == 0:
                continue
            w1, v1, w2 = (getattr(self, f"{group}_{name}") for name in MATRICES)
            if rows.dtype != w1.dtype:
                w1, v1, w2 = w1.to(rows.dtype), v1.to(rows.dtype), w2.to(rows.dtype)
            out.append(self._group_forward(rows, cnt, w1, v1, w2))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _group_forward(self, rows, counts, w1, v1, w2) -> torch.Tensor:
        if self._use_grouped_mm(rows):
            offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
            gate = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(rows, v1.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(F.silu(gate) * up, w2, offs=offs)
        pieces = []
        start = 0
        for i, cnt in enumerate(counts):
            if cnt == 0:
                continue
            chunk = rows[start : start + cnt]
            start += cnt
            pieces.append((F.silu(chunk @ w1[i].T) * (chunk @ v1[i].T)) @ w2[i])
        return torch.cat(pieces)
