/* Batched byte-run copies for kvxferd's CPU data path (loaded with ctypes, see runcopy.py).
 *
 * Python callers check every offset against the regions' sizes before calling: these
 * loops trust their arguments. ctypes releases the GIL around each call, so data threads
 * copy in parallel with each other and with socket I/O.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Copies for destinations that are not read again soon (KV pages a decode engine reads
 * later): non-temporal stores skip reading each destination line into the cache first,
 * which is a third of the memory traffic of a large copy. Plain memcpy elsewhere, and for
 * short runs, where the stores' partial lines would cost more than they save. */
static inline void copy_nt(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__SSE2__)
    if (n >= 256) {
        size_t lead = (size_t)(-(uintptr_t)dst) & 15;
        memcpy(dst, src, lead);
        dst += lead; src += lead; n -= lead;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}

static inline void fence(int nt)
{
#if defined(__SSE2__)
    if (nt)
        _mm_sfence(); /* streamed stores visible before the caller reports the copy done */
#else
    (void)nt;
#endif
}

/* Short runs at scattered addresses leave the hardware prefetcher no time to ramp up:
 * ask for the next run's source (up to 4 KiB of it) while this one is copied. */
static inline void prefetch(const uint8_t *src, size_t n)
{
    if (n > 4096)
        n = 4096;
    for (size_t k = 0; k < n; k += 64)
        __builtin_prefetch(src + k, 0, 0);
}

#define COPY(nt, d, s, n) do { if (nt) copy_nt((d), (s), (n)); else memcpy((d), (s), (n)); } while (0)

/* For every region pair r and run i: dst_bases[r] + dst_off[i] <- src_bases[r] + src_off[i],
 * lengths[i * len_stride] bytes (len_stride 0: one length for every run). */
void kvx_copy_runs(int64_t n_regions, const uint64_t *src_bases, const uint64_t *dst_bases,
                   int64_t n_runs, const int64_t *src_off, const int64_t *dst_off,
                   const int64_t *lengths, int64_t len_stride, int nt)
{
    for (int64_t r = 0; r < n_regions; r++) {
        const uint8_t *src = (const uint8_t *)(uintptr_t)src_bases[r];
        uint8_t *dst = (uint8_t *)(uintptr_t)dst_bases[r];
        for (int64_t i = 0; i < n_runs; i++) {
            if (i + 1 < n_runs)
                prefetch(src + src_off[i + 1], (size_t)lengths[(i + 1) * len_stride]);
            COPY(nt, dst + dst_off[i], src + src_off[i], (size_t)lengths[i * len_stride]);
        }
    }
    fence(nt);
}

/* For every region pair r and token i: the slice_bytes at src_slots[i] * src_row + src_head
 * go to dst_slots[i] * dst_row + dst_head. */
void kvx_copy_rows(int64_t n_regions, const uint64_t *src_bases, const uint64_t *dst_bases,
                   int64_t n, const int64_t *src_slots, int64_t src_row, int64_t src_head,
                   const int64_t *dst_slots, int64_t dst_row, int64_t dst_head, int64_t slice_bytes, int nt)
{
    for (int64_t r = 0; r < n_regions; r++) {
        const uint8_t *src = (const uint8_t *)(uintptr_t)src_bases[r] + src_head;
        uint8_t *dst = (uint8_t *)(uintptr_t)dst_bases[r] + dst_head;
        for (int64_t i = 0; i < n; i++) {
            if (i + 1 < n)
                prefetch(src + src_slots[i + 1] * src_row, (size_t)slice_bytes);
            COPY(nt, dst + dst_slots[i] * dst_row, src + src_slots[i] * src_row, (size_t)slice_bytes);
        }
    }
    fence(nt);
}

/* Where whole rows are moved (slice_bytes == row), consecutive slots are one run of memory:
 * the end of the run of slots starting at i. One call per run, not per row, doubles the
 * speed of gathering 1 KiB rows of 16-token pages (a TP2 rank's rows of a 70B model). */
static inline int64_t run_end(const int64_t *slots, int64_t i, int64_t n, int whole)
{
    int64_t j = i + 1;
    if (whole)
        while (j < n && slots[j] == slots[j - 1] + 1)
            j++;
    return j;
}

/* Slices of n slots, in order, into the contiguous buffer out (a staging slot about to be
 * sent: plain stores keep it in cache for the socket). */
void kvx_gather_rows(const uint8_t *base, int64_t n, const int64_t *slots, int64_t row,
                     int64_t head, int64_t slice_bytes, uint8_t *out)
{
    int whole = slice_bytes == row;
    base += head;
    for (int64_t i = 0, j; i < n; i = j) {
        j = run_end(slots, i, n, whole);
        size_t len = (size_t)((j - i) * slice_bytes);
        if (j < n)
            prefetch(base + slots[j] * row, (size_t)slice_bytes);
        memcpy(out, base + slots[i] * row, len);
        out += len;
    }
}

