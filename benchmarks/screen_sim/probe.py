"""The screens with the best lower bound raised to the exact logits of the candidates with the largest upper bounds (README step 4)."""
import torch, numpy as np
import os
DIR = os.environ.get("SCREEN_SIM_DIR", "/tmp/screen_sim")
torch.set_num_threads(2)
o = torch.load(DIR + "/scores.pt")
T, D, xn, En = o["T"], o["D"], o["xn"], o["En"]
M, V = T.shape
real = (torch.arange(M) % 26) < 16
Emax = {3: 15.5, 4: 7.5, 5: 3.5}
LIMIT = 16384; FULL = V * 1008
top = T.argmax(1)
ar = torch.arange(M)
print("bits bound probes | set      | cands all med/p90/p99 | real med/p90/p99 | random med/p90/p99 | fb all | exp MB all (vs 93.6) | real | random")
for b in (5, 4, 3):
    S = o[f"S{b}"]
    for kind in ("L1", "min"):
        B = (Emax[b] + 0.005) * D
        if kind == "min": B = torch.minimum(B, En[b][None, :] * xn[:, None] * (1 + 1e-3))
        up = S + B
        lower = (S - B).amax(1, keepdim=True)
        keep1 = up >= lower
        n1 = keep1.sum(1)
        for m in (0, 1, 4, 16, "ideal"):
            if m == 0:
                L = lower; cost = 0
            elif m == "ideal":
                L = T.amax(1, keepdim=True); cost = 0
            else:
                idx = up.topk(m, dim=1).indices
                L = torch.maximum(lower, T.gather(1, idx).amax(1, keepdim=True)); cost = m * 1008
            c = (up >= L)
            assert bool(c[ar, top].all())
            n = c.sum(1)
            by = V * (112 * b + 56) + cost + torch.where(n > LIMIT, float(FULL), n.float() * 1008)
            q = lambda x: "/".join(f"{v:.0f}" for v in np.percentile(x.numpy(), [50, 90, 99]))
            print(f"{b} {kind:4s} {str(m):5s} | kept1 {q(n1)} | {q(n)} | {q(n[real])} | {q(n[~real])} | "
                  f"{(n > LIMIT).float().mean().item()*100:.1f}% | {by.mean().item()/1e6:.1f} ({(by.mean().item()/93.6e6-1)*100:+.0f}%) | "
                  f"{by[real].mean().item()/1e6:.1f} | {by[~real].mean().item()/1e6:.1f}", flush=True)
