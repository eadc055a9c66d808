/* One fp32 decode layer of the native rollout as two C calls instead of a dozen Python-level ops
   (cpu_decode_layer.py). It owns no arithmetic: it calls the kernels the eager step calls one by one -- the panel
   projections (cpu_panel_linear.c), the RMSNorm and rotary embedding (cpu_step_ops.c) and the decode attention
   (cpu_decode_attention.c) -- through the function pointers the Python side passes, with the same arguments in the
   same order, so its outputs are the same bits. Between the two calls the MLP activation stays torch's
   (act(gate) * up), since its exp is torch's own.

   layer_attention_f32: x += o_proj(attention(rope(q/k (norms), v))) of input_norm(x), with the sandwich norm on
   the attention output where the architecture has one; then gate_up = gate_up_proj(mlp_norm(x)).
   layer_mlp_out_f32:   x += down_proj(act) (post-MLP norm first, where the architecture has one).
   decode_step_f32:     a whole decode step in one call: the token embeddings, every layer with the MLP's gate in C
                        (act_mul_f32), the final norm and the output head's logits.
   decode_step_bf16:    the same in bf16 (cpu_bf16_step.py): the bf16 projections (cpu_bf16_linear.c: AMX or
                        AVX512-BF16), the fused residual norms and attention inputs (cpu_step_ops.c), the attention
                        and act_mul_bf16.
   moe_experts_bf16:    a bf16 step's routed experts and their weighted sum (cpu_bf16_step.py).

   act_mul_f32 reproduces torch's `act(gate).mul_(up)` bit for bit for SiLU and GELU's tanh form. torch's vector path
   computes x / (1 + exp(-x)), or 0.5 x (1 + tanh(beta (x + kappa x^3))), with its own vector exp or tanh (Sleef,
   passed in as a function pointer from libtorch), two vectors at a time, and the elements left over in each
   contiguous run of its loop with the scalar function (glibc's expf / tanhf). The vector and scalar functions differ
   in the last bit on some inputs, so which elements take which path is reproduced too: a row is one run, split where
   torch's parallel loop splits the flat index range between threads (SiLU and GELU use different thresholds). Where
   torch's build fused x + kappa x^3 into one multiply-add, so does `fma`. cpu_decode_layer.py checks the result
   against torch's before using it. act_mul_bf16 is the same for the eager bf16 decode step's gate (cpu_bf16_step.py),
   which keeps its bf16 projections between its C calls; moe_experts_bf16 runs that step's routed experts, their
   projections through the bf16 kernel's function pointer (cpu_bf16_linear.c). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*panel_fn)(const float *x, long M, long K, const float *packed, long N, const float *bias, float *y);
typedef int (*rms_fn)(long R, long H, long n, const float *x, long sr, long sh, const float *w, float eps, int lanes,
                      float *y, int nthreads);
typedef void (*rope_fn)(long R, long H, long D, const float *x, long sr, long sh, const float *cos, const float *ssin,
                        long dim, const int64_t *pos, float *out, int nthreads);
typedef void (*attn_fn)(int R, int KV, int G, int D, const float *q, float *out, float scale, float softcap,
                        const float *kA, long kAr, long kAh, long kAd, const float *vA, long vAr, long vAh, int lenA,
                        const int64_t *pa, const float *kB, long kBr, long kBh, long kBd, const float *vB, long vBr,
                        long vBh, int lenB, const int32_t *start, const float *kN, const float *vN, float *scratch,
                        int nthreads);

/* the kernels and the model's shape: fixed for a decoder */
struct model {
    panel_fn panel;
    rms_fn rms;
    rope_fn rope;
    attn_fn attn;
    long hidden, heads, kv_heads, head_dim, inter;
    float eps, scale, softcap; /* softcap 0: none */
    int lanes;                 /* the fp32 norm's vector width (cpu_step_ops.py's f32_lanes) */
    int sandwich;              /* norms around the attention and MLP outputs (Gemma) */
    const void *vact;          /* torch's vector exp (SiLU) or tanh (GELU), 16 or 8 floats; NULL: not available */
    int vact_width;            /* 16 or 8 */
    int act;                   /* ACT_SILU or ACT_GELU_TANH */
    int act_fma;               /* GELU: x + kappa x^3 as one multiply-add, as torch's build computes it */
};

/* one layer's tensors: packed weights, biases and norms (NULL where absent), its rotary table, its KV cache; fp32
   for the fp32 step, bf16 (weights packed in bf16 tiles) for decode_step_bf16 */
struct layer {
    const void *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm, *q_norm, *k_norm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    const void *cos, *ssin;
    long rotary_dim;
    /* segment A (the prompt part when shared, else the whole cache) and B (the generated part; unused when not
       shared), with their strides in elements */
    const void *kA, *vA;
    long kAr, kAh, kAd, vAr, vAh;
    const void *kB, *vB;
    long kBr, kBh, kBd, vBr, vBh;
    const void *moe; /* decode_step_bf16: a routed layer's struct moe_bf16 (NULL: a dense MLP) */
};

/* one decode step's rows and work buffers (contiguous, fp32) */
struct step {
    long R;
    int lenA, lenB, threads;
    const int64_t *positions;    /* [R] */
    const int64_t *prompt_index; /* [R] prompt slot of each row when the cache is shared, else NULL */
    float *x;                    /* [R, hidden]: the residual stream, updated in place */
    float *h;                    /* [R, hidden] */
    float *qkv;                  /* [R, (heads + 2 kv_heads) head_dim] */
    float *qn, *kn;              /* q/k after their norms, [R, heads, D] and [R, kv_heads, D]; NULL without them */
    float *q, *k, *v;            /* rotated q [R, heads, D], k and v [R, kv_heads, D] */
    float *attn;                 /* [R, heads * head_dim] */
    float *gate_up;              /* [R, 2 inter] */
    float *tmp;                  /* [R, hidden]: a sandwich norm's output; NULL without sandwich norms */
    float *scratch;              /* the attention's per-thread scratch */
    float *act;                  /* [R, inter]: the MLP's activation (decode_step_f32 only) */
};

