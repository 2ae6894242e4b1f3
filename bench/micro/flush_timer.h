// The micro-benchmarks' timer: the median of 30 launches between CUDA events, each after a 256 MB
// memset that flushes the L2 (as triton's do_bench), and their error check (CK: print, return 1).
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

struct FlushTimer {
  void* flush = nullptr;
  cudaEvent_t e0{}, e1{};
  cudaError_t init() {
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    return cudaMalloc(&flush, 256 << 20);
  }
  // milliseconds, median of 30 timed launch() calls
  template <typename Launch>
  float median_ms(Launch launch) {
    std::vector<float> t;
    for (int r = 0; r < 30; ++r) {
      cudaMemsetAsync(flush, r, 256 << 20);
      cudaEventRecord(e0);
      launch();
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};
