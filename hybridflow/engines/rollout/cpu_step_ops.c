/* Small ops of the eager decode step on CPU as one call each (cpu_step_ops.py): the rotary embedding (fp32, bf16)
 * and the bf16 RMSNorm, instead of torch's gather of the table rows and four ops, or its float conversions around a
 * five-op norm.
 *
 * Built without -ffast-math and with -ffp-contract=off: each product and sum is rounded as torch's op rounds it
 * (bf16 ops: computed in fp32, rounded to bf16 to nearest even, as torch's CPU kernels do), so the rotary embedding is
 * transformers' arithmetic bit for bit in both dtypes. The RMSNorm's sum of squares is summed in fp32 in vector
 * lanes, not in torch's order: its fp32 result can differ in the last bit, which changes the bf16 output only where
 * that value lies within one fp32 ulp of a bf16 rounding boundary.
 *
 * Rows are (row, head) pairs: row r, head h starts at x + r * sr + h * sh (strides in elements; the last dimension
 * is contiguous). Outputs are contiguous [R, H, n]. Small calls run on one thread: the fork would cost more.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_FROM 32768L /* elements per call from which the rows are split over threads */

typedef uint16_t bf16;

static inline float from_bf16(bf16 h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}
static inline bf16 to_bf16(float f) { /* round to nearest even, NaN to torch's quiet NaN */
    union { uint32_t u; float f; } x;
    x.f = f;
    if (isnan(f)) return 0x7fc0;
    return (bf16)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* out[t, :] for the R * H rows x_t of D features at position pos[r]: the first `dim` features rotated,
 * x * cos[p] + roll(x, dim / 2) * ssin[p] (ssin: rotate_half's sign folded into sin), the rest copied.
 * cos, ssin: tables [positions, dim]. */
void rope_f32(long R, long H, long D, const float *x, long sr, long sh, const float *cos, const float *ssin,
              long dim, const int64_t *pos, float *out, int nthreads) {
    const long half = dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * H * D >= PARALLEL_FROM)
    for (long t = 0; t < R * H; t++) {
        const long r = t / H;
        const float *xt = x + r * sr + (t % H) * sh;
        const float *c = cos + pos[r] * dim, *s = ssin + pos[r] * dim;
        float *o = out + t * D;
        for (long j = 0; j < half; j++) o[j] = xt[j] * c[j] + xt[j + half] * s[j];
        for (long j = half; j < dim; j++) o[j] = xt[j] * c[j] + xt[j - half] * s[j];
        for (long j = dim; j < D; j++) o[j] = xt[j];
    }
}

/* rope_f32 in bf16: each product rounded to bf16, then their sum */
void rope_bf16(long R, long H, long D, const bf16 *x, long sr, long sh, const bf16 *cos, const bf16 *ssin,
               long dim, const int64_t *pos, bf16 *out, int nthreads) {
    const long half = dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * H * D >= PARALLEL_FROM)
    for (long t = 0; t < R * H; t++) {
        const long r = t / H;
        const bf16 *xt = x + r * sr + (t % H) * sh;
        const bf16 *c = cos + pos[r] * dim, *s = ssin + pos[r] * dim;
        bf16 *o = out + t * D;
        for (long j = 0; j < dim; j++) {
            const bf16 rolled = xt[j < half ? j + half : j - half];
            const float a = from_bf16(to_bf16(from_bf16(xt[j]) * from_bf16(c[j])));
            const float b = from_bf16(to_bf16(from_bf16(rolled) * from_bf16(s[j])));
            o[j] = to_bf16(a + b);
        }
        for (long j = dim; j < D; j++) o[j] = xt[j];
    }
}

/* y_t = transformers' bf16 RMSNorm of the R * H rows x_t of n features: v = x * (1 / sqrt(mean(x^2) + eps)) in
 * fp32, then w * bf16(v) rounded to bf16 (Llama's order), or with offset (Gemma's: w holds 1 + w) bf16(v * w) */
void rms_norm_bf16(long R, long H, long n, const bf16 *x, long sr, long sh, const bf16 *w, float eps, int offset,
                   bf16 *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * H * n >= PARALLEL_FROM)
    for (long t = 0; t < R * H; t++) {
        const bf16 *xt = x + (t / H) * sr + (t % H) * sh;
        bf16 *yt = y + t * n;
        float lanes[16] = {0};
        long i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) {
                const float v = from_bf16(xt[i + j]);
                lanes[j] += v * v;
            }
        float sum = 0.f;
        for (int j = 0; j < 16; j++) sum += lanes[j];
        for (; i < n; i++) sum += from_bf16(xt[i]) * from_bf16(xt[i]);
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (long k = 0; k < n; k++) {
            const float v = from_bf16(xt[k]) * inv;
            yt[k] = offset ? to_bf16(v * from_bf16(w[k])) : to_bf16(from_bf16(w[k]) * from_bf16(to_bf16(v)));
        }
    }
}
