// llmk::skinny_gemm (bf16) per environment variant, in two conditions: back to back over distinct
// weight copies (>= 256 MB cycled, so every call reads W from DRAM while the previous call ends: a
// decode step's condition, with programmatic dependent launch as the library sets it) and one call
// after a 256 MB L2-flushing memset (as do_bench). Rounds visit the variants in alternating order.
// Links libllmk; needs no PyTorch, so a library built elsewhere for sm_90a can be carried to the GPU.
//   micro_gemm_back_to_back            (prints us per call and TB/s of weight read per row)
#include <llmk/llmk.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "flush_timer.h"

namespace {

struct Variant {
  const char* name;
  const char* loads;  // LLMK_GEMM_DEEP_LOADS (nullptr: unset)
  const char* split;  // LLMK_GEMM_DEEP_SPLIT (nullptr: unset)
};

struct Shape {
  const char* name;
  int k, n, m;
  std::vector<Variant> variants;
};

void set_env(const char* name, const char* value) {
  if (value) setenv(name, value, 1);
  else unsetenv(name);
}

}  // namespace

int main() {
  const std::vector<Variant> loads = {{"loads=8", nullptr, nullptr}, {"loads=16", "16", nullptr}};
  const std::vector<Variant> splits = {{"plan", nullptr, nullptr}, {"sk=1", nullptr, "1"}, {"sk=2", nullptr, "2"},
                                       {"sk=4", nullptr, "4"}, {"loads=16", "16", nullptr}};
  const std::vector<Shape> shapes = {
      // issue 5's shapes
      {"4096x4096", 4096, 4096, 1, loads}, {"4096x4096", 4096, 4096, 8, loads},
      {"4096x14336", 4096, 14336, 1, loads}, {"4096x14336", 4096, 14336, 8, loads},
      {"14336x4096", 14336, 4096, 1, loads}, {"14336x4096", 14336, 4096, 8, loads},
      {"8192x28672", 8192, 28672, 1, loads},
      // the 1B model's decode step (K x N): down, o, q/k/v, the head
      {"down 8192x2048", 8192, 2048, 1, loads}, {"o 2048x2048", 2048, 2048, 1, loads},
      {"qkv 2048x3072", 2048, 3072, 1, loads}, {"head 2048x32000", 2048, 32000, 1, splits}};
  const llmk::Device gpu{llmk::DeviceKind::gpu, 0};
  FlushTimer timer;
  CK(timer.init());
  for (const Shape& s : shapes) {
    const size_t wbytes = size_t(s.k) * s.n * 2;
    const int copies = int((256ull << 20) / wbytes) + 2;
    std::vector<void*> w(copies);
    for (auto& p : w) {
      CK(cudaMalloc(&p, wbytes));
      CK(cudaMemset(p, 0x3c, wbytes));  // bf16 0x3c3c, about 0.0115
    }
    void *x = nullptr, *y = nullptr;
    CK(cudaMalloc(&x, size_t(s.m) * s.k * 2));
    CK(cudaMemset(x, 0x3c, size_t(s.m) * s.k * 2));
    CK(cudaMalloc(&y, size_t(s.m) * s.n * 2));
    auto call = [&](int i) {
      llmk::skinny_gemm(llmk::TensorView::contiguous(y, llmk::DType::bf16, gpu, {s.m, s.n}),
                        llmk::TensorView::contiguous(x, llmk::DType::bf16, gpu, {s.m, s.k}),
                        llmk::TensorView::contiguous(w[i % copies], llmk::DType::bf16, gpu, {s.n, s.k}),
                        llmk::TensorView{});
    };
    const int iters = copies * 8;
    for (int round = 0; round < 2; ++round)
      for (size_t i = 0; i < s.variants.size(); ++i) {
        const Variant& v = s.variants[round % 2 ? s.variants.size() - 1 - i : i];
        set_env("LLMK_GEMM_DEEP_LOADS", v.loads);
        set_env("LLMK_GEMM_DEEP_SPLIT", v.split);
        for (int c = 0; c < copies; ++c) call(c);  // warm-up
        CK(cudaEventRecord(timer.e0));
        for (int c = 0; c < iters; ++c) call(c);
        CK(cudaEventRecord(timer.e1));
        CK(cudaEventSynchronize(timer.e1));
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, timer.e0, timer.e1));
        const double b2b = ms * 1e3 / iters;
        const double flushed = timer.median_ms([&] { call(0); }) * 1e3;
        std::printf("%-16s M%-2d %-9s round %d: back to back %7.2f us (%4.2f TB/s), flushed %7.2f us (%4.2f TB/s)\n",
                    s.name, s.m, v.name, round, b2b, wbytes / b2b / 1e6, flushed, wbytes / flushed / 1e6);
        std::fflush(stdout);
      }
    set_env("LLMK_GEMM_DEEP_LOADS", nullptr);
    set_env("LLMK_GEMM_DEEP_SPLIT", nullptr);
    for (void* p : w) CK(cudaFree(p));
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaGetLastError());
  }
  return 0;
}
