// The tensor-core decode attention kernels for bf16 at head dim 64 (decode_mma.h), one of four
// files so that they compile in parallel.
#include "decode/decode_mma.h"

#if LLMK_MMA_SYNC_BUILD
namespace llmk::detail {
int decode_mma_bf16_d64(const DecodeParams& p, bool launch) { return mma_layout<gpu::bfloat16, 64>(p, launch); }
unsigned decode_mma_bf16_d64_flags() { return take_decode_mma_flags(); }
}  // namespace llmk::detail
#endif
