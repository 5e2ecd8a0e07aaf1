// The fuzzed input as a stream of values for the encoder harnesses: bytes past its end read as 0.
#ifndef TANDEM_FUZZ_INPUT_H
#define TANDEM_FUZZ_INPUT_H
#include <stdint.h>

typedef struct {
    const uint8_t *p, *end;
} input_t;

static inline uint8_t next_byte(input_t *in) { return in->p < in->end ? *in->p++ : 0; }

static inline uint64_t next_bytes(input_t *in, int n) {
    uint64_t value = 0;
    for (int i = 0; i < n; i++) value |= (uint64_t)next_byte(in) << (8 * i);
    return value;
}

#endif
