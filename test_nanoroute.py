"""
Tests for nanoroute. Run: python -m pytest -q

The model tests check every routing mechanism against a small reference written here with plain
loops over sources (no batching, no online softmax, no custom autograd), from SPEC.md's equations.
"""

import argparse
import builtins
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import hashlib
import http.server
import importlib.util
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import bench
import experiments
import nanoroute
import prepare_data
import sample
import train
from nanoroute import GPT, GPTConfig, js_divergence, routing_stats


@pytest.fixture(autouse=True)
def _tf32_as_before():
    """train.py and bench.py turn TF32 on in this process; a later float32 test on CUDA must not inherit it."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before

# -----------------------------------------------------------------------------
# Model: a loop-based reference of the routing math (SPEC.md), and the tests against it

VOCAB, SEQ = 23, 16
TINY = dict(vocab_size=VOCAB, sequence_len=SEQ, n_layer=3, n_head=2, n_embd=16)

# Every routing configuration the tests sweep. n_layer=3 is 6 sublayers, so attnres_block=4 leaves a
# shorter last block of 2 and attnres_block=1 is Full AttnRes.
ATTNRES_MODES = {
    "block": dict(residual="attnres", attnres_block=2),
    "block_short_last": dict(residual="attnres", attnres_block=4),
    "full": dict(residual="attnres", attnres_block=1),
    "wav": dict(residual="attnres", wav=True, attnres_block=4),
    "wav_split": dict(residual="attnres", wav=True, wav_bases="split", attnres_block=4),
    "wav_phase_readout": dict(residual="attnres", wav=True, wav_bases="phase", wav_readout_details=True,
                              attnres_block=4),
    "wav_wide": dict(residual="attnres", wav=True, attnres_block=6, n_layer=3),
    **{f"rd_{m}": dict(residual="attnres", rd=m, attnres_block=4) for m in nanoroute.RD_MODES if m != "off"},
    "rd_wav": dict(residual="attnres", rd="decoupled", wav=True, attnres_block=4),
    "wav_learned": dict(residual="attnres", wav=True, wav_learned_bases=True, attnres_block=4),  # SPEC: Learnable bases
    "wav_learned_rd": dict(residual="attnres", wav=True, wav_learned_bases=True, wav_readout_details=True, rd="decoupled",
                           attnres_block=6),
}
ALL_MODES = {"prenorm": dict(), "rezero": dict(residual="rezero"), "layerscale": dict(residual="layerscale"),
             **ATTNRES_MODES}


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def randomise_routing(model, seed=1, scale=1.0):
    """Move every routing parameter away from its init, so tests do not only see uniform weights: every
    parameter that is not a Linear or Embedding matrix (the rule configure_optimizers uses), whatever its name."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.no_decay_parameters().values():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def tokens(B=2, T=12, seed=3):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def ref_read(query, bias, values):
    """SPEC: α = softmax_s(wᵀ RMSNorm(v_s) + bias_s), h = Σ α_s v_s, one source at a time."""
    logits = []
    for v, b in zip(values, bias):
        key = v / torch.sqrt((v * v).mean(-1, keepdim=True) + nanoroute.EPS)
        logits.append((key * query).sum(-1) + b)
    top = torch.stack(logits).max(0).values
    exps = [torch.exp(x - top) for x in logits]
    total = sum(exps)
    weights = [x / total for x in exps]
    h = sum(w[..., None] * v for w, v in zip(weights, values))
    return h, torch.stack(weights)


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
            c = (a if basis == "phase" else r) if learned is None else learned[l, k - 1]
            detail = detail + c * u
        rms = lambda x: torch.sqrt((x * x).mean(-1))  # noqa: E731
        scale = torch.minimum(rms(state) / (rms(detail) + nanoroute.EPS), torch.tensor(rho)).detach()
        out.append((f"{name}.{basis}", scale[..., None] * detail, k))
    return out


def ref_pool(e, updates, l, cfg, learned=None):
    """The pool before sublayer l: [e, C_0 (+details), ..., C_{b-1} (+details)] + [P (+details)]."""
    m, bases = cfg.routing_block, cfg.detail_bases
    pool = [("emb", e, 0)]
    for b in range(l // m):
        pool += ref_block_sources(updates[b * m:(b + 1) * m], b * m, f"C{b}", bases, m, cfg.wav_rho, learned)
    if l % m:
        first = l // m * m
        pool += ref_block_sources(updates[first:l], first, "P", bases, m, cfg.wav_rho, learned)
    return pool


def reference_forward(model, idx):
    """AttnRes forward from SPEC.md, using the model's own parameters and sublayer modules.
    Returns logits, {read name: (source names, weights)} and the normed sublayer inputs."""
    cfg = model.config
    T = idx.size(1)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    e = model.wte(idx)
    updates, reads, inputs = [], {}, []

    def read(name, pool):
        key = name.replace(".", "_")
        query = model.query[key] if key in model.query else torch.zeros(cfg.n_embd)
        beta = model.detail_bias[key] if key in model.detail_bias else torch.full(
            (len(cfg.detail_bases),), cfg.wav_detail_bias)
        bias = [0.0 if basis == 0 else beta[basis - 1] for _, _, basis in pool]
        h, w = ref_read(query, bias, [v for _, v, _ in pool])
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
        h_qk = read(f"layer{l // 2}.attn", pool)
        h_v = h_qk if cfg.rd in ("off", "tied") else read(f"layer{l // 2}.attn.v", pool)
        if cfg.rd == "tied":  # w^V ≡ w^QK: the value route is the same read
            reads[f"layer{l // 2}.attn.v"] = reads[f"layer{l // 2}.attn"]
        if cfg.rd == "average":
            h_qk = h_v = 0.5 * (h_qk + h_v)
        x, x_v = nanoroute.norm(h_qk), nanoroute.norm(h_v)
        inputs.append(x)
        updates.append(layer.attn(x, rope, x_v))
    pool = ref_pool(e, updates, 2 * cfg.n_layer, cfg, learned)
    if not cfg.wav_readout_details:
        pool = [s for s in pool if s[2] == 0]
    h = read("readout", pool)
    return model.lm_head(nanoroute.norm(h)), reads, inputs


def ref_full_attnres(model, idx):
    """Full AttnRes written directly: every sublayer reads [e, u_0, ..., u_{l-1}] (no blocks)."""
    T = idx.size(1)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    sources = [model.wte(idx)]
    for l in range(2 * model.config.n_layer):
        name = f"layer{l // 2}.{'mlp' if l % 2 else 'attn'}"
        query = model.query[name.replace(".", "_")] if l else torch.zeros(model.config.n_embd)
        x = nanoroute.norm(ref_read(query, [0.0] * len(sources), sources)[0])
        sublayer = model.layers[l // 2].mlp if l % 2 else model.layers[l // 2].attn
        sources.append(sublayer(x) if l % 2 else sublayer(x, rope))
    h = ref_read(model.query["readout"], [0.0] * len(sources), sources)[0]
    return model.lm_head(nanoroute.norm(h))


def reference_residual(model, idx):
    """SPEC: prenorm x += f(norm(x)); rezero x += α·f(x) (no norm inside); layerscale x += γ⊙f(norm(x))."""
    cfg = model.config
    rope = (model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)])
    x = model.wte(idx)
    for l in range(2 * cfg.n_layer):
        inp = x if cfg.residual == "rezero" else nanoroute.norm(x)
        layer = model.layers[l // 2]
        u = layer.mlp(inp) if l % 2 else layer.attn(inp, rope)
        x = x + (u if cfg.residual == "prenorm" else model.residual_gain[l] * u)
    return model.lm_head(nanoroute.norm(x))


@pytest.mark.parametrize("residual", ["prenorm", "rezero", "layerscale"])
def test_classic_residuals_equal_reference(residual):
    model = randomise_routing(make_model(residual=residual), scale=0.5)
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference_residual(model, idx), atol=1e-5, rtol=1e-5)


def test_residual_gain_init():
    assert torch.equal(make_model(residual="rezero").residual_gain, torch.zeros(6, 1))  # ReZero: α = 0
    for n_layer, gamma in [(3, 0.1), (18, 0.1), (20, 1e-5), (24, 1e-5), (30, 1e-6)]:  # CaiT's rule
        gain = GPT(GPTConfig(**{**TINY, "n_layer": n_layer}, residual="layerscale")).residual_gain
        assert gain.shape == (2 * n_layer, 16) and torch.all(gain == gamma), n_layer


def capture_sublayer_inputs(model):
    """Forward pre-hooks recording what each attention and MLP sublayer receives, in forward order."""
    seen, hooks = [], []
    for layer in model.layers:
        for sub in (layer.attn, layer.mlp):
            hooks.append(sub.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach())))
    return seen, hooks


@pytest.mark.parametrize("mode", ATTNRES_MODES)
@pytest.mark.parametrize("fast", [True, False])
def test_routed_inputs_equal_reference(mode, fast):
    model = randomise_routing(make_model(**ATTNRES_MODES[mode], fast_routing=fast))
    idx = tokens()
    seen, hooks = capture_sublayer_inputs(model)
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
    assert len(seen) == len(ref_inputs)
    for got, want in zip(seen, ref_inputs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)



# WAV with a short last block, or a routing block that does not divide 2*n_layer, equals the reference
@pytest.mark.parametrize("n_layer,block,bases", [(3, 4, "split"), (4, 6, "split"), (5, 4, "both"), (5, 6, "split"),
                                                 (5, 8, "split")])
def test_wav_split_basis_with_a_short_last_block_equals_reference(n_layer, block, bases):
    # the split basis signs by position in the *full* block (SPEC), so a short last block is the hard case
    assert (2 * n_layer) % block  # every shape here ends on a partial block
    for fast in (True, False):
        model = randomise_routing(make_model(residual="attnres", wav=True, wav_bases=bases, n_layer=n_layer,
                                             attnres_block=block, wav_readout_details=True, fast_routing=fast))
        idx = tokens(T=6)
        logits, _, routes = model(idx, return_routes=True)
        with torch.no_grad():
            ref_logits, ref_reads, _ = reference_forward(model, idx)
        assert {r["name"] for r in routes} == set(ref_reads)
        for r in routes:
            names, w = ref_reads[r["name"]]
            assert r["sources"] == names, (fast, r["name"])
            torch.testing.assert_close(r["weights"], w, atol=1e-5, rtol=1e-5)
        assert any(n.endswith(".split") for n in ref_reads["readout"][0])  # the readout sees details
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)

def test_pool_names_and_short_last_block():
    model = make_model(residual="attnres", wav=True, attnres_block=4)  # 6 sublayers: blocks of 4 and 2
    _, _, routes = model(tokens(), return_routes=True)
    by_name = {r["name"]: r["sources"] for r in routes}
    assert by_name["layer0.attn"] == ["emb"]
    assert by_name["layer0.mlp"] == ["emb", "P", "P.phase", "P.split"]
    assert by_name["layer2.attn"] == ["emb", "C0", "C0.phase", "C0.split"]
    assert by_name["layer2.mlp"] == ["emb", "C0", "C0.phase", "C0.split", "P", "P.phase", "P.split"]
    assert by_name["readout"] == ["emb", "C0", "P"]  # conservative readout: no details


def test_full_attnres_is_attnres_block_1():
    model = randomise_routing(make_model(residual="attnres", attnres_block=1))
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], ref_full_attnres(model, idx), atol=1e-5, rtol=1e-5)


def test_default_routing_block_is_whole_layers_at_most_8_blocks():
    for n_layer, m in [(1, 2), (4, 2), (8, 2), (12, 4), (16, 4), (24, 6), (48, 12)]:
        assert GPTConfig(n_layer=n_layer, residual="attnres").routing_block == m
        assert math.ceil(2 * n_layer / m) <= 8
    assert GPTConfig(n_layer=4, residual="attnres", wav=True).routing_block == 4  # WAV needs m >= 4


@pytest.mark.parametrize("mode", ["block", "full", "block_short_last", "rd_decoupled"])
def test_zero_queries_give_uniform_weights(mode):
    _, _, routes = make_model(**ATTNRES_MODES[mode])(tokens(), return_routes=True)
    for r in routes:
        S = len(r["sources"])
        torch.testing.assert_close(r["weights"], torch.full_like(r["weights"], 1 / S))


def test_wav_details_start_at_exp_minus_2_of_state():
    _, _, routes = make_model(**ATTNRES_MODES["wav"])(tokens(), return_routes=True)
    checked = 0
    for r in routes:
        state = [i for i, n in enumerate(r["sources"]) if "." not in n]
        detail = [i for i, n in enumerate(r["sources"]) if "." in n]
        for i in detail:
            torch.testing.assert_close(r["weights"][i] / r["weights"][state[0]],
                                       torch.full_like(r["weights"][i], math.exp(-2.0)))
            checked += 1
        for i in state:
            torch.testing.assert_close(r["weights"][i], r["weights"][state[0]])
    assert checked > 0


@pytest.mark.parametrize("coefficients", [[1], [-1], [2.5], [0], [1, -1, 0], [-1, 1, 1], [0, 1], [-1, -1]])
def test_combine_is_the_weighted_sum_for_any_coefficients(coefficients):
    """combine(c, u) = Σ c_i·u_i exactly, whatever the first coefficient (a basis of one's own may start
    at −1 or 0), and for learned coefficients (0-d tensors, the first at 1 as at init) each gets the
    gradient ⟨dL/dsum, u_i⟩."""
    us = [torch.randn(2, 3, 4) for _ in coefficients]
    want = sum(c * u for c, u in zip(coefficients, us))
    torch.testing.assert_close(nanoroute.combine(coefficients, us), want, rtol=0, atol=1e-6)
    learned = [torch.tensor(float(c), requires_grad=True) for c in coefficients]
    g = torch.randn(2, 3, 4)
    total = nanoroute.combine(learned, us)
    torch.testing.assert_close(total, want, rtol=0, atol=1e-6)
    (total * g).sum().backward()
    for c, u in zip(learned, us):
        assert c.grad is not None
        torch.testing.assert_close(c.grad, (u * g).sum())


def test_wav_bases_are_explicit_signed_sums():
    cfg = GPTConfig(**TINY, residual="attnres", wav=True, attnres_block=6)
    model = GPT(cfg)
    us = [torch.randn(2, 5, 16) for _ in range(6)]
    sources = {s.basis or "state": s.value for s in model.block_sources("C0", us, 0)}
    torch.testing.assert_close(sources["state"], us[0] + us[1] + us[2] + us[3] + us[4] + us[5])
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    for basis, want in (("phase", us[0] - us[1] + us[2] - us[3] + us[4] - us[5]),  # attention +, MLP −
                        ("split", us[0] + us[1] + us[2] - us[3] - us[4] - us[5])):  # first half +, second −
        scale = torch.clamp(rms(sources["state"]) / (rms(want) + nanoroute.EPS), max=cfg.wav_rho)
        torch.testing.assert_close(sources[basis], scale[..., None] * want)
    # a partial block keeps the same signs: after 4 of 6 updates, split is u0+u1+u2−u3
    refs = ref_block_sources(us[:4], 0, "P", cfg.detail_bases, 6, cfg.wav_rho)
    for src, (rname, rvalue, rbasis) in zip(model.block_sources("P", us[:4], 0), refs, strict=True):
        assert (src.name, src.basis) == (rname, (None, *cfg.detail_bases)[rbasis])
        torch.testing.assert_close(src.value, rvalue)


def test_kernel_sums_updates_with_equal_coefficients_into_one_term():
    # the kernel's representation (below the banner): WAV's two bases make at most four sign patterns
    # (attention / MLP × first / second half), so a block of 6 updates is read through 4 terms; with
    # learned coefficients every update is its own term. Either way the sources are the same.
    us = [torch.randn(2, 5, 16, requires_grad=True) for _ in range(6)]
    for learned in (False, True):
        model = randomise_routing(make_model(residual="attnres", wav=True, attnres_block=6, wav_learned_bases=learned))
        pool = [nanoroute.Source("emb", torch.randn(2, 5, 16))]
        reads = model.block_reads(pool, 0, range(0, 6), None, None)
        terms, coeffs, inv_rms, scale = reads._block_state(us[:5])  # what sublayer 5's read sees
        assert len(terms) == (5 if learned else 4) and coeffs.shape == (3, len(terms))
        sources = model.block_sources("P", us[:5], 0)
        for p, source in enumerate(sources):  # the same sources, and their key norms
            value = scale[p][..., None] * sum(c * t for c, t in zip(coeffs[p], terms))
            torch.testing.assert_close(value, source.value)
            torch.testing.assert_close(inv_rms[p], torch.rsqrt(nanoroute.mean_square(source.value) + nanoroute.EPS))


def test_wav_rms_matching_caps_at_rho_and_passes_no_gradient_through_scale():
    model = GPT(GPTConfig(**TINY, residual="attnres", wav=True, wav_rho=3.0))  # block of 4: phase + − + −, split + + − −
    state = torch.randn(2, 5, 16)
    small = 1e-3 * torch.randn(2, 5, 16)  # needs a scale-up far beyond rho
    large = 5.0 * torch.randn(2, 5, 16)  # needs a scale-down: no cap
    # updates whose signed sums are C = state, D^phase = small, D^split = large (and + − − + = 0):
    # the inverse of the 4x4 Hadamard matrix of the signs is its transpose / 4
    targets = [state, small, large, torch.zeros(2, 5, 16)]
    H = [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    us = [sum(H[k][i] * targets[k] for k in range(4)).div(4).requires_grad_() for i in range(4)]
    sources = model.complete(0, us, [])
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    torch.testing.assert_close(sources[0].value, state, atol=1e-6, rtol=1e-5)
    phase = nanoroute.combine(H[1], [u.detach() for u in us])  # ≈ small, up to float32 cancellation
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


@pytest.mark.parametrize("base", ["block", "block_short_last", "wav"])
def test_rd_tied_equals_off_exactly(base):
    off = randomise_routing(make_model(**ATTNRES_MODES[base]))
    tied = randomise_routing(make_model(**ATTNRES_MODES[base], rd="tied"))
    assert set(dict(off.named_parameters())) == set(dict(tied.named_parameters()))  # no extra parameter
    idx = tokens()
    assert torch.equal(off(idx)[0], tied(idx)[0])


def test_rd_decoupled_equals_off_at_init_and_differs_once_v_query_moves():
    off, dec = make_model(**ATTNRES_MODES["block_short_last"]), make_model(**ATTNRES_MODES["rd_decoupled"])
    idx = tokens()
    torch.testing.assert_close(dec(idx)[0], off(idx)[0], atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        dec.query["layer1_attn_v"].normal_()
    logits, _, routes = dec(idx, return_routes=True)
    assert not torch.allclose(logits, off(idx)[0], atol=1e-4)
    stats = routing_stats(routes)
    assert stats["js"]["layer1"] > 0 and stats["js"]["layer2"] == 0
    # layer 0's two routes both read e alone (JS = 0 by construction): left out of js and js_mean
    assert list(stats["js"]) == ["layer1", "layer2"]
    assert stats["js_mean"] == pytest.approx(stats["js"]["layer1"] / 2)


def test_rd_frozen_v_with_wav_keeps_the_value_route_at_its_init():
    # choice (SPEC): frozen_v's value route keeps its zero query and its detail bias at wav_detail_bias,
    # without parameters: at init it is exactly rd=decoupled, whose value route starts there too
    cfg = dict(residual="attnres", wav=True, attnres_block=4, wav_detail_bias=-1.5)
    frozen, decoupled = make_model(**cfg, rd="frozen_v"), make_model(**cfg, rd="decoupled")
    assert not any(k.endswith("_v") for k in (*frozen.query, *frozen.detail_bias))
    assert any(k.endswith("_v") for k in decoupled.detail_bias)
    idx = tokens()
    torch.testing.assert_close(frozen(idx)[0], decoupled(idx)[0])
    _, _, routes = frozen(idx, return_routes=True)
    for r in routes:  # a value route's detail sources weigh e^-1.5 of a state source
        if r["name"].endswith(".v") and len(r["sources"]) > 1:
            torch.testing.assert_close(r["weights"][2] / r["weights"][1], torch.full_like(r["weights"][1], math.exp(-1.5)))


def test_rd_frozen_v_route_stays_uniform():
    model = make_model(**ATTNRES_MODES["rd_frozen_v"])
    assert not any(k.endswith("_v") for k in model.query)  # the value route has no parameter
    opt = model.configure_optimizers(0.1, 1e-2)
    idx = tokens()
    for _ in range(3):
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    _, _, routes = model(idx, return_routes=True)
    for r in routes:
        if r["name"].endswith(".v"):
            torch.testing.assert_close(r["weights"], torch.full_like(r["weights"], 1 / len(r["sources"])))
        elif r["name"] != "layer0.attn":
            assert not torch.allclose(r["weights"], torch.full_like(r["weights"], 1 / len(r["sources"])))


def test_rd_average_feeds_the_mean_route_to_q_k_and_v():
    model = randomise_routing(make_model(**ATTNRES_MODES["rd_average"]))
    seen = []
    hook = model.layers[1].attn.register_forward_pre_hook(lambda mod, args: seen.append(args))
    logits, _, routes = model(tokens(), return_routes=True)
    hook.remove()
    x, _rope, x_v = seen[0][:3]
    assert x_v is None  # one input for Q, K and V
    # and it is the normed mean of the two routes' mixtures (the reference computes both routes)
    with torch.no_grad():
        ref_logits, _, ref_inputs = reference_forward(model, tokens())
    torch.testing.assert_close(x, ref_inputs[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_js_divergence():
    p = torch.softmax(torch.randn(5, 2, 7), 0)
    q = torch.softmax(torch.randn(5, 2, 7), 0)
    assert js_divergence(p, p) == pytest.approx(0.0, abs=1e-12)
    m = 0.5 * (p + q)
    want = (0.5 * (p * (p / m).log()).sum(0) + 0.5 * (q * (q / m).log()).sum(0)).mean().item()
    assert js_divergence(p, q) == pytest.approx(want, rel=1e-6) and 0 < want < math.log(2)
    one_hot_a, one_hot_b = torch.eye(2)[:, :, None], torch.eye(2).flip(0)[:, :, None]
    assert js_divergence(one_hot_a, one_hot_b) == pytest.approx(math.log(2))  # disjoint: the bound


def test_routing_stats_entropy_and_means():
    model = make_model(**ATTNRES_MODES["wav"])
    _, _, routes = model(tokens(), return_routes=True)
    stats = routing_stats(routes)
    assert list(stats["reads"]) == [r["name"] for r in routes]
    for r in routes:
        s = stats["reads"][r["name"]]
        assert s["sources"] == r["sources"] and sum(s["mean_weight"]) == pytest.approx(1.0)
        w = r["weights"]
        assert s["entropy"] == pytest.approx(-(w * w.log()).sum(0).mean().item(), rel=1e-5)
        S = len(r["sources"])  # normalised by the log of the pool size: 1 for the uniform weights at init
        assert s["entropy_norm"] == (None if S == 1 else pytest.approx(s["entropy"] / math.log(S)))
    assert stats["js"] == {} and stats["js_mean"] is None
    assert stats["sources"] == ["emb", "C0", "C0.phase", "C0.split", "P", "P.phase", "P.split"]  # pool order
    # by block number, not as text: C2 before C10 (a 48-layer model has up to 8 blocks; an extension more)
    names = ["emb", "C10", "C2", "C10.split", "C1", "P"]
    fake = [dict(name="readout", sources=names, weights=torch.full((6, 1, 1), 1 / 6))]
    assert routing_stats(fake)["sources"] == ["emb", "C1", "C2", "C10", "C10.split", "P"]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_causal(mode):
    model = randomise_routing(make_model(**ALL_MODES[mode]))
    a = tokens()
    b = a.clone()
    b[:, 7:] = (b[:, 7:] + 1) % VOCAB
    la, lb = model(a)[0], model(b)[0]
    torch.testing.assert_close(la[:, :7], lb[:, :7], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(la[:, 7:], lb[:, 7:])


@pytest.mark.parametrize("mode", ALL_MODES)
def test_kv_cache_generate_equals_full_recompute(mode):
    model = randomise_routing(make_model(**ALL_MODES[mode], sequence_len=8), scale=0.3)
    prompt = tokens(B=2, T=3)
    rng = torch.get_rng_state()
    out = model.generate(prompt, 9, top_k=1)  # runs past sequence_len=8: the sliding window
    assert torch.equal(rng, torch.get_rng_state())  # greedy decoding draws no random numbers
    idx = prompt
    with torch.no_grad():
        for _ in range(9):  # greedy decoding by full recompute, nanoGPT-style crop
            idx = torch.cat([idx, model(idx[:, -8:])[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, idx)
    # the cached pass gives the same logits as the full pass at every position, not only the argmax
    cache = nanoroute.KVCache(model.config, 2, "cpu", torch.float32)
    with torch.no_grad():
        steps = [model._hidden(idx[:, :3], cache)] + [model._hidden(idx[:, t:t + 1], cache) for t in range(3, 8)]
        torch.testing.assert_close(torch.cat(steps, 1), model._hidden(idx[:, :8]), atol=1e-5, rtol=1e-5)


def test_generate_rejects_bad_sampling_settings():
    model = make_model()
    for kwargs in (dict(temperature=0.0), dict(temperature=-1.0), dict(top_k=0)):
        with pytest.raises(ValueError, match="temperature|top_k"):
            model.generate(tokens(T=2), 2, **kwargs)
    with pytest.raises(ValueError, match="sequence_len"):
        model(tokens(T=SEQ + 1))


def test_paired_init_shares_every_common_parameter():
    models = {mode: make_model(seed=7, **kw) for mode, kw in ALL_MODES.items()}
    reference = dict(models["prenorm"].named_parameters())
    for mode, model in models.items():
        for name, p in model.named_parameters():
            if name in reference:
                assert torch.equal(p, reference[name]), (mode, name)
        shared = set(reference) & set(dict(model.named_parameters()))
        assert len(shared) == len(reference), mode  # every Transformer weight is shared
    other_seed = make_model(seed=8)
    assert not torch.equal(other_seed.lm_head.weight, reference["wte.weight"])


@pytest.mark.parametrize("mode", ALL_MODES)
def test_gradients_reach_every_routing_parameter(mode):
    model = make_model(**ALL_MODES[mode])
    _, loss = model(tokens(), tokens(seed=4))
    loss.backward()
    routing = list(model.no_decay_parameters().items())
    assert routing or mode == "prenorm"
    for name, p in routing:  # (ReZero's sublayer weights get none at init: α = 0 by design)
        grad = p.grad
        if name == "basis_coefficients" and not model.config.wav_readout_details:
            grad = grad[:-1]  # the last update is read only by the readout, which reads no detail source
        assert grad is not None and (grad != 0).any(dim=-1).all(), name
    if mode.startswith(("block", "full", "wav", "rd")):
        n_reads = len([n for n in model.read_names if n != "layer0.attn" and not
                       (model.config.rd == "frozen_v" and n.endswith(".v")) and n != "layer0.attn.v"])
        assert len(model.query) == n_reads


def test_optimizer_decays_only_matrices():
    model = make_model(**ATTNRES_MODES["rd_wav"], bias=True)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        is_matrix = name.endswith(".weight") and p.dim() == 2 and not name.startswith(("query", "detail_bias"))
        assert (id(p) in decayed) == is_matrix, name
    layerscale = make_model(residual="layerscale")
    opt = layerscale.configure_optimizers(0.1, 1e-3)
    assert not any(p is layerscale.residual_gain for g in opt.param_groups if g["weight_decay"] for p in g["params"])


# The kernel and fast == reference checks run on NANOROUTE_TEST_DEVICE (default cpu; cuda on a GPU:
# NANOROUTE_TEST_DEVICE=cuda python -m pytest -q -m gpu, with the CUDA-only tests of "Speed and
# memory": TF32 on, as train.py runs), in float32 and under bf16 autocast. The routing math is
# float32 in both, so the kernel's tolerances are float32's; a model under autocast rounds its
# sublayers to bf16, which amplifies float32-level differences.
TEST_DEVICE = os.environ.get("NANOROUTE_TEST_DEVICE", "cpu")
PRECISIONS = ["float32", "bf16_autocast"]


@pytest.fixture
def device():
    if TEST_DEVICE == "cuda":
        if not torch.cuda.is_available():
            pytest.fail("NANOROUTE_TEST_DEVICE=cuda, but torch sees no CUDA device")
        tf32 = torch.backends.cuda.matmul.allow_tf32  # true float32 matmuls (train.py turns TF32 on)
        torch.backends.cuda.matmul.allow_tf32 = False
        yield torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = tf32
    else:
        yield torch.device(TEST_DEVICE)


def precision_context(device, precision):
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16_autocast" \
        else contextlib.nullcontext()


def model_tolerance(device, precision):
    if precision == "bf16_autocast":
        return dict(atol=3e-2, rtol=3e-2)
    if precision == "tf32":  # float32 with TF32 matmuls (CUDA, as train.py runs): 10-bit mantissas
        return dict(atol=1e-2, rtol=1e-2)
    return dict(atol=1e-5, rtol=1e-4) if device.type == "cpu" else dict(atol=1e-4, rtol=1e-3)


def fast_and_reference(mode, device, precision, model_class=GPT):
    """Logits and the gradient of every parameter that requires grad, fast path and reference path, of
    one randomised model; and the names of its routing parameters (the rule configure_optimizers uses)."""
    results = []
    for fast in (True, False):
        torch.manual_seed(0)
        cfg = GPTConfig(**{**TINY, **ATTNRES_MODES[mode]} if isinstance(mode, str) else {**TINY, **mode},
                        fast_routing=fast)
        model = randomise_routing(model_class(cfg)).to(device)
        with precision_context(device, precision):
            logits, loss = model(tokens().to(device), tokens(seed=4).to(device))
        loss.backward()
        results.append((logits.float(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    return (*results, set(model.no_decay_parameters()))


def assert_fast_equals_reference(mode, device, precision, model_class=GPT, frozen=()):
    """The fast kernel gives the reference path's logits and gradients: every gradient in float32, the
    routing parameters' under bf16 autocast (whose sublayers round to bf16). Fails when a parameter
    that requires grad gets no gradient, or only zeros, on either path (frozen: those allowed to)."""
    (fast_logits, fast_grads), (ref_logits, ref_grads), routing = fast_and_reference(mode, device, precision,
                                                                                     model_class)
    tol = model_tolerance(device, precision)
    torch.testing.assert_close(fast_logits, ref_logits, **tol)
    assert set(fast_grads) == set(ref_grads)
    for name in ref_grads:
        for path, grad in (("fast", fast_grads[name]), ("reference", ref_grads[name])):
            if name not in frozen:
                assert grad is not None and grad.abs().sum() > 0, f"{name} gets no gradient on the {path} path"
        if precision != "bf16_autocast" or name in routing:
            torch.testing.assert_close(fast_grads[name], ref_grads[name], **tol, msg=name)
    return routing


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["block", "block_short_last", "full", "wav", "wav_split", "wav_phase_readout",
                                  "wav_wide", "rd_decoupled", "rd_tied", "rd_average", "rd_frozen_v", "rd_wav",
                                  "wav_learned", "wav_learned_rd"])
def test_fast_path_equals_reference_path_forward_and_gradients(mode, device):
    # wav_wide (m = 6) has reads over all four pieces of a partial block (see the kernel's BlockReads)
    assert_fast_equals_reference(mode, device, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["block", "full", "wav", "rd_wav", "wav_learned_rd"])
def test_fast_path_equals_reference_path_under_bf16_autocast(mode, device):
    routing = assert_fast_equals_reference(mode, device, "bf16_autocast")
    assert {"query.readout", "basis_coefficients"} & routing  # the routing's own parameters are compared


@pytest.mark.gpu
def test_the_harness_fails_on_a_missing_gradient(device):
    # a change that leaves a parameter without gradient on both paths (coefficients built under no_grad)
    # must not pass because None == None
    class NoGradCoefficients(GPT):
        def block_coefficients(self, first, n):
            with torch.no_grad():
                return super().block_coefficients(first, n)
    with pytest.raises(AssertionError, match="basis_coefficients gets no gradient"):
        assert_fast_equals_reference("wav_learned", device, "float32", NoGradCoefficients)


def test_randomise_routing_moves_every_routing_parameter():
    for mode in ("rd_wav", "wav_learned_rd"):
        model = make_model(**ATTNRES_MODES[mode])
        before = {n: p.clone() for n, p in model.no_decay_parameters().items()}
        assert "basis_coefficients" in before or mode == "rd_wav"
        randomise_routing(model)
        for name, p in model.no_decay_parameters().items():
            assert not torch.equal(p, before[name]), name


# The kernel alone, against depth_read on random inputs: R reads over S completed sources and the P
# sources of a block of updates, each a combination of the updates (fixed numbers, where the kernel sums
# updates with equal columns into one term, or learned coefficients), every source after the first
# RMS-matched to it with a detached scale; the block grows by one update per sublayer.
MATCH = functools.partial(nanoroute.matching_scale, rho=2.0)
ROWS = [[1, 1, 1, 1, 1], [1, -1, 1, -1, 1], [0.5, 1, -2, 0.5, 1]]  # columns 0 and 4 are equal: one term


def kernel_inputs(device, learned=False, seed=0, B=2, T=5, d=16, S=3):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    completed = [rand(B, T, d).requires_grad_() for _ in range(S)]
    updates = [rand(B, T, d).requires_grad_() for _ in ROWS[0]]
    coefficients = torch.tensor(ROWS, device=device, requires_grad=True) if learned else ROWS
    return completed, updates, coefficients, rand(2, d).requires_grad_(), rand(2, S + len(ROWS)).requires_grad_()


def explicit_sources(block, coefficients):
    """A block's sources built explicitly: v_p = Σ_i c_pi·u_i, scaled by MATCH(ms(v_0), ms(v_p)) for p > 0."""
    values = [sum(c * u for c, u in zip(row, block)) for row in coefficients]
    with torch.no_grad():
        ms = [nanoroute.mean_square(v) for v in values]
    return values[:1] + [v * MATCH(ms[0], m)[..., None] for v, m in zip(values[1:], ms[1:])]


def kernel_and_reference(inputs, precision, device, n_partial):
    """h and weights of both reads at every length of the block, and the gradients of a random loss of
    them, by the kernel and by depth_read over the explicit sources."""
    completed, updates, coefficients, queries, biases = inputs
    coefficients, S = coefficients[:n_partial], len(completed)
    leaves = [queries, biases, *completed, *updates] + [inputs[2]] * isinstance(inputs[2], torch.Tensor)
    out = []
    for kernel in (True, False):
        g, results = torch.Generator().manual_seed(5), []
        with precision_context(device, precision):
            routes = {r: (queries[r], biases[r, :S + n_partial]) for r in (0, 1)}
            reads = nanoroute.BlockReads(routes, list(enumerate(completed)), coefficients, MATCH, None, routes)
            for n in range(1, len(updates) + 1):
                for r in (0, 1):
                    if kernel:
                        results.append(reads(r, updates[:n], keep_weights=True)[:2])
                    else:
                        sources = completed + explicit_sources(updates[:n], coefficients) * (n_partial > 0)
                        results.append(nanoroute.depth_read(*routes[r], sources))
        loss = sum((h * torch.randn(h.shape, generator=g).to(device)).sum() for h, _ in results)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        out.append(([h for h, _ in results], [w for _, w in results], grads))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n_partial", [0, 1, 3])
@pytest.mark.parametrize("learned", [False, True])
def test_kernel_equals_reference_read_forward_and_gradients(device, precision, n_partial, learned):
    inputs = kernel_inputs(device, learned)
    (h, w, grads), (ref_h, ref_w, ref_grads) = kernel_and_reference(inputs, precision, device, n_partial)
    tol = dict(atol=1e-5, rtol=1e-4) if device.type == "cpu" else dict(atol=1e-4, rtol=1e-3)
    for a, b in zip(h + w, ref_h + ref_w, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **tol)
    names = ["queries", "biases"] + ["completed"] * 3 + ["update"] * 5 + ["coefficients"] * learned
    for name, a, b in zip(names, grads, ref_grads, strict=True):
        if name in ("update", "coefficients") and n_partial == 0:
            assert a is None and b is None  # no block source: the updates are not read
            continue
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, **tol, msg=name)


@pytest.mark.gpu
def test_kernel_reuses_a_key_norm_only_for_the_same_value(device):
    # the kernel computes a completed source's key norm once per forward and passes it to the next block's
    # reads; a source replaced by another value under the same name (an override of complete) gets its own
    g = torch.Generator().manual_seed(0)
    x, y, x2 = (torch.randn(2, 5, 16, generator=g).to(device) for _ in range(3))
    query, bias = torch.randn(16, generator=g).to(device), torch.zeros(2, device=device)
    first = nanoroute.BlockReads({0: (query, bias)}, [("x", x), ("y", y)], [[1]], MATCH, None, {0: []})
    then = nanoroute.BlockReads({0: (query, bias)}, [("x", 3 * x2), ("y", y)], [[1]], MATCH, first, {0: []})
    torch.testing.assert_close(then(0, [])[0], nanoroute.depth_read(query, bias, [3 * x2, y])[0])


@pytest.mark.gpu
def test_kernel_backward_inside_autocast_equals_outside(device):
    # a user may call backward() inside an autocast block: the kernel's backward stays float32
    completed, updates, coefficients, queries, biases = kernel_inputs(device, learned=True)
    leaves = [queries, biases, *completed, *updates, coefficients]
    grads = []
    for inside in (False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            routes = {r: (queries[r], biases[r]) for r in (0, 1)}
            reads = nanoroute.BlockReads(routes, list(enumerate(completed)), coefficients, MATCH, None, routes)
            loss = sum((reads(r, updates[:n])[0] * (r + 1)).square().sum() for r in (0, 1) for n in (2, 5))
            if inside:
                grads.append(torch.autograd.grad(loss, leaves))
        if not inside:
            grads.append(torch.autograd.grad(loss, leaves))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# Extending the routing (docs/routing.md walks through each): every change a researcher makes passes
# fast == reference, forward and every gradient, float32 and bf16 autocast, or is refused when built.
# The extensions tested are the docs' own code, run as written.
@functools.cache
def docs_code(path):
    """The names defined by the Python blocks of a doc that start with an import, each run as written."""
    namespace = {}
    for block in re.findall(r"```python\n(.*?)```", (Path(__file__).parent / path).read_text(), re.S):
        if block.startswith(("import ", "from ")):
            exec(compile(block, path, "exec"), namespace)
    return namespace


def docs_class(name):
    return docs_code("docs/routing.md")[name]


def assert_extension_fast_equals_reference(cfg, device, model_class):
    """assert_fast_equals_reference in both precisions: what docs/routing.md says to run for a change."""
    for precision in PRECISIONS:
        assert_fast_equals_reference(cfg, device, precision, model_class)


def test_readme_python_blocks_run_as_written():
    names = docs_code("README.md")  # the model in Python, then the README's routing change
    assert names["out"].shape == (2, 28)  # generate: 8 prompt tokens + 20
    assert names["model"].bases == ["phase", "split", "cross"]


# A new detail basis: one small method override
@pytest.mark.gpu
def test_extension_new_basis_fast_equals_reference_and_is_the_explicit_sum(device):
    cfg = dict(residual="attnres", wav=True, attnres_block=4)
    model = docs_class("GPTWithCrossBasis")(GPTConfig(**TINY, **cfg))
    assert all(b.shape == (3,) for b in model.detail_bias.values())  # a detail bias per read for it too
    _, _, routes = model(tokens(), return_routes=True)
    assert routing_stats(routes)["sources"] == ["emb", "C0", "C0.phase", "C0.split", "C0.cross",
                                                "P", "P.phase", "P.split", "P.cross"]
    us = [torch.randn(2, 5, 16) for _ in range(4)]
    state, *_, cross = model.block_sources("P", us, 0)
    assert cross.name == "P.cross" and cross.basis == "cross"
    want = us[0] - us[1] - us[2] + us[3]
    scale = torch.clamp(state.value.pow(2).mean(-1).sqrt() / (want.pow(2).mean(-1).sqrt() + nanoroute.EPS), max=4.0)
    torch.testing.assert_close(cross.value, scale[..., None] * want)
    assert_extension_fast_equals_reference(cfg, device, docs_class("GPTWithCrossBasis"))


# A source made from earlier blocks: an override of complete
@pytest.mark.gpu
def test_extension_block_difference_source_fast_equals_reference(device):
    cfg = dict(residual="attnres", attnres_block=2)  # 3 layers: C0, C1, C2, then the readout
    model = randomise_routing(docs_class("GPTWithBlockDifference")(GPTConfig(**TINY, **cfg)))
    pools = []
    complete = model.complete
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


# A learned temperature per read and a recency bias per source: an override of route
@pytest.mark.gpu
def test_extension_temperature_and_recency_in_route_fast_equals_reference(device):
    cfg = dict(residual="attnres", wav=True, rd="decoupled", attnres_block=4)
    torch.manual_seed(0)
    model = docs_class("GPTWithTemperatureAndRecency")(GPTConfig(**TINY, **cfg))
    torch.testing.assert_close(model(tokens())[0], make_model(**cfg)(tokens())[0])  # paired with its parent at init
    assert {"temperature.readout", "recency.layer1_attn_v"} <= set(model.no_decay_parameters())  # no weight decay
    assert_extension_fast_equals_reference(cfg, device, docs_class("GPTWithTemperatureAndRecency"))


# Learned detail coefficients: the flag wav_learned_bases (SPEC: Learnable bases)
@pytest.mark.gpu
def test_learned_bases_start_at_the_signs_and_learn(device):
    cfg = dict(residual="attnres", wav=True, attnres_block=4)
    fixed, learned = make_model(**cfg), make_model(**cfg, wav_learned_bases=True)
    signs = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]] * 2)[:6]  # phase, split; m = 4
    assert torch.equal(learned.basis_coefficients, signs)
    idx = tokens()
    torch.testing.assert_close(learned(idx)[0], fixed(idx)[0])  # exactly WAV v1 at init
    assert "basis_coefficients" in learned.no_decay_parameters()  # no weight decay, like every routing parameter
    shared = {n: p for n, p in fixed.named_parameters()}
    for name, p in learned.named_parameters():  # created from constants: the shared weights stay paired
        assert name == "basis_coefficients" or torch.equal(p, shared[name]), name
    opt = learned.configure_optimizers(0.1, 1e-2)
    for _ in range(2):
        learned(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(learned.basis_coefficients, signs)  # they learn
    assert not torch.allclose(learned(idx)[0], fixed(idx)[0])


# A normalised block summary (RMS-Block): completed blocks in complete(); the partial block is refused by
# the fast kernel (its contract), and works on the reference path
@pytest.mark.gpu
def test_extension_normalised_summaries_fast_equals_reference_or_refused(device):
    cfg = dict(residual="attnres", attnres_block=2)
    model = randomise_routing(docs_class("GPTWithNormalisedBlocks")(GPTConfig(**TINY, **cfg)))
    pools = []
    complete = model.complete
    model.complete = lambda b, block, pool: pools.append((complete(b, block, pool), sum(block))) or pools[-1][0]
    model(tokens())
    for b, (pool, state) in enumerate(pools):  # C_b / rms(C_b), i.e. RMSNorm(C_b) with its ε
        rms = torch.sqrt(nanoroute.mean_square(state) + nanoroute.EPS)
        torch.testing.assert_close(pool[-1].value, state / rms[..., None])
    assert_extension_fast_equals_reference(cfg, device, docs_class("GPTWithNormalisedBlocks"))
    with pytest.raises(ValueError, match="overrides block_sources, which the fast kernel cannot follow") as err:
        docs_class("GPTWithNormalisedPartialBlock")(GPTConfig(**TINY, **cfg))
    assert "contract" in str(err.value) and "fast_routing=False" in str(err.value) and "\n" not in str(err.value)
    slow = randomise_routing(docs_class("GPTWithNormalisedPartialBlock")(GPTConfig(**TINY, **cfg, fast_routing=False)))
    _, loss, routes = slow(tokens(), tokens(seed=4), return_routes=True)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in slow.no_decay_parameters().values())


# Numerics: backward() called inside an autocast block gives the gradients it gives outside
@pytest.mark.parametrize("fast", [True, False])
def test_backward_inside_bf16_autocast_equals_outside(fast):
    grads = []
    for inside in (False, True):
        model = randomise_routing(make_model(**ATTNRES_MODES["wav_learned_rd"], fast_routing=fast))
        sources = []  # every update written into the pool, to compare the sources' gradients
        sublayer = model._sublayer

        def keep_update(*args):
            u = sublayer(*args)
            u.retain_grad()
            sources.append(u)
            return u

        model._sublayer = keep_update
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
        torch.testing.assert_close(routing_inside[name], routing[name], atol=1e-7, rtol=1e-5, msg=name)
    for a, b in zip(updates_inside, updates, strict=True):  # the sources, through every update
        torch.testing.assert_close(a.float(), b.float(), atol=1e-7, rtol=1e-5)


# RD with Linear biases: the value projection keeps its bias
def test_rd_value_projection_keeps_its_bias():
    def model(rd, v_query=None):
        m = make_model(**{**ATTNRES_MODES["rd_decoupled"], "rd": rd}, bias=True)
        with torch.no_grad():
            for layer in m.layers:
                layer.attn.c_attn.bias.normal_()  # non-zero biases for Q, K and V
            if v_query is not None:
                m.query["layer1_attn_v"].copy_(v_query)
        return m

    idx = tokens()
    off = model("off")(idx)[0]
    torch.testing.assert_close(model("decoupled")(idx)[0], off, atol=1e-6, rtol=1e-6)  # zero V query
    torch.testing.assert_close(model("tied")(idx)[0], off, atol=1e-6, rtol=1e-6)
    # the value bias reaches the output on the RD path: changing it changes the logits
    dec = model("decoupled", v_query=torch.randn(16))
    before = dec(idx)[0]
    with torch.no_grad():
        dec.layers[1].attn.c_attn.bias[32:].add_(1.0)  # the V part of layer 1's bias (n_embd = 16)
    assert not torch.allclose(dec(idx)[0], before, atol=1e-4)


def test_wav_keeps_no_more_per_sublayer_for_backward_than_block_attnres():
    # Memory (issue 5): a sublayer leaves one new (B, T, d) tensor for the backward, the piece it
    # wrote, however many WAV bases there are. What WAV keeps beyond Block AttnRes is its completed
    # detail sources (2 per block that later blocks read) and small per-token statistics, not two
    # running sums per sublayer (that first design kept 39 extra tensors here, not < 12)
    shape = dict(vocab_size=64, sequence_len=8, n_layer=8, n_head=2, n_embd=128)
    x, y = torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8))
    kept = {}
    for name, extra in (("block", {}), ("wav", dict(wav=True))):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**shape, residual="attnres", attnres_block=4, **extra))
        exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        kept[name] = bench.saved_bytes(model, x, y, contextlib.nullcontext(), exclude) / (8 * 128 * 4)
    n_sub, n_blocks = 16, 4
    assert 2 * (n_blocks - 1) <= kept["wav"] - kept["block"] < 2 * n_blocks + 0.25 * n_sub


def test_routing_stays_float32_under_bf16_autocast():
    model = randomise_routing(make_model(**ATTNRES_MODES["rd_wav"]))
    pools, complete = [], model.complete  # choice: sources accumulate in float32, whatever the sublayers' dtype
    model.complete = lambda b, block, pool: pools.append((block, complete(b, block, pool))) or pools[-1][1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss, routes = model(tokens(), tokens(seed=4), return_routes=True)
        loss.backward()
    assert pools and all(u.dtype == torch.float32 for block, pool in pools for u in block)
    assert all(s.value.dtype == torch.float32 for _, pool in pools for s in pool)
    assert all(r["weights"].dtype == torch.float32 for r in routes)
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    ref = randomise_routing(make_model(**ATTNRES_MODES["rd_wav"]))
    with torch.no_grad():
        torch.testing.assert_close(logits.float(), ref(tokens())[0], atol=0.1, rtol=0.05)


def test_routing_math_ignores_bf16_autocast():
    # every routing statistic (mean squares, logits, softmax, mixtures) is computed in float32 under
    # autocast, bit for bit as without it (autocast would run vecdot and matmul in bf16)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    rinv = [torch.rsqrt(nanoroute.mean_square(v) + nanoroute.EPS) for v in values]
    queries, biases = torch.randn(4, 16, generator=g), torch.randn(4, 3, generator=g)
    sigma, scale = torch.tensor([[1.0, 1.0], [1.0, -1.0]]), torch.rand(2, 2, 5, generator=g) + 0.5

    def run():
        mix, lse, *_ = nanoroute.completed_reads(queries, biases, values, rinv)
        return (nanoroute.mean_square(values[0]), *nanoroute.depth_read(queries[0], biases[0], values),
                mix, lse, *nanoroute.merge_partial(mix[:, :, 0], lse[..., 0], queries[1], biases[1, :2],
                                            torch.stack(rinv[:2]), scale, sigma, values[:2]))

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = run()
    for a, b in zip(plain, auto):
        assert b.dtype == torch.float32 and torch.equal(a, b)


INVALID = [
    (dict(n_embd=30, n_head=4), "n_embd=30: must be divisible by n_head=4"),
    (dict(n_embd=12, n_head=4), "n_head=4: head size"),
    (dict(n_layer=0), "n_layer=0: must be a positive integer"),
    (dict(vocab_size=-1), "vocab_size=-1"),
    (dict(sequence_len=0), "sequence_len=0"),
    (dict(dropout=1.5), "dropout=1.5"),
    (dict(dropout=1.0), "dropout=1.0: must be in [0, 1)"),
    (dict(residual="postnorm"), "residual='postnorm': must be one of prenorm, rezero, layerscale, attnres"),
    (dict(rd="both"), "rd='both': must be one of"),
    (dict(wav=True), "wav=True: applies only to residual=attnres"),
    (dict(rd="decoupled"), "rd='decoupled': applies only to residual=attnres"),
    (dict(attnres_block=2), "attnres_block=2: applies only to residual=attnres"),
    (dict(residual="attnres", wav=True, attnres_block=3), "attnres_block=3: WAV needs an even routing block"),
    (dict(residual="attnres", wav=True, attnres_block=2), "attnres_block=2: WAV needs an even routing block"),
    (dict(residual="attnres", attnres_block=99), "attnres_block=99: must be 0 (auto) or 1..2*n_layer"),
    (dict(residual="attnres", wav=True, wav_rho=0.0), "wav_rho=0.0: must be > 0"),
    (dict(residual="attnres", wav=True, wav_rho=-1.0), "wav_rho=-1.0: must be > 0"),
    (dict(residual="attnres", wav=True, wav_bases="haar"), "wav_bases='haar': must be one of phase, split, both"),
    (dict(residual="attnres", wav_rho=2.0), "wav_rho=2.0: applies only with wav=True"),
    (dict(residual="attnres", wav_learned_bases=True), "wav_learned_bases=True: applies only with wav=True"),
    (dict(wav_learned_bases=True), "wav_learned_bases=True: applies only to residual=attnres"),
    (dict(fast_routing=False), "fast_routing=False: applies only to residual=attnres"),
    (dict(residual="attnres", wav=True, n_layer=1), "n_layer=1: WAV needs at least 2 layers"),
]


def test_routing_fields_are_one_list_a_subclass_extends():
    @dataclasses.dataclass
    class ConfigWithTemperature(GPTConfig):
        route_temperature: float = nanoroute.setting(1.0, "logit temperature of every read", needs="attnres")

    assert nanoroute.routing_fields() == ("residual", "attnres_block", "wav", "wav_bases", "wav_rho", "wav_detail_bias",
                                          "wav_readout_details", "wav_learned_bases", "rd", "fast_routing")
    assert nanoroute.routing_fields(ConfigWithTemperature)[-1] == "route_temperature"
    with pytest.raises(ValueError, match="route_temperature=2.0: applies only to residual=attnres"):
        ConfigWithTemperature(route_temperature=2.0)  # validate() follows the one list too
    ConfigWithTemperature(residual="attnres", route_temperature=2.0)


@pytest.mark.parametrize("overrides,message", INVALID)
def test_invalid_configs_raise_one_line_value_error(overrides, message):
    with pytest.raises(ValueError) as err:
        GPTConfig(**{**TINY, **overrides})
    assert message in str(err.value) and "\n" not in str(err.value)


class CountTensorsFromLists(torch.overrides.TorchFunctionMode):
    """Counts tensors built from Python data (torch.tensor, as_tensor, new_tensor): on a GPU each is a
    blocking copy from the host, which drains the GPU's queue."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("learned", [False, True])
def test_no_tensor_is_built_from_python_data_per_read(learned):
    model = make_model(**ATTNRES_MODES["wav_learned_rd" if learned else "rd_wav"], n_layer=4)
    model(tokens(), tokens(seed=4))[1].backward()  # the first forward may build the kernel's constants, once
    for grad in (True, False):  # training and evaluation
        with CountTensorsFromLists() as counter, torch.set_grad_enabled(grad):
            model(tokens(), tokens(seed=4))[1].sum()
        assert counter.count == 0, counter.count
    with CountTensorsFromLists() as counter:  # the counter sees them: a read that builds one is caught
        torch.tensor([1.0, 2.0])
    assert counter.count == 1


def test_kernel_constants_are_built_once_per_device():
    a = nanoroute._constant(((1.0, -1.0),), torch.device("cpu"))
    assert nanoroute._constant(((1.0, -1.0),), torch.device("cpu")) is a  # reused
    assert nanoroute._constant(((1.0, -1.0),), torch.device("meta")).device.type == "meta"  # not the CPU's copy


def test_embedding_dropout_is_on_in_training_only():
    model = make_model(dropout=0.5)
    seen = []
    model.drop.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    model(tokens())
    (e, dropped), = seen
    assert torch.equal(e, model.wte(tokens())) and (dropped == 0).float().mean() > 0.3  # the embedding e
    model.eval()
    model(tokens())
    assert torch.equal(seen[-1][0], seen[-1][1])


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


# -----------------------------------------------------------------------------
# Data: prepare_data.py against a local HTTP server (no test touches the internet)

_DATA_SCRIPT = str(Path(prepare_data.__file__).resolve())


# -----------------------------------------------------------------------------
# helpers: a small HTTP server that honours Range, and tiny stand-ins for the real files

class _DataHandler(http.server.BaseHTTPRequestHandler):
    files, log, status, cut_once, ignore_range = {}, [], {}, set(), False  # replaced per server
    wrong_range = False  # answer a Range request with 206 from byte 0 (another range than asked)

    def log_message(self, *args):
        pass

    def do_GET(self):
        name, rng = self.path.lstrip("/"), self.headers.get("Range")
        self.log.append((name, rng))
        if name in self.status or name not in self.files:
            self.send_error(self.status.get(name, 404))
            return
        data, start = self.files[name], 0
        if rng and not self.ignore_range:
            start = 0 if self.wrong_range else int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if name in self.cut_once and start == 0:  # promise the whole file, send half, hang up
            self.cut_once.discard(name)
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def _data_server():
    handler = type("Handler", (_DataHandler,), dict(files={}, log=[], status={}, cut_once=set()))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()
    server.server_close()


def _data_text8(n=2000, seed=0):
    rng = random.Random(seed)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(n)).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("text8", text)
    return text, buf.getvalue()


def _data_shard(tokens, magic=20240520, version=1):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens)
    return header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()


def _data_gpt2_files():
    """A tiny encoder.json / vocab.bpe: the 256 byte tokens, three merges, and <|endoftext|>."""
    b2u = prepare_data._bytes_to_unicode()
    enc = {b2u[b]: b for b in range(256)}
    enc.update({"he": 256, "Ġt": 257, "Ġthe": 258, "<|endoftext|>": 50256})
    bpe = "#version: 0.2\nh e\nĠ t\nĠt he\n"
    return {"encoder.json": json.dumps(enc).encode(), "vocab.bpe": bpe.encode()}


def _data_fineweb_files():
    val = [50256, 1, 2, 3, 50256, 4, 5, 6, 7, 50256, 8, 9, 10, 11, 50256, 12]  # middle is 8
    train = [[50256, 100, 101, 102, 50000], [50256, 200, 201]]
    files = {"finewebedu_val_000000.bin": _data_shard(val),
             "finewebedu_train_000001.bin": _data_shard(train[0]),
             "finewebedu_train_000002.bin": _data_shard(train[1]), **_data_gpt2_files()}
    return files, val, train


def _data_cli(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k != "NANOROUTE_BASE_URL"}
    full_env.update(NANOROUTE_RETRY_BACKOFF="0.001", **(env or {}))
    return subprocess.run([sys.executable, _DATA_SCRIPT, *args], capture_output=True, text=True,
                          env=full_env, timeout=60)


def _data_one_error_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def _data_fast(**kw):
    return dict(retries=2, backoff=0.001, **kw)


def _data_cut_text8(out, server, zipped):
    """The folder a cut text8 download leaves: progress.json records the download, and
    downloads/text8.zip.part holds its first half. Returns the .part file."""
    server.files["text8.zip"] = zipped
    server.cut_once.add("text8.zip")
    with pytest.raises(prepare_data.UsageError, match="failed after 1 tries"):
        prepare_data.prepare("text8", out, base_url=server.url, retries=0, backoff=0.001)
    server.log.clear()
    part = out / "downloads" / "text8.zip.part"
    assert 0 < part.stat().st_size < len(zipped)
    return part


def _data_stopped_before_meta_json(monkeypatch, *args, **kw):
    """prepare(*args, **kw) until every split is written and the downloads are deleted, then an I/O
    error at meta.json: the folder a run killed at its last step leaves (a re-run resumes it)."""
    real = prepare_data.write_json

    def crash(path, obj):
        if path.name == "meta.json":
            raise OSError(errno.EIO, "I/O error")
        real(path, obj)
    with monkeypatch.context() as m:
        m.setattr(prepare_data, "write_json", crash)
        with pytest.raises(OSError):
            prepare_data.prepare(*args, **kw)
    assert not (Path(args[1]) / "meta.json").exists()


# -----------------------------------------------------------------------------
# demo

# an unfinished folder prepared again with other options starts over: no split of the old options is kept
def test_data_unfinished_folder_with_other_options_is_made_anew(tmp_path, monkeypatch):
    finish = prepare_data._finish_split

    def stop_after_train(out, state, split, chunks, dtype):
        if split != "train":
            raise KeyboardInterrupt  # as Ctrl-C once train.bin is written
        finish(out, state, split, chunks, dtype)
    monkeypatch.setattr(prepare_data, "_finish_split", stop_after_train)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.prepare("demo", tmp_path / "a", seed=1, demo_mb=0.01)
    assert (tmp_path / "a" / "train.bin").exists() and not (tmp_path / "a" / "meta.json").exists()
    monkeypatch.setattr(prepare_data, "_finish_split", finish)
    prepare_data.prepare("demo", tmp_path / "a", seed=2, demo_mb=0.01)
    prepare_data.prepare("demo", tmp_path / "b", seed=2, demo_mb=0.01)  # the same options, at once
    for name in ("train.bin", "val.bin", "test.bin", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_data_demo_deterministic_and_readable(tmp_path):
    a = prepare_data.prepare("demo", tmp_path / "a")
    b = prepare_data.prepare("demo", tmp_path / "b")
    c = prepare_data.prepare("demo", tmp_path / "c", seed=7, demo_mb=0.2)
    meta = prepare_data.load_meta(a)
    assert meta == prepare_data.load_meta(b)
    assert meta["level"] == "char" and meta["dtype"] == "uint8" and meta["format_version"] == 1
    assert meta["source"] == "generated (seed 1337)" and meta["vocab_size"] == len(meta["chars"]) <= 256
    n = meta["splits"]
    assert 1.9e6 < sum(n.values()) < 2.2e6 and abs(n["train"] / sum(n.values()) - 0.9) < 0.01
    for split in ("train", "val", "test"):
        assert (Path(a) / f"{split}.bin").read_bytes() == (Path(b) / f"{split}.bin").read_bytes()
    assert (Path(a) / "val.bin").read_bytes()[:1000] != (Path(c) / "val.bin").read_bytes()[:1000]
    text = prepare_data.decoder(meta, a)(prepare_data.open_split(a, "val")[:20000])
    assert text.endswith("\n\n") or len(text) == 20000
    assert '"' in text and "said" in text and "\n" in text and ". " in text
    assert len(set(text.split())) > 200  # varied words
    assert not (Path(a) / "progress.json").exists() and not list(Path(a).glob("*.tmp"))


def test_data_api_roundtrip_and_clear_errors(tmp_path):
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.1)
    meta = prepare_data.load_meta(out)
    enc, dec = prepare_data.encoder(meta, out), prepare_data.decoder(meta, out)
    assert dec(enc('Lily said, "Hello!"\n')) == 'Lily said, "Hello!"\n'
    with pytest.raises(prepare_data.UsageError, match="€"):
        enc("10 €")
    with pytest.raises(prepare_data.UsageError, match="python prepare_data.py demo --out"):
        prepare_data.load_meta(tmp_path / "nothing" / "demo")
    with pytest.raises(prepare_data.UsageError, match="no 'bogus' split"):
        prepare_data.open_split(out, "bogus")
    with open(out / "val.bin", "r+b") as f:  # a damaged split is refused, and the command repairs it
        f.truncate(10)
    with pytest.raises(prepare_data.UsageError, match="expected .* prepare_data.py demo"):
        prepare_data.open_split(out, "val")
    prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.1)
    assert len(prepare_data.open_split(out, "val")) == meta["splits"]["val"]
    assert dec([meta["vocab_size"] + 5]) == "\ufffd"  # a padded head's extra ids decode harmlessly



# the demo's train/val/test splits are disjoint: no story is both trained on and evaluated on
def test_data_demo_splits_are_disjoint(tmp_path):
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.3)
    meta = prepare_data.load_meta(out)
    decode = prepare_data.decoder(meta, out)
    stories = {s: decode(prepare_data.open_split(out, s)).split("\n\n") for s in prepare_data.SPLITS}
    assert all(len(stories[s]) > 20 and stories[s][-1] == "" for s in stories)  # whole stories only
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert not set(stories[a][:-1]) & set(stories[b][:-1]), (a, b)

# the vocabulary is every split's characters: at the smallest --demo_mb, 'Z' and 'L' occur only in val/test
def test_data_demo_vocabulary_covers_every_split(tmp_path):
    texts = prepare_data.demo_stories(1337, 0.001)
    assert set(texts["val"] + texts["test"]) - set(texts["train"])  # the hard case is there
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.001)
    meta = prepare_data.load_meta(out)
    decode = prepare_data.decoder(meta, out)
    assert all(decode(prepare_data.open_split(out, s)) == texts[s] for s in prepare_data.SPLITS)
    prepare_data.check_tokens(out, meta, meta["splits"])  # train.py's check: every id below vocab_size

# -----------------------------------------------------------------------------
# text8

def _data_text8_expected(text):
    ids = np.array([0 if ch == 32 else ch - 96 for ch in text], dtype=np.uint8)
    n = len(ids)
    return dict(train=ids[:n * 90 // 100], val=ids[n * 90 // 100:n * 95 // 100], test=ids[n * 95 // 100:])


def _data_check_text8(out, text, url):
    meta = prepare_data.load_meta(out)
    assert meta["chars"] == list(" abcdefghijklmnopqrstuvwxyz") and meta["vocab_size"] == 27
    assert meta["source"] == [url + "/text8.zip"] and meta["dtype"] == "uint8"
    for split, ids in _data_text8_expected(text).items():
        assert np.array_equal(prepare_data.open_split(out, split), ids)
        assert meta["splits"][split] == len(ids)


def test_data_text8_from_mirror(tmp_path, _data_server):
    text, zipped = _data_text8(2099)  # no multiple of 100: val is [90%, 95%), test the rest
    _data_server.files["text8.zip"] = zipped
    out = prepare_data.prepare("text8", tmp_path / "t8", base_url=_data_server.url, **_data_fast())
    _data_check_text8(out, text, _data_server.url)
    assert not (out / "downloads").exists() and not (out / "progress.json").exists()


def test_data_cut_download_resumes_with_range(tmp_path, _data_server):
    text, zipped = _data_text8(5000)
    _data_server.files["text8.zip"] = zipped
    _data_server.cut_once.add("text8.zip")
    out = prepare_data.prepare("text8", tmp_path / "t8", base_url=_data_server.url, **_data_fast())
    _data_check_text8(out, text, _data_server.url)
    ranges = [r for name, r in _data_server.log if name == "text8.zip" and r]
    assert len(ranges) == 1 and 0 < int(ranges[0].split("=")[1].rstrip("-")) < len(zipped)


def test_data_server_ignoring_range_restarts_from_zero(tmp_path, _data_server):
    text, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    _data_cut_text8(tmp_path / "t8", _data_server, zipped).write_bytes(b"junk" * 50)
    _data_server.ignore_range = True
    out = prepare_data.prepare("text8", tmp_path / "t8", base_url=_data_server.url, keep_downloads=True,
                               **_data_fast())
    assert _data_server.log[0][1] == "bytes=200-"  # it did ask to resume; the server sent it all
    _data_check_text8(out, text, _data_server.url)
    assert (out / "downloads" / "text8.zip").read_bytes() == zipped  # no junk kept before it


def test_data_whole_part_file_is_finished_not_refetched(tmp_path, _data_server):
    text, zipped = _data_text8()
    # killed after the last byte, before the rename
    _data_cut_text8(tmp_path / "t8", _data_server, zipped).write_bytes(zipped)
    out = prepare_data.prepare("text8", tmp_path / "t8", base_url=_data_server.url, **_data_fast())
    assert _data_server.log == [("text8.zip", f"bytes={len(zipped)}-")]  # answered 416: nothing left
    _data_check_text8(out, text, _data_server.url)


@pytest.mark.parametrize("damage", ["truncated", "damaged data"])
def test_data_truncated_zip_is_rejected(tmp_path, _data_server, capsys, damage):
    _, zipped = _data_text8()
    if damage == "truncated":
        zipped = zipped[:len(zipped) // 2]
    else:  # the directory intact, the deflate stream's first block of an invalid type (zlib.error)
        zipped, head = bytearray(zipped), zipfile.ZipFile(io.BytesIO(zipped)).infolist()[0].header_offset
        name, extra = (int.from_bytes(zipped[head + i:head + i + 2], "little") for i in (26, 28))
        zipped[head + 30 + name + extra] |= 0b110
    _data_server.files["text8.zip"] = bytes(zipped)
    out = tmp_path / "t8"
    rc = prepare_data.main(["text8", "--out", str(out), "--base_url", _data_server.url, "--retries", "0"])
    line = _data_one_error_line(capsys.readouterr().err)
    assert rc == 2 and "text8.zip" in line and "corrupt" in line and "re-run" in line
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == []  # nothing a later run would trust


# a crash right before meta.json: the splits are done, a re-run must reuse them (uint8 and uint16 splits)
@pytest.mark.parametrize("dataset", ["text8", "fineweb_edu"])
def test_data_rerun_skips_finished_work(tmp_path, _data_server, monkeypatch, dataset):
    text, zipped = _data_text8()
    files, _, train = _data_fineweb_files()
    _data_server.files.update({"text8.zip": zipped, **files})
    kw = dict(base_url=_data_server.url, **_data_fast(), **({"shards": 2} if dataset == "fineweb_edu" else {}))
    out = tmp_path / dataset
    _data_stopped_before_meta_json(monkeypatch, dataset, out, **kw)
    stamps = {s: (out / f"{s}.bin").stat().st_mtime_ns for s in prepare_data.SPLITS}
    _data_server.log.clear()
    _data_server.files.clear()  # nothing more may be downloaded
    prepare_data.prepare(dataset, out, **kw)
    if dataset == "text8":
        _data_check_text8(out, text, _data_server.url)
    else:
        assert prepare_data.open_split(out, "train").tolist() == train[0] + train[1]
    assert {s: (out / f"{s}.bin").stat().st_mtime_ns for s in stamps} == stamps and _data_server.log == []
    prepare_data.prepare(dataset, out, **kw)  # finished folder: nothing to do
    assert {s: (out / f"{s}.bin").stat().st_mtime_ns for s in stamps} == stamps and _data_server.log == []


def test_data_full_disk_and_ctrl_c_leave_nothing_complete(tmp_path, _data_server, monkeypatch, capsys):
    text, zipped = _data_text8(5000)
    _data_server.files["text8.zip"] = zipped
    out, real = tmp_path / "t8", prepare_data._write
    args = ["text8", "--out", str(out), "--base_url", _data_server.url]

    def full_disk(f, data):
        if f.name.endswith(".bin.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
        real(f, data)
    monkeypatch.setattr(prepare_data, "_write", full_disk)
    assert prepare_data.main(args) == 2
    line = _data_one_error_line(capsys.readouterr().err)
    assert "No space left" in line and "free some disk space" in line
    assert not list(out.glob("*.bin*")) and not (out / "meta.json").exists()

    shutil.rmtree(out)

    def ctrl_c(f, data):  # Ctrl-C once the first 1000 bytes of the download have landed
        real(f, data[:1000] if f.name.endswith(".part") else data)
        if f.name.endswith(".part"):
            raise KeyboardInterrupt
    monkeypatch.setattr(prepare_data, "_write", ctrl_c)
    assert prepare_data.main(args) == 2
    assert "interrupted" in _data_one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["progress.json", "text8.zip.part"]
    monkeypatch.undo()
    assert prepare_data.main(args) == 0
    assert any(r == "bytes=1000-" for _, r in _data_server.log)
    _data_check_text8(out, text, _data_server.url)


# issue 12: a run killed right after meta.json leaves nothing behind for good; issue 21: clean-up
# deletes only the downloads the records (progress.json, meta.json) name, never a file it did not make
def test_data_leftovers_of_a_run_killed_after_meta_json_are_cleaned(tmp_path, _data_server, monkeypatch, capsys):
    text, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    out, real = tmp_path / "t8", prepare_data.write_json

    def killed_after_meta_json(path, obj):
        real(path, obj)
        if path.name == "meta.json":
            raise KeyboardInterrupt
    monkeypatch.setattr(prepare_data, "write_json", killed_after_meta_json)
    for keep in (False, True):
        with pytest.raises(KeyboardInterrupt):
            prepare_data.prepare("text8", out, base_url=_data_server.url, keep_downloads=keep, **_data_fast())
        left = sorted(p.name for p in out.rglob("*"))
        assert left == sorted(["meta.json", "progress.json", "test.bin", "train.bin", "val.bin",
                               *(["downloads", "text8.zip"] if keep else [])])
        monkeypatch.setattr(prepare_data, "write_json", real)
        if not keep:
            prepare_data.prepare("text8", out, base_url=_data_server.url, **_data_fast())
            assert "already prepared" in capsys.readouterr().out
            assert sorted(p.name for p in out.iterdir()) == ["meta.json", "test.bin", "train.bin", "val.bin"]
            shutil.rmtree(out)
            monkeypatch.setattr(prepare_data, "write_json", killed_after_meta_json)
    (out / "downloads" / "notes.txt").write_text("the user's")  # not the project's: never deleted
    prepare_data.prepare("text8", out, keep_downloads=True, **_data_fast())
    assert "already prepared" in capsys.readouterr().out
    assert not (out / "progress.json").exists() and (out / "downloads" / "text8.zip").read_bytes() == zipped
    prepare_data.prepare("text8", out, **_data_fast())  # without --keep_downloads: the kept ones go
    assert "deleted the downloads kept" in capsys.readouterr().out
    assert sorted(p.name for p in out.rglob("*")) == ["downloads", "meta.json", "notes.txt", "test.bin",
                                                        "train.bin", "val.bin"]
    assert "made" not in prepare_data.load_meta(out)
    _data_check_text8(out, text, _data_server.url)


def test_writes_that_matter_fsync_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.01)
    train.save_atomic(dict(model={"w": torch.ones(2)}), tmp_path / "last.pt")
    train.save_atomic(dict(best_val_loss=1.0), tmp_path / "summary.json")
    written = [out / "train.bin", out / "val.bin", out / "test.bin", out / "meta.json", tmp_path / "last.pt",
               tmp_path / "summary.json"]
    for path in written:
        i = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(path))
        tmp = Path(events[i][1])  # a fresh name next to path
        assert tmp.parent == path.parent and tmp.name.endswith(f".{path.name}.tmp") and not tmp.exists()
        assert events[i - 1] == ("fsync", str(tmp)) and events[i + 1] == ("fsync", str(path.parent)), path


# a file from a pinned official URL whose size or sha256 is not the pinned one is rejected
@pytest.mark.parametrize("wrong", ["shorter", "longer", "sha256"])
def test_data_official_file_with_other_size_or_sha256_is_rejected(tmp_path, _data_server, monkeypatch, capsys, wrong):
    text, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    url, sha = _data_server.url + "/text8.zip", hashlib.sha256(zipped).hexdigest()
    pins = {"shorter": (len(zipped) + 1, sha), "longer": (len(zipped) - 1, sha),  # than the pin says
            "sha256": (len(zipped), hashlib.sha256(b"other").hexdigest())}
    monkeypatch.setattr(prepare_data, "KNOWN", {url: pins[wrong]})  # the test server plays the official site
    out = tmp_path / "t8"
    args = ["text8", "--out", str(out), "--base_url", _data_server.url, "--retries", "0"]
    assert prepare_data.main(args) == 2
    line = _data_one_error_line(capsys.readouterr().err)
    why = "sha256 differs" if wrong == "sha256" else f"{len(zipped)} bytes, expected {pins[wrong][0]}"
    assert "text8.zip" in line and why in line
    assert [p for p in out.rglob("*") if p.is_file()] == []
    monkeypatch.setattr(prepare_data, "KNOWN", {url: (len(zipped), sha)})  # the right pins pass
    assert prepare_data.main(args) == 0
    _data_check_text8(out, text, _data_server.url)


# Ctrl-C while a download is verified leaves no file under its final name, and a re-run verifies again
def test_data_ctrl_c_during_verification_leaves_nothing_a_rerun_trusts(tmp_path, _data_server, monkeypatch,
                                                                        capsys):
    _, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped  # a valid zip, but not the file the pin names
    monkeypatch.setattr(prepare_data, "KNOWN", {_data_server.url + "/text8.zip": (len(zipped), "0" * 64)})
    out, sha256 = tmp_path / "t8", hashlib.sha256
    args = ["text8", "--out", str(out), "--base_url", _data_server.url, "--retries", "0"]

    class Interrupted:  # Ctrl-C in the middle of hashing the download
        def update(self, block):
            raise KeyboardInterrupt
    monkeypatch.setattr(prepare_data.hashlib, "sha256", Interrupted)
    assert prepare_data.main(args) == 2
    assert "interrupted" in _data_one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["progress.json", "text8.zip.part"]
    monkeypatch.setattr(prepare_data.hashlib, "sha256", sha256)
    assert prepare_data.main(args) == 2
    assert "sha256 differs" in _data_one_error_line(capsys.readouterr().err)
    assert [p for p in out.rglob("*") if p.is_file()] == []

# -----------------------------------------------------------------------------
# tinystories

def test_data_tinystories_vocab_eot_and_replacement(tmp_path, _data_server, monkeypatch):
    train = ("Once upon a time, Tom saw a cat.\n<|endoftext|>\nLily said \"hi\" to Tom. é!\n"
             "<|endoftext|>\nThe cat ran to Lily and Tom.\n<|endoftext|>")
    valid = "Tom saw Lily. Zoë ran.\n<|endoftext|>\n"
    _data_server.files.update({"TinyStoriesV2-GPT4-train.txt": train.encode(),
                               "TinyStoriesV2-GPT4-valid.txt": valid.encode()})
    monkeypatch.setattr(prepare_data, "CHUNK", 5)  # stories and <|endoftext|> cut across chunks
    plain = train.replace("<|endoftext|>", "")
    out = prepare_data.prepare("tinystories", tmp_path / "ts", base_url=_data_server.url,
                               min_per_million=1.5e6 / len(plain), **_data_fast())  # 1.5 occurrences
    meta = prepare_data.load_meta(out)
    frequent = sorted(c for c in set(plain) if plain.count(c) >= 2)
    assert meta["chars"] == frequent + ["<|endoftext|>", "\ufffd"] and meta["dtype"] == "uint8"
    assert "é" not in meta["chars"] and "T" in meta["chars"]

    def expected(text):
        ids = []
        for i, story in enumerate(text.split("<|endoftext|>")):
            ids += [len(frequent)] if i else []
            ids += [frequent.index(c) if c in frequent else len(frequent) + 1 for c in story]
        return ids
    assert prepare_data.open_split(out, "train").tolist() == expected(train)
    assert prepare_data.open_split(out, "val").tolist() == expected(valid)
    assert set(meta["splits"]) == {"train", "val"}
    dec, enc = prepare_data.decoder(meta, out), prepare_data.encoder(meta, out)
    shown = "<|endoftext|>".join("".join(c if c in frequent else "\ufffd" for c in story)
                                 for story in valid.split("<|endoftext|>"))
    assert dec(prepare_data.open_split(out, "val")) == shown and "\ufffdo\ufffd" in shown
    assert enc("Tom<|endoftext|>") == expected("Tom<|endoftext|>")


# --min_per_million is a frequency: a small file keeps its ordinary characters, and what it replaces is shown
def test_data_tinystories_small_file_keeps_ordinary_characters(tmp_path, _data_server, capsys):
    story = "Once upon a time, Dan saw a quiet Zebra: \"Hi!\" - it said; Kim's cat ran. "
    train = (story * 30 + "é" + "<|endoftext|>") * 10  # 'q', 'Z', ':' 300 times each in ~23K characters
    _data_server.files.update({"TinyStoriesV2-GPT4-train.txt": train.encode(),
                               "TinyStoriesV2-GPT4-valid.txt": story.encode()})
    out = prepare_data.prepare("tinystories", tmp_path / "small", base_url=_data_server.url, **_data_fast())
    meta = prepare_data.load_meta(out)
    assert set(story + "é") <= set(meta["chars"]) and meta["replaced"] == []  # default 0.5 per million
    assert meta["options"]["min_per_million"] == 0.5
    assert "become" not in capsys.readouterr().out
    _data_server.log.clear()  # finished, although it has no test split: a re-run fetches and writes nothing
    prepare_data.prepare("tinystories", tmp_path / "small", base_url=_data_server.url, **_data_fast())
    assert "is already prepared" in capsys.readouterr().out and _data_server.log == []
    # a threshold of 15 occurrences: only 'é' (10 times) is rarer; every character of the story is there 300 times
    plain = train.replace("<|endoftext|>", "")
    out = prepare_data.prepare("tinystories", tmp_path / "strict", base_url=_data_server.url,
                               min_per_million=15 / len(plain) * 1e6, **_data_fast())  # 15 occurrences
    meta = prepare_data.load_meta(out)
    assert meta["replaced"] == ["é"] and "q" in meta["chars"] and "é" not in meta["chars"]
    printed = capsys.readouterr().out
    assert "1 characters rarer than --min_per_million" in printed and "become '\ufffd': 'é'" in printed
    with pytest.raises(prepare_data.UsageError) as e:  # what sample.py prints for such a prompt
        prepare_data.encoder(meta, out)("Zoé ran ☃")
    assert "'é' '☃'" in str(e.value) and "'é' became '\ufffd'" in str(e.value)
    assert "lower --min_per_million" in str(e.value)
    with pytest.raises(prepare_data.UsageError) as e:  # a character the data never had: the plain message
        prepare_data.encoder(meta, out)("☃")
    assert "min_per_million" not in str(e.value) and "'☃'; remove or replace them" in str(e.value)

# --v1: the V1 files by their names; --min_per_million 0 keeps a character the default 0.5 replaces (once in
# 2.1M characters is 0.48 per million)
def test_data_tinystories_v1_files_and_min_per_million_0_keeps_every_character(tmp_path, _data_server):
    train = "Tom saw a cat. " * 140_000 + "é<|endoftext|>Tom saw a cat.<|endoftext|>"
    _data_server.files.update({"TinyStories-train.txt": train.encode(),
                               "TinyStories-valid.txt": "Tom ran é.<|endoftext|>".encode()})
    keep = prepare_data.prepare("tinystories", tmp_path / "keep", base_url=_data_server.url, v1=True,
                                min_per_million=0, **_data_fast())
    meta = prepare_data.load_meta(keep)
    assert "TinyStories-train.txt" in json.dumps(meta["source"]) and "V2" not in json.dumps(meta["source"])
    assert meta["replaced"] == [] and "é" in meta["chars"] and meta["options"]["v1"] is True
    default = prepare_data.prepare("tinystories", tmp_path / "default", base_url=_data_server.url, v1=True,
                                   **_data_fast())
    meta = prepare_data.load_meta(default)
    assert meta["replaced"] == ["é"] and "é" not in meta["chars"]
    assert {name for name, _ in _data_server.log} == {"TinyStories-train.txt", "TinyStories-valid.txt"}
    with pytest.raises(prepare_data.UsageError, match="TinyStoriesV2-GPT4-"):  # without --v1: the V2 files
        prepare_data.prepare("tinystories", tmp_path / "v2", base_url=_data_server.url, **_data_fast())



# at least --min_per_million: a character exactly at the threshold is kept; the replaced ones are listed
# commonest first; '\ufffd' (in the text, or from undecodable bytes) is the one last id, never "replaced"
@pytest.mark.parametrize("ufffd", [4, 1])  # times '\ufffd' occurs: above the threshold, below it
def test_data_tinystories_threshold_order_and_the_replacement_symbol(tmp_path, _data_server, capsys, ufffd):
    text = "xxx" + "yy" + "z" + "<|endoftext|>"  # at 3 per 1000 characters: x kept, y and z replaced
    raw = text.encode() + b"\xff" * (ufffd - ufffd // 2) + ("\ufffd" * (ufffd // 2)).encode()
    raw = b"a" * (1000 - len(text) + len("<|endoftext|>") - ufffd) + raw  # 1000 characters besides the marker
    _data_server.files.update({"TinyStoriesV2-GPT4-train.txt": raw,
                               "TinyStoriesV2-GPT4-valid.txt": b"zyx\xff<|endoftext|>a"})
    out = prepare_data.prepare("tinystories", tmp_path / "ts", base_url=_data_server.url, min_per_million=3000,
                               **_data_fast())  # 3000 per million of 1000 characters: exactly 3
    meta = prepare_data.load_meta(out)
    assert meta["chars"] == ["a", "x", "<|endoftext|>", "\ufffd"] and meta["replaced"] == ["y", "z"]
    assert "2 characters rarer than --min_per_million 3000 (0.3% of train) become '\ufffd': 'y' 'z'\n" in \
        capsys.readouterr().out
    assert prepare_data.open_split(out, "train").tolist() == [0] * (1000 - 6 - ufffd) + [1, 1, 1] + [3] * 3 + \
        [2] + [3] * ufffd
    assert prepare_data.open_split(out, "val").tolist() == [3, 3, 1, 3, 2, 0]


# uint8 holds up to 256 symbols: 254 characters + <|endoftext|> + '\ufffd' are uint8, one more is uint16
@pytest.mark.parametrize("n_chars, dtype", [(254, "uint8"), (255, "uint16")])
def test_data_tinystories_256_symbols_are_uint8(tmp_path, _data_server, n_chars, dtype):
    chars = [chr(0x100 + i) for i in range(n_chars)]
    train = "".join(chars) + "<|endoftext|>" + "".join(reversed(chars))
    _data_server.files.update({"TinyStoriesV2-GPT4-train.txt": train.encode(),
                               "TinyStoriesV2-GPT4-valid.txt": chars[-1].encode()})
    out = prepare_data.prepare("tinystories", tmp_path / "ts", base_url=_data_server.url, **_data_fast())
    meta = prepare_data.load_meta(out)
    assert meta["vocab_size"] == n_chars + 2 and meta["dtype"] == dtype
    assert (out / "train.bin").stat().st_size == (2 * n_chars + 1) * np.dtype(dtype).itemsize
    prepare_data.check_tokens(out, meta, meta["splits"])  # train.py's check takes the folder
    assert prepare_data.decoder(meta, out)(prepare_data.open_split(out, "train")) == train


# A half-finished folder's error names the dataset that was being prepared (not a placeholder)
def test_data_half_finished_folder_names_its_dataset(tmp_path, _data_server):
    _data_server.files["TinyStoriesV2-GPT4-train.txt"] = b"Once upon a time.<|endoftext|>"  # no valid file: 404
    r = _data_cli("tinystories", "--out", str(tmp_path / "my_stories"), "--base_url", _data_server.url)
    assert r.returncode == 2 and "404" in _data_one_error_line(r.stderr)
    with pytest.raises(prepare_data.UsageError) as e:
        prepare_data.load_meta(tmp_path / "my_stories")
    assert f"run: python prepare_data.py tinystories --out {tmp_path / 'my_stories'}" in str(e.value)
    assert json.loads((tmp_path / "my_stories/progress.json").read_text())["dataset"] == "tinystories"
    (tmp_path / "my_text/downloads").mkdir(parents=True)
    (tmp_path / "my_text/downloads/text8.zip.part").write_bytes(b"PK")  # a download cut before any split
    with pytest.raises(prepare_data.UsageError) as e:
        prepare_data.load_meta(tmp_path / "my_text")
    assert f"run: python prepare_data.py text8 --out {tmp_path / 'my_text'}" in str(e.value)
    with pytest.raises(prepare_data.UsageError) as e:  # never started: the datasets to choose from
        prepare_data.load_meta(tmp_path / "elsewhere")
    assert "NAME" not in str(e.value) and "(DATASET: demo, text8, tinystories, fineweb_edu)" in str(e.value)


# -----------------------------------------------------------------------------
# fineweb_edu

def test_data_fineweb_shards_split_and_decoding(tmp_path, _data_server):
    files, val, train = _data_fineweb_files()
    _data_server.files.update(files)
    out = prepare_data.prepare("fineweb_edu", tmp_path / "fw", base_url=_data_server.url, shards=2,
                               **_data_fast())
    meta = prepare_data.load_meta(out)
    assert meta["level"] == "gpt2" and meta["dtype"] == "uint16" and meta["vocab_size"] == 50257
    assert meta["splits"] == {"train": 8, "val": 9, "test": 7} and "chars" not in meta
    assert prepare_data.open_split(out, "train").tolist() == train[0] + train[1]
    assert prepare_data.open_split(out, "val").tolist() == val[:9]  # cut at the first EOT >= middle
    assert prepare_data.open_split(out, "test").tolist() == val[9:]
    assert (out / "encoder.json").exists() and (out / "vocab.bpe").exists()
    assert prepare_data.decoder(meta, out)([258, 99, 97, 116, 50256]) == " thecat<|endoftext|>"
    if importlib.util.find_spec("tiktoken"):  # optional: without it, encoding is one line naming it
        assert prepare_data.encoder(meta, out)(" the cat") == [258, 32, 99, 97, 116]
    else:
        with pytest.raises(prepare_data.UsageError, match="pip install tiktoken"):
            prepare_data.encoder(meta, out)


def test_data_fineweb_more_shards_fetches_only_new_files(tmp_path, _data_server):
    files, _, train = _data_fineweb_files()
    _data_server.files.update(files)
    kw = dict(base_url=_data_server.url, keep_downloads=True, **_data_fast())
    prepare_data.prepare("fineweb_edu", tmp_path / "fw", shards=1, **kw)
    _data_server.log.clear()
    out = prepare_data.prepare("fineweb_edu", tmp_path / "fw", shards=2, **kw)
    assert [name for name, _ in _data_server.log] == ["finewebedu_train_000002.bin"]
    assert prepare_data.open_split(out, "train").tolist() == train[0] + train[1]


# a shard must hold exactly its header's token count, each id below 50257 (GPT-2's vocabulary)
@pytest.mark.parametrize("bad", ["magic", "shorter", "longer", "token", "token 50257"])
def test_data_corrupt_shard_is_rejected(tmp_path, _data_server, capsys, bad):
    files, _, _ = _data_fineweb_files()
    name = "finewebedu_train_000002.bin"
    files[name] = {"magic": _data_shard([1, 2, 3], magic=1234), "shorter": _data_shard([1, 2, 3])[:-2],
                   "longer": _data_shard([1, 2, 3]) + b"\x04\x00", "token": _data_shard([1, 60000, 3]),
                   "token 50257": _data_shard([1, 50257, 3])}[bad]
    _data_server.files.update(files)
    out = tmp_path / "fw"
    rc = prepare_data.main(["fineweb_edu", "--shards", "2", "--out", str(out), "--base_url",
                            _data_server.url, "--retries", "0"])
    line = _data_one_error_line(capsys.readouterr().err)
    assert rc == 2 and name in line and "corrupt" in line and "re-run" in line
    assert not (out / "train.bin").exists() and not (out / "meta.json").exists()
    assert not list(out.rglob(name + "*"))


# a mirror's encoder.json (no hash to check) that is not GPT-2's is refused with one line, by the check
# sample.py's decoding makes too: no JSON object, <|endoftext|> in a list or at another id, a token
# that is not byte-level ("\n" is "Ċ" in GPT-2's table), an id past the vocabulary
@pytest.mark.parametrize("served", [b"50256", b"not json", b'["<|endoftext|>"]', b'{"<|endoftext|>": 3}',
                                    b'{"<|endoftext|>": 50256, "a\\n": 1}',
                                    b'{"<|endoftext|>": 50256, "a": 50257}'])
def test_data_mirror_encoder_json_that_is_not_gpt2s_is_one_line(tmp_path, _data_server, capsys, served):
    files, _, _ = _data_fineweb_files()
    _data_server.files.update({**files, "encoder.json": served})
    out = tmp_path / "fw"
    rc = prepare_data.main(["fineweb_edu", "--shards", "2", "--out", str(out), "--base_url",
                            _data_server.url, "--retries", "0"])
    line = _data_one_error_line(capsys.readouterr().err)
    assert rc == 2 and "encoder.json" in line and "not GPT-2's encoder.json" in line
    assert not (out / "encoder.json").exists() and not (out / "meta.json").exists()


# -----------------------------------------------------------------------------
# command line: exit code 2, one line, no traceback

def test_data_cli_http_404_and_500(tmp_path, _data_server):
    r = _data_cli("text8", "--out", str(tmp_path / "a"), "--base_url", _data_server.url)
    assert r.returncode == 2 and "404" in _data_one_error_line(r.stderr)
    _data_server.status["text8.zip"] = 500
    r = _data_cli("text8", "--out", str(tmp_path / "b"), "--base_url", _data_server.url, "--retries", "2")
    line = _data_one_error_line(r.stderr)
    assert r.returncode == 2 and "HTTP 500" in line and "3 tries" in line
    assert [name for name, _ in _data_server.log].count("text8.zip") == 4  # one 404, three 500s
    assert not (tmp_path / "b" / "meta.json").exists()


def test_data_cli_bad_input_and_no_network(tmp_path):
    r = _data_cli("wikipedia")
    assert r.returncode == 2 and "unknown dataset 'wikipedia'" in _data_one_error_line(r.stderr)
    (tmp_path / "file").write_text("not a folder")
    r = _data_cli("demo", "--out", str(tmp_path / "file" / "demo"))
    assert r.returncode == 2 and "cannot write to output folder" in _data_one_error_line(r.stderr)
    r = _data_cli("demo", "--shards", "3", "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "--shards does not apply to demo" in _data_one_error_line(r.stderr)
    with socket.socket() as s:  # a port nobody listens on: like having no network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _data_cli("text8", "--out", str(tmp_path / "t"), "--retries", "1",
                  env={"NANOROUTE_BASE_URL": f"http://127.0.0.1:{port}"})
    line = _data_one_error_line(r.stderr)
    assert r.returncode == 2 and "failed after 2 tries" in line and "network" in line


def test_data_cli_base_url_env_and_help(tmp_path, _data_server):
    text, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    r = _data_cli("text8", "--out", str(tmp_path / "t8"), env={"NANOROUTE_BASE_URL": _data_server.url})
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and _data_server.log == [("text8.zip", None)]
    _data_check_text8(tmp_path / "t8", text, _data_server.url)
    r = _data_cli("--help")
    assert r.returncode == 0 and all(name in r.stdout for name in prepare_data.DATASETS)
    assert "NANOROUTE_BASE_URL" in r.stdout and "huggingface.co" in r.stdout


# -----------------------------------------------------------------------------
# download edges (issue 22): a longer partial file, another range, a truncated split, chunk boundaries

def test_data_partial_file_longer_than_the_remote_one_restarts(tmp_path, _data_server):
    text, zipped = _data_text8()
    _data_cut_text8(tmp_path / "t8", _data_server, zipped).write_bytes(zipped + b"stale tail")
    out = prepare_data.prepare("text8", tmp_path / "t8", base_url=_data_server.url, **_data_fast())
    assert _data_server.log == [("text8.zip", f"bytes={len(zipped) + 10}-"), ("text8.zip", None)]  # 416, then all
    _data_check_text8(out, text, _data_server.url)


def test_data_server_answering_another_range_restarts(tmp_path, _data_server, capsys):
    text, zipped = _data_text8()
    have = _data_cut_text8(tmp_path / "t8", _data_server, zipped).stat().st_size
    _data_server.wrong_range = True  # 206, but from byte 0: appending it would corrupt the file
    out = prepare_data.prepare("text8", tmp_path / "t8", base_url=_data_server.url, **_data_fast())
    assert _data_server.log == [("text8.zip", f"bytes={have}-"), ("text8.zip", None)]
    assert "another range than asked" in capsys.readouterr().out  # the retry line says why
    _data_check_text8(out, text, _data_server.url)


# each retry waits twice as long as the one before, at most 600 s (time.sleep is recorded, not slept)
def test_data_retry_wait_doubles_up_to_600_seconds(tmp_path, _data_server, monkeypatch, capsys):
    waits = []
    monkeypatch.setattr(prepare_data, "time", types.SimpleNamespace(sleep=waits.append))
    monkeypatch.setenv("NANOROUTE_RETRY_BACKOFF", "200")
    _data_server.status["text8.zip"] = 503
    args = ["text8", "--out", str(tmp_path / "t8"), "--base_url", _data_server.url, "--retries", "4"]
    assert prepare_data.main(args) == 2
    assert "failed after 5 tries (HTTP 503)" in _data_one_error_line(capsys.readouterr().err)
    assert waits == [200, 400, 600, 600]
    # an empty NANOROUTE_RETRY_BACKOFF (exported, blank) counts as unset: the default 1 s
    waits.clear()
    monkeypatch.setenv("NANOROUTE_RETRY_BACKOFF", "")
    assert prepare_data.main([*args[:-1], "1"]) == 2
    assert waits == [1.0]


# --base_url wins over $NANOROUTE_BASE_URL (a flag typed now over a setting made earlier)
def test_data_base_url_flag_wins_over_the_environment(tmp_path, _data_server, monkeypatch):
    text, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    monkeypatch.setenv("NANOROUTE_BASE_URL", _data_server.url + "/from_the_environment")  # 404 there
    args = ["text8", "--out", str(tmp_path / "t8"), "--base_url", _data_server.url, "--retries", "0"]
    assert prepare_data.main(args) == 0
    assert _data_server.log == [("text8.zip", None)]
    _data_check_text8(tmp_path / "t8", text, _data_server.url)


# issue 22: a resumed run must not count a split as done when its file was truncated (or grew)
@pytest.mark.parametrize("damage", ["truncated", "longer"])
def test_data_resume_redoes_a_damaged_finished_split(tmp_path, _data_server, monkeypatch, damage):
    text, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    out = tmp_path / "t8"
    _data_stopped_before_meta_json(monkeypatch, "text8", out, base_url=_data_server.url, **_data_fast())
    stamps = {s: (out / f"{s}.bin").stat().st_mtime_ns for s in ("val", "test")}
    with open(out / "train.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) + (-7 if damage == "truncated" else 7))
    prepare_data.prepare("text8", out, base_url=_data_server.url, **_data_fast())
    _data_check_text8(out, text, _data_server.url)  # train.bin made again, whole
    assert {s: (out / f"{s}.bin").stat().st_mtime_ns for s in ("val", "test")} == stamps  # the others kept


# the end-of-text marker is one symbol wherever a chunk boundary falls inside it (tinystories reads in CHUNKs)
def test_data_chunk_boundary_inside_the_end_of_text_marker(tmp_path, monkeypatch):
    eot = prepare_data.EOT
    text = "ab" + eot + "cd" + eot + "e<|f|>g<|end"  # '<', '|' outside the marker; it ends in part of one
    path = tmp_path / "train.txt"
    path.write_text(text, encoding="utf-8")
    chars = sorted(set(text.replace(eot, ""))) + [eot, "\ufffd"]
    lut = prepare_data._char_lut(chars, len(chars) - 1)
    want = [chars.index(c) for c in "ab"] + [len(chars) - 2] + [chars.index(c) for c in "cd"] + \
        [len(chars) - 2] + [chars.index(c) for c in "e<|f|>g<|end"]
    for cut in range(1, len(eot)):  # the first boundary falls `cut` characters into the first marker
        monkeypatch.setattr(prepare_data, "CHUNK", 2 + cut)
        pieces = list(prepare_data._read_chunks(path))
        assert "".join(pieces) == text and sum(p.count(eot) for p in pieces) == text.count(eot), cut
        ids = np.concatenate(list(prepare_data._encode_stream(path, lut, len(chars) - 2)))
        assert ids.tolist() == want, cut


# val/test cut at the first <|endoftext|> at or after the val shard's middle (8 here), else at the middle
@pytest.mark.parametrize("eot_at, cut", [(12, 12), (None, 8)])
def test_data_fineweb_cut_found_across_chunks(tmp_path, _data_server, monkeypatch, eot_at, cut):
    files, _, train = _data_fineweb_files()
    val = [50256] + list(range(1, 16))
    if eot_at:
        val[eot_at] = 50256
    files["finewebedu_val_000000.bin"] = _data_shard(val)
    _data_server.files.update(files)
    monkeypatch.setattr(prepare_data, "CHUNK", 3)  # the search reads [8:11], then [11:14]
    out = prepare_data.prepare("fineweb_edu", tmp_path / "fw", base_url=_data_server.url, shards=2,
                               **_data_fast())
    assert prepare_data.open_split(out, "val").tolist() == val[:cut]
    assert prepare_data.open_split(out, "test").tolist() == val[cut:]
    assert prepare_data.open_split(out, "train").tolist() == train[0] + train[1]  # shards read in chunks


# -----------------------------------------------------------------------------
# only what the project made is deleted or overwritten (issue 21)

def _data_foreign(folder):
    """A user's folder: files the project did not make, named like the ones it writes."""
    files = {"train.bin": b"my tokens", "progress.json": b'{"mine": 1}', "downloads/photo.jpg": b"jpeg",
             "notes.txt": b"notes"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def _data_unchanged(folder, files):
    assert {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("contents", ["user files", "downloads only", "another dataset"])
def test_data_a_folder_the_project_did_not_make_is_never_prepared_into(tmp_path, _data_server, capsys, contents):
    _, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    out = tmp_path / "x"
    if contents == "another dataset":
        prepare_data.prepare("demo", out, demo_mb=0.01)
    else:
        _data_foreign(out)
        if contents == "downloads only":
            for name in ("train.bin", "progress.json", "notes.txt"):
                (out / name).unlink()
    files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for name in ("text8",) if contents == "another dataset" else ("demo", "text8"):
        args = [name, "--out", str(out), "--base_url", _data_server.url, "--retries", "0"]
        assert prepare_data.main(args if name == "text8" else args[:3] + ["--demo_mb", "0.01"]) == 2, name
        line = _data_one_error_line(capsys.readouterr().err)
        want = "holds the demo dataset" if contents == "another dataset" else "not empty and holds no dataset"
        assert want in line and str(out) in line, line
        _data_unchanged(out, files)
    assert _data_server.log == []


# train.py prepares a missing demo itself (prepare_data.prepare("demo", DIR)), for a new run only: never
# into someone's folder, and --resume never prepares (neither into --data nor the checkpoint's folder)
@pytest.mark.parametrize("how", ["new run", "resume --data", "resume --data (missing)", "resume (recorded)"])
def test_train_does_not_prepare_the_demo_into_a_foreign_folder(_train_runs, _train_one_thread, tmp_path, capsys,
                                                               how):
    folder = tmp_path / "X" / "demo"
    files = _data_foreign(folder)  # a train.bin, a downloads/ and more of the user's
    run = tmp_path / "run"
    if how == "new run":
        argv = ["--data", folder, "--out_dir", run, *_TRAIN_TINY, "--max_iters", 1]
    else:
        shutil.copytree(_train_runs[0], run)
        argv = ["--out_dir", run, "--resume", "--max_iters", 5]
    if how == "resume (recorded)":  # the checkpoint's --data is that folder
        ckpt = torch.load(run / "last.pt", weights_only=True)
        ckpt["train_args"]["data"] = str(folder)
        torch.save(ckpt, run / "last.pt")
    elif how != "new run":
        argv += ["--data", tmp_path / "Y" / "demo" if how.endswith("(missing)") else folder]
    code, _, err = _train_main(train, argv, capsys)
    line = _data_one_error_line(err)
    assert code == 2 and not (tmp_path / "Y").exists()
    assert line.startswith({"new run": f"error: --data {folder}: {folder} is not empty and holds no dataset",
                            "resume --data": f"error: data folder {folder} is not a finished dataset",
                            "resume --data (missing)": f"error: data folder {tmp_path / 'Y' / 'demo'} does not exist",
                            "resume (recorded)": f"error: the data folder of the run in {run}: no prepared demo "
                                                 f"dataset at {folder}"}[how]), line
    _data_unchanged(folder, files)


@pytest.mark.parametrize("case", ["success", "failure"])
def test_data_clean_up_deletes_only_recorded_downloads(tmp_path, _data_server, capsys, case):
    """A user's files inside a folder the project made survive its clean-up after a finished run and
    after a failed one; the recorded download and its folder go (the folder only when emptied)."""
    text, zipped = _data_text8()
    out = tmp_path / "t8"
    _data_cut_text8(out, _data_server, zipped)
    mine = {"downloads/photo.jpg": b"jpeg", "notes.txt": b"notes"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    if case == "failure":
        _data_server.files["text8.zip"] = b"not a zip"  # the resumed download fails its check
        _data_server.ignore_range = True
    rc = prepare_data.main(["text8", "--out", str(out), "--base_url", _data_server.url, "--retries", "0"])
    assert rc == (0 if case == "success" else 2), capsys.readouterr().err
    left = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert set(mine) <= left and "downloads/text8.zip" not in left and "downloads/text8.zip.part" not in left
    if case == "success":
        _data_check_text8(out, text, _data_server.url)


def test_data_a_download_the_records_do_not_name_is_not_used_or_deleted(tmp_path, _data_server, capsys):
    _, zipped = _data_text8()
    out = tmp_path / "t8"
    _data_cut_text8(out, _data_server, zipped)
    progress = json.loads((out / "progress.json").read_text())
    progress["made"] = []  # as if the download under its name were someone else's
    (out / "progress.json").write_text(json.dumps(progress))
    files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    del files["progress.json"]
    assert prepare_data.main(["text8", "--out", str(out), "--base_url", _data_server.url]) == 2
    assert "was not downloaded by prepare_data.py" in _data_one_error_line(capsys.readouterr().err)
    assert json.loads((out / "progress.json").read_text()) == progress  # still recording none of them
    (out / "progress.json").unlink()
    _data_unchanged(out, files)
    assert _data_server.log == []


def test_data_records_name_nothing_outside_downloads(tmp_path, _data_server):
    """A forged "made" record cannot make clean-up delete anything but a download in downloads/."""
    text, zipped = _data_text8()
    out = tmp_path / "t8"
    _data_cut_text8(out, _data_server, zipped)
    progress = json.loads((out / "progress.json").read_text())
    forged = ["../outside.txt", "notes.txt", "downloads/../notes.txt", "downloads/.hidden", "/etc/hostname"]
    progress["made"] += forged
    (out / "progress.json").write_text(json.dumps(progress))
    for path in (tmp_path / "outside.txt", out / "notes.txt", out / "downloads" / ".hidden"):
        path.write_text("keep")
    prepare_data.prepare("text8", out, base_url=_data_server.url, **_data_fast())
    _data_check_text8(out, text, _data_server.url)
    assert all(p.read_text() == "keep" for p in (tmp_path / "outside.txt", out / "notes.txt",
                                                  out / "downloads" / ".hidden"))
    assert not (out / "downloads" / "text8.zip").exists()


def test_data_a_downloads_folder_that_is_a_link_is_refused(tmp_path, _data_server, capsys):
    _, zipped = _data_text8()
    out = tmp_path / "t8"
    _data_cut_text8(out, _data_server, zipped)
    (out / "downloads").rename(tmp_path / "elsewhere")
    (out / "downloads").symlink_to(tmp_path / "elsewhere")
    before = {p.name: p.read_bytes() for p in (tmp_path / "elsewhere").iterdir()}
    assert prepare_data.main(["text8", "--out", str(out), "--base_url", _data_server.url]) == 2
    assert "downloads is a symbolic link" in _data_one_error_line(capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in (tmp_path / "elsewhere").iterdir()} == before
    assert _data_server.log == []


# clean-up never deletes through a link planted at downloads/, whichever record names the downloads; a
# progress.json written before "made" was recorded lists nothing through the link (and so the run finishes)
@pytest.mark.parametrize("records", ["meta.json (--keep_downloads)", "progress.json", "progress.json before made"])
def test_data_clean_up_never_deletes_through_a_downloads_link(tmp_path, _data_server, monkeypatch, capsys,
                                                              records):
    text, zipped = _data_text8()
    _data_server.files["text8.zip"] = zipped
    out, elsewhere = tmp_path / "t8", tmp_path / "elsewhere"
    kw = dict(base_url=_data_server.url, **_data_fast())
    if records.startswith("meta.json"):
        prepare_data.prepare("text8", out, keep_downloads=True, **kw)
    else:  # every split written, the downloads deleted, meta.json not written
        _data_stopped_before_meta_json(monkeypatch, "text8", out, **kw)
    if records == "progress.json before made":
        progress = json.loads((out / "progress.json").read_text())
        del progress["made"]
        (out / "progress.json").write_text(json.dumps(progress))
    shutil.rmtree(out / "downloads", ignore_errors=True)
    elsewhere.mkdir()
    theirs = {"text8.zip": b"their copy", "photo.jpg": b"jpeg"}
    for name, data in theirs.items():
        (elsewhere / name).write_bytes(data)
    (out / "downloads").symlink_to(elsewhere)
    _data_server.log.clear()
    rc = prepare_data.main(["text8", "--out", str(out), "--base_url", _data_server.url])
    if records == "progress.json before made":
        assert rc == 0, capsys.readouterr().err
        _data_check_text8(out, text, _data_server.url)
    else:
        assert rc == 2 and "downloads is a symbolic link" in _data_one_error_line(capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == theirs and _data_server.log == []
    assert (out / "downloads").is_symlink()


def test_data_progress_json_of_the_wrong_types_starts_over(tmp_path, _data_server):
    train = "Once upon a time.<|endoftext|>Tom ran.<|endoftext|>"
    _data_server.files.update({"TinyStoriesV2-GPT4-train.txt": train.encode(),
                               "TinyStoriesV2-GPT4-valid.txt": b"Tom ran.<|endoftext|>"})
    out = tmp_path / "ts"
    out.mkdir()
    options = dict(v1=False, min_per_million=0.5)
    (out / "progress.json").write_text(json.dumps(dict(dataset="tinystories", options=options, made=[],
                                                       splits={}, chars=5, replaced=[], replaced_share=0.0)))
    prepare_data.prepare("tinystories", out, base_url=_data_server.url, **_data_fast())
    meta = prepare_data.load_meta(out)
    assert meta["chars"] == sorted(set(train.replace("<|endoftext|>", ""))) + ["<|endoftext|>", "\ufffd"]
    assert prepare_data.decoder(meta, out)(prepare_data.open_split(out, "val")) == "Tom ran.<|endoftext|>"


def test_data_a_failed_first_download_leaves_no_folder_and_says_each_retry(tmp_path, monkeypatch, capsys):
    """issue 24: no network: a line per retry (what failed, the wait, --base_url), a last line naming
    --base_url, and no empty data/NAME/downloads/, data/NAME/ or data/ left behind."""
    with socket.socket() as s:  # a port nobody listens on: like having no network
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NANOROUTE_RETRY_BACKOFF", "0.001")
    monkeypatch.setattr(prepare_data, "TEXT8_URL", refused + "/text8.zip")  # plays the official site
    (tmp_path / "empty").mkdir()
    for args, hint in ((["text8", "--retries", "2"], "from a mirror with --base_url URL"),
                       (["text8", "--base_url", refused + "/mirror", "--retries", "2", "--out", "empty"],
                        "the mirror given by --base_url")):
        assert prepare_data.main(args) == 2
        out, err = capsys.readouterr()
        retries = [line for line in out.splitlines() if line.startswith("text8.zip: ConnectionError")]
        assert len(retries) == 2 and all(hint in line for line in retries), out
        assert "try 2 of 3 in 0.001 s" in retries[0] and "try 3 of 3 in 0.002 s" in retries[1]
        line = _data_one_error_line(err)
        assert "failed after 3 tries" in line and hint in line and "re-run" in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["empty"]  # no data/; the user's folder stays
    # every official site's files (a folder URL and its files) get the official hint, a mirror's the other
    official = (prepare_data.TINYSTORIES_URL + "TinyStories-train.txt",
                prepare_data.FINEWEB_URL + "finewebedu_val_000000.bin", prepare_data.GPT2_URL + "encoder.json")
    assert all("from a mirror with --base_url URL" in prepare_data._mirror_hint(url) for url in official)
    assert "the mirror given by --base_url" in prepare_data._mirror_hint(refused + "/mirror/encoder.json")


def test_data_two_runs_preparing_one_folder_take_turns(tmp_path, capsys):
    """The train.py runs of a sweep may all prepare the demo at once: the second waits for the first
    (a lock on the folder), then finds it prepared, instead of deleting its files under it."""
    import fcntl
    out = tmp_path / "demo"
    out.mkdir()
    held = os.open(out, os.O_RDONLY)  # another run holds the folder
    fcntl.flock(held, fcntl.LOCK_EX)
    runs = concurrent.futures.ThreadPoolExecutor(1)
    second = runs.submit(prepare_data.prepare, "demo", out, demo_mb=0.01)
    printed = ""
    for _ in range(3000):  # until it says it waits, or it finishes without waiting
        printed += capsys.readouterr().out
        if "waiting for another run" in printed or second.done():
            break
        time.sleep(0.01)
    assert "waiting for another run preparing" in printed and not second.done()
    prepare_data.prepare("demo", tmp_path / "first", demo_mb=0.01)  # what the other run writes
    for name in ("train.bin", "val.bin", "test.bin", "meta.json"):
        shutil.copy(tmp_path / "first" / name, out / name)
    os.close(held)
    second.result(timeout=120)
    runs.shutdown()
    assert "is already prepared" in capsys.readouterr().out


def test_data_a_leftover_temporary_file_does_not_make_a_folder_foreign(tmp_path):
    """A run killed inside its first write leaves only a temporary file: the folder is still taken."""
    (tmp_path / "d").mkdir()
    leftover = tmp_path / "d" / "tmp0a1b2c3d.progress.json.tmp"
    leftover.write_bytes(b'{"dataset": "de')
    out = prepare_data.prepare("demo", tmp_path / "d", demo_mb=0.01)
    assert prepare_data.load_meta(out)["dataset"] == "demo" and leftover.read_bytes() == b'{"dataset": "de'


# -----------------------------------------------------------------------------
# no write follows a link (issue 21): for every kind of file prepare_data writes

@pytest.fixture
def _data_victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    yield victim
    assert victim.read_bytes() == b"precious"  # whatever the test did, the link's target is untouched


def _data_plant(victim, folder, names):
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(victim)


def _data_predictable_temp_names(monkeypatch):
    """The random part of write_atomic's temporary names cycles through 00000000, 00000001, 00000002:
    with links planted at the first two, every write meets two taken names before a free one."""
    real, counter = os.urandom, itertools.cycle(range(3))
    monkeypatch.setattr(prepare_data.os, "urandom", lambda n: next(counter).to_bytes(4, "big") if n == 4 else real(n))


def _data_taken_temp_names(names):
    return [f"tmp{i:08x}.{n}.tmp" for i in range(2) for n in names] + [n + ".tmp" for n in names]  # and the old ones


@pytest.mark.parametrize("where", ["splits and temporary names", "meta.json", "progress.json"])
def test_data_planted_links_at_every_name_a_dataset_is_written_to(tmp_path, monkeypatch, capsys, _data_victim,
                                                                   where):
    """Links at the temporary names are skipped, a link at a final name is replaced by a real file, and
    a link where the records should be (progress.json) stops the run with one line."""
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.01)
    written = ["train.bin", "val.bin", "test.bin", "meta.json", "progress.json"]
    _data_predictable_temp_names(monkeypatch)
    if where == "splits and temporary names":
        links = written[:3] + _data_taken_temp_names(written)
    else:
        links = [where]
    if where == "meta.json":  # an unfinished folder: progress.json is the record
        (out / "progress.json").write_text(json.dumps(dict(dataset="demo", options={}, splits={}, made=[])))
    _data_plant(_data_victim, out, links)
    rc = prepare_data.main(["demo", "--out", str(out), "--demo_mb", "0.02"])  # other options: written again
    if where == "progress.json":
        assert rc == 2 and "progress.json was not written by prepare_data.py" in _data_one_error_line(
            capsys.readouterr().err)
        assert (out / "progress.json").is_symlink()
        return
    assert rc == 0, capsys.readouterr().err
    assert prepare_data.load_meta(out)["options"]["demo_mb"] == 0.02
    for name in written[:4]:
        assert (out / name).is_file() and not (out / name).is_symlink(), name  # a real file replaced the link
    assert all((out / n).is_symlink() for n in links if n not in written)  # taken: skipped, not followed
    assert len(prepare_data.open_split(out, "train")) > 10000


def test_data_planted_link_at_checked_json(tmp_path, monkeypatch, _data_victim):
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.01)
    _data_predictable_temp_names(monkeypatch)
    _data_plant(_data_victim, out, ["checked.json"] + _data_taken_temp_names(["checked.json"]))
    meta = prepare_data.load_meta(out)
    cache = prepare_data.check_tokens(out, meta, meta["splits"])
    assert not (out / "checked.json").is_symlink() and json.loads((out / "checked.json").read_text()) == cache


@pytest.mark.parametrize("where", ["part", "download", "encoder.json"])
def test_data_planted_links_at_download_names(tmp_path, _data_server, capsys, _data_victim, where):
    """A link at NAME.part stops the run with one line; a link at a download's final name is not a
    download (it fails its check): it is replaced by the real file, its target untouched."""
    files, _, train = _data_fineweb_files()
    _data_server.files.update(files)
    out = tmp_path / "fw"
    _data_server.status["finewebedu_train_000002.bin"] = 404  # a first run stops after shard 1
    args = ["fineweb_edu", "--shards", "2", "--out", str(out), "--base_url", _data_server.url, "--retries", "0"]
    assert prepare_data.main(args) == 2
    assert "HTTP 404" in _data_one_error_line(capsys.readouterr().err)
    del _data_server.status["finewebedu_train_000002.bin"]
    assert "downloads/finewebedu_train_000002.bin" in json.loads((out / "progress.json").read_text())["made"]
    name = {"part": "downloads/finewebedu_train_000002.bin.part", "download": "downloads/finewebedu_train_000001.bin",
            "encoder.json": "encoder.json"}[where]
    _data_plant(_data_victim, out, [name])
    rc = prepare_data.main(args)
    if where == "part":
        assert rc == 2 and "is a symbolic link" in _data_one_error_line(capsys.readouterr().err)
        assert (out / name).is_symlink()
        (out / name).unlink()
        assert prepare_data.main(args) == 0
    else:
        assert rc == 0 and "is damaged" in capsys.readouterr().out
        assert not (out / name).is_symlink()
    assert prepare_data.open_split(out, "train").tolist() == train[0] + train[1]


# Ctrl-C in the middle of a write leaves neither the file nor its temporary file
def test_write_atomic_interrupted_leaves_no_temporary_file(tmp_path):
    def interrupted(f):
        f.write(b"half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prepare_data.write_atomic(tmp_path / "x.bin", interrupted)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_write_atomic_makes_an_ordinary_file_and_leaves_no_temporary_file(tmp_path, umask):
    old = os.umask(umask)
    try:
        prepare_data.write_atomic(tmp_path / "a.json", lambda f: f.write(b"{}"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask

    def fails(f):
        f.write(b"half")
        raise ValueError("the writer failed")
    with pytest.raises(ValueError, match="the writer failed"):
        prepare_data.write_atomic(tmp_path / "a.json", fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"] and (tmp_path / "a.json").read_bytes() == b"{}"


# -----------------------------------------------------------------------------
# every input checked where it enters (issue 21): one line, exit 2, nothing written

@pytest.mark.parametrize("argv, env, message", [
    (["demo", "--demo_mb", "nan"], {}, "--demo_mb nan: must be a number from 0.001 to 100"),
    (["demo", "--demo_mb", "inf"], {}, "--demo_mb inf: must be a number"),
    (["demo", "--demo_mb", "1e9"], {}, "--demo_mb 1000000000.0: must be a number from 0.001 to 100"),
    (["demo", "--demo_mb", "0"], {}, "--demo_mb 0.0: must be"),
    (["demo", "--seed", "-1"], {}, "--seed -1: must be an integer from 0"),
    (["text8", "--retries", "-1"], {}, "--retries -1: must be an integer from 0 to 100"),
    (["text8", "--retries", "1000000"], {}, "--retries 1000000: must be an integer from 0 to 100"),
    (["fineweb_edu", "--shards", "0"], {}, "--shards 0: must be an integer from 1 to 99"),
    (["fineweb_edu", "--shards", "100"], {}, "--shards 100: must be an integer from 1 to 99"),
    (["tinystories", "--min_per_million", "nan"], {}, "--min_per_million nan: must be a number"),
    (["tinystories", "--min_per_million", "-1"], {}, "--min_per_million -1.0: must be a number from 0"),
    (["text8"], {"NANOROUTE_RETRY_BACKOFF": "abc"}, "NANOROUTE_RETRY_BACKOFF=abc: must be a number of seconds"),
    (["text8"], {"NANOROUTE_RETRY_BACKOFF": "-1"}, "NANOROUTE_RETRY_BACKOFF=-1: must be a number of seconds"),
    (["text8"], {"NANOROUTE_RETRY_BACKOFF": "nan"}, "NANOROUTE_RETRY_BACKOFF=nan: must be"),
    (["text8"], {"NANOROUTE_RETRY_BACKOFF": "inf"}, "NANOROUTE_RETRY_BACKOFF=inf: must be"),
    (["text8"], {"NANOROUTE_BASE_URL": "ftp://mirror"}, "must start with http:// or https://"),
])
def test_data_bad_numbers_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, argv, env,
                                                                  message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(prepare_data, "writable_folder", _data_tripwire)  # a value let through stops here
    assert prepare_data.main(argv + ["--out", str(tmp_path / "d")]) == 2
    assert message in _data_one_error_line(capsys.readouterr().err)


def _data_tripwire(*args):
    raise AssertionError("a bad value was let through: preparing would start now (--demo_mb inf never ends)")


@pytest.mark.parametrize("option", [dict(demo_mb="2"), dict(seed=1.5), dict(seed=True), dict(demo_mb=10 ** 400),
                                    dict(keep_downloads="yes"), dict(retries=2.0)])
def test_data_api_options_of_the_wrong_type_are_refused(tmp_path, monkeypatch, option):
    monkeypatch.setattr(prepare_data, "writable_folder", _data_tripwire)
    with pytest.raises(prepare_data.UsageError, match=f"--{next(iter(option))}"):
        prepare_data.prepare("demo", tmp_path / "d", **option)


@pytest.mark.parametrize("field, value, words", [
    ("vocab_size", "53", 'field "vocab_size" must be an integer'), ("vocab_size", True, '"vocab_size"'),
    ("vocab_size", 70000, '"vocab_size" must be an integer from 1 to 65536'),
    ("splits", [1, 2], 'field "splits" must be the token count of each split'),
    ("splits", {"train": -5}, '"splits"'), ("splits", {"train": "9"}, '"splits"'),
    ("splits", {"other": 9}, '"splits"'), ("chars", "ids", 'field "chars" must list'),
    ("dtype", 8, 'field "dtype" must be "uint8" or "uint16"'), ("level", ["char"], 'field "level"'),
    ("format_version", "1", 'field "format_version" must be 1'), ("format_version", True, '"format_version"'),
    ("dataset", 5, 'field "dataset" must be a dataset name'), ("options", [1], 'field "options"'),
    ("replaced", 5, 'field "replaced"'), ("source", None, 'field "source"'), ("made", "downloads", '"made"'),
    (None, None, "it holds a JSON list, not an object"), ("splits", "delete", 'field "splits" is missing'),
])
def test_data_meta_json_of_the_wrong_types_is_one_line_naming_the_field(tmp_path, field, value, words):
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.01)
    meta = json.loads((out / "meta.json").read_text())
    if field is None:
        meta = [meta]
    elif value == "delete":
        del meta[field]
    elif value == "ids":  # integers, as many as vocab_size says
        meta[field] = list(range(meta["vocab_size"]))
    else:
        meta[field] = value
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(prepare_data.UsageError) as e:
        prepare_data.load_meta(out)
    assert str(out / "meta.json") in str(e.value) and words in str(e.value)
    ours = field not in (None, "dataset")  # the records still name the demo: prepare() takes the folder back
    fix = "prepare it again: " if ours else f"if {out} holds nothing else of value, delete it and run: "
    assert fix + f"python prepare_data.py demo --out {out}" in str(e.value)
    if not ours:
        shutil.rmtree(out)
    prepare_data.prepare("demo", out, demo_mb=0.01)  # the command it names repairs the folder
    assert prepare_data.load_meta(out)["vocab_size"] == len(prepare_data.load_meta(out)["chars"])


def test_data_damaged_encoder_json_is_one_line(tmp_path):
    meta = dict(level="gpt2", vocab_size=prepare_data.GPT2_VOCAB)
    eot = '"<|endoftext|>": 50256'
    for damage in (b"\xff\xfe not json", b"[1, 2]", b'{"a": 1}', '{%s, "a": "1"}' % eot,  # no EOT; an id a string
                   '{%s, "\\u0100\\u3042": 5}' % eot,  # a character that is no byte of GPT-2's table
                   '{"<|endoftext|>": 7}', '{%s, "a": -1}' % eot):  # EOT at another id; an id below 0
        (tmp_path / "encoder.json").write_bytes(damage if isinstance(damage, bytes) else damage.encode())
        with pytest.raises(prepare_data.UsageError, match="is not GPT-2's encoder.json"):
            prepare_data.decoder(meta, tmp_path)
        with pytest.raises(prepare_data.UsageError, match="is not GPT-2's encoder.json"):
            prepare_data.encoder(meta, tmp_path)  # sample.py's prompt (with or without tiktoken)


# checked.json: a train.bin replaced by another file with the same size and modification time (cp -p,
# rsync -t) is scanned again, not trusted
@pytest.mark.parametrize("how", ["in place, like cp -p", "a new file renamed over it, like rsync -t"])
def test_data_check_cache_is_not_fooled_by_an_equal_size_and_mtime(tmp_path, how):
    out = prepare_data.prepare("demo", tmp_path / "demo", demo_mb=0.2)
    meta = prepare_data.load_meta(out)
    assert prepare_data.check_tokens(out, meta, meta["splits"])["train"]["max_id"] < meta["vocab_size"]
    path = out / "train.bin"
    stat, raw = path.stat(), bytearray(path.read_bytes())
    if how.startswith("in place"):
        raw[10] = meta["vocab_size"]  # an id out of range, where the cheap hash reads
        path.write_bytes(bytes(raw))
    else:
        assert 65536 < len(raw) // 2 < len(raw) - 65536  # between the hashed head and tail
        raw[len(raw) // 2] = meta["vocab_size"]  # so only the inode (and change time) tell the files apart
        (out / "copy").write_bytes(bytes(raw))
        os.replace(out / "copy", path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same size and mtime as when cached
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    with pytest.raises(prepare_data.UsageError, match=f"holds token id {meta['vocab_size']}"):
        prepare_data.check_tokens(out, meta, meta["splits"])


# issue 20: training and sampling import only torch and numpy; requests, urllib3 and tqdm only download
def test_training_and_sampling_import_without_the_download_packages(tmp_path):
    code = f"""
import sys
BLOCKED = ("requests", "urllib3", "tqdm")
sys.modules.update(dict.fromkeys(BLOCKED))  # as if not installed: import raises ImportError
sys.path.insert(0, {str(Path(train.__file__).parent)!r})
import train, sample, prepare_data
try:
    train.main(["--data", {str(tmp_path / "demo")!r}, "--out_dir", {str(tmp_path / "run")!r},
                *{_TRAIN_TINY!r}, "--max_iters", "1"])
except SystemExit as e:
    assert not e.code, e.code
assert prepare_data.load_meta({str(tmp_path / "demo")!r})["dataset"] == "demo"
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m]))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0 and "loaded: []" in r.stdout, r.stderr[-3000:]
    assert (tmp_path / "run" / "last.pt").exists()


# -----------------------------------------------------------------------------
# Training and sampling: train.py and sample.py end to end on tiny models

_TRAIN_ROOT = Path(__file__).resolve().parent
# 2 layers x 32 wide, 32-token crops, 8 per batch: a step takes milliseconds
_TRAIN_TINY = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--sequence_len", "32", "--batch_size", "8",
               "--eval_tokens", "256", "--log_interval", "1", "--warmup_iters", "2", "--device", "cpu"]
_TRAIN_ROUTED = ["--residual", "attnres", "--rd", "decoupled", "--wav", "True", "--attnres_block", "4"]


@pytest.fixture(scope="module")
def _train_data(tmp_path_factory):
    """A 0.2M-character demo corpus, and a copy whose vocabulary has one extra symbol."""
    root = tmp_path_factory.mktemp("train_data")
    demo = prepare_data.prepare("demo", root / "demo", demo_mb=0.2)
    other = root / "other_vocab"
    shutil.copytree(demo, other)
    meta = json.loads((other / "meta.json").read_text())
    meta.update(chars=meta["chars"] + ["@"], vocab_size=meta["vocab_size"] + 1)
    (other / "meta.json").write_text(json.dumps(meta))
    return demo, other


@pytest.fixture
def _train_one_thread():
    """One intra-op thread: on a small shared machine, two threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _train_main(module, argv, capsys=None):
    """Run train.main / sample.main in this process; returns (exit code, stdout, stderr)."""
    try:
        module.main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr() if capsys else ("", "")
    return code, out, err


def _train_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def _train_env():
    """The scripts importable from any folder; a PYTHONPATH already set (tools/coverage.sh's hook) is kept."""
    path = os.pathsep.join(p for p in (str(_TRAIN_ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


@pytest.fixture(scope="module")
def _train_runs(_train_data, tmp_path_factory):
    """Two finished tiny runs: a routed one (attnres + WAV + RD) with milestones, and a prenorm one."""
    demo, _ = _train_data
    root = tmp_path_factory.mktemp("train_runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    routed, prenorm = root / "routed", root / "prenorm"
    try:
        assert _train_main(train, ["--data", demo, "--out_dir", routed, *_TRAIN_TINY, *_TRAIN_ROUTED,
                                   "--max_iters", 4, "--eval_interval", 2, "--milestones", "512,1K"])[0] == 0
        assert _train_main(train, ["--data", demo, "--out_dir", prenorm, *_TRAIN_TINY, "--residual", "prenorm",
                                   "--max_iters", 1])[0] == 0
    finally:
        torch.set_num_threads(threads)
    return routed, prenorm


# -----------------------------------------------------------------------------
# train.py


def test_train_writes_checkpoints_metrics_and_summary(_train_runs):
    routed, _ = _train_runs
    assert sorted(p.name for p in routed.iterdir()) == ["best.pt", "last.pt", "metrics.jsonl", "summary.json"]
    lines = _train_metrics(routed)
    train_lines = [r for r in lines if r["type"] == "train"]
    evals = [r for r in lines if r["type"] == "eval"]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    assert set(train_lines[0]) == {"type", "step", "tokens", "loss", "lr", "tok_per_s", "ms_per_step", "mfu"}
    assert train_lines[-1]["tokens"] == 4 * 8 * 32 and train_lines[0]["mfu"] is None
    assert set(evals[0]) == {"type", "step", "tokens", "train_loss", "val_loss", "val_bpc", "lr", "elapsed_s",
                             "milestone", "routes"}
    assert [e["milestone"] for e in evals] == [None, "512", "1K"]  # 256 tokens per step
    for e in evals:
        assert e["val_bpc"] == pytest.approx(e["val_loss"] / math.log(2))
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    routes = evals[-1]["routes"]
    assert set(routes) == {"entropy", "entropy_norm", "js", "js_mean"} and set(routes["js"]) == {"layer1"}  # not layer 0
    assert {"layer0.attn", "layer0.attn.v", "layer1.mlp", "readout"} <= set(routes["entropy"])
    assert routes["entropy_norm"]["layer0.attn"] is None  # one source: nothing to normalise by
    assert 0 < routes["entropy_norm"]["readout"] <= 1

    summary = json.loads((routed / "summary.json").read_text())
    assert set(summary) == {"config", "train", "final", "best_val_loss", "step", "tokens_seen", "wall_time_s",
                            "milestones", "routes", "dataset", "level"}
    assert summary["config"]["rd"] == "decoupled" and summary["train"]["max_iters"] == 4
    assert summary["final"]["val_loss"] == evals[-1]["val_loss"] and summary["final"]["test_loss"] > 0
    assert summary["final"]["test_bpc"] == pytest.approx(summary["final"]["test_loss"] / math.log(2))
    assert set(summary["milestones"]) == {"512", "1K"} and summary["milestones"]["1K"]["step"] == 4
    assert summary["step"] == 4 and summary["tokens_seen"] == 1024 and summary["dataset"] == "demo"

    ckpt = torch.load(routed / "last.pt", weights_only=True)  # plain tensors and Python types only
    assert ckpt["step"] == 4 and ckpt["config"] == summary["config"] and ckpt["meta"]["level"] == "char"
    meta = prepare_data.load_meta(summary["train"]["data"])  # the dataset's identity, for --resume and sample.py
    assert ckpt["meta"] == {k: meta[k] for k in ("dataset", "level", "vocab_size", "chars")}
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    best = torch.load(routed / "best.pt", weights_only=True)
    assert best["best_val_loss"] == min(e["val_loss"] for e in evals)


# train lines come every --log_interval steps, and at step 1 (docs/training.md)
def test_train_lines_every_log_interval_steps_and_at_step_1(_train_data, _train_one_thread, tmp_path, capsys):
    demo, _ = _train_data
    argv = _train_tiny_run(demo, tmp_path, "--max_iters", 5, "--log_interval", 2, "--eval_interval", 10)
    code, text, err = _train_main(train, argv, capsys)
    assert code == 0, err
    assert [r["step"] for r in _train_metrics(tmp_path) if r["type"] == "train"] == [1, 2, 4]
    assert [line.split(" |")[0] for line in text.splitlines() if line.startswith("step ")] == [
        "step 1", "step 2", "step 4"]


def test_resume_is_bitwise_exact(_train_data, _train_one_thread, tmp_path, capsys):
    """N steps in one go == N/2 steps, stop, --resume to N: every weight and optimizer state equal
    (dropout on, so the RNG state must be restored too; grad_accum 2), and the milestones reached
    before the stop are kept."""
    demo, _ = _train_data
    flags = ["--data", demo, *_TRAIN_TINY, *_TRAIN_ROUTED, "--dropout", 0.1, "--grad_accum", 2, "--max_iters", 6,
             "--eval_interval", 4, "--milestones", "1K", "--dtype", "float32"]  # 512 tokens per step
    assert _train_main(train, [*flags, "--out_dir", tmp_path / "a"])[0] == 0
    code, text, _ = _train_main(train, [*flags, "--out_dir", tmp_path / "b", "--stop_after", 3],
                                capsys)
    assert code == 0 and torch.load(tmp_path / "b" / "last.pt", weights_only=True)["step"] == 3
    assert not (tmp_path / "b" / "summary.json").exists()
    # the line --stop_after prints is the whole command that continues the run: run as printed. It
    # repeats --device and --dtype, which --resume does not take from last.pt
    resume = shlex.split(text.split("(--stop_after); continue with: ")[1].splitlines()[0])
    assert resume == ["python", "train.py", "--out_dir", str(tmp_path / "b"), "--resume",
                      "--device", "cpu", "--dtype", "float32"]
    assert _train_main(train, resume[2:], capsys)[0] == 0
    a, b = (torch.load(tmp_path / d / "last.pt", weights_only=True) for d in "ab")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [r["step"] for r in _train_metrics(tmp_path / "b") if r["type"] == "train"] == [1, 2, 3, 4, 5, 6]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert sa["final"] == sb["final"]
    assert sa["milestones"] == sb["milestones"] and sb["milestones"]["1K"]["step"] == 2  # before the stop


# a given --max_iters beats the checkpoint's --max_tokens on --resume: it extends the schedule
# (docs/training.md); and --stop_after at the last step just finishes the run
def test_resume_with_max_iters_extends_a_token_budget(_train_data, _train_one_thread, tmp_path, capsys):
    demo, _ = _train_data
    # 256 tokens a step: 300 tokens are 2 steps, and --stop_after 2 is the last step
    argv = _train_tiny_run(demo, tmp_path, "--max_tokens", 300, "--stop_after", 2)
    code, text, err = _train_main(train, argv, capsys)
    assert code == 0, err
    assert "done: 2 steps, 512 tokens" in text and "stopped after" not in text
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 2
    code, text, err = _train_main(train, ["--out_dir", tmp_path, "--resume", "--max_iters", 3], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 3 and summary["train"]["max_iters"] == 3
    assert summary["train"]["max_tokens"] is None


def test_same_seed_runs_are_paired_across_routing_variants(_train_data, _train_one_thread, tmp_path):
    """rd=tied is exactly Block AttnRes, so with the same seed (same init, same batches) every logged
    loss is equal; rd=decoupled starts equal (zero V query) and then moves away."""
    demo, _ = _train_data
    losses = {}
    for rd in ("off", "tied", "decoupled"):
        argv = ["--data", demo, "--out_dir", tmp_path / rd, *_TRAIN_TINY, "--residual", "attnres", "--rd", rd,
                "--max_iters", 3, "--eval_interval", 10, "--lr", 1e-2, "--warmup_iters", 0]
        assert _train_main(train, argv)[0] == 0
        losses[rd] = [r["loss"] for r in _train_metrics(tmp_path / rd) if r["type"] == "train"]
    assert losses["off"] == losses["tied"]
    assert losses["decoupled"][0] == losses["off"][0] and losses["decoupled"][1:] != losses["off"][1:]


def test_batches_depend_only_on_seed_and_step_and_shard_over_processes():
    rows = train.batch_offsets(7, 3, 1, 10_000, 32, 8)
    assert (rows == train.batch_offsets(7, 3, 1, 10_000, 32, 8)).all()
    assert not (rows == train.batch_offsets(7, 4, 1, 10_000, 32, 8)).all()
    assert sorted(list(rows[0::2]) + list(rows[1::2])) == sorted(rows)  # 2 processes see the global batch
    assert rows.min() >= 0 and rows.max() <= 10_000 - 33


def test_schedule_and_token_counts():
    a = train.argparse.Namespace(lr=1.0, min_lr=None, warmup_iters=10)
    assert train.get_lr(0, a, 100) == pytest.approx(0.1) and train.get_lr(9, a, 100) == pytest.approx(1.0)
    assert train.get_lr(10, a, 100) == pytest.approx(1.0) and train.get_lr(99, a, 100) == pytest.approx(0.1)
    assert [train.count(t) for t in ("0.25B", "2B", "500M", "64K", "1000")] == [
        250_000_000, 2_000_000_000, 500_000_000, 64_000, 1000]


# --max_tokens: steps = ceil(tokens / tokens per step); a given --max_iters beats a preset's budget
def test_max_tokens_rounds_the_steps_up_and_a_given_max_iters_beats_a_preset_budget():
    for tokens, steps in (("5000", 2), ("4096", 1), ("100", 1)):  # 16 x 256 = 4,096 tokens per step
        a, _ = _train_settings(["--max_tokens", tokens])
        assert a.max_iters == steps, tokens
    a, _ = _train_settings(["--preset", "rd_s", "--max_iters", "5"])  # rd_s: a 2B-token budget
    assert a.max_iters == 5 and a.max_tokens is None


def _train_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_match_one(_train_data, _train_one_thread, tmp_path):
    """torchrun --nproc_per_node=2 (gloo): each process takes half of every batch, so the losses and
    final weights equal the single-process run with the same flags (up to float rounding)."""
    demo, _ = _train_data
    flags = ["--data", demo, *_TRAIN_TINY, *_TRAIN_ROUTED, "--grad_accum", 2, "--max_iters", 3,
             "--eval_interval", 10]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_train_free_port()}",
           str(_TRAIN_ROOT / "train.py"), "--", *map(str, flags), "--out_dir", str(tmp_path / "ddp")]
    run = subprocess.run(cmd, capture_output=True, text=True, env=_train_env(), timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert _train_main(train, [*flags, "--out_dir", tmp_path / "one"])[0] == 0
    one, ddp = (_train_metrics(tmp_path / d) for d in ("one", "ddp"))
    assert [r["type"] for r in one] == [r["type"] for r in ddp]  # rank 0 alone writes the log
    for r1, r2 in zip(one, ddp):
        for key in ("loss", "train_loss", "val_loss"):
            if key in r1:
                assert r2[key] == pytest.approx(r1[key], abs=1e-5)
    w1, w2 = (torch.load(tmp_path / d / "last.pt", weights_only=True)["model"] for d in ("one", "ddp"))
    assert all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)


def test_divergence_stops_and_keeps_the_last_good_checkpoint(_train_data, _train_one_thread, tmp_path, capsys):
    """A real divergence: resume a healthy run with lr 1e30; the loss turns non-finite within steps."""
    demo, _ = _train_data
    out = tmp_path / "run"
    assert _train_main(train, ["--data", demo, "--out_dir", out, *_TRAIN_TINY, "--max_iters", 4,
                               "--eval_interval", 2])[0] == 0
    good = {name: (out / name).read_bytes() for name in ("last.pt", "best.pt")}
    capsys.readouterr()
    code, _, err = _train_main(train, ["--out_dir", out, "--resume", "--max_iters", 40, "--lr", 1e30,
                                       "--warmup_iters", 0], capsys)
    assert code == 2 and "error: non-finite" in err and f"last good checkpoint kept at {out / 'last.pt'}" in err
    assert {name: (out / name).read_bytes() for name in good} == good
    assert not list(out.glob("*.tmp"))


# issue 12: faults while training lose nothing, and each ends in one clear line
class _TrainCrash(BaseException):
    """Stands for the process dying at an injected point (nothing below it catches a BaseException)."""


def _train_tiny_run(demo, out, *extra):
    return ["--data", demo, "--out_dir", out, *_TRAIN_TINY, "--residual", "attnres", "--attnres_block", "2", *extra]


def test_full_disk_while_saving_keeps_the_checkpoints_and_resume_works(_train_data, _train_one_thread, tmp_path,
                                                                       monkeypatch, capsys):
    demo, _ = _train_data
    out = tmp_path / "run"
    assert _train_main(train, _train_tiny_run(demo, out, "--max_iters", 4, "--eval_interval", 2,
                                              "--stop_after", 2))[0] == 0
    good = {name: (out / name).read_bytes() for name in ("last.pt", "best.pt")}
    real, written = prepare_data._write, []

    def full_disk(f, data):  # the disk fills up a few writes into the next checkpoint
        if f.name.endswith(".pt.tmp"):
            written.append(len(data))
            if len(written) > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, data)
    monkeypatch.setattr(prepare_data, "_write", full_disk)
    capsys.readouterr()
    code, _, err = _train_main(train, ["--out_dir", out, "--resume"], capsys)
    assert code == 2 and len(written) == 4, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: saving a checkpoint in")
    assert "No space left on device; free some disk space" in err and "continue with --resume" in err
    assert {name: (out / name).read_bytes() for name in good} == good  # the previous checkpoints, whole
    assert not list(out.glob("*.tmp")) and not (out / "train.lock").exists()
    monkeypatch.setattr(prepare_data, "_write", real)  # space freed: the same --resume finishes the run
    assert _train_main(train, ["--out_dir", out, "--resume"], capsys)[0] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 4
    assert summary["best_val_loss"] == torch.load(out / "best.pt", weights_only=True)["best_val_loss"]


def test_crash_between_the_checkpoint_renames_keeps_best_pt_and_summary_agreeing(_train_data, _train_one_thread,
                                                                                 tmp_path, monkeypatch):
    """The process dies between the two renames of an improved checkpoint (step 2). The resumed run
    ends at step 2 with --lr 0, so nothing improves after the crash: summary.json's best must still be
    the model best.pt holds."""
    demo, _ = _train_data
    out, real, renamed = tmp_path / "run", os.replace, []

    def replace(src, dst):
        if str(dst).endswith(".pt"):
            renamed.append(Path(dst).name)
            if len(renamed) == 4:  # 1-2: step 0 (best.pt, last.pt), 3-4: step 2
                raise _TrainCrash
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_TrainCrash):
        _train_main(train, _train_tiny_run(demo, out, "--max_iters", 4, "--eval_interval", 2))
    monkeypatch.setattr(os, "replace", real)
    evals = [r for r in _train_metrics(out) if r["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2] and evals[1]["val_loss"] < evals[0]["val_loss"]  # step 2 improved
    assert not list(out.glob("*.tmp"))
    assert _train_main(train, ["--out_dir", out, "--resume", "--max_iters", 2, "--lr", 0])[0] == 0
    summary = json.loads((out / "summary.json").read_text())
    best = torch.load(out / "best.pt", weights_only=True)
    assert summary["best_val_loss"] == best["best_val_loss"] == evals[1]["val_loss"]


def test_metrics_resume_from_step_0_no_duplicates_atomic_rewrite_and_damaged_bytes(_train_data, _train_one_thread,
                                                                                  tmp_path, monkeypatch, capsys):
    demo, _ = _train_data
    out, real_offsets, real_write = tmp_path / "run", train.batch_offsets, prepare_data._write

    def dies(*args):
        raise _TrainCrash
    monkeypatch.setattr(train, "batch_offsets", dies)  # killed in step 1: last.pt is the step-0 checkpoint
    with pytest.raises(_TrainCrash):
        _train_main(train, _train_tiny_run(demo, out, "--max_iters", 2, "--eval_interval", 2))
    monkeypatch.setattr(train, "batch_offsets", real_offsets)
    with open(out / "metrics.jsonl", "ab") as f:  # damaged bytes, then a line cut by the kill
        f.write(b'{"type": "train", "step": 0, "note": "\xff\xfe"}\n{"type": "tra')
    before = (out / "metrics.jsonl").read_bytes()

    def killed_in_rewrite(f, data):
        if f.name.endswith("metrics.jsonl.tmp"):
            real_write(f, data[:10])
            raise _TrainCrash
        return real_write(f, data)
    monkeypatch.setattr(prepare_data, "_write", killed_in_rewrite)
    with pytest.raises(_TrainCrash):
        _train_main(train, ["--out_dir", out, "--resume"])
    assert (out / "metrics.jsonl").read_bytes() == before and not list(out.glob("*.tmp"))
    monkeypatch.setattr(prepare_data, "_write", real_write)
    capsys.readouterr()
    code, stdout, err = _train_main(train, ["--out_dir", out, "--resume"], capsys)
    assert code == 0, err
    assert f"note: dropped 2 line(s) of {out / 'metrics.jsonl'} that do not parse" in stdout
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(set(lines)) == len(lines)
    assert [(r["type"], r["step"]) for r in map(json.loads, lines)] == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]


def test_a_lock_of_another_users_live_process_is_not_taken_over(monkeypatch):
    # os.kill(pid, 0) answers PermissionError for a live process of another user (root here gets no
    # such answer, so the kernel's answer is stood in for): alive, its lock is not stale
    assert train.process_alive(os.getpid())
    for error, alive in ((PermissionError, True), (ProcessLookupError, False)):
        def kill(pid, signum, error=error):
            raise error(pid)
        monkeypatch.setattr(train.os, "kill", kill)
        assert train.process_alive(12345) is alive, error


def test_out_dir_lock_is_held_during_the_run_and_a_stale_one_is_taken_over(_train_data, _train_one_thread, tmp_path,
                                                                           monkeypatch, capsys):
    demo, _ = _train_data
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / "train.lock").write_text(gone.stdout)  # left by a process that was killed
    real, seen = train.get_batch, []

    def get_batch(*args):
        seen.append((out / "train.lock").read_text().strip())
        return real(*args)
    monkeypatch.setattr(train, "get_batch", get_batch)
    code, stdout, err = _train_main(train, _train_tiny_run(demo, out, "--max_iters", 1), capsys)
    assert code == 0, err
    assert f"note: taking over {out / 'train.lock'} from process {gone.stdout.strip()}, which no longer runs" in stdout
    assert set(seen) == {str(os.getpid())}  # held by this run while it trains
    assert not list(out.glob("train.lock*"))  # and released at the end


_LOCK_RACER = """
import sys, time
from contextlib import ExitStack
from pathlib import Path
import train
out, go = Path(sys.argv[1]), Path(sys.argv[2])
alive, read_pid = train.process_alive, train.lock_pid
def slow_alive(pid):  # both runs find the dead lock before either takes it over
    time.sleep(1.0)
    return alive(pid)
def slow_read(path):  # and a lock read just before another run replaces it would be stale
    pid = read_pid(path)
    time.sleep(0.5)
    return pid
train.process_alive, train.lock_pid = slow_alive, slow_read
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
with ExitStack() as cleanup:
    try:
        train.lock_out_dir(out, cleanup)
    except train.UsageError as e:
        print("in use", e)
        sys.exit(0)
    print("locked", flush=True)
    time.sleep(2.5)  # held while the other run tries
"""


def test_two_runs_taking_over_the_same_stale_lock_one_wins(tmp_path):
    # both find the lock of a dead process; the slower one must not remove the lock the faster just made
    out, go = tmp_path / "run", tmp_path / "go"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / "train.lock").write_text(gone.stdout)
    racers = [subprocess.Popen([sys.executable, "-c", _LOCK_RACER, out, go], cwd=Path(__file__).parent,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert [r.stdout.readline() for r in racers] == ["ready\n"] * 2  # both have imported train.py
    go.touch()
    results = [r.communicate(timeout=60) for r in racers]
    assert all(r.returncode == 0 for r in racers), results
    assert all("note: taking over" in stdout for stdout, _ in results), results  # both found the dead lock
    said = sorted(stdout.splitlines()[-1].split()[0] for stdout, _ in results)
    assert said == ["in", "locked"], results
    assert not list(out.glob("train.lock*"))  # the winner released it; no takeover claim left behind


def _train_check_stopped(out, err, signum, capsys):
    """After a signal: one line naming the step saved in last.pt, and --resume continues from it."""
    step = torch.load(out / "last.pt", weights_only=True)["step"]
    assert err.strip().splitlines() == [f"stopped by {signal.Signals(signum).name} after step {step}, "
                                        f"{out / 'last.pt'} saved; continue with: python train.py --out_dir {out} "
                                        "--resume --device cpu"], err  # not restored by --resume
    assert step >= 1 and not list(out.glob("*.tmp")) and not (out / "train.lock").exists()
    assert max(r["step"] for r in _train_metrics(out)) == step
    assert _train_main(train, ["--out_dir", out, "--resume", "--max_iters", step + 1], capsys)[0] == 0
    assert [r["step"] for r in _train_metrics(out) if r["type"] == "train"] == list(range(1, step + 2))


def _train_ignore(*signums):  # in the child before exec: as nohup (SIGHUP) and `cmd &` in a script (SIGINT)
    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):  # a suite run under nohup ignores SIGHUP
        signal.signal(signum, signal.SIG_IGN if signum in signums else signal.SIG_DFL)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP, the terminal closed", "SIGHUP and SIGINT ignored at start"])
def test_sigterm_to_a_training_process_stops_after_the_step_saves_and_resumes(_train_data, _train_one_thread,
                                                                              tmp_path, capsys, how):
    """A real SIGTERM to a train.py process: it finishes its step, saves last.pt, exits 143. SIGHUP does
    the same (exit 129), also when the terminal it writes to is gone (writes fail with EIO); a signal
    ignored at start (nohup, `cmd &`) stays ignored, and SIGTERM still stops the run."""
    demo, _ = _train_data
    out = tmp_path / "run"
    cmd = [sys.executable, str(_TRAIN_ROOT / "train.py"), *map(str, _train_tiny_run(demo, out, "--max_iters", 10 ** 6,
                                                                                  "--eval_interval", 10 ** 6))]
    terminal, stdout = (os.openpty() if how.endswith("closed") else (None, None)), subprocess.DEVNULL
    if terminal[0] is not None:
        stdout = terminal[1]  # the terminal: its other end closed once the run trains, as a closed window
    ignored = (signal.SIGHUP, signal.SIGINT) if how.endswith("at start") else ()
    sent = signal.Signals[how.split()[0].rstrip(",")]
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=_train_env(),
                            preexec_fn=functools.partial(_train_ignore, *ignored))
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and '"train"' in (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        if terminal[0] is not None:
            os.close(terminal[1])
            os.close(terminal[0])  # from now on the run's every line to its terminal fails (EIO)
        # pending together, SIGHUP and SIGINT are handled before SIGTERM (signals in number order)
        for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM) if ignored else (sent,):
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    signum = signal.SIGTERM if ignored else sent
    assert proc.returncode == 128 + signum, err
    _train_check_stopped(out, err, signum, capsys)


def test_ctrl_c_stops_after_the_step_saves_and_resumes(_train_data, _train_one_thread, tmp_path, monkeypatch, capsys):
    """SIGINT sent to this process during step 3 (twice, as torchrun forwards a Ctrl-C): exit 130."""
    demo, _ = _train_data
    out, real = tmp_path / "run", train.batch_offsets

    def ctrl_c_in_step_3(seed, step, *args):
        if step == 2:  # the step that takes step from 2 to 3
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real(seed, step, *args)
    monkeypatch.setattr(train, "batch_offsets", ctrl_c_in_step_3)
    # train.py's clock stands still: the two signals are one Ctrl-C however busy the machine is (a second
    # signal a second or more after the first would interrupt at once)
    clock = {n: getattr(time, n) for n in dir(time) if not n.startswith("_")}
    monkeypatch.setattr(train, "time", types.SimpleNamespace(**{**clock, "monotonic": lambda: 0.0}))
    # a suite started with `&` in a script runs with SIGINT ignored, which train.py respects: not ignored here
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = _train_main(train, _train_tiny_run(demo, out, "--max_iters", 100, "--eval_interval", 100),
                                   capsys)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # train.py's handler is gone again
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(train, "batch_offsets", real)
    assert code == 130 and torch.load(out / "last.pt", weights_only=True)["step"] == 3, err
    _train_check_stopped(out, err, signal.SIGINT, capsys)


@pytest.mark.parametrize("error", [errno.EACCES, errno.EROFS])
def test_unwritable_out_dir_is_one_line(_train_data, _train_one_thread, tmp_path, monkeypatch, capsys, error):
    """No permission or a read-only disk (root ignores permissions, so the refusal is injected)."""
    demo, _ = _train_data

    def refuse(*args, **kwargs):
        raise OSError(error, os.strerror(error))
    monkeypatch.setattr(prepare_data.tempfile, "TemporaryFile", refuse)
    code, _, err = _train_main(train, _train_tiny_run(demo, tmp_path / "run", "--max_iters", 1), capsys)
    assert code == 2 and err == f"error: cannot write to output folder {tmp_path / 'run'} ({os.strerror(error)}); " \
                                "choose a writable folder with --out_dir\n"


# -----------------------------------------------------------------------------
# train.py never writes through a planted link (issue 21): every kind of file it writes

_TRAIN_WHOLE_FILES = ["last.pt", "best.pt", "summary.json"]


def _train_linked_run(demo, out, victim, names, resume_from=None, **kw):
    """Plant links to victim at names in out (a copy of the run resume_from, or a new folder), run
    train.py there: (exit code, stderr)."""
    if resume_from is None:
        out.mkdir(exist_ok=True)
    else:
        shutil.copytree(resume_from, out)
    _data_plant(victim, out, names)
    argv = ["--out_dir", out, "--resume", "--max_iters", 5] if resume_from else _train_tiny_run(
        demo, out, "--max_iters", 2, "--eval_interval", 1)
    code, _, err = _train_main(train, argv, kw.get("capsys"))
    return code, err


@pytest.mark.parametrize("where", ["final names", "temporary names", "metrics.jsonl, resumed"])
def test_train_replaces_a_link_at_a_whole_file_or_skips_a_taken_temporary_name(
        _train_data, _train_runs, _train_one_thread, tmp_path, monkeypatch, capsys, _data_victim, where):
    """Whole files go through write_atomic: a link at the final name is replaced by a real file, links at
    temporary names are skipped; a resumed run never reads metrics.jsonl through a link."""
    out = tmp_path / "run"
    if where == "metrics.jsonl, resumed":
        code, err = _train_linked_run(None, out, _data_victim, ["metrics.jsonl"], _train_runs[0], capsys=capsys)
        assert code == 2 and _data_one_error_line(err) == (
            f"error: {out / 'metrics.jsonl'} is a symbolic link: train.py never writes through one (it could "
            "point anywhere); remove it and re-run")
        assert (out / "metrics.jsonl").is_symlink()
        return
    _data_predictable_temp_names(monkeypatch)
    names = _TRAIN_WHOLE_FILES if where == "final names" else _data_taken_temp_names(
        _TRAIN_WHOLE_FILES + ["metrics.jsonl"])
    if where == "final names":  # a link at last.pt to a file is a run already there: one to nowhere is not
        out.mkdir()
        (out / "last.pt").symlink_to(tmp_path / "nowhere")
    code, err = _train_linked_run(_train_data[0], out, _data_victim, [n for n in names if n != "last.pt"],
                                  capsys=capsys)
    assert code == 0 and not (tmp_path / "nowhere").exists(), err
    for name in _TRAIN_WHOLE_FILES + ["metrics.jsonl"]:
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 2
    assert all((out / n).is_symlink() for n in names if n not in _TRAIN_WHOLE_FILES)  # taken: left alone


def _train_fake_wandb(dir, **kwargs):  # writes where wandb would: its folder in --out_dir
    (Path(dir) / "wandb").mkdir(exist_ok=True)
    (Path(dir) / "wandb" / "run.wandb").write_text("logged")
    return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)


@pytest.mark.parametrize("where", ["metrics.jsonl", "train.lock", "train.lock.PID", "train.lock.takeover",
                                   "wandb"])
def test_train_never_appends_or_locks_through_a_planted_link(_train_data, _train_one_thread, tmp_path, monkeypatch,
                                                             capsys, where):
    """Files that are appended to or created new (O_NOFOLLOW, O_EXCL) and wandb's folder: a link there
    stops the run with one line, its target untouched, no checkpoint written."""
    out, name = tmp_path / "run", where.replace("PID", str(os.getpid()))
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    target = tmp_path / "victim.txt"  # holds a dead pid: read through a link, it would pass for a stale lock
    target.write_text(gone.stdout)
    argv = _train_tiny_run(_train_data[0], out, "--max_iters", 1)
    if where == "wandb":  # a folder: wandb would write into it
        target = tmp_path / "elsewhere"
        target.mkdir()
        monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=_train_fake_wandb))
        argv += ["--wandb_project", "p"]
    if where == "train.lock.takeover":  # a lock of a dead process, which the run takes over
        (out / "train.lock").write_text(gone.stdout)
    if where == "metrics.jsonl":  # planted after the run removed an earlier try's metrics.jsonl
        real = train.start_fresh

        def start_fresh(run):
            real(run)
            _data_plant(target, out, [name])
        monkeypatch.setattr(train, "start_fresh", start_fresh)
    else:
        _data_plant(target, out, [name])
    code, _, err = _train_main(train, argv, capsys)
    line = _data_one_error_line(err)
    assert code == 2 and (out / name).is_symlink(), line
    assert line == {"train.lock": f"error: {out / name} is not a lock train.py wrote (a link, or no pid in it): "
                                  f"delete it if no train.py writes to {out}, and re-run"}.get(
        where, f"error: {out / name} is a symbolic link: train.py never writes through one (it could point "
               "anywhere); remove it and re-run")
    assert (list(target.iterdir()) == []) if where == "wandb" else target.read_text() == gone.stdout
    assert not (out / "last.pt").exists()


def test_train_lock_never_overwrites_a_file_at_its_own_name(_train_data, _train_one_thread, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / f"train.lock.{os.getpid()}").write_text("someone's notes")  # or a lock of a dead run of this pid
    code, _, err = _train_main(train, _train_tiny_run(_train_data[0], out, "--max_iters", 1), capsys)
    assert code == 2 and _data_one_error_line(err) == (
        f"error: {out / f'train.lock.{os.getpid()}'} is in the way of this run's lock (left by a killed train.py "
        f"of the same pid?): delete it if no train.py writes to {out}, and re-run")
    assert (out / f"train.lock.{os.getpid()}").read_text() == "someone's notes" and not (out / "last.pt").exists()


# kill -9 during a save leaves write_atomic's temporary file: the next run in that --out_dir removes those of the
# files train.py writes (checkpoint-sized ones would pile up), under its lock, and nothing else
def test_train_removes_only_the_temporary_files_its_own_saves_left(_train_runs, _train_one_thread, tmp_path, capsys,
                                                                  _data_victim):
    out = tmp_path / "run"
    shutil.copytree(_train_runs[0], out)
    ours = ["tmp0123abcd.last.pt.tmp", "tmpdeadbeef.best.pt.tmp", "tmp00000000.summary.json.tmp",
            "tmp99999999.metrics.jsonl.tmp"]
    others = ["tmp0123abcd.notes.txt.tmp", "tmpnothex1.last.pt.tmp", "tmp0123abcde.last.pt.tmp", "last.pt.tmp",
              "tmp0123abcd.last.pt.tmp.bak"]
    for name in ours + others:
        (out / name).write_bytes(b"x" * 1000)
    _data_plant(_data_victim, out, ["tmp11111111.last.pt.tmp"])  # a link, not a file a save left
    (out / "tmp22222222.best.pt.tmp").mkdir()
    code, stdout, err = _train_main(train, ["--out_dir", out, "--resume", "--max_iters", 5], capsys)
    assert code == 0, err
    assert f"note: removed 4 temporary file(s) of saves cut short in {out} (tmp00000000.summary.json.tmp, " in stdout
    assert not any((out / name).exists() for name in ours)
    assert all((out / name).read_bytes() == b"x" * 1000 for name in others)
    assert (out / "tmp11111111.last.pt.tmp").is_symlink() and (out / "tmp22222222.best.pt.tmp").is_dir()


def test_data_check_is_cached_and_sees_a_changed_file(_train_data, tmp_path, monkeypatch):
    demo, _ = _train_data
    data = tmp_path / "demo"
    shutil.copytree(demo, data)
    meta = prepare_data.load_meta(data)
    cache = prepare_data.check_tokens(data, meta, meta["splits"])
    assert json.loads((data / "checked.json").read_text()) == cache
    assert cache["train"]["max_id"] == int(np.fromfile(data / "train.bin", dtype=np.uint8).max()) < meta["vocab_size"]
    scans = []
    monkeypatch.setattr(prepare_data, "_chunks", lambda a, n=None: scans.append(len(a)) or [a])
    prepare_data.check_tokens(data, meta, meta["splits"])
    assert scans == []  # cached: no scan
    raw = bytearray((data / "train.bin").read_bytes())
    raw[7] = meta["vocab_size"]
    (data / "train.bin").write_bytes(bytes(raw))  # same size, new content
    with pytest.raises(prepare_data.UsageError, match=f"holds token id {meta['vocab_size']}"):
        prepare_data.check_tokens(data, meta, meta["splits"])
    assert scans == [meta["splits"]["train"]]


# --eval_tokens's default: smaller on CPU with a large vocabulary, whose output layer dominates evaluation
def test_default_eval_tokens_depends_on_vocabulary_and_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert train.default_eval_tokens(50257, cpu) == 8192 < train.default_eval_tokens(27, cpu) == 32768
    assert train.default_eval_tokens(50257, cuda) == 32768 and train.default_eval_tokens(1024, cpu) == 32768
    assert train.build_parser().get_default("eval_tokens") is None  # None: resolved once data and device are known
    # --eval_tokens is a floor: whole batches of rows x T tokens, enough to reach it (at least one)
    shapes = [train.eval_offsets(10 ** 6, 32, 4, tokens, 0).shape for tokens in (1, 128, 129, 300)]
    assert shapes == [(1, 4), (1, 4), (2, 4), (3, 4)]


# train.py says once when the automatic routing block differs from Block AttnRes's at that depth
def test_train_notes_a_routing_block_other_than_the_parents(_train_data, _train_one_thread, tmp_path, capsys):
    note = train.block_note(GPTConfig(n_layer=8, residual="attnres", wav=True))
    assert "routing block is 4 sublayers" in note and "but 2 for Block AttnRes at 8 layers" in note
    assert "--attnres_block 4" in note
    assert train.block_note(GPTConfig(n_layer=16, residual="attnres", wav=True)) is None  # 4 for both
    assert train.block_note(GPTConfig(n_layer=8, residual="attnres", wav=True, attnres_block=4)) is None  # chosen
    assert train.block_note(GPTConfig(n_layer=8, residual="attnres", rd="decoupled")) is None
    assert train.block_note(GPTConfig(n_layer=8)) is None
    demo, _ = _train_data
    t = ["--data", demo, *_TRAIN_TINY, "--max_iters", 2, "--eval_interval", 1, "--residual", "attnres"]
    code, out, _ = _train_main(train, [*t, "--wav", "True", "--out_dir", tmp_path / "wav"], capsys)
    assert code == 0 and out.count("note: the automatic routing block is 4 sublayers") == 1
    code, out, _ = _train_main(train, [*t, "--out_dir", tmp_path / "block"], capsys)
    assert code == 0 and "note: the automatic routing block" not in out


# a checkpoint of an older train.py records the dataset's name, level and size, not its characters
def test_resume_of_a_checkpoint_without_the_characters_compares_the_rest_and_says_so(_train_data, _train_runs,
                                                                                     _train_one_thread, tmp_path, capsys):
    (demo, _), (routed, _) = _train_data, _train_runs
    old = tmp_path / "old"
    shutil.copytree(routed, old)
    ckpt = torch.load(old / "last.pt", weights_only=True)
    assert ckpt["meta"].pop("chars")  # this train.py records them
    torch.save(ckpt, old / "last.pt")
    code, out, err = _train_main(train, ["--out_dir", old, "--resume", "--max_iters", 5], capsys)
    assert code == 0, err
    assert out.count(f"note: {old / 'last.pt'} does not record the dataset's chars (an older train.py wrote it): "
                     "compared on the rest") == 1
    ckpt["meta"]["dataset"] = "tinystories"  # what it has is still compared
    torch.save(ckpt, old / "last.pt")
    code, _, err = _train_main(train, ["--out_dir", old, "--resume", "--max_iters", 6, "--data", demo], capsys)
    assert code == 2 and "its dataset is demo, the checkpoint's tinystories" in err


# the header names the threads, and on CPU notes when the run's processes ask for more threads than cores
def test_train_header_names_the_threads_and_notes_more_than_the_cores(_train_data, _train_one_thread, tmp_path,
                                                                    monkeypatch, capsys):
    demo, _ = _train_data
    t = ["--data", demo, *_TRAIN_TINY, "--max_iters", 1, "--eval_interval", 1, "--residual", "prenorm"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 cores
    code, out, _ = _train_main(train, [*t, "--out_dir", tmp_path / "one"], capsys)
    assert code == 0 and "1 process(es) on cpu (1 thread each)" in out and "OMP_NUM_THREADS" not in out
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # torch's default on a machine of 4 cores
    code, out, _ = _train_main(train, [*t, "--out_dir", tmp_path / "four"], capsys)
    assert code == 0 and "1 process(es) on cpu (4 threads each)" in out
    assert "note: 1 process(es) x 4 threads share 2 cores: set OMP_NUM_THREADS=2" in out
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert train.threads_note(cpu, world=1) is None  # 2 threads on 2 cores
    assert "2 process(es) x 2 threads share 2 cores: set OMP_NUM_THREADS=1" in train.threads_note(cpu, world=2)
    assert train.threads_note(torch.device("cuda"), world=2) is None  # the GPU does the work
    # experiments.py sweep --jobs N gives each of its CPU runs its share of the cores: no note there
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(experiments, "_cores", lambda: 2)
    for jobs in (2, 3):
        threads = int(experiments.job_slots(jobs, extra=["--device", "cpu"])[0]["OMP_NUM_THREADS"])
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        assert train.threads_note(cpu, world=1) is None, jobs


# the first run: no flags train Block AttnRes and end with the routing summary and the next commands
def test_default_run_is_routed_and_ends_with_routing_summary(_train_data, _train_one_thread, tmp_path, capsys):
    demo, _ = _train_data
    out = tmp_path / "my run"  # a space: the printed commands must quote it
    code, text, _ = _train_main(train, ["--data", demo, "--out_dir", out, *_TRAIN_TINY, "--max_iters", 2], capsys)
    assert code == 0 and "residual attnres (block 2, wav False, rd off)" in text
    assert json.loads((out / "summary.json").read_text())["config"]["residual"] == "attnres"
    lines = text.split("\nrouting (")[1].splitlines()
    reads = [line.split()[0] for line in lines[1:lines.index("")]]
    assert reads == ["layer0.attn", "layer0.mlp", "layer1.attn", "layer1.mlp", "readout"]
    assert lines[1].split() == ["layer0.attn", "emb", "1.00"]  # the first read sees only the embedding
    assert len(lines[5].split()) == 7  # readout: emb, C0, C1 with their weights; all three, no "..."
    weights = [float(w) for w in lines[5].split()[2::2]]
    assert weights == sorted(weights, reverse=True) and sum(weights) == pytest.approx(1, abs=0.02)
    lines = text.split("\nnext:\n")[1].splitlines()
    nxt = [shlex.split(line.rsplit("  # ", 1)[0]) for line in lines]
    assert nxt[:2] == [["python", "sample.py", "--out_dir", str(out)], ["python", "sample.py", "--out_dir", str(out),
                                                                         "--routes"]]
    assert nxt[2][:4] == ["python", "train.py", "--residual", "prenorm"] and nxt[2][-2:] == ["--out_dir",
                                                                                          f"{out}_prenorm"]
    # the suggested baseline, run as printed, is paired with this run: the same but the routing
    assert _train_main(train, nxt[2][2:])[0] == 0
    routed, baseline = (json.loads((Path(d) / "summary.json").read_text()) for d in (out, f"{out}_prenorm"))
    assert baseline["config"] == dict(routed["config"], residual="prenorm")
    assert baseline["train"] == dict(routed["train"], out_dir=f"{out}_prenorm")


def _train_settings(argv, config_class=GPTConfig, vocab_size=53, device=torch.device("cpu")):
    """The settings a train.py run with these flags would have (its own steps, on no data): the
    TrainSettings and the config."""
    given = vars(train.build_parser(config_class).parse_args(argv))
    a, model, _ = train.resolve_settings({k: v for k, v in given.items() if v is not None},
                                         config_class=config_class)
    config = train.model_config(model, vocab_size, a.data, config_class)
    train.complete_settings(a, config, device)  # --eval_tokens's default, max_iters from max_tokens
    return a, config


def _train_baseline(a, config, device=torch.device("cpu")):
    """The baseline command of the next: block, as a shell would split it."""
    line = train.next_commands(a, config, True, device).splitlines()[-1]
    return shlex.split(line.rsplit("  # ", 1)[0])


def test_next_commands_baseline_repeats_only_the_settings_a_plain_run_would_not_get():
    a, config = _train_settings([])  # --eval_tokens filled in as a run does: not repeated
    plain = ["python", "train.py", "--residual", "prenorm"]
    assert _train_baseline(a, config) == [*plain, "--out_dir", "out_prenorm"]
    a.eval_tokens, a.seed = 1024, 7  # given by the user: the baseline repeats them
    assert _train_baseline(a, config) == [*plain, "--eval_tokens", "1024", "--seed", "7",
                                          "--out_dir", "out_prenorm"]


# the printed baseline of every variant and preset, run through train.py's parser and GPTConfig, is
# the run itself without the routing; the flags of how it runs (--dtype, --device) are repeated too
_TRAIN_PAIRED = [[f"--{k}={v}" for k, v in values.items()] for values in nanoroute.VARIANTS.values()]
_TRAIN_PAIRED += [["--preset", name] for name in train.PRESETS]


@pytest.mark.parametrize("flags", _TRAIN_PAIRED, ids=[*nanoroute.VARIANTS, *train.PRESETS])
def test_printed_baseline_is_the_same_run_without_routing(flags):
    a, config = _train_settings([*flags, "--dtype", "bfloat16", "--device", "cpu", "--seed", "3",
                                 "--out_dir", "runs/a b"])
    baseline = _train_baseline(a, config)
    assert baseline[:4] == ["python", "train.py", "--residual", "prenorm"]
    b, base = _train_settings(baseline[2:])  # no error: no routing field is left over
    routing = nanoroute.routing_fields(GPTConfig)
    assert base.residual == "prenorm"
    assert all(getattr(base, f) == getattr(GPTConfig(), f) for f in routing[1:])
    assert {k: v for k, v in dataclasses.asdict(base).items() if k not in routing} == \
        {k: v for k, v in dataclasses.asdict(config).items() if k not in routing}
    assert dataclasses.asdict(b) == dict(dataclasses.asdict(a), out_dir="runs/a b_prenorm",
                                         preset=None)


# a GPTConfig subclass adding a routing field (setting(..., needs="attnres")): the baseline drops it
@dataclasses.dataclass
class _TrainConfigWithGain(GPTConfig):
    read_gain: float = nanoroute.setting(1.0, "a made-up routing knob", needs="attnres")


def test_printed_baseline_drops_a_routing_field_of_a_config_subclass():
    flags = ["--residual", "attnres", "--read_gain", "2.0", "--seed", "3"]
    a, config = _train_settings(flags, _TrainConfigWithGain)
    assert config.read_gain == 2.0
    assert "--read_gain" in train.build_parser(_TrainConfigWithGain).format_help()
    baseline = _train_baseline(a, config)
    b, base = _train_settings(baseline[2:], _TrainConfigWithGain)  # --read_gain 2.0: an error
    assert "--read_gain" not in baseline and base.read_gain == 1.0
    assert base.residual == "prenorm" and b.seed == 3


def test_routing_summary_shows_the_three_heaviest_sources_and_dots_for_more():
    four = {"sources": ["emb", "C0", "C1", "P"], "mean_weight": [0.1, 0.4, 0.2, 0.3]}
    three = {"sources": ["emb", "C0", "P"], "mean_weight": [0.5, 0.2, 0.3]}
    lines = train.routing_summary({"reads": {"a": four, "b": three}, "js_mean": None}).splitlines()
    assert [line.split() for line in lines[1:]] == [["a", "C0", "0.40", "P", "0.30", "C1", "0.20", "..."],
                                                   ["b", "emb", "0.50", "P", "0.30", "C0", "0.20"]]


def test_prenorm_run_has_no_routing_summary(_train_data, _train_one_thread, tmp_path, capsys):
    demo, _ = _train_data
    code, text, _ = _train_main(train, ["--data", demo, "--out_dir", tmp_path, *_TRAIN_TINY, "--max_iters", 1,
                                        "--residual", "prenorm"], capsys)
    assert code == 0 and "\nrouting (" not in text and text.split("\nnext:\n")[1].count("python ") == 1


# --device under torchrun: cuda is each process's own GPU (LOCAL_RANK); cuda:N with several GPUs visible
# would put every process on GPU N: one line. One process, or one GPU visible per process: as given
def test_device_cuda_under_torchrun_is_the_process_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert train.pick_device("cuda", local_rank=3, world=8) == torch.device("cuda:3")
    assert train.pick_device("auto", local_rank=3, world=8) == torch.device("cuda:3")
    assert train.pick_device("cuda:1") == torch.device("cuda:1")  # one process: any GPU
    with pytest.raises(train.UsageError, match=r"^--device cuda:0 under torchrun: every process would run on "
                                               r"that one GPU; give --device cuda"):
        train.pick_device("cuda:0", local_rank=3, world=8)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # CUDA_VISIBLE_DEVICES: one GPU each
    assert train.pick_device("cuda:0", local_rank=3, world=8) == torch.device("cuda:0")


# --device mps: used where torch has MPS (Apple silicon), else one clear line; auto prefers cuda, mps, cpu
def test_device_mps_where_available_else_one_line(_train_data, _train_runs, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert train.pick_device("mps") == torch.device("mps") and train.pick_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert train.pick_device("auto") == torch.device("cpu")
    demo, _ = _train_data
    routed, _ = _train_runs
    for script, out_dir in ((train, tmp_path / "run"), (sample, routed)):
        code, _, err = _train_main(script, ["--data", demo, "--out_dir", out_dir, "--device", "mps"], capsys)
        assert code == 2 and err == "error: --device mps: MPS (Apple silicon GPU) is not available here; use " \
                                    "--device cpu\n"
    assert not (tmp_path / "run").exists()


# --wandb_project: one line naming the package when wandb is missing; else the same numbers as metrics.jsonl
def test_wandb_missing_is_one_line_before_training(_train_data, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    demo, _ = _train_data
    code, out, err = _train_main(train, ["--data", demo, "--out_dir", tmp_path / "run", *_TRAIN_TINY,
                                         "--max_iters", 1, "--wandb_project", "p"], capsys)
    assert code == 2 and err == "error: --wandb_project needs the wandb package: pip install wandb (or drop the " \
                                "flag)\n"
    assert out == "" and not (tmp_path / "run").exists()
    code, _, err = _train_main(train, ["--data", demo, "--out_dir", tmp_path / "run", *_TRAIN_TINY, "--max_iters", 1,
                                       "--wandb_run", "r"], capsys)
    assert code == 2 and err == "error: --wandb_run needs --wandb_project NAME\n"


def test_wandb_logs_the_numbers_of_metrics_jsonl(_train_data, _train_one_thread, monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb", reason="needs wandb (optional: pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never upload from a test
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, real_log = [], wandb.Run.log

    def spy(run, data, *args, **kwargs):  # records, then logs for real
        logged.append((kwargs.get("step"), dict(data)))
        return real_log(run, data, *args, **kwargs)

    monkeypatch.setattr(wandb.Run, "log", spy)
    demo, _ = _train_data
    out = tmp_path / "run"
    argv = ["--data", demo, "--out_dir", out, *_TRAIN_TINY, *_TRAIN_ROUTED, "--max_iters", 2, "--eval_interval", 1,
            "--wandb_project", "nanoroute-test", "--wandb_run", "tiny"]
    assert _train_main(train, argv)[0] == 0
    lines = _train_metrics(out)
    assert [step for step, _ in logged] == [line["step"] for line in lines]
    for line, (_, numbers) in zip(lines, logged):
        kind = line["type"]
        expected = {f"{kind}/{k}": v for k, v in line.items() if isinstance(v, (int, float)) and k != "step"}
        if kind == "eval":
            expected.update({f"eval/routes/entropy/{read}": v for read, v in line["routes"]["entropy"].items()})
            expected.update({f"eval/routes/entropy_norm/{read}": v for read, v in line["routes"]["entropy_norm"].items()
                             if v is not None})  # a read of one source has none
            expected.update({f"eval/routes/js/{layer}": v for layer, v in line["routes"]["js"].items()},
                            **{"eval/routes/js_mean": line["routes"]["js_mean"]})
        assert numbers == expected
    assert {"train/loss", "train/lr", "eval/val_loss", "eval/val_bpc"} <= {k for _, n in logged for k in n}
    assert len(list((out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1  # the real wandb wrote its run


# training: every micro-step of a --grad_accum step reads its own crops
def test_grad_accum_micro_steps_read_their_own_crops(_train_data, _train_one_thread, tmp_path, monkeypatch):
    demo, _ = _train_data
    seen, real = [], train.get_batch

    def spy(data, offsets, T, device):  # records the crops, then reads them as train.py does
        seen.append(tuple(int(o) for o in offsets))
        return real(data, offsets, T, device)
    monkeypatch.setattr(train, "get_batch", spy)
    argv = ["--data", demo, "--out_dir", tmp_path / "run", *_TRAIN_TINY, "--grad_accum", 3, "--max_iters", 2,
            "--eval_interval", 10]
    assert _train_main(train, argv)[0] == 0
    n = prepare_data.load_meta(demo)["splits"]["train"]
    crops = [tuple(int(o) for o in train.batch_offsets(1337, step, micro, n, 32, 8))
             for step in range(2) for micro in range(3)]
    assert len(set(crops)) == 6
    assert [c for c in seen if c in crops] == crops  # each one once, in order; the rest are evaluations


def _train_crop_loss(model, data, offsets, T):
    """The model's mean loss over crops data[o:o+T] predicting data[o+1:o+T+1], written out here."""
    x = torch.stack([torch.from_numpy(data[o:o + T].astype(np.int64)) for o in offsets])
    y = torch.stack([torch.from_numpy(data[o + 1:o + T + 1].astype(np.int64)) for o in offsets])
    return model(x, y)[1]


# training: the logged train, val and test losses are the losses on those splits
def test_logged_losses_are_the_split_losses_of_the_checkpoint(_train_data, _train_runs):
    demo, _ = _train_data
    routed, _ = _train_runs
    ckpt = torch.load(routed / "last.pt", weights_only=True)
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    last = [r for r in _train_metrics(routed) if r["type"] == "eval"][-1]
    final = json.loads((routed / "summary.json").read_text())["final"]
    assert last["step"] == ckpt["step"] == 4
    for split, split_id, logged in (("train", 0, last["train_loss"]), ("val", 1, last["val_loss"]),
                                    ("test", 2, final["test_loss"])):
        data = prepare_data.open_split(demo, split)
        with torch.no_grad():
            losses = [_train_crop_loss(model, data, offsets, 32) for offsets in
                      train.eval_offsets(len(data), 32, 8, 256, split_id)]
        assert logged == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5), split


# training: gradient accumulation averages: clipping sees the gradient norm of the step's mean loss
def test_grad_accum_clips_the_gradient_of_the_mean_loss(_train_data, _train_one_thread, tmp_path, monkeypatch):
    demo, _ = _train_data
    seen, real = [], torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):  # records the norm and the weights it was computed at
        params = list(params)
        norm = real(params, max_norm, *args, **kwargs)
        seen.append((norm.item(), [p.detach().clone() for p in params]))
        return norm
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    out = tmp_path / "run"
    assert _train_main(train, ["--data", demo, "--out_dir", out, *_TRAIN_TINY, "--grad_accum", 3, "--max_iters", 1,
                               "--eval_interval", 10])[0] == 0
    (norm, weights), = seen
    model = GPT(GPTConfig(**torch.load(out / "last.pt", weights_only=True)["config"]))
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    data = prepare_data.open_split(demo, "train")
    losses = [_train_crop_loss(model, data, train.batch_offsets(1337, 0, micro, len(data), 32, 8), 32)
              for micro in range(3)]
    mean = torch.stack(losses).mean()
    mean.backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert norm == pytest.approx(want, rel=1e-4) and norm > 1.0  # > grad_clip: clipping did act
    logged = [r for r in _train_metrics(out) if r["type"] == "train"][0]
    assert logged["loss"] == pytest.approx(mean.item(), rel=1e-5)  # the logged loss is that mean too


# --grad_clip 0 is off: the same run as with a clip too large to ever act
def test_grad_clip_0_is_off(_train_data, _train_one_thread, tmp_path):
    demo, _ = _train_data
    losses = []
    for clip in (0, 1e9):
        out = tmp_path / str(clip)
        assert _train_main(train, _train_tiny_run(demo, out, "--max_iters", 3, "--grad_clip", clip))[0] == 0
        losses.append([r["loss"] for r in _train_metrics(out) if r["type"] == "train"])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


# training: --resume keeps the best val loss and best.pt when the resumed run gets worse
def test_resume_keeps_best_when_the_run_gets_worse(_train_data, _train_one_thread, tmp_path, capsys):
    demo, _ = _train_data
    out = tmp_path / "run"
    assert _train_main(train, ["--data", demo, "--out_dir", out, *_TRAIN_TINY, "--max_iters", 8,
                               "--eval_interval", 2, "--stop_after", 4])[0] == 0
    best_bytes = (out / "best.pt").read_bytes()
    best = torch.load(out / "best.pt", weights_only=True)["best_val_loss"]
    # resumed with a far too large learning rate: every later evaluation is worse than the best
    assert _train_main(train, ["--out_dir", out, "--resume", "--lr", 3.0, "--warmup_iters", 0], capsys)[0] == 0
    later = [r["val_loss"] for r in _train_metrics(out) if r["type"] == "eval" and r["step"] > 4]
    assert len(later) == 2 and min(later) > best
    assert (out / "best.pt").read_bytes() == best_bytes
    assert torch.load(out / "last.pt", weights_only=True)["best_val_loss"] == best
    assert json.loads((out / "summary.json").read_text())["best_val_loss"] == best


# training: resume under torchrun is bitwise exact: each process restores its own dropout RNG
def test_torchrun_resume_is_bitwise_exact(_train_data, _train_one_thread, tmp_path):
    demo, _ = _train_data
    flags = ["--data", demo, *_TRAIN_TINY, *_TRAIN_ROUTED, "--dropout", 0.1, "--max_iters", 4, "--eval_interval", 2]

    def torchrun(*extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_train_free_port()}", str(_TRAIN_ROOT / "train.py"), "--", *map(str, flags),
               *map(str, extra)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_train_env())

    def finish(run):
        out, err = run.communicate(timeout=180)
        assert run.returncode == 0, out[-2000:] + err[-4000:]
    whole, part = torchrun("--out_dir", tmp_path / "whole"), torchrun("--out_dir", tmp_path / "part",
                                                                       "--stop_after", 2)
    finish(whole)
    finish(part)
    finish(torchrun("--out_dir", tmp_path / "part", "--resume"))
    a, b = (torch.load(tmp_path / d / "last.pt", weights_only=True) for d in ("whole", "part"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x["torch"], y["torch"]) for x, y in zip(a["rng"], b["rng"]))
    assert _train_metrics(tmp_path / "whole")[-1]["val_loss"] == _train_metrics(tmp_path / "part")[-1]["val_loss"]


def test_a_torchrun_worker_leaves_with_its_exit_code(tmp_path):
    """A worker skips the interpreter's teardown (where gloo's threads can abort it) but keeps its exit
    code, its atexit handlers (wandb's) and its buffered output; a bug is left to raise with its traceback.
    One process per case, two at a time."""
    def leave(case, how):
        script = f"""import atexit, sys, train
atexit.register(lambda: open({str(tmp_path / case)!r}, "w").close())
print("buffered", end="")
train.leave_worker({how})
print(" returned")
"""
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_train_env(),
                              timeout=60)
    cases = {"None": 0, "SystemExit(2)": 2, "SystemExit(130)": 130, "SystemExit(None)": 0,
             "RuntimeError('a bug')": None}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {how: pool.submit(leave, f"atexit{i}", how) for i, how in enumerate(cases)}
    for i, (how, code) in enumerate(cases.items()):
        run = runs[how].result()
        if code is None:  # leave_worker returned: the interpreter ends as usual
            assert (run.returncode, run.stdout) == (0, "buffered returned\n"), (how, run.stderr)
        else:
            assert (run.returncode, run.stdout) == (code, "buffered"), (how, run.stderr)
        assert (tmp_path / f"atexit{i}").exists(), how


@pytest.mark.parametrize("body, code, err", [("pass", 0, ""), ("raise train.UsageError('bad input')", 2,
                                                                  "error: bad input\n")])
def test_run_safely_ends_a_process_of_a_process_group(tmp_path, body, code, err):
    """With a process group (torchrun), run_safely destroys it and ends the process itself: the
    interpreter's teardown, where an object's __del__ would run, never comes."""
    script = f"""import torch.distributed as dist, train
class Teardown:
    def __del__(self):
        print("teardown")
keep = Teardown()
dist.init_process_group("gloo", init_method={(tmp_path / 'store').as_uri()!r}, rank=0, world_size=1)
with train.run_safely():
    print("trained")
    {body}
print("after")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_train_env(),
                         timeout=60)
    assert (run.returncode, run.stdout, run.stderr[-len(err):] if err else "") == (code, "trained\n", err), \
        run.stderr


# training and sampling: evaluation and generation turn dropout off
def test_eval_and_generation_are_deterministic_with_dropout(_train_data, _train_runs, _train_one_thread, tmp_path,
                                                            capsys):
    demo, _ = _train_data
    val = prepare_data.open_split(demo, "val")
    model = GPT(GPTConfig(vocab_size=prepare_data.load_meta(demo)["vocab_size"], sequence_len=32, n_layer=2,
                          n_head=2, n_embd=32, dropout=0.5))
    batches = train.eval_offsets(len(val), 32, 4, 256, 1)
    losses = [train.evaluate(model, val, batches, 32, torch.device("cpu"), contextlib.nullcontext(), 0, 1)
              for _ in range(2)]
    assert model.training  # evaluate puts the model back into training mode
    with torch.no_grad():
        noisy = torch.stack([_train_crop_loss(model, val, b, 32) for b in batches]).mean().item()  # dropout on
        model.eval()
        clean = torch.stack([_train_crop_loss(model, val, b, 32) for b in batches]).mean().item()
    assert losses[0] == losses[1] == pytest.approx(clean, rel=1e-6) and noisy != pytest.approx(clean, rel=1e-3)
    # sample.py: greedy decoding of a dropout-0.5 checkpoint is the same whatever the seed
    routed, _ = _train_runs
    ckpt = torch.load(routed / "best.pt", weights_only=True)
    ckpt["config"]["dropout"] = 0.5
    (tmp_path / "drop").mkdir()
    torch.save(ckpt, tmp_path / "drop" / "best.pt")
    texts = [_train_main(sample, ["--out_dir", tmp_path / "drop", "--num_samples", 2, "--max_new_tokens", 40,
                                  "--top_k", 1, "--seed", seed], capsys)[1] for seed in (1, 2)]
    assert texts[0] == texts[1] and texts[0].count("-" * 40) == 2

# --grad_clip: the gradient norm is clipped to it; 0 is off, the same run as one never clipped
def test_train_grad_clip_clips_and_0_is_off(_train_data, _train_one_thread, tmp_path):
    demo, _ = _train_data
    weights = {}
    for clip in ("0", "1e9", "1e-3"):  # 1e9: clip_grad_norm_ scales by exactly 1.0, as if never clipped
        argv = ["--data", demo, "--out_dir", tmp_path / clip, *_TRAIN_TINY, "--residual", "prenorm",
                "--max_iters", 3, "--eval_interval", 10, "--grad_clip", clip]
        assert _train_main(train, argv)[0] == 0
        weights[clip] = torch.load(tmp_path / clip / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(weights["0"][k], weights["1e9"][k]) for k in weights["0"])
    assert not all(torch.equal(weights["0"][k], weights["1e-3"][k]) for k in weights["0"])


# --grad_accum 2: a step is batch_size x grad_accum x sequence_len tokens, in every count that uses it:
# the logged tokens, tokens_seen, the steps --max_tokens gives, the step a milestone is crossed at
def test_train_grad_accum_counts_the_tokens_of_every_micro_step(_train_data, _train_one_thread, tmp_path,
                                                                capsys):
    demo, _ = _train_data
    argv = ["--data", demo, "--out_dir", tmp_path, *_TRAIN_TINY, "--residual", "prenorm", "--batch_size", 4,
            "--grad_accum", 2, "--max_tokens", 900, "--milestones", "500", "--log_interval", 2,
            "--eval_interval", 10]
    code, text, _ = _train_main(train, argv, capsys)
    assert code == 0 and "training: 4 steps x 256 tokens (batch 4 x accum 2 x 32)" in text  # ceil(900 / 256)
    lines = _train_metrics(tmp_path)
    assert [(r["step"], r["tokens"]) for r in lines if r["type"] == "train"] == [(1, 256), (2, 512), (4, 1024)]
    evals = [(r["step"], r["tokens"], r["milestone"]) for r in lines if r["type"] == "eval"]
    assert evals == [(0, 0, None), (2, 512, "500"), (4, 1024, None)]  # 500 is crossed during step 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["train"]["max_iters"], summary["step"], summary["tokens_seen"]) == (4, 4, 1024)
    at_2 = next(r for r in lines if r["type"] == "eval" and r["step"] == 2)
    assert summary["milestones"] == {"500": dict(step=2, tokens=512, val_loss=at_2["val_loss"])}


# --stop_after at a step without an evaluation, then --resume: every record of the run (metrics.jsonl's
# steps, tokens, lr, losses and milestones; summary.json; best.pt) is the uninterrupted run's, and the stop
# writes no best.pt of a model that was never evaluated
def test_resume_bookkeeping_equals_an_uninterrupted_run(_train_data, _train_one_thread, tmp_path):
    demo, _ = _train_data
    flags = ["--data", demo, *_TRAIN_TINY, "--residual", "prenorm", "--grad_accum", 2, "--max_iters", 6,
             "--eval_interval", 4, "--milestones", "1K,2.5K"]  # 512 tokens a step: crossed in steps 2 and 5
    assert _train_main(train, [*flags, "--out_dir", tmp_path / "whole"])[0] == 0
    part = tmp_path / "part"
    assert _train_main(train, [*flags, "--out_dir", part, "--stop_after", 3])[0] == 0
    stopped_best = torch.load(part / "best.pt", weights_only=True)
    evals_so_far = [r for r in _train_metrics(part) if r["type"] == "eval"]
    assert [r["step"] for r in evals_so_far] == [0, 2] and stopped_best["step"] in (0, 2)
    assert stopped_best["best_val_loss"] == min(r["val_loss"] for r in evals_so_far)
    assert torch.load(part / "last.pt", weights_only=True)["milestones"]["1K"]["step"] == 2
    before_stop = max(r["elapsed_s"] for r in _train_metrics(part) if r["type"] == "eval")
    assert _train_main(train, ["--out_dir", part, "--resume", "--device", "cpu"])[0] == 0
    # the wall time counts every segment: it goes on from the stopped run's, never back
    elapsed = [r["elapsed_s"] for r in _train_metrics(part) if r["type"] == "eval"]
    assert elapsed == sorted(elapsed) and elapsed[-1] > before_stop
    assert json.loads((part / "summary.json").read_text())["wall_time_s"] >= elapsed[-1]

    timing = {"tok_per_s", "ms_per_step", "elapsed_s"}
    whole, resumed = ([{k: v for k, v in r.items() if k not in timing} for r in _train_metrics(d)]
                      for d in (tmp_path / "whole", part))
    assert resumed == whole
    assert [r["milestone"] for r in whole if r["type"] == "eval"] == [None, "1K", None, "2.5K", None]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (tmp_path / "whole", part)]
    for s in summaries:
        del s["wall_time_s"], s["train"]["out_dir"], s["train"]["resume"]  # how each was invoked
    assert summaries[1] == summaries[0]
    best = [torch.load(d / "best.pt", weights_only=True) for d in (tmp_path / "whole", part)]
    assert best[1]["step"] == best[0]["step"] and best[1]["best_val_loss"] == best[0]["best_val_loss"]
    assert all(torch.equal(best[0]["model"][k], best[1]["model"][k]) for k in best[0]["model"])


# --preset: its values, an explicit flag over them (and said so at start), an explicit --max_iters over its
# --max_tokens; with --resume the checkpoint's config wins and a preset value that differs from it is an error
def test_train_preset_values_explicit_flags_and_resume(tmp_path, capsys):
    a, model, _ = train.resolve_settings({"preset": "rd_s"})
    assert (a.data, a.grad_accum, a.max_tokens, a.milestones, a.lr) == (
        "data/fineweb_edu", 8, 2_000_000_000, "0.25B,0.5B,1B,2B", 6e-4)
    assert [model[k] for k in ("n_layer", "n_embd", "n_head", "sequence_len", "residual", "rd")] == [
        16, 576, 9, 1024, "attnres", "decoupled"]
    a, model, _ = train.resolve_settings({"preset": "rd_s", "max_iters": 10, "n_layer": 4, "lr": 1e-3})
    assert (a.max_iters, a.max_tokens, a.lr, model["n_layer"], model["n_embd"]) == (10, None, 1e-3, 4, 576)
    with pytest.raises(prepare_data.UsageError, match="not both"):
        train.resolve_settings({"max_iters": 5, "max_tokens": 1000})
    train.read_settings({"preset": "rd_m", "n_layer": 4, "out_dir": str(tmp_path)}, 1, True)
    printed = capsys.readouterr().out
    assert printed.startswith("preset rd_m: ") and " n_layer=24 (overridden: 4) " in printed
    assert " lr=0.0003 " in printed and " grad_accum=8 " in printed

    a, model, _ = train.resolve_settings({"preset": "wav24"})
    assert (model["wav"], model["n_layer"], a.max_iters, a.max_tokens, a.lr) == (True, 24, 20000, None, 1e-3)
    ckpt = dict(config=dict(model, vocab_size=53), train_args=dataclasses.asdict(a))  # a wav24 run's last.pt
    resumed, config, _ = train.resolve_settings({"max_iters": 30000}, ckpt, "x/last.pt")
    assert config == ckpt["config"] and (resumed.max_iters, resumed.lr, resumed.data) == (30000, 1e-3,
                                                                                          "data/tinystories")
    with pytest.raises(prepare_data.UsageError, match="--n_layer 48 conflicts with x/last.pt's n_layer=24"):
        train.resolve_settings({"preset": "wav48"}, ckpt, "x/last.pt")


# --lr, --min_lr, --warmup_iters, --weight_decay, --beta1, --beta2: the schedule the log shows (warmup 0: the
# peak at once; min_lr at the last step) and AdamW's own settings in the checkpoint
def test_train_optimizer_flags_reach_adamw(_train_data, _train_one_thread, tmp_path):
    demo, _ = _train_data
    argv = ["--data", demo, "--out_dir", tmp_path, *_TRAIN_TINY, "--residual", "prenorm", "--max_iters", 3,
            "--eval_interval", 10, "--lr", 0.01, "--min_lr", 0.001, "--warmup_iters", 0,
            "--weight_decay", 0.05, "--beta1", 0.8, "--beta2", 0.9]
    assert _train_main(train, argv)[0] == 0
    lrs = [r["lr"] for r in _train_metrics(tmp_path) if r["type"] == "train"]
    assert lrs == pytest.approx([0.01, 0.0055, 0.001])
    groups = torch.load(tmp_path / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.05]  # matrices decay, the rest does not
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in groups)
    edge, _, _ = train.resolve_settings({"beta1": 0.0, "beta2": 0.0})
    train.check_settings(edge, 1)  # 0 is in [0, 1): AdamW without momentum, as documented
    a = train.argparse.Namespace(lr=1.0, min_lr=0.0, warmup_iters=0)
    assert train.get_lr(0, a, 5) == 1.0 and train.get_lr(4, a, 5) == pytest.approx(0.0)


# every model flag reaches GPTConfig: summary.json's and last.pt's config, the header and the weights
def test_train_model_flags_reach_the_config(_train_data, _train_one_thread, tmp_path, capsys):
    demo, _ = _train_data
    given = dict(sequence_len=16, n_layer=3, n_head=8, n_embd=32, dropout=0.1, bias=True, residual="attnres",
                 attnres_block=4, wav=True, wav_bases="phase", wav_rho=2.0, wav_detail_bias=-1.0,
                 wav_readout_details=True, wav_learned_bases=True, rd="average", fast_routing=False)
    argv = ["--data", demo, "--out_dir", tmp_path, *_TRAIN_TINY, "--max_iters", 1]
    for name, value in given.items():
        argv += [f"--{name}", value]
    code, text, _ = _train_main(train, argv, capsys)
    assert code == 0, text
    config = json.loads((tmp_path / "summary.json").read_text())["config"]
    assert {k: config[k] for k in given} == given
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ckpt["config"] == config
    assert ("model: 3 layers x 32, 8 heads, sequence_len 16, residual attnres (block 4, wav True, "
            "rd average)") in text
    plain = GPT(GPTConfig(**dict(config, bias=False))).state_dict()
    assert set(ckpt["model"]) == set(GPT(GPTConfig(**config)).state_dict()) > set(plain)  # the biases


# --dtype bfloat16 trains under bf16 autocast on the CPU too; auto and float32 are float32 there
def test_train_dtype_bfloat16_autocasts_and_float32_does_not(_train_data, _train_runs, _train_one_thread,
                                                                tmp_path, capsys):
    demo, _ = _train_data
    _, prenorm = _train_runs  # the same flags, --dtype auto
    argv = ["--data", demo, "--out_dir", tmp_path, *_TRAIN_TINY, "--residual", "prenorm", "--max_iters", 1,
            "--dtype", "bfloat16"]
    code, text, _ = _train_main(train, argv, capsys)
    assert code == 0 and re.search(r"1 process\(es\) on cpu \(\d+ threads? each\), bfloat16;", text)
    auto, bf16 = (_train_metrics(d) for d in (prenorm, tmp_path))
    assert [r["step"] for r in auto] == [r["step"] for r in bf16]
    for a, b in zip(auto, bf16):
        key = "loss" if a["type"] == "train" else "val_loss"
        assert a[key] != b[key] and a[key] == pytest.approx(b[key], abs=0.05)  # rounded, not another model
    cpu = torch.device("cpu")
    assert train.pick_dtype("auto", cpu) == train.pick_dtype("float32", cpu) == torch.float32


# --compile: the model goes through torch.compile (here with the eager backend: inductor would spend a
# minute compiling C++; the wrapper and its parameter names are the same), and the checkpoint's names are plain
def test_train_compile_compiles_and_saves_plain_names(_train_data, _train_runs, _train_one_thread, tmp_path,
                                                       monkeypatch):
    demo, _ = _train_data
    _, prenorm = _train_runs
    compiled, real = [], torch.compile

    def compile_eager(model, **kwargs):
        compiled.append(model)
        return real(model, backend="eager")
    monkeypatch.setattr(torch, "compile", compile_eager)
    argv = ["--data", demo, "--out_dir", tmp_path, *_TRAIN_TINY, "--residual", "prenorm", "--max_iters", 1,
            "--compile"]
    assert _train_main(train, argv)[0] == 0
    assert len(compiled) == 1 and isinstance(compiled[0], GPT)
    state = torch.load(tmp_path / "last.pt", weights_only=True)["model"]
    assert list(state) == list(compiled[0].state_dict())  # no _orig_mod. prefix
    eager = torch.load(prenorm / "last.pt", weights_only=True)["model"]
    assert all(torch.allclose(state[k], eager[k], atol=1e-6) for k in eager)  # the same training step


# -----------------------------------------------------------------------------
# sample.py


def test_sample_prints_text_and_tokens_per_second(_train_runs, _train_one_thread, capsys):
    routed, _ = _train_runs
    code, out, err = _train_main(sample, ["--out_dir", routed, "--num_samples", 2, "--max_new_tokens", 20,
                                          "--start", "Once upon"], capsys)
    assert code == 0 and out.count("Once upon") == 2 and out.count("-" * 40) == 2
    assert "40 tokens in" in err and "tok/s" in err
    code, out, err = _train_main(sample, ["--out_dir", routed, "--num_samples", 1, "--max_new_tokens", 5,
                                          "--start", "x" * 50], capsys)  # sequence_len is 32
    assert code == 0 and "longer than sequence_len=32: using its last 32" in err


# sample.py: a count of zero or less is one line before anything loads (nothing written), and the
# documented bounds themselves are taken: --temperature 1e-6 (--help: ">= 1e-6 and finite")
def test_sample_settings_at_their_bounds(_train_runs, _train_one_thread, capsys):
    routed, _ = _train_runs
    for flag, value in (("--max_new_tokens", 0), ("--max_new_tokens", -5), ("--num_samples", 0)):
        code, out, err = _train_main(sample, ["--out_dir", routed, flag, value], capsys)
        assert (code, out) == (2, "")
        assert err == f"error: {flag} {value}: must be a positive integer\n"
    code, out, _ = _train_main(sample, ["--out_dir", routed, "--num_samples", 1,
                                        "--max_new_tokens", 5, "--temperature", 1e-6], capsys)
    assert code == 0 and out.count("-" * 40) == 1


# sample.py --ckpt last reads last.pt; a folder without the checkpoint asked for says how to train
# one into that very folder (the command, pasted, trains there, not into out/)
def test_sample_ckpt_last_and_the_missing_checkpoint_fix(_train_runs, _train_one_thread, tmp_path,
                                                         capsys):
    routed, _ = _train_runs
    run = tmp_path / "only_last"
    run.mkdir()
    shutil.copy(routed / "last.pt", run / "last.pt")
    flags = ["--out_dir", run, "--num_samples", 1, "--max_new_tokens", 5, "--start", "Once"]
    code, out, err = _train_main(sample, [*flags, "--ckpt", "last"], capsys)
    assert code == 0 and out.startswith("Once"), err
    code, out, err = _train_main(sample, flags, capsys)
    fix = shlex.join(["python", "train.py", "--out_dir", str(run)])
    assert (code, out) == (2, "")
    assert err == f"error: no checkpoint at {run / 'best.pt'}: train one with {fix}\n"


# sample.py: a checkpoint whose config does not build its own weights (an unknown field, a value the
# model refuses, weights of another shape) is one line that names it, not a traceback
def test_sample_checkpoint_that_does_not_fit_its_config_is_one_line(_train_runs, _train_one_thread,
                                                                     tmp_path, capsys):
    routed, _ = _train_runs
    ckpt = torch.load(routed / "best.pt", weights_only=True)
    for name, change, says in (("unknown", dict(colour="blue"), "does not know: colour"),
                               ("invalid", dict(n_head=3), "must be divisible by n_head=3"),
                               ("reshaped", dict(n_embd=64), "shape")):
        (tmp_path / name).mkdir()
        torch.save(dict(ckpt, config={**ckpt["config"], **change}), tmp_path / name / "best.pt")
        path = tmp_path / name / "best.pt"
        code, out, err = _train_main(sample, ["--out_dir", path.parent, "--max_new_tokens", 2], capsys)
        assert (code, out) == (2, "") and err.count("\n") == 1, (name, err)
        assert err.startswith(f"error: checkpoint {path} ") and err.endswith(" retrain\n"), (name, err)
        assert says in err, (name, err)


# sample.py's default char-level prompt is a newline (not printed): the samples are what follows one
def test_sample_default_prompt_is_a_newline(_train_runs, _train_one_thread, capsys):
    routed, _ = _train_runs

    def greedy(*start):
        code, out, _ = _train_main(sample, ["--out_dir", routed, "--num_samples", 1,
                                            "--max_new_tokens", 30, "--top_k", 1, *start], capsys)
        assert code == 0
        return out
    default, after_space = greedy(), greedy("--start", " ")
    assert default == greedy("--start", "\n")[1:]  # --start's prompt is printed
    assert default != after_space[1:]  # the check can see the prompt: the tiny model copies it


# a run made in project/ with --data data/demo (the relative path train.py records), sampled from
# another folder: the data folder is found from the run folder (not a nearer one of another
# dataset); once moved away, the error names --data
def test_sample_finds_the_data_of_a_run_from_another_folder(_train_data, _train_runs,
                                                            _train_one_thread, tmp_path, monkeypatch,
                                                            capsys):
    demo, other = _train_data
    routed, _ = _train_runs
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(demo, project / "data" / "demo")
    decoy = project / "runs" / "data" / "demo"  # another dataset (and vocabulary), the same name
    shutil.copytree(other, decoy)
    meta = json.loads((decoy / "meta.json").read_text())
    (decoy / "meta.json").write_text(json.dumps(dict(meta, dataset="x")))
    (project / "runs" / "r").mkdir(parents=True)
    elsewhere.mkdir()
    ckpt = torch.load(routed / "best.pt", weights_only=True)
    ckpt["train_args"]["data"] = "data/demo"
    torch.save(ckpt, project / "runs" / "r" / "best.pt")
    flags = ["--num_samples", 1, "--max_new_tokens", 5, "--start", "Once"]
    for cwd, out_dir in ((elsewhere, project / "runs" / "r"), (project / "runs" / "r", "."),
                         (project / "runs", "r")):
        monkeypatch.chdir(cwd)
        code, text, err = _train_main(sample, ["--out_dir", out_dir, *flags], capsys)
        assert code == 0 and text.startswith("Once"), (cwd, err)
    shutil.move(project / "data", tmp_path / "moved")
    monkeypatch.chdir(project / "runs" / "r")
    code, _, err = _train_main(sample, ["--out_dir", ".", *flags], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "give --data DIR, the prepared demo dataset" in err, err
    moved = tmp_path / "moved" / "demo"
    assert _train_main(sample, ["--out_dir", ".", "--data", moved, *flags], capsys)[0] == 0


def test_sample_routes_view(_train_runs, _train_one_thread, capsys):
    routed, _ = _train_runs
    code, out, _ = _train_main(sample, ["--out_dir", routed, "--routes", "--start", "Once upon a time"], capsys)
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if "emb" in line and "C0" in line).split()
    assert header == ["emb", "C0", "P", "P.ph", "P.sp", "H"]  # pool order; the readout sees no details
    rows = {line.split()[0]: line for line in lines if line.startswith(("layer", "readout"))}
    assert list(rows) == ["layer0.attn", "layer0.attn.v", "layer0.mlp", "layer1.attn", "layer1.attn.v",
                          "layer1.mlp", "readout"]
    assert "█100" in rows["layer0.attn"]  # the first read sees only the embedding
    assert any(shade in rows["readout"] for shade in "░▒▓")
    js = lines[lines.index(next(line for line in lines if "JS divergence" in line)) + 1:]
    assert [line.split()[0] for line in js] == ["layer1", "mean"]  # layer 0's routes both read e alone


# sample.py --routes: every column label stands apart, also the 5-character detail labels
def test_sample_routes_header_keeps_labels_apart(capsys):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, sequence_len=8, n_layer=4, n_head=2, n_embd=16, residual="attnres",
                          wav=True, attnres_block=4)).eval()
    sample.show_routes(model, tokens(B=1, T=8) % 16, "wav.pt", "a prompt")
    header = next(line for line in capsys.readouterr().out.splitlines() if "emb" in line)
    assert header.split() == ["emb", "C0", "C0.ph", "C0.sp", "C1", "P", "P.ph", "P.sp", "H"]


# sample.py --routes without --start: the prompt is the first sequence_len tokens of val, in full (a
# prompt of exactly sequence_len tokens needs no cropping: no note)
def test_sample_routes_default_prompt_is_the_start_of_val(_train_data, _train_runs, _train_one_thread,
                                                          capsys):
    demo, _ = _train_data
    routed, _ = _train_runs
    meta = prepare_data.load_meta(demo)
    decode = prepare_data.decoder(meta, demo)
    val, train_split = (decode(prepare_data.open_split(demo, split, meta)[:32].tolist())
                        for split in ("val", "train"))
    assert val != train_split
    code, out, err = _train_main(sample, ["--out_dir", routed, "--routes"], capsys)
    assert code == 0 and "sequence_len" not in err, err
    header = f"depth routing of {routed / 'best.pt'} over a 32-token prompt: {val!r}"
    assert out.splitlines()[0] == header


# sample.py --routes draws what its legend says: shade ░ <=25 ▒ <=50 ▓ <=75 █ >75, a JS bar of
# 40 blocks at ln 2, and a long prompt as "..." and its end
def test_sample_routes_shades_bars_and_prompt_follow_the_legend(monkeypatch, capsys):
    reads = {"layer1.attn": [0.25, 0.26, 0.49], "layer1.attn.v": [0.24, 0.51, 0.25],
             "layer1.mlp": [0.75, 0.24, 0.01], "readout": [0.76, 0.23, 0.01]}
    stats = dict(reads={name: dict(sources=["emb", "C0", "P"], mean_weight=w, entropy=1.0)
                        for name, w in reads.items()},
                 sources=["emb", "C0", "P"], js={"layer1": 0.1628, "layer2": math.log(2)},
                 js_mean=0.43)
    monkeypatch.setattr(sample, "routing_stats", lambda routes: stats)
    model = GPT(GPTConfig(vocab_size=16, sequence_len=8, n_layer=2, n_head=2, n_embd=16,
                          residual="attnres")).eval()
    prompt = "Once upon a time, " + "the basket fell into the lake. " * 3 + "Suddenly, it b"
    sample.show_routes(model, tokens(B=1, T=8) % 16, "rd.pt", prompt)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f" prompt: {'...' + prompt[-57:]!r}")
    cells = {line.split()[0]: re.findall(r"([░▒▓█]) *(\d+)", line)
             for line in lines if line.startswith(tuple(reads))}
    assert cells == {"layer1.attn": [("░", "25"), ("▒", "26"), ("▒", "49")],
                     "layer1.attn.v": [("░", "24"), ("▓", "51"), ("░", "25")],
                     "layer1.mlp": [("▓", "75"), ("░", "24"), ("░", "1")],
                     "readout": [("█", "76"), ("░", "23"), ("░", "1")]}
    bars = {line.split()[0]: line.split()[2:] for line in lines if line.startswith("  layer")}
    assert bars == {"layer1": ["█" * 9], "layer2": ["█" * 40]}
    sample.show_routes(model, tokens(B=1, T=8) % 16, "rd.pt", prompt[:60])
    assert capsys.readouterr().out.splitlines()[0].endswith(f" prompt: {prompt[:60]!r}")


def test_gpt2_level_run_and_sample(_train_one_thread, tmp_path, capsys, monkeypatch):
    """A GPT-2-token dataset (a stand-in: random ids, an encoder.json of made-up tokens): no bits per
    char in the logs, --eval_tokens's large-vocabulary default on CPU, and sample.py starts from
    <|endoftext|> (not printed) and decodes through encoder.json."""
    data = tmp_path / "gpt2"
    data.mkdir()
    vocab = prepare_data.GPT2_VOCAB
    tokens = {f"Ġt{i}": i for i in range(vocab - 1)}  # GPT-2 writes a leading space as Ġ
    tokens[prepare_data.EOT] = prepare_data.GPT2_EOT
    (data / "encoder.json").write_text(json.dumps(tokens))
    splits = {"train": 4000, "val": 1000}
    for split, n in splits.items():
        torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).numpy().astype("uint16").tofile(
            data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps(dict(dataset="gpt2_standin", level="gpt2", dtype="uint16",
                                                    vocab_size=vocab, splits=splits, source="test",
                                                    format_version=1)))
    out = tmp_path / "run"
    tiny = _TRAIN_TINY[:_TRAIN_TINY.index("--eval_tokens")] + _TRAIN_TINY[_TRAIN_TINY.index("--eval_tokens") + 2:]
    monkeypatch.setattr(train, "EVAL_TOKENS_CPU_LARGE_VOCAB", 256)  # the real 8K takes ~20 s here
    argv = ["--data", data, "--out_dir", out, *tiny, "--n_layer", 1, "--n_embd", 16, "--sequence_len", 16,
            "--max_iters", 2]
    code, log, _ = _train_main(train, argv, capsys)
    assert code == 0 and "evaluation: 256 tokens per split" in log
    evals = [r for r in _train_metrics(out) if r["type"] == "eval"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train"]["eval_tokens"] == 256
    assert all(e["val_bpc"] is None for e in evals) and summary["level"] == "gpt2"
    assert summary["final"]["val_bpc"] is None and summary["final"]["test_loss"] is None  # no test split
    code, text, err = _train_main(sample, ["--out_dir", out, "--num_samples", 1, "--max_new_tokens", 4], capsys)
    assert code == 0 and text.count(" t") >= 3 and "4 tokens in" in err
    assert prepare_data.EOT not in text and text.startswith(" t")  # the default prompt is not printed



# sampling: temperature and top-k draw from softmax(logits / T) over the k likeliest tokens
def _sample_counts_fit(counts, probs, n):
    """Each token's count within 6 binomial standard deviations of n*p: a fixed-seed draw from the
    right distribution passes (a miss has odds of about 1e-8 per token), a wrong distribution fails."""
    sd = torch.sqrt(n * probs * (1 - probs))
    return bool(((counts - n * probs).abs() <= 6 * sd + 1).all())


def _sample_probs(logits, temperature, k):
    probs = torch.zeros_like(logits, dtype=torch.float64)
    top = logits.topk(k).indices
    probs[top] = torch.softmax(logits[top].double() / temperature, 0)
    return probs


@pytest.mark.parametrize("temperature,top_k", [(0.7, 5), (1.6, None)])
def test_generate_draws_from_softmax_over_temperature_among_top_k(temperature, top_k):
    model = make_model()
    with torch.no_grad():  # spread the logits over a few units, so that temperature matters
        model.lm_head.weight.normal_(0, 0.3)
        prompt, n = tokens(B=1, T=3), 20000
        logits = model(prompt)[0][0, -1]
        torch.manual_seed(0)
        drawn = model.generate(prompt.expand(n, -1), 1, temperature, top_k)[:, -1]
    counts = torch.bincount(drawn, minlength=VOCAB).double()
    k = top_k or VOCAB
    probs = _sample_probs(logits, temperature, k)
    assert counts[probs == 0].sum() == 0  # only the top k tokens appear
    assert _sample_counts_fit(counts, probs, n)
    # the check has the power to see the usual mistakes: no temperature, top-k off by one
    assert not _sample_counts_fit(counts, _sample_probs(logits, 1.0, k), n)
    for wrong_k in (k - 1, k + 1) if top_k else ():
        assert not _sample_counts_fit(counts, _sample_probs(logits, temperature, wrong_k), n)


# sampling: the same --seed writes the same text, run to run; another seed writes another
def test_sample_same_seed_same_text(_train_runs, _train_one_thread, capsys):
    routed, _ = _train_runs
    texts = []
    for seed in (5, 5, 6):
        code, out, _ = _train_main(sample, ["--out_dir", routed, "--num_samples", 2, "--max_new_tokens", 30,
                                            "--temperature", 1.0, "--seed", seed], capsys)
        assert code == 0
        texts.append(out)
    assert texts[0] == texts[1] and texts[0] != texts[2]



# sampling: sample.py hands --temperature and --top_k to generate
def test_sample_temperature_and_top_k_reach_generate(_train_runs, _train_one_thread, capsys):
    routed, _ = _train_runs

    def text(*flags):
        return _train_main(sample, ["--out_dir", routed, "--num_samples", 2, "--max_new_tokens", 30, *flags],
                           capsys)[1]
    greedy = text("--top_k", 1, "--seed", 1)
    assert text("--top_k", 1, "--seed", 2) == greedy  # top_k 1 is greedy, whatever the seed
    assert text("--temperature", 1e-4, "--seed", 3) == greedy  # so is a near-zero temperature
    assert text("--temperature", 1.0, "--seed", 3) != greedy

# sampling: a prompt longer than the context keeps its last sequence_len tokens
def test_sample_long_prompt_keeps_its_end(_train_runs, _train_one_thread, capsys):
    routed, _ = _train_runs
    prompt = "Lily saw a cat. " * 3 + "Tom ran to the big park."  # sequence_len is 32
    code, out, err = _train_main(sample, ["--out_dir", routed, "--num_samples", 1, "--max_new_tokens", 3,
                                          "--start", prompt], capsys)
    assert code == 0 and "using its last 32" in err
    assert out.startswith(prompt[-32:]) and not out.startswith(prompt[:32])

# --ckpt: best (the default) reads best.pt, last reads last.pt (here a folder whose two files are two runs)
def test_sample_ckpt_best_and_last_read_their_files(_train_runs, _train_one_thread, tmp_path, capsys):
    routed, prenorm = _train_runs
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(routed / "best.pt", mixed / "best.pt")
    shutil.copy(prenorm / "last.pt", mixed / "last.pt")

    def run(out_dir, *flags):
        return _train_main(sample, ["--out_dir", out_dir, "--num_samples", 1, "--max_new_tokens", 20,
                                    "--temperature", 1.0, "--seed", 3, *flags], capsys)
    assert run(mixed)[:2] == run(mixed, "--ckpt", "best")[:2] == run(routed)[:2]
    assert run(mixed, "--ckpt", "last")[:2] == run(prenorm, "--ckpt", "last")[:2]
    code, out, _ = run(mixed, "--routes")
    assert code == 0 and out.startswith(f"depth routing of {mixed / 'best.pt'} ")
    code, _, err = run(mixed, "--routes", "--ckpt", "last")  # the prenorm run's
    assert code == 2 and f"{mixed / 'last.pt'} is a residual=prenorm model" in err


# --start FILE:path reads the prompt from that file; --num_samples and --max_new_tokens give that many samples
# of exactly that many new characters; the default prompt (a newline) is not printed; --routes without --start
# reads the first sequence_len tokens of val
# sample.py: an empty prompt file and a NaN temperature are one line each, exit 2, no traceback
def test_sample_empty_prompt_file_and_nan_temperature_are_one_line(_train_runs, tmp_path, capsys):
    routed, _ = _train_runs
    (tmp_path / "empty.txt").write_text("")
    cases = {("--start", f"FILE:{tmp_path / 'empty.txt'}"): "--start is empty: give at least one character",
             ("--temperature", "nan"): "--temperature nan: must be > 0, at least 1e-06 and finite"}
    for flags, message in cases.items():
        code, _, err = _train_main(sample, ["--out_dir", routed, "--device", "cpu", *flags], capsys)
        assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_sample_start_file_and_the_default_prompt(_train_data, _train_runs, _train_one_thread, tmp_path,
                                                  monkeypatch, capsys):
    demo, _ = _train_data
    routed, _ = _train_runs
    prompt = "Tom saw a cat."
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # a relative FILE: path is read from the working folder

    def run(*flags):
        return _train_main(sample, ["--out_dir", routed, "--device", "cpu", "--seed", 1, *flags], capsys)
    code, out, err = run("--start", "FILE:prompt.txt", "--num_samples", 2, "--max_new_tokens", 7)
    samples = out.split("-" * 40 + "\n")
    assert code == 0 and len(samples) == 3 and samples[-1] == "" and "14 tokens in" in err
    # each sample: the prompt, 7 new characters and print's newline
    assert all(s.startswith(prompt) and len(s) == len(prompt) + 7 + 1 for s in samples[:2])
    assert run("--start", prompt, "--num_samples", 2, "--max_new_tokens", 7)[1] == out
    code, _, err = run("--start", "FILE:missing.txt")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "missing.txt" in err

    code, default, _ = run("--num_samples", 1, "--max_new_tokens", 9)
    assert code == 0 and len(default.split("-" * 40 + "\n")[0]) == 9 + 1
    assert run("--start", "\n", "--num_samples", 1, "--max_new_tokens", 9)[1] == "\n" + default

    code, out, _ = run("--routes")
    meta = prepare_data.load_meta(demo)
    val = prepare_data.decoder(meta, demo)(prepare_data.open_split(demo, "val")[:32].tolist())
    assert code == 0 and f"over a 32-token prompt: {val!r}" in out.splitlines()[0]



# sampling: GPT-2 decoding joins bytes before UTF-8, so multi-byte characters split over tokens survive
def test_gpt2_decoding_round_trips_multibyte_characters(tmp_path):
    for name, data in _data_gpt2_files().items():
        (tmp_path / name).write_bytes(data)
    meta = dict(level="gpt2", vocab_size=prepare_data.GPT2_VOCAB)
    decode = prepare_data.decoder(meta, tmp_path)
    for text in ("café", "日本", "🙂 ok", " the é\n日本🙂<|endoftext|>"):
        ids = list(text.removesuffix(prepare_data.EOT).encode("utf-8"))  # one token per byte
        ids += [prepare_data.GPT2_EOT] if text.endswith(prepare_data.EOT) else []
        assert decode(ids) == text
    assert decode([258, 195, 169]) == " theé"  # a merged token, then é's two bytes

# -----------------------------------------------------------------------------
# Bad input: one line on stderr, exit code 2, no traceback. Each case runs the script as __main__ with
# its argv, as `python train.py ...` does; all of them in one fresh Python process (one torch import),
# and three also as separate `python script.py` commands.

_TRAIN_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv, err = argv, io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()  # what the interpreter prints for an uncaught exception
            code = 1
    results.append((code, err.getvalue()))
print(json.dumps(results))
"""
_TRAIN_SEPARATE = ("missing dataset", "unknown preset", "corrupt checkpoint (sample)")
_TRAIN_OWN_PROCESS = ("compile fails",)  # only in a process of its own: it must also end (no worker keeps it)
# torch.compile whose compiler fails inside the first step, as inductor without a working C++ compiler: its pool
# of compile workers starts first (where it has one), then the backend raises
_TRAIN_COMPILE_FAILS = """
import runpy, sys, torch
from torch._inductor.async_compile import AsyncCompile
def failing(graph, example_inputs):
    AsyncCompile.warm_pool()
    raise RuntimeError("the C++ compiler failed")
real = torch.compile
torch.compile = lambda model, **kwargs: real(model, backend=failing)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _train_bad_cases(demo, other, routed, prenorm, tmp):
    corrupt = tmp / "corrupt"
    shutil.copytree(routed, corrupt)
    for name in ("last.pt", "best.pt"):
        data = (corrupt / name).read_bytes()
        (corrupt / name).write_bytes(data[:len(data) // 2])
    vocab = prepare_data.load_meta(demo)["vocab_size"]
    t = ["train.py", "--data", demo, *_TRAIN_TINY, "--residual", "prenorm", "--max_iters", 1]
    faulty = _train_faulty_inputs(demo, routed, prenorm, tmp)
    return {
        "missing dataset": (["train.py", "--data", tmp / "datasets" / "tinystories"],
                            "run: python prepare_data.py tinystories --out"),
        "vocab flag differs": ([*t, "--vocab_size", 7, "--out_dir", tmp / "v"],
                               f"--vocab_size 7 differs from dataset {demo}'s vocab_size {vocab}"),
        "resume without checkpoint": ([*t, "--out_dir", tmp / "empty", "--resume"], "--resume: no checkpoint at"),
        "resume with other config": (["train.py", "--out_dir", routed, "--resume", "--n_layer", 3],
                                     f"--n_layer 3 conflicts with {routed / 'last.pt'}'s n_layer=2"),
        "resume with other vocab": (["train.py", "--out_dir", routed, "--resume", "--data", other],
                                    f"has vocab_size {vocab + 1} but {routed / 'last.pt'} was trained with {vocab}"),
        "run already there": ([*t, "--out_dir", routed], "already holds a run"),
        "corrupt checkpoint (train)": (["train.py", "--out_dir", corrupt, "--resume"],
                                       f"checkpoint {corrupt / 'last.pt'} is corrupt or truncated"),
        "corrupt checkpoint (sample)": (["sample.py", "--out_dir", corrupt],
                                        f"checkpoint {corrupt / 'best.pt'} is corrupt or truncated"),
        "batch larger than data": ([*t, "--batch_size", 10 ** 5, "--out_dir", tmp / "b"],
                                   "is larger than the training data"),
        "sequence longer than val": ([*t, "--batch_size", 1, "--sequence_len", 20_000, "--n_head", 1,
                                      "--out_dir", tmp / "s"], "--sequence_len 20000 is longer than the val split"),
        "invalid config": ([*t, "--n_head", 3, "--out_dir", tmp / "c"], "n_embd=32: must be divisible by n_head=3"),
        "unknown flag": (["train.py", "--lernrate", 1], "unrecognized arguments: --lernrate"),
        "unknown preset": (["train.py", "--preset", "gpt5"], "invalid choice: 'gpt5'"),
        "bad bool": (["train.py", "--wav", "maybe"], "expected True/False/1/0"),
        "prompt outside vocabulary": (["sample.py", "--out_dir", routed, "--start", "snow☃man é"],
                                      "characters not in the demo vocabulary: 'é' '☃'"),
        "temperature zero": (["sample.py", "--out_dir", routed, "--temperature", 0], "--temperature 0.0: must be > 0"),
        "temperature negative": (["sample.py", "--out_dir", routed, "--temperature", -1], "--temperature -1.0"),
        "top_k zero": (["sample.py", "--out_dir", routed, "--top_k", 0], "--top_k 0: must be >= 1"),
        "sample other vocab": (["sample.py", "--out_dir", routed, "--data", other], "trained with"),
        "routes without routing": (["sample.py", "--out_dir", prenorm, "--routes"], "has no depth routing"),
        # issue 12: out_dir faults, data that disagrees with meta.json, optimizer and sampling ranges,
        # foreign checkpoints, damaged run folders, bench flags
        "out_dir is a file": ([*t, "--out_dir", faulty["file"]], f"cannot write to output folder {faulty['file']}"),
        "out_dir under a file": ([*t, "--out_dir", faulty["file"] / "run"], "cannot write to output folder"),
        "out_dir in use": ([*t, "--out_dir", faulty["locked"]], f"is in use by another train.py (pid {os.getpid()}"),
        "token id beyond vocab": (["train.py", "--data", faulty["big_ids"], *_TRAIN_TINY, "--residual", "prenorm",
                                   "--out_dir", tmp / "ids"],
                                  f"holds token id 250, but meta.json's vocab_size is {vocab}"),
        "dtype disagrees with meta": (["train.py", "--data", faulty["dtype"], *_TRAIN_TINY, "--residual", "prenorm",
                                       "--out_dir", tmp / "dt"], f"says dtype uint16 for vocab_size {vocab}"),
        "beta1 too large": ([*t, "--beta1", 2.0, "--out_dir", tmp / "b1"], "--beta1 2.0: must be in [0, 1)"),
        "beta2 negative": ([*t, "--beta2", -0.5, "--out_dir", tmp / "b2"], "--beta2 -0.5: must be in [0, 1)"),
        "temperature tiny": (["sample.py", "--out_dir", routed, "--temperature", 1e-45], "--temperature 1e-45: must"),
        "temperature inf": (["sample.py", "--out_dir", routed, "--temperature", "inf"], "--temperature inf: must"),
        "malicious checkpoint (sample)": (["sample.py", "--out_dir", faulty["evil"]], "it holds Python objects"),
        "malicious checkpoint (train)": (["train.py", "--out_dir", faulty["evil"], "--resume"],
                                         "it holds Python objects"),
        "report: summary is a list": (["experiments.py", "report", faulty["exp_list"]], "summary.json is damaged"),
        "report: summary lacks final": (["experiments.py", "report", faulty["exp_final"]], "(no final val_loss)"),
        "report: summary not JSON": (["experiments.py", "report", faulty["exp_json"]], "(not valid JSON"),
        "report: heatmap of unknown variant": (["experiments.py", "report", faulty["exp_foo"], "--heatmap", "foo_run"],
                                               "--heatmap foo_run: a foo run has no depth routes"),
        "bench: unknown variant": (["bench.py", "--variants", "foo"], "unknown variant(s) foo"),
        # issue 21: every input checked where it enters, every fault one line
        "seed beyond torch's range": ([*t, "--seed", 2 ** 70, "--out_dir", tmp / "sd"],
                                      f"--seed {2 ** 70}: must be an integer from 0 to 2**63 - 1"),
        "seed beyond torch's range (sample)": (["sample.py", "--out_dir", routed, "--seed", 2 ** 64],
                                               f"--seed {2 ** 64}: must be an integer from 0 to 2**63 - 1"),
        "seed negative (sample)": (["sample.py", "--out_dir", routed, "--seed", -1], "--seed -1: must be"),
        "lr inf": ([*t, "--lr", "inf", "--out_dir", tmp / "lr"], "--lr inf: must be a finite number >= 0"),
        "min_lr inf": ([*t, "--min_lr", "inf", "--out_dir", tmp / "mlr"], "--min_lr inf: must be a finite number"),
        "grad_clip inf": ([*t, "--grad_clip", "inf", "--out_dir", tmp / "gc"], "--grad_clip inf: must be a finite"),
        "weight_decay nan": ([*t, "--weight_decay", "nan", "--out_dir", tmp / "wd"], "--weight_decay nan: must be"),
        "out_dir empty": ([*t, "--out_dir", ""], "--out_dir '': give a folder name, e.g. --out_dir out"),
        "out_dir empty (sample)": (["sample.py", "--out_dir", ""], "--out_dir '': give a folder name"),
        "data empty": (["train.py", "--data", "", *_TRAIN_TINY, "--out_dir", tmp / "de"],
                       "--data '': give the folder of a prepared dataset"),
        "eval_tokens too many": ([*t, "--eval_tokens", 10 ** 15, "--out_dir", tmp / "et"],
                                 f"--eval_tokens {10 ** 15}: at most 1,000,000,000 tokens per split"),
        **{f"checkpoint {what}{' (sample)' * sampled}": (
            ["sample.py", "--out_dir", faulty[what]] if sampled else ["train.py", "--out_dir", faulty[what], "--resume"],
            f"checkpoint {faulty[what] / ('best.pt' if sampled else 'last.pt')} {words}")
           for what, (_, words) in _TRAIN_EDITED.items() for sampled in (False, True)
           if not sampled or what in _TRAIN_EDITED_SAMPLED},
        "resume on other characters": (["train.py", "--out_dir", routed, "--resume", "--data", faulty["chars"]],
                                       f"dataset {faulty['chars']} is not the one {routed / 'last.pt'} was trained "
                                       f"on: other characters, as many (id 0 is"),
        "resume on another dataset": (["train.py", "--out_dir", routed, "--resume", "--data", faulty["renamed"]],
                                      f"is not the one {routed / 'last.pt'} was trained on: its dataset is "
                                      "mine, the checkpoint's demo; resume with the --data it was trained on"),
        "sample on other characters": (["sample.py", "--out_dir", routed, "--data", faulty["chars"]],
                                       "other characters, as many (id 0 is"),
        "prompt file not UTF-8": (["sample.py", "--out_dir", routed, "--start", f"FILE:{faulty['latin1']}"],
                                  f"{faulty['latin1']} is not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8"),
        "compile fails": ([faulty["compile"], _TRAIN_ROOT / t[0], *t[1:], "--compile", "True", "--out_dir", tmp / "cf"],
                          "error: torch.compile failed (RuntimeError: the C++ compiler failed); run with --compile "
                          "False (the same model, only slower)"),
        # 2 layers x 32 positions x 32 wide, keys and values, float32: 16 KiB a sample, checked before allocating
        "num_samples too many": (["sample.py", "--out_dir", routed, "--num_samples", 10 ** 8, "--max_new_tokens", 2],
                                 f"--num_samples {10 ** 8:} needs a 1,638.4 GB KV cache (2 layers x 32 positions x "
                                 "32 wide, keys and values, per sample) but cpu has"),
        **({} if torch.cuda.is_available() else {
            "bench: cuda without CUDA": (["bench.py", "--device", "cuda"], "CUDA is not available here")}),
    }


# checkpoints of another layout (issue 21): edit, and the words of the error
_FIT, _OURS = "does not fit its own config's model: its ", "is not one this train.py writes: its "
_TRAIN_EDITED = {
    "lacking a tensor": (lambda c: c["model"].pop("wte.weight"), _FIT + "model lacks wte.weight"),
    "with an extra tensor": (lambda c: c["model"].update(extra=torch.zeros(2)),
                             _FIT + "model has tensors this one has not: extra"),
    "with another shape": (lambda c: c["model"].update({"lm_head.weight": c["model"]["lm_head.weight"][:-1]}),
                           _FIT + "model has other shapes for lm_head.weight"),
    "lacking an optimizer group": (lambda c: c["optimizer"]["param_groups"].pop(),
                                   _FIT + "optimizer has 1 parameter groups, this model's 2"),
    "with a smaller optimizer group": (lambda c: c["optimizer"]["param_groups"][0]["params"].pop(),
                                       _FIT + "optimizer's group 0 has"),
    "with optimizer states of another shape": (
        lambda c: c["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)),
        _FIT + "optimizer's state 0 fits none of this model's parameters"),
    "without vocab_size": (lambda c: c["config"].pop("vocab_size"), _OURS + "config has no vocab_size"),
    "with an unknown config field": (lambda c: c["config"].update(flux=3),
                                     _OURS + "config has fields this GPTConfig does not know: flux"),
    "with a training arg of another type": (lambda c: c["train_args"].update(lr="fast"),
                                            _OURS + "train_args lr='fast' is not of the type float"),
}
_TRAIN_EDITED_SAMPLED = ("lacking a tensor", "with an extra tensor", "without vocab_size",
                         "with an unknown config field")


def _train_edited_run(routed, folder, edit):
    shutil.copytree(routed, folder)
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(folder / name, weights_only=True)
        edit(ckpt)
        torch.save(ckpt, folder / name)
    return folder


class _TrainEvil:
    """Unpickling this runs os.mkdir(path): a checkpoint that executes code when loaded unsafely."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _train_faulty_inputs(demo, routed, prenorm, tmp):
    """Folders for the issue 12 and 21 cases: a file where a folder should be, a locked out_dir, datasets
    that disagree with their meta.json or are another one of the same size, a malicious checkpoint,
    checkpoints of another layout, damaged run folders, a prompt file that is not UTF-8."""
    made = dict(file=tmp / "a_file", locked=tmp / "locked", big_ids=tmp / "big_ids", dtype=tmp / "dtype",
                evil=tmp / "evil", exp_list=tmp / "exp_list", exp_final=tmp / "exp_final",
                exp_json=tmp / "exp_json", exp_foo=tmp / "exp_foo")
    made["file"].write_text("not a folder")
    made["locked"].mkdir()
    (made["locked"] / "train.lock").write_text(f"{os.getpid()}\n")  # pytest's own pid: alive
    shutil.copytree(demo, made["big_ids"])
    with open(made["big_ids"] / "train.bin", "r+b") as f:
        f.seek(12345)
        f.write(bytes([250]))  # same size, one id outside the vocabulary
    shutil.copytree(demo, made["dtype"])
    meta = json.loads((made["dtype"] / "meta.json").read_text())
    for split in meta["splits"]:  # the same bytes read as uint16: half as many tokens
        path = made["dtype"] / f"{split}.bin"
        path.write_bytes(path.read_bytes()[:meta["splits"][split] // 2 * 2])
        meta["splits"][split] //= 2
    (made["dtype"] / "meta.json").write_text(json.dumps(dict(meta, dtype="uint16")))
    made["evil"].mkdir()
    for name in ("last.pt", "best.pt"):
        torch.save(dict(model=_TrainEvil(tmp / "pwned")), made["evil"] / name)
    for key, text in (("exp_list", "[]"), ("exp_final", '{"config": {}}'), ("exp_json", '{"final": ')):
        (made[key] / "r1").mkdir(parents=True)
        (made[key] / "r1" / "summary.json").write_text(text)
    shutil.copytree(prenorm, made["exp_foo"] / "foo_run")
    (made["exp_foo"] / "foo_run" / "run.json").write_text(json.dumps(dict(variant="foo", seed=0)))
    for what, (edit, _) in _TRAIN_EDITED.items():
        made[what] = _train_edited_run(routed, tmp / f"ckpt {what}", edit)
    for key, change in (("chars", lambda m: m.update(chars=m["chars"][::-1])),
                        ("renamed", lambda m: m.update(dataset="mine"))):  # the same vocab_size
        made[key] = tmp / key
        shutil.copytree(demo, made[key])
        meta = json.loads((made[key] / "meta.json").read_text())
        change(meta)
        (made[key] / "meta.json").write_text(json.dumps(meta))
    made["compile"] = tmp / "compile_fails.py"
    made["compile"].write_text(_TRAIN_COMPILE_FAILS)
    made["latin1"] = tmp / "latin1.txt"
    made["latin1"].write_bytes("café".encode("latin-1"))
    return made


@pytest.fixture(scope="module")
def _train_bad_results(_train_data, _train_runs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_bad")
    cases = _train_bad_cases(*_train_data, *_train_runs, tmp)
    argvs = {name: [str(_TRAIN_ROOT / argv[0]), *map(str, argv[1:])] for name, (argv, _) in cases.items()}

    def run(cmd):  # in a scratch folder: the default --out_dir out and data/ are never the repository's
        return subprocess.run(cmd, capture_output=True, text=True, env=_train_env(), cwd=tmp, timeout=600)

    in_driver = [name for name in argvs if name not in _TRAIN_OWN_PROCESS]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        driver = pool.submit(run, [sys.executable, "-c", _TRAIN_DRIVER, json.dumps([argvs[n] for n in in_driver])])
        separate = {name: pool.submit(run, [sys.executable, *argvs[name]])
                    for name in (*_TRAIN_SEPARATE, *_TRAIN_OWN_PROCESS)}
        assert driver.result().returncode == 0, driver.result().stderr[-2000:]
        results = dict(zip(in_driver, json.loads(driver.result().stdout)))
        results.update({f"{name} [own process]": (f.result().returncode, f.result().stderr)
                        for name, f in separate.items()})
    return {name: (*result, cases[name.removesuffix(" [own process]")][1]) for name, result in results.items()}


_TRAIN_BAD = ["missing dataset", "vocab flag differs", "resume without checkpoint", "resume with other config",
              "resume with other vocab", "run already there", "corrupt checkpoint (train)",
              "corrupt checkpoint (sample)", "batch larger than data", "sequence longer than val", "invalid config",
              "unknown flag", "unknown preset", "bad bool", "prompt outside vocabulary", "temperature zero",
              "temperature negative", "top_k zero", "sample other vocab", "routes without routing",
              "out_dir is a file", "out_dir under a file", "out_dir in use", "token id beyond vocab",
              "dtype disagrees with meta", "beta1 too large", "beta2 negative", "temperature tiny", "temperature inf",
              "malicious checkpoint (sample)", "malicious checkpoint (train)", "report: summary is a list",
              "report: summary lacks final", "report: summary not JSON", "report: heatmap of unknown variant",
              "bench: unknown variant", *(() if torch.cuda.is_available() else ("bench: cuda without CUDA",)),
              "seed beyond torch's range", "seed beyond torch's range (sample)", "seed negative (sample)", "lr inf",
              "min_lr inf", "grad_clip inf", "weight_decay nan", "out_dir empty", "out_dir empty (sample)",
              "data empty", "eval_tokens too many", *(f"checkpoint {what}" for what in _TRAIN_EDITED),
              *(f"checkpoint {what} (sample)" for what in _TRAIN_EDITED_SAMPLED), "resume on other characters",
              "resume on another dataset", "sample on other characters", "prompt file not UTF-8",
              "num_samples too many",
              *(f"{name} [own process]" for name in (*_TRAIN_SEPARATE, *_TRAIN_OWN_PROCESS))]


@pytest.mark.parametrize("case", _TRAIN_BAD)
def test_bad_input_exits_2_with_a_clear_message(_train_bad_results, case):
    code, stderr, message = _train_bad_results[case]
    assert code == 2, stderr
    assert message in stderr
    assert "Traceback" not in stderr
    assert "usage:" in stderr or stderr.strip().splitlines()[-1].startswith("error: ")


# a damaged or malicious checkpoint: our own line, nothing run, no hint at weights_only=False
def test_foreign_checkpoint_is_reported_in_our_words_and_never_run(_train_bad_results, tmp_path_factory):
    for case in ("corrupt checkpoint (train)", "corrupt checkpoint (sample)", "malicious checkpoint (sample)",
                 "malicious checkpoint (train)"):
        code, stderr, _ = _train_bad_results[case]
        assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert "weights_only" not in stderr and "Re-running" not in stderr and "torch.load" not in stderr, stderr
    assert not list(tmp_path_factory.getbasetemp().rglob("pwned"))


# flags are never abbreviated (--max_iter is not taken as --max_iters) and a misspelt one is one
# line that names the flag meant; the rest of each command would run (a taken abbreviation: exit 0)
@pytest.mark.parametrize("script,argv,meant", [
    ("train", ["--max_iter", "5"], "--max_iters"), ("train", ["--lerning_rate", "1"], "--lr"),
    ("sample", ["--num_sample", "1"], "--num_samples"), ("bench", ["--iter", "1"], "--iters")])
def test_flags_are_never_abbreviated_and_a_misspelling_names_the_flag(
        _train_data, _train_runs, _train_one_thread, tmp_path, capsys, script, argv, meant):
    demo, _ = _train_data
    routed, _ = _train_runs
    rest = {"train": ["--data", demo, "--out_dir", tmp_path / "run", *_TRAIN_TINY, "--max_iters",
                      1],
            "sample": ["--out_dir", routed, "--max_new_tokens", 2],
            "bench": ["--shape", "tiny", "--device", "cpu", "--variants", "prenorm", "--warmup", 0,
                      "--gen_tokens", 0]}[script]
    module = {"train": train, "sample": sample, "bench": bench}[script]
    code, _, err = _train_main(module, [*argv, *rest], capsys)
    assert code == 2
    wrong = " ".join(argv)
    assert err == f"error: unrecognized arguments: {wrong} (did you mean {meant}?); see --help\n"


# bool flags take True/False/1/0 in any case (--help's epilog); alone they mean True
def test_bool_flags_take_true_false_1_0_and_alone_mean_true():
    parser = train.build_parser()
    for text, value in [("True", True), ("true", True), ("1", True), ("False", False), ("false", False),
                        ("0", False)]:
        a = parser.parse_args(["--wav", text, "--resume", text])
        assert a.wav is value and a.resume is value, text
    assert parser.parse_args(["--wav"]).wav is True


# --help lists every flag with its help: each TrainSettings and GPTConfig field, one way
def test_train_help_lists_every_flag_with_its_help(capsys):
    code, text, _ = _train_main(train, ["--help"], capsys)
    flat = " ".join(text.split())  # argparse wraps the help text
    fields = [*dataclasses.fields(train.TrainSettings), *dataclasses.fields(GPTConfig)]
    assert code == 0 and len(fields) == 27 + len(dataclasses.fields(GPTConfig))
    for f in fields:
        assert f"--{f.name} " in flat and " ".join(f.metadata["help"].split()) in flat, f.name
    assert "--max_tokens N token budget" in flat
    assert "(default: 128 here; GPTConfig's is 384)" in flat


# -----------------------------------------------------------------------------
# Benchmark: bench.py runs and its ratios are consistent

def _bench_run(tmp_path, *extra):
    path = tmp_path / "bench.json"
    out = bench.main(["--shape", "tiny", "--device", "cpu", "--iters", "2", "--warmup", "1",
                      "--gen_tokens", "4", "--gen_repeats", "1", "--json", str(path), *extra])
    with open(path) as f:
        data = json.load(f)
    assert data["variants"].keys() == out["variants"].keys()
    return data


def test_bench_helpers():
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.ratios({"prenorm": 2.0, "block": 3.0}, "prenorm") == {"prenorm": 1.0, "block": 1.5}
    assert bench.ratios({"block": 3.0}, "prenorm") == {}
    s = bench.summarize([0.003, 0.001, 0.002], tokens_per_step=100)
    assert s["ms_median"] == pytest.approx(2.0) and s["ms_min"] == pytest.approx(1.0)
    assert s["tokens_per_s"] == pytest.approx(100 / 0.002)
    with pytest.raises(prepare_data.UsageError, match="--variants"):
        bench.parse_list("prenorm,nope", "--variants")
    # per-round ratios: a machine that slows down by 2x halfway changes no paired ratio
    times = {"prenorm": [1.0, 1.0, 2.0, 2.0, 2.0], "block": [1.1, 1.2, 2.2, 2.4, 2.6]}
    paired = bench.paired_ratios(times, "prenorm")
    assert paired["prenorm"] == (1.0, 1.0, 1.0)
    assert paired["block"] == pytest.approx((1.2, 1.1, 1.2))
    assert bench.paired_ratios(times, "wav") == {}


# bench.py: the CPU memory count is parameters + gradients + AdamW state + what the forward saves
def test_bench_cpu_memory_count_adds_every_part():
    model = make_model()
    opt = model.configure_optimizers(0.1, 1e-3)
    x, y, amp = tokens(), tokens(seed=4), contextlib.nullcontext()
    bench.train_step(model, opt, x, y, amp)  # AdamW's state exists after a step
    n = sum(p.numel() for p in model.parameters())  # float32; the tied embedding counts once
    params, state = bench.static_bytes(model, opt)
    assert sum(params.values()) == 4 * n and state >= 2 * 4 * n  # two moments per parameter (and steps)
    exclude = set(params) | {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved = bench.saved_bytes(model, x, y, amp, exclude)
    assert saved > 0
    assert bench.memory_bytes(model, model, opt, x, y, amp, "cpu") == 4 * n + 4 * n + state + saved

def test_bench_smoke(tmp_path):
    data = _bench_run(tmp_path)
    variants = data["variants"]
    assert list(variants) == list(bench.VARIANTS)  # every variant, in the interleaving order
    for name, v in variants.items():
        assert math.isfinite(v["ms_median"]) and v["ms_median"] > 0, name
        assert len(v["ms_all"]) == 2 and v["ms_min"] <= v["ms_median"]
        assert v["tokens_per_s"] == pytest.approx(2 * 32 / (v["ms_median"] / 1e3))
        assert v["ratio_prenorm"] == pytest.approx(v["ms_median"] / variants["prenorm"]["ms_median"])
        assert v["ratio_block"] == pytest.approx(v["ms_median"] / variants["block"]["ms_median"])
        assert v["memory_bytes"] > 0
        assert v["memory_ratio_prenorm"] == pytest.approx(v["memory_bytes"] / variants["prenorm"]["memory_bytes"])
        rounds = [t / b for t, b in zip(v["ms_all"], variants["block"]["ms_all"])]
        assert v["paired_ratio_block"][0] == pytest.approx(statistics.median(rounds))
    # the counted footprint is at least params + grads + AdamW moments (4 fp32 copies of the parameters)
    assert variants["prenorm"]["memory_bytes"] >= 4 * 4 * variants["prenorm"]["params"]
    gen = data["generation"]
    assert gen["new_tokens"] == 4
    assert set(gen["variants"]) == {"prenorm", "block", "wav", "rd"}
    for name, g in gen["variants"].items():
        assert g["kv_ms"] > 0 and g["recompute_ms"] > 0, name
        assert g["speedup"] == pytest.approx(g["recompute_ms"] / g["kv_ms"])
        assert g["same_tokens"], name  # KV cache and full recompute decode the same tokens
    assert data["machine"]["torch"] and data["args"]["shape"] == "tiny"


# bench.py's arithmetic, checked exactly on a simulated machine: the real steps and generations run,
# but bench.py's clock reads a counter that each of them advances by a set cost times the machine's
# slowness(n) at that moment (n: the steps and generations before it)
def _simulated_machine(monkeypatch, slowness):
    clock = types.SimpleNamespace(now=0.0, n=0)

    def spend(seconds):
        clock.now += seconds * slowness(clock.n)
        clock.n += 1

    step, generate, recompute = bench.train_step, nanoroute.GPT.generate, bench.generate_recompute

    def train_step(model, *rest):  # PreNorm 10 ms a step, other variants 15 ms; --against's code 2x
        step(model, *rest)
        other = type(model).__module__ == "nanoroute_against"
        spend((0.010 if model.config.residual == "prenorm" else 0.015) * (2 if other else 1))

    def kv(model, idx, n, **kw):  # 1 ms a token with the KV cache
        out = generate(model, idx, n, **kw)
        spend(0.001 * n)
        return out

    def full(model, idx, n):  # 4 ms a token recomputed
        out = recompute(model, idx, n)
        spend(0.004 * n)
        return out

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(bench, "train_step", train_step)
    monkeypatch.setattr(nanoroute.GPT, "generate", kv)
    monkeypatch.setattr(bench, "generate_recompute", full)


def test_bench_interleaved_rounds_cancel_a_slowdown_out_of_the_ratios(tmp_path, monkeypatch, capsys):
    # a machine 3x slower from the third timed round on: the medians move, the per-round ratios do
    # not, as round i of every variant and version ran side by side (4 timed names a round; each
    # model's first step, then 1 warm-up round, are not timed)
    _simulated_machine(monkeypatch, lambda n: 3 if n >= (1 + 1 + 2) * 4 else 1)
    (tmp_path / "other").mkdir()  # another version: a folder holding nanoroute.py (here: this one)
    shutil.copy(nanoroute.__file__, tmp_path / "other" / "nanoroute.py")
    data = _bench_run(tmp_path, "--variants", "prenorm,block", "--iters", "4", "--gen_tokens", "0",
                      "--against", str(tmp_path / "other"))
    v = data["variants"]
    assert list(v) == ["prenorm", "prenorm@against", "block", "block@against"]  # pairs side by side
    for version, (prenorm, block) in {"": (10, 15), "@against": (20, 30)}.items():  # ms a step
        for name, ms in ((f"prenorm{version}", prenorm), (f"block{version}", block)):
            r = v[name]
            assert r["ms_all"] == pytest.approx([ms, ms, 3 * ms, 3 * ms]), name
            # an even number of steps: the median is the mean of the two middle ones
            assert r["ms_median"] == pytest.approx(2 * ms) and r["ms_min"] == pytest.approx(ms), name
            assert r["tokens_per_s"] == pytest.approx(2 * 32 * 1e3 / (2 * ms)), name
            # the ratios to the baselines, round by round, within each version
            assert r["paired_ratio_prenorm"] == pytest.approx([ms / prenorm] * 3), name
            assert r["paired_ratio_block"] == pytest.approx([ms / block] * 3), name
    for name in ("prenorm", "block"):  # this code takes half the time of that code, round by round
        assert v[name]["paired_ratio_against"] == pytest.approx([0.5] * 3)
    out = capsys.readouterr().out
    assert "below 1 means this code is faster" in out
    for name in ("prenorm", "block"):
        assert f"| {name} | 0.500 [0.500, 0.500] | 1.000 |" in out


def test_bench_generation_reports_the_median_of_its_repeats(tmp_path, monkeypatch):
    # every step and generation slower than the one before: the repeats differ, the report is their
    # median; one timed round (--iters 1) gives one per-round ratio
    _simulated_machine(monkeypatch, lambda n: 1 + n)
    data = _bench_run(tmp_path, "--variants", "prenorm", "--iters", "1",
                      "--gen_variants", "prenorm,block", "--gen_repeats", "3")
    # the first step and the warm-up took 10 and 20 ms, the timed step 30
    assert data["variants"]["prenorm"]["ms_all"] == pytest.approx([30.0])
    assert data["first_steps"]["prenorm"]["first_step_s"] == pytest.approx(0.010)
    assert data["variants"]["prenorm"]["paired_ratio_prenorm"] == [1.0, 1.0, 1.0]
    assert data["generation"]["new_tokens"] == 4 and data["generation"]["repeats"] == 3
    for name, g in data["generation"]["variants"].items():
        assert g["speedup"] == pytest.approx(g["recompute_ms"] / g["kv_ms"]), name  # both medians
        assert g["kv_tokens_per_s"] == pytest.approx(4 * 1e3 / g["kv_ms"]), name  # new tokens only
        assert g["same_tokens"], name


def test_bench_defaults_and_the_command_it_records(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    flags = ["--shape", "tiny", "--device", "cpu", "--variants", "prenorm", "--warmup", "0",
             "--gen_variants", "prenorm", "--gen_repeats", "1"]
    argv = [*flags, "--json", "bench.json"]  # a bare file name: written in the current folder
    bench.main(argv)
    data = json.loads((tmp_path / "bench.json").read_text())
    out = capsys.readouterr().out
    assert data["iters"] == 10 and len(data["variants"]["prenorm"]["ms_all"]) == 10  # CPU default
    # min(256, sequence_len) new tokens: all that fit the context after the prompt, so no note
    assert data["generation"]["new_tokens"] == 32 and "### Generation: 32 new tokens" in out
    assert "note:" not in out
    command = "python bench.py " + " ".join(argv)  # the flags that made these numbers
    assert data["machine"]["command"] == command and out.splitlines()[0].endswith("| " + command)

    data = bench.main([*flags, "--iters", "1", "--gen_tokens", "0"])  # 0: no generation
    out = capsys.readouterr().out
    assert data["generation"]["new_tokens"] == 0 and data["generation"]["variants"] == {}
    assert "### Generation" not in out
    bench.main([*flags, "--iters", "1", "--gen_tokens", "33"])  # past the context: said so
    assert "note: --gen_tokens=33 > sequence_len=32" in capsys.readouterr().out


def test_bench_subset_without_baselines_and_profile(tmp_path, capsys, monkeypatch):
    # a CPU never has a peak in train.PEAK_FLOPS: one of 1 TFLOP/s here shows MFU's arithmetic, from the
    # median step of B·T tokens, over the peak of the precision run: bf16 autocast, as on a GPU with
    # native bf16 (train.py's --dtype auto)
    asked = []
    monkeypatch.setattr(train, "peak_flops", lambda name, dtype: asked.append((name, dtype)) or 1e12)
    monkeypatch.setattr(train, "pick_dtype", lambda name, device: torch.bfloat16)
    data = _bench_run(tmp_path, "--variants", "rezero,wav", "--gen_variants", "rezero", "--profile", "wav")
    assert list(data["variants"]) == ["rezero", "wav"]
    assert asked == [(data["machine"]["device_name"], torch.bfloat16)]
    assert data["machine"]["dtype"] == "bf16 autocast"
    shape = data["shape"]
    for name, r in data["variants"].items():
        model = GPT(GPTConfig(**{k: shape[k] for k in bench.MODEL_FIELDS}, **bench.VARIANTS[name]))
        tokens = shape["batch_size"] * shape["sequence_len"]
        flops = model.flops_per_token() * tokens / (r["ms_median"] / 1e3)
        assert r["mfu"] == pytest.approx(flops / 1e12, rel=1e-9) and r["ms_median"] != r["ms_min"], name
    assert all(v["ratio_prenorm"] is None and v["ratio_block"] is None and v["paired_ratio_block"] is None
               for v in data["variants"].values())
    assert list(data["generation"]["variants"]) == ["rezero"]
    out = capsys.readouterr().out
    assert "### Profile: wav, 3 training steps" in out and "PartialMergeBackward" in out
    calls = re.search(r"KV-cache generation of 4 tokens: (\d+) aten calls per token", out)
    assert calls and int(calls.group(1)) > 0


def test_bench_against_times_another_version_in_the_same_rounds(tmp_path, capsys, monkeypatch):
    # another version of the model: this file, whose forward notes "that" in a log that this version's
    # forward notes "this" in. No timing is asserted (a busy machine reorders any speeds): the log shows
    # that each model ran its own code and that the rounds interleave the versions side by side
    log = []
    monkeypatch.setattr(builtins, "_nanoroute_bench_log", log, raising=False)
    forward = GPT.forward

    def logged_forward(self, *args, **kwargs):
        log.append(("this", self.config.residual, torch.is_grad_enabled()))
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(GPT, "forward", logged_forward)
    src = Path(nanoroute.__file__).read_text()
    other = src.replace("    def forward(self, idx, targets=None, return_routes=False):\n",
                        "    def forward(self, idx, targets=None, return_routes=False):\n"
                        "        import builtins\n"
                        "        builtins._nanoroute_bench_log.append((\"that\", self.config.residual, "
                        "torch.is_grad_enabled()))\n"
                        "        if not hasattr(self, \"more\"):  # that version keeps 256 KB more\n"
                        "            self.more = torch.nn.Parameter(torch.zeros(1 << 16))\n")
    assert other != src
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "nanoroute.py").write_text(other)
    data = _bench_run(tmp_path, "--variants", "prenorm,block", "--gen_tokens", "0",
                      "--against", str(tmp_path / "other"), "--iters", "3")  # a folder holding nanoroute.py
    v = data["variants"]
    assert list(v) == ["prenorm", "prenorm@against", "block", "block@against"]
    steps = [(who, residual) for who, residual, grad in log if grad]  # the training steps, in order
    one_round = [("this", "prenorm"), ("that", "prenorm"), ("this", "attnres"), ("that", "attnres")]
    assert steps[-4 * 4:] == one_round * 4  # 1 warm-up round and 3 timed ones, each version side by side
    for name in ("prenorm", "block"):
        this, that = v[name], v[name + "@against"]
        assert len(this["ms_all"]) == len(that["ms_all"]) == 3
        rounds = [a / b for a, b in zip(this["ms_all"], that["ms_all"])]
        assert this["paired_ratio_against"][0] == pytest.approx(statistics.median(rounds))
        assert "paired_ratio_against" not in that
        # ratios to Block AttnRes stay within one version
        assert this["ratio_block"] == pytest.approx(this["ms_median"] / v["block"]["ms_median"])
        assert that["ratio_block"] == pytest.approx(that["ms_median"] / v["block@against"]["ms_median"])
        assert that["memory_bytes"] > this["memory_bytes"]  # the same model, and its 256 KB more
    assert v["block@against"]["ratio_block"] == 1.0 and v["prenorm@against"]["ratio_prenorm"] == 1.0
    out = capsys.readouterr().out
    median, q1, q3 = v["block"]["paired_ratio_against"][:3]
    memory = v["block"]["memory_bytes"] / v["block@against"]["memory_bytes"]  # this / against: below 1
    assert memory < 1 and f"| block | {median:.3f} [{q1:.3f}, {q3:.3f}] | {memory:.3f} |" in out, out


def test_bench_against_bad_versions_are_one_error_line(tmp_path, capsys):
    (tmp_path / "no_gpt.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("import torch\nraise RuntimeError('half-edited file')\n")
    (tmp_path / "no_rd.py").write_text(  # a version from before RD-AttnRes, whose config has no rd
        "from nanoroute import GPT, GPTConfig as Config\n"
        "def GPTConfig(**kw):\n"
        "    if 'rd' in kw:\n"
        "        raise TypeError(\"GPTConfig() got an unexpected keyword argument 'rd'\")\n"
        "    return Config(**kw)\n")
    (tmp_path / "syntax.py").write_text("def forward(self:\n")
    cases = {"missing.py": "no such file", "no_gpt.py": "has no GPT and GPTConfig",
             "broken.py": "importing .* failed: RuntimeError: half-edited file",
             "syntax.py": "importing .* failed: SyntaxError: ",
             "no_rd.py": "^error: rd@against: the --against version cannot build it: TypeError: .*'rd'"}
    for file, message in cases.items():
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--shape", "tiny", "--device", "cpu", "--iters", "1", "--warmup", "0", "--gen_tokens", "0",
                        "--variants", "block,rd", "--against", str(tmp_path / file)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, (file, err)
        assert re.search(message, err), (file, err)

# bench.py's shape overrides, --iters, --warmup, --gen_tokens 0 (no generation), --gen_repeats, --threads
def test_bench_flags_override_the_shape(tmp_path, monkeypatch):
    steps, recomputes = [], []
    train_step, recompute = bench.train_step, bench.generate_recompute
    monkeypatch.setattr(bench, "train_step", lambda *a: steps.append(1) or train_step(*a))
    monkeypatch.setattr(bench, "generate_recompute", lambda *a: recomputes.append(1) or recompute(*a))
    shape = dict(n_layer=1, n_embd=16, n_head=4, sequence_len=8, vocab_size=50, batch_size=3)
    flags = ["--shape", "tiny", "--device", "cpu", "--variants", "prenorm", "--iters", 3,
             *[x for k, v in shape.items() for x in (f"--{k}", v)]]
    threads = torch.get_num_threads()
    try:
        counts = {}
        for warmup in (0, 2):
            steps.clear()
            torch.set_num_threads(2)  # --threads 1 changes it
            out = bench.main([str(x) for x in [*flags, "--warmup", warmup, "--gen_tokens", 0, "--threads", 1]])
            counts[warmup] = len(steps)
            assert torch.get_num_threads() == 1 and out["machine"]["threads"] == 1
        gen = ["--gen_tokens", 2, "--gen_variants", "prenorm", "--gen_repeats", 2]
        out = bench.main([str(x) for x in [*flags, *gen]])
    finally:
        torch.set_num_threads(threads)
    assert counts[2] - counts[0] == 2  # two untimed rounds of the one variant
    assert out["shape"] == shape and len(out["variants"]["prenorm"]["ms_all"]) == 3
    v = out["variants"]["prenorm"]
    assert v["params"] == GPT(GPTConfig(**{k: shape[k] for k in shape if k != "batch_size"})).get_num_params()
    assert v["tokens_per_s"] == pytest.approx(3 * 8 / (v["ms_median"] / 1e3))
    assert len(recomputes) == 1 + 2 and out["generation"]["repeats"] == 2  # a warm-up, then the repeats
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--variants", "prenorm", "--iters", "1",
                       "--gen_tokens", "0"])["generation"]["variants"] == {}




def test_bench_unknown_gen_variant_is_one_error_line_naming_its_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--shape", "tiny", "--device", "cpu", "--gen_variants", "prenorm,bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == ("error: --gen_variants='prenorm,bogus': unknown variant(s) bogus; "
                   f"choose from {','.join(bench.VARIANTS)}\n")

# -----------------------------------------------------------------------------
# Speed and memory: micro-batches, the memory estimate, MFU, the dtype, bench.py's compile guard and
# results as they come, the GPU check script; then the CUDA-only tests (NANOROUTE_TEST_DEVICE=cuda
# python -m pytest -q -m gpu), skipped on the CPU

MEMORY_VARIANTS = dict(bench.VARIANTS, rd_average=nanoroute.VARIANTS["rd_average"])


@pytest.mark.parametrize("precision", ["float32", "bf16_autocast"])
def test_memory_estimate_matches_the_saved_tensor_count(precision):
    # train.estimate_memory against bench.py's exact CPU count: its activations against the bytes
    # one eager forward saves for backward; with parameters, gradients and AdamW's state against the
    # whole count. Within 10% for every variant (they agree within 3%, the reference read's within
    # 8%); n_layer 5 gives WAV a short last block of 2 sublayers. What learned bases add (each
    # completed block's last update, kept for its coefficient's gradient) is a few percent of the
    # whole: their extra over WAV is compared on its own
    bf16 = precision == "bf16_autocast"
    dtype = torch.bfloat16 if bf16 else torch.float32
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    B, T = 2, 32
    names = ("prenorm", "rezero", "layerscale", "block", "full", "wav", "wav_learned", "rd", "rd_average",
             "naive")
    for shape in (dict(n_layer=4, n_embd=64, n_head=2), dict(n_layer=5, n_embd=128, n_head=4)):
        activations = {}
        for name in names:
            torch.manual_seed(0)
            config = GPTConfig(**shape, sequence_len=T, vocab_size=256, **MEMORY_VARIANTS[name])
            model = GPT(config)
            opt = model.configure_optimizers(0.1, 1e-3)
            x, y = (torch.randint(256, (B, T), generator=torch.Generator().manual_seed(s))
                    for s in (1, 2))
            bench.train_step(model, opt, x, y, amp)  # AdamW's state exists after a step
            params, _ = bench.static_bytes(model, opt)
            exclude = set(params) | {b.untyped_storage().data_ptr() for b in model.buffers()}
            estimate = train.estimate_memory(config, B * T, dtype)
            saved = bench.saved_bytes(model, x, y, amp, exclude)
            assert estimate["activations"] == pytest.approx(saved, rel=0.1), (name, shape)
            activations[name] = estimate["activations"], saved
            counted = bench.memory_bytes(model, model, opt, x, y, amp, "cpu")
            without_logits = estimate["total"] - estimate["logits"]
            assert without_logits == pytest.approx(counted, rel=0.1), (name, shape)
        (wav, wav_saved), (learned, learned_saved) = activations["wav"], activations["wav_learned"]
        assert learned - wav == pytest.approx(learned_saved - wav_saved, rel=0.05), shape
    # the parts: AdamW's two moments, DDP's buckets with several processes, the logits' gradients
    one, eight = (train.estimate_memory(config, 1024, torch.bfloat16, world) for world in (1, 8))
    assert one["optimizer"] == 2 * one["parameters"] == 2 * one["gradients"] > 0
    assert one["ddp"] == 0 and eight["ddp"] == one["gradients"]
    assert one["logits"] == 8 * 256 * 1024
    assert one["total"] == sum(v for k, v in one.items() if k != "total")


def test_presets_keep_their_batch_and_fit_an_80gb_gpu():
    # rd_s and rd_m: 0.5M tokens per optimizer step on 1 GPU and on 8, the same rows seen whatever
    # the number of processes and chunks, each process's peak within FIT_SHARE of 80 GB in bf16
    for name in ("rd_s", "rd_m"):
        a, model, _ = train.resolve_settings({"preset": name})
        shape = bench.preset_shape(name)
        fields = {k: shape[k] for k in bench.MODEL_FIELDS}
        for world in (1, 8):
            train.check_settings(a, world)
            train.check_micro_batch(a, world)
            assert a.batch_size * a.grad_accum * model["sequence_len"] == 524288
            rows = [train.batch_offsets(a.seed, 5, micro, 10 ** 9, 1024, a.batch_size)
                    for micro in range(a.grad_accum)]
            parts = [[p for r in range(world) for p in train.chunks(m[r::world], a.micro_batch)]
                     for m in rows]
            assert {len(p) for ps in parts for p in ps} == {16 if world == 1 else 8}
            assert [sorted(np.concatenate(ps)) for ps in parts] == [sorted(m) for m in rows]
            for variant, values in nanoroute.VARIANTS.items():
                estimate = train.estimate_memory(GPTConfig(**fields, **values),
                                                 min(16, 64 // world) * 1024, torch.bfloat16, world)
                assert estimate["total"] <= train.FIT_SHARE * 80e9, (name, world, variant)
        # without micro-batches rd_m would not fit one GPU: the reason for the preset's micro_batch
        wav = GPTConfig(**fields, **nanoroute.VARIANTS["wav"])
        whole = train.estimate_memory(wav, 64 * 1024, torch.bfloat16)["total"]
        assert name == "rd_s" or whole > 80e9
    assert bench.preset_shape("rd_m") == dict(n_layer=24, n_embd=832, n_head=13, sequence_len=1024,
                                              batch_size=16, vocab_size=prepare_data.GPT2_VOCAB)
    assert bench.preset_shape("wav48")["batch_size"] == 64  # no micro-batches: 64 x 256 fit
    table = bench.memory_table()  # the docs hold the table this function prints
    for doc in ("docs/speed.md", "docs/training.md"):
        assert table in (_TRAIN_ROOT / doc).read_text(), doc


def test_micro_batch_gives_the_same_batches_losses_and_weights(_train_data, _train_one_thread,
                                                                tmp_path, monkeypatch, capsys):
    # --micro_batch 2 cuts each micro-step of 8 rows into 4 forwards: the same rows in the same
    # order (training and evaluation), the same losses and weights to float rounding (prenorm: a
    # routed model also reads 8 rows for its routing statistics)
    demo, _ = _train_data
    seen, get_batch = [], train.get_batch

    def recorded(data, offsets, *args):
        seen.append(list(offsets))
        return get_batch(data, offsets, *args)
    monkeypatch.setattr(train, "get_batch", recorded)
    runs = {}
    for micro in (0, 2):
        seen.clear()
        out = tmp_path / f"micro{micro}"
        code, _, err = _train_main(train, ["--data", demo, "--out_dir", out, *_TRAIN_TINY,
                                           "--grad_accum", 2, "--max_iters", 3, "--eval_interval",
                                           3, "--residual", "prenorm", "--micro_batch", micro],
                                   capsys)
        assert code == 0, err
        ckpt = torch.load(out / "last.pt", weights_only=True)
        runs[micro] = (sum(seen, []), {len(o) for o in seen}, _train_metrics(out), ckpt)
    (rows0, sizes0, lines0, ckpt0), (rows2, sizes2, lines2, ckpt2) = runs[0], runs[2]
    assert rows0 == rows2 and sizes0 == {8} and sizes2 == {2}
    for a, b in zip(lines0, lines2, strict=True):
        for key in ("loss", "train_loss", "val_loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    for name, value in ckpt0["model"].items():
        torch.testing.assert_close(value, ckpt2["model"][name], atol=1e-5, rtol=1e-4, msg=name)


def test_micro_batch_that_does_not_divide_is_one_line(_train_data, tmp_path, capsys):
    demo, _ = _train_data
    cases = {3: "--micro_batch 3 does not divide the 8 sequences each process runs per micro-step "
                "(--batch_size 8 over 1 process(es)): choose one of 1, 2, 4 or 0",
             -1: "--micro_batch -1: must be 0"}
    for micro, message in cases.items():
        code, _, err = _train_main(train, ["--data", demo, "--out_dir", tmp_path / "o",
                                           *_TRAIN_TINY, "--max_iters", 1, "--micro_batch", micro],
                                   capsys)
        assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()
    # under torchrun it divides each process's share: 4 divides a --batch_size of 12, not the 6 of 2 processes
    a, _, _ = train.resolve_settings({"batch_size": 12, "micro_batch": 4})
    train.check_micro_batch(a, 1)
    with pytest.raises(train.UsageError, match=r"^--micro_batch 4 does not divide the 6 sequences each process "
                                               r"runs per micro-step \(--batch_size 12 over 2 process\(es\)\): "
                                               r"choose one of 1, 2, 3 or 0"):
        train.check_micro_batch(a, 2)
    odd, _, _ = train.resolve_settings({"batch_size": 7})  # the default --micro_batch 0 too
    with pytest.raises(train.UsageError, match=r"^--batch_size 7 is not divisible by the 2 processes"):
        train.check_settings(odd, 2)


def test_out_of_memory_is_one_line_and_keeps_last_pt(_train_data, _train_one_thread, tmp_path,
                                                     monkeypatch, capsys):
    demo, _ = _train_data
    forward, calls = GPT.forward, []

    def out_of_memory_at_step_3(self, idx, targets=None, return_routes=False):
        if self.training:
            calls.append(1)
            if len(calls) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. "
                                             "GPU 0 has a total capacity of 79.10 GiB (...)")
        return forward(self, idx, targets, return_routes)
    monkeypatch.setattr(GPT, "forward", out_of_memory_at_step_3)
    out = tmp_path / "oom"
    code, _, err = _train_main(train, ["--data", demo, "--out_dir", out, *_TRAIN_TINY,
                                       "--max_iters", 6, "--eval_interval", 2], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: out of GPU memory (tried to allocate 2.00 GiB): lower "
                          "--micro_batch"), err
    assert "--batch_size" in err and "--sequence_len" in err and "--resume" in err
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 2  # step 2's is kept
    assert not (out / "train.lock").exists()


def test_dtype_auto_is_bf16_only_where_it_is_native(monkeypatch):
    capabilities = ((6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0))
    assert [train.bf16_native(c) for c in capabilities] == [False] * 3 + [True] * 5
    # torch.cuda.is_bf16_supported() is true where bf16 is emulated (before Ampere): not the test
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    cases = {(7, 0): torch.float32, (7, 5): torch.float32, (8, 0): torch.bfloat16,
             (9, 0): torch.bfloat16}
    for capability, dtype in cases.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert train.pick_dtype("auto", torch.device("cuda")) == dtype, capability
        assert train.pick_dtype("float32", torch.device("cuda")) == torch.float32
    assert train.pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert train.pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_mfu_peak_comes_from_the_gpu_and_dtype():
    peaks = {"NVIDIA A100-SXM4-80GB": (312e12, 156e12), "NVIDIA A100-PCIE-40GB": (312e12, 156e12),
             "NVIDIA H100 80GB HBM3": (989e12, 494e12), "NVIDIA H100 PCIe": (756e12, 378e12),
             "NVIDIA H100 NVL": (835e12, 418e12), "NVIDIA H200": (989e12, 494e12),
             "NVIDIA H200 NVL": (835e12, 418e12), "NVIDIA L4": (121e12, 60e12),
             "NVIDIA GeForce RTX 4090": (165e12, 83e12), "NVIDIA L40S": (None, None),
             "Tesla T4": (None, None), "NVIDIA GeForce RTX 3090": (None, None),
             "NVIDIA RTX A1000": (None, None), "NVIDIA GeForce RTX 4090 D": (None, None),
             "NVIDIA GeForce RTX 4090 Laptop GPU": (None, None), "NVIDIA H800": (None, None)}
    for name, expected in peaks.items():
        found = train.peak_flops(name, torch.bfloat16), train.peak_flops(name, torch.float32)
        assert found == expected, name
    assert train.peak_flops("NVIDIA H100 80GB HBM3", torch.float16) is None  # never trained in


def test_flops_per_token_by_hand():
    # 2 layers, n_embd 32, sequence_len 16, vocabulary 64 (tied embedding, no biases):
    #   per layer: c_attn 32·96 + attention's c_proj 32·32 + c_fc 32·128 + the MLP's c_proj 128·32
    #   = 3072 + 1024 + 4096 + 4096 = 12288
    #   N = 2·12288 + 64·32 (the embedding, which is the output layer) = 26624; 6N = 159744
    #   attention (PaLM, appendix B): 12·L·d·T = 12·2·32·16 = 12288
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, sequence_len=16, vocab_size=64))
    assert model.get_num_params() == 26624
    assert model.flops_per_token() == 159744 + 12288
    # MFU: 1000 tokens in 0.5 s on a 1e12 FLOP/s device
    assert model.estimate_mfu(1000, 0.5, 1e12) == pytest.approx(172032 * 1000 / 0.5 / 1e12)


def test_train_log_leaves_the_first_step_out_of_tokens_per_s(_train_data, _train_one_thread,
                                                             tmp_path, monkeypatch, capsys):
    # a clock that moves 1 s per reading, and a first step of each invocation 100 s longer
    # (compiling): that step gets its own line and no rate; later lines average the other steps
    demo, _ = _train_data
    clock, first = [0.0], []

    def now():
        clock[0] += 1.0
        return clock[0]
    monkeypatch.setattr(train, "time", types.SimpleNamespace(time=now, monotonic=time.monotonic))
    step = train.train_step

    def compiling_first(run, lr):
        if not first:
            first.append(run.step)
            clock[0] += 100.0
        clock[0] += {6: 2.0, 8: 2.0}.get(run.step + 1, 0.0)  # steps 6 and 8 take 3 s, the others 1 s
        return step(run, lr)
    monkeypatch.setattr(train, "train_step", compiling_first)
    out = tmp_path / "rate"
    args = ["--data", demo, "--out_dir", out, *_TRAIN_TINY, "--max_iters", 8, "--log_interval", 4,
            "--eval_interval", 2]
    code, stdout, err = _train_main(train, [*args, "--stop_after", 2], capsys)
    assert code == 0, err
    first.clear()
    code, _, err = _train_main(train, ["--out_dir", out, "--resume", "--device", "cpu"], capsys)
    assert code == 0, err
    lines = {r["step"]: r for r in _train_metrics(out) if r["type"] == "train"}
    assert list(lines) == [1, 4, 8]
    assert lines[1]["tok_per_s"] is None and lines[1]["mfu"] is None
    assert lines[1]["ms_per_step"] == 101000
    assert re.search(r"^step 1 \| loss \S+ \| lr \S+ \| first step 101000\.0 ms \(warm-up: not in "
                     r"tok/s\)$", stdout, re.M), stdout
    # step 3, the resumed run's first, is left out of the step-4 line; the step-8 line is the mean of
    # steps 5 to 8 (1, 3, 1 and 3 s), not the last step's time
    assert lines[4]["ms_per_step"] == 1000 and lines[4]["tok_per_s"] == 8 * 32, lines[4]
    assert lines[8]["ms_per_step"] == 2000 and lines[8]["tok_per_s"] == 8 * 32 / 2, lines[8]


def test_bench_preset_times_its_shape_and_memory_table_prints_every_estimate(tmp_path, capsys):
    # --preset: the preset's model, rows per forward and vocabulary; the size flags still override it
    small = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--sequence_len", "16"]
    data = _bench_run(tmp_path, "--preset", "wav48", *small, "--variants", "prenorm", "--gen_tokens", "0")
    assert data["shape"] == dict(n_layer=2, n_embd=32, n_head=2, sequence_len=16,
                                 batch_size=bench.preset_shape("wav48")["batch_size"], vocab_size=256)
    assert "preset wav48: n_layer=2," in capsys.readouterr().out
    # --memory_table: the estimates of every preset and variant on 1 and 8 GPUs, and nothing is timed
    assert bench.main(["--memory_table", "--json", str(tmp_path / "none.json")]) is None
    out = capsys.readouterr().out
    assert out == bench.memory_table() + "\n" and not (tmp_path / "none.json").exists()
    assert all(f"| {name} | {gpus} |" in out for name in train.PRESETS for gpus in (1, 8))


def test_bench_compiles_every_model_and_says_which_did(tmp_path, monkeypatch, capsys):
    # torch._dynamo keeps at most recompile_limit compiled versions of one function over all models
    # (8: --against's 16 models would overflow it); a limit of 1 shows the same with 4 small models.
    # Each version of nanoroute.py takes one (--against loads this file again, as other code), and
    # bench.py raises the limit for its run. (Dynamo's own patch, not monkeypatch: monkeypatch would
    # delete the setting afterwards, and every later torch.compile in the suite would fail.)
    argv = ["--shape", "tiny", "--device", "cpu", "--variants", "prenorm,block",
            "--against", nanoroute.__file__, "--iters", "1", "--warmup", "0", "--gen_tokens", "0",
            "--compile", "--compile_backend", "eager"]
    torch._dynamo.reset()
    before = torch._dynamo.config.recompile_limit
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            out = bench.main(argv)
            for name, r in out["variants"].items():
                assert r["compiled"] is True and r["graphs"] == 1, name
                # compile time: the first step less a timed one (the median), never negative
                assert r["compile_s"] == max(0.0, r["first_step_s"] - r["ms_median"] / 1e3), name
            assert torch._dynamo.config.recompile_limit == 1  # back as it was after the run
            assert "| yes: 1 graph(s)" in capsys.readouterr().out
            # without the raised limit the second model falls back: the report says so
            torch._dynamo.reset()
            monkeypatch.setattr(bench, "compile_limit", lambda b: contextlib.nullcontext())
            out = bench.main([a for a in argv if a not in ("--against", nanoroute.__file__)])
            assert {k: v["compiled"] for k, v in out["variants"].items()} == {
                "prenorm": True, "block": False}
            printed = capsys.readouterr().out
            assert "block: " in printed and "NOT compiled: dynamo fell back to eager" in printed
            assert "| NO: eager fallback |" in printed
    finally:
        torch._dynamo.reset()
    assert torch._dynamo.config.recompile_limit == before  # for the tests after this one
    with pytest.raises(SystemExit):
        bench.main([*argv[:-1], "no_such_backend"])
    err = capsys.readouterr().err
    assert "error: --compile_backend no_such_backend: not a torch.compile backend" in err


def test_bench_saves_what_it_measured_as_it_goes(tmp_path, monkeypatch):
    # a run cut short (a time limit; here at the second variant's record) keeps in --json what it
    # measured so far
    path, done = tmp_path / "cut.json", []
    result = bench.variant_result

    def cut_at_the_second(*args):
        if done:
            raise KeyboardInterrupt
        done.append(1)
        return result(*args)
    monkeypatch.setattr(bench, "variant_result", cut_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--shape", "tiny", "--device", "cpu", "--variants", "prenorm,block,rd",
                    "--iters", "2", "--warmup", "0", "--gen_tokens", "0", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["complete"] is False and list(data["first_steps"]) == ["prenorm", "block", "rd"]
    assert all(r["first_step_s"] > 0 for r in data["first_steps"].values())
    assert {k: len(v) for k, v in data["rounds_ms"].items()} == {"prenorm": 2, "block": 2, "rd": 2}
    assert list(data["variants"]) == ["prenorm"] and data["variants"]["prenorm"]["memory_bytes"] > 0
    # cut in the second timed round (the steps: each model's first, then round 1 of three models): the
    # first round is kept
    steps, step = [], bench.train_step

    def cut_in_round_2(*args):
        steps.append(1)
        if len(steps) == 3 + 3 + 2:
            raise KeyboardInterrupt
        return step(*args)
    monkeypatch.setattr(bench, "train_step", cut_in_round_2)
    monkeypatch.setattr(bench, "variant_result", result)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--shape", "tiny", "--device", "cpu", "--variants", "prenorm,block,rd",
                    "--iters", "2", "--warmup", "0", "--gen_tokens", "0", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["complete"] is False and data["variants"] == {}
    assert {k: len(v) for k, v in data["rounds_ms"].items()} == {"prenorm": 1, "block": 1, "rd": 1}


def test_gpu_check_script_runs_its_parts_on_cpu(tmp_path):
    # tools/gpu_check.sh cpu at its smallest: one test, two variants, one timed step, dynamo's
    # eager backend
    results = tmp_path / "check"
    env = dict(_train_env(), GPU_CHECK_TESTS="-m gpu -k harness", GPU_CHECK_VARIANTS="prenorm,rd",
               GPU_CHECK_ITERS="1", GPU_CHECK_BACKEND="eager")
    script = _TRAIN_ROOT / "tools" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script), "cpu", str(results)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = [line.split()[:2] for line in (results / "status.txt").read_text().splitlines()]
    assert status == [["tests", "0"], ["eager", "0"], ["memory_rd_m", "0"], ["memory_wav48", "0"],
                      ["compiled_prenorm", "0"], ["compiled_rd", "0"]]
    tests = (results / "tests.txt").read_text()
    assert "1 passed" in tests and tests.count(" PASSED") == 1  # a line per test: a cut keeps them
    for name in ("bench_eager", "bench_compiled_prenorm", "bench_compiled_rd", "memory_rd_m", "memory_wav48"):
        data = json.loads((results / f"{name}.json").read_text())
        assert data["complete"] and data["variants"], name
        if name.startswith("bench_compiled_"):  # one bench.py per variant
            assert list(data["variants"]) == [name.removeprefix("bench_compiled_")]
        for r in data["variants"].values():
            assert r["memory_bytes"] > 0 and r["memory_estimate_bytes"] > 0
            assert r["compiled"] is (True if name.startswith("bench_compiled") else None), name
    wav48 = json.loads((results / "memory_wav48.json").read_text())
    assert list(wav48["variants"]) == ["prenorm", "block", "wav"]
    summary = (results / "summary.md").read_text()
    assert "| compiled_rd | ok |" in summary and "## compiled\n" in summary
    compiled = summary.split("## compiled\n")[1].split("\n## ")[0]
    assert [row.split(" | ")[0] for row in compiled.splitlines() if row.startswith("| ") and "yes |" in row] \
        == ["| prenorm", "| rd"]


_GPU_CHECK_FAKE_PYTHON = """#!{python}
# stands in for python in tools/gpu_check.sh: logs each command, with the NANOROUTE_TEST_DEVICE it gets;
# "pytest" takes 2 s; bench.py writes the JSON of a run stopped early: its first variant timed, every
# variant's first step (compiled) taken. The summary (python -) is the real python's
import json, os, sys, time
if sys.argv[1:2] == ["-"]:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
with open({log!r}, "a") as f:
    f.write(json.dumps([os.environ.get("NANOROUTE_TEST_DEVICE"), sys.argv[1:]]) + "\\n")
if "pytest" in sys.argv:
    time.sleep(2)
    print("== 1 passed in 2.00s ==")
if "bench.py" in sys.argv:
    variants = sys.argv[sys.argv.index("--variants") + 1].split(",")
    record = dict(ms_median=10.0, tokens_per_s=1000.0, mfu=0.25, memory_bytes=2**20,
                  memory_estimate_bytes=2**21, first_step_s=1.5, compiled=None)
    data = dict(machine=dict(device_name="GPU", torch="2", dtype="bf16 autocast", command="bench"),
                shape=dict(n_layer=12), complete=False, variants=dict([(variants[0], record)][:len(variants) - 1]),
                first_steps={{v: dict(first_step_s=1.5) for v in variants}})
    with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
        json.dump(data, f)
"""


def test_gpu_check_script_on_a_gpu_runs_the_documented_commands(tmp_path):
    # the script's own logic in its GPU mode, with python replaced by a stand-in (no GPU here): the
    # commands of each part, their settings and time limits, the default folders, the seconds of each
    # part, and the summary of runs stopped early
    (tmp_path / "tools").mkdir()
    shutil.copy(_TRAIN_ROOT / "tools" / "gpu_check.sh", tmp_path / "tools")
    fake, log = tmp_path / "fake_python", tmp_path / "calls.jsonl"
    fake.write_text(_GPU_CHECK_FAKE_PYTHON.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    env = {k: v for k, v in _train_env().items() if not k.startswith("GPU_CHECK_")}
    start = time.monotonic()
    run = subprocess.run(["bash", str(tmp_path / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                         env=dict(env, PYTHON=str(fake)), timeout=120)
    wall = time.monotonic() - start
    assert run.returncode == 0, run.stdout + run.stderr
    rel = "results/gpu_check"  # the default folder on a GPU, in the repository
    out = tmp_path / rel
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    bench = ["bench.py", "--gen_tokens", "0", "--iters", "10"]
    gpu12 = ["--shape", "gpu12", "--device", "cuda"]
    assert calls == [
        ["cuda", ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu"]],
        [None, [*bench, "--variants", "prenorm,block,wav,rd", *gpu12, "--json", f"{rel}/bench_eager.json"]],
        [None, ["bench.py", "--preset", "rd_m", "--variants", "prenorm,block,rd", "--iters", "1", "--warmup", "0",
                "--gen_tokens", "0", "--json", f"{rel}/memory_rd_m.json"]],
        [None, ["bench.py", "--preset", "wav48", "--variants", "prenorm,block,wav", "--iters", "1", "--warmup", "0",
                "--gen_tokens", "0", "--json", f"{rel}/memory_wav48.json"]],
        *([None, [*bench, "--variants", v, *gpu12, "--compile", "--compile_backend", "inductor", "--json",
                  f"{rel}/bench_compiled_{v}.json"]] for v in ("prenorm", "block", "wav", "rd"))]
    limits = re.findall(r"^== (\w+) \(at most (\d+) s\)", run.stdout, re.M)
    assert limits[:4] == [("tests", "190"), ("eager", "45"), ("memory_rd_m", "35"), ("memory_wav48", "35")]
    assert limits[4][0] == "compiled_prenorm" and int(limits[4][1]) in (214, 215)  # 215 s for all four
    # each part's own seconds: together no more than the whole run (each rounds up by at most 1)
    status = [line.split() for line in (out / "status.txt").read_text().splitlines()]
    assert [row[:2] for row in status] == [[name, "0"] for name, _ in limits]
    assert int(status[0][2]) >= 1 and sum(int(row[2]) for row in status) <= wall + len(status)
    summary = (out / "summary.md").read_text()
    assert "tests: == 1 passed in 2.00s ==" in summary
    assert "## eager (incomplete: stopped before the end)" in summary
    assert "| prenorm | 10.0 | 1000 | 25.0 | 1.0 | 2.0 | 1.5 | - |" in summary
    assert "| rd | - | - | - | - | - | 1.5 | not timed |" in summary  # first step taken, then stopped
    compiled = summary.split("## compiled")[1].split("\n## ")[0]
    assert compiled.count("| not timed |") == 4 and "(incomplete: stopped before the end)" in compiled
    # on the CPU the default folder is another
    run = subprocess.run(["bash", str(tmp_path / "tools" / "gpu_check.sh"), "cpu"], capture_output=True, text=True,
                         env=dict(env, PYTHON=str(fake), GPU_CHECK_VARIANTS="prenorm"), timeout=120)
    assert run.returncode == 0 and (tmp_path / "results" / "gpu_check_cpu" / "summary.md").exists()


def test_gpu_check_script_keeps_going_past_its_time_limits(tmp_path):
    # every part cut at 1 s (python and torch take longer to start): each says so and the next one
    # still runs; the compiled variants share one limit, so the second is not run; a limit of 0 (for
    # timeout, none) is refused before anything is written
    script = _TRAIN_ROOT / "tools" / "gpu_check.sh"
    run = subprocess.run(["bash", str(script), "cpu", str(tmp_path / "bad")], capture_output=True, text=True,
                         env=dict(_train_env(), GPU_CHECK_LIMITS="60 60 0 60"), timeout=60)
    assert (run.returncode, run.stderr) == (2, 'error: GPU_CHECK_LIMITS="60 60 0 60": give four whole numbers of '
                                               'seconds, at least 1 each (tests eager memory compiled)\n')
    assert not (tmp_path / "bad").exists()
    # RESULTS_DIR: not a folder of other files (they are left alone), nor through a link
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "summary.md").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "notes")
    (tmp_path / "planted").mkdir()  # an earlier check's folder, with a link where summary.md goes
    (tmp_path / "planted" / "status.txt").write_text("")
    (tmp_path / "planted" / "summary.md").symlink_to(tmp_path / "notes" / "summary.md")
    refusals = {"notes": "notes is not an empty folder nor an earlier check's results: give a new RESULTS_DIR",
                "link": "link is not an empty folder nor an earlier check's results: give a new RESULTS_DIR",
                "planted": "planted/summary.md is a link, which this check does not follow: remove it or give a "
                           "new RESULTS_DIR"}
    for folder, why in refusals.items():
        run = subprocess.run(["bash", str(script), "cpu", str(tmp_path / folder)], capture_output=True, text=True,
                             env=_train_env(), timeout=60)
        assert (run.returncode, run.stderr) == (2, f"error: {tmp_path}/{why}\n")
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["summary.md"]
    assert (tmp_path / "notes" / "summary.md").read_text() == "mine"
    results = tmp_path / "cut"  # an earlier check's folder: its status lines are replaced, not added to
    results.mkdir()
    (results / "status.txt").write_text("tests 0 99\n")
    run = subprocess.run(["bash", str(script), "cpu", str(results)], capture_output=True, text=True, timeout=120,
                         env=dict(_train_env(), GPU_CHECK_LIMITS="1 1 1 1", GPU_CHECK_VARIANTS="prenorm,rd"))
    assert run.returncode == 0, run.stdout + run.stderr
    status = [line.split()[:2] for line in (results / "status.txt").read_text().splitlines()]
    assert status == [["tests", "124"], ["eager", "124"], ["memory_rd_m", "124"], ["memory_wav48", "124"],
                      ["compiled_prenorm", "124"], ["compiled_rd", "not_run"]]
    summary = (results / "summary.md").read_text()
    assert "| eager | 124 (time limit) |" in summary and "| compiled_rd | not run (time limit used up) |" in summary
    assert "tests: == tests: stopped at its time limit (1 s)" in summary


@pytest.fixture
def cuda():
    """The GPU, for the CUDA-only tests: they run with NANOROUTE_TEST_DEVICE=cuda, else skip."""
    if TEST_DEVICE != "cuda":
        pytest.skip("a CUDA check: NANOROUTE_TEST_DEVICE=cuda python -m pytest -q -m gpu on a GPU")
    if not torch.cuda.is_available():
        pytest.fail("NANOROUTE_TEST_DEVICE=cuda, but torch sees no CUDA device")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["block", "full", "wav", "rd_wav", "wav_learned_rd"])
def test_gpu_fast_path_equals_reference_with_tf32(mode, cuda):
    # train.py trains float32 runs with TF32 matmuls (10-bit mantissas): the fast path still gives
    # the reference's logits and every gradient, at a looser tolerance than true float32
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert_fast_equals_reference(mode, cuda, "tf32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["prenorm", "block", "wav", "rd_decoupled", "rd_wav"])
def test_gpu_kv_cache_generation_in_bf16(mode, cuda):
    # under bf16 autocast the cache holds bf16 keys and values: the cached pass gives the full
    # pass's hidden states at every position (to bf16 rounding), also past sequence_len
    model = randomise_routing(make_model(**ALL_MODES[mode], sequence_len=8), scale=0.3).to(cuda)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.generate(tokens(B=2, T=3).to(cuda), 9, top_k=1)  # the window refills at 8
        cache = nanoroute.KVCache(model.config, 2, cuda, torch.bfloat16)
        with torch.no_grad():
            steps = [model._hidden(out[:, :3], cache)]
            steps += [model._hidden(out[:, t:t + 1], cache) for t in range(3, 8)]
            full = model._hidden(out[:, :8])
    assert out.shape == (2, 12) and cache.k.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(steps, 1).float(), full.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_train_resume_eager_and_compiled(compiled, cuda, _train_data, tmp_path, capsys):
    # train.py on CUDA (bf16 autocast where native, fused AdamW, the CUDA RNG in checkpoints): a
    # run stopped at step 3 and resumed matches the uninterrupted run: losses to 1e-3, weights and
    # AdamW's moments to atol 1e-3 (CUDA kernels with atomic adds are not bitwise deterministic)
    demo, _ = _train_data
    args = ["--data", demo, *_TRAIN_TINY, *_TRAIN_ROUTED, "--device", "cuda", "--max_iters", 6,
            "--eval_interval", 3, "--dropout", 0.1, "--compile", compiled]
    code, stdout, err = _train_main(train, [*args, "--out_dir", tmp_path / "whole"], capsys)
    assert code == 0, err
    assert "memory: estimated peak" in stdout and "GiB on " in stdout
    code, _, err = _train_main(train, [*args, "--out_dir", tmp_path / "cut", "--stop_after", 3],
                               capsys)
    assert code == 0, err
    code, _, err = _train_main(train, ["--out_dir", tmp_path / "cut", "--resume", "--device",
                                       "cuda", "--compile", compiled], capsys)
    assert code == 0, err
    whole, cut = (torch.load(tmp_path / d / "last.pt", weights_only=True) for d in ("whole", "cut"))
    assert cut["step"] == whole["step"] == 6 and "cuda" in cut["rng"][0]
    assert cut["optimizer"]["param_groups"][0]["fused"] is True
    for name, value in whole["model"].items():
        torch.testing.assert_close(cut["model"][name], value, atol=1e-3, rtol=1e-2, msg=name)
    for key, state in whole["optimizer"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(cut["optimizer"]["state"][key][moment], state[moment],
                                       atol=1e-3, rtol=1e-2)
    losses = [{r["step"]: r["loss"] for r in _train_metrics(tmp_path / d) if r["type"] == "train"}
              for d in ("whole", "cut")]
    assert losses[0].keys() == losses[1].keys()
    for step, loss in losses[0].items():
        assert losses[1][step] == pytest.approx(loss, abs=1e-3), step


@pytest.mark.gpu
def test_gpu_bench_tiny_compiled(cuda, tmp_path, capsys):
    out = bench.main(["--shape", "tiny", "--device", "cuda", "--variants", "prenorm,rd",
                      "--iters", "2", "--warmup", "1", "--gen_tokens", "4", "--gen_repeats", "1",
                      "--compile", "--json", str(tmp_path / "bench.json")])
    native = train.bf16_native(torch.cuda.get_device_capability())  # else float32, as train.py's auto
    assert out["machine"]["dtype"] == ("bf16 autocast" if native else "fp32")
    dtype = torch.bfloat16 if native else torch.float32
    known = train.peak_flops(torch.cuda.get_device_name(), dtype) is not None
    for name, r in out["variants"].items():
        assert r["compiled"] is True and r["compile_s"] > 0 and r["memory_bytes"] > 0, name
        assert (r["mfu"] is not None) == known and (r["mfu"] is None or 0 < r["mfu"] < 1), name
    assert known or "note: MFU left out" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_memory_estimate_near_the_allocator_peak(cuda):
    # the estimate against CUDA's allocator peak of one eager training step in bf16
    # (bench.memory_bytes), within ±35%: flash attention and CUDA's kernels save about what the
    # CPU's do
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    for name in ("prenorm", "block", "wav", "rd"):
        torch.manual_seed(0)
        config = GPTConfig(n_layer=4, n_embd=256, n_head=4, sequence_len=256, vocab_size=4096,
                           **bench.VARIANTS[name])
        model = GPT(config).to(cuda)
        opt = model.configure_optimizers(0.1, 1e-3, device_type="cuda")
        x, y = (torch.randint(4096, (8, 256), device=cuda) for _ in range(2))
        bench.train_step(model, opt, x, y, amp)
        measured = bench.memory_bytes(model, model, opt, x, y, amp, "cuda")
        estimate = train.estimate_memory(config, 8 * 256, torch.bfloat16)["total"]
        assert 0.65 * measured <= estimate <= 1.35 * measured, (name, estimate, measured)
        del model, opt


# -----------------------------------------------------------------------------
# Experiments: sweep and report

_EXP_HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _exp_run(root, name, variant, seed, val=None, *, depth=4, dataset="demo", level="char", milestones=None,
             entropy=None, js=None, evals=((0, 4.0), (100, 3.0))):
    """A hand-made run folder: run.json, metrics.jsonl (eval lines (tokens, val_loss)) and, when val is
    given, summary.json with that final val loss. entropy: the normalised route entropy per read (the
    raw entropy, which the report does not show, is written as 10x it)."""
    d = Path(root) / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(dict(variant=variant, dataset=dataset, depth=depth, seed=seed, sweep="x")))
    routes = None if entropy is None else dict(
        entropy={k: 10 * (v or 0) for k, v in entropy.items()}, entropy_norm=entropy, js={}, js_mean=js)
    lines = [dict(type="eval", step=i, tokens=t, val_loss=v, routes=routes) for i, (t, v) in enumerate(evals)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"type": "ev')  # a cut line
    if val is not None:
        config = dict(n_layer=depth, **experiments.VARIANTS.get(variant, dict(residual="attnres")))
        summary = dict(config=config, train=dict(seed=seed),
                       final=dict(val_loss=val), best_val_loss=val, step=100, tokens_seen=100, wall_time_s=10.0,
                       milestones={label: dict(step=1, tokens=tokens, val_loss=v)
                                   for label, tokens, v in milestones or ()},
                       routes=routes, dataset=dataset, level=level)
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def _exp_study(root):
    """block (baseline) and rd over seeds 0,1,2, prenorm with one seed, an unfinished rd seed 3, and a
    GPT-2-level group with one pair."""
    block, rd = [2.0, 2.2, 2.4], [1.9, 2.25, 2.3]  # rd - block = -0.1, +0.05, -0.1
    for seed in range(3):
        _exp_run(root, f"block_L4_s{seed}", "block", seed, block[seed],
                 entropy={"layer0.attn": None, "a": 0.5, "b": 0.7},  # a read of one source has no value
                 milestones=[("0.5B", 500, 3.0 + seed / 10), ("0.25B", 250, 3.5)],
                 evals=((0, 4.0), (250, 3.5), (500, 3.0 + seed / 10)))
        _exp_run(root, f"rd_L4_s{seed}", "rd", seed, rd[seed], entropy={"a": 0.25, "b": 0.25, "layer1.attn.v": 0.9},
                 js=0.2 + 0.02 * seed,
                 milestones=[("0.5B", 500, 2.9 + seed / 10), ("0.25B", 250, 3.5)],
                 evals=((0, 4.0), (250, 3.5), (500, 2.9 + seed / 10)))
    _exp_run(root, "prenorm_L4_s0", "prenorm", 0, 2.5)
    _exp_run(root, "rd_L4_s3", "rd", 3, evals=((0, 4.0), (250, 3.25)))  # interrupted: no summary.json
    _exp_run(root, "fw/block_L16_s0", "block", 0, 3.0, depth=16, dataset="fineweb_edu", level="gpt2")
    _exp_run(root, "fw/rd_L16_s0", "rd", 0, 2.9, depth=16, dataset="fineweb_edu", level="gpt2")


def test_exp_report_statistics_on_hand_made_runs(tmp_path):
    _exp_study(tmp_path)
    runs = experiments.load_runs(tmp_path)
    assert len(runs) == 10 and [r["name"] for r in runs if r["summary"] is None] == ["rd_L4_s3"]
    demo, fw = experiments.summarize(runs, "block")
    assert (demo["dataset"], demo["depth"], demo["baseline"]) == ("demo", 4, "block")
    assert demo["milestones"] == ["0.25B", "0.5B"]  # in token order
    rows = {row["variant"]: row for row in demo["rows"]}
    assert [row["variant"] for row in demo["rows"]] == ["prenorm", "block", "rd"]  # VARIANTS order
    block, rd, prenorm = rows["block"], rows["rd"], rows["prenorm"]
    assert block["seeds"] == [0, 1, 2] and rd["seeds"] == [0, 1, 2]  # the unfinished seed 3 is not counted
    assert block["val"] == pytest.approx((2.2, 0.2))
    assert block["metric"] == pytest.approx((2.2 / math.log(2), 0.2 / math.log(2)))  # bits per char
    assert block["delta"] is None and block["entropy"] == pytest.approx((0.6, 0.0)) and block["js"] == (None, None)
    assert rd["delta"]["mean"] == pytest.approx(-0.05) and rd["delta"]["std"] == pytest.approx(math.sqrt(0.0075))
    assert (rd["delta"]["wins"], rd["delta"]["n"]) == (2, 3)
    assert rd["js"] == pytest.approx((0.22, 0.02)) and rd["entropy"] == pytest.approx((0.25, 0.0))  # .v reads excluded
    assert rd["at"]["0.5B"]["delta"] == pytest.approx(dict(mean=-0.1, std=0.0, wins=3, ties=0, n=3))
    assert rd["at"]["0.25B"]["delta"] == pytest.approx(dict(mean=0.0, std=0.0, wins=0, ties=3, n=3))  # no win
    assert prenorm["val"] == (2.5, None)
    assert prenorm["delta"] == pytest.approx(dict(mean=0.5, std=None, wins=0, ties=0, n=1))
    assert fw["level"] == "gpt2" and {r["variant"]: r["metric"][0] for r in fw["rows"]} == pytest.approx(
        {"block": math.exp(3.0), "rd": math.exp(2.9)})  # perplexity at GPT-2 level

    assert experiments.main(["report", str(tmp_path)]) == 0  # default baseline: block
    text = (tmp_path / "report.md").read_text()
    assert ("| rd | 3 | 2.1500 ± 0.2179 | 3.1018 ± 0.3144 | -0.0500 ± 0.0866 | 2/3 | 0.250 ± 0.000 | "
            "0.220 ± 0.020 |") in text
    assert "| route entropy (norm.) |" in text and "Route entropy: normalised, entropy / ln(number of sources" in text
    assert "| prenorm | 1 | 2.5000 ± – | 3.6067 ± – | +0.5000 ± – | 0/1 | – | – |" in text  # no routes: –
    assert "| prenorm | 1 | 2.5000 ± – |" in text and "| +0.5000 ± – | 0/1 |" in text
    assert ("| rd | 3.5000 ± 0.0000 | +0.0000 ± 0.0000 | 0/3 (3 tied) | 3.0000 ± 0.1000 | -0.1000 ± 0.0000 | "
            "3/3 |") in text
    assert "## fineweb_edu, 16 layers" in text and "val ppl" in text
    assert "- rd_L4_s3: last eval at step 1, val loss 3.2500" in text  # listed, not dropped


def test_exp_report_baseline_and_folder_errors(tmp_path, capsys):
    _exp_study(tmp_path)
    assert experiments.main(["report", str(tmp_path), "--baseline", "wav"]) == 2
    err = capsys.readouterr().err
    assert "--baseline wav: no finished run of that variant; finished variants: block, prenorm, rd" in err
    assert experiments.main(["report", str(tmp_path), "--baseline", "prenorm"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| -0.6000 ± – | 1/1 |" in text  # only seed 0 pairs with prenorm
    assert "(baseline prenorm has no finished run here: no paired differences)" in text  # the fineweb_edu group
    assert experiments.main(["report", str(tmp_path / "fw"), "--plots", "--heatmap", "rd_L16_s0"]) == 2  # no best.pt
    assert "--heatmap rd_L16_s0: no run folder with a best.pt" in capsys.readouterr().err
    assert experiments.main(["report", str(tmp_path / "nothing")]) == 2
    assert "no runs under" in capsys.readouterr().err
    assert experiments.variant_of(dict(residual="attnres", wav=False, rd="frozen_v")) == "rd_frozen_v"


_EXP_FAKE_TRAIN = """
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
out = Path(argv[argv.index("--out_dir") + 1])
with open(os.environ["EXP_CALLS"], "a") as f:
    f.write(json.dumps(dict(argv=argv, threads=os.environ.get("OMP_NUM_THREADS"))) + "\\n")
if argv[argv.index("--residual") + 1] == "rezero":
    print("error: --fake failure", file=sys.stderr)
    sys.exit(2)
(out / "summary.json").write_text(json.dumps(dict(final=dict(val_loss=1.5))))
"""


def test_exp_sweep_skips_finished_runs_resumes_interrupted_and_reports_failures(tmp_path, monkeypatch, capsys):
    fake, calls = tmp_path / "fake_train.py", tmp_path / "calls.jsonl"
    fake.write_text(_EXP_FAKE_TRAIN)
    monkeypatch.setenv("EXP_CALLS", str(calls))
    runs = experiments.plan("tiny", tmp_path / "out", seeds="0,1", variants="prenorm,rezero,rd")
    assert [r["name"] for r in runs] == ["prenorm_L4_s0", "rezero_L4_s0", "rd_L4_s0",
                                          "prenorm_L4_s1", "rezero_L4_s1", "rd_L4_s1"]  # seed-major: whole pairs first
    assert "--attnres_block" in runs[2]["args"] and "--attnres_block" not in runs[0]["args"]  # AttnRes only
    (tmp_path / "out/rd_L4_s1").mkdir(parents=True)
    (tmp_path / "out/rd_L4_s1/last.pt").write_bytes(b"")  # an interrupted run
    launcher = [sys.executable, str(fake)]

    assert experiments.run_sweep(runs, launcher) == ["rezero_L4_s0", "rezero_L4_s1"]  # failures don't stop it
    out = capsys.readouterr().out
    assert "FAILED (exit 2): error: --fake failure" in out and "4 done, 2 failed" in out
    launched = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(launched) == 6 and all(c["threads"] == os.environ.get("OMP_NUM_THREADS", "1") for c in launched)
    resumed = [c["argv"] for c in launched if "--resume" in c["argv"]]
    assert len(resumed) == 1 and resumed[0][resumed[0].index("--out_dir") + 1].endswith("rd_L4_s1")
    info = json.loads((tmp_path / "out/rd_L4_s0/run.json").read_text())
    assert [info[k] for k in ("variant", "dataset", "depth", "seed")] == ["rd", "demo", 4, 0]
    assert "--rd decoupled" in info["command"] and "--seed 0" in info["command"]

    assert experiments.run_sweep(runs, launcher) == ["rezero_L4_s0", "rezero_L4_s1"]  # again: only the failed rerun
    assert len(calls.read_text().splitlines()) == 8
    calls.unlink()
    runs[0]["args"] = runs[0]["args"] + ["--lr", "1"]
    experiments.run_sweep([r for r in runs if r["variant"] != "rezero"], launcher)  # all finished: launches nothing
    out = capsys.readouterr().out
    assert not calls.exists() and out.count("skip ") == 4 + 4
    assert out.count("WARNING: it ran with other flags") == 1  # a changed sweep does not silently reuse runs
    (tmp_path / "out/rd_L4_s0/run.json").unlink()  # finished, its flags unknown: no warning
    experiments.run_sweep([r for r in runs if r["variant"] == "rd"], launcher)
    out = capsys.readouterr().out
    assert out.count("skip ") == 2 and "WARNING" not in out and not calls.exists()


# a sweep stops when a run it started ends by SIGINT or SIGTERM (sent to that run alone, as `kill PID`
# or a Ctrl-C that reaches only the child would): the run is "stopped", not FAILED, the other run under
# way gets the same signal, no run starts after them, "interrupted" is said once, and the sweep exits
# 128 + signum. The children are real processes.
_EXP_SIGNALLED_TRAIN = """
import os, signal, sys, time
from pathlib import Path
argv = sys.argv[1:]
out = Path(argv[argv.index("--out_dir") + 1])
with open(os.environ["EXP_CALLS"], "a") as f:
    f.write(out.name + "\\n")
def stop(signum, frame):  # as train.py does: stop after the step, save last.pt, exit 128 + signum
    (out / "last.pt").write_bytes(b"")
    sys.exit(128 + signum)


if os.environ["EXP_CATCH"] == "1":  # train.py saves on these two (SIGHUP: the sweep sends SIGTERM)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
(out / "ready.tmp").write_text(str(os.getpid()))
(out / "ready.tmp").rename(out / "ready")
time.sleep(120)  # until a signal ends it
"""


def _exp_wait_for(path):
    """Wait until path exists (a child says it is ready); no timing is asserted, 120 s is a hang."""
    for _ in range(2400):
        if path.exists():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.parametrize("sig, catch", [(signal.SIGINT, "1"), (signal.SIGTERM, "1"), (signal.SIGTERM, "0")])
def test_exp_sweep_stops_when_a_run_ends_by_a_signal(_train_data, tmp_path, monkeypatch, capsys, sig, catch):
    fake, calls, out = tmp_path / "fake_train.py", tmp_path / "calls", tmp_path / "runs"
    fake.write_text(_EXP_SIGNALLED_TRAIN)
    monkeypatch.setattr(experiments, "TRAIN", str(fake))
    monkeypatch.setenv("EXP_CALLS", str(calls))
    monkeypatch.setenv("EXP_CATCH", catch)  # "0": the signal kills the child (exit -signum)
    def send():  # once both runs are under way, to one of them
        _exp_wait_for(out / "block_L2_s0" / "ready")
        os.kill(_exp_wait_for(out / "prenorm_L2_s0" / "ready"), sig)

    sender = threading.Thread(target=send)
    sender.start()
    argv = ["sweep", "custom", "--data", str(_train_data[0]), "--variants", "prenorm,block", "--depths", "2",
            "--seeds", "0-1", "--jobs", "2", "--out", str(out)]
    assert experiments.main(argv) == 128 + sig
    sender.join()
    captured = capsys.readouterr()
    rc = 128 + sig if catch == "1" else -sig
    name = signal.Signals(sig).name
    again = "resumes it from its last.pt" if catch == "1" else "starts it again"  # saved, or killed
    for run in ("prenorm_L2_s0", "block_L2_s0"):
        assert f"{run}: stopped by {name} (exit {rc}); the same command {again}\n" in captured.out
    assert "FAILED" not in captured.out + captured.err and "failed" not in captured.err
    assert "0 done, 0 failed, 2 stopped" in captured.out
    assert captured.err.splitlines() == ["interrupted: run the same command again to resume (finished runs are "
                                         "skipped, the others continue from their last.pt)"]
    assert (captured.out + captured.err).count("interrupted") == 1
    assert sorted(calls.read_text().split()) == ["block_L2_s0", "prenorm_L2_s0"]  # seed 1 never started


# a Ctrl-C at the terminal reaches the sweep (its process group); the sweep passes it on to each run under
# way once, and prints each as stopped (never FAILED) before the one "interrupted" line
_EXP_SWEEP_DRIVER = "import sys, experiments; experiments.TRAIN = sys.argv[1]; sys.exit(experiments.main(sys.argv[2:]))"


def test_exp_terminal_ctrl_c_stops_the_sweep_and_its_runs_once(_train_data, tmp_path):
    fake, calls, out = tmp_path / "fake_train.py", tmp_path / "calls", tmp_path / "runs"
    fake.write_text(_EXP_SIGNALLED_TRAIN)
    argv = ["sweep", "custom", "--data", str(_train_data[0]), "--variants", "prenorm,block", "--depths", "2",
            "--seeds", "0-1", "--jobs", "2", "--out", str(out)]
    # a session of its own, as a terminal's foreground job; Ctrl-C not ignored (as it is under `&` in a script)
    sweep = subprocess.Popen([sys.executable, "-c", _EXP_SWEEP_DRIVER, str(fake), *argv], cwd=_TRAIN_ROOT,
                             env=dict(_train_env(), EXP_CALLS=str(calls), EXP_CATCH="1"), start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [_exp_wait_for(out / name / "ready") for name in ("prenorm_L2_s0", "block_L2_s0")]
    os.killpg(sweep.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the whole foreground group
    stdout, stderr = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, stderr
    for name in ("prenorm_L2_s0", "block_L2_s0"):
        assert stdout.count(f"{name}: stopped by SIGINT (exit 130)") == 1, stdout
    assert "FAILED" not in stdout + stderr and "Traceback" not in stderr
    assert stderr.count("interrupted") == 1 and stderr.startswith("interrupted: run the same command again")
    assert sorted(calls.read_text().split()) == ["block_L2_s0", "prenorm_L2_s0"]  # seed 1 never started
    for pid in pids:  # no run is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _exp_routed_run(root, recorded=None):
    """A run folder with a real best.pt of a tiny RD model (untrained) on a tiny demo corpus in
    root/demo; the checkpoint records that folder as `recorded` (default: its absolute path)."""
    data = prepare_data.prepare("demo", root / "demo", demo_mb=0.05)
    config = dict(vocab_size=prepare_data.load_meta(data)["vocab_size"], sequence_len=16, n_layer=2, n_head=2,
                  n_embd=16, residual="attnres", rd="decoupled", attnres_block=2)
    d = _exp_run(root / "runs", "rd_L2_s0", "rd", 0, 3.0, depth=2)
    torch.manual_seed(0)
    torch.save(dict(model=GPT(GPTConfig(**config)).state_dict(), config=config,
                    train_args=dict(data=str(recorded or data))), d / "best.pt")
    return root / "runs"


def test_exp_route_matrix_rows_reads_columns_pool_order(tmp_path):
    reads, sources, matrix = experiments.route_matrix(_exp_routed_run(tmp_path) / "rd_L2_s0")
    assert reads == ["layer0.attn", "layer0.attn.v", "layer0.mlp", "layer1.attn", "layer1.attn.v", "layer1.mlp",
                     "readout"]
    assert sources == ["emb", "C0", "C1", "P"]
    assert matrix[0] == [1.0, None, None, None]  # the first read sees only the embedding
    assert matrix[2] == pytest.approx([0.5, None, None, 0.5]) and matrix[-1] == pytest.approx([1 / 3] * 3 + [None])


@pytest.mark.skipif(not _EXP_HAS_MPL,
                    reason="needs matplotlib (optional: pip install matplotlib); the no-matplotlib path is tested below")
def test_exp_plots_headless(tmp_path, capsys):
    runs_dir = _exp_routed_run(tmp_path)
    _exp_run(runs_dir, "rd_L2_s1", "rd", 1, 2.5, depth=2, evals=((0, 4.0), (100, 3.1), (200, 2.5)))
    assert experiments.main(["report", str(runs_dir), "--heatmap", "rd_L2_s0"]) == 0  # and --plots
    sizes = {}
    for png in ("val_loss.png", "routes_rd_L2_s0.png"):
        data = (runs_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        sizes[png] = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR: width, height
    dpi = experiments.PLOT_DPI
    assert sizes["val_loss.png"] == (8 * dpi, 6 * dpi)  # the figure's own size: nothing cropped
    assert sizes["routes_rd_L2_s0.png"][0] >= 6.4 * dpi and sizes["routes_rd_L2_s0.png"][1] >= 3.6 * dpi


@pytest.mark.parametrize("matplotlib", ["as installed", "missing"])
def test_exp_heatmap_of_a_corrupt_checkpoint_is_one_clear_line(tmp_path, monkeypatch, capsys, matplotlib):
    if matplotlib == "missing":
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    runs_dir = _exp_routed_run(tmp_path)
    (runs_dir / "rd_L2_s0" / "best.pt").write_bytes(b"not a checkpoint")
    assert experiments.main(["report", str(runs_dir), "--heatmap", "rd_L2_s0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint ") and "corrupt or truncated" in err and err.count("\n") == 1


# report --heatmap from another folder: the run's data (recorded relative to where train.py ran) is
# found from the run folder; once moved, the error names --data_root, which finds it
def test_exp_heatmap_finds_the_data_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the data is read with or without plots
    runs_dir = _exp_routed_run(tmp_path, recorded="demo")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    opened, open_split = [], prepare_data.open_split
    monkeypatch.setattr(prepare_data, "open_split", lambda d, split: opened.append(split) or open_split(d, split))
    assert experiments.main(["report", str(runs_dir), "--heatmap", "rd_L2_s0"]) == 0
    assert opened == ["val"]  # the routes are averaged over val crops (docs/experiments.md)
    shutil.move(tmp_path / "demo", tmp_path / "store")
    (tmp_path / "data_root").mkdir()
    shutil.move(tmp_path / "store", tmp_path / "data_root" / "demo")
    capsys.readouterr()
    assert experiments.main(["report", str(runs_dir), "--heatmap", "rd_L2_s0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --data_root DIR" in err, err
    assert experiments.main(["report", str(runs_dir), "--heatmap", "rd_L2_s0", "--data_root",
                             str(tmp_path / "data_root")]) == 0


def test_exp_plots_without_matplotlib_print_the_message(tmp_path, monkeypatch, capsys):
    _exp_study(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert experiments.main(["report", str(tmp_path), "--plots"]) == 0
    assert experiments.NO_MATPLOTLIB in capsys.readouterr().out
    assert (tmp_path / "report.md").exists() and not list(tmp_path.glob("*.png"))


def test_exp_real_sweep_through_train_py(tmp_path, capsys):
    """Two 3-step runs of the tiny sweep (shrunk by flags after --), the report, and a resumed no-op."""
    prepare_data.prepare("demo", tmp_path / "data/demo", demo_mb=0.2)
    argv = ["sweep", "tiny", "--out", str(tmp_path / "runs"), "--variants", "prenorm,rd", "--seeds", "0",
            "--depths", "2", "--data_root", str(tmp_path / "data"), "--", "--n_embd", "32", "--n_head", "2",
            "--sequence_len", "32", "--batch_size", "8", "--max_iters", "3", "--eval_tokens", "256",
            "--milestones", "0.5K", "--device", "cpu"]
    assert experiments.main(argv) == 0
    # not a terminal: a line per evaluation of each run (steps 0, 2 at the milestone, 3), before its end line
    lines = capsys.readouterr().out.splitlines()
    for i, name in enumerate(("prenorm_L2_s0", "rd_L2_s0"), 1):
        mine = [line.split(": ", 1)[1] for line in lines if line.startswith(f"[{i}/2] {tmp_path / 'runs' / name}: ")]
        started = "started" + " OMP_NUM_THREADS=1" * ("OMP_NUM_THREADS" not in os.environ)  # tiny's
        assert mine[0] == started and mine[-1].startswith("done in ") and len(mine) == 5, lines
        assert [re.sub(r"[\d.]+\d", "X", m) for m in mine[1:-1]] == [
            f"eval step {step}/3 | train X | val X | bpc X" for step in (0, 2, 3)], lines
    assert experiments.main(["report", str(tmp_path / "runs"), "--baseline", "prenorm"]) == 0
    text = (tmp_path / "runs/report.md").read_text()
    assert "| **prenorm** (baseline) | 1 |" in text and ("| 0/1 |" in text or "| 1/1 |" in text)
    assert "val @0.5K" in text
    capsys.readouterr()
    assert experiments.main(argv) == 0
    assert capsys.readouterr().out.count("skip ") == 2


# sweep custom: the grid of a prepared folder, named by its meta.json; one routing block per depth for every
# AttnRes variant (the largest automatic one among them)
def _exp_renamed_data(demo, root, dataset):
    folder = Path(root) / "mine"
    shutil.copytree(demo, folder)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps(dict(meta, dataset=dataset)))
    return folder


def test_exp_custom_grid_plan_and_like_for_like_block(_train_data, tmp_path):
    data = _exp_renamed_data(_train_data[0], tmp_path, "tinystories")
    runs = experiments.plan("custom", tmp_path / "out", "0-1", "4,8", "prenorm,block,wav,rd", data=data)
    assert [r["name"] for r in runs[:8]] == [f"{v}_L4_s{s}" for s in (0, 1) for v in ("prenorm", "block", "wav", "rd")]
    assert len(runs) == 16 and [r["depth"] for r in runs] == [4] * 8 + [8] * 8
    assert {r["dataset"] for r in runs} == {"tinystories"}  # from meta.json, not the folder's name
    assert all(r["args"][r["args"].index("--data") + 1] == str(data) for r in runs)
    for r in runs:  # at 4 and 8 layers Block AttnRes alone would take 2 sublayers, WAV takes 4: all get 4
        routed = r["variant"] != "prenorm"
        assert r["attnres_block"] == (4 if routed else None)
        assert r["args"].count("--attnres_block") == routed
        assert not routed or r["args"][r["args"].index("--attnres_block") + 1] == "4"
    parents = experiments.plan("custom", tmp_path / "out", "0", "8,24", "block,rd", data=data)
    assert [r["attnres_block"] for r in parents] == [2, 2, 6, 6]  # without WAV: the automatic block
    given = experiments.plan("custom", tmp_path / "out", "0", "8", "prenorm,wav", ["--attnres_block", "8"], data=data)
    assert [r["attnres_block"] for r in given] == [None, 8] and given[1]["args"].count("--attnres_block") == 1
    default = experiments.plan("custom", tmp_path / "out", None, None, "block", data=data)
    assert [(r["depth"], r["seed"]) for r in default] == [(4, 0), (4, 1), (4, 2)]
    assert {r["attnres_block"] for r in experiments.plan("tiny", tmp_path / "t") if r["variant"] != "prenorm"} == {4, None}


# sweep's bad grid input: one error line, exit 2
def test_exp_bad_grid_input_is_one_error_line(_train_data, tmp_path, capsys):
    demo = str(_train_data[0])
    custom = ["sweep", "custom", "--out", str(tmp_path / "runs"), "--dry_run"]
    cases = [
        ([*custom, "--data", demo, "--variants", "prenorm,blok"], "--variants prenorm,blok: unknown 'blok'; choose"),
        ([*custom, "--data", demo, "--variants", "wav,wav"], "--variants wav,wav: a variant twice"),
        ([*custom, "--data", demo, "--variants", "block", "--seeds", "2-0"], "--seeds 2-0: expected distinct"),
        ([*custom, "--data", demo, "--variants", "block", "--seeds", "0,1,1"], "--seeds 0,1,1: expected distinct"),
        ([*custom, "--data", demo, "--variants", "block", "--seeds", "a-b"], "--seeds a-b: expected"),
        ([*custom, "--data", demo, "--variants", "block", "--depths", "0"], "--depths 0: expected distinct integers >= 1"),
        ([*custom, "--data", demo, "--variants", "wav", "--depths", "1"], "--depths 1: n_layer=1: WAV needs"),
        ([*custom, "--data", str(tmp_path / "text8"), "--variants", "block"],
         f"data folder {tmp_path / 'text8'} does not exist; run: python prepare_data.py text8 --out"),
        ([*custom, "--variants", "block"], "sweep custom needs --data FOLDER"),
        ([*custom, "--data", demo], "sweep custom needs --data FOLDER (a prepared dataset) and --variants"),
        (["sweep", "tiny", "--data", demo, "--dry_run"], "only sweep custom takes a data folder"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--n_layer", "8"], "--n_layer after --: the sweep"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--data=x"], "--data after --"),
        ([*custom, "--data", demo, "--variants", "block", "--jobs", "0"], "--jobs 0: must be at least 1"),
        # flags after -- are train.py's, checked by its parser before any run: abbreviations and misspellings
        # (once taken by prefix, a 3-layer model in a folder named L2), bad values, the grid's flags by name
        ([*custom, "--data", demo, "--variants", "block", "--depths", "2", "--", "--n_lay", "3"],
         "after --: unrecognized arguments: --n_lay 3 (did you mean --n_layer?); the sweep sets --n_layer itself: "
         "use --depths (the flags after -- go to every run: python train.py --help)"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--max_iter", "5"],
         "after --: unrecognized arguments: --max_iter 5 (did you mean --max_iters?)"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--max_iters", "abc"],
         "after --: argument --max_iters: invalid int value: 'abc'"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--n_layer=3"], "--n_layer after --: the sweep"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--wav", "True"], "--wav after --: the sweep sets it"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--out_dir", "x"], "--out_dir after --"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--resume"], "--resume after --: the sweep resumes"),
        ([*custom, "--data", demo, "--variants", "block", "--", "--help"], "--help after --: the flags after -- are"),
        (["sweep", "wav_paper", "--dry_run", "--", "--preset", "wav12"],
         "--preset after --: sweep wav_paper sets the preset of each depth (wav12, wav24, wav48)"),
        ([*custom, "--data", demo, "--variants", "block", "--out", str(tmp_path / "a_file" / "runs")],
         f"--out {tmp_path / 'a_file' / 'runs'}: cannot make that folder (a file is in the way: "
         f"{tmp_path / 'a_file'}); choose another --out"),
        (["report", str(tmp_path), "--", "--baseline", "rd"], "report takes no flags after -- (got --baseline rd)"),
    ]
    (tmp_path / "a_file").write_text("")
    for argv, message in cases:
        assert experiments.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1, argv
        assert message in captured.err, (argv, captured.err)


# --jobs N: N runs at once, each with its share of the CPU cores, or on CUDA its own GPUs
def test_exp_job_slots_share_cores_or_give_each_run_its_gpus(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(experiments, "_cores", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert experiments.job_slots(1) == [{}]  # one run: the environment as it is
    assert experiments.job_slots(2) == [{"OMP_NUM_THREADS": "4"}] * 2
    assert experiments.job_slots(3, per_run=2) == [{"OMP_NUM_THREADS": "1"}] * 3
    monkeypatch.setattr(experiments, "_cores", lambda: 2)
    assert experiments.job_slots(4) == [{"OMP_NUM_THREADS": "1"}] * 4  # more runs than cores: not 0
    monkeypatch.setattr(experiments, "_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert experiments.job_slots(2) == [{}, {}]  # the user's setting stands
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert experiments.job_slots(4) == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]
    assert experiments.job_slots(2, per_run=2) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert experiments.job_slots(2, extra=["--device", "cpu"]) == [{}, {}]  # CPU runs: OMP_NUM_THREADS is set
    with pytest.raises(experiments.UsageError, match="--jobs 5: 4 visible GPU"):
        experiments.job_slots(5)
    with pytest.raises(experiments.UsageError, match="drop --device"):
        experiments.job_slots(2, extra=["--device", "cuda:1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    slots = experiments.job_slots(2)
    assert slots == [{"CUDA_VISIBLE_DEVICES": "5"}, {"CUDA_VISIBLE_DEVICES": "7"}]  # among the visible ones
    run = dict(env={"OMP_NUM_THREADS": "1"})
    assert experiments._run_env(run, slots[1]) == {"CUDA_VISIBLE_DEVICES": "7"}  # the user's OMP_NUM_THREADS stands


def test_exp_custom_sweep_runs_two_at_once_resumes_and_reports(_train_data, tmp_path, monkeypatch, capsys):
    """Two real tiny runs with --jobs 2, one thread each (on 2 cores): both start before either ends."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(experiments, "_cores", lambda: 2)
    tiny = [a for i, a in enumerate(_TRAIN_TINY) if "--n_layer" not in _TRAIN_TINY[max(0, i - 1):i + 1]]
    argv = ["sweep", "custom", "--data", str(_train_data[0]), "--variants", "prenorm,wav", "--depths", "2",
            "--seeds", "0", "--jobs", "2", "--out", str(tmp_path / "runs"), "--", *tiny, "--max_iters", "3"]
    assert experiments.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    events = [line.split(": ")[1].split()[0] for line in lines if line.startswith("[")]
    assert [e for e in events if e != "eval"] == ["started", "started", "done", "done"], lines
    assert "2 done, 0 failed" in lines[-1] and "2 at a time" in lines[-1]
    info = {v: json.loads((tmp_path / f"runs/{v}_L2_s0/run.json").read_text()) for v in ("prenorm", "wav")}
    assert all(i["command"].startswith("OMP_NUM_THREADS=1 ") and i["dataset"] == "demo" for i in info.values())
    assert info["wav"]["attnres_block"] == 4 and info["prenorm"]["attnres_block"] is None
    assert experiments.main(["report", str(tmp_path / "runs"), "--baseline", "prenorm"]) == 0
    text = (tmp_path / "runs/report.md").read_text()
    assert "## demo, 2 layers" in text and "Routing block: 4 sublayers for every AttnRes variant" in text
    assert "| **prenorm** (baseline) | 1 |" in text and re.search(r"\| wav \| 1 \| \d\.\d{4} ± – \|", text)
    capsys.readouterr()
    assert experiments.main(argv) == 0  # the same command again: both finished, nothing runs
    assert capsys.readouterr().out.count("skip ") == 2

_EXP_FAKE_DDP_TRAIN = """
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["EXP_CALLS"], "a") as f:
    f.write(json.dumps(dict(argv=argv, rank=os.environ["RANK"], world=os.environ["WORLD_SIZE"])) + "\\n")
if os.environ["RANK"] == "0":
    summary = Path(argv[argv.index("--out_dir") + 1]) / "summary.json"
    summary.write_text(json.dumps(dict(final=dict(val_loss=1.5))))
"""


# --torchrun N: each run is torchrun --standalone --nproc_per_node=N train.py -- ...: N processes of it;
# without --out the run folders go to runs/NAME
def test_exp_sweep_torchrun_and_the_default_out(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake_train.py"
    fake.write_text(_EXP_FAKE_DDP_TRAIN)
    monkeypatch.setenv("EXP_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.setattr(experiments, "TRAIN", str(fake))
    monkeypatch.chdir(tmp_path)
    prepare_data.prepare("demo", tmp_path / "data" / "demo", demo_mb=0.01)
    capsys.readouterr()
    argv = ["sweep", "tiny", "--seeds", "0", "--variants", "prenorm", "--torchrun", "2"]
    assert experiments.main([*argv, "--dry_run"]) == 0
    command = capsys.readouterr().out.splitlines()[0]
    assert " -m torch.distributed.run --standalone --nproc_per_node=2 " in command
    assert f" {fake} -- " in command and " --out_dir runs/tiny/prenorm_L4_s0" in command
    assert experiments.main(argv) == 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert sorted((c["rank"], c["world"]) for c in calls) == [("0", "2"), ("1", "2")]
    assert all("--rd" in c["argv"] for c in calls)  # after --: torchrun does not take it for its --rdzv_*
    assert (tmp_path / "runs" / "tiny" / "prenorm_L4_s0" / "summary.json").exists()



# the report states the routing block of each group's AttnRes variants, and flags groups where they differ
def test_exp_report_states_the_routing_block(tmp_path):
    _exp_study(tmp_path)
    assert experiments.main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "## demo, 4 layers\n\nRouting block: 2 sublayers for every AttnRes variant (like for like)." in text
    assert "## fineweb_edu, 16 layers\n\nRouting block: 4 sublayers" in text
    d = _exp_run(tmp_path, "wav_L4_s0", "wav", 0, 2.0)  # a hand-run WAV: automatic block 4 at 4 layers
    summary = json.loads((d / "summary.json").read_text())
    summary["config"].update(wav=True)
    (d / "summary.json").write_text(json.dumps(summary))
    assert experiments.main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "**Routing blocks differ** (block: 2, rd: 2, wav: 4 sublayers)" in text
    assert "Routing block: 2 sublayers" not in text and "Routing block: 4 sublayers" in text  # fineweb_edu


# the report's statistics on hand-made runs whose seeds are 2, 3 and 10 (which sort wrongly as text), with
# a variant that lacks a seed: pairs, wins and milestones go by seed value, never by position
def test_exp_report_pairs_by_seed_value_with_missing_seeds_and_seed_10(tmp_path):
    block = {2: 2.0, 3: 2.5, 10: 3.0}
    rd = {10: 2.7, 2: 2.1}  # no seed 3; by value: +0.1 (seed 2), -0.3 (seed 10)
    block_at = {2: 2.8, 3: 2.9, 10: 3.1}
    rd_at = {10: 3.0, 2: 2.8}  # at 2K tokens: a tie on seed 2, -0.1 on seed 10
    for variant, finals, at in (("block", block, block_at), ("rd", rd, rd_at)):
        for seed, val in finals.items():
            _exp_run(tmp_path, f"{variant}_L4_s{seed}", variant, seed, val,
                     milestones=[("10K", 10_000, val), ("2K", 2_000, at[seed])])
    _exp_run(tmp_path, "wav_L4_s10", "wav", 10, 2.9)
    d = _exp_run(tmp_path, "mine", "prenorm", None, 2.2)  # no seed anywhere: counted, never paired
    summary = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps(dict(summary, train={})))
    for variant in ("block", "rd"):  # at 8 layers, neither has a seed: nothing pairs
        d = _exp_run(tmp_path, f"L8/{variant}", variant, None, 2.0, depth=8)
        (d / "summary.json").write_text(json.dumps(dict(json.loads((d / "summary.json").read_text()), train={})))
    runs = experiments.load_runs(tmp_path)
    assert [r["name"] for r in runs][2:5] == ["block_L4_s10", "block_L4_s2", "block_L4_s3"]  # folders: text order
    group, seedless = experiments.summarize(runs, "block")
    assert [(row["variant"], row["seeds"]) for row in seedless["rows"]] == [("block", [None]), ("rd", [None])]
    assert seedless["rows"][1]["delta"]["n"] == 0
    assert group["milestones"] == ["2K", "10K"]  # token order, not text order
    rows = {row["variant"]: row for row in group["rows"]}
    assert [row["variant"] for row in group["rows"]] == ["prenorm", "block", "wav", "rd"]  # VARIANTS order
    assert rows["block"]["seeds"] == [2, 3, 10] and rows["rd"]["seeds"] == [2, 10]  # by value
    assert rows["block"]["val"] == pytest.approx((2.5, 0.5))
    assert rows["rd"]["val"] == pytest.approx((2.4, statistics.stdev([2.1, 2.7])))
    assert rows["rd"]["delta"] == pytest.approx(dict(mean=-0.1, std=statistics.stdev([0.1, -0.3]), wins=1, ties=0,
                                                     n=2))
    assert rows["rd"]["at"]["2K"]["delta"] == pytest.approx(dict(mean=-0.05, std=statistics.stdev([0.0, -0.1]),
                                                                 wins=1, ties=1, n=2))
    assert rows["rd"]["at"]["2K"]["val"] == pytest.approx((2.9, statistics.stdev([2.8, 3.0])))
    assert rows["wav"]["delta"] == pytest.approx(dict(mean=-0.1, std=None, wins=1, ties=0, n=1))  # seed 10's pair
    assert rows["prenorm"]["seeds"] == [None] and rows["prenorm"]["val"] == (2.2, None)
    assert rows["prenorm"]["delta"]["n"] == 0  # a run without a seed pairs with none
    assert experiments.main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| rd | 2 | 2.4000 ± 0.4243 | 3.4625 ± 0.6121 | -0.1000 ± 0.2828 | 1/2 |" in text
    assert "| prenorm | 1 | 2.2000 ± – | 3.1739 ± – | – | – |" in text
    assert "| variant | val @2K | Δ @2K | wins | val @10K |" in text
    assert "| rd | 2.9000 ± 0.1414 | -0.0500 ± 0.0707 | 1/2 (1 tied) | 2.4000 ± 0.4243 | -0.1000 ± 0.2828 | 1/2 |" \
        in text
    # the same variant and seed twice (two sweeps' folders in one report) pairs ambiguously: one line
    _exp_run(tmp_path / "again", "rd_L4_s2", "rd", 2, 2.0)
    with pytest.raises(experiments.UsageError, match="runs again/rd_L4_s2 and rd_L4_s2 are both rd with seed 2"):
        experiments.summarize(experiments.load_runs(tmp_path), "block")


# report: damaged run folders are one error line (a damaged summary.json), or left out with a note that
# says so (run.json, metrics.jsonl lines); never a traceback
def test_exp_report_damaged_files_are_one_line_or_a_note(tmp_path, capsys):
    _exp_study(tmp_path)
    d = tmp_path / "rd_L4_s0"
    with open(d / "metrics.jsonl", "r+") as f:  # valid JSON that is not an object, and a bad eval line
        lines = f.read().split("\n")
        f.seek(0)
        f.write("\n".join(lines[:1] + ["[1, 2]", "3", '"text"', '{"type": "eval", "step": "x"}'] + lines[1:]))
    (tmp_path / "block_L4_s1" / "run.json").write_text("[]")  # a list: read from summary.json alone
    (tmp_path / "block_L4_s2" / "run.json").write_text(json.dumps(dict(variant="block", seed="2")))
    assert experiments.main(["report", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"note: {d / 'metrics.jsonl'}: 4 damaged line(s) left out\n" in err
    assert f"note: {tmp_path / 'block_L4_s1' / 'run.json'} is damaged (it is not a JSON object): left out" in err
    assert "block_L4_s2/run.json is damaged (seed is not an integer)" in err and "Traceback" not in err
    text = (tmp_path / "report.md").read_text()
    assert "Left out: " in text and "4 damaged line(s) left out" in text
    assert "| **block** (baseline) | 3 |" in text  # both block runs still count, from their summary.json
    runs = {r["name"]: r for r in experiments.load_runs(tmp_path)}
    assert len(runs["rd_L4_s0"]["evals"]) == 3 and runs["block_L4_s1"]["seed"] == 1  # train.seed

    summary = tmp_path / "block_L4_s0" / "summary.json"
    good = json.loads(summary.read_text())
    cases = [
        ("[1]", "(not a JSON object)"),
        (json.dumps(dict(good, routes=dict(entropy_norm="high"))), "(routes.entropy_norm is not an object of numbers)"),
        (json.dumps(dict(good, milestones=[1])), "(milestones is not an object)"),
        (json.dumps(dict(good, milestones={"1K": 5})), "(milestone 1K has no tokens and val_loss)"),
        (json.dumps(dict(good, train=dict(seed="0"))), "(train.seed is not an integer)"),
        (json.dumps(dict(good, wall_time_s="10 s")), "(wall_time_s is not a number)"),
        (json.dumps(dict(good, final=dict(val_loss=float("nan")))), "(no final val_loss)"),
        (b"\xff\xfe{}", "(not UTF-8 text)"),
    ]
    for content, message in cases:
        (summary.write_bytes if isinstance(content, bytes) else summary.write_text)(content)
        assert experiments.main(["report", str(tmp_path)]) == 2, message
        err = capsys.readouterr().err
        assert err.startswith(f"error: {summary} is damaged {message}") and err.count("\n") == 1, err
    summary.unlink()
    summary.mkdir()  # a summary.json that cannot be read (a folder; a file without permission reads the same)
    assert experiments.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read {summary} (Is a directory)") and err.count("\n") == 1
    summary.rmdir()
    (d / "metrics.jsonl").unlink()
    (d / "metrics.jsonl").mkdir()  # unreadable metrics: the run is reported without its curve
    (tmp_path / "report.md").unlink()
    (tmp_path / "report.md").mkdir()  # and report.md cannot be written: one line
    assert experiments.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"note: {d / 'metrics.jsonl'} cannot be read (Is a directory): the run's curve is left out" in err
    assert err.splitlines()[-1] == (f"error: cannot write the report into {tmp_path} (Is a directory): make that "
                                    "folder writable, or report a writable copy of it") and "Traceback" not in err


# a sweep's run folder: a planted link named train.log is refused, not followed
def test_exp_sweep_never_follows_a_planted_train_log_link(tmp_path, monkeypatch, capsys):
    fake, outside = tmp_path / "fake_train.py", tmp_path / "outside.txt"
    fake.write_text(_EXP_FAKE_TRAIN)
    outside.write_text("not the sweep's")
    monkeypatch.setenv("EXP_CALLS", str(tmp_path / "calls.jsonl"))
    runs = experiments.plan("tiny", tmp_path / "out", seeds="0", variants="prenorm,rd")
    (tmp_path / "out" / "prenorm_L4_s0").mkdir(parents=True)
    (tmp_path / "out" / "prenorm_L4_s0" / "train.log").symlink_to(outside)
    assert experiments.run_sweep(runs, [sys.executable, str(fake)]) == ["prenorm_L4_s0"]
    out = capsys.readouterr().out
    assert "prenorm_L4_s0: FAILED: Too many levels of symbolic links" in out and "1 done, 1 failed" in out
    assert outside.read_text() == "not the sweep's"


# the progress of a running run on a terminal: one status line, redrawn in place under each new line;
# elsewhere a line per evaluation, never twice, also when train.py rewrites metrics.jsonl on resume
class _ExpTerminal(io.StringIO):
    def isatty(self):
        return True


def test_exp_progress_in_place_on_a_terminal_and_a_line_per_eval_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # shutil.get_terminal_size reads it first
    d = tmp_path / "wav_L4_s0"
    d.mkdir()
    (d / "train.log").write_text("an older run's lines\ntraining: 300 steps x 1,024 tokens\n")
    metrics = d / "metrics.jsonl"
    old = [dict(type="eval", step=0, tokens=0, train_loss=4.0, val_loss=4.1)]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in old))  # a resumed run's earlier lines
    terminal, plain = _ExpTerminal(), io.StringIO()
    shows = [experiments.Progress(terminal), experiments.Progress(plain)]
    for show in shows:
        show.watch("[1/2] wav", experiments.RunTail(dict(name="wav_L4_s0", dir=d), len("an older run's lines\n")))
    new = [dict(type="train", step=25, tokens=25_600, loss=2.5), dict(type="eval", step=25, tokens=25_600,
                                                                       train_loss=2.4, val_loss=2.45, val_bpc=3.5)]
    with open(metrics, "a") as f:
        f.write("".join(json.dumps(x) + "\n" for x in new) + '{"type": "tra')  # a line being written
    for show in shows:
        show.poll()
    status = "[wav_L4_s0: eval step 25/300 | train 2.4000 | val 2.4500 | bpc 3.5000]"
    assert terminal.getvalue() == "\r\x1b[K" + status
    shows[0].say("[2/2] rd: started")
    assert terminal.getvalue().endswith("\r\x1b[K[2/2] rd: started\n" + status)
    assert "\n" not in terminal.getvalue().replace("[2/2] rd: started\n", "")  # no line per evaluation
    assert plain.getvalue() == f"[1/2] wav: {status[12:-1]}\n"  # the step 0 evaluation was not news
    rewritten = tmp_path / "metrics.tmp"  # train.py's repair on resume: the same lines, a new file
    rewritten.write_text("".join(json.dumps(x) + "\n" for x in old + new))
    os.replace(rewritten, metrics)
    with open(metrics, "a") as f:
        f.write(json.dumps(dict(type="eval", step=50, tokens=51_200, train_loss=2.0, val_loss=2.1)) + "\n")
    shows[1].unwatch("[1/2] wav")
    assert plain.getvalue().splitlines()[1:] == ["[1/2] wav: eval step 50/300 | train 2.0000 | val 2.1000"]
    shows[0].poll()
    assert terminal.getvalue().endswith("\r\x1b[K[wav_L4_s0: eval step 50/300 | train 2.0000 | val 2.1000]")


# --dry_run names what the real run would need; the real run then stops before its first run, with one line
def test_exp_dry_run_names_what_is_missing_and_the_sweep_stops_before_starting(tmp_path, monkeypatch, capsys):
    data, out = tmp_path / "data", tmp_path / "runs"
    argv = ["sweep", "rd_paper", "--seeds", "0", "--depths", "16", "--data_root", str(data), "--out", str(out)]
    assert experiments.main([*argv, "--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(" --preset rd_s " in line for line in lines[:5])
    assert lines[5] == (f"missing: data folder {data / 'fineweb_edu'} does not exist; run: python prepare_data.py "
                        f"fineweb_edu --out {data / 'fineweb_edu'} (the sweep stops before its first run until then)")
    assert experiments.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: data folder {data / 'fineweb_edu'} does not exist; run: python prepare_data.py "
                            f"fineweb_edu --out {data / 'fineweb_edu'}\n")
    assert captured.out == "" and not out.exists()  # nothing started
    # the demo is no download: the dry run says the sweep prepares it, and the sweep does (once, before its runs)
    fake = tmp_path / "fake_train.py"
    fake.write_text(_EXP_FAKE_TRAIN)
    monkeypatch.setenv("EXP_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.setattr(experiments, "TRAIN", str(fake))
    tiny = ["sweep", "tiny", "--seeds", "0", "--variants", "prenorm", "--data_root", str(data), "--out", str(out)]
    assert experiments.main([*tiny, "--dry_run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"note: {data / 'demo'} is not prepared yet; the sweep prepares it first (python prepare_data.py demo "
        f"--out {data / 'demo'})")
    assert experiments.main(tiny) == 0
    assert "preparing the demo dataset in" in capsys.readouterr().out
    assert prepare_data.load_meta(data / "demo")["dataset"] == "demo"


# val_loss.png's difference panel: a zero line and ticks that read as plain numbers on both sides of 0, linear
# when the variants lie close, symlog (still plain ticks) when one is far off; the two rows sit close together
def _exp_curves(root, offsets):
    """block and one variant per offset (val loss = block's + offset), seeds 0 and 1, five evaluations."""
    for seed in (0, 1):
        base = [3.0 - 0.2 * i - 0.05 * seed for i in range(5)]
        for variant, offset in {"block": 0.0, **offsets}.items():
            ys = [y + offset * (i + 1) / 5 + 0.002 * seed for i, y in enumerate(base)]
            _exp_run(root, f"{variant}_L4_s{seed}", variant, seed, ys[-1],
                     evals=[(0, 4.0)] + [(1000 * (i + 1), y) for i, y in enumerate(ys)])
    return experiments.load_runs(root)


@pytest.mark.skipif(not _EXP_HAS_MPL, reason="needs matplotlib (optional: pip install matplotlib)")
@pytest.mark.parametrize("offsets, scale", [(dict(rd=-0.02, wav=-0.03, prenorm=0.05), "linear"),
                                            (dict(rd=-0.02, wav=-0.03, prenorm=0.05, rezero=0.9), "symlog")])
def test_exp_val_loss_plot_ticks_are_plain_numbers_and_rows_sit_close(tmp_path, offsets, scale):
    fig = experiments.val_loss_figure(_exp_curves(tmp_path, offsets), "block")
    fig.draw_without_rendering()  # runs the layout
    (top, bottom) = fig.axes[:2]
    assert bottom.get_yscale() == scale
    assert bottom.get_ylabel().endswith("(same seed; log beyond ±0.05)" if scale == "symlog" else "(same seed)")
    ticks = [(t.get_position()[1], t.get_text()) for t in bottom.get_yticklabels() if t.get_text()]
    for value, label in ticks:  # +0.05, −0.1, 0: no ×10⁻², no 1e-2, no offset text
        assert re.fullmatch(r"0|[+−]\d+(\.\d+)?", label), ticks
        assert float(label.replace("−", "-")) == pytest.approx(value, abs=1e-12)
    assert min(v for v, _ in ticks) < 0 < max(v for v, _ in ticks) and len(ticks) >= 4
    assert max(v for v, _ in ticks) >= max(offsets.values()) / 2  # ticks out to the furthest variant
    assert bottom.yaxis.get_offset_text().get_text() == ""
    assert any(list(line.get_ydata()) == [0, 0] for line in bottom.get_lines())  # the zero line
    ymin, ymax = bottom.get_ylim()
    assert ymin < -0.03 and ymax > max(offsets.values())  # every variant's difference is in view
    gap = top.get_position().y0 - bottom.get_position().y1
    assert 0 < gap < 0.06 and fig.get_figheight() <= 6.5  # compact: no empty band between the rows
    labels = [t.get_text() for t in bottom.get_xticklabels() if t.get_text()]
    assert labels[-1].endswith("K") and "1K" in labels  # 5K, not 5000; 1K, not 1000


@pytest.mark.skipif(not _EXP_HAS_MPL, reason="needs matplotlib (optional: pip install matplotlib)")
def test_exp_routes_heatmap_is_wide_with_titles_at_body_size():
    import matplotlib
    reads = ["layer0.attn", "layer0.mlp", "layer1.attn", "layer1.mlp", "readout"]
    sources = ["emb", "C0", "P"]
    matrix = [[1.0, None, None], [0.4, None, 0.6], [0.3, 0.7, None], [0.2, 0.3, 0.5], [0.5, 0.5, None]]
    fig = experiments.routes_figure("block_L2_s0", reads, sources, matrix)
    ax = fig.axes[0]
    body = matplotlib.rcParams["font.size"]
    assert fig.get_figwidth() >= 6.4  # three sources still give a readable width
    assert ax.title.get_fontsize() >= body and ax.title.get_text().startswith("block_L2_s0: mean routing weight")
    assert all(t.get_fontsize() >= 0.9 * body for t in ax.get_xticklabels() + ax.get_yticklabels())
    cells = [t.get_text() for t in ax.texts]
    assert cells == ["1.00", "0.40", "0.60", "0.30", "0.70", "0.20", "0.30", "0.50", "0.50", "0.50"]
    assert all(t.get_fontsize() >= 0.9 * body for t in ax.texts)


# val_loss.png of a sweep with many (dataset, depth) groups (wav_paper: 6) wraps into rows of 3 panel pairs
@pytest.mark.skipif(not _EXP_HAS_MPL, reason="needs matplotlib (optional: pip install matplotlib)")
def test_exp_val_loss_plot_of_many_groups_wraps_into_rows(tmp_path):
    for dataset in ("tinystories", "text8"):
        for depth in (12, 24, 48):
            for variant in ("block", "wav"):
                _exp_run(tmp_path, f"{dataset}/{variant}_L{depth}_s0", variant, 0, 2.0, depth=depth, dataset=dataset,
                         evals=((100, 3.0), (200, 2.5), (300, 2.0 - 0.01 * (variant == "wav"))))
    fig = experiments.val_loss_figure(experiments.load_runs(tmp_path), "block")
    assert tuple(fig.get_size_inches()) == (24.0, 12.0) and len(fig.axes) == 12
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == [f"{d}, {n} layers" for d in ("text8", "tinystories") for n in (12, 24, 48)]


# the report's groups: depths in numeric order (8 before 12); variants in VARIANTS order, any other
# (a plain train.py run of a config no variant names: "custom") after them; the same variant, depth
# and seed on two datasets (wav_paper's tinystories and text8) are two groups, not an ambiguous pair
def test_exp_report_orders_groups_and_variants_and_keeps_datasets_apart(tmp_path):
    for dataset in ("tinystories", "text8"):
        for depth in (12, 8):
            for variant, val in (("wav", 1.9), ("block", 2.0)):
                _exp_run(tmp_path, f"{dataset}/{variant}_L{depth}_s0", variant, 0, val, depth=depth,
                         dataset=dataset)
    d = _exp_run(tmp_path, "text8/mine", "wav", 0, 1.8, depth=8, dataset="text8")
    (d / "run.json").unlink()  # a plain train.py --out_dir: read from its summary.json
    summary = json.loads((d / "summary.json").read_text())
    summary["config"].update(rd="decoupled")  # WAV and RD together: no variant of VARIANTS
    (d / "summary.json").write_text(json.dumps(summary))
    groups = experiments.summarize(experiments.load_runs(tmp_path), "block")
    assert [(g["dataset"], g["depth"]) for g in groups] == [
        ("text8", 8), ("text8", 12), ("tinystories", 8), ("tinystories", 12)]
    assert [row["variant"] for row in groups[0]["rows"]] == ["block", "wav", "custom"]
    assert groups[0]["rows"][2]["delta"]["mean"] == pytest.approx(-0.2)
    for g in groups:  # each pairs within its own dataset
        rows = {row["variant"]: row for row in g["rows"]}
        assert rows["wav"]["delta"] == pytest.approx(dict(mean=-0.1, std=None, wins=1, ties=0, n=1))
    assert experiments.main(["report", str(tmp_path)]) == 0
    headers = re.findall(r"^## (.+)$", (tmp_path / "report.md").read_text(), re.M)
    assert headers == ["text8, 8 layers", "text8, 12 layers", "tinystories, 8 layers",
                       "tinystories, 12 layers"]


# a damaged line of metrics.jsonl is noted wherever it is, also as the last complete line; only a
# cut last line (no newline: an interrupted run's, which train.py repairs on resume) goes silently
def test_exp_report_notes_a_damaged_last_metrics_line_but_not_a_cut_one(tmp_path):
    good = json.dumps(dict(type="eval", step=0, tokens=0, val_loss=4.0)) + "\n"
    path, cut = tmp_path / "metrics.jsonl", '{"type": "eval", "st'
    cases = [(good + "{not json\n", 1), (good + "{not json\n" + cut, 1), (good + cut, 0), (good, 0)]
    for text, damaged in cases:
        path.write_text(text)
        notes = []
        assert len(experiments.read_evals(path, notes)) == 1, text
        assert notes == [f"{path}: 1 damaged line(s) left out"] * damaged, text


def _exp_without_train_seed(d):  # a summary.json without train.seed (hand-made, or an old one)
    summary = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps(dict(summary, train={})))


# a seed of 0 is a seed: run.json's seed 0 is taken as it is, not as missing (which would fall back
# on the summary's, which an unfinished run has none of)
def test_exp_report_seed_0_of_run_json_is_a_seed(tmp_path):
    for variant, val in (("block", 2.0), ("rd", 1.9)):
        _exp_without_train_seed(_exp_run(tmp_path, f"{variant}_L4_s0", variant, 0, val))
    _exp_run(tmp_path, "wav_L4_s0", "wav", 0)  # unfinished
    runs = experiments.load_runs(tmp_path)
    assert [(r["name"], r["seed"]) for r in runs] == [
        ("block_L4_s0", 0), ("rd_L4_s0", 0), ("wav_L4_s0", 0)]
    (group,) = experiments.summarize(runs, "block")
    assert group["rows"][1]["delta"] == pytest.approx(dict(mean=-0.1, std=None, wins=1, ties=0,
                                                           n=1))


# a failed run's line shows the last line of its train.log that names an error (a traceback's own
# last line, not the source line above it that also says Error)
_EXP_CRASHING_TRAIN = '''
def check_width():
    raise ValueError("the model is too wide for this data")


print("training: 300 steps")
check_width()
'''


def test_exp_failed_run_shows_the_last_error_line_of_its_log(tmp_path, capsys):
    fake = tmp_path / "fake_train.py"
    fake.write_text(_EXP_CRASHING_TRAIN)
    runs = experiments.plan("tiny", tmp_path / "out", seeds="0", variants="block")
    assert experiments.run_sweep(runs, [sys.executable, str(fake)]) == ["block_L4_s0"]
    assert 'raise ValueError("the model' in (tmp_path / "out/block_L4_s0/train.log").read_text()
    assert ("block_L4_s0: FAILED (exit 1): ValueError: the model is too wide for this data\n"
            in capsys.readouterr().out)


# sweep tiny under --jobs: each run keeps tiny's one thread (not its slot's cores/N), and its
# started line and run.json's command say what it got
def test_exp_tiny_under_jobs_keeps_one_thread_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(experiments, "_cores", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake, calls = tmp_path / "fake_train.py", tmp_path / "calls.jsonl"
    fake.write_text(_EXP_FAKE_TRAIN)
    monkeypatch.setenv("EXP_CALLS", str(calls))
    runs = experiments.plan("tiny", tmp_path / "out", seeds="0", variants="prenorm,block")
    slots = experiments.job_slots(2)
    assert slots == [{"OMP_NUM_THREADS": "4"}] * 2  # what a sweep without its own setting gives
    assert experiments.run_sweep(runs, [sys.executable, str(fake)], slots=slots) == []
    assert [json.loads(line)["threads"] for line in calls.read_text().splitlines()] == ["1", "1"]
    out = capsys.readouterr().out
    assert out.count(": started OMP_NUM_THREADS=1\n") == 2 and "OMP_NUM_THREADS=4" not in out
    for r in runs:
        command = json.loads((r["dir"] / "run.json").read_text())["command"]
        assert command.startswith("OMP_NUM_THREADS=1 ")


# a stopped sweep passes its signal on to each run under way once (a second one makes train.py stop
# at once, without saving), as SIGTERM for its own SIGHUP (train.py saves on SIGTERM); a second
# Ctrl-C passes on again; the sweep exits by its own signal, whatever signals its runs end by
def test_exp_stop_signals_each_run_once_and_keeps_the_sweeps_signal(monkeypatch):
    sent = []
    monkeypatch.setattr(experiments.os, "killpg", lambda pid, sig: sent.append((pid, sig)))
    sweep = experiments.Sweep([{}, {}], experiments.Progress(io.StringIO()))
    sweep.running = {"a": types.SimpleNamespace(pid=101, returncode=None),
                     "b": types.SimpleNamespace(pid=102, returncode=None)}
    sweep.stop(signal.SIGHUP, again=True)  # the sweep's own SIGHUP (a closed terminal)
    sweep.stop(signal.SIGTERM)  # then a third run ends by the SIGTERM it was passed
    assert sent == [(101, signal.SIGTERM), (102, signal.SIGTERM)] and sweep.signum == signal.SIGHUP
    sweep.stop(signal.SIGINT, again=True)  # a second Ctrl-C
    assert sent[2:] == [(101, signal.SIGINT), (102, signal.SIGINT)]
    assert sweep.signum == signal.SIGHUP


# SIGTERM to the sweep (kill PID, a job scheduler) and SIGHUP (a closed terminal): each run under
# way gets SIGTERM, saves its last.pt and is listed as stopped, no run starts after them, and the
# sweep exits 143 or 129 (128 + its own signal). The runs are real processes; the signal reaches
# this process, the sweep's.
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_exp_sigterm_or_sighup_to_the_sweep_stops_it_and_each_run_saves(_train_data, tmp_path,
                                                                         monkeypatch, capsys, sig):
    fake, calls, out = tmp_path / "fake_train.py", tmp_path / "calls", tmp_path / "runs"
    fake.write_text(_EXP_SIGNALLED_TRAIN)
    monkeypatch.setattr(experiments, "TRAIN", str(fake))
    monkeypatch.setenv("EXP_CALLS", str(calls))
    monkeypatch.setenv("EXP_CATCH", "1")

    def send():  # once both runs are under way
        for name in ("prenorm_L2_s0", "block_L2_s0"):
            _exp_wait_for(out / name / "ready")
        os.kill(os.getpid(), sig)

    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal (not under nohup)
    sender = threading.Thread(target=send)
    sender.start()
    argv = ["sweep", "custom", "--data", str(_train_data[0]), "--variants", "prenorm,block",
            "--depths", "2", "--seeds", "0-1", "--jobs", "2", "--out", str(out)]
    try:
        assert experiments.main(argv) == 128 + sig
    finally:
        sender.join()
        signal.signal(signal.SIGHUP, hup)
    captured = capsys.readouterr()
    for run in ("prenorm_L2_s0", "block_L2_s0"):
        assert (f"{run}: stopped by SIGTERM (exit 143); the same command resumes it from its "
                "last.pt\n") in captured.out
        assert (out / run / "last.pt").exists()
    assert "0 done, 0 failed, 2 stopped" in captured.out and "FAILED" not in captured.out
    assert captured.err.startswith("interrupted: run the same command")
    assert captured.err.count("\n") == 1
    assert sorted(calls.read_text().split()) == ["block_L2_s0", "prenorm_L2_s0"]  # not seed 1


# under nohup (SIGHUP ignored) a closed terminal does not stop the sweep: an ignored SIGHUP stays
# ignored, and SIGTERM still stops it
def test_exp_sighup_ignored_under_nohup_stays_ignored():
    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with experiments.stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
            assert callable(signal.getsignal(signal.SIGTERM))  # the sweep's handler
            with pytest.raises(experiments.Stopped) as stopped:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)  # the handler ends the wait as soon as it runs
            assert stopped.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, hup)


# the token axis reads as the milestones write token counts, also at exact powers (1K, 1B; not 1000)
def test_exp_token_counts_read_as_the_milestones_write_them():
    counts = (0, 500, 1e3, 76.8e3, 1e6, 1.5e6, 0.25e9, 1e9, 2e9)
    assert [experiments._tokens(x) for x in counts] == [
        "0", "500", "1K", "76.8K", "1M", "1.5M", "250M", "1B", "2B"]


# the Δ axis when one variant lies far off: linear within ±L, the smallest 1, 2 or 5 x 10^k that
# holds the typical variant (a larger L would flatten the small gaps the plot is for), log beyond
@pytest.mark.skipif(not _EXP_HAS_MPL, reason="needs matplotlib (optional: pip install matplotlib)")
def test_exp_diff_axis_is_linear_within_the_smallest_round_number():
    from matplotlib.figure import Figure
    cases = [(0.015, "0.02"), (0.04, "0.05"), (0.1, "0.1"), (0.15, "0.2"), (0.3, "0.5")]
    for typical, linear in cases:
        spans = {"rd": [-0.5 * typical], "wav": [-typical], "prenorm": [0.8 * typical],
                 "rezero": [50 * typical]}
        note = experiments.diff_axis(Figure().subplots(), spans, "black")
        assert note == f"; log beyond ±{linear}", typical


# report --plots while a sweep has just begun (its runs have only their step-0 evaluation): no
# traceback, no val_loss.png yet. Runs without a seed are each drawn and pair with none (as in the
# table).
@pytest.mark.skipif(not _EXP_HAS_MPL, reason="needs matplotlib (optional: pip install matplotlib)")
def test_exp_plots_of_a_sweep_just_begun_and_of_runs_without_a_seed(tmp_path, capsys):
    _exp_run(tmp_path / "begun", "block_L4_s0", "block", 0, evals=((0, 4.0),))
    assert experiments.main(["report", str(tmp_path / "begun"), "--plots"]) == 0
    assert "no evaluation past step 0 in any run yet: no val_loss.png" in capsys.readouterr().out
    assert not (tmp_path / "begun" / "val_loss.png").exists()
    for name, variant, val in (("a", "block", 2.0), ("b", "block", 2.2), ("c", "rd", 1.9)):
        d = _exp_run(tmp_path / "seedless", name, variant, None, val, evals=((100, 3.0), (200, val)))
        _exp_without_train_seed(d)
    fig = experiments.val_loss_figure(experiments.load_runs(tmp_path / "seedless"), "block")
    top, bottom = fig.axes[:2]
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert legend == ["block (2 seeds)", "rd (1 seed)"]
    assert len(bottom.get_lines()) == 1  # the zero line alone: nothing pairs


# -----------------------------------------------------------------------------
# Packaging: the model from any folder (pip install -e .), and the repository's pytest configuration

def test_pip_install_editable_makes_the_model_importable_from_any_folder(tmp_path):
    # the README's `pip install -e .`, offline: a fresh venv that borrows this environment's packages (torch,
    # setuptools) through a .pth file, installing a copy of the project's pyproject.toml and nanoroute.py
    root = Path(__file__).resolve().parent
    project = tmp_path / "clone"
    project.mkdir()
    for name in ("pyproject.toml", "nanoroute.py", "LICENSE"):
        shutil.copy(root / name, project / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    here = [p for p in sys.path if p.endswith("site-packages")]
    (Path(site_packages) / "borrowed.pth").write_text("\n".join(here) + "\n")
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                          "-e", str(project)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = "import nanoroute; from nanoroute import GPT, GPTConfig; print(nanoroute.__file__)"
    out = subprocess.run([python, "-c", script], cwd=elsewhere, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == project / "nanoroute.py"  # editable: the clone's own file


def test_pytest_configuration_lists_skip_reasons(tmp_path):
    # `python -m pytest -q` (the README's command) says why tests were skipped: -rs in pyproject.toml
    shutil.copy(Path(__file__).resolve().parent / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "test_skip.py").write_text("import pytest\n\n\ndef test_x():\n    pytest.skip('needs a thing')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert "SKIPPED [1] test_skip.py:5: needs a thing" in out.stdout, out.stdout



# -----------------------------------------------------------------------------
# docs/testing.md's behaviour table: a row for every flag of every script, and tests that exist

def _table_parsers():
    """{table title: the flags and positionals of that parser}, from the scripts' own parsers."""
    def names(parser):
        found = set()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            found |= {o for o in action.option_strings if o.startswith("--")} or {action.dest}
        return found
    parsers = {"train.py": train.build_parser(), "sample.py": sample.build_parser(),
               "prepare_data.py": prepare_data._parser(), "bench.py": bench.build_parser()}
    sub = next(a for a in experiments.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers.update({f"experiments.py {name}": p for name, p in sub.choices.items()})
    return {title: names(p) for title, p in parsers.items()}


def _table_rows(text):
    """{section title: [(first cell, last cell)]} for every table row under a ### heading."""
    sections, title = {}, None
    for line in text.splitlines():
        if line.startswith("### "):
            title = line[4:].strip()
            sections[title] = []
        elif title and line.startswith("| ") and not set(line) <= set("|- "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if cells[0] not in ("flag", "promise (where)"):
                sections[title].append((cells[0], cells[-1]))
    return sections


def test_behaviour_table_matches_the_parsers():
    root = Path(__file__).resolve().parent
    sections = _table_rows((root / "docs" / "testing.md").read_text())
    tests = set(re.findall(r"^def (test_\w+)", Path(__file__).read_text(), re.M))
    problems = []
    for title, flags in _table_parsers().items():
        rows = sections.get(title)
        if rows is None:
            problems.append(f"no table '### {title}'")
            continue
        listed = [name for first, _ in rows for name in re.findall(r"`([\w-]+)`", first)]
        problems += [f"{title}: {flag} has no row" for flag in sorted(flags - set(listed))]
        problems += [f"{title}: a row names {flag}, which the parser does not have" for flag in listed
                     if flag not in flags]
        problems += [f"{title}: {flag} has two rows" for flag in set(listed) if listed.count(flag) > 1]
        for first, last in rows:
            if not re.search(r"`test_\w+`", last):
                problems.append(f"{title}: the row of {first} names no test")
    assert "Promises" in sections and len(sections["Promises"]) >= 20
    for title, rows in sections.items():
        for first, last in rows:
            problems += [f"{title}: the row of {first[:40]} names {t}, which test_nanoroute.py does not define"
                         for t in re.findall(r"`(test_\w+)`", last) if t not in tests]
    assert not problems, "docs/testing.md's behaviour table:\n" + "\n".join(problems)
