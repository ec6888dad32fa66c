/* Paged decode attention on the CPU: one query token per sequence attends to its whole context,
 * reading keys and values straight from the paged KV cache (no gathered copy). q and out are float32;
 * the cache is float32, or float16 (kv_f16, head_dim a multiple of 8), widened as it is read.
 * q: (B, H, D); k_cache, v_cache: (KVH, num_slots, D); slots: the cache slot of each position of row
 * b at slots + b * slot_stride (slot_stride 0: every row reads one list, as the rows of one prefill
 * sequence do); ctx_lens: (B,); out: (B, H, D). Heads of one KV group are consecutive (H = KVH * G).
 * Each (row, KV head) is one task computed in a fixed order, so a row's result does not depend on the
 * other rows. */
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

/* Lane i = the sum of the 8 lanes of v[i]: 8 dot products finished with 7 shuffles and adds. */
static inline __m256 sum8x8(const __m256 *v) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

#define PREFETCH_ROWS 16 /* how far ahead attend_vec asks for key and value rows (8-48 measured alike) */

/* 8 cache values at element offset i as floats: float32 as is, float16 widened (F16C). */
static inline __m256 load_kv(const void *base, int64_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
               : _mm256_loadu_ps((const float *)base + i);
}

static inline const char *kv_addr(const void *base, int64_t i, int f16) {
    return (const char *)base + i * (f16 ? 2 : 4);
}

/* One (sequence, KV head) task with head_dim a multiple of 8, vectorized. Every key and value row is
 * read from memory once for all the query heads of its group: scores are computed 8 keys at a time for
 * each head while those 8 rows sit in L1, and the output is accumulated for up to 3 heads x 32 dims
 * (12 registers) while the value rows stream past.
 * Inlined into two copies, float32 and float16 cache (f16 a constant in each). */
static inline __attribute__((always_inline)) void attend_vec(
        const float *qh, const void *kbase, const void *vbase, const int64_t *seq_slots, int64_t ctx, int64_t group,
        int64_t D, float scale, float *scores, float *oh, int f16) {
    for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
        int64_t krow[8]; /* element offsets of the 8 key rows, -1 past the context */
        for (int r = 0; r < 8; r++) krow[r] = t0 + r < ctx ? seq_slots[t0 + r] * D : -1;
        /* Cache blocks are pages of their own, where the hardware prefetcher stops: ask for the rows
         * PREFETCH_ROWS ahead, keys and values. */
        for (int64_t t = t0 + PREFETCH_ROWS; t < t0 + PREFETCH_ROWS + 8 && t < ctx; t++)
            for (int64_t d = 0; d < D; d += f16 ? 32 : 16) {
                _mm_prefetch(kv_addr(kbase, seq_slots[t] * D + d, f16), _MM_HINT_T0);
                _mm_prefetch(kv_addr(vbase, seq_slots[t] * D + d, f16), _MM_HINT_T1);
            }
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qh + g * D;
            __m256 acc[8];
            for (int r = 0; r < 8; r++) {
                acc[r] = _mm256_setzero_ps();
                if (krow[r] < 0) continue;
                for (int64_t d = 0; d < D; d += 8)
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load_kv(kbase, krow[r] + d, f16), acc[r]);
            }
            float dots[8];
            _mm256_storeu_ps(dots, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
            for (int r = 0; r < 8 && t0 + r < ctx; r++) scores[g * ctx + t0 + r] = dots[r];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * ctx;
        float max_score = s[0], sum = 0.f;
        for (int64_t t = 1; t < ctx; t++) max_score = s[t] > max_score ? s[t] : max_score;
        for (int64_t t = 0; t < ctx; t++) {
            s[t] = fast_expf(s[t] - max_score);
            sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
    }
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
        const int64_t gn = group - g0 < 3 ? group - g0 : 3;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const int64_t nv = (D - d0 < 32 ? D - d0 : 32) / 8;
            __m256 o[3][4];
            for (int g = 0; g < 3; g++)
                for (int j = 0; j < 4; j++) o[g][j] = _mm256_setzero_ps();
            if (gn == 3 && nv == 4) { /* the common case, fully unrolled */
                const float *s0 = scores + g0 * ctx, *s1 = s0 + ctx, *s2 = s1 + ctx;
                __m256 o00 = o[0][0], o01 = o00, o02 = o00, o03 = o00, o10 = o00, o11 = o00, o12 = o00;
                __m256 o13 = o00, o20 = o00, o21 = o00, o22 = o00, o23 = o00;
                for (int64_t t = 0; t < ctx; t++) { /* 12 accumulators, 3 weights, 1 value vector */
                    const int64_t vrow = seq_slots[t] * D + d0;
                    const __m256 p0 = _mm256_broadcast_ss(s0 + t), p1 = _mm256_broadcast_ss(s1 + t);
                    const __m256 p2 = _mm256_broadcast_ss(s2 + t);
                    __m256 v = load_kv(vbase, vrow, f16);
                    o00 = _mm256_fmadd_ps(p0, v, o00); o10 = _mm256_fmadd_ps(p1, v, o10); o20 = _mm256_fmadd_ps(p2, v, o20);
                    v = load_kv(vbase, vrow + 8, f16);
                    o01 = _mm256_fmadd_ps(p0, v, o01); o11 = _mm256_fmadd_ps(p1, v, o11); o21 = _mm256_fmadd_ps(p2, v, o21);
                    v = load_kv(vbase, vrow + 16, f16);
                    o02 = _mm256_fmadd_ps(p0, v, o02); o12 = _mm256_fmadd_ps(p1, v, o12); o22 = _mm256_fmadd_ps(p2, v, o22);
                    v = load_kv(vbase, vrow + 24, f16);
                    o03 = _mm256_fmadd_ps(p0, v, o03); o13 = _mm256_fmadd_ps(p1, v, o13); o23 = _mm256_fmadd_ps(p2, v, o23);
                }
                o[0][0] = o00; o[0][1] = o01; o[0][2] = o02; o[0][3] = o03;
                o[1][0] = o10; o[1][1] = o11; o[1][2] = o12; o[1][3] = o13;
                o[2][0] = o20; o[2][1] = o21; o[2][2] = o22; o[2][3] = o23;
            } else {
                for (int64_t t = 0; t < ctx; t++) {
                    const int64_t vrow = seq_slots[t] * D + d0;
                    for (int64_t g = 0; g < gn; g++) {
                        const __m256 p = _mm256_set1_ps(scores[(g0 + g) * ctx + t]);
                        for (int64_t j = 0; j < nv; j++)
                            o[g][j] = _mm256_fmadd_ps(p, load_kv(vbase, vrow + 8 * j, f16), o[g][j]);
                    }
                }
            }
            for (int64_t g = 0; g < gn; g++)
                for (int64_t j = 0; j < nv; j++) _mm256_storeu_ps(oh + (g0 + g) * D + d0 + 8 * j, o[g][j]);
        }
    }
}

