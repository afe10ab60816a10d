"""bench.sweep's pure parts: the data set of each shape, the steps that time about the same
tokens everywhere, and the verdicts against the issue's lines (1.7x TRL, 85 % MFU)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_each_shape_has_its_own_set_and_times_about_the_same_tokens():
    from bench.sweep import POINTS, data_args, timed_steps

    assert data_args(POINTS["bench"]) == ()   # the fixed bench's own set
    assert data_args(POINTS["L2048"]) == ("--max-len", "2048", "--prompt-mean", "400", "--response-mean", "600")
    assert data_args(POINTS["L128"])[:2] == ("--max-len", "128")
    for shape, mean in ((POINTS["L128"], 62.5), (POINTS["bench"], 250.0), (POINTS["G64"], 250.0)):
        steps = timed_steps(shape, mean, 40000)
        assert 40000 <= steps * shape.global_batch * mean < 40000 + shape.global_batch * mean
    assert timed_steps(POINTS["L2048"], 1000.0, 1000) == 3   # never fewer than 3 timed steps


def test_verdicts_hold_every_point_to_the_trl_ratio_and_the_bench_point_to_the_mfu():
    from bench.sweep import table

    peak = {"peak_gflops_fp32": 100.0, "threads": 2}
    rows = [{"point": "bench", "shape": {"max_len": 512, "global_batch": 16, "micro_batch": 4, "nproc": 1},
             "steps": 10, "tokens_per_s": {"ours": 1800.0, "trl_packed": 1000.0, "ours_baseline": 900.0},
             "gflops": {"ours": 86.0, "trl_packed": 47.0}},
            {"point": "L128", "shape": {"max_len": 128, "global_batch": 16, "micro_batch": 4, "nproc": 1},
             "steps": 40, "tokens_per_s": {"ours": 1500.0, "trl_packed": 1000.0}, "gflops": {"ours": 50.0}}]
    text, verdicts = table(rows, peak)
    assert ("| bench | 512 | 16 | 4 | 1 | 10 | 1800 | 900 | 1000 | – | 86.0% | 47.0% | 79.9% | 1.80× | 0.90× | 2.00× "
            "| – |") in text
    # A contender without a run has no ratio.
    assert "| L128 | 128 | 16 | 4 | 1 | 40 | 1500 | – | 1000 | – | 50.0% | – | – | 1.50× | – | – | – |" in text
    assert verdicts == ["bench: ours ÷ TRL packed 1.80× (need ≥ 1.7: 79.9% MFU) PASS",
                        "bench: MFU 86.0% of the fp32 peak (need ≥ 85%) PASS",
                        "L128: ours ÷ TRL packed 1.50× (need ≥ 1.7: – MFU) FAIL"]


def test_mfu_is_against_the_higher_of_the_peaks_measured_before_and_after_the_points():
    """One box measured 179 and 195 GFLOP/s with the same command minutes apart: a peak taken in
    a slow minute alone would pass an MFU that the machine's own faster minute fails."""
    from bench.sweep import higher_peak, table

    row = {"point": "bench", "shape": {"max_len": 512, "global_batch": 16, "micro_batch": 4, "nproc": 1},
           "steps": 10, "tokens_per_s": {"ours": 1900.0}, "gflops": {"ours": 157.0}}
    before, after = {"peak_gflops_fp32": 179.0, "threads": 2}, {"peak_gflops_fp32": 195.0, "threads": 2}
    assert table([row], before)[1][-1] == "bench: MFU 87.7% of the fp32 peak (need ≥ 85%) PASS"
    for peak in (higher_peak(before, after), higher_peak(after, before)):
        assert peak["peak_gflops_fp32"] == 195.0
        text, verdicts = table([row], peak)
        assert verdicts[-1] == "bench: MFU 80.5% of the fp32 peak (need ≥ 85%) FAIL"
    assert text.startswith("fp32 matmul peak 195 GFLOP/s (the higher of 195 before the first point and 179 after "
                           "the last, 2 threads)")


