"""Gated DeltaNet (Qwen3-Next linear attention) kernels: the short causal convolution over the
mixed q/k/v channels, the gates, and the gated delta rule in its recurrent (decode) and chunked
(prefill) forms. The math is transformers' Qwen3NextGatedDeltaNet; weights come in GGUF layout.

Gated delta rule, per token t and value head h (key head kh = h // (hv // hk), as HF's
repeat_interleave), with S the [dk, dv] state of head h:
    S   = exp(g_t) * S
    d   = beta_t * (v_t - S^T k_t)
    S   = S + k_t d^T
    o_t = S^T (scale * q_t)           scale = dk ** -0.5 unless given
q and k come in already L2-normalized (norms.l2norm), as HF's use_qk_l2norm_in_kernel=True does
before the rule; the scale is applied here, as HF does. States are float32 [hv, dk, dv] and are
updated in place, so successive calls continue one sequence.
"""

from __future__ import annotations

import numba
import numpy as np

from .activations import ELEMENTWISE_MATH, _mul_sigmoid, by_size, sigmoid_f32
from .checks import require_array, require_positive
from .norms import _gated_rmsnorm_rows, _l2norm_rows, _rmsnorm_rows
from .simd import flush_subnormals
from .small_matmul import FASTMATH, matmul_nn
from .task_queue import next_task, task_counter


@numba.njit(inline="always", nogil=True)
def _conv_token(t, x, state, w_t, out):
    """out[t] = silu of the causal convolution at token t (w_t: the weight transposed, [kernel, channels])."""
    history = w_t.shape[0] - 1  # rows of conv_state; x[t] is history row history + t
    o = out[t]
    o[:] = 0.0
    for j in range(w_t.shape[0]):
        src = t + j
        row = state[src] if src < history else x[src - history]
        w = w_t[j]
        for c in range(o.shape[0]):
            o[c] += w[c] * row[c]
    for c in range(o.shape[0]):
        o[c] = o[c] * sigmoid_f32(o[c])


@numba.njit(inline="always", nogil=True)
def _keep_history(x, state):
    """Keep the last kernel-1 inputs. Row i takes row i + n of the history; ascending i only reads state rows that
    have not been overwritten yet."""
    n, history = x.shape[0], state.shape[0]
    for i in range(history):
        src = i + n
        if src < history:
            state[i, :] = state[src, :]
        else:
            state[i, :] = x[src - history, :]


# A serial and a parallel loop over the tokens (the same bits; the parallel one for prompt chunks). Both take the
# weight transposed, [kernel, channels], so that the channel loops run over contiguous rows; the callers transpose
# it once (DecodeStep at its making): transposed inside, the strided copy of GGUF's [channels, kernel] on every call
# had been ~40% of a decoded token's convolution (8192 channels, one token, in one process: 22.9 us a call, 14.0
# with the weight transposed once; the same bits).
@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _causal_conv1d_silu(x, state, w_t, out):
    for t in range(x.shape[0]):
        _conv_token(t, x, state, w_t, out)
    _keep_history(x, state)


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy", parallel=True)
def _causal_conv1d_silu_parallel(x, state, w_t, out):
    for t in numba.prange(x.shape[0]):
        _conv_token(t, x, state, w_t, out)
    _keep_history(x, state)


@numba.njit(nogil=True, cache=True, fastmath=False)
def _gdn_gates(alpha, b, ssm_a, dt_bias, g, beta):
    n, hv = alpha.shape
    for t in range(n):
        for h in range(hv):
            z = np.float64(alpha[t, h]) + np.float64(dt_bias[h])
            softplus = max(z, 0.0) + np.log1p(np.exp(-abs(z)))
            g[t, h] = ssm_a[h] * softplus
            beta[t, h] = 1.0 / (1.0 + np.exp(-np.float64(b[t, h])))


