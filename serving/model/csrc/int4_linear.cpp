// Weight-only int4 projections on a CPU: y = x W^T + bias for float32 activations x [rows, in] and a weight stored
// as 4-bit ints in groups along the inputs (`pylon.serving.model.quant`, engine.quantization int4):
//
//   W[o, i] = q[o, i] * scales[o, g] + mins[o, g],  g = i / group,  q in 0..15
//
// q is packed two to a byte in blocks of 32 inputs: byte 16b + j of a row holds input 32b + j in its low nibble and
// input 32b + 16 + j in its high nibble (so that one 16-byte load holds a block, split by a mask and a shift).
// Decodes are bound by the bytes of weight they read: a weight here is half a byte, plus 8 bytes of scale and min a
// group. Decodes of 1 or 2 rows widen each nibble to float32 in registers, times its group's scale, into float32
// accumulators of 4 output channels (as the int8 kernel does); the mins' part, the sum over groups of mins[o, g] x
// (the sum of x over group g), is added once per row and channel. More rows: 4 output channels at a time, their
// weights are dequantized (q * scale + min, in float32, 1,024 inputs at a time: 16 KiB that stay in L1) once, and
// every row's dot products read them from there, 2 rows at a time: the unpacking is paid once per weight whatever
// the rows.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYLON_INT4_AVX2 1
#endif

namespace {

constexpr int kOuts = 4;       // output channels a tile computes together
constexpr int kBlock = 32;     // inputs a packed block holds (16 bytes)
constexpr int64_t kChunk = 1024;  // inputs of a tile dequantized at a time (4 x 1024 floats: 16 KiB, in L1)

#ifdef PYLON_INT4_AVX2
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 unsigned bytes (the low 8 of v) widened to 8 floats.
static inline __m256 widen8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
#endif

// Decodes (1 or 2 rows): rows r0..r0+R-1 (R = 1 or 2) of output channels o0..o0+kOuts-1, each weight unpacked in
// registers as it is read (no store): sum over i of q[o, i] * scales[o, i / group] *
// x[r, i] into acc[j][r] (the mins' part is the caller's).
template <int R>
static inline void direct_tile(const float* x, int64_t r0, const uint8_t* q, const float* scales, int64_t o0,
                               int64_t in, int64_t group, float acc[kOuts][2]) {
  const int64_t row_bytes = in / 2, groups = in / group;
#ifdef PYLON_INT4_AVX2
  __m256 a[kOuts][R];
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) a[j][r] = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = g * group; b < (g + 1) * group; b += kBlock) {
      for (int j = 0; j < kOuts; ++j) {
        const __m256 s = _mm256_set1_ps(scales[(o0 + j) * groups + g]);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (o0 + j) * row_bytes + b / 2));
        const __m128i lo = _mm_and_si128(bytes, low);                     // inputs b .. b + 15
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);  // inputs b + 16 .. b + 31
        const __m256 w0 = _mm256_mul_ps(widen8(lo), s);
        const __m256 w1 = _mm256_mul_ps(widen8(_mm_srli_si128(lo, 8)), s);
        const __m256 w2 = _mm256_mul_ps(widen8(hi), s);
        const __m256 w3 = _mm256_mul_ps(widen8(_mm_srli_si128(hi, 8)), s);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + (r0 + r) * in + b;
          a[j][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a[j][r]);
          a[j][r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a[j][r]);
          a[j][r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a[j][r]);
          a[j][r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a[j][r]);
        }
      }
    }
  }
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = hsum(a[j][r]);
#else
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < in; ++i) {
        const uint8_t byte = q[(o0 + j) * row_bytes + (i / kBlock) * 16 + (i % kBlock) % 16];
        const int v = (i % kBlock) < 16 ? (byte & 0x0F) : (byte >> 4);
        sum += float(v) * scales[(o0 + j) * groups + i / group] * x[(r0 + r) * in + i];
      }
      acc[j][r] = sum;
    }
#endif
}

