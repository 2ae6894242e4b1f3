// decode_warp_kernel for bf16 (decode_warp.h), one of two files so that they compile in parallel.
#include "decode/decode_warp.h"

namespace llmk::detail {
int decode_warp_bf16(int head_dim, bool paged, int rows, const DecodeParams* p) {
  return warp_dim<gpu::bfloat16>(head_dim, paged, rows, p);
}
}  // namespace llmk::detail