@numba.njit(nogil=True, cache=True, parallel=True, fastmath=FASTMATH)
def _gated_delta_rule_recurrent(q, k, v, g, beta, state, scale, out):
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    group = hv // hk
    for h in numba.prange(hv):
        mxcsr = flush_subnormals(True)  # decays of exp(g) < 1e-38 would otherwise leave subnormal states
        kh = h // group
        S = state[h]
        kS = np.empty(dv, np.float32)
        qS = np.empty(dv, np.float32)
        delta = np.empty(dv, np.float32)
        for t in range(n):
            decay = np.float32(np.exp(np.float64(g[t, h])))
            # One pass over S reads both S^T k and S^T q; the output then follows from
            # S_new^T q = decay * S^T q + (k . q) * delta without a third pass.
            kS[:] = 0.0
            qS[:] = 0.0
            kq = np.float32(0.0)
            for i in range(dk):
                ki = k[t, kh, i]
                qi = q[t, kh, i]
                kq += ki * qi
                for j in range(dv):
                    s = S[i, j]
                    kS[j] += ki * s
                    qS[j] += qi * s
            bt = beta[t, h]
            for j in range(dv):
                delta[j] = bt * (v[t, h, j] - decay * kS[j])
            for i in range(dk):
                ki = k[t, kh, i]
                for j in range(dv):
                    S[i, j] = decay * S[i, j] + ki * delta[j]
            for j in range(dv):
                out[t, h, j] = scale * (decay * qS[j] + kq * delta[j])
        flush_subnormals(mxcsr)


@numba.njit(nogil=True, cache=True, parallel=True, fastmath=FASTMATH)
def _gated_delta_rule_chunked(q, k, v, g, beta, state, scale, chunk, out, workers):
    # Within a chunk of L tokens starting from state S0, with G_t the cumulative log decay from the
    # chunk start (so decays between tokens are exp(G_t - G_s) <= 1):
    #   deltas D solve the unit lower-triangular system (I + A) D = diag(beta) (V - diag(exp G) K S0),
    #       A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s) for s < t
    #   outputs  O = diag(exp G) Q S0 + P D,  P[t, s] = exp(G_t - G_s) (q_t . k_s) for s <= t
    #   state    S = exp(G_L) S0 + sum_s exp(G_L - G_s) k_s D_s^T
    # which equals L steps of the recurrence, with matrix-matrix work instead of L passes over S.
    # Every product is an outer-product form C = A B over contiguous rows of B (matmul_nn), so the state
    # is updated in place in its own [dk, dv] layout and only the chunk's keys are transposed. (As dot
    # products over contiguous rows, with the state transposed, each output's horizontal sum over
    # k = 64 or 128 had cost about as much as its multiply-adds: 512 tokens, 32 heads of 128, 2 threads,
    # old and new alternating, best of 15: 26.7-33.2 -> 17.5-20.0 ms a layer.)
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    group = hv // hk
    counter = task_counter()
    for worker in numba.prange(workers):  # heads from the counter (task_queue)
        # Decays between far-apart tokens of a chunk (exp(G_t - G_s)) reach below float32's normal range; flushed to
        # zero instead of taking a microcode assist per multiply (10x slower on a synthetic model's fast decays).
        mxcsr = flush_subnormals(True)
        Kc = np.empty((chunk, dk), np.float32)  # chunk keys
        KcT = np.empty((dk, chunk), np.float32)  # the same, transposed; then decayed to the chunk end
        Qc = np.empty((chunk, dk), np.float32)  # chunk queries, scaled (then also by exp G)
        D = np.empty((chunk, dv), np.float32)  # K S0, then the right-hand side, then the deltas
        O = np.empty((chunk, dv), np.float32)  # chunk outputs
        A = np.empty((chunk, chunk), np.float32)
        P = np.empty((chunk, chunk), np.float32)
        G = np.empty(chunk, np.float64)
        decay = np.empty(chunk, np.float64)  # row t of exp(G_t - G_s), s <= t
        h = next_task(counter)
        while h < hv:
            kh = h // group
            S = state[h]  # [dk, dv], updated in place
            for t0 in range(0, n, chunk):
                L = min(chunk, n - t0)
                acc = 0.0
                for t in range(L):
                    acc += g[t0 + t, h]
                    G[t] = acc
                    for i in range(dk):
                        ki = k[t0 + t, kh, i]
                        Kc[t, i] = ki
                        KcT[i, t] = ki
                        Qc[t, i] = q[t0 + t, kh, i] * scale
                matmul_nn(Kc, KcT, A, L, L, dk, False)
                matmul_nn(Qc, KcT, P, L, L, dk, False)
                for t in range(L):
                    # exp(G_t - G_s) = exp(g_t) exp(G_{t-1} - G_s): one exp per row, not per entry
                    step = np.exp(np.float64(g[t0 + t, h]))
                    for s in range(t):
                        decay[s] *= step
                    decay[t] = 1.0
                    bt = beta[t0 + t, h]
                    for s in range(t):
                        A[t, s] *= np.float32(bt * decay[s])
                    for s in range(t + 1):
                        P[t, s] *= np.float32(decay[s])
                    for s in range(t, L):
                        A[t, s] = 0.0
                    for s in range(t + 1, L):
                        P[t, s] = 0.0
                matmul_nn(Kc, S, D, L, dv, dk, False)
                for t in range(L):
                    et = np.float32(np.exp(G[t]))
                    for i in range(dk):
                        Qc[t, i] *= et
                matmul_nn(Qc, S, O, L, dv, dk, False)
                # Forward substitution, in place: row t needs the deltas of rows s < t only.
                for t in range(L):
                    bt = beta[t0 + t, h]
                    et = np.float32(np.exp(G[t]))
                    for j in range(dv):
                        D[t, j] = bt * (v[t0 + t, h, j] - et * D[t, j])
                    for s in range(t):
                        c = A[t, s]
                        for j in range(dv):
                            D[t, j] -= c * D[s, j]
                matmul_nn(P, D, O, L, dv, L, True)
                for t in range(L):
                    for j in range(dv):
                        out[t0 + t, h, j] = O[t, j]
                end = G[L - 1]
                for s in range(L):
                    w = np.float32(np.exp(end - G[s]))
                    for i in range(dk):
                        KcT[i, s] *= w
                e_end = np.float32(np.exp(end))
                for i in range(dk):
                    for j in range(dv):
                        S[i, j] *= e_end
                matmul_nn(KcT, D, S, dk, dv, L, True)
            h = next_task(counter)
        flush_subnormals(mxcsr)


