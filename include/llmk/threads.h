// Threads for llmk's CPU kernels. They split their rows (tokens, heads) over the function
// installed here; with none installed (the default) they run on the calling thread, so the
// library starts no threads and links no OpenMP runtime of its own. The PyTorch extension installs
// at::parallel_for when it loads, so from Python the kernels share torch's intra-op thread pool
// (torch.set_num_threads). Results do not depend on the number of threads.
#pragma once

#include <cstdint>

namespace llmk {

// Must run chunk(ctx, begin, end) over pieces covering [0, n) exactly once, pieces of at least
// `grain` items where n allows, possibly on several threads at once, and return when all are done.
// Pieces do not throw (the kernels check their inputs before they split).
using CpuParallelFor = void (*)(int64_t n, int64_t grain, void* ctx,
                                void (*chunk)(void* ctx, int64_t begin, int64_t end));

void set_cpu_parallel_for(CpuParallelFor fn);  // nullptr: back to the calling thread
CpuParallelFor cpu_parallel_for();             // the installed function, or nullptr

}  // namespace llmk
