from hypothesis import given, settings
from hypothesis import strategies as st

from angel_ptm.memory import BeladyPolicy, LRUPolicy, count_misses

# The reference string of the operating-systems textbooks (Silberschatz et al.), 3 frames.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def test_lru_misses_the_textbook_twelve_times():
    assert count_misses(LRUPolicy(), TEXTBOOK, capacity=3) == 12


def test_belady_misses_the_textbook_nine_times():
    assert count_misses(BeladyPolicy(TEXTBOOK), TEXTBOOK, capacity=3) == 9


def test_lru_picks_the_least_recently_used_page():
    lru = LRUPolicy()
    for page in [7, 0, 1]:
        lru.on_access(page)
    assert lru.victim([0, 1, 7]) == 7  # first replacement of the textbook run: 2 replaces 7


def test_belady_picks_the_page_used_farthest_in_the_future():
    belady = BeladyPolicy(TEXTBOOK)
    for page in [7, 0, 1]:
        belady.on_access(page)
    # Next uses after position 3: 0 at 4, 1 at 13, 7 at 17 -> evict 7.
    assert belady.victim([0, 1, 7]) == 7
    for page in [2, 0]:
        belady.on_access(page)
    # At position 5 (page 3 misses): 0 at 6, 1 at 13, 2 at 8 -> evict 1.
    assert belady.victim([0, 1, 2]) == 1


def test_belady_counts_accesses_that_deviate_from_the_known_sequence():
    belady = BeladyPolicy([1, 2, 3])
    for page in [1, 5, 3]:
        belady.on_access(page)
    assert belady.deviations == 1


@settings(max_examples=200, deadline=None)
@given(sequence=st.lists(st.integers(0, 12), min_size=1, max_size=80), capacity=st.integers(1, 6))
def test_belady_never_misses_more_than_lru(sequence, capacity):
    assert count_misses(BeladyPolicy(sequence), sequence, capacity) <= count_misses(LRUPolicy(), sequence, capacity)


def _farthest(future, candidates, now: int, last_use: dict) -> int:
    """Belady's choice computed from scratch: farthest next use at `now`, then least recently used, then lowest id."""
    def key(pid):
        later = [i for i, p in enumerate(future) if p == pid and i >= now]
        return (later[0] if later else float("inf"), -last_use.get(pid, 0), -pid)
    return max(candidates, key=key)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=40),
       st.lists(st.tuples(st.sampled_from(["access", "seek", "victim"]), st.integers(0, 60),
                          st.sets(st.integers(0, 9), min_size=1), st.sampled_from([None, "device", "host"])),
                max_size=60))
def test_belady_keeps_next_uses_between_evictions_and_still_picks_what_a_fresh_scan_picks(future, ops):
    """The victim's index (a heap per group of candidates, each entry valid until its page is used or the clock
    passes its next use) names, whatever the accesses, seeks forward and back and candidate sets coming and going
    in each group, the page a scan from scratch names."""
    policy = BeladyPolicy(future)
    for op, number, candidates, group in ops:
        if op == "access":
            policy.on_access(number % 10)
        elif op == "seek":
            policy.seek(number)
        else:
            pool = sorted(candidates)
            assert policy.victim(pool, group) == _farthest(future, pool, policy._now, policy.history._last_use)