def causal_conv1d(x: np.ndarray, conv_state: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution + SiLU over the DeltaNet q/k/v channels.

    x [n, channels] float32 (n >= 1: one decode token or a prefill chunk); conv_state
    [kernel-1, channels] float32, the previous kernel-1 inputs oldest first (zeros for a fresh
    sequence), updated in place to the last kernel-1 inputs; weight [channels, kernel] float32 as
    GGUF's ssm_conv1d (numpy order). Returns silu(conv) [n, channels] float32.
    """
    require_array("x", x, (None, None))
    require_positive("x rows", x.shape[0])
    require_array("weight", weight, (x.shape[1], None))
    require_positive("conv kernel size", weight.shape[1])
    require_array("conv_state", conv_state, (weight.shape[1] - 1, x.shape[1]), writable=True)
    out = np.empty_like(x)
    by_size(x.size, _causal_conv1d_silu, _causal_conv1d_silu_parallel)(x, conv_state, _transposed(weight), out)
    return out


def gdn_gates(alpha: np.ndarray, b: np.ndarray, ssm_a: np.ndarray,
              dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decay and write strength of the gated delta rule from the ba projection.

    alpha, b [n, hv] float32 (the a and b halves of ssm_ba's output); ssm_a [hv] (GGUF's ssm_a,
    which is -exp(A_log)); dt_bias [hv] (GGUF's ssm_dt.bias). Returns (g, beta), both [n, hv]
    float32: g = ssm_a * softplus(alpha + dt_bias), beta = sigmoid(b).
    """
    require_array("alpha", alpha, (None, None))
    require_array("b", b, alpha.shape)
    require_array("ssm_a", ssm_a, (alpha.shape[1],))
    require_array("dt_bias", dt_bias, (alpha.shape[1],))
    g = np.empty_like(alpha)
    beta = np.empty_like(alpha)
    _gdn_gates(alpha, b, ssm_a, dt_bias, g, beta)
    return g, beta


def _check_delta_rule_args(q, k, v, g, beta, state) -> None:
    require_array("q", q, (None, None, None))
    n, hk, dk = q.shape
    require_positive("sequence length (q rows)", n)
    require_array("k", k, q.shape)
    require_array("v", v, (n, None, None))
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    require_array("g", g, (n, hv))
    require_array("beta", beta, (n, hv))
    require_array("state", state, (hv, dk, dv), writable=True)


def _scale(dk: int, scale: float | None) -> np.float32:
    return np.float32(dk ** -0.5 if scale is None else scale)


def _transposed(conv_w: np.ndarray) -> np.ndarray:
    """GGUF's conv weight [channels, kernel] as the convolution kernels take it: [kernel, channels], float32."""
    return np.ascontiguousarray(np.asarray(conv_w, np.float32).T)


def gated_delta_rule_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                               beta: np.ndarray, state: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Gated delta rule token by token (decode, or a few tokens): see the module docstring.

    q, k [n, hk, dk] float32, L2-normalized; v [n, hv, dv]; g (log decay, <= 0), beta [n, hv];
    state [hv, dk, dv] float32, updated in place. Returns out [n, hv, dv] float32.
    """
    _check_delta_rule_args(q, k, v, g, beta, state)
    out = np.empty_like(v)
    _gated_delta_rule_recurrent(q, k, v, g, beta, state, _scale(q.shape[2], scale), out)
    return out


def gated_delta_rule_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                             beta: np.ndarray, state: np.ndarray, chunk: int = 64,
                             scale: float | None = None) -> np.ndarray:
    """Gated delta rule over a prompt, ``chunk`` tokens at a time with matrix-matrix work inside
    each chunk (prefill). Same arguments, result and state update as gated_delta_rule_recurrent;
    any length (the last chunk may be short). The arithmetic per token is the recurrent form's
    (3 dk dv per head) plus chunk * (dk + dv) for the in-chunk products; what changes is that
    the state is read and written once per chunk instead of once per token."""
    _check_delta_rule_args(q, k, v, g, beta, state)
    require_positive("chunk", chunk)
    out = np.empty_like(v)
    _gated_delta_rule_chunked(q, k, v, g, beta, state, _scale(q.shape[2], scale), int(chunk), out,
                              numba.get_num_threads())
    return out


# One decoded token's mixer between its projections, in one compiled call: the steps above (convolution, q/k L2
# norms, gates, recurrent rule, gated norm) called in turn, so the bits are theirs. Done from Python, the six
# calls and the reshapes and copies between them had cost ~0.1-0.2 ms a layer: a decoded token's Python runs
# with cold caches, each layer streaming megabytes of weights through them.
@numba.njit(nogil=True, cache=True, fastmath=False)
def _decode_step(qkv, z, ba, fused_ba, conv_state, conv_w_t, ssm_a, dt_bias, state, norm_w, eps, hk, dk, hv, dv,
                 tiled, silu_gate, scale, out):
    r = hv // hk
    mixed = np.empty(qkv.shape[0], np.float32)
    _causal_conv1d_silu(qkv.reshape(1, -1), conv_state, conv_w_t, mixed.reshape(1, -1))
    qk = np.empty((2 * hk, dk), np.float32)  # q heads, then k heads
    _l2norm_rows(mixed[:2 * hk * dk].reshape(2 * hk, dk), 1e-6, qk)  # norms.l2norm's eps, as the prompt path
    kq = hv if tiled else hk  # tiled: each value head gets its own copy of its key head (h % hk)
    q = np.empty((1, kq, dk), np.float32)
    k = np.empty((1, kq, dk), np.float32)
    for h in range(kq):
        src = h % hk
        q[0, h] = qk[src]
        k[0, h] = qk[hk + src]
    v = mixed[2 * hk * dk:].reshape(1, hv, dv)
    b = np.empty((1, hv), np.float32)
    a = np.empty((1, hv), np.float32)
    for h in range(hv):  # fused ba: per key head, its r betas then its r alphas
        b[0, h] = ba[(h // r) * 2 * r + h % r] if fused_ba else ba[h]
        a[0, h] = ba[(h // r) * 2 * r + r + h % r] if fused_ba else ba[hv + h]
    g = np.empty((1, hv), np.float32)
    beta = np.empty((1, hv), np.float32)
    _gdn_gates(a, b, ssm_a, dt_bias, g, beta)
    o = np.empty((1, hv, dv), np.float32)
    _gated_delta_rule_recurrent(q, k, v, g, beta, state, scale, o)
    rows, zr, outr = o.reshape(hv, dv), z.reshape(hv, dv), out.reshape(hv, dv)
    if silu_gate:
        _gated_rmsnorm_rows(rows, zr, norm_w, eps, outr)
    else:
        normed = np.empty((hv, dv), np.float32)
        _rmsnorm_rows(rows, norm_w, eps, normed)
        _mul_sigmoid(normed.reshape(-1), z, out)


class DecodeStep:
    """A DeltaNet layer's mixer for one decoded token between its input and output projections, its weights checked
    once: ``step(qkv, z, ba, conv_state, state)`` -> the gated, normed rule output [hv * dv] (what the output
    projection takes), advancing conv_state and state as causal_conv1d and gated_delta_rule_recurrent do.

    qkv [2 hk dk + hv dv]: the input projection's q, k, v channels; z [hv dv]: its gate; ba: the b/a projection,
    fused_ba: as ssm_ba stores it (per key head its hv/hk betas then as many alphas), else the betas [hv] then the
    alphas [hv]. conv_w [channels, kernel], ssm_a and dt_bias [hv], norm_w [dv]: as GGUF stores them. tiled: value
    head h reads key head h % hk (else h // (hv / hk)); silu_gate: rmsnorm(o) * w * silu(z), else
    rmsnorm(o) * w * sigmoid(z).
    """

    def __init__(self, conv_w: np.ndarray, ssm_a: np.ndarray, dt_bias: np.ndarray, norm_w: np.ndarray, eps: float,
                 hk: int, dk: int, hv: int, dv: int, fused_ba: bool, tiled: bool, silu_gate: bool,
                 scale: float | None = None):
        require_positive("key heads", hk)
        if hv % hk:
            raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
        self.channels = 2 * hk * dk + hv * dv
        require_array("conv weight", conv_w, (self.channels, None))
        require_positive("conv kernel size", conv_w.shape[1])
        for name, a, n in (("ssm_a", ssm_a, hv), ("dt_bias", dt_bias, hv), ("norm weight", norm_w, dv)):
            require_array(name, a, (n,))
        self.hv, self.dk, self.dv, self.kernel = hv, dk, dv, conv_w.shape[1]
        self._fused_ba = bool(fused_ba)
        self._args = (_transposed(conv_w), ssm_a, dt_bias)
        self._rest = (norm_w, float(eps), hk, dk, hv, dv, bool(tiled), bool(silu_gate), _scale(dk, scale))

    @property
    def fused_ba(self) -> bool:
        return self._fused_ba

    def kernel_weights(self) -> tuple[tuple, tuple]:
        """_decode_step's (conv weight, ssm_a, dt_bias) and its arguments after the state (norm weight, eps,
        shapes, flags, scale): for a compiled caller that runs the step inside a larger call (decode_layer)."""
        return self._args, self._rest

    def check_states(self, conv_state: np.ndarray, state: np.ndarray) -> None:
        """Raise where conv_state or state is not this layer's (shape, float32, writable)."""
        require_array("conv_state", conv_state, (self.kernel - 1, self.channels), writable=True)
        require_array("state", state, (self.hv, self.dk, self.dv), writable=True)

    def __call__(self, qkv: np.ndarray, z: np.ndarray, ba: np.ndarray, conv_state: np.ndarray,
                 state: np.ndarray) -> np.ndarray:
        hv, dv = self.hv, self.dv
        require_array("qkv", qkv, (self.channels,))
        require_array("z", z, (hv * dv,))
        require_array("ba", ba, (2 * hv,))
        self.check_states(conv_state, state)
        out = np.empty(hv * dv, np.float32)
        _decode_step(qkv, z, ba, self._fused_ba, conv_state, *self._args, state, *self._rest, out)
        return out
