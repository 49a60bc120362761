/* A layer's routed experts in one call, bf16 weights and activations, AVX-512 BF16 (vdpbf16ps).

   For tokens x [T, D] routed to k of E experts with weights w [T, k]: out = sum_j w_j *
   down_e(silu(gate_e(x)) * up_e(x)), e = idx[t, j]. oneDNN's packed bf16 GEMM reaches 62-79 % of the
   machine's peak at the 16-32 rows an expert sees in a decode step (two Zen 5 cores); this kernel
   keeps a 6-row x 64-column tile of fp32 sums in registers, streams each weight panel once in the
   order it is stored (software prefetch ahead), and fuses what torch runs as separate passes: the
   gather of each expert's rows (read in place through the token index), SiLU(gate) * up (in fp32,
   rounded once to bf16), the routing weight and the sum over experts (in fp32, rounded once).

   Packed layouts, made once at load by core/model/cpu/ffn.py (bf16 pairs along K, as vdpbf16ps reads),
   expert e's at w13 + e * s13 and w2 + e * s2 (elements):
     gate/up of expert e: I/32 panels, panel p = [D/2][4][16][2]: vectors 0-1 gate columns 32p..32p+31,
       vectors 2-3 up columns 32p..32p+31;
     down of expert e: D/64 panels, panel p = [I/2][4][16][2]: output columns 64p..64p+63.
   Threads (OpenMP, on the libgomp torch has loaded): gate/up panels then down panels are split into
   contiguous runs, one per thread, with one barrier between; each thread owns its output columns.
   Scratch (bytes from mlight_moe_scratch): routing order, the bf16 [T*k, I] intermediate and a fp32
   [T, 64] sum per thread. Returns 0, or -1 for an expert id out of range. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 4  /* 16-float vectors per tile row: 64 output columns */
#define MR 6  /* rows per tile: 24 accumulators + 4 weight vectors + a broadcast in 32 registers */
#define PFD 16 /* K pairs ahead that the weight stream is prefetched */

static inline __m512 exp512(__m512 x) { /* 2^n * p(r), relative error < 2e-7; saturates to 0 / inf */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu_mul(__m512 g, __m512 u) { /* g * sigmoid(g) * u */
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.f))), u);
}

/* 16 fp32 -> 16 bf16, round to nearest even (vcvtneps2bf16) */
static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline void prefetch_panel(const uint16_t *w) {
    const char *c = (const char *)w;
    _mm_prefetch(c, _MM_HINT_T0);
    _mm_prefetch(c + 64, _MM_HINT_T0);
    _mm_prefetch(c + 128, _MM_HINT_T0);
    _mm_prefetch(c + 192, _MM_HINT_T0);
}

/* One tile: M rows (a compile-time constant in each instance, so the sums stay in registers) of an
   input against a 64-column panel over all of K, then its epilogue. GATE_UP: rows of x, gathered
   through tok; out[r] = silu(gate) * up (32 bf16). Else: rows of the intermediate; sum[tok[r]] +=
   weight * y (64 fp32). */
enum { GATE_UP, DOWN };

static inline __attribute__((always_inline)) void tile(const int M, const int mode, const uint16_t *in, int64_t ld,
                                                       const int32_t *tok, const float *wt, const uint16_t *w,
                                                       int64_t K2, uint16_t *mid, int64_t I, float *sum,
                                                       const char *next, int64_t lines) {
    __m512 acc[MR][NR];
    const int64_t per_step = (lines + K2 - 1) / K2;
    const uint16_t *rows[MR];
    for (int m = 0; m < M; m++) {
        rows[m] = mode == GATE_UP ? in + (int64_t)tok[m] * ld : in + m * ld;
        for (int v = 0; v < NR; v++) acc[m][v] = _mm512_setzero_ps();
    }
    for (int64_t k2 = 0; k2 < K2; k2++, w += 32 * NR) {
        prefetch_panel(w + 32 * NR * PFD);
        for (int64_t j = 0; j < per_step && lines > 0; j++, lines--, next += 64) _mm_prefetch(next, _MM_HINT_T1);
        __m512bh wv[NR];
        for (int v = 0; v < NR; v++) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
        for (int m = 0; m < M; m++) {
            int32_t pair;
            memcpy(&pair, rows[m] + 2 * k2, 4);
            __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NR; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], b, wv[v]);
        }
    }
    for (int m = 0; m < M; m++) {
        if (mode == GATE_UP) {
            store_bf16(mid + m * I, silu_mul(acc[m][0], acc[m][2]));
            store_bf16(mid + m * I + 16, silu_mul(acc[m][1], acc[m][3]));
        } else {
            float *s = sum + (int64_t)tok[m] * 64;
            __m512 g = _mm512_set1_ps(wt[m]);
            for (int v = 0; v < NR; v++)
                _mm512_storeu_ps(s + 16 * v, _mm512_fmadd_ps(acc[m][v], g, _mm512_loadu_ps(s + 16 * v)));
        }
    }
}

