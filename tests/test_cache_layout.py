"""Per-layer cache kinds from one page pool: grouping, page bytes, capacity, sliding-window blocks dropped as
decoding moves on (the memory bound), and prefix hits that need only the window."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import save_tiny
from parity import LogitsRecorder, run_and_compare
from resin import LLM
from resin.core.cache_layout import plan_cache_layout
from resin.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, _group_key
from resin.core.request import Request
from resin.core.sampling_params import SamplingParams
from resin.hal import AttentionLayer

pytestmark = pytest.mark.unit


def layers_of(windows, kv_heads=2, head_size=8):
    return [AttentionLayer(4, kv_heads, head_size, 1.0, sliding_window=w) for w in windows]


def test_one_kind_is_one_group_of_every_layer():
    layout = plan_cache_layout(layers_of([None] * 5), 16, torch.float32)
    assert [g.layers for g in layout.groups] == [(0, 1, 2, 3, 4)]
    assert layout.page_bytes == 5 * 2 * 16 * 2 * 8 * 4
    assert layout.pages_for(100, chunk=64) == 7


def test_gemma3_pattern_groups_by_the_rarest_kind():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 22 sliding, 4 full
    layout = plan_cache_layout(layers_of(windows), 16, torch.bfloat16)
    assert [len(g.layers) for g in layout.groups] == [4, 4, 4, 4, 4, 2, 4]
    assert layout.groups[-1].window is None and layout.groups[-1].layers == (5, 11, 17, 23)
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(26))
    assert layout.num_slots == 4 and layout.page_bytes == 4 * 2 * 16 * 2 * 8 * 2
    route = layout.route()
    assert route[5] == (6, 0) and route[24] == (5, 0) and route[25] == (5, 1)
    # a long sequence: the full group grows with it, each sliding group stays at its window's blocks
    window_blocks = layout.window_blocks(512, chunk=256)
    assert window_blocks == (511 + 255) // 16 + 2
    assert layout.pages_for(32768, chunk=256) == 2048 + 6 * window_blocks
    assert layout.capacity_tokens(2048 + 6 * window_blocks, 256, 10**6) == 32768
    lines = layout.describe(layers_of(windows), torch.bfloat16)
    assert lines == ["sliding window 512: 22 layers, 1408 bytes/token, at most 527 tokens kept per sequence",
                     "full attention: 4 layers, 256 bytes/token"]


def test_kinds_with_different_kv_shapes_are_refused_clearly():
    layers = layers_of([8, None]) + [AttentionLayer(4, 1, 8, 1.0)]
    layers[1] = AttentionLayer(4, 1, 16, 1.0)
    with pytest.raises(ValueError, match="different KV shapes"):
        plan_cache_layout(layers, 16, torch.float32)


def run_tokens(kv, req, n):
    """Compute n more tokens of req as the scheduler and engine would: allocate, then record and index them."""
    assert kv.allocate(req, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def make_req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), max_tokens=1)


def test_sliding_blocks_are_dropped_and_a_prefix_hit_needs_only_the_window():
    layout = plan_cache_layout(layers_of([8, None]), 4, torch.float32)
    kv = KVCacheManager(64, 4, True, layout.groups)
    a = make_req("a", range(200, 240))
    assert kv.admit_cached_prefix(a) == 0
    for n in (12, 12, 12, 4):  # chunked prefill of the 40-token prompt
        run_tokens(kv, a, n)
        sliding, full = kv.num_blocks_held(a)
        assert full == -(-a.num_computed_tokens // 4)
        assert sliding <= layout.window_blocks(8, 12)
    # the first decode: queries from token 40 on see keys > 32, so blocks 0..7 (tokens 0..31) are dropped
    assert kv.allocate(a, 1)
    assert a.block_ids[0][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in a.block_ids[0][8:]
    assert NULL_BLOCK not in a.block_ids[1]
    assert kv.pool.num_free == 64 - 22 + 8
    kv.free(a)
    # another request takes the 50 pages that were free before a ended: the 42 never used, then a's 8 dropped
    # sliding blocks (freed before the rest of a, so earlier in the LRU queue); a's other 14 blocks stay cached
    b = make_req("b", range(1000, 1100))
    kv.admit_cached_prefix(b)
    run_tokens(kv, b, 100)
    assert kv.pool.num_free == 14
    c = make_req("c", list(range(200, 240)) + [7])
    hit = kv.admit_cached_prefix(c)
    assert hit == 40  # all 10 blocks: the sliding group only needs blocks 8 and 9 (keys 33..39)
    assert c.block_ids[0][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in c.block_ids[0][8:]
    assert len(c.block_ids[1]) == 10 and NULL_BLOCK not in c.block_ids[1]


def test_a_missing_window_block_shortens_the_hit():
    layout = plan_cache_layout(layers_of([8, None]), 4, torch.float32)
    kv = KVCacheManager(64, 4, True, layout.groups)
    a = make_req("a", range(41))
    kv.admit_cached_prefix(a)
    run_tokens(kv, a, 40)
    kv.pool.reset_prefix_cache()  # forget everything, then index only the full group's blocks and sliding 0..4
    for g, held in enumerate(a.block_ids):
        for i, block in enumerate(held[:10]):
            if block != NULL_BLOCK and (g == 1 or i < 5):
                kv.pool.cache(block, _group_key(a.block_hashes[i], g))
    kv.free(a)
    c = make_req("c", list(range(41)))
    # hits of 10..6 blocks need sliding blocks >= 5 (window 8 = two blocks back); 5 blocks need 3 and 4: cached
    assert kv.admit_cached_prefix(c) == 20


def test_sliding_window_memory_stays_bounded_far_past_the_window(tmp_path):
    """Gemma 2 (window 12, blocks of 16) generating 260 tokens: logits equal transformers' at every step, the
    sliding group never holds more than its window's blocks, the full group holds the whole sequence."""
    hf = save_tiny(tmp_path, "Gemma2ForCausalLM", seed=4, max_position_embeddings=512)
    rec = LogitsRecorder()
    llm = LLM(str(tmp_path), dtype="float32", logits_observer=rec, kv_cache_memory="2MiB",
              max_num_batched_tokens=32)
    engine = llm.engine
    held: list[list[int]] = []
    observer = engine.logits_observer

    def watch(reqs, logits):
        observer(reqs, logits)
        held.extend(engine.kv.num_blocks_held(r) for r in reqs)
    engine.logits_observer = watch
    prompt = [random.randrange(211) for _ in range(40)]
    run_and_compare(llm, rec, hf, [prompt], max_tokens=260)
    bound = engine.layout.window_blocks(12, 32)
    assert max(s for s, _ in held) <= bound == 4
    assert held[-1] == [2, -(-299 // 16)]  # 12 keys before the last token span two blocks here
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # everything back after the request


@pytest.mark.parametrize("backend", ["native", "cpu"])
def test_copy_blocks_copies_whole_pages_in_the_backends_layout(backend):
    """A fork's partial block is copied page by page in whatever layout the backend keeps (head-major on cpu)."""
    from resin.backends.cpu.attention import CpuAttention
    from resin.hal.attention import NativeAttention

    cls = CpuAttention if backend == "cpu" else NativeAttention
    layers = layers_of([None])
    attn = cls(layers, 4, torch.float32, torch.device("cpu"))
    cache = torch.randn(cls.kv_cache_shape(6, 4, 2, 8))
    before = cache.clone()
    attn.copy_blocks(cache, torch.tensor([1, 4]), torch.tensor([5, 0]))
    axis = 2 if backend == "cpu" else 1
    page = lambda t, i: t.select(axis, i)  # noqa: E731
    assert torch.equal(page(cache, 5), page(before, 1)) and torch.equal(page(cache, 0), page(before, 4))
    for i in (1, 2, 3, 4):
        assert torch.equal(page(cache, i), page(before, i))
