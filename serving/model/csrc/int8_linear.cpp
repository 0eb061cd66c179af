// Weight-only int8 projections on a CPU: y = x w^T * scale + bias for float32 activations x [rows, in], int8
// weights w [out, in] and one float32 scale per output channel (`pylon.serving.model.quant`).
//
// Decodes are bound by the bytes of weight they read; an int8 weight is a quarter of a float32 one. Each int8 lane is
// widened to float32 in registers (never in memory) and multiplied into float32 accumulators: 4 output channels at a
// time, over 2 rows at a time, so that 4 channels' weights (4 x in bytes) stay in L1 while every row pair reads them.
// torch's own `_weight_int8pack_mm` runs a scalar loop on CPUs without AVX-512 (~10x slower than float32 here).
// The caller sends steps of many rows (prompt chunks) to a float32 matmul over a dequantized weight instead.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYLON_INT8_AVX2 1
#endif

namespace {

constexpr int kOuts = 4;  // output channels a tile computes together

#ifdef PYLON_INT8_AVX2
// 8 int8 weights widened to 8 floats.
static inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Rows r0..r0+R-1 (R = 1 or 2) of output channels o0..o0+kOuts-1: the raw dot products into acc[j][r].
template <int R>
static inline void tile(const float* x, int64_t r0, const int8_t* w, int64_t o0, int64_t in, float acc[kOuts][2]) {
  int64_t i = 0;
#ifdef PYLON_INT8_AVX2
  __m256 a[kOuts][R];
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) a[j][r] = _mm256_setzero_ps();
  for (; i + 8 <= in; i += 8) {
    __m256 wv[kOuts];
    for (int j = 0; j < kOuts; ++j) wv[j] = widen8(w + (o0 + j) * in + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (r0 + r) * in + i);
      for (int j = 0; j < kOuts; ++j) a[j][r] = _mm256_fmadd_ps(wv[j], xv, a[j][r]);
    }
  }
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = hsum(a[j][r]);
#else
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
#endif
  for (; i < in; ++i)
    for (int j = 0; j < kOuts; ++j)
      for (int r = 0; r < R; ++r) acc[j][r] += float(w[(o0 + j) * in + i]) * x[(r0 + r) * in + i];
}

}  // namespace

at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scales, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int8_linear: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(w.dtype() == at::kChar && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "int8_linear: w must be a contiguous int8 [out, in] tensor matching x");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() && scales.numel() == w.size(0),
              "int8_linear: scales must be float32 [out]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "int8_linear: bias must be float32 [out]");
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = out / kOuts;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    float acc[kOuts][2];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * kOuts;
      for (int64_t r0 = 0; r0 < rows; r0 += 2) {
        const int R = rows - r0 >= 2 ? 2 : 1;
        if (R == 2)
          tile<2>(xp, r0, wp, o0, in, acc);
        else
          tile<1>(xp, r0, wp, o0, in, acc);
        for (int j = 0; j < kOuts; ++j)
          for (int r = 0; r < R; ++r)
            yp[(r0 + r) * out + o0 + j] = acc[j][r] * sp[o0 + j] + (bp ? bp[o0 + j] : 0.f);
      }
    }
  });
  for (int64_t o = tiles * kOuts; o < out; ++o)  // the last out % kOuts channels
    for (int64_t r = 0; r < rows; ++r) {
      float s = 0.f;
      for (int64_t i = 0; i < in; ++i) s += float(wp[o * in + i]) * xp[r * in + i];
      yp[r * out + o] = s * sp[o] + (bp ? bp[o] : 0.f);
    }
  return y;
}

bool has_avx2() {
#ifdef PYLON_INT8_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = x w^T * scales + bias, int8 w [out, in]", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("scales"), pybind11::arg("bias") = pybind11::none());
  m.def("has_avx2", &has_avx2, "whether the vector loops are built");
}
