"""The start-up check of the MoE backend and expert kernel (p2p_spes/moe/selfcheck.py), on the CPU.

On a GPU the check runs by itself; here it is forced (``check=True``) and candidates are made to fail
by replacing how they are built: one raises (an unsupported GPU), one disagrees with the per-expert
loop in its output, gradients, statistics or eval mode. MegaBlocks is the CPU stand-in of
test_megablocks_adapter.py.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch
from test_megablocks_adapter import stand_in_megablocks

from p2p_spes import train
from p2p_spes.config import load_config
from p2p_spes.errors import BackendError
from p2p_spes.moe import BackendChoice, MegaBlocksMoE, TorchMoE, choose_backend, import_megablocks
from p2p_spes.moe.selfcheck import candidates

SMALL = [
    "model.vocab_size=97",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=16",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.ffn_dim=48",
]
CPU = torch.device("cpu")


def moe_config(*extra: str):
    return load_config(None, SMALL + list(extra)).moe


NO_KERNEL = "CUDA error: no kernel image is available for execution on the device"


def raising(*args):
    raise RuntimeError(NO_KERNEL)


class Disagrees(TorchMoE):
    """The torch backend, wrong in one way (same weight names, so the check's weights load)."""

    how = "output"

    def forward(self, x):
        out, stats = super().forward(x)
        if self.how == "output":
            out = out * 1.1
        elif self.how == "gradient":  # same values, 1.5 times the gradient
            out = out + 0.5 * (out - out.detach())
        elif self.how == "eval" and not self.training:
            out = out + 1.0
        elif self.how == "statistics":
            stats = dataclasses.replace(stats, mean_probs=stats.mean_probs.roll(1))
        elif self.how == "nan":
            out = out * float("nan")
        return out, stats


def disagreeing(how: str):
    def build(cfg, d_model, local, device, resident_only):
        module = Disagrees(cfg, d_model, local, device, resident_only=resident_only)
        module.how = how
        return module

    return build


def test_on_the_cpu_nothing_is_checked_and_the_configured_choice_stands():
    cfg = moe_config()
    choice = choose_backend(cfg, 32, CPU, builders={"torch:loop": raising, "torch:grouped_mm": raising})
    assert (choice.label, choice.checked, choice.findings) == ("torch:loop", False, [])
    assert choice.apply(cfg) is cfg
    assert choose_backend(moe_config("moe.torch_kernel=grouped_mm"), 32, CPU).label == "torch:grouped_mm"
    assert choose_backend(moe_config("moe.impl=megablocks"), 32, CPU).label == "megablocks"


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_torch_loop_always_passes(dtype):
    cfg = moe_config("moe.impl=torch", "moe.torch_kernel=loop")
    choice = choose_backend(cfg, 32, CPU, dtype, local_experts=[1, 6], check=True)
    assert (choice.label, choice.checked, choice.findings) == ("torch:loop", True, [])
    assert choice.apply(cfg).torch_kernel == "loop"


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_grouped_mm_passes_against_the_loop(dtype):
    choice = choose_backend(moe_config("moe.impl=torch"), 32, CPU, dtype, check=True)
    assert (choice.label, choice.checked, choice.findings) == ("torch:grouped_mm", True, [])


def test_a_backend_that_raises_falls_back_to_the_next_and_is_logged(caplog):
    cfg = moe_config()  # moe.impl: auto
    with caplog.at_level(logging.WARNING, logger="p2p_spes.moe.selfcheck"):
        choice = choose_backend(cfg, 32, CPU, check=True, megablocks=True, builders={"megablocks": raising})
    assert choice.label == "torch:grouped_mm" and choice.checked
    assert choice.findings == [f"megablocks: RuntimeError: {NO_KERNEL}"]
    assert "megablocks failed its start-up check" in caplog.text
    applied = choice.apply(cfg)
    assert (applied.impl, applied.torch_kernel) == ("torch", "grouped_mm")


@pytest.mark.parametrize(
    "how, finding",
    [
        ("output", "output differs from the per-expert loop"),
        ("gradient", "gradient of the input differs"),
        ("eval", "eval-mode output differs"),
        ("statistics", "mean_probs differs"),
        ("nan", "output is not finite"),
    ],
)
def test_a_kernel_that_disagrees_falls_back_to_the_loop(how, finding):
    choice = choose_backend(
        moe_config(), 32, CPU, check=True, megablocks=False, builders={"torch:grouped_mm": disagreeing(how)}
    )
    assert choice.label == "torch:loop" and choice.checked
    assert choice.findings[0] == "megablocks: not installed"
    assert choice.findings[1].startswith("torch:grouped_mm: ") and finding in choice.findings[1]
    if how == "gradient":
        assert "eval-mode output" not in choice.findings[1] and "output differs" not in choice.findings[1]


def test_an_explicit_megablocks_that_fails_is_an_error_with_the_finding():
    cfg = moe_config("moe.impl=megablocks")
    with pytest.raises(
        BackendError,
        match="moe.impl=megablocks failed its start-up check on cpu: megablocks: "
        "RuntimeError: CUDA error: no kernel image",
    ):
        choose_backend(cfg, 32, CPU, check=True, megablocks=True, builders={"megablocks": raising})
    with pytest.raises(BackendError, match="moe.impl=megablocks failed .*not importable"):  # the real one, here
        choose_backend(cfg, 32, CPU, check=True)


def test_an_explicit_grouped_mm_that_disagrees_is_an_error_not_the_loop():
    cfg = moe_config("moe.impl=torch", "moe.torch_kernel=grouped_mm")
    with pytest.raises(BackendError, match="moe.torch_kernel=grouped_mm failed .*gradient of the input differs"):
        choose_backend(cfg, 32, CPU, check=True, builders={"torch:grouped_mm": disagreeing("gradient")})


def test_when_megablocks_passes_it_is_chosen(monkeypatch):
    """The whole path with the MegaBlocks adapter on the CPU stand-in of MegaBlocks 0.10.0."""
    for name, mod in stand_in_megablocks().items():
        monkeypatch.setitem(sys.modules, name, mod)
    api = import_megablocks()

    def build(cfg, d_model, local, device, resident_only):
        return MegaBlocksMoE(cfg, d_model, local, device=device, api=api)

    choice = choose_backend(
        moe_config(), 32, CPU, local_experts=[1, 6], check=True, megablocks=True, builders={"megablocks": build}
    )
    assert (choice.label, choice.checked, choice.findings) == ("megablocks", True, [])
    assert choice.apply(moe_config()).impl == "megablocks"


def test_candidates_in_order_and_explicit_settings_leave_no_fall_back():
    def labels(*extra, megablocks=True, resident_only=False):
        return [c.label for c in candidates(moe_config(*extra), 32, megablocks, resident_only)]

    assert labels() == ["megablocks", "torch:grouped_mm", "torch:loop"]
    assert labels(megablocks=False) == ["torch:grouped_mm", "torch:loop"]
    assert labels(resident_only=True) == ["torch:grouped_mm", "torch:loop"]  # partial residency needs torch
    assert labels("moe.impl=megablocks") == ["megablocks"]
    assert labels("moe.impl=torch", "moe.torch_kernel=grouped_mm") == ["torch:grouped_mm"]
    assert labels("moe.impl=torch", "moe.torch_kernel=loop") == ["torch:loop"]
    assert labels("moe.ffn_dim=47", megablocks=False) == ["torch:loop"]  # rows not 16-byte aligned


def test_the_check_leaves_the_global_random_state_alone():
    before = torch.random.get_rng_state()
    choose_backend(moe_config(), 32, CPU, check=True, megablocks=True, builders={"megablocks": raising})
    assert torch.equal(before, torch.random.get_rng_state())


def test_the_trainer_builds_with_the_choice_and_reports_it(tmp_path, monkeypatch):
    overrides = SMALL + ["model.vocab_size=8192", "train.batch_size=2", f"train.run_dir={tmp_path}"]
    cfg = load_config(None, overrides)
    trainer = train.Trainer(cfg)
    assert (trainer.moe_backend.label, trainer.moe_backend.checked) == ("torch:loop", False)  # CPU: unchecked

    found = ["megablocks: not installed", "torch:grouped_mm: output differs from the per-expert loop"]
    monkeypatch.setattr(train, "choose_backend", lambda *a, **k: BackendChoice("torch", "loop", True, found))
    trainer = train.Trainer(load_config(None, overrides + ["moe.torch_kernel=grouped_mm"]))
    assert all(e.kernel == "loop" for e in trainer.model.expert_modules())
    summary = trainer.write_summary()
    assert (summary["moe_backend"], summary["moe_backend_checked"], summary["moe_backend_findings"]) == (
        "torch:loop",
        True,
        found,
    )
