"""
nanoroute: a minimal GPT whose residual stream is a choice of depth routing.

    residual = prenorm | rezero | layerscale | denseformer | attnres
    on top of attnres:  wav = True   (WAV v1 multi-resolution block sources)
                        rd  = decoupled | tied | average | frozen_v   (RD-AttnRes)
                        route_heads = H (multi-head depth reads), route_static = True (a control)

Read top-down: config, Transformer pieces, the routing (pool, read, write, RD's routes, readout),
the GPT, generation; below the banner, a generic fast kernel for the reads. What the routes say
(routing_stats) is in diagnostics.py. "# SPEC: <section>" points to SPEC.md, "# choice:" to its list
of choices the papers leave open; docs/routing.md says how to change the routing.

References:
1) nanoGPT model.py, A. Karpathy: https://github.com/karpathy/nanoGPT/blob/master/model.py
2) Attention Residuals, Kimi Team, arXiv:2603.15031 (Full / Block AttnRes, two-phase reads)
3) WAV v1, K. Wang 2026, arXiv:2606.06564v1 (phase and split detail bases)
4) RD-AttnRes, K. Wang 2026, arXiv:2608.01075 (role-decoupled attention reads)
5) Multi-head attention residuals (MHAR), arXiv:2607.27230 (H softmaxes over depth per read)
6) DenseFormer, Pagliardini et al. 2024, arXiv:2402.02622 (depth-weighted averages)
7) ReZero, Bachlechner et al. 2020, arXiv:2003.04887
8) LayerScale (CaiT), Touvron et al. 2021, arXiv:2103.17239
9) RoFormer (rotary position embedding), Su et al. 2021, arXiv:2104.09864
"""

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

RESIDUALS = ("prenorm", "rezero", "layerscale", "denseformer", "attnres")
WAV_BASES = {"phase": ("phase",), "split": ("split",), "both": ("phase", "split")}
EPS = 1e-6  # RMSNorm epsilon, for sublayer inputs and routing keys alike

class RD(NamedTuple):
    """An RD-AttnRes mode (SPEC): the depth read, by its role, that feeds attention's queries (q),
    keys (k) and values (v). "attn" is the QK route; any other role "attn.<name>" is a read of its
    own with its own pseudo-query. average: Q, K and V all take the mean of the mode's reads;
    frozen: roles whose pseudo-query stays zero (uniform weights); tied: w^V ≡ w^QK, every role is
    the q read itself (computed once, recorded under each role's name in the routes)."""
    q: str = "attn"
    k: str = "attn"
    v: str = "attn"
    average: bool = False
    frozen: tuple = ()
    tied: bool = False

    @property
    def roles(self):  # the attention sublayer's reads, in forward order (q's first)
        return tuple(dict.fromkeys((self.q, self.k, self.v)))

    def feeds(self, role):  # what a role's read feeds: "QK", "V", ... (a route's label)
        return "".join(name for name, r in zip("QKV", (self.q, self.k, self.v)) if r == role)

# The one table of RD's modes: the reads, the sublayer's inputs and the diagnostics derive from it.
# A mode reading a new role is one line here (docs/routing.md), e.g. RD(k="attn.k", v="attn.v").
RD_MODES = {"off": RD(), "decoupled": RD(v="attn.v"), "tied": RD(v="attn.v", tied=True),
            "average": RD(v="attn.v", average=True),
            "frozen_v": RD(v="attn.v", frozen=("attn.v",))}

def missing_need(needs, config):
    """Why a setting marked needs= has no effect in config (a GPTConfig, or a dict of its fields:
    a missing one at its default), with the flag to add; None where it applies. needs: "attnres"
    (residual=attnres), or a GPTConfig field that must be off its default where it applies itself
    ("wav", "rd"). GPTConfig, train.py's settings and experiments.py's sweeps all ask it."""
    def value(name):
        default = CONFIG_FIELDS[name].default
        return config.get(name, default) if isinstance(config, dict) else getattr(config, name)
    if needs is None:
        return None
    if value("residual") != "attnres":
        return "applies only to residual=attnres: add --residual attnres"
    if needs == "attnres":
        return None
    field_ = CONFIG_FIELDS[needs]
    inner = missing_need(field_.metadata.get("needs"), config)
    if inner or value(needs) != field_.default:
        return inner
    if field_.default is False:
        return f"applies only with {needs}=True: add --{needs} True"
    return f"applies only with {needs} other than {field_.default!r}: add --{needs} (see --help)"

def setting(default, help, needs=None):
    """A config field with its help text (train.py's --help). needs="attnres", or the field it
    needs off its default ("wav"), marks a field of the depth routing: set where missing_need
    says it has no effect, it is an error."""
    return field(default=default, metadata=dict(help=help, needs=needs))

