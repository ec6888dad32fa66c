/* The elementwise steps of a decoder layer, each one pass over its rows instead of several PyTorch
 * ops: SiLU(gate) * up for the MLP, rotary embedding of q and k in place plus the write of the new keys
 * and values into the paged KV cache, and RMSNorm. */
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* gate_up: (T, 2I), gate then up in each row; out: (T, I) = silu(gate) * up. Split between the threads
 * from 8192 values (SmolLM2's 32-row decode steps, 49152, ran on one thread while the other waited). */
void silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I > 8192)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + fast_expf(-g[i])) * u[i];
    }
}

/* qk: T rows (row stride qk_stride floats) of num_heads query heads then num_kv_heads key heads of D
 * floats, rotated in place with cos, sin (T, D) in the rotate-half convention (element i pairs with
 * i + D/2). Then each token's key heads and value heads (v, row stride v_stride) are copied into the
 * caches (KVH, num_slots, D) at slots[t], float32 or (kv_f16) float16. */
/* D floats to a cache row: copied (float32 cache) or narrowed to float16, rounding to nearest. */
static inline void store_row(void *cache, int64_t row, const float *x, int64_t D, int f16) {
    if (!f16) {
        memcpy((float *)cache + row * D, x, sizeof(float) * (size_t)D);
        return;
    }
    uint16_t *o = (uint16_t *)cache + row * D;
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < D; i++) o[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

void rope_write_kv_f32(float *qk, int64_t qk_stride, const float *v, int64_t v_stride, const float *cos,
                       const float *sin, void *k_cache, void *v_cache, const int64_t *slots, int64_t T,
                       int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t num_slots, int64_t kv_f16) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            float *x = qk + t * qk_stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
            if (h >= num_heads) store_row(k_cache, (h - num_heads) * num_slots + slots[t], x, D, (int)kv_f16);
        }
        for (int64_t h = 0; h < num_kv_heads; h++)
            store_row(v_cache, h * num_slots + slots[t], v + t * v_stride + h * D, D, (int)kv_f16);
    }
}

/* RMSNorm in one call, out = x / sqrt(mean(x^2) + eps) * w: PyTorch's composite op costs ~40 us of
 * dispatch for a few rows of 576 numbers and is 17x slower than this loop at 2048 rows. Rows split between
 * the threads from 8 rows (each row's result is the same either way). With SiLU's split from 8192 values:
 * SmolLM2 Q8_0 decode steps of 32 rows 0.962x and 0.975x the time (two runs of 20 rounds, alternated in
 * one process, 2026-12-07). */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 8)
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
