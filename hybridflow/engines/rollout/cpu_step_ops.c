/* Small ops of the eager decode step on CPU as one call each (cpu_step_ops.py): the rotary embedding (fp32, bf16)
 * and the RMSNorm (fp32, bf16), instead of torch's gather of the table rows and four ops, or its five-op norm (with
 * float conversions around it in bf16).
 *
 * Built without -ffast-math and with -ffp-contract=off: each product and sum is rounded as torch's op rounds it
 * (bf16 ops: computed in fp32, rounded to bf16 to nearest even, as torch's CPU kernels do), so the rotary embedding is
 * transformers' arithmetic bit for bit in both dtypes. The fp32 RMSNorm sums its squares in torch's order and is
 * torch's bit for bit (rms_norm_f32). The bf16 one sums them in fp32 in vector lanes, not in torch's order: its fp32
 * result can differ in the last bit, which changes the bf16 output only where that value lies within one fp32 ulp of
 * a bf16 rounding boundary.
 *
 * Rows are (row, head) pairs: row r, head h starts at x + r * sr + h * sh (strides in elements; the last dimension
 * is contiguous). Outputs are contiguous [R, H, n]. Small calls run on one thread: the fork would cost more.
 *
 * add_rms_norm_bf16 is a bf16 decode step's residual add and the norm after it as one call, qkv_heads_bf16 its
 * attention inputs from the fused projection (q/k norms, rotation, contiguous q, k, v) as one (cpu_step_ops.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* 16 lanes at a time in GCC's vector types (two registers on AVX2): the same per-element arithmetic as the scalar
 * functions above, in the same order */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* with AVX-512 each of these is a few instructions on one register (the generic conversions below widen and narrow
 * in halves, and round16_bf16 goes through memory): the step's small ops were bound by these conversions */
#include <immintrin.h>
static inline v16f load16_bf16(const bf16 *p) {
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline __m512i rounded16_bf16(v16f f) { /* to_bf16 on each lane, in the low 16 bits of its 32 */
    const __m512i u = (__m512i)f;
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask((__m512)f, (__m512)f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
static inline void store16_bf16(bf16 *p, v16f f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(rounded16_bf16(f)));
}
static inline v16f round16_bf16(v16f f) { return (v16f)_mm512_slli_epi32(rounded16_bf16(f), 16); }
#else
static inline v16f load16_bf16(const bf16 *p) {
    v16h h;
    __builtin_memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}
static inline void store16_bf16(bf16 *p, v16f f) { /* to_bf16 on each lane */
    const v16u u = (v16u)f, nan = (v16u)(f != f);
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16h h = __builtin_convertvector((rounded & ~nan) | (nan & 0x7fc0u), v16h);
    __builtin_memcpy(p, &h, sizeof h);
}
static inline v16f round16_bf16(v16f f) { /* from_bf16(to_bf16(f)) on each lane */
    bf16 tmp[16];
    store16_bf16(tmp, f);
    return load16_bf16(tmp);
}
#endif

/* one head x of D features rotated in bf16 (c, s: its position's table rows): each product rounded to bf16, then
 * their sum */
static inline void rotate_head_bf16(const bf16 *x, long D, const bf16 *c, const bf16 *s, long dim, bf16 *o) {
    const long half = dim / 2;
    long j = 0;
    if (half % 16 == 0) /* 16 features at a time, none straddling the halves */
        for (; j < dim; j += 16) {
            const v16f a = round16_bf16(load16_bf16(x + j) * load16_bf16(c + j));
            const v16f b = round16_bf16(load16_bf16(x + (j < half ? j + half : j - half)) * load16_bf16(s + j));
            store16_bf16(o + j, a + b);
        }
    for (; j < dim; j++) {
        const bf16 rolled = x[j < half ? j + half : j - half];
        const float a = from_bf16(to_bf16(from_bf16(x[j]) * from_bf16(c[j])));
        const float b = from_bf16(to_bf16(from_bf16(rolled) * from_bf16(s[j])));
        o[j] = to_bf16(a + b);
    }
    for (long j = dim; j < D; j++) o[j] = x[j];
}

/* rope_f32 in bf16 */
void rope_bf16(long R, long H, long D, const bf16 *x, long sr, long sh, const bf16 *cos, const bf16 *ssin,
               long dim, const int64_t *pos, bf16 *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * H * D >= PARALLEL_FROM)
    for (long t = 0; t < R * H; t++) {
        const long r = t / H;
        rotate_head_bf16(x + r * sr + (t % H) * sh, D, cos + pos[r] * dim, ssin + pos[r] * dim, dim, out + t * D);
    }
}

/* y = transformers' bf16 RMSNorm of one row x of n features: v = x * (1 / sqrt(mean(x^2) + eps)) in fp32, then
 * w * bf16(v) rounded to bf16 (Llama's order), or with offset (Gemma's: w holds 1 + w) bf16(v * w). The squares are
 * summed in 16 lanes (lane j takes the elements j mod 16), then the lanes in order, then the elements past them. */
static inline void norm_row_bf16(const bf16 *x, long n, const bf16 *w, float eps, int offset, bf16 *y) {
    v16f lanes = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16f v = load16_bf16(x + i);
        lanes += v * v;
    }
    float sum = 0.f;
    for (int j = 0; j < 16; j++) sum += lanes[j];
    for (; i < n; i++) sum += from_bf16(x[i]) * from_bf16(x[i]);
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    long k = 0;
    for (; k + 16 <= n; k += 16) {
        const v16f v = load16_bf16(x + k) * inv, wk = load16_bf16(w + k);
        store16_bf16(y + k, offset ? v * wk : wk * round16_bf16(v));
    }
    for (; k < n; k++) {
        const float v = from_bf16(x[k]) * inv;
        y[k] = offset ? to_bf16(v * from_bf16(w[k])) : to_bf16(from_bf16(w[k]) * from_bf16(to_bf16(v)));
    }
}

