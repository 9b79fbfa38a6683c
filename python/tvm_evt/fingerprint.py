"""Fingerprints of what the ``evt`` pipeline makes of a model: hashes to compare two trees by.

``fingerprint(entry)`` builds the training graph as ``compile_training`` does for an sm_90a
target, runs the CUDA route's phases up to (not including) ``PrebuildKernels`` and hashes

- ``module``: the whole module's TVMScript at that point (graph passes, partitions, offloads);
- ``partitions``: each ``Codegen`` function (evt, evt_attention, evt_conv) by name;
- ``sources``: the C++ of every kernel ``RunCodegen`` would build (``relax_ext.kernel_sources``).

No GPU and no nvcc are needed.  A refactoring that must not change behaviour compares the
fingerprints of every zoo and bench model before and after (``scripts/fingerprint.py``).
"""
from __future__ import annotations

import hashlib

import tvm
from tvm import relax


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# what the partitioner's report says of its own run, not of the partition it chose
_RUN_FIELDS = ("solve_seconds", "method", "legality_calls")


def _stable_script(mod: tvm.IRModule) -> str:
    """The module's TVMScript, its partition report without the solver's timings."""
    import json

    report = mod.attrs.get("evt_partition_report") if mod.attrs else None
    text = tvm.IRModule(dict(mod.functions_items())).script()
    if report is not None:
        runs = json.loads(str(report))
        for entry in runs.values():
            for field in _RUN_FIELDS:
                entry.pop(field, None)
        text += json.dumps(runs, sort_keys=True)
    return text


def models(quick: bool = True) -> dict:
    """{name: ZooEntry factory} of every zoo model (its small default) and every bench model
    (``bench:KEY``, at --quick's shapes unless `quick` is False)."""
    from . import bench_e2e
    from .models import ZOO

    found = {name: factory for name, factory in ZOO.items()}
    for key in bench_e2e.MODELS:
        found[f"bench:{key}"] = lambda key=key: bench_e2e.build_entry(key, quick)
    return found


def fingerprint(entry, precision: str = "bf16") -> dict:
    """{"module": hash, "partitions": {name: hash}, "sources": {symbol: hash}} of `entry` (a
    ``models.ZooEntry``) on the sm_90a route (see the module docstring)."""
    import torch

    from .codegen import relax_ext
    from .optim import AdamW
    from .pipeline import phases
    from .training import hopper_target
    from .tuning import training_graph

    torch.manual_seed(0)
    target = hopper_target()
    _, graph = training_graph(entry, precision, AdamW(lr=1e-4), target)
    passes = phases(target)
    cut = [p.info.name for p in passes].index("PrebuildKernels")
    with target:
        mod = tvm.transform.Sequential(passes[:cut])(graph.mod)
    parts = {gv.name_hint: _sha(func.script()) for gv, func in mod.functions_items()
             if isinstance(func, relax.Function) and func.attrs and "Codegen" in func.attrs}
    sources = {sym: _sha(src) for sym, src in relax_ext.kernel_sources(mod).items()}
    return {"module": _sha(_stable_script(mod)), "partitions": dict(sorted(parts.items())),
            "sources": dict(sorted(sources.items()))}


def differences(before: dict, after: dict) -> list[str]:
    """What differs between two {model: fingerprint} maps, one line each ([] when equal)."""
    lines = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            lines.append(f"{name}: only {'after' if a is None else 'before'}")
            continue
        if a.get("error") or b.get("error"):
            if a.get("error") != b.get("error"):
                lines.append(f"{name}: error {a.get('error')!r} -> {b.get('error')!r}")
            continue
        if a["module"] != b["module"]:
            lines.append(f"{name}: module {a['module']} -> {b['module']}")
        for key in ("partitions", "sources"):
            for item in sorted(set(a[key]) | set(b[key])):
                if a[key].get(item) != b[key].get(item):
                    lines.append(f"{name}: {key[:-1]} {item} {a[key].get(item)} -> {b[key].get(item)}")
    return lines
