#include <atomic>

#include "core/parallel.h"

namespace llmk {

namespace {
std::atomic<CpuParallelFor> installed{nullptr};
}  // namespace

void set_cpu_parallel_for(CpuParallelFor fn) { installed.store(fn); }
CpuParallelFor cpu_parallel_for() { return installed.load(std::memory_order_relaxed); }

}  // namespace llmk
