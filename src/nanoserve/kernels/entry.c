/* The library's exported surface: every kernel Python may call takes pointers to the argument structs
 * of abi.h and nothing else, plus the build's identity (ABI version, build key, compiled-in ISA
 * features) and struct sizes that kernels/abi.py checks at load. Everything else is hidden
 * (-fvisibility=hidden). Also one whole decoder layer for a decode step (ns_decode_layer): the same
 * kernels, in the same order, as the layer's forward on this backend, without the Python between them. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "quant_blocks.h"

#define NS_EXPORT __attribute__((visibility("default")))

#ifndef NS_BUILD_KEY
#error "NS_BUILD_KEY must be defined by the build (kernels/build.py)"
#endif

/* The kernels behind the entry points (weight_linear.c, int8_gemm.c, elementwise.c, decode_attention.c,
 * sampling.c). */
void weight_stream_f32(const float *x, const BlockWeight *w, float *out, int64_t M, int64_t ldo);
void weight_gemm_f32(const float *x, const BlockWeight *w, float *out, int64_t M, int64_t ldo);
void weight_gemm_i8(const float *x, const BlockWeight *w, float *out, int64_t M, int64_t ldo);
void dequant_rows(const BlockWeight *w, int64_t n0, int64_t rows, float *buf);
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps);
void silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I);
void rope_write_kv_f32(float *qk, int64_t qk_stride, const float *v, int64_t v_stride, const float *cos,
                       const float *sin, void *k_cache, void *v_cache, const int64_t *slots, int64_t T,
                       int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t num_slots, int64_t kv_f16);
void decode_attention_f32(const float *q, const void *k_cache, const void *v_cache, const int64_t *slots,
                          const int64_t *ctx_lens, float *out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t slot_stride,
                          int64_t kv_f16, float scale);
void sample_rows(const SampleArgs *a);

/* Up to this many rows a float32 product streams the weights once (bound by memory); beyond, the
 * dequantizing GEMM. Block types: measured as fast at 5 rows, faster from 6. Float types (F16, BF16,
 * F32), since the streaming kernel prefetches: 6 rows 12.5-15.1 ms streaming vs 23.8-26.6 GEMM, 8 rows
 * 19.9-23.5 vs 24.7-27.4, 12 rows equal (2026-12-03, AMD EPYC, 268 MB of F16/BF16). The only copies of
 * these thresholds. */
#define BLOCKS_MAX_ROWS 5
#define FLOAT_MAX_ROWS 8

static void linear(const float *x, const BlockWeight *w, float *out, int64_t rows, int64_t int8_x) {
    for (const BlockWeight *p = w; p; p = (const BlockWeight *)p->next) {
        float *o = out + p->out_col;
        if (int8_x && !TYPE_IS_FLOAT(p->type)) weight_gemm_i8(x, p, o, rows, p->out_stride);
        else if (rows > (TYPE_IS_FLOAT(p->type) ? FLOAT_MAX_ROWS : BLOCKS_MAX_ROWS)) weight_gemm_f32(x, p, o, rows, p->out_stride);
        else weight_stream_f32(x, p, o, rows, p->out_stride);
    }
}

NS_EXPORT void ns_linear(const LinearArgs *a) { linear(a->x, a->w, a->out, a->rows, a->int8_x); }

NS_EXPORT int64_t ns_gather_rows(const GatherRowsArgs *a) {
    int64_t outside = 0;
    for (int64_t i = 0; i < a->count; i++) {
        const int64_t id = a->ids[i];
        if (id < 0 || id >= a->w->n) outside++;
        else dequant_rows(a->w, id, 1, a->out + i * a->w->k);
    }
    return outside;
}

NS_EXPORT void ns_rms_norm(const RmsNormArgs *a) { rms_norm_f32(a->x, a->weight, a->out, a->rows, a->dim, a->eps); }

NS_EXPORT void ns_silu_mul(const SiluMulArgs *a) { silu_mul_f32(a->gate_up, a->out, a->rows, a->inter); }

static void rope_write_kv(float *qkv, int64_t stride, const float *cos, const float *sin, const KVCacheRef *c,
                          const int64_t *slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D) {
    rope_write_kv_f32(qkv, stride, qkv + (heads + kv_heads) * D, stride, cos, sin, c->k, c->v, slots, rows, heads,
                      kv_heads, D, c->num_slots, c->kv_f16);
}

NS_EXPORT void ns_rope_write_kv(const RopeWriteKVArgs *a) {
    rope_write_kv(a->qkv, a->row_stride, a->cos, a->sin, a->cache, a->slots, a->rows, a->num_heads,
                  a->num_kv_heads, a->head_dim);
}

NS_EXPORT void ns_decode_attention(const DecodeAttentionArgs *a) {
    decode_attention_f32(a->q, a->cache->k, a->cache->v, a->slots, a->ctx_lens, a->out, a->batch, a->num_heads,
                         a->num_kv_heads, a->head_dim, a->cache->num_slots, a->slot_stride, a->cache->kv_f16,
                         a->scale);
}

NS_EXPORT void ns_sample_rows(const SampleArgs *a) { sample_rows(a); }

