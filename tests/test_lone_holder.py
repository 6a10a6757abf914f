"""A lone holder under a lossy codec keeps its own weights; its anchor, the value it serves and the
others follow by encoded deltas, trails them by what the codec has not carried yet (swarm/outer.py).

Before, a lone holder wrote ``anchor - decoded(anchor - weights)`` back into its weights every round:
with top-k (1/64 of the values per round) each expert kept about 1/64 of what it learned between
rounds, and the top-k arm of the convergence benchmark ended 18.6% worse than uncompressed.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from helpers import SMALL_MODEL

from p2p_spes.averaging.compression import Codec
from p2p_spes.config import load_config
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.outer import OuterOptimizer, flatten


def outer(optimizer: str = "average", keep: bool = False) -> OuterOptimizer:
    return OuterOptimizer(
        load_config(
            None, SMALL_MODEL + [f"swarm.outer_optimizer={optimizer}", f"swarm.keep_local_progress={keep}"]
        ).swarm
    )


def test_only_a_lone_holder_averaging_under_a_lossy_codec_keeps_its_weights():
    assert outer().keeps_own(members=1, lossy=True)
    assert not outer().keeps_own(members=1, lossy=False)  # uncompressed: the result is our weights anyway
    assert not outer().keeps_own(members=2, lossy=True)  # a group: every member takes the same result
    assert not outer("nesterov").keeps_own(members=1, lossy=True)  # the outer step is not our weights
    # swarm.keep_local_progress: a member of a group keeps what its message has not carried yet...
    assert outer(keep=True).keeps_own(members=2, lossy=True)
    assert not outer(keep=True).keeps_own(members=2, lossy=True, carried=False)  # ...when the result counted it
    assert not outer(keep=True).keeps_own(members=3, lossy=False)
    assert not outer("nesterov", keep=True).keeps_own(members=2, lossy=True)


def test_members_keeping_their_progress_share_the_anchor_and_converge_to_the_mean():
    """With ``swarm.keep_local_progress`` each member's weights become the group's result plus what its
    top-k message left out (``value - (sent - decoded)``, as ``RoundRunner._apply`` writes them). Their
    anchors stay identical and the mean of their weights never moves, so when they stop training the
    anchor and every member close in on the plain average of what they had trained."""
    codec = Codec("topk", 1 / 64)
    torch.manual_seed(0)
    anchor = torch.randn(4096)
    weights = [anchor + torch.randn(4096) * 1e-2 for _ in range(3)]
    target = torch.stack(weights).mean(0)
    opts = [outer(keep=True) for _ in weights]
    for opt in opts:
        opt.set_anchor("shared", anchor.clone(), 0)
    gaps = []
    for k in range(1, 129):
        sent = [opt.pseudo_gradient("shared", w) for opt, w in zip(opts, weights)]
        decoded = [codec.decode(codec.encode(g), g.numel()) for g in sent]
        average = torch.stack(decoded).mean(0)
        assert all(opt.keeps_own(len(opts), lossy=True) for opt in opts)
        values = [opt.step("shared", average, k) for opt in opts]
        weights = [v - (g - d) for v, g, d in zip(values, sent, decoded)]
        assert all(torch.equal(opt.anchor["shared"], opts[0].anchor["shared"]) for opt in opts)
        torch.testing.assert_close(torch.stack(weights).mean(0), target, rtol=0, atol=1e-6)
        gaps.append(max(float((w - opts[0].anchor["shared"]).norm()) for w in weights))
    assert gaps[-1] < 0.05 * gaps[0], gaps[::16]
    torch.testing.assert_close(opts[0].anchor["shared"], target, rtol=0, atol=1e-3 * float(target.abs().max()))


@pytest.mark.parametrize(("codec", "rounds", "left"), [(Codec("int8"), 1, 0.01), (Codec("topk", 1 / 64), 64, 0.05)])
def test_the_anchor_follows_weights_that_stopped_moving(codec, rounds, left):
    """Each round sends ``anchor - weights`` (what the last message dropped included): a frozen copy
    stays bit-identical to the anchor, and the anchor closes in on the weights, which nothing writes."""
    opt = outer()
    torch.manual_seed(0)
    anchor = torch.randn(4096)
    weights = anchor + torch.randn(4096) * 1e-2
    kept = weights.clone()
    opt.set_anchor("expert:1", anchor.clone(), 0)
    frozen, gap = anchor.clone(), [(anchor - weights).norm()]
    for k in range(1, rounds + 1):
        g = opt.pseudo_gradient("expert:1", weights)
        decoded = codec.decode(codec.encode(g), g.numel())
        opt.step("expert:1", decoded, k)
        frozen = opt.step_frozen("expert:1", frozen, decoded)
        assert torch.equal(frozen, opt.anchor["expert:1"])
        gap.append((opt.anchor["expert:1"] - weights).norm())
    assert torch.equal(weights, kept)
    assert gap[-1] < left * gap[0], [float(g / gap[0]) for g in gap[:: max(rounds // 8, 1)]]
    assert all(b <= a for a, b in pairwise(gap))


def test_public_values_are_the_anchor_shaped_like_the_model():
    cfg = load_config(None, SMALL_MODEL)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[0])
    with torch.no_grad():
        for t in model.expert_tensors(0):
            t.copy_(torch.randn_like(t))
    opt = outer()
    opt.reset_anchors(model)
    assert opt.public_values(model) == {}  # nothing runs ahead: the model's values are served
    moved = flatten(model.expert_tensors(0)) + 1.0
    opt.set_anchor("expert:0", moved, 2)
    opt.ahead.add("expert:0")
    public = opt.public_values(model)["expert:0"]
    assert [t.shape for t in public] == [t.shape for t in model.expert_tensors(0)]
    assert torch.equal(flatten(public), moved)
    opt.set_anchor("expert:0", flatten(model.expert_tensors(0)), 3)  # agreed again (adopted, taken over)
    assert opt.public_values(model) == {}
