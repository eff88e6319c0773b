"""`resin models`: each supported architecture and the HAL ops its forward pass really calls (traced)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from resin.hal.registry import trace_ops
from resin.models import MODEL_REGISTRY, MODEL_TYPES


def supported_models() -> list[tuple[str, str, list[str]]]:
    from resin.core.sampling_params import SamplingParams
    from resin.llm import LLM
    from resin.tiny import save_tiny_model

    types = {v: k for k, v in MODEL_TYPES.items()}
    rows = []
    for arch in MODEL_REGISTRY:
        with tempfile.TemporaryDirectory() as tmp, trace_ops() as seen:
            save_tiny_model(Path(tmp), arch)
            llm = LLM(tmp, backend="cpu", kv_cache_memory="4MiB")
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        rows.append((arch, types.get(arch, "?"), sorted(seen)))
    return rows
