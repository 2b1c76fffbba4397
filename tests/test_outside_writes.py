"""Parameters written in place outside their units' forward, under torch.no_grad() (or through `.data` and
`.detach()`), reach the pages, as torch writes the parameters (angel_ptm/outside_writes.py): `nn.init.*_`,
`p.mul_()`, `p[i] = v`, a view written later (`emb.weight[0].zero_()`, `p.detach().clamp_()`, `p.data.clamp_()`),
between steps, in any placement; training then matches plain
torch with the same writes. Only the elements written change: a mixed-precision master keeps its fp32 values
elsewhere, and a view written after a step leaves the step's update in the others."""

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ParameterAccessError
from conformance_cases import PAGE_BYTES, place
from conformance_cases import one_compute_thread  # noqa: F401  (an autouse fixture)
from test_engine_equivalence import assert_same_losses, engine_config

STEPS = 6
VOCAB = 64


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 48, padding_idx=0)
        self.mix = nn.Linear(48, 96)
        self.norm = nn.LayerNorm(96)
        self.head = nn.Linear(96, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.mix(self.emb(tokens)))))


def build():
    torch.manual_seed(0)
    return Tagger()


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (4, 6), generator=g), torch.randint(0, VOCAB, (4, 6), generator=g))
            for _ in range(STEPS)]


def loss_of(model, tokens, labels):
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1))


def edit(model, step: int):
    """What a training script might do to the weights between steps, each a write torch makes in place."""
    with torch.no_grad():
        if step == 1:
            nn.init.normal_(model.head.weight, std=0.05, generator=torch.Generator().manual_seed(3))
            nn.init.zeros_(model.mix.bias)
        elif step == 3:
            model.emb.weight[0].zero_()  # a view, written and dropped in one statement
            model.mix.weight.mul_(0.5)
            model.norm.weight[:5] = 2.0
            model.head.bias.detach().clamp_(-0.01, 0.01)
    if step == 4:  # with gradients on: `.data` and `.detach()` record no autograd (WGAN's clipping, an EMA's read)
        for param in model.head.parameters():
            param.data.clamp_(-0.05, 0.05)
        model.norm.bias.detach().add_(0.1)


def train(model, step_fn, edit_fn):
    losses = []
    for step, (x, y) in enumerate(batches()):
        edit_fn(step)
        losses.append(step_fn(x, y))
    return losses


def torch_losses():
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return train(model, step, lambda s: edit(model, s)), {n: p.detach().clone() for n, p in model.named_parameters()}


def make_engine(placement: str, tmp_path, scheduler="planned", dtype="float32"):
    model = build()
    memory = {"page_bytes": PAGE_BYTES, "disk_dir": str(tmp_path), "scheduler": scheduler}
    return model, angel_ptm.initialize(model, place(engine_config(memory, dtype=dtype), model, placement))


