/* One whole decoder layer for a decode step (every row one new token of its own sequence), in one call
 * instead of a dozen Python-level operations: the same kernels, in the same order, as the layer's
 * PyTorch forward with the kernels on (model/llama.py), so the results are identical; only the Python,
 * ctypes and PyTorch dispatch between them is gone. Weights are 4-bit (m != NULL) or 8-bit blocks. */
#include <stdint.h>
#include <string.h>

/* The kernels this layer strings together (block_linear.c, elementwise.c, decode_attention.c). */
void q4_linear_f32(const float *x, const uint8_t *qw, const uint16_t *d, const uint16_t *mn, float *out,
                   int64_t M, int64_t K, int64_t N);
void q8_linear_f32(const float *x, const int8_t *qw, const uint16_t *d, float *out, int64_t M, int64_t K, int64_t N);
void block_gemm_f32(const float *x, const void *qw, const uint16_t *d, const uint16_t *mn, float *out, int64_t M,
                    int64_t K, int64_t N);
void q4_gemm_i8(const float *x, const uint8_t *qw, const uint16_t *d, const uint16_t *mn, float *out, int64_t M,
                int64_t K, int64_t N);
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps);
void silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I);
void rope_write_kv_f32(float *qk, int64_t qk_stride, const float *v, int64_t v_stride, const float *cos,
                       const float *sin, void *k_cache, void *v_cache, const int64_t *slots, int64_t T,
                       int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t num_slots, int64_t kv_f16);
void decode_attention_f32(const float *q, const void *k_cache, const void *v_cache, const int64_t *slots,
                          const int64_t *ctx_lens, float *out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t slot_stride,
                          int64_t kv_f16, float scale);

#define BLOCKS_MAX_ROWS 5 /* as Linear.BLOCKS_MAX_ROWS: the streaming kernel up to here, then the GEMM */

/* w: the weight's blocks, {quants, d, m}, m NULL for 8-bit; int8_x: x quantized to 8 bits for 4-bit
 * weights (as Linear.int8_activations). */
static void linear(const float *x, const void *const *w, float *out, int64_t M, int64_t K, int64_t N,
                   int64_t int8_x) {
    if (int8_x && w[2]) q4_gemm_i8(x, w[0], w[1], w[2], out, M, K, N);
    else if (M > BLOCKS_MAX_ROWS) block_gemm_f32(x, w[0], w[1], w[2], out, M, K, N);
    else if (w[2]) q4_linear_f32(x, w[0], w[1], w[2], out, M, K, N);
    else q8_linear_f32(x, w[0], w[1], out, M, K, N);
}

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* x (M, hidden): the residual stream, updated in place. weights: 4 x {quants, d, m} for qkv, o,
 * gate_up, down. cos, sin (M, D); slots (M,) where each new K/V goes; decode_slots (M, max_ctx) and
 * ctx_lens (M,) for attention. work: at least M * (hidden + (H + 2 KVH) D + 2 H D + 3 inter) floats. */
void decode_layer_f32(float *x, int64_t M, int64_t hidden, int64_t inter, int64_t num_heads, int64_t num_kv_heads,
                      int64_t D, const float *ln1, const float *ln2, float eps, const void *const *weights,
                      const float *cos, const float *sin, void *k_cache, void *v_cache, int64_t num_slots,
                      int64_t kv_f16, const int64_t *slots, const int64_t *decode_slots, const int64_t *ctx_lens,
                      int64_t max_ctx, float scale, int64_t int8_x, float *work) {
    const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * D, q_width = num_heads * D;
    float *h = work;                      /* (M, hidden) normed input, then each projection's output */
    float *qkv = h + M * hidden;          /* (M, qkv_width) */
    float *q = qkv + M * qkv_width;       /* (M, q_width) contiguous queries for attention */
    float *attn = q + M * q_width;        /* (M, q_width) */
    float *gate_up = attn + M * q_width;  /* (M, 2 inter) */
    float *act = gate_up + M * 2 * inter; /* (M, inter) */

    rms_norm_f32(x, ln1, h, M, hidden, eps);
    linear(h, weights, qkv, M, hidden, qkv_width, int8_x);
    rope_write_kv_f32(qkv, qkv_width, qkv + (num_heads + num_kv_heads) * D, qkv_width, cos, sin, k_cache, v_cache,
                      slots, M, num_heads, num_kv_heads, D, num_slots, kv_f16);
    for (int64_t i = 0; i < M; i++) memcpy(q + i * q_width, qkv + i * qkv_width, sizeof(float) * (size_t)q_width);
    decode_attention_f32(q, k_cache, v_cache, decode_slots, ctx_lens, attn, M, num_heads, num_kv_heads, D,
                         num_slots, max_ctx, kv_f16, scale);
    linear(attn, weights + 3, h, M, q_width, hidden, int8_x);
    add_into(x, h, M * hidden);

    rms_norm_f32(x, ln2, h, M, hidden, eps);
    linear(h, weights + 6, gate_up, M, hidden, 2 * inter, int8_x);
    silu_mul_f32(gate_up, act, M, inter);
    linear(act, weights + 9, h, M, inter, hidden, int8_x);
    add_into(x, h, M * hidden);
}
