"""Candidates and expected bytes per call of single-pass and multi-pass screens under the L1, Cauchy-Schwarz and min
bounds (README step 3), over all collected rows or only the real-text or random-token ones (`analyze.py [real|random]`)."""
import torch, numpy as np
import os
import sys
DIR = os.environ.get("SCREEN_SIM_DIR", "/tmp/screen_sim")
torch.set_num_threads(2)
o = torch.load(DIR + "/scores.pt")
if len(sys.argv) > 1:   # the real-text rows (request < 16 of 26) or the random-token ones
    sel = torch.arange(o["T"].shape[0]) % 26
    sel = sel < 16 if sys.argv[1] == "real" else sel >= 16
    for key in ("T", "D", "S3", "S4", "S5", "xn"):
        o[key] = o[key][sel]
    print(sys.argv[1], int(sel.sum()), "rows")
T, D, xn, En = o["T"], o["D"], o["xn"], o["En"]
M, V = T.shape
Emax = {3: 15.5, 4: 7.5, 5: 3.5}
TILE = 8; ROWB = 896 // 8; SCB = 56; FULL = V * 1008; LIMIT = 16384
top = T.argmax(1)
def bound(b, kind):
    l1 = (Emax[b] + 0.005) * D
    if kind == "L1": return l1
    cs = En[b][None, :] * xn[:, None] * (1 + 1e-3)
    return cs if kind == "CS" else torch.minimum(l1, cs)
def select(S, B, mask=None, lower0=None):
    lo = S - B; up = S + B
    if mask is not None:
        lo = torch.where(mask, lo, torch.full_like(lo, -np.inf))
    lower = lo.amax(1, keepdim=True)
    if lower0 is not None: lower = torch.maximum(lower, lower0)
    c = up >= lower
    if mask is not None: c &= mask
    return c, lower
def tiles_of(c):
    Vp = (V + TILE - 1) // TILE * TILE
    cp = torch.zeros(M, Vp, dtype=torch.bool); cp[:, :V] = c
    t = cp.view(M, -1, TILE).any(-1)
    return t, t.repeat_interleave(TILE, 1)[:, :V]
def report(name, stages, kind):
    # stages: list of bits; gran: 'tile' or 'row' for later passes
    for gran in (["-"] if len(stages) == 1 else ["tile", "row"]):
        b0 = stages[0]
        S = o[f"S{b0}"]; B = bound(b0, kind)
        c, lower = select(S, B)
        bytes_ = torch.full((M,), float(V * (ROWB * b0 + SCB)))
        prev = b0; counts = [c.sum(1)]
        for b in stages[1:]:
            if gran == "tile":
                t, rows = tiles_of(c); n = rows.sum(1).float()
            else:
                rows = c; n = c.sum(1).float()
            bytes_ += n * (ROWB * (b - prev) + SCB)
            c, lower = select(o[f"S{b}"], bound(b, kind), mask=rows & c, lower0=lower)
            prev = b; counts.append(c.sum(1))
        n = c.sum(1)
        assert bool(c[torch.arange(M), top].all()), "argmax lost"
        fb = n > LIMIT
        bytes_ += torch.where(fb, float(FULL), n.float() * 1008)
        qs = lambda x: "/".join(f"{v:.0f}" for v in np.percentile(x.numpy(), [50, 90, 99]))
        print(f"{name:14s} {kind:6s} {gran:4s} | " + " | ".join(qs(x) for x in counts) +
              f" | fb {fb.float().mean().item()*100:.1f}% | {bytes_.mean().item()/1e6:6.1f} MB ({(bytes_.mean().item()/93.6e6-1)*100:+.0f}%)  med {bytes_.median().item()/1e6:.1f}")
print("variant        bound  gran | candidates med/p90/p99 per pass | fallback | expected bytes")
for kind in ("L1", "CS", "min"):
    for st in ([5], [4], [3], [4, 5], [3, 5], [3, 4, 5]):
        report("->".join(map(str, st)), st, kind)
