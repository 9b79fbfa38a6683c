"""Flash-attention kernel benchmark (``relax.ext.evt_attention``) against torch's SDPA on the GPU.

Cases are the attention cores of the end-to-end models (bf16, head dimension 64 unless named):
  bert       BERT-Large layer   32 x 16 x 512 x 512, dropout 0.1, keep bits saved by the forward
  bert_regen the same, the backward drawing the keep bits again from the seed
  bert_p0    the same without dropout
  gpt2       GPT-2 medium block 16 x 16 x 1024 x 1024, causal, dropout 0.1 (saved)
  vit        ViT-B/16 block     128 x 12 x 197 x 208, key bias (PadAttentionKeys' -inf), dropout 0.1 (saved)
  llama      a Llama-2-7B layer 4 x 32 x 2048 x 2048, head dimension 128, causal, no dropout
  llama_gqa  the same over 8 key/value heads (grouped-query; torch: SDPA's enable_gqa)

Method: both kernels of a case are built through ``build_attention`` and called through their FFI
entries on torch tensors; each is timed with CUDA events after warm-up, with fresh random inputs
(regenerated in place) and NaN-poisoned outputs before every run, median of ``iters`` runs.
torch is timed the same way in the same process: ``scaled_dot_product_attention`` forward, and
forward + backward (its fused flash or memory-efficient kernel, whichever torch picks).
Correctness is tests/test_gpu_flash_attention.py's job; here every output is only checked finite.
"""
from __future__ import annotations

import os
import tempfile

from .bench import median_ms
from .ir.attention import AttentionCall

CASES = {  # name: (batch, heads, sq, sk, head dimension, causal, bias, dropout, saved mask[, key/value heads])
    "bert": (32, 16, 512, 512, 64, False, False, 0.1, True),
    "bert_regen": (32, 16, 512, 512, 64, False, False, 0.1, False),
    "bert_p0": (32, 16, 512, 512, 64, False, False, 0.0, False),
    "gpt2": (16, 16, 1024, 1024, 64, True, False, 0.1, True),
    "vit": (128, 12, 197, 208, 64, False, True, 0.1, True),
    "llama": (4, 32, 2048, 2048, 128, True, False, 0.0, False),
    "llama_gqa": (4, 32, 2048, 2048, 128, True, False, 0.0, False, 8),
}
SITE = 3
WARMUP = 3  # untimed runs before each timing


def calls(name: str, dtype: str = "bfloat16", layout: str = "bhsd") -> tuple[AttentionCall, AttentionCall]:
    batch, heads, sq, sk, head_dim, causal, bias, p, saved, *kv_heads = CASES[name]
    common = dict(dtype=dtype, batch=batch, heads=heads, sq=sq, sk=sk, head_dim=head_dim, scale=head_dim ** -0.5,
                  causal=causal, dropout=p, site=SITE, has_bias=bias, saved_mask=saved and p > 0, layout=layout,
                  kv_heads=kv_heads[0] if kv_heads else heads)
    return (AttentionCall(symbol=f"bench_{name}_{layout}_fwd", backward=False, **common),
            AttentionCall(symbol=f"bench_{name}_{layout}_bwd", backward=True, **common))


