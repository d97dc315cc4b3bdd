/* Non-temporal ("streaming") bulk copy for radixkv.hostcopy, loaded with ctypes (not a Python module).
 *
 * Why: a KV chunk copied between an engine's host pool and a memory tier is not read again by this CPU
 * soon (the next reader is a DMA engine, a disk write or a later request), so caching the destination
 * only costs bandwidth: an ordinary store first reads each destination line into the cache
 * (read-for-ownership), then writes it back. Streaming stores write whole lines straight to memory,
 * moving 2 bytes per byte copied instead of 3. glibc's memmove switches to them only above ~3/4 of
 * the last-level cache per copy (hundreds of MiB on large servers), never for the 64 KiB-4 MiB pieces
 * a tier copies. Measured on the 2-core development VM: 128 MiB in 512 KiB pieces on two threads,
 * 9.4-11.8 ms against 12.7-15.7 ms for memmove (docs/benchmarks.md).
 *
 * Contract: dst and src do not overlap (the caller checks); the stores are fenced (sfence) before the
 * function returns, so a thread that joins the copier afterwards sees every byte.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

int radixkv_stream_copy_streams(void) {
#if defined(__SSE2__)
    return 1;
#else
    return 0;
#endif
}

void radixkv_stream_copy(void *dst, const void *src, size_t n) {
#if defined(__SSE2__)
    if (n == 0) return; /* memcpy with a null pointer is undefined even for 0 bytes */
    char *d = (char *)dst;
    const char *s = (const char *)src;
    /* Streaming stores need 16-byte aligned targets; aligning to the 64-byte line makes each group
     * of four fill one whole line (the write-combining buffer then goes out in one burst). */
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)(d), a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        s += 64;
        d += 64;
    }
    memcpy(d, s, n - lines * 64);
    _mm_sfence();
#else
    if (n) memcpy(dst, src, n);
#endif
}
