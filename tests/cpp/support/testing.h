// Helpers shared by the C++ test files.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "llmk/error.h"
#include "support/gpu_memory.h"

// GPU cases skip without a GPU, unless LLMK_REQUIRE_GPU is set (the GPU machine's run), where a
// missing GPU is a failure.
#define SKIP_WITHOUT_GPU(on_gpu)                                                   \
  if ((on_gpu) && llmk_test::gpu_count() == 0) {                                   \
    if (std::getenv("LLMK_REQUIRE_GPU")) FAIL() << "LLMK_REQUIRE_GPU set, no GPU"; \
    GTEST_SKIP() << "no GPU: GPU case not run on this machine";                    \
  }

namespace llmk_test {

// The message of the llmk::Error that f throws, or "<no error>".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const llmk::Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace llmk_test
