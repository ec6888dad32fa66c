/* Paged decode attention on the CPU: one query token per sequence attends to its whole context,
 * reading keys and values straight from the paged KV cache (no gathered copy). Float32 only.
 * q: (B, H, D); k_cache, v_cache: (KVH, num_slots, D); slots: (B, max_ctx) cache slot of each
 * position; ctx_lens: (B,); out: (B, H, D). Heads of one KV group are consecutive (H = KVH * G). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
