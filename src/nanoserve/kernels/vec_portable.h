/* Plain-C definitions of the AVX2 / FMA / F16C intrinsics the kernels use, for the portable build
 * (any CPU the compiler targets: ARM, x86 without AVX2). The same kernel sources then compile to scalar
 * loops with the same operations, in the same order, with the same rounding (round-to-nearest-even
 * conversions; a fused multiply-add where the CPU has one), so the portable build computes what the
 * vector build does; it is tested against the PyTorch references like the vector build. Lanes are
 * arrays. */
#ifndef NANOSERVE_VEC_PORTABLE_H
#define NANOSERVE_VEC_PORTABLE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { float f[8]; } __m256;
typedef struct { float f[4]; } __m128;
typedef union { int8_t b[32]; uint8_t ub[32]; int16_t h[16]; int32_t i[8]; uint32_t u[8]; } __m256i;
typedef union { int8_t b[16]; uint8_t ub[16]; int16_t h[8]; uint16_t uh[8]; int32_t i[4]; int64_t q[2]; } __m128i;

#define NS_LANES(n) for (int l = 0; l < (n); l++)
#define NS_INLINE static inline

/* Comparison predicates (ordered, quiet: false when either side is NaN) and rounding modes. */
#define _CMP_EQ_OQ 0x00
#define _CMP_LE_OQ 0x12
#define _CMP_GE_OQ 0x1d
#define _CMP_GT_OQ 0x1e
#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_TO_NEG_INF 0x01
#define _MM_FROUND_TO_POS_INF 0x02
#define _MM_FROUND_TO_ZERO 0x03
#define _MM_FROUND_NO_EXC 0x08
#define _MM_HINT_T0 3
#define _MM_HINT_T1 2
#define _mm_prefetch(p, hint) __builtin_prefetch((const void *)(p), 0, hint)

/* ---------------------------------------------------------------- float16 <-> float32, exactly */
NS_INLINE float _cvtsh_ss(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        const float f = (float)m * (1.0f / 16777216.0f); /* subnormal: m * 2^-24, exact */
        return sign ? -f : f;
    }
    const uint32_t x = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* Round to nearest, ties to even (the only mode the kernels ask for). */
NS_INLINE uint16_t _cvtss_sh(float f, int rounding) {
    (void)rounding;
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: infinity */
    if (a < 0x38800000u) {                                /* below 2^-14: a subnormal half */
        float af;
        memcpy(&af, &a, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(af * 16777216.0f));
    }
    uint32_t h = ((a >> 23) - 112) << 10 | ((a & 0x7fffff) >> 13);
    const uint32_t rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

/* ---------------------------------------------------------------- 8 floats */
NS_INLINE __m256 _mm256_setzero_ps(void) { __m256 r = {{0}}; return r; }
NS_INLINE __m256 _mm256_set1_ps(float v) { __m256 r; NS_LANES(8) r.f[l] = v; return r; }
NS_INLINE __m256 _mm256_loadu_ps(const float *p) { __m256 r; memcpy(r.f, p, 32); return r; }
NS_INLINE __m256 _mm256_load_ps(const float *p) { return _mm256_loadu_ps(p); }
NS_INLINE __m256 _mm256_broadcast_ss(const float *p) { return _mm256_set1_ps(*p); }
NS_INLINE void _mm256_storeu_ps(float *p, __m256 a) { memcpy(p, a.f, 32); }
NS_INLINE void _mm256_store_ps(float *p, __m256 a) { memcpy(p, a.f, 32); }
NS_INLINE __m256 _mm256_add_ps(__m256 a, __m256 b) { NS_LANES(8) a.f[l] += b.f[l]; return a; }
NS_INLINE __m256 _mm256_sub_ps(__m256 a, __m256 b) { NS_LANES(8) a.f[l] -= b.f[l]; return a; }
NS_INLINE __m256 _mm256_mul_ps(__m256 a, __m256 b) { NS_LANES(8) a.f[l] *= b.f[l]; return a; }
NS_INLINE __m256 _mm256_div_ps(__m256 a, __m256 b) { NS_LANES(8) a.f[l] /= b.f[l]; return a; }
NS_INLINE __m256 _mm256_max_ps(__m256 a, __m256 b) { NS_LANES(8) a.f[l] = a.f[l] > b.f[l] ? a.f[l] : b.f[l]; return a; }
NS_INLINE __m256 _mm256_min_ps(__m256 a, __m256 b) { NS_LANES(8) a.f[l] = a.f[l] < b.f[l] ? a.f[l] : b.f[l]; return a; }
/* Fused where the CPU fuses (fmaf is then one instruction: aarch64, x86 with FMA); elsewhere fmaf is a
 * slow library routine, so a * b + c, which rounds twice. */
#ifdef __FP_FAST_FMAF
#define NS_FMA(a, b, c) fmaf(a, b, c)
#else
#define NS_FMA(a, b, c) ((a) * (b) + (c))
#endif
NS_INLINE __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) { NS_LANES(8) a.f[l] = NS_FMA(a.f[l], b.f[l], c.f[l]); return a; }
NS_INLINE __m256 _mm256_fnmadd_ps(__m256 a, __m256 b, __m256 c) { NS_LANES(8) a.f[l] = NS_FMA(-a.f[l], b.f[l], c.f[l]); return a; }

