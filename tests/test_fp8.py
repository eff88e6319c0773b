"""fp8 w8a8 on the cpu: the e4m3fn -> e4m3fnuz conversion, the fp8_linear op against a float64 reference, and
fp8 checkpoints (compressed-tensors layout, per-tensor and per-channel scales, static and dynamic activations)
loading and running end to end."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import save_tiny
from parity import quantised_greedy_agreement
from resin import hal
from resin.hal.fp8 import FP8_DTYPES
from resin.models.fp8 import Fp8Linear, parse_quant_config
from resin.models.loader import load_model

pytestmark = pytest.mark.unit

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def test_fn_to_fnuz_reinterprets_bits_and_doubles_scales():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    fn = bits.view(FN)
    finite = ~torch.isnan(fn.float())
    scale, in_scale = torch.tensor([0.37]), torch.tensor([1.5])
    fnuz, scale2, in_scale2 = hal.e4m3fn_to_e4m3fnuz(fn, scale, in_scale)
    assert fnuz.dtype == FNUZ
    same = bits != -128
    assert torch.equal(fnuz.view(torch.int8)[same], bits[same])  # bits unchanged ...
    assert fnuz.view(torch.int8)[bits == -128].item() == 0  # ... except -0.0 (fnuz's NaN), which becomes 0
    assert torch.allclose(scale2, scale * 2) and torch.allclose(in_scale2, in_scale * 2)
    # every finite fn value times its scale equals the fnuz value times the doubled scale, exactly
    ok = finite & same
    assert torch.equal((fn.float() * scale)[ok], (fnuz.float() * scale2)[ok])


def _fp8_reference(x, wq, w_scale, in_scale, bias):
    """float64: quantise x to wq's flavour as the op defines it (round to nearest even, clamp to the max), then
    exact products."""
    fmax = torch.finfo(wq.dtype).max
    x64 = x.double()
    xs = (x64.abs().amax(-1, keepdim=True) / fmax).clamp_min(1e-12) if in_scale is None else in_scale.double()
    xq = (x64 / xs).clamp(-fmax, fmax).to(wq.dtype).double()  # fp8 has 3 mantissa bits: exact in float64
    out = (xq @ wq.double().T) * xs * w_scale.double().reshape(1, -1)
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static_input", [False, True])
@pytest.mark.parametrize("shape", [(1, 32, 16), (9, 80, 33)])
def test_fp8_linear_matches_float64(fp8_dtype, per_channel, static_input, shape):
    m, k, n = shape
    fmax = torch.finfo(fp8_dtype).max
    x, w, bias = torch.randn(m, k) * 2, torch.randn(n, k), torch.randn(n)
    w_scale = w.abs().amax(1) / fmax if per_channel else (w.abs().max() / fmax).reshape(1)
    wq = (w / w_scale.reshape(-1, 1)).to(fp8_dtype)
    in_scale = (x.abs().max() / fmax).reshape(1) if static_input else None
    got = hal.FP8_LINEAR.native(x, wq, w_scale, in_scale, bias)
    ref = _fp8_reference(x, wq, w_scale, in_scale, bias)
    # fp32 accumulation of k exact products: error bounded by k * eps32 * sum|terms|
    bound = k * 1.2e-7 * ((x.abs().double() / 1) @ (wq.double().abs().T * w_scale.double().reshape(1, -1))).max()
    assert (got.double() - ref).abs().max().item() <= 4 * bound.item() + 1e-6
    # and the quantisation itself is what it should be: e4m3 keeps 3 mantissa bits, so each factor is within
    # 2^-4 relative (plus a tiny absolute error in the subnormal range) and each product within (1 + 2^-4)^2 - 1
    exact = x.double() @ w.double().T + bias.double()
    rel = (1 + 2 ** -4) ** 2 - 1
    assert ((ref - exact).abs() <= rel * (x.double().abs() @ w.double().abs().T) + 1e-3).all()


def _quantize_checkpoint(folder, per_channel: bool, static: bool) -> dict[str, torch.Tensor]:
    """Turn a tiny fp32 checkpoint into a compressed-tensors FP8 one in place; returns the dequantised weights."""
    from safetensors.torch import load_file

    files = list(folder.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
        f.unlink()
    fmax = torch.finfo(FN).max
    out, dequant = {}, {}
    for name, t in tensors.items():
        proj = name.rsplit(".", 1)[0]
        if name.endswith("proj.weight"):
            scale = t.abs().amax(1, keepdim=True) / fmax if per_channel else (t.abs().max() / fmax).reshape(1)
            q = (t / scale).to(FN)
            out[name], out[f"{proj}.weight_scale"] = q, scale
            if static:
                out[f"{proj}.input_scale"] = torch.rand(1) * 0.02 + 0.01
            dequant[name] = q.float() * scale
        else:
            out[name] = t
            dequant[name] = t
    save_file(out, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    activations = ({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False} if static else
                   {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                      "weights": {"type": "float", "num_bits": 8, "dynamic": False,
                                                  "strategy": "channel" if per_channel else "tensor"}}}}
    (folder / "config.json").write_text(json.dumps(config))
    return dequant


@pytest.mark.parametrize("per_channel,static", [(False, True), (True, False), (False, False)])
def test_fp8_checkpoint_loads_and_runs(tmp_path, per_channel, static):
    hf = save_tiny(tmp_path, "LlamaForCausalLM", seed=5, tie_word_embeddings=False)
    dequant = _quantize_checkpoint(tmp_path, per_channel, static)

    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    attn = loaded.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and not isinstance(loaded.model.lm_head, Fp8Linear)
    # the fused q/k/v weight is each shard's fp8 rows under that shard's scales
    w = attn.qkv_proj.weight.float() * attn.qkv_proj.weight_scale.reshape(-1, 1)
    ref = torch.cat([dequant[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(w, ref)
    assert (attn.qkv_proj.input_scale is not None) == static
    if static:  # one activation scale for the fused GEMM: the largest of the shards' (vLLM's rule)
        from safetensors.torch import load_file

        ckpt = load_file(str(tmp_path / "model.safetensors"))
        shard_scales = [ckpt[f"model.layers.0.self_attn.{p}_proj.input_scale"] for p in "qkv"]
        assert attn.qkv_proj.input_scale.item() == max(x.item() for x in shard_scales)

    # on gfx942 the same checkpoint becomes e4m3fnuz with identical dequantised weights
    fnuz = load_model(tmp_path, torch.float32, torch.device("cpu"), fp8_dtype=FNUZ).model
    q2 = fnuz.model.layers[0].self_attn.qkv_proj
    assert q2.weight.dtype == FNUZ and torch.equal(q2.weight.float() * q2.weight_scale.reshape(-1, 1), ref)

    # end to end: greedy tokens of the fp8 model follow the dequantised fp32 model's (activation quantisation
    # moves logits by a few percent of their spread: top-1 agreement on most steps, bounded error)
    with torch.no_grad():
        hf.load_state_dict({k: v for k, v in dequant.items()}, strict=False)
    agree = quantised_greedy_agreement(tmp_path, hf)
    assert agree >= 0.75, f"fp8 greedy tokens agree with the dequantised model on {agree:.0%} of steps"


def test_ignore_lists_use_checkpoint_names():
    from resin.models.fp8 import Fp8Config, quantize_linears
    from resin.models.llama import MixtralForCausalLM
    from resin.tiny import tiny_hf_config

    cfg = MixtralForCausalLM.parse_config(tiny_hf_config("MixtralForCausalLM").to_dict())
    model = MixtralForCausalLM(cfg)
    replaced = quantize_linears(model, Fp8Config(static_input=False, ignore=(
        "lm_head", "re:.*block_sparse_moe.gate", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj")))
    assert "model.layers.0.mlp.gate" not in replaced  # the router, under its checkpoint name
    assert "model.layers.1.self_attn.qkv_proj" not in replaced  # all three shards ignored
    assert "model.layers.0.self_attn.qkv_proj" in replaced and "model.layers.1.self_attn.o_proj" in replaced
    with pytest.raises(ValueError, match="quantises only some of"):
        quantize_linears(MixtralForCausalLM(cfg), Fp8Config(static_input=False,
                                                            ignore=("model.layers.0.self_attn.q_proj",)))


def test_unsupported_quantisation_is_a_clear_error():
    with pytest.raises(ValueError, match="'awq' is not supported"):
        parse_quant_config({"quantization_config": {"quant_method": "awq"}})
    assert parse_quant_config({}) is None
