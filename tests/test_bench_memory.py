"""The largest-batch benchmark (tvm_evt/bench_memory.py, ``scripts/bench.py --max-batch``): its search
finds the largest fitting batch of affine, noisy and stepped peak curves in few trials, each system's
row keeps the trial at that batch, the tvm_evt systems confirm the estimate with runs, and the
libraries' own activation checkpointing is found and switched on (CPU; the trials themselves need a GPU)."""
import argparse

import pytest

from tvm_evt import bench_e2e, bench_memory
from tvm_evt.bench_memory import largest_batch, search_system

GB = 10**9


# BERT-Large's memory plans (bf16, seq 512, CUDA graphs, arena; CPU, no kernel built): batch -> bytes
BERT_LARGE_PLANS = {1: 5_520_129_480, 2: 5_776_941_000, 24: 17_916_869_576, 83: 51_249_912_264,
                    109: 66_022_571_464, 135: 80_591_151_560, 187: 110_081_944_008, 291: 169_063_528_904}


def _bert_large_plan(batch: int) -> int:
    """`BERT_LARGE_PLANS` joined by straight lines (0.26 GB a sample from 1 to 2, then about 0.56)."""
    points = sorted(BERT_LARGE_PLANS.items())
    (b0, p0), (b1, p1) = next(((a, c) for a, c in zip(points, points[1:]) if batch <= c[0]), points[-2:])
    return p0 + (batch - b0) * (p1 - p0) // (b1 - b0)


def _truth(peak, limit, ceiling=1 << 16):
    fitting = [b for b in range(1, ceiling) if peak(b) is not None and peak(b) <= limit]
    return max(fitting) if fitting else None


