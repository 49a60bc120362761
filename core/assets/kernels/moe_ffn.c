/* A layer's routed experts in one call, bf16 weights and activations, AVX-512 BF16 (vdpbf16ps).

   For tokens x [T, D] routed to k of E experts with weights w [T, k]: out = sum_j w_j *
   down_e(silu(gate_e(x)) * up_e(x)), e = idx[t, j]. oneDNN's packed bf16 GEMM reaches 62-79 % of the
   machine's peak at the 16-32 rows an expert sees in a decode step (two Zen 5 cores); this kernel
   keeps a tile of up to 6 rows x 64 columns of fp32 sums in registers, streams each weight panel once
   in the order it is stored, block by block (software prefetch one block ahead, to L2), and fuses what
   torch runs as separate passes: the gather of each expert's rows (read in place through the token
   index), SiLU(gate) * up (in fp32, rounded once to bf16), the routing weight and the sum over experts
   (in fp32, rounded once). `mlight_linear` runs a dense projection on the same panels.

   Packed layouts, made once at load by core/model/cpu/ffn.py (bf16 pairs along K, as vdpbf16ps reads),
   expert e's at w13 + e * s13 and w2 + e * s2 (elements):
     gate/up of expert e: I/32 panels, panel p = [D/2][4][16][2]: vectors 0-1 gate columns 32p..32p+31,
       vectors 2-3 up columns 32p..32p+31;
     down of expert e: D/64 panels, panel p = [I/2][4][16][2]: output columns 64p..64p+63.
   Threads (OpenMP, on the libgomp torch has loaded): gate/up panels then down panels are split into
   contiguous runs, one per thread, with one barrier between; each thread owns its output columns.
   Scratch (bytes from mlight_moe_scratch): routing order, the bf16 [T*k, I] intermediate, and per thread
   a fp32 [T, 64] sum and the [T*k, 64] sums a panel's tiles carry between K blocks. Returns 0, or -1 for an expert id out of range. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 4  /* 16-float vectors per tile row: 64 output columns */
#define MR 6  /* rows per tile: 24 accumulators + 4 weight vectors + a broadcast in 32 registers */
#ifndef KC
#define KC 64 /* K pairs a block: 16 KB of a 64-column panel, read by every tile of an expert's rows from L1 */
#endif

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

/* One tile: M rows (a compile-time constant in each instance, so the sums stay in registers) of an
   input against K pairs k0..k0+kn of a 64-column panel (w: that block), its sums carried between blocks
   in `acc` (fp32 [M][64]; zeros before the first block), the epilogue after the last. GATE_UP: rows of
   x, gathered through tok; out[r] = silu(gate) * up (32 bf16). Else: rows of the intermediate;
   sum[tok[r]] += weight * y (64 fp32). Meanwhile it prefetches its share (`lines` from `next`) of the
   block that follows, spread over its K steps, into L2 (T2), not L1: a prefetch to L1 holds one of the
   core's few L1 miss buffers for a whole trip to memory, and at the 8-16 rows an expert sees in a B = 32-64
   step those ran out (the stream stalled the arithmetic: 1.2-1.5x slower there on two Zen 4 cores, the
   same from 32 rows up); the first tile's loads bring the block from L2 to L1. */
enum { GATE_UP, DOWN };

