"""Qwen3-MoE end to end: llama.cpp-converted GGUF files against transformers, quantized files against their
dequantized F32 copies (the checks are in parity.ParitySuite)."""

from parity import ParitySuite


class TestQwen3MoeParity(ParitySuite):
    model_key = "qwen3moe"
    kquant_key = "qwen3moe_kquant"
