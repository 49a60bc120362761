/* GGUF block formats multiplied as the file stores them: y [M, N] = x [M, K] . W^T, W's rows the file's blocks.

   Before this kernel a GGUF expert was expanded into a float buffer on every use (core/model/quant/expand.py):
   ~190 M weights written and read back per token on the 784M test model. Here each weight row's blocks are
   decoded into a K-float row buffer of the thread's own (L1/L2-resident) and dotted at once with every
   activation row: the matrix is read once, at the file's bits, and never exists expanded.
   The decoders do the float32 arithmetic of `gguf.quants.dequantize` (core/model/quant/blocks.py): every
   product there is exact in float32 (an f16 scale times a small integer, or times a 6-bit scale and then a
   small integer), so the row buffer holds the reference's weights bit for bit, and only the dot's order of
   summation differs from torch's fp32 matmul (tests/test_gguf_native.py checks both). The math is fp32:
   no activation quantization, unlike llama.cpp's int8 dots.

   Layouts per block (bytes): see core/model/quant/blocks.py. kind: 0 Q8_0, 1 Q4_0, 2 Q4_K, 3 Q5_K, 4 Q6_K,
   5 MXFP4. Inputs bf16 or fp32, outputs bf16 (round to nearest even) or fp32. Plain C the compiler
   vectorises (-O3 with the ISA's flags: AVX-512, AVX2, or baseline); OpenMP splits output rows over torch's
   threads when built with -fopenmp. Entry points return 0, or -1 for a call they do not take.
   `mlight_gguf_moe` is one token's routed experts with SwiGLU in one call (decode at batch 1: the ~6 torch
   ops and two kernel calls an expert become one call a layer), gate/up and SiLU in float32. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#define OMP(directive) _Pragma(#directive)
#else
#define OMP(directive)
#endif

#define L 32 /* accumulator lanes a row: one Q8_0 block, a K-quant sub-block */
#define MR 4 /* activation rows a pass over the decoded weight row */

static const int BS[6] = {32, 32, 256, 256, 256, 32};   /* values a block */
static const int TS[6] = {34, 18, 144, 176, 210, 17};   /* bytes a block */
static const float MX[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float bf16f(uint16_t x) { return bits_f((uint32_t)x << 16); }
static inline uint16_t f32bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
/* IEEE half -> float, exactly (subnormals included) */
static inline float f16f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) { float f = (float)m * 5.9604644775390625e-8f; uint32_t u; memcpy(&u, &f, 4); return bits_f(u | s); }
    if (e == 31) return bits_f(s | 0x7f800000 | (m << 13));
    return bits_f(s | ((e + 112) << 23) | (m << 13));
}

static inline void q8_0(const uint8_t *b, float *w) {
    float d = f16f(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) w[j] = (float)q[j] * d;
}

