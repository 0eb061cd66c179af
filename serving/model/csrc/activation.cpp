#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "cpu_vec.h"
#include "ops.h"

// GPT-2's GELU, the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in place. Written as
// x * sigmoid(2u) = x / (1 + exp(-2u)), which is the same function: one exponential and one division per
// element. torch's CPU `gelu(approximate="tanh")` runs at ~0.3 G elements/s here (its tanh is the slow part),
// ~5% of a decoding step; this runs at several G elements/s. Results agree within a few float ulps.
void gelu_tanh_(at::Tensor x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "gelu_tanh_: a contiguous float32 CPU tensor");
  float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__) || defined(PYLON_AVX2)
    using R = Vec::R;
    const R c0 = Vec::set1(-2.f * 0.7978845608028654f), c1 = Vec::set1(0.044715f), one = Vec::set1(1.f);
    for (; i + Vec::W <= end; i += Vec::W) {
      const R v = Vec::load(p + i);
      const R inner = Vec::fmadd(Vec::mul(c1, v), Vec::mul(v, v), v);  // x + 0.044715 x^3
      Vec::store(p + i, Vec::div(v, Vec::add(one, Vec::exp(Vec::mul(c0, inner)))));
    }
#endif
    for (; i < end; ++i) {
      const float v = p[i];
      p[i] = v / (1.f + std::exp(-2.f * 0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
  });
}
