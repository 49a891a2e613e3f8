"""Qwen3-Next (GGUF architecture ``qwen3next``; transformers ``Qwen3NextForCausalLM``).

    h = embed(tokens)
    per layer:  h += mixer(rmsnorm(h))         gated DeltaNet on "recurrent" layers (3 of 4), else
                                               gated attention: o_proj(attn(q, k, v) * sigmoid(gate)),
                                               q and gate from one projection, q/k RMSNorm, partial RoPE
                h += moe(rmsnorm(h))           softmax top-k (renormalised) routed experts
                                               + sigmoid(w . x) * shared expert
    logits = output(rmsnorm(h))
GGUF norm weights already hold transformers' 1 + weight (except the DeltaNet output norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import LoadOptions, Metadata, ModelConfig
from ..deltanet import DeltaNetShape, DeltaNetWeights, InputProjection, gated_deltanet
from ..device import Device
from ..layers import AttentionShape, attention, decoded_attention_layer, gate_sigmoid, linear, rmsnorm, rope
from ..moe import RoutedExperts, SharedExpert, moe_layer
from ..state import KVCache, SequenceState
from ..weights import QTensor, WeightStore
from . import DebugHook, no_hook
from .qwen3moe import Attention, Embeddings, load_experts

ARCH = "qwen3next"


@dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    norm_topk_prob: bool  # renormalise the top-k routing weights (GGUF has no key: llama.cpp assumes True)
    shared_ffn: int  # intermediate size of the shared expert
    recurrent: tuple[bool, ...]  # per layer: DeltaNet (True) or full attention (False)
    deltanet: DeltaNetShape

    @classmethod
    def arch_fields(cls, md: Metadata) -> dict[str, Any]:
        n_layers = md.decoder_layers()
        recurrent = md.get("attention.recurrent_layers", None)
        if recurrent is None:  # older files: every full_attention_interval-th layer is full attention
            interval = md.get_int("full_attention_interval", 4)
            recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
        n_v_heads = md.get_int("ssm.time_step_rank")
        return dict(
            norm_topk_prob=bool(md.get("expert_weights_norm", True)),
            shared_ffn=md.get_int("expert_shared_feed_forward_length"),
            recurrent=tuple(bool(r) for r in list(recurrent)[:n_layers]),
            deltanet=DeltaNetShape(n_k_heads=md.get_int("ssm.group_count"),
                                   n_v_heads=n_v_heads,
                                   k_dim=md.get_int("ssm.state_size"),
                                   v_dim=md.get_int("ssm.inner_size") // n_v_heads,
                                   conv_kernel=md.get_int("ssm.conv_kernel")),
        )


def load_deltanet(ws: WeightStore, p: str, c: Qwen3NextConfig) -> DeltaNetWeights:
    s, d = c.deltanet, c.hidden
    if ws.has(f"{p}.ssm_in.weight"):
        in_proj = InputProjection.fused(ws.tensor(f"{p}.ssm_in.weight", (s.conv_dim + s.value_dim, d)), s)
    else:
        in_proj = InputProjection(qkv=ws.tensor(f"{p}.attn_qkv.weight", (s.conv_dim, d)),
                                  z=ws.tensor(f"{p}.attn_gate.weight", (s.value_dim, d)))
    return DeltaNetWeights(in_proj=in_proj,
                           ba=ws.tensor(f"{p}.ssm_ba.weight", (2 * s.n_v_heads, d)),
                           conv=ws.decoded(f"{p}.ssm_conv1d.weight", (s.conv_dim, s.conv_kernel)),
                           dt_bias=ws.vector(f"{p}.ssm_dt.bias", s.n_v_heads),
                           ssm_a=ws.vector(f"{p}.ssm_a", s.n_v_heads),
                           norm=ws.vector(f"{p}.ssm_norm.weight", s.v_dim),
                           out=ws.tensor(f"{p}.ssm_out.weight", (d, s.value_dim)))


def load_shared_expert(ws: WeightStore, p: str, d: int, f: int) -> SharedExpert:
    """The shared expert of layer prefix ``p`` (hidden size d, intermediate size f) and its sigmoid gate."""
    return SharedExpert(gate=ws.tensor(f"{p}.ffn_gate_shexp.weight", (f, d)),
                        up=ws.tensor(f"{p}.ffn_up_shexp.weight", (f, d)),
                        down=ws.tensor(f"{p}.ffn_down_shexp.weight", (d, f)),
                        gate_inp=ws.tensor(f"{p}.ffn_gate_inp_shexp.weight", (1, d)))


@dataclass(frozen=True)
class Layer:
    attn_norm: np.ndarray
    mixer: DeltaNetWeights | Attention
    ffn_norm: np.ndarray
    router: QTensor
    experts: RoutedExperts
    shared: SharedExpert


class Model:
    def __init__(self, ws: WeightStore, dev: Device, options: LoadOptions | None = None):
        self.config = c = Qwen3NextConfig.from_gguf(ws.gguf)
        self.dev = dev
        self.emb = Embeddings.load(ws, c)
        self.layers = []
        for i in range(c.n_layers):
            p, d, f = f"blk.{i}", c.hidden, c.shared_ffn
            router, experts = load_experts(ws, p, c)
            mixer = (load_deltanet(ws, p, c) if c.recurrent[i]
                     else Attention.load(ws, p, c, 2 * c.n_heads * c.head_dim))
            shared = load_shared_expert(ws, p, d, f)
            self.layers.append(Layer(attn_norm=ws.vector(f"{p}.attn_norm.weight", d), mixer=mixer,
                                     ffn_norm=ws.vector(f"{p}.post_attention_norm.weight", d),
                                     router=router, experts=experts, shared=shared))
        self._decode_calls: dict[int, Any] = {}  # by layer: the device's compiled decode layer, or None

    def decode_call(self, i: int):
        """Layer i's whole decode step as one device call (Device.deltanet_moe_layer, attention_moe_layer), or
        None: files whose DeltaNet input projection or beta/alpha rows come in other layouts, devices without one."""
        if i not in self._decode_calls:
            layer, c, call = self.layers[i], self.config, None
            w, e, s = layer.mixer, layer.experts, layer.shared
            moe = (layer.router, c.n_experts_used, c.norm_topk_prob, (e.gate, e.up, e.down), (s.gate, s.up, s.down),
                   s.gate_inp)
            if not c.recurrent[i]:
                shape = AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, True, c.rope_theta, c.rope_dim,
                                       c.head_dim ** -0.5)
                call = self.dev.attention_moe_layer(layer.attn_norm, layer.ffn_norm, c.rms_eps, (w.q, w.k, w.v),
                                                    w.q_norm, w.k_norm, shape, w.o, *moe)
            elif w.in_proj.qkvz is None and w.ba is not None:
                call = self.dev.deltanet_moe_layer(layer.attn_norm, layer.ffn_norm, c.rms_eps,
                                                   (w.in_proj.qkv, w.in_proj.z, w.ba),
                                                   w.decode_step(c.deltanet, c.rms_eps), w.out, *moe)
            self._decode_calls[i] = call
        return self._decode_calls[i]

    def new_state(self, max_context: int) -> SequenceState:
        c = self.config
        return SequenceState([c.deltanet.new_state() if rec else KVCache(c.n_kv_heads, c.head_dim, max_context)
                              for rec in c.recurrent], max_context)

    def attention(self, a: Attention, x: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        c, n = self.config, x.shape[0]
        q_gate, k, v = self.dev.linears(x, (a.q, a.k, a.v))
        q_gate = q_gate.reshape(n, c.n_heads, 2, c.head_dim)  # per head: query, then gate
        q = rmsnorm(q_gate[:, :, 0], a.q_norm, c.rms_eps)
        gate = q_gate[:, :, 1].reshape(n, c.n_heads * c.head_dim)
        k = rmsnorm(k.reshape(n, c.n_kv_heads, c.head_dim), a.k_norm, c.rms_eps)
        v = v.reshape(n, c.n_kv_heads, c.head_dim)
        q = rope(q, positions, c.rope_theta, c.rope_dim)
        k = rope(k, positions, c.rope_theta, c.rope_dim)
        return linear(self.dev, gate_sigmoid(attention(q, k, v, cache, c.head_dim ** -0.5), gate), a.o)

    def forward(self, state: SequenceState, tokens: np.ndarray, hook: DebugHook) -> np.ndarray:
        """Final-normed hidden states [n, hidden] of the tokens; advances the state."""
        c = self.config
        positions = state.position + np.arange(len(tokens))
        h = self.emb.tokens.take_rows(tokens)
        fused = len(tokens) == 1 and hook is no_hook  # no one watches the layers' insides
        for i, (layer, layer_state) in enumerate(zip(self.layers, state.layers)):
            if fused and (call := self.decode_call(i)) is not None:  # h += the whole layer, in place
                if c.recurrent[i]:
                    call(h[0], layer_state.conv, layer_state.recurrent)
                else:
                    decoded_attention_layer(call, h, layer_state, state.position)
                continue
            x = hook("attn_norm", i, rmsnorm(h, layer.attn_norm, c.rms_eps))
            if c.recurrent[i]:
                mixed = gated_deltanet(self.dev, x, layer.mixer, c.deltanet, layer_state, c.rms_eps)
            else:
                mixed = self.attention(layer.mixer, x, positions, layer_state)
            h = h + hook("attn_out", i, mixed)
            hook("ffn_inp", i, h)
            x = hook("ffn_norm", i, rmsnorm(h, layer.ffn_norm, c.rms_eps))
            moe = moe_layer(self.dev, x, layer.router, c.n_experts_used, c.norm_topk_prob, layer.experts,
                            layer.shared)
            h = h + hook("moe_out", i, moe)
            hook("layer_out", i, h)
        return hook("output_norm", -1, rmsnorm(h, self.emb.output_norm, c.rms_eps))

    def logits(self, h: np.ndarray) -> np.ndarray:
        return linear(self.dev, h, self.emb.output)
