"""
Tests of the model, nanoroute.py. Run: python -m pytest -q (the scripts' tests are in tests/)

The model tests check every routing mechanism against a small reference written here with plain
loops over sources (no batching, no online softmax, no custom autograd), from SPEC.md's equations.
"""

import ast
import contextlib
import dataclasses
import functools
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

import bench
import diagnostics
import nanoroute
from diagnostics import js_divergence, routing_stats
from nanoroute import GPT, GPTConfig


@pytest.fixture(autouse=True)
def _tf32_as_before():
    """train.py and bench.py turn TF32 on here; a later float32 test on CUDA must not inherit it."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before

# --- Model: a loop-based reference of the routing math (SPEC.md), and the tests against it ---

VOCAB, SEQ = 23, 16
TINY = dict(vocab_size=VOCAB, sequence_len=SEQ, n_layer=3, n_head=2, n_embd=16)
ATTNRES = dict(residual="attnres")  # the residual every routing setting needs

# The per-mode tests take their cases from the tables, so that an entry is tested the moment it
# exists: the shapes the kernel treats apart first (n_layer=3 is 6 sublayers: attnres_block=4
# leaves a shorter last block of 2, attnres_block=1 is Full AttnRes), then every variant of
# VARIANTS, every residual of RESIDUALS and every mode of RD_MODES.
SHAPES = {
    "block_short_last": dict(ATTNRES, attnres_block=4),
    "full": dict(ATTNRES, attnres_block=1),
    "wav_split": dict(ATTNRES, wav=True, wav_bases="split", attnres_block=4),
    "wav_phase_readout": dict(ATTNRES, wav=True, wav_bases="phase", wav_readout_details=True,
                              attnres_block=4),
    "wav_wide": dict(ATTNRES, wav=True, attnres_block=6, n_layer=3),
    # two completed blocks: the readout reads C0 and C1 but not C0's details (the kernel's slots)
    "wav_deep": dict(ATTNRES, wav=True, attnres_block=4, n_layer=4, wav_rho=1.5,
                     wav_detail_bias=-1.0),
    "rd_wav": dict(ATTNRES, rd="decoupled", wav=True, attnres_block=4),
    # SPEC: Learnable bases
    "wav_learned": dict(ATTNRES, wav=True, wav_learned_bases=True, attnres_block=4),
    "wav_learned_rd": dict(ATTNRES, wav=True, wav_learned_bases=True, wav_readout_details=True,
                           rd="decoupled", attnres_block=6),
    "static": dict(ATTNRES, route_static=True, attnres_block=4),  # SPEC: Controls
    "static_wav_rd": dict(ATTNRES, route_static=True, wav=True, rd="decoupled", attnres_block=4),
    "heads": dict(ATTNRES, route_heads=4, attnres_block=4),  # SPEC: Multi-head reads
    "heads_wav_rd": dict(ATTNRES, route_heads=2, wav=True, rd="frozen_v", attnres_block=4,
                         wav_detail_bias=-1.5),  # frozen_v's value route starts at it too
    "heads_wav_learned": dict(ATTNRES, route_heads=2, wav=True, wav_learned_bases=True),
}


def distinct(cases):
    """The cases of distinct configurations: the tables name a few twice (prenorm, rd=off)."""
    seen, kept = [], {}
    for name, overrides in cases.items():
        config = GPTConfig(**{**TINY, **overrides})
        if config not in seen:
            seen.append(config)
            kept[name] = overrides
    return kept


ALL_MODES = distinct({**SHAPES,
                      **{name: nanoroute.variant(name) for name in nanoroute.VARIANTS},
                      **{residual: dict(residual=residual) for residual in nanoroute.RESIDUALS},
                      **{f"wav_{bases}": dict(residual="attnres", wav=True, wav_bases=bases)
                         for bases in nanoroute.WAV_BASES},
                      **{f"rd_{m}": dict(residual="attnres", rd=m, attnres_block=4)
                         for m in nanoroute.RD_MODES}})
# a model setting outside the routing (not a size): the value a case runs it with; causality, KV
# cache == recompute and fast == reference run it on Block AttnRes (a mask the one-token step
# misses fails there, and so does a setting the fast kernel ignores)
MODEL_CASES = dict(dropout=0.1, bias=True)
ON_BLOCK = {f"block_{name}": dict(nanoroute.variant("block"), **{name: value})
            for name, value in MODEL_CASES.items()}
CACHE_MODES = {**ALL_MODES, **ON_BLOCK}
ATTNRES_MODES = {m: kw for m, kw in ALL_MODES.items() if kw.get("residual") == "attnres"}
CLASSIC_MODES = [m for m, kw in ALL_MODES.items() if kw.get("residual") != "attnres"]


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def randomise_routing(model, seed=1, scale=1.0):
    """Move every routing parameter off its init, so tests see more than uniform weights: every
    parameter not a Linear or Embedding matrix (configure_optimizers' rule), whatever its name."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.no_decay_parameters().values():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def tokens(B=2, T=12, seed=3):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def ref_read(query, bias, values, heads=1):
    """SPEC: α = softmax_s(wᵀ RMSNorm(v_s) + bias_s), h = Σ α_s v_s, one source at a time; with
    H heads (MHAR), the same per slice k of the width: w_k against RMSNorm(v_s)'s slice k (the
    norm over the whole width), mixing the values' slice k. Weights (S, B, T, H)."""
    width = values[0].size(-1) // heads
    hs, ws = [], []
    for k in range(heads):
        part = slice(k * width, (k + 1) * width)
        logits = []
        for v, b in zip(values, bias):
            key = v / torch.sqrt((v * v).mean(-1, keepdim=True) + nanoroute.EPS)
            logits.append((key[..., part] * query[part]).sum(-1) + b)
        top = torch.stack(logits).max(0).values
        exps = [torch.exp(x - top) for x in logits]
        total = sum(exps)
        weights = [x / total for x in exps]
        hs.append(sum(w[..., None] * v[..., part] for w, v in zip(weights, values)))
        ws.append(torch.stack(weights))
    return torch.cat(hs, -1), torch.stack(ws, -1)


def ref_block_sources(updates, first, name, bases, m, rho, learned=None):
    """Sources of one block from its updates u_first, u_first+1, ... written as explicit sums
    (SPEC: C = Σ u_i, D^phase = Σ a_i u_i, D^split = Σ r_i u_i, then detached RMS matching); with
    learned (SPEC: Learnable bases, a (2·n_layer, bases) tensor), D = Σ learned[l, basis]·u_l."""
    state = sum(updates)
    out = [(name, state, 0)]
    for k, basis in enumerate(bases, start=1):
        detail = 0
        for i, u in enumerate(updates):
            l = first + i  # the sublayer that wrote u
            a = 1 if l % 2 == 0 else -1  # attention +1, MLP −1
            r = 1 if i < m / 2 else -1  # first half of the (full) block +1
            signs = dict(phase=a, split=r)  # SPEC's bases: a new one needs its signs here
            c = signs[basis] if learned is None else learned[l, k - 1]
            detail = detail + c * u
        rms = lambda x: torch.sqrt((x * x).mean(-1))  # noqa: E731
        scale = torch.minimum(rms(state) / (rms(detail) + nanoroute.EPS), torch.tensor(rho))
        out.append((f"{name}.{basis}", scale.detach()[..., None] * detail, k))
    return out


def ref_pool(e, updates, l, cfg, learned=None):
    """The pool before sublayer l: [e, C_0 (+details), ..., C_{b-1} (+details)] + [P (+details)]."""
    m, bases, rho = cfg.routing_block, cfg.detail_bases, cfg.wav_rho
    pool = [("emb", e, 0)]
    for b in range(l // m):
        pool += ref_block_sources(updates[b * m:b * m + m], b * m, f"C{b}", bases, m, rho, learned)
    if l % m:
        first = l // m * m
        pool += ref_block_sources(updates[first:l], first, "P", bases, m, rho, learned)
    return pool


# The routing settings reference_forward computes: a new one, its equations there, then its name
REFERENCE_FIELDS = ("residual", "attnres_block", "wav", "wav_bases", "wav_rho", "wav_detail_bias",
                    "wav_readout_details", "wav_learned_bases", "rd", "route_heads",
                    "route_static", "fast_routing")


def reference_forward(model, idx):
    """AttnRes forward from SPEC.md, using the model's own parameters and sublayer modules.
    Returns logits, {read name: (source names, weights)} and the normed sublayer inputs."""
    cfg, T = model.config, idx.size(1)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    unknown = [name for name in nanoroute.routing_fields(type(cfg))
               if name not in REFERENCE_FIELDS and getattr(cfg, name) != defaults[name]]
    if unknown:  # said here, not as a mismatch of the outputs
        pytest.fail(f"{', '.join(unknown)}: reference_forward in test_nanoroute.py does not "
                    "compute it: write its SPEC equations there, then add it to REFERENCE_FIELDS")
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    e = model.wte(idx)
    updates, reads, inputs = [], {}, []

    def read(name, pool):
        key = name.replace(".", "_")
        query = model.query[key] if key in model.query else torch.zeros(cfg.n_embd)
        beta = model.detail_bias[key] if key in model.detail_bias else torch.full(
            (len(cfg.detail_bases),), cfg.wav_detail_bias)
        bias = [0.0 if basis == 0 else beta[basis - 1] for _, _, basis in pool]
        if key in model.static_logits:  # SPEC: Controls, a learned logit per source, no query
            bias = [b + s for b, s in zip(bias, model.static_logits[key])]
        masked = {n for read, names in model.masked.items() if str(read) == name for n in names}
        bias = [-math.inf if n in masked else b for b, (n, _, _) in zip(bias, pool)]
        h, w = ref_read(query, bias, [v for _, v, _ in pool], cfg.route_heads)
        reads[name] = ([n for n, _, _ in pool], w)
        return h
    learned = getattr(model, "basis_coefficients", None)  # SPEC: Learnable bases
    for l in range(2 * cfg.n_layer):
        pool = ref_pool(e, updates, l, cfg, learned)
        layer = model.layers[l // 2]
        if l % 2:
            x = nanoroute.norm(read(f"layer{l // 2}.mlp", pool))
            inputs.append(x)
            updates.append(layer.mlp(x))
            continue
        rd, h = nanoroute.RD_MODES[cfg.rd], {}  # SPEC: RD-AttnRes, as its table says
        for role in rd.roles:
            if rd.tied and role != rd.q:  # w^V ≡ w^QK: the same read, under both names
                h[role] = h[rd.q]
                reads[f"layer{l // 2}.{role}"] = reads[f"layer{l // 2}.{rd.q}"]
            else:
                h[role] = read(f"layer{l // 2}.{role}", pool)
        q, k, v = h[rd.q], h[rd.k], h[rd.v]
        if rd.average:  # Q, K and V read the mean of the reads
            q = k = v = sum(h.values()) / len(h)
        x = nanoroute.norm(q)
        inputs.append(x)
        updates.append(layer.attn(x, rope, nanoroute.norm(k), nanoroute.norm(v)))
    pool = ref_pool(e, updates, 2 * cfg.n_layer, cfg, learned)
    if not cfg.wav_readout_details:
        pool = [s for s in pool if s[2] == 0]
    h = read("readout", pool)
    return model.lm_head(nanoroute.norm(h)), reads, inputs


def test_every_routing_setting_is_run_by_a_case_and_table_entries_differ():
    # a new routing field is tested once a case sets it (the reference then fails until it
    # computes it); set by no case, it would pass every test without being run
    for name in nanoroute.routing_fields()[1:]:
        default = nanoroute.CONFIG_FIELDS[name].default
        cases = [m for m, kw in ATTNRES_MODES.items() if kw.get(name, default) != default]
        assert cases or name == "fast_routing", f"no case of SHAPES sets {name}: add one"
    # an entry equal to another is that one under a new name: every test would pass on it
    variants = {name: nanoroute.variant(name) for name in nanoroute.VARIANTS}
    for table in (nanoroute.RD_MODES, variants):
        for i, (a, row_a) in enumerate(table.items()):
            for b, row_b in list(table.items())[i + 1:]:
                assert row_a != row_b, f"{b} is {a} under another name: give it what differs"


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(GPTConfig)
                                  if f.name not in (*TINY, *nanoroute.routing_fields())])
def test_every_model_setting_has_a_case_and_changes_the_model(name):
    # a new field outside the routing fails here until a case sets it; set, it must change the
    # model: a field that no code reads would pass every other test
    assert name in MODEL_CASES, f"no case sets {name}: add its value to MODEL_CASES"
    idx, targets, losses = tokens(), tokens(seed=4), []
    for value in (nanoroute.CONFIG_FIELDS[name].default, MODEL_CASES[name]):
        model = make_model(**{name: value})
        optimizer = model.configure_optimizers(0.1, 1e-2)
        for _ in range(2):  # the second step's loss: a setting may act through training
            torch.manual_seed(0)
            _, loss = model(idx, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] != losses[1], f"{name}={MODEL_CASES[name]} changed nothing"


def reference_residual(model, idx):
    """SPEC: prenorm x += f(norm(x)); rezero x += α·f(x) (no norm inside); layerscale
    x += γ⊙f(norm(x)); denseformer: PreNorm layers, each layer's input the weighted sum of e and
    every earlier layer's output."""
    cfg = model.config
    if cfg.residual not in ("prenorm", "rezero", "layerscale", "denseformer"):
        pytest.fail(f"residual={cfg.residual!r} has no reference: write its SPEC equations in "
                    "reference_residual, test_nanoroute.py, beside the others (docs/routing.md)")
    rope = (model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)])
    x = model.wte(idx)
    outputs = [x]
    for l in range(2 * cfg.n_layer):
        inp = x if cfg.residual == "rezero" else nanoroute.norm(x)
        layer = model.layers[l // 2]
        u = layer.mlp(inp) if l % 2 else layer.attn(inp, rope)
        x = x + (u if cfg.residual in ("prenorm", "denseformer") else model.residual_gain[l] * u)
        if cfg.residual == "denseformer" and l % 2:
            outputs.append(x)
            alpha = model.dwa_weights[l // 2]
            x = sum(alpha[i] * outputs[i] for i in range(len(outputs)))
    return model.lm_head(nanoroute.norm(x))


@pytest.mark.parametrize("mode", CLASSIC_MODES)
def test_classic_residuals_equal_reference(mode):
    model, idx = randomise_routing(make_model(**ALL_MODES[mode]), scale=0.5), tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference_residual(model, idx),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ATTNRES_MODES)
@pytest.mark.parametrize("fast", [True, False])
def test_routed_inputs_equal_reference_and_reads_start_uniform(mode, fast):
    assert_routed_model_equals_reference(ATTNRES_MODES[mode], fast)
    # at init, zero queries (or static logits): every state source weighs the same; a WAV detail
    # source (a dotted name) e^wav_detail_bias of it (e^-2 by default)
    model = make_model(**ATTNRES_MODES[mode], fast_routing=fast)
    _, _, routes = model(tokens(), return_routes=True)
    detail = math.exp(model.config.wav_detail_bias)
    for r in routes:
        gain = torch.tensor([detail if "." in n else 1.0 for n in r["sources"]])
        want = (gain / gain.sum())[:, None, None, None].expand_as(r["weights"])
        torch.testing.assert_close(r["weights"], want)


def assert_routed_model_equals_reference(overrides, fast):
    """Logits, every read's sources and weights, and every sublayer's input, against the loops;
    returns the reference's reads."""
    model, idx = randomise_routing(make_model(**overrides, fast_routing=fast)), tokens()
    seen = []  # what each attention and MLP sublayer gets, in forward order
    hooks = [sub.register_forward_pre_hook(lambda mod, args: seen.append(args))
             for layer in model.layers for sub in (layer.attn, layer.mlp)]
    logits, _, routes = model(idx, return_routes=True)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        ref_logits, ref_reads, ref_inputs = reference_forward(model, idx)
    assert [r["name"] for r in routes if r["name"] in ref_reads] == list(ref_reads)  # forward order
    for r in routes:
        names, w = ref_reads[r["name"]]
        assert r["sources"] == names, r["name"]
        torch.testing.assert_close(r["weights"], w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["weights"].sum(0), torch.ones_like(r["weights"][0]))
        assert r["weights"].shape[-1] == model.config.route_heads
    assert len(seen) == len(ref_inputs)
    for args, want in zip(seen, ref_inputs):
        torch.testing.assert_close(args[0].detach(), want, atol=1e-5, rtol=1e-5)
    if nanoroute.RD_MODES[model.config.rd].average:  # one input for Q, K and V: the mean's
        assert all(args[2] is None for args in seen[::2])
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    return ref_reads


# WAV with a short last block, or a routing block not dividing 2*n_layer, equals the reference
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("n_layer,block,bases", [(3, 4, "split"), (4, 6, "split"), (5, 4, "both"),
                                                 (5, 6, "split"), (5, 8, "split")])
def test_wav_split_basis_with_a_short_last_block_equals_reference(n_layer, block, bases, fast):
    # the split basis signs by place in the *full* block (SPEC): a short last block is the hard case
    assert (2 * n_layer) % block  # every shape here ends on a partial block
    reads = assert_routed_model_equals_reference(dict(
        residual="attnres", wav=True, wav_bases=bases, n_layer=n_layer, attnres_block=block,
        wav_readout_details=True), fast)
    assert any(n.endswith(".split") for n in reads["readout"][0])  # readout sees details


@pytest.mark.parametrize("coefficients",
                         [[1], [-1], [2.5], [0], [1, -1, 0], [-1, 1, 1], [0, 1], [-1, -1]])
def test_combine_is_the_weighted_sum_for_any_coefficients(coefficients):
    """combine(c, u) = Σ c_i·u_i exactly, whatever the first coefficient (a basis of one's own
    may start at −1 or 0), and for learned coefficients (0-d tensors, the first at 1 as at init)
    each gets the gradient ⟨dL/dsum, u_i⟩."""
    us = [torch.randn(2, 3, 4) for _ in coefficients]
    want = sum(c * u for c, u in zip(coefficients, us))
    torch.testing.assert_close(nanoroute.combine(coefficients, us), want, rtol=0, atol=1e-6)
    learned = [torch.tensor(float(c), requires_grad=True) for c in coefficients]
    g, total = torch.randn(2, 3, 4), nanoroute.combine(learned, us)
    torch.testing.assert_close(total, want, rtol=0, atol=1e-6)
    (total * g).sum().backward()
    for c, u in zip(learned, us):
        assert c.grad is not None
        torch.testing.assert_close(c.grad, (u * g).sum())


def test_wav_bases_are_signed_sums_learned_ones_start_at_the_signs_and_the_kernel_sums_once():
    cfg = GPTConfig(**TINY, residual="attnres", wav=True, attnres_block=6)
    model = GPT(cfg)
    us = [torch.randn(2, 5, 16, requires_grad=True) for _ in range(6)]
    sources = {s.basis or "state": s.value for s in model.block_sources("C0", us, 0)}
    torch.testing.assert_close(sources["state"], us[0] + us[1] + us[2] + us[3] + us[4] + us[5])
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    # phase: attention +, MLP −; split: first half +, second half −
    for basis, want in (("phase", us[0] - us[1] + us[2] - us[3] + us[4] - us[5]),
                        ("split", us[0] + us[1] + us[2] - us[3] - us[4] - us[5])):
        scale = torch.clamp(rms(sources["state"]) / (rms(want) + nanoroute.EPS), max=cfg.wav_rho)
        torch.testing.assert_close(sources[basis], scale[..., None] * want)
    # the kernel's representation (below the banner): WAV's two bases make at most four sign
    # patterns (attention / MLP × first / second half), so a block of 6 updates is read through 4
    # terms; with learned coefficients every update is its own term. Either way, the same sources.
    for learned in (False, True):
        model = randomise_routing(make_model(residual="attnres", wav=True, attnres_block=6,
                                             wav_learned_bases=learned))
        pool = [nanoroute.Source("emb", torch.randn(2, 5, 16))]
        reads = model.block_reads(pool, 0, range(0, 6), None, None)
        terms, coeffs, inv_rms, scale = reads._block_state(us[:5])  # what sublayer 5's read sees
        assert len(terms) == (5 if learned else 4) and coeffs.shape == (3, len(terms))
        sources = model.block_sources("P", us[:5], 0)
        for p, source in enumerate(sources):  # the same sources, and their key norms
            value = scale[p][..., None] * sum(c * t for c, t in zip(coeffs[p], terms))
            torch.testing.assert_close(value, source.value)
            want = torch.rsqrt(nanoroute.mean_square(source.value) + nanoroute.EPS)
            torch.testing.assert_close(inv_rms[p], want)
    # learned detail coefficients (the flag wav_learned_bases, SPEC: Learnable bases)
    cfg = dict(residual="attnres", wav=True, attnres_block=4)
    fixed, learned = make_model(**cfg), make_model(**cfg, wav_learned_bases=True)
    signs = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]] * 2)[:6]
    assert torch.equal(learned.basis_coefficients, signs)  # columns phase, split; m = 4
    idx = tokens()
    torch.testing.assert_close(learned(idx)[0], fixed(idx)[0])  # exactly WAV v1 at init
    opt = learned.configure_optimizers(0.1, 1e-2)
    for _ in range(2):
        learned(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(learned.basis_coefficients, signs)  # they learn
    assert not torch.allclose(learned(idx)[0], fixed(idx)[0])


def test_wav_rms_matching_caps_at_rho_and_passes_no_gradient_through_scale():
    # a block of 4: phase + − + −, split + + − −
    model = GPT(GPTConfig(**TINY, residual="attnres", wav=True, wav_rho=3.0))
    state = torch.randn(2, 5, 16)
    small = 1e-3 * torch.randn(2, 5, 16)  # needs a scale-up far beyond rho
    large = 5.0 * torch.randn(2, 5, 16)  # needs a scale-down: no cap
    # updates with signed sums C = state, D^phase = small, D^split = large (and + − − + = 0):
    # the inverse of the 4x4 Hadamard matrix of the signs is its transpose / 4
    targets = [state, small, large, torch.zeros(2, 5, 16)]
    H = [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    us = [sum(H[k][i] * targets[k] for k in range(4)).div(4).requires_grad_() for i in range(4)]
    sources = model.complete(0, us, [])
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    torch.testing.assert_close(sources[0].value, state, atol=1e-6, rtol=1e-5)
    phase = nanoroute.combine(H[1], [u.detach() for u in us])  # ≈ small (float32 cancellation)
    torch.testing.assert_close(phase, small, atol=1e-5, rtol=0)
    torch.testing.assert_close(sources[1].value, 3.0 * phase)  # capped at rho
    torch.testing.assert_close(rms(sources[2].value), rms(state), rtol=1e-4, atol=1e-6)  # matched
    # gradient: d(s·D)/du_i = s·sign_i, and nothing reaches the updates through the scale s
    r = torch.randn(2, 5, 16)
    grads = torch.autograd.grad((sources[1].value * r).sum(), us)
    for i, g in enumerate(grads):
        torch.testing.assert_close(g, 3.0 * H[1][i] * r)
    scale = (rms(state) / (rms(large) + nanoroute.EPS)).clamp(max=3.0)
    grads = torch.autograd.grad((sources[2].value * r).sum(), us)
    for i, g in enumerate(grads):
        torch.testing.assert_close(g, H[2][i] * scale[..., None] * r, atol=1e-6, rtol=1e-4)


def test_wav_detail_bias_to_minus_infinity_is_block_attnres():
    block = randomise_routing(make_model(residual="attnres", attnres_block=4))
    wav = make_model(residual="attnres", attnres_block=4, wav=True)
    with torch.no_grad():
        for k, q in block.query.items():
            wav.query[k].copy_(q)
        for beta in wav.detail_bias.values():
            beta.fill_(-float("inf"))
    idx = tokens()
    torch.testing.assert_close(wav(idx)[0], block(idx)[0], atol=1e-5, rtol=1e-5)
    for beta in wav.detail_bias.values():  # and with a large finite bias the details do matter
        beta.data.fill_(2.0)
    assert not torch.allclose(wav(idx)[0], block(idx)[0], atol=1e-3)


@pytest.mark.parametrize("base", [m for m, kw in ATTNRES_MODES.items()
                                  if kw.get("rd", "off") == "off"])
def test_rd_tied_equals_off_exactly(base):
    off = randomise_routing(make_model(**ATTNRES_MODES[base]))
    tied = randomise_routing(make_model(**{**ATTNRES_MODES[base], "rd": "tied"}))
    assert set(dict(off.named_parameters())) == set(dict(tied.named_parameters()))  # no extras
    idx = tokens()
    assert torch.equal(off(idx)[0], tied(idx)[0])


def test_rd_decoupled_equals_off_at_init_and_differs_once_v_query_moves():
    # with Linear biases (non-zero for Q, K and V): the value projection keeps its bias; two
    # route heads: JS per token and head, not of the heads' mean
    def model(rd):
        m = make_model(**{**ATTNRES_MODES["rd_decoupled"], "rd": rd}, bias=True, route_heads=2)
        with torch.no_grad():
            for layer in m.layers:
                layer.attn.c_attn.bias.normal_()
        return m
    off, dec, idx = model("off"), model("decoupled"), tokens()
    torch.testing.assert_close(dec(idx)[0], off(idx)[0], atol=1e-6, rtol=1e-6)  # V query = 0
    torch.testing.assert_close(model("tied")(idx)[0], off(idx)[0], atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        dec.query["layer1_attn_v"].normal_()
    logits, _, routes = dec(idx, return_routes=True)
    assert not torch.allclose(logits, off(idx)[0], atol=1e-4)
    stats = routing_stats(routes)
    assert stats["js"]["layer1"] > 0 and stats["js"]["layer2"] == 0
    qk, v = (r["weights"] for r in routes if r["name"] in ("layer1.attn", "layer1.attn.v"))
    assert stats["js"]["layer1"] == js_divergence(qk, v)
    # layer 0's two routes both read e alone (JS = 0 by construction): left out of js and js_mean
    assert list(stats["js"]) == ["layer1", "layer2"]
    assert stats["js_mean"] == pytest.approx(stats["js"]["layer1"] / 2)
    # by what they read, not by their layer: a routing that starts higher up (its first routed
    # layer reads one source) leaves that layer out, and layer 0 counts where it reads more
    one = [dict(r, sources=["pre"], weights=r["weights"][:1] / r["weights"][:1]) for r in routes
           if r["read"].layer == 1]
    two = [r for r in routes if r["read"].layer == 2]  # C0, emb, P, ...
    moved = [dict(r, read=r["read"]._replace(layer=0)) for r in two]
    assert list(routing_stats(one + two)["js"]) == ["layer2"]
    assert list(routing_stats(moved)["js"]) == ["layer0"]


def test_rd_frozen_v_keeps_the_value_route_at_its_init():
    # choice (SPEC): frozen_v's value route keeps its zero query and detail bias at wav_detail_bias,
    # without parameters: at init it is exactly rd=decoupled, whose value route starts there too;
    # training moves every other read of several sources, never it
    cfg = dict(residual="attnres", wav=True, attnres_block=4, wav_detail_bias=-1.5)
    frozen, decoupled = make_model(**cfg, rd="frozen_v"), make_model(**cfg, rd="decoupled")
    assert not any(k.endswith("_v") for k in (*frozen.query, *frozen.detail_bias))
    assert any(k.endswith("_v") for k in decoupled.detail_bias)
    idx = tokens()
    torch.testing.assert_close(frozen(idx)[0], decoupled(idx)[0])
    _, _, init = frozen(idx, return_routes=True)  # at wav_detail_bias: SHAPES' heads_wav_rd
    opt = frozen.configure_optimizers(0.1, 1e-2)
    for _ in range(3):
        frozen(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    for r, start in zip(frozen(idx, return_routes=True)[2], init, strict=True):
        if r["name"].endswith(".v"):
            torch.testing.assert_close(r["weights"], start["weights"])
        elif r["name"] != "layer0.attn":
            assert not torch.allclose(r["weights"], start["weights"])


def test_js_divergence_and_routing_stats_entropy_means_and_sources_of_any_name(monkeypatch):
    p, q = torch.softmax(torch.randn(5, 2, 7), 0), torch.softmax(torch.randn(5, 2, 7), 0)
    assert js_divergence(p, p) == pytest.approx(0.0, abs=1e-12)
    m = 0.5 * (p + q)
    want = (0.5 * (p * (p / m).log()).sum(0) + 0.5 * (q * (q / m).log()).sum(0)).mean().item()
    assert js_divergence(p, q) == pytest.approx(want, rel=1e-6) and 0 < want < math.log(2)
    one_hot_a, one_hot_b = torch.eye(2)[:, :, None], torch.eye(2).flip(0)[:, :, None]
    assert js_divergence(one_hot_a, one_hot_b) == pytest.approx(math.log(2))  # disjoint: the bound
    # per token, then the mean (SPEC): routes that swap their sources token by token differ by
    # the bound at each, though their mean weights are alike
    assert js_divergence(torch.eye(2)[:, None], torch.eye(2).flip(0)[:, None]) == pytest.approx(
        math.log(2))
    _, _, routes = make_model(**ATTNRES_MODES["wav"])(tokens(), return_routes=True)
    stats = routing_stats(routes)
    assert list(stats["reads"]) == [r["name"] for r in routes]
    for r in routes:
        s = stats["reads"][r["name"]]
        assert s["sources"] == r["sources"] and sum(s["mean_weight"]) == pytest.approx(1.0)
        w = r["weights"]
        assert s["entropy"] == pytest.approx(-(w * w.log()).sum(0).mean().item(), rel=1e-5)
        S = len(r["sources"])  # normalised by log(pool size): 1 for uniform weights at init
        assert s["entropy_norm"] == (None if S == 1 else pytest.approx(s["entropy"] / math.log(S)))
    assert stats["js"] == {} and stats["js_mean"] is None
    # the mean over every read of more than one source, named: a report compares like means
    norms = {name: s["entropy_norm"] for name, s in stats["reads"].items() if s["entropy_norm"]}
    assert stats["entropy_reads"] == sorted(norms) and "layer0.attn" not in norms  # e alone
    assert stats["entropy_norm_mean"] == pytest.approx(sum(norms.values()) / len(norms))
    assert stats["sources"] == ["emb", "C0", "C0.phase", "C0.split", "P", "P.phase", "P.split"]
    # a run-level number the report's heading would not define is refused where it is made
    with monkeypatch.context() as m, pytest.raises(ValueError, match="entropy_norm_mean: define"):
        m.setattr(diagnostics, "ROUTE_NUMBERS", dict(js_mean=diagnostics.ROUTE_NUMBERS["js_mean"]))
        routing_stats(routes)
    # pool order, by block number not text: C2 before C10 (48 layers: ≤ 8 blocks, extensions
    # more); a new variant may record routes over sources named its own way ("stream", "A0"): the
    # diagnostics sort them after the blocks and say so, instead of failing on the name
    for names, order in ((["emb", "P", "C10", "C2", "C10.split", "C1"],
                          ["emb", "C1", "C2", "C10", "C10.split", "P"]),
                         (["stream", "C1", "emb", "A0"], ["emb", "A0", "C1", "stream"])):
        w = torch.full((len(names), 1, 1, 1), 1 / len(names))
        fake = [dict(read=nanoroute.Read(0, "mix"), name="layer0.mix", weights=w, sources=names)]
        assert routing_stats(fake)["sources"] == order
    # a legend names each kind of source once, and never passes off one it does not know (a
    # suffix of a new source, C0.mean) as another
    names = ["emb", "C0", "C0.phase", "C1", "C1.mean", "C12", "C12.phase", "P", "stream"]
    legend = diagnostics.source_legend(names)
    assert legend == ("emb: embedding, C<i>: completed block i, .phase: WAV detail (phase basis), "
                      ".mean: named by the model, P: partial block, stream: named by the model")


def test_kv_cache_refuses_keys_of_another_shape():
    # one key head written into a cache of two would broadcast into both, and generation would still
    # equal recompute: a change to the attention's heads (grouped queries) must size the cache too
    cache = nanoroute.KVCache(GPTConfig(**TINY), batch=2, device="cpu", dtype=torch.float32)
    k = torch.zeros(2, TINY["n_head"], 3, TINY["n_embd"] // TINY["n_head"])
    cache.update(0, k, k)
    for other in (k[:, :1], k[:1]):  # one head, or one sequence of two: neither broadcasts
        with pytest.raises(AssertionError, match="KVCache not shaped as the keys"):
            cache.update(1, other, other)


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_causal_and_kv_cache_generate_equals_full_recompute(mode):
    model = randomise_routing(make_model(**CACHE_MODES[mode], sequence_len=8), scale=0.3).eval()
    prompt, rng, seen = tokens(B=2, T=3), torch.get_rng_state(), []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out))
    out = model.generate(prompt, 9, top_k=1)  # runs past sequence_len=8: the sliding window
    hook.remove()
    assert torch.equal(rng, torch.get_rng_state())  # greedy decoding draws no random numbers
    idx = prompt
    with torch.no_grad():
        for step in range(9):  # greedy decoding by full recompute, nanoGPT-style crop
            logits = model(idx[:, -8:])[0][:, -1]  # the last sequence_len tokens: what it saw
            torch.testing.assert_close(seen[step], logits, atol=1e-5, rtol=1e-5)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, idx)
    # the cached pass gives the same logits as the full pass at every position, not only the argmax
    cache = nanoroute.KVCache(model.config, 2, "cpu", torch.float32)
    with torch.no_grad():
        steps = [model._hidden(idx[:, :3], cache)]
        steps += [model._hidden(idx[:, t:t + 1], cache) for t in range(3, 8)]
        torch.testing.assert_close(torch.cat(steps, 1), model._hidden(idx[:, :8]),
                                   atol=1e-5, rtol=1e-5)
    # causal: the tokens from position 5 on changed, the logits before it stay as they were
    changed = idx[:, :8].clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % VOCAB
    before, after = model(idx[:, :8])[0], model(changed)[0]
    torch.testing.assert_close(before[:, :5], after[:, :5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def sample_probs(logits, temperature, k):  # softmax(logits / T) over the top k tokens
    probs = torch.zeros_like(logits, dtype=torch.float64)
    top = logits.topk(k).indices
    probs[top] = torch.softmax(logits[top].double() / temperature, 0)
    return probs


def counts_fit(counts, probs, n):  # each count within 6 binomial standard deviations of n·p
    return bool(((counts - n * probs).abs() <= 6 * torch.sqrt(n * probs * (1 - probs)) + 1).all())


# 1e30: even among the top k (no overflow), where temperature 1 would not be
@pytest.mark.parametrize("temperature,top_k", [(0.7, 5), (1.6, None), (1e30, 5)])
def test_generate_draws_from_softmax_over_temperature_among_top_k(temperature, top_k):
    model = make_model()
    with torch.no_grad():  # spread the logits over a few units, so that temperature matters
        model.lm_head.weight.normal_(0, 0.3)
        prompt, n = tokens(B=1, T=3), 20000
        logits = model(prompt)[0][0, -1]
        torch.manual_seed(0)
        drawn = model.generate(prompt.expand(n, -1), 1, temperature, top_k)[:, -1]
    counts, k = torch.bincount(drawn, minlength=VOCAB).double(), top_k or VOCAB
    probs = sample_probs(logits, temperature, k)
    assert counts_fit(counts, probs, n) and counts[probs == 0].sum() == 0  # none past the top k
    # the check sees the usual mistakes: no temperature, top-k off by one
    assert not counts_fit(counts, sample_probs(logits, 1.0, k), n)
    for wrong_k in (k - 1, k + 1) if top_k else ():
        assert not counts_fit(counts, sample_probs(logits, temperature, wrong_k), n)


def test_generate_keeps_every_token_tied_with_the_kth():
    model = make_model()
    with torch.no_grad():  # every row of the tied embedding alike: every logit ties
        model.lm_head.weight.copy_(model.lm_head.weight[:1].expand_as(model.lm_head.weight))
        torch.manual_seed(0)
        drawn = model.generate(tokens(B=1, T=3).expand(2000, -1), 1, 1.0, 2)[:, -1]
    assert drawn.unique().numel() == VOCAB  # all tie with the 2nd likeliest: all are drawn


def test_flops_per_token_by_hand_and_wav_keeps_for_backward_about_what_block_attnres_does():
    # 2 layers, n_embd 32, sequence_len 16, vocabulary 64 (tied embedding, no biases): per layer
    # c_attn 32·96 + c_proj 32·32 + c_fc 32·128 + c_proj 128·32 = 12288; N = 2·12288 + 64·32 =
    # 26624, 6N = 159744; attention (PaLM, appendix B): 12·L·d·T = 12·2·32·16 = 12288
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, sequence_len=16, vocab_size=64))
    assert model.get_num_params() == 26624 and model.flops_per_token() == 159744 + 12288
    assert model.estimate_mfu(1000, 0.5, 1e12) == pytest.approx(172032 * 1000 / 0.5 / 1e12)
    # the count is the matrix products': an embedding of its own (untied) is a lookup, no FLOPs
    model.wte.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    assert model.get_num_params() == 26624 + 64 * 32 and model.flops_per_token() == 159744 + 12288
    model.layers[1] = model.layers[0]  # layers that share their weights: each use computes
    assert model.get_num_params() == 14336 + 64 * 32 and model.flops_per_token() == 159744 + 12288
    # Memory (issue 5): a sublayer leaves one new (B, T, d) tensor for the backward, the piece it
    # wrote, however many WAV bases there are. What WAV keeps beyond Block AttnRes is its completed
    # detail sources (2 per block that later blocks read) and small per-token statistics, not two
    # running sums per sublayer (that first design kept 39 extra tensors here, not < 12)
    shape = dict(vocab_size=64, sequence_len=8, n_layer=8, n_head=2, n_embd=128)
    x, y, kept = torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8)), {}
    for name, extra in (("block", {}), ("wav", dict(wav=True))):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**shape, residual="attnres", attnres_block=4, **extra))
        exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        kept[name] = bench.saved_bytes(model, x, y, contextlib.nullcontext(), exclude) \
            / (8 * 128 * 4)
    n_sub, n_blocks = 16, 4
    assert 2 * (n_blocks - 1) <= kept["wav"] - kept["block"] < 2 * n_blocks + 0.25 * n_sub