/* y_t = norm_row_bf16 of the R * H rows x_t of n features */
void rms_norm_bf16(long R, long H, long n, const bf16 *x, long sr, long sh, const bf16 *w, float eps, int offset,
                   bf16 *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * H * n >= PARALLEL_FROM)
    for (long t = 0; t < R * H; t++) norm_row_bf16(x + (t / H) * sr + (t % H) * sh, n, w, eps, offset, y + t * n);
}

/* A bf16 decode step's residual add and the norm after it, in one pass over the R rows of n features (contiguous):
 * x = x + y' in place, then h = the norm of x with weight w. y' is y, or y's own norm with weight yw (Gemma's
 * sandwich norm on a block's output; NULL: none), computed into h's row first. Each result is what torch's ops give
 * the eager step: the add rounds float(x) + float(y') to bf16 as torch's bf16 add does, the norms are
 * norm_row_bf16. */
void add_rms_norm_bf16(long R, long n, bf16 *x, const bf16 *y, const bf16 *yw, const bf16 *w, float eps, int offset,
                       bf16 *h, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * n >= PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        bf16 *xr = x + r * n, *hr = h + r * n;
        const bf16 *yr = y + r * n;
        if (yw) {
            norm_row_bf16(yr, n, yw, eps, offset, hr);
            yr = hr;
        }
        long k = 0;
        for (; k + 16 <= n; k += 16) store16_bf16(xr + k, load16_bf16(xr + k) + load16_bf16(yr + k));
        for (; k < n; k++) xr[k] = to_bf16(from_bf16(xr[k]) + from_bf16(yr[k]));
        norm_row_bf16(xr, n, w, eps, offset, hr);
    }
}

/* A bf16 decode step's attention inputs from its fused projection qkv [R, (H + 2 KV) D] (row stride sr): q [R, H, D]
 * and k [R, KV, D] rotated at positions pos (after their per-head norms with weights qn / kn where given: Qwen3,
 * Gemma 3), v [R, KV, D] copied, all contiguous: the eager step's norm, rotation and the attention kernel's copies
 * in one call, each value what rms_norm_bf16 and rope_bf16 give. */
