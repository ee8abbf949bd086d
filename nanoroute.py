"""
nanoroute: a minimal GPT whose residual stream is a choice of depth routing.

    residual = prenorm | rezero | layerscale | attnres
    on top of attnres:  wav = True   (WAV v1 multi-resolution block sources)
                        rd  = decoupled | tied | average | frozen_v   (RD-AttnRes)

The mathematics is in SPEC.md; comments marked "# SPEC: <section>" point to it.

References:
1) nanoGPT model.py, A. Karpathy: https://github.com/karpathy/nanoGPT/blob/master/model.py
2) Attention Residuals, Kimi Team, arXiv:2603.15031 (Full / Block AttnRes, two-phase reads)
3) WAV v1, K. Wang 2026, arXiv:2606.06564v1 (phase and split detail bases)
4) RD-AttnRes, K. Wang 2026, arXiv:2608.01075 (role-decoupled attention reads)
5) ReZero, Bachlechner et al. 2020, arXiv:2003.04887
6) LayerScale (CaiT), Touvron et al. 2021, arXiv:2103.17239
7) RoFormer (rotary position embedding), Su et al. 2021, arXiv:2104.09864

Choices SPEC.md leaves open, made here:
- Positions: rotary embeddings (RoPE) on queries and keys, so the embedding e that AttnRes reads
  is the token embedding alone. No position table to crop, relative positions for char-level data.
- Norms: RMSNorm without a learnable gain everywhere (sublayer inputs, final norm, routing keys).
  A key-norm gain would be redundant with the pseudo-query (SPEC: wᵀ(g⊙k̂) = (w⊙g)ᵀk̂).
- WAV: rho (wav_rho) defaults to 4.0: the paper's value is not public; 4 lets a detail basis be
  matched up to the scale of its state source unless it is nearly cancelled (< 1/4 of it).
  One detail bias per read and per basis. With rd=frozen_v the value route keeps its detail bias
  frozen at its initial value, like its zero query.
- attnres_block=0 (default) picks whole layers per block and at most 8 blocks:
  m = 2·ceil(n_layer / 8) sublayers (4 at least with WAV).
"""

import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

RESIDUALS = ("prenorm", "rezero", "layerscale", "attnres")
RD_MODES = ("off", "decoupled", "tied", "average", "frozen_v")
WAV_BASES = {"phase": ("phase",), "split": ("split",), "both": ("phase", "split")}
EPS = 1e-6  # RMSNorm epsilon, for sublayer inputs and routing keys alike


