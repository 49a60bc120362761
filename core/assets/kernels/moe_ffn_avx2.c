/* A layer's routed experts in one call on AVX2 CPUs: bf16 weights, fp32 activations and math.

   For tokens x [T, D] (fp32) routed to k of E experts with weights w [T, k]: out = sum_j w_j *
   down_e(silu(gate_e(x)) * up_e(x)), e = idx[t, j], all in fp32 — what torch computes on these CPUs after
   widening the weights to fp32 (core.model.cpu.kernels.Widen), which ran a 784M Mixtral's decode step at
   B = 64 at 39 GFLOP/s against fp32 GEMMs' 170-220 on two Zen 5 cores limited to AVX2: each 1 MB tile
   widened into a scratch, one torch call per tile, the gathers and scatters as separate passes. Here the
   bf16 weights widen in registers (a shift or a mask per 8 columns of a K pair) right before their FMAs,
   each weight byte is read once per call, and the gather of each expert's rows, SiLU(gate) * up, the
   routing weight and the sum over experts are fused as in moe_ffn.c.

   The weights are in moe_ffn.c's packed layout (core/model/cpu/ffn.py packs them; the same bytes serve
   both kernels): gate/up of expert e: I/32 panels [D/2][4][16][2] (vectors 0-1 gate columns
   32p..32p+31, 2-3 up); down: D/64 panels [I/2][4][16][2]. A K pair's 8 neighbouring columns are 16
   bf16 = one 256-bit load: the low halves are K's even index, the high halves its odd one.
   A tile is MR rows x 16 columns (two groups of 8: a gate group and its up group, or 16 neighbouring
   down columns) over a block of KC K pairs, its sums carried between blocks in `acc` (fp32 [rows][64]).
   An expert with WIDE_ROWS rows or more has each block widened once into a per-thread fp32 buffer and
   runs MRW-row tiles over it (a 784M layer at 64 rows an expert: 176 against 146 GFLOP/s; at 4 rows the
   extra pass cost 12 %, at 16 it broke even: bench/RESULTS.md, twentieth session).
   Threads (OpenMP on torch's libgomp) split gate/up panels, then down panels, one barrier between.
   Returns 0, or -1 for an expert id out of range. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MR 4 /* rows per tile: 8 accumulators + 4 widened weight vectors + 2 broadcasts of 16 registers */
#define MRW 6 /* rows per tile over a block widened once: 12 accumulators + 2 weight vectors + a broadcast */
#ifndef WIDE_ROWS
#define WIDE_ROWS 16 /* an expert with this many rows or more has each block widened once, not in every tile */
#endif
#ifndef KC
#define KC 64 /* K pairs a block: 16 KB of a 64-column panel, read by every tile from L1 */
#endif

static inline __m256 exp256(__m256 x) { /* 2^n * p(r), relative error < 2e-7; saturates to 0 / inf */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-88.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 silu_mul(__m256 g, __m256 u) { /* g * sigmoid(g) * u */
    __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(e, _mm256_set1_ps(1.f))), u);
}

enum { GATE_UP, DOWN };

/* One tile: M rows of fp32 input against K pairs k0..k0+kn of two 8-column groups of a panel (w: the
   block's first K pair; `ga`, `gb`: the groups' element offsets in a K pair's 128 bf16; `ca`, `cb`: their
   first columns in the tile's 64), sums carried in acc (fp32 [M][64]), the epilogue after the last block.
   GATE_UP: rows of x gathered through tok; mid[r, col] = silu(gate) * up (gate group a, up group b; col
   = the gate column). DOWN: rows of the intermediate; sum[tok[r], col] += weight * y. Meanwhile it
   prefetches `lines` lines from `next` (the block after), spread over its K pairs, into L2 (T2: see
   moe_ffn.c; 1.1x faster at 16 rows an expert, the same at 64). `wide`: the block is read from `wf`, widened
   once by `panel` ([2 kn][64] fp32: K's even index, then its odd one, for each K pair), not from `w`. */