static void residual_add(float *x, const float *y, long n) {
    for (long i = 0; i < n; i++) x[i] = x[i] + y[i];
}

void layer_attention_f32(const struct model *m, const struct layer *l, const struct step *s, const int32_t *start) {
    const long R = s->R, H = m->heads, KV = m->kv_heads, D = m->head_dim, hid = m->hidden;
    const long qs = H * D, kvs = KV * D, width = qs + 2 * kvs;
    /* attention block */
    m->rms(R, 1, hid, s->x, hid, hid, l->input_norm, m->eps, m->lanes, s->h, s->threads);
    m->panel(s->h, R, hid, l->qkv, width, l->qkv_bias, s->qkv);
    const float *qsrc = s->qkv, *ksrc = s->qkv + qs;
    long qsr = width, ksr = width;
    if (l->q_norm) { /* per-head norms before the rotation (Qwen3, Gemma 3) */
        m->rms(R, H, D, s->qkv, width, D, l->q_norm, m->eps, m->lanes, s->qn, s->threads);
        m->rms(R, KV, D, s->qkv + qs, width, D, l->k_norm, m->eps, m->lanes, s->kn, s->threads);
        qsrc = s->qn, ksrc = s->kn, qsr = qs, ksr = kvs;
    }
    m->rope(R, H, D, qsrc, qsr, D, l->cos, l->ssin, l->rotary_dim, s->positions, s->q, s->threads);
    m->rope(R, KV, D, ksrc, ksr, D, l->cos, l->ssin, l->rotary_dim, s->positions, s->k, s->threads);
    for (long r = 0; r < R; r++) memcpy(s->v + r * kvs, s->qkv + r * width + qs + kvs, kvs * sizeof(float));
    m->attn((int)R, (int)KV, (int)(H / KV), (int)D, s->q, s->attn, m->scale, m->softcap, l->kA, l->kAr, l->kAh,
            l->kAd, l->vA, l->vAr, l->vAh, s->lenA, s->prompt_index, l->kB, l->kBr, l->kBh, l->kBd, l->vB, l->vBr,
            l->vBh, s->lenB, start, s->k, s->v, s->scratch, s->threads);
    m->panel(s->attn, R, qs, l->o, hid, l->o_bias, s->h);
    if (m->sandwich) {
        m->rms(R, 1, hid, s->h, hid, hid, l->post_attn_norm, m->eps, m->lanes, s->tmp, s->threads);
        residual_add(s->x, s->tmp, R * hid);
    } else {
        residual_add(s->x, s->h, R * hid);
    }
    /* the MLP's input and its gate/up projection */
    m->rms(R, 1, hid, s->x, hid, hid, m->sandwich ? l->pre_ff_norm : l->post_attn_norm, m->eps, m->lanes, s->h,
           s->threads);
    if (l->gate_up) /* NULL on a routed-experts layer: its MLP runs in layer_moe_out_f32 on h */
        m->panel(s->h, R, hid, l->gate_up, 2 * m->inter, l->gate_up_bias, s->gate_up);
}

void layer_mlp_out_f32(const struct model *m, const struct layer *l, const struct step *s, const float *act) {
    const long R = s->R, hid = m->hidden;
    m->panel(act, R, m->inter, l->down, hid, l->down_bias, s->h);
    if (m->sandwich) {
        m->rms(R, 1, hid, s->h, hid, hid, l->post_ff_norm, m->eps, m->lanes, s->tmp, s->threads);
        residual_add(s->x, s->tmp, R * hid);
    } else {
        residual_add(s->x, s->h, R * hid);
    }
}

/* ---- routed experts (Qwen3-MoE) ------------------------------------------------------------------------- */

/* a routed-experts layer's packed expert weights: expert e's gate_up [2 inter, hidden] and down [hidden, inter] */
struct moe_layer {
    const float *const *gate_up, *const *down;
};

/* a decode step's routed-experts shape and work buffers, for R rows of k assignments each (contiguous) */
struct moe_step {
    long experts, k, inter;
    int act, act_fma; /* the experts' gate, as struct model's act / act_fma for their width */
    int64_t *token;   /* [R k]: the row of each assignment, grouped by expert */
    float *weight;    /* [R k]: its routing weight */
    float *rows;      /* [R k, hidden]: the assigned rows of h */
    float *gate_up;   /* [R k, 2 inter] */
    float *act_out;   /* [R k, inter] */
    float *y;         /* [R k, hidden]: each assignment's expert output, then times its weight */
    float *sum;       /* [R, hidden]: a row's weighted outputs summed */
};

int act_mul_f32(int act, int fma, const void *vfn, int width, const float *gate_up, long R, long inter, float *out,
                int threads);

/* slot[a] for each of A assignments to E experts (ids `experts`) grouped by expert in ascending order, stable, and
   first[e] expert e's first slot (first[E] = A). Returns 0, or -1 when an id is out of range. */
static int group_by_expert(const int64_t *experts, long A, long E, long *first, int64_t *slot) {
    for (long a = 0; a < A; a++)
        if (experts[a] < 0 || experts[a] >= E) return -1;
    memset(first, 0, (E + 1) * sizeof(long));
    for (long a = 0; a < A; a++) first[experts[a] + 1]++;
    for (long e = 0; e < E; e++) first[e + 1] += first[e];
    long next[E];
    memcpy(next, first, E * sizeof(long));
    for (long a = 0; a < A; a++) slot[a] = next[experts[a]]++;
    return 0;
}