def test_a_sweep_measures_the_peak_again_after_its_last_point_and_reports_the_higher(tmp_path, monkeypatch):
    """main's wiring of the second measurement (the table test above holds only higher_peak)."""
    import json

    from bench import sweep

    monkeypatch.setattr(sweep, "point_inputs", lambda *a: ({"peak": {"peak_gflops_fp32": 179.0, "threads": 2}}, 10))
    monkeypatch.setattr(sweep, "run_one", lambda name, *a: {"tokens_per_s": 1900.0, "model_gflops_per_s": 157.0,
                                                             "final_loss": 8.0})
    measured = []
    monkeypatch.setattr(sweep, "measure_peak", lambda path, *a, **k: measured.append(path) or
                        {"peak_gflops_fp32": 195.0, "threads": 2})
    assert sweep.main(["--points", "bench", "--contenders", "ours", "--out", str(tmp_path)]) == 0
    assert measured == [tmp_path / "peak-after.json"]
    assert json.loads((tmp_path / "sweep.json").read_text())["peak"]["measured_fp32"] == [179.0, 195.0]
    assert "bench: MFU 80.5% of the fp32 peak (need ≥ 85%) FAIL" in (tmp_path / "sweep.md").read_text()


def test_repetitions_show_medians_and_every_repetition_must_pass():
    """--reps: a median that passes is not enough when one repetition's own ratio fails."""
    from bench.sweep import median_row, table

    peak = {"peak_gflops_fp32": 100.0, "threads": 2}
    row = median_row({"point": "2ranks", "shape": {"max_len": 512, "global_batch": 16, "micro_batch": 4, "nproc": 2},
                      "steps": 10, "runs": {"ours": [1800.0, 1700.0, 1900.0], "trl_packed": [1000.0, 1050.0, 900.0]},
                      "runs_gflops": {"ours": [60.0, 50.0, 70.0], "trl_packed": [1.0, 1.0, 1.0]}})
    assert row["tokens_per_s"] == {"ours": 1800.0, "trl_packed": 1000.0} and row["gflops"]["ours"] == 60.0
    text, verdicts = table([row], peak)
    assert "| 2ranks | 512 | 16 | 4 | 2 | 10 | 1800 | – | 1000 | – | 60.0% | 1.0% | 1.7% | 1.80× |" in text
    assert verdicts == ["2ranks: ours ÷ TRL packed 1.80× (need ≥ 1.7: 1.7% MFU) "
                        "per repetition 1.80×, 1.62×, 2.11× FAIL"]
    row["runs"]["trl_packed"][1] = 950.0
    assert table([row], peak)[1][0].endswith("1.79×, 2.11× PASS")
    # Without TRL in the run (--contenders ours,ours_baseline) there is no verdict to give.
    alone = median_row({**row, "runs": {"ours": [1.0]}, "runs_gflops": {"ours": [1.0]}})
    assert table([alone], peak)[1] == ["2ranks: ours ÷ TRL packed – (needs both runs)"]