@pytest.mark.parametrize("name,peak", [
    ("affine", lambda b: 3 * GB + b * 370_000_000),
    ("affine, start over the line", lambda b: 50 * GB + b * 2 * GB),
    # the allocator's rounding: peaks in 512 MiB steps
    ("stepped", lambda b: ((2 * GB + b * 300_000_000) // 2**29 + 1) * 2**29),
    # faster than linear (a workspace that grows with the batch squared)
    ("convex", lambda b: GB + b * 100_000_000 + b * b * 2_000_000),
    # out of memory (None) well before the peak says so
    ("oom early", lambda b: None if b > 150 else 5 * GB + b * 10_000_000),
    ("steeper past small batches", lambda b: _bert_large_plan(b)),
])
def test_search_finds_the_largest_fitting_batch_within_its_resolution(name, peak):
    limit = 80 * GB
    calls = []
    batch, trials = largest_batch(lambda b: calls.append(b) or peak(b), limit, start=1, max_trials=16)
    truth = _truth(peak, limit, 4096)
    assert batch is not None and peak(batch) is not None and peak(batch) <= limit
    assert truth - max(1, int(truth * bench_memory.RESOLUTION)) <= batch <= truth, (name, batch, truth, trials)
    assert len(calls) == len(set(calls)) == len(trials)  # no batch tried twice
    assert len(trials) <= 14, (name, trials)


def test_an_affine_peak_is_found_exactly_in_four_trials():
    limit, peak = 80 * GB, lambda b: 3 * GB + b * 370_000_000
    batch, trials = largest_batch(peak, limit, start=8)
    assert batch == (limit - 3 * GB) // 370_000_000
    assert sorted(trials) == [8, 16, batch, batch + 1]


def test_a_flat_peak_that_ends_in_out_of_memory_is_bisected_in_few_trials():
    """The peak of a step whose update outweighs its activations barely grows with the batch (a
    budget's rematerialisation recomputes them), so the line points far past where the estimate
    first fails: the bracket it leaves is bisected geometrically."""
    peak = lambda b: None if b > 300 else 1_625_623_156 + 2048 * b  # noqa: E731
    batch, trials = largest_batch(peak, 3 * GB, start=2, max_trials=16)
    assert 300 - 300 // 32 <= batch <= 300 and len(trials) <= 12, trials


def test_a_line_that_overshoots_gives_way_to_the_bracket_line():
    """The first two trials' line points far past the limit when the plan's peak grows faster past
    small batches; the line through the bracket's ends then lands within the resolution in the
    trials an estimate-only run is given (the default 8)."""
    limit = int(bench_memory.PLAN_SHARE * 80 * GB)
    batch, trials = largest_batch(_bert_large_plan, limit, start=1)
    truth = _truth(_bert_large_plan, limit, 4096)
    assert truth - max(1, int(truth * bench_memory.RESOLUTION)) <= batch <= truth, (batch, truth, trials)


def test_nothing_fits():
    batch, trials = largest_batch(lambda b: None, 80 * GB, start=4)
    assert batch is None and trials == {4: None}


def test_the_search_stops_at_max_trials_with_the_largest_batch_seen_to_fit():
    peak = lambda b: 1000 * b**3  # noqa: E731  (no line predicts it)
    batch, trials = largest_batch(peak, 10**15, start=1, max_trials=5)
    assert len(trials) == 5 and batch == max(b for b, p in trials.items() if p <= 10**15) < 10**4


def _args(**kw):
    return argparse.Namespace(start_batch=kw.get("start", 4), max_trials=kw.get("trials", 10), quick=False,
                              steps=5, warmup=2, timeout=100)


def _torch_trial(peak, limit):
    def run(b):
        p = peak(b)
        if p > limit:
            return {"ok": True, "fits": False, "batch": b, "error": "OutOfMemoryError"}
        return {"ok": True, "fits": True, "batch": b, "peak_bytes": p, "step_ms": 10.0 * b, "samples_per_s": 100.0}
    return run


def test_a_torch_systems_row_is_its_largest_fitting_trial():
    limit, peak = 80 * GB, lambda b: 2 * GB + b * GB
    row = search_system(_args(), "hf_bert_large", "eager", limit, None, _torch_trial(peak, limit))
    assert row["ok"] and row["batch"] == 78 and row["peak_bytes"] == 80 * GB and row["step_ms"] == 780.0
    assert row["trials"]["79"]["fits"] is False


def test_a_failing_trial_fails_the_row_with_its_error():
    row = search_system(_args(), "m", "compile", 80 * GB, None,
                        lambda b: {"ok": False, "batch": b, "error": "exit code 1: boom"})
    assert not row["ok"] and "boom" in row["error"]


def test_a_model_without_checkpointing_is_skipped():
    row = search_system(_args(), "m", "eager_checkpoint", 80 * GB, None,
                        lambda b: {"ok": True, "skipped": "no checkpointing"})
    assert row["skipped"] == "no checkpointing"


def _tvm_trial(measured, limit, ran: list):
    """A tvm_evt trial on a device whose memory use is `measured(batch)`: it runs whatever it
    takes (TVM's allocator is not capped) and says whether that fit; the batches go to `ran`."""
    def run(b):
        ran.append(b)
        p = measured(b)
        return {"ok": True, "fits": p <= limit, "batch": b, "peak_bytes": p, "step_ms": 1.0, "samples_per_s": b * 1e3}
    return run


def test_tvm_evt_runs_the_estimated_batch_and_scales_down_what_is_over_the_limit():
    limit = 80 * GB
    estimate = lambda b: GB + b * GB  # noqa: E731  (the plan: 79 fits)
    measured = lambda b: 5 * GB + b * GB  # noqa: E731  (the device: 75 fits)
    ran = []
    trial = _tvm_trial(measured, limit, ran)
    row = search_system(_args(start=8), "m", "tvm_evt", limit, None, trial, estimate)
    assert ran[0] == 79 and row["ok"] and measured(row["batch"]) <= limit and row["batch"] >= 74
    assert len(ran) <= 3 and set(row["estimates"]) >= {"8", "16", "79"}


def test_tvm_evt_grows_an_estimate_that_errs_high_once():
    limit = 80 * GB
    estimate = lambda b: 10 * GB + 2 * b * GB  # noqa: E731  (the plan: 35)
    measured = lambda b: 4 * GB + b * GB  # noqa: E731  (the device: 76)
    ran = []
    trial = _tvm_trial(measured, limit, ran)
    row = search_system(_args(start=4), "m", "tvm_evt", limit, None, trial, estimate)
    assert ran == [35, 71] and row["batch"] == 71  # 35 * 80 / 39: under the limit, as an affine peak must be


def test_tvm_evt_at_eager_batch_runs_that_batch_once():
    trial = lambda b: {"ok": True, "fits": True, "batch": b, "peak_bytes": GB, "step_ms": 2.0,  # noqa: E731
                       "samples_per_s": b * 500.0}
    row = search_system(_args(), "m", "tvm_evt_at_eager_batch", 80 * GB, 24, trial)
    assert row["ok"] and row["batch"] == 24 and list(row["trials"]) == ["24"]
    assert search_system(_args(), "m", "tvm_evt_at_eager_batch", 80 * GB, None, trial)["skipped"]


def test_the_budget_at_twice_eagers_batch_runs_that_batch_once_with_the_budget():
    trial = lambda b: {"ok": True, "fits": True, "batch": b, "peak_bytes": GB, "step_ms": 2.0,  # noqa: E731
                       "samples_per_s": b * 500.0}
    row = search_system(_args(), "m", "tvm_evt_budget_at_twice_eager", 80 * GB, 24, trial)
    assert row["ok"] and row["batch"] == 48 and list(row["trials"]) == ["48"]
    assert bench_memory._budget("tvm_evt_budget_at_twice_eager", 80 * GB) == 64 * GB
    assert bench_memory._budget("tvm_evt_at_eager_batch", 80 * GB) is None


def test_markdown_compares_with_eager_and_the_budget_with_tvm_evt_at_eagers_batch():
    rows = [{"model": "m", "system": "eager", "ok": True, "batch": 20, "peak_bytes": 79 * GB, "step_ms": 100.0,
             "samples_per_s": 200.0, "trials": {}},
            {"model": "m", "system": "tvm_evt_budget", "ok": True, "batch": 44, "peak_bytes": 78 * GB,
             "step_ms": 200.0, "samples_per_s": 220.0,
             "trials": {"30": {"fits": True}, "50": {"fits": False}, "46": {"fits": False}, "45": {"error": "timed out"}}},
            {"model": "m", "system": "tvm_evt_at_eager_batch", "ok": True, "batch": 20, "peak_bytes": 30 * GB,
             "step_ms": 80.0, "samples_per_s": 250.0, "trials": {}},
            {"model": "m", "system": "eager_checkpoint", "skipped": "no checkpointing"},
            {"model": "m", "system": "tvm_evt_budget_at_twice_eager", "ok": True, "batch": 40, "peak_bytes": 70 * GB,
             "step_ms": 180.0, "samples_per_s": 225.0, "trials": {}}]
    text = bench_memory.markdown({"meta": {"limit_bytes": 80 * GB}, "rows": rows})
    assert "| m | tvm_evt_budget | 44 | 46 | 2.20× | 78.0 | 200.0 | 220.0 | 1.10× |" in text
    assert "tvm_evt_budget's batch 44 (2.20× eager's) at 0.88× the samples/s of tvm_evt at eager's batch 20" in text
    assert "tvm_evt_budget_at_twice_eager's batch 40 (2.00× eager's) at 0.90× the samples/s" in text
    assert "| m | eager_checkpoint | – |" in text and "no checkpointing" in text


def test_markdown_marks_an_unbracketed_search_and_a_batch_bounded_by_its_plan():
    """A torch search that never failed shows its batch as a lower bound; a tvm_evt row confirmed
    from its plans shows the first batch whose plan is over the limit (and its own summary line)."""
    rows = [{"model": "m", "system": "eager", "ok": True, "batch": 24, "peak_bytes": 74 * GB, "step_ms": 340.0,
             "samples_per_s": 70.0, "trials": {"24": {"fits": True}, "25": {"fits": False}}},
            {"model": "m", "system": "compile", "ok": True, "batch": 20, "peak_bytes": 35 * GB, "step_ms": 138.0,
             "samples_per_s": 145.0, "trials": {"20": {"fits": True}}},
            {"model": "m", "system": "tvm_evt_at_eager_batch", "ok": True, "batch": 24, "peak_bytes": 32 * GB,
             "step_ms": 131.0, "samples_per_s": 183.0, "trials": {"24": {"fits": True}}},
            {"model": "m", "system": "tvm_evt", "ok": True, "batch": 66, "peak_bytes": 79.7 * GB, "step_ms": 355.0,
             "samples_per_s": 186.0, "trials": {"66": {"fits": True}},
             "estimates": {"48": 59 * GB, "66": 79.6 * GB, "67": 80.7 * GB, "96": 113 * GB}}]
    text = bench_memory.markdown({"meta": {"limit_bytes": 80 * GB}, "rows": rows})
    assert "| m | eager | 24 | 25 |" in text
    assert "| m | compile | ≥ 20 | – |" in text
    assert "| m | tvm_evt | 66 | 67 (plan) | 2.75× |" in text
    assert "| m | tvm_evt_at_eager_batch | 24 | – |" in text
    assert "tvm_evt's batch 66 (2.75× eager's) at 1.02× the samples/s of tvm_evt at eager's batch 24" in text


def test_bench_cli_takes_max_batch_with_its_own_systems():
    args = bench_e2e.parse_args(["--max-batch", "80", "--models", "hf_bert_large"])
    assert args.systems == list(bench_e2e.MAX_BATCH_SYSTEMS) and args.max_batch == 80
    assert "tvm_evt_budget" not in bench_e2e.parse_args([]).systems
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--max-batch", "80", "--systems", "tvm_default"])


def test_checkpointing_finds_the_librarys_own_switch():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    model = transformers.BertForMaskedLM(config)
    wrapped = torch_module_list(model)
    assert bench_memory.checkpointing(wrapped).startswith("BertForMaskedLM.")
    assert any(m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing"))
    assert bench_memory.checkpointing(torch_module_list(__import__("torch").nn.Linear(2, 2))) is None


def torch_module_list(*modules):
    import torch

    return torch.nn.ModuleList(modules)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
def test_script_with_max_batch_without_gpu(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
    out = subprocess.run([sys.executable, str(script), "--max-batch", "80", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--max-batch needs a CUDA GPU" in out.stderr


def test_run_writes_every_systems_row_and_feeds_eagers_batch_on(tmp_path, monkeypatch):
    """The driver over models and systems (trials and estimates faked): rows in the JSON and the
    table, eager's batch taken by tvm_evt_at_eager_batch, rows already there not searched again."""
    limit = 80 * GB
    peaks = {"eager": lambda b: 10 * GB + 2 * GB * b, "eager_checkpoint": lambda b: 10 * GB + GB * b // 2,
             "compile": lambda b: 10 * GB + GB * b, "tvm_evt": lambda b: 8 * GB + GB * b,
             "tvm_evt_budget": lambda b: 8 * GB + GB * b // 3, "tvm_evt_at_eager_batch": lambda b: 8 * GB + GB * b,
             "tvm_evt_budget_at_twice_eager": lambda b: 8 * GB + GB * b // 3}
    ran = []

    aims = []

    def fake_trial(args, model, system, batch, lim, aimed=None):
        ran.append((system, batch))
        if aimed is not None:
            aims.append((system, batch, aimed["memory_budget"]))
        p = peaks[system](batch)
        return {"ok": True, "fits": p <= lim, "batch": batch, "peak_bytes": p, "step_ms": float(batch),
                "samples_per_s": 1000.0}

    def fake_aim(model, batch, lim, quick=False):
        aims.append(("aimed", batch))
        return {"memory_budget": 90 * GB, "planned_peak_bytes": 70 * GB}

    monkeypatch.setattr(bench_memory, "run_trial", fake_trial)
    monkeypatch.setattr(bench_memory, "aimed_budget", fake_aim)
    monkeypatch.setattr(bench_memory, "estimated_peak", lambda model, system, b, lim, quick=False: peaks[system](b))
    argv = ["--max-batch", "80", "--models", "hf_bert_large", "--out", str(tmp_path), "--start-batch", "2",
            "--max-trials", "12"]
    assert bench_memory.run(bench_e2e.parse_args(argv)) == 0
    rows = {r["system"]: r for r in bench_e2e.load_results(tmp_path, bench_memory.RESULTS_JSON)["rows"]}
    assert set(rows) == set(bench_e2e.MAX_BATCH_SYSTEMS)
    assert rows["eager"]["batch"] == 35 and rows["tvm_evt_budget"]["batch"] >= 200
    assert rows["tvm_evt_at_eager_batch"]["batch"] == 35 and rows["tvm_evt_budget_at_twice_eager"]["batch"] == 70
    assert "| hf_bert_large | eager | 35 | 36 |" in (tmp_path / bench_memory.RESULTS_MD).read_text()
    # twice eager's batch: the budget aimed at the limit's plan, once, and compiled with
    assert aims == [("aimed", 70), ("tvm_evt_budget_at_twice_eager", 70, 90 * GB)]
    assert rows["tvm_evt_budget_at_twice_eager"]["aimed_budget"]["memory_budget"] == 90 * GB
    before = len(ran)
    bench_memory.run(bench_e2e.parse_args(argv))
    assert len(ran) == before  # resumed: nothing searched again


def test_estimates_made_without_a_gpu_are_kept_for_the_gpu_run(tmp_path, monkeypatch):
    """--estimate-only searches the tvm_evt systems' estimates alone (no trial) and keeps them in
    --out; the run that follows confirms with trials and estimates nothing again; another limit
    estimates afresh."""
    estimated, ran = [], []

    def fake_estimate(model, system, b, lim, quick=False):
        estimated.append((system, b))
        return 8 * GB + GB * b

    def fake_trial(args, model, system, batch, lim, aimed=None):
        ran.append((system, batch))
        return {"ok": True, "fits": True, "batch": batch, "peak_bytes": 8 * GB + GB * batch, "step_ms": 1.0,
                "samples_per_s": 1.0}

    monkeypatch.setattr(bench_memory, "estimated_peak", fake_estimate)
    monkeypatch.setattr(bench_memory, "run_trial", fake_trial)
    argv = ["--max-batch", "80", "--models", "hf_bert_large", "--out", str(tmp_path), "--systems", "eager,tvm_evt"]
    assert bench_memory.main([*argv, "--estimate-only"]) == 0
    assert not ran and estimated and {s for s, _ in estimated} == {"tvm_evt"}
    before = len(estimated)
    bench_memory.run(bench_e2e.parse_args(argv))
    assert len(estimated) == before and ("tvm_evt", 72) in ran
    bench_memory.run(bench_e2e.parse_args(["--max-batch", "40", *argv[2:], "--estimate-only"]))
    assert len(estimated) > before


def test_a_search_cut_short_resumes_without_running_its_trials_again(tmp_path, monkeypatch):
    ran, cut = [], [True]

    def fake_trial(args, model, system, batch, lim, aimed=None):
        if cut[0] and len(ran) == 2:  # the third trial: the device call ends
            return {"ok": False, "batch": batch, "error": "timed out after 1 s"}
        ran.append(batch)
        p = 10 * GB + 2 * GB * batch
        return {"ok": True, "fits": p <= lim, "batch": batch, "peak_bytes": p, "step_ms": 1.0, "samples_per_s": 1.0}

    monkeypatch.setattr(bench_memory, "run_trial", fake_trial)
    argv = ["--max-batch", "80", "--models", "hf_bert_large", "--out", str(tmp_path), "--systems", "eager",
            "--start-batch", "8"]
    bench_memory.run(bench_e2e.parse_args(argv))
    row, = bench_e2e.load_results(tmp_path, bench_memory.RESULTS_JSON)["rows"]
    assert not row["ok"] and ran == [8, 16]
    cut[0] = False
    bench_memory.run(bench_e2e.parse_args(argv))
    row, = bench_e2e.load_results(tmp_path, bench_memory.RESULTS_JSON)["rows"]
    assert row["ok"] and row["batch"] == 35 and ran[:2] == [8, 16] and 8 not in ran[2:] and 16 not in ran[2:]


def test_the_gpu_run_confirms_the_batch_the_estimate_only_run_found(tmp_path, monkeypatch):
    """Other --start-batch / --max-trials on the GPU than in the --estimate-only run: no estimate is
    made again, the trial runs at the batch found before."""
    estimated, ran = [], []

    def fake_estimate(model, system, b, lim, quick=False):
        estimated.append(b)
        return 8 * GB + GB * b

    def fake_trial(args, model, system, batch, lim, aimed=None):
        ran.append(batch)
        return {"ok": True, "fits": True, "batch": batch, "peak_bytes": lim - GB, "step_ms": 1.0, "samples_per_s": 1.0}

    monkeypatch.setattr(bench_memory, "estimated_peak", fake_estimate)
    monkeypatch.setattr(bench_memory, "run_trial", fake_trial)
    argv = ["--max-batch", "80", "--models", "hf_bert_large", "--out", str(tmp_path), "--systems", "tvm_evt"]
    bench_memory.main([*argv, "--estimate-only", "--start-batch", "16"])
    before = len(estimated)
    bench_memory.run(bench_e2e.parse_args([*argv, "--start-batch", "32", "--max-trials", "3"]))
    assert len(estimated) == before and ran[0] == 72


def test_estimates_are_made_for_the_cuda_route_on_any_machine():
    """On a machine without a GPU the estimate still runs the CUDA route's passes (a Hopper's)."""
    target = bench_memory.estimate_target()
    assert target.kind.name == "cuda"
    import torch
    if not torch.cuda.is_available():
        assert str(target.attrs["arch"]) == "sm_90a"


def test_a_trial_compiles_with_the_aimed_budget(monkeypatch):
    """run_trial hands the aimed budget to the trial subprocess, which compiles with it."""
    import json
    import subprocess
    import types

    jobs = []

    def fake_run(cmd, **kwargs):
        jobs.append(json.loads(cmd[cmd.index("--trial") + 1]))
        return types.SimpleNamespace(stdout="", stderr="", returncode=1)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = bench_e2e.parse_args(["--max-batch", "80"])
    bench_memory.run_trial(args, "hf_bert_large", "tvm_evt_budget_at_twice_eager", 204, 80 * GB,
                           {"memory_budget": 95 * GB, "planned_peak_bytes": 77 * GB})
    bench_memory.run_trial(args, "hf_bert_large", "tvm_evt_budget_at_twice_eager", 204, 80 * GB,
                           {"memory_budget": None, "planned_peak_bytes": None, "error": "no budget fits"})
    assert jobs[0]["memory_budget"] == 95 * GB and "memory_budget" not in jobs[1]


def test_tvm_evt_is_estimated_by_its_plan_and_old_estimates_are_not_reused(tmp_path, monkeypatch):
    """tvm_evt's batch is searched on its memory plan, the budget system's on the estimate its budget
    bounds; values kept on another basis are made again."""
    assert bench_memory.estimate_basis("tvm_evt") == "plan"
    assert bench_memory.estimate_basis("tvm_evt_budget") == "estimate"
    made = []

    def fake_estimate(model, system, b, lim, quick=False):
        made.append(b)
        return 8 * GB + GB * b

    monkeypatch.setattr(bench_memory, "estimated_peak", fake_estimate)
    argv = ["--max-batch", "80", "--models", "hf_bert_large", "--out", str(tmp_path), "--systems", "tvm_evt",
            "--estimate-only"]
    bench_memory.main(argv)
    data = bench_e2e.load_results(tmp_path, bench_memory.RESULTS_JSON)
    assert data["estimates"]["hf_bert_large/tvm_evt"]["basis"] == "plan"
    data["estimates"]["hf_bert_large/tvm_evt"].pop("basis")  # as an older run kept them
    bench_e2e.save_results(data, tmp_path, bench_memory.RESULTS_JSON)
    before = len(made)
    bench_memory.main(argv)
    assert len(made) > before
