/* Experiment (not part of the package): what a native chunk-key index costs on the tree benchmark's
 * shared-prefix workload. Keys are SGLang/vLLM page keys, 64 hex characters of a SHA-256 chain, so
 * their first 16 hex characters are already a uniform 64-bit hash: the index parses them as the
 * fingerprint (no SipHash), probes an open-addressing table of (fingerprint, node id), and confirms a
 * hit against the full 32-byte digest kept per node. Build and run with
 * `python docs/experiments/native_index.py` (it compiles this file with gcc into a temp dir). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { uint64_t fp; int32_t id; } slot_t;

static slot_t *table;
static uint8_t *digests;  /* 32 bytes per node id */
static uint64_t mask;
static int32_t n_nodes, cap_nodes;

static inline int hexval(char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

static inline void parse(const char *k, uint8_t out[32]) {
    for (int i = 0; i < 32; i++) out[i] = (uint8_t)(hexval(k[2 * i]) << 4 | hexval(k[2 * i + 1]));
}

static inline uint64_t fingerprint(const uint8_t d[32]) {
    uint64_t fp; memcpy(&fp, d, 8); return fp | 1;  /* 0 marks an empty slot */
}

int idx_init(int32_t capacity_nodes) {
    uint64_t slots = 1; while (slots < (uint64_t)capacity_nodes * 2) slots <<= 1;
    table = calloc(slots, sizeof(slot_t)); digests = malloc((size_t)capacity_nodes * 32);
    mask = slots - 1; n_nodes = 0; cap_nodes = capacity_nodes;
    return table && digests ? 0 : -1;
}

static inline int32_t find(const uint8_t d[32], uint64_t fp, uint64_t *where) {
    uint64_t i = fp & mask;
    for (;; i = (i + 1) & mask) {
        if (table[i].fp == 0) { *where = i; return -1; }
        if (table[i].fp == fp && memcmp(digests + (size_t)table[i].id * 32, d, 32) == 0) return table[i].id;
    }
}

/* keys: n keys of 64 hex chars back to back. Inserts the absent ones; ids[i] = node id. Returns new. */
int32_t idx_insert(const char *keys, int32_t n, int32_t *ids) {
    int32_t fresh = 0; uint8_t d[32]; uint64_t where;
    for (int32_t k = 0; k < n; k++) {
        parse(keys + 64 * (size_t)k, d);
        uint64_t fp = fingerprint(d);
        int32_t id = find(d, fp, &where);
        if (id < 0) {
            if (n_nodes == cap_nodes) return -1;
            id = n_nodes++; memcpy(digests + (size_t)id * 32, d, 32);
            table[where].fp = fp; table[where].id = id; fresh++;
        }
        ids[k] = id;
    }
    return fresh;
}

/* Longest present prefix of a chain by binary search (keys name whole prefixes). */
int32_t idx_match(const char *keys, int32_t n) {
    uint8_t d[32]; uint64_t where;
    int32_t lo = 0, hi = n;  /* keys[:lo] present, keys[hi:] absent */
    while (lo < hi) {
        int32_t mid = (lo + hi + 1) / 2;
        parse(keys + 64 * (size_t)(mid - 1), d);
        if (find(d, fingerprint(d), &where) >= 0) lo = mid; else hi = mid - 1;
    }
    return lo;
}
