"""The llm-kernels command: probe and a quick bench run on whatever device is here."""

import json
import os

import pytest
from typer.testing import CliRunner

from llm_kernels import bench
from llm_kernels.cli import app

runner = CliRunner()


def test_probe_json_reports_versions_and_device():
    result = runner.invoke(app, ["probe", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["llmk_gpu_backend"] in ("cuda", "hip", "off")
    assert isinstance(info["llmk_gpu_targets"], list)
    assert "torch" in info and "device" in info
    if not info["device"].startswith("cpu"):
        assert info["programmatic_dependent_launch"].startswith(("on", "off"))
        assert info["sdpa_drop_in_fp16"] == "ours" or info["sdpa_drop_in_fp16"].startswith("PyTorch's SDPA: ")


def test_probe_names_who_runs_sdpa(monkeypatch):
    from llm_kernels import flash
    from llm_kernels.probe import sdpa_drop_in_choice

    assert sdpa_drop_in_choice("cpu") == "PyTorch's SDPA: CPU tensors (llm_kernels.flash.use_on_cpu is off)"
    monkeypatch.setattr(flash, "use_on_cpu", True)
    assert sdpa_drop_in_choice("cpu") == "ours"


def test_probe_pdl_state_follows_the_library_rule():
    from llm_kernels.probe import pdl_state

    assert pdl_state("cuda", (9, 0), None).startswith("on")
    assert pdl_state("cuda", (10, 0), "").startswith("on")  # empty: unset
    assert pdl_state("cuda", (9, 0), "1").startswith("on")
    assert pdl_state("cuda", (9, 0), "0") == "off (LLMK_PDL=0)"
    assert pdl_state("cuda", (8, 9), None) == "off (needs compute capability 9.0+)"
    assert pdl_state("hip", None, None) == "off (NVIDIA only)"
    assert pdl_state("off", (9, 0), None) == "off (no GPU backend)"


def test_build_targets_follow_the_backend():
    from llm_kernels._library import gpu_backend, gpu_targets

    targets = gpu_targets()
    assert (targets == []) == (gpu_backend() == "off")
    if gpu_backend() == "cuda":
        assert all(t[:2].isdigit() for t in targets), targets
    if gpu_backend() == "hip":
        assert all(t.startswith("gfx") for t in targets), targets


def test_probe_says_whether_the_build_runs_on_a_gpu():
    from llm_kernels.probe import code_for_device

    # AMD: only the exact processor; the feature suffix of gcnArchName does not matter
    assert code_for_device("hip", ["gfx90a", "gfx942"], "gfx942:sramecc+:xnack-") == "yes (gfx942 code)"
    no = code_for_device("hip", ["gfx90a", "gfx940", "gfx1030"], "gfx942:sramecc+:xnack-")
    assert no.startswith("NO") and "-DLLMK_HIP_ARCHITECTURES=gfx942" in no
    # NVIDIA: code of the same major at a lower minor runs; "a" targets only on their own arch
    assert code_for_device("cuda", ["80", "90a"], "sm_90") == "yes (sm_90a code)"
    assert code_for_device("cuda", ["80", "90a"], "sm_86") == "yes (sm_80 code)"
    assert code_for_device("cuda", ["80", "90a"], "sm_80") == "yes (sm_80 code)"
    assert code_for_device("cuda", ["80", "90a"], "sm_100").startswith("through PTX: compute_80")
    assert code_for_device("cuda", ["90a"], "sm_100").startswith("NO")  # compute_90a PTX is sm_90 only
    assert code_for_device("cuda", ["80-real", "90a"], "sm_100").startswith("NO")
    assert code_for_device("cuda", ["80", "90a"], "sm_75").startswith("NO")
    assert code_for_device("cuda", ["native"], "sm_90").startswith("unknown")
    assert code_for_device("off", [], "sm_90").startswith("no GPU code")


def test_bench_quick_writes_records(tmp_path):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    result = runner.invoke(
        app, ["bench", "--quick", "--op", "rms_norm", "--dtype", "bf16", "--json", str(out_json), "--md", str(out_md)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    recs = data["records"]
    assert {r["impl"] for r in recs} == {"llm_kernels", "eager (HF LlamaRMSNorm)", "F.rms_norm", "torch.compile", bench.SAME_BYTES_COPY}
    assert {r["shape"] for r in recs} == {f"{r}x{c}" for r, c in bench.QUICK_SHAPES}
    assert all(r["median_ms"] > 0 and r["gbps"] > 0 for r in recs)
    assert data["meta"]["copy_gbps"] > 0
    assert "### rms_norm" in out_md.read_text()


def test_bench_activation_ops(tmp_path):
    out_json = tmp_path / "a.json"
    result = runner.invoke(app, ["bench", "--quick", "--op", "swiglu", "--op", "geglu_tanh", "--dtype", "bf16",
                                 "--no-peers", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    recs = json.loads(out_json.read_text())["records"]
    assert {r["op"] for r in recs} == {"swiglu", "geglu_tanh"}
    assert {r["shape"] for r in recs} == {f"{r}x{c}" for r, c in bench.ACT_QUICK}


def test_bench_rejects_unknown_op():
    result = runner.invoke(app, ["bench", "--op", "nope"])
    assert result.exit_code != 0
    assert "unknown op" in result.output


def test_bench_attention_quick_writes_records(tmp_path):
    out_json, out_md = tmp_path / "a.json", tmp_path / "a.md"
    result = runner.invoke(app, ["bench-attention", "--quick", "--dtype", "fp16", "--json", str(out_json), "--md", str(out_md)])
    assert result.exit_code == 0, result.output
    recs = json.loads(out_json.read_text())["records"]
    ours = [r for r in recs if r["impl"] == "llm_kernels"]
    assert ours and all(r["tflops"] > 0 and r["max_abs_vs_sdpa"] < 1e-2 for r in ours)
    assert any(r["impl"].startswith("sdpa") for r in recs)  # math on the CPU; efficient/flash/cudnn on the GPU
    gpu = json.loads(out_json.read_text())["meta"].get("gpu")
    assert not gpu or any(r["impl"] == "llm_kernels (v2)" for r in recs)
    if not gpu:  # the CPU kernel runs fp32, beside PyTorch's math backend and its CPU flash one
        assert {r["dtype"] for r in recs} == {"fp32"}
        assert {"sdpa math", "sdpa flash"} <= {r["impl"] for r in recs}
    assert "TFLOP/s" in out_md.read_text()
    assert "median of 2 rounds" in out_md.read_text()  # the default


def test_bench_decode_quick_writes_records(tmp_path):
    """bench-decode --quick: decode attention (contiguous and paged) and the skinny GEMM beside
    their PyTorch peers, every time positive, in JSON and Markdown."""
    out_json, out_md = tmp_path / "d.json", tmp_path / "d.md"
    result = runner.invoke(app, ["bench-decode", "--quick", "--json", str(out_json), "--md", str(out_md)])
    assert result.exit_code == 0, result.output
    recs = json.loads(out_json.read_text())["records"]
    assert {"decode_attention", "skinny_gemm"} <= {r["op"] for r in recs}
    assert {"llm_kernels contiguous", "llm_kernels paged16"} <= {r["impl"] for r in recs if r["op"] == "decode_attention"}
    assert {"llm_kernels", "F.linear"} <= {r["impl"] for r in recs if r["op"] == "skinny_gemm"}
    assert all(r["median_us"] > 0 for r in recs)
    assert "### skinny_gemm" in out_md.read_text()
    # --part gemm: the skinny GEMM table alone; an unknown part is refused
    result = runner.invoke(app, ["bench-decode", "--quick", "--part", "gemm", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    assert {r["op"] for r in json.loads(out_json.read_text())["records"]} == {"skinny_gemm"}
    result = runner.invoke(app, ["bench-decode", "--quick", "--part", "nope"])
    assert result.exit_code != 0 and "unknown part" in result.output


def test_bench_attention_rounds_option(tmp_path):
    out_json = tmp_path / "a.json"
    result = runner.invoke(app, ["bench-attention", "--quick", "--dtype", "fp16", "--rounds", "1", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    assert json.loads(out_json.read_text())["meta"]["rounds"] == 1
    result = runner.invoke(app, ["bench-attention", "--quick", "--rounds", "0"])
    assert result.exit_code != 0


def test_rotated_medians_visits_in_alternating_order():
    calls = []

    def measure(i):
        def fn():
            calls.append(i)
            return float(10 * i + len(calls))  # later calls take longer: the order shows in the medians
        return fn

    medians = bench.rotated_medians([measure(i) for i in range(3)], rounds=4)
    # rounds: 0 1 2 / 2 1 0 / 1 2 0 / 0 2 1 (each pair of rounds rotated by one more)
    assert calls == [0, 1, 2, 2, 1, 0, 1, 2, 0, 0, 2, 1]
    assert medians == [(6 + 9) / 2, 10 + (5 + 7) / 2, 20 + (4 + 8) / 2]
    assert bench.rotated_medians([measure(0)], rounds=1) == [13.0]
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        bench.rotated_medians([measure(0)], rounds=0)


def test_envs_sets_and_restores_several_variables(monkeypatch):
    monkeypatch.setenv("LLMK_TEST_A", "old")
    monkeypatch.delenv("LLMK_TEST_B", raising=False)
    with bench.envs({"LLMK_TEST_A": None, "LLMK_TEST_B": "1"}):
        assert "LLMK_TEST_A" not in os.environ and os.environ["LLMK_TEST_B"] == "1"
    assert os.environ["LLMK_TEST_A"] == "old" and "LLMK_TEST_B" not in os.environ


def test_timed_in_env_sets_the_variables_around_the_timing_only(monkeypatch):
    monkeypatch.delenv("LLMK_TEST_A", raising=False)
    seen = []
    measure = bench.timed_in_env(lambda fn: (fn(), 2.5)[1], lambda: seen.append(os.environ.get("LLMK_TEST_A")),
                                 {"LLMK_TEST_A": "1"})
    assert "LLMK_TEST_A" not in os.environ  # nothing set before the call
    assert measure() == 2.5 and seen == ["1"]
    assert "LLMK_TEST_A" not in os.environ
