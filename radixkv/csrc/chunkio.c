/* Disk-tier chunk I/O, one foreign call per chunk and direction, without the GIL.
 *
 * Why: done in Python, a 1 MiB chunk is ~12 system and ctypes calls, each dropping and retaking the
 * GIL; with two I/O threads on a small machine those hand-offs cost ~20-25% over a bare read loop
 * (docs/benchmarks.md).
 *
 * radixkv_read_chunk: the success path of a read: open, fstat, read the header and the payload block
 * by block, hash each block right after reading it, close. It only *reads*, it never judges: any
 * outcome but RK_OK (no file, not a regular file, a size other than header_len + payload bytes, a
 * short read, an I/O error) is "don't know", and the caller runs its full Python read, which
 * classifies it (miss, corrupt, size mismatch) exactly as before. On RK_OK the caller still checks
 * the header (identity, header checksum) and compares the payload checksum with *digest_out.
 *
 * radixkv_write_payload: the payload half of writing a frame (below).
 *
 * The hash functions are xxhash's own (XXH3_64bits_reset / _update / _digest, from the Python
 * xxhash extension), passed in by address, with a state owned by the calling thread.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { RK_OK = 0, RK_NO_FILE = 1, RK_NOT_REGULAR = 2, RK_SIZE = 3, RK_SHORT = 4, RK_IO = 5 };

typedef int (*rk_reset_fn)(void *);
typedef int (*rk_update_fn)(void *, const void *, size_t);
typedef uint64_t (*rk_digest_fn)(void *);

/* Read exactly n bytes at offset into buf; 0 on success, RK_SHORT at end of file, RK_IO on error. */
static int read_exact(int fd, char *buf, size_t n, off_t offset) {
    while (n > 0) {
        ssize_t got = pread(fd, buf, n, offset);
        if (got < 0) {
            if (errno == EINTR) continue;
            return RK_IO;
        }
        if (got == 0) return RK_SHORT;
        buf += got;
        n -= (size_t)got;
        offset += got;
    }
    return RK_OK;
}

/* spans: n_spans (address, bytes) pairs, the payload's parts in order. block_bytes: hash granularity
 * (each block is hashed while it is still in cache). */
int radixkv_read_chunk(const char *path, char *head, size_t head_len, const uint64_t *spans,
                       size_t n_spans, size_t block_bytes, void *state, rk_reset_fn reset,
                       rk_update_fn update, rk_digest_fn digest, uint64_t *digest_out,
                       int64_t *size_out) {
    if (block_bytes == 0) return RK_IO; /* (never from radixkv) no progress: "don't know" */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return RK_NO_FILE;
    int rc = RK_OK;
    struct stat st;
    size_t payload = 0;
    for (size_t i = 0; i < n_spans; i++) payload += (size_t)spans[2 * i + 1];
    if (fstat(fd, &st) != 0) {
        rc = RK_IO;
        goto out;
    }
    *size_out = (int64_t)st.st_size;
    if (!S_ISREG(st.st_mode)) {
        rc = RK_NOT_REGULAR;
        goto out;
    }
    if ((uint64_t)st.st_size != (uint64_t)head_len + payload) {
        rc = RK_SIZE;
        goto out;
    }
    if ((rc = read_exact(fd, head, head_len, 0)) != RK_OK) goto out;
    reset(state);
    off_t at = (off_t)head_len;
    for (size_t i = 0; i < n_spans && rc == RK_OK; i++) {
        char *p = (char *)(uintptr_t)spans[2 * i];
        size_t left = (size_t)spans[2 * i + 1];
        while (left > 0) {
            size_t take = left < block_bytes ? left : block_bytes;
            if ((rc = read_exact(fd, p, take, at)) != RK_OK) break;
            update(state, p, take);
            p += take;
            left -= take;
            at += (off_t)take;
        }
    }
    if (rc == RK_OK) {
        /* one byte past the frame must not exist: the file may have grown since the fstat */
        char probe;
        ssize_t extra = pread(fd, &probe, 1, at);
        if (extra != 0) rc = extra < 0 ? RK_IO : RK_SIZE;
        else *digest_out = digest(state);
    }
out:
    close(fd);
    return rc;
}

/* Write exactly n bytes at offset; 0 on success, else the errno (ENOSPC for a write that made no
 * progress). */
static int write_exact(int fd, const char *buf, size_t n, off_t offset) {
    while (n > 0) {
        ssize_t put = pwrite(fd, buf, n, offset);
        if (put < 0) {
            if (errno == EINTR) continue;
            return errno ? errno : EIO;
        }
        if (put == 0) return ENOSPC;
        buf += put;
        n -= (size_t)put;
        offset += put;
    }
    return 0;
}

/* The payload half of writing a frame: the parts at spans written from offset on, block by block,
 * each block hashed right after the kernel copied it (still in cache). Returns 0 and the payload's
 * xxh3 in *digest_out, or an errno; the caller then writes the header (which carries the digest) at
 * offset 0, into a file no reader can see yet. */
int radixkv_write_payload(int fd, int64_t offset, const uint64_t *spans, size_t n_spans,
                          size_t block_bytes, void *state, rk_reset_fn reset, rk_update_fn update,
                          rk_digest_fn digest, uint64_t *digest_out) {
    if (block_bytes == 0) return EINVAL; /* (never from radixkv) it would make no progress */
    off_t at = (off_t)offset;
    reset(state);
    for (size_t i = 0; i < n_spans; i++) {
        const char *p = (const char *)(uintptr_t)spans[2 * i];
        size_t left = (size_t)spans[2 * i + 1];
        while (left > 0) {
            size_t take = left < block_bytes ? left : block_bytes;
            int err = write_exact(fd, p, take, at);
            if (err) return err;
            update(state, p, take);
            p += take;
            left -= take;
            at += (off_t)take;
        }
    }
    *digest_out = digest(state);
    return 0;
}
