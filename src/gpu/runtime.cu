#include <array>
#include <atomic>
#include <string>

#include "core/check.h"
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
  return env_flag("LLMK_PDL") && info(device).major.load() >= 9;
#else
  (void)device;
  return false;
#endif
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