NS_INLINE __m256 _mm256_round_ps(__m256 a, int mode) {
    NS_LANES(8) {
        switch (mode & 3) {
        case 0: a.f[l] = nearbyintf(a.f[l]); break;
        case 1: a.f[l] = floorf(a.f[l]); break;
        case 2: a.f[l] = ceilf(a.f[l]); break;
        default: a.f[l] = truncf(a.f[l]);
        }
    }
    return a;
}

NS_INLINE __m256 _mm256_castsi256_ps(__m256i a) { __m256 r; memcpy(r.f, a.i, 32); return r; }
NS_INLINE __m256i _mm256_castps_si256(__m256 a) { __m256i r; memcpy(r.i, a.f, 32); return r; }

NS_INLINE __m256 _mm256_cmp_ps(__m256 a, __m256 b, int pred) {
    __m256i r;
    NS_LANES(8) {
        const float x = a.f[l], y = b.f[l];
        const int t = pred == _CMP_EQ_OQ ? x == y : pred == _CMP_LE_OQ ? x <= y : pred == _CMP_GE_OQ ? x >= y : x > y;
        r.u[l] = t ? 0xffffffffu : 0u;
    }
    return _mm256_castsi256_ps(r);
}

NS_INLINE int _mm256_movemask_ps(__m256 a) {
    const __m256i m = _mm256_castps_si256(a);
    int r = 0;
    NS_LANES(8) r |= (int)(m.u[l] >> 31) << l;
    return r;
}

NS_INLINE __m256 _mm256_and_ps(__m256 a, __m256 b) {
    __m256i x = _mm256_castps_si256(a), y = _mm256_castps_si256(b);
    NS_LANES(8) x.u[l] &= y.u[l];
    return _mm256_castsi256_ps(x);
}

NS_INLINE __m256 _mm256_andnot_ps(__m256 a, __m256 b) { /* ~a & b */
    __m256i x = _mm256_castps_si256(a), y = _mm256_castps_si256(b);
    NS_LANES(8) x.u[l] = ~x.u[l] & y.u[l];
    return _mm256_castsi256_ps(x);
}

NS_INLINE __m256 _mm256_blendv_ps(__m256 a, __m256 b, __m256 mask) {
    const __m256i m = _mm256_castps_si256(mask);
    NS_LANES(8) a.f[l] = (m.u[l] >> 31) ? b.f[l] : a.f[l];
    return a;
}

/* Pairwise sums within each 128-bit half: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]. */
NS_INLINE __m256 _mm256_hadd_ps(__m256 a, __m256 b) {
    __m256 r;
    for (int half = 0; half < 2; half++) {
        const int o = 4 * half;
        r.f[o] = a.f[o] + a.f[o + 1];
        r.f[o + 1] = a.f[o + 2] + a.f[o + 3];
        r.f[o + 2] = b.f[o] + b.f[o + 1];
        r.f[o + 3] = b.f[o + 2] + b.f[o + 3];
    }
    return r;
}

NS_INLINE __m256 _mm256_permute2f128_ps(__m256 a, __m256 b, int imm) {
    __m256 r;
    for (int half = 0; half < 2; half++) {
        const int sel = (imm >> (4 * half)) & 0xf;
        const float *src = (sel & 2) ? b.f : a.f;
        NS_LANES(4) r.f[4 * half + l] = (sel & 8) ? 0.0f : src[4 * (sel & 1) + l];
    }
    return r;
}