static inline void q4_0(const uint8_t *b, float *w) {
    float d = f16f(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((int)(q[j] & 15) - 8);
        w[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
    }
}

/* the 8 six-bit scales and mins of a Q4_K / Q5_K block, times d and dmin */
static inline void scale_min_k4(const uint8_t *b, float *ds, float *dm) {
    float d = f16f(b), dmin = f16f(b + 2);
    const uint8_t *s = b + 4;
    for (int j = 0; j < 4; j++) {
        ds[j] = d * (float)(s[j] & 0x3f);
        dm[j] = dmin * (float)(s[j + 4] & 0x3f);
        ds[j + 4] = d * (float)((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
        dm[j + 4] = dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
}

static inline void q4_k(const uint8_t *b, float *w) {
    float ds[8], dm[8];
    scale_min_k4(b, ds, dm);
    const uint8_t *q = b + 16;
    for (int i = 0; i < 4; i++) /* 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high */
        for (int j = 0; j < 32; j++) {
            w[64 * i + j] = ds[2 * i] * (float)(q[32 * i + j] & 15) - dm[2 * i];
            w[64 * i + 32 + j] = ds[2 * i + 1] * (float)(q[32 * i + j] >> 4) - dm[2 * i + 1];
        }
}

static inline void q5_k(const uint8_t *b, float *w) {
    float ds[8], dm[8];
    scale_min_k4(b, ds, dm);
    const uint8_t *qh = b + 16, *q = b + 48;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 32; j++) {
            int lo = (q[32 * i + j] & 15) | (((qh[j] >> (2 * i)) & 1) << 4);
            int hi = (q[32 * i + j] >> 4) | (((qh[j] >> (2 * i + 1)) & 1) << 4);
            w[64 * i + j] = ds[2 * i] * (float)lo - dm[2 * i];
            w[64 * i + 32 + j] = ds[2 * i + 1] * (float)hi - dm[2 * i + 1];
        }
}

static inline void q6_k(const uint8_t *b, float *w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16f(b + 208), ds[16];
    for (int j = 0; j < 16; j++) ds[j] = d * (float)sc[j];
    for (int h = 0; h < 2; h++) /* halves of 128 values: 64 ql bytes, 32 qh bytes */
        for (int s = 0; s < 4; s++) { /* sub-block 4h + s: nibble s / 2 of ql[64h + 32(s % 2) + j] */
            const uint8_t *l = ql + 64 * h + 32 * (s & 1), *hb = qh + 32 * h;
            float lo16 = ds[8 * h + 2 * s], hi16 = ds[8 * h + 2 * s + 1], *o = w + 128 * h + 32 * s;
            for (int j = 0; j < 32; j++) {
                int q = (((l[j] >> (4 * (s >> 1))) & 15) | (((hb[j] >> (2 * s)) & 3) << 4)) - 32;
                o[j] = (j < 16 ? lo16 : hi16) * (float)q;
            }
        }
}

/* 2^(e - 128) from its bits, as ggml (subnormal for e < 2) */
static inline float e8m0_half(uint8_t e) { return bits_f(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

static inline void mxfp4(const uint8_t *b, float *w) {
    float d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        w[j] = d * MX[b[1 + j] & 15];
        w[j + 16] = d * MX[b[1 + j] >> 4];
    }
}

/* one weight row's blocks into w [K]: a loop per kind, so that each decoder is inlined into its own */
#define ROW(f, bs, ts) for (int64_t b = 0; b < K / (bs); b++) f(row + b * (ts), w + b * (bs)); break
static void decode_row(int kind, const uint8_t *row, int64_t K, float *w) {
    switch (kind) {
    case 0: ROW(q8_0, 32, 34);
    case 1: ROW(q4_0, 32, 18);
    case 2: ROW(q4_k, 256, 144);
    case 3: ROW(q5_k, 256, 176);
    case 4: ROW(q6_k, 256, 210);
    default: ROW(mxfp4, 32, 17);
    }
}

/* out[m] = w . x[m] for MRC rows of x, ldx floats apart: MRC a constant, so the accumulators stay in registers
   (indexed by a variable row count they lived on the stack: a store and a load around every FMA) */
static inline __attribute__((always_inline)) void dot_n(const float *w, int64_t K, const float *x, int64_t ldx,
                                                        const int MRC, float *out) {
    float acc[MR][L] = {{0}};
    for (int64_t k = 0; k < K; k += L) {
        const float *wk = w + k;
        for (int m = 0; m < MRC; m++) {
            const float *xk = x + m * ldx + k;
            for (int j = 0; j < L; j++) acc[m][j] += wk[j] * xk[j];
        }
    }
    for (int m = 0; m < MRC; m++) {
        float t = 0;
        for (int j = 0; j < L; j++) t += acc[m][j];
        out[m] = t;
    }
}

/* out[m] = w . x[m] for mr (1..MR) rows of x */
static void dot_rows(const float *w, int64_t K, const float *x, int64_t ldx, int mr, float *out) {
    switch (mr) {
    case 1: dot_n(w, K, x, ldx, 1, out); break;
    case 2: dot_n(w, K, x, ldx, 2, out); break;
    case 3: dot_n(w, K, x, ldx, 3, out); break;
    default: dot_n(w, K, x, ldx, 4, out); break;
    }
}

int mlight_gguf_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* floats of scratch a call needs: x as fp32 (when bf16) and a decoded row per thread */
int64_t mlight_gguf_scratch(int64_t M, int64_t K, int threads) { return M * K + (int64_t)threads * K; }

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) . W^T; W's rows ldw bytes apart from w */
int mlight_gguf_linear(int kind, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                       int64_t ldw, int64_t N, void *y, int y_bf16, int64_t ldy, float *scratch, int threads) {
    if (kind < 0 || kind > 5 || K % BS[kind] || M < 1 || threads < 1) return -1;
    const float *xf = (const float *)x;
    int64_t lx = ldx;
    if (x_bf16) {
        float *t = scratch;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) t[m * K + k] = bf16f(((const uint16_t *)x)[m * ldx + k]);
        xf = t, lx = K;
    }
    float *rows = scratch + M * K;
    OMP(omp parallel num_threads(threads))
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *wr = rows + (int64_t)t * K, out[MR];
        OMP(omp for schedule(static))
        for (int64_t n = 0; n < N; n++) {
            decode_row(kind, w + n * ldw, K, wr);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = M - m0 < MR ? (int)(M - m0) : MR;
                dot_rows(wr, K, xf + m0 * lx, lx, mr, out);
                for (int m = 0; m < mr; m++) {
                    int64_t i = (m0 + m) * ldy + n;
                    if (y_bf16) ((uint16_t *)y)[i] = f32bf(out[m]);
                    else ((float *)y)[i] = out[m];
                }
            }
        }
    }
    return 0;
}

