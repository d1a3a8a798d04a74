"""ShardedMuon (draftsmith/train/muon.py): Muon's Newton-Schulz work split across DDP ranks gives torch.optim.Muon's
weights and state exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.train.muon import (
    NS_COEFFICIENTS,
    ShardedMuon,
    adjusted_lr,
    muon_owners,
    newton_schulz_flops,
    orthogonalize,
)

#: a tall, a wide and a square matrix, two of one shape: the transpose path, both lr adjustments' sides, ties
SHAPES = [(24, 8), (8, 40), (16, 16), (16, 16), (12, 20)]
KW = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
STEPS = 3


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    for step in range(STEPS):
        for p, grad in zip(params, _grads(step)):
            p.grad = grad
        opt.step()


def test_owners_balance_the_newton_schulz_flops():
    """Each matrix gets one owner; the largest first to the least loaded rank, so at the 27B drafter's 36 matrices
    (gpu-node's: fc 5,120 x 25,600, 5 layers of q / k / v / o and gate / up / down; 197 TFLOP a step) no rank of 2,
    4 or 8 does more than 1.05x its fair share; the same shapes give the same owners; one rank owns everything."""
    hidden, inter, q, kv = 5120, 17408, 4096, 1024
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    shapes = [(hidden, 5 * hidden)] + layer * 5
    total = sum(newton_schulz_flops(s) for s in shapes)
    assert round(total / 1e12) == 197  # docs/peers/README.md's count
    for world in (2, 4, 8):
        owners = muon_owners(shapes, world)
        assert owners == muon_owners(shapes, world) and set(owners) == set(range(world))
        load = [sum(newton_schulz_flops(s) for s, r in zip(shapes, owners) if r == rank) for rank in range(world)]
        assert max(load) <= 1.05 * total / world, world
    assert muon_owners(shapes, 1) == [0] * len(shapes)
    # the FLOP count of docs/peers/README.md: 5 iterations of 4 m^2 n + 2 m^3, m the smaller side
    assert newton_schulz_flops((17408, 5120)) == 5 * (4 * 5120 ** 2 * 17408 + 2 * 5120 ** 3)
    assert muon_owners([(4, 4), (8, 8)], 4) == [1, 0]  # more ranks than matrices: some idle


def _by_hand(kw: dict, dtype: torch.dtype = torch.bfloat16) -> tuple[list, list]:
    """``(weights, momentum buffers)`` after :data:`STEPS` steps of orthogonalize + adjusted_lr applied as
    ShardedMuon's owner applies them, the orthogonalisations in ``dtype``."""
    params = _params()
    bufs = [torch.zeros_like(p) for p in params]
    with torch.no_grad():
        for step in range(STEPS):
            for p, buf, grad in zip(params, bufs, _grads(step)):
                buf.lerp_(grad, 1 - kw["momentum"])
                update = orthogonalize(grad.lerp(buf, kw["momentum"]), NS_COEFFICIENTS, 5, 1e-7, dtype)
                assert update.dtype == dtype
                p.mul_(1 - kw["lr"] * kw["weight_decay"])
                p.add_(update, alpha=-adjusted_lr(kw["lr"], kw["adjust_lr_fn"], p.shape))
    return params, bufs


def test_the_step_arithmetic_is_torch_muons():
    """orthogonalize + adjusted_lr, applied as ShardedMuon's owner applies them, give torch.optim.Muon's weights
    bit for bit over three steps (both learning-rate adjustments)."""
    for adjust in ("match_rms_adamw", "original"):
        kw = dict(KW, adjust_lr_fn=adjust)
        ref = _params()
        _run(torch.optim.Muon(ref, **kw), ref)
        mine, _ = _by_hand(kw)
        for a, b in zip(ref, mine):
            assert torch.equal(a, b), adjust


def test_float32_orthogonalisation_is_the_same_step_in_float32():
    """``ns_dtype=torch.float32`` (the CPU's: bf16 products are emulated there) runs the step's arithmetic with the
    Newton-Schulz iterations in float32: the weights equal a by-hand float32 step exactly, and differ from
    torch.optim.Muon's bf16 step by bf16's rounding of the orthogonalised update only (a few percent of the weights'
    change, where a wrong learning rate, decay or transpose would be of its order)."""
    start = _params()
    ref = _params()
    _run(torch.optim.Muon(ref, **KW), ref)
    mine = _params()
    opt = ShardedMuon(mine, ns_dtype=torch.float32, **KW)
    assert opt.world == 1
    _run(opt, mine)
    by_hand, bufs = _by_hand(KW, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(mine, by_hand))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], buf) for p, buf in zip(mine, bufs))
    for s0, a, b in zip(start, ref, mine):
        change, diff = (a - s0).norm(), (b - a).norm()
        assert 0 < diff < 0.05 * change, (diff / change).item()
    with pytest.raises(ValueError, match="ns_dtype"):
        ShardedMuon(_params(), ns_dtype=torch.float16, **KW)
    # without Nesterov the update is the momentum buffer itself, which float32 must not orthogonalise in place: the
    # buffers (gradients only, no orthogonalisation in them) stay torch.optim.Muon's exactly
    plain = dict(KW, nesterov=False)
    ref, mine = _params(), _params()
    ref_opt, opt = torch.optim.Muon(ref, **plain), ShardedMuon(mine, ns_dtype=torch.float32, **plain)
    _run(ref_opt, ref)
    _run(opt, mine)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
               for p, q in zip(mine, ref))