NS_INLINE __m256 _mm256_permutevar8x32_ps(__m256 a, __m256i idx) {
    __m256 r;
    NS_LANES(8) r.f[l] = a.f[idx.i[l] & 7];
    return r;
}

NS_INLINE __m128 _mm256_castps256_ps128(__m256 a) { __m128 r; memcpy(r.f, a.f, 16); return r; }
NS_INLINE __m128 _mm256_extractf128_ps(__m256 a, int imm) { __m128 r; memcpy(r.f, a.f + 4 * (imm & 1), 16); return r; }

/* Rounded to nearest even, as the kernels convert; out of range gives INT32_MIN, as the instruction. */
NS_INLINE __m256i _mm256_cvtps_epi32(__m256 a) {
    __m256i r;
    NS_LANES(8) {
        const float v = nearbyintf(a.f[l]);
        r.i[l] = (v >= -2147483648.0f && v < 2147483648.0f) ? (int32_t)v : INT32_MIN;
    }
    return r;
}

NS_INLINE __m256 _mm256_cvtepi32_ps(__m256i a) { __m256 r; NS_LANES(8) r.f[l] = (float)a.i[l]; return r; }

NS_INLINE __m128i _mm256_cvtps_ph(__m256 a, int rounding) {
    __m128i r;
    NS_LANES(8) r.uh[l] = _cvtss_sh(a.f[l], rounding);
    return r;
}

NS_INLINE __m256 _mm256_cvtph_ps(__m128i a) { __m256 r; NS_LANES(8) r.f[l] = _cvtsh_ss(a.uh[l]); return r; }

/* ---------------------------------------------------------------- 4 floats */
NS_INLINE __m128 _mm_add_ps(__m128 a, __m128 b) { NS_LANES(4) a.f[l] += b.f[l]; return a; }
NS_INLINE __m128 _mm_max_ps(__m128 a, __m128 b) { NS_LANES(4) a.f[l] = a.f[l] > b.f[l] ? a.f[l] : b.f[l]; return a; }
NS_INLINE __m128 _mm_add_ss(__m128 a, __m128 b) { a.f[0] += b.f[0]; return a; }
NS_INLINE __m128 _mm_max_ss(__m128 a, __m128 b) { a.f[0] = a.f[0] > b.f[0] ? a.f[0] : b.f[0]; return a; }
NS_INLINE __m128 _mm_movehl_ps(__m128 a, __m128 b) { __m128 r = {{b.f[2], b.f[3], a.f[2], a.f[3]}}; return r; }
NS_INLINE __m128 _mm_movehdup_ps(__m128 a) { __m128 r = {{a.f[1], a.f[1], a.f[3], a.f[3]}}; return r; }
NS_INLINE float _mm_cvtss_f32(__m128 a) { return a.f[0]; }