static inline __attribute__((always_inline)) void tile(const int M, const int mode, const uint16_t *in, int64_t ld,
                                                       const int32_t *tok, const float *wt, const uint16_t *w,
                                                       int64_t k0, int64_t kn, float *acc_buf, int first, int last,
                                                       uint16_t *mid, int64_t I, float *sum, const char *next,
                                                       int64_t lines) {
    __m512 acc[MR][NR];
    const int64_t per_step = (lines + kn - 1) / kn;
    const uint16_t *rows[MR];
    for (int m = 0; m < M; m++) {
        rows[m] = (mode == GATE_UP ? in + (int64_t)tok[m] * ld : in + m * ld) + 2 * k0;
        for (int v = 0; v < NR; v++)
            acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + m * 64 + 16 * v);
    }
    for (int64_t k2 = 0; k2 < kn; k2++, w += 32 * NR) {
        for (int64_t j = 0; j < per_step && lines > 0; j++, lines--, next += 64) _mm_prefetch(next, _MM_HINT_T2);
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
        if (!last) {
            for (int v = 0; v < NR; v++) _mm512_storeu_ps(acc_buf + m * 64 + 16 * v, acc[m][v]);
        } else if (mode == GATE_UP) {
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
static void tile_##M(int mode, const uint16_t *in, int64_t ld, const int32_t *tok, const float *wt,        \
                     const uint16_t *w, int64_t k0, int64_t kn, float *acc, int first, int last,           \
                     uint16_t *mid, int64_t I, float *sum, const char *next, int64_t lines) {              \
    if (mode == GATE_UP)                                                                                   \
        tile(M, GATE_UP, in, ld, tok, 0, w, k0, kn, acc, first, last, mid, I, 0, next, lines);             \
    else                                                                                                   \
        tile(M, DOWN, in, ld, tok, wt, w, k0, kn, acc, first, last, 0, I, sum, next, lines);               \
}
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
#pragma GCC pop_options

typedef void (*tile_fn)(int, const uint16_t *, int64_t, const int32_t *, const float *, const uint16_t *, int64_t,
                        int64_t, float *, int, int, uint16_t *, int64_t, float *, const char *, int64_t);
static const tile_fn TILE[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* A panel for an expert's n rows, K pairs in blocks of KC: every tile reads a block while it is in L1
   (the first tile brings it in), and the tiles of one block together prefetch the next (the panel's next
   block, or `bytes` of `next`: the first block of this thread's next panel). So the memory streams
   evenly whatever the number of tiles, and what the cache holds ahead is one block, never a panel
   (a 64-column panel of K = 7168 is 896 KB: a second one prefetched beside it overflowed L2).
   GATE_UP: mid[r, 32p..32p+31] = silu(gate) * up; DOWN: sum[tok, 0..63] += weight * (mid row @ panel). */
static void panel(int mode, const uint16_t *in, int64_t ld, const int32_t *tok, const float *wt, int64_t n,
                  const uint16_t *w, int64_t K2, float *acc, uint16_t *mid, int64_t I, float *sum,
                  const uint16_t *next, int64_t bytes) {
    const int64_t tiles = (n + MR - 1) / MR;
    for (int64_t k0 = 0; k0 < K2; k0 += KC) {
        const int64_t kn = K2 - k0 < KC ? K2 - k0 : KC;
        const int more = k0 + KC < K2; /* the next block: this panel's, or the thread's next work */
        const char *nb = more ? (const char *)(w + (k0 + KC) * 32 * NR) : (const char *)next;
        const int64_t lines = more ? (K2 - k0 - KC < KC ? K2 - k0 - KC : KC) * 4 : (bytes < KC * 256 ? bytes : KC * 256) / 64;
        for (int64_t t = 0; t < tiles; t++) { /* balanced: 13 rows are tiles of 5, 4, 4, not 6, 6, 1 */
            const int64_t r = n * t / tiles, m = n * (t + 1) / tiles - r, a = lines * t / tiles, b = lines * (t + 1) / tiles;
            TILE[m](mode, mode == GATE_UP ? in : in + r * ld, ld, tok + r, wt ? wt + r : 0, w + k0 * 32 * NR, k0, kn,
                    acc + r * 64, k0 == 0, k0 + kn == K2, mode == GATE_UP ? mid + r * I : 0, I, sum, nb + 64 * a, b - a);
        }
    }
}

/* the first expert after e that got rows, or E */
static inline int64_t next_expert(const int32_t *start, int64_t E, int64_t e) {
    for (e++; e < E && start[e + 1] == start[e]; e++) {}
    return e;
}

static inline int64_t align64(int64_t b) { return (b + 63) & ~(int64_t)63; }

int64_t mlight_moe_scratch(int64_t T, int64_t k, int64_t E, int64_t I, int64_t threads) {
    return 2 * align64(4 * (E + 1)) + align64(4 * T * k) + align64(4 * T * k) + align64(2 * T * k * I) +
           (align64(4 * T * 64) + align64(4 * T * k * 64)) * threads + 64;
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
        float *sum = sums + (int64_t)id * ((align64(4 * T * 64) + align64(4 * T * k * 64)) / 4);
        float *acc = sum + align64(4 * T * 64) / 4; /* a panel's sums between K blocks, [rows][64] */
        for (int64_t e = first; e < E; e = next_expert(start, E, e)) {
            const int64_t n = start[e + 1] - start[e], en = next_expert(start, E, e);
            for (int64_t p = a0; p < a1; p++) {
                /* what this thread reads next: the following panel, the next expert's first, or its first down panel */
                const uint16_t *nx = p + 1 < a1 ? w13 + e * s13 + (p + 1) * D * 64
                                   : en < E ? w13 + en * s13 + a0 * D * 64 : w2 + first * s2 + b0 * I * 64;
                panel(GATE_UP, x, D, tok + start[e], 0, n, w13 + e * s13 + p * D * 64, D / 2, acc,
                      mid + start[e] * I + p * 32, I, 0, nx, p + 1 < a1 || en < E ? D * 128 : (b0 < b1 ? I * 128 : 0));
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int64_t p = b0; p < b1; p++) {
            memset(sum, 0, 4 * T * 64);
            for (int64_t e = first; e < E; e = next_expert(start, E, e)) {
                const int64_t en = next_expert(start, E, e);
                const uint16_t *nx = en < E ? w2 + en * s2 + p * I * 64 : w2 + first * s2 + (p + 1) * I * 64;
                panel(DOWN, mid + start[e] * I, I, tok + start[e], wt + start[e], start[e + 1] - start[e],
                      w2 + e * s2 + p * I * 64, I / 2, acc, 0, I, sum, nx, en < E || p + 1 < b1 ? I * 128 : 0);
            }
            for (int64_t t = 0; t < T; t++)
                for (int v = 0; v < NR; v++) store_bf16(out + t * D + p * 64 + 16 * v, _mm512_loadu_ps(sum + t * 64 + 16 * v));
        }
    }
    return 0;
}

/* A dense projection on the same panels: out[t, n] = bf16(sum_k x[t, k] w[n, k] (+ bias[n])), the sum in fp32
   rounded once (as oneDNN's bf16 GEMM does). w packed as the down weights: N/64 panels [K/2][4][16][2]; x rows
   ldx apart, out rows ldo apart; bias bf16 [N] or null. The DOWN tiles with every row its own token and a
   weight of 1 (sum + 1 * acc is acc exactly); threads split the panels. At one row, the decode step of a
   single stream, oneDNN's packed GEMV read a cold 1536 x 1024 QKV at 10-12 GB/s on two Zen 4 cores. */
int64_t mlight_linear_scratch(int64_t T, int64_t threads) {
    return 2 * align64(4 * T) + 2 * align64(4 * T * 64) * threads + 64;
}

void mlight_linear(const uint16_t *x, int64_t T, int64_t ldx, int64_t K, const uint16_t *w, int64_t N,
                   const uint16_t *bias, uint16_t *out, int64_t ldo, void *scratch, int threads) {
    char *s = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *tok = (int32_t *)s;
    float *one = (float *)(s + align64(4 * T));
    float *sums = (float *)(s + 2 * align64(4 * T));
    for (int64_t t = 0; t < T; t++) tok[t] = (int32_t)t, one[t] = 1.f;
    const int64_t P = N / 64;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int nt = 1, id = 0;
#endif
        const int64_t p0 = P * id / nt, p1 = P * (id + 1) / nt;
        float *sum = sums + (int64_t)id * 2 * (align64(4 * T * 64) / 4), *acc = sum + align64(4 * T * 64) / 4;
        for (int64_t p = p0; p < p1; p++) {
            memset(sum, 0, 4 * T * 64);
            panel(DOWN, x, ldx, tok, one, T, w + p * K * 64, K / 2, acc, 0, 0, sum, w + (p + 1) * K * 64,
                  p + 1 < p1 ? K * 128 : 0);
            for (int64_t t = 0; t < T; t++)
                for (int v = 0; v < NR; v++) {
                    __m512 y = _mm512_loadu_ps(sum + t * 64 + 16 * v);
                    if (bias) {
                        __m256i b = _mm256_loadu_si256((const __m256i *)(bias + p * 64 + 16 * v));
                        y = _mm512_add_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
                    }
                    store_bf16(out + t * ldo + p * 64 + 16 * v, y);
                }
        }
    }
}

int mlight_moe_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