/* x += sum over each row's k experts of weight * expert_mlp(h), for weights [R, k] (fp32) and expert ids [R, k]
   from the router (run by the caller on s->h, the MLP norm's output layer_attention_f32 left there), as moe.py's
   dispatch computes it: the assignments grouped by expert in ascending order, stable (a row's order within an
   expert is its index), each expert's rows through its gate_up product, the gate and its down product as one
   call each, every output times its weight, then summed per row from zero in that order, and the residual add.
   Returns 0, or -1 when an expert id is out of range, no vector function was given or the model has sandwich norms
   (no routed-experts architecture has them; nothing is changed). */
int layer_moe_out_f32(const struct model *m, const struct moe_layer *e, const struct step *s,
                      const struct moe_step *w, const float *weights, const int64_t *experts) {
    const long R = s->R, hid = m->hidden, k = w->k, E = w->experts, I = w->inter, A = R * k;
    long first[E + 1];
    int64_t slots[A];
    if (!m->vact || m->sandwich || group_by_expert(experts, A, E, first, slots)) return -1;
    for (long a = 0; a < A; a++) {
        const long slot = slots[a];
        w->token[slot] = a / k;
        w->weight[slot] = weights[a];
        memcpy(w->rows + slot * hid, s->h + (a / k) * hid, hid * sizeof(float));
    }
    for (long x = 0; x < E; x++) {
        const long n = first[x + 1] - first[x], at = first[x];
        if (!n) continue;
        m->panel(w->rows + at * hid, n, hid, e->gate_up[x], 2 * I, NULL, w->gate_up + at * 2 * I);
        act_mul_f32(w->act, w->act_fma, m->vact, m->vact_width, w->gate_up + at * 2 * I, n, I, w->act_out + at * I,
                    s->threads);
        m->panel(w->act_out + at * I, n, I, e->down[x], hid, NULL, w->y + at * hid);
    }
    for (long slot = 0; slot < A; slot++) {
        float *y = w->y + slot * hid;
        const float weight = w->weight[slot];
        for (long i = 0; i < hid; i++) y[i] = y[i] * weight;
    }
    memset(w->sum, 0, R * hid * sizeof(float));
    for (long slot = 0; slot < A; slot++) residual_add(w->sum + w->token[slot] * hid, w->y + slot * hid, hid);
    residual_add(s->x, w->sum, R * hid);
    return 0;
}

/* ---- torch's MLP activations, bit for bit ----------------------------------------------------------------- */

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
#define TORCH_GRAIN 32768       /* at::internal::GRAIN_SIZE: TensorIterator loops this long run on several threads */
#define TORCH_GELU_PARALLEL 16384 /* GELU's own threshold, above which its grain is the elements over the threads */
#define ACT_PARALLEL_FROM 4096   /* elements from which act_mul_f32 runs its rows on several threads */
#define GELU_BETA ((float)(M_SQRT2 * M_2_SQRTPI * 0.5))
#define GELU_KAPPA ((float)0.044715)

/* y = act(x) over n contiguous floats as torch's vectorised loop runs one contiguous run: two vectors at a time with
   the vector function, the rest with the scalar one */
static void act_run(int act, int fma, const float *x, float *y, long n, const void *vfn, int width) {
    long i = 0;
#ifdef __AVX512F__
    if (width == 16) {
        __m512 (*f16)(__m512) = (__m512(*)(__m512))vfn;
        const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f);
        const __m512 beta = _mm512_set1_ps(GELU_BETA), kappa = _mm512_set1_ps(GELU_KAPPA);
        while (i + 32 <= n)
            for (int j = 0; j < 2; j++, i += 16) {
                const __m512 v = _mm512_loadu_ps(x + i);
                __m512 r;
                if (act == ACT_SILU) {
                    r = _mm512_div_ps(v, _mm512_add_ps(one, f16(_mm512_xor_ps(sign, v))));
                } else {
                    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
                    const __m512 sum = fma ? _mm512_fmadd_ps(kappa, cube, v) : _mm512_add_ps(v, _mm512_mul_ps(kappa, cube));
                    r = _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, f16(_mm512_mul_ps(beta, sum))));
                }
                _mm512_storeu_ps(y + i, r);
            }
    }
#endif
#ifdef __AVX2__
    if (width == 8) {
        __m256 (*f8)(__m256) = (__m256(*)(__m256))vfn;
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
        const __m256 beta = _mm256_set1_ps(GELU_BETA), kappa = _mm256_set1_ps(GELU_KAPPA);
        while (i + 16 <= n)
            for (int j = 0; j < 2; j++, i += 8) {
                const __m256 v = _mm256_loadu_ps(x + i);
                __m256 r;
                if (act == ACT_SILU) {
                    r = _mm256_div_ps(v, _mm256_add_ps(one, f8(_mm256_xor_ps(sign, v))));
                } else {
                    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
                    const __m256 sum = fma ? _mm256_fmadd_ps(kappa, cube, v) : _mm256_add_ps(v, _mm256_mul_ps(kappa, cube));
                    r = _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, f8(_mm256_mul_ps(beta, sum))));
                }
                _mm256_storeu_ps(y + i, r);
            }
    }
#endif
    for (; i < n; i++) {
        const float v = x[i];
        if (act == ACT_SILU) {
            y[i] = v / (1.0f + expf(-v));
        } else {
            const float cube = v * v * v, sum = fma ? fmaf(GELU_KAPPA, cube, v) : v + GELU_KAPPA * cube;
            y[i] = 0.5f * v * (1.0f + tanhf(GELU_BETA * sum));
        }
    }
}