void decode_attention_f32(const float *q, const void *k_cache_any, const void *v_cache_any,
                          const int64_t *slots, const int64_t *ctx_lens, float *out,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int64_t slot_stride, int64_t kv_f16, float scale) {
    const float *k_cache = k_cache_any, *v_cache = v_cache_any; /* the scalar path: float32 only */
    const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t *seq_slots = slots + b * slot_stride;
        const float *kbase = k_cache + kvh * num_slots * head_dim;
        const float *vbase = v_cache + kvh * num_slots * head_dim;
        float *scores = malloc(sizeof(float) * group * ctx);  /* (G, ctx) */
        const float *qh = q + (b * num_heads + kvh * group) * head_dim;  /* (G, D) */
        if (head_dim % 8 == 0) {
            float *oh = out + (b * num_heads + kvh * group) * head_dim;
            const int64_t head_off = kvh * num_slots * head_dim;
            if (kv_f16)
                attend_vec(qh, (const uint16_t *)k_cache_any + head_off, (const uint16_t *)v_cache_any + head_off,
                           seq_slots, ctx, group, head_dim, scale, scores, oh, 1);
            else
                attend_vec(qh, kbase, vbase, seq_slots, ctx, group, head_dim, scale, scores, oh, 0);
            free(scores);
            continue;
        }
        /* Each key row is read once and scored against every query head of its group. */
        for (int64_t t = 0; t < ctx; t++) {
            const float *krow = kbase + seq_slots[t] * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qh + g * head_dim;
                float dot = 0.f;
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * krow[d];
                scores[g * ctx + t] = dot * scale;
            }
        }
        for (int64_t g = 0; g < group; g++) {  /* softmax of each head's row */
            float *s = scores + g * ctx;
            float max_score = s[0];
            for (int64_t t = 1; t < ctx; t++) if (s[t] > max_score) max_score = s[t];
            float sum = 0.f;
            for (int64_t t = 0; t < ctx; t++) { s[t] = expf(s[t] - max_score); sum += s[t]; }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
        }
        float *oh = out + (b * num_heads + kvh * group) * head_dim;  /* (G, D) */
        memset(oh, 0, sizeof(float) * group * head_dim);
        for (int64_t t = 0; t < ctx; t++) {  /* each value row is read once as well */
            const float *vrow = vbase + seq_slots[t] * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * ctx + t];
                float *og = oh + g * head_dim;
                for (int64_t d = 0; d < head_dim; d++) og[d] += p * vrow[d];
            }
        }
        free(scores);
    }
}
