"""
nanoroute: a minimal GPT whose residual stream is a choice of depth routing.

    residual = prenorm | rezero | layerscale | attnres
    on top of attnres:  wav = True   (WAV v1 multi-resolution block sources)
                        rd  = decoupled | tied | average | frozen_v   (RD-AttnRes)

Read top-down: config, Transformer pieces, the routing (pool, read, write, RD's routes, readout), the
GPT, generation, diagnostics; below the banner, a generic fast kernel for the reads. "# SPEC: <section>"
points to SPEC.md, "# choice:" to its list of choices the papers leave open; docs/routing.md says how
to change the routing.

References:
1) nanoGPT model.py, A. Karpathy: https://github.com/karpathy/nanoGPT/blob/master/model.py
2) Attention Residuals, Kimi Team, arXiv:2603.15031 (Full / Block AttnRes, two-phase reads)
3) WAV v1, K. Wang 2026, arXiv:2606.06564v1 (phase and split detail bases)
4) RD-AttnRes, K. Wang 2026, arXiv:2608.01075 (role-decoupled attention reads)
5) ReZero, Bachlechner et al. 2020, arXiv:2003.04887
6) LayerScale (CaiT), Touvron et al. 2021, arXiv:2103.17239
7) RoFormer (rotary position embedding), Su et al. 2021, arXiv:2104.09864
"""

import contextlib
import functools
import math
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

RESIDUALS = ("prenorm", "rezero", "layerscale", "attnres")
RD_MODES = ("off", "decoupled", "tied", "average", "frozen_v")
WAV_BASES = {"phase": ("phase",), "split": ("split",), "both": ("phase", "split")}
EPS = 1e-6  # RMSNorm epsilon, for sublayer inputs and routing keys alike


def setting(default, help, needs=None):
    """A config field with its help text (train.py's --help). needs="attnres" or "wav" marks a field of
    the depth routing: it is an error unless residual=attnres (and wav=True), and routing_fields lists it."""
    return field(default=default, metadata=dict(help=help, needs=needs))


