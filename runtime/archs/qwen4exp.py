"""Qwen3.8-Flash-Next (GGUF architecture ``qwen4exp``; transformers ``Qwen4ExpForCausalLM``).

    h = [embed(tokens)] * hc                               hc residual streams (hyper-connections)
    per layer:  h += ple(h, n-gram rows)                   on the PLE layer only (runtime/ple.py)
                x, w = hc_read(h);  h = hc_write(h, mixer(x), w)
                                                           mixer: gated DeltaNet on recurrent layers, else
                                                           gated attention over the positions the QSA
                                                           indexer keeps (runtime/qsa.py)
                x, w = hc_read(h);  h = hc_write(h, moe(x), w)
                                                           softmax top-k routed experts + gated shared expert
    logits = output(hc_read(h))                            the final mixer reads the streams into one

No layer norms besides the ones inside the hyper-connections (runtime/hyper.py). The DeltaNet value heads
are stored in "tiled" order and b/a projections apart (ssm_beta / ssm_alpha); its output gate is a sigmoid,
what llama.cpp assumes (transformers' output_gate_type), unless the file says ``qwen4exp.ssm.output_gate``.
The multi-token-prediction block is not in converted files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import LoadOptions, Metadata, ModelConfig
from ..deltanet import DeltaNetShape, DeltaNetWeights, InputProjection, gated_deltanet
from ..device import Device
from ..hyper import HyperConnection, hc_read, hc_write
from ..layers import attention, gate_sigmoid, linear, rmsnorm, rope, sparse_attention
from ..moe import RoutedExperts, SharedExpert, moe_layer
from ..ple import TABLE_TENSOR, NGramHash, NGramTable, PLEWeights, new_ple_state, ple_module
from ..qsa import Indexer, QSAShape, select_positions
from ..state import DeltaNetState, IndexedKVCache, KVCache, PLELayerState, SequenceState
from ..weights import QTensor, WeightError, WeightStore
from . import DebugHook
from .qwen3moe import Attention, load_experts
from .qwen3next import load_shared_expert

ARCH = "qwen4exp"
GATES = ("sigmoid", "silu")


@dataclass(frozen=True)
class Qwen4ExpConfig(ModelConfig):
    norm_topk_prob: bool
    shared_ffn: int
    recurrent: tuple[bool, ...]  # per layer: DeltaNet (True) or attention (False)
    deltanet: DeltaNetShape
    hc: int  # residual streams
    hc_low_rank: int
    qsa: QSAShape | None  # the indexer; None: the file has none
    compress_ratios: tuple[int, ...]  # per layer: the QSA block size; 0 = dense attention (or a DeltaNet layer)
    ple_layer: int | None  # the (one) layer with the n-gram PLE module
    ngram: NGramHash | None
    ple_row_dim: int
    ple_conv_kernel: int

    @classmethod
    def arch_fields(cls, md: Metadata) -> dict[str, Any]:
        n_layers = md.decoder_layers()
        recurrent = tuple(bool(r) for r in list(md.get("attention.recurrent_layers"))[:n_layers])
        n_v_heads = md.get_int("ssm.time_step_rank")
        gate = str(md.get("ssm.output_gate", "sigmoid"))
        if gate not in GATES:
            raise ValueError(f"{md.gguf.path}: {md.arch}.ssm.output_gate is {gate!r}; supported: {', '.join(GATES)}")
        ratios = tuple(int(r) for r in list(md.get("attention.compress_ratios", [0] * n_layers))[:n_layers])
        qsa = None
        if md.get("attention.indexer.head_count", None) is not None:
            qsa = QSAShape(n_heads=md.get_int("attention.indexer.head_count"),
                           dim=md.get_int("attention.indexer.key_length"),
                           budget=md.get_int("attention.indexer.top_k"),
                           ratio=0)
        for i, r in enumerate(ratios):
            if r < 0 or (r and (qsa is None or recurrent[i] or qsa.budget % r)):
                raise ValueError(f"{md.gguf.path}: layer {i} has QSA compress ratio {r}, which needs an attention "
                                 "layer, an indexer and a token budget that the ratio divides")
        ple_layers = [int(i) for i in list(md.get("ple.layers", []))]
        ngram = None
        if ple_layers:
            if len(ple_layers) != 1:
                raise ValueError(f"{md.gguf.path}: {md.arch}.ple.layers lists {ple_layers}; the file format holds "
                                 "one n-gram table, for one PLE layer")
            if not (0 <= ple_layers[0] < n_layers and recurrent[ple_layers[0]]):
                raise ValueError(f"{md.gguf.path}: the PLE layer {ple_layers[0]} must be a DeltaNet layer")
            ngram = NGramHash(ngram_size=md.get_int("ple.ngram_size"),
                              heads_per_ngram=md.get_int("ple.heads_per_ngram"),
                              eos_id=md.get_int("ple.eos_token_id"),
                              multipliers=np.asarray(md.get("ple.layer_multipliers"), np.int64),
                              head_offsets=np.asarray(md.get("ple.head_offsets"), np.int64),
                              head_sizes=np.asarray(md.get("ple.head_vocab_sizes"), np.int64))
            if (len(ngram.multipliers) != ngram.ngram_size or len(ngram.head_offsets) != ngram.n_heads
                    or len(ngram.head_sizes) != ngram.n_heads or (ngram.head_sizes <= 0).any()):
                raise ValueError(f"{md.gguf.path}: the PLE hash constants do not match ngram_size "
                                 f"{ngram.ngram_size} x heads_per_ngram {ngram.heads_per_ngram}")
        return dict(
            norm_topk_prob=bool(md.get("expert_weights_norm", True)),
            shared_ffn=md.get_int("expert_shared_feed_forward_length"),
            recurrent=recurrent,
            deltanet=DeltaNetShape(n_k_heads=md.get_int("ssm.group_count"), n_v_heads=n_v_heads,
                                   k_dim=md.get_int("ssm.state_size"),
                                   v_dim=md.get_int("ssm.inner_size") // n_v_heads,
                                   conv_kernel=md.get_int("ssm.conv_kernel"), v_head_order="tiled", gate=gate),
            hc=md.get_int("hyper_connection.count"),
            hc_low_rank=md.get_int("hyper_connection.low_rank"),
            qsa=qsa,
            compress_ratios=ratios,
            ple_layer=ple_layers[0] if ple_layers else None,
            ngram=ngram,
            ple_row_dim=md.get_int("embedding_length_per_layer_input", 0) if ple_layers else 0,
            ple_conv_kernel=md.get_int("ple.conv_kernel", 4),
        )

    def qsa_of(self, layer: int) -> QSAShape | None:
        r = self.compress_ratios[layer]
        return None if not r else QSAShape(self.qsa.n_heads, self.qsa.dim, self.qsa.budget, r)


@dataclass(frozen=True)
class QSAAttention:
    attn: Attention
    indexer: Indexer | None  # None: dense attention
    shape: QSAShape | None


@dataclass(frozen=True)
class Layer:
    mixer: DeltaNetWeights | QSAAttention
    attn_hc: HyperConnection
    ffn_hc: HyperConnection
    router: QTensor
    experts: RoutedExperts
    shared: SharedExpert
    ple: PLEWeights | None


def load_deltanet(ws: WeightStore, p: str, c: Qwen4ExpConfig) -> DeltaNetWeights:
    s, d = c.deltanet, c.hidden
    return DeltaNetWeights(in_proj=InputProjection(qkv=ws.tensor(f"{p}.attn_qkv.weight", (s.conv_dim, d)),
                                                   z=ws.tensor(f"{p}.attn_gate.weight", (s.value_dim, d))),
                           ba=None,
                           beta=ws.tensor(f"{p}.ssm_beta.weight", (s.n_v_heads, d)),
                           alpha=ws.tensor(f"{p}.ssm_alpha.weight", (s.n_v_heads, d)),
                           conv=ws.decoded(f"{p}.ssm_conv1d.weight", (s.conv_dim, s.conv_kernel)),
                           dt_bias=ws.vector(f"{p}.ssm_dt.bias", s.n_v_heads),
                           ssm_a=ws.vector(f"{p}.ssm_a", s.n_v_heads),
                           norm=ws.vector(f"{p}.ssm_norm.weight", s.v_dim),
                           out=ws.tensor(f"{p}.ssm_out.weight", (d, s.value_dim)))


class Model:
    def __init__(self, ws: WeightStore, dev: Device, options: LoadOptions | None = None):
        options = options or LoadOptions()
        self.config = c = Qwen4ExpConfig.from_gguf(ws.gguf)
        self.dev = dev
        d, hc, rank = c.hidden, c.hc, c.hc_low_rank
        table = None
        if c.ngram is not None:  # check the table first: a mismatch there explains any other
            table = ws.gguf.tensors.get(TABLE_TENSOR)
            if table is None:
                raise WeightError(f"{ws.gguf.path}: the model has a PLE layer but no '{TABLE_TENSOR}' table")
            NGramTable.check(table, c.ple_row_dim, c.ngram.rows_needed)
        self.tokens = ws.tensor("token_embd.weight", (c.vocab_size, d))  # rows looked up: as they lie (ROW_TABLES)
        self.output = ws.tensor("output.weight", (c.vocab_size, d)) if ws.has("output.weight") else self.tokens
        self.final_hc = HyperConnection.load(ws, "output_hc", hc, d, rank, inject=False)
        self.layers: list[Layer] = []
        for i in range(c.n_layers):
            p = f"blk.{i}"
            if c.recurrent[i]:
                mixer: DeltaNetWeights | QSAAttention = load_deltanet(ws, p, c)
            else:
                shape = c.qsa_of(i)
                mixer = QSAAttention(Attention.load(ws, p, c, 2 * c.n_heads * c.head_dim),
                                     Indexer.load(ws, p, shape, d) if shape else None, shape)
            router, experts = load_experts(ws, p, c)
            ple = None
            if i == c.ple_layer:
                ple = PLEWeights.load(ws, p, hc, d, c.ngram.n_heads * c.ple_row_dim, c.ple_conv_kernel)
            self.layers.append(Layer(mixer=mixer, attn_hc=HyperConnection.load(ws, f"{p}.hc_attn", hc, d, rank, True),
                                     ffn_hc=HyperConnection.load(ws, f"{p}.hc_ffn", hc, d, rank, True),
                                     router=router, experts=experts, shared=load_shared_expert(ws, p, d, c.shared_ffn),
                                     ple=ple))
        self.ple_table = None if table is None else NGramTable(table, c.ple_row_dim, c.ngram.rows_needed,
                                                               options.ple_io, options.ple_cache_rows)

    def close(self) -> None:
        if self.ple_table is not None:
            self.ple_table.close()

    def new_state(self, max_context: int) -> SequenceState:
        c = self.config
        layers: list[Any] = []
        for i, layer in enumerate(self.layers):
            if c.recurrent[i]:
                mixer_state: DeltaNetState = c.deltanet.new_state()
                layers.append(mixer_state if layer.ple is None
                              else PLELayerState(mixer_state, new_ple_state(c.ngram, layer.ple)))
            elif c.compress_ratios[i]:
                layers.append(IndexedKVCache(c.n_kv_heads, c.head_dim, max_context, index_dim=c.qsa.dim))
            else:
                layers.append(KVCache(c.n_kv_heads, c.head_dim, max_context))
        return SequenceState(layers, max_context)

    def attention(self, m: QSAAttention, x: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        c, a, n = self.config, m.attn, x.shape[0]
        q_gate = linear(self.dev, x, a.q).reshape(n, c.n_heads, 2, c.head_dim)  # per head: query, then gate
        q = rope(rmsnorm(q_gate[:, :, 0], a.q_norm, c.rms_eps), positions, c.rope_theta, c.rope_dim)
        gate = q_gate[:, :, 1].reshape(n, c.n_heads * c.head_dim)
        k = rmsnorm(linear(self.dev, x, a.k).reshape(n, c.n_kv_heads, c.head_dim), a.k_norm, c.rms_eps)
        k = rope(k, positions, c.rope_theta, c.rope_dim)
        v = linear(self.dev, x, a.v).reshape(n, c.n_kv_heads, c.head_dim)
        scale = c.head_dim ** -0.5
        if m.indexer is None:
            out = attention(q, k, v, cache, scale)
        else:
            allowed = select_positions(self.dev, x, m.indexer, m.shape, cache, positions, c.rope_theta, c.rope_dim,
                                       c.rms_eps)
            out = sparse_attention(q, k, v, cache, allowed, scale)
        return linear(self.dev, gate_sigmoid(out, gate), a.o)

    def forward(self, state: SequenceState, tokens: np.ndarray, hook: DebugHook) -> np.ndarray:
        """The final mixer's output [n, hidden] for the tokens; advances the state."""
        c, n = self.config, len(tokens)
        positions = state.position + np.arange(n)
        rows = None
        if self.ple_table is not None:
            # Ask for this step's table rows now; they are read while the layers before the PLE layer run.
            ple_state = state.layers[c.ple_layer].ple
            rows = c.ngram.row_ids(ple_state.context, tokens)
            self.ple_table.prefetch(rows)
        h = np.tile(self.tokens.take_rows(tokens), (1, c.hc))
        for i, (layer, layer_state) in enumerate(zip(self.layers, state.layers)):
            if layer.ple is not None:
                emb = self.ple_table.rows(rows).reshape(n, -1)
                h = h + hook("ple_out", i, ple_module(self.dev, h, emb, layer.ple, layer_state.ple, c.hc,
                                                      c.ngram.ngram_size, c.rms_eps))
                layer_state.ple.context = c.ngram.advance(layer_state.ple.context, tokens)
                layer_state = layer_state.mixer
            x, inject = hc_read(self.dev, layer.attn_hc, h, c.hc, c.rms_eps)
            if c.recurrent[i]:
                mixed = gated_deltanet(self.dev, x, layer.mixer, c.deltanet, layer_state, c.rms_eps)
            else:
                mixed = self.attention(layer.mixer, x, positions, layer_state)
            h = hc_write(h, hook("attn_out", i, mixed), inject)
            x, inject = hc_read(self.dev, layer.ffn_hc, h, c.hc, c.rms_eps)
            moe = moe_layer(self.dev, x, layer.router, c.n_experts_used, c.norm_topk_prob, layer.experts,
                            layer.shared)
            h = hc_write(h, hook("moe_out", i, moe), inject)
            hook("layer_out", i, h)
        out, _ = hc_read(self.dev, self.final_hc, h, c.hc, c.rms_eps)
        return hook("output_norm", -1, out)

    def logits(self, h: np.ndarray) -> np.ndarray:
        return linear(self.dev, h, self.output)
