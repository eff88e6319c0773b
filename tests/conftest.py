"""Shared fixtures: tiny random-weight models built from transformers configs and saved as safetensors, and a
small byte-level BPE tokenizer trained on the spot (no downloads)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from resin.tiny import random_hf_model, save_tiny_model, tiny_hf_config  # noqa: F401 (re-exported)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter here; set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Where the Triton kernel tests put their tensors: the interpreter works on host memory, a GPU on its own.
KERNEL_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
torch.set_num_threads(min(2, torch.get_num_threads()))

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
         "Qwen3NextForCausalLM", "GptOssForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM",
         "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # their shapes: test_mla_models
RECURRENT_ARCHS = ("Qwen3NextForCausalLM",)  # prefix caching is off for these (recurrent state per sequence)

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CORPUS = [
    "Hello world! The capital of France is Paris.",
    "Grüße aus München: Straße, Käse, Übermaß.",
    "日本語のテキストと絵文字 🙂🚀 も入っています。",
    "The quick brown fox jumps over the lazy dog. STOP here. END of story.",
    "Числа 1234567890 и знаки !@#$%^&*()",
]


def require_cpu_kernels() -> None:
    """For modules testing Resin's C++ kernels: only a missing toolchain skips; a build error of the source fails."""
    from resin.backends.cpu import kernels
    from resin.hal.platform import cpu_platform

    if kernels.missing_toolchain():
        pytest.skip(f"requires a C++ compiler and ninja: {kernels.missing_toolchain()}", allow_module_level=True)
    ok, why = kernels.supported(cpu_platform())
    if not ok:
        raise RuntimeError(f"Resin's CPU kernels did not build: {why}")


def save_tiny(tmp: Path, arch: str, tokenizer=None, seed: int = 0, **overrides):
    return save_tiny_model(tmp, arch, seed, tokenizer, **overrides)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (folder, transformers model) for the default tiny config of each architecture."""
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = (folder, save_tiny(folder, arch))
    return out


@pytest.fixture(scope="session")
def text_model(tmp_path_factory, bpe_tokenizer):
    """A tiny Llama with a real (trained here) tokenizer and chat template, for text-level tests."""
    folder = tmp_path_factory.mktemp("text-llama")
    model = save_tiny(folder, "LlamaForCausalLM", tokenizer=bpe_tokenizer, vocab_size=len(bpe_tokenizer),
                      max_position_embeddings=2048,
                      eos_token_id=bpe_tokenizer.eos_token_id, bos_token_id=bpe_tokenizer.bos_token_id)
    return folder, model
