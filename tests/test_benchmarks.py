"""Smoke test of benchmarks/bench.py at a toy size (seconds): the unrolled reference, the FLOP
formula, the memory measurement, the achieved-FLOP-rate mode and the JSON output."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from flt_diag.model.transformer import Block, LoopedTransformer, ModelConfig, parameter_groups
from numerics import assert_close64, record, softcap_fp32_atol

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("flt_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["flt_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def toy_spec(bench):
    return bench.BenchSpec("tiny", model=dict(depth=1, width=32, heads=2, seq_len=16),
                           train=dict(batch_size=4), step_loops=2, mem_loops=(3, 12), repeats=2,
                           steps_per_sample=1, warmup=1, peak_size=64, description="toy")


def test_unrolled_has_LK_distinct_blocks_of_the_same_shapes(bench):
    cfg = ModelConfig(depth=2, width=32, heads=2, seq_len=16, loops=3, variant="lt")
    looped, unrolled = LoopedTransformer(cfg), bench.UnrolledTransformer(cfg)
    assert len(unrolled.blocks) == 2 * 3
    assert all(isinstance(b, Block) for b in unrolled.blocks)
    ptrs = [p.data_ptr() for b in unrolled.blocks for p in b.parameters()]
    assert len(set(ptrs)) == len(ptrs)  # no weight is shared
    ref = [(n, p.shape) for n, p in looped.blocks[0].named_parameters()]
    for b in unrolled.blocks:
        assert [(n, p.shape) for n, p in b.named_parameters()] == ref
    assert unrolled.embed.weight.shape == looped.embed.weight.shape
    assert unrolled.head.weight.shape == looped.head.weight.shape
    n_looped = sum(p.numel() for p in looped.blocks.parameters())
    assert sum(p.numel() for p in unrolled.blocks.parameters()) == 3 * n_looped
    assert len(parameter_groups(unrolled)) == 2 + 2 * 6  # the optimizer recipe sees every block


def test_unrolled_with_one_loop_is_the_looped_model(bench):
    cfg = ModelConfig(depth=2, width=32, heads=2, seq_len=16, loops=1, variant="lt")
    torch.manual_seed(0)
    looped = LoopedTransformer(cfg)
    torch.manual_seed(0)
    unrolled = bench.UnrolledTransformer(cfg)
    for b in looped.blocks:  # the init zeroes o and down; make the blocks do something
        torch.nn.init.normal_(b.attn.o.weight, std=0.1)
        torch.nn.init.normal_(b.mlp.down.weight, std=0.1)
    unrolled.load_state_dict(looped.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    # both in float64: the head outputs to RTOL64, the logits (soft-capped in fp32) to twice that step's rounding
    (got, _, got_z), (want, _, want_z) = record(unrolled.double(), idx), record(looped.double(), idx)
    assert_close64(got_z[-1], want_z[-1])
    torch.testing.assert_close(got, want, rtol=0, atol=2 * softcap_fp32_atol(want_z[-1]))


def test_flop_formula_matches_a_hand_count(bench):
    # L=1, K=2, d=8, V=16, T=4, B=2: tokens = 8, block matmul weights = 12 * 64 = 768
    cfg = ModelConfig(depth=1, width=8, heads=2, seq_len=4, vocab_size=16, loops=2)
    f = bench.train_flops(cfg, batch_size=2)
    assert f["blocks"] == 6 * 8 * (1 * 2) * 768 == 73728
    assert f["head"] == 6 * 8 * 8 * 16 == 6144
    assert f["attention"] == 6 * 2 * 4 ** 2 * 8 * (1 * 2) == 3072
    assert f["total"] == 82944
    assert bench.train_flops(cfg, batch_size=2, grad_accum=3)["total"] == 3 * 82944
    block = Block(ModelConfig(width=8, heads=2))
    assert bench.matmul_params_per_block(8) == sum(m.weight.numel() for m in block.modules()
                                                   if isinstance(m, torch.nn.Linear))


def test_checkpointing_cuts_activation_memory(bench, one_thread):
    rows = bench.memory_sweep(toy_spec(bench), "flt", [3, 12], "cpu")
    by = {(r["loops"], r["checkpoint"]): r for r in rows}
    assert by[(12, True)]["peak_bytes"] < by[(12, False)]["peak_bytes"]
    assert by[(12, True)]["saved_bytes"] < by[(12, False)]["saved_bytes"]
    assert by[(12, False)]["peak_bytes"] > by[(3, False)]["peak_bytes"]
    assert all(r["peak_bytes"] > 0 and r["saved_bytes"] > 0 for r in rows)


def test_main_writes_sane_json(bench, one_thread, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench.BENCH_PRESETS, "toy", toy_spec(bench))
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "toy", "--variants", "lt", "flt", "--diag-variants", "flt",
                       "--eager-variants", "flt", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "looped/unrolled" in printed and "targets:" in printed
    assert res["unrolled_blocks"] == 1 * 2
    assert [r["variant"] for r in res["steps"]] == ["lt", "flt", "unrolled"]
    for r in res["steps"]:
        assert r["step_s"]["n"] == 2 and r["step_s"]["median"] > 0
        assert 0 < r["mfu"]["median"] < 1
        assert r["fwd_bwd_s"]["median"] > 0
        if r["variant"] != "unrolled":
            assert math.isfinite(r["vs_unrolled"]["median"]) and r["vs_unrolled"]["median"] > 0
    flt = next(r for r in res["steps"] if r["variant"] == "flt")
    assert flt["diag_overhead"]["median"] > 0
    assert flt["compiled_vs_eager"]["median"] > 0 and "compiled vs eager" in printed  # (both eager on CPU)
    assert res["peak_flops"]["median"] > 0
    assert set(res["targets"]) == {"step_vs_unrolled", "diagnostics_overhead", "checkpoint_memory_ratio"}
    assert res["memory"]["ratio_checkpoint"]["loops"] == [3, 12]
    assert res["memory"]["ratio_plain"]["peak"] > res["memory"]["ratio_checkpoint"]["peak"]


def test_flops_mode_times_each_K_against_the_measured_peak(bench, one_thread, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench.BENCH_PRESETS, "toy", toy_spec(bench))
    out = tmp_path / "flops.json"
    assert bench.main(["--flops", "--preset", "toy", "--loops", "1", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "% of peak" in printed and "GFLOP/s" in printed
    res = json.loads(out.read_text())
    modes = ["eager", "compiled"] if bench.compile_modes("cpu") == [False, True] else ["eager"]
    assert [(r["loops"], r["mode"]) for r in res["rows"]] == [(k, m) for k in (1, 2) for m in modes]
    assert res["clock"] == "process CPU" and res["peak"]["peak"] >= res["peak"]["median"] > 0 and res["peak"]["dtype"] == "float32"
    cfg = ModelConfig(depth=1, width=32, heads=2, seq_len=16, vocab_size=256)
    for r in res["rows"]:
        flops = bench.train_flops(cfg, batch_size=4, loops=r["loops"])["total"]
        assert r["gflop_per_step"] == pytest.approx(flops / 1e9)
        assert r["gflops"] == pytest.approx(flops / r["step_s"] / 1e9)
        assert r["pct_of_peak"] == pytest.approx(100 * flops / r["step_s"] / res["peak"]["peak"])


def test_flops_of_a_finished_sweep_per_K(bench, one_thread, tmp_path, monkeypatch, capsys):
    """--sweep: step time = wall time / steps of each finished run (fake runs: 1 s for 80 steps),
    medians per K over the finished runs (two per K; fla K3 is still running)."""
    from fake_runs import STEPS, make_sweep
    from flt_diag.config.run_config import build_config
    monkeypatch.setitem(bench.BENCH_PRESETS, "toy", toy_spec(bench))
    sweep = make_sweep(tmp_path / "sweep")
    assert bench.main(["--flops", "--preset", "toy", "--sweep", str(sweep), "--out", str(tmp_path / "f.json")]) == 0
    res = json.loads((tmp_path / "f.json").read_text())
    assert [(r["loops"], r["runs"]) for r in res["rows"]] == [(3, 2), (6, 2)]
    for r in res["rows"]:
        cfg = build_config("tiny", model=dict(loops=r["loops"]))
        assert r["step_s"] == pytest.approx(1.0 / STEPS)
        assert r["gflop_per_step"] == pytest.approx(bench.train_flops(cfg.model, cfg.train.batch_size)["total"] / 1e9)
    assert "sweep" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_cuda_without_cuda_is_one_clear_line(bench, capsys):
    assert bench.main(["--device", "cuda", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "CUDA is not available" in err


def test_gpu_preset_at_toy_size_on_cpu(tmp_path):
    """`python benchmarks/bench.py --preset gpu --quick --toy` as a user runs it: the GPU preset's own
    code path (compiled blocks, diagnostics, compiled vs eager, memory with checkpointing) on a CPU,
    at tiny's shape."""
    import subprocess
    out = tmp_path / "toy.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--preset", "gpu", "--quick", "--toy", "--variants", "flt",
                           "--diag-variants", "flt", "--eager-variants", "flt", "--no-fwd-bwd", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["quick"] and res["toy"] and res["env"]["threads"] == 1 and res["device"] == "cpu"
    assert res["spec"]["compile"] is True and res["spec"]["base"] == "small"
    assert (res["model"]["width"], res["model"]["depth"], res["batch_size"]) == (64, 2, 4)
    flt = next(r for r in res["steps"] if r["variant"] == "flt")
    assert flt["compiled_vs_eager"]["median"] > 0 and flt["diag_overhead"]["median"] > 0
    assert "compiled vs eager" in proc.stdout and ("MET" in proc.stdout or "MISSED" in proc.stdout)