static inline __attribute__((always_inline)) void tile(const int M, const int mode, const int wide, const float *in,
                                                       int64_t ld, const int32_t *tok, const float *wt,
                                                       const uint16_t *w, const float *wf, int64_t k0, int64_t kn,
                                                       int ga, int gb, int ca, int cb, float *acc, int first,
                                                       int last, float *mid, int64_t I, float *sum,
                                                       const char *next, int64_t lines) {
    __m256 a[MRW], b[MRW];
    const float *rows[MRW];
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    const int64_t per_step = (lines + kn - 1) / kn;
    /* The row loops unrolled before GCC decides where the sums live: left to itself (GCC 12, -O3) it kept a[]
       and b[] in memory, storing all 2M sums every K pair beside the 4M FMAs (bench/RESULTS.md, twentieth session). */
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        rows[m] = (mode == GATE_UP ? in + (int64_t)tok[m] * ld : in + m * ld) + 2 * k0;
        a[m] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + m * 64 + ca);
        b[m] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + m * 64 + cb);
    }
    for (int64_t k2 = 0; wide && k2 < kn; k2++) {
        for (int64_t j = 0; j < per_step && lines > 0; j++, lines--, next += 64) _mm_prefetch(next, _MM_HINT_T2);
        for (int h = 0; h < 2; h++) {
            const __m256 a0 = _mm256_load_ps(wf + 128 * k2 + 64 * h + ga / 2), b0 = _mm256_load_ps(wf + 128 * k2 + 64 * h + gb / 2);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const __m256 x = _mm256_broadcast_ss(rows[m] + 2 * k2 + h);
                a[m] = _mm256_fmadd_ps(x, a0, a[m]);
                b[m] = _mm256_fmadd_ps(x, b0, b[m]);
            }
        }
    }
    for (int64_t k2 = 0; !wide && k2 < kn; k2++, w += 128) {
        for (int64_t j = 0; j < per_step && lines > 0; j++, lines--, next += 64) _mm_prefetch(next, _MM_HINT_T2);
        const __m256i ra = _mm256_loadu_si256((const __m256i *)(w + ga));
        const __m256i rb = _mm256_loadu_si256((const __m256i *)(w + gb));
        const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(ra, 16)), a1 = _mm256_castsi256_ps(_mm256_and_si256(ra, hi));
        const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(rb, 16)), b1 = _mm256_castsi256_ps(_mm256_and_si256(rb, hi));
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const __m256 x0 = _mm256_broadcast_ss(rows[m] + 2 * k2), x1 = _mm256_broadcast_ss(rows[m] + 2 * k2 + 1);
            a[m] = _mm256_fmadd_ps(x0, a0, a[m]);
            b[m] = _mm256_fmadd_ps(x0, b0, b[m]);
            a[m] = _mm256_fmadd_ps(x1, a1, a[m]);
            b[m] = _mm256_fmadd_ps(x1, b1, b[m]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        if (!last) {
            _mm256_storeu_ps(acc + m * 64 + ca, a[m]);
            _mm256_storeu_ps(acc + m * 64 + cb, b[m]);
        } else if (mode == GATE_UP) {
            _mm256_storeu_ps(mid + m * I + ca, silu_mul(a[m], b[m]));
        } else {
            float *s = sum + (int64_t)tok[m] * 64;
            const __m256 g = _mm256_set1_ps(wt[m]);
            _mm256_storeu_ps(s + ca, _mm256_fmadd_ps(a[m], g, _mm256_loadu_ps(s + ca)));
            _mm256_storeu_ps(s + cb, _mm256_fmadd_ps(b[m], g, _mm256_loadu_ps(s + cb)));
        }
    }
}

