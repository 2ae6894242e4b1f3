// Normalises a row of 2s with eps = 0 on the CPU through the installed library: y must equal w.
#include <llmk/llmk.h>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> x(5, 2.f), w = {1.f, -2.f, 0.5f, 3.f, 0.f}, y(5, -1.f);
  const llmk::Device cpu{};
  llmk::rms_norm(llmk::TensorView::contiguous(y.data(), llmk::DType::f32, cpu, {1, 5}),
                 llmk::TensorView::contiguous(x.data(), llmk::DType::f32, cpu, {1, 5}),
                 llmk::TensorView::contiguous(w.data(), llmk::DType::f32, cpu, {5}), 0.f);
  for (int i = 0; i < 5; ++i)
    if (y[i] != w[i]) {
      std::printf("consumer: y[%d] = %g, expected %g\n", i, y[i], w[i]);
      return 1;
    }
  std::printf("consumer: find_package(llmk) build ok, gpu backend '%s'\n", llmk::gpu_backend());
  return 0;
}