def test_breakdown_mode_splits_each_step_and_measures_its_floor_against_the_peak(bench, one_thread, tmp_path,
                                                                                   monkeypatch, capsys):
    monkeypatch.setitem(bench.BENCH_PRESETS, "toy", toy_spec(bench))
    out = tmp_path / "breakdown.json"
    assert bench.main(["--breakdown", "--preset", "toy", "--loops", "1", "2", "--out", str(out)]) == 0
    assert "step breakdown" in capsys.readouterr().out
    res = json.loads(out.read_text())
    modes = bench.compile_modes("cpu")
    assert [(r["loops"], r["compiled"]) for r in res["rows"]] == [(k, m) for k in (1, 2) for m in modes]
    cfg = ModelConfig(depth=1, width=32, heads=2, seq_len=16, vocab_size=256)
    for r in res["rows"]:
        floor_ms = 1e3 * bench.train_flops(cfg, batch_size=4, loops=r["loops"])["total"] / res["peak"]["peak"]
        assert r["floor_ms"] == pytest.approx(floor_ms) and r["pct_of_peak"] == pytest.approx(100 * floor_ms / r["step_ms"])
        assert r["matmul_ms"] > 0 and r["forward_ms"] > 0 and r["step_ms"] > r["forward_ms"]
        assert r["kernel_ceiling_pct"] == pytest.approx(100 * floor_ms / (r["matmul_ms"] + r["attention_ms"]))
        assert r["kernel_ceiling_pct"] > r["pct_of_peak"]  # the kernels are part of the step


