// saguaro_kernels::masked_attention(q [B, G, R, D], k [B, G, S, D], v [B, G, S, D], bias [B, 1, R, S], scale)
//   -> [B, G, R, D], all float32
//
// The attention of a few query rows per KV head over a KV store: softmax(q . k * scale + bias) . v, as
// torch's scaled_dot_product_attention computes it with an additive mask (masked_attention.py). It is written
// for decode stages, where SDPA's CPU kernel spends most of a call setting up blocks over the whole store
// (60 us for 6 rows over 256 slots, 14 us for one row of a small draft): this kernel reads only the slots the
// bias leaves visible (-inf marks the others), keeps each row's logits in a buffer, and takes the
// exponentials eight at a time. The rows of a head take K and V block by block (a block stays in L1 while
// every row reads it): 1.2-1.3x a row-at-a-time loop at a verify's six rows, the same bits. Results equal
// SDPA's up to float rounding (another summation order, an exponential within 2 ulp). A row that sees no slot
// gets zeros. The vector path needs AVX2 + FMA; any other machine runs the scalar loop.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "stable_tensors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SAGUARO_ATTENTION_AVX2 1
#endif

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t R, S, D;
};

#ifdef SAGUARO_ATTENTION_AVX2
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (the logits less their maximum), eight at a time: x = n ln2 + f, e^f by a degree-6
// polynomial (Cephes' expf coefficients), 2^n in the exponent bits; below -87 the result is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  __m256 zero_mask = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                             _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, f), f, _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(zero_mask, y);
}
#endif

// A row's logits -> exp(logit - maximum) in place; returns 1 / their sum (0 for a row that sees no slot).
float softmax_weights(float* row, int64_t S, float maximum) {
  if (maximum == NEG_INF) {
    std::fill(row, row + S, 0.f);
    return 0.f;
  }
  float total = 0.f;
  int64_t s = 0;
#ifdef SAGUARO_ATTENTION_AVX2
  __m256 sum = _mm256_setzero_ps(), m = _mm256_set1_ps(maximum);
  for (; s + 8 <= S; s += 8) {
    __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + s), m));  // -inf - m: below -87, so 0
    _mm256_storeu_ps(row + s, p);
    sum = _mm256_add_ps(sum, p);
  }
  total = horizontal_sum(sum);
#endif
  for (; s < S; ++s) {
    float p = row[s] == NEG_INF ? 0.f : std::exp(row[s] - maximum);
    row[s] = p;
    total += p;
  }
  return 1.f / total;
}

// One row's logits over every slot (-inf where the bias is); returns their maximum. Scalar loop: any D.
float logits_scalar(const float* q, const float* k, const float* bias, float scale, const Shape& n, float* logits) {
  float maximum = NEG_INF;
  for (int64_t s = 0; s < n.S; ++s) {
    if (bias[s] == NEG_INF) {
      logits[s] = NEG_INF;
      continue;
    }
    float dot = 0.f;
    for (int64_t d = 0; d < n.D; ++d) dot = std::fma(q[d], k[s * n.D + d], dot);
    logits[s] = dot * scale + bias[s];
    maximum = std::max(maximum, logits[s]);
  }
  return maximum;
}

// out[:] = sum_s weights[s] v[s, :] * inverse, slots of zero weight skipped. Scalar loop: any D.
void values_scalar(const float* v, const float* weights, float inverse, const Shape& n, float* out) {
  std::fill(out, out + n.D, 0.f);
  for (int64_t s = 0; s < n.S; ++s)
    if (weights[s] != 0.f)
      for (int64_t d = 0; d < n.D; ++d) out[d] = std::fma(weights[s], v[s * n.D + d], out[d]);
  for (int64_t d = 0; d < n.D; ++d) out[d] *= inverse;
}

