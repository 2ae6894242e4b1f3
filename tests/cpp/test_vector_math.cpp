// core/vector_math.h: the CPU kernels' branch-free exp and erfc against float64 libm, element by
// element over their whole useful range.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/vector_math.h"

using llmk::detail::erfc_vectorisable;
using llmk::detail::exp_vectorisable;

namespace {

constexpr double kEps = std::numeric_limits<float>::epsilon();

TEST(VectorMath, ExpWithin2UlpAndItsEnds) {
  double worst = 0;
  for (int i = -866000; i <= 887228; ++i) {  // -86.6 .. 88.7228
    const float x = static_cast<float>(i) * 1e-4f;
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(exp_vectorisable(x) - want) / want);
  }
  EXPECT_LT(worst, 2 * kEps) << "worst relative error";
  EXPECT_EQ(exp_vectorisable(-100.f), 0.f);
  EXPECT_EQ(exp_vectorisable(100.f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(exp_vectorisable(-std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_TRUE(std::isnan(exp_vectorisable(std::nanf(""))));
}

TEST(VectorMath, ErfcWithin4EpsRelativeAndItsEnds) {
  double worst = 0, worst_at = 0;
  for (int i = -200000; i <= 100000; ++i) {  // -20 .. 10
    const float x = static_cast<float>(i) * 1e-4f;
    const double want = std::erfc(static_cast<double>(x));
    const double abs_err = std::fabs(erfc_vectorisable(x) - want);
    if (want < std::numeric_limits<float>::min()) {  // x > 9.19: subnormal floats, fewer bits
      EXPECT_LT(abs_err, std::numeric_limits<float>::min() * kEps * 8) << "at x = " << x;
      continue;
    }
    if (abs_err / want > worst) worst = abs_err / want, worst_at = x;
  }
  // this needs e^(-z^2) in two parts: with z^2 rounded to float the error is 8e-6 at z ~ 8.3,
  // and the scale by 2^n in two steps: in one, results below 2^-126 (x > 9.2) would be 0
  EXPECT_LT(worst, 4 * kEps) << "at x = " << worst_at;  // measured: 3.74e-7 at x = 2.5785
  EXPECT_EQ(erfc_vectorisable(12.f), 0.f);
  EXPECT_EQ(erfc_vectorisable(std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_EQ(erfc_vectorisable(-std::numeric_limits<float>::infinity()), 2.f);
  EXPECT_TRUE(std::isnan(erfc_vectorisable(std::nanf(""))));
}

}  // namespace