/* ---------------------------------------------------------------- 256-bit integers */
NS_INLINE __m256i _mm256_setzero_si256(void) { __m256i r; memset(&r, 0, 32); return r; }
NS_INLINE __m256i _mm256_set1_epi32(int32_t v) { __m256i r; NS_LANES(8) r.i[l] = v; return r; }
NS_INLINE __m256i _mm256_set1_epi16(int16_t v) { __m256i r; NS_LANES(16) r.h[l] = v; return r; }
NS_INLINE __m256i _mm256_set1_epi8(int8_t v) { __m256i r; NS_LANES(32) r.b[l] = v; return r; }
NS_INLINE __m256i _mm256_setr_epi32(int32_t e0, int32_t e1, int32_t e2, int32_t e3, int32_t e4, int32_t e5,
                                    int32_t e6, int32_t e7) {
    __m256i r = {.i = {e0, e1, e2, e3, e4, e5, e6, e7}};
    return r;
}
NS_INLINE __m256i _mm256_loadu_si256(const __m256i *p) { __m256i r; memcpy(&r, p, 32); return r; }
NS_INLINE __m256i _mm256_load_si256(const __m256i *p) { return _mm256_loadu_si256(p); }
NS_INLINE void _mm256_storeu_si256(__m256i *p, __m256i a) { memcpy(p, &a, 32); }
NS_INLINE void _mm256_store_si256(__m256i *p, __m256i a) { memcpy(p, &a, 32); }
NS_INLINE __m256i _mm256_add_epi32(__m256i a, __m256i b) { NS_LANES(8) a.u[l] += b.u[l]; return a; }
NS_INLINE __m256i _mm256_add_epi16(__m256i a, __m256i b) {
    NS_LANES(16) a.h[l] = (int16_t)(uint16_t)((uint16_t)a.h[l] + (uint16_t)b.h[l]);
    return a;
}
NS_INLINE __m256i _mm256_hadd_epi32(__m256i a, __m256i b) { /* pairs within each 128-bit half: a's, then b's */
    __m256i r;
    for (int half = 0; half < 2; half++) {
        const int o = 4 * half;
        r.u[o] = a.u[o] + a.u[o + 1];
        r.u[o + 1] = a.u[o + 2] + a.u[o + 3];
        r.u[o + 2] = b.u[o] + b.u[o + 1];
        r.u[o + 3] = b.u[o + 2] + b.u[o + 3];
    }
    return r;
}
NS_INLINE __m256i _mm256_permute2x128_si256(__m256i a, __m256i b, int imm) {
    __m256i r;
    for (int half = 0; half < 2; half++) {
        const int sel = (imm >> (4 * half)) & 0xf;
        const uint32_t *src = (sel & 2) ? b.u : a.u;
        NS_LANES(4) r.u[4 * half + l] = (sel & 8) ? 0u : src[4 * (sel & 1) + l];
    }
    return r;
}
NS_INLINE __m256i _mm256_unpacklo_epi32(__m256i a, __m256i b) { /* within each 128-bit half */
    __m256i r;
    for (int o = 0; o < 8; o += 4) { r.u[o] = a.u[o]; r.u[o + 1] = b.u[o]; r.u[o + 2] = a.u[o + 1]; r.u[o + 3] = b.u[o + 1]; }
    return r;
}
NS_INLINE __m256i _mm256_unpackhi_epi32(__m256i a, __m256i b) {
    __m256i r;
    for (int o = 0; o < 8; o += 4) { r.u[o] = a.u[o + 2]; r.u[o + 1] = b.u[o + 2]; r.u[o + 2] = a.u[o + 3]; r.u[o + 3] = b.u[o + 3]; }
    return r;
}
NS_INLINE __m256i _mm256_unpacklo_epi64(__m256i a, __m256i b) {
    __m256i r;
    for (int o = 0; o < 8; o += 4) { r.u[o] = a.u[o]; r.u[o + 1] = a.u[o + 1]; r.u[o + 2] = b.u[o]; r.u[o + 3] = b.u[o + 1]; }
    return r;
}
NS_INLINE __m256i _mm256_unpackhi_epi64(__m256i a, __m256i b) {
    __m256i r;
    for (int o = 0; o < 8; o += 4) { r.u[o] = a.u[o + 2]; r.u[o + 1] = a.u[o + 3]; r.u[o + 2] = b.u[o + 2]; r.u[o + 3] = b.u[o + 3]; }
    return r;
}
NS_INLINE __m256i _mm256_mullo_epi32(__m256i a, __m256i b) { NS_LANES(8) a.u[l] *= b.u[l]; return a; }
NS_INLINE __m256i _mm256_srli_epi32(__m256i a, int n) { NS_LANES(8) a.u[l] = n > 31 ? 0 : a.u[l] >> n; return a; }
NS_INLINE __m256i _mm256_slli_epi32(__m256i a, int n) { NS_LANES(8) a.u[l] = n > 31 ? 0 : a.u[l] << n; return a; }
NS_INLINE __m256i _mm256_xor_si256(__m256i a, __m256i b) { NS_LANES(8) a.u[l] ^= b.u[l]; return a; }
NS_INLINE __m256i _mm256_and_si256(__m256i a, __m256i b) { NS_LANES(8) a.u[l] &= b.u[l]; return a; }
NS_INLINE __m256i _mm256_cmpgt_epi32(__m256i a, __m256i b) {
    NS_LANES(8) a.u[l] = a.i[l] > b.i[l] ? 0xffffffffu : 0u;
    return a;
}
NS_INLINE __m256i _mm256_blendv_epi8(__m256i a, __m256i b, __m256i mask) {
    NS_LANES(32) a.b[l] = (mask.ub[l] & 0x80) ? b.b[l] : a.b[l];
    return a;
}
NS_INLINE __m256i _mm256_permute4x64_epi64(__m256i a, int imm) {
    __m256i r;
    NS_LANES(4) memcpy(&r.i[2 * l], &a.i[2 * ((imm >> (2 * l)) & 3)], 8);
    return r;
}

