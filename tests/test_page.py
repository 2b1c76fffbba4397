import pytest
import torch

from angel_ptm.errors import PageStateError
from angel_ptm.memory import TRANSITIONS, Page, PageState

ALL_PAIRS = [(a, b) for a in PageState for b in PageState]
LEGAL = [(a, b) for a, b in ALL_PAIRS if b in TRANSITIONS[a]]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if b not in TRANSITIONS[a]]


def make_page(state):
    return Page(id=0, kind="param", index=3, dtype=torch.float32, nbytes=4096, state=state)


def test_transition_table_has_the_documented_edges():
    assert len(LEGAL) == 18
    assert TRANSITIONS[PageState.DISK] == {PageState.FROM_DISK}
    # ZeRO: another rank's page is filled by a gather onto the device or host, and dropped back (never to disk)
    assert TRANSITIONS[PageState.REMOTE] == {PageState.DEVICE, PageState.HOST}
    assert [a for a, b in LEGAL if b is PageState.REMOTE] == [PageState.DEVICE, PageState.HOST]


@pytest.mark.parametrize("src,dst", LEGAL, ids=[f"{a.name}->{b.name}" for a, b in LEGAL])
def test_every_legal_transition_works(src, dst):
    page = make_page(src)
    page.transition(dst)
    assert page.state is dst


@pytest.mark.parametrize("src,dst", ILLEGAL, ids=[f"{a.name}->{b.name}" for a, b in ILLEGAL])
def test_every_illegal_transition_raises(src, dst):
    page = make_page(src)
    with pytest.raises(PageStateError, match=f"page param:3: illegal transition {src.name} -> {dst.name}"):
        page.transition(dst)
    assert page.state is src


def test_dirty_page_is_no_longer_clean_on_disk():
    page = make_page(PageState.HOST)
    page.disk_slot, page.disk_version = 0, page.version
    assert page.clean_on_disk
    page.mark_dirty()
    assert not page.clean_on_disk


def test_view_of_a_page_on_disk_raises():
    with pytest.raises(PageStateError, match="no readable buffer"):
        make_page(PageState.DISK).view()
