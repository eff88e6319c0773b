"""Block-scale fp8 (DeepSeek-V3's `weight_block_size` / `weight_scale_inv` format): the native GEMM against a float64
reference, the Triton kernels against native (interpreted), and a tiny DeepSeek-V3 checkpoint written here in that
layout: every weight Resin holds dequantises to what transformers' own loader makes of the file, MoE experts and
MLA's absorbed kv_b_proj included; the fnuz conversion keeps them; and the model's greedy tokens follow the
dequantised model's."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import KERNEL_DEVICE, save_tiny
from parity import quantised_greedy_agreement
from resin import hal
from resin.hal.fp8 import expand_block_scales, quantize_fp8_groups
from resin.models.block_fp8 import BlockFp8Linear
from resin.models.fp8 import parse_quant_config
from resin.models.loader import load_model

FN = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as a block-fp8 checkpoint stores it: fp8 e4m3fn and one amax / 448 scale per tile."""
    n, k = w.shape
    nb, kb = -(-n // block[0]), -(-k // block[1])
    tiles = torch.nn.functional.pad(w.float(), (0, kb * block[1] - k, 0, nb * block[0] - n))
    tiles = tiles.view(nb, block[0], kb, block[1])
    scale = tiles.abs().amax((1, 3)).clamp_min(1e-12) / torch.finfo(FN).max
    q = (tiles / scale[:, None, :, None]).view(nb * block[0], kb * block[1])[:n, :k].to(FN)
    return q, scale


@pytest.mark.kernels
@pytest.mark.parametrize("m,n,k,block", [(1, 48, 64, (16, 32)), (7, 50, 70, (16, 32)), (5, 256, 384, (128, 128)),
                                         (3, 40, 96, (32, 16))])
def test_block_fp8_linear_matches_float64(m, n, k, block):
    """Ragged tiles at the right and bottom edges, square and non-square blocks; the result is the exact w8a8 math
    (activations quantised per token per block width) to fp32 accumulation."""
    x, w, bias = torch.randn(m, k) * 3, torch.randn(n, k), torch.randn(n)
    wq, ws = quantize_blocks(w, block)
    got = hal.BLOCK_FP8_LINEAR.native(x, wq, ws, block, bias)
    xq, xs = quantize_fp8_groups(x, FN, block[1])
    x64 = xq.double() * xs.double().repeat_interleave(block[1], 1)[:, :k]
    w64 = wq.double() * expand_block_scales(ws, block, (n, k)).double()
    ref = x64 @ w64.T + bias.double()
    bound = k * 1.2e-7 * (x64.abs() @ w64.abs().T).max().item()
    assert (got.double() - ref).abs().max().item() <= 4 * bound + 1e-6
    # the activation scales are per token per group: each group's largest value lands on the fp8 maximum
    groups = torch.nn.functional.pad(x, (0, xs.shape[1] * block[1] - k)).view(m, -1, block[1])
    torch.testing.assert_close(xs, groups.abs().amax(-1) / torch.finfo(FN).max)


@pytest.mark.kernels
@pytest.mark.parametrize("m,n,k,block", [(1, 48, 64, (16, 32)), (9, 50, 96, (16, 32)), (4, 130, 256, (128, 128))])
def test_triton_block_fp8_linear_matches_native(m, n, k, block):
    from resin.backends.triton import block_fp8

    torch.set_default_device(KERNEL_DEVICE)
    try:
        x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        wq, ws = quantize_blocks(w, block)
        q, s = block_fp8.quantize_fp8_groups(x, FN, block[1])
        ref_q, ref_s = quantize_fp8_groups(x, FN, block[1])
        assert torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s)
        assert block_fp8.block_fp8_linear_supports_args(x, wq, ws, block) is None
        got = block_fp8.block_fp8_linear(x, wq, ws, block, bias)
        torch.testing.assert_close(got, hal.BLOCK_FP8_LINEAR.native(x, wq, ws, block, bias), rtol=1e-5, atol=1e-4)
        assert "power of two" in block_fp8.block_fp8_linear_supports_args(x, wq, ws, (16, 24))
    finally:
        torch.set_default_device(None)


