"""The step benchmark (benchmarks/step_time.py) on a micro model: its parts add up to the step it times,
Muon's Newton-Schulz time sits inside the optimizer's, and every field the tables read is there."""

from __future__ import annotations

import torch

from benchmarks import step_time
from p2p_spes.optim import ns_flops

MICRO = [
    "model.vocab_size=97",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=16",
    "moe.ffn_dim=48",
    "train.batch_size=2",
    "train.device=cpu",
]


def test_the_parts_add_up_to_the_step_and_the_fields_are_there():
    arms = [step_time.ARMS[a] for a in ("adamw", "muon", "muon-attn")]
    shape = step_time.measure_shape(
        "spes-1b-stack", arms, steps=2, repeats=2, device=torch.device("cpu"), extra=MICRO, seed=0
    )
    step_time.add_mfu(shape, [step_time.matmul_rate(torch.device("cpu"), 128, repeat=2)])
    assert shape["tokens_per_step"] == 2 * 16 and shape["model_flops_per_step"] > 0
    for name, arm in shape["arms"].items():
        assert len(arm["repeats"]) == 2
        for rep in arm["repeats"]:
            parts = sum(rep[k] for k in step_time.PARTS)
            assert abs(parts - rep["total"]) <= 0.05 * rep["total"] + 2e-3, (name, rep)
            assert 0 <= rep["orthogonalize"] <= rep["optimizer"]
        assert set(arm["parts_s"]) == {*step_time.PARTS, "orthogonalize"}
        assert arm["mfu"] > 0 and arm["step_ratio_to_adamw"]["min"] > 0
        assert 0 < arm["projected"]["optimizer_share"] < 1
    adamw, muon, attn = (shape["arms"][a] for a in ("adamw", "muon", "muon-attn"))
    assert adamw["parts_s"]["orthogonalize"] == 0 and adamw["ns_flops_per_step"] == 0
    assert muon["parts_s"]["orthogonalize"] > 0
    assert 0 < attn["ns_flops_per_step"] < muon["ns_flops_per_step"]  # the experts left to AdamW


def test_newton_schulz_flops_count_each_matrix_of_a_stack_on_its_short_side():
    assert ns_flops((4, 512, 256), 5) == 4 * 5 * (4 * 256 * 256 * 512 + 2 * 256**3)
    assert ns_flops((256, 512), 3) == ns_flops((512, 256), 3)
