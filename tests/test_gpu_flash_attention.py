"""Flash-attention kernels (relax.ext.evt_attention) against a float64 torch reference on the GPU.

Each case builds the forward and the backward kernel for one (shape, flags, head dimension)
through the BYOC entry, exports and loads them, and checks O, LSE, dQ, dK and dV on fresh random
inputs with the outputs poisoned (NaN) before the run, every element; the dropout mask of the
reference is the numpy Philox reference (``codegen.philox``), so forward and backward must
regenerate exactly that mask.  Grouped-query cases (fewer key/value heads than query heads) take
K and V with their own heads, and the reference repeats each over its group.  Every case runs at head dimension 64 in both dtypes; the other head
dimensions run the cases that cover every flag and layout (``HEAD_DIM_CASES``) in bf16, and two of
them in fp16.
"""
from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CASES = [
    # id, batch, heads, sq, sk, causal, bias, dropout, saved mask[, layout[, key/value heads]]
    ("plain", 2, 3, 128, 128, False, False, 0.0, False),
    ("dropout", 2, 3, 128, 192, False, False, 0.1, False),
    ("dropout_saved", 2, 3, 128, 192, False, False, 0.1, True),
    ("causal_dropout", 2, 2, 256, 256, True, False, 0.1, False),
    ("causal_saved", 2, 2, 256, 256, True, False, 0.1, True),
    ("vit_padded", 2, 3, 197, 208, False, True, 0.1, False),
    ("vit_saved", 2, 3, 197, 208, False, True, 0.1, True),
    ("ragged", 1, 2, 100, 77, True, False, 0.0, False),
    ("ragged_keys", 1, 2, 100, 77, False, False, 0.1, False),  # kRagged without causal: keys bound the rows
    ("bias_full_tiles", 2, 3, 128, 128, False, True, 0.0, False),  # a bias, no bound (kRagged false)
    ("ragged_dropout", 1, 2, 100, 77, True, False, 0.2, False),  # rows not 4-aligned: nine draws per word, shifted
    ("bshd_saved", 2, 3, 128, 192, False, False, 0.1, True, "bshd"),  # [B, S, H, D] in and out
    ("bshd_ragged_causal", 2, 3, 100, 77, True, False, 0.2, False, "bshd"),
    ("bshd_vit", 2, 3, 197, 208, False, True, 0.1, True, "bshd"),
    # grouped-query attention: 2 query heads a key/value head (Llama's causal form), one for all (MQA)
    ("gqa_causal_saved", 2, 4, 256, 256, True, False, 0.1, True, "bhsd", 2),
    ("gqa_bshd_ragged", 2, 6, 100, 77, True, False, 0.0, False, "bshd", 2),
    ("mqa_dropout", 1, 4, 128, 192, False, False, 0.1, False, "bhsd", 1),
]


# the cases every other head dimension runs: full tiles without flags; dropout (saved, and drawn
# again); causal; a key bias with ragged keys; ragged keys alone; both layouts
HEAD_DIM_CASES = ("plain", "dropout_saved", "causal_saved", "vit_padded", "ragged_keys", "ragged",
                  "bshd_ragged_causal", "bshd_vit", "gqa_causal_saved", "gqa_bshd_ragged")
OTHER_HEAD_DIMS = (32, 80, 96, 128)
PARAMS = [(case, dtype, 64) for case in CASES for dtype in ("bfloat16", "float16")] + [
    (case, "bfloat16", d) for d in OTHER_HEAD_DIMS for case in CASES if case[0] in HEAD_DIM_CASES] + [
    (case, "float16", d) for d in OTHER_HEAD_DIMS for case in CASES if case[0] in ("causal_saved", "bshd_vit")]


