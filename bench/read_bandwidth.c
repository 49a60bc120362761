/* How fast this machine's cores read memory: 512 MB (on 2 MB pages where Linux gives them) read by 1 and by 2
   OpenMP threads, the best of 5 passes each. The CPU rows of bench/RESULTS.md quote it beside the engine's own
   rates: on the shared 2-core dev box the two-thread figure moves between ~40-53 GB/s (the vCPUs share a core's
   bandwidth) and ~64-82 GB/s (they sit apart) from one process to the next, and a kernel's ratio with it.

       cc -O3 -march=native -fopenmp bench/read_bandwidth.c -o /tmp/read_bandwidth && /tmp/read_bandwidth */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

int main(void) {
    const size_t n = (size_t)512 << 20, words = n / 8;
    uint64_t *p = aligned_alloc((size_t)1 << 21, n);
    if (!p) return 1;
#ifdef __linux__
    madvise(p, n, MADV_HUGEPAGE);
#endif
    memset(p, 1, n);
    for (int threads = 1; threads <= 2; threads++) {
        double best = 0.0;
        uint64_t seen = 0;
        for (int pass = 0; pass < 5; pass++) {
            double t0 = omp_get_wtime();
#pragma omp parallel for num_threads(threads) schedule(static) reduction(^ : seen)
            for (size_t i = 0; i < words; i++) seen ^= p[i];
            double gbs = n / (omp_get_wtime() - t0) / 1e9;
            best = gbs > best ? gbs : best;
        }
        printf("%d thread%s: %.1f GB/s%s\n", threads, threads > 1 ? "s" : "", best, seen == 42 ? " " : "");
    }
    free(p);
    return 0;
}