#ifdef SAGUARO_ATTENTION_AVX2
// Eight vectors' sums in one: lane j of the result is the sum of a[j]'s lanes.
inline __m256 sums_of_eight(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Slots per block of K and V that the rows of a head take in turn: a block of 16 KiB stays in L1 while every row
// reads it, where one row after another over the whole store read K and V from L2 once per row (the cost of a
// verify's six rows).
inline int64_t block_slots(int64_t D) { return std::max<int64_t>(8, (4096 / D) / 8 * 8); }

// Every row's logits over slots [s0, s1) (a multiple of eight), eight slots at a time (D = 8 NC), blocks the bias
// hides whole skipped; maxima: eight running maxima per row.
template <int NC>
void logits_block(const float* q, const float* k, const float* bias, float scale, const Shape& n, int64_t s0,
                  int64_t s1, float* logits, float* maxima) {
  constexpr int64_t D = 8 * NC;
  const __m256 neg_inf = _mm256_set1_ps(NEG_INF), sc = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < n.R; ++r) {
    __m256 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(q + r * D + 8 * c);
    const float* row_bias = bias + r * n.S;
    float* row_logits = logits + r * n.S;
    __m256 row_max = _mm256_loadu_ps(maxima + 8 * r);
    for (int64_t s = s0; s < s1; s += 8) {
      __m256 b = _mm256_loadu_ps(row_bias + s);
      if (_mm256_movemask_ps(_mm256_cmp_ps(b, neg_inf, _CMP_NEQ_OQ)) == 0) {
        _mm256_storeu_ps(row_logits + s, neg_inf);
        continue;
      }
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) {
        const float* ks = k + (s + j) * D;
        __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(ks));
        for (int c = 1; c < NC; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(ks + 8 * c), a);
        acc[j] = a;
      }
      __m256 l = _mm256_fmadd_ps(sums_of_eight(acc), sc, b);  // a hidden slot: finite + -inf = -inf
      _mm256_storeu_ps(row_logits + s, l);
      row_max = _mm256_max_ps(row_max, l);
    }
    _mm256_storeu_ps(maxima + 8 * r, row_max);
  }
}

// acc[r, :] += sum over slots [s0, s1) of weights[r, s] v[s, :] (D = 8 NC), slots in order, zero weights skipped.
template <int NC>
void values_block(const float* v, const float* weights, const Shape& n, int64_t s0, int64_t s1, float* acc_rows) {
  constexpr int64_t D = 8 * NC;
  for (int64_t r = 0; r < n.R; ++r) {
    const float* w = weights + r * n.S;
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(acc_rows + r * D + 8 * c);
    for (int64_t s = s0; s < s1; ++s) {
      if (w[s] == 0.f) continue;
      __m256 ws = _mm256_set1_ps(w[s]);
      const float* vs = v + s * D;
      for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(vs + 8 * c), acc[c]);
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc_rows + r * D + 8 * c, acc[c]);
  }
}

// The rows of one head: logits block by block (each block of K read once for all rows), a softmax per row, then
// the values block by block. Per row the arithmetic and its order are a row-at-a-time loop's. scratch: R S logits,
// 8 R maxima, R D accumulators, R inverses.
template <int NC>
void rows_vector(const float* q, const float* k, const float* v, const float* bias, float scale, const Shape& n,
                 float* out, float* scratch) {
  constexpr int64_t D = 8 * NC;
  float* logits = scratch;
  float* maxima = logits + n.R * n.S;
  float* acc_rows = maxima + 8 * n.R;
  float* inverses = acc_rows + n.R * D;
  std::fill(maxima, maxima + 8 * n.R, NEG_INF);
  std::fill(acc_rows, acc_rows + n.R * D, 0.f);
  const int64_t block = block_slots(D), vector_end = n.S / 8 * 8;
  for (int64_t s = 0; s < vector_end; s += block)
    logits_block<NC>(q, k, bias, scale, n, s, std::min(s + block, vector_end), logits, maxima);
  for (int64_t r = 0; r < n.R; ++r) {
    float maximum = *std::max_element(maxima + 8 * r, maxima + 8 * r + 8);
    Shape rest{n.R, n.S - vector_end, n.D};
    if (rest.S > 0)
      maximum = std::max(maximum, logits_scalar(q + r * D, k + vector_end * D, bias + r * n.S + vector_end, scale,
                                                rest, logits + r * n.S + vector_end));
    inverses[r] = softmax_weights(logits + r * n.S, n.S, maximum);
  }
  for (int64_t s = 0; s < n.S; s += block) values_block<NC>(v, logits, n, s, std::min(s + block, n.S), acc_rows);
  for (int64_t r = 0; r < n.R; ++r) {
    __m256 inv = _mm256_set1_ps(inverses[r]);
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(out + r * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc_rows + r * D + 8 * c), inv));
  }
}
#endif

