#!/usr/bin/env bash
# The A/B of the two prepared decode patches (docs/next-steps.md, device plan item 2):
# scripts/patches/decode-release-publish.patch and decode-paged-two-groups.patch (stacked).
#
#   bash scripts/decode_patches_ab.sh apply   # on the device copy of the tree: apply both patches
#                                             # (git apply where .git travelled, else patch -p1)
#   bash scripts/decode_patches_ab.sh round   # one round of the sweeps (gpu_ab.sh's command)
#
# One device call, after `bash scripts/gpu_ab.sh --prepare` here with the patches applied (then
# revert them here; carry .carry and .ab-base):
#   bash scripts/decode_patches_ab.sh apply && AB_SDPA=--sdpa OUT=$OUT bash scripts/gpu_ab.sh --rounds 1 \
#     --tests '*Decode*:*WriteKv*:*GatedInPlace*:*VectorMath*' -- bash scripts/decode_patches_ab.sh round
# Rows: contiguous and paged (pages of 16) b1 / b2 kv4096 (issue 5's paged ratio at batch 1: the
# new build runs two warp groups on paged caches), and the 1B step's 203-slot masked cache at 1 and
# 2 splits (the release publish's effect on a split merge), all with the kept zeroed workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  apply)
    for p in scripts/patches/decode-release-publish.patch scripts/patches/decode-paged-two-groups.patch; do
      if git apply "$p" 2>/dev/null; then echo "git apply $p"
      elif patch -p1 -s < "$p"; then echo "patch -p1 $p"
      else echo "$p does not apply"; exit 1; fi
    done ;;
  round)
    # shellcheck disable=SC2086  # AB_SDPA is an optional flag
    python3 scripts/decode_split_sweep.py --rows b1kv4096,b2kv4096 --splits 0 --counters zeroed ${AB_SDPA:-}
    python3 scripts/decode_split_sweep.py --rows b1kv4096,b2kv4096 --paged 16 --splits 0 --counters zeroed
    python3 scripts/decode_split_sweep.py --rows b1kv203 --dim 64 --mask-len 160 --splits 0,2 --counters zeroed ;;
  *) echo "usage: $0 apply|round"; exit 2 ;;
esac