@dataclass
class GPTConfig:
    vocab_size: int = 256
    sequence_len: int = 256  # context length in tokens ("block" means a routing block here)
    n_layer: int = 6  # Transformer layers; each has two sublayers (attention, MLP)
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False  # biases in Linear layers
    residual: str = "prenorm"  # prenorm | rezero | layerscale | attnres
    attnres_block: int = 0  # sublayers per routing block; 1 = Full AttnRes; 0 = auto (see top)
    wav: bool = False  # WAV v1 detail sources (needs residual=attnres)
    wav_bases: str = "both"  # phase | split | both
    wav_rho: float = 4.0  # cap on the detached RMS-matching scale of detail sources
    wav_detail_bias: float = -2.0  # initial logit offset of every detail source
    wav_readout_details: bool = False  # let the final readout read detail sources too
    rd: str = "off"  # off | decoupled | tied | average | frozen_v (needs residual=attnres)
    fast_routing: bool = True  # False: the readable reference read (slow; for checking)

    def __post_init__(self):
        self.validate()

    def validate(self):
        def bad(field, fix):
            raise ValueError(f"{field}={getattr(self, field)!r}: {fix}")

        for f in ("vocab_size", "sequence_len", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                bad(f, "must be a positive integer")
        if self.n_embd % self.n_head:
            bad("n_embd", f"must be divisible by n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            bad("n_head", f"head size n_embd/n_head={self.n_embd // self.n_head} must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", "must be in [0, 1)")
        if self.residual not in RESIDUALS:
            bad("residual", f"must be one of {', '.join(RESIDUALS)}")
        if self.rd not in RD_MODES:
            bad("rd", f"must be one of {', '.join(RD_MODES)}")
        if self.wav_bases not in WAV_BASES:
            bad("wav_bases", f"must be one of {', '.join(WAV_BASES)}")
        if not isinstance(self.attnres_block, int) or not 0 <= self.attnres_block <= 2 * self.n_layer:
            bad("attnres_block", f"must be 0 (auto) or 1..2*n_layer={2 * self.n_layer} sublayers")
        if not self.wav_rho > 0:  # also catches NaN
            bad("wav_rho", "must be > 0")
        if not math.isfinite(self.wav_detail_bias):
            bad("wav_detail_bias", "must be a finite number (e.g. -2.0)")
        if self.residual != "attnres":
            fix = "applies only to residual=attnres: add --residual attnres"
            if self.wav:
                bad("wav", fix)
            if self.rd != "off":
                bad("rd", fix)
            if self.attnres_block != 0:
                bad("attnres_block", fix)
        if not self.wav:  # WAV knobs without WAV would be silently ignored
            for f, default in (("wav_bases", "both"), ("wav_rho", 4.0), ("wav_detail_bias", -2.0),
                               ("wav_readout_details", False)):
                if getattr(self, f) != default:
                    bad(f, "applies only with wav=True: add --wav True")
        elif self.attnres_block and (self.attnres_block % 2 or self.attnres_block < 4):
            # SPEC: WAV needs an even block (zero-sum bases) of at least 4 (m = 2 makes phase == split)
            bad("attnres_block", "WAV needs an even routing block of at least 4 sublayers, e.g. 4")
        elif self.n_layer < 2:
            bad("n_layer", "WAV needs at least 2 layers (one routing block of 4 sublayers)")

    @property
    def routing_block(self):
        """m, the number of sublayers per routing block (resolves attnres_block=0)."""
        if self.attnres_block:
            return self.attnres_block
        m = 2 * math.ceil(self.n_layer / 8)  # whole layers, at most 8 blocks
        return max(m, 4) if self.wav else m

    @property
    def detail_bases(self):
        return WAV_BASES[self.wav_bases] if self.wav else ()


def norm(x):
    # parameterless RMSNorm; a gain would only rescale what the next Linear learns anyway
    return F.rms_norm(x, (x.size(-1),), eps=EPS)


def float32(x):
    """Context for routing math: autocast off, since it would run vecdot and matmul in bf16
    (entered only when autocast is on: the context manager costs more than a small op)."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def mean_square(v):
    # per-token mean(v²) in float32 (B, T): one fused reduction
    with float32(v):
        return torch.linalg.vector_norm(v.float(), dim=-1).square() / v.size(-1)


# -----------------------------------------------------------------------------
# The depth read. SPEC: Attention Residuals, h = Σ_s α_s v_s with α = softmax_s(wᵀ RMSNorm(v_s) + bias_s)


def depth_read_reference(query, bias, values):
    """The readable definition of one read. query (d,), bias (S,), values: S tensors (B, T, d).
    Returns h (B, T, d) and the weights α (S, B, T). No 1/sqrt(d) temperature (SPEC)."""
    with float32(values[0]):
        V = torch.stack([v.float() for v in values])  # (S, B, T, d)
        logits = norm(V) @ query.float() + bias.float()[:, None, None]  # (S, B, T)
        weights = logits.softmax(0)
        return (weights[..., None] * V).sum(0), weights


def phase1(queries, biases, values, rinv):
    """The forward math of Phase1: queries (R, d), biases (R, S), S sources (B, T, d) and their rinv.
    Returns mix (B, T, R, d), lse (B, T, R), p (B, T, S, R), the stacked rinv (B, T, S) and the dot
    products vᵀw (B, T, S, R)."""
    with float32(values[0]):
        V = torch.stack(values, dim=2).float()  # (B, T, S, d)
        rinv = torch.stack(rinv, dim=2)  # (B, T, S)
        dots = V @ queries.float().t()  # (B, T, S, R)
        logits = dots * rinv[..., None] + biases.float().t()
        lse = logits.logsumexp(2)  # (B, T, R)
        p = (logits - lse[:, :, None]).exp()
        mix = p.transpose(2, 3) @ V  # (B, T, R, S) @ (B, T, S, d) -> (B, T, R, d)
    return mix, lse, p, rinv, dots


def phase2(mix, lse, query, bias, rinv, scale, sigma, pieces):
    """The forward math of Phase2: one read's phase-1 summary, its query (d,), and the P partial
    sources, each a signed sum of the block's K pieces, source_p = scale_p · Σ_k sigma[p, k] · piece_k
    (SPEC: WAV bases; scale 1 for the state): biases (P,), inverse RMS and detached scales (P, B, T),
    sigma (P, K) of ±1 (None: one source, the one piece, as without WAV), pieces (B, T, d).
    Returns h (B, T, d), the merge weights a (1+P, B, T) and the dot products sourceᵀw (P, B, T)."""
    with float32(mix):
        q = query.float()
        # vecdot, not v @ q: a per-token dot product is one fused pass, matrix-vector is 2x slower on CPU
        dots = _per_source(sigma, torch.stack([torch.linalg.vecdot(v.float(), q) for v in pieces])) * scale
        a = torch.cat([lse[None], dots * rinv + bias.float()[:, None, None]]).softmax(0)
        h = a[0][..., None] * mix
        for v, w in zip(pieces, _per_piece(sigma, a[1:] * scale)):  # each piece's weight in h
            h.addcmul_(w[..., None], v.float())
    return h, a, dots


def _per_source(sigma, x):
    """Σ_k sigma[p, k]·x_k for every source p: (K, ...) -> (P, ...)."""
    return x if sigma is None else (sigma @ x.flatten(1)).view(sigma.size(0), *x.shape[1:])


def _per_piece(sigma, x):
    """Σ_p sigma[p, k]·x_p for every piece k: (P, ...) -> (K, ...)."""
    return x if sigma is None else (sigma.t() @ x.flatten(1)).view(sigma.size(1), *x.shape[1:])


class Phase1(torch.autograd.Function):
    """Phase 1 of the two-phase read (SPEC: Two-phase computation): the R reads of a routing block
    against its S completed sources, in one batched pass. For read r it returns the mixture of the
    completed sources normalised over them, mix_r (B, T, d), and its log-sum-exp lse_r (B, T), which
    phase 2 treats as one source with logit lse_r; and the weights p (B, T, S, R), for diagnostics.
    The backward is batched the same way, so each source gets one gradient per block instead of one
    per read. It saves the dot products vᵀw (as small as p) and recomputes p from them; the sources
    are held by the model anyway:
        dlogit_rs = p_rs (⟨dmix_r, v_s⟩ − Σ_s' p_rs' ⟨dmix_r, v_s'⟩ + dlse_r)
        dv_s = Σ_r p_rs dmix_r + dlogit_rs·rinv_s·w_r,  dw_r = Σ dlogit_rs·rinv_s·v_s,
        drinv_s = Σ_r dlogit_rs·(v_s·w_r),  dbias_rs = Σ dlogit_rs."""

    @staticmethod
    def forward(ctx, queries, biases, *values_and_rinv):
        S = len(values_and_rinv) // 2
        mix, lse, p, rinv, dots = phase1(queries, biases, values_and_rinv[:S], values_and_rinv[S:])
        ctx.save_for_backward(queries, biases, rinv, dots, lse, *values_and_rinv[:S])
        ctx.mark_non_differentiable(p)
        return (*mix.unbind(2), *lse.unbind(2), p)

    @staticmethod
    def backward(ctx, *grads):
        queries, biases, rinv, dots, lse, *values = ctx.saved_tensors
        R = queries.size(0)
        Q = queries.float()
        p = (dots * rinv[..., None] + biases.float().t() - lse[:, :, None]).exp()  # as in the forward
        dmix = torch.stack(grads[:R], dim=2).float()  # (B, T, R, d)
        dlse = torch.stack(grads[R:2 * R], dim=2).float()  # (B, T, R)
        V = torch.stack(values, dim=2).float()  # (B, T, S, d)
        g = (dmix @ V.transpose(2, 3)).transpose(2, 3)  # (B, T, S, R): ⟨dmix_r, v_s⟩
        dlogits = p * (g - (p * g).sum(2, keepdim=True) + dlse[:, :, None])
        c = dlogits * rinv[..., None]
        dV = p @ dmix + c @ Q  # (B, T, S, d)
        dQ = c.flatten(0, 2).t() @ V.flatten(0, 2)  # (R, d)
        drinv = (dlogits * dots).sum(-1)  # (B, T, S)
        dbiases = dlogits.sum((0, 1)).t()  # (R, S)
        return dQ.to(queries.dtype), dbiases, *(t.to(v.dtype) for t, v in zip(dV.unbind(2), values)), \
            *drinv.unbind(2)


class Phase2(torch.autograd.Function):
    """Phase 2: one read merges its phase-1 summary (mix, lse) with the sources of the partial block,
    by a softmax over [lse, logits of the partial sources] (the online-softmax merge). Returns h and the
    merge weights a (1+P, B, T). The partial sources come folded: as the block's pieces (its updates
    summed by sign pattern, SPEC: WAV bases), the signs sigma that make each source from them, and the
    sources' detached scales and inverse RMS. So the P sources of a read are never materialised, the
    key norm and the WAV scale need no graph nodes, and a sublayer leaves one new tensor (the piece it
    wrote) for the backward, as Block AttnRes does, however many detail bases WAV has. Saves h, the
    pieces (shared with the block's other reads) and P×B×T numbers. Backward, with source
    ṽ_p = s_p·v_p, v_p = Σ_k σ_pk·piece_k and rinv_p = (s_p²·mean(v_p²) + ε)^(−1/2):
        dlogit_p = a_p (⟨dh, ṽ_p⟩ − ⟨dh, h⟩),  dlse = −Σ_p dlogit_p (softmax gradients sum to zero,
        so no copy of mix is needed),  dmix = a_0 dh,
        dv_p = s_p (a_p dh + dlogit_p·rinv_p·w) − dlogit_p·(ṽ_p·w)·rinv_p³·s_p²/d · v_p,
        dpiece_k = Σ_p σ_pk dv_p."""

    @staticmethod
    def forward(ctx, mix, lse, query, bias, rinv, scale, sigma, *pieces):
        h, a, dots = phase2(mix, lse, query, bias, rinv, scale, sigma, pieces)
        ctx.save_for_backward(query, rinv, scale, sigma, dots, a, h, *pieces)
        ctx.mark_non_differentiable(a)
        return h, a

    @staticmethod
    def backward(ctx, dh, _):
        query, rinv, scale, sigma, dots, a, h, *pieces = ctx.saved_tensors
        dh, q = dh.float(), query.float()
        pieces = [v.float() for v in pieces]
        g = _per_source(sigma, torch.stack([torch.linalg.vecdot(dh, v) for v in pieces]))
        dlogit = a[1:] * (g * scale - torch.linalg.vecdot(dh, h))  # (P, B, T)
        c = dlogit * rinv * scale  # through the dot product
        norm_term = dlogit * dots * rinv.pow(3) * scale.square() / h.size(-1)  # through the key norm
        c_k, a_k = _per_piece(sigma, c), _per_piece(sigma, a[1:] * scale)
        # −Σ_p σ_pk·norm_term_p·v_p = Σ_j M_kj·piece_j, M_kj = −Σ_p σ_pk·σ_pj·norm_term_p
        M = -norm_term[:, None] if sigma is None else -_per_piece(sigma, sigma[:, :, None, None] * norm_term[:, None])
        dquery = sum(c_k[k].flatten() @ v.flatten(0, 1) for k, v in enumerate(pieces))
        dpieces = []
        for k in range(len(pieces)):
            dv = torch.addcmul(c_k[k][..., None] * q, a_k[k][..., None], dh)
            for j, v in enumerate(pieces):
                dv.addcmul_(M[k, j][..., None], v)
            dpieces.append(dv)
        return (a[0][..., None] * dh, -dlogit.sum(0), dquery.to(query.dtype), dlogit.sum((1, 2)), None, None, None,
                *(dv.to(v.dtype) for dv, v in zip(dpieces, ctx.saved_tensors[7:])))


class Source(NamedTuple):
    """One entry of the source pool: its name (emb, C0, C0.phase, ..., P, P.split), its value
    (B, T, d), its inverse RMS (B, T), and its basis (0 state, 1.. detail basis). For the partial
    block on the fast path the source is folded: value is None (Phase2 makes it from the block's
    pieces), scale is its detached RMS-matching scale (B, T), and rinv is detached: Phase2 applies
    both, and their gradients, itself."""
    name: str
    value: torch.Tensor
    rinv: torch.Tensor
    basis: int
    scale: torch.Tensor = None


class Partial(NamedTuple):
    """The routing block being filled: its running sums by basis (SPEC: partial source P and its
    details) and, on the fast path, its pieces (see GPT._write), which then carry the gradient."""
    sums: dict
    pieces: dict


# -----------------------------------------------------------------------------
# Transformer sublayers


def rotary_tables(sequence_len, head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(sequence_len).float(), inv_freq)  # (T, hs/2)
    return freqs.cos(), freqs.sin()


def apply_rotary(x, cos, sin):  # x (B, nh, T, hs), cos/sin (T, hs/2)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class KVCache:
    """Keys and values of every layer for generation. Only attention needs a cache: depth routing
    mixes sources of the same token, so it is recomputed per new token at no extra cost."""

    def __init__(self, n_layer, batch, n_head, max_len, head_dim, device, dtype):
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # tokens already in the cache

    def update(self, layer, k, v):  # k, v (B, nh, T, hs) at positions pos..pos+T-1
        assert self.pos == 0 or k.size(2) == 1, "after the prefill, feed one token at a time"
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope, x_v=None, cache=None, layer=0):
        B, T, C = x.size()
        if x_v is None:
            q, k, v = self.c_attn(x).split(C, dim=2)
        else:  # SPEC: RD-AttnRes, queries and keys read h^QK, values read h^V (same weights)
            w_qk, w_v = self.c_attn.weight.split([2 * C, C])
            b_qk, b_v = self.c_attn.bias.split([2 * C, C]) if self.c_attn.bias is not None else (None, None)
            q, k = F.linear(x, w_qk, b_qk).split(C, dim=2)
            v = F.linear(x_v, w_v, b_v)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        # with a cache: prefill (empty cache) is causal; a single new token sees every cached key
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=T > 1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Layer(nn.Module):
    """One Transformer layer: sublayer 2j (attention) and 2j+1 (MLP). How their inputs and outputs
    join the residual stream is the routing, and lives in GPT."""

    def __init__(self, config):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)


# -----------------------------------------------------------------------------
# The model


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        d, n_sub = config.n_embd, 2 * config.n_layer
        self.wte = nn.Embedding(config.vocab_size, d)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.n_layer)])
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied: https://paperswithcode.com/method/weight-tying
        cos, sin = rotary_tables(config.sequence_len, d // config.n_head)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

        # Routing parameters are created from constants, never from the random stream, so that two
        # configs with the same seed start with identical shared weights (SPEC: Paired experiments).
        self.residual_gain = None
        if config.residual == "rezero":  # SPEC: x += α_l·f(x), α_l = 0
            self.residual_gain = nn.Parameter(torch.zeros(n_sub, 1))
        elif config.residual == "layerscale":  # SPEC: x += γ_l ⊙ f(norm(x)), CaiT's initial γ
            gamma = 0.1 if config.n_layer <= 18 else 1e-5 if config.n_layer <= 24 else 1e-6
            self.residual_gain = nn.Parameter(torch.full((n_sub, d), gamma))
        if config.residual == "attnres":
            # One pseudo-query per read, zero-initialised (SPEC), and per read one detail bias per
            # WAV basis. Reads in forward order: layer{j}.attn, [layer{j}.attn.v,] layer{j}.mlp, readout.
            self.read_names = [name for j in range(config.n_layer) for name in self._layer_reads(j)]
            self.read_names.append("readout")
            # The first sublayer reads e alone (weight 1 whatever its query), so it has no parameters;
            # neither has rd=frozen_v's value route, whose query stays zero and detail bias at its init.
            learned = [r for r in self.read_names if not r.startswith("layer0.attn")
                       and not (config.rd == "frozen_v" and r.endswith(".v"))]
            self.query = nn.ParameterDict({_key(r): nn.Parameter(torch.zeros(d)) for r in learned})
            n_bases = len(config.detail_bases)
            reads_details = [r for r in learned if r != "readout" or config.wav_readout_details]
            self.detail_bias = nn.ParameterDict(
                {_key(r): nn.Parameter(torch.full((n_bases,), config.wav_detail_bias)) for r in reads_details}
                if n_bases else {})
            self.register_buffer("frozen_query", torch.zeros(d), persistent=False)
            self.register_buffer("frozen_detail_bias", torch.full((n_bases,), config.wav_detail_bias),
                                 persistent=False)

        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(n_sub))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def _layer_reads(self, j):
        v_route = [f"layer{j}.attn.v"] if self.config.rd in ("decoupled", "average", "frozen_v") else []
        return [f"layer{j}.attn", *v_route, f"layer{j}.mlp"]

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    # ----- forward -----------------------------------------------------------------

    def forward(self, idx, targets=None, return_routes=False):
        routes = [] if return_routes else None
        logits = self.lm_head(self._hidden(idx, routes=routes))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return (logits, loss, routes) if return_routes else (logits, loss)

    def _hidden(self, idx, cache=None, routes=None):
        """Final normed hidden states (B, T, d) for tokens idx (B, T) at positions cache.pos onward."""
        B, T = idx.size()
        start = cache.pos if cache is not None else 0
        if start + T > self.config.sequence_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds sequence_len={self.config.sequence_len}")
        rope = (self.rope_cos[start:start + T], self.rope_sin[start:start + T])
        e = self.drop(self.wte(idx))
        if self.config.residual == "attnres":
            x = self._attnres(e, rope, cache, routes)
        else:
            x = self._residual(e, rope, cache)
        if cache is not None:
            cache.pos += T
        return norm(x)

    def _sublayer(self, l, x, rope, cache, x_v=None):
        """u_l = f_l(norm(x)); ReZero feeds f_l the raw stream (SPEC: no pre-norm inside)."""
        layer = self.layers[l // 2]
        prep = (lambda t: t) if self.config.residual == "rezero" else norm
        if l % 2 == 0:
            return layer.attn(prep(x), rope, None if x_v is None else prep(x_v), cache, l // 2)
        return layer.mlp(prep(x))

    def _residual(self, x, rope, cache):
        # SPEC: prenorm x += f(norm(x)); rezero x += α·f(x); layerscale x += γ⊙f(norm(x))
        for l in range(2 * self.config.n_layer):
            u = self._sublayer(l, x, rope, cache)
            x = x + u if self.residual_gain is None else x + self.residual_gain[l] * u
        return x

    def _attnres(self, e, rope, cache, routes):
        """SPEC: Attention Residuals. Sublayer l reads the pool [e, C_0, ..., C_{b-1}, P] (with WAV:
        each block also brings its detail sources), runs on the read, and writes its update into
        the partial block P. Reads of a block share one phase-1 pass over the completed sources."""
        cfg, m, n_sub = self.config, self.config.routing_block, 2 * self.config.n_layer
        # Generation (a KV cache, no graph) reads one token at a time: the batched two-phase path has
        # nothing to batch there and costs more small ops than the direct reference read.
        fast = cfg.fast_routing and (cache is None or torch.is_grad_enabled())
        done = self._sources({"state": e}, "emb")  # completed sources
        partial = Partial({}, {})  # the block being filled (SPEC: partial source P)
        for l in range(n_sub):
            if l % m == 0:  # a new block: phase 1 for all its reads over the completed sources
                names = [r for k in range(l, min(l + m, n_sub)) for r in self._sublayer_reads(k)]
                prefix = self._prefix(names, done) if fast else {}
            pool = done + self._partial_sources(partial, fast)

            def read(name):
                return self._read(name, pool, prefix.get(name), routes, partial.pieces)

            x_v = None
            if l % 2 == 1:
                x = read(f"layer{l // 2}.mlp")
            elif cfg.rd in ("off", "tied"):  # tied: w^V ≡ w^QK, one read serves Q, K and V
                x = read(f"layer{l // 2}.attn")
                if cfg.rd == "tied" and routes is not None:  # list the (identical) value route too
                    routes.append(dict(routes[-1], name=f"layer{l // 2}.attn.v"))
            else:  # SPEC: RD-AttnRes, two routes over the same pool and key norm
                x, x_v = read(f"layer{l // 2}.attn"), read(f"layer{l // 2}.attn.v")
                if cfg.rd == "average":  # Q, K and V all read ½(h^QK + h^V)
                    x, x_v = 0.5 * (x + x_v), None
            u = self._sublayer(l, x, rope, cache, x_v)
            partial = self._write(partial, u, l, fast)
            if (l + 1) % m == 0:  # block complete: P becomes C_b (and its details)
                sums = self._signed_sums(partial.pieces) if fast else partial.sums
                done = done + self._sources(sums, f"C{l // m}")
                partial = Partial({}, {})
        # SPEC: final readout, one more read over the final pool (details only if asked for)
        if not cfg.wav_readout_details:
            done = [s for s in done if s.basis == 0]
        prefix = self._prefix(["readout"], done)["readout"] if fast else None
        pool = done + [s for s in self._partial_sources(partial, fast) if cfg.wav_readout_details or s.basis == 0]
        return self._read("readout", pool, prefix, routes, partial.pieces)

    def _sublayer_reads(self, l):
        return self._layer_reads(l // 2)[:-1] if l % 2 == 0 else [f"layer{l // 2}.mlp"]

    def _write(self, partial, u, l, fast):
        """Add the update u of sublayer l to the running sums of its block. SPEC: WAV v1, the state
        adds every update; the phase basis adds attention updates and subtracts MLP updates; the
        split basis adds the first half of the full block and subtracts the second.
        On the fast path the gradient goes through the block's pieces instead: its updates summed by
        their signs in the detail bases (attention or MLP, first or second half: at most 4 pieces;
        without WAV one, the state itself). Every running sum is a signed sum of the pieces
        (_signed_sums) and a sublayer adds to one piece only, so it leaves one tensor for the
        backward (see Phase2); the running sums are then kept without gradient, for the key norms."""
        signs = self._signs(l)
        u = u.float()  # sources accumulate in float32, like nanoGPT's residual stream
        pieces = {}
        if fast:
            key = tuple(signs[b] for b in self.config.detail_bases)
            pieces = {**partial.pieces, key: partial.pieces[key] + u if key in partial.pieces else u}
            if not self.config.wav:
                return Partial({"state": pieces[()]}, pieces)  # the one piece is the state
        with torch.no_grad() if fast else contextlib.nullcontext():
            if not partial.sums:  # a new block; details get tensors of their own (torch.compile rejects aliases)
                sums = {b: u if b == "state" else u * signs[b] for b in ("state", *self.config.detail_bases)}
            else:
                sums = {b: torch.add(v, u, alpha=signs.get(b, 1)) for b, v in partial.sums.items()}
        return Partial(sums, pieces)

    def _signs(self, l):
        m = self.config.routing_block
        return {"phase": 1 if l % 2 == 0 else -1, "split": 1 if l % m < m / 2 else -1}

    def _signed_sums(self, pieces):
        """The running sums of the block, by basis: {"state": Σ_k piece_k, basis: Σ_k ±piece_k}."""
        sums = {}
        for j, basis in enumerate(("state", *self.config.detail_bases)):
            for key, piece in pieces.items():
                sign = key[j - 1] if j else 1
                if basis not in sums:
                    sums[basis] = piece if sign == 1 else -piece
                else:
                    sums[basis] = torch.add(sums[basis], piece, alpha=sign)
        return sums

    def _partial_sources(self, partial, fast):
        """The partial block's sources P (and its details): folded on the fast path (see Source)."""
        with torch.no_grad() if fast else contextlib.nullcontext():
            return self._sources(partial.sums, "P", folded=fast)

    def _sources(self, sums, name, folded=False):
        """Pool entries of one block from its running sums: the state source, then each detail
        basis, RMS-matched to the state with a detached scale capped at rho (SPEC: WAV stability 2).
        A source's inverse RMS is computed once, for every later read: RMSNorm(v)·w =
        (v·w)·rsqrt(mean(v²)+ε), and mean((s·D)²) = s²·mean(D²) for a detail; but with a graph, a
        detail's is taken from the scaled source, which phase 1 keeps anyway, so that the backward
        does not keep the unscaled sum D too.
        folded=True (the partial block, fast path): no values; Phase2 applies scale and key norm."""
        if not sums:
            return []
        state_ms = mean_square(sums["state"])
        out = [Source(name, None if folded else sums["state"], torch.rsqrt(state_ms + EPS), 0)]
        for k, basis in enumerate(self.config.detail_bases, start=1):
            if basis not in sums:  # the embedding e is a state source only
                continue
            with torch.no_grad():  # s = min(rho, rms(C) / (rms(D) + ε)), no gradient through s
                detail_ms = mean_square(sums[basis])
                scale = (state_ms.sqrt() / (detail_ms.sqrt() + EPS)).clamp(max=self.config.wav_rho)
            if folded:
                out.append(Source(f"{name}.{basis}", None, torch.rsqrt(scale.square() * detail_ms + EPS), k, scale))
                continue
            value = sums[basis] * scale[..., None]
            ms = mean_square(value) if value.requires_grad else scale.square() * detail_ms
            out.append(Source(f"{name}.{basis}", value, torch.rsqrt(ms + EPS), k))
        return out

    def _route_params(self, name, pool):
        """The read's pseudo-query (d,) and its per-source logit bias (S,): 0 for state sources,
        the read's detail bias for detail sources (SPEC: WAV stability 1)."""
        learned = _key(name) in self.query
        query = self.query[_key(name)] if learned else self.frozen_query
        if not self.config.wav or all(s.basis == 0 for s in pool):
            return query, query.new_zeros(len(pool))
        beta = self.detail_bias[_key(name)] if learned else self.frozen_detail_bias
        # the pool is e, then one group (state, detail bases...) per block: [0, 0, β, 0, β, ...]
        group = torch.cat([beta.new_zeros(1), beta])
        return query, torch.cat([beta.new_zeros(1), group.repeat((len(pool) - 1) // len(group))])

    def _prefix(self, names, done):
        """Phase 1 for the reads `names` over the completed sources: {name: (mix, lse, p)}."""
        params = [self._route_params(name, done) for name in names]
        queries, biases = torch.stack([q for q, _ in params]), torch.stack([b for _, b in params])
        values, rinv = [s.value for s in done], [s.rinv for s in done]
        if torch.is_grad_enabled():
            out = Phase1.apply(queries, biases, *values, *rinv)
            mix, lse, p = out[:len(names)], out[len(names):-1], out[-1]
        else:  # no graph to build (eval, generation): the same math without the autograd.Function
            mix, lse, p, _, _ = phase1(queries, biases, values, rinv)
            mix, lse = mix.unbind(2), lse.unbind(2)
        return {name: (mix[r], lse[r], p[..., r]) for r, name in enumerate(names)}

    def _read(self, name, pool, prefix, routes, pieces):
        """SPEC: one depth read h = Σ_s α_s v_s. Fast: phase 1's summary of the completed sources
        merged with the rest of the pool (phase 2); else the reference form over the whole pool."""
        query, bias = self._route_params(name, pool)
        if prefix is None:
            h, weights = depth_read_reference(query, bias, [s.value for s in pool])
        else:
            mix, lse, p = prefix
            rest = pool[p.size(2):]  # the partial block's sources
            if rest:
                rinv = torch.stack([s.rinv for s in rest])
                scale = torch.stack([torch.ones_like(s.rinv) if s.scale is None else s.scale for s in rest])
                sigma = None if not self.config.wav else torch.tensor(
                    [[key[s.basis - 1] if s.basis else 1 for key in pieces] for s in rest],
                    dtype=torch.float32, device=rinv.device)
                args = (mix, lse, query, bias[p.size(2):], rinv, scale, sigma)
                values = list(pieces.values())
                h, a = Phase2.apply(*args, *values) if torch.is_grad_enabled() else phase2(*args, values)[:2]
                weights = torch.cat([a[0] * p.permute(2, 0, 1), a[1:]]) if routes is not None else None
            else:  # a compact copy: a view would keep phase 1's output for the whole block alive
                h, weights = mix.contiguous(), p.permute(2, 0, 1)
        if routes is not None:
            routes.append(dict(name=name, sources=[s.name for s in pool], weights=weights.detach()))
        return h

    # ----- training helpers ----------------------------------------------------------

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), device_type="cpu"):
        """AdamW with weight decay on the matrices of Linear and Embedding layers only: pseudo-queries,
        detail biases, ReZero/LayerScale gains and biases get none (SPEC: Numerics)."""
        matrices = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        decay = [p for p in self.parameters() if id(p) in matrices]
        no_decay = [p for p in self.parameters() if id(p) not in matrices]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops=989e12):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (default: H100/H200 bf16 dense).
        Counts 6N per token for the matmuls plus attention (PaLM appendix B); routing is negligible."""
        cfg = self.config
        flops_per_token = 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.sequence_len
        return flops_per_token * tokens_per_iter / dt / peak_flops

    # ----- generation ------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens tokens after idx (B, T) with a KV cache. Past sequence_len tokens the
        context is the last sequence_len tokens (as in nanoGPT), re-encoded at each step: exact, slower."""
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r}: must be > 0 (use top_k=1 for greedy decoding)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k!r}: must be >= 1, or None for no cut-off")
        cfg, cache = self.config, None
        for _ in range(max_new_tokens):
            if cache is None or cache.pos >= cfg.sequence_len:  # (re)fill the cache with the context
                context = idx[:, -cfg.sequence_len:]
                dtype = torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type) \
                    else self.lm_head.weight.dtype
                cache = KVCache(cfg.n_layer, idx.size(0), cfg.n_head, cfg.sequence_len,
                                cfg.n_embd // cfg.n_head, idx.device, dtype)
            else:
                context = idx[:, -1:]
            logits = self.lm_head(self._hidden(context, cache)[:, -1]).float()
            if top_k == 1:  # greedy: the likeliest token (the first of equals), no random draw
                idx_next = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def _key(read_name):  # ParameterDict keys cannot contain "."
    return read_name.replace(".", "_")


# -----------------------------------------------------------------------------
# Routing diagnostics


def route_entropy(weights):
    """Entropy in nats of a route's weights (S, B, T) over sources, averaged over tokens."""
    return max(0.0, -torch.xlogy(weights, weights).sum(0).mean().item())  # (no -0.0 for one source)


def js_divergence(p, q):
    """Jensen-Shannon divergence in nats (≤ ln 2) between two routes (S, B, T) over the same pool,
    per token, averaged over tokens (SPEC: RD-AttnRes, Diagnostic)."""
    p, q = p.double(), q.double()
    mid = 0.5 * (p + q)
    kl = lambda a: (torch.xlogy(a, a) - torch.xlogy(a, mid)).sum(0)  # noqa: E731
    return (0.5 * kl(p) + 0.5 * kl(q)).clamp(min=0).mean().item()


def _pool_order(source):
    """Sort key of a source name in pool order: emb, C0, C0.phase, C0.split, C1, ..., P, P.phase, P.split."""
    block, _, basis = source.partition(".")
    return -1 if block == "emb" else math.inf if block == "P" else int(block[1:]), ("", "phase", "split").index(basis)


def routing_stats(routes):
    """Summary of model(..., return_routes=True)'s routes:
    {"reads": {name: {"sources": [...], "mean_weight": [...], "entropy": nats}},
     "sources": every source any read saw, in pool order (the columns of a reads × sources table),
     "js": {"layer{j}": nats, ...} (RD: QK route vs V route), "js_mean": nats or None}."""
    reads = {r["name"]: dict(sources=r["sources"], mean_weight=r["weights"].mean((1, 2)).tolist(),
                             entropy=route_entropy(r["weights"])) for r in routes}
    sources = sorted({s for r in routes for s in r["sources"]}, key=_pool_order)
    by_name = {r["name"]: r["weights"] for r in routes}
    js = {name[:-len(".attn.v")]: js_divergence(by_name[name[:-len(".v")]], w)
          for name, w in by_name.items() if name.endswith(".attn.v")}
    return dict(reads=reads, sources=sources, js=js, js_mean=sum(js.values()) / len(js) if js else None)
