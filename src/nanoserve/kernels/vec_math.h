/* Branch-free float32 exp and log that GCC vectorizes, a vector's horizontal sum and an 8 x 8 transpose,
 * shared by the C kernels. */
#ifndef NANOSERVE_VEC_MATH_H
#define NANOSERVE_VEC_MATH_H

#include "simd.h"
#include <math.h>
#include <stdint.h>

/* The sum of the 8 lanes of v. */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight vectors of eight 4-byte lanes transposed: out[k] lane n = in[n] lane k (the int8 GEMMs' layout of
 * 8 weight rows side by side, one per 32-bit lane; the float32 GEMM's panels of x). */
static inline void transpose8x32(const __m256i *in, __m256i *out) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(in[i], in[i + 1]);     /* n=i,i+1 at k 0,1 | 4,5 */
        a[i + 1] = _mm256_unpackhi_epi32(in[i], in[i + 1]); /* k 2,3 | 6,7 */
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            b[i + h] = _mm256_unpacklo_epi64(a[i + h], a[i + 2 + h]);     /* n=i..i+3 at k 2h | 2h+4 */
            b[i + 2 + h] = _mm256_unpackhi_epi64(a[i + h], a[i + 2 + h]); /* k 2h+1 | 2h+5 */
        }
    /* b[i + q] (i = 0, 4) holds rows i..i+3 of steps kq and kq + 4, kq = 0, 2, 1, 3 for q = 0..3 */
    static const int kq[4] = {0, 2, 1, 3};
    for (int q = 0; q < 4; q++) {
        out[kq[q]] = _mm256_permute2x128_si256(b[q], b[4 + q], 0x20);
        out[kq[q] + 4] = _mm256_permute2x128_si256(b[q], b[4 + q], 0x31);
    }
}

/* log(x) for finite x > 0 (normal floats), branch-free so that loops over it vectorize; the Cephes
 * polynomial, about 1e-7 relative error. */
static inline float fast_logf(float x) {
    union { float f; int32_t i; } v = { x };
    int32_t e = ((v.i >> 23) & 0xff) - 127;
    v.i = (v.i & 0x007fffff) | 0x3f800000; /* mantissa in [1, 2) */
    float m = v.f;
    int big = m > 1.41421356f;
    m = big ? m * 0.5f : m;
    e += big;
    float f = m - 1.0f, z = f * f;
    float y = 7.0376836292e-2f;
    y = y * f - 1.1514610310e-1f;
    y = y * f + 1.1676998740e-1f;
    y = y * f - 1.2420140846e-1f;
    y = y * f + 1.4249322787e-1f;
    y = y * f - 1.6668057665e-1f;
    y = y * f + 2.0000714765e-1f;
    y = y * f - 2.4999993993e-1f;
    y = y * f + 3.3333331174e-1f;
    y = y * f * z - 0.5f * z;
    return f + y + 0.693147180559945f * (float)e;
}

/* exp(x), branch-free: 2^n * exp(r) with |r| <= ln(2) / 2 and the Cephes polynomial, about 2e-7
 * relative error; x <= -87 (and -inf) gives 0, x above 88 gives exp(88). */
static inline float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = floorf(x * 1.44269504089f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    union { float f; int32_t i; } v = { .i = ((int32_t)n + 127) << 23 };
    return x <= -87.0f ? 0.0f : y * v.f;
}

/* fast_expf on 8 lanes with intrinsics (GCC's vectorization of the scalar version needs many blends
 * and spills): the same range reduction and polynomial, so the same values up to FMA rounding. */
static inline __m256 fast_exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LE_OQ); /* also -inf */
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504089f), _mm256_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

#endif
