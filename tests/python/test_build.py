"""The CMake configure step's choice of AMD targets (cmake/hip_targets.cmake): a HIP code object
runs only on the processor it was built for, so without LLMK_HIP_ARCHITECTURES the build must take
PYTORCH_ROCM_ARCH, else the machine's GPUs, else the default targets its hipcc can compile. Runs
cmake's configure step only (seconds), where hipcc and cmake are installed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("hipcc") is None or shutil.which("cmake") is None,
                                reason="needs hipcc and cmake (the HIP configure step)")


def configure(tmp_path: Path, *defines: str, rocm_arch: str | None = None) -> tuple[str, str]:
    """(cmake's output, the build_info.cpp compile line) of a HIP configure into tmp_path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_ROCM_ARCH"}
    if rocm_arch is not None:
        env["PYTORCH_ROCM_ARCH"] = rocm_arch
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    done = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path), *generator, "-DLLMK_GPU=hip",
                           "-DLLMK_BUILD_TESTS=OFF", *defines], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = (tmp_path / "build.ninja") if generator else next(tmp_path.rglob("build_info.cpp.o.d"), None)
    text = rules.read_text() if rules and rules.exists() else ""
    return done.stdout + done.stderr, text


def targets_line(out: str) -> list[str]:
    m = re.search(r"llmk HIP targets from (.*?): (\S+)", out)
    assert m, out
    return m.group(2).split(";")


def test_pytorch_rocm_arch_names_the_targets(tmp_path):
    out, rules = configure(tmp_path, rocm_arch="gfx90a gfx1030")
    assert "from PYTORCH_ROCM_ARCH" in out
    assert targets_line(out) == ["gfx90a", "gfx1030"]
    if rules:
        assert r'LLMK_GPU_TARGETS=\"gfx90a,gfx1030\"' in rules  # what llmk::gpu_targets() returns


def test_explicit_targets_win(tmp_path):
    out, rules = configure(tmp_path, "-DLLMK_HIP_ARCHITECTURES=gfx1030", rocm_arch="gfx90a")
    assert "llmk HIP targets from" not in out
    if rules:
        assert r'LLMK_GPU_TARGETS=\"gfx1030\"' in rules


def test_without_a_gpu_the_default_targets_hipcc_knows(tmp_path):
    out, _ = configure(tmp_path)
    if "the GPUs of this machine" in out:
        pytest.skip("this machine has an AMD GPU: the build targets it")
    targets = targets_line(out)
    assert {"gfx90a", "gfx1030"} <= set(targets)
    # MI300X's gfx942, or gfx940 with a warning where this hipcc cannot target gfx942
    assert "gfx942" in targets or ("gfx940" in targets and "cannot target gfx942" in out)
