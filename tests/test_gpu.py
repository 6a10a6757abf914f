"""On a CUDA GPU: the model computes there what it computes on the CPU, and the fast MoE paths pass their check.

Marked ``gpu``: ``tests/conftest.py`` skips these when torch sees no CUDA device (CI has none). The
CPU-side contract of the same code is covered by test_model, test_backend_check and test_megablocks_adapter.
"""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_MODEL

from p2p_spes.config import load_config
from p2p_spes.model import MoETransformer
from p2p_spes.moe import megablocks_available
from p2p_spes.moe.selfcheck import candidates, choose_backend

pytestmark = pytest.mark.gpu


def loss_and_grads(model: MoETransformer, idx: torch.Tensor) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    out = model.loss(idx[:, :-1], idx[:, 1:])
    out.loss.backward()
    parts = {name: float(getattr(out, name).detach()) for name in ("loss", "ce", "lb_loss", "router_z_loss")}
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return parts, grads


def test_the_model_on_cuda_computes_what_it_computes_on_the_cpu():
    """fp32, the per-expert loop on both sides: loss parts and gradients agree to float rounding."""
    cfg = load_config(None, SMALL_MODEL + ["moe.impl=torch", "moe.torch_kernel=loop"])
    local = [1, 2, 5]  # a SPES peer's subset: frozen experts pass gradients through, get none
    cpu = MoETransformer(cfg.model, cfg.moe, local_experts=local)
    cpu.init_weights(0)
    gpu = MoETransformer(cfg.model, cfg.moe, local_experts=local, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    idx = torch.randint(
        0, cfg.model.vocab_size, (4, cfg.model.max_seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    parts_cpu, grads_cpu = loss_and_grads(cpu, idx)
    parts_gpu, grads_gpu = loss_and_grads(gpu, idx.cuda())
    assert parts_gpu == pytest.approx(parts_cpu, rel=1e-4, abs=1e-6)
    assert grads_gpu.keys() == grads_cpu.keys()
    for name, grad in grads_cpu.items():
        torch.testing.assert_close(grads_gpu[name], grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_fast_moe_path_passes_its_start_up_check_here(dtype):
    """Each backend a peer would try on this GPU (MegaBlocks if installed, torch grouped_mm, the loop), set
    explicitly so that a failure is an error naming the finding instead of a silent fall-back."""
    cfg = load_config(None, SMALL_MODEL).moe
    d_model = load_config(None, SMALL_MODEL).model.d_model
    plan = candidates(cfg, d_model, megablocks_available())
    assert plan, "no MoE backend to try"
    for cand in plan:
        choice = choose_backend(
            cand.config(cfg), d_model, torch.device("cuda"), autocast_dtype=dtype, local_experts=[0, 3]
        )
        assert choice.checked and choice.label == cand.label, (cand.label, choice)
