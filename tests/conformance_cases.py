"""The models of the conformance suite (issue 16), their data and losses, and the three placements of their pages.

Every model is tiny (a few thousand parameters) and built under a fixed seed, so a fresh build gives the same
initial weights each time: one copy trains with torch.optim.AdamW, another through the engine. At 4 KiB pages
(1024 fp32 elements) each model has a weight spanning several pages.

Placements are derived from the job's own estimate (the layout's page count, the pages the device must hold at
once, the pages one optimizer update pins), not hard-coded bytes, so they stay right when the layout changes:

- device: the device tier holds every state page; the host holds the pages of one optimizer update (the least the
  estimate accepts), where pages are created first;
- host: the device holds what one step needs at once and a little more, but fewer pages than the parameters and
  gradients; the host holds everything;
- disk: the same device, and a host two pages above the least the estimate accepts (an update's pages, or the
  largest unit staged up from disk); the live states (parameters and both moments) fit neither, so every step
  cycles them through the disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import angel_ptm
from angel_ptm.errors import AngelError, BudgetError
from angel_ptm.estimate import estimate_job

from test_any_model import Encoder
from test_engine_equivalence import CASES, assert_tiers_used, engine_config, run_steps

STEPS = 15
PAGE_BYTES = 4096  # the smallest page (O_DIRECT alignment): every model here has a weight larger than one
PLACEMENTS = ["device", "host", "disk"]
SCHEDULERS = ["on_demand", "planned"]
TIERS_USED = {"device": "device", "disk": "device+host+disk"}  # test_engine_equivalence's names


# ---------------------------------------------------------------------------------------------------- models
class ConvNet(nn.Sequential):
    """Convolutions with BatchNorm2d in training mode: the running statistics are buffers updated by forward. The
    convolutions have no bias, as usual before a BatchNorm, which subtracts it again (its gradient would be zero
    but for rounding, see GRADIENT_FREE)."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 48, 3, padding=1, bias=False), nn.BatchNorm2d(48), nn.ReLU(),  # 14 pages
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 10))


class Recurrent(nn.Module):
    """A 2-layer nn.LSTM or nn.GRU (one autograd node reads all its weights) and a linear head."""

    def __init__(self, rnn: type[nn.RNNBase]):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = rnn(8, 32, num_layers=2, batch_first=True)  # weight_hh_l0: 128 x 32 (LSTM), 96 x 32 (GRU)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).squeeze(-1)


class TokenTagger(nn.Module):
    """nn.Embedding with a padding index (its row gets no gradient) and a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(96, 64, padding_idx=0)  # 6144 weights: 6 pages
        self.out = nn.Linear(64, 96)

    def forward(self, tokens):
        return self.out(torch.tanh(self.embedding(tokens)))


class PartlyTrained(nn.Module):
    """A frozen weight (requires_grad False), a module never called, and a branch only every other step uses: in
    torch those get no gradient, so AdamW neither decays them nor counts a step for them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 96)
        self.inp.weight.requires_grad_(False)
        self.branch = nn.Linear(96, 96)  # 9216 weights: 9 pages
        self.unused = nn.Linear(96, 16)
        self.head = nn.Linear(96, 1)

    def forward(self, x, with_branch: bool):
        h = torch.tanh(self.inp(x))
        if with_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).squeeze(-1)


def hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attention_dropout=0.0,
        attn_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=False, attn_implementation="eager", bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


# ---------------------------------------------------------------------------------------------------- data, losses
def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def encoder_batches():
    g = _generator(3)
    return [(torch.randn(4, 8, 32, generator=g),) for _ in range(STEPS)]


def encoder_loss(model, x):
    return (model(x) - x.mean(dim=(1, 2)).sin()).pow(2).mean()


def recurrent_batches():
    g = _generator(8)
    return [(torch.randn(4, 6, 8, generator=g),) for _ in range(STEPS)]


def last_step_loss(model, x):
    return (model(x) - x[:, -1].sum(dim=-1).sin()).pow(2).mean()


def images():
    g = _generator(4)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(STEPS)]


def classification_loss(model, x, labels):
    return F.cross_entropy(model(x), labels)


def padded_tokens():
    """Tokens with about a third of the positions padding (0); the label of a token is (3 * token + 1) % 96."""
    g = _generator(5)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(1, 96, (8, 12), generator=g)
        tokens[torch.rand(8, 12, generator=g) < 0.33] = 0
        out.append((tokens, (3 * tokens + 1) % 96))
    return out


