#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "core/check.h"
#include "core/text_parts.h"
#include "gpu/runtime.h"

namespace llmk::gpu {

void check(gpuError_t err, const char* op, const char* what) {
  if (err != gpuSuccess)
    detail::fail(ErrorKind::runtime, op, std::string(what) + " failed: " + gpuGetErrorString(err));
}

void check_launch(const char* op) { check(gpuGetLastError(), op, "kernel launch"); }

namespace {
constexpr int kMaxDevices = 64;
struct DeviceInfo {
  std::atomic<int> warp{0};
  std::atomic<int> sms{0};
  std::atomic<int> major{0};
};
std::array<DeviceInfo, kMaxDevices> g_info;

DeviceInfo& info(int device) {
  if (device < 0 || device >= kMaxDevices)
    detail::fail(ErrorKind::device, "gpu", "device index " + std::to_string(device) + " out of range");
  DeviceInfo& i = g_info[device];
  if (i.warp.load() == 0) {
    int warp = 0, sms = 0, major = 0;
    check(gpuDeviceGetAttribute(&warp, gpuDevAttrWarpSize, device), "gpu", "reading the warp size");
    check(gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, device), "gpu",
          "reading the multiprocessor count");
    check(gpuDeviceGetAttribute(&major, gpuDevAttrComputeCapabilityMajor, device), "gpu",
          "reading the compute capability");
    i.sms.store(sms);
    i.major.store(major);
    i.warp.store(warp);
  }
  return i;
}
}  // namespace

int warp_size(int device) { return info(device).warp.load(); }
int multiprocessor_count(int device) { return info(device).sms.load(); }

bool pdl_enabled(int device) {
#if LLMK_CUDA
  return env_flag("LLMK_PDL", true) && info(device).major.load() >= 9;
#else
  (void)device;
  return false;
#endif
}

namespace {
std::atomic<int64_t> g_pdl_launches{0};
[[maybe_unused]] std::mutex g_kernel_info_mutex;  // CUDA only: guards g_pdl_kernels and the carveout maps
[[maybe_unused]] std::unordered_map<const void*, bool> g_pdl_kernels;  // kernel -> its loaded code is sm_90+
[[maybe_unused]] std::unordered_map<const void*, int> g_carveouts;  // kernel -> the LLMK_SMEM_CARVEOUT last set
// (kernel, block threads, dynamic shared memory) -> LLMK_SMEM_CARVEOUT=fit's percentage
[[maybe_unused]] std::map<std::tuple<const void*, int, std::size_t>, int> g_fit_carveouts;
}  // namespace

bool kernel_supports_pdl(const void* kernel) {
#if LLMK_CUDA
  std::lock_guard<std::mutex> lock(g_kernel_info_mutex);
  auto it = g_pdl_kernels.find(kernel);
  if (it != g_pdl_kernels.end()) return it->second;
  cudaFuncAttributes attr{};
  bool ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion >= 90;
  if (!ok) (void)cudaGetLastError();
  g_pdl_kernels.emplace(kernel, ok);
  return ok;
#else
  (void)kernel;
  return false;
#endif
}

void count_pdl_launch() { g_pdl_launches.fetch_add(1, std::memory_order_relaxed); }

#if LLMK_CUDA
namespace {
// LLMK_SMEM_CARVEOUT=fit: the percentage of the multiprocessor's shared memory that `kernel`'s
// resident blocks at full occupancy need (blocks x (static + dynamic + the per-block reserve)),
// rounded up; -1 when a query fails. Called before the kernel has a preference of ours.
int fit_carveout(const void* kernel, int block_threads, std::size_t dynamic_smem) {
  int device = 0, per_sm = 0, reserve = 0;
  cudaFuncAttributes attr{};
  const int blocks = resident_blocks_or(kernel, block_threads, dynamic_smem, 0);
  if (blocks == 0 || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&reserve, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess ||
      cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || per_sm <= 0) {
    (void)cudaGetLastError();
    return -1;
  }
  const double need = static_cast<double>(blocks) * static_cast<double>(attr.sharedSizeBytes + dynamic_smem + reserve);
  return std::min(100, static_cast<int>(std::ceil(100.0 * need / per_sm)));
}
}  // namespace
#endif