#pragma GCC push_options
#pragma GCC optimize("unroll-loops")
#define TILES(M)                                                                                           \
static void gate_up_##M(const uint16_t *x, int64_t D, const int32_t *tok, const uint16_t *w, uint16_t *mid, \
                        int64_t I, const char *next, int64_t lines) {                                      \
    tile(M, GATE_UP, x, D, tok, 0, w, D / 2, mid, I, 0, next, lines);                                      \
}                                                                                                          \
static void down_##M(const uint16_t *mid, int64_t I, const int32_t *tok, const float *wt, const uint16_t *w, \
                     float *sum, const char *next, int64_t lines) {                                        \
    tile(M, DOWN, mid, I, tok, wt, w, I / 2, 0, 0, sum, next, lines);                                      \
}
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
#pragma GCC pop_options

typedef void (*gate_up_fn)(const uint16_t *, int64_t, const int32_t *, const uint16_t *, uint16_t *, int64_t,
                           const char *, int64_t);
typedef void (*down_fn)(const uint16_t *, int64_t, const int32_t *, const float *, const uint16_t *, float *,
                        const char *, int64_t);
static const gate_up_fn GATE_UPS[MR + 1] = {0, gate_up_1, gate_up_2, gate_up_3, gate_up_4, gate_up_5, gate_up_6};
static const down_fn DOWNS[MR + 1] = {0, down_1, down_2, down_3, down_4, down_5, down_6};

/* The tiles of a panel over n rows spread the prefetch of the next panel (`next`, `bytes`; the thread's
   next work) into L2 among them: the later tiles read this panel from L2 and would otherwise leave
   the memory idle while they compute. */
static inline int64_t share(int64_t bytes, int64_t n, int64_t r) {
    int64_t tiles = (n + MR - 1) / MR, lines = bytes / 64;
    return lines * (r / MR + 1) / tiles - lines * (r / MR) / tiles;
}

/* One gate/up panel for an expert's n rows: mid[r, 32p..32p+31] = silu(gate) * up, bf16. */
static void gate_up_panel(const uint16_t *x, int64_t D, const int32_t *tok, int64_t n, const uint16_t *w,
                          uint16_t *mid, int64_t I, const uint16_t *next, int64_t bytes) {
    for (int64_t r = 0; r < n; r += MR)
        GATE_UPS[n - r < MR ? n - r : MR](x, D, tok + r, w, mid + r * I, I,
                                          (const char *)next + 64 * (bytes / 64 * (r / MR) / ((n + MR - 1) / MR)),
                                          share(bytes, n, r));
}

/* One down panel for an expert's n rows: sum[tok, 0..63] += weight * (mid row @ panel). */
static void down_panel(const uint16_t *mid, int64_t I, const int32_t *tok, const float *wt, int64_t n,
                       const uint16_t *w, float *sum, const uint16_t *next, int64_t bytes) {
    for (int64_t r = 0; r < n; r += MR)
        DOWNS[n - r < MR ? n - r : MR](mid + r * I, I, tok + r, wt + r, w, sum,
                                       (const char *)next + 64 * (bytes / 64 * (r / MR) / ((n + MR - 1) / MR)),
                                       share(bytes, n, r));
}

