"""Tuning on the CPU: MetaSchedule on llvm for the MLP, then a compile that uses the work dir."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tvm
import tvm_evt
from tvm_evt import models, tuned, tuning

ROOT = Path(__file__).resolve().parent.parent


def _torch_loss_and_grads(entry, inputs):
    loss = entry.training_module()(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in entry.model.named_parameters()}


def test_tune_then_compile_matches_torch(tmp_path):
    torch.manual_seed(0)
    entry = models.ZOO["mlp"](dropout=0.0)
    result = tuning.tune(entry, "llvm", tmp_path, trials=8, max_tasks=2, precision="fp32", show_progress=False)
    assert result.cutlass == {"skipped": "not a CUDA target"}
    if "skipped" in result.tir:  # MetaSchedule unavailable in this TVM build: said why, and compiled without it
        assert "MetaSchedule" in result.tir["skipped"] or "save_json" in result.tir["skipped"]
    else:
        assert result.tir["tasks"] == 2 and tuned.has_database(tmp_path)
        again = tuning.tune(entry, "llvm", tmp_path, trials=8, max_tasks=2, precision="fp32", show_progress=False)
        assert again.tir["already_tuned"] + len(again.tir["failed"]) == 2  # resumed: nothing re-tuned
    inputs = entry.example_inputs()
    step = tvm_evt.compile_training(entry.model, inputs, loss_fn=entry.loss_fn, target="llvm", tuning_dir=tmp_path)
    loss, grads = step.loss_and_grads(*inputs)
    want_loss, want_grads = _torch_loss_and_grads(entry, inputs)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5)
    assert json.loads((tmp_path / tuning.PROGRESS_FILE).read_text())["runs"]


def test_split_phases_puts_fusion_before_the_build():
    before, after = tuned.split_phases(tvm.target.Target("llvm"))
    names = [p.info.name for p in before]
    assert names[-5:] == ["LegalizeOps", *tuned._FUSE] and len(after) == 1


def test_opaque_evt_calls_leave_no_partition(tmp_path):
    entry = models.ZOO["mlp"](dropout=0.0)
    _imported, graph = tuning.training_graph(entry, "bf16")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    mod = tuning.partitioned(graph.mod, target)
    assert tuning.evt_functions(mod)
    opaque = tuning.OpaqueEVTCalls()(mod)
    assert not tuning.evt_functions(opaque)
    assert "call_dps_packed" in opaque["train_step"].script()
    parts, _skipped = tuning.cutlass_partitions(mod)
    assert parts and len({p.symbol for p in parts}) == len(parts)


def test_kernel_traffic_counts_every_kernel_of_the_step():
    """An MLP step on the CUDA route: its GEMMs are CUTLASS partitions, the rest TIR kernels,
    each counted with its calls and with the bytes of its buffers."""
    entry = models.ZOO["mlp"](dropout=0.0)
    _imported, graph = tuning.training_graph(entry, "bf16")
    rows = tuning.kernel_traffic(graph.mod, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    kinds = {r["kind"] for r in rows}
    assert kinds == {"cutlass", "tir"}
    assert all(r["calls"] >= 1 and r["bytes"] == r["calls"] * r["bytes_per_call"] > 0 for r in rows)
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)
    # the first layer's forward GEMM reads x [batch, in] and W [in, hidden] (bf16), writes at least [batch, hidden]
    (x, _target) = entry.example_inputs()
    w = next(iter(entry.model.parameters()))
    least = 2 * (x.numel() + w.numel() + x.shape[0] * w.shape[0])
    assert any(r["kind"] == "cutlass" and r["bytes_per_call"] >= least for r in rows)
    with pytest.raises(ValueError, match="CUDA route"):
        tuning.kernel_traffic(graph.mod, tvm.target.Target({"kind": "llvm"}))


def test_kernel_traffic_counts_flash_attention_kernels():
    """A bf16 BERT layer with head dim 64: its attention is two flash kernels, each counted with
    q, k, v, O, LSE and dropout's keep bits (forward) or the gradients (backward)."""
    entry = models.ZOO["bert_layer"](batch=2, seq=64, hidden=128, heads=2)
    _imported, graph = tuning.training_graph(entry, "bf16")
    rows = tuning.kernel_traffic(graph.mod, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    flash = sorted((r for r in rows if r["kind"] == "flash"), key=lambda r: r["kernel"])
    assert len(flash) == 2 and "backward" in flash[1]["kernel"] and all(r["calls"] == 1 for r in flash)
    qkv = 2 * 64 * 128 * 2  # one [B, S, H*D] bf16 tensor
    mask = 2 * 2 * 1 * 1 * 128 * 4  # the keep bits: 128 words per 64 x 64 tile
    lse = 2 * 2 * 64 * 4
    assert flash[0]["bytes_per_call"] == 4 * qkv + 8 + lse + mask  # q, k, v, seed -> O, LSE, bits
    assert flash[1]["bytes_per_call"] == 8 * qkv + lse + mask  # q, k, v, O, dO, LSE, bits -> dQ, dK, dV


def test_xml_cnn_step_is_a_few_dozen_kernels():
    """XML-CNN's adaptive max pooling (63-wide windows) differentiates as one argmax a window,
    and its conv1d gathers read the NWC embedding: before, the pooling gradient alone was ~500
    kernels a step (667 launches on H100), and the step read the embedding transposed."""
    from tvm_evt import bench_e2e

    _imported, graph = tuning.training_graph(bench_e2e.build_entry("xml_cnn", False), "bf16")
    rows = tuning.kernel_traffic(graph.mod, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    tir = [r for r in rows if r["kind"] == "tir"]
    assert sum(r["calls"] for r in tir) <= 100, len(tir)
    assert sum(r["calls"] for r in tir if r["kernel"].startswith("argmax")) == 3  # one a pool
    assert not any("transpose" in r["kernel"] and r["bytes_per_call"] > 50e6 for r in tir)


def test_resnet50_batch_norm_sums_read_their_inputs_once():
    """ResNet-50 conv3_x's batch norms take their column sums as FuseColumnMoments' one-pass
    kernels (13 forward, 13 backward), no M x C sum is left, and no GEMM epilogue stores its
    output widened to float32 for them (the widening cast stays with its elementwise readers):
    TIR traffic was 15.9 GB a step with the sums in pairs, 14.4 GB with them fused."""
    from tvm_evt import bench_e2e

    _imported, graph = tuning.training_graph(bench_e2e.build_entry("resnet50", False), "bf16")
    rows = tuning.kernel_traffic(graph.mod, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    tir = [r for r in rows if r["kind"] == "tir"]
    moments = [r for r in tir if r["kernel"].startswith("column_moments")]
    assert sum(r["calls"] for r in moments if "centered" in r["kernel"]) == 13
    assert sum(r["calls"] for r in moments if "centered" not in r["kernel"]) == 13
    # the loss's sum of squares over [128, 28, 28, 512] is the only large sum left
    big = [r for r in tir if "sum" in r["kernel"] and r["bytes_per_call"] > 20e6]
    assert len(big) == 1 and big[0]["calls"] == 1, big
    cutlass = sum(r["bytes"] for r in rows if r["kind"] == "cutlass")
    assert cutlass < 8.0e9, cutlass  # 7.4 GB; 9.6 GB with the widened outputs stored


def test_load_model_specs():
    assert "MLP" in tuning.load_model("mlp", batch=3).description
    assert tuning.load_model("tvm_evt.models:mlp").model is not None
    # bench:KEY gives the bench's entry (shapes, channels-last), so its --tuning-dir finds the choices
    (x,) = tuning.load_model("bench:resnet50", batch=2, size=8).example_inputs()[:1]
    assert x.shape[0] == 2 and x.is_contiguous(memory_format=torch.channels_last)
    # a bare name that is also a zoo or preset name keeps meaning that one: ViT-B/16 with 12 layers
    preset = tuning.load_model("vit_b16", batch=1)
    assert preset.model is not None
    assert tuning.load_model("bench:vit_b16", batch=1).description != preset.description
    with pytest.raises(ValueError, match="bench:resnet50"):
        tuning.load_model("resnet50")
    with pytest.raises(ValueError, match="unknown bench model"):
        tuning.load_model("bench:no_such_model")
    assert tvm_evt.bench_e2e.TUNED_MARK == tuning.PROGRESS_FILE
    with pytest.raises(ValueError):
        tuning.load_model("no_such_model")


def test_script_help():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--trials" in out.stdout and "--work-dir" in out.stdout
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "traffic.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--top" in out.stdout and "kernel_traffic" in out.stdout


@pytest.fixture(scope="module")
def small_bert_partitions():
    """The lowered CUTLASS partitions of a small BERT layer (head dim 16, which the flash kernels do
    not take: the attention stays unfused, so its batched GEMMs are among them)."""
    entry = models.PRESETS["bert_large_layer"](batch=2, seq=128, hidden=256, heads=16, ffn=1024)
    _imported, graph = tuning.training_graph(entry, "bf16")
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    parts, _ = tuning.cutlass_partitions(tuning.partitioned(graph.mod, cuda))
    return parts


def test_sweep_times_every_candidate_and_the_plain_gemm(small_bert_partitions, monkeypatch):
    from tvm_evt.codegen import select
    from tvm_evt.codegen.backend import Decomposition, KernelConfig, default_config
    from tvm_evt.codegen.legality import fitting_config

    parts = small_bert_partitions[:3]
    untuned = KernelConfig(tile=(128, 64, 64), decomposition=Decomposition.SPLIT_K, splits=3)
    assert untuned not in select.space_table("full")
    monkeypatch.setattr(select, "heuristic_config", lambda p, *a, **k: untuned)  # in no search space
    asked = []

    def measure(jobs):  # a fake GPU: wider tiles and narrow epilogues are slower, plain GEMMs fastest
        asked.append(jobs)
        return {name: (0.5 if "_plain__" in name else 1.0) * cfg.tile[1] + (cfg.epi_tile is not None)
                for name, (job, cfg) in jobs.items()}

    rows = tuning.sweep_configs(parts, "quick", measure)
    assert len(asked) == 1 and {r["symbol"] for r in rows} == {p.symbol for p in parts}
    for r in rows:
        p = next(p for p in parts if p.symbol == r["symbol"])
        assert len(r["ms"]) >= len(select.candidates(p, "quick"))  # with the epilogue variants
        assert fitting_config(p, untuned).name in r["ms"]  # and what untuned builds run
        plain = asked[0][f"{p.symbol}_plain__{default_config('bfloat16').name}"][0]
        assert plain.symbol.endswith("_plain__" + default_config("bfloat16").name)
        assert len(plain.outputs) == 1 and r["plain_ms"] == 0.5 * default_config("bfloat16").tile[1]
        assert r["ms"][r["best"]] == min(r["ms"].values()) and r["errors"] == {}
    assert [r["ms"][r["best"]] for r in rows] == sorted((r["ms"][r["best"]] for r in rows), reverse=True)


def test_sweep_times_only_the_configurations_asked_for(small_bert_partitions):
    parts = small_bert_partitions[:2]
    asked = []

    def measure(jobs):
        asked.append(jobs)
        return {name: float(cfg.tile[1]) for name, (job, cfg) in jobs.items()}

    full = tuning.sweep_configs(parts, "quick", measure)
    names = {n for r in full for n in r["ms"]}
    keep = sorted(names)[:2]
    rows = tuning.sweep_configs(parts, "quick", measure, only=keep)
    for r in rows:  # every timed configuration was asked for, and each asked one is timed where it exists
        full_row = next(f for f in full if f["symbol"] == r["symbol"])
        assert set(r["ms"]) == set(keep) & set(full_row["ms"])
    assert all("_plain__" in n or n.rsplit("__", 1)[1] in keep for n in asked[1])
    with pytest.raises(ValueError, match="none of"):
        tuning.sweep_configs(parts, "quick", measure, only=["no_such_config"])
    by_pattern = tuning.sweep_configs(parts, "quick", measure, only=["pp_*"])  # shell patterns of names
    for r in by_pattern:
        full_row = next(f for f in full if f["symbol"] == r["symbol"])
        assert set(r["ms"]) == {n for n in full_row["ms"] if n.startswith("pp_")} != set()


def test_sweep_rows_carry_the_librarys_time_where_the_measure_has_one(small_bert_partitions):
    parts = small_bert_partitions[:2]

    class Measure:  # a fake GPU whose "cuBLAS" takes m / 1000 ms
        def __call__(self, jobs):
            return {name: 1.0 for name in jobs}

        def matmul_ms(self, gemm):
            return gemm.m / 1000

    rows = tuning.sweep_configs(parts, "quick", Measure())
    for r in rows:
        p = next(p for p in parts if p.symbol == r["symbol"])
        assert r["library_ms"] == p.gemm.m / 1000 and r["layout"] == p.gemm.layout_name and r["heuristic"]
    assert all(r["library_ms"] is None for r in tuning.sweep_configs(parts, "quick", lambda jobs: {n: 1.0 for n in jobs}))


def test_compare_configs_times_each_partition_under_default_and_heuristic(small_bert_partitions):
    from tvm_evt.codegen import select
    from tvm_evt.codegen.legality import fitting_config

    parts = small_bert_partitions
    asked = []

    def measure(jobs):  # a fake GPU: a job's time is its config's tile width plus its M, all distinct
        asked.append(jobs)
        return {name: float(cfg.tile[1]) + job.gemm.m / 1e6 for name, (job, cfg) in jobs.items()}

    rows = tuning.compare_configs(parts, measure)
    assert len(asked) == 1 and {r["symbol"] for r in rows} == {p.symbol for p in parts}
    for r in rows:
        p = next(p for p in parts if p.symbol == r["symbol"])
        names = [n for n in asked[0] if n.rsplit("__", 1)[0] == p.symbol]
        assert len(names) == (1 if r["default"] == r["heuristic"] else 2)  # equal configs timed once
        assert all(asked[0][n][0].symbol == n for n in names)  # each job builds under its own name
        assert r["heuristic"] == fitting_config(p, select.heuristic_config(p)).name
        assert r["heuristic_ms"] == measure({"x": (p, next(c for n, (_, c) in asked[0].items()
                                                            if n == f"{p.symbol}__{r['heuristic']}"))})["x"]
    assert any(r["default"] != r["heuristic"] for r in rows)
    assert [r["heuristic_ms"] for r in rows] == sorted((r["heuristic_ms"] for r in rows), reverse=True)


def test_bench_partitions_names_the_partitions_it_does_not_know(capsys, monkeypatch):
    """``--only`` with a symbol the model lacks stops before any GPU work and lists the real ones;
    ``--only MxNxK`` takes every partition of that problem."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_partitions", ROOT / "scripts" / "bench_partitions.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as exc:
        script.main(["xml_cnn", "--quick", "--only", "no_such_partition", "--sweep", "quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no partition ['no_such_partition']" in err and "main_adjoint_evt0_" in err

    swept = []
    monkeypatch.setattr(tuning, "sweep_configs", lambda parts, *a, **k: swept.append(parts) or [])
    script.main(["xml_cnn", "--quick", "--sweep", "quick"])
    problem = lambda p: "x".join(map(str, (p.gemm.m, p.gemm.n, p.gemm.k)))  # noqa: E731
    chosen = problem(swept[0][0])
    script.main(["xml_cnn", "--quick", "--only", chosen, "--sweep", "quick"])
    assert [p.symbol for p in swept[1]] == [p.symbol for p in swept[0] if problem(p) == chosen] != []


def test_bert_large_layer_norms_write_no_float32_element_values():
    """BERT-Large's layer norms save x (bf16, a GEMM's output) and the row statistics; xhat and
    the loss's z are recomputed by their readers' kernels, not written in float32 and read back:
    TIR traffic was 2486 MB a step with them written, 1883 MB without (H100: 3.58 -> 3.40 ms);
    1747 MB with dgamma and dbeta in one pass and dropout's backward in the gradient kernels;
    1257 MB with dgamma's and dbeta's partial sums made by the gradient kernels and the statistics
    stored by the forward kernels (no second read of x or of dy); 1291 MB at 46efa40, and 1324 MB
    with the first layer norm's gradient kernel writing its bf16 result again (34 MB) for FFN1's
    weight gradient (norm_output: the step keeps 34 MB less across the forward); 1375 MB with the
    four 1024x1024 projections' weight gradients as two K slices each (SplitMatmulReduction),
    whose float32 partials a TVM kernel sums (12.6 MB a call)."""
    from tvm_evt import bench_e2e

    _imported, graph = tuning.training_graph(bench_e2e.build_entry("bert_large", False), "bf16")
    rows = tuning.kernel_traffic(graph.mod, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    tir = [r for r in rows if r["kind"] == "tir"]
    forward = [r["kernel"] for r in tir if r["kernel"].startswith("layer_norm_") and "grad" not in r["kernel"]]
    assert len(forward) == 2 and all("mean_rstd" in k and "xhat" not in k for k in forward), forward
    backward = [r for r in tir if r["kernel"].startswith("layer_norm_grad")]
    # each reads x in bf16 (a float32 xhat would add 64 MB) and writes dx's bf16 cast, dropout's
    # backward of it (reading the keep mask) and dgamma's and dbeta's partial sums (2048 groups of
    # 8 rows, 17 MB: rows_per_block fills the GPU once): 201 MB, and the first one the bf16
    # [16384, 1024] result of its forward (34 MB) that FFN1's weight gradient reads (norm_output)
    assert len(backward) == 2, backward
    assert all(r["bytes_per_call"] < 205e6 + ("_ybfloat16" in r["kernel"]) * 34e6 for r in backward), backward
    assert sum("_ybfloat16" in r["kernel"] for r in backward) == 1, backward
    assert all("_tail_sum_dy_xhat_sum_dy_" in r["kernel"] for r in backward), backward
    assert sum(r["bytes"] for r in tir) < 1.38e9, sum(r["bytes"] for r in tir)


def test_cuda_route_leaves_no_var_undefined():
    """The CUDA route's Relax rewrites on a bf16 BERT layer without dropout (the GPU tier's
    bert_layer_d64 graph): every var a function reads is a parameter or bound before.  A reader
    RecomputeElementwise rebuilt over its copies once took a new dataflow var, and the step's
    returned bias-gradient sum was undefined when the VM code was generated."""
    from tvm import relax

    from _torch_ref import no_dropout
    from tvm_evt.training import build_training_module, from_torch, runtime_module

    entry = models.ZOO["bert_layer"](batch=4, seq=80, hidden=256, heads=4)
    no_dropout(entry.model)
    graph = build_training_module(from_torch(entry.model, entry.example_inputs(), entry.loss_fn), None, "bf16")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    before, schedule = tuning.until_scheduling(target)
    with target:
        mod = tvm.transform.Sequential([*before, schedule])(runtime_module(graph.mod))
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs and "Codegen" in func.attrs):
            continue
        defined, missing = set(func.params), []

        def note(e, defined=defined, missing=missing):
            if isinstance(e, relax.Var) and e not in defined:
                missing.append(str(e))

        for block in func.body.blocks:
            for b in block.bindings:
                relax.analysis.post_order_visit(b.value, note)
                defined.add(b.var)
        relax.analysis.post_order_visit(func.body.body, note)
        assert not missing, (gv.name_hint, missing[:5])


def test_in_place_step_partitions_as_the_functional_one():
    """A CUDA step runs in place (CUDA graphs): its dataflow block hands the gradients to the
    update after it.  The graph passes must keep those block outputs (a rewrite that remapped one
    to a dataflow var left the weight gradients' bf16 -> float32 casts to kernels of their own:
    four 1024 x 1024 and two 4096 x 1024 on BERT-Large), so the in-place step has the functional
    step's partitions, and tune.py (``training_graph(..., target)``) tunes those of the compile."""
    import dataclasses

    from tvm import relax

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    entry = models.ZOO["bert_layer"](batch=2, seq=64, hidden=128, heads=2)
    _imported, functional = tuning.training_graph(entry, "bf16")
    _imported, in_place = tuning.training_graph(entry, "bf16", target=cuda)
    assert not functional.inplace and in_place.inplace
    before, _schedule = tuning.until_scheduling(cuda)
    mod = in_place.mod
    with cuda:
        for p in before:
            mod = p(mod)
            relax.analysis.well_formed(mod)  # raises naming a dataflow var read outside its block

    def partitions(graph):
        parts, skipped = tuning.cutlass_partitions(tuning.partitioned(graph.mod, cuda))
        assert not skipped
        return sorted(repr(dataclasses.replace(p, symbol="")) for p in parts)

    assert partitions(in_place) == partitions(functional)

    def casts(graph):  # (bytes, calls) of the cast kernels: the parameters' to bf16, the input's
        return sorted((r["bytes_per_call"], r["calls"]) for r in tuning.kernel_traffic(graph.mod, cuda)
                      if r["kind"] == "tir" and r["kernel"].startswith("cast"))

    assert casts(in_place) == casts(functional)


def test_the_heuristic_sweep_times_what_an_untuned_build_runs_beside_the_plain_gemm(small_bert_partitions):
    from tvm_evt.codegen import select
    from tvm_evt.codegen.legality import fitting_config

    parts = small_bert_partitions[:3]
    asked = []

    def measure(jobs):
        asked.append(sorted(jobs))
        return {name: 1.0 for name in jobs}

    rows = tuning.sweep_configs(parts, tuning.HEURISTIC_SPACE, measure)
    assert len(asked) == 1 and len(asked[0]) == 2 * len(parts)  # one build batch: each partition and its plain GEMM
    for r in rows:
        p = next(p for p in parts if p.symbol == r["symbol"])
        assert list(r["ms"]) == [fitting_config(p, select.heuristic_config(p)).name] == [r["heuristic"]]
