"""The MegaBlocks adapter's contract, checked on the CPU against a stand-in for MegaBlocks 0.10.0.

Why a stand-in: MegaBlocks runs only on CUDA (its permutation ops are CUDA kernels and its
``Arguments`` asserts grouped_gemm), and neither it nor a GPU is here. What the adapter depends on
is MegaBlocks' Python-level behaviour, which the stand-in reproduces from the 0.10.0 source:

- ``megablocks/layers/arguments.py``: the ``Arguments`` dataclass fields and defaults (an unknown
  keyword fails as it would; ``fp16=True`` by default, which makes ``common.dtype`` fp16);
- ``megablocks/layers/router.py``: ``LearnedRouter.forward`` computes ``logits = layer(x.view(-1, H))``,
  appends them to the module-global ``_ROUTER_LOGITS`` only when ``moe_zloss_weight != 0``, and
  returns ``(scores (T, E), expert_weights (T, k), expert_indices (T, k))``, p-norm normalised;
- ``megablocks/layers/moe.py``: ``ParallelMLP.forward`` appends ``(tokens_per_expert (E,),
  scores (T, E))`` to the module-global ``_LOAD_BALANCING_LOSS`` only ``if self.training and
  args.moe_loss_weight > 0``; ``MoE.forward`` = cast, router, experts; no bias tuple when ``bias=False``;
- ``megablocks/layers/dmoe.py``: the grouped path sorts the (token, slot) pairs by expert id, calls
  ``mlp(x, tokens_per_expert)`` and scatters the rows back weighted by ``expert_weights``.

Only the CUDA ops (radix sort, histogram, gather/scatter) are replaced by plain torch. The adapter
used to read ``get_load_balancing_loss()[-1]`` and ``_ROUTER_LOGITS[-1]``, which raised IndexError
against this stand-in in eval mode and for a zero loss weight (and, after such a failure, read the
previous call's left-over logits).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.machinery
import sys
import types
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from p2p_spes.config import load_config
from p2p_spes.errors import BackendError
from p2p_spes.moe import MegaBlocksAPI, MegaBlocksMoE, TorchMoE, import_megablocks

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

# MegaBlocks' Arguments defaults for activation_fn and init_method.
GELU_TANH = partial(F.gelu, approximate="tanh")
NORMAL_INIT = partial(torch.nn.init.normal_, mean=0.0, std=0.02)


def _module(name: str, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)  # find_spec() sees it
    if package:
        mod.__path__ = []
    return mod


def stand_in_megablocks() -> dict[str, types.ModuleType]:
    """Fresh stand-in modules (with empty global lists) keyed by their MegaBlocks import names."""
    top, layers = _module("megablocks", package=True), _module("megablocks.layers", package=True)
    arguments, router, moe, dmoe = (_module(f"megablocks.layers.{n}") for n in ("arguments", "router", "moe", "dmoe"))
    top.layers = layers
    layers.arguments, layers.router, layers.moe, layers.dmoe = arguments, router, moe, dmoe

    @dataclasses.dataclass
    class Arguments:  # megablocks/layers/arguments.py (the fields a dMoE without parallelism reads)
        hidden_size: int = 1024
        ffn_hidden_size: int = 4096
        num_layers: int = 1
        bias: bool = True
        return_bias: bool = True
        activation_fn: Callable | None = GELU_TANH
        moe_num_experts: int = 1
        moe_top_k: int = 1
        moe_capacity_factor: int = 1
        moe_normalize_expert_weights: int | float | None = None
        moe_loss_weight: float = 0.1
        moe_jitter_eps: float | None = None
        moe_lbl_in_fp32: bool = False
        moe_expert_model_parallelism: bool = False
        expert_parallel_group: Any = None
        pipeline_model_parallel_size: int = 1
        num_layers_per_virtual_pipeline_stage: int | None = None
        memory_optimized_mlp: bool = False
        mlp_type: str = "mlp"
        mlp_impl: str = "sparse"
        fp16: bool = True
        bf16: bool = False
        device: Any = None  # MegaBlocks: torch.cuda.current_device
        init_method: Callable = NORMAL_INIT
        uniform_expert_assignment: bool = False
        shared_expert: bool = False
        moe_zloss_weight: float = 0
        moe_zloss_in_fp32: bool = False

    arguments.Arguments = Arguments

    def dtype(args):  # megablocks/layers/common.py
        return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None

    router._ROUTER_LOGITS = []

    def _save_router_logits(logits, args):
        if args.moe_zloss_weight == 0:
            return
        router._ROUTER_LOGITS.append(logits)

    router._save_router_logits = _save_router_logits
    router.clear_router_zloss = router._ROUTER_LOGITS.clear

    class LearnedRouter(nn.Module):
        def __init__(self, args):
            super().__init__()
            self.args = args
            self.layer = nn.Linear(
                args.hidden_size, args.moe_num_experts, bias=False, dtype=dtype(args), device=args.device
            )
            args.init_method(self.layer.weight)

        def forward(self, x):
            logits = self.layer(x.view(-1, x.shape[-1]))
            _save_router_logits(logits, self.args)
            scores = logits.softmax(dim=-1)
            expert_weights, expert_indices = torch.topk(scores, self.args.moe_top_k, dim=-1)
            if self.args.moe_normalize_expert_weights:
                p = self.args.moe_normalize_expert_weights
                expert_weights = expert_weights / torch.norm(expert_weights, p=p, dim=-1, keepdim=True)
            return scores, expert_weights, expert_indices

    router.LearnedRouter = LearnedRouter

    moe._LOAD_BALANCING_LOSS = []
    moe.save_load_balancing_loss = moe._LOAD_BALANCING_LOSS.append
    moe.get_load_balancing_loss = lambda: moe._LOAD_BALANCING_LOSS
    moe.clear_load_balancing_loss = moe._LOAD_BALANCING_LOSS.clear

    class GroupedGLU(nn.Module):  # megablocks/layers/glu.py: fused (E*F, H) weights
        def __init__(self, args):
            super().__init__()
            self.args = args
            shape = (args.moe_num_experts * args.ffn_hidden_size, args.hidden_size)
            for name in ("w1", "v1", "w2"):
                setattr(self, name, nn.Parameter(torch.empty(shape, device=args.device, dtype=dtype(args))))

        def forward(self, x, tokens_per_expert):
            shape = (self.args.moe_num_experts, -1, self.args.hidden_size)
            w1, v1, w2 = (w.view(shape) for w in (self.w1, self.v1, self.w2))
            pieces = torch.split(x, tokens_per_expert.cpu().tolist())
            act = self.args.activation_fn
            return torch.cat([(act(p @ w1[e].T) * (p @ v1[e].T)) @ w2[e] for e, p in enumerate(pieces)])

    class ParallelDroplessMLP(nn.Module):  # moe.ParallelMLP.forward with dmoe's grouped_forward_once
        def __init__(self, args):
            super().__init__()
            self.args, self.num_experts, self.top_k = args, args.moe_num_experts, args.moe_top_k
            self.mlp = GroupedGLU(args)
            self.register_parameter("bias", None)  # args.bias is False here

        def forward_once(self, x, expert_weights, top_experts):
            expert_weights, top_experts = expert_weights.flatten(), top_experts.flatten()
            with torch.no_grad():
                indices = torch.argsort(top_experts, stable=True)  # ops.sort: (bin_ids, indices)
                tokens_per_expert = torch.bincount(top_experts, minlength=self.num_experts).int()  # ops.histogram
            rows = x.view(-1, x.shape[-1])[indices // self.top_k]  # ops.gather
            rows = self.mlp(rows, tokens_per_expert)
            out = torch.zeros(x.view(-1, x.shape[-1]).shape, dtype=rows.dtype, device=rows.device)
            out.index_add_(0, indices // self.top_k, rows * expert_weights[indices].unsqueeze(-1).to(rows.dtype))
            return out, tokens_per_expert  # ops.scatter: weighted sum over the top-k slots

        def forward(self, x, scores, expert_weights, top_experts):
            in_shape = x.size()
            x, tokens_per_expert = self.forward_once(x, expert_weights, top_experts)
            if self.training and self.args.moe_loss_weight > 0:
                moe.save_load_balancing_loss((tokens_per_expert, scores))
            return x.view(in_shape)

    class dMoE(nn.Module):  # moe.MoE.forward
        def __init__(self, args):
            super().__init__()
            self.router = LearnedRouter(args)
            self.experts = ParallelDroplessMLP(args)

        def forward(self, x):
            if torch.is_autocast_enabled():  # common.cast_if_autocast_enabled
                x = x.to(torch.get_autocast_dtype(x.device.type))
            scores, expert_weights, top_experts = self.router(x)
            return self.experts(x, scores, expert_weights, top_experts)

    dmoe.dMoE = dMoE
    return {m.__name__: m for m in (top, layers, arguments, router, moe, dmoe)}


@pytest.fixture
def mb(monkeypatch) -> MegaBlocksAPI:
    """The stand-in installed as ``megablocks``, imported through the adapter's own import function."""
    for name, mod in stand_in_megablocks().items():
        monkeypatch.setitem(sys.modules, name, mod)
    return import_megablocks()


