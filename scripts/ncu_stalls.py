"""Where a kernel's warps wait, from Nsight Compute's per-instruction source page:

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > REPORT.csv
    python scripts/ncu_stalls.py REPORT.csv [--top 25] [--around ADDRESS [--lines 20]]

Prints the share of the warp-stall samples per stall reason, then the instructions with the most
samples, each with its two largest reasons. A stall is booked on the instruction that waits, so a
long wait on a barrier shows on the instruction after the wait (e.g. the branch that leaves a
try-wait loop). --around prints the instructions near one address (its low hex digits suffice)
with their samples and execution counts, to see what a hot instruction waits for.
"""
import argparse
import csv

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
ap.add_argument("--top", type=int, default=25)
ap.add_argument("--around", help="an instruction address (hex, its low digits are enough)")
ap.add_argument("--lines", type=int, default=20, help="with --around: instructions on each side")
a = ap.parse_args()

with open(a.csv, newline="") as f:
    rows = list(csv.reader(f))
header_at = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
head, data = rows[header_at], [r for r in rows[header_at + 1:] if len(r) == len(rows[header_at])]
col = {name: i for i, name in enumerate(head)}
samples_col, addr_col, src_col = col["Warp Stall Sampling (All Samples)"], col["Address"], col["Source"]
executed_col = col.get("Instructions Executed")
reasons = [(name, i) for name, i in col.items() if name.startswith("stall_") and "Not Issued" not in name]


def short(address: str) -> str:  # the low 6 hex digits, enough to tell a kernel's instructions apart
    return address.lower().removeprefix("0x")[-6:]


def number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


total = sum(number(r[samples_col]) for r in data)
if total == 0:
    raise SystemExit(f"{a.csv}: no warp-stall samples (was the report taken with --set full?)")
print(f"{len(data)} instructions, {total:.0f} warp-stall samples")
by_reason = sorted(((sum(number(r[i]) for r in data), name[len("stall_"):]) for name, i in reasons), reverse=True)
print("by reason: " + ", ".join(f"{name} {100 * v / total:.1f}%" for v, name in by_reason if v > 0))

if a.around:
    at = next((k for k, r in enumerate(data) if r[addr_col].lower().endswith(a.around.lower().removeprefix("0x"))), None)
    if at is None:
        raise SystemExit(f"no instruction at an address ending in {a.around}")
    for r in data[max(0, at - a.lines): at + a.lines + 1]:
        executed = r[executed_col] if executed_col is not None else ""
        print(f"{short(r[addr_col])} {number(r[samples_col]):7.0f} {executed:>10} {r[src_col]}")
else:
    print(f"top {a.top} instructions by samples:")
    for r in sorted(data, key=lambda r: -number(r[samples_col]))[: a.top]:
        top2 = sorted(((number(r[i]), name[len("stall_"):]) for name, i in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {100 * v / total:.1f}%" for v, name in top2 if v > 0)
        print(f"{short(r[addr_col])} {100 * number(r[samples_col]) / total:5.1f}%  {r[src_col][:70]:70s} {why}")
