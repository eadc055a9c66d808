/* Backward passes of the training engine's fused CPU ops (cpu_train_ops.py): the RMSNorm's (fp32) and the gated
 * MLP's (SwiGLU: silu(a) * b; fp32 and bf16), each one pass over its rows. Their forwards are torch's arithmetic
 * (the norm is the native rollout's bit-exact C kernel, the SwiGLU torch's own ops), so only gradients come from
 * here: fp32 sums, not torch's order, which is rounding only.
 *
 * Built with -ffast-math for the vectorised expf. Work is split over threads in fixed chunks, and the norm weight's
 * gradient sums per-thread partials in thread order, so a result depends on the thread count only.
 */
#include <math.h>
#include <omp.h>

#define PARALLEL_FROM 32768L /* elements from which a call is split over threads */

/* For the R rows x_t of n features (row stride sx; g, dx: contiguous [R, n]) of y_t = x_t * r_t * w with
 * r_t = 1 / sqrt(mean(x_t^2) + eps) (w: the norm's effective weight, Gemma's 1 + w):
 *   dx_t = r_t * (g_t * w) - x_t * r_t^3 * sum(g_t * w * x_t) / n
 *   dw   = sum_t g_t * x_t * r_t          (when dw is not NULL; partial: nthreads * n floats of scratch) */
void rms_norm_backward_f32(long R, long n, const float *x, long sx, const float *g, const float *w, float eps,
                           float *dx, float *dw, float *partial, int nthreads) {
    const int threads = R * n >= PARALLEL_FROM ? nthreads : 1;
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp single
        used = nth;
        float *acc = dw ? partial + (long)tid * n : 0;
        if (acc)
            for (long k = 0; k < n; k++) acc[k] = 0.f;
        const long lo = R * tid / nth, hi = R * (tid + 1) / nth;
        for (long t = lo; t < hi; t++) {
            const float *xt = x + t * sx, *gt = g + t * n;
            float ss = 0.f, dot = 0.f;
            for (long k = 0; k < n; k++) {
                ss += xt[k] * xt[k];
                dot += gt[k] * w[k] * xt[k];
            }
            const float r = 1.0f / sqrtf(ss / (float)n + eps);
            const float c = r * r * r * dot / (float)n;
            float *dxt = dx + t * n;
            for (long k = 0; k < n; k++) dxt[k] = r * gt[k] * w[k] - xt[k] * c;
            if (acc)
                for (long k = 0; k < n; k++) acc[k] += gt[k] * xt[k] * r;
        }
    }
    if (dw) {
        for (long k = 0; k < n; k++) dw[k] = partial[k];
        for (int t = 1; t < used; t++)
            for (long k = 0; k < n; k++) dw[k] += partial[(long)t * n + k];
    }
}

typedef unsigned short bf16;
static inline float from_f32(float f) { return f; }
static inline float to_f32(float f) { return f; }
static inline float from_bf16(bf16 h) {
    union { unsigned u; float f; } v = {(unsigned)h << 16};
    return v.f;
}
static inline bf16 to_bf16(float f) { /* round to nearest even, NaN to torch's quiet NaN */
    union { float f; unsigned u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    return (bf16)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* The gradients of y = silu(a) * b for R rows of C features: a, b with row strides sa, sb; gy contiguous [R, C];
 * da, db with row strides sda, sdb (the same buffer for a fused gate/up projection's output):
 *   db = gy * silu(a),  da = gy * b * s * (1 + a * (1 - s)),  s = sigmoid(a)
 * in fp32 arithmetic; the bf16 variant (a bf16 engine's gate/up outputs under autocast) reads bf16 and rounds each
 * gradient to bf16 once (nearest even), where torch's backward rounds after each op. */
#define SILU_MUL_BACKWARD(NAME, T, LOAD, STORE)                                                                     \
    void NAME(long R, long C, const T *a, long sa, const T *b, long sb, const T *gy, T *da, long sda, T *db,        \
              long sdb, int nthreads) {                                                                            \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (R * C >= PARALLEL_FROM)")              \
        for (long t = 0; t < R; t++) {                                                                             \
            const T *at = a + t * sa, *bt = b + t * sb, *gt = gy + t * C;                                          \
            T *dat = da + t * sda, *dbt = db + t * sdb;                                                            \
            _Pragma("omp simd")                                                                                    \
            for (long k = 0; k < C; k++) {                                                                         \
                const float x = LOAD(at[k]);                                                                       \
                const float s = 1.0f / (1.0f + expf(-x));                                                          \
                const float gs = LOAD(gt[k]) * s;                                                                  \
                dbt[k] = STORE(gs * x);                                                                            \
                dat[k] = STORE(gs * LOAD(bt[k]) * (1.0f + x * (1.0f - s)));                                        \
            }                                                                                                      \
        }                                                                                                          \
    }
SILU_MUL_BACKWARD(silu_mul_backward_f32, float, from_f32, to_f32)
SILU_MUL_BACKWARD(silu_mul_backward_bf16, bf16, from_bf16, to_bf16)