def small_config(*extra: str):
    return load_config(None, SMALL + list(extra))


def pair(mb: MegaBlocksAPI, cfg, local=None) -> tuple[TorchMoE, MegaBlocksMoE]:
    """The torch backend with random weights and the adapter loaded from its state dict."""
    torch.manual_seed(0)
    ref = TorchMoE(cfg.moe, cfg.model.d_model, local_experts=local)
    ref.router.layer.weight.data.normal_(0, 0.5)
    ref.expert_weights.reset_parameters(0.1, 0.1)
    adapter = MegaBlocksMoE(cfg.moe, cfg.model.d_model, local_experts=local, device="cpu", api=mb)
    adapter.load_state_dict(ref.state_dict())
    return ref, adapter


def step(module: nn.Module, x: torch.Tensor, train: bool):
    """Output, stats and (in train mode) the gradients of a loss that uses output and statistics."""
    module.train(train)
    x = x.clone().requires_grad_(train)
    with torch.set_grad_enabled(train):
        out, stats = module(x)
    grads = {}
    if train:
        (out.pow(2).sum() + torch.dot(stats.tokens_per_expert, stats.mean_probs) + stats.router_z).backward()
        grads = {"input": x.grad, **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}
    return out, stats, grads


def assert_same(a, b) -> None:
    out_a, stats_a, grads_a = a
    out_b, stats_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)
    for field in ("tokens_per_expert", "mean_probs", "router_z"):
        torch.testing.assert_close(getattr(stats_a, field), getattr(stats_b, field), rtol=1e-5, atol=1e-6)
    assert stats_a.num_tokens == stats_b.num_tokens
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "weights", [(0.01, 0.001), (0.0, 0.001), (0.01, 0.0), (0.0, 0.0)], ids=["both", "no-lb", "no-z", "none"]
)
def test_adapter_matches_torch_backend_in_train_and_eval_mode_for_any_loss_weights(mb, train, weights):
    """Eval mode and zero loss weights are where MegaBlocks keeps no statistics (IndexError before)."""
    cfg = small_config(f"moe.lb_loss_weight={weights[0]}", f"moe.router_z_loss_weight={weights[1]}")
    ref, adapter = pair(mb, cfg)
    x = torch.randn(2, 7, cfg.model.d_model)
    assert_same(step(adapter, x, train), step(ref, x, train))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("local", [[0, 1, 2, 3], [1, 6]])
