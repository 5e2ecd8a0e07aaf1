// libFuzzer harness: the C front's parser of the JSON inference body (infer_body_parse, infer_body_values), with the
// model's input shape chosen by the first byte. Besides the sanitizers' findings it checks that a body taken has
// rows within the model's limit, and that every number it yields is a finite float32 (anything else is the Python
// server's to refuse).
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "_front_parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const long shapes[4][2] = {{4, 0}, {2, 3}, {1, 1}, {64, 0}};
    int which = data[0] & 3;
    int dims = shapes[which][1] ? 2 : 1;
    long features = dims == 2 ? shapes[which][0] * shapes[which][1] : shapes[which][0];
    long max_rows = (data[0] >> 2 & 7) + 1;
    infer_spec_t spec = {"input", 5, dims, shapes[which], features, max_rows, max_rows * features};
    infer_body_t parsed;
    if (!infer_body_parse((const char *)data + 1, size - 1, &spec, &parsed)) return 0;
    assert(parsed.rows >= 1 && parsed.rows <= max_rows);
    assert(parsed.data >= (const char *)data + 1 && parsed.end <= (const char *)data + size);
    long count = parsed.rows * features;
    float *x = malloc(sizeof(float) * count);
    if (infer_body_values(&parsed, count, x))
        for (long i = 0; i < count; i++) assert(isfinite(x[i]));
    free(x);
    return 0;
}
