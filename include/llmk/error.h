// llmk errors: every op validates its arguments and throws llmk::Error with a message that names
// the op, the argument, what was expected and what was given, e.g.
//   "llmk::rms_norm: weight: expected shape (4096), got (4095)".
#pragma once

#include <stdexcept>
#include <string>

namespace llmk {

enum class ErrorKind : int {
  value,            // bad shape, size, stride or scalar
  type,             // unsupported or mismatched dtype
  device,           // tensors on different devices, or a device this build cannot run
  not_implemented,  // valid input that this build or op does not support
  runtime,          // a GPU runtime call failed
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace llmk
