// Walking a separated list in a setting's text (the GEMM's measurement switches' lists).
#pragma once

#include <cstddef>
#include <string_view>

namespace llmk::detail {

// Calls f(part) on each part of `text` between separators `sep`, in order, empty parts included
// ("a,,b": a, "", b; "": one empty part), so that a caller can reject them.
template <typename F>
void for_each_part(std::string_view text, char sep, F&& f) {
  for (;;) {
    const std::size_t at = text.find(sep);
    f(text.substr(0, at));
    if (at == std::string_view::npos) return;
    text = text.substr(at + 1);
  }
}

}  // namespace llmk::detail