# every tiny weight divides into whole 8x8 tiles: transformers' dequantiser infers the block from the scale grid
# (ragged edge tiles are checked against float64 above, the DeepSeek-reference way: ceil-divided grids)
BLOCK = (8, 8)


def _block_fp8_checkpoint(folder) -> dict[str, torch.Tensor]:
    """Rewrite a tiny checkpoint as DeepSeek-V3's fp8 release is laid out: every projection (attention, dense and
    shared MLPs, each routed expert, kv_b_proj) fp8 with `weight_scale_inv`; routers, norms, embeddings and the
    lm_head as they were. Returns each quantised weight dequantised."""
    tensors = load_file(folder / "model.safetensors")
    out, dequant = {}, {}
    for name, t in tensors.items():
        if "_proj" in name and name.endswith(".weight") and t.dim() == 2:
            q, s = quantize_blocks(t, BLOCK)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, s
            dequant[name] = q.float() * expand_block_scales(s, BLOCK, tuple(t.shape))
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (folder / "config.json").write_text(json.dumps(config))
    return dequant


@pytest.mark.parity
def test_deepseek_v3_block_fp8_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny(tmp_path, "DeepseekV3ForCausalLM", seed=4)
    dequant = _block_fp8_checkpoint(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # dequantised on the cpu
    ref = hf.state_dict()
    for name, w in dequant.items():  # transformers' reading of the file is ours
        if ".experts." not in name:
            assert torch.equal(ref[name], w), name

    for fp8_dtype in (None, FNUZ):  # gfx942: e4m3fnuz bits, doubled scales, the same weights
        model = load_model(tmp_path, torch.float32, torch.device("cpu"), fp8_dtype=fp8_dtype).model
        layer = model.model.layers[1]
        qkv_a = layer.self_attn.qkv_a_proj
        assert isinstance(qkv_a, BlockFp8Linear) and qkv_a.weight.dtype == (fp8_dtype or FN)
        got = qkv_a.weight.float() * expand_block_scales(qkv_a.weight_scale_inv, BLOCK, tuple(qkv_a.weight.shape))
        assert torch.equal(got, torch.cat([ref[f"model.layers.1.self_attn.{p}.weight"]
                                           for p in ("q_a_proj", "kv_a_proj_with_mqa")]))
        assert torch.equal(layer.self_attn.kv_b_proj.weight, ref["model.layers.1.self_attn.kv_b_proj.weight"])
        experts = layer.mlp.experts
        e13 = torch.stack([w.float() * expand_block_scales(s, BLOCK, tuple(w.shape))
                           for w, s in zip(experts.w13, experts.w13_scale)])
        e2 = torch.stack([w.float() * expand_block_scales(s, BLOCK, tuple(w.shape))
                          for w, s in zip(experts.w2, experts.w2_scale)])
        assert torch.equal(e13, ref["model.layers.1.mlp.experts.gate_up_proj"])
        assert torch.equal(e2, ref["model.layers.1.mlp.experts.down_proj"])
        assert experts.gate.weight.dtype == torch.float32  # the router stays unquantised

    # end to end: greedy tokens of the w8a8 model follow the dequantised model's, as for per-tensor fp8
    agree = quantised_greedy_agreement(tmp_path, hf)
    assert agree >= 0.75, f"block-fp8 greedy tokens agree with the dequantised model on {agree:.0%} of steps"


@pytest.mark.unit
def test_block_config_is_read_and_misfits_are_named():
    cfg = parse_quant_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                      "weight_block_size": [128, 128]}})
    assert cfg.block == (128, 128) and not cfg.static_input
    with pytest.raises(ValueError, match="dynamic per-token-group"):
        parse_quant_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                                    "weight_block_size": [128, 128]}})
    from resin.models.layers import MergedLinear

    with pytest.raises(ValueError, match="block boundaries"):  # a fused shard that does not fill whole blocks
        BlockFp8Linear(MergedLinear(64, [24, 40], ["a", "b"]), (16, 16))