void qkv_heads_bf16(long R, long H, long KV, long D, const bf16 *qkv, long sr, const bf16 *qn, const bf16 *kn,
                    float eps, int offset, const bf16 *cos, const bf16 *ssin, long dim, const int64_t *pos, bf16 *q,
                    bf16 *k, bf16 *v, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * (H + 2 * KV) * D >= PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        const bf16 *row = qkv + r * sr, *c = cos + pos[r] * dim, *s = ssin + pos[r] * dim;
        bf16 normed[D];
        for (long h = 0; h < H + KV; h++) {
            const bf16 *head = row + h * D, *w = h < H ? qn : kn;
            bf16 *out = h < H ? q + (r * H + h) * D : k + (r * KV + h - H) * D;
            if (w) {
                norm_row_bf16(head, D, w, eps, offset, normed);
                head = normed;
            }
            rotate_head_bf16(head, D, c, s, dim, out);
        }
        memcpy(v + r * KV * D, row + (H + KV) * D, KV * D * sizeof(bf16));
    }
}

/* torch's sum of the squares x_i * x_i of one contiguous fp32 row, in torch's order (aten's inner sum kernel for
 * V-lane vectors, SumKernel.cpp): whole vectors go to four vector accumulators in turn (vector 4 i + k to
 * accumulator k), with a cascade of partial sums every 2^p groups (p = max(4, ceil_log2(groups) / 4)); leftover
 * vectors go to accumulator 0, then accumulators 1-3 are added to it; the sum is the leftover elements' running
 * sum plus the accumulator's lanes in order. Each lane is a plain float sum, so this is bitwise torch's result. */
#define MAX_LANES 16
static inline __attribute__((always_inline)) float torch_sum_of_squares(const float *x, long n, int V) {
    const long vectors = n / V, groups = vectors / 4;
    long bits = 1;
    if (groups > 2) {
        bits = 0;
        for (unsigned long g = (unsigned long)(groups - 1); g; g >>= 1) bits++;
    }
    const long power = bits / 4 > 4 ? bits / 4 : 4, step = 1L << power, mask = step - 1;
    float acc[4][4][MAX_LANES] = {{{0}}}; /* [level][accumulator][lane] */
    long i = 0;
    for (; i + step <= groups;) {
        for (long j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; k++) {
                const float *v = x + (4 * i + k) * V;
                for (int l = 0; l < V; l++) acc[0][k][l] += v[l] * v[l];
            }
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < V; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < groups; ++i)
        for (int k = 0; k < 4; k++) {
            const float *v = x + (4 * i + k) * V;
            for (int l = 0; l < V; l++) acc[0][k][l] += v[l] * v[l];
        }
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < V; l++) acc[0][k][l] += acc[j][k][l];
    float *part = acc[0][0];
    for (long v = groups * 4; v < vectors; v++)
        for (int l = 0; l < V; l++) part[l] += x[v * V + l] * x[v * V + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < V; l++) part[l] += acc[0][k][l];
    float sum = 0.f;
    for (long e = vectors * V; e < n; e++) sum += x[e] * x[e];
    for (int l = 0; l < V; l++) sum += part[l];
    return sum;
}

/* y_t = F.rms_norm(x_t, w, eps) in fp32 for the R * H rows x_t of n features, bit for bit: the sum of squares in
 * torch's order (`lanes`: the float vector width of torch's sum kernel, 1 to 16, found at load by cpu_step_ops.py),
 * divided by n, plus eps, then
 * 1 / sqrt (torch's rsqrt), x * that, times w */
int rms_norm_f32(long R, long H, long n, const float *x, long sr, long sh, const float *w, float eps, int lanes,
                 float *y, int nthreads) {
    if (lanes < 1 || lanes > MAX_LANES) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * H * n >= PARALLEL_FROM)
    for (long t = 0; t < R * H; t++) {
        const float *xt = x + (t / H) * sr + (t % H) * sh;
        float *yt = y + t * n;
        /* a row shorter than a vector is summed as scalars, in the same grouping (torch's scalar path) */
        const int V = n >= lanes ? lanes : 1;
        /* the usual widths spelled out: with V a constant the compiler keeps the lanes in vector registers */
        const float sum = V == 16  ? torch_sum_of_squares(xt, n, 16)
                          : V == 8 ? torch_sum_of_squares(xt, n, 8)
                                   : torch_sum_of_squares(xt, n, V);
        const float mean = sum / (float)n;
        const float inv = 1.0f / sqrtf(mean + eps);
        for (long k = 0; k < n; k++) yt[k] = xt[k] * inv * w[k];
    }
    return 0;
}