NS_INLINE __m256i _mm256_permutevar8x32_epi32(__m256i a, __m256i idx) {
    __m256i r;
    NS_LANES(8) r.i[l] = a.i[idx.i[l] & 7];
    return r;
}

NS_INLINE int16_t ns_sat16(int32_t v) { return (int16_t)(v > 32767 ? 32767 : v < -32768 ? -32768 : v); }
NS_INLINE int8_t ns_sat8(int32_t v) { return (int8_t)(v > 127 ? 127 : v < -128 ? -128 : v); }

/* Within each 128-bit half: a's 4 (8) values saturated, then b's. */
NS_INLINE __m256i _mm256_packs_epi32(__m256i a, __m256i b) {
    __m256i r;
    for (int half = 0; half < 2; half++) {
        NS_LANES(4) r.h[8 * half + l] = ns_sat16(a.i[4 * half + l]);
        NS_LANES(4) r.h[8 * half + 4 + l] = ns_sat16(b.i[4 * half + l]);
    }
    return r;
}

NS_INLINE __m256i _mm256_packs_epi16(__m256i a, __m256i b) {
    __m256i r;
    for (int half = 0; half < 2; half++) {
        NS_LANES(8) r.b[16 * half + l] = ns_sat8(a.h[8 * half + l]);
        NS_LANES(8) r.b[16 * half + 8 + l] = ns_sat8(b.h[8 * half + l]);
    }
    return r;
}

/* Unsigned bytes of a times signed bytes of b, adjacent pairs summed with signed saturation. */
NS_INLINE __m256i _mm256_maddubs_epi16(__m256i a, __m256i b) {
    __m256i r;
    NS_LANES(16) r.h[l] = ns_sat16((int32_t)a.ub[2 * l] * b.b[2 * l] + (int32_t)a.ub[2 * l + 1] * b.b[2 * l + 1]);
    return r;
}

NS_INLINE __m256i _mm256_madd_epi16(__m256i a, __m256i b) {
    __m256i r;
    NS_LANES(8) r.u[l] = (uint32_t)((int32_t)a.h[2 * l] * b.h[2 * l]) + (uint32_t)((int32_t)a.h[2 * l + 1] * b.h[2 * l + 1]);
    return r;
}

NS_INLINE __m256i _mm256_set_m128i(__m128i hi, __m128i lo) { __m256i r; memcpy(r.b, &lo, 16); memcpy(r.b + 16, &hi, 16); return r; }
NS_INLINE __m128i _mm256_castsi256_si128(__m256i a) { __m128i r; memcpy(&r, a.b, 16); return r; }
NS_INLINE __m128i _mm256_extracti128_si256(__m256i a, int imm) { __m128i r; memcpy(&r, a.b + 16 * (imm & 1), 16); return r; }
NS_INLINE __m256i _mm256_cvtepu8_epi32(__m128i a) { __m256i r; NS_LANES(8) r.i[l] = a.ub[l]; return r; }
NS_INLINE __m256i _mm256_cvtepi8_epi32(__m128i a) { __m256i r; NS_LANES(8) r.i[l] = a.b[l]; return r; }
NS_INLINE __m256i _mm256_cvtepi8_epi16(__m128i a) { __m256i r; NS_LANES(16) r.h[l] = a.b[l]; return r; }
NS_INLINE __m256i _mm256_cvtepu8_epi16(__m128i a) { __m256i r; NS_LANES(16) r.h[l] = a.ub[l]; return r; }