@dataclass
class GPTConfig:
    vocab_size: int = setting(256, "vocabulary size")
    sequence_len: int = setting(256, "context length in tokens (\"block\" means a routing block here)")
    n_layer: int = setting(6, "Transformer layers; each has two sublayers (attention, MLP)")
    n_head: int = setting(6, "attention heads (head size n_embd/n_head, even)")
    n_embd: int = setting(384, "width of the residual stream")
    dropout: float = setting(0.0, "dropout probability")
    bias: bool = setting(False, "biases in Linear layers")
    residual: str = setting("prenorm", "prenorm | rezero | layerscale | attnres")
    attnres_block: int = setting(0, "sublayers per routing block; 1 = Full AttnRes; 0 = auto: whole layers, at "
                                    "most 8 blocks (at least 4 sublayers with WAV)", needs="attnres")
    wav: bool = setting(False, "WAV v1 detail sources (needs residual=attnres)", needs="attnres")
    wav_bases: str = setting("both", "phase | split | both", needs="wav")
    wav_rho: float = setting(4.0, "cap on the detached RMS-matching scale of detail sources", needs="wav")
    wav_detail_bias: float = setting(-2.0, "initial logit offset of every detail source", needs="wav")
    wav_readout_details: bool = setting(False, "let the final readout read detail sources too", needs="wav")
    wav_learned_bases: bool = setting(False, "learn the detail bases: a coefficient per sublayer and basis, "
                                             "started at the signs (beyond WAV v1)", needs="wav")
    rd: str = setting("off", "off | decoupled | tied | average | frozen_v (needs residual=attnres)", needs="attnres")
    fast_routing: bool = setting(True, "False: the readable reference read (slow; for checking)", needs="attnres")

    def __post_init__(self):
        self.validate()

    def validate(self):
        def bad(name, fix):
            raise ValueError(f"{name}={getattr(self, name)!r}: {fix}")
        for f in ("vocab_size", "sequence_len", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                bad(f, "must be a positive integer")
        if self.n_embd % self.n_head:
            bad("n_embd", f"must be divisible by n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            bad("n_head", f"head size n_embd/n_head={self.n_embd // self.n_head} must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", "must be in [0, 1)")
        for f, allowed in (("residual", RESIDUALS), ("rd", RD_MODES), ("wav_bases", WAV_BASES)):
            if getattr(self, f) not in allowed:
                bad(f, f"must be one of {', '.join(allowed)}")
        # a routing knob where it has no effect is an error, not silently ignored (needs=, see setting)
        for f in fields(self):
            needs, changed = f.metadata.get("needs"), getattr(self, f.name) != f.default
            if changed and needs and self.residual != "attnres":
                bad(f.name, "applies only to residual=attnres: add --residual attnres")
            if changed and needs == "wav" and not self.wav:
                bad(f.name, "applies only with wav=True: add --wav True")
        if not isinstance(self.attnres_block, int) or not 0 <= self.attnres_block <= 2 * self.n_layer:
            bad("attnres_block", f"must be 0 (auto) or 1..2*n_layer={2 * self.n_layer} sublayers")
        if not self.wav_rho > 0:  # also catches NaN
            bad("wav_rho", "must be > 0")
        if not math.isfinite(self.wav_detail_bias):
            bad("wav_detail_bias", "must be a finite number (e.g. -2.0)")
        if self.wav and self.attnres_block and (self.attnres_block % 2 or self.attnres_block < 4):
            # SPEC: WAV needs an even block (zero-sum bases) of at least 4 (m = 2 makes phase == split)
            bad("attnres_block", "WAV needs an even routing block of at least 4 sublayers, e.g. 4")
        if self.wav and self.n_layer < 2:
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


def routing_fields(config_class=GPTConfig):
    """The fields of the depth routing: residual and every field with needs= (a subclass's too). A
    paired baseline without routing (--residual prenorm) drops them all."""
    return ("residual",) + tuple(f.name for f in fields(config_class) if f.metadata.get("needs"))


# The routing variants this codebase compares, as GPTConfig values (train.py's presets, experiments.py's
# sweeps and bench.py use this table). All three fields are always given, so one variant's values never
# leak into another (a preset with wav=True, then --residual attnres --wav False --rd off, is Block AttnRes).
VARIANTS = {
    "prenorm": dict(residual="prenorm", wav=False, rd="off"),
    "rezero": dict(residual="rezero", wav=False, rd="off"),
    "layerscale": dict(residual="layerscale", wav=False, rd="off"),
    "block": dict(residual="attnres", wav=False, rd="off"),  # Block AttnRes: the parent of WAV and RD
    "wav": dict(residual="attnres", wav=True, rd="off"),
    "rd": dict(residual="attnres", wav=False, rd="decoupled"),
    "rd_tied": dict(residual="attnres", wav=False, rd="tied"),
    "rd_average": dict(residual="attnres", wav=False, rd="average"),
    "rd_frozen_v": dict(residual="attnres", wav=False, rd="frozen_v"),
}


# -----------------------------------------------------------------------------
# Transformer sublayers

def norm(x):
    # choice: parameterless RMSNorm; a gain would only rescale what the next Linear learns anyway
    return F.rms_norm(x, (x.size(-1),), eps=EPS)


def rotary_tables(sequence_len, head_dim, base=10000.0):  # choice: rotary positions, e = token embedding
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

    def __init__(self, config, batch, device, dtype):
        shape = (config.n_layer, batch, config.n_head, config.sequence_len, config.n_embd // config.n_head)
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
        self.n_head, self.dropout = config.n_head, config.dropout
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


# -----------------------------------------------------------------------------
# Depth routing (residual=attnres). SPEC: Attention Residuals, WAV v1, RD-AttnRes. A routing block is the
# list of its updates; each source of the pool is named and is an explicit combination of one block's
# updates; a read is a softmax over the key-normed pool. The kernel below the banner computes the same.

def float32(x):
    """Context for routing math: autocast off, which would run it in bf16 (entered only when on)."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def mean_square(v):  # per-token mean(v²) in float32 (B, T): one fused reduction
    with float32(v):
        return torch.linalg.vector_norm(v.float(), dim=-1).square() / v.size(-1)


class Source(NamedTuple):
    """A named source of the pool: emb, C0, C0.phase, C0.split, ..., and the partial block's P, P.phase, ..."""
    name: str
    value: torch.Tensor  # (B, T, d), float32; None where only the name and basis matter (see route)
    basis: str = None  # None for a state source, else its detail basis (its logit gets a detail bias)


def depth_read(query, bias, values):
    """SPEC: one read, h = Σ_s α_s v_s, α = softmax_s(wᵀ RMSNorm(v_s) + bias_s), no 1/sqrt(d); query (d,),
    bias (S,), S values (B, T, d) -> h (B, T, d), α (S, B, T). The kernel below the banner is faster."""
    with float32(values[0]):  # SPEC: Numerics, key RMS, logits and softmax in float32
        V = torch.stack([v.float() for v in values])  # (S, B, T, d)
        logits = norm(V) @ query.float() + bias.float()[:, None, None]  # (S, B, T)
        weights = logits.softmax(0)
        return (weights[..., None] * V).sum(0), weights


def combine(coefficients, updates):
    """Σ_i c_i·u_i over a block's updates; c_i a number (a sign) or a 0-d tensor (a learned coefficient).
    The sum starts at c_0·u_0, which is u_0 itself for the number 1: Full AttnRes's block of one update
    is that update, not a copy."""
    c0, u0 = coefficients[0], updates[0]
    total = u0 if isinstance(c0, (int, float)) and c0 == 1 else c0 * u0
    for c, u in zip(coefficients[1:], updates[1:]):
        total = torch.add(total, u, alpha=c) if isinstance(c, (int, float)) else torch.addcmul(total, c, u)
    return total


def matching_scale(state_ms, detail_ms, rho):
    """SPEC: WAV stability 2, from mean squares: s = min(ρ, rms(C) / (rms(D) + ε)) per token. Computed
    without gradient: it sets how much a selected detail contributes, not where the gradient goes."""
    return (state_ms.sqrt() / (detail_ms.sqrt() + EPS)).clamp(max=rho)


class DepthRouting:
    """The routing of residual=attnres, inherited by GPT: parameters, the pool, the read, RD's routes, the loop."""

    def init_routing(self, config):
        d, n_sub = config.n_embd, 2 * config.n_layer
        self.bases = list(self.detail_signs(0))  # WAV's detail bases (none without WAV)
        self.read_names = [r for l in range(n_sub + 1) for r in self.reads_before(l)]
        # a zero pseudo-query per read (SPEC); choice: none for the first sublayer (it reads e alone) nor for
        # rd=frozen_v's value route; one detail bias per read and basis
        learned = [r for r in self.read_names if not r.startswith("layer0.attn")
                   and not (config.rd == "frozen_v" and r.endswith(".v"))]
        self.query = nn.ParameterDict({_key(r): nn.Parameter(torch.zeros(d)) for r in learned})
        with_details = [r for r in learned if r != "readout" or config.wav_readout_details]
        self.detail_bias = nn.ParameterDict({_key(r): nn.Parameter(torch.full((len(self.bases),), config.wav_detail_bias))
                                             for r in with_details} if self.bases else {})
        self.register_buffer("frozen_query", torch.zeros(d), persistent=False)
        self.register_buffer("frozen_detail_bias", torch.full((len(self.bases),), config.wav_detail_bias),
                             persistent=False)
        if config.wav_learned_bases:  # SPEC: Learnable bases, a coefficient per sublayer and basis, from the signs
            signs = [[float(s) for s in self.detail_signs(l).values()] for l in range(n_sub)]
            self.basis_coefficients = nn.Parameter(torch.tensor(signs))  # (2·n_layer, bases)
        if config.fast_routing and type(self).block_sources is not DepthRouting.block_sources:
            raise ValueError(f"fast_routing=True: {type(self).__name__} overrides block_sources, which the fast "
                             "kernel cannot follow. Its contract: the partial block's sources are the linear "
                             "combinations of the block's updates that block_coefficients gives, each detail "
                             "RMS-matched to the state with a detached scale, and it never builds them. Change "
                             "completed blocks in complete(), the bases in detail_signs(), or build the model "
                             "with fast_routing=False (docs/routing.md)")

    def reads_before(self, l):
        """The reads that feed sublayer l, in forward order: one (two with RD's value route) for attention,
        one for an MLP; "before" sublayer 2·n_layer is the final readout (SPEC)."""
        j = l // 2
        if l == 2 * self.config.n_layer:
            return ["readout"]
        if l % 2:
            return [f"layer{j}.mlp"]
        return [f"layer{j}.attn"] + ([f"layer{j}.attn.v"] if self.config.rd in ("decoupled", "average", "frozen_v")
                                     else [])

    # ----- the pool ------------------------------------------------------------------
    def detail_signs(self, l):
        """SPEC: WAV v1 bases. Sublayer l's sign in each basis ({} without WAV): phase +1 attention, −1 MLP;
        split +1 in the first half of a full block (i < m/2, also when partial). Add a basis here."""
        m = self.config.routing_block
        signs = {"phase": 1 if l % 2 == 0 else -1, "split": 1 if l % m < m / 2 else -1}
        return {basis: signs[basis] for basis in self.config.detail_bases}

    def block_coefficients(self, first, n):
        """How the sources of a block combine its n updates (sublayers first, ..., first+n-1): the state's
        row of ones, then a row per detail basis, its signs (SPEC: WAV v1) or, with wav_learned_bases, the
        learned coefficients: lists of numbers, or a (1 + bases, n) tensor."""
        if not self.config.wav_learned_bases:
            signs = [self.detail_signs(l) for l in range(first, first + n)]
            return [[1] * n] + [[s[basis] for s in signs] for basis in self.bases]
        learned = self.basis_coefficients[first:first + n].t()  # (bases, n)
        return torch.cat([torch.ones_like(learned[:1]), learned])

    def block_sources(self, name, block, first):
        """SPEC: the sources of the block of updates `block` (sublayers first, ...), explicitly: the state
        C = Σ u_i, then per detail basis D = Σ c_i·u_i RMS-matched to C (stability 2)."""
        state, *details = [combine(row, block) for row in self.block_coefficients(first, len(block))]
        with torch.no_grad():
            scales = [matching_scale(mean_square(state), mean_square(d), self.config.wav_rho) for d in details]
        values = [state] + [d * s[..., None] for d, s in zip(details, scales)]
        return [s._replace(value=v) for s, v in zip(self.block_source_names(name), values)]

    def block_source_names(self, name):  # a block's sources without their values: the state, then its details
        return [Source(name, None)] + [Source(f"{name}.{basis}", None, basis) for basis in self.bases]

    def complete(self, b, block, pool):
        """SPEC: block b is complete: its sources C_b (and details) join the pool. Add other sources here."""
        return pool + self.block_sources(f"C{b}", block, b * self.config.routing_block)

    # ----- the read ------------------------------------------------------------------
    def route(self, name, sources):
        """A read's pseudo-query (d,) and its logit bias per source (S,): 0 for a state source, the read's
        detail bias for its basis (SPEC: WAV stability 1). It sees the sources' names and bases, not their
        values (the fast kernel never builds the partial block's)."""
        learned = _key(name) in self.query
        query = self.query[_key(name)] if learned else self.frozen_query
        beta = self.detail_bias[_key(name)] if _key(name) in self.detail_bias else self.frozen_detail_bias
        bias = {None: query.new_zeros(()), **{basis: beta[k] for k, basis in enumerate(self.bases)}}
        return query, torch.stack([bias[s.basis] for s in sources])

    def block_reads(self, pool, first, sublayers, cache, previous):
        """The reads before `sublayers` (a routing block that starts at sublayer `first`, or the readout),
        each over the pool and the block's own sources, which a read sees from the block's second sublayer
        on. The one place that picks the kernel below the banner or depth_read (fast_routing=False; choice:
        generation with a KV cache, one token at a time, has nothing to batch)."""
        details = sublayers[0] < 2 * self.config.n_layer or self.config.wav_readout_details  # choice: the readout
        if not self.config.fast_routing or (cache is not None and not torch.is_grad_enabled()):
            return ReferenceReads(self, pool, first, details)
        partial = [s for s in self.block_source_names("P") if details or s.basis is None]
        sources = {name: pool + (partial if l > first else []) for l in sublayers for name in self.reads_before(l)}
        rows = self.block_coefficients(first, sublayers[-1] - first)[:len(partial)]
        match = functools.partial(matching_scale, rho=self.config.wav_rho)
        return BlockReads({name: self.route(name, s) for name, s in sources.items()}, [(s.name, s.value) for s in pool],
                          rows, match, previous, sources)

    def read(self, reads, name, block, routes):
        """Read `name` over its sources: h (B, T, d). With routes (return_routes), it records the read's
        weights over its sources too (RD tied: also as the value route, which is the same read)."""
        h, weights, sources = reads(name, block, keep_weights=routes is not None)
        if routes is not None:
            routes.append(dict(name=name, sources=[s.name for s in sources], weights=weights.detach()))
            if self.config.rd == "tied" and name.endswith(".attn"):
                routes.append(dict(routes[-1], name=f"{name}.v"))
        return h

    def sublayer_inputs(self, l, h):
        """SPEC: RD-AttnRes. What sublayer l runs on, from its reads h (in reads_before order): (x, x_v),
        x_v None when one input feeds Q, K and V."""
        if len(h) == 1:  # an MLP; attention with one route (rd=off, or tied: w^V ≡ w^QK)
            return h[0], None
        if self.config.rd == "average":  # Q, K and V read ½(h^QK + h^V)
            return 0.5 * (h[0] + h[1]), None
        return h[0], h[1]  # decoupled, frozen_v: Q and K read h^QK, V reads h^V

    # ----- the forward loop ----------------------------------------------------------
    def _attnres(self, e, rope, cache, routes):
        """SPEC: Attention Residuals. Sublayer l reads the pool [e, C_0, ..., C_{b-1}] (with WAV each block
        also brings its detail sources) and its own block's sources, runs on what it read, and appends its
        update to the block; a complete block's sources join the pool. The final readout reads them all."""
        m, n_sub = self.config.routing_block, 2 * self.config.n_layer
        pool, block, reads = [Source("emb", e)], [], None  # completed sources; the updates of block l // m
        for l in range(n_sub):
            if l % m == 0:  # a new block (the kernel reuses what the last block's reads computed)
                reads = self.block_reads(pool, l, range(l, min(l + m, n_sub)), cache, reads)
            h = [self.read(reads, name, block, routes) for name in self.reads_before(l)]
            u = self._sublayer(l, *self.sublayer_inputs(l, h), rope, cache)
            block.append(u.float())  # choice: sources accumulate in float32, like nanoGPT's residual stream
            if len(block) == m:  # complete (a short last block stays partial)
                pool, block = self.complete(l // m, block, pool), []
        # SPEC: the final readout; choice: no detail sources unless wav_readout_details (conservative readout)
        pool = [s for s in pool if s.basis is None or self.config.wav_readout_details]
        reads = self.block_reads(pool, n_sub - len(block), [n_sub], cache, reads)
        return self.read(reads, "readout", block, routes)


class ReferenceReads(NamedTuple):
    """The reads of one routing block, one by one: depth_read over the pool and the block's own sources,
    built explicitly (block_sources; their details only if `details`). Returns h, the weights, the sources."""
    model: DepthRouting
    pool: list
    first: int
    details: bool

    def __call__(self, name, block, keep_weights=False):
        own = self.model.block_sources("P", block, self.first) if block else []
        sources = self.pool + [s for s in own if self.details or s.basis is None]
        return *depth_read(*self.model.route(name, sources), [s.value for s in sources]), sources


def _key(read_name):  # ParameterDict keys cannot contain "."
    return read_name.replace(".", "_")


# -----------------------------------------------------------------------------
# The model

class GPT(DepthRouting, nn.Module):
    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        d, n_sub = config.n_embd, 2 * config.n_layer
        self.wte = nn.Embedding(config.vocab_size, d)
        self.drop = nn.Dropout(config.dropout)
        # layer j holds sublayers 2j (attention) and 2j+1 (MLP); how they join the stream is the routing
        self.layers = nn.ModuleList([nn.ModuleDict(dict(attn=CausalSelfAttention(config), mlp=MLP(config)))
                                     for _ in range(config.n_layer)])
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
            self.init_routing(config)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(n_sub))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

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
        routed = self.config.residual == "attnres"
        x = self._attnres(e, rope, cache, routes) if routed else self._residual(e, rope, cache)
        if cache is not None:
            cache.pos += T
        return norm(x)

    def _sublayer(self, l, x, x_v, rope, cache):
        """u_l = f_l(norm(x)); ReZero feeds f_l the raw stream (SPEC: no pre-norm inside)."""
        layer = self.layers[l // 2]
        prep = (lambda t: t) if self.config.residual == "rezero" else norm
        if l % 2 == 0:
            return layer.attn(prep(x), rope, None if x_v is None else prep(x_v), cache, l // 2)
        return layer.mlp(prep(x))

    def _residual(self, x, rope, cache):
        # SPEC: prenorm x += f(norm(x)); rezero x += α·f(x); layerscale x += γ⊙f(norm(x))
        for l in range(2 * self.config.n_layer):
            u = self._sublayer(l, x, None, rope, cache)
            x = x + u if self.residual_gain is None else x + self.residual_gain[l] * u
        return x

    # ----- training helpers ----------------------------------------------------------
    def no_decay_parameters(self):
        """{name: parameter} of everything but the matrices of Linear and Embedding layers: the routing's
        (pseudo-queries, detail biases, learned bases), ReZero/LayerScale gains, Linear biases (SPEC: Numerics)."""
        matrices = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        return {name: p for name, p in self.named_parameters() if id(p) not in matrices}

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), device_type="cpu"):
        """AdamW with weight decay on the matrices of Linear and Embedding layers only (no_decay_parameters)."""
        no_decay = list(self.no_decay_parameters().values())
        decay = [p for p in self.parameters() if not any(p is q for q in no_decay)]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops):
        """Model FLOPs utilisation: achieved FLOP/s (flops_per_token) over peak_flops, the device's
        dense peak in the precision trained (train.peak_flops)."""
        return self.flops_per_token() * tokens_per_iter / dt / peak_flops

    def flops_per_token(self):
        """Training FLOPs per token as PaLM counts them (appendix B): 6N for the matmuls of the N
        parameters (forward 2N, backward 4N), plus attention's scores and mix, 12·L·d·T (at full
        context T); the routing's few FLOPs per source and token are left out."""
        cfg = self.config
        return 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.sequence_len

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
                amp = torch.is_autocast_enabled(idx.device.type)
                dtype = torch.get_autocast_dtype(idx.device.type) if amp else self.lm_head.weight.dtype
                cache = KVCache(cfg, idx.size(0), idx.device, dtype)
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


# -----------------------------------------------------------------------------
# Routing diagnostics

def _block_order(source):  # emb, C0 and its details, C1, ..., P
    block = source.partition(".")[0]
    return -1 if block == "emb" else math.inf if block == "P" else int(block[1:])


def js_divergence(p, q):
    """Jensen-Shannon divergence (nats, ≤ ln 2) of two routes (S, B, T), token mean (SPEC: RD-AttnRes)."""
    p, q = p.double(), q.double()
    mid = 0.5 * (p + q)
    kl = lambda a: (torch.xlogy(a, a) - torch.xlogy(a, mid)).sum(0)  # noqa: E731
    return (0.5 * kl(p) + 0.5 * kl(q)).clamp(min=0).mean().item()


def routing_stats(routes):
    """Summary of model(..., return_routes=True)'s routes: {"reads": {name: {"sources", "mean_weight",
    "entropy" (nats, token mean), "entropy_norm" (entropy / ln(number of sources): 1 = uniform, so reads
    over pools of different sizes compare; None for one source)}}, "sources": every source seen, in pool
    order (a table's columns), "js": {"layer{j}": nats} (RD: QK route vs V route), "js_mean": nats or
    None}. Layer 0 is left out of js and js_mean: both its routes read e alone, so its JS is 0 by construction."""
    reads = {}
    for r in routes:
        entropy = max(0.0, -torch.xlogy(r["weights"], r["weights"]).sum(0).mean().item())  # max: no -0.0
        n = len(r["sources"])
        reads[r["name"]] = dict(sources=r["sources"], mean_weight=r["weights"].mean((1, 2)).tolist(), entropy=entropy,
                                entropy_norm=entropy / math.log(n) if n > 1 else None)
    # sorted by block (stable: a block keeps its own order, C0, C0.phase, C0.split)
    sources = sorted(dict.fromkeys(s for r in routes for s in r["sources"]), key=_block_order)
    by_name = {r["name"]: r["weights"] for r in routes}
    js = {name[:-len(".attn.v")]: js_divergence(by_name[name[:-len(".v")]], w)
          for name, w in by_name.items() if name.endswith(".attn.v") and not name.startswith("layer0.")}
    return dict(reads=reads, sources=sources, js=js, js_mean=sum(js.values()) / len(js) if js else None)


# =============================================================================
# Below this banner: a fast kernel for depth reads, and nothing of the model. It is given a pool of
# sources, queries and logit biases, and a block of updates with the coefficients that combine them into
# the block's own sources; it computes what depth_read computes over them, with hand-written backward
# passes (the coefficients' gradient too), and keeps whatever it needs for speed and memory. It knows
# nothing of WAV, RD or the routing fields. Its own tests check it against depth_read.
# =============================================================================

class BlockReads:
    """The reads of one routing block, two-phase (SPEC: Two-phase computation). Phase 1 (here): every read
    over the completed sources in one batched pass, one read of each source instead of one per read.
    Phase 2 (per call): an online softmax merges a read's phase-1 summary with the block's own sources,
    which are linear combinations of the block's updates and are never built.

    routes: {read: (query (d,), bias (S + P_r,))}, the bias over the S completed sources, then over the
    P_r block sources it sees (0 or P); completed: [(key, value (B, T, d))]; coefficients: P rows of n
    numbers, or a (P, n) tensor (learned: its gradient is computed): block source p = s_p · Σ_i c_pi·u_i,
    s_0 = 1 and s_p = match(mean_square(source 0), mean_square(source p)) for p > 0, without gradient;
    previous: the last block's BlockReads, whose key norms are reused; sources: {read: the caller's list
    of its sources}, returned with each read (the kernel reads the routes only)."""

    def __init__(self, routes, completed, coefficients, match, previous, sources):
        self.routes, self.coefficients, self.match, self.sources = routes, coefficients, match, sources
        self.learned = isinstance(coefficients, torch.Tensor)
        # running sums of the block's sources are needed unless the one source is the one term (Block AttnRes)
        self.summed = self.learned or len(coefficients) > 1 or any(c != 1 for row in coefficients for c in row)
        self.norms = dict(previous.norms) if isinstance(previous, BlockReads) else {}  # key -> (value, inv_rms)
        values, inv_rms = [v for _, v in completed], [self._inv_rms(key, v) for key, v in completed]
        S, names = len(values), list(routes)
        queries = torch.stack([routes[r][0] for r in names])
        biases = torch.stack([routes[r][1][:S] for r in names])
        if torch.is_grad_enabled():
            out = CompletedReads.apply(queries, biases, *values, *inv_rms)
            mix, lse, p = out[:len(names)], out[len(names):-1], out[-1]
        else:  # eval: the same math without the autograd.Function (which torch.compile rejects there)
            mix, lse, p, _, _ = completed_reads(queries, biases, values, inv_rms)
            mix, lse = mix.unbind(2), lse.unbind(2)
        self.phase1 = {name: (mix[r], lse[r], p[..., r]) for r, name in enumerate(names)}
        self.pieces, self.sums, self.seen, self.state = {}, None, 0, None

    def _inv_rms(self, key, value):
        """rsqrt(mean(v²)+ε) of a completed source (with its graph), once per source per forward: every
        read's key norm is then RMSNorm(v)·w = (v·w)·inv_rms (SPEC: Two-phase computation)."""
        cached = self.norms.get(key)
        if cached is None or cached[0] is not value:
            cached = self.norms[key] = (value, torch.rsqrt(mean_square(value) + EPS))
        return cached[1]

    def __call__(self, name, block, keep_weights=False):
        """h (B, T, d) of read `name` over the completed sources and the sources of `block` (its updates
        so far, a list that grows by one per sublayer); its weights (S + P_r, B, T) if keep_weights; its sources."""
        mix, lse, p = self.phase1[name]
        query, bias = self.routes[name]
        S = p.size(2)
        if bias.size(0) == S:  # it sees no block source. A compact copy: a view would keep phase 1's output alive
            return mix.contiguous(), p.permute(2, 0, 1) if keep_weights else None, self.sources[name]
        terms, coeffs, inv_rms, scale = self._block_state(block)
        args = (mix, lse, query, bias[S:], inv_rms, scale, coeffs)
        h, a = PartialMerge.apply(*args, *terms) if torch.is_grad_enabled() else merge_partial(*args, terms)[:2]
        return h, torch.cat([a[0] * p.permute(2, 0, 1), a[1:]]) if keep_weights else None, self.sources[name]

    def _block_state(self, block):
        """The block's sources as PartialMerge takes them: terms, their coefficients (P, K) (None: the one
        source is the one term), inv_rms and detached scale (P, B, T). Updates with identical fixed
        coefficient columns are summed into one term (WAV's two bases: at most 4 per block; without WAV, 1:
        a sublayer leaves one tensor for the backward); learned coefficients keep one term per update."""
        if self.state is None or self.seen != len(block):
            for i in range(self.seen, len(block)):
                self._absorb(i, block[i])
            self.seen = len(block)
            terms = tuple(self.pieces.values())
            if self.learned:
                coeffs = self.coefficients[:, :len(terms)]
            else:
                keys = list(self.pieces)
                coeffs = _constant(tuple(zip(*keys)), terms[0].device)  # (P, K)
                if coeffs.shape == (1, 1) and keys[0] == (1,):  # the one source is the one term itself
                    coeffs = None
            with torch.no_grad():  # SPEC: WAV stability 2, mean squares and scales without gradient
                ms = mean_square(self.sums) if self.summed else mean_square(terms[0])[None]  # (P, B, T)
                scale = torch.cat([torch.ones_like(ms[:1]), self.match(ms[0], ms[1:])])
                inv_rms = torch.rsqrt(scale.square() * ms + EPS)  # mean((s·v)²) = s²·mean(v²)
            self.state = terms, coeffs, inv_rms, scale
        return self.state

    def _absorb(self, i, u):
        """Update i joins its piece (with gradient) and the running sums of the block's sources (without)."""
        key = i if self.learned else tuple(row[i] for row in self.coefficients)
        self.pieces[key] = self.pieces[key] + u if key in self.pieces else u
        if not self.summed:
            return
        with torch.no_grad():
            column = self.coefficients[:, i] if self.learned else _constant(key, u.device)
            term = column.float()[:, None, None, None] * u  # (P, B, T, d)
            self.sums = term if self.sums is None else self.sums + term


_CONSTANTS = {}  # (values, device) -> tensor


def _constant(values, device):
    """A small float32 tensor of fixed values on `device`, built once per values and device: a copy from
    the host to a GPU at every read would wait for the GPU's queue to drain. A compiled graph holds it as
    a constant instead. Never an inference tensor (autograd may save it later)."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (values, str(device))
    if key not in _CONSTANTS:
        with torch.inference_mode(False):
            _CONSTANTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _CONSTANTS[key]


def completed_reads(queries, biases, values, inv_rms):
    """Phase 1's forward: queries (R, d), biases (R, S), S sources (B, T, d), their inv_rms (B, T).
    Returns mix (B, T, R, d), lse (B, T, R), p (B, T, S, R), inv_rms (B, T, S), dots vᵀw (B, T, S, R)."""
    with float32(values[0]):
        V = torch.stack(values, dim=2).float()  # (B, T, S, d)
        inv_rms = torch.stack(inv_rms, dim=2)  # (B, T, S)
        dots = V @ queries.float().t()  # (B, T, S, R); choice: TF32 allowed on CUDA (SPEC: Choices)
        logits = dots * inv_rms[..., None] + biases.float().t()
        lse = logits.logsumexp(2)  # (B, T, R)
        p = (logits - lse[:, :, None]).exp()
        mix = p.transpose(2, 3) @ V  # (B, T, R, S) @ (B, T, S, d) -> (B, T, R, d)
    return mix, lse, p, inv_rms, dots


def merge_partial(mix, lse, query, bias, inv_rms, scale, coeffs, terms):
    """Phase 2's forward: a read's summary (mix, lse), query (d,) and P partial sources scale_p ·
    Σ_k coeffs[p, k]·terms_k: bias (P,), inv_rms and detached scale (P, B, T), coeffs (P, K) (None: the
    source is its one term), terms (B, T, d). Returns h (B, T, d), a (1+P, B, T), dots ṽ_pᵀw (P, B, T) and
    the terms' dots t_kᵀw (K, B, T)."""
    with float32(mix):
        q = query.float()
        # vecdot, not v @ q: a per-token dot product is one fused pass, matrix-vector is 2x slower on CPU
        term_dots = torch.stack([torch.linalg.vecdot(t.float(), q) for t in terms])
        dots = _per_source(coeffs, term_dots) * scale
        a = torch.cat([lse[None], dots * inv_rms + bias.float()[:, None, None]]).softmax(0)
        h = a[0][..., None] * mix
        for t, w in zip(terms, _per_term(coeffs, a[1:] * scale)):  # each term's weight in h
            h.addcmul_(w[..., None], t.float())
    return h, a, dots, term_dots


def _per_source(coeffs, x):  # Σ_k coeffs[p, k]·x_k for every source p: (K, ...) -> (P, ...)
    return x if coeffs is None else (coeffs.float() @ x.flatten(1)).view(coeffs.size(0), *x.shape[1:])


def _per_term(coeffs, x):  # Σ_p coeffs[p, k]·x_p for every term k: (P, ...) -> (K, ...)
    return x if coeffs is None else (coeffs.float().t() @ x.flatten(1)).view(coeffs.size(1), *x.shape[1:])


class CompletedReads(torch.autograd.Function):
    """Phase 1 with a batched backward (one gradient per source, not one per read). Read r returns
    mix_r (B, T, d), normalised over the completed sources, and lse_r (B, T), which phase 2 treats as
    one source with logit lse_r; and p (B, T, S, R), recomputed in the backward from the saved vᵀw:
        dlogit_rs = p_rs (⟨dmix_r, v_s⟩ − Σ_s' p_rs' ⟨dmix_r, v_s'⟩ + dlse_r)
        dv_s = Σ_r p_rs dmix_r + dlogit_rs·inv_rms_s·w_r,  dw_r = Σ dlogit_rs·inv_rms_s·v_s,
        dinv_rms_s = Σ_r dlogit_rs·(v_s·w_r),  dbias_rs = Σ dlogit_rs."""

    @staticmethod
    def forward(ctx, queries, biases, *values_and_inv_rms):
        S = len(values_and_inv_rms) // 2
        mix, lse, p, inv_rms, dots = completed_reads(queries, biases, values_and_inv_rms[:S], values_and_inv_rms[S:])
        ctx.save_for_backward(queries, biases, inv_rms, dots, lse, *values_and_inv_rms[:S])
        ctx.mark_non_differentiable(p)
        return (*mix.unbind(2), *lse.unbind(2), p)

    @staticmethod
    def backward(ctx, *grads):
        queries, biases, inv_rms, dots, lse, *values = ctx.saved_tensors
        with float32(queries):  # float32 also when backward() is called under autocast
            R = queries.size(0)
            Q = queries.float()
            p = (dots * inv_rms[..., None] + biases.float().t() - lse[:, :, None]).exp()  # as in the forward
            dmix = torch.stack(grads[:R], dim=2).float()  # (B, T, R, d)
            dlse = torch.stack(grads[R:2 * R], dim=2).float()  # (B, T, R)
            V = torch.stack(values, dim=2).float()  # (B, T, S, d)
            g = (dmix @ V.transpose(2, 3)).transpose(2, 3)  # (B, T, S, R): ⟨dmix_r, v_s⟩
            dlogits = p * (g - (p * g).sum(2, keepdim=True) + dlse[:, :, None])
            c = dlogits * inv_rms[..., None]
            dV = p @ dmix + c @ Q  # (B, T, S, d)
            dQ = c.flatten(0, 2).t() @ V.flatten(0, 2)  # (R, d)
            dinv_rms = (dlogits * dots).sum(-1)  # (B, T, S)
            dbiases = dlogits.sum((0, 1)).t()  # (R, S)
        return dQ.to(queries.dtype), dbiases, *(t.to(v.dtype) for t, v in zip(dV.unbind(2), values)), \
            *dinv_rms.unbind(2)


class PartialMerge(torch.autograd.Function):
    """Phase 2 with a hand-written backward: a softmax over [lse, the partial sources' logits]. The
    sources are combinations of the terms with detached scales and inv_rms: never built, no graph nodes,
    and the backward keeps only the terms (shared by the block's reads), h and P×B×T numbers. With
    ṽ_p = s_p·v_p, v_p = Σ_k c_pk·term_k and inv_rms_p = (s_p²·mean(v_p²) + ε)^(−1/2):
        dlogit_p = a_p (⟨dh, ṽ_p⟩ − ⟨dh, h⟩),  dmix = a_0 dh,
        dlse = −Σ_p dlogit_p (softmax gradients sum to zero: no copy of mix is needed),
        dv_p = s_p (a_p dh + dlogit_p·inv_rms_p·w) − dlogit_p·(ṽ_p·w)·inv_rms_p³·s_p²/d · v_p,
        dterm_k = Σ_p c_pk dv_p,  dc_pk = Σ ⟨dv_p, term_k⟩ (only for coefficients that require grad)."""

    @staticmethod
    def forward(ctx, mix, lse, query, bias, inv_rms, scale, coeffs, *terms):
        h, a, dots, term_dots = merge_partial(mix, lse, query, bias, inv_rms, scale, coeffs, terms)
        ctx.save_for_backward(query, inv_rms, scale, coeffs, dots, a, h, term_dots, *terms)
        ctx.mark_non_differentiable(a)
        return h, a

    @staticmethod
    def backward(ctx, dh, _):
        query, inv_rms, scale, coeffs, dots, a, h, term_dots, *stored = ctx.saved_tensors
        with float32(h):  # float32 also when backward() is called under autocast
            dh, q = dh.float(), query.float()
            terms = [t.float() for t in stored]
            term_grads = torch.stack([torch.linalg.vecdot(dh, t) for t in terms])  # ⟨dh, term_k⟩ (K, B, T)
            dlogit = a[1:] * (_per_source(coeffs, term_grads) * scale - torch.linalg.vecdot(dh, h))  # (P, B, T)
            c = dlogit * inv_rms * scale  # through the dot product
            norm_term = dlogit * dots * inv_rms.pow(3) * scale.square() / h.size(-1)  # through the key norm
            c_k, a_k = _per_term(coeffs, c), _per_term(coeffs, a[1:] * scale)
            # −Σ_p c_pk·norm_term_p·v_p = Σ_j M_kj·term_j, M_kj = −Σ_p c_pk·c_pj·norm_term_p
            C = None if coeffs is None else coeffs.float()
            M = -norm_term[:, None] if C is None else -_per_term(C, C[:, :, None, None] * norm_term[:, None])
            dquery = sum(c_k[k].flatten() @ t.flatten(0, 1) for k, t in enumerate(terms))
            dterms = []
            for k in range(len(terms)):
                dt = torch.addcmul(c_k[k][..., None] * q, a_k[k][..., None], dh)
                for j, t in enumerate(terms):
                    dt.addcmul_(M[k, j][..., None], t)
                dterms.append(dt)
            dmix, dlse, dbias = a[0][..., None] * dh, -dlogit.sum(0), dlogit.sum((1, 2))
            dcoeffs = None
            if ctx.needs_input_grad[6]:  # ⟨dv_p, term_k⟩ = s_p a_p ⟨dh, t_k⟩ + c_p ⟨w, t_k⟩ − norm_p Σ_j c_pj ⟨t_j, t_k⟩
                gram = torch.stack([torch.stack([torch.linalg.vecdot(t, u) for u in terms]) for t in terms])
                dcoeffs = (torch.einsum("pbt,kbt->pk", a[1:] * scale, term_grads)
                           + torch.einsum("pbt,kbt->pk", c, term_dots)
                           - torch.einsum("pbt,pj,jkbt->pk", norm_term, C, gram)).to(coeffs.dtype)
        return dmix, dlse, dquery.to(query.dtype), dbias, None, None, dcoeffs, \
            *(dt.to(t.dtype) for dt, t in zip(dterms, stored))