// One (batch row, KV head): q [R, D], k and v [S, D], bias [R, S], out [R, D]; scratch: scratch_floats(n).
void head(const float* q, const float* k, const float* v, const float* bias, float scale, const Shape& n,
          float* out, float* scratch) {
  float* logits = scratch;
#ifdef SAGUARO_ATTENTION_AVX2
  switch (n.D) {
    case 16: return rows_vector<2>(q, k, v, bias, scale, n, out, scratch);
    case 32: return rows_vector<4>(q, k, v, bias, scale, n, out, scratch);
    case 64: return rows_vector<8>(q, k, v, bias, scale, n, out, scratch);
    case 128: return rows_vector<16>(q, k, v, bias, scale, n, out, scratch);
    default: break;
  }
#endif
  for (int64_t r = 0; r < n.R; ++r) {
    float maximum = logits_scalar(q + r * n.D, k, bias + r * n.S, scale, n, logits);
    float inverse = softmax_weights(logits, n.S, maximum);
    values_scalar(v, logits, inverse, n, out + r * n.D);
  }
}

// Scratch floats of one head: the vector path's R S logits, 8 R maxima, R D accumulators and R inverses (the
// scalar loop uses the first S).
int64_t scratch_floats(const Shape& n) { return n.R * n.S + 8 * n.R + n.R * n.D + n.R; }

void check(bool ok, const char* message) {
  if (!ok) throw std::runtime_error(message);
}

torch::stable::Tensor masked_attention(torch::stable::Tensor q_in, torch::stable::Tensor k_in,
                                       torch::stable::Tensor v_in, torch::stable::Tensor bias_in, double scale) {
  using torch::headeronly::ScalarType;
  for (const auto* t : {&q_in, &k_in, &v_in, &bias_in})
    check(t->dim() == 4 && t->scalar_type() == ScalarType::Float, "masked_attention: every tensor must be 4-D float32");
  const int64_t B = q_in.size(0), G = q_in.size(1), R = q_in.size(2), D = q_in.size(3), S = k_in.size(2);
  check(k_in.size(0) == B && k_in.size(1) == G && k_in.size(3) == D, "masked_attention: k must be [B, G, S, D] of q's");
  check(v_in.size(0) == B && v_in.size(1) == G && v_in.size(2) == S && v_in.size(3) == D,
        "masked_attention: v must be k's shape");
  check(bias_in.size(0) == B && bias_in.size(1) == 1 && bias_in.size(2) == R && bias_in.size(3) == S,
        "masked_attention: bias must be [B, 1, R, S]");
  torch::stable::Tensor q = saguaro::contiguous_of(q_in), k = saguaro::contiguous_of(k_in);
  torch::stable::Tensor v = saguaro::contiguous_of(v_in), bias = saguaro::contiguous_of(bias_in);
  torch::stable::Tensor out = saguaro::new_float(q, {B, G, R, D});
  if (B * G * R * D == 0) return out;
  const float* qp = static_cast<const float*>(q.const_data_ptr());
  const float* kp = static_cast<const float*>(k.const_data_ptr());
  const float* vp = static_cast<const float*>(v.const_data_ptr());
  const float* bp = static_cast<const float*>(bias.const_data_ptr());
  float* op = static_cast<float*>(out.mutable_data_ptr());
  const Shape n{R, S, D};
  const float fscale = static_cast<float>(scale);
  // grain: about 128K multiply-adds a task, so a small draft's heads stay on one thread (a draft step's 4 heads of
  // one row over 256 slots took as long on two threads as on one, and paid the second thread's start)
  int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, 2 * R * S * D));
  torch::stable::parallel_for(0, B * G, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_floats(n));
    for (int64_t i = begin; i < end; ++i) {
      int64_t b = i / G;
      head(qp + i * R * D, kp + i * S * D, vp + i * S * D, bp + b * R * S, fscale, n, op + i * R * D, scratch.data());
    }
  });
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(saguaro_kernels, m) {
  m.def("masked_attention(Tensor q, Tensor k, Tensor v, Tensor bias, float scale) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(saguaro_kernels, CPU, m) { m.impl("masked_attention", TORCH_BOX(&masked_attention)); }