#pragma GCC push_options
#pragma GCC optimize("unroll-loops")
#define TILES(NAME, M, WIDE)                                                                               \
static void NAME(int mode, const float *in, int64_t ld, const int32_t *tok, const float *wt, const uint16_t *w, \
                 const float *wf, int64_t k0, int64_t kn, int ga, int gb, int ca, int cb, float *acc, int first, \
                 int last, float *mid, int64_t I, float *sum, const char *next, int64_t lines) {             \
    if (mode == GATE_UP)                                                                                   \
        tile(M, GATE_UP, WIDE, in, ld, tok, 0, w, wf, k0, kn, ga, gb, ca, cb, acc, first, last, mid, I, 0, next, \
             lines);                                                                                       \
    else                                                                                                   \
        tile(M, DOWN, WIDE, in, ld, tok, wt, w, wf, k0, kn, ga, gb, ca, cb, acc, first, last, 0, I, sum, next, \
             lines);                                                                                       \
}
TILES(tile_1, 1, 0) TILES(tile_2, 2, 0) TILES(tile_3, 3, 0) TILES(tile_4, 4, 0)
TILES(wide_3, 3, 1) TILES(wide_4, 4, 1) TILES(wide_5, 5, 1) TILES(wide_6, 6, 1)
#pragma GCC pop_options

typedef void (*tile_fn)(int, const float *, int64_t, const int32_t *, const float *, const uint16_t *, const float *,
                        int64_t, int64_t, int, int, int, int, float *, int, int, float *, int64_t, float *,
                        const char *, int64_t);
static const tile_fn TILE[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4};
static const tile_fn WIDE[MRW + 1] = {0, 0, 0, wide_3, wide_4, wide_5, wide_6}; /* n >= 16: tiles of 3 rows or more */

/* A panel for an expert's n rows, K pairs in blocks of KC, four 16-column passes over each block while it
   is in L1; the first pass's tiles prefetch the next block (this panel's, or `bytes` of `next`: the
   thread's next work). GATE_UP: mid[r, 32p + 8q .. +7] = silu(gate) * up for q = 0..3; DOWN: sum[tok,
   16q .. 16q + 15] += weight * (mid row @ panel) for q = 0..3. */
static void panel(int mode, const float *in, int64_t ld, const int32_t *tok, const float *wt, int64_t n,
                  const uint16_t *w, int64_t K2, float *acc, float *mid, int64_t I, float *sum,
                  const uint16_t *next, int64_t bytes, float *wf) {
    const int wide = n >= WIDE_ROWS;
    const int64_t tiles = wide ? (n + MRW - 1) / MRW : (n + MR - 1) / MR;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t k0 = 0; k0 < K2; k0 += KC) {
        const int64_t kn = K2 - k0 < KC ? K2 - k0 : KC;
        for (int64_t k2 = 0; wide && k2 < kn; k2++) /* [2 kn][64] fp32, the column groups in the panel's order */
            for (int g = 0; g < 8; g++) {
                const __m256i r = _mm256_loadu_si256((const __m256i *)(w + (k0 + k2) * 128 + 16 * g));
                _mm256_store_ps(wf + 128 * k2 + 8 * g, _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)));
                _mm256_store_ps(wf + 128 * k2 + 64 + 8 * g, _mm256_castsi256_ps(_mm256_and_si256(r, hi)));
            }
        const int more = k0 + KC < K2;
        const char *nb = more ? (const char *)(w + (k0 + KC) * 128) : (const char *)next;
        const int64_t lines = more ? (K2 - k0 - KC < KC ? K2 - k0 - KC : KC) * 4 : (bytes < KC * 256 ? bytes : KC * 256) / 64;
        for (int q = 0; q < 4; q++) {
            /* gate/up: gate columns 8q.. (vectors 0-1) with up columns 32 + 8q.. (vectors 2-3); down: 16q..16q+15 */
            const int ga = mode == GATE_UP ? (q / 2) * 32 + (q % 2) * 16 : q * 32;
            const int gb = mode == GATE_UP ? (2 + q / 2) * 32 + (q % 2) * 16 : q * 32 + 16;
            const int ca = mode == GATE_UP ? 8 * q : 16 * q, cb = mode == GATE_UP ? 32 + 8 * q : 16 * q + 8;
            for (int64_t t = 0; t < tiles; t++) { /* balanced: 7 rows are tiles of 4 and 3, not 4, 3 */
                const int64_t r = n * t / tiles, m = n * (t + 1) / tiles - r;
                const int64_t a = q ? 0 : lines * t / tiles, c = q ? 0 : lines * (t + 1) / tiles;
                (wide ? WIDE : TILE)[m](mode, mode == GATE_UP ? in : in + r * ld, ld, tok + r, wt ? wt + r : 0,
                                        w + k0 * 128, wf, k0, kn, ga, gb, ca, cb, acc + r * 64, k0 == 0, k0 + kn == K2,
                                        mode == GATE_UP ? mid + r * I : 0, I, sum, nb + 64 * a, c - a);
            }
        }
    }
}

