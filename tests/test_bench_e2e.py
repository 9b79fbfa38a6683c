"""The end-to-end benchmark's CPU-testable parts: arguments, reports from fake results, no-GPU exit."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tvm_evt import bench_e2e, models, pipeline

ROOT = Path(__file__).resolve().parent.parent


def fake_results():
    rows = [
        {"model": "bert_large", "system": "eager", "ok": True, "step_ms": 100.0, "compile_s": 0.5,
         "torch_peak_mb": 9000.0, "device_used_mb": 9500.0},
        {"model": "bert_large", "system": "tvm_evt", "ok": True, "step_ms": 80.0, "compile_s": 60.0,
         "device_used_mb": 7000.0, "kernel_ms": 70.0, "launches": 4.0, "kernels": [{"kernel": "evt_gemm|x", "calls_per_step": 4, "ms_per_step": 20.0}]},
        {"model": "gpt2_medium", "system": "tvm_evt", "ok": True, "step_ms": 50.0, "compile_s": 60.0,
         # today's defaults but two (the note names those)
         "rewrites": [n for n, r in pipeline.OPTIONAL.items() if r.default and n not in ("vectorize", "nhwc")],
         "note": "at abc123"},
        {"model": "bert_large", "system": "compile", "ok": False, "error": "timed out after 540 s"},
        {"model": "resnet50", "system": "eager_sdpa", "skipped": "no attention"},
    ]
    return {"meta": {"gpu": "Fake H100", "steps": 20, "warmup": 3}, "rows": rows}


def test_parse_args_defaults_and_subsets():
    args = bench_e2e.parse_args([])
    assert args.models == list(bench_e2e.MODELS) and args.systems == bench_e2e.DEFAULT_SYSTEMS
    assert set(bench_e2e.SYSTEMS) - set(args.systems) == {"tvm_evt_launched"}  # asked for by name
    args = bench_e2e.parse_args(["--models", "bert_large,xml_cnn", "--systems", "eager,tvm_evt", "--steps", "25",
                                 "--quick", "--profile"])
    assert args.models == ["bert_large", "xml_cnn"] and args.systems == ["eager", "tvm_evt"]
    assert args.steps == 25 and args.quick and args.profile
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--models", "alexnet"])
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--systems", "jax"])


def test_models_are_presets():
    for preset, full, small, _label in bench_e2e.MODELS.values():
        assert preset in models.PRESETS
        assert set(small) <= set(full) | {"size", "seq", "batch", "layers"}


def test_applicable(tmp_path):
    assert bench_e2e.applicable("eager_sdpa", "resnet50", None) == "no attention"
    assert bench_e2e.applicable("eager_sdpa", "bert_large", None) is None
    assert bench_e2e.applicable("tvm_evt_tuned", "bert_large", None) == "no tuning dir"
    (tmp_path / "bert_large").mkdir()
    assert bench_e2e.applicable("tvm_evt_tuned", "bert_large", str(tmp_path)).startswith("no tuning results")
    (tmp_path / "bert_large" / bench_e2e.TUNED_MARK).write_text("{}")
    assert bench_e2e.applicable("tvm_evt_tuned", "bert_large", str(tmp_path)) is None


def test_reports_from_fake_results(tmp_path):
    data = fake_results()
    bench_e2e.write_reports(data, tmp_path)
    assert json.loads((tmp_path / "bench_e2e.json").read_text()) == data
    md = (tmp_path / "bench_e2e.md").read_text()
    assert "| BERT-Large layer | tvm_evt | 80.00 | 1.25× |" in md
    assert "FAILED: timed out" in md and "n/a: no attention" in md
    # the optional rewrites a tvm_evt row was compiled with, where they differ from the defaults
    assert md.splitlines()[[i for i, ln in enumerate(md.splitlines()) if "| GPT-2" in ln][0]].endswith(
        "| -vectorize -nhwc; at abc123 |")
    assert "| BERT-Large layer | tvm_evt | 80.00 | 1.25× | 60.0 | – | 7000 | |" in md  # no record: no note
    assert "Top kernels: bert_large / tvm_evt" in md and "`evt_gemm/x`" in md
    assert "GPU busy 70.00 ms/step in 4 kernel launches; idle 10.00 ms." in md
    png = tmp_path / "bench_e2e.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench_e2e.load_results(tmp_path) == data


def test_replot_needs_no_gpu(tmp_path):
    bench_e2e.write_reports(fake_results(), tmp_path)
    (tmp_path / "bench_e2e.png").unlink()
    assert bench_e2e.main(["--out", str(tmp_path), "--replot"]) == 0
    assert (tmp_path / "bench_e2e.png").exists()


def test_no_gpu_exits_with_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_e2e, "gpu_problem", lambda: "no CUDA GPU is visible")
    assert bench_e2e.main(["--out", str(tmp_path)]) == 2
    assert "cannot run: no CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
def test_script_without_gpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_script_help():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--systems" in out.stdout and "--profile" in out.stdout


def test_deadline_starts_only_measurements_that_fit(tmp_path, monkeypatch, capsys):
    """With --deadline, a measurement starts only while its --timeout still fits; the others are
    left for a second run with the same --out, which measures them and skips the rows it has."""
    clock = [0.0]
    ran = []

    def measure(args, model, system):
        ran.append((model, system))
        clock[0] += 100.0  # each measurement takes 100 s of the run
        return {"model": model, "system": system, "ok": True, "step_ms": 1.0, "step_ms_min": 1.0,
                "step_ms_max": 1.0, "steps": 1, "compile_s": 1.0}

    monkeypatch.setattr(bench_e2e, "gpu_problem", lambda: None)
    monkeypatch.setattr(bench_e2e, "run_measurement", measure)
    monkeypatch.setattr(bench_e2e.time, "monotonic", lambda: clock[0])
    argv = ["--out", str(tmp_path), "--models", "xml_cnn", "--systems", "eager,compile,tvm_evt",
            "--timeout", "150", "--deadline", "300"]
    assert bench_e2e.main(argv) == 0
    assert ran == [("xml_cnn", "eager"), ("xml_cnn", "compile")]  # 200 + 150 > 300: tvm_evt waits
    assert "not started: xml_cnn / tvm_evt" in capsys.readouterr().err
    clock[0] = 0.0
    assert bench_e2e.main(argv) == 0
    assert ran[2:] == [("xml_cnn", "tvm_evt")]
    assert bench_e2e.fits(0.0, 150, None) and not bench_e2e.fits(151.0, 150, 300)


def test_rows_name_their_run_and_commit_and_a_row_with_fewer_steps_says_so(tmp_path, monkeypatch):
    """Two invocations into one --out (the second with --steps 5): every row records its run (host,
    start time) and commit; the table states the usual step count and notes the row that had fewer."""
    def measure(args, model, system):
        return {"model": model, "system": system, "ok": True, "step_ms": 2.0, "step_ms_min": 2.0,
                "step_ms_max": 2.0, "steps": args.steps, "compile_s": 1.0}

    monkeypatch.setattr(bench_e2e, "gpu_problem", lambda: None)
    monkeypatch.setattr(bench_e2e, "run_measurement", measure)
    monkeypatch.setenv("TVM_EVT_COMMIT", "abc1234")
    base = ["--out", str(tmp_path), "--models", "xml_cnn"]
    assert bench_e2e.main(base + ["--systems", "eager,compile"]) == 0
    monkeypatch.setenv("TVM_EVT_COMMIT", "def5678")
    epoch = bench_e2e.time.gmtime(0)
    monkeypatch.setattr(bench_e2e.time, "gmtime", lambda *secs: epoch)  # another run
    assert bench_e2e.main(base + ["--systems", "tvm_default", "--steps", "5"]) == 0
    rows = {r["system"]: r for r in bench_e2e.load_results(tmp_path)["rows"]}
    assert rows["eager"]["commit"] == "abc1234" and rows["tvm_default"]["commit"] == "def5678"
    assert rows["eager"]["run"] == rows["compile"]["run"] != rows["tvm_default"]["run"]
    md = (tmp_path / "bench_e2e.md").read_text()
    assert "median of 20 steps" in md
    assert "| XML-CNN (EUR-Lex) | tvm_default | 2.00 | 1.00× | 1.0 | – | – | 5 steps |" in md
    assert "| XML-CNN (EUR-Lex) | compile | 2.00 | 1.00× | 1.0 | – | – | |" in md
    runs = [ln for ln in md.splitlines() if ln.startswith("- `")]
    assert len(runs) == 2 and "commit abc1234: xml_cnn/eager, xml_cnn/compile" in runs[0]
    assert "1970-01-01T00:00:00Z`, commit def5678: xml_cnn/tvm_default" in runs[1]


def test_a_timed_out_row_says_how_far_it_got(tmp_path, monkeypatch):
    """The measurement logs its compile and first-step times, so a row that runs out of time tells
    which part was slow (TVM's default pipeline: its steps, not its build)."""
    script = tmp_path / "slow.py"
    script.write_text("import sys, time\n"
                      "print('[bench] bert_large / tvm_default: compiled in 3.2 s', file=sys.stderr, flush=True)\n"
                      "print('[bench] bert_large / tvm_default: first step 0.50 s', file=sys.stderr, flush=True)\n"
                      "print('[bench] gpt2_medium / tvm_default: compiled in 9.9 s', file=sys.stderr, flush=True)\n"
                      "time.sleep(30)\n")
    real_run = bench_e2e.subprocess.run
    monkeypatch.setattr(bench_e2e.subprocess, "run",
                        lambda cmd, **kw: real_run([sys.executable, str(script)], **kw))
    args = bench_e2e.parse_args(["--timeout", "3"])
    row = bench_e2e.run_measurement(args, "bert_large", "tvm_default")
    assert not row["ok"]
    assert row["error"] == "timed out after 3 s (compiled in 3.2 s; first step 0.50 s)"
    assert bench_e2e.progress("nothing here", "bert_large", "tvm_default") == ""


def test_a_step_that_leaves_no_room_for_another_is_the_measurement():
    assert bench_e2e.only_the_first_step(58.0, 70.0)  # BERT-Large under TVM's default pipeline
    assert not bench_e2e.only_the_first_step(1.3, 80.0)  # XML-CNN's: warm-up and timed steps follow
    assert not bench_e2e.only_the_first_step(0.0, 0.0)


def test_active_time_counts_overlapping_kernels_once():
    # two streams: [0, 10) and [5, 15) overlap, [20, 25) follows a gap, [21, 23) lies inside it
    assert bench_e2e.active_time([(20, 5), (0, 10), (5, 10), (21, 2)]) == 20
    assert bench_e2e.active_time([]) == 0


def test_a_profile_with_side_streams_reports_the_active_time(tmp_path):
    data = fake_results()
    row = data["rows"][1]  # bert_large / tvm_evt: 80 ms a step
    row.update(kernel_ms=90.0, active_ms=75.0)  # side-stream kernels overlap: summed > the step
    bench_e2e.write_reports(data, tmp_path)
    md = (tmp_path / "bench_e2e.md").read_text()
    assert ("GPU busy 90.00 ms/step summed over 4 kernel launches; active 75.00 ms (some kernel running, "
            "on any stream); idle 5.00 ms.") in md


def test_fit_steps_shrinks_a_slow_system_to_the_time_left():
    assert bench_e2e.fit_steps(0.005, 500, steps=20, warmup=2, extra=3) == (20, 2)  # fast: as asked
    assert bench_e2e.fit_steps(30.0, 500, steps=20, warmup=2, extra=3) == (8, 0)  # 0.7 * 500 s: 11 steps, 3 profiled
    assert bench_e2e.fit_steps(16.0, 500, steps=20, warmup=2) == (20, 1)  # 21 fit: warm-up gives way first
    assert bench_e2e.fit_steps(100.0, 500, steps=20, warmup=2) == (3, 0)
    assert bench_e2e.fit_steps(900.0, 500, steps=20, warmup=2) == (1, 0)  # never fewer than one


def test_error_summary_keeps_the_compiler_error_line():
    log = ("NVRTC compilation failed:\n"
           "cuda_fp8.hpp(1461): warning #1444-D: class \"double4\" was declared deprecated\n" * 20
           + "default_function_kernel.cu(42): error: identifier \"__hfma2\" is undefined\n"
           "1 error detected in the compilation of \"default_function_kernel.cu\".\n")
    text = bench_e2e.error_summary(RuntimeError(log))
    assert text.startswith("RuntimeError: NVRTC compilation failed:")
    assert 'identifier "__hfma2" is undefined' in text
    assert "double4" not in text
    assert bench_e2e.error_summary(ValueError("plain message")) == "ValueError: plain message"


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_tvm_default_baseline_builds_a_training_step_for_cuda():
    """The tvm_default system: TVM's CUDA pipeline, no evt, DLight per function. TVM's own
    ApplyDefaultSchedule stops on this graph (Reduction rule, rfactor check): the baseline must
    still build (compile only, no GPU needed)."""
    import copy

    import tvm

    from tvm_evt import optim
    from tvm_evt.frontend import from_torch
    from tvm_evt.pipeline import tvm_default_cuda_pipeline
    from tvm_evt.training import build_training_module

    entry = models.ZOO["bert_layer"]()
    imported = from_torch(copy.deepcopy(entry.model), entry.example_inputs(), entry.loss_fn)
    graph = build_training_module(imported, optim.AdamW(lr=1e-4), "bf16")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    ex = tvm.compile(graph.mod, target=target, relax_pipeline=tvm_default_cuda_pipeline())
    assert ex is not None
    names = [gv.name_hint for gv in graph.mod.get_global_vars()]
    assert not any("evt" in n for n in names)  # nothing partitioned: the baseline is TVM alone


def test_attention_summary_counts_the_calls_the_kernels_run():
    import types

    import tvm_evt

    entry = models.ZOO["bert_layer"](batch=2, seq=64, hidden=128, heads=2)  # head dim 64
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    step = types.SimpleNamespace(graph=tvm_evt.build_training_module(imported, None, "bf16"))
    assert bench_e2e.attention_summary(step) == {"fused": 2, "kernels": 2, "reasons": []}
    step = types.SimpleNamespace(graph=tvm_evt.build_training_module(imported, None, "fp32"))
    assert bench_e2e.attention_summary(step) == {"fused": 0, "kernels": 0, "reasons": []}


def test_speedups_keep_a_significant_digit():
    assert bench_e2e._fmt(2.751, "x") == "2.75×"
    assert bench_e2e._fmt(15.63 / 70226.84, "x") == "0.0002×"
    assert bench_e2e._fmt(None, "x") == "–"


def test_memory_rows_get_a_memory_plan_table(tmp_path):
    data = fake_results()
    plan = {"planned_peak": 900.0, "parameters": 100.0, "gradients": 100.0, "optimizer_state": 200.0,
            "saved_activations": 300.0, "temporaries": 150.5}
    data["rows"][1]["memory_plan"] = plan
    assert bench_e2e.parse_args(["--memory"]).memory and not bench_e2e.parse_args([]).memory
    md = bench_e2e.markdown(data)
    assert "## Memory plan (MiB; --memory)" in md
    assert "| BERT-Large layer | tvm_evt | 900.0 | 100.0 | 100.0 | 200.0 | 300.0 | 150.5 |" in md
    assert "Memory plan" not in bench_e2e.markdown(fake_results())  # no --memory row: no table
    report = {"planned_peak_bytes": 3 * 2**20, "categories": {"parameters": 2**20, "gradients": 2**20,
              "optimizer_state": 2**21, "saved_activations": 2**19, "temporaries": 0, "inputs": 5}}
    assert bench_e2e.memory_columns(report) == {"planned_peak": 3.0, "parameters": 1.0, "gradients": 1.0,
                                                "optimizer_state": 2.0, "saved_activations": 0.5, "temporaries": 0.0}
