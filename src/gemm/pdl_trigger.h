// Where the skinny GEMM's deep kernel lets the next kernel launch (programmatic dependent launch):
// after its streaming loop (the default) or at its start. Host code in a header of its own, apart
// from the kernel's source, so that a CPU test checks how LLMK_GEMM_PDL_LATE is read.
#pragma once

#include <string>
#include <string_view>

#include "core/check.h"

namespace llmk::detail {

// Whether the trigger goes after the streaming loop (true) or at the start, for a launch of
// `role` (rope: skinny_gemm_rope_kv, the q/k/v projection; gated: the SwiGLU / GEGLU gate/up
// GEMMs; plain: every other) whose grid fits one wave of resident blocks or not, in 16-warp blocks
// (one per SM: the plan for small N with a long K) or not. `setting` is LLMK_GEMM_PDL_LATE (a
// measurement switch): empty or "1": after the loop; "0": at the start; "wave": at the start where
// the grid is one wave (all of it placed at launch, so the next kernel's blocks can take only
// slots it leaves unused); "wide": at the start of 16-warp launches only (a full SM each, so the
// next kernel's blocks can start early only on SMs this grid leaves empty); "early:ROLES" (a comma
// list of rope, gated and plain): as "wave", for launches of those roles only, to time each decode
// GEMM's trigger on its own in a model's step. Any other value is an error (not the default).
inline bool deep_pdl_late(std::string_view setting, std::string_view role, bool one_wave, bool wide_blocks) {
  if (setting.empty() || setting == "1") return true;
  if (setting == "0") return false;
  if (setting == "wave") return !one_wave;
  if (setting == "wide") return !wide_blocks;
  constexpr std::string_view kPrefix = "early:";
  if (setting.substr(0, kPrefix.size()) != kPrefix)
    fail(ErrorKind::value, "skinny_gemm",
         "LLMK_GEMM_PDL_LATE: expected 1, 0, wave, wide or early:ROLES, got '" + std::string(setting) + "'");
  bool listed = false;
  for (std::string_view rest = setting.substr(kPrefix.size());;) {  // every comma-separated part, empty ones too
    const size_t comma = rest.find(',');
    const std::string_view r = rest.substr(0, comma);
    if (r != "rope" && r != "gated" && r != "plain")
      fail(ErrorKind::value, "skinny_gemm",
           "LLMK_GEMM_PDL_LATE: expected early: followed by rope, gated or plain, comma separated, got '" +
               std::string(setting) + "'");
    listed = listed || r == role;
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return !(listed && one_wave);
}

}  // namespace llmk::detail