def test_a_tiny_temperature_is_greedy_and_bad_settings_raise():
    model = make_model(n_layer=1)
    torch.nn.init.normal_(model.lm_head.weight, 0, 0.3)  # logits units apart
    prompt = torch.randint(0, VOCAB, (4, 3))
    assert torch.equal(model.generate(prompt, 6, 1e-45, 5), model.generate(prompt, 6, top_k=1))
    for kwargs in (dict(temperature=0.0), dict(temperature=-1.0), dict(temperature=math.inf),
                   dict(temperature=math.nan), dict(top_k=0)):
        with pytest.raises(ValueError, match="temperature=.*must be > 0 and finite|top_k=0: must"):
            model.generate(tokens(T=2), 2, **kwargs)
    with pytest.raises(ValueError, match="sequence_len"):
        model(tokens(T=SEQ + 1))
    model = make_model(n_layer=1, dropout=0.1)  # in training mode: each draw would drop out
    with pytest.raises(ValueError, match=r"training mode drops out: call model.eval\(\) first"):
        model.generate(prompt, 2)
    assert model.eval().generate(prompt, 2).shape == (4, 5)


def test_paired_init_shares_every_common_parameter():
    for mode, kw in ALL_MODES.items():  # against PreNorm of the same shape
        shape = {k: v for k, v in kw.items() if k not in nanoroute.routing_fields()}
        reference = dict(make_model(seed=7, **shape).named_parameters())
        model = make_model(seed=7, **kw)
        for name, p in model.named_parameters():
            if name in reference:
                assert torch.equal(p, reference[name]), (mode, name)
        shared = set(reference) & set(dict(model.named_parameters()))
        assert len(shared) == len(reference), mode  # every Transformer weight is shared
    assert not torch.equal(make_model(seed=8).lm_head.weight, reference["wte.weight"])


