"""Expert parallelism over gloo on CPU (angel_ptm/parallel/moe): an MoE layer whose experts are split over 2 ranks
gives, on each rank's tokens, the output and the gradients of the unsplit layer (fp32 within 1e-5): the input's
and the gate's per rank, each expert's summed over the ranks whose tokens it served; top-1 and top-2 with drops
and dropless."""

from __future__ import annotations

import pytest
import torch

from angel_ptm.models.moe import MoE, MoESpec

from dist_harness import spawn, values

DIM, HIDDEN, TOKENS, EXPERTS = 12, 16, 20, 4
SPECS = {
    "switch-drops": dict(gate="switch", capacity_factor=0.5),
    "top2-drops": dict(gate="gshard", capacity_factor=0.5),
    "top2-dropless": dict(gate="gshard", capacity_factor=0.0),
    "ktop1": dict(gate="ktop1", top_k=2, capacity_factor=1.0),
}


def layer(name: str) -> MoE:
    torch.manual_seed(0)
    return MoE(DIM, HIDDEN, MoESpec(**{"experts": EXPERTS, "top_k": 2, **SPECS[name]})).eval()  # eval: no sampling


def tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)


def split_layers(rank: int, world: int, tmp: str) -> dict:
    from angel_ptm.config import load_config
    from angel_ptm.parallel.mesh import init_mesh
    from angel_ptm.parallel.moe import EPComm, apply_expert_parallel, expert_names

    mesh = init_mesh(load_config({}).parallel)
    comm = EPComm(mesh, mesh.dp_ranks)
    out = {}
    for name in SPECS:
        moe = layer(name)
        holder = torch.nn.Module()
        holder.moe = moe
        apply_expert_parallel(holder, comm)
        x = tokens(rank)
        y = moe(x)
        (y * y).sum().backward()
        names = expert_names(holder)
        out[name] = {"y": y.tolist(), "x_grad": x.grad.tolist(), "experts": len(moe.experts),
                     "grads": {names.get(f"moe.{n}", f"moe.{n}"): p.grad.tolist() if p.grad is not None else None
                               for n, p in moe.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep2")
    return values(spawn(2, split_layers, (str(tmp),), tmp))


@pytest.mark.parametrize("name", list(SPECS))
def test_ep2_gives_the_unsplit_layers_outputs_and_gradients(two_ranks, name):
    whole = layer(name)
    expert_grads: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        whole.zero_grad(set_to_none=True)
        x = tokens(rank)
        y = whole(x)
        (y * y).sum().backward()
        got = two_ranks[rank][name]
        assert got["experts"] == EXPERTS // 2
        torch.testing.assert_close(torch.tensor(got["y"]), y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["x_grad"]), x.grad, rtol=1e-5, atol=1e-6)
        gate = got["grads"]["moe.gate.router.weight"]
        torch.testing.assert_close(torch.tensor(gate), whole.gate.router.weight.grad, rtol=1e-5, atol=1e-6)
        for n, p in whole.named_parameters():
            if ".experts." in f".{n}" and p.grad is not None:
                expert_grads[n] = expert_grads.get(n, 0) + p.grad
    for n, expected in expert_grads.items():
        owner = 0 if int(n.split(".")[1]) < EXPERTS // 2 else 1
        got = two_ranks[owner][name]["grads"][f"moe.{n}"]
        torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)