def test_attention_micro_benchmark_times_each_form_against_the_peak(one_thread):
    """benchmarks/attention_cpu.py at a toy shape: every form agrees with SDPA (checked inside) and
    its share of the peak is its FLOPs (6 B T^2 d, the causal half) over its time."""
    spec = importlib.util.spec_from_file_location("flt_attention_cpu", BENCH.parent / "attention_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.measure(B=2, H=2, T=8, D=4, rounds=2, calls=2, compile=False)
    assert [r["form"] for r in rows] == ["sdpa (the model's)", "sdpa, math backend", "explicit, eager"]
    for r in rows:
        flops = 6 * 2 * 8 * 8 * (2 * 4)
        assert r["pct_of_peak"] == pytest.approx(100 * flops / (r["ms"] / 1e3) / (r["peak_gflops"] * 1e9))
        assert r["ms"] > 0


def test_compile_scope_benchmark_times_each_scope(bench, one_thread, monkeypatch):
    """benchmarks/compile_scope.py at a toy size with dynamo's eager backend (graph capture without code
    generation): every scope is timed."""
    spec_ = importlib.util.spec_from_file_location("flt_compile_scope", BENCH.parent / "compile_scope.py")
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    ms = mod.measure(toy_spec(bench), loops=2, rounds=1, backend="eager")
    assert list(ms) == list(mod.SCOPES) and all(v > 0 for v in ms.values())


def test_the_loop_dynamics_benchmark_runs_and_its_overhead_adds_up(tmp_path):
    """benchmarks/dynamics.py end to end at K = 2 (a config change once broke it unseen): its overhead at the
    defaults is the cheap step's ratio - 1, plus the exit loss's extra over its cadence E, plus the every-N call
    over N, from the ratios it reports."""
    import json
    import subprocess
    out = tmp_path / "d.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "dynamics.py"
    done = subprocess.run([sys.executable, str(script), "--loops", "2", "--repeats", "1", "--steps-per-sample", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["loops"] == 2 and r["step_off_ms"]["median"] > 0
    n, e = r["defaults"]["dynamics_every"], r["defaults"]["exit_loss_every"]
    cheap = r["cheap"]["cpu"]["median"]
    expected = cheap - 1 + (r["exit"]["cpu"]["median"] - cheap) / e + r["gain+agreement"]["cpu"]["median"] / n
    assert r["overhead_at_defaults_cpu"]["median"] == pytest.approx(expected, rel=1e-6, abs=1e-9)  # one round


def _probe_overhead():
    spec = importlib.util.spec_from_file_location("flt_probe_overhead", BENCH.parent / "probe_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv", [["--repeats", "1"], ["--width", "3"], ["--steps-per-sample", "0"],
                                  ["--out", "/nonexistent-folder/r.json"]])
def test_the_probe_overhead_benchmark_refuses_bad_input_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        _probe_overhead().main(argv)
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()[-1]) < 120


def test_the_probe_overhead_benchmark_reports_its_ablations_and_adds_up(tmp_path, one_thread):
    """benchmarks/probe_overhead.py --ablate at a toy width: one paired ratio per arm of ABLATIONS, and the overhead
    at the defaults is the watched ratio - 1 plus the every-500 record over 500 plain steps."""
    mod = _probe_overhead()
    out = tmp_path / "r.json"
    assert mod.main(["--repeats", "2", "--steps-per-sample", "1", "--width", "16", "--ablate", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["ablations"]) == list(mod.ABLATIONS)
    assert all(math.isfinite(a["median"]) and a["median"] > 0 and a["n"] == 2 for a in r["ablations"].values())
    want = r["cpu_ratio"]["median"] - 1 + r["every_500_record_s"] / r["plain_step_s"] / 500
    assert r["overhead_at_defaults"] == pytest.approx(want)


def _probe_profile():
    spec = importlib.util.spec_from_file_location("flt_probe_profile", BENCH.parent / "probe_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_probe_profile_counts_only_the_timed_samples_and_splits_flt_diags_share(tmp_path, capsys):
    """benchmarks/probe_profile.py --read on a hand-written py-spy raw file: samples outside timed_steps are not
    counted; the flt_diag share and its pieces are the counts added by hand."""
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "0x1 (libc.so.6);<module> (probe_profile.py:9);run (probe_profile.py:50);Arm.step (x.py:1);mm 40\n"  # warm-up
        "0x1 (libc.so.6);timed_steps (probe_profile.py:30);Arm.step (x.py:1);addmm 60\n"
        "0x1 (libc.so.6);timed_steps (probe_profile.py:30);LoopProbe.step (/a/flt_diag/probe/loop_probe.py:9);"
        "LoopProbe.after_backward (/a/flt_diag/probe/loop_probe.py:20);pair_sums (/a/flt_diag/x.py:3);mul 15\n"
        "0x1 (libc.so.6);timed_steps (probe_profile.py:30);LoopProbe.step (/a/flt_diag/probe/loop_probe.py:9);"
        "LoopProbe.after_backward (/a/flt_diag/probe/loop_probe.py:22);sum 5\n"
        "0x1 (libc.so.6);timed_steps (probe_profile.py:30);hook (/a/flt_diag/instruments/loop_hooks.py:5);norm 20\n"
        "\n")
    mod = _probe_profile()
    with raw.open() as f:
        total, ours, pieces = mod.shares(f, depth=2)
    assert (total, ours) == (100, 40)
    assert pieces == {"LoopProbe.step > LoopProbe.after_backward": 20, "hook": 20}
    with raw.open() as f:
        assert mod.shares(f, depth=1)[2] == {"LoopProbe.step": 20, "hook": 20}
    assert mod.main(["--read", str(raw)]) == 0
    assert "40 (40.0 %, an overhead of +66.7 %" in capsys.readouterr().out


@pytest.mark.parametrize("content", [None, "0x1 (libc.so.6);run (p.py:1);mm 5\n"])
def test_the_probe_profile_refuses_a_missing_or_foreign_file(tmp_path, content, capsys):
    raw = tmp_path / "raw.txt"
    if content is not None:
        raw.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        _probe_profile().main(["--read", str(raw)])
    assert exit_.value.code == 2 and "--read:" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_probe_profile_runs_the_watched_arm_inside_timed_steps(monkeypatch, one_thread):
    """The workload py-spy samples: the watched Huginn model's steps, the timed ones inside timed_steps (the frame
    --read counts), two warm-up steps before them."""
    mod = _probe_profile()
    timed = []
    real = mod.timed_steps
    monkeypatch.setattr(mod, "timed_steps", lambda arm, steps: (timed.append((arm.i, steps)), real(arm, steps)))
    assert mod.main(["--steps", "2"]) == 0
    assert timed == [(2, 2)]