// Output channels o0..o0+kOuts-1, inputs c0..c0+n-1 (whole blocks): their weights dequantized into w
// [kOuts, kChunk] (q * scale + min, the same float32 arithmetic as the dequantized weight), once for every row.
static inline void dequantize_tile(const uint8_t* q, const float* scales, const float* mins, int64_t o0, int64_t in,
                                   int64_t group, int64_t c0, int64_t n, float* w) {
  const int64_t row_bytes = in / 2, groups = in / group;
  for (int j = 0; j < kOuts; ++j) {
    const uint8_t* qo = q + (o0 + j) * row_bytes;
    float* wj = w + j * kChunk;
    for (int64_t b = c0; b < c0 + n; b += kBlock) {
      const float s = scales[(o0 + j) * groups + b / group], m = mins[(o0 + j) * groups + b / group];
      float* out = wj + (b - c0);
#ifdef PYLON_INT4_AVX2
      const __m128i low = _mm_set1_epi8(0x0F);
      const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qo + b / 2));
      const __m128i lo = _mm_and_si128(bytes, low);                     // inputs b .. b + 15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);  // inputs b + 16 .. b + 31
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(widen8(lo), sv), mv));
      _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(widen8(_mm_srli_si128(lo, 8)), sv), mv));
      _mm256_storeu_ps(out + 16, _mm256_add_ps(_mm256_mul_ps(widen8(hi), sv), mv));
      _mm256_storeu_ps(out + 24, _mm256_add_ps(_mm256_mul_ps(widen8(_mm_srli_si128(hi, 8)), sv), mv));
#else
      for (int k = 0; k < 16; ++k) {
        const uint8_t byte = qo[b / 2 + k];
        out[k] = float(byte & 0x0F) * s + m;
        out[16 + k] = float(byte >> 4) * s + m;
      }
#endif
    }
  }
}

// Rows r0..r0+R-1 (R = 1 or 2) against the dequantized tile w (kOuts channels, n inputs from c0): the dot products
// added into acc[r][j].
template <int R>
static inline void dot_tile(const float* x, int64_t r0, int64_t in, int64_t c0, int64_t n, const float* w,
                            float* acc) {
  int64_t i = 0;
#ifdef PYLON_INT4_AVX2
  __m256 a[kOuts][R];
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) a[j][r] = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + (r0 + r) * in + c0 + i);
    for (int j = 0; j < kOuts; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * kChunk + i);
      for (int r = 0; r < R; ++r) a[j][r] = _mm256_fmadd_ps(wv, xv[r], a[j][r]);
    }
  }
  for (int j = 0; j < kOuts; ++j)
    for (int r = 0; r < R; ++r) acc[(r0 + r) * kOuts + j] += hsum(a[j][r]);
#endif
  for (; i < n; ++i)
    for (int j = 0; j < kOuts; ++j)
      for (int r = 0; r < R; ++r) acc[(r0 + r) * kOuts + j] += w[j * kChunk + i] * x[(r0 + r) * in + c0 + i];
}

// One output channel o over one row r, scalar (the channels past the last whole tile).
static inline float scalar_dot(const float* xr, const uint8_t* qo, const float* so, int64_t in, int64_t group) {
  float sum = 0.f;
  for (int64_t i = 0; i < in; ++i) {
    const uint8_t byte = qo[(i / kBlock) * 16 + (i % kBlock) % 16];
    const int v = (i % kBlock) < 16 ? (byte & 0x0F) : (byte >> 4);
    sum += float(v) * so[i / group] * xr[i];
  }
  return sum;
}

}  // namespace