@dataclass
class GPTConfig:
    vocab_size: int = setting(256, "vocabulary size")
    sequence_len: int = setting(256, "context length in tokens (\"block\" is a routing block)")
    n_layer: int = setting(6, "Transformer layers; each has two sublayers (attention, MLP)")
    n_head: int = setting(6, "attention heads (head size n_embd/n_head, even)")
    n_embd: int = setting(384, "width of the residual stream")
    dropout: float = setting(0.0, "dropout probability")
    bias: bool = setting(False, "biases in Linear layers")
    residual: str = setting("prenorm", " | ".join(RESIDUALS))
    attnres_block: int = setting(0, "sublayers per routing block; 1 = Full AttnRes; 0 = auto: "
                                 "whole layers, at most 8 blocks (4 sublayers at least with WAV)",
                                 "attnres")
    wav: bool = setting(False, "WAV v1 detail sources", "attnres")
    wav_bases: str = setting("both", " | ".join(WAV_BASES), "wav")
    wav_rho: float = setting(4.0, "cap on the detached RMS-matching scale of details", "wav")
    wav_detail_bias: float = setting(-2.0, "initial logit offset of every detail source", "wav")
    wav_readout_details: bool = setting(False, "the final readout reads detail sources too", "wav")
    wav_learned_bases: bool = setting(False, "learn the detail bases: a coefficient per sublayer "
                                      "and basis, started at the signs (beyond WAV v1)", "wav")
    rd: str = setting("off", " | ".join(RD_MODES) + " (RD-AttnRes)", "attnres")
    route_heads: int = setting(1, "H softmaxes over depth per read, each on 1/H of the width "
                               "(MHAR; 1 = AttnRes)", "attnres")
    route_static: bool = setting(False, "control: every read weighs its sources by learned "
                                 "logits that ignore the input (no query)", "attnres")
    fast_routing: bool = setting(True, "False: the readable reference read (slow; to check or "
                                 "step through in a debugger)", "attnres")

    def __post_init__(self):
        self.validate()

    def validate(self):
        def bad(name, fix):
            raise ValueError(f"{name}={getattr(self, name)!r}: {fix}")
        for f in ("vocab_size", "sequence_len", "n_layer", "n_head", "n_embd", "route_heads"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                bad(f, "must be a positive integer")
        for f in ("n_head", "route_heads"):
            if self.n_embd % getattr(self, f):
                bad(f, f"must divide n_embd={self.n_embd}")
        if (self.n_embd // self.n_head) % 2:
            bad("n_head", f"head size n_embd/n_head={self.n_embd // self.n_head} must be even "
                "for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", "must be in [0, 1)")
        for f, allowed in (("residual", RESIDUALS), ("rd", RD_MODES), ("wav_bases", WAV_BASES)):
            if getattr(self, f) not in allowed:
                bad(f, f"must be one of {', '.join(allowed)}")
        # a routing knob where it has no effect is an error, not silently ignored (needs=)
        for f in fields(self):
            missing = missing_need(f.metadata.get("needs"), self)
            if missing and getattr(self, f.name) != f.default:
                bad(f.name, missing)
        most = 2 * self.n_layer
        if not isinstance(self.attnres_block, int) or not 0 <= self.attnres_block <= most:
            bad("attnres_block", f"must be 0 (auto) or 1..2*n_layer={most} sublayers")
        if not self.wav_rho > 0:  # also catches NaN
            bad("wav_rho", "must be > 0")
        if not math.isfinite(self.wav_detail_bias):
            bad("wav_detail_bias", "must be a finite number (e.g. -2.0)")
        if self.wav and self.attnres_block and (self.attnres_block % 2 or self.attnres_block < 4):
            # SPEC: WAV needs an even block (zero-sum bases) of at least 4 (m = 2: phase == split)
            bad("attnres_block", "WAV needs an even routing block of at least 4 sublayers, e.g. 4")
        if self.wav and self.n_layer < 2:
            bad("n_layer", "WAV needs at least 2 layers (one routing block of 4 sublayers)")
        if self.route_static and self.route_heads > 1:  # one logit per source: every head alike
            bad("route_heads", "has no effect with route_static=True: drop one of the two")
        rd = RD_MODES[self.rd]
        if any(role.partition(".")[0] != "attn" for role in rd.roles):
            bad("rd", f"RD_MODES[{self.rd!r}] reads {rd.roles}: attention reads attn, attn.<name>")
        if set(rd.frozen) - set(rd.roles):
            bad("rd", f"RD_MODES[{self.rd!r}] freezes {rd.frozen}, but reads only {rd.roles}")
        if (rd.average or rd.tied) and len(rd.roles) < 2:
            bad("rd", f"RD_MODES[{self.rd!r}] = {rd}: average or tied needs a second read "
                "(with one it would be rd=off)")

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

CONFIG_FIELDS = {f.name: f for f in fields(GPTConfig)}

def routing_fields(config_class=GPTConfig):
    """residual and every field of the depth routing (needs=): a paired baseline drops them all."""
    return ("residual",) + tuple(f.name for f in fields(config_class) if f.metadata.get("needs"))

# The variants this codebase compares, as GPTConfig values: train.py's presets, experiments.py's
# sweeps and bench.py read this table. A new variant is one line here (and its test).
VARIANTS = {
    "prenorm": dict(residual="prenorm"),
    "rezero": dict(residual="rezero"),
    "layerscale": dict(residual="layerscale"),
    "denseformer": dict(residual="denseformer"),
    "block": dict(residual="attnres"),  # Block AttnRes: the parent of WAV and RD
    "block_static": dict(residual="attnres", route_static=True),  # its input-independent control
    "block_h4": dict(residual="attnres", route_heads=4),  # multi-head depth reads (MHAR)
    "wav": dict(residual="attnres", wav=True),
    "rd": dict(residual="attnres", rd="decoupled"),
    "rd_tied": dict(residual="attnres", rd="tied"),
    "rd_average": dict(residual="attnres", rd="average"),
    "rd_frozen_v": dict(residual="attnres", rd="frozen_v"),
}

def variant(name):
    """VARIANTS[name] with every field a variant may set (the others' defaults), so that nothing of
    a preset or another variant leaks into it (a wav preset run as block gets wav=False)."""
    every_field = {f: CONFIG_FIELDS[f].default for row in VARIANTS.values() for f in row}
    return every_field | VARIANTS[name]

# -----------------------------------------------------------------------------
# Transformer sublayers

def norm(x):
    # choice: parameterless RMSNorm; a gain would only rescale what the next Linear learns anyway
    return F.rms_norm(x, (x.size(-1),), eps=EPS)

def basis_signs(l, m):
    """SPEC: WAV v1 bases. Sublayer l's sign in each basis, blocks of m sublayers: phase +1
    attention, −1 MLP; split +1 in the first half of a full block (i < m/2, also when partial).
    Add a basis here and in WAV_BASES."""
    return {"phase": 1 if l % 2 == 0 else -1, "split": 1 if l % m < m / 2 else -1}

def rotary_tables(sequence_len, head_dim, base=10000.0):  # choice: rotary positions, e = wte(idx)
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
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch, config.n_head, config.sequence_len, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # tokens already in the cache

    def update(self, layer, k, v):  # k, v (B, nh, T, hs) at positions pos..pos+T-1
        assert self.pos == 0 or k.size(2) == 1, "after the prefill, feed one token at a time"
        end = self.pos + k.size(2)
        assert k.shape == self.k[layer, :, :, self.pos:end].shape, "KVCache not shaped as the keys"
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

    def forward(self, x, rope, x_k=None, x_v=None, cache=None, layer=0):
        """x feeds the queries, and the keys and values where x_k, x_v are None (RD-AttnRes)."""
        B, T, C = x.size()
        if x_k is None and x_v is None:
            q, k, v = self.c_attn(x).split(C, dim=2)
        else:  # SPEC: RD-AttnRes, Q, K and V each from its own read, with the same weights
            inputs = (x, *(x if t is None else t for t in (x_k, x_v)))
            bias = self.c_attn.bias
            biases = (None, None, None) if bias is None else bias.split(C)
            weights = self.c_attn.weight.split(C)
            q, k, v = (F.linear(t, w, b) for t, w, b in zip(inputs, weights, biases))
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        # with a cache: prefill (empty cache) is causal; a single new token sees every cached key.
        # Without one, a plain True: T > 1 is symbolic when torch.compile traces any length
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None or T > 1,
                                           dropout_p=self.dropout if self.training else 0.0)
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
# Depth routing (residual=attnres). SPEC: Attention Residuals, WAV v1, RD-AttnRes. A routing
# block is the list of its updates; each source of the pool is named and is an explicit
# combination of one block's updates; a read is a softmax over the key-normed pool. The kernel
# below the banner computes the same.

def float32(x):
    """Context for routing math: autocast off, which would run it in bf16 (entered only when on)."""
    on = torch.is_autocast_enabled(x.device.type)
    return torch.autocast(x.device.type, enabled=False) if on else contextlib.nullcontext()

def mean_square(v):  # per-token mean(v²) in float32 (B, T): one fused reduction
    with float32(v):
        return torch.linalg.vector_norm(v.float(), dim=-1).square() / v.size(-1)

class Read(NamedTuple):
    """A depth read: the input of layer `layer`'s attention (role "attn": Q and K, and V unless
    RD reads it apart), RD's value route ("attn.v"), the MLP's ("mlp"), or the final readout;
    not a read, DenseFormer's weighted sum after layer `layer` is recorded as role "dwa"."""
    layer: int
    role: str

    def __str__(self):  # its name in routes and metrics: layer0.attn, layer0.attn.v, ..., readout
        return "readout" if self.role == "readout" else f"layer{self.layer}.{self.role}"

    @property
    def key(self):  # its parameters' name (ParameterDict keys cannot contain ".")
        return str(self).replace(".", "_")

    @property
    def sublayer(self):  # the sublayer it feeds: 2·layer (+1 for an MLP); 2·n_layer: the readout
        return 2 * self.layer + (self.role == "mlp")

class Source(NamedTuple):
    """A named source of the pool: emb, C0, C0.phase, C0.split, ..., the partial block's P, ..."""
    name: str
    value: torch.Tensor  # (B, T, d), float32; None where only the name and basis matter (route)
    basis: str = None  # None for a state source, else its detail basis (a detail bias applies)

def depth_read(query, bias, values, heads=1):
    """SPEC: one read, h = Σ_s α_s v_s, α = softmax_s(wᵀ RMSNorm(v_s) + bias_s), no 1/sqrt(d);
    query (d,), bias (S,), S values (B, T, d) -> h (B, T, d), α (S, B, T, H). With H heads
    (MHAR) head k weighs the sources by its slice of w against the same slice of the normed
    keys, and mixes that slice of the values. The kernel below the banner is faster."""
    with float32(values[0]):  # SPEC: Numerics, key RMS, logits and softmax in float32
        V = torch.stack([v.float() for v in values])  # (S, B, T, d)
        keys = norm(V).unflatten(-1, (heads, -1))  # (S, B, T, H, d/H)
        # an elementwise product and sum, not a matmul: autocast would run that in bf16 when
        # backward() is called inside an autocast block
        logits = (keys * query.float().view(heads, -1)).sum(-1) + bias.float()[:, None, None, None]
        weights = logits.softmax(0)  # (S, B, T, H)
        return (weights[..., None] * V.unflatten(-1, (heads, -1))).sum(0).flatten(-2), weights

def combine(coefficients, updates):
    """Σ_i c_i·u_i, c_i a number (a sign) or a 0-d tensor (learned); from c_0·u_0, which is u_0
    itself for the number 1: Full AttnRes's block of one update is that update, not a copy."""
    c0, u0 = coefficients[0], updates[0]
    total = u0 if isinstance(c0, (int, float)) and c0 == 1 else c0 * u0
    for c, u in zip(coefficients[1:], updates[1:]):
        if isinstance(c, (int, float)):
            total = torch.add(total, u, alpha=c)
        else:
            total = torch.addcmul(total, c, u)
    return total

def matching_scale(state_ms, detail_ms, rho):
    """SPEC: WAV stability 2, from mean squares: s = min(ρ, rms(C) / (rms(D) + ε)) per token.
    Without gradient: it sets how much a selected detail contributes, not where gradients go."""
    return (state_ms.sqrt() / (detail_ms.sqrt() + EPS)).clamp(max=rho)

class DepthRouting:
    """The routing of residual=attnres, inherited by GPT: parameters, pool, read, RD, the loop."""

    def init_routing(self, config):
        d, n_sub = config.n_embd, 2 * config.n_layer
        self.bases = list(self.detail_signs(0))  # WAV's detail bases (none without WAV)
        # each basis a contrast of its own over a block: one equal to another, chosen or not, or to
        # its negative, would add the same detail twice or be that basis under its own name (a new
        # basis that is split at this block size)
        m = config.routing_block
        signs = [{**basis_signs(l, m), **self.detail_signs(l)} for l in range(m)]
        columns = {basis: [s[basis] for s in signs] for basis in signs[0]}
        for basis, other in [(b, o) for b in self.bases for o in columns if o != b]:
            if columns[basis] in (columns[other], [-s for s in columns[other]]):
                raise ValueError(f"WAV bases {basis} and {other} weigh a block of {m} sublayers "
                                 "alike: choose another basis or block size")
        self.reads = [read for l in range(n_sub + 1) for read in self.reads_before(l)]
        # routing parameters per read, but for the first sublayer's (it reads e alone: choice) and
        # rd=frozen_v's value route: a zero pseudo-query (SPEC), or with route_static a logit per
        # source, zero (uniform: equal to Block AttnRes at init); a detail bias per basis
        learned = [r for r in self.reads if r not in self.reads_before(0)
                   and r.role not in RD_MODES[config.rd].frozen]
        self.query = nn.ParameterDict()
        self.static_logits = nn.ParameterDict()
        for r in learned:
            if config.route_static:
                self.static_logits[r.key] = nn.Parameter(torch.zeros(self.pool_size(r)))
            else:
                self.query[r.key] = nn.Parameter(torch.zeros(d))
        beta = torch.full((len(self.bases),), config.wav_detail_bias)
        self.detail_bias = nn.ParameterDict()
        for r in learned if self.bases else []:
            if r.role != "readout" or config.wav_readout_details:
                self.detail_bias[r.key] = nn.Parameter(beta.clone())
        self.register_buffer("frozen_query", torch.zeros(d), persistent=False)
        self.register_buffer("frozen_detail_bias", beta, persistent=False)
        self.masked = {}  # routing interventions: {Read: names of the sources it may not read}
        if config.wav_learned_bases:  # SPEC: Learnable bases, a coefficient per sublayer and basis
            signs = [[float(s) for s in self.detail_signs(l).values()] for l in range(n_sub)]
            self.basis_coefficients = nn.Parameter(torch.tensor(signs))  # (2·n_layer, bases)
        if config.fast_routing and type(self).block_sources is not DepthRouting.block_sources:
            raise ValueError(
                f"fast_routing=True: {type(self).__name__} overrides block_sources, which the fast "
                "kernel cannot follow (its contract, docs/routing.md). Change completed blocks in "
                "complete(), the bases in detail_signs(), or build with fast_routing=False")

    def reads_before(self, l):
        """The reads that feed sublayer l, in forward order; before 2·n_layer, the readout."""
        if l == 2 * self.config.n_layer:
            return [Read(self.config.n_layer, "readout")]
        if l % 2:
            return [Read(l // 2, "mlp")]
        rd = RD_MODES[self.config.rd]
        roles = rd.roles[:1] if rd.tied else rd.roles  # tied: the one read is every role's
        return [Read(l // 2, role) for role in roles]

    def pool_size(self, read):
        """How many sources a read sees (route_static's logits): e, then per completed block and
        the partial one its state and details (the readout: states only, by default)."""
        m, l = self.config.routing_block, read.sublayer
        per_block = 1 + len(self.bases)
        if read.role == "readout" and not self.config.wav_readout_details:
            per_block = 1
        return 1 + per_block * (l // m) + (per_block if l % m else 0)

    def kernel_slots(self):
        """How many completed sources the kernel stores a forward: those the last sublayer reads,
        then a last full block's that only the readout reads (its state, unless
        wav_readout_details). Count a source added in complete() here too, or the kernel warns."""
        n_sub, m = 2 * self.config.n_layer, self.config.routing_block
        per_block = 1 + len(self.bases)
        last = per_block if self.config.wav_readout_details else 1
        return 1 + per_block * ((n_sub - 1) // m) + last * (n_sub % m == 0)

    # ----- the pool --------------------------------------------------------------
    def detail_signs(self, l):  # sublayer l's sign in each of the model's bases
        signs = basis_signs(l, self.config.routing_block)
        return {basis: signs[basis] for basis in self.config.detail_bases}

    def block_coefficients(self, first, n):
        """How a block's sources combine its n updates (sublayers first, ...): a row of ones, then
        per basis its signs or learned coefficients: lists of numbers or a (1 + bases, n) tensor."""
        if not self.config.wav_learned_bases:
            signs = [self.detail_signs(l) for l in range(first, first + n)]
            return [[1] * n] + [[s[basis] for s in signs] for basis in self.bases]
        learned = self.basis_coefficients[first:first + n].t()  # (bases, n)
        return torch.cat([torch.ones_like(learned[:1]), learned])

    def block_sources(self, name, block, first):
        """SPEC: the sources of the block of updates `block` (sublayers first, ...), explicitly:
        the state C = Σ u_i, then per detail basis D = Σ c_i·u_i RMS-matched to C (stability 2)."""
        rows = self.block_coefficients(first, len(block))
        state, *details = [combine(row, block) for row in rows]
        with torch.no_grad():
            scales = [matching_scale(mean_square(state), mean_square(d), self.config.wav_rho)
                      for d in details]
        values = [state] + [d * s[..., None] for d, s in zip(details, scales)]
        return [s._replace(value=v) for s, v in zip(self.block_source_names(name), values)]

    def block_source_names(self, name):  # a block's sources without values: the state, its details
        return [Source(name, None)] + [Source(f"{name}.{b}", None, b) for b in self.bases]

    def complete(self, b, block, pool):
        """SPEC: block b is complete: its sources C_b (and details) join the pool. Add more here."""
        return pool + self.block_sources(f"C{b}", block, b * self.config.routing_block)

    # ----- the read --------------------------------------------------------------
    def route(self, read, sources):
        """A read's pseudo-query (d,) and logit bias per source (S,): the detail bias of a detail's
        basis (SPEC: WAV stability 1), route_static's logits, −inf if masked. It sees the sources'
        names and bases, not their values (the kernel never builds the partial block's)."""
        key = read.key
        query = self.query[key] if key in self.query else self.frozen_query
        beta = self.detail_bias[key] if key in self.detail_bias else self.frozen_detail_bias
        by_basis = {None: query.new_zeros(()), **dict(zip(self.bases, beta))}  # a state: no bias
        bias = torch.stack([by_basis[s.basis] for s in sources])
        if key in self.static_logits:  # SPEC: Controls, static routing
            if len(sources) != len(self.static_logits[key]):  # e.g. sources added in complete()
                raise ValueError(f"route_static: {read} reads {len(sources)} sources but has "
                                 f"{len(self.static_logits[key])} logits: count them in pool_size")
            bias = bias + self.static_logits[key]
        if self.masked.get(read):  # SPEC: Controls, interventions: logit −inf, then renormalised
            # Python bools, not a tensor: a test of a tensor would break torch.compile's graph
            hidden = [s.name in self.masked[read] for s in sources]
            if all(hidden):
                raise ValueError(f"masking every source of {read} leaves it nothing to read")
            bias = bias.masked_fill(torch.tensor(hidden, device=bias.device), -math.inf)
        return query, bias

    def block_reads(self, pool, first, sublayers, cache, previous):
        """The kernel's reads before `sublayers` (a block that starts at sublayer `first`, or the
        readout), over the pool and the block's own sources, seen from its second sublayer on;
        None where read() takes the reference path: fast_routing=False, and generation with a KV
        cache (choice: one token at a time has nothing to batch). previous: the last block's."""
        if not self.config.fast_routing or (cache is not None and not torch.is_grad_enabled()):
            return None
        details = sublayers[0] < 2 * self.config.n_layer or self.config.wav_readout_details
        partial = [s for s in self.block_source_names("P") if details or s.basis is None]
        sources = {}  # what each read sees: the block's own sources from its second sublayer on
        for l in sublayers:
            for read in self.reads_before(l):
                sources[read] = pool + partial if l > first else pool
        rows = self.block_coefficients(first, sublayers[-1] - first)[:len(partial)]
        match = functools.partial(matching_scale, rho=self.config.wav_rho)
        routes = {read: self.route(read, s) for read, s in sources.items()}
        return BlockReads(routes, [(s.name, s.value) for s in pool], rows, match, previous,
                          sources, self.config.route_heads, self.kernel_slots())

    def read(self, read, pool, block, first, kernel, routes):
        """SPEC: the read `read` over the pool and the sources of its block (the updates `block`
        of sublayers first, ...): h (B, T, d). With routes (return_routes) it records the read's
        weights over its sources, and what it feeds (RD tied: under every role)."""
        if kernel is None:  # the reference: every source built explicitly, one softmax over them
            details = read.role != "readout" or self.config.wav_readout_details  # choice
            own = self.block_sources("P", block, first) if block else []
            sources = pool + [s for s in own if details or s.basis is None]
            query, bias = self.route(read, sources)
            values = [s.value for s in sources]
            h, weights = depth_read(query, bias, values, self.config.route_heads)
        else:  # the kernel below the banner: the same numbers, without building P's sources
            h, weights, sources = kernel(read, block, keep_weights=routes is not None)
        if routes is None:
            return h
        rd = RD_MODES[self.config.rd]
        names = [s.name for s in sources]
        tied = rd.tied and read.role == rd.q
        for role in rd.roles if tied else (read.role,):
            named = read._replace(role=role)
            feeds = rd.feeds(role) if role.startswith("attn") else ""
            # not detached: a loss written on the routes trains the routing (docs/routing.md)
            routes.append(dict(read=named, name=str(named), sources=names, weights=weights,
                               feeds=feeds))
        return h

    def sublayer_inputs(self, l, h):
        """SPEC: RD-AttnRes. What sublayer l runs on from its reads h ({role: (B, T, d)}): (x, x_k,
        x_v), where x_k, x_v are None when x feeds them too. A read computed but not used is an
        error (a role added to reads_before, or to RD_MODES, needs its use here)."""
        rd = RD_MODES[self.config.rd]
        roles = ("mlp",) * 3 if l % 2 else (rd.q, rd.k, rd.v)
        unused = [role for role in h if role not in roles]
        if unused:
            raise ValueError(f"reads computed but not used by the sublayer: {', '.join(unused)}")
        if rd.average and l % 2 == 0:  # Q, K and V read the mean of the reads, ½(h^QK + h^V)
            return sum(h.values()) / len(h), None, None
        x, x_k, x_v = (h[role] if role in h else h[rd.q] for role in roles)  # tied: q's read
        # None where x feeds the keys or values too: attention's one fused projection
        return x, *(None if t is x else t for t in (x_k, x_v))

    # ----- the forward loop ------------------------------------------------------
    def _attnres(self, e, rope, cache, routes):
        """SPEC: Attention Residuals. Sublayer l reads the pool [e, C_0, ..., C_{b-1}] (and WAV's
        details) and its own block's sources, runs, and appends its update to the block; a full
        block's sources join the pool. The final readout reads them all."""
        m, n_sub = self.config.routing_block, 2 * self.config.n_layer
        pool, block, kernel = [Source("emb", e)], [], None  # completed sources; block l // m so far
        for l in range(n_sub):
            first = l - len(block)  # the block's first sublayer
            if l % m == 0:  # a new block (the kernel reuses what the last block's reads computed)
                kernel = self.block_reads(pool, l, range(l, min(l + m, n_sub)), cache, kernel)
            h = {}
            for read in self.reads_before(l):
                h[read.role] = self.read(read, pool, block, first, kernel, routes)
            u = self._sublayer(l, *self.sublayer_inputs(l, h), rope, cache)
            block.append(u.float())  # choice: sources accumulate in float32, like nanoGPT's stream
            if len(block) == m:  # complete (a short last block stays partial)
                pool, block = self.complete(l // m, block, pool), []
        if self.masked:  # a mask on a read or source the model lacks (a typo: c0) hides nothing
            seen = {s.name for s in pool + self.block_source_names("P")}
            unknown = [*map(str, set(self.masked) - set(self.reads)),
                       *sorted({name for names in self.masked.values() for name in names} - seen)]
            if unknown:
                raise ValueError(f"masked: {', '.join(unknown)}: not a read or source of this "
                                 f"model (reads: {', '.join(map(str, self.reads))}; sources: "
                                 f"{', '.join(sorted(seen))})")
        # SPEC: the final readout; choice: no details unless wav_readout_details (conservative)
        pool = [s for s in pool if s.basis is None or self.config.wav_readout_details]
        first = n_sub - len(block)
        kernel = self.block_reads(pool, first, [n_sub], cache, kernel)
        return self.read(self.reads_before(n_sub)[0], pool, block, first, kernel, routes)

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
        # layer j: sublayers 2j (attention) and 2j+1 (MLP); how they join the stream: the routing
        self.layers = nn.ModuleList([nn.ModuleDict(dict(attn=CausalSelfAttention(config),
                                                        mlp=MLP(config)))
                                     for _ in range(config.n_layer)])
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied (weight tying, as GPT-2 and nanoGPT)
        cos, sin = rotary_tables(config.sequence_len, d // config.n_head)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # routing parameters come from constants, not the random stream: two configs with the same
        # seed start with identical shared weights (SPEC: Paired experiments)
        self.residual_gain = None
        if config.residual == "rezero":  # SPEC: x += α_l·f(x), α_l = 0
            self.residual_gain = nn.Parameter(torch.zeros(n_sub, 1))
        elif config.residual == "layerscale":  # SPEC: x += γ_l ⊙ f(norm(x)), CaiT's initial γ
            gamma = 0.1 if config.n_layer <= 18 else 1e-5 if config.n_layer <= 24 else 1e-6
            self.residual_gain = nn.Parameter(torch.full((n_sub, d), gamma))
        elif config.residual == "denseformer":  # SPEC: DenseFormer, weights (0, ..., 0, 1): PreNorm
            self.dwa_weights = nn.ParameterList([nn.Parameter(torch.eye(j + 2)[-1])
                                                 for j in range(config.n_layer)])
        elif config.residual == "attnres":
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

    # ----- forward ---------------------------------------------------------------
    def forward(self, idx, targets=None, return_routes=False):
        routes = [] if return_routes else None
        logits = self.lm_head(self._hidden(idx, routes=routes))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return (logits, loss, routes) if return_routes else (logits, loss)

    def _hidden(self, idx, cache=None, routes=None):
        """Final normed hidden states (B, T, d) for tokens idx (B, T) at positions cache.pos on."""
        B, T = idx.size()
        start = cache.pos if cache is not None else 0
        if start + T > self.config.sequence_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds "
                             f"sequence_len={self.config.sequence_len}")
        rope = (self.rope_cos[start:start + T], self.rope_sin[start:start + T])
        e = self.drop(self.wte(idx))
        residual = self._attnres if self.config.residual == "attnres" else self._residual
        x = residual(e, rope, cache, routes)
        if cache is not None:
            cache.pos += T
        return norm(x)

    def _sublayer(self, l, x, x_k, x_v, rope, cache):
        """u_l = f_l(norm(x)); ReZero feeds f_l the raw stream (SPEC: no pre-norm inside). x_k, x_v:
        RD-AttnRes's inputs of the keys and values, None where x feeds them."""
        layer = self.layers[l // 2]
        prep = (lambda t: t) if self.config.residual == "rezero" else norm
        x_k, x_v = (t if t is None else prep(t) for t in (x_k, x_v))
        if l % 2 == 0:
            return layer.attn(prep(x), rope, x_k, x_v, cache, l // 2)
        return layer.mlp(prep(x))

    def _residual(self, x, rope, cache, routes=None):
        """SPEC: prenorm x += f(norm(x)); rezero x += α·f(x); layerscale x += γ⊙f(norm(x));
        denseformer: after layer j, x = Σ_i α_ji·X_i over e and each layer's output X_i. With
        routes (return_routes) DenseFormer records each layer's α_j as the read layer{j}.dwa."""
        outputs = [x]  # DenseFormer: e, then each layer's output
        for l in range(2 * self.config.n_layer):
            u = self._sublayer(l, x, None, None, rope, cache)
            x = x + u if self.residual_gain is None else x + self.residual_gain[l] * u
            if self.config.residual == "denseformer" and l % 2:
                outputs.append(x)
                alpha = self.dwa_weights[l // 2]
                x = sum(w * X for w, X in zip(alpha, outputs))
                if routes is not None:
                    read = Read(l // 2, "dwa")
                    names = ["emb"] + [f"L{j}" for j in range(l // 2 + 1)]
                    weights = alpha.detach().view(-1, 1, 1, 1).expand(-1, *x.shape[:2], 1)
                    # any real numbers, not a distribution: routing_stats gives them no entropy
                    routes.append(dict(read=read, name=str(read), sources=names, weights=weights,
                                       distribution=False))
        return x

    # ----- training helpers ------------------------------------------------------
    def no_decay_parameters(self):
        """{name: parameter} of all but the matrices of Linear and Embedding layers: the routing's,
        ReZero/LayerScale gains, DenseFormer's weights, Linear biases (SPEC: Numerics)."""
        matrices = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear | nn.Embedding)}
        return {name: p for name, p in self.named_parameters() if id(p) not in matrices}

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), device_type=""):
        """AdamW, weight decay on the matrices of Linear and Embedding layers only."""
        no_decay = list(self.no_decay_parameters().values())
        decay = [p for p in self.parameters() if not any(p is q for q in no_decay)]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops):
        """Model FLOPs utilisation: achieved FLOP/s (flops_per_token) over the device's peak."""
        return self.flops_per_token() * tokens_per_iter / dt / peak_flops

    def flops_per_token(self):
        """Training FLOPs per token as PaLM counts them (appendix B): 6N for the N weights of the
        Linear layers, at each use (a lookup does none), plus attention's 12·L·d·T."""
        cfg = self.config
        N = sum(m.weight.numel() for _, m in self.named_modules(remove_duplicate=False)
                if isinstance(m, nn.Linear))
        return 6 * N + 12 * cfg.n_layer * cfg.n_embd * cfg.sequence_len

    # ----- generation ------------------------------------------------------------
    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens tokens after idx (B, T) with a KV cache. Past sequence_len tokens
        the context is the last sequence_len tokens, re-encoded at each step: exact, slower."""
        if not 0 < temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature={temperature!r}: must be > 0 and finite")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k!r}: must be >= 1, or None for no cut-off")
        if self.training and self.config.dropout > 0:  # dropout would change the tokens drawn
            raise ValueError("generate() in training mode drops out: call model.eval() first")
        # within float32's range: 1e-46 would be 0 there, 1e39 inf (0 / 0, -inf / inf: NaN)
        f32 = torch.finfo(torch.float32)
        temperature = min(max(temperature, f32.tiny), f32.max)
        cfg, cache = self.config, None
        for _ in range(max_new_tokens):
            if cache is None or cache.pos >= cfg.sequence_len:  # (re)fill the cache
                context = idx[:, -cfg.sequence_len:]
                amp = torch.is_autocast_enabled(idx.device.type)
                dtype = torch.get_autocast_dtype(idx.device.type) if amp else self.wte.weight.dtype
                cache = KVCache(cfg, idx.size(0), idx.device, dtype)
            else:
                context = idx[:, -1:]
            logits = self.lm_head(self._hidden(context, cache)[:, -1]).float()
            if top_k == 1:  # greedy: the likeliest token (the first of equals), no random draw
                idx_next = logits.argmax(-1, keepdim=True)
            else:
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                # the likeliest at 0: a tiny temperature sends the others to -inf (greedy), a huge
                # one every allowed logit to ~0 (uniform), never inf - inf
                logits = (logits - logits.amax(-1, keepdim=True)) / temperature
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

# =============================================================================
# Below this banner: a fast kernel for depth reads, and nothing of the model. It is given a pool
# of sources, queries and logit biases, and a block of updates with the coefficients that combine
# them into the block's own sources; it computes what depth_read computes over them, with
# hand-written backward passes (the coefficients' gradient too), and keeps whatever it needs for
# speed and memory. It knows nothing of WAV, RD or the routing fields. Its tests check it against
# depth_read.
# =============================================================================

class BlockReads:
    """The reads of one routing block, two-phase (SPEC: Two-phase computation). Phase 1 (here):
    every read over the completed sources, one batched pass over a buffer holding each once. Phase
    2 (per call): an online softmax merges it with the block's own sources, never built.

    routes: {read: (query (d,), bias (S + P_r,))}, a bias per S completed source, then per block
    source it sees (0 or P); completed: [(key, value (B, T, d))]; coefficients (P rows of n numbers,
    or a (P, n) tensor) and match: the block's sources (_block_state); previous: the last block's
    (its buffer reused); sources: {read: what it reads}; heads: H; capacity: the buffer's slots."""

    def __init__(self, routes, completed, coefficients, match, previous, sources, heads=1,
                 capacity=1):
        self.routes, self.coefficients, self.match = routes, coefficients, match
        self.sources = sources
        self.learned = isinstance(coefficients, torch.Tensor)
        self._store(completed, previous, capacity)
        # phase 1 reads the buffer's first S slots; a slot this block does not read gets logit −inf
        self.slots = [self.slot[key] for key, _ in completed]
        S, names = max(self.slots) + 1, list(routes)
        queries = torch.stack([routes[r][0] for r in names])
        biases = torch.stack([routes[r][1][:len(completed)] for r in names])
        column = dict(zip(self.slots, biases.unbind(1)))  # each slot's bias, by read
        hidden = biases.new_full(biases.shape[:1], -math.inf)
        biases = torch.stack([column.get(s, hidden) for s in range(S)], 1)
        V, inv_rms = self.buffer[:S], self.inv_rms[:S]  # views: no copy of the sources
        if torch.is_grad_enabled():
            out = CompletedReads.apply(queries, biases, V, inv_rms, heads, *self.owners[:S])
            mix, lse, p = out[:len(names)], out[len(names):-1], out[-1]
        else:  # eval: the same math without the autograd.Function (torch.compile rejects it there)
            mix, lse, p, _ = completed_reads(queries, biases, V, inv_rms, heads)
            mix, lse = mix.unbind(3), lse.unbind(2)
        self.phase1 = {name: (mix[r], lse[r], p[..., r, :]) for r, name in enumerate(names)}
        self.pieces, self.seen, self.state = {}, 0, None

    def _store(self, completed, previous, capacity):
        """Writes each new completed source once a forward into a slot of one float32 buffer
        (slots, B, T, d), with its inv_rms = rsqrt(mean(v²)+ε): phase 1 reads a view of it, no
        stack. A new value under a known key (an override of complete) takes a slot of its own."""
        if isinstance(previous, BlockReads):
            self.buffer, self.inv_rms = previous.buffer, previous.inv_rms
            self.slot, self.owners = dict(previous.slot), list(previous.owners)
        else:
            v = completed[0][1]
            self.buffer = v.new_empty((capacity, *v.shape), dtype=torch.float32)
            self.inv_rms = v.new_empty((capacity, *v.shape[:-1]), dtype=torch.float32)
            self.slot, self.owners = {}, []
        for key, value in completed:
            if key in self.slot and self.owners[self.slot[key]] is value:
                continue
            n = len(self.owners)
            if n == self.buffer.size(0):  # more sources than `capacity`: a copy, twice as large
                warnings.warn(f"fast_routing: more sources than kernel_slots() counts ({n}): the "
                              "kernel copies its buffer at each forward; count them there")
                self.buffer = torch.cat([self.buffer, torch.empty_like(self.buffer)])
                self.inv_rms = torch.cat([self.inv_rms, torch.empty_like(self.inv_rms)])
            # slot n is new: the views of slots < n that earlier blocks saved for backward are
            # unchanged, so their version need not change (it would fail their backward)
            with torch.no_grad(), _same_version(self.buffer), _same_version(self.inv_rms):
                self.buffer[n] = value
                self.inv_rms[n] = torch.rsqrt(mean_square(value) + EPS)
            self.slot[key] = n
            self.owners.append(value)

    def __call__(self, name, block, keep_weights=False):
        """h (B, T, d) of read `name` over the completed sources and those of `block` (its updates
        so far, one more per sublayer); its weights (S + P_r, B, T, H) if keep_weights; sources."""
        mix, lse, p = self.phase1[name]
        query, bias = self.routes[name]
        S = len(self.slots)
        if keep_weights:  # the weights of this read's completed sources, in its order
            p = torch.stack([p[s] for s in self.slots])
        if bias.size(0) == S:  # no block source; a copy: a view would keep all of phase 1 alive
            h = mix.clone(memory_format=torch.contiguous_format).flatten(-2)
            return h, p if keep_weights else None, self.sources[name]
        terms, coeffs, inv_rms, scale = self._block_state(block)
        args = (mix, lse, query, bias[S:], inv_rms[..., None], scale[..., None], coeffs)
        if torch.is_grad_enabled():
            h, a = PartialMerge.apply(*args, *terms)
        else:
            h, a = merge_partial(*args, terms)[:2]
        weights = torch.cat([a[0] * p, a[1:]]) if keep_weights else None
        return h, weights, self.sources[name]

    def _block_state(self, block):
        """The block's sources p = s_p·Σ_i c_pi·u_i (s_0 = 1, s_p = match(mean squares), without
        gradient) as PartialMerge takes them: terms, their coefficients (P, K), inv_rms and scale
        (P, B, T). Updates with equal fixed coefficients are summed into one term (WAV: at most 4
        a block; Block AttnRes: 1); learned coefficients keep one term per update."""
        if self.state is None or self.seen != len(block):
            for i in range(self.seen, len(block)):  # update i joins its piece
                key = i if self.learned else tuple(row[i] for row in self.coefficients)
                self.pieces[key] = self.pieces[key] + block[i] if key in self.pieces else block[i]
            self.seen = len(block)
            terms = tuple(self.pieces.values())
            rows = self.coefficients[:, :len(terms)] if self.learned else tuple(zip(*self.pieces))
            if self.learned:
                coeffs = rows
            elif rows == ((1,),):  # Block AttnRes: its one source is its one term
                coeffs = None
            else:
                coeffs = _constant(rows, terms[0].device)  # (P, K)
            # SPEC: WAV stability 2, mean squares and scales without gradient (and in float32)
            with torch.no_grad(), float32(terms[0]):
                # a source at a time from its terms: on a CPU faster than a (P, K) matrix product
                ms = torch.stack([mean_square(combine(row, terms)) for row in rows])  # (P, B, T)
                scale = torch.cat([torch.ones_like(ms[:1]), self.match(ms[0], ms[1:])])  # (P, B, T)
                inv_rms = torch.rsqrt(scale.square() * ms + EPS)  # mean((s·v)²) = s²·mean(v²)
            self.state = terms, coeffs, inv_rms, scale
        return self.state

_same_version = torch.autograd._unsafe_preserve_version_counter
_CONSTANTS = {}  # (values, device) -> tensor

def _constant(values, device):
    """A small float32 tensor of fixed values on `device`, built once: a copy from the host to a
    GPU at every read would wait for its queue to drain (compiled: a constant of the graph)."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (values, str(device))
    if key not in _CONSTANTS:
        with torch.inference_mode(False):
            _CONSTANTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _CONSTANTS[key]

def _by_head(queries, heads):  # (R, d) -> (d, R·H): column (r, k) is w_r on slice k, else 0
    mask = torch.eye(heads, device=queries.device).repeat_interleave(queries.size(1) // heads, 1)
    return (queries[:, None] * mask).flatten(0, 1).t()

def _slices(V, heads):  # (S, B, T, d) -> (B·T·H, S, d/H): each token's head slices, a view
    return V.reshape(V.size(0), -1, V.size(-1) // heads).transpose(0, 1)

def completed_reads(queries, biases, V, inv_rms, heads=1):
    """Phase 1's forward: queries (R, d), biases (R, S), the sources V (S, B, T, d) and their
    inv_rms (S, B, T). Returns mix (B, T, H, R, d/H), lse (B, T, R, H), p (S, B, T, R, H) and the
    dots (S, B, T, R, H), head k's slice of vᵀw."""
    with float32(V):
        W = _by_head(queries.float(), heads)
        # one matmul over every source and token; choice: TF32 allowed on CUDA (SPEC: Choices)
        dots = (V.reshape(-1, V.size(-1)) @ W).view(*V.shape[:-1], -1, heads)
        logits = dots * inv_rms[..., None, None] + biases.float().t()[:, None, None, :, None]
        # finite when every completed source is masked (−inf): p = 0, not NaN
        lse = logits.logsumexp(0).clamp(min=torch.finfo(torch.float32).min)
        p = (logits - lse).exp()
        # (B·T·H, R, S) @ (B·T·H, S, d/H); a view of p, not contiguous, takes a slow path on a CPU
        mix = torch.bmm(p.permute(1, 2, 4, 3, 0).contiguous().flatten(0, 2), _slices(V, heads))
    return mix.view(*V.shape[1:3], heads, *mix.shape[1:]), lse, p, dots

def merge_partial(mix, lse, query, bias, inv_rms, scale, coeffs, terms):
    """Phase 2's forward: a read's summary mix (B, T, H, d/H), lse (B, T, H), its query (d,), and
    P partial sources scale_p · Σ_k coeffs[p, k]·terms_k: bias (P,), inv_rms and detached scale
    (P, B, T, 1), coeffs (P, K) or None (_per_row), terms (B, T, d). Returns h (B, T, d), a (1+P,
    B, T, H), dots ṽ_pᵀw (P, B, T, H), the terms' dots t_kᵀw (K, B, T, H)."""
    with float32(mix):
        q = query.float().view(mix.size(-2), -1)  # (H, d/H)
        # vecdot, not v @ q: a per-token dot product is one fused pass, v @ q 2x slower on a CPU
        term_dots = torch.stack([torch.linalg.vecdot(t.float().view(mix.shape), q) for t in terms])
        dots = _per_row(coeffs, term_dots) * scale
        a = torch.cat([lse[None], dots * inv_rms + bias.float()[:, None, None, None]]).softmax(0)
        h = a[0][..., None] * mix
        for t, w in zip(terms, _per_row(coeffs, a[1:] * scale, by_term=True)):  # its weight in h
            h.addcmul_(w[..., None], t.float().view(mix.shape))
    return h.flatten(-2), a, dots, term_dots

def _per_row(coeffs, x, by_term=False):
    """Σ_k coeffs[p, k]·x_k for every row p, (K, ...) -> (P, ...): the sources from the terms; or
    by_term, Σ_p coeffs[p, k]·x_p: what each term receives from the sources. None: one source,
    the one term (Block AttnRes): x itself."""
    if coeffs is None:
        return x
    coeffs = coeffs.t() if by_term else coeffs
    return (coeffs.float() @ x.flatten(1)).view(coeffs.size(0), *x.shape[1:])

class CompletedReads(torch.autograd.Function):
    """Phase 1 with a batched backward (one gradient per source, not one per read). Read r returns
    mix_r (B, T, H, d/H), normalised over the completed sources, and lse_r (B, T, H), which phase
    2 treats as one source with logit lse_r; and p (S, B, T, R, H), recomputed in the backward
    from the dots vᵀw. The sources come as the buffer V (not differentiable) and as the values
    that own its slots (their gradients); per head k, on its slice of the width:
        dlogit_rs = p_rs (g_rs − Σ_s' p_rs' g_rs' + dlse_r),  g_rs = ⟨dmix_r, v_s⟩ + dp_rs
        dv_s = Σ_r p_rs dmix_r + dlogit_rs·inv_rms_s·w_r − Σ_r dlogit_rs·(v_sᵀw_r)·inv_rms_s³/d·v_s
        dw_r = Σ dlogit_rs·inv_rms_s·v_s,  dbias_rs = Σ dlogit_rs."""

    @staticmethod
    def forward(ctx, queries, biases, V, inv_rms, heads, *owners):
        mix, lse, p, dots = completed_reads(queries, biases, V, inv_rms, heads)
        ctx.save_for_backward(queries, biases, V, inv_rms, dots, lse)
        ctx.heads = heads
        return (*mix.unbind(3), *lse.unbind(2), p)

    @staticmethod
    def backward(ctx, *grads):
        queries, biases, V, inv_rms, dots, lse = ctx.saved_tensors
        H, R, (S, B, T, d) = ctx.heads, queries.size(0), V.shape
        with float32(queries):  # float32 also when backward() is called under autocast
            p = (dots * inv_rms[..., None, None] + biases.float().t()[:, None, None, :, None]
                 - lse).exp()
            dmix = [g.float() for g in grads[:R]]  # (B, T, H, d/H) each
            dlse = torch.stack(grads[R:2 * R], dim=2).float()  # (B, T, R, H)
            # g (S, B, T, R, H): ⟨dmix_r, v_s⟩ per head, plus dp, the gradient of a loss on p
            rhs = torch.stack(dmix, 3).flatten(0, 2)  # (B·T·H, R, d/H)
            g = torch.bmm(rhs, _slices(V, H).transpose(1, 2)).view(B, T, H, R, S)
            g = g.permute(4, 0, 1, 3, 2) + grads[2 * R].float()
            dlogits = p * (g - (p * g).sum(0) + dlse)
            c = dlogits * inv_rms[..., None, None]
            # through the key norm: inv_rms = (mean(v²) + ε)^(−1/2), ∂inv_rms/∂v = −inv_rms³·v/d
            norm = (dlogits * dots).sum((3, 4)) * inv_rms.pow(3) / -d  # (S, B, T)
            W = _by_head(queries.float(), H).t()  # (R·H, d): row (r, k) is w_r on slice k
            dV = [_source_grad(p[s], c[s], norm[s], V[s], dmix, W) for s in range(S)]
            # dw_r's slice k: the (r, k, k) block of (R, H, H, d/H)
            dW = (c.reshape(-1, R * H).t() @ V.reshape(-1, d)).view(R, H, H, -1)
            dqueries = dW.diagonal(dim1=1, dim2=2).transpose(1, 2).reshape(R, d)
            dbiases = dlogits.sum((1, 2, 4)).t()  # (R, S)
        return dqueries.to(queries.dtype), dbiases, None, None, None, *dV

def _source_grad(p, c, norm, v, dmix, W):
    """dv (B, T, d) of one source v: through the dot products, c (B, T, R, H) @ W (R·H, d) in one
    matrix product, through the key norm (B, T), then through the mix, Σ_r p_r·dmix_r (p (B, T,
    R, H)), elementwise: on a CPU faster than a matrix product per token."""
    B, T, R, H = p.shape
    dv = torch.addcmul((c.reshape(-1, R * H) @ W).view_as(v), norm[..., None], v)
    heads = dv.view(B, T, H, -1)
    for r in range(R):
        heads.addcmul_(p[:, :, r, :, None], dmix[r])
    return dv

class PartialMerge(torch.autograd.Function):
    """Phase 2 with a hand-written backward: a softmax over [lse, the partial sources' logits].
    The sources, combinations of the terms with detached scales and inv_rms, are never built: the
    backward keeps the terms (shared by the block's reads), h and P×B×T numbers. Per head, on its
    slice of the width (the key norm's term sums the heads: the norm is over the whole width), with
    ṽ_p = s_p·v_p, v_p = Σ_k c_pk·term_k, inv_rms_p = (s_p²·mean(v_p²) + ε)^(−1/2):
        dlogit_p = a_p (⟨dh, ṽ_p⟩ − ⟨dh, h⟩ + da_p − Σ_j a_j da_j),  dmix = a_0 dh,
        dlse = −Σ_p dlogit_p (softmax gradients sum to zero: no copy of mix is needed),
        dv_p = s_p (a_p dh + dlogit_p·inv_rms_p·w) − dlogit_p·(ṽ_p·w)·inv_rms_p³·s_p²/d · v_p,
        dterm_k = Σ_p c_pk dv_p,  dc_pk = Σ ⟨dv_p, term_k⟩ (for coefficients that require grad)."""

    @staticmethod
    def forward(ctx, mix, lse, query, bias, inv_rms, scale, coeffs, *terms):
        h, a, dots, term_dots = merge_partial(mix, lse, query, bias, inv_rms, scale, coeffs, terms)
        ctx.save_for_backward(query, inv_rms, scale, coeffs, dots, a, h, term_dots, *terms)
        ctx.set_materialize_grads(False)  # da is None unless a loss reads the weights: no work
        return h, a

    @staticmethod
    def backward(ctx, dh, da):
        query, inv_rms, scale, coeffs, dots, a, h, term_dots, *stored = ctx.saved_tensors
        with float32(h):  # float32 also when backward() is called under autocast
            dh = torch.zeros_like(h) if dh is None else dh.float()  # a loss on the weights alone
            heads = (*h.shape[:-1], a.size(-1), -1)  # (B, T, H, d/H): a view of (B, T, d)
            q = query.float().view(heads[-2:])
            terms = [t.float() for t in stored]
            # ⟨dh, term_k⟩ (K, B, T, H), then dlogit (P, B, T, H)
            term_grads = torch.stack([torch.linalg.vecdot(dh.view(heads), t.view(heads))
                                      for t in terms])
            dlogit = a[1:] * (_per_row(coeffs, term_grads) * scale
                              - torch.linalg.vecdot(dh.view(heads), h.view(heads)))
            if da is not None:  # a loss on the weights a: the softmax's backward, a·(da − Σ a·da)
                dlogit += a[1:] * (da[1:].float() - (a * da.float()).sum(0))
            c = dlogit * inv_rms * scale  # through the dot product
            # the key norm (P, B, T, 1)
            norm_term = (dlogit * dots).sum(-1, keepdim=True) * inv_rms.pow(3) * scale.square()
            norm_term = norm_term / h.size(-1)
            c_k = _per_row(coeffs, c, by_term=True)
            a_k = _per_row(coeffs, a[1:] * scale, by_term=True)
            # −Σ_p c_pk·norm_term_p·v_p = Σ_j M_kj·term_j, M_kj = −Σ_p c_pk·c_pj·norm_term_p
            C = coeffs.float() if coeffs is not None else h.new_ones(1, 1)
            M = -_per_row(C, C[:, :, None, None, None] * norm_term[:, None], by_term=True)
            dquery = sum(torch.einsum("bth,bthe->he", c_k[k], t.view(heads))
                         for k, t in enumerate(terms)).flatten()
            dterms = []
            for k in range(len(terms)):
                dt = torch.addcmul(c_k[k][..., None] * q, a_k[k][..., None], dh.view(heads))
                dt = dt.flatten(-2)
                for j, t in enumerate(terms):
                    dt.addcmul_(M[k, j], t)
                dterms.append(dt)
            dmix = a[0][..., None] * dh.view(heads)
            dlse = -dlogit.sum(0)
            dbias = dlogit.sum((1, 2, 3))
            dcoeffs = None
            if ctx.needs_input_grad[6]:
                # ⟨dv_p, t_k⟩ = s_p a_p ⟨dh, t_k⟩ + c_p ⟨w, t_k⟩ − norm_p Σ_j c_pj ⟨t_j, t_k⟩
                gram = torch.stack([torch.stack([torch.linalg.vecdot(t, u) for u in terms])
                                    for t in terms])
                dcoeffs = (torch.einsum("pbth,kbth->pk", a[1:] * scale, term_grads)
                           + torch.einsum("pbth,kbth->pk", c, term_dots)
                           - torch.einsum("pbt,pj,jkbt->pk", norm_term[..., 0], C, gram))
                dcoeffs = dcoeffs.to(coeffs.dtype)
        return dmix, dlse, dquery.to(query.dtype), dbias, None, None, dcoeffs, \
            *(dt.to(t.dtype) for dt, t in zip(dterms, stored))