/* One token's routed experts, SwiGLU: out [D] = sum_e w[e] * W2_e (silu(G_e x) * U_e x). W13_e = [G_e; U_e]
   [2I, D] in blocks of kind k13, rows ldw13 bytes apart, experts e13 bytes apart from w13; W2_e [D, I] in
   kind k2 likewise. ids int64, routing weights fp32 or bf16. Phases split over the team: every expert's
   gate/up rows; SiLU; the down rows (each output summed over the experts in the order given). */
int mlight_gguf_moe(int k13, int k2, const void *x, int x_bf16, int64_t D, int64_t I, int nexp, const int64_t *ids,
                    const void *wts, int w_bf16, const uint8_t *w13, int64_t e13, int64_t ldw13, const uint8_t *w2,
                    int64_t e2, int64_t ldw2, void *out, int out_bf16, float *scratch, int threads) {
    if (k13 < 0 || k13 > 5 || k2 < 0 || k2 > 5 || D % BS[k13] || I % BS[k2] || nexp < 1 || threads < 1) return -1;
    float *xf = scratch, *gu = xf + D, *rows = gu + (int64_t)nexp * 2 * I, w[64];
    if (nexp > 64) return -1;
    for (int e = 0; e < nexp; e++) w[e] = w_bf16 ? bf16f(((const uint16_t *)wts)[e]) : ((const float *)wts)[e];
    for (int64_t d = 0; d < D; d++) xf[d] = x_bf16 ? bf16f(((const uint16_t *)x)[d]) : ((const float *)x)[d];
    int64_t RW = D > I ? D : I;
    OMP(omp parallel num_threads(threads))
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *wr = rows + (int64_t)t * RW;
        OMP(omp for schedule(static))
        for (int64_t r = 0; r < nexp * 2 * I; r++) {
            int64_t e = r / (2 * I), n = r % (2 * I);
            decode_row(k13, w13 + ids[e] * e13 + n * ldw13, D, wr);
            dot_rows(wr, D, xf, D, 1, gu + r);
        }
        OMP(omp for schedule(static))
        for (int64_t r = 0; r < nexp * I; r++) {
            float *h = gu + (r / I) * 2 * I + r % I, g = h[0];
            h[0] = g / (1.f + expf(-g)) * h[I];
        }
        OMP(omp for schedule(static))
        for (int64_t d = 0; d < D; d++) {
            float y = 0, v;
            for (int e = 0; e < nexp; e++) {
                decode_row(k2, w2 + ids[e] * e2 + d * ldw2, I, wr);
                dot_rows(wr, I, gu + (int64_t)e * 2 * I, I, 1, &v);
                y += w[e] * v;
            }
            if (out_bf16) ((uint16_t *)out)[d] = f32bf(y);
            else ((float *)out)[d] = y;
        }
    }
    return 0;
}

/* floats of scratch a mlight_gguf_moe call needs */
int64_t mlight_gguf_moe_scratch(int64_t D, int64_t I, int nexp, int threads) {
    return D + (int64_t)nexp * 2 * I + (int64_t)threads * (D > I ? D : I);
}
