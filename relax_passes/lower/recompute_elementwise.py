"""RecomputeElementwise: cheap elementwise values recomputed inside each kernel that reads them.

TVM's ``FuseOps`` puts an elementwise op into its reader's kernel only when it has one reader (or
all its readers end in one kernel); with readers in several kernels the value is written to
global memory once and read back by each.  For a widening cast or a centring ``x - mean`` that
costs more than recomputing: a batch norm's gradient reads ``x32 = astype(x, float32)`` and
``c = x32 - mean`` in two column sums and in the input-gradient pass, and ResNet-50's stage wrote
and re-read them as float32 M×C tensors (206 MB each at 100352×512, against 103 MB for ``x``).

A sigmoid is cheap next to its bytes too (an exp and a division an element, where the readers are
memory-bound): SiLU's gradient reads ``sigmoid(x)`` in the batch norm gradient's column sums and in
its input-gradient pass, and each EfficientNet block wrote it and read it back (on H200,
EfficientNet-B0's ``tir_sigmoid*`` kernels took about 0.3 ms a step of their own).  Recomputed,
with the normalisation it reads (itself cheap), a replica of two of its blocks (batch 16, 64²)
moves 386 MB a step in TVM kernels where it moved 525 (``tuning.kernel_traffic``, modelled), and
timm's EfficientNet-B0 at batch 128 trains in 16.81 ms a step on an H200 where it took 18.32
(the ``recompute_sigmoid`` rewrite of ``pipeline.OPTIONAL``, on by default).

A slice is cheap the same way: GPT-2's LM head, padded to 50264 columns (PadUnalignedMatmuls),
is sliced back to the vocabulary's 50257 and cast to float32 for the loss's kernels; the cast is
recomputed in each of them, and the slice, now read by each copy, was a kernel of its own (H200:
``strided_slice3``, 2.9 ms a step copying the [16384, 50257] logits).  Each reader now reads the
padded logits where the slice would have.

Here a value ``v = op(args)`` with ``op`` in ``CHEAP`` is recomputed, one copy bound just before
each reader that is a call of an op FuseOps fuses it into (``FUSABLE``: elementwise ops and the
reductions), when

* it has two or more such readers, or a reader that is itself recomputed (chains are copied whole:
  each copy of ``c`` gets its own copy of ``x32``), and
* recomputing moves fewer bytes (``recompute_pays``): with L the bytes of its full-size operands
  (those with ``v``'s element count; the per-channel statistics it also reads are small) and V
  its own, k readers recomputing read k L, where writing it once and reading it back moves
  L + V + k V.  Where other readers need ``v`` written anyway, a copy must read no more than
  reading ``v`` back would: L <= V.

With ``statistics``, values under ``MIN_ELEMENTS`` (a batch norm's per-channel statistics:
``mean = s / N``, ``rstd = 1 / sqrt(v + eps)`` and the products of them its gradient reads) cost
no bytes worth counting but a kernel launch each, with the gap around it: ResNet-50 conv3_x ran
110 such kernels a step.  Such a value (``SMALL_CHEAP``: ``CHEAP`` with ``sqrt``, ``rsqrt`` and ``reshape``) is
recomputed where that takes its kernel away: every reader is a fusable call (two or more, or a
recomputed one) and it is not returned.  That takes 39 of ResNet-50 conv3_x's 247 kernels a step,
but each element of the readers' kernels then recomputes what was computed once per channel (its
batch-norm input gradient takes the ``sqrt`` chain four times, left to nvcc to merge): off by
default (the ``recompute_statistics`` rewrite of ``pipeline.OPTIONAL``) until measured.

Readers that are not such calls (evt partitions, ``call_tir`` kernels, the function's outputs)
keep reading the original binding, which stays only for them.  A reader rebuilt over the copies
keeps its own var (a dataflow block's output stays one).  CUDA route, before ``SplitReduction``
(each reduction then has producers of its own to view through its split) and ``LegalizeOps``;
nothing after it may eliminate common subexpressions.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import binding_uses, elements, flat_bindings, mutate_relax_functions, op_name
from ..partition.evt_cost import tensor_bytes

CHEAP = frozenset({"relax.astype", "relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                   "relax.negative", "relax.strided_slice"})
SIGMOID = "relax.sigmoid"  # cheap next to its bytes: recomputed, and a reader, with ``sigmoid``
SLICES = frozenset({"relax.strided_slice"})  # read only the part of their operand they return
FUSABLE = CHEAP | frozenset({"relax.where", "relax.sqrt", "relax.exp", "relax.less", "relax.greater",
                             "relax.nn.relu", "relax.sum", "relax.mean", "relax.max", "relax.min"})
MIN_ELEMENTS = 1 << 16  # smaller values: their bytes cost nothing, their kernel launches do
# what a small value (a batch norm's per-channel statistics) may be recomputed from in each reader
SMALL_CHEAP = CHEAP | frozenset({"relax.sqrt", "relax.rsqrt", "relax.reshape"})


def recompute_pays(value: relax.Call, var: relax.Var, readers: int, others: bool) -> bool:
    """Whether `readers` kernels recomputing ``var = value`` from its operands move fewer bytes
    than one kernel writing it and each of them reading it back.  With L the bytes of its
    full-size operands (as many elements as `var`) and V its own: written once, L + V + k V;
    recomputed by each of k readers, k L.  Where `others` (readers that cannot recompute it, or
    the function's result) read it anyway, it is written regardless: recomputing pays when L <= V."""
    n = elements(var)
    if n is None:
        return False
    own = tensor_bytes(var)
    if op_name(value) in SLICES:  # a copy reads the elements it returns, in the operand's dtype
        full = n * tensor_bytes(value.args[0]) // (elements(value.args[0]) or 1)
    else:
        full = sum(tensor_bytes(a) for a in value.args if elements(a) == n)
    return full <= own if others else (readers - 1) * full <= (readers + 1) * own


def op_sets(sigmoid: bool) -> tuple[frozenset, frozenset]:
    """(ops whose values are recomputed, ops a recomputed value fuses into), with ``SIGMOID`` in
    both where `sigmoid`."""
    return (CHEAP | {SIGMOID}, FUSABLE | {SIGMOID}) if sigmoid else (CHEAP, FUSABLE)


def plan(func: relax.Function, statistics: bool = False, sigmoid: bool = False) -> tuple[dict, set]:
    """(var -> its bound call, for every recomputed var; the recomputed vars whose original
    binding stays for readers that cannot recompute them).  `statistics`: small values too;
    `sigmoid`: sigmoids as well as ``CHEAP`` values."""
    cheap, fusable_ops = op_sets(sigmoid)
    bindings, block_of = flat_bindings(func)
    uses = binding_uses(func)  # index len(bindings): the function's result
    readers = {v: {bindings[i].var for i in idx if i < len(bindings)} for v, idx in uses.items()}
    outputs = {v for v, idx in uses.items() if len(bindings) in idx}
    bound = {b.var: b.value for b in bindings}
    recomputed: dict = {}
    for b in reversed(bindings):  # readers first
        v, value = b.var, b.value
        n = elements(v)
        if block_of.get(v) is None or n is None:
            continue
        small = n < MIN_ELEMENTS
        if (small and not statistics) or op_name(value) not in (SMALL_CHEAP if small else cheap):
            continue
        fusable = [r for r in readers.get(v, ()) if op_name(bound.get(r)) in fusable_ops and block_of.get(r) == block_of[v]]
        others = v in outputs or len(fusable) < len(readers.get(v, ()))
        if not (len(fusable) >= 2 or any(r in recomputed for r in fusable)):
            continue
        # a small value: recomputed only where that takes its kernel away (no other reader keeps it)
        if (not others) if small else recompute_pays(value, v, len(fusable), others):
            recomputed[v] = value
    kept = {v for v in recomputed
            if v in outputs or any(op_name(bound.get(r)) not in fusable_ops for r in readers.get(v, ()))}
    return recomputed, kept


@mutator
class _Recomputer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, statistics: bool, sigmoid: bool):
        super().__init__(mod)
        self.statistics = statistics
        self.sigmoid = sigmoid
        self.fusable = op_sets(sigmoid)[1]
        self.recomputed: dict = {}
        self.kept: set = set()

    def prime(self, func: relax.Function) -> None:
        self.recomputed, self.kept = plan(func, self.statistics, self.sigmoid)

    def _call(self, value: relax.Call, made: dict) -> relax.Call:
        """`value` with its recomputed operands copied (each once: `made`)."""
        args = [self._copy(a, made) if a in self.recomputed else self.visit_expr(a) for a in value.args]
        return relax.Call(value.op, args, value.attrs, value.ty_args)

    def _copy(self, v: relax.Var, made: dict) -> relax.Var:
        """A copy of recomputed `v` bound afresh (once per reader: `made`)."""
        if v not in made:
            made[v] = self.builder_.emit(self._call(self.recomputed[v], made))
        return made[v]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        v, value = binding.var, binding.value
        if v in self.recomputed and v not in self.kept:
            return  # every reader recomputes it
        if op_name(value) in self.fusable and any(a in self.recomputed for a in value.args):
            # one copy per reader, the reader bound to its own var (a dataflow block's output stays one)
            self.builder_.emit_normalized(relax.VarBinding(v, self.builder_.normalize(self._call(value, {}))))
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="RecomputeElementwise")
class RecomputeElementwise:
    """Give every reader of a cheap, multiply-read elementwise value its own copy (module docstring);
    `statistics`: values under ``MIN_ELEMENTS`` too, where that takes their kernels away;
    `sigmoid`: sigmoids too."""

    def __init__(self, statistics: bool = False, sigmoid: bool = False):
        self.statistics = statistics
        self.sigmoid = sigmoid

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        recomputer = _Recomputer(mod, self.statistics, self.sigmoid)
        return mutate_relax_functions(recomputer, mod, before_each=recomputer.prime)
