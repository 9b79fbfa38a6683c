"""scripts/bench_dp.py (tvm_evt.bench_dp): arguments, the driver's bookkeeping and the report's
scaling efficiencies, on fake measurements (the measurements themselves need GPUs and NCCL)."""
from __future__ import annotations

import json

import pytest

from tvm_evt import bench_dp


def _row(model, system, ranks, samples, **extra):
    batch = 32
    return {"model": model, "system": system, "ranks": ranks, "ok": True, "batch_per_gpu": batch,
            "samples_per_s": samples, "step_ms": 1e3 * ranks * batch / samples, "compile_s": 10.0,
            "device_used_mb": 1000, **extra}


def test_parse_args():
    args = bench_dp.parse_args([])
    assert args.models == ["hf_bert_large", "hf_gpt2_medium"]
    assert args.systems == ["tvm_evt", "ddp", "ddp_compile"] and args.gpus == [1, 2, 4]
    with pytest.raises(SystemExit):
        bench_dp.parse_args(["--systems", "eager"])
    with pytest.raises(SystemExit):
        bench_dp.parse_args(["--gpus", "0,2"])


def test_efficiency_is_against_the_same_system_on_one_gpu():
    rows = [_row("hf_bert_large", "tvm_evt", 1, 400.0), _row("hf_bert_large", "tvm_evt", 4, 1520.0),
            _row("hf_bert_large", "ddp", 1, 300.0), _row("hf_bert_large", "ddp", 2, 570.0),
            _row("hf_gpt2_medium", "ddp", 2, 100.0)]  # no one-GPU row: no efficiency
    rows.append(_row("hf_bert_large", "tvm_evt_overlap", 2, 640.0))  # against tvm_evt's one-GPU row
    eff = bench_dp.efficiencies(rows)
    assert eff == {("hf_bert_large", "tvm_evt", 1): 1.0, ("hf_bert_large", "tvm_evt", 4): pytest.approx(0.95),
                   ("hf_bert_large", "tvm_evt_overlap", 2): pytest.approx(0.8),
                   ("hf_bert_large", "ddp", 1): 1.0, ("hf_bert_large", "ddp", 2): pytest.approx(0.95)}


def test_markdown_compares_with_ddp_compile_at_the_same_rank_count():
    rows = [_row("hf_bert_large", "tvm_evt", 2, 800.0), _row("hf_bert_large", "ddp_compile", 2, 640.0),
            _row("hf_bert_large", "tvm_evt", 1, 420.0),
            {"model": "hf_bert_large", "system": "ddp", "ranks": 4, "ok": False, "error": "timed out after 9 s"}]
    text = bench_dp.markdown({"meta": {"steps": 20}, "rows": rows})
    lines = [ln for ln in text.splitlines() if ln.startswith("| BertForMaskedLM")]
    assert [ln.split(" | ")[1:3] for ln in lines] == [["1", "tvm_evt"], ["2", "tvm_evt"], ["2", "ddp_compile"],
                                                      ["4", "ddp"]]
    assert "| 1.25× |" in lines[1] and "95.2 %" in lines[1]
    assert "FAILED: timed out after 9 s" in lines[3]


def test_driver_skips_what_an_earlier_run_measured_and_refuses_more_ranks_than_gpus(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    done = _row("hf_bert_large", "ddp", 1, 300.0)
    (tmp_path / bench_dp.RESULTS_JSON).write_text(json.dumps({"meta": {}, "rows": [done]}))
    measured = []

    def fake(args, model, system, ranks):
        measured.append((system, ranks))
        return _row(model, system, ranks, 290.0 * ranks)

    monkeypatch.setattr(bench_dp, "run_measurement", fake)
    assert bench_dp.main(["--models", "hf_bert_large", "--systems", "tvm_evt,tvm_evt_overlap,ddp", "--gpus", "1,2,4",
                          "--out", str(tmp_path)]) == 0
    # (tvm_evt_overlap on one GPU is tvm_evt's step: not measured)
    assert measured == [("tvm_evt", 1), ("tvm_evt", 2), ("tvm_evt_overlap", 2), ("ddp", 2)]
    rows = json.loads((tmp_path / bench_dp.RESULTS_JSON).read_text())["rows"]
    four = [r for r in rows if r["ranks"] == 4]
    assert len(four) == 3 and all(not r["ok"] and r["error"] == "4 ranks, 2 GPUs visible" for r in four)
    assert (tmp_path / bench_dp.RESULTS_MD).read_text().count("| BertForMaskedLM") == 8
