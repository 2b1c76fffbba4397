import pytest
import torch
from torch import nn

from angel_ptm.memory import PageLayout, build_layout, first_use_order
from angel_ptm.models import GPT, GPTConfig

KIB = 1024


def small_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, dim=64))


def test_layout_of_a_gpt_is_deterministic():
    a = build_layout(small_gpt(), page_bytes=16 * KIB)
    b = build_layout(small_gpt(), page_bytes=16 * KIB)
    assert a.fingerprint() == b.fingerprint()
    assert a.slots == b.slots


def test_every_parameter_is_placed_once_and_tied_weights_share_a_slot():
    model = small_gpt()
    layout = build_layout(model, page_bytes=16 * KIB)
    assert [s.name for s in layout.slots] == [n for n, _ in model.named_parameters()]
    assert sum(s.numel for s in layout.slots) == model.num_params()


def test_tensor_larger_than_a_page_spans_consecutive_pages():
    layout = build_layout(small_gpt(), page_bytes=16 * KIB)
    emb = layout.slot("tok_embeddings.weight")  # 256 x 64 fp32 = 64 KiB = 4 pages
    assert emb.spans_pages
    assert emb.pages == [0, 1, 2, 3]
    assert [s.numel for s in emb.segments] == [4096] * 4
    assert [s.start for s in emb.segments] == [0, 4096, 8192, 12288]


def test_small_tensors_pack_into_one_page_at_aligned_offsets():
    tensors = [("a", torch.zeros(3)), ("b", torch.zeros(5)), ("c", torch.zeros(2))]
    layout = PageLayout.build(tensors, page_bytes=4 * KIB)
    assert [s.segments[0].page for s in layout.slots] == [0, 0, 0]
    assert [s.segments[0].offset for s in layout.slots] == [0, 16, 32]  # 64-byte aligned, in fp32 elements


def test_tensor_that_does_not_fit_the_rest_of_a_page_starts_a_new_one():
    tensors = [("a", torch.zeros(600)), ("b", torch.zeros(600))]  # 2400 bytes each, 4 KiB pages
    layout = PageLayout.build(tensors, page_bytes=4 * KIB)
    assert layout.slot("b").segments[0].page == 1
    assert layout.slot("b").segments[0].offset == 0


def test_each_page_holds_one_dtype():
    tensors = [("w", torch.zeros(10)), ("ids", torch.zeros(10, dtype=torch.int64)), ("v", torch.zeros(10))]
    layout = PageLayout.build(tensors, page_bytes=4 * KIB)
    assert layout.page_dtypes == [torch.float32, torch.int64]
    assert layout.slot("v").segments[0].page == 0


def test_pages_form_groups_of_dp_world_size():
    layout = build_layout(small_gpt(), page_bytes=16 * KIB, dp_world_size=4)
    assert layout.n_pages % 4 == 0
    assert all(len(g) == 4 for g in layout.groups)
    assert [layout.owner(p) for p in layout.groups[1]] == [0, 1, 2, 3]


def test_first_use_order_follows_the_forward_pass():
    model = nn.Sequential()
    model.add_module("second", nn.Linear(4, 4))
    model.add_module("first", nn.Linear(4, 4))

    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner.second(self.inner.first(x))

    order = first_use_order(Reversed(), torch.zeros(1, 4))
    assert order == ["inner.first.weight", "inner.first.bias", "inner.second.weight", "inner.second.bias"]


def test_a_tensor_that_fills_its_last_page_leaves_the_open_page_open():
    # "b" fills pages 1-2 exactly: "c" still fits the rest of page 0, where "a" is
    tensors = [("a", torch.zeros(10)), ("b", torch.zeros(2048)), ("c", torch.zeros(10)), ("d", torch.zeros(1500))]
    layout = PageLayout.build(tensors, page_bytes=4 * KIB)
    assert [s.pages for s in layout.slots] == [[0], [1, 2], [0], [3, 4]]
    assert layout.slot("c").segments[0].offset == 16


@pytest.mark.parametrize("page_kib", [4, 12, 16, 48, 256])
def test_each_moe_expert_is_on_pages_of_its_own(page_kib):
    """However the sizes fall against the page size, no page holds two experts' tensors or an expert's and another
    tensor's (a step that routes an expert no token leaves all of its pages alone), and each expert's tensors come
    one after another."""
    from angel_ptm.units import expert_page_indexes, moe_layers

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=3, n_head=2, dim=48,
                          moe={"experts": 4, "every": 2}))
    layout = build_layout(model, page_bytes=page_kib * KIB)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(moe_layers(model)) == 1
    for layer in moe_layers(model):
        own = expert_page_indexes(layer, model, layout)
        for expert, pages in zip(layer.experts, own):
            slots = [layout.slot(names[id(p)]) for p in expert.parameters()]
            assert {p for s in slots for p in s.pages} == pages  # every page of its tensors holds only them
            order = [s.name for s in layout.slots]
            at = [order.index(s.name) for s in slots]
            assert at == list(range(at[0], at[0] + len(at)))
    assert sum(s.numel for s in layout.slots) == sum(p.numel() for p in model.parameters())
