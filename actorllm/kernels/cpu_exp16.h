/* exp(x) for x <= 0 on sixteen AVX-512 lanes, and the mask of a loop's last lanes: shared
 * by the decode kernel (cpu_paged_decode.c, C, built with -march=native, where it is
 * included under __AVX512F__) and the decode op's draw (cpu_decode_step.cpp, C++, built
 * for any x86-64, where only the functions that call these target AVX-512: it defines
 * ACTORLLM_EXP16_TARGET as that target attribute before including this file).
 *
 * The steps are those of cpu_paged_decode.c's scalar exp_le0: 2^n, applied by scalef,
 * times a degree-6 polynomial of the remainder; 0 below -87, relative error a few 1e-7.
 * NaN lanes are the caller's concern. Build caches hash this file with the sources
 * (ops/cpu_backend.build_library). */
#ifndef ACTORLLM_CPU_EXP16_H
#define ACTORLLM_CPU_EXP16_H

#include <immintrin.h>
#include <stdint.h>

#ifndef ACTORLLM_EXP16_TARGET
#define ACTORLLM_EXP16_TARGET
#endif

static inline ACTORLLM_EXP16_TARGET __m512 exp16_le0(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_floor_ps(
        _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)));
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* The lanes of the last `left` (< 16) elements of a loop, or all sixteen. */
static inline ACTORLLM_EXP16_TARGET __mmask16 lanes_left(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

#endif