def tagging_loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())


def alternating_batches():
    g = _generator(6)
    return [(torch.randn(8, 16, generator=g), step % 2 == 0) for step in range(STEPS)]


def alternating_loss(model, x, with_branch):
    return (model(x, with_branch) - x.sum(dim=1).sin()).pow(2).mean()


def next_tokens():
    g = _generator(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        out.append((ids, (3 * ids + 1) % 64))
    return out


def causal_lm_loss(model, input_ids, labels):
    return model(input_ids, labels=labels).loss


def gpt_batches():
    return CASES["gpt"][1]()[:STEPS]


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batches: Callable[[], list]
    loss: Callable
    gradient_free: dict = field(default_factory=dict)  # parameter name -> its elements that no loss depends on


# The key biases of attention (the middle third of a packed q, k, v bias): a softmax does not change when every
# score of a query moves by the same amount, so they never change the loss, and their gradients are rounding noise.
# AdamW scales that noise up to steps of about lr, whose signs follow ulps: the native Adam's square root (within
# an ulp of torch's) sends them elsewhere than torch does (0.04 apart after 15 steps). Everything else matches.
KEY_BIAS = slice(32, 64)

MODELS = {
    # nn.TransformerEncoder (2 layers, d_model 32), whose MultiheadAttention reads out_proj.weight outside
    # out_proj's forward, and a linear head
    "transformer": Case(Encoder, encoder_batches, encoder_loss,
                        {f"encoder.layers.{i}.self_attn.in_proj_bias": KEY_BIAS for i in range(2)}),
    "convbn": Case(ConvNet, images, classification_loss),
    "lstm": Case(lambda: Recurrent(nn.LSTM), recurrent_batches, last_step_loss),
    "gru": Case(lambda: Recurrent(nn.GRU), recurrent_batches, last_step_loss),
    "embedding": Case(TokenTagger, padded_tokens, tagging_loss),
    "partial": Case(PartlyTrained, alternating_batches, alternating_loss),
    "gpt": Case(CASES["gpt"][0], gpt_batches, CASES["gpt"][2]),
    "hf-llama": Case(hf_llama, next_tokens, causal_lm_loss),
    "hf-gpt2": Case(hf_gpt2, next_tokens, causal_lm_loss,
                    {f"transformer.h.{i}.attn.c_attn.bias": KEY_BIAS for i in range(2)}),
}


# ---------------------------------------------------------------------------------------------------- the runs
@pytest.fixture(autouse=True, scope="module")
def one_compute_thread():
    """Models this small gain nothing from a second intra-op thread; on 2 cores it only contends with the engine's
    copy and I/O threads (a step then takes several times as long)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------- placements
def place(config: dict, model: nn.Module, placement: str) -> dict:
    """`config` (an engine job whose memory section has page_bytes, disk_dir and scheduler) with the device and host
    budgets that put `model`'s state pages in `placement`, from the job's estimate."""
    memory = config["memory"]
    page = memory["page_bytes"]

    def estimate(device_budget="auto", host_budget="auto"):
        job = dict(config, memory=dict(memory, device_budget=device_budget, host_budget=host_budget))
        return estimate_job(job, model, disk_dir=memory["disk_dir"])

    whole = estimate()  # on a CPU, "auto" puts every page on the device
    pages = {kind: size // page for kind, size in whole.kind_bytes.items()}  # frozen tensors: parameter pages only
    states, group = sum(pages.values()), len(pages)  # one optimizer update pins a page of each kind
    if placement == "device":
        device, host = states, group
    else:
        # What the device must hold at once (the largest unit with the units around it, or an update's pages),
        # and an update's worth more for the gradients landing while a node's saved pages are pinned.
        device = whole.tiers["device"].needed // page + group
        moving = pages["param"] + pages["grad"]
        assert device < moving, f"{device} device pages hold all {moving} parameter and gradient pages"
        if placement == "host":
            host = states
        else:  # the least the host must hold (an update's pages, or a unit staged up from disk) and two more
            host = estimate(device * page, group * page).tiers["host"].needed // page + 2
            live = states - pages["grad"]  # gradients are discarded after the update, never written to disk
            assert device + host < live, f"{device} device and {host} host pages hold all {live} live state pages"
    return dict(config, memory=dict(memory, device_budget=device * page, host_budget=host * page))


def assert_placement_is_real(engine, placement: str) -> None:
    """The pages really went where the placement says: nothing off the device for `device`; pages resting on the
    host and brought up from it, no disk, for `host`; the disk both ways, and a tensor spanning pages, for `disk`."""
    stats = engine.memory_stats()
    moved, in_use = stats["moved"], stats["in_use"]
    if placement == "host":
        # Pages need not go back down: a planned step may keep every parameter page on the device while the
        # optimizer states stay on the host and are updated there (a device copy serves a host access).
        assert in_use["host"] > 0 and moved["host->device"] > 0
        assert in_use["disk"] == 0 and not any("disk" in hop for hop in moved)
    else:
        assert_tiers_used(TIERS_USED[placement], stats)
    if placement == "disk":
        assert any(slot.spans_pages for slot in engine.layout.slots)


def initialize_or_refusal(model: nn.Module, config: dict):
    """The engine, or the typed error with which `initialize` refuses a model it does not support. A BudgetError is
    no such refusal: the budgets here come from the job's own estimate, so the job fits."""
    try:
        return angel_ptm.initialize(model, config)
    except BudgetError:
        raise
    except AngelError as refusal:
        assert str(refusal) and "\n" not in str(refusal), f"an unclear refusal: {refusal!r}"
        return refusal


def run_engine(name: str, placement: str, scheduler: str, tmp_path, build=None, flush=False, dtype="float32",
               **optimizer):
    """Train model `name` (built by `build`, default its own) through the engine in `placement`; the engine (still
    open, to read its state; the caller closes it) and the losses, or the typed refusal of `initialize` and None."""
    case = MODELS[name]
    model = (build or case.build)()
    memory = {"page_bytes": PAGE_BYTES, "disk_dir": str(tmp_path), "scheduler": scheduler}
    engine = initialize_or_refusal(model, place(engine_config(memory, dtype=dtype, **optimizer), model, placement))
    if isinstance(engine, AngelError):
        return engine, None
    try:
        losses = run_steps(engine, case.batches(), case.loss)
        if flush:
            engine.flush()
    except BaseException:
        engine.close()
        raise
    return engine, losses


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """`actual` within `rel` of `expected`, relative in norm over the whole tensor. Not elementwise: the native Adam's
    square root is within an ulp of torch's, and over 15 steps that moves a few elements of a tensor by more (in
    hf-llama's gate_proj, one element by 1.4e-5 of the tensor's largest value, the tensor by 1.3e-6 in norm; with
    the engine's torch update path the parameters are bitwise equal)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    difference = actual.double() - expected.double()
    error, scale = float(difference.norm()), float(expected.double().norm())
    assert error <= rel * scale, (f"{what}: off by {error:.3g} in norm against {scale:.3g} (at most {rel:g} "
                                  f"relative); largest difference {float(difference.abs().max()):.3g}")


def trained_state(model: nn.Module) -> tuple[dict, dict]:
    """Copies of a model's parameters and buffers, by name."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return params, buffers


def loss_dependent(name: str, actual: torch.Tensor, expected: torch.Tensor, gradient_free: dict):
    """`actual` and `expected` without the elements of parameter `name` that no loss depends on (Case.gradient_free),
    which must only stay within the 15 AdamW steps of about lr each that their rounding-noise gradients take."""
    free = gradient_free.get(name)
    if free is None:
        return actual, expected
    drift = (actual[free].double() - expected[free].double()).abs().max()
    assert drift <= 2 * 1e-2 * STEPS, f"{name}[{free.start}:{free.stop}]: {float(drift):.3g} from torch's"
    keep = torch.ones(expected.shape[0], dtype=torch.bool)
    keep[free] = False
    return actual[keep], expected[keep]


def assert_state_matches(engine, params: dict, buffers: dict, gradient_free: dict, rel: float = 1e-5,
                         read=None) -> None:
    """Every parameter (read from its pages) within `rel` of torch's, but for its elements no loss depends on; the
    buffers too, which stay ordinary module buffers on the model (not in pages)."""
    read = read or engine.parameter
    for name, expected in params.items():
        assert_close_relative(*loss_dependent(name, read(name), expected, gradient_free), rel, name)
    in_pages = {slot.name for slot in engine.layout.slots}
    model_buffers = dict(engine.model.named_buffers())
    assert set(model_buffers) == set(buffers)
    for name, expected in buffers.items():
        buffer = model_buffers[name]
        assert name not in in_pages and not isinstance(buffer, nn.Parameter), name
        if expected.is_floating_point():
            assert_close_relative(buffer, expected, rel, name)
        else:
            assert torch.equal(buffer, expected), name
