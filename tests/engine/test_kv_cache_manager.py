"""Block pool bookkeeping and stop-string matching, in isolation (torch-free)."""

from __future__ import annotations

from model.engine.kv_cache_manager import KVCacheManager
from model.engine.request import Request, Sequence
from model.text.stop_strings import StopStringMatcher


def _seq(tokens, sid=0):
    req = Request(str(sid), list(tokens), params=None)
    return Sequence(sid, req, 0, req.prompt_token_ids)


def _compute(kv, seq, n):
    assert kv.allocate(seq, n)
    seq.num_computed_tokens += n
    kv.commit(seq)


def test_shared_prefix_is_reference_counted_and_lru_evicted():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _seq(range(10), 0)  # blocks: [0..3] [4..7] [8, 9]
    assert kv.attach_cached_prefix(a) == 0
    _compute(kv, a, 10)
    assert len(a.block_ids) == 3 and kv.num_free_blocks == 3
    b = _seq(list(range(8)) + [99], 1)  # shares a's two full blocks
    assert kv.attach_cached_prefix(b) == 8 and b.block_ids == a.block_ids[:2]
    assert [kv.pool.ref_count[i] for i in a.block_ids[:2]] == [2, 2]
    _compute(kv, b, 1)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 6 and all(c == 0 for c in kv.pool.ref_count)
    # the freed-but-cached prefix is still found...
    c = _seq(list(range(8)) + [7, 7, 7], 2)
    assert kv.attach_cached_prefix(c) == 8
    kv.free(c)
    # ...until enough new blocks are needed that it is evicted (tail block of the prefix first)
    d = _seq([50 + i for i in range(20)], 3)
    kv.attach_cached_prefix(d)
    assert kv.allocate(d, 20) and kv.num_free_blocks == 1
    e = _seq(list(range(8)) + [1], 4)
    assert kv.attach_cached_prefix(e) == 4  # block [0..3] survived, [4..7] was evicted


def test_fully_cached_prompt_recomputes_its_last_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _seq(range(8), 0)
    kv.attach_cached_prefix(a)
    _compute(kv, a, 8)
    b = _seq(range(8), 1)
    assert kv.attach_cached_prefix(b) == 4  # never 8: the last position's logits must be computed


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = _seq(range(20), 0)
    kv.attach_cached_prefix(a)
    assert not kv.allocate(a, 20) and a.block_ids == [] and kv.num_free_blocks == 3
    assert kv.allocate(a, 12) and kv.num_free_blocks == 0


def test_stop_string_matcher_holds_back_only_possible_starts():
    m = StopStringMatcher(["</s>", "STOP"])
    assert m.feed("Hello <") == ("Hello ", None)  # "<" may start "</s>"
    assert m.feed("b>") == ("<b>", None)  # it did not
    assert m.feed(" S") == (" ", None)
    assert m.feed("TO") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    m = StopStringMatcher(["ab"])
    assert m.feed("xa") == ("x", None)
    assert m.flush() == "a"  # generation ended for another reason: the held text was not a stop
    m = StopStringMatcher(["aab"])
    assert m.feed("aaa") == ("a", None) and m.feed("b!") == ("", "aab")  # "aaab!" stops after "a"