@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_routing_parameter_gets_a_gradient_and_no_weight_decay(mode):
    model = make_model(**ALL_MODES[mode])
    model(tokens(), tokens(seed=4))[1].backward()
    routing = list(model.no_decay_parameters().items())
    assert routing or mode == "prenorm"
    for name, p in routing:  # (ReZero's sublayer weights get none at init: α = 0 by design)
        grad = p.grad
        if name == "basis_coefficients" and not model.config.wav_readout_details:
            grad = grad[:-1]  # the last update is read only by the readout, which reads no details
        assert grad is not None and (grad != 0).any(dim=-1).all(), name
    before = {name: p.detach().clone() for name, p in routing}
    randomise_routing(model)  # and the tests' helper moves every one off its init
    for name, p in routing:
        assert not torch.equal(p, before[name]), name
    if model.config.residual == "attnres":  # a query or static logits per read, but e's reads
        frozen = nanoroute.RD_MODES[model.config.rd].frozen  # and those RD freezes
        learned = [r for r in model.reads if r.sublayer > 0 and r.role not in frozen]
        assert len(model.query) + len(model.static_logits) == len(learned)
    # queries, detail biases, learned bases, static logits, gains, DenseFormer's weights: no decay
    model = make_model(**ALL_MODES[mode], bias=True)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        is_matrix = (name.endswith(".weight") and p.dim() == 2
                     and not name.startswith(("query", "detail_bias")))
        assert (id(p) in decayed) == is_matrix, name


