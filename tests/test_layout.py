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
