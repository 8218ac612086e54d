/* exp(x) for x <= 0 on eight AVX2 lanes, the lanes of a loop's last elements, and a
 * vector's largest and summed lane: the AVX2 counterparts of cpu_exp16.h, for the decode
 * op's draw (cpu_sample_rows.h) on CPUs without AVX-512 (AMD Zen 3, many Intel client
 * parts), where the plain loop's libm exp per token was a quarter of an offline run's CPU
 * time at temperature 1 (issue 28). The op library is built for any x86-64, so the
 * includer defines ACTORLLM_EXP8_TARGET as an AVX2 target attribute first.
 *
 * The steps are those of the scalar exp_le0 in cpu_paged_decode.c. AVX2 has no scalef,
 * so 2^n is built in the exponent bits, as the scalar code does; the clamp at -87 keeps
 * n >= -126, a normal float. 0 below -87 and for NaN lanes (the caller's concern). The
 * decode kernel itself has no AVX2 steps: built with -march=native, gcc vectorizes its
 * portable loops for AVX2 well enough (hand-written AVX2 steps measured within noise of
 * them on Zen 3, the kernel being bound by reading the cache). */
#ifndef ACTORLLM_CPU_EXP8_H
#define ACTORLLM_CPU_EXP8_H

#include <immintrin.h>
#include <stdint.h>

#ifndef ACTORLLM_EXP8_TARGET
#define ACTORLLM_EXP8_TARGET
#endif

static inline ACTORLLM_EXP8_TARGET __m256 exp8_le0(__m256 x) {
    const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* All ones in the lanes of the last `left` elements of a loop (all eight from 8 on). */
static inline ACTORLLM_EXP8_TARGET __m256i lanes8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The largest and the sum of a vector's eight lanes. */
static inline ACTORLLM_EXP8_TARGET float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline ACTORLLM_EXP8_TARGET float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif
