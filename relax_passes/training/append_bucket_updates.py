"""AppendBucketUpdates: the optimizer update of each gradient bucket as a function of its own.

Data-parallel training (``tvm_evt.distributed``) runs the update after the gradients are
averaged across ranks, one bucket at a time, so bucket b's update runs while the collectives of
the later buckets are still in flight.  This pass adds, for each group of tensors ``groups[b]``
(a list of (shape, dtype) of the parameters the update function takes):

    update{b}(*params, *grads, *slots (slot-major), step) -> (*new_params, *new_slots (slot-major))

with each gradient in its parameter's dtype (``AutoMixedPrecision`` hands fp32 gradients to the
fp32 master weights), each the fused kernel(s) of ``optimizer_update.emit_update``; and

    advance(step[, rng_seed]) -> (step + 1[, rng_seed + (0, 1)])

the step counter (and the dropout seed's counter) for the next step, kept on the device as
``AppendOptimizer``'s ``train_step`` keeps them.  Under ZeRO-1 a group is one flat 1-D shard of
the bucket's parameters: the update is elementwise, so a flat shard updates as its elements would.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from .optimizer_update import emit_update

UPDATE_NAME = "update{}"
ADVANCE_NAME = "advance"


@tvm.transform.module_pass(opt_level=0, name="AppendBucketUpdates")
class AppendBucketUpdates:
    """Add ``update{b}`` for each group of (shape, dtype) in `groups` and ``advance`` (see the
    module docstring); `has_seed`: ``advance`` also advances the dropout seed."""

    def __init__(self, optimizer, groups: list[list[tuple[tuple[int, ...], str]]], has_seed: bool):
        self.optimizer = optimizer
        self.groups = groups
        self.has_seed = has_seed

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        slots = self.optimizer.slots()
        scalar = relax.TensorType((), "float32")
        for b, group in enumerate(self.groups):
            tensor = lambda name, spec: relax.Var(name, relax.TensorType(spec[0], spec[1]))
            params = [tensor(f"p{i}", spec) for i, spec in enumerate(group)]
            grads = [tensor(f"g{i}", spec) for i, spec in enumerate(group)]
            state = {s: [tensor(f"{s}{i}", spec) for i, spec in enumerate(group)] for s in slots}
            step = relax.Var("step", scalar)
            args = params + grads + [v for s in slots for v in state[s]] + [step]
            with bb.function(UPDATE_NAME.format(b), args, attrs={"num_input": len(args)}):
                with bb.dataflow():
                    new_params, new_state, _ = emit_update(bb, self.optimizer, params, grads, state, step)
                    out = bb.emit_output(relax.Tuple([*new_params, *(v for s in slots for v in new_state[s])]))
                bb.emit_func_output(out)
        step = relax.Var("step", scalar)
        args = [step]
        if self.has_seed:
            args.append(relax.Var("rng_seed", relax.TensorType((2,), "uint32")))
        with bb.function(ADVANCE_NAME, args, attrs={"num_input": len(args)}):
            with bb.dataflow():
                outs = [bb.emit(R.add(step, relax.const(1.0, "float32")))]
                if self.has_seed:
                    outs.append(bb.emit(R.add(args[1], relax.const(np.array([0, 1], dtype="uint32")))))
                out = bb.emit_output(relax.Tuple(outs))
            bb.emit_func_output(out)
        return bb.get()