/* Inverse of kvx_gather_rows: consecutive slices of data into n slots. */
void kvx_scatter_rows(uint8_t *base, int64_t n, const int64_t *slots, int64_t row,
                      int64_t head, int64_t slice_bytes, const uint8_t *data, int nt)
{
    int whole = slice_bytes == row;
    base += head;
    for (int64_t i = 0, j; i < n; i = j) {
        j = run_end(slots, i, n, whole);
        size_t len = (size_t)((j - i) * slice_bytes);
        COPY(nt, base + slots[i] * row, data, len);
        data += len;
    }
    fence(nt);
}

/* Integrity digests (kvxferd.datapath.digest): XXH3-64, the digests of the xxhash package,
 * from the xxhash library's header (Debian's libxxhash-dev), compiled in here: no library to
 * link or load at run time. Built without that header, the library has no kvx_hash_* and
 * Python hashes with the xxhash package instead. */
#if defined(__has_include)
#if __has_include(<xxhash.h>)
#define KVX_XXH3 1
#endif
#endif

#ifdef KVX_XXH3
/* On x86-64 the hashing functions are compiled for AVX2 (three times SSE2's speed here) and
 * refuse to run (-2) on a CPU without it; Python then hashes with the xxhash package. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__)
#pragma GCC target("avx2")
#define XXH_VECTOR 2 /* XXH_AVX2 */
#define KVX_NEEDS_AVX2 1
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

static int kvx_can_hash(void)
{
#ifdef KVX_NEEDS_AVX2
    return __builtin_cpu_supports("avx2");
#else
    return 1;
#endif
}

/* For every region r: the XXH3-64 of its n pieces bases[r] + off[i] (len[i] bytes), in order,
 * into out[r]. Returns 0, -1 when no hash state could be allocated, -2 on a CPU it was not
 * built for. */
int kvx_hash_pieces(int64_t n_regions, const uint64_t *bases, int64_t n, const int64_t *off,
                    const int64_t *len, uint64_t *out)
{
    if (!kvx_can_hash())
        return -2;
    XXH3_state_t *st = XXH3_createState();
    if (!st)
        return -1;
    for (int64_t r = 0; r < n_regions; r++) {
        const uint8_t *base = (const uint8_t *)(uintptr_t)bases[r];
        XXH3_64bits_reset(st);
        for (int64_t i = 0; i < n; i++)
            XXH3_64bits_update(st, base + off[i], (size_t)len[i]);
        out[r] = XXH3_64bits_digest(st);
    }
    XXH3_freeState(st);
    return 0;
}

/* kvx_copy_runs over n pieces, hashing the pieces with hashed[i] set on both sides as they are
 * copied: the source piece and the destination piece right after the copy, while both are in
 * cache (the caller keeps hashed pieces a cache's size or less), so checking the bytes costs no
 * second read from memory. Pieces not hashed are copied as kvx_copy_runs would (nt).
 * flip: the first hashed destination byte is inverted after its copy, before it is hashed
 * (fault injection for tests: a landed byte changed between the write and the check).
 * Returns 0, -1 when no hash state could be allocated, -2 on a CPU it was not built for
 * (nothing was copied). */
int kvx_copy_hash(int64_t n_regions, const uint64_t *src_bases, const uint64_t *dst_bases, int64_t n,
                  const int64_t *src_off, const int64_t *dst_off, const int64_t *len, const uint8_t *hashed,
                  int nt, int flip, uint64_t *src_out, uint64_t *dst_out)
{
    if (!kvx_can_hash())
        return -2;
    XXH3_state_t *s = XXH3_createState(), *d = XXH3_createState();
    if (!s || !d) {
        XXH3_freeState(s);
        XXH3_freeState(d);
        return -1;
    }
    for (int64_t r = 0; r < n_regions; r++) {
        const uint8_t *src = (const uint8_t *)(uintptr_t)src_bases[r];
        uint8_t *dst = (uint8_t *)(uintptr_t)dst_bases[r];
        XXH3_64bits_reset(s);
        XXH3_64bits_reset(d);
        for (int64_t i = 0; i < n; i++) {
            size_t k = (size_t)len[i];
            if (!hashed[i]) {
                COPY(nt, dst + dst_off[i], src + src_off[i], k);
                continue;
            }
            memcpy(dst + dst_off[i], src + src_off[i], k);
            if (flip && k) {
                dst[dst_off[i]] ^= 0xFF;
                flip = 0;
            }
            XXH3_64bits_update(s, src + src_off[i], k);
            XXH3_64bits_update(d, dst + dst_off[i], k);
        }
        src_out[r] = XXH3_64bits_digest(s);
        dst_out[r] = XXH3_64bits_digest(d);
    }
    fence(nt);
    XXH3_freeState(s);
    XXH3_freeState(d);
    return 0;
}
#endif
