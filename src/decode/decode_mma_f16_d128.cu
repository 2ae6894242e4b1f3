// The tensor-core decode attention kernels for f16 at head dim 128 (decode_mma.h), one of four
// files so that they compile in parallel.
#include "decode/decode_mma.h"

#if LLMK_MMA_SYNC_BUILD
namespace llmk::detail {
int decode_mma_f16_d128(const DecodeParams& p, bool launch) { return mma_layout<gpu::half, 128>(p, launch); }
unsigned decode_mma_f16_d128_flags() { return take_decode_mma_flags(); }
}  // namespace llmk::detail
#endif
