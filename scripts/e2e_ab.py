"""Whole-model decode speed under several environment settings, in alternating fresh processes (for
switches read at import or per call, e.g. LLMK_FUSE_MLP_NORM=0, LLMK_GEMM_PDL_LATE=0), on the GPU
machine after building the torch extension (the package on PYTHONPATH):

    python3 scripts/e2e_ab.py --configs 7b,1b --rounds 2 --out $OUT -- default LLMK_FUSE_MLP_NORM=0 \
        LLMK_FUSE_MLP_NORM=0,LLMK_FUSE_QKV_NORM=0

A setting is "default" (nothing set) or NAME=VALUE[,NAME=VALUE]; every variable some setting names is
unset for the others. Each round runs every config with every setting (the settings' order reversed
in odd rounds), each one `llm-kernels e2e --config C --variant V --batch B --no-compile ... --json F`
(B: --batch, default 1). Writes OUT/e2e_ab.md (decode tok/s at batch B per setting and config, one
value per round, and the % of the weight-streaming roof, B x batch 1's; below it any run whose
decode steps were not replayed from a CUDA graph, which also makes the exit status 1) and
OUT/e2e_ab.tar.gz (every run's log and JSON: the device tool returns at most 8 files).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path


def parse_setting(text: str) -> dict[str, str]:
    if text == "default":
        return {}
    out = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"bad setting {text!r}: want 'default' or NAME=VALUE[,NAME=VALUE]")
        out[name] = value
    return out


def apply_in_process(text: str, base: dict[str, str], bare: str = "LLMK_GEMM_KERNEL") -> None:
    """os.environ becomes `base` plus setting `text`'s variables (a value without '=' is `bare`'s),
    for scripts that time several settings in one process (switches read per call)."""
    for name in set(os.environ) - set(base):
        del os.environ[name]
    os.environ.update(base)
    if text != "default":
        os.environ.update(parse_setting(text if "=" in text else f"{bare}={text}"))


def kernel_name(name: str) -> str:
    """A profiler's kernel name without its parameter list, "void " and anonymous namespaces (for the
    scripts that list a step's kernels; the namespaces go first, their brackets are no parameter list)."""
    return name.replace("(anonymous namespace)::", "").replace("void ", "").split("(")[0]


def show(cell: float | str) -> str:
    return f"{cell:.0f}" if isinstance(cell, float) else cell


def decode_cell(res: dict, batch: int = 1) -> tuple[float | str, str]:
    """The decode tok/s at `batch` of one `llm-kernels e2e --json` result (or why there is none), and
    a note where its steps were not replayed from a CUDA graph (a failed capture times eager steps,
    which would read as a slow setting)."""
    rec = next((x for x in res["records"] if x["metric"] == "decode" and x["batch"] == batch and x["status"] == "ok"),
               None)
    if rec is None:
        return "no decode record", ""
    if rec.get("cuda_graph") is False:
        return rec["tok_s"], "no CUDA graph" + (f": {rec['note']}" if rec.get("note") else "")
    return rec["tok_s"], ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1b", help="comma-separated e2e configs (default 1b)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", default="kernelized_fused")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/e2e-ab"))
    ap.add_argument("--e2e-args", default="--prefill-len 128 --iters 2 --steps 64 --budget-s 40",
                    help="further arguments for each `llm-kernels e2e` run")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per run before it is stopped")
    ap.add_argument("--batch", type=int, default=1, help="the decode batch size to run and report")
    ap.add_argument("settings", nargs="+")
    a = ap.parse_args()
    # e2e's --batch is repeatable: the table would take one of them (either spelling of the option)
    if any(t == "--batch" or t.startswith("--batch=") for t in a.e2e_args.split()):
        ap.error("give the batch size as e2e_ab.py's --batch, not inside --e2e-args")
    settings = [(s, parse_setting(s)) for s in a.settings]
    names = {n for _, env in settings for n in env}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="e2e-ab."))
    results: dict[tuple[str, str], list[float | str]] = {}  # tok/s, or why there is none
    flagged: list[str] = []  # runs whose steps ran without a CUDA graph
    roofs: dict[str, float] = {}
    for r in range(a.rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for cfg in a.configs.split(","):
            for label, env_set in order:
                env = {k: v for k, v in os.environ.items() if k not in names}
                env.update(env_set)
                stem = f"r{r}_{cfg}_{label.replace('=', '-').replace(',', '+')}"
                cmd = [sys.executable, "-m", "llm_kernels.cli", "e2e", "--config", cfg, "--variant", a.variant,
                       "--batch", str(a.batch), "--no-compile", *a.e2e_args.split(), "--json", str(work / f"{stem}.json")]
                print(f"== {time.strftime('%H:%M:%S')} round {r} {cfg} {label}", flush=True)
                with open(work / f"{stem}.log", "w") as log:
                    try:
                        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                cell: float | str = f"failed ({rc})"
                if rc == 0:
                    res = json.loads((work / f"{stem}.json").read_text())
                    # B rows read the weights once a step: B x the batch-1 roof (KV cache bytes left out)
                    roofs[cfg] = a.batch * (res["meta"].get("decode_roof_tok_s_batch1") or 0.0)
                    cell, flag = decode_cell(res, a.batch)
                    if flag:
                        flagged.append(f"- round {r}, {cfg}, `{label}`: {flag}")
                results.setdefault((cfg, label), []).append(cell)
                print(f"   {show(cell)} tok/s", flush=True)
    lines = [f"Decode tok/s at batch {a.batch}, `{a.variant}`, {a.rounds} alternating rounds "
             f"(`llm-kernels e2e --batch {a.batch} --no-compile {a.e2e_args}`), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", "| config | setting | tok/s per round | % of roof (best) |", "|---|---|---|---|"]
    for cfg in a.configs.split(","):
        for label, _ in settings:
            cells = results.get((cfg, label), [])
            nums = [c for c in cells if isinstance(c, float)]
            roof = roofs.get(cfg, 0.0)
            pct = f"{100 * max(nums) / roof:.0f}%" if nums and roof else "-"
            lines.append(f"| {cfg} | `{label}` | {', '.join(map(show, cells))} | {pct} |")
    if flagged:
        lines += ["", "Not replayed from a CUDA graph (eager steps: not comparable with the others):", *flagged]
    (out / "e2e_ab.md").write_text("\n".join(lines) + "\n")
    with tarfile.open(out / "e2e_ab.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="e2e_ab")
    print("\n".join(lines))
    return 0 if not flagged and all(isinstance(c, float) for cells in results.values() for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