def _kernels(name, batch, heads, sq, sk, causal, has_bias, p, saved, dtype, head_dim, tmp, layout="bhsd",
             kv_heads=0):
    """The forward and backward entries of one case, built, exported and loaded."""
    import tvm

    from tvm_evt.codegen.ir.attention import AttentionCall
    from tvm_evt.codegen.relax_ext import build_attention

    common = dict(dtype=dtype, batch=batch, heads=heads, sq=sq, sk=sk, head_dim=head_dim, scale=head_dim ** -0.5,
                  causal=causal, dropout=p, site=5, has_bias=has_bias, saved_mask=saved, layout=layout,
                  kv_heads=kv_heads)
    fwd = AttentionCall(symbol=f"{name}_{dtype}_d{head_dim}_fwd", backward=False, **common)
    bwd = AttentionCall(symbol=f"{name}_{dtype}_d{head_dim}_bwd", backward=True, **common)
    lib = build_attention([fwd, bwd])
    path = os.path.join(tmp, f"{name}_{dtype}_d{head_dim}.so")
    lib.export_library(path)
    mod = tvm.runtime.load_module(path)
    return fwd, bwd, mod[fwd.symbol], mod[bwd.symbol]


def _reference(q, k, v, do, bias, causal, p, seed, site, scale):
    import torch

    from tvm_evt.codegen import philox

    q, k, v, do = (t.double().requires_grad_(True) for t in (q, k, v, do))
    groups = q.shape[1] // k.shape[1]  # query heads a key/value head, in a row
    kr, vr = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    s = q @ kr.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    prob = torch.softmax(s, -1)
    if p > 0:
        b, h, sq, sk = s.shape
        keep = philox.dropout_keep((b * h, sq, sk), seed, site, p).reshape(s.shape)
        prob = prob * torch.from_numpy(keep).to(s.device) * float(philox.dropout_scale(p))
    o = prob @ vr
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), lse.detach(), dq, dk, dv


@pytest.mark.parametrize("case, dtype, head_dim", PARAMS, ids=[f"{c[0]}-{t}-d{d}" for c, t, d in PARAMS])
def test_flash_attention_matches_float64(case, dtype, head_dim, tmp_path):
    import torch
    import tvm

    name, batch, heads, sq, sk, causal, has_bias, p, saved, *rest = case
    layout, kv_heads = (list(rest) + ["bhsd", heads][len(rest):])[:2]
    fwd, bwd, run_fwd, run_bwd = _kernels(name, batch, heads, sq, sk, causal, has_bias, p, saved, dtype, head_dim,
                                          str(tmp_path), layout, kv_heads)
    # the kernels' view: [B, S, H, D] tensors for "bshd" (the reference stays [B, H, S, D])
    kernel = (lambda t: t.transpose(1, 2).contiguous()) if layout == "bshd" else (lambda t: t)
    back = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(tdt)

    q, do = (randn(batch, heads, sq, head_dim) for _ in range(2))
    k, v = (randn(batch, kv_heads, sk, head_dim) for _ in range(2))
    seed = (int.from_bytes(os.urandom(4), "little"), 7)
    tensors = {"q": kernel(q), "k": kernel(k), "v": kernel(v), "dout": kernel(do),
               "seed": torch.tensor(seed, dtype=torch.int64).to(torch.uint32).cuda()}
    if has_bias:  # ViT's padded keys: the last 11 masked
        tensors["bias"] = torch.zeros(sk, device="cuda")
        tensors["bias"][sk - 11:] = float("-inf")
    poison = float("nan")
    o = torch.full_like(tensors["q"], poison)
    lse = torch.full((batch, heads, sq), poison, device="cuda")
    dq, dk, dv = (torch.full_like(tensors[n], poison) for n in "qkv")

    def call(entry, spec, outs):
        args = [tensors[n] for n in spec.inputs] + outs
        entry(*[tvm.runtime.from_dlpack(t) for t in args])

    outs = [o, lse]
    if "mask" in fwd.outputs:
        tensors["mask"] = torch.zeros(fwd.mask_shape, device="cuda", dtype=torch.int32).to(torch.uint32)
        outs.append(tensors["mask"])
    call(run_fwd, fwd, outs)
    tensors["o"], tensors["lse"] = o, lse
    call(run_bwd, bwd, [dq, dk, dv])
    torch.cuda.synchronize()
    want = _reference(q, k, v, do, tensors.get("bias"), causal, p, seed, 5, fwd.scale)
    for what, g, w in zip(["O", "LSE", "dQ", "dK", "dV"], [back(o), lse, back(dq), back(dk), back(dv)], want):
        g = g.double()
        assert torch.isfinite(g).all(), f"{what} has non-finite values"
        err = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
        assert err <= 1e-2, f"{what}: relative error {err:.3g}"
