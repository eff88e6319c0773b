"""Tensor parallelism over quantised weights: fp8 (static and block scales), MXFP4 experts, int8 rows and packed
GGUF blocks split over two real ranks (gloo) equal one rank."""
from __future__ import annotations

import pytest
import torch

from conftest import save_tiny
from tp_utils import PROMPTS, greedy_tp2_equals_tp1, run_tp
from resin import LLM, SamplingParams
from resin.hal import ParallelGroup, set_parallel
from resin.models.loader import load_model

pytestmark = pytest.mark.distributed
if torch.cuda.is_available() and torch.cuda.device_count() < 2:
    pytest.skip(f"requires 2 GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)


def _rank_modules(path):
    """(rank, name, module, the whole model's module of that name) for every module of each of two ranks' models,
    loaded as that rank of a group of two would load them (the split needs only rank and world, no group)."""
    whole = load_model(path, torch.float32, torch.device("cpu")).model
    for rank in range(2):
        set_parallel(ParallelGroup(rank=rank, world=2))
        try:
            mine = load_model(path, torch.float32, torch.device("cpu")).model
        finally:
            set_parallel(ParallelGroup())
        for name, m in mine.named_modules():
            yield rank, name, m, whole.get_submodule(name)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_mxfp4_experts_split_after_dequantising(ep, tmp_path):
    from test_gpt_oss import write_mxfp4_checkpoint

    write_mxfp4_checkpoint(tmp_path)
    ref, ref_rec, _ = run_tp(tmp_path, 1)
    got, rec, _ = run_tp(tmp_path, 2, ep)
    for a, b in zip(ref, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (rec.of(b.request_id) - ref_rec.of(a.request_id)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_fp8_weights_and_scales_split_together(per_channel, tmp_path):
    """Static input scales: each rank computes exactly what one rank would for its rows, so TP=2 equals TP=1."""
    from test_fp8 import _quantize_checkpoint

    save_tiny(tmp_path, "Qwen3ForCausalLM", seed=5, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
              hidden_size=72)
    _quantize_checkpoint(tmp_path, per_channel, static=True)
    ref, ref_rec, (ref_bytes,) = run_tp(tmp_path, 1)
    got, rec, rank_bytes = run_tp(tmp_path, 2)
    for a, b in zip(ref, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (rec.of(b.request_id) - ref_rec.of(a.request_id)).abs().max().item() <= 1e-4
    assert max(rank_bytes) < 0.65 * ref_bytes


def test_block_fp8_weights_and_scales_split_on_block_boundaries(tmp_path):
    """DeepSeek-V3 in block-scale fp8: each rank's weights, read with only its scale blocks, dequantise to exactly
    its slice of the whole model's (q/k/v-style shards, row-split columns, experts by intermediate size,
    kv_b_proj); and two real ranks generate TP=1's greedy tokens. Logits are not held to 1e-4 here as for
    unquantised and static-scale models: activations are quantised per token at run time, and the all-reduce's
    summation order moves an activation across an fp8 rounding step now and then (a few percent of a logit)."""
    from test_block_fp8 import _block_fp8_checkpoint

    from resin.hal.fp8 import expand_block_scales
    from resin.models.block_fp8 import BlockFp8Linear, DequantizedWeight
    from resin.models.moe import SparseMoe

    save_tiny(tmp_path, "DeepseekV3ForCausalLM", seed=6)
    _block_fp8_checkpoint(tmp_path)

    def dense(w, scale, block):
        return w.float() * expand_block_scales(scale, block, tuple(w.shape))

    checked = 0
    for _, name, m, ref in _rank_modules(tmp_path):
        if isinstance(m, BlockFp8Linear):
            full = dense(ref.weight, ref.weight_scale_inv, ref.block)
            if m.in_part is not None:
                want = full[:, m.in_part[0]:sum(m.in_part)]
            else:
                want = torch.cat([full[ref.offsets[s][0] + start:ref.offsets[s][0] + start + size]
                                  for s, (start, size) in m.parts.items()])
            assert torch.equal(dense(m.weight, m.weight_scale_inv, m.block), want), name
        elif isinstance(m, DequantizedWeight):
            assert torch.equal(m.weight, ref.weight[m.part[0]:sum(m.part)]), name
        elif isinstance(m, SparseMoe):
            start, size = m.inter_part
            inter = ref.w13.shape[1] // 2
            for e in range(m.w13.shape[0]):
                w13, w2 = dense(ref.w13[e], ref.w13_scale[e], ref.block), dense(ref.w2[e], ref.w2_scale[e],
                                                                                 ref.block)
                want13 = torch.cat((w13[start:start + size], w13[inter + start:inter + start + size]))
                assert torch.equal(dense(m.w13[e], m.w13_scale[e], m.block), want13), name
                assert torch.equal(dense(m.w2[e], m.w2_scale[e], m.block), w2[:, start:start + size]), name
        else:
            continue
        checked += 1
    assert checked > 20
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=tp)
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
        llm.shutdown()
    assert outs[1] == outs[2]


def test_int8_rows_split_with_whole_row_scales(tmp_path):
    """--quantization int8: a row-split layer's scale is the max over the whole row (all ranks), so the rounding
    equals one rank's and TP=2 equals TP=1."""
    save_tiny(tmp_path, "LlamaForCausalLM", seed=3)
    greedy_tp2_equals_tp1(tmp_path, quantization="int8")


def test_packed_gguf_split_over_ranks(tmp_path):
    """GGUF weights stay packed under TP: each rank's packed layers unpack to exactly its slice of the whole
    model's (column-split rows of each shard, vocabulary rows of the embedding and lm_head, whole blocks of a
    row-split layer's columns); a row split that cuts through blocks (o_proj: 128 columns a rank of Q5_K's 256-wide
    blocks) is dequantised on load instead. Two real ranks then give TP=1's greedy tokens, logits within 1e-4."""
    from test_gguf_packed import _tiny, write_packed_gguf

    from resin.hal.quant import dequantize
    from resin.models.layers import RowLinear
    from resin.models.quantized import QuantEmbedding, QuantLinear

    path = tmp_path / "model.gguf"
    write_packed_gguf(path, _tiny("LlamaForCausalLM", False), "LlamaForCausalLM")

    def unpack(m: QuantLinear) -> torch.Tensor:
        return torch.cat([dequantize(m._segment(m.weight, i), seg.qtype) for i, seg in enumerate(m.segments)])

    def shard_rows(m: QuantLinear) -> dict:  # shard -> its first row in the layer (shards stacked in order)
        firsts, first = {}, 0
        for shard, (_, size) in m.parts.items():
            firsts[shard], first = first, first + size
        return firsts

    kinds: dict[str, int] = {}
    packed_bytes: dict = {}
    for rank, name, m, ref in _rank_modules(path):
        if isinstance(m, QuantLinear):
            full, local = unpack(ref), unpack(m)
            if m.in_part is not None:
                kind, want = "row-split", full[:, m.in_part[0]:sum(m.in_part)]
            elif m.parts is not None:
                kind, starts = "column-split", shard_rows(ref)
                want = torch.cat([full[starts[s] + start:starts[s] + start + size]
                                  for s, (start, size) in m.parts.items()])
            else:
                kind, want = "vocabulary", full[m.vocab_part[0]:sum(m.vocab_part)]
        elif isinstance(m, QuantEmbedding):
            kind, local = "embedding", dequantize(m.weight, m.qtype)
            want = dequantize(ref.weight, ref.qtype)[m.part[0]:sum(m.part)]
        elif isinstance(m, RowLinear) and name.endswith("o_proj"):
            kind, local, want = "dequantised row split", m.weight, unpack(ref)[:, m.in_part[0]:sum(m.in_part)]
        else:
            continue
        assert torch.equal(local, want), name
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind != "dequantised row split":
            packed_bytes[rank] = packed_bytes.get(rank, 0) + m.weight.numel()
            packed_bytes["whole"] = packed_bytes.get("whole", 0) + ref.weight.numel() * (rank == 0)
    assert set(kinds) == {"row-split", "column-split", "vocabulary", "embedding", "dequantised row split"}, kinds
    assert packed_bytes[0] == packed_bytes[1] == packed_bytes["whole"] / 2  # half of every packed layer a rank
    weight_bytes = greedy_tp2_equals_tp1(path)
    assert max(weight_bytes[2]) < weight_bytes[1][0]  # less than the whole though o_proj is fp32 on both ranks