/* the first expert after e that got rows, or E */
static inline int64_t next_expert(const int32_t *start, int64_t E, int64_t e) {
    for (e++; e < E && start[e + 1] == start[e]; e++) {}
    return e;
}

static inline int64_t align64(int64_t b) { return (b + 63) & ~(int64_t)63; }

int64_t mlight_moe_scratch(int64_t T, int64_t k, int64_t E, int64_t I, int64_t threads) {
    return 2 * align64(4 * (E + 1)) + align64(4 * T * k) + align64(4 * T * k) + align64(2 * T * k * I) +
           align64(4 * T * 64) * threads + 64;
}

int mlight_moe_ffn(const uint16_t *x, int64_t T, int64_t k, const int64_t *idx, const void *wts, int wts_bf16,
                   int64_t E, int64_t D, int64_t I, const uint16_t *w13, int64_t s13, const uint16_t *w2, int64_t s2,
                   uint16_t *out, void *scratch, int threads) {
    char *s = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *start = (int32_t *)s, *fill = (int32_t *)(s + align64(4 * (E + 1)));
    s += 2 * align64(4 * (E + 1));
    int32_t *tok = (int32_t *)s;
    s += align64(4 * T * k);
    float *wt = (float *)s;
    s += align64(4 * T * k);
    uint16_t *mid = (uint16_t *)s;
    s += align64(2 * T * k * I);
    float *sums = (float *)s;
    /* the (token, slot) pairs grouped by expert, tokens ascending within each (a counting sort) */
    memset(start, 0, 4 * (E + 1));
    for (int64_t i = 0; i < T * k; i++) {
        if (idx[i] < 0 || idx[i] >= E) return -1;
        start[idx[i] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, 4 * E);
    for (int64_t i = 0; i < T * k; i++) {
        int32_t at = fill[idx[i]]++;
        tok[at] = (int32_t)(i / k);
        if (wts_bf16) {
            uint32_t b = (uint32_t)((const uint16_t *)wts)[i] << 16;
            memcpy(wt + at, &b, 4);
        } else {
            wt[at] = ((const float *)wts)[i];
        }
    }
    const int64_t PA = I / 32, PB = D / 64;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int nt = 1, id = 0;
#endif
        const int64_t a0 = PA * id / nt, a1 = PA * (id + 1) / nt, b0 = PB * id / nt, b1 = PB * (id + 1) / nt;
        const int64_t first = next_expert(start, E, -1);
        for (int64_t e = first; e < E; e = next_expert(start, E, e)) {
            const int64_t n = start[e + 1] - start[e], en = next_expert(start, E, e);
            for (int64_t p = a0; p < a1; p++) {
                /* what this thread reads next: the following panel, the next expert's first, or its first down panel */
                const uint16_t *nx = p + 1 < a1 ? w13 + e * s13 + (p + 1) * D * 64
                                   : en < E ? w13 + en * s13 + a0 * D * 64 : w2 + first * s2 + b0 * I * 64;
                gate_up_panel(x, D, tok + start[e], n, w13 + e * s13 + p * D * 64, mid + start[e] * I + p * 32, I,
                              nx, p + 1 < a1 || en < E ? D * 128 : (b0 < b1 ? I * 128 : 0));
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        float *sum = sums + (int64_t)id * (align64(4 * T * 64) / 4);
        for (int64_t p = b0; p < b1; p++) {
            memset(sum, 0, 4 * T * 64);
            for (int64_t e = first; e < E; e = next_expert(start, E, e)) {
                const int64_t en = next_expert(start, E, e);
                const uint16_t *nx = en < E ? w2 + en * s2 + p * I * 64 : w2 + first * s2 + (p + 1) * I * 64;
                down_panel(mid + start[e] * I, I, tok + start[e], wt + start[e], start[e + 1] - start[e],
                           w2 + e * s2 + p * I * 64, sum, nx, en < E || p + 1 < b1 ? I * 128 : 0);
            }
            for (int64_t t = 0; t < T; t++)
                for (int v = 0; v < NR; v++) store_bf16(out + t * D + p * 64 + 16 * v, _mm512_loadu_ps(sum + t * 64 + 16 * v));
        }
    }
    return 0;
}

int mlight_moe_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
