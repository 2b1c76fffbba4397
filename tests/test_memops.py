import pytest
import torch

from angel_ptm.memory import memops


@pytest.mark.parametrize("numel", [7, 1 << 15, (1 << 20) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_zero_and_copy_give_torchs_bytes_on_every_path(numel, dtype):
    """Large contiguous CPU buffers go through libc (memset, memmove), the rest through torch: the bytes are
    torch's either way, a slice of a larger buffer included (its neighbours untouched)."""
    backing = torch.arange(numel + 10).to(dtype)
    middle = backing[5: 5 + numel]
    assert memops.zero_(middle) is middle
    assert torch.equal(backing[5: 5 + numel], torch.zeros(numel, dtype=dtype))
    assert torch.equal(backing[:5], torch.arange(5).to(dtype))
    assert torch.equal(backing[-5:], torch.arange(numel + 5, numel + 10).to(dtype))
    source = torch.randn(numel).to(dtype)
    assert memops.copy_(middle, source) is middle
    assert torch.equal(middle, source) and torch.equal(backing[:5], torch.arange(5).to(dtype))


def test_copy_converts_and_strides_as_torch_does():
    """A dtype change, a shape that broadcasts or a strided view is torch's copy_ (converted, broadcast)."""
    dst = torch.empty(1 << 16)
    memops.copy_(dst, torch.ones(1 << 16, dtype=torch.float64))
    assert torch.equal(dst, torch.ones(1 << 16))
    memops.copy_(dst, torch.tensor(2.0))
    assert torch.equal(dst, torch.full((1 << 16,), 2.0))
    grid = torch.zeros(512, 512)
    memops.zero_(grid.t())
    memops.copy_(grid.t(), torch.arange(512.0).expand(512, 512))
    assert torch.equal(grid, torch.arange(512.0).expand(512, 512).t())
    assert memops._direct(grid.t()) == 0 and memops._direct(grid) == 512 * 512 * 4