# The kernel and fast == reference checks run on NANOROUTE_TEST_DEVICE (default cpu; cuda on a GPU:
# NANOROUTE_TEST_DEVICE=cuda python -m pytest -q -m gpu), in float32 and under bf16 autocast. The
# routing math is float32 in both, so the kernel's tolerances are float32's; a model under
# autocast rounds its sublayers to bf16, which amplifies float32-level differences.
TEST_DEVICE = os.environ.get("NANOROUTE_TEST_DEVICE", "cpu")
PRECISIONS = ["float32", "bf16_autocast"]


@pytest.fixture
def device(request):
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("NANOROUTE_TEST_DEVICE=cuda, but torch sees no CUDA device")
    # -m gpu on a GPU without it would check the kernel on the CPU and pass: a check of nothing
    if request.config.getoption("-m") == "gpu" and torch.cuda.is_available() and \
            TEST_DEVICE != "cuda":
        pytest.fail("-m gpu on a machine with CUDA: set NANOROUTE_TEST_DEVICE=cuda to test it")
    # true float32 matmuls (train.py uses TF32 on CUDA); _tf32_as_before restores the setting
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device(TEST_DEVICE)


def precision_context(device, precision):
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16_autocast" \
        else contextlib.nullcontext()


def float32_tolerance(device):  # the kernel's in both precisions, a float32 model's
    return dict(atol=1e-5, rtol=1e-4) if device.type == "cpu" else dict(atol=1e-4, rtol=1e-3)


def fast_and_reference(mode, device, precision, model_class=GPT):
    """Logits and the gradient of every parameter that requires grad, fast and reference paths, of
    one randomised model; and the names of its routing parameters (configure_optimizers' rule)."""
    results = []
    for fast in (True, False):
        torch.manual_seed(0)
        kw = {**ATTNRES_MODES, **ON_BLOCK}[mode] if isinstance(mode, str) else mode
        cfg = GPTConfig(**{**TINY, **kw}, fast_routing=fast)
        model = randomise_routing(model_class(cfg)).to(device)
        with precision_context(device, precision):
            logits, loss, routes = model(tokens().to(device), tokens(seed=4).to(device),
                                         return_routes=True)
        (loss + routes_loss(routes)).backward()  # a loss on the routes too: its gradient
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((logits.float(), grads))
    return (*results, set(model.no_decay_parameters()))


