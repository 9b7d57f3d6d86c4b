// Bytes handed out by malloc and friends, now and at their peak, for LD_PRELOAD into a benchmark.
//
// Why: on a GPU, "peak memory" is torch.cuda.max_memory_allocated(); on CPU every tensor comes from
// malloc, and the resident set also moves with page-touch patterns, code pages and thread stacks, by
// more than the differences a memory comparison must see. This counts exactly what the allocator
// hands out (malloc_usable_size of each block), whatever the page layout. Built and loaded by
// perf/heapcount.py; read through heap_peak_current / heap_peak_peak / heap_peak_reset.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <stddef.h>
#include <string.h>

static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_memalign)(size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);

static long long cur, peak;
static char boot[1 << 16];
static size_t boot_used;
static int resolving;

static void resolve(void) {
    if (real_malloc || resolving) return;
    resolving = 1;
    real_malloc = dlsym(RTLD_NEXT, "malloc");
    real_free = dlsym(RTLD_NEXT, "free");
    real_calloc = dlsym(RTLD_NEXT, "calloc");
    real_realloc = dlsym(RTLD_NEXT, "realloc");
    real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    real_memalign = dlsym(RTLD_NEXT, "memalign");
    real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
    resolving = 0;
}

static void add(void *p) {
    if (!p) return;
    long long n = (long long)malloc_usable_size(p);
    long long now = __atomic_add_fetch(&cur, n, __ATOMIC_RELAXED);
    long long old = __atomic_load_n(&peak, __ATOMIC_RELAXED);
    while (now > old && !__atomic_compare_exchange_n(&peak, &old, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}
static void sub(void *p) {
    if (p) __atomic_sub_fetch(&cur, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}
static int is_boot(void *p) { return (char *)p >= boot && (char *)p < boot + sizeof boot; }

void *malloc(size_t n) {
    resolve();
    if (!real_malloc) { void *p = boot + boot_used; boot_used += (n + 15) & ~15UL; return p; }
    void *p = real_malloc(n); add(p); return p;
}
void *calloc(size_t a, size_t b) {
    resolve();
    if (!real_calloc) { void *p = boot + boot_used; boot_used += (a * b + 15) & ~15UL; memset(p, 0, a * b); return p; }
    void *p = real_calloc(a, b); add(p); return p;
}
void free(void *p) {
    if (!p || is_boot(p)) return;
    resolve(); sub(p); real_free(p);
}
void *realloc(void *p, size_t n) {
    resolve();
    if (is_boot(p)) { void *q = malloc(n); memcpy(q, p, n); return q; }
    sub(p); void *q = real_realloc(p, n);
    if (q) add(q); else if (p && n) add(p);
    return q;
}
int posix_memalign(void **out, size_t a, size_t n) {
    resolve(); int r = real_posix_memalign(out, a, n); if (!r) add(*out); return r;
}
void *memalign(size_t a, size_t n) { resolve(); void *p = real_memalign(a, n); add(p); return p; }
void *aligned_alloc(size_t a, size_t n) { resolve(); void *p = real_aligned_alloc(a, n); add(p); return p; }

long long heap_peak_current(void) { return __atomic_load_n(&cur, __ATOMIC_RELAXED); }
long long heap_peak_peak(void) { return __atomic_load_n(&peak, __ATOMIC_RELAXED); }
void heap_peak_reset(void) { __atomic_store_n(&peak, __atomic_load_n(&cur, __ATOMIC_RELAXED), __ATOMIC_RELAXED); }