/* torch splits an elementwise op's flat range [0, numel) in equal chunks, one per thread, once it is at least a grain
   long (at::parallel_for in TensorIterator::for_each); each chunk loops row by row, so a chunk boundary inside a row
   splits that row into two runs. Returns the chunk length. */
static long torch_chunk(int act, long numel, int threads) {
    long chunk = numel, grain = TORCH_GRAIN;
    if (act == ACT_GELU_TANH && numel > TORCH_GELU_PARALLEL) grain = numel / threads;
    if (threads > 1 && numel >= grain) {
        long team = (numel + grain - 1) / grain;
        if (team > threads) team = threads;
        chunk = (numel + team - 1) / team;
    }
    return chunk;
}

/* act [R, inter] = act(gate) * up for gate_up [R, 2 inter] (gate, then up, per row), as torch computes
   `act(gate_up[:, :inter]).mul_(gate_up[:, inter:])` with `threads` threads. Returns 0, or -1 when no vector
   function was given or the activation is unknown (the caller keeps torch's ops). */
int act_mul_f32(int act, int fma, const void *vfn, int width, const float *gate_up, long R, long inter, float *out,
                int threads) {
    if (!vfn || (width != 16 && width != 8) || (act != ACT_SILU && act != ACT_GELU_TANH)) return -1;
    const long numel = R * inter, chunk = torch_chunk(act, numel, threads);
    /* the rows split over this kernel's own threads from a few thousand elements (a 16-row decode step of a small
       MLP): each row's runs follow torch's chunks above, not this split, so the bits do not depend on it */
#pragma omp parallel for num_threads(threads) schedule(static) if (numel >= ACT_PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *y = out + r * inter;
        for (long c = 0; c < inter;) {
            const long flat = r * inter + c;
            long end = (flat / chunk + 1) * chunk - r * inter; /* the next chunk boundary, as a column */
            if (end > inter) end = inter;
            act_run(act, fma, gate + c, y + c, end - c, vfn, width);
            c = end;
        }
        for (long c = 0; c < inter; c++) y[c] = y[c] * up[c];
    }
    return 0;
}

/* act_mul_f32 in bf16: act [R, inter] = act(gate) * up for gate_up [R, 2 inter] bf16, as torch computes
   `act(gate_up[:, :inter]).mul_(gate_up[:, inter:])` on bf16 tensors (the eager bf16 decode step's MLP gate). torch's
   bf16 kernels compute in fp32 and round to bf16: the activation with the fp32 kernel's arithmetic, its vectorised loop
   taking two bf16 vectors (four float vectors) at a time and the rest of each run with the scalar function, runs split
   between threads as in act_mul_f32; then the product of the two bf16 values, rounded. Returns 0, or -1 as
   act_mul_f32. */
typedef uint16_t bf16;
static inline float bf16_to_f32(bf16 h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}
static inline bf16 f32_to_bf16(float f) { /* round to nearest even, NaN to torch's quiet NaN */
    union { uint32_t u; float f; } x;
    x.f = f;
    if (isnan(f)) return 0x7fc0;
    return (bf16)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}