def test_another_contender_gets_a_column_and_a_misspelt_one_fails_before_any_run(capsys):
    """--contenders ours,ours_compiled,trl_packed ran compile but its tokens/s were in no column;
    a typo ran into a KeyError only after the inputs were made (minutes)."""
    from bench.sweep import main, table

    peak = {"peak_gflops_fp32": 100.0, "threads": 2}
    row = {"point": "micro1", "shape": {"max_len": 512, "global_batch": 16, "micro_batch": 1, "nproc": 1},
           "steps": 10, "tokens_per_s": {"ours": 1500.0, "trl_packed": 1000.0, "ours_compiled": 1650.0},
           "gflops": {"ours": 60.0, "trl_packed": 40.0}}
    text = table([row], peak)[0].splitlines()
    assert text[2].startswith("| point | max len | global | micro | ranks (ours) | steps | ours | ours_baseline "
                              "| trl_packed | plain_padfree | ours_compiled | MFU ours |")
    assert text[3].count("---") == text[2].count("|") - 1
    assert text[4].startswith("| micro1 | 512 | 16 | 1 | 1 | 10 | 1500 | – | 1000 | – | 1650 | 60.0% |")
    with pytest.raises(SystemExit) as exit_:
        main(["--contenders", "ours,trl_pakced", "--work", "/nonexistent/never-made"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--contenders: unknown ['trl_pakced']" in err and "ours_compiled" in err


def test_the_baseline_is_told_to_pack_unless_it_runs_as_its_user_got_it():
    from bench.run import contender_shape
    from bench.sweep import POINTS

    shape = POINTS["L128"]
    assert "data.packing" not in shape.ours()                    # ours: the trainer's own default
    assert contender_shape("ours", shape).ours() == shape.ours()
    assert contender_shape("ours_baseline", shape).ours()["data.packing"] == "true"
    assert "data.packing" not in contender_shape("ours_baseline", shape, baseline_as_is=True).ours()


def test_profile_and_kernels_find_the_largest_set_the_sweep_made_for_a_length(tmp_path):
    from bench.sweep import made_inputs

    for name in ("L512-n192", "L512-n1000", "L512-n320", "L128-n5000"):
        (tmp_path / "sweep" / name / "model").mkdir(parents=True)
    (tmp_path / "sweep" / "L512-n9999").mkdir()          # a set whose model was never made
    assert made_inputs(tmp_path, 512) == tmp_path / "sweep" / "L512-n1000"   # by rows, not by name
    with pytest.raises(SystemExit, match="no sweep inputs of length 2048"):
        made_inputs(tmp_path, 2048)


def test_the_peak_is_measured_for_the_dtypes_asked_only(tmp_path, monkeypatch):
    """bench.sweep runs fp32 only and asks for the fp32 peak alone: an emulated bf16 peak costs minutes."""
    import json
    import sys

    from bench import matmul_peak

    out = tmp_path / "peak.json"
    monkeypatch.setattr(sys, "argv", ["matmul_peak", "--dtypes", "fp32", "--sizes", "32", "--seconds", "0.001",
                                      "--repeats", "1", "--json", str(out)])
    matmul_peak.main()
    peak = json.loads(out.read_text())
    assert list(peak["by_size"]) == ["fp32"] and "peak_gflops_bf16" not in peak
    assert peak["peak_dtype"] == "fp32" and peak["peak_gflops"] == peak["peak_gflops_fp32"] > 0


def test_the_profile_by_shape_folds_token_counts_into_one_row(capsys):
    """bench.profile_step --by-shape: one layer's product at every micro-batch length is one
    row (token counts shown as T, the model's own sizes kept), with its GFLOP/s."""
    from types import SimpleNamespace as E

    from bench.profile_step import print_by_shape

    events = [E(key="aten::mm", input_shapes=[[t, 384], [384, 1024]], count=3, self_cpu_time_total=t * 1000,
                flops=2 * t * 384 * 1024 * 3) for t in (1105, 2022)]
    events += [E(key="aten::mul", input_shapes=[[1, 2022, 1024], [1, 2022, 1024]], count=1, self_cpu_time_total=500,
                 flops=0), E(key="aten::mm", input_shapes=[[2022, 384], [384, 384]], count=1,
                             self_cpu_time_total=100, flops=0)]
    print_by_shape(E(key_averages=lambda group_by_input_shape: events), 2, {384, 1024, 8192})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "[['T', 384], [384, 1024]]" in out[1] and " 6  " in out[1]
    seconds = (1105 + 2022) * 1000 / 1e6
    assert f"{2 * (1105 + 2022) * 384 * 1024 * 3 / seconds / 1e9:5.0f} GFLOP/s" in out[1]
    assert "aten::mul" in out[2] and "[[1, 'T', 1024], [1, 'T', 1024]]" in out[2]
