from hypothesis import given, settings
from hypothesis import strategies as st

from angel_ptm.memory import BeladyPolicy, LRUPolicy, count_misses
from angel_ptm.memory.policy import RestingSet

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


@settings(max_examples=120, deadline=None)
@given(future=st.lists(st.integers(0, 9), max_size=40),
       ops=st.lists(st.tuples(st.sampled_from(["access", "seek", "join", "leave", "victim", "plain"]),
                              st.integers(0, 60), st.sampled_from(["device", "host"]), st.booleans()),
                    max_size=80))
def test_belady_reading_the_managers_live_resting_sets_picks_what_a_fresh_scan_picks(future, ops):
    """Given the manager's live candidate sets (RestingSet: the index reads only the pages that joined since its
    last choice), with pages joining and leaving between choices, accesses, seeks back and forth, an excluded page
    and now and then a plain collection for the same group, the victim is the one a scan from scratch names."""
    policy = BeladyPolicy(future)
    sets = {"device": RestingSet(), "host": RestingSet(range(3))}
    for op, number, group, flag in ops:
        live = sets[group]
        if op == "access":
            policy.on_access(number % 10)
        elif op == "seek":
            policy.seek(number)
        elif op == "join":
            live.add(number % 10)
        elif op == "leave":
            live.discard(number % 10)
        elif live:
            exclude = number % 10 if flag else None
            choices = sorted(pid for pid in live if pid != exclude)
            if not choices:
                continue
            given_set = sorted(live) if op == "plain" else live
            expected = _farthest(future, choices, policy._now, policy.history._last_use)
            assert policy.victim(given_set, group, exclude=exclude) == expected


def test_lru_and_belady_never_pick_the_excluded_page():
    assert LRUPolicy().victim([3, 4], exclude=3) == 4
    belady = BeladyPolicy([1, 2])
    assert belady.victim(RestingSet([1, 2]), "device", exclude=2) == 1
    assert belady.victim(RestingSet([1, 2]), "device") == 2  # (another live set for the group: compared in full)


def test_belady_on_a_live_set_rekeys_a_page_accessed_while_it_rested():
    """A page used (or passed over by the clock) while it stays a candidate gets a fresh key: no join tells the
    index, its own rekey does."""
    belady = BeladyPolicy([1, 2, 1, 3, 3, 2])
    live = RestingSet([1, 2])
    assert belady.victim(live, "host") == 2  # next uses: 1 at 0, 2 at 1
    belady.on_access(1)
    assert belady.victim(live, "host") == 1  # now 1 at 2, 2 at 1
    belady.seek(4)  # the clock passes 2's use at 1 unused... and 1's at 2
    assert belady.victim(live, "host") == 1  # 1 never again, 2 at 5


def test_belady_on_live_sets_keeps_its_index_bounded_over_many_steps():
    """Steps of accesses, evictions and seeks back to the start (no full rebuild any more) leave the index's heaps
    a bounded size: stale entries are dropped once they outnumber the live ones, and the choices stay a scan's."""
    future = [i % 50 for i in range(0, 400, 3)]
    policy = BeladyPolicy(future)
    live = RestingSet(range(50))
    for _ in range(200):
        policy.seek(0)
        for position, pid in enumerate(future):
            live.discard(pid)  # pinned while used
            policy.on_access(pid)
            live.add(pid)
            if position % 3 == 0:
                assert policy.victim(live, "host") == _farthest(future, sorted(live), policy._now,
                                                                policy.history._last_use)
    assert len(policy._heaps["host"]) + len(policy._expiry["host"]) <= 4 * 50 + 1024 + 50


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["access", "join", "leave", "victim", "plain", "belady"]),
                              st.integers(0, 60), st.sampled_from(["device", "host"]), st.booleans()),
                    max_size=100))
def test_lru_reading_the_managers_live_resting_sets_picks_the_least_recently_used(ops):
    """LRU's index over the manager's live sets (the pages that joined since its last choice; accesses while a
    page rests; an excluded page; a plain collection now and then; a Belady policy reading the same sets between
    its choices, as after a plan) names the page a scan names: the least recently used, then the lowest id."""
    lru, belady = LRUPolicy(), BeladyPolicy(list(range(10)) * 3)
    sets = {"device": RestingSet(), "host": RestingSet(range(3))}
    for op, number, group, flag in ops:
        live = sets[group]
        if op == "access":
            lru.on_access(number % 10)
        elif op == "join":
            live.add(number % 10)
        elif op == "leave":
            live.discard(number % 10)
        elif op == "belady" and live:
            belady.victim(live, group)
        elif live and op in ("victim", "plain"):
            exclude = number % 10 if flag else None
            choices = [pid for pid in live if pid != exclude]
            if not choices:
                continue
            expected = min(choices, key=lambda pid: (lru._last_use.get(pid, 0), pid))
            assert lru.victim(sorted(live) if op == "plain" else live, group, exclude=exclude) == expected
