/* y = x W^T for small batches with W stored in blocks of 4-bit or 8-bit integers.
 * 4-bit: each row of W is cut into blocks of 32
 * weights, each block holds w = d * q + m with q in 0..15 (16 bytes of nibbles: byte j has weight j in
 * its low nibble and weight j + 16 in its high nibble), d and m float16 (as in a GGUF Q4_1 block). A
 * row then streams 20 bytes per 32 weights instead of 128, which bounds a decode step with few rows. */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 8 partial sums of 32 activations times one block's 32 weights (as 4 vectors of 8 floats). */
static inline __m256 dot32(const float *xr, __m256 q0, __m256 q1, __m256 q2, __m256 q3) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xr), q0);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q1, s);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q2, s);
    return _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q3, s);
}

#define ROWS 4 /* rows of x kept in registers per pass over a weight row */

void q4_linear_f32(const float *x, const uint8_t *qw, const uint16_t *d, const uint16_t *mn, float *out,
                   int64_t M, int64_t K, int64_t N) {
    const int64_t nb = K / 32;
    float *xsum = malloc(sizeof(float) * (size_t)(M * nb)); /* sum of x over each block, for the m term */
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            __m256 s = _mm256_loadu_ps(x + i * K + b * 32);
            s = _mm256_add_ps(s, _mm256_loadu_ps(x + i * K + b * 32 + 8));
            s = _mm256_add_ps(s, _mm256_loadu_ps(x + i * K + b * 32 + 16));
            s = _mm256_add_ps(s, _mm256_loadu_ps(x + i * K + b * 32 + 24));
            xsum[i * nb + b] = hsum256(s);
        }
    const __m128i low4 = _mm_set1_epi8(0x0F);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = qw + n * nb * 16;
        const uint16_t *dn = d + n * nb, *mnn = mn + n * nb;
        for (int64_t i0 = 0; i0 < M; i0 += ROWS) {
            const int64_t rows = M - i0 < ROWS ? M - i0 : ROWS;
            __m256 acc[ROWS];
            float macc[ROWS];
            for (int r = 0; r < ROWS; r++) {
                acc[r] = _mm256_setzero_ps();
                macc[r] = 0.0f;
            }
            for (int64_t b = 0; b < nb; b++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16));
                __m128i lo = _mm_and_si128(bytes, low4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                __m256 db = _mm256_set1_ps(_cvtsh_ss(dn[b]));
                const float mb = _cvtsh_ss(mnn[b]);
                for (int64_t r = 0; r < rows; r++) {
                    acc[r] = _mm256_fmadd_ps(db, dot32(x + (i0 + r) * K + b * 32, q0, q1, q2, q3), acc[r]);
                    macc[r] += mb * xsum[(i0 + r) * nb + b];
                }
            }
            for (int64_t r = 0; r < rows; r++)
                out[(i0 + r) * N + n] = hsum256(acc[r]) + macc[r];
        }
    }
    free(xsum);
}

/* The same for 8-bit blocks: w = d * q with q in -127..127 and d float16, 34 bytes per block of 32
 * weights (the layout of a GGUF Q8_0 tensor, which round-trips exactly). */
void q8_linear_f32(const float *x, const int8_t *qw, const uint16_t *d, float *out, int64_t M, int64_t K,
                   int64_t N) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = qw + n * K;
        const uint16_t *dn = d + n * nb;
        for (int64_t i0 = 0; i0 < M; i0 += ROWS) {
            const int64_t rows = M - i0 < ROWS ? M - i0 : ROWS;
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++)
                acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m128i lo = _mm_loadu_si128((const __m128i *)(row + b * 32));
                __m128i hi = _mm_loadu_si128((const __m128i *)(row + b * 32 + 16));
                __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
                __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
                __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
                __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
                __m256 db = _mm256_set1_ps(_cvtsh_ss(dn[b]));
                for (int64_t r = 0; r < rows; r++) {
                    acc[r] = _mm256_fmadd_ps(db, dot32(x + (i0 + r) * K + b * 32, q0, q1, q2, q3), acc[r]);
                }
            }
            for (int64_t r = 0; r < rows; r++)
                out[(i0 + r) * N + n] = hsum256(acc[r]);
        }
    }
}

/* RMSNorm of a few rows in one call: for a step with few rows PyTorch's composite op costs ~40 us of
 * dispatch for 576 numbers. out = x / sqrt(mean(x^2) + eps) * w. */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum256(acc);
        for (; i < dim; i++)
            ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        const __m256 s = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), s), _mm256_loadu_ps(w + i)));
        for (; i < dim; i++)
            o[i] = xr[i] * inv * w[i];
    }
}
