/* stream_copy: copy n bytes with non-temporal stores (past the caches), for _stream_c.c and
 * _add_c.c. Not ordered with other stores: callers fence before and after (see _stream_c.c). */
#ifndef SHMBUF_STREAM_COPY_H
#define SHMBUF_STREAM_COPY_H
#include <emmintrin.h>
#include <stdint.h>

static void stream_copy(char *dst, const char *src, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n && ((uintptr_t)(dst + i) & 15)) {  /* up to 16-byte alignment */
        dst[i] = src[i];
        i++;
    }
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i < n; i++) dst[i] = src[i];
}

#endif
