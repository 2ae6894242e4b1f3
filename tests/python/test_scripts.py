"""Smoke tests of the profiling helpers in scripts/ (they run on the GPU machine, so a broken one
would cost device time): the Monarch Nsight Compute driver on the CPU, and the stall summary on a
small report in the layout of `ncu --page source --csv --print-source sass`."""
import csv
import subprocess
import sys
from pathlib import Path

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
