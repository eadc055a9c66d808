/* One fp32 decode layer of the native rollout as two C calls instead of a dozen Python-level ops
   (cpu_decode_layer.py). It owns no arithmetic: it calls the kernels the eager step calls one by one -- the panel
   projections (cpu_panel_linear.c), the RMSNorm and rotary embedding (cpu_step_ops.c) and the decode attention
   (cpu_decode_attention.c) -- through the function pointers the Python side passes, with the same arguments in the
   same order, so its outputs are the same bits. Between the two calls the MLP activation stays torch's
   (act(gate) * up), since its exp is torch's own.

   layer_attention_f32: x += o_proj(attention(rope(q/k (norms), v))) of input_norm(x), with the sandwich norm on
   the attention output where the architecture has one; then gate_up = gate_up_proj(mlp_norm(x)).
   layer_mlp_out_f32:   x += down_proj(act) (post-MLP norm first, where the architecture has one). */
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
};

/* one layer's tensors: packed weights, biases and norms (NULL where absent), its rotary table, its KV cache */
struct layer {
    const float *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm, *q_norm, *k_norm;
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    const float *cos, *ssin;
    long rotary_dim;
    /* segment A (the prompt part when shared, else the whole cache) and B (the generated part; unused when not
       shared), with their strides in elements */
    const float *kA, *vA;
    long kAr, kAh, kAd, vAr, vAh;
    const float *kB, *vB;
    long kBr, kBh, kBd, vBr, vBh;
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
