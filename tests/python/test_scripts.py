"""Smoke tests of the profiling helpers in scripts/ (they run on the GPU machine, so a broken one
would cost device time): the Monarch Nsight Compute driver on the CPU, and the stall summary on a
small report in the layout of `ncu --page source --csv --print-source sass`; and that the device
steps files (scripts/steps) name scripts and options that exist."""
import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ncu_monarch_once_runs_on_cpu():
    out = run(str(SCRIPTS / "ncu_monarch_once.py"), "--device", "cpu", "--row", "96x4x5", "--calls", "2")
    assert "2 calls of monarch_matmul(5, 96) -> (5, 96) torch.float32 on cpu" in out


def test_ncu_stalls_sums_reasons_and_ranks_instructions(tmp_path):
    report = tmp_path / "report.csv"
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_wait", "stall_long_sb (Not Issued)"]
    rows = [["0x7f00", "IMAD R1, R2, R3, RZ", "10", "64", "0", "10", "0"],
            ["0x7f10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R4], R5", "0", "64", "0", "0", "0"],
            ["0x7f20", "@P0 BRA 0x7f40", "30", "64", "30", "0", "30"]]
    with open(report, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])  # the line ncu writes above the header
        w.writerow(head)
        w.writerows(rows)
    out = run(str(SCRIPTS / "ncu_stalls.py"), str(report), "--top", "2")
    assert "3 instructions, 40 warp-stall samples" in out
    assert "by reason: long_sb 75.0%, wait 25.0%" in out  # the Not Issued column is not counted again
    ranked = [line for line in out.splitlines() if line.startswith("7f")]
    assert [line.split()[0] for line in ranked] == ["7f20", "7f00"]
    assert "75.0%" in ranked[0] and "@P0 BRA" in ranked[0]
    around = run(str(SCRIPTS / "ncu_stalls.py"), str(report), "--around", "7f10", "--lines", "1")
    assert [line.split()[0] for line in around.splitlines()[2:]] == ["7f00", "7f10", "7f20"]