void apply_smem_carveout(const void* kernel, int block_threads, std::size_t dynamic_smem) {
#if LLMK_CUDA
  const char* v = std::getenv("LLMK_SMEM_CARVEOUT");
  if (v == nullptr || *v == '\0') v = "fit";  // the default (gpu/runtime.h)
  std::lock_guard<std::mutex> lock(g_kernel_info_mutex);
  int64_t percent = -1;  // outside 0-100 (also a value that is no whole number): nothing set
  if (std::strcmp(v, "fit") == 0) {
    auto [it, fresh] = g_fit_carveouts.try_emplace({kernel, block_threads, dynamic_smem}, -1);
    if (fresh) it->second = fit_carveout(kernel, block_threads, dynamic_smem);
    percent = it->second;
  } else {
    percent = detail::whole_integer(v).value_or(-1);
  }
  if (percent < 0 || percent > 100) return;
  int& last = g_carveouts.try_emplace(kernel, -1).first->second;
  if (last == static_cast<int>(percent)) return;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, static_cast<int>(percent)) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  last = static_cast<int>(percent);
#else
  (void)kernel;
  (void)block_threads;
  (void)dynamic_smem;
#endif
}

int64_t pdl_launches_gpu() { return g_pdl_launches.load(std::memory_order_relaxed); }

#if LLMK_CUDA
namespace {
// The self test's writer: lets its dependents launch at once, then stores 42 after ~20 us.
__global__ void pdl_writer_kernel(int* flag) {
  pdl_trigger();
  const uint64_t t0 = global_timer_ns();
  while (global_timer_ns() - t0 < 20000) {
  }
  *static_cast<volatile int*>(flag) = 42;
}

// The self test's reader: what it sees of the writer's store (after pdl_wait() when WAIT; it
// always waits before it exits, as every PDL-launched kernel must).
template <bool WAIT>
__global__ void pdl_reader_kernel(const int* flag, int* seen) {
  if (WAIT) pdl_wait();
  *seen = *static_cast<const volatile int*>(flag);
  if (!WAIT) pdl_wait();
}

template <bool WAIT>
int pdl_selftest_typed(int device) {
  const char* op = "pdl_selftest";
  DeviceGuard guard(Device{DeviceKind::gpu, device}, op);
  if (info(device).major.load() < 9 || !kernel_supports_pdl(reinterpret_cast<const void*>(pdl_reader_kernel<WAIT>)))
    return -1;
  int* buf = nullptr;
  check(cudaMalloc(&buf, 2 * sizeof(int)), op, "cudaMalloc");
  cudaStream_t stream = nullptr;
  int seen = -2;
  const cudaError_t err = [&] {
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaMemsetAsync(buf, 0, 2 * sizeof(int), stream);
    if (e != cudaSuccess) return e;
    pdl_writer_kernel<<<1, 32, 0, stream>>>(buf);
    launch(pdl_reader_kernel<WAIT>, 1, 32, 0, stream, true, buf, buf + 1);
    e = cudaStreamSynchronize(stream);
    if (e == cudaSuccess) e = cudaMemcpy(&seen, buf + 1, sizeof(int), cudaMemcpyDeviceToHost);
    return e;
  }();
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
  (void)cudaFree(buf);
  check(err, op, "running the writer and reader kernels");
  return seen;
}
}  // namespace
#endif

namespace {
// Whether GPU `device` exists here (the self tests report -1 when it does not).
bool device_present(int device) {
  int count = 0;
  if (gpuGetDeviceCount(&count) != gpuSuccess) {
    (void)gpuGetLastError();
    return false;
  }
  return device >= 0 && device < count;
}
}  // namespace

#if LLMK_CUDA
namespace {
__global__ void carveout_probe_kernel(int* out) {
  if (threadIdx.x == 0) *out = 1;
}
}  // namespace
#endif

int smem_carveout_selftest_gpu(int device) {
#if LLMK_CUDA
  if (!device_present(device)) return -1;
  const char* op = "smem_carveout_selftest";
  DeviceGuard guard(Device{DeviceKind::gpu, device}, op);
  int* buf = nullptr;
  check(cudaMalloc(&buf, sizeof(int)), op, "cudaMalloc");
  launch(carveout_probe_kernel, 1, 32, 0, nullptr, false, buf);
  cudaFuncAttributes attr{};
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(carveout_probe_kernel));
  (void)cudaFree(buf);
  check(err, op, "running the probe kernel");
  return attr.preferredShmemCarveout;
#else
  (void)device;
  return -2;
#endif
}