at::Tensor int4_linear(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor mins, int64_t group,
                       c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int4_linear: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(group > 0 && group % kBlock == 0 && in % group == 0,
              "int4_linear: group must be a multiple of 32 that divides the inputs");
  TORCH_CHECK(q.dtype() == at::kByte && q.dim() == 2 && q.is_contiguous() && q.size(1) * 2 == in,
              "int4_linear: q must be a contiguous uint8 [out, in / 2] tensor matching x");
  const int64_t out = q.size(0), groups = in / group;
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() && scales.numel() == out * groups,
              "int4_linear: scales must be float32 [out, in / group]");
  TORCH_CHECK(mins.dtype() == at::kFloat && mins.is_contiguous() && mins.numel() == out * groups,
              "int4_linear: mins must be float32 [out, in / group]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
                "int4_linear: bias must be float32 [out]");
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = out / kOuts;
  // each row's sum of x over each group: the mins' part, for the decodes' kernel and the last channels (the tiles'
  // dequantized weights hold their mins)
  std::vector<float> xsum(rows <= 2 || out % kOuts ? rows * groups : 0, 0.f);
  for (int64_t r = 0; r < (xsum.empty() ? 0 : rows); ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) s += xp[r * in + i];
      xsum[r * groups + g] = s;
    }
  auto offset = [&](int64_t o, int64_t r) {  // sum over groups of mins[o, g] * xsum[r, g], and the bias
    float s = bp ? bp[o] : 0.f;
    for (int64_t g = 0; g < groups; ++g) s += mp[o * groups + g] * xsum[r * groups + g];
    return s;
  };
  if (rows <= 2) {  // decodes: bound by the weight's bytes, each unpacked in registers as it is read
    at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
      float acc[kOuts][2];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t o0 = t * kOuts;
        if (rows == 2)
          direct_tile<2>(xp, 0, qp, sp, o0, in, group, acc);
        else
          direct_tile<1>(xp, 0, qp, sp, o0, in, group, acc);
        for (int j = 0; j < kOuts; ++j)
          for (int r = 0; r < rows; ++r) yp[r * out + o0 + j] = acc[j][r] + offset(o0 + j, r);
      }
    });
  } else {  // more rows: each tile's weights dequantized once into L1, every row's dot products from there
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w(kOuts * kChunk), acc(rows * kOuts);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t o0 = t * kOuts;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t c0 = 0; c0 < in; c0 += kChunk) {
          const int64_t n = std::min<int64_t>(kChunk, in - c0);
          dequantize_tile(qp, sp, mp, o0, in, group, c0, n, w.data());
          for (int64_t r0 = 0; r0 < rows; r0 += 2) {
            if (rows - r0 >= 2)
              dot_tile<2>(xp, r0, in, c0, n, w.data(), acc.data());
            else
              dot_tile<1>(xp, r0, in, c0, n, w.data(), acc.data());
          }
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < kOuts; ++j) yp[r * out + o0 + j] = acc[r * kOuts + j] + (bp ? bp[o0 + j] : 0.f);
      }
    });
  }
  for (int64_t o = tiles * kOuts; o < out; ++o)  // the last out % kOuts channels
    for (int64_t r = 0; r < rows; ++r)
      yp[r * out + o] = scalar_dot(xp + r * in, qp + o * (in / 2), sp + o * groups, in, group) + offset(o, r);
  return y;
}

// The whole weight dequantized, [out, in] float32 (q * scale + min): for steps of many rows (prompt chunks), which
// then run as a float32 matmul.
at::Tensor int4_dequantize(at::Tensor q, at::Tensor scales, at::Tensor mins, int64_t group) {
  TORCH_CHECK(q.dtype() == at::kByte && q.dim() == 2 && q.is_contiguous(),
              "int4_dequantize: q must be uint8 [out, in / 2]");
  const int64_t out = q.size(0), in = q.size(1) * 2;
  TORCH_CHECK(group > 0 && group % kBlock == 0 && in % group == 0 && scales.numel() == out * (in / group) &&
                  mins.numel() == out * (in / group) && scales.dtype() == at::kFloat && mins.dtype() == at::kFloat &&
                  scales.is_contiguous() && mins.is_contiguous(),
              "int4_dequantize: scales and mins must be float32 [out, in / group]");
  at::Tensor w = at::empty({out, in}, scales.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  const int64_t tiles = out / kOuts;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(kOuts * kChunk);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c0 = 0; c0 < in; c0 += kChunk) {
        const int64_t n = std::min<int64_t>(kChunk, in - c0);
        dequantize_tile(qp, sp, mp, t * kOuts, in, group, c0, n, buffer.data());
        for (int j = 0; j < kOuts; ++j)
          std::copy(buffer.data() + j * kChunk, buffer.data() + j * kChunk + n, wp + (t * kOuts + j) * in + c0);
      }
  });
  for (int64_t o = tiles * kOuts; o < out; ++o)  // the last out % kOuts channels
    for (int64_t i = 0; i < in; ++i) {
      const uint8_t byte = qp[o * (in / 2) + (i / kBlock) * 16 + (i % kBlock) % 16];
      const int v = (i % kBlock) < 16 ? (byte & 0x0F) : (byte >> 4);
      wp[o * in + i] = float(v) * sp[o * (in / group) + i / group] + mp[o * (in / group) + i / group];
    }
  return w;
}

bool has_avx2() {
#ifdef PYLON_INT4_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "y = x W^T + bias, W 4-bit in groups (q * scale + min)", pybind11::arg("x"),
        pybind11::arg("q"), pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("group"),
        pybind11::arg("bias") = pybind11::none());
  m.def("int4_dequantize", &int4_dequantize, "the whole weight, [out, in] float32", pybind11::arg("q"),
        pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("group"));
  m.def("has_avx2", &has_avx2, "whether the vector loops are built");
}