/* ---------------------------------------------------------------- 128-bit integers */
NS_INLINE __m128i _mm_loadu_si128(const __m128i *p) { __m128i r; memcpy(&r, p, 16); return r; }
NS_INLINE void _mm_storeu_si128(__m128i *p, __m128i a) { memcpy(p, &a, 16); }
NS_INLINE __m128i _mm_loadl_epi64(const __m128i *p) { __m128i r; memset(&r, 0, 16); memcpy(&r, p, 8); return r; }
NS_INLINE __m128i _mm_cvtsi64_si128(long long v) { __m128i r; memset(&r, 0, 16); memcpy(&r, &v, 8); return r; }
NS_INLINE __m128i _mm_set1_epi8(int8_t v) { __m128i r; NS_LANES(16) r.b[l] = v; return r; }
NS_INLINE __m128i _mm_set1_epi16(int16_t v) { __m128i r; NS_LANES(8) r.h[l] = v; return r; }
NS_INLINE __m128i _mm_setr_epi32(int32_t a, int32_t b, int32_t c, int32_t d) {
    __m128i r;
    r.i[0] = a, r.i[1] = b, r.i[2] = c, r.i[3] = d;
    return r;
}
NS_INLINE __m128i _mm_and_si128(__m128i a, __m128i b) { NS_LANES(16) a.ub[l] &= b.ub[l]; return a; }
NS_INLINE __m128i _mm_sub_epi8(__m128i a, __m128i b) { NS_LANES(16) a.ub[l] = (uint8_t)(a.ub[l] - b.ub[l]); return a; }
NS_INLINE __m128i _mm_add_epi32(__m128i a, __m128i b) {
    NS_LANES(4) a.i[l] = (int32_t)((uint32_t)a.i[l] + (uint32_t)b.i[l]);
    return a;
}
NS_INLINE __m128i _mm_srli_epi16(__m128i a, int n) { NS_LANES(8) a.uh[l] = n > 15 ? 0 : (uint16_t)(a.uh[l] >> n); return a; }
NS_INLINE __m128i _mm_srli_si128(__m128i a, int bytes) { /* shifts the whole register right by bytes */
    __m128i r;
    memset(&r, 0, 16);
    if (bytes < 16) memcpy(r.ub, a.ub + bytes, (size_t)(16 - bytes));
    return r;
}
NS_INLINE __m128i _mm_shuffle_epi32(__m128i a, int imm) {
    __m128i r;
    NS_LANES(4) r.i[l] = a.i[(imm >> (2 * l)) & 3];
    return r;
}
NS_INLINE int32_t _mm_cvtsi128_si32(__m128i a) { return a.i[0]; }


/* ---------------------------------------------------------------- used by the weight decoders (quant_blocks.h) */
NS_INLINE __m128 _mm_set1_ps(float v) { __m128 r; NS_LANES(4) r.f[l] = v; return r; }
NS_INLINE __m256 _mm256_set_m128(__m128 hi, __m128 lo) { __m256 r; NS_LANES(4) { r.f[l] = lo.f[l]; r.f[l + 4] = hi.f[l]; } return r; }
NS_INLINE __m256i _mm256_set1_epi64x(int64_t v) { __m256i r; NS_LANES(4) memcpy(r.b + 8 * l, &v, 8); return r; }
NS_INLINE __m256i _mm256_or_si256(__m256i a, __m256i b) { NS_LANES(32) a.ub[l] |= b.ub[l]; return a; }
NS_INLINE __m256i _mm256_sub_epi8(__m256i a, __m256i b) { NS_LANES(32) a.ub[l] = (uint8_t)(a.ub[l] - b.ub[l]); return a; }
NS_INLINE __m256i _mm256_cmpeq_epi8(__m256i a, __m256i b) { NS_LANES(32) a.ub[l] = a.ub[l] == b.ub[l] ? 0xFF : 0; return a; }
NS_INLINE __m256i _mm256_slli_epi16(__m256i a, int n) { NS_LANES(16) a.h[l] = n > 15 ? 0 : (int16_t)((uint16_t)a.h[l] << n); return a; }
NS_INLINE __m256i _mm256_srli_epi16(__m256i a, int n) { NS_LANES(16) a.h[l] = n > 15 ? 0 : (int16_t)((uint16_t)a.h[l] >> n); return a; }
NS_INLINE __m256i _mm256_abs_epi8(__m256i a) { NS_LANES(32) a.ub[l] = (uint8_t)(a.b[l] < 0 ? -a.b[l] : a.b[l]); return a; }
NS_INLINE __m256i _mm256_sign_epi8(__m256i a, __m256i b) { /* a negated where b < 0, zeroed where b == 0 */
    NS_LANES(32) a.b[l] = (int8_t)(b.b[l] < 0 ? -a.b[l] : (b.b[l] == 0 ? 0 : a.b[l]));
    return a;
}
NS_INLINE __m256i _mm256_shuffle_epi8(__m256i a, __m256i idx) { /* within each 128-bit half */
    __m256i r;
    NS_LANES(32) r.ub[l] = (idx.ub[l] & 0x80) ? 0 : a.ub[(l & 16) + (idx.ub[l] & 15)];
    return r;
}
NS_INLINE __m256i _mm256_cvtepu16_epi32(__m128i a) { __m256i r; NS_LANES(8) r.i[l] = a.uh[l]; return r; }

#endif
