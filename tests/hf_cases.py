"""HuggingFace models the multi-process tensor-parallel tests split with the built-in Llama plan (tests/dist_jobs.py):
Llama (GQA, tied embeddings), Qwen2 (biases on q, k, v), Qwen3 (per-head q/k norms inside the attention) and a
Llama with biases everywhere (row-parallel o_proj and down_proj biases)."""

from __future__ import annotations

import pytest
import torch


def hf_llama_tp():
    """conformance_cases.hf_llama (4 heads, 2 kv heads, tied embeddings) with sdpa attention."""
    from conformance_cases import hf_llama

    return hf_llama()


def hf_qwen2_tp():
    """A HuggingFace Qwen2 laid out like Llama (the built-in Llama plan), with biases on q, k and v."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def hf_qwen3_tp():
    """A HuggingFace Qwen3: per-head RMS norms of q and k inside the attention (whole parameters used on each tp
    rank's heads)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, tie_word_embeddings=True,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config)


def hf_llama_bias_tp():
    """A HuggingFace Llama with biases everywhere: the row-parallel o_proj's and down_proj's are whole."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_bias=True, mlp_bias=True,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)