/* The scratch decode_layer needs, in floats; its layout is the one in ns_decode_layer below. */
NS_EXPORT int64_t ns_decode_layer_work_floats(const DecodeLayerWeights *w, int64_t rows) {
    const int64_t q_width = w->num_heads * w->head_dim, qkv_width = (w->num_heads + 2 * w->num_kv_heads) * w->head_dim;
    return rows * (w->hidden + qkv_width + 2 * q_width + 3 * w->inter);
}

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

NS_EXPORT void ns_decode_layer(const DecodeLayerWeights *w, const KVCacheRef *cache, const DecodeStep *s) {
    const int64_t M = s->rows, D = w->head_dim, hidden = w->hidden, inter = w->inter;
    const int64_t qkv_width = (w->num_heads + 2 * w->num_kv_heads) * D, q_width = w->num_heads * D;
    float *h = s->work;                   /* (M, hidden) normed input, then each projection's output */
    float *qkv = h + M * hidden;          /* (M, qkv_width) */
    float *q = qkv + M * qkv_width;       /* (M, q_width) contiguous queries for attention */
    float *attn = q + M * q_width;        /* (M, q_width) */
    float *gate_up = attn + M * q_width;  /* (M, 2 inter) */
    float *act = gate_up + M * 2 * inter; /* (M, inter) */
    float *x = s->x;

    rms_norm_f32(x, w->ln1, h, M, hidden, w->eps);
    linear(h, w->qkv, qkv, M, s->int8_x);
    rope_write_kv(qkv, qkv_width, s->cos, s->sin, cache, s->slots, M, w->num_heads, w->num_kv_heads, D);
    for (int64_t i = 0; i < M; i++) memcpy(q + i * q_width, qkv + i * qkv_width, sizeof(float) * (size_t)q_width);
    decode_attention_f32(q, cache->k, cache->v, s->decode_slots, s->ctx_lens, attn, M, w->num_heads,
                         w->num_kv_heads, D, cache->num_slots, s->max_ctx, cache->kv_f16, w->scale);
    linear(attn, w->o, h, M, s->int8_x);
    add_into(x, h, M * hidden);

    rms_norm_f32(x, w->ln2, h, M, hidden, w->eps);
    linear(h, w->gate_up, gate_up, M, s->int8_x);
    silu_mul_f32(gate_up, act, M, inter);
    linear(act, w->down, h, M, s->int8_x);
    add_into(x, h, M * hidden);
}

NS_EXPORT void ns_set_num_threads(int64_t n) { omp_set_num_threads((int)n); }

NS_EXPORT int64_t ns_num_threads(void) { return omp_get_max_threads(); }

NS_EXPORT int64_t ns_abi_version(void) { return NS_ABI_VERSION; }

/* The build key kernels/build.py compiled this file with: a library whose key is not the one the
 * loader computed for this machine (other sources, compiler, flags or target) is never used. */
NS_EXPORT const char *ns_build_key(void) { return NS_BUILD_KEY; }

/* The instruction-set extensions the compiler was allowed to use, by their /proc/cpuinfo names: the
 * loader refuses the library on a CPU that lacks any of them. */
NS_EXPORT const char *ns_isa_features(void) {
    return ""
#ifdef __SSSE3__
           "ssse3 "
#endif
#ifdef __SSE4_2__
           "sse4_2 "
#endif
#ifdef __POPCNT__
           "popcnt "
#endif
#ifdef __AVX__
           "avx "
#endif
#ifdef __AVX2__
           "avx2 "
#endif
#ifdef __FMA__
           "fma "
#endif
#ifdef __F16C__
           "f16c "
#endif
#ifdef __BMI__
           "bmi1 "
#endif
#ifdef __BMI2__
           "bmi2 "
#endif
#ifdef __LZCNT__
           "abm "
#endif
#ifdef __MOVBE__
           "movbe "
#endif
#ifdef __AVX512F__
           "avx512f "
#endif
#ifdef __AVX512BW__
           "avx512bw "
#endif
#ifdef __AVX512VL__
           "avx512vl "
#endif
#ifdef __AVX512DQ__
           "avx512dq "
#endif
#ifdef __AVX512VNNI__
           "avx512_vnni "
#endif
#ifdef __AVXVNNI__
           "avx_vnni "
#endif
        ;
}

/* sizeof() of each struct of abi.h, in the order they appear there (abi.py compares its mirrors). */
NS_EXPORT int64_t ns_struct_size(const char *name) {
#define SIZE_OF(T) if (strcmp(name, #T) == 0) return (int64_t)sizeof(T);
    SIZE_OF(BlockWeight) SIZE_OF(LinearArgs) SIZE_OF(GatherRowsArgs) SIZE_OF(RmsNormArgs) SIZE_OF(SiluMulArgs) SIZE_OF(KVCacheRef)
    SIZE_OF(RopeWriteKVArgs) SIZE_OF(DecodeAttentionArgs) SIZE_OF(DecodeLayerWeights) SIZE_OF(DecodeStep)
    SIZE_OF(SampleArgs)
#undef SIZE_OF
    return -1;
}