def routes_loss(routes):
    """A loss on the routes' weights (S, B, T, H): each weight times a fixed number, so that every
    weight of every read has its own gradient (an entropy's would vanish at uniform weights)."""
    g = torch.Generator().manual_seed(5)
    weights = [r["weights"] for r in routes]
    return sum((w * torch.randn(w.shape, generator=g).to(w.device)).mean() for w in weights)


def assert_fast_equals_reference(mode, device, precision, model_class=GPT, zeros=False):
    """The fast kernel gives the reference path's logits and gradients: every gradient in float32,
    the routing parameters' under bf16 autocast (whose sublayers round to bf16). Fails when a
    parameter requiring grad gets no gradient, or only zeros (unless zeros: a mask that leaves a
    read one source zeroes its query's), on either path."""
    (fast_logits, fast_grads), (ref_logits, ref_grads), routing = fast_and_reference(
        mode, device, precision, model_class)
    tol = dict(atol=3e-2, rtol=3e-2) if precision == "bf16_autocast" else float32_tolerance(device)
    torch.testing.assert_close(fast_logits, ref_logits, **tol)
    assert set(fast_grads) == set(ref_grads)
    for name in ref_grads:
        for path, grad in (("fast", fast_grads[name]), ("reference", ref_grads[name])):
            assert grad is not None and (zeros or grad.abs().sum() > 0), \
                f"{name} gets no gradient on the {path} path"
        if precision != "bf16_autocast" or name in routing:
            torch.testing.assert_close(fast_grads[name], ref_grads[name], **tol, msg=name)
    return routing


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", {**ATTNRES_MODES, **ON_BLOCK})
def test_fast_path_equals_reference_path_forward_and_gradients(mode, precision, device):
    # wav_wide (m = 6) reads all four pieces of a partial block (see the kernel's BlockReads)
    assert assert_fast_equals_reference(mode, device, precision)  # routing ones compared


def test_evaluation_reads_through_the_kernel_and_generation_through_the_reference(monkeypatch):
    calls, plain = [], nanoroute.completed_reads
    monkeypatch.setattr(nanoroute, "completed_reads", lambda *a: calls.append(1) or plain(*a))
    model = make_model(**ATTNRES_MODES["block"]).eval()
    with torch.no_grad():
        model(tokens())  # an evaluation: phase 1 batched (SPEC: Two-phase computation)
    assert calls
    calls.clear()
    model.generate(tokens(T=2), 3)  # a KV cache: one token at a time, the reference read
    assert not calls


@pytest.mark.parametrize("mode", ATTNRES_MODES)
def test_fast_path_equals_reference_on_sharp_routes(mode):
    # logits in the hundreds, as a long run may sharpen its routes: exp() alone overflows at 88
    results = []
    for fast in (True, False):
        model = randomise_routing(make_model(**ATTNRES_MODES[mode], fast_routing=fast), scale=30)
        logits, loss = model(tokens(), tokens(seed=4))
        loss.backward()
        results.append((logits, [p.grad for p in model.parameters()]))
    (fast_logits, fast_grads), (ref_logits, ref_grads) = results
    assert torch.isfinite(fast_logits).all()
    torch.testing.assert_close(fast_logits, ref_logits, atol=1e-5, rtol=1e-4)
    for fast_grad, ref_grad in zip(fast_grads, ref_grads):  # logits of 100s round at 1e-5
        torch.testing.assert_close(fast_grad, ref_grad, atol=5e-4, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ATTNRES_MODES)
def test_fast_path_writes_each_source_once_into_a_buffer_of_exact_size(mode, device):
    # a forward writes each completed source once into one buffer, sized for them all: it never
    # grows (memory)
    model = make_model(**ATTNRES_MODES[mode])
    kernels, block_reads = [], model.block_reads
    model.block_reads = lambda *args: kernels.append(block_reads(*args)) or kernels[-1]
    model(tokens())
    assert all(k.buffer is kernels[0].buffer for k in kernels)
    assert kernels[-1].buffer.size(0) == len(kernels[-1].owners)


@pytest.mark.gpu
def test_block_coefficients_overrides_fast_equal_reference_and_the_harness_sees_no_grad(device):
    class GPTWithDoubledState(GPT):  # the kernel takes the coefficients given: here 2·Σ u_i
        def block_coefficients(self, first, n):
            return [[2] * n] + super().block_coefficients(first, n)[1:]
    assert_extension_fast_equals_reference(dict(residual="attnres"), device, GPTWithDoubledState)
    # a parameter without gradient on both paths (built under no_grad) must not pass: None == None
    class NoGradCoefficients(GPT):
        def block_coefficients(self, first, n):
            with torch.no_grad():
                return super().block_coefficients(first, n)
    with pytest.raises(AssertionError, match="basis_coefficients gets no gradient"):
        assert_fast_equals_reference("wav_learned", device, "float32", NoGradCoefficients)


@pytest.mark.parametrize("mode", ATTNRES_MODES)
def test_docs_route_entropy_loss_trains_the_routing_on_both_paths(mode, device):
    # the routes' weights carry a gradient: a routing loss alone moves every pseudo-query, or
    # route_static's logits
    route_entropy = docs_code("docs/routing.md")["route_entropy"]  # as docs/routing.md writes it
    grads = []
    for fast in (True, False):
        model = randomise_routing(make_model(**ATTNRES_MODES[mode], fast_routing=fast))
        route_entropy(model.to(device)(tokens().to(device), return_routes=True)[2]).backward()
        routing = {**model.query, **model.static_logits}
        grads.append({name: p.grad for name, p in routing.items()})
        assert grads[-1] and all(g is not None and g.abs().sum() > 0 for g in grads[-1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-5, rtol=1e-4)


# The kernel alone, against depth_read on random inputs: R reads over S completed sources and the P
# sources of a block of updates, each a combination of the updates (fixed numbers, where the kernel
# sums updates with equal columns into one term, or learned coefficients), every source after the
# first RMS-matched to it with a detached scale; the block grows by one update per sublayer.
MATCH = functools.partial(nanoroute.matching_scale, rho=2.0)
ROWS = [[1, 1, 1, 1, 1], [1, -1, 1, -1, 1], [0.5, 1, -2, 0.5, 1]]  # columns 0 and 4 equal: one term


def kernel_inputs(device, learned=False, seed=0, B=2, T=5, d=16, S=3):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    completed = [rand(B, T, d).requires_grad_() for _ in range(S)]
    updates = [rand(B, T, d).requires_grad_() for _ in ROWS[0]]
    coefficients = torch.tensor(ROWS, device=device, requires_grad=True) if learned else ROWS
    return (completed, updates, coefficients, rand(2, d).requires_grad_(),
            rand(2, S + len(ROWS)).requires_grad_())


def explicit_sources(block, coefficients):
    """Explicit block sources: v_p = Σ_i c_pi·u_i, times MATCH(ms(v_0), ms(v_p)) for p > 0."""
    values = [sum(c * u for c, u in zip(row, block)) for row in coefficients]
    with torch.no_grad():
        ms = [nanoroute.mean_square(v) for v in values]
    return values[:1] + [v * MATCH(ms[0], m)[..., None] for v, m in zip(values[1:], ms[1:])]


def kernel_and_reference(inputs, precision, device, n_partial):
    """h and weights of both reads at every length of the block, and the gradients of a random
    loss of them (backward outside the precision's context, then inside it), by the kernel and by
    depth_read over the explicit sources."""
    completed, updates, coefficients, queries, biases = inputs
    coefficients, S, out = coefficients[:n_partial], len(completed), []
    leaves = [queries, biases, *completed, *updates]
    leaves += [inputs[2]] * isinstance(inputs[2], torch.Tensor)
    for kernel in (True, False):
        g, results = torch.Generator().manual_seed(5), []
        with precision_context(device, precision):
            routes = {r: (queries[r], biases[r, :S + n_partial]) for r in (0, 1)}
            reads = nanoroute.BlockReads(routes, list(enumerate(completed)), coefficients, MATCH,
                                         None, routes, capacity=S)
            for n in range(1, len(updates) + 1):
                for r in (0, 1):
                    if kernel:
                        results.append(reads(r, updates[:n], keep_weights=True)[:2])
                    else:
                        sources = completed + (explicit_sources(updates[:n], coefficients)
                                               * (n_partial > 0))
                        results.append(nanoroute.depth_read(*routes[r], sources))
            loss = sum((h * torch.randn(h.shape, generator=g).to(device)).sum() for h, _ in results)
            inside = torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=True)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        out.append(([h for h, _ in results], [w for _, w in results], grads, inside))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n_partial", [0, 1, 3])
