"""The hardware abstraction layer: op declarations with native implementations, providers, Platform facts,
backend selection and the attention-backend contract. Models call these ops; backends implement them."""
from resin.hal.attention import (ATTENTION, AttentionBackend, AttentionLayer, AttentionMetadata, ForwardContext,
                                 NativeAttention,
                                 write_kv)
from resin.hal.distributed import ALL_GATHER, ALL_REDUCE, ParallelGroup, parallel, set_parallel
from resin.hal.fp8 import BLOCK_FP8_LINEAR, FP8_LINEAR, e4m3fn_to_e4m3fnuz, quantize_fp8
from resin.hal.memory import move_to_huge_pages, zeros_on_huge_pages
from resin.hal.mla import MLA_ATTENTION, MlaLayer, NativeMla, attention_op, mla_layer
from resin.hal.moe import FUSED_MOE, MOE_ROUTE
from resin.hal.ops import (ARGMAX, EMBEDDING, FUSED_ADD_RMS_NORM, GELU_AND_MUL, LINEAR, RANDOM_SAMPLE, RMS_NORM,
                           ROTARY, SILU_AND_MUL)
from resin.hal.platform import Platform, detect_kind
from resin.hal.quant import QUANT_EMBEDDING, QUANT_LINEAR
from resin.hal.recurrent import (CAUSAL_CONV1D, CAUSAL_CONV1D_UPDATE, GATED_DELTA_RULE, RecurrentLayer,
                                 RecurrentMetadata)
from resin.hal.registry import Op, Provider, all_ops
from resin.hal.rotary import rope_cos_sin_cache
from resin.hal.selection import (BACKENDS, BackendSpec, OpChoice, Selection, SelectionError, describe_backend,
                                 select_backend)

__all__ = [
    "ATTENTION", "AttentionBackend", "AttentionLayer", "AttentionMetadata", "ForwardContext", "NativeAttention",
    "write_kv", "MLA_ATTENTION", "MlaLayer", "NativeMla", "attention_op", "mla_layer",
    "ALL_GATHER", "ALL_REDUCE", "ParallelGroup", "parallel", "set_parallel",
    "BLOCK_FP8_LINEAR", "FP8_LINEAR", "e4m3fn_to_e4m3fnuz", "quantize_fp8", "FUSED_MOE", "MOE_ROUTE",
    "CAUSAL_CONV1D", "CAUSAL_CONV1D_UPDATE", "GATED_DELTA_RULE", "RecurrentLayer", "RecurrentMetadata",
    "ARGMAX", "EMBEDDING", "FUSED_ADD_RMS_NORM", "GELU_AND_MUL", "LINEAR", "RANDOM_SAMPLE", "RMS_NORM", "ROTARY",
    "SILU_AND_MUL",
    "move_to_huge_pages", "zeros_on_huge_pages",
    "QUANT_EMBEDDING", "QUANT_LINEAR", "Platform", "detect_kind", "Op", "OpChoice", "Provider", "SelectionError", "all_ops", "rope_cos_sin_cache",
    "BACKENDS", "BackendSpec", "Selection", "describe_backend", "select_backend",
]
