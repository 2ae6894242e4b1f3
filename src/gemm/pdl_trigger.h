// Where the skinny GEMM's deep kernel lets the next kernel launch (programmatic dependent launch):
// after its streaming loop or at its start (the default: at the start of one-wave gate/up launches
// and of 16-warp launches, after the loop everywhere else). Host code in a header of its own, apart
// from the kernel's source, so that a CPU test checks how LLMK_GEMM_PDL_LATE is read.
#pragma once

#include <string>
#include <string_view>

#include "core/check.h"
#include "core/text_parts.h"

namespace llmk::detail {

// Whether the trigger goes after the streaming loop (true) or at the start, for a launch of `role`
// (rope: skinny_gemm_rope_kv, the q/k/v projection; gated: the SwiGLU / GEGLU gate/up GEMMs; plain:
// every other) whose grid fits one wave of resident blocks or not, in 16-warp blocks (one per SM:
// the plan for small N with a long K) or not. `setting` is LLMK_GEMM_PDL_LATE (a measurement
// switch): empty (the default): as "early:gated+wide"; "1": after the loop (the default until
// 2026-12-07); "0": at the start; "wave": at the start where the grid is one wave (all of it placed
// at launch, so the next kernel's blocks can take only slots it leaves unused); "wide": at the
// start of 16-warp launches only (a full SM each, so the next kernel's blocks can start early only
// on SMs this grid leaves empty); "early:ROLES" (a comma list of rope, gated and plain): as "wave",
// for launches of those roles only, to time each decode GEMM's trigger on its own in a model's
// step; several of these joined by "+" (e.g. "early:gated+wide"): at the start where any of them
// puts it. Any other value is an error (not the default).
// Why early:gated+wide by default (H100, 2026-12-07, scripts/steps/pdl-roles.txt and
// pdl-gated-wide.txt): the 1B decode took 1085-1087 against 1069-1071 tok/s for early:gated alone
// and 1052-1054 for "1" after 128 tokens, 971-972 against 962-965 after 1000; the 7B 197 all three
// ways (it has no 16-warp launch); early:plain cost the 7B (186) and early:rope gained nothing at
// 1B.
inline bool deep_pdl_late_part(std::string_view part, std::string_view setting, std::string_view role, bool one_wave,
                               bool wide_blocks) {
  if (part == "1") return true;
  if (part == "0") return false;
  if (part == "wave") return !one_wave;
  if (part == "wide") return !wide_blocks;
  constexpr std::string_view kPrefix = "early:";
  if (part.substr(0, kPrefix.size()) != kPrefix)
    fail(ErrorKind::value, "skinny_gemm",
         "LLMK_GEMM_PDL_LATE: expected 1, 0, wave, wide or early:ROLES, or several joined by +, got '" +
             std::string(setting) + "'");
  bool listed = false;
  for_each_part(part.substr(kPrefix.size()), ',', [&](std::string_view r) {  // every role, empty ones too
    if (r != "rope" && r != "gated" && r != "plain")
      fail(ErrorKind::value, "skinny_gemm",
           "LLMK_GEMM_PDL_LATE: expected early: followed by rope, gated or plain, comma separated, got '" +
               std::string(setting) + "'");
    listed = listed || r == role;
  });
  return !(listed && one_wave);
}

inline bool deep_pdl_late(std::string_view setting, std::string_view role, bool one_wave, bool wide_blocks) {
  if (setting.empty()) setting = "early:gated+wide";
  bool late = true;
  for_each_part(setting, '+', [&](std::string_view part) {  // each checked, empty ones are errors
    late = deep_pdl_late_part(part, setting, role, one_wave, wide_blocks) && late;
  });
  return late;
}

}  // namespace llmk::detail