@pytest.mark.parametrize("placement, scheduler", [("device", "planned"), ("disk", "planned"), ("disk", "on_demand")])
def test_writes_between_steps_train_as_torch(placement, scheduler, tmp_path):
    expected, params = torch_losses()
    model, engine = make_engine(placement, tmp_path, scheduler)
    try:
        def step(x, y):
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        assert_same_losses(expected, train(model, step, lambda s: edit(model, s)))
        for name, value in params.items():
            torch.testing.assert_close(engine.parameter(name), value, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_an_inplace_op_returns_the_parameter_and_reads_see_the_write(tmp_path):
    model, engine = make_engine("disk", tmp_path)
    try:
        with torch.no_grad():
            assert model.mix.weight.mul_(2.0) is model.mix.weight
            model.mix.weight[1, 2] = 5.0
            assert float(model.mix.weight[1, 2]) == 5.0  # (a read of the written element, outside the unit)
        with torch.inference_mode():
            nn.init.constant_(model.head.bias, 0.25)
        assert torch.equal(engine.parameter("head.bias"), torch.full((VOCAB,), 0.25))
        assert float(engine.parameter("mix.weight")[1, 2]) == 5.0
        assert float(model.state_dict()["mix.weight"][1, 2]) == 5.0
    finally:
        engine.close()
    assert float(model.mix.weight.detach()[1, 2]) == 5.0  # the model keeps it after close


def test_views_of_a_parameter_follow_it_across_writes_and_steps_as_torchs_do(tmp_path):
    model, engine = make_engine("disk", tmp_path)
    try:
        with torch.no_grad():
            row, rows = model.emb.weight[2], model.emb.weight[1:4]
        row.fill_(3.0)  # (written through a view outside no_grad too: the view records no autograd)
        assert torch.equal(engine.parameter("emb.weight")[2], torch.full((48,), 3.0))
        assert torch.equal(rows[1], torch.full((48,), 3.0))  # another view of it sees the write, as in torch
        rows[2].fill_(4.0)
        now = engine.parameter("emb.weight")
        assert torch.equal(now[2], torch.full((48,), 3.0)) and torch.equal(now[3], torch.full((48,), 4.0))
        x, y = batches()[0]
        engine.backward(loss_of(engine, x, y))
        engine.step()
        trained = engine.parameter("emb.weight")
        assert torch.equal(row, trained[2])  # the view reads the step's values
        row.mul_(2.0)
        assert torch.equal(engine.parameter("emb.weight")[2], 2.0 * trained[2])
        assert torch.equal(engine.parameter("emb.weight")[3], trained[3])
        del row, rows
        engine.backward(loss_of(engine, x, y))  # (the entry after its last view is gone lets the copy go)
        engine.step()
        assert not engine.binder.outside_writes._watched
    finally:
        engine.close()


def test_assigning_data_is_refused_and_reads_through_data_see_the_pages(tmp_path):
    model, engine = make_engine("device", tmp_path)
    try:
        assert torch.equal(model.mix.bias.data, engine.parameter("mix.bias"))
        with pytest.raises(ParameterAccessError, match="'mix.bias'"):
            model.mix.bias.data = torch.zeros(96)
        with torch.no_grad(), pytest.raises(ParameterAccessError, match="'mix.bias'"):
            model.mix.bias.data = torch.zeros(96)
        with pytest.raises(ParameterAccessError, match="'mix.bias'"):
            model.mix.bias.sum()  # (with gradients on, an op autograd records stays an error)
    finally:
        engine.close()


def test_mixed_precision_keeps_the_master_where_nothing_was_written(tmp_path):
    model, engine = make_engine("disk", tmp_path, dtype="bfloat16")
    try:
        x, y = batches()[0]
        engine.backward(loss_of(engine, x, y))
        engine.step()
        master = engine.master_parameter("mix.weight")
        with torch.no_grad():
            model.mix.weight[0, 0] = 1.0
        written = master.clone()
        written[0, 0] = 1.0
        assert torch.equal(engine.master_parameter("mix.weight"), written)
        assert torch.equal(engine.parameter("mix.weight"), written.to(torch.bfloat16))
    finally:
        engine.close()


def test_a_write_while_a_forward_runs_is_refused(tmp_path):
    """Another unit's parameter written from inside a forward: the write cannot go in then (the unit's own are
    refused by the binder at its end, test_torch_api_semantics)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]))
    blocks = model[0]
    engine = angel_ptm.initialize(model, {"trainer": {"device": "cpu"}})

    def write_other(_module, _args):
        with torch.no_grad():
            blocks[1].bias.zero_()
    blocks[0].register_forward_pre_hook(write_other)
    try:
        with pytest.raises(ParameterAccessError, match="0.1.bias.*while a forward runs"):
            with torch.no_grad():
                blocks[0](torch.ones(2, 8))
    finally:
        engine.close()


def test_under_staleness_1_a_write_lands_on_the_pending_update_and_draws_torchs_random_numbers(tmp_path):
    """optimizer.staleness 1: between steps the model computes with weights a step behind the master (its update is
    pending). An op writing a parameter there read those lagging weights, and its write replaced the pending update
    of the elements it wrote (p.mul_(0.5) gave 0.5 * theta_{t-1}, not 0.5 * theta_t). It now runs again on the
    updated weights, with the random numbers it drew the first time; a view taken while they lag and written later
    is refused, saying to flush first."""
    model = build()
    memory = {"page_bytes": PAGE_BYTES, "disk_dir": str(tmp_path)}
    engine = angel_ptm.initialize(model, place(engine_config(memory, staleness=1), model, "disk"))
    try:
        for x, y in batches()[:2]:
            engine.backward(loss_of(engine, x, y))
            engine.step()
        updated = engine.state_dict()  # (the pending update run: the weights after every step taken)
        with torch.no_grad():
            model.mix.weight.mul_(0.5)
            torch.manual_seed(7)
            nn.init.normal_(model.head.bias)
            after_init = torch.rand(3)
        torch.manual_seed(7)
        drawn = torch.empty(VOCAB).normal_()
        assert torch.equal(after_init, torch.rand(3))  # one draw, as torch's
        now = engine.state_dict()
        assert torch.equal(now["mix.weight"], 0.5 * updated["mix.weight"])
        assert torch.equal(now["head.bias"], drawn)
        assert torch.equal(now["mix.bias"], updated["mix.bias"])
        x, y = batches()[2]
        engine.backward(loss_of(engine, x, y))
        engine.step()
        view = model.norm.weight.detach()  # taken while the update of that step is pending
        view.zero_()
        with pytest.raises(ParameterAccessError, match=r"'norm.weight' written through a view taken under "
                                                       r"optimizer.staleness 1.*engine.flush\(\)"):
            engine(x)
        engine.flush()
        model.norm.weight.detach().zero_()
        assert torch.equal(engine.state_dict()["norm.weight"], torch.zeros(96))
        engine.backward(loss_of(engine, x, y))  # trains on
        engine.step()
    finally:
        engine.close()


def test_an_op_on_parameters_of_two_engines_reads_each_as_a_copy_and_writes_into_its_own_pages(tmp_path):
    """An EMA or a teacher copy kept by a second engine: `ema_p.lerp_(p, 0.1)` under no_grad mixes two engines'
    parameters, and every such op was a ParameterAccessError (each engine read only its own). Each engine now
    reads its own as copies and takes the writes into its own pages: the EMA follows torch's."""
    student, ema = build(), build()
    plain_student, plain_ema = build(), build()
    memory = {"page_bytes": PAGE_BYTES, "disk_dir": str(tmp_path / "s")}
    engine = angel_ptm.initialize(student, place(engine_config(memory), student, "disk"))
    shadow = angel_ptm.initialize(ema, place(engine_config(dict(memory, disk_dir=str(tmp_path / "e"))), ema, "disk"))
    opt = torch.optim.AdamW(plain_student.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    try:
        for x, y in batches()[:3]:
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            plain = loss_of(plain_student, x, y)
            plain.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for mine, theirs in zip(ema.parameters(), student.parameters()):
                    mine.lerp_(theirs, 0.1)
                for mine, theirs in zip(plain_ema.parameters(), plain_student.parameters()):
                    mine.lerp_(theirs, 0.1)
                assert float((ema.mix.weight * student.mix.weight).sum()) == pytest.approx(
                    float((plain_ema.mix.weight * plain_student.mix.weight).sum()), rel=1e-4)
        for name, value in plain_ema.named_parameters():
            torch.testing.assert_close(shadow.parameter(name), value.detach(), rtol=1e-5, atol=1e-6)
    finally:
        engine.close()
        shadow.close()
