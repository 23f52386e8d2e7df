// The weight dtypes packed_linear.cpp reads (float32, float16, bfloat16) and how a panel's 16 columns widen to
// float32: one value at a time (the scalar loop) or 16 at a time into two AVX2 registers (the vector blocks).
// Every widening is exact, so a weight held narrow gives the float32 weight's products bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SAGUARO_AVX2 1
#endif

namespace saguaro {

constexpr int64_t NB = 16;  // output columns per panel

struct Half { uint16_t bits; };   // float16, as stored
struct Brain { uint16_t bits; };  // bfloat16, as stored

inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(float v) { return v; }
inline float widen(Brain v) { return from_bits(uint32_t{v.bits} << 16); }
inline float widen(Half v) {  // exact: every float16 value is a float32 value
  uint32_t sign = uint32_t{v.bits & 0x8000u} << 16, exponent = (v.bits >> 10) & 0x1f, mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1f) return from_bits(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return from_bits(sign);
  int shift = 0;  // subnormal: normalise
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  return from_bits(sign | uint32_t(113 - shift) << 23 | ((mantissa & 0x3ffu) << 13));
}

#ifdef SAGUARO_AVX2
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const Half* p, __m256& lo, __m256& hi) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
inline void load16(const Brain* p, __m256& lo, __m256& hi) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
}

inline void store16(float* out, __m256 lo, __m256 hi, int64_t cols) {
  if (cols == NB) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  } else {
    alignas(32) float tmp[NB];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    std::memcpy(out, tmp, cols * sizeof(float));
  }
}
#endif

}  // namespace saguaro