def test_adapter_matches_torch_backend_with_local_and_frozen_experts(mb, normalize, local):
    cfg = small_config(f"moe.normalize_top_k={str(normalize).lower()}")
    ref, adapter = pair(mb, cfg, local)
    x = torch.randn(3, 5, cfg.model.d_model)
    a, b = step(adapter, x, True), step(ref, x, True)
    assert_same(a, b)
    assert set(a[2]) == {
        "input",
        "router.layer.weight",
        "experts.mlp.local_w1",
        "experts.mlp.local_v1",
        "experts.mlp.local_w2",
    }


def test_megablocks_global_lists_are_empty_after_every_call_even_one_that_raises(mb):
    cfg = small_config()
    _, adapter = pair(mb, cfg)
    x = torch.randn(2, 7, cfg.model.d_model)
    for train in (True, False, True):
        step(adapter, x, train)
        assert mb.moe.get_load_balancing_loss() == [] and mb.router._ROUTER_LOGITS == []

    mb.moe.save_load_balancing_loss(("left", "over"))  # what a MegaBlocks user with loss weights would leave
    mb.router._ROUTER_LOGITS.append("left over")

    def fail(*args):
        raise RuntimeError("kernel failed")

    adapter.expert_weights.forward = fail
    with pytest.raises(RuntimeError, match="kernel failed"):
        adapter(x)
    assert mb.moe.get_load_balancing_loss() == [] and mb.router._ROUTER_LOGITS == []
    assert not adapter.router._forward_hooks and not adapter.router.layer._forward_hooks


