/* The eager decode step's rotary embedding on CPU in fp32 as one call (cpu_rotary.py) instead of torch's gather of
 * the table rows and four ops.
 *
 * Built without -ffast-math and with -ffp-contract=off: transformers' arithmetic bit for bit (x * cos and
 * roll(x) * signed_sin each rounded, then their sum).
 *
 * Rows are (row, head) pairs: row r, head h starts at x + r * sr + h * sh (strides in elements; the last dimension
 * is contiguous). The output is contiguous [R, H, D]. Small calls run on one thread: the fork would cost more.
 */
#include <stdint.h>

#define PARALLEL_FROM 32768L /* elements per call from which the rows are split over threads */

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
