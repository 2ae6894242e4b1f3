#!/usr/bin/env python3
"""Registers, spills and shared memory per kernel from `nvcc -Xptxas -v` output (read on stdin),
with demangled, shortened names: a register-pressure check that needs no GPU.

    nvcc ... -Xptxas -v -c src/rmsnorm/rmsnorm_gpu.cu 2>&1 | python3 scripts/ptxas_report.py [FILTER]
"""
import re
import subprocess
import sys

filt = sys.argv[1] if len(sys.argv) > 1 else ""
name, rows = None, []
for line in sys.stdin:
    m = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
    if m:
        name = m.group(1)
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name:
        spills = int(m.group(1)) + int(m.group(2))
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        rows.append((name, int(m.group(1)), spills))
        name = None
names = subprocess.run(["c++filt"], input="\n".join(r[0] for r in rows), capture_output=True, text=True).stdout.split("\n")
for (mangled, regs, spills), pretty in zip(rows, names):
    pretty = re.sub(r"llmk::detail::\(anonymous namespace\)::|llmk::gpu::|\(llmk::detail::\w+\)", "", pretty)
    if filt in pretty:
        print(f"{regs:4d} regs {spills:5d} B spilled  {pretty}")