def test_weights_are_fp32_with_the_torch_backends_names_and_checkpoints_interchange(mb):
    """MegaBlocks' Arguments default to fp16; the adapter's router must be fp32 like the torch backend's."""
    cfg = small_config()
    ref, adapter = pair(mb, cfg, [2, 5])
    state = adapter.state_dict()
    assert state.keys() == ref.state_dict().keys()
    assert all(v.dtype == torch.float32 for v in state.values())
    back = TorchMoE(cfg.moe, cfg.model.d_model, local_experts=[2, 5])
    back.load_state_dict(state)
    for key, value in back.state_dict().items():
        torch.testing.assert_close(value, ref.state_dict()[key], rtol=0, atol=0)


def test_a_deep_copy_of_the_adapter_runs(mb):
    """The swarm keeps a deep copy of the model (peer.py's shadow); module objects cannot be copied."""
    cfg = small_config()
    _, adapter = pair(mb, cfg)
    shadow = copy.deepcopy(adapter)
    x = torch.randn(1, 4, cfg.model.d_model)
    torch.testing.assert_close(shadow(x)[0], adapter(x)[0])
    assert shadow.api is adapter.api


def test_without_a_stand_in_the_adapter_refuses_the_cpu(mb):
    cfg = small_config()
    with pytest.raises(BackendError, match="needs a CUDA device"):
        MegaBlocksMoE(cfg.moe, cfg.model.d_model, device="cpu")


def test_the_stand_in_keeps_statistics_only_when_megablocks_does(mb):
    """The behaviour the adapter must survive, as megablocks/layers/moe.py and router.py define it."""
    args = mb.arguments.Arguments(
        hidden_size=8,
        ffn_hidden_size=16,
        moe_num_experts=4,
        moe_top_k=2,
        bias=False,
        return_bias=False,
        fp16=False,
        moe_loss_weight=0.1,
        moe_zloss_weight=0.001,
    )
    layer = mb.dmoe.dMoE(args)
    nn.init.normal_(layer.experts.mlp.w1), nn.init.normal_(layer.experts.mlp.v1), nn.init.normal_(layer.experts.mlp.w2)
    x = torch.randn(2, 3, 8)
    assert layer(x).shape == x.shape
    ((tokens_per_expert, scores),) = mb.moe.get_load_balancing_loss()
    assert tokens_per_expert.shape == (4,) and int(tokens_per_expert.sum()) == 6 * 2 and scores.shape == (6, 4)
    assert len(mb.router._ROUTER_LOGITS) == 1 and mb.router._ROUTER_LOGITS[0].shape == (6, 4)
    mb.clear_global_state()
    layer.eval()
    layer(x)
    assert mb.moe.get_load_balancing_loss() == [] and len(mb.router._ROUTER_LOGITS) == 1  # eval: no lb stats
    mb.clear_global_state()
    layer.train()
    args.moe_loss_weight, args.moe_zloss_weight = 0.0, 0.0
    layer(x)
    assert mb.moe.get_load_balancing_loss() == [] and mb.router._ROUTER_LOGITS == []