def test_without_a_process_group_it_is_torch_muon():
    ref, mine = _params(), _params()
    _run(torch.optim.Muon(ref, **KW), ref)
    opt = ShardedMuon(mine, **KW)
    assert opt.world == 1 and opt.largest_share == 1.0
    _run(opt, mine)
    assert all(torch.equal(a, b) for a, b in zip(ref, mine))


def _rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world)
    try:
        params = _params()
        opt = ShardedMuon(params[:3], **KW)
        opt.add_param_group({"params": params[3:]})  # owned once step() sees it
        _run(opt, params)
        owned = [i for i, p in enumerate(params) if opt.owner[id(p)] == rank]
        tensors = {f"w{i}": p.detach() for i, p in enumerate(params)}
        tensors.update({f"m{i}": opt.state[p]["momentum_buffer"] for i, p in enumerate(params)})
        tensors["owned"] = torch.tensor(owned + [-1])
        tensors["share"] = torch.tensor([opt.largest_share])
        save_file(tensors, str(Path(out) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sharing_the_work_give_torch_muons_weights_and_state_exactly(tmp_path, world):
    """2 and 3 gloo ranks with the same gradients: every rank ends with torch.optim.Muon's weights and momentum
    buffers bit for bit (a parameter group added after construction included), each rank orthogonalised only its
    own matrices (together: each matrix once), and torch.optim.Muon's state loads into it (the checkpoints are
    torch's)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(world, str(tmp_path)), nprocs=world, join=True)
    ref = _params()
    plain = torch.optim.Muon(ref[:3], **KW)
    plain.add_param_group({"params": ref[3:]})
    _run(plain, ref)
    got = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(world)]
    owned = sorted(int(i) for g in got for i in g["owned"] if i >= 0)
    assert owned == list(range(len(SHAPES)))
    assert all(len([i for i in g["owned"] if i >= 0]) >= 1 for g in got)
    assert float(got[0]["share"]) < 1.0
    for g in got:
        for i, p in enumerate(ref):
            assert torch.equal(g[f"w{i}"], p.detach()), i
            assert torch.equal(g[f"m{i}"], plain.state[p]["momentum_buffer"]), i
    resumed = _params()
    opt = ShardedMuon(resumed[:3], **KW)
    opt.add_param_group({"params": resumed[3:]})
    sd = plain.state_dict()
    opt.load_state_dict(sd)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], plain.state[q]["momentum_buffer"])
               for p, q in zip(resumed, ref))