int pdl_selftest_gpu(int device, bool wait) {
#if LLMK_CUDA
  if (!device_present(device)) return -1;
  return wait ? pdl_selftest_typed<true>(device) : pdl_selftest_typed<false>(device);
#else
  (void)device;
  (void)wait;
  return -1;
#endif
}

namespace {
// grid_barrier's self test: slots[block] = round, barrier, every slot checked, barrier again (so
// that no block overwrites its slot with the next round while another still checks it).
__global__ void grid_barrier_test_kernel(unsigned* state, int* slots, unsigned long long* stale, int rounds) {
  const unsigned blocks = gridDim.x;
  for (int r = 1; r <= rounds; ++r) {
    if (threadIdx.x == 0) *static_cast<volatile int*>(slots + blockIdx.x) = r;
    // a timeout (1 s: blocks not all resident, or a lost release) counts as the whole grid stale
    if (!grid_barrier(state, blocks, 1000000000ull)) {
      if (threadIdx.x == 0) atomicAdd(stale, blocks);
      return;
    }
    unsigned long long bad = 0;
    for (unsigned b = threadIdx.x; b < blocks; b += blockDim.x)
      bad += *static_cast<volatile int*>(slots + b) != r;
    if (bad) atomicAdd(stale, bad);
    if (!grid_barrier(state, blocks, 1000000000ull)) {
      if (threadIdx.x == 0) atomicAdd(stale, blocks);
      return;
    }
  }
}
}  // namespace

int64_t grid_barrier_selftest_gpu(int device, int rounds, int blocks_per_sm, double* ns_per_barrier) {
  const char* op = "grid_barrier_selftest";
  if (!device_present(device)) return -1;
  DeviceGuard guard(Device{DeviceKind::gpu, device}, op);
  constexpr int kThreads = 128;
  const int fit = resident_blocks(grid_barrier_test_kernel, kThreads, 0, op);
  const int blocks = (blocks_per_sm > 0 && blocks_per_sm < fit ? blocks_per_sm : fit) * multiprocessor_count(device);
  // one buffer: the barrier state (2 words), the stale count (8 bytes), then a slot per block
  char* buf = nullptr;
  const std::size_t bytes = 16 + static_cast<std::size_t>(blocks) * sizeof(int);
  check(gpuMalloc(reinterpret_cast<void**>(&buf), bytes), op, "allocating the test buffers");
  auto* stale = reinterpret_cast<unsigned long long*>(buf + 8);
  unsigned long long seen = 0;
  gpuEvent_t start = nullptr, stop = nullptr;
  gpuError_t err = gpuMemsetAsync(buf, 0, bytes, nullptr);
  if (err == gpuSuccess) err = gpuEventCreate(&start);
  if (err == gpuSuccess) err = gpuEventCreate(&stop);
  if (err == gpuSuccess) err = gpuEventRecord(start, nullptr);
  if (err == gpuSuccess) {
    grid_barrier_test_kernel<<<blocks, kThreads>>>(reinterpret_cast<unsigned*>(buf), reinterpret_cast<int*>(buf + 16),
                                                   stale, rounds);
    err = gpuGetLastError();
  }
  if (err == gpuSuccess) err = gpuEventRecord(stop, nullptr);
  if (err == gpuSuccess) err = gpuDeviceSynchronize();
  float ms = 0.f;
  if (err == gpuSuccess) err = gpuEventElapsedTime(&ms, start, stop);
  // two barriers a round; the slot checks between them are part of the figure (a small upper bound)
  if (err == gpuSuccess && ns_per_barrier) *ns_per_barrier = 1e6 * ms / (2.0 * rounds);
  if (start) (void)gpuEventDestroy(start);
  if (stop) (void)gpuEventDestroy(stop);
  if (err == gpuSuccess) err = gpuMemcpy(&seen, stale, sizeof(seen), gpuMemcpyDeviceToHost);
  (void)gpuFree(buf);
  check(err, op, "running the persistent test kernel");
  return static_cast<int64_t>(seen);
}

DeviceGuard::DeviceGuard(Device device, const char* op) {
  if (device.kind != DeviceKind::gpu)
    detail::fail(ErrorKind::device, op, "expected a GPU tensor, got " + device_name(device));
  check(gpuGetDevice(&previous_), op, "reading the current device");
  device_ = device.index;
  if (device_ != previous_) check(gpuSetDevice(device_), op, "selecting the device");
}

DeviceGuard::~DeviceGuard() {
  if (device_ != previous_ && previous_ >= 0) (void)gpuSetDevice(previous_);
}

}  // namespace llmk::gpu