/* 16 lanes at a time in GCC's vector types (two registers on AVX2), each lane as the scalar functions above */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
static inline v16f load16_bf16(const bf16 *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}
static inline v16h to16_bf16(v16f f) {
    const v16u u = (v16u)f, nan = (v16u)(f != f);
    return __builtin_convertvector(((((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)) & ~nan) | (nan & 0x7fc0u), v16h);
}
#define ACT_BLOCK 256 /* floats converted at a time; a multiple of every vector loop's step (4 x 16 and 4 x 8) */

int act_mul_bf16(int act, int fma, const void *vfn, int width, const bf16 *gate_up, long R, long inter, bf16 *out,
                 int threads) {
    if (!vfn || (width != 16 && width != 8) || (act != ACT_SILU && act != ACT_GELU_TANH)) return -1;
    const long numel = R * inter, step = 4L * width, chunk = torch_chunk(act, numel, threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (numel >= ACT_PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        const bf16 *gate = gate_up + r * 2 * inter, *up = gate + inter;
        bf16 *y = out + r * inter;
        float in[ACT_BLOCK], res[ACT_BLOCK];
        for (long c = 0; c < inter;) {
            const long flat = r * inter + c;
            long end = (flat / chunk + 1) * chunk - r * inter; /* the run ends at torch's next chunk boundary */
            if (end > inter) end = inter;
            const long vector_end = c + (end - c) / step * step; /* the run's vector part: whole steps from its start */
            for (long b = c; b < end; b += ACT_BLOCK) {
                const long e = b + ACT_BLOCK < end ? b + ACT_BLOCK : end;
                const long v = e < vector_end ? e : (vector_end > b ? vector_end : b);
                long i = b;
                for (; i + 16 <= e; i += 16) {
                    const v16f g = load16_bf16(gate + i);
                    memcpy(in + (i - b), &g, sizeof g);
                }
                for (; i < e; i++) in[i - b] = bf16_to_f32(gate[i]);
                if (v > b) act_run(act, fma, in, res, v - b, vfn, width);
                if (e > v) act_run(act, fma, in + (v - b), res + (v - b), e - v, NULL, 0); /* scalar */
                for (i = b; i + 16 <= e; i += 16) {
                    v16f a;
                    memcpy(&a, res + (i - b), sizeof a);
                    const v16h rounded = to16_bf16(a);
                    const v16f product = (v16f)(__builtin_convertvector(rounded, v16u) << 16) * load16_bf16(up + i);
                    const v16h h = to16_bf16(product);
                    memcpy(y + i, &h, sizeof h);
                }
                for (; i < e; i++) y[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(res[i - b])) * bf16_to_f32(up[i]));
            }
            c = end;
        }
    }
    return 0;
}

/* ---- routed experts in bf16 (the eager bf16 decode step, cpu_bf16_step.py) ---------------------------------- */

/* y [M, N] = x [M, K] times a packed weight (cpu_bf16_linear.c's amx_linear_bf16 or dot_linear_bf16; K a multiple
   of 32) */
typedef void (*bf16_linear_fn)(const bf16 *x, long M, long K, const bf16 *packed, long N, const bf16 *bias, bf16 *y,
                               int nthreads);

/* a bf16 routed-experts layer: its experts' packed weights, their shape and gate, and work buffers for up to R rows
   of k assignments (contiguous) */
struct moe_bf16 {
    bf16_linear_fn linear;
    /* [experts]: expert e's gate_up [2 inter, hidden] and down [hidden, inter], packed */
    const bf16 *const *gate_up, *const *down;
    long experts, k, inter, hidden;
    int act, act_fma, vact_width; /* the experts' gate, as act_mul_bf16 takes it for their width */
    const void *vact;
    int64_t *slot; /* [R k]: where each assignment's output lands, grouped by expert */
    bf16 *rows;    /* [R k, hidden]: the assigned rows */
    bf16 *gate_up_out; /* [R k, 2 inter] */
    bf16 *act_out; /* [R k, inter] */
    bf16 *y;       /* [R k, hidden]: each assignment's expert output */
    /* the routing in C (cpu_moe_router.cpp's route_bf16; NULL: the step calls the model's router back): the router's
       product on `router` [experts, hidden] packed, into logits [R, experts], then route_weights and route_experts
       [R, k] (this layer's own, so that a step's routes can be recorded) */
    void (*route)(long R, long E, long k, int normalize, const bf16 *logits, const void *exp16, bf16 *weights,
                  int64_t *experts, void *scratch);
    const bf16 *router;
    const void *exp16;
    int normalize;
    bf16 *logits;
    void *scratch;
    bf16 *route_weights;
    int64_t *route_experts;
};

/* out [R, hidden] = sum over each row's k experts of weight * expert_mlp(h) for h [R, hidden], weights and expert ids
   [R, k] (bf16 and int64, the router's, moe.py's `route`), as moe.py's dispatch computes it in bf16: the assignments
   grouped by expert in ascending order, stable, each expert's rows through its gate_up product, the gate and its down
   product as one call each, each output times its weight (rounded to bf16), then summed per row from zero in expert
   order, each sum rounded (torch's bf16 index_add_). Returns 0, or -1 when an expert id is out of range (nothing
   is written). */
int moe_experts_bf16(const struct moe_bf16 *w, long R, const bf16 *h, const bf16 *weights, const int64_t *experts,
                     bf16 *out, int threads) {
    const long hid = w->hidden, k = w->k, E = w->experts, I = w->inter, A = R * k;
    long first[E + 1];
    if (group_by_expert(experts, A, E, first, w->slot)) return -1;
    for (long a = 0; a < A; a++) /* assignment a = (row a / k, its a % k-th expert) */
        memcpy(w->rows + w->slot[a] * hid, h + (a / k) * hid, hid * sizeof(bf16));
    /* experts in parallel, one thread each: an expert's products stream its weights from memory whatever its rows,
       and one thread reading one matrix front to back keeps the prefetchers ahead. The products run on that thread
       (their bits do not depend on it); act_mul_bf16 is given `threads` so that it splits its runs as torch does at
       that count (its own region, nested here, runs on this thread). */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long e = 0; e < E; e++) {
        const long n = first[e + 1] - first[e], at = first[e];
        if (!n) continue;
        w->linear(w->rows + at * hid, n, hid, w->gate_up[e], 2 * I, NULL, w->gate_up_out + at * 2 * I, 1);
        act_mul_bf16(w->act, w->act_fma, w->vact, w->vact_width, w->gate_up_out + at * 2 * I, n, I,
                     w->act_out + at * I, threads);
        w->linear(w->act_out + at * I, n, I, w->down[e], hid, NULL, w->y + at * hid, 1);
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (R * hid >= ACT_PARALLEL_FROM)
    for (long r = 0; r < R; r++) {
        long order[k]; /* this row's assignments by ascending expert: the order index_add_ sums them in */
        for (long j = 0; j < k; j++) {
            long at = j;
            while (at > 0 && experts[r * k + order[at - 1]] > experts[r * k + j]) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = j;
        }
        bf16 *o = out + r * hid;
        for (long j = 0; j < k; j++) {
            const long a = r * k + order[j];
            const bf16 *y = w->y + w->slot[a] * hid;
            const float weight = bf16_to_f32(weights[a]);
            long i = 0;
            for (; i + 16 <= hid; i += 16) {
                const v16h scaled = to16_bf16(load16_bf16(y + i) * weight);
                const v16h sum = j ? to16_bf16(load16_bf16(o + i) + load16_bf16((const bf16 *)&scaled))
                                   : to16_bf16(load16_bf16((const bf16 *)&scaled) + 0.0f);
                memcpy(o + i, &sum, sizeof sum);
            }
            for (; i < hid; i++) {
                const float scaled = bf16_to_f32(f32_to_bf16(bf16_to_f32(y[i]) * weight));
                o[i] = j ? f32_to_bf16(bf16_to_f32(o[i]) + scaled) : f32_to_bf16(scaled + 0.0f);
            }
        }
    }
    return 0;
}

/* ---- a bf16 decode step as one call (cpu_bf16_step.py) ---------------------------------------------------- */

typedef void (*rms_bf16_fn)(long R, long H, long n, const bf16 *x, long sr, long sh, const bf16 *w, float eps,
                            int offset, bf16 *y, int nthreads);
typedef void (*add_rms_bf16_fn)(long R, long n, bf16 *x, const bf16 *y, const bf16 *yw, const bf16 *w, float eps,
                                int offset, bf16 *h, int nthreads);
typedef void (*heads_bf16_fn)(long R, long H, long KV, long D, const bf16 *qkv, long sr, const bf16 *qn,
                              const bf16 *kn, float eps, int offset, const bf16 *cos, const bf16 *ssin, long dim,
                              const int64_t *pos, bf16 *q, bf16 *k, bf16 *v, int nthreads);
typedef void (*attn_bf16_fn)(int R, int KV, int G, int D, const bf16 *q, bf16 *out, float scale, float softcap,
                             const bf16 *kA, long kAr, long kAh, long kAd, const bf16 *vA, long vAr, long vAh,
                             int lenA, const int64_t *pa, const bf16 *kB, long kBr, long kBh, long kBd,
                             const bf16 *vB, long vBr, long vBh, int lenB, const int32_t *start, const bf16 *kN,
                             const bf16 *vN, float *scratch, int nthreads);

/* the kernels (cpu_bf16_linear.c, cpu_step_ops.c, cpu_decode_attention.c) and the model's shape */
struct model_bf16 {
    bf16_linear_fn linear;
    rms_bf16_fn rms;
    add_rms_bf16_fn add_rms;
    heads_bf16_fn heads;
    attn_bf16_fn attn;
    long hidden, heads_n, kv_heads, head_dim, inter;
    float eps, scale, softcap; /* softcap 0: none */
    int offset;                /* Gemma's norms: the weights hold 1 + w */
    int sandwich;
    const void *vact;
    int vact_width, act, act_fma;
    /* the router of routed layer `layer` (torch's, called back) on the step's h: fills its route_weights and
       route_experts; 0, or -1 when it failed */
    int (*router)(long layer);
};

/* a step's rows and work buffers, bf16 and contiguous */
struct step_bf16 {
    long R;
    int lenA, lenB, threads;
    const int64_t *positions, *prompt_index;
    bf16 *x;       /* [R, hidden]: the residual stream, updated in place */
    bf16 *h;       /* [R, hidden]: a norm's output */
    bf16 *qkv;     /* [R, (heads + 2 kv_heads) D] */
    bf16 *q, *k, *v; /* [R, heads, D], [R, kv_heads, D] twice */
    bf16 *attn;    /* [R, heads D] */
    bf16 *out;     /* [R, hidden]: the o and down projections' outputs */
    bf16 *gate_up; /* [R, 2 inter] */
    bf16 *act;     /* [R, inter] */
    float *scratch; /* the attention's */
    bf16 *route_weights;     /* [R, k]: a routed layer's router output */
    int64_t *route_experts;  /* [R, k] */
};

/* cpu_bf16_step.layers and the output head as one call, the same kernels on the same arguments in the same order:
   logits [R, vocab] bf16 of the residual stream x [R, hidden] (the scaled embeddings, updated in place). Each layer:
   qkv product; q/k norms, rotation and contiguous q, k, v (one call); attention (writing this step's k, v into the
   cache); o product; residual add and the MLP's norm; gate_up product; the gate; down product; residual add and the
   next norm; on a routed layer its routing (the router's product and route_bf16, or the router called back) and
   moe_experts_bf16 instead of the three MLP calls.
   `layers` are struct layer with bf16 tensors and weights packed in bf16 tiles. Returns 0; -1 when no vector function
   was given (nothing is computed), -2 when a router failed, -3 when it chose an expert out of range. */
int decode_step_bf16(const struct model_bf16 *m, const struct layer *layers, long n_layers,
                     const struct step_bf16 *s, const int32_t *const *starts, const bf16 *final_norm,
                     const bf16 *head, long vocab, bf16 *logits) {
    const long R = s->R, H = m->heads_n, KV = m->kv_heads, D = m->head_dim, hid = m->hidden, I = m->inter;
    const long width = (H + 2 * KV) * D;
    const int T = s->threads;
    if (!m->vact) return -1;
    m->rms(R, 1, hid, s->x, hid, hid, layers[0].input_norm, m->eps, m->offset, s->h, T);
    for (long li = 0; li < n_layers; li++) {
        const struct layer *l = layers + li;
        m->linear(s->h, R, hid, l->qkv, width, l->qkv_bias, s->qkv, T);
        m->heads(R, H, KV, D, s->qkv, width, l->q_norm, l->k_norm, m->eps, m->offset, l->cos, l->ssin, l->rotary_dim,
                 s->positions, s->q, s->k, s->v, T);
        m->attn((int)R, (int)KV, (int)(H / KV), (int)D, s->q, s->attn, m->scale, m->softcap, l->kA, l->kAr, l->kAh,
                l->kAd, l->vA, l->vAr, l->vAh, s->lenA, s->prompt_index, l->kB, l->kBr, l->kBh, l->kBd, l->vB, l->vBr,
                l->vBh, s->lenB, starts[li], s->k, s->v, s->scratch, T);
        m->linear(s->attn, R, H * D, l->o, hid, l->o_bias, s->out, T);
        m->add_rms(R, hid, s->x, s->out, m->sandwich ? l->post_attn_norm : NULL,
                   m->sandwich ? l->pre_ff_norm : l->post_attn_norm, m->eps, m->offset, s->h, T);
        const struct moe_bf16 *e = l->moe;
        if (e && e->route) {
            m->linear(s->h, R, hid, e->router, e->experts, NULL, e->logits, T);
            e->route(R, e->experts, e->k, e->normalize, e->logits, e->exp16, e->route_weights, e->route_experts,
                     e->scratch);
            if (moe_experts_bf16(e, R, s->h, e->route_weights, e->route_experts, s->out, T) != 0) return -3;
        } else if (e) {
            if (m->router(li) != 0) return -2;
            if (moe_experts_bf16(e, R, s->h, s->route_weights, s->route_experts, s->out, T) != 0) return -3;
        } else {
            m->linear(s->h, R, hid, l->gate_up, 2 * I, l->gate_up_bias, s->gate_up, T);
            act_mul_bf16(m->act, m->act_fma, m->vact, m->vact_width, s->gate_up, R, I, s->act, T);
            m->linear(s->act, R, I, l->down, hid, l->down_bias, s->out, T);
        }
        m->add_rms(R, hid, s->x, s->out, m->sandwich ? l->post_ff_norm : NULL,
                   li + 1 < n_layers ? layers[li + 1].input_norm : final_norm, m->eps, m->offset, s->h, T);
    }
    m->linear(s->h, R, hid, head, vocab, NULL, logits, T);
    return 0;
}

/* One decode step: x = embed[tokens] (* embed_scale, 0: none), every layer, then logits [R, vocab] of the final
   norm's rows through the packed head. starts[li]: layer li's first attended column per row. Returns 0, or -1 when a
   token is outside the embedding or no vector function was given (nothing is computed). */
int decode_step_f32(const struct model *m, const struct layer *layers, long n_layers, const struct step *s,
                    const int32_t *const *starts, const int64_t *tokens, const float *embed, long vocab_rows,
                    float embed_scale, const float *final_norm, const float *head, long vocab, float *logits) {
    const long R = s->R, hid = m->hidden;
    for (long r = 0; r < R; r++)
        if (tokens[r] < 0 || tokens[r] >= vocab_rows) return -1;
    if (!m->vact) return -1;
    for (long r = 0; r < R; r++) {
        float *x = s->x + r * hid;
        memcpy(x, embed + tokens[r] * hid, hid * sizeof(float));
        if (embed_scale != 0.0f)
            for (long i = 0; i < hid; i++) x[i] = x[i] * embed_scale;
    }
    for (long li = 0; li < n_layers; li++) {
        layer_attention_f32(m, layers + li, s, starts[li]);
        act_mul_f32(m->act, m->act_fma, m->vact, m->vact_width, s->gate_up, R, m->inter, s->act, s->threads);
        layer_mlp_out_f32(m, layers + li, s, s->act);
    }
    m->rms(R, 1, hid, s->x, hid, hid, final_norm, m->eps, m->lanes, s->h, s->threads);
    m->panel(s->h, R, hid, head, vocab, NULL, logits);
    return 0;
}

/* ---- the decode loop (cpu_decode_layer.py's `loop`) ------------------------------------------------------------ */

typedef long (*sample_fn)(long R, long V, const float *logits, long ld, float temperature, int greedy, const double *u,
                          int64_t *tokens, float *log_probs, double *block_sums, int nthreads);
typedef long (*filtered_fn)(long R, long V, const float *logits, long ld, float temperature, long top_k, double top_p,
                            const double *u, int64_t *tokens, float *log_probs, int nthreads);

/* A decode loop's state between steps: what native_rollout.py's loop keeps in tensors, by address. Rows are the
   running slots; none is dropped inside a call (the caller drops stopped rows between calls). */
struct loop {
    sample_fn sample;               /* cpu_sampling.c's sample_rows_f32 */
    filtered_fn filtered;           /* its sample_filtered_rows_f32 where top-k or top-p filters, else NULL */
    long top_k;
    double top_p;
    long vocab;                     /* the head's rows: a logits row */
    float temperature;              /* 1 when greedy */
    int greedy;
    const double *uniforms;         /* [uniforms_end - uniforms_first, R]: the draws of a step, one row per step */
    long uniforms_first, uniforms_end;
    long max_new;
    const int64_t *stop_ids;        /* [n_stop] */
    long n_stop;
    double compact_fraction;        /* return when done >= this fraction of the rows (and some are done) */
    int64_t *out_tokens;            /* [output rows, max_new] */
    float *out_log_probs;           /* [output rows, max_new] */
    int64_t *out_lengths;           /* [output rows] */
    const int64_t *row_index;       /* [R] the output row of each running slot */
    uint8_t *done;                  /* [R] whether a slot has stopped */
    long n_done;                    /* slots stopped since the last drop */
    int64_t *tokens;                /* [R] a step's chosen tokens */
    float *log_probs;               /* [R] */
    double *sums;                   /* [R, blocks]: sample_fn's scratch */
    float *logits;                  /* [R, vocab]: the decode steps' logits */
    int64_t *positions;             /* [R]: the positions of the next decode step, advanced in place */
    const int32_t *pads;            /* [R] left padding of each row's prompt */
    const long *windows;            /* [layers] a layer's sliding window, 0: full attention */
    int32_t *starts;                /* [layers, R]: a step's first attended column per layer and row */
    long prompt_len, offset;        /* kv_cache.py's */
    int shared;                     /* a shared prompt cache (segment A the prompts, B the generated tokens) */
    long step;                      /* out: the step the call stopped at */
    bf16 *step_logits;              /* [R, vocab]: a bf16 step's logits (decode_loop_bf16) */
};

/* Choose each row's token of step `step` from its logits [R, vocab], record it (token, log-prob, and the length where
   it is a stop token), as native_rollout.py's loop does. Returns 1 after the last step or once every row has
   stopped; 0 when enough rows have stopped to drop them; 2 before choosing a step whose draws are not in `uniforms`;
   -2 when a row of logits is no distribution (a NaN, +inf or only -inf); -3 when the top-k / top-p scratch could not
   be allocated; 3: go on (decode the next step). */
static long choose_and_record(struct loop *L, long R, long step, const float *logits, int threads) {
    const long V = L->vocab;
    L->step = step;
    if (!L->greedy && step >= L->uniforms_end) return 2;
    const double *u = L->greedy ? NULL : L->uniforms + (step - L->uniforms_first) * R;
    const long undecided =
        L->filtered ? L->filtered(R, V, logits, V, L->temperature, L->top_k, L->top_p, u, L->tokens, L->log_probs,
                                  threads)
                    : L->sample(R, V, logits, V, L->temperature, L->greedy, u, L->tokens, L->log_probs, L->sums,
                                threads);
    if (undecided < 0) return -3;
    if (undecided) return -2;
    for (long r = 0; r < R; r++) {
        const long at = L->row_index[r] * L->max_new + step;
        L->out_tokens[at] = L->tokens[r];
        L->out_log_probs[at] = L->log_probs[r];
        if (L->done[r]) continue;
        for (long j = 0; j < L->n_stop; j++)
            if (L->tokens[r] == L->stop_ids[j]) {
                L->out_lengths[L->row_index[r]] = step + 1;
                L->done[r] = 1;
                L->n_done++;
                break;
            }
    }
    if (step == L->max_new - 1 || L->n_done == R) return 1;
    if (L->n_done && (double)L->n_done >= L->compact_fraction * (double)R) return 0;
    return 3;
}

/* Decode step `step` (its K/V go to generated column `step`, it attends to `step + 1` generated keys): the cache's
   two key counts, and each layer's first attended column per row (the pads, clamped to a sliding window, as
   cpu_attention.py's `starts`) into starts[layers]. */
static void step_columns(struct loop *L, long R, long n_layers, long step, int *lenA, int *lenB,
                         const int32_t **starts) {
    const long length = step + 1;
    *lenA = (int)(L->shared ? L->prompt_len : L->offset + length);
    *lenB = (int)(L->shared ? length : 0);
    for (long li = 0; li < n_layers; li++) {
        const long window = L->windows[li];
        if (!window) {
            starts[li] = L->pads;
            continue;
        }
        int32_t *start = L->starts + li * R;
        const long first = L->prompt_len + length - window;
        for (long r = 0; r < R; r++) start[r] = L->pads[r] < first ? (int32_t)first : L->pads[r];
        starts[li] = start;
    }
}

/* Steps from `step` on, whose logits [R, vocab] are `logits` (the prefill's, or a decode step's): choose and record
   each step's tokens (choose_and_record), then decode the next step with them as one C call (decode_step_f32), as
   native_rollout.py's loop does step by step. Returns what choose_and_record returns (never 3), or -1 when a token is
   outside the embedding. L->step: the step it stopped at; on 2 the step's logits are in L->logits. */
long decode_loop_f32(const struct model *m, const struct layer *layers, long n_layers, struct step *s, struct loop *L,
                     long step, const float *logits, const float *embed, long vocab_rows, float embed_scale,
                     const float *final_norm, const float *head) {
    const long R = s->R, V = L->vocab;
    const int32_t *starts[n_layers > 0 ? n_layers : 1];
    for (;; step++) {
        const long status = choose_and_record(L, R, step, logits, s->threads);
        if (status != 3) return status;
        step_columns(L, R, n_layers, step, &s->lenA, &s->lenB, starts);
        if (decode_step_f32(m, layers, n_layers, s, starts, L->tokens, embed, vocab_rows, embed_scale, final_norm,
                            head, V, L->logits))
            return -1;
        for (long r = 0; r < R; r++) L->positions[r]++;
        logits = L->logits;
    }
}

/* decode_loop_f32 with bf16 steps (decode_step_bf16): each step's embeddings (times embed_scale rounded to bf16 as
   torch's bf16 product; 0: none) into s->x, its bf16 logits into L->step_logits, their fp32 values into L->logits.
   Returns as decode_loop_f32, and -4 when a step failed (decode_step_bf16's -1 to -3). */
long decode_loop_bf16(const struct model_bf16 *m, const struct layer *layers, long n_layers, struct step_bf16 *s,
                      struct loop *L, long step, const float *logits, const bf16 *embed, long vocab_rows,
                      float embed_scale, const bf16 *final_norm, const bf16 *head) {
    const long R = s->R, V = L->vocab, hid = m->hidden;
    const int32_t *starts[n_layers > 0 ? n_layers : 1];
    bf16 *step_logits = L->step_logits;
    for (;; step++) {
        const long status = choose_and_record(L, R, step, logits, s->threads);
        if (status != 3) return status;
        for (long r = 0; r < R; r++)
            if (L->tokens[r] < 0 || L->tokens[r] >= vocab_rows) return -1;
        for (long r = 0; r < R; r++) {
            bf16 *x = s->x + r * hid;
            memcpy(x, embed + L->tokens[r] * hid, hid * sizeof(bf16));
            if (embed_scale != 0.0f)
                for (long i = 0; i < hid; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * embed_scale);
        }
        step_columns(L, R, n_layers, step, &s->lenA, &s->lenB, starts);
        if (decode_step_bf16(m, layers, n_layers, s, starts, final_norm, head, V, step_logits)) return -4;
        for (long i = 0; i < R * V; i++) L->logits[i] = bf16_to_f32(step_logits[i]);
        for (long r = 0; r < R; r++) L->positions[r]++;
        logits = L->logits;
    }
}
