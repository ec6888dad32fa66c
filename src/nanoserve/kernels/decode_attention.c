/* Paged decode attention on the CPU: one query token per sequence attends to its whole context,
 * reading keys and values straight from the paged KV cache (no gathered copy). Float32 only.
 * q: (B, H, D); k_cache, v_cache: (KVH, num_slots, D); slots: (B, max_ctx) cache slot of each
 * position; ctx_lens: (B,); out: (B, H, D). Heads of one KV group are consecutive (H = KVH * G). */
#include <immintrin.h>
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

/* One (sequence, KV head) task with head_dim a multiple of 8, vectorized: scores of 8 keys at a time,
 * softmax with the vectorizable exp, and each head's output kept in registers 64 values at a time
 * while its value rows stream past. */
static void attend_vec(const float *qh, const float *kbase, const float *vbase, const int64_t *seq_slots,
                       int64_t ctx, int64_t group, int64_t D, float scale, float *scores, float *oh) {
    for (int64_t g = 0; g < group; g++) {
        const float *qg = qh + g * D;
        float *s = scores + g * ctx;
        for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
            __m256 acc[8];
            for (int r = 0; r < 8; r++) {
                acc[r] = _mm256_setzero_ps();
                if (t0 + r >= ctx) continue;
                const float *krow = kbase + seq_slots[t0 + r] * D;
                for (int64_t d = 0; d < D; d += 8)
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(krow + d), acc[r]);
            }
            float dots[8];
            _mm256_storeu_ps(dots, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
            for (int r = 0; r < 8 && t0 + r < ctx; r++) s[t0 + r] = dots[r];
        }
        float max_score = s[0], sum = 0.f;
        for (int64_t t = 1; t < ctx; t++) max_score = s[t] > max_score ? s[t] : max_score;
        for (int64_t t = 0; t < ctx; t++) {
            s[t] = fast_expf(s[t] - max_score);
            sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int64_t nv = (D - d0 < 64 ? D - d0 : 64) / 8;
            __m256 o[8];
            for (int j = 0; j < 8; j++) o[j] = _mm256_setzero_ps();
            for (int64_t t = 0; t < ctx; t++) {
                const __m256 p = _mm256_set1_ps(s[t]);
                const float *vrow = vbase + seq_slots[t] * D + d0;
                if (nv == 8) {
                    for (int j = 0; j < 8; j++) o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 8 * j), o[j]);
                } else {
                    for (int j = 0; j < nv; j++) o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 8 * j), o[j]);
                }
            }
            for (int j = 0; j < nv; j++) _mm256_storeu_ps(oh + g * D + d0 + 8 * j, o[j]);
        }
    }
}

void decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                          const int64_t *slots, const int64_t *ctx_lens, float *out,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int64_t max_ctx, float scale) {
    const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t *seq_slots = slots + b * max_ctx;
        const float *kbase = k_cache + kvh * num_slots * head_dim;
        const float *vbase = v_cache + kvh * num_slots * head_dim;
        float *scores = malloc(sizeof(float) * group * ctx);  /* (G, ctx) */
        const float *qh = q + (b * num_heads + kvh * group) * head_dim;  /* (G, D) */
        if (head_dim % 8 == 0) {
            attend_vec(qh, kbase, vbase, seq_slots, ctx, group, head_dim, scale, scores,
                       out + (b * num_heads + kvh * group) * head_dim);
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