def test_gpu_ab_builds_the_base_and_runs_both_variants(tmp_path):
    """scripts/gpu_ab.sh in a throwaway repo with a stand-in cmake: --prepare records the base
    version of a changed file, the run builds the old tree with it (and without a file added since),
    and the command runs for both variants with their own Python package (the old one with the base
    Python sources: new Python may pass arguments that the old library does not take)."""
    import os
    import shutil
    import tarfile

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "python" / "llm_kernels").mkdir(parents=True)
    shutil.copy(SCRIPTS / "gpu_ab.sh", repo / "scripts")
    (repo / "python" / "llm_kernels" / "__init__.py").write_text("")
    (repo / "kernel.cu").write_text("old\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(git + cmd, check=True)
    (repo / "kernel.cu").write_text("new\n")
    (repo / "python" / "llm_kernels" / "__init__.py").write_text("NEW = 1\n")
    (repo / "added.cu").write_text("added\n")
    subprocess.run(git + ["add", "added.cu"], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(  # records what each tree's kernel.cu held when it was "built"
        '#!/bin/bash\nif [ "$1" = --build ]; then mkdir -p "$2/src/torch"; '
        'touch "$2/libllmk.so" "$2/src/torch/libllmk_torch.so"; cat kernel.cu > "$2/built_from"; '
        '[ -f added.cu ] && echo has-added >> "$2/built_from"; fi; exit 0\n')
    (bin_dir / "cmake").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    script = str(repo / "scripts" / "gpu_ab.sh")
    prep = subprocess.run(["bash", script, "--prepare"], capture_output=True, text=True, env=env, timeout=60)
    assert prep.returncode == 0, prep.stderr
    assert (repo / ".ab-base" / "kernel.cu").read_text() == "old\n"
    done = subprocess.run(["bash", script, "--rounds", "1", "--", "sh", "-c", 'echo "$AB_VARIANT $PYTHONPATH"'],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (repo / "build" / "gpu" / "built_from").read_text() == "new\nhas-added\n"
    assert open("/tmp/llmk-ab-old/build/built_from").read() == "old\n"
    with tarfile.open(tmp_path / "out" / "ab.tar.gz") as tar:
        logs = {m.name.lstrip("./"): tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert logs["round1_new.log"].split() == ["new", "/tmp/llmk-ab-py-new"]
    assert logs["round1_old.log"].split() == ["old", "/tmp/llmk-ab-py-old"]
    assert open("/tmp/llmk-ab-py-new/llm_kernels/__init__.py").read() == "NEW = 1\n"
    assert open("/tmp/llmk-ab-py-old/llm_kernels/__init__.py").read() == ""
    assert "done, status 0" in logs["summary.txt"]
    bad = subprocess.run(["bash", script, "--bogus"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2


def _gpu_check_sandbox(tmp_path, llmk_tests="exit 0", bins=None, python="exit 0"):
    """A copy of scripts/gpu_check.sh in tmp_path/repo and stand-ins on PATH: cmake (its --build
    makes the libraries and a build/gpu/llmk_tests running the bash `llmk_tests`), the Python front
    (`python`, bash) and any of `bins` (name: bash script). Returns (repo, env)."""
    import os
    import shutil

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPTS / "gpu_check.sh", repo / "scripts")
    (repo / "python" / "llm_kernels").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tests_script = f"#!/bin/bash\n{llmk_tests}\n"
    scripts = {"cmake": '#!/bin/bash\nif [ "$1" = --build ]; then mkdir -p "$2/src/torch"; '
                        'touch "$2/libllmk.so" "$2/src/torch/libllmk_torch.so"; '
                        f'cat > "$2/llmk_tests" <<\'EOF\'\n{tests_script}EOF\nchmod +x "$2/llmk_tests"; fi; exit 0\n',
               "fakepy": f"#!/bin/bash\n{python}\n", **(bins or {})}
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               PYTHON=str(bin_dir / "fakepy"))
    return repo, env


def _run_gpu_check(repo, env, *flags, timeout=120):
    """gpu_check.sh with `flags`; (the finished process, its logs by name, summary.txt)."""
    import tarfile

    done = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), *flags], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    out = Path(env["OUT"])
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {m.name.lstrip("./"): tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    return done, logs, (out / "summary.txt").read_text()


def test_gpu_check_runs_and_logs_extra_steps(tmp_path):
    """scripts/gpu_check.sh --fast with every test step off and LLMK_STEPS (stand-in cmake and
    Python): each listed step runs with PYTHONPATH set, its log lands in logs.tar.gz, a failing
    step fails the run, comments and blank lines are skipped, and a step's stdin is not the list
    (a command that reads stdin must not eat the steps after it)."""
    repo, env = _gpu_check_sandbox(tmp_path)
    steps = tmp_path / "steps.txt"
    steps.write_text("# a comment\n\nfirst: echo one $PYTHONPATH; cat\nsecond one: echo two; exit 3\n"
                     "third: echo three\n")
    env["LLMK_STEPS"] = str(steps)
    done, logs, summary = _run_gpu_check(repo, env, "--fast", "--no-cpp", "--no-pytest", "--no-bench", "--no-sanitizer")
    assert done.returncode == 1, done.stdout + done.stderr  # the second step failed
    word, path = logs["step_first.log"].split()
    assert word == "one" and path.split(":")[0] == f"{repo}/python"
    assert logs["step_second_one.log"].strip() == "two"
    assert logs["step_third.log"].strip() == "three"
    assert "step_second_one: FAILED (rc 3)" in summary and "step_third: ok" in summary
    assert "comment" not in summary


@pytest.mark.parametrize("gtest_filter", ["", "*Gemm*"])
def test_gpu_check_runs_the_persistent_attention_step_with_the_whole_suite_only(tmp_path, gtest_filter):
    """scripts/gpu_check.sh (stand-in cmake, test binary and Python): the C++ tests run with
    LLMK_GTEST_FILTER, and the persistent-attention step (LLMK_ATTENTION_PERSISTENT=1) only when no
    filter narrows the call."""
    record = tmp_path / "calls.txt"
    repo, env = _gpu_check_sandbox(tmp_path, llmk_tests=f'echo "${{LLMK_ATTENTION_PERSISTENT:-0}} $*" >> {record}')
    env["LLMK_GTEST_FILTER"] = gtest_filter
    done, _, _ = _run_gpu_check(repo, env, "--fast", "--no-pytest", "--no-bench", "--no-sanitizer")
    assert done.returncode == 0, done.stdout + done.stderr
    calls = record.read_text().splitlines()
    assert calls[0] == f"0 --gtest_brief=1 --gtest_filter={gtest_filter or '*'}"
    if gtest_filter:
        assert calls == calls[:1]
    else:
        assert calls[1:] == ["1 --gtest_brief=1 --gtest_filter=*ttention*:*Grid*:*Hopper*"]


@pytest.mark.parametrize("fail,jobs,broken,gpu_skip", [(False, 2, False, False), (True, 2, False, False),
                                                       (False, 9, False, False), (False, 2, True, False),
                                                       (False, 2, False, True)])
def test_gpu_check_runs_the_python_memcheck_in_shares(tmp_path, fail, jobs, broken, gpu_skip):
    """scripts/gpu_check.sh's Python memcheck with LLMK_MEMCHECK_PY_JOBS (stand-in cmake, Python
    front and compute-sanitizer; the real pytest): the tests its -k selects are dealt into that many
    sanitized processes (at most one a test) without the caching allocator, each logged, every
    selected test runs once (a collection warning whose text has "::" is no test), a failing test in
    any share fails the step, and so does a test module that fails to import or a test skipped for
    want of a GPU (pytest's -rs summary, as the plain pytest step checks)."""
    sanitizer = ('#!/bin/bash\necho "sanitized ${PYTORCH_NO_CUDA_MEMORY_CACHING:-caching}"\n'
                 'while [ "${1#--}" != "$1" ]; do shift 2; done\nexec "$@"\n')
    repo, env = _gpu_check_sandbox(tmp_path, bins={"compute-sanitizer": sanitizer},
                                   python=f'[ "$1 $2" = "-m llm_kernels.cli" ] && exit 0\nexec {sys.executable} "$@"')
    (repo / "tests" / "python").mkdir(parents=True)
    (repo / "tests" / "python" / "test_fake.py").write_text(
        "import os\nimport warnings\nimport pytest\n\nwarnings.warn('aten::fake is deprecated')\n\n\n"
        "@pytest.mark.parametrize('i', range(5))\n"
        "def test_on_cuda(i):\n    assert os.environ['PYTORCH_NO_CUDA_MEMORY_CACHING'] == '1'\n"
        "    assert os.environ['LLMK_MEMCHECK'] == '1'\n"
        "    assert not (i == 3 and os.environ.get('FAKE_FAIL'))\n"
        "    if i == 2 and os.environ.get('FAKE_GPU_SKIP'):\n        pytest.skip('no GPU on this machine')\n"
        "\n\ndef test_cpu_only():\n    pass\n")
    if broken:
        (repo / "tests" / "python" / "test_broken.py").write_text("import no_such_module_here\n")
    env.update(LLMK_MEMCHECK_PY_JOBS=str(jobs), LLMK_MEMCHECK_PY_K="cuda")
    env.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    env.pop("LLMK_MEMCHECK", None)
    if fail:
        env["FAKE_FAIL"] = "1"
    if gpu_skip:
        env["FAKE_GPU_SKIP"] = "1"
    done, logs, summary = _run_gpu_check(repo, env, "--fast", "--no-cpp", "--no-pytest", "--no-bench", timeout=300)
    assert done.returncode == (1 if fail or broken or gpu_skip else 0), done.stdout + done.stderr
    if gpu_skip:
        assert "GPU tests SKIPPED" in logs["memcheck_py.log"] and "memcheck_py: FAILED (rc 1)" in summary
        return
    if broken:
        assert "memcheck_py: collection failed (pytest rc 2)" in logs["memcheck_py.log"]
        assert "memcheck_py: FAILED (rc 1)" in summary and "memcheck_py.0.log" not in logs
        return
    assert "aten::fake" in logs["memcheck_py.collect.log"]  # the warning was printed, and is not a test
    shares = [text for name, text in logs.items() if re.fullmatch(r"memcheck_py\.\d+\.log", name)]
    assert len(shares) == min(jobs, 5) and all(s.startswith("sanitized 1") for s in shares)
    ran = sorted(line.split()[0] for s in shares for line in s.splitlines() if " PASSED" in line or " FAILED" in line)
    assert ran == [f"tests/python/test_fake.py::test_on_cuda[{i}]" for i in range(5)]
    assert f"memcheck_py: 5 tests in {min(jobs, 5)} share(s)" in logs["memcheck_py.log"]
    assert ("memcheck_py: FAILED (rc 1)" if fail else "memcheck_py: ok") in summary


def test_decode_cluster_bisect_runs_its_chains_on_cpu():
    out = run(str(SCRIPTS / "decode_cluster_bisect.py"), "--device", "cpu", "--layers", "2", "--context", "40",
              "--chains", "attn,rope_kv+attn,layer")
    assert out.splitlines() == ["attn: ran once on cpu", "rope_kv+attn: ran once on cpu",
                                "qkv+rope_kv+attn+o+mlp: ran once on cpu"]
    bad = subprocess.run([sys.executable, str(SCRIPTS / "decode_cluster_bisect.py"), "--device", "cpu",
                          "--chains", "attn+bogus"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "unknown stage(s) ['bogus']" in bad.stderr


def test_e2e_ab_alternates_settings_on_cpu(tmp_path):
    """scripts/e2e_ab.py on the CPU's tiny config: one fresh e2e process per setting, a table row each."""
    out = run(str(SCRIPTS / "e2e_ab.py"), "--configs", "tiny", "--rounds", "1", "--out", str(tmp_path),
              "--e2e-args", "--prefill-len 8 --context 8 --iters 1 --steps 2 --budget-s 300",
              "--", "default", "LLMK_FUSE_MLP_NORM=0")
    table = (tmp_path / "e2e_ab.md").read_text()
    assert "| tiny | `default` | " in table and "| tiny | `LLMK_FUSE_MLP_NORM=0` | " in table
    assert "failed" not in table and "no decode record" not in table
    assert (tmp_path / "e2e_ab.tar.gz").stat().st_size > 0
    assert out.count("tok/s") >= 2


def test_e2e_ab_reports_the_batch_it_asks_for(tmp_path):
    """--batch B runs e2e at batch B and reports that record (B x batch 1's roof); a --batch inside
    --e2e-args, which e2e would take as a second batch size, is refused."""
    out = run(str(SCRIPTS / "e2e_ab.py"), "--configs", "tiny", "--rounds", "1", "--out", str(tmp_path), "--batch", "2",
              "--e2e-args", "--prefill-len 8 --context 8 --iters 1 --steps 2 --budget-s 300", "--", "default")
    table = (tmp_path / "e2e_ab.md").read_text()
    assert table.startswith("Decode tok/s at batch 2,") and "--batch 2 --no-compile" in table
    assert "| tiny | `default` | " in table and "no decode record" not in table and "failed" not in table
    assert out.count("tok/s") >= 1
    bad = subprocess.run([sys.executable, str(SCRIPTS / "e2e_ab.py"), "--configs", "tiny", "--out", str(tmp_path),
                          "--e2e-args", "--batch 4 --steps 2", "--", "default"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "not inside --e2e-args" in bad.stderr


def test_e2e_ab_flags_runs_without_a_cuda_graph():
    """A run whose graph capture failed times eager steps; e2e_ab reads that from the record and says
    so instead of reporting it as the setting's speed alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_ab", SCRIPTS / "e2e_ab.py")
    e2e_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e_ab)

    def result(**rec):
        base = dict(metric="decode", batch=1, status="ok", tok_s=1234.5, cuda_graph=True, note="")
        return {"records": [dict(metric="prefill", batch=1, status="ok", tok_s=9.0), {**base, **rec}]}

    assert e2e_ab.decode_cell(result()) == (1234.5, "")
    assert e2e_ab.decode_cell(result(cuda_graph=None)) == (1234.5, "")  # the CPU: no graphs to ask for
    cell, flag = e2e_ab.decode_cell(result(cuda_graph=False, note="CUDA graph capture failed (RuntimeError: x)"))
    assert cell == 1234.5 and flag == "no CUDA graph: CUDA graph capture failed (RuntimeError: x)"
    assert e2e_ab.decode_cell(result(status="error")) == ("no decode record", "")
    assert e2e_ab.decode_cell(result(batch=32)) == ("no decode record", "")
    assert e2e_ab.decode_cell(result(batch=4), batch=4) == (1234.5, "")


def test_e2e_ab_apply_in_process(monkeypatch):
    """The in-process settings of profile_step_sequence.py and tma_neighbour_times.py: each starts
    from the given environment (variables of the setting before it gone, changed ones restored), a
    bare value is LLMK_GEMM_KERNEL's, and a malformed pair is an error."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("e2e_ab", SCRIPTS / "e2e_ab.py")
    e2e_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e_ab)
    monkeypatch.delenv("LLMK_GEMM_KERNEL", raising=False)
    monkeypatch.delenv("LLMK_TEST_A", raising=False)
    monkeypatch.setenv("LLMK_TEST_B", "start")
    base = dict(os.environ)
    e2e_ab.apply_in_process("tma@4096x28672", base)
    assert os.environ["LLMK_GEMM_KERNEL"] == "tma@4096x28672" and os.environ["LLMK_TEST_B"] == "start"
    e2e_ab.apply_in_process("LLMK_TEST_A=1,LLMK_TEST_B=2", base)
    assert "LLMK_GEMM_KERNEL" not in os.environ
    assert os.environ["LLMK_TEST_A"] == "1" and os.environ["LLMK_TEST_B"] == "2"
    e2e_ab.apply_in_process("default", base)
    assert "LLMK_TEST_A" not in os.environ and os.environ["LLMK_TEST_B"] == "start"
    with pytest.raises(SystemExit, match="bad setting"):
        e2e_ab.apply_in_process("LLMK_TEST_A=1,oops", base)
    # the kernel names the step-listing scripts print keep the kernel's namespace and template
    assert e2e_ab.kernel_name("void llmk::detail::(anonymous namespace)::gemm_tma_kernel<__nv_bfloat16, 1, 1>"
                              "(llmk::detail::GemmParams, long)") == "llmk::detail::gemm_tma_kernel<__nv_bfloat16, 1, 1>"


def test_profile_step_sequence_dry_run_on_cpu():
    """scripts/profile_step_sequence.py on the CPU's tiny config (its ops instead of GPU kernels):
    one column per setting, the launch counts and the totals by name of each."""
    out = run(str(SCRIPTS / "profile_step_sequence.py"), "--config", "tiny", "--device", "cpu", "--all",
              "--", "default", "LLMK_TEST_UNUSED=1")
    assert "launches per step: default: " in out and "LLMK_TEST_UNUSED=1: " in out
    assert re.search(r"^\s+\d+\s+[\d.]+\s+[\d.]+\s+\S", out, re.M), out[-2000:]
    assert out.count("us per step") == 1 and "llm_kernels::rms_norm" in out


@pytest.mark.parametrize("masked", [[], ["--masked-capacity", "13"]], ids=["exact", "masked"])
def test_layer_chain_graph_dry_run_on_cpu(masked):
    """scripts/layer_chain_graph.py's calls (the fused q/k/v, attention, o, the separate norm, gate/up,
    down) at small odd-headed shapes on the CPU, the attention over exact lengths or over a larger
    cache with a mask (kernelize's static cache): every role runs and the output stays finite."""
    out = run(str(SCRIPTS / "layer_chain_graph.py"), "--device", "cpu", "--layers", "2", "--hidden", "96",
              "--inter", "80", "--heads", "6", "--kv-heads", "2", "--context", "7", "--attention",
              "--separate-mlp-norm", *masked)
    assert "roles qkv, attention, o, mlp_norm, gate_up, down; output (1, 96), finite True" in out, out[-2000:]


# ---------------------------------------------------------------- scripts/steps/*.txt (LLMK_STEPS)
def _cli_help(sub: str) -> str:
    from typer.testing import CliRunner

    from llm_kernels.cli import app

    done = CliRunner().invoke(app, [sub, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert done.exit_code == 0, f"llm-kernels {sub}: {done.output}"
    return done.output


def _has_option(text: str, option: str) -> bool:
    import re

    return re.search(r"(?<![\w-])" + re.escape(option) + r"(?![\w-])", text) is not None


def _check_step_command(command: str, where: str) -> int:
    """Checks one command of a steps line: the scripts and test files it names exist and the options
    it passes are ones the script or the CLI subcommand defines. Returns how many it checked."""
    import shlex

    root = SCRIPTS.parent
    checked = 0
    for part in command.split("&&"):
        words = shlex.split(part)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]  # NAME=VALUE prefixes
        if not words or words[0] != "python3":
            continue
        args = words[1:]
        if args[:2] == ["-m", "llm_kernels.cli"]:
            sub, opts = args[2], [a for a in args[3:] if a.startswith("--")]
            text = _cli_help(sub)
        elif args[:2] == ["-m", "pytest"]:
            for a in args[2:]:
                if a.endswith(".py"):
                    assert (root / a).is_file(), f"{where}: no {a}"
            checked += 1
            continue
        else:
            script = root / args[0]
            assert script.is_file(), f"{where}: no {args[0]}"
            text = script.read_text()
            opts = [a for a in args[1:] if a.startswith("--") and a != "--" and " " not in a]  # (not --e2e-args' value)
            if "--e2e-args" in args:  # e2e_ab.py hands these to `llm-kernels e2e`
                inner = shlex.split(args[args.index("--e2e-args") + 1])
                e2e = _cli_help("e2e")
                for o in (a for a in inner if a.startswith("--")):
                    assert _has_option(e2e, o), f"{where}: `llm-kernels e2e` has no option {o}"
        for o in opts:
            assert _has_option(text, o), f"{where}: {args[0] if args[0] != '-m' else args[2]} has no option {o}"
        checked += 1
    return checked


def test_steps_files_name_scripts_and_options_that_exist():
    """Each line of scripts/steps/*.txt is `name: command`, and its Python commands name scripts,
    test files, CLI subcommands and options that exist: a typo there costs a device call."""
    files = sorted((SCRIPTS / "steps").glob("*.txt"))
    assert files
    checked = 0
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            name, sep, command = line.partition(":")
            assert sep and name and all(c.isalnum() or c in "_.-" for c in name), f"{f.name}:{n}: not `name: command`"
            checked += _check_step_command(command, f"{f.name}:{n}")
    assert checked >= 8


def test_memcheck_selection_takes_every_gpu_only_test():
    """gpu_check.sh's Python memcheck selects `-k llmk_gpu`, the marker conftest.py gives every
    test that needs a GPU: cuda-parametrized ones and GPU-only tests without "cuda" in their ids
    (these were left out while the selection was `-k cuda`); CPU cases stay out."""
    tests = Path(__file__).resolve().parent
    out = run("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(tests / "test_decode.py"),
              str(tests / "test_pdl.py"), "-k", "llmk_gpu")
    ids = {line.strip() for line in out.splitlines() if "::" in line}
    names = {i.split("::")[1].split("[")[0] for i in ids}
    assert "test_decode_attn_mask_prefetch_matches_float64" in names  # GPU-only, no "cuda" in its ids
    assert "test_pdl_is_the_default_on_hopper" in names  # a Hopper-only skip reason that names the GPU
    assert any(i.endswith("test_decode_attn_mask_bad_input[cuda]") for i in ids)
    assert not any(i.endswith("[cpu]") or "-cpu-" in i or "[cpu-" in i or "-cpu]" in i for i in ids), ids
