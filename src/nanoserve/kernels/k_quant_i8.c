/* Decode steps (up to STREAM_MAX_ROWS rows of x) on W of a K type (Q4_K, Q5_K, Q6_K), x quantized to 8
 * bits per block of 32 (quantized_rows.h): each super-block's scales are unpacked once, as vectors,
 * instead of as scalars per sub-block (quant_blocks.h's decode32, which the tiled GEMM of int8_gemm.c
 * unpacks with, once per group of weight rows). Each output takes the GEMM's operations in the GEMM's
 * order, so a row's result does not depend on its batch. */
/* No fused a * b + c or reordered sums that one kernel would get and the other not (the build allows both). */
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#include "simd.h"
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "quant_blocks.h"
#include "quantized_rows.h"
#include "vec_math.h"

/* One super-block's scales as the products need them (k_dd): Q6_K's as 8 vectors, lanes 0-3 for
 * sub-block j's weights 0..15 and 4-7 for 16..31 (two scales per sub-block); Q4_K / Q5_K's one scale per
 * sub-block, broadcast where it is used, and each sub-block's minimum, negated. */
typedef struct {
    __m256 q6_dd[8];
    float sc[8];
    float mneg[8];
} KScales;

NS_ALWAYS_INLINE void k_super_scales(int t, const uint8_t *p, KScales *ks) {
    if (t == T_Q6_K) {
        const __m256 d = _mm256_set1_ps(f16_at(p + 208));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(p + 192)); /* 16 signed scales, one per 16 weights */
        const __m256 lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        const __m256 hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        for (int j = 0; j < 8; j++) {
            const int a = (2 * j) & 7;
            const __m256i idx = _mm256_setr_epi32(a, a, a, a, a + 1, a + 1, a + 1, a + 1);
            ks->q6_dd[j] = _mm256_permutevar8x32_ps(j < 4 ? lo : hi, idx);
        }
        return;
    }
    /* the 12 bytes of six-bit scales and minimums (k_scale_min), four at a time */
    uint32_t u[3], sm[4];
    memcpy(u, p + 4, 12);
    sm[0] = u[0] & 0x3f3f3f3f;                                               /* scales 0..3 */
    sm[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);         /* scales 4..7 */
    sm[2] = u[1] & 0x3f3f3f3f;                                               /* minimums 0..3 */
    sm[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);  /* minimums 4..7 */
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 2))));
    _mm256_storeu_ps(ks->sc, _mm256_mul_ps(_mm256_set1_ps(f16_at(p)), sc));
    _mm256_storeu_ps(ks->mneg, _mm256_mul_ps(_mm256_set1_ps(-f16_at(p + 2)), mn));
}

/* The 8 lanes' scales of sub-block j (quant_blocks.h's Sub32 s0 / s1, the same values). */
NS_ALWAYS_INLINE __m256 k_dd(int t, const KScales *ks, int j) {
    return t == T_Q6_K ? ks->q6_dd[j] : _mm256_broadcast_ss(&ks->sc[j]);
}

/* One weight row against M <= STREAM_MAX_ROWS rows of x, each output in the tiled GEMM's order
 * (int8_gemm.c): per sub-block acc = fma(sums, dd, acc) and m_term = fma(x's block sum, minimum, m_term),
 * then out = dx * (acc's lanes summed) + m_term. */
NS_ALWAYS_INLINE void k_stream_row(int t, const QuantizedRows *xq, const uint8_t *row, float *out, int64_t ldo,
                                   int64_t M, int64_t nb) {
    const int64_t bytes = type_block_bytes(t);
    __m256 acc[STREAM_MAX_ROWS];
    float m_term[STREAM_MAX_ROWS];
    for (int64_t i = 0; i < M; i++) {
        acc[i] = _mm256_setzero_ps();
        m_term[i] = 0.0f;
    }
    for (int64_t g = 0; g < nb / 8; g++) {
        const uint8_t *p = row + g * bytes;
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + STREAM_PREFETCH_BYTES + o, _MM_HINT_T0);
        KScales ks;
        k_super_scales(t, p, &ks);
        /* unrolled, so that each sub-block's shifts and offsets in k_codes are constants */
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * g + j;
            const __m256i w = k_codes(t, p, j);
            const __m256i wa = TYPE_SIGNED(t) ? _mm256_abs_epi8(w) : w;
            for (int64_t i = 0; i < M; i++) {
                const int64_t off = quantized_row_offset(i, nb) + b * TR;
                const __m256i xv = _mm256_load_si256((const __m256i *)(xq->q + off * 32));
                const __m256i sv = _mm256_load_si256((const __m256i *)(xq->s + off * 16));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_codes(t, w, wa, xv, sv)), k_dd(t, &ks, j), acc[i]);
                if (!TYPE_SIGNED(t)) m_term[i] = NS_FMA(xq->sum[i * nb + b], ks.mneg[j], m_term[i]);
            }
        }
    }
    for (int64_t i = 0; i < M; i++) out[i * ldo] = finish(xq->dx[i], acc[i], m_term[i]);
}

/* Each weight row in parallel (quantized_rows.h's STREAM_ROWS_CASE). */
void k_stream_i8(const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo, int64_t M) {
    const uint8_t *data = (const uint8_t *)w->data;
    const int64_t N = w->n, rb = w->row_bytes, nb = w->k / 32;
    switch (w->type) {
        STREAM_ROWS_CASE(T_Q4_K, k_stream_row) STREAM_ROWS_CASE(T_Q5_K, k_stream_row)
        STREAM_ROWS_CASE(T_Q6_K, k_stream_row)
    default: break;
    }
}
