"""Qwen3-MoE (GGUF architecture ``qwen3moe``; transformers ``Qwen3MoeForCausalLM``).

    h = embed(tokens)
    per layer:  h += attn(rmsnorm(h))          GQA, per-head q/k RMSNorm, RoPE, causal
                h += moe(rmsnorm(h))           softmax top-k (renormalised) over routed SwiGLU experts
    logits = output(rmsnorm(h))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import LoadOptions, Metadata, ModelConfig
from ..device import Device
from ..layers import AttentionShape, attention, decoded_attention_layer, linear, rmsnorm, rope
from ..moe import RoutedExperts, moe_layer
from ..state import KVCache, SequenceState
from ..weights import QTensor, WeightStore
from . import DebugHook, no_hook

ARCH = "qwen3moe"


@dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    norm_topk_prob: bool  # renormalise the top-k routing weights (GGUF has no key: llama.cpp assumes True)

    @classmethod
    def arch_fields(cls, md: Metadata) -> dict[str, Any]:
        return dict(norm_topk_prob=bool(md.get("expert_weights_norm", True)))


@dataclass(frozen=True)
class Attention:
    q: QTensor
    k: QTensor
    v: QTensor
    o: QTensor
    q_norm: np.ndarray
    k_norm: np.ndarray

    @classmethod
    def load(cls, ws: WeightStore, p: str, c: ModelConfig, q_rows: int) -> Attention:
        kv = c.n_kv_heads * c.head_dim
        return cls(q=ws.tensor(f"{p}.attn_q.weight", (q_rows, c.hidden)),
                   k=ws.tensor(f"{p}.attn_k.weight", (kv, c.hidden)),
                   v=ws.tensor(f"{p}.attn_v.weight", (kv, c.hidden)),
                   o=ws.tensor(f"{p}.attn_output.weight", (c.hidden, c.n_heads * c.head_dim)),
                   q_norm=ws.vector(f"{p}.attn_q_norm.weight", c.head_dim),
                   k_norm=ws.vector(f"{p}.attn_k_norm.weight", c.head_dim))


def load_experts(ws: WeightStore, p: str, c: ModelConfig) -> tuple[QTensor, RoutedExperts]:
    """A layer's router [n_experts, hidden] and routed experts."""
    e, f, d = c.n_experts, c.expert_ffn, c.hidden
    return (ws.tensor(f"{p}.ffn_gate_inp.weight", (e, d)),
            RoutedExperts(gate=ws.tensor(f"{p}.ffn_gate_exps.weight", (e, f, d)),
                          up=ws.tensor(f"{p}.ffn_up_exps.weight", (e, f, d)),
                          down=ws.tensor(f"{p}.ffn_down_exps.weight", (e, d, f))))


@dataclass(frozen=True)
class Embeddings:
    tokens: QTensor  # [vocab, hidden]
    output: QTensor  # [vocab, hidden]: the output head (the token embeddings when the file ties them)
    output_norm: np.ndarray

    @classmethod
    def load(cls, ws: WeightStore, c: ModelConfig) -> Embeddings:
        tokens = ws.tensor("token_embd.weight", (c.vocab_size, c.hidden))  # rows looked up: as they lie (ROW_TABLES)
        output = ws.tensor("output.weight", (c.vocab_size, c.hidden)) if ws.has("output.weight") else tokens
        return cls(tokens, output, ws.vector("output_norm.weight", c.hidden))


@dataclass(frozen=True)
class Layer:
    attn_norm: np.ndarray
    attn: Attention
    ffn_norm: np.ndarray
    router: QTensor
    experts: RoutedExperts


class Model:
    def __init__(self, ws: WeightStore, dev: Device, options: LoadOptions | None = None):
        self.config = c = Qwen3MoeConfig.from_gguf(ws.gguf)
        self.dev = dev
        self.emb = Embeddings.load(ws, c)
        self.layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}"
            router, experts = load_experts(ws, p, c)
            self.layers.append(Layer(attn_norm=ws.vector(f"{p}.attn_norm.weight", c.hidden),
                                     attn=Attention.load(ws, p, c, c.n_heads * c.head_dim),
                                     ffn_norm=ws.vector(f"{p}.ffn_norm.weight", c.hidden),
                                     router=router, experts=experts))
        self._decode_calls: dict[int, Any] = {}  # by layer: the device's compiled decode layer, or None

    def decode_call(self, i: int):
        """Layer i's whole decode step as one device call (Device.attention_moe_layer), or None where the device
        has none for its tensors."""
        if i not in self._decode_calls:
            layer, c = self.layers[i], self.config
            a, e = layer.attn, layer.experts
            shape = AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, False, c.rope_theta, c.rope_dim,
                                   c.head_dim ** -0.5)
            self._decode_calls[i] = self.dev.attention_moe_layer(
                layer.attn_norm, layer.ffn_norm, c.rms_eps, (a.q, a.k, a.v), a.q_norm, a.k_norm, shape, a.o,
                layer.router, c.n_experts_used, c.norm_topk_prob, (e.gate, e.up, e.down), None, None)
        return self._decode_calls[i]

    def new_state(self, max_context: int) -> SequenceState:
        c = self.config
        return SequenceState([KVCache(c.n_kv_heads, c.head_dim, max_context) for _ in self.layers], max_context)

    def attention(self, a: Attention, x: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        c, n = self.config, x.shape[0]
        q = rmsnorm(linear(self.dev, x, a.q).reshape(n, c.n_heads, c.head_dim), a.q_norm, c.rms_eps)
        k = rmsnorm(linear(self.dev, x, a.k).reshape(n, c.n_kv_heads, c.head_dim), a.k_norm, c.rms_eps)
        v = linear(self.dev, x, a.v).reshape(n, c.n_kv_heads, c.head_dim)
        q = rope(q, positions, c.rope_theta, c.rope_dim)
        k = rope(k, positions, c.rope_theta, c.rope_dim)
        return linear(self.dev, attention(q, k, v, cache, c.head_dim ** -0.5), a.o)

    def forward(self, state: SequenceState, tokens: np.ndarray, hook: DebugHook) -> np.ndarray:
        """Final-normed hidden states [n, hidden] of the tokens; advances the state."""
        c = self.config
        positions = state.position + np.arange(len(tokens))
        h = self.emb.tokens.take_rows(tokens)
        fused = len(tokens) == 1 and hook is no_hook  # no one watches the layers' insides
        for i, (layer, cache) in enumerate(zip(self.layers, state.layers)):
            if fused and (call := self.decode_call(i)) is not None:
                decoded_attention_layer(call, h, cache, state.position)  # h += the whole layer, in place
                continue
            x = hook("attn_norm", i, rmsnorm(h, layer.attn_norm, c.rms_eps))
            h = h + hook("attn_out", i, self.attention(layer.attn, x, positions, cache))
            hook("ffn_inp", i, h)
            x = hook("ffn_norm", i, rmsnorm(h, layer.ffn_norm, c.rms_eps))
            moe = moe_layer(self.dev, x, layer.router, c.n_experts_used, c.norm_topk_prob, layer.experts)
            h = h + hook("moe_out", i, moe)
            hook("layer_out", i, h)
        return hook("output_norm", -1, rmsnorm(h, self.emb.output_norm, c.rms_eps))

    def logits(self, h: np.ndarray) -> np.ndarray:
        return linear(self.dev, h, self.emb.output)
