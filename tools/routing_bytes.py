"""Bytes the depth routing moves in one training step, from the shapes (docs/speed.md).

    python tools/routing_bytes.py            # s12 and s48, the variants of docs/speed.md
    python tools/routing_bytes.py --rates    # and what this machine moves at s12's sizes

must: the two-phase floor. Per block, its reads read each completed source once (forward), then
read it again and write its gradient (backward); each read of a partial block reads its terms and
phase 1's mix and writes h, and the backward twice that; a completed block is built once.
now: the passes over (B, T, d) tensors that this kernel's operations make, counted from the code
(an estimate: it leaves out what the memory caches absorb and the work that is not the routing's).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanoroute import GPT, GPTConfig, VARIANTS  # noqa: E402

SHAPES = {"s12": dict(n_layer=12, n_embd=256, n_head=4, sequence_len=256),
          "s48": dict(n_layer=48, n_embd=128, n_head=4, sequence_len=128)}
BATCH = 8
ROWS = {"full": dict(residual="attnres", attnres_block=1)} | VARIANTS

def routing_bytes(config, batch=BATCH):
    """(must, now) in bytes for one training step of a residual=attnres config whose routing
    blocks divide its 2·n_layer sublayers."""
    model = GPT(config)
    unit = batch * config.sequence_len * config.n_embd * 4  # one (B, T, d) float32 tensor
    n_sub, m = 2 * config.n_layer, config.routing_block
    per_block = 1 + len(model.bases)
    # it counts the sources of Block AttnRes, WAV and RD: a model whose kernel stores others (a
    # source added in complete()) is refused, not given their numbers
    last = per_block if config.wav_readout_details else 1
    counted = 1 + per_block * ((n_sub - 1) // m) + last * (n_sub % m == 0)
    if model.kernel_slots() != counted:
        raise ValueError(f"the kernel stores {model.kernel_slots()} completed sources a forward, "
                         f"routing_bytes counts {counted}: count them in routing_bytes() (a new "
                         "source, or blocks counted from another sublayer)")
    must = now = 0
    for first in range(0, n_sub + 1, m):
        subs = list(range(first, min(first + m, n_sub))) or [n_sub]  # the last: the readout
        completed = 1 + per_block * (first // m)  # the sources written so far
        read = 1 + first // m if first == n_sub and not config.wav_readout_details else completed
        must += 3 * read * unit  # the readout reads the states alone, by default
        # the new sources into the buffer (read, write, their rms), then forward: dots, mix; the
        # backward per source: ⟨dmix, v⟩, its dots' gradient (a matmul), the key norm's addcmul
        # (3), each of the block's R reads' mix gradient added in (3 each), dw
        R = sum(len(model.reads_before(l)) for l in subs)
        now += (3 * (per_block if first else 1) + 2 * completed + (6 + 3 * R) * completed) * unit
        for i, l in enumerate(subs[1:], 1):
            # the kernel sums the updates of equal signs into one term (learned: one each)
            signs = {tuple(model.detail_signs(j).values()) for j in range(first, l)}
            terms = i if config.wav_learned_bases else len(signs)
            reads = len(model.reads_before(l))
            must += reads * 3 * (terms + 2) * unit
            # forward: term dots, h from mix and each term; backward: ⟨dh, t⟩, ⟨dh, h⟩, dmix,
            # each term's gradient and the key norm's terms
            now += reads * (6 * terms + 6 + terms * (3 + 3 * terms)) * unit
            # once a sublayer, not a read: the update joins its term (an add, where the term holds
            # more than one), then each block source summed from the terms for its mean square
            now += (3 * (terms < i) + per_block * (3 * (terms - 1) + 1)) * unit
        if subs[0] < n_sub:  # the block completes: its sources from its updates, mean squares
            must += (len(subs) + per_block) * unit
            now += (len(subs) * per_block + 2 * per_block) * unit
    return must, now

def rates(threads=2, S=6, R=4):
    """GiB/s (bytes read and written) on this machine at s12's sizes, S sources and R reads: a
    plain copy of the sources, and phase 1's mix, one small matrix product per token."""
    torch.set_num_threads(threads)
    tokens, d = BATCH * SHAPES["s12"]["sequence_len"], SHAPES["s12"]["n_embd"]
    V, p = torch.randn(S, tokens, d), torch.rand(tokens, R, S)
    slices = V.transpose(0, 1)  # (tokens, S, d): each token's sources, a view, as the kernel's
    copy, mix = torch.empty_like(V), torch.empty(tokens, R, d)  # outputs allocated once
    cases = {"copy of the sources": (lambda: copy.copy_(V), 2 * V.numel()),
             "phase 1's mix (bmm)": (lambda: torch.bmm(p, slices, out=mix),
                                     V.numel() + mix.numel())}
    for name, (run, floats) in cases.items():
        run()
        start = time.perf_counter()
        for _ in range(20):
            run()
        seconds = (time.perf_counter() - start) / 20
        print(f"{name}: {4 * floats / seconds / 2**30:.1f} GiB/s ({threads} threads)")

def main():
    if "--rates" in sys.argv:
        rates()
    print("| shape | variant | must GiB | now GiB | now / must |")
    print("|---|---|---|---|---|")
    for shape, dims in SHAPES.items():
        for name in ("block", "full", "wav", "rd", "block_h4"):
            must, now = routing_bytes(GPTConfig(vocab_size=256, **dims, **ROWS[name]))
            print(f"| {shape} | {name} | {must / 2**30:.2f} | {now / 2**30:.2f} | "
                  f"{now / must:.2f} |")

if __name__ == "__main__":
    main()
