// Reading a setting's text (environment switches): a separated list's parts, a whole integer.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
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

// `text` as a base-10 integer when that is all it is (an optional leading '-', digits, nothing
// else: no spaces, no '+', no trailing characters), else nothing (also out of int64_t's range).
inline std::optional<int64_t> whole_integer(std::string_view text) {
  int64_t v = 0;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || err != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

}  // namespace llmk::detail
