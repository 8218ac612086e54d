// One row of logits to one token, for sample_rows in cpu_decode_step.cpp (included there,
// inside its anonymous namespace, after <immintrin.h>, <cmath> and <algorithm>): torch's
// argmax and the inverse-CDF draw of filters.draw, each with an AVX-512 and an AVX2 body,
// the widest the CPU has taken at run time (the op library is built for any x86-64).
#pragma once

// The index of a row's largest value, the first of equals, as torch.argmax: a NaN counts
// as the largest (the first NaN wins).
int64_t row_argmax(const float* x, int64_t n) {
  int64_t best = 0;
  float top = x[0];
  if (std::isnan(top)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    const float v = x[j];
    if (v > top) {
      top = v;
      best = j;
    } else if (std::isnan(v)) {
      return j;
    }
  }
  return best;
}

constexpr int64_t kChunk = 64;

// A row's unnormalized weights e_j = exp(x_j * inv - max_k x_k * inv) (softmax at
// temperature 1 / inv without the division), their sums per kChunk tokens, and their
// total; -1 where the row has a NaN. Two passes (the maximum; the weights and sums) where
// at::softmax and then chunk sums took four and an op dispatch.
double row_weights_plain(const float* x, int64_t n, float inv, float* e, double* sums) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return -1;
    top = std::max(top, x[j]);
  }
  const float m = top * inv;  // x * inv is monotonic in x for inv > 0: the same maximum
  double total = 0;
  for (int64_t c = 0; c * kChunk < n; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    float sum = 0;
    for (int64_t j = c * kChunk; j < end; ++j) {
      e[j] = std::exp(x[j] * inv - m);
      sum += e[j];
    }
    sums[c] = sum;
    total += sum;
  }
  return total;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ACTORLLM_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

// exp16_le0 and lanes_left, shared with the decode kernel; here they target AVX-512 alone.
#define ACTORLLM_EXP16_TARGET ACTORLLM_AVX512
#include "cpu_exp16.h"

// row_weights_plain sixteen tokens at a time (the op library is built for any x86-64,
// so this function alone targets AVX-512, taken where the CPU has it).
ACTORLLM_AVX512 double row_weights_avx512(const float* x, int64_t n, float inv, float* e,
                                          double* sums) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = lanes_left(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_mask_max_ps(top, k, top, v);
  }
  if (nan) return -1;
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top) * inv), vinv = _mm512_set1_ps(inv);
  double total = 0;
  for (int64_t c = 0; c * kChunk < n; ++c) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); j += 16) {
      const __mmask16 k = lanes_left(n - j);
      const __m512 w = _mm512_maskz_mov_ps(
          k, exp16_le0(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + j), vinv), m)));
      _mm512_mask_storeu_ps(e + j, k, w);
      sum = _mm512_add_ps(sum, w);
    }
    sums[c] = _mm512_reduce_add_ps(sum);
    total += sums[c];
  }
  return total;
}

// row_argmax sixteen tokens at a time: the maximum and whether any NaN in one pass, then
// the first index holding it (or the first NaN) in a second that stops there. The scalar
// loop's compare and NaN branch per token made greedy rows cost more than drawn ones
// (240 rows of 4096: 0.87 ms against 0.52, one thread; now 0.23).
ACTORLLM_AVX512 int64_t row_argmax_avx512(const float* x, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n && !nan; j += 16) {
    const __mmask16 k = lanes_left(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + j);
    nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
    top = _mm512_mask_max_ps(top, k, top, v);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = lanes_left(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + j);
    const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q)
                              : _mm512_mask_cmp_ps_mask(k, v, m, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is one of the row's values
}

#define ACTORLLM_AVX2 __attribute__((target("avx2,fma")))
#define ACTORLLM_EXP8_TARGET ACTORLLM_AVX2
#include "cpu_exp8.h"

// Eight floats from x + j, of which the first n - j (all eight from 8 on) are live; only a
// row's last, partial vector takes the masked load. In row_weights_avx2 this measured
// 0.76-0.78 against 0.81-0.85 ms with every load masked (240 rows of 4096, one thread, one
// run each on a noisy Zen 3: the store below is what mattered); row_argmax_avx2 keeps its
// masked loads, which this made slower (0.26 against 0.21 ms).
ACTORLLM_AVX2 inline __m256 load8(const float* x, int64_t j, int64_t n) {
  return n - j >= 8 ? _mm256_loadu_ps(x + j) : _mm256_maskload_ps(x + j, lanes8(n - j));
}

