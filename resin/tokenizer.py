"""Tokenizer loading: a Hugging Face folder's tokenizer files, or the vocabulary embedded in a GGUF file."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("resin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: Path, gguf_file: Path | None) -> Any | None:
    """The model's tokenizer, or None when the model ships none (prompts must then be token ids)."""
    from transformers import AutoTokenizer

    if gguf_file is not None:
        from gguf import GGUFReader

        if "tokenizer.ggml.tokens" not in GGUFReader(str(gguf_file)).fields:
            return None
        return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if not any((model_path / f).exists() for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=False)


def eos_token_ids(tokenizer: Any | None, hf_config: dict[str, Any], generation_config: dict[str, Any]) -> frozenset[int]:
    """Every id that ends generation: the config's and generation config's eos ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (hf_config.get("eos_token_id"), generation_config.get("eos_token_id")):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
