import torch
from . import metal_model_splitd_backward as SB, metal_model as M, metal_model_timing as T, apple_gpus as G, metal_backward_model as BM
for causal in (True, False):
    for n in (1024, 4096):
        s = M.Shape(1, 8, 8, n, n, 512)
        recs = SB.records(s, causal)
        for chip in SB.CHIPS:
            gpu = G.BY_NAME[chip]
            parts = []
            for i, r in enumerate(recs):
                t, terms, sgs = T.dispatch_time(r, i, gpu, s, torch.float16, causal)
                parts.append((t, terms["compute"], terms["memory"]))
            print(f"{chip} n{n} causal={causal}: total {sum(p[0] for p in parts)*1e3:.2f} compute {sum(p[1] for p in parts)*1e3:.2f} "
                  f"(dQ {parts[0][1]*1e3:.2f}, dKdV {parts[1][1]*1e3:.2f}) memory dQ {parts[0][2]*1e3:.2f} dKdV {parts[1][2]*1e3:.2f} "
                  f"unfused {BM.unfused_seconds(s, torch.float16, gpu)*1e3:.2f}")