static inline int64_t next_expert(const int32_t *start, int64_t E, int64_t e) {
    for (e++; e < E && start[e + 1] == start[e]; e++) {}
    return e;
}

static inline int64_t align64(int64_t b) { return (b + 63) & ~(int64_t)63; }

int64_t mlight_moe_avx2_scratch(int64_t T, int64_t k, int64_t E, int64_t I, int64_t threads) {
    return 2 * align64(4 * (E + 1)) + align64(4 * T * k) + align64(4 * T * k) + align64(4 * T * k * I) +
           (align64(4 * T * 64) + align64(4 * T * k * 64) + 512 * KC) * threads + 64;
}

int mlight_moe_avx2(const float *x, int64_t T, int64_t k, const int64_t *idx, const float *wts, int64_t E,
                    int64_t D, int64_t I, const uint16_t *w13, int64_t s13, const uint16_t *w2, int64_t s2,
                    float *out, void *scratch, int threads) {
    char *s = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *start = (int32_t *)s, *fill = (int32_t *)(s + align64(4 * (E + 1)));
    s += 2 * align64(4 * (E + 1));
    int32_t *tok = (int32_t *)s;
    s += align64(4 * T * k);
    float *wt = (float *)s;
    s += align64(4 * T * k);
    float *mid = (float *)s;
    s += align64(4 * T * k * I);
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
        wt[at] = wts[i];
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
        float *sum = sums + (int64_t)id * ((align64(4 * T * 64) + align64(4 * T * k * 64) + 512 * KC) / 4);
        float *acc = sum + align64(4 * T * 64) / 4;
        float *wf = acc + align64(4 * T * k * 64) / 4; /* a block widened once, for the experts with many rows */
        for (int64_t e = first; e < E; e = next_expert(start, E, e)) {
            const int64_t n = start[e + 1] - start[e], en = next_expert(start, E, e);
            for (int64_t p = a0; p < a1; p++) {
                const uint16_t *nx = p + 1 < a1 ? w13 + e * s13 + (p + 1) * D * 64
                                   : en < E ? w13 + en * s13 + a0 * D * 64 : w2 + first * s2 + b0 * I * 64;
                panel(GATE_UP, x, D, tok + start[e], 0, n, w13 + e * s13 + p * D * 64, D / 2, acc,
                      mid + start[e] * I + p * 32, I, 0, nx, p + 1 < a1 || en < E ? D * 128 : (b0 < b1 ? I * 128 : 0), wf);
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
                      w2 + e * s2 + p * I * 64, I / 2, acc, 0, I, sum, nx, en < E || p + 1 < b1 ? I * 128 : 0, wf);
            }
            for (int64_t t = 0; t < T; t++) memcpy(out + t * D + p * 64, sum + t * 64, 64 * 4);
        }
    }
    return 0;
}

int mlight_moe_avx2_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