def bench_case(name: str, iters: int = 20, dtype: str = "bfloat16", layout: str = "bhsd") -> dict:
    """Times (ms) of our forward and backward kernels and of torch's SDPA on one case; with
    `layout` "bshd" the kernels take [B, S, H, D] tensors (torch gets [B, H, S, D] views of them)."""
    import torch
    import tvm

    from .relax_ext import build_attention

    fwd, bwd = calls(name, dtype, layout)
    with tempfile.TemporaryDirectory() as tmp:  # a static library runs once exported and loaded
        path = os.path.join(tmp, f"{name}.so")
        build_attention([fwd, bwd]).export_library(path)
        lib = tvm.runtime.load_module(path)
    run_fwd, run_bwd = lib[fwd.symbol], lib[bwd.symbol]
    tdt = getattr(torch, dtype)
    b, h, sq, sk = fwd.batch, fwd.heads, fwd.sq, fwd.sk
    q = torch.empty(fwd.shape(sq), device="cuda", dtype=tdt)
    k, v = (torch.empty(fwd.shape(sk, fwd.kv_heads), device="cuda", dtype=tdt) for _ in range(2))
    do = torch.empty_like(q)
    o, lse = torch.empty_like(q), torch.empty(b, h, sq, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    t = {"q": q, "k": k, "v": v, "dout": do, "o": o, "lse": lse,
         "seed": torch.zeros(2, dtype=torch.int32, device="cuda").to(torch.uint32)}
    if fwd.has_bias:
        t["bias"] = torch.zeros(sk, device="cuda")
        t["bias"][sk - (sk - sq):] = float("-inf")  # the padded keys
    if "mask" in fwd.outputs:
        t["mask"] = torch.empty(fwd.mask_shape, dtype=torch.int32, device="cuda").to(torch.uint32)

    def fresh():
        for x in (q, k, v, do):
            x.normal_()
        t["seed"].copy_(torch.tensor(list(os.urandom(8)), dtype=torch.uint8).view(torch.int32).to(torch.uint32))

    def call(entry, spec, outs):
        entry(*[tvm.runtime.from_dlpack(x) for x in [t[n] for n in spec.inputs] + outs])

    fwd_outs = [o, lse] + ([t["mask"]] if "mask" in fwd.outputs else [])
    ours_fwd = median_ms(lambda: call(run_fwd, fwd, fwd_outs),
                         lambda: (fresh(), o.fill_(float("nan")), lse.fill_(float("nan"))), iters, WARMUP)

    def prepare_bwd():  # a forward on fresh inputs (untimed), then poisoned gradients
        fresh()
        call(run_fwd, fwd, fwd_outs)
        for x in (dq, dk, dv):
            x.fill_(float("nan"))

    ours_bwd = median_ms(lambda: call(run_bwd, bwd, [dq, dk, dv]), prepare_bwd, iters, WARMUP)
    for what, x in (("O", o), ("LSE", lse), ("dQ", dq), ("dK", dk), ("dV", dv)):
        if not torch.isfinite(x).all():
            raise RuntimeError(f"{name}: {what} of the flash-attention kernels is not finite")

    mask = t["bias"].to(tdt).expand(b, h, sq, sk) if fwd.has_bias else None  # causal: is_causal
    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads_major = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    ql, kl, vl = (heads_major(x.detach().requires_grad_()) for x in (q, k, v))

    def torch_fwd():
        return sdpa(ql, kl, vl, attn_mask=mask, dropout_p=fwd.dropout, is_causal=fwd.causal, scale=fwd.scale,
                    enable_gqa=fwd.kv_heads != fwd.heads)

    with torch.no_grad():
        torch_f = median_ms(torch_fwd, fresh, iters, WARMUP)
    torch_fb = median_ms(lambda: torch_fwd().backward(heads_major(do)), fresh, iters, WARMUP)
    return {"case": name, "layout": layout, "shape": [b, h, sq, sk], "kv_heads": fwd.kv_heads, "causal": fwd.causal, "bias": fwd.has_bias,
            "dropout": fwd.dropout, "saved_mask": fwd.saved_mask,
            "ours_fwd_ms": ours_fwd, "ours_bwd_ms": ours_bwd, "ours_ms": ours_fwd + ours_bwd,
            "sdpa_fwd_ms": torch_f, "sdpa_ms": torch_fb, "speedup": torch_fb / (ours_fwd + ours_bwd)}


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"GPU: {gpu}", "",
             "| case | B x H x Sq x Sk | ours fwd | ours bwd | ours fwd+bwd | SDPA fwd | SDPA fwd+bwd | SDPA / ours |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        case = r["case"] + (f" ({r['layout']})" if r.get("layout", "bhsd") != "bhsd" else "")
        lines.append(f"| {case} | {' x '.join(map(str, r['shape']))} | {r['ours_fwd_ms']:.3f} | "
                     f"{r['ours_bwd_ms']:.3f} | {r['ours_ms']:.3f} | {r['sdpa_fwd_ms']:.3f} | "
                     f"{r['sdpa_ms']:.3f} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(names: list[str], iters: int = 20, out: str | None = None, layout: str = "bhsd") -> list[dict]:
    import json

    import torch

    from .relax_ext import build_attention

    build_attention([c for n in names for c in calls(n, layout=layout)])  # in parallel, into the object cache
    rows = [bench_case(n, iters, layout=layout) for n in names]
    text = markdown(rows, torch.cuda.get_device_name())
    print(text)
    if out:
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows

