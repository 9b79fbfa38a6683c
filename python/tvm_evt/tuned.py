"""Compiling with the results of a tuning work dir (``scripts/tune.py``; ``tvm_evt.tuning.tune``).

``compile_tuned(mod, target, work_dir)`` (what ``compile_training(..., tuning_dir=...)`` calls)
compiles with the ``evt`` pipeline plus ``MetaScheduleApplyDatabase`` right after ``FuseTIR``, so
tuned kernels replace DLight's default schedules, and with the CUTLASS choices in effect
(``TVM_EVT_SELECT=1``; the work dir's choices are merged into the selection cache that
``relax.ext.evt`` reads).  This is the library half of tuning: the drivers that search and write a
work dir (``tuning``) import it, never the reverse.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import tvm
from tvm import relax

from .pipeline import cache_tvm_kernels, phases
from .relax_passes.lower.legalize_ops import legalize_ops

CUTLASS_FILE = "cutlass_select.json"
MS_FILES = ("database_workload.json", "database_tuning_record.json")
# what the CPU route must do before ApplyDatabase (the CUDA route has these in its legalize passes)
_FUSE = ("AnnotateTIROpPattern", "FoldConstant", "FuseOps", "FuseTIR")  # after legalize_ops()


def _names(passes) -> list[str]:
    return [p.info.name for p in passes]


def split_phases(target: tvm.target.Target) -> tuple[list, list]:
    """The ``evt`` pipeline's phases cut right after ``FuseTIR``: (up to fused TIR, the rest).

    The CUDA route fuses inside its legalize passes; the generic route legalizes inside
    ``default_build_pipeline``, so the cut adds legalize_ops() ... FuseTIR before that last phase."""
    passes = phases(target)
    names = _names(passes)
    if "FuseTIR" in names:
        cut = names.index("FuseTIR") + 1
        return passes[:cut], passes[cut:]
    fuse = [legalize_ops()] + [getattr(relax.transform, name)() for name in _FUSE]
    return passes[:-1] + fuse, passes[-1:]


def has_database(work_dir) -> bool:
    return all((Path(work_dir) / f).is_file() for f in MS_FILES)


def tuned_pipeline(work_dir) -> tvm.transform.Pass:
    """The ``evt`` pipeline with ``MetaScheduleApplyDatabase(work_dir)`` after ``FuseTIR``."""
    work_dir = str(work_dir)

    @tvm.transform.module_pass(opt_level=0, name="EVTTunedPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current()
        if target is None:
            raise ValueError("the tuned evt pipeline needs a target: tvm.compile(mod, target=...)")
        cache_tvm_kernels(target)
        with target:
            before, after = split_phases(target)
            apply = [relax.transform.MetaScheduleApplyDatabase(work_dir)] if has_database(work_dir) else []
            return tvm.transform.Sequential(before + apply + after)(mod)

    return _pipeline


@contextlib.contextmanager
def cutlass_choices(work_dir):
    """Make ``relax.ext.evt`` use the CUTLASS choices of ``work_dir`` (merged into the selection
    cache it reads; ``TVM_EVT_SELECT=1`` while the block runs)."""
    from .codegen import select
    from .codegen.backend import KernelConfig

    path = Path(work_dir) / CUTLASS_FILE
    if path.is_file():
        mine, shared = select.SelectionCache(path), select.SelectionCache()
        current = shared.load()
        for key, entry in mine.load().items():
            if current.get(key, {}).get("config") == entry.get("config"):
                continue
            sig, gpu, _version = key.split("|")
            shared.put(sig, gpu, KernelConfig.from_json(entry["config"]), note=entry.get("note", ""))
    old = os.environ.get("TVM_EVT_SELECT")
    os.environ["TVM_EVT_SELECT"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TVM_EVT_SELECT", None)
        else:
            os.environ["TVM_EVT_SELECT"] = old


def compile_tuned(mod: tvm.IRModule, target: tvm.target.Target, work_dir):
    """``tvm.compile`` with the tuning results of ``work_dir`` (MetaSchedule database + CUTLASS choices)."""
    with cutlass_choices(work_dir):
        return tvm.compile(mod, target=target, relax_pipeline=tuned_pipeline(work_dir))
