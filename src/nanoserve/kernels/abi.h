/* The one definition of every argument block Python passes to the C kernels. Each exported kernel
 * takes pointers to these structs (entry.c), never long positional lists. kernels/abi.py reads this
 * file to build its ctypes mirrors and checks sizeof() of each against the compiled library at load.
 * Keep the format simple: one typedef per struct, one field per line, no comments inside, types
 * among int64_t, float, pointers. Bump NS_ABI_VERSION whenever a struct or a kernel's meaning changes. */
#ifndef NANOSERVE_ABI_H
#define NANOSERVE_ABI_H

#include <stdint.h>

#define NS_ABI_VERSION 4

/* A weight matrix (n, k) in its file's form: type is a GGML type code (quant_blocks.h), data n rows of
 * row_bytes each. A fused projection is a chain of parts (next, or NULL), part p writing output columns
 * out_col .. out_col + n - 1 of rows out_stride floats apart. */
typedef struct {
    const void *data;
    const void *next;
    int64_t type;
    int64_t n;
    int64_t k;
    int64_t row_bytes;
    int64_t out_col;
    int64_t out_stride;
} BlockWeight;

/* out (rows, w.out_stride) = x (rows, w.k) W^T over w's parts; int8_x: x quantized to 8 bits per block of 32
 * before the products on block types (float types always multiply float32 x). */
typedef struct {
    const float *x;
    float *out;
    const BlockWeight *w;
    int64_t rows;
    int64_t int8_x;
} LinearArgs;

/* out (count, w.k) = rows ids of w (one part) as float32, the values gguf-py dequantizes to (a token
 * embedding lookup). An id outside 0 .. w.n - 1 leaves its row of out untouched and is counted in the
 * kernel's return value. */
typedef struct {
    const BlockWeight *w;
    const int64_t *ids;
    float *out;
    int64_t count;
} GatherRowsArgs;

/* out (rows, dim) = x / sqrt(mean(x^2) + eps) * weight. */
typedef struct {
    const float *x;
    const float *weight;
    float *out;
    int64_t rows;
    int64_t dim;
    float eps;
} RmsNormArgs;

/* out (rows, inter) = silu(gate) * up, gate_up (rows, 2 inter). */
typedef struct {
    const float *gate_up;
    float *out;
    int64_t rows;
    int64_t inter;
} SiluMulArgs;

/* One layer's paged KV cache: k and v (num_kv_heads, num_slots, head_dim), float32 or float16 (kv_f16). */
typedef struct {
    void *k;
    void *v;
    int64_t num_slots;
    int64_t kv_f16;
} KVCacheRef;

/* Rotary on q and k heads of qkv (rows, row_stride floats; q heads, k heads, v heads) in place, with
 * cos and sin (rows, head_dim); k and v written to the cache at slots (rows,). */
typedef struct {
    float *qkv;
    const float *cos;
    const float *sin;
    const int64_t *slots;
    const KVCacheRef *cache;
    int64_t row_stride;
    int64_t rows;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
} RopeWriteKVArgs;

/* q, out (batch, num_heads, head_dim); row b attends to the cache slots at slots + b * slot_stride, its
 * first ctx_lens[b] of them. */
typedef struct {
    const float *q;
    float *out;
    const int64_t *slots;
    const int64_t *ctx_lens;
    const KVCacheRef *cache;
    int64_t batch;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t slot_stride;
    float scale;
} DecodeAttentionArgs;

/* One decoder layer's weights and shape for decode_layer, built once per layer. */
typedef struct {
    const float *ln1;
    const float *ln2;
    const BlockWeight *qkv;
    const BlockWeight *o;
    const BlockWeight *gate_up;
    const BlockWeight *down;
    int64_t hidden;
    int64_t inter;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    float eps;
    float scale;
} DecodeLayerWeights;

/* What a decode step shares across layers: the residual stream x (rows, hidden), updated in place;
 * cos, sin (rows, head_dim); slots (rows,) for the new K/V; decode_slots (rows, max_ctx) and ctx_lens
 * (rows,) for attention; work: decode_layer_work_floats() floats of scratch. */
typedef struct {
    float *x;
    const float *cos;
    const float *sin;
    const int64_t *slots;
    const int64_t *decode_slots;
    const int64_t *ctx_lens;
    float *work;
    int64_t rows;
    int64_t max_ctx;
    int64_t int8_x;
} DecodeStep;

/* The sampler's chain over a batch (sampling.c). Per row: temperature (0: greedy), min_p, top_k (vocab:
 * off), top_p, keys (2 int64 noise halves); allowed[allowed_row[b]] (a packed mask of (vocab + 31) / 32 int32 words, token t
 * allowed when bit t % 32 of word t / 32 is set; row -1: none);
 * banned tokens and logit_bias as CSR lists (offsets (batch + 1,)); penalties from penalty_row[b]'s
 * seen_tokens (rows, seen_stride) int32, num_seen and output_counts (rows, vocab) int32. */
typedef struct {
    const float *logits;
    float *work;
    const float *temperature;
    const float *min_p;
    const int64_t *top_k;
    const float *top_p;
    const int64_t *keys;
    const void *allowed;
    const int64_t *allowed_row;
    const int64_t *ban_offsets;
    const int64_t *ban_tokens;
    const int64_t *bias_offsets;
    const int64_t *bias_tokens;
    const float *bias_values;
    const int32_t *seen_tokens;
    const int64_t *num_seen;
    const int32_t *output_counts;
    const int64_t *penalty_row;
    const float *repetition;
    const float *frequency;
    const float *presence;
    int64_t *tokens;
    int64_t write_work;
    int64_t batch;
    int64_t vocab;
    int64_t seen_stride;
} SampleArgs;

#endif