@pytest.mark.parametrize("learned", [False, True])
def test_kernel_equals_reference_read_forward_and_gradients(device, precision, n_partial, learned):
    (h, w, grads, inside), (ref_h, ref_w, ref_grads, _) = kernel_and_reference(
        kernel_inputs(device, learned), precision, device, n_partial)
    tol = float32_tolerance(device)
    for a, b in zip(h + w, ref_h + ref_w, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **tol)
    names = ["queries", "biases"] + ["completed"] * 3 + ["update"] * 5 + ["coefficients"] * learned
    for name, a, b, c in zip(names, grads, ref_grads, inside, strict=True):
        if name in ("update", "coefficients") and n_partial == 0:
            assert a is None and b is None  # no block source: the updates are not read
            continue
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, **tol, msg=name)
        # a user may call backward() inside an autocast block: the kernel's backward stays float32
        torch.testing.assert_close(c, a, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.gpu
def test_kernel_reuses_a_key_norm_only_for_the_same_value_and_doubles_its_buffer(device):
    # the kernel computes a completed source's key norm once a forward, for the next block's reads;
    # a source replaced by another value under its name (an override of complete) gets its own
    g = torch.Generator().manual_seed(0)
    x, y, x2 = (torch.randn(2, 5, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    query, bias = torch.randn(16, generator=g).to(device), torch.zeros(2, device=device)
    routes, sources = {0: (query, bias), 1: (-query, bias)}, {0: [], 1: []}
    first = nanoroute.BlockReads(routes, [("x", x), ("y", y)], [[1]], MATCH, None, sources,
                                 capacity=3)
    then = nanoroute.BlockReads(routes, [("x", 3 * x2), ("y", y)], [[1]], MATCH, first, sources)
    # its slot comes after y's: the weights still come in the read's order, x's first
    h, weights, _ = then(0, [], keep_weights=True)
    torch.testing.assert_close((h, weights), nanoroute.depth_read(query, bias, [3 * x2, y]))
    # and the first block's backward still reads x, not what took its name (its saved slots)
    grads = torch.autograd.grad((first(1, [])[0] + h).square().sum(), (x, y, x2))
    want = nanoroute.depth_read(-query, bias, [x, y])[0] + nanoroute.depth_read(query, bias,
                                                                               [3 * x2, y])[0]
    want = want.square().sum()
    for got, ref in zip(grads, torch.autograd.grad(want, (x, y, x2))):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # h is its own tensor, not a view that would keep the other read's phase 1 alive
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    # sources added in complete() may pass the buffer's capacity: each growth copies the buffer,
    # and earlier blocks' saved views keep the old copy alive, so it doubles (here 1 to 16), and
    # says so: kernel_slots must count them
    values = [torch.randn(2, 5, 16, generator=g).to(device) for _ in range(9)]
    kernels = [None]
    with pytest.warns(UserWarning, match=r"than kernel_slots\(\) counts \(\d\).*count them there"):
        for n in range(1, 10):
            routes = {0: (query, torch.zeros(n, device=device))}
            completed = list(enumerate(values[:n]))
            kernels.append(nanoroute.BlockReads(routes, completed, [[1]], MATCH, kernels[-1],
                                                {0: []}))
    assert len({id(k.buffer) for k in kernels[1:]}) == 5
    want = nanoroute.depth_read(query, routes[0][1], values)[0]
    torch.testing.assert_close(kernels[-1](0, [])[0], want)


# Extending the routing (docs/routing.md walks through each): every change a researcher makes passes
# fast == reference, forward and every gradient, float32 and bf16 autocast, or is refused at build.
# The extensions tested are the docs' own code, run as written.
@functools.cache
def docs_code(path):
    """Names defined by a doc's Python blocks that start with an import, each run as written."""
    namespace, text = {}, (Path(__file__).parent / path).read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if block.startswith(("import ", "from ")):
            exec(compile(block, path, "exec"), namespace)
    return namespace


def test_pip_install_e_installs_what_the_docs_python_imports():
    # the README: `pip install -e .` makes its Python work from any folder; what it installs is
    # pyproject.toml's py-modules
    root = Path(__file__).parent
    installed = ast.literal_eval(re.search(r"py-modules = (\[.*?\])",
                                           (root / "pyproject.toml").read_text())[1])
    imported = set()
    for doc in [root / "README.md", *(root / "docs").glob("*.md")]:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            for name in re.findall(r"^\s*(?:from|import) (\w+)", block, re.M):
                imported |= {name} if (root / f"{name}.py").exists() else set()
    assert imported and imported <= set(installed), imported - set(installed)


def docs_class(name):
    return docs_code("docs/routing.md")[name]


def assert_extension_fast_equals_reference(cfg, device, model_class):
    """docs/routing.md's check for a change: assert_fast_equals_reference in both precisions, and
    with dropout, whose draws a random number drawn in route would shift on one path (the kernel
    calls route at a block's start, the reference at each read); and the kernel's buffer holds
    every completed source without growing (its warning is an error: count them in kernel_slots)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "fast_routing")
        for precision in PRECISIONS:
            assert_fast_equals_reference(cfg, device, precision, model_class)
        dropout = {**cfg, "dropout": 0.1}
        (fast, _), (ref, _), _ = fast_and_reference(dropout, device, "float32", model_class)
        torch.testing.assert_close(fast, ref, **float32_tolerance(device))  # the same draws


# A new detail basis: one small method override, the README's (its Python blocks, and
# docs/model.md's, run as written); one that repeats another is refused
@pytest.mark.gpu
def test_extension_new_basis_fast_equals_reference_and_is_the_explicit_sum(device):
    assert docs_code("docs/model.md")["out"].shape == (2, 28)  # every variant, routes, generation
    names = docs_code("README.md")  # the model in Python, then the README's routing change
    assert names["out"].shape == (2, 28)  # generate: 8 prompt tokens + 20
    assert names["model"].bases == ["phase", "split", "cross"]
    cfg = dict(residual="attnres", wav=True, attnres_block=4)
    cross_basis = names["GPTWithCrossBasis"]
    model = cross_basis(GPTConfig(**TINY, **cfg))
    assert all(b.shape == (3,) for b in model.detail_bias.values())  # a bias for it in each read
    _, _, routes = model(tokens(), return_routes=True)
    assert routing_stats(routes)["sources"] == ["emb", "C0", "C0.phase", "C0.split", "C0.cross",
                                                "P", "P.phase", "P.split", "P.cross"]
    us = [torch.randn(2, 5, 16) for _ in range(4)]
    state, *_, cross = model.block_sources("P", us, 0)
    assert cross.name == "P.cross" and cross.basis == "cross"
    want = us[0] - us[1] - us[2] + us[3]
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    scale = torch.clamp(rms(state.value) / (rms(want) + nanoroute.EPS), max=4.0)
    torch.testing.assert_close(cross.value, scale[..., None] * want)
    assert_extension_fast_equals_reference(cfg, device, cross_basis)
    class GPTWithQuarterBasis(GPT):  # +1 in the first and third quarter of a block
        def detail_signs(self, l):
            m = self.config.routing_block
            quarter = 1 if (l % m) * 4 // m % 2 == 0 else -1
            return {**super().detail_signs(l), "quarter": quarter}
    with pytest.raises(ValueError, match="bases phase and quarter weigh a block of 4 sublayers"):
        GPTWithQuarterBasis(GPTConfig(**TINY, residual="attnres", wav=True, attnres_block=4))
    class GPTWithAntiPhase(GPT):  # phase's negative: the same detail, its sign flipped
        def detail_signs(self, l):
            return {**super().detail_signs(l), "anti": -super().detail_signs(l)["phase"]}
    with pytest.raises(ValueError, match="bases phase and anti weigh a block of 4 sublayers"):
        GPTWithAntiPhase(GPTConfig(**TINY, residual="attnres", wav=True, attnres_block=4))
    model = GPTWithQuarterBasis(GPTConfig(**TINY, residual="attnres", wav=True, attnres_block=6))
    assert model.bases == ["phase", "split", "quarter"]  # at 6 sublayers, a contrast of its own


def test_a_wav_bases_value_that_is_another_basis_at_this_block_is_refused(monkeypatch):
    # a basis added as the docs say (a sign in basis_signs, a WAV_BASES entry), chosen alone: at
    # blocks of 4 its signs (+ + − −) are split's, so it would train split under its own name
    signs = nanoroute.basis_signs
    monkeypatch.setattr(nanoroute, "basis_signs", lambda l, m: {
        **signs(l, m), "quarter": 1 if l % m % 4 < 2 else -1})
    monkeypatch.setitem(nanoroute.WAV_BASES, "quarter", ("quarter",))
    quarter = dict(residual="attnres", wav=True, wav_bases="quarter")
    with pytest.raises(ValueError, match="bases quarter and split weigh a block of 4 sublayers"):
        GPT(GPTConfig(**TINY, **quarter, attnres_block=4))
    assert GPT(GPTConfig(**TINY, **quarter, attnres_block=6)).bases == ["quarter"]


# A source made from earlier blocks: an override of complete
@pytest.mark.gpu
def test_extension_block_difference_source_fast_equals_reference(device):
    cfg = dict(residual="attnres", attnres_block=2)  # 3 layers: C0, C1, C2, then the readout
    model = randomise_routing(docs_class("GPTWithBlockDifference")(GPTConfig(**TINY, **cfg)))
    pools, complete = [], model.complete
    model.complete = lambda b, block, pool: pools.append(complete(b, block, pool)) or pools[-1]
    _, _, routes = model(tokens(), return_routes=True)
    model.complete = complete
    assert routing_stats(routes)["sources"] == ["emb", "C0", "C1", "C1.diff", "C2", "C2.diff", "P"]
    value = {s.name: s.value for s in pools[-1]}
    torch.testing.assert_close(value["C2.diff"], value["C2"] - value["C1"])
    torch.testing.assert_close(value["C1.diff"], value["C1"] - value["C0"])
    readout = next(r for r in routes if r["name"] == "readout")
    assert readout["sources"] == ["emb", "C0", "C1", "C1.diff", "C2", "C2.diff"]
    assert_extension_fast_equals_reference(cfg, device, docs_class("GPTWithBlockDifference"))
    static = docs_class("GPTWithBlockDifference")(GPTConfig(**TINY, **cfg, route_static=True))
    with pytest.raises(ValueError, match="reads 4 sources but has 3 logits: count them in pool"):
        static(tokens())  # route_static's logits per source: pool_size must count the new ones


# A learned temperature per read and a recency bias per source: an override of route
@pytest.mark.gpu
def test_extension_temperature_and_recency_in_route_fast_equals_reference(device):
    cfg = dict(residual="attnres", wav=True, rd="decoupled", attnres_block=4)
    extended = docs_class("GPTWithTemperatureAndRecency")  # first: the docs' code draws numbers
    torch.manual_seed(0)  # as make_model: paired with its parent at init
    model = extended(GPTConfig(**TINY, **cfg))
    torch.testing.assert_close(model(tokens())[0], make_model(**cfg)(tokens())[0])
    assert {"temperature.readout", "recency.layer1_attn_v"} <= set(model.no_decay_parameters())
    assert_extension_fast_equals_reference(cfg, device, extended)


# A normalised block summary (RMS-Block): completed blocks in complete(); the partial block is
# refused by the fast kernel (its contract), and works on the reference path
@pytest.mark.gpu
def test_extension_normalised_summaries_fast_equals_reference_or_refused(device):
    cfg = dict(residual="attnres", attnres_block=2)
    model = randomise_routing(docs_class("GPTWithNormalisedBlocks")(GPTConfig(**TINY, **cfg)))
    pools, complete = [], model.complete
    model.complete = lambda b, block, pool: (pools.append((complete(b, block, pool), sum(block)))
                                             or pools[-1][0])
    model(tokens())
    for b, (pool, state) in enumerate(pools):  # C_b / rms(C_b), i.e. RMSNorm(C_b) with its ε
        rms = torch.sqrt(nanoroute.mean_square(state) + nanoroute.EPS)
        torch.testing.assert_close(pool[-1].value, state / rms[..., None])
    assert_extension_fast_equals_reference(cfg, device, docs_class("GPTWithNormalisedBlocks"))
    match = "overrides block_sources, which the fast kernel cannot follow"
    with pytest.raises(ValueError, match=match) as err:
        docs_class("GPTWithNormalisedPartialBlock")(GPTConfig(**TINY, **cfg))
    message = str(err.value)
    assert "contract" in message and "fast_routing=False" in message and "\n" not in message
    slow = randomise_routing(docs_class("GPTWithNormalisedPartialBlock")(
        GPTConfig(**TINY, **cfg, fast_routing=False)))
    slow(tokens(), tokens(seed=4), return_routes=True)[1].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in slow.no_decay_parameters().values())


# Numerics under bf16 autocast: backward() called inside an autocast block gives the gradients it
# gives outside, and the routing stays float32
@pytest.mark.parametrize("fast", [True, False])
def test_backward_inside_bf16_autocast_equals_outside_and_the_routing_stays_float32(fast):
    grads = []
    for inside in (False, True):
        model = randomise_routing(make_model(**ATTNRES_MODES["wav_learned_rd"], fast_routing=fast))
        sources = []  # every update written into the pool, to compare the sources' gradients
        for layer in model.layers:
            for sub in (layer.attn, layer.mlp):
                sub.register_forward_hook(lambda mod, args, u: u.retain_grad() or sources.append(u))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(tokens(), tokens(seed=4))
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        routing = {n: p.grad for n, p in model.no_decay_parameters().items()}
        grads.append((routing, [u.grad for u in sources]))
    (routing, updates), (routing_inside, updates_inside) = grads
    assert {"detail_bias.readout", "basis_coefficients"} <= set(routing)
    for name in routing:  # queries, detail biases, learned bases
        torch.testing.assert_close(routing_inside[name], routing[name],
                                   atol=1e-7, rtol=1e-5, msg=name)
    for a, b in zip(updates_inside, updates, strict=True):  # the sources, through every update
        torch.testing.assert_close(a.float(), b.float(), atol=1e-7, rtol=1e-5)
    model = randomise_routing(make_model(**ATTNRES_MODES["rd_wav"], fast_routing=fast))
    # choice: sources accumulate in float32, whatever the sublayers' dtype, and every routing
    # statistic (mean squares, logits, softmax, mixtures) is computed in float32 under autocast,
    # bit for bit as without it (autocast would run vecdot and matmul in bf16)
    pools, complete = [], model.complete
    model.complete = lambda b, block, pool: (pools.append((block, complete(b, block, pool)))
                                             or pools[-1][1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss, routes = model(tokens(), tokens(seed=4), return_routes=True)
        loss.backward()
    assert pools and all(u.dtype == torch.float32 for block, pool in pools for u in block)
    assert all(s.value.dtype == torch.float32 for _, pool in pools for s in pool)
    assert all(r["weights"].dtype == torch.float32 for r in routes)
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    ref = randomise_routing(make_model(**ATTNRES_MODES["rd_wav"], fast_routing=fast))
    with torch.no_grad():
        torch.testing.assert_close(logits.float(), ref(tokens())[0], atol=0.1, rtol=0.05)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    rinv = [torch.rsqrt(nanoroute.mean_square(v) + nanoroute.EPS) for v in values]
    queries, biases = torch.randn(4, 16, generator=g), torch.randn(4, 3, generator=g)
    sigma, scale = torch.tensor([[1.0, 1.0], [1.0, -1.0]]), torch.rand(2, 2, 5, generator=g) + 0.5

    def run():
        mix, lse, *_ = nanoroute.completed_reads(queries, biases, torch.stack(values),
                                                 torch.stack(rinv))
        return (nanoroute.mean_square(values[0]),
                *nanoroute.depth_read(queries[0], biases[0], values), mix, lse,
                *nanoroute.merge_partial(mix[..., 0, :], lse[:, :, 0], queries[1], biases[1, :2],
                                         torch.stack(rinv[:2])[..., None], scale[..., None],
                                         sigma, values[:2]))
    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = run()
    for a, b in zip(plain, auto):
        assert b.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("own_k, own_v", [(False, False), (True, False), (False, True),
                                          (True, True)])
def test_attention_takes_q_k_and_v_each_from_its_own_read(own_k, own_v):
    # an RD mode may give the keys a read of their own, the values, or both (RD(k="attn.k")):
    # each read feeds its projection, with c_attn's weights and biases; the others read x
    attn = nanoroute.CausalSelfAttention(GPTConfig(**TINY, bias=True))
    with torch.no_grad():
        attn.c_attn.bias.normal_()
    rope = nanoroute.rotary_tables(SEQ, 8)
    x, x_k, x_v = torch.randn(3, 2, SEQ, 16).unbind(0)
    inputs = (x, x_k if own_k else x, x_v if own_v else x)
    weights, biases = attn.c_attn.weight.split(16), attn.c_attn.bias.split(16)
    q, k, v = (torch.nn.functional.linear(t, w, b) for t, w, b in zip(inputs, weights, biases))
    q, k, v = (t.view(2, SEQ, 2, 8).transpose(1, 2) for t in (q, k, v))
    q, k = nanoroute.apply_rotary(q, *rope), nanoroute.apply_rotary(k, *rope)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = attn.c_proj(y.transpose(1, 2).reshape(2, SEQ, 16))
    got = attn(x, rope, x_k if own_k else None, x_v if own_v else None)
    torch.testing.assert_close(got, want)


INVALID = [
    (dict(n_embd=30, n_head=4), "n_head=4: must divide n_embd=30"),
    (dict(ATTNRES, route_heads=3), "route_heads=3: must divide n_embd=16"),
    (dict(route_heads=2), "route_heads=2: applies only to residual=attnres"),
    (dict(route_static=True), "route_static=True: applies only to residual=attnres"),
    (dict(n_embd=12, n_head=4), "n_head=4: head size"),
    (dict(n_layer=0), "n_layer=0: must be a positive integer"),
    (dict(vocab_size=-1), "vocab_size=-1"),
    (dict(sequence_len=0), "sequence_len=0"),
    (dict(ATTNRES, route_static=True, route_heads=2), "route_heads=2: has no effect with route_"),
    (dict(dropout=1.0), "dropout=1.0: must be in [0, 1)"),
    (dict(residual="postnorm"),
     f"residual='postnorm': must be one of {', '.join(nanoroute.RESIDUALS)}"),
    (dict(rd="both"), "rd='both': must be one of"),
    (dict(wav=True), "wav=True: applies only to residual=attnres"),
    (dict(rd="decoupled"), "rd='decoupled': applies only to residual=attnres"),
    (dict(attnres_block=2), "attnres_block=2: applies only to residual=attnres"),
    (dict(ATTNRES, wav=True, attnres_block=3), "attnres_block=3: WAV needs an even routing block"),
    (dict(ATTNRES, wav=True, attnres_block=2), "attnres_block=2: WAV needs an even routing block"),
    (dict(ATTNRES, attnres_block=99), "attnres_block=99: must be 0 (auto) or 1..2*n_layer"),
    (dict(ATTNRES, wav=True, wav_rho=0.0), "wav_rho=0.0: must be > 0"),
    (dict(ATTNRES, wav=True, wav_bases="haar"),
     "wav_bases='haar': must be one of phase, split, both"),
    (dict(ATTNRES, wav_rho=2.0), "wav_rho=2.0: applies only with wav=True"),
    (dict(ATTNRES, wav_readout_details=True),
     "wav_readout_details=True: applies only with wav=True"),
    (dict(ATTNRES, wav_learned_bases=True), "wav_learned_bases=True: applies only with wav=True"),
    (dict(wav_learned_bases=True), "wav_learned_bases=True: applies only to residual=attnres"),
    (dict(fast_routing=False), "fast_routing=False: applies only to residual=attnres"),
    (dict(ATTNRES, wav=True, n_layer=1), "n_layer=1: WAV needs at least 2 layers"),
]


def test_config_default_routing_block_needs_and_the_one_list_of_routing_fields():
    # the default routing block: whole layers, at most 8 blocks
    for n_layer, m in [(1, 2), (4, 2), (8, 2), (12, 4), (16, 4), (24, 6), (48, 12)]:
        assert GPTConfig(n_layer=n_layer, residual="attnres").routing_block == m
        assert math.ceil(2 * n_layer / m) <= 8
    assert GPTConfig(n_layer=4, residual="attnres", wav=True).routing_block == 4  # WAV needs m >= 4
    # needs= "attnres", or a field that must be off its default (where it applies itself)
    assert nanoroute.missing_need("rd", dict(residual="attnres", rd="decoupled")) is None
    assert "add --rd" in nanoroute.missing_need("rd", dict(residual="attnres"))
    assert "add --residual attnres" in nanoroute.missing_need("rd", dict(rd="decoupled"))
    assert "add --wav True" in nanoroute.missing_need("wav", GPTConfig(residual="attnres"))
    # the routing fields are one list, which a subclass extends
    @dataclasses.dataclass
    class ConfigWithToyKnob(GPTConfig):
        toy_knob: float = nanoroute.setting(1.0, "a made-up routing knob", needs="attnres")
    fields = nanoroute.routing_fields(ConfigWithToyKnob)
    assert fields[0] == "residual" and "toy_knob" in fields  # a subclass's field is listed
    assert "toy_knob" not in nanoroute.routing_fields()
    with pytest.raises(ValueError, match="toy_knob=2.0: applies only to residual=attnres"):
        ConfigWithToyKnob(toy_knob=2.0)  # validate() follows the one list too
    ConfigWithToyKnob(residual="attnres", toy_knob=2.0)


@pytest.mark.parametrize("overrides,message", INVALID)
def test_invalid_configs_raise_one_line_value_error(overrides, message):
    with pytest.raises(ValueError) as err:
        GPTConfig(**{**TINY, **overrides})
    assert message in str(err.value) and "\n" not in str(err.value)


class CountTensorsFromLists(torch.overrides.TorchFunctionMode):
    """Counts tensors built from Python data (torch.tensor, as_tensor, new_tensor): on a GPU each
    is a blocking copy from the host, which drains the GPU's queue."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("learned", [False, True])
def test_no_tensor_is_built_from_python_data_per_read_and_constants_once_a_device(learned):
    model = make_model(**ATTNRES_MODES["wav_learned_rd" if learned else "rd_wav"], n_layer=4)
    model(tokens(), tokens(seed=4))[1].backward()  # the first forward may build constants, once
    for grad in (True, False):  # training and evaluation
        with CountTensorsFromLists() as counter, torch.set_grad_enabled(grad):
            model(tokens(), tokens(seed=4))[1].sum()
        assert counter.count == 0, counter.count
    with CountTensorsFromLists() as counter:  # the counter sees them: a read building one is caught
        torch.tensor([1.0, 2.0])
    assert counter.count == 1
    # the kernel's constants are built once per device
    a = nanoroute._constant(((1.0, -1.0),), torch.device("cpu"))  # CPU's copy; meta gets its own
    assert nanoroute._constant(((1.0, -1.0),), torch.device("cpu")) is a  # reused
    assert nanoroute._constant(((1.0, -1.0),), torch.device("meta")).device.type == "meta"
    with torch.inference_mode():  # first built in an eval: a later training step may save it
        assert not nanoroute._constant(((2.0, -3.0),), torch.device("cpu")).is_inference()


def test_dropout_of_the_embedding_and_each_sublayers_output_is_on_in_training_only():
    # docs/model.md: dropout on embeddings, attention and sublayer outputs (half of them zero here)
    model, seen = make_model(dropout=0.5), []
    model.drop.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    model(tokens())
    (e, dropped), = seen
    assert torch.equal(e, model.wte(tokens())) and (dropped == 0).float().mean() > 0.3  # embedding
    x, rope = torch.randn(4, SEQ, 16), (model.rope_cos, model.rope_sin)
    layer = model.layers[0]
    for name, sublayer in (("attn", lambda: layer.attn(x, rope)), ("mlp", lambda: layer.mlp(x))):
        assert 0.4 < (sublayer() == 0).float().mean() < 0.6, name
    model.eval()
    model(tokens())
    assert torch.equal(seen[-1][0], seen[-1][1])
    assert (layer.attn(x, rope) == 0).sum() == 0 and (layer.mlp(x) == 0).sum() == 0


def test_torch_compile_traces_every_routing_path_without_graph_breaks():
    # fullgraph=True fails on any graph break; the aot_eager backend traces forward and backward
    # (our autograd Functions included) like inductor does, without its minute-long C++ build.
    # (Inductor itself was checked by hand: same logits and gradients.)
    model = randomise_routing(make_model(**ATTNRES_MODES["rd_wav"]))
    ref = randomise_routing(make_model(**ATTNRES_MODES["rd_wav"]))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    logits, loss = compiled(tokens(), tokens(seed=4))
    loss.backward()
    ref_logits, ref_loss = ref(tokens(), tokens(seed=4))
    ref_loss.backward()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # eval and generation take the no-graph path: it must compile too
        torch.testing.assert_close(compiled(tokens())[0], ref_logits, atol=1e-5, rtol=1e-5)
        # masks set after the first call: compiled again, in one graph, and they take effect
        for m in (model, ref):
            m.masked = {nanoroute.Read(1, "mlp"): {"emb"}}
        masked = ref(tokens())[0]
        assert not torch.allclose(masked, ref_logits, atol=1e-4)
        torch.testing.assert_close(compiled(tokens())[0], masked, atol=1e-5, rtol=1e-5)


def test_torch_compile_of_any_length_is_one_graph():
    # crops of another length (a sequence-length warmup, say) compile the model again with the
    # length dynamic, as dynamic=True does at once: attention's is_causal=T > 1, a symbolic bool
    # there, broke the graph, then the trace
    model, ref = make_model(**ATTNRES_MODES["block"]), make_model(**ATTNRES_MODES["block"])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    x = tokens()[:, :SEQ - 1]
    with torch.no_grad():  # the eval path: the attention of training's, a shorter trace
        torch.testing.assert_close(compiled(x)[0], ref(x)[0], atol=1e-5, rtol=1e-5)


# --- Controls (SPEC: Controls): static routing, DenseFormer, multi-head depth reads, masks ---

def parent(name):
    """The variant whose VARIANTS row is the largest that name's row extends, or None."""
    row = nanoroute.VARIANTS[name].items()
    parents = [p for p, r in nanoroute.VARIANTS.items() if r.items() < row]
    return max(parents, key=lambda p: len(nanoroute.VARIANTS[p]), default=None)


# a variant that extends another starts as it, bit for bit (route_static's logits and every
# query zero; RD's routes one read at init), but where it adds WAV's detail sources (weight e^-2);
# DenseFormer starts as PreNorm (each weighted sum is the last layer's output)
STARTS_AS = [(name, parent(name)) for name in nanoroute.VARIANTS
             if parent(name) and not nanoroute.variant(name).get("wav")]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("name,parent", [*STARTS_AS, ("denseformer", "prenorm")])
def test_variants_start_equal_to_their_parents_bitwise(name, parent, fast):
    idx, targets = tokens(), tokens(seed=4)
    a, b = (make_model(**nanoroute.variant(v)) for v in (name, parent))
    if a.config.residual == "attnres":
        a, b = (make_model(**nanoroute.variant(v), fast_routing=fast) for v in (name, parent))
    (la, loss_a), (lb, loss_b) = a(idx, targets), b(idx, targets)
    assert torch.equal(la, lb), f"{name} does not start as {parent}, the variant it extends"
    loss_a.backward()
    loss_b.backward()
    shared = dict(b.named_parameters())  # the shared weights get the same gradients: bit for bit
    same_reads = getattr(a, "reads", None) == getattr(b, "reads", None)  # (RD's two: rounding)
    for weight, p in a.named_parameters():
        if weight in shared and weight not in b.no_decay_parameters():
            if same_reads:
                assert torch.equal(p.grad, shared[weight].grad), (name, weight)
            torch.testing.assert_close(p.grad, shared[weight].grad, atol=1e-6, rtol=1e-5)


def test_gains_and_controls_at_init_static_logits_and_multi_head_reads():
    assert torch.equal(make_model(residual="rezero").residual_gain, torch.zeros(6, 1))  # α = 0
    for n_layer, gamma in [(3, 0.1), (18, 0.1), (20, 1e-5), (24, 1e-5), (30, 1e-6)]:  # CaiT's rule
        gain = GPT(GPTConfig(**{**TINY, "n_layer": n_layer}, residual="layerscale")).residual_gain
        assert gain.shape == (2 * n_layer, 16) and torch.all(gain == gamma), n_layer
    static = make_model(residual="attnres", route_static=True)
    assert not static.query and all(p.abs().sum() == 0 for p in static.static_logits.values())
    # SPEC: Controls, with WAV the detail biases stay: static logits take the queries' place alone
    static_wav = make_model(**ATTNRES_MODES["static_wav_rd"])
    learned = make_model(**{**ATTNRES_MODES["static_wav_rd"], "route_static": False})
    assert static_wav.detail_bias and set(static_wav.detail_bias) == set(learned.detail_bias)
    dense = make_model(residual="denseformer")
    assert [w.tolist() for w in dense.dwa_weights] == [[0, 1], [0, 0, 1], [0, 0, 0, 1]]
    # static logits ignore the input; multi-head reads are per head
    model = randomise_routing(make_model(**ATTNRES_MODES["static"]))
    a, b = (model(tokens(seed=s), return_routes=True)[2] for s in (1, 2))
    for ra, rb in zip(a, b):  # every token of every input: the same weights
        assert torch.allclose(ra["weights"], ra["weights"][:, :1, :1]) \
            and torch.allclose(ra["weights"], rb["weights"])
    heads = randomise_routing(make_model(**ATTNRES_MODES["heads"]))
    routes = heads(tokens(), return_routes=True)[2]
    readout = routing_stats(routes)["reads"]["readout"]
    head_weight, mean_weight = readout["head_weight"], readout["mean_weight"]
    assert len(head_weight) == 4 and head_weight[0] != head_weight[1]
    torch.testing.assert_close(torch.tensor(head_weight).mean(0), torch.tensor(mean_weight))
    w = next(r["weights"] for r in routes if r["name"] == "readout")  # each head's own entropy
    assert readout["entropy"] == pytest.approx(-torch.xlogy(w, w).sum(0).mean().item(), rel=1e-5)


class MaskedModel(GPT):
    """Sources masked by name in every read (C0, and P's first detail), and by age in one read;
    layer0.mlp keeps only its partial block (its one completed source, emb, is masked)."""

    def __init__(self, config):
        super().__init__(config)
        detail = [s.name for s in self.block_source_names("P") if s.basis][:1]  # WAV's first
        self.masked = {read: {"C0", *detail} for read in self.reads if read.layer > 1}
        self.masked[nanoroute.Read(1, "mlp")] = {"emb"}
        self.masked[nanoroute.Read(0, "mlp")] = {"emb"}


@pytest.mark.gpu
def test_masked_sources_get_no_weight_the_rest_renormalise_and_fast_equals_reference(device):
    model = randomise_routing(make_model(**ATTNRES_MODES["wav"]))
    plain = model(tokens())[0]
    model.masked = {}
    assert torch.equal(model(tokens())[0], plain)  # no mask: the plain model, bit for bit
    read = nanoroute.Read(2, "attn")  # sees emb, C0 (and its details)
    for mode, kw in ATTNRES_MODES.items():  # static logits, heads, RD...: each renormalises
        routed = randomise_routing(make_model(**kw))
        unmasked = next(r for r in routed(tokens(), return_routes=True)[2] if r["read"] == read)
        routed.masked = {read: {"emb"}}
        masked = next(r for r in routed(tokens(), return_routes=True)[2] if r["read"] == read)
        assert masked["sources"][0] == "emb" and masked["weights"][0].abs().sum() == 0, mode
        renormalised = unmasked["weights"][1:] / unmasked["weights"][1:].sum(0)
        torch.testing.assert_close(masked["weights"][1:], renormalised, msg=mode)
    model.masked = {nanoroute.Read(0, "attn"): {"emb"}}
    with pytest.raises(ValueError, match="masking every source of layer0.attn"):
        model(tokens())
    # a read the model does not make (here no RD: no value route) is refused, not ignored; so is
    # a name no read sees (a typo), while one that this read does not see hides nothing there
    model.masked = {nanoroute.Read(1, "attn.v"): {"emb"}}
    with pytest.raises(ValueError, match="layer1.attn.v: not a read or source of this model"):
        model(tokens())
    model.masked = {nanoroute.Read(1, "attn"): {"c0", "C0.phase"}}
    with pytest.raises(ValueError, match=r"masked: c0: not a read or source .* sources: C0, "):
        model(tokens())
    model.masked = {nanoroute.Read(0, "mlp"): {"C0"}}  # C0: a source of later reads only
    assert torch.equal(model(tokens())[0], plain)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ATTNRES_MODES)
def test_masks_fast_equals_reference(mode, device):
    # a mask is a −inf logit bias, a kernel input: forward and every gradient follow it
    assert_fast_equals_reference(mode, device, "float32", MaskedModel, zeros=True)


@pytest.mark.parametrize("fast", [True, False])
def test_extension_rd_mode_reading_a_new_role(monkeypatch, fast, device):
    # docs/routing.md: an RD mode whose keys read a route of their own is one line of RD_MODES;
    # a read the sublayer does not take is refused (a table row, an override of reads_before)
    monkeypatch.setitem(nanoroute.RD_MODES, "qk_split", nanoroute.RD(k="attn.k", v="attn.v"))
    mode = dict(residual="attnres", rd="qk_split", wav=True, attnres_block=4)
    assert_routed_model_equals_reference(mode, fast)  # the reference reads RD_MODES too
    if fast:
        assert_fast_equals_reference(mode, device, "float32")
    model = randomise_routing(make_model(**mode))
    assert {"layer1_attn", "layer1_attn_k", "layer1_attn_v"} <= set(model.query)
    stats = routing_stats(model(tokens(), return_routes=True)[2])
    assert stats["js_pair"] == "Q‖V" and stats["js"]["layer1"] > 0  # labels from the table
    assert stats["reads"]["layer1.attn.k"]["feeds"] == "K"
    main = [r["entropy_norm"] for n, r in stats["reads"].items() if not n.endswith((".k", ".v"))]
    assert stats["entropy_norm_mean"] == pytest.approx(sum(main[1:]) / len(main[1:]))  # not e's
    assert not [name for name in stats["entropy_reads"] if name.endswith((".k", ".v"))]
    for role in ("mlp.v", "attn_v"):  # attn_v: its parameters' key would be attn.v's
        monkeypatch.setitem(nanoroute.RD_MODES, "bad", nanoroute.RD(v=role))
        with pytest.raises(ValueError, match="attention reads attn, attn.<name>"):
            make_model(residual="attnres", rd="bad")
    class GPTWithAnExtraRead(GPT):  # a read added to reads_before that no sublayer takes
        def reads_before(self, l):
            extra = [nanoroute.Read(l // 2, "mlp.gate")] \
                if l % 2 and l < 2 * self.config.n_layer else []
            return super().reads_before(l) + extra
    model = GPTWithAnExtraRead(GPTConfig(**TINY, residual="attnres", fast_routing=fast))
    assert "layer0_mlp_gate" in model.query  # it gets its parameters like every read
    with pytest.raises(ValueError, match="reads computed but not used by the sublayer: mlp.gate"):
        model(tokens())
