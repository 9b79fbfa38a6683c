"""LegalizeOps for the CUDA route, with index generators legalized as kernels.

TVM 0.27 legalizes ``relax.arange`` with constant bounds to a constant tensor
(``relax.const(np.arange(...))``); a kernel that reads it then loads what it could compute from its
own index.  The cross-entropy's one-hot compares the classes' ``arange`` with the labels in its
gradient kernel over [tokens, vocabulary]: the folded int64 row, read along the vocabulary, made
that bf16 kernel's vectors two lanes wide (8 bytes an element; Llama's at 8192 x 32000, GPT-2's at
16384 x 50257).  Here an ``arange`` becomes ``topi.arange``'s kernel (``call_tir`` with no tensor
arguments), which ``FuseOps`` fuses into its readers as index arithmetic.  TVM's ``FoldConstant``
after legalization still folds one of up to about a thousand elements (ImageNet's 1000 classes):
there the row is small and stays in cache.
"""
from __future__ import annotations

import tvm
from tvm import relax, topi


def _bound(arg):
    """An arange bound as TE takes it: its PrimValue's value (an IntImm or FloatImm, or a symbolic
    expression)."""
    return getattr(arg, "value", arg)


def _arange(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    start, end, step = (_bound(a) for a in call.args)
    return bb.call_te(topi.arange, start, end, step, str(call.attrs.dtype), primfunc_name_hint="arange")


LEGALIZE = {"relax.arange": _arange}


def legalize_ops() -> tvm.transform.Pass:
    """``relax.transform.LegalizeOps`` with ``LEGALIZE`` in place of TVM's rules for those ops."""
    return relax.transform.LegalizeOps(customize_legalize_map=LEGALIZE)