// row_weights_plain eight tokens at a time, the last n % 8 in masked lanes: the AVX-512
// body's weights (the same polynomial), summed in another order. Full vectors are stored
// plainly and only the last, partial one with vmaskmovps, whose store form Zen 3 runs far
// slower than a plain store: storing every vector that way made the draw 1.6x slower
// (240 rows of 4096, the near-zero model of benchmarks/host_overhead.py).
ACTORLLM_AVX2 double row_weights_avx2(const float* x, int64_t n, float inv, float* e,
                                      double* sums) {
  __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 v = load8(x, j, n), live = _mm256_castsi256_ps(lanes8(n - j));
    nan = _mm256_or_ps(nan, _mm256_and_ps(live, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    top = _mm256_blendv_ps(top, _mm256_max_ps(top, v), live);
  }
  if (_mm256_movemask_ps(nan)) return -1;
  const __m256 m = _mm256_set1_ps(max8(top) * inv), vinv = _mm256_set1_ps(inv);
  double total = 0;
  for (int64_t c = 0; c * kChunk < n; ++c) {
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); j += 8) {
      const __m256i k = lanes8(n - j);
      const __m256 w = _mm256_and_ps(
          _mm256_castsi256_ps(k), exp8_le0(_mm256_sub_ps(_mm256_mul_ps(load8(x, j, n), vinv), m)));
      if (n - j >= 8)
        _mm256_storeu_ps(e + j, w);
      else
        _mm256_maskstore_ps(e + j, k, w);
      sum = _mm256_add_ps(sum, w);
    }
    sums[c] = sum8(sum);
    total += sums[c];
  }
  return total;
}

// row_argmax_avx512's two passes on eight lanes.
ACTORLLM_AVX2 int64_t row_argmax_avx2(const float* x, int64_t n) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int nan = 0;
  for (int64_t j = 0; j < n && !nan; j += 8) {
    const __m256i k = lanes8(n - j);
    const __m256 v = _mm256_maskload_ps(x + j, k), live = _mm256_castsi256_ps(k);
    nan |= _mm256_movemask_ps(_mm256_and_ps(live, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    top = _mm256_blendv_ps(top, _mm256_max_ps(top, v), live);
  }
  const __m256 m = _mm256_set1_ps(max8(top));
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i k = lanes8(n - j);
    const __m256 v = _mm256_maskload_ps(x + j, k);
    const __m256 eq = nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, m, _CMP_EQ_OQ);
    const int hit = _mm256_movemask_ps(_mm256_and_ps(_mm256_castsi256_ps(k), eq));
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is one of the row's values
}
#endif

// The widest vector body the draw takes: 2 AVX-512, 1 AVX2, 0 the plain loops. What the
// CPU has, unless capped (cap_vector_isa: tests run every body on one machine).
std::atomic<int> isa_cap{2};

int cpu_vector_isa() {
#ifdef ACTORLLM_AVX512
  static const int widest = [] {
    __builtin_cpu_init();  // may run before libgcc's own initialisation did
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
  }();
  return widest;
#else
  return 0;
#endif
}

int vector_isa() { return std::min(cpu_vector_isa(), isa_cap.load(std::memory_order_relaxed)); }

int64_t row_argmax_fast(const float* x, int64_t n) {
#ifdef ACTORLLM_AVX512
  switch (vector_isa()) {
    case 2: return row_argmax_avx512(x, n);
    case 1: return row_argmax_avx2(x, n);
  }
#endif
  return row_argmax(x, n);
}

double row_weights(const float* x, int64_t n, float inv, float* e, double* sums) {
#ifdef ACTORLLM_AVX512
  switch (vector_isa()) {
    case 2: return row_weights_avx512(x, n, inv, e, sums);
    case 1: return row_weights_avx2(x, n, inv, e, sums);
  }
#endif
  return row_weights_plain(x, n, inv, e, sums);
}

// The inverse-CDF draw of filters.draw over one row of logits x at temperature 1 / inv:
// the first j whose cumulative weight reaches u * total, u in (0, 1]. Chunk sums find the
// chunk and a scan inside it the token, so a row costs two passes, not a full cumsum. A
// token of weight 0 is never drawn (the mass before it already fell short). -1 where the
// row has no finite positive total (a NaN, +inf, every token masked): the caller takes
// the argmax, as it did when softmax gave NaNs.
int64_t row_draw(const float* x, int64_t n, float inv, float u, float* e, double* sums) {
  const double total = row_weights(x, n, inv, e, sums);
  if (!(total > 0) || !std::isfinite(total)) return -1;
  const double target = static_cast<double>(u) * total;
  double acc = 0;
  int64_t last = -1;  // the last token of positive weight seen, should rounding fall short
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < chunks; ++c) {
    if (acc + sums[c] < target) {
      acc += sums[c];
      continue;
    }
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t j = c * kChunk; j < end; ++j) {
      if (e[j] > 0) last = j;
      acc += e[j];
      if (acc >= target && e[j] > 0) return j;
    }
  }
  if (last >= 0) return last;
  for (int64_t j = n - 1; j >= 0; --j)
    if (e[j] > 0) return j;
  return -1;
}

