// llmk::skinny_gemm (bf16) per environment variant, in two conditions: back to back over distinct
// weight copies (>= 256 MB cycled, so every call reads W from DRAM while the previous call ends: a
// decode step's condition, with programmatic dependent launch as the library sets it) and one call
// after a 256 MB L2-flushing memset (as do_bench). Rounds visit the variants in alternating order.
// The "cublas" variant is cublasGemmEx in the same conditions (what F.linear calls at these shapes).
// Links libllmk and cuBLAS; needs no PyTorch, so a library built elsewhere for sm_90a can be carried
// to the GPU.
//   micro_gemm_back_to_back            (prints us per call and TB/s of weight read per row)
#include <cublas_v2.h>
#include <llmk/llmk.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "flush_timer.h"

namespace {

using EnvList = std::vector<std::pair<std::string, std::string>>;

struct Variant {
  std::string name;
  EnvList env;          // variables set for it; every other variable any variant sets is unset
  bool cublas = false;  // cublasGemmEx instead of llmk::skinny_gemm
};

struct Shape {
  const char* name;
  int k, n, m;
  std::vector<Variant> variants;
};

// "A=1,B=2" -> {{A, 1}, {B, 2}}
EnvList parse_env(const std::string& text) {
  EnvList out;
  size_t at = 0;
  while (at < text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(at, comma - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "bad variant '%s' (want NAME=VALUE[,NAME=VALUE])\n", item.c_str());
      std::exit(2);
    }
    out.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    at = comma + 1;
  }
  return out;
}

}  // namespace

// Arguments: extra variants for every shape, each "NAME=VALUE[,NAME=VALUE]" (environment settings),
// e.g. micro_gemm_back_to_back LLMK_GEMM_DEEP_CHAINS=2; --only=TEXT runs only the rows whose
// "<shape> M<m> <variant>" contains TEXT (e.g. under a profiler: --only="8192x28672 M1 cublas").
int main(int argc, char** argv) {
  std::string only;
  std::vector<Variant> loads = {{"loads=8", {{"LLMK_GEMM_DEEP_LOADS", "8"}}},
                                {"loads=16", {{"LLMK_GEMM_DEEP_LOADS", "16"}}},
                                {"default", {}},
                                {"cublas", {}, true}};
  std::vector<Variant> splits = {{"plan", {}},
                                 {"sk=1", {{"LLMK_GEMM_DEEP_SPLIT", "1"}}},
                                 {"sk=2", {{"LLMK_GEMM_DEEP_SPLIT", "2"}}},
                                 {"sk=4", {{"LLMK_GEMM_DEEP_SPLIT", "4"}}},
                                 {"loads=16", {{"LLMK_GEMM_DEEP_LOADS", "16"}}},
                                 {"cublas", {}, true}};
  std::set<std::string> names;  // every variable some variant sets
  for (int a = 1; a < argc; ++a) {
    if (std::string(argv[a]).rfind("--only=", 0) == 0) {
      only = argv[a] + 7;
      continue;
    }
    const Variant extra{argv[a], parse_env(argv[a])};
    loads.push_back(extra);
    splits.push_back(extra);
  }
  for (const auto* list : {&loads, &splits})
    for (const Variant& v : *list)
      for (const auto& kv : v.env) names.insert(kv.first);
  auto apply_env = [&](const Variant& v) {
    for (const std::string& n : names) unsetenv(n.c_str());
    for (const auto& kv : v.env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  };
  const std::vector<Shape> shapes = {
      // issue 5's shapes
      {"4096x4096", 4096, 4096, 1, loads}, {"4096x4096", 4096, 4096, 8, loads},
      {"4096x14336", 4096, 14336, 1, loads}, {"4096x14336", 4096, 14336, 8, loads},
      {"14336x4096", 14336, 4096, 1, loads}, {"14336x4096", 14336, 4096, 8, loads},
      {"8192x28672", 8192, 28672, 1, loads}, {"8192x28672", 8192, 28672, 16, loads},
      // the 1B model's decode step (K x N): down, o, q/k/v, the head
      {"down 8192x2048", 8192, 2048, 1, loads}, {"o 2048x2048", 2048, 2048, 1, loads},
      {"qkv 2048x3072", 2048, 3072, 1, loads}, {"head 2048x32000", 2048, 32000, 1, splits},
      // the e2e 8b config's (Llama-3-8B's) that the rows above lack: q/k/v, gate/up as one GEMM, the
      // head (o is 4096x4096, down 14336x4096)
      {"8b qkv 4096x6144", 4096, 6144, 1, loads}, {"8b gate/up 4096x28672", 4096, 28672, 1, loads},
      {"8b head 4096x128256", 4096, 128256, 1, splits}};
  const llmk::Device gpu{llmk::DeviceKind::gpu, 0};
  llmk::GemmOptions fixed;  // the weights are constants: the kernel may read them before its PDL wait
  fixed.fixed_weight = true;
  FlushTimer timer;
  CK(timer.init());
  cublasHandle_t blas = nullptr;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) return 1;
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
    bool use_cublas = false;
    const float one = 1.f, zero = 0.f;
    auto call = [&](int i) {
      if (use_cublas) {  // y^T (N x M) = W (N x K, column-major K x N transposed) x^T (K x M)
        const cublasStatus_t st =
            cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, s.n, s.m, s.k, &one, w[i % copies], CUDA_R_16BF, s.k, x,
                         CUDA_R_16BF, s.k, &zero, y, CUDA_R_16BF, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (st != CUBLAS_STATUS_SUCCESS) {
          std::fprintf(stderr, "cublasGemmEx: status %d\n", static_cast<int>(st));
          std::exit(1);
        }
        return;
      }
      llmk::skinny_gemm(llmk::TensorView::contiguous(y, llmk::DType::bf16, gpu, {s.m, s.n}),
                        llmk::TensorView::contiguous(x, llmk::DType::bf16, gpu, {s.m, s.k}),
                        llmk::TensorView::contiguous(w[i % copies], llmk::DType::bf16, gpu, {s.n, s.k}),
                        llmk::TensorView{}, fixed);
    };
    const int iters = copies * 8;
    for (int round = 0; round < 2; ++round)
      for (size_t i = 0; i < s.variants.size(); ++i) {
        const Variant& v = s.variants[round % 2 ? s.variants.size() - 1 - i : i];
        const std::string label = std::string(s.name) + " M" + std::to_string(s.m) + " " + v.name;
        if (label.find(only) == std::string::npos) continue;
        apply_env(v);
        use_cublas = v.cublas;
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
                    s.name, s.m, v.name.c_str(), round, b2b, wbytes / b2b / 1e6, flushed, wbytes / flushed / 1e6);
        std::fflush(stdout);
      }
    apply_env(Variant{});
    for (void* p : w) CK(cudaFree(p));
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaGetLastError());
  }
  cublasDestroy(blas);
  return 0;
}
