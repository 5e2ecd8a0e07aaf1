// libFuzzer harness: the C front's recogniser of the one HTTP/1.1 request it serves (http1_recognise, on llhttp),
// then that request's JSON body as the front reads it, over arbitrary bytes. Besides the sanitizers' findings it
// checks what the front relies on: a request taken lies inside the input, and its numbers fill exactly its rows.
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_front_parse.h"

#define PATH "/v2/models/digits/infer"
#define TOKEN "Bearer secret-token"

static int token_ok(void *context, const char *value, size_t len) {
    (void)context;
    return len == strlen(TOKEN) && memcmp(value, TOKEN, len) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    // The first byte chooses the limits and whether a token is asked, so that every branch is reachable.
    http1_spec_t spec = {PATH, strlen(PATH), (data[0] & 1) ? 16384 : 256, (data[0] & 2) ? 1 << 20 : 64,
                         (data[0] & 4) != 0, token_ok, NULL};
    const char *in = (const char *)data + 1;
    size_t len = size - 1;
    const char *body = NULL;
    size_t body_len = 0, used = 0;
    int what = http1_recognise(in, len, &spec, &body, &body_len, &used);
    assert(what == HTTP1_INCOMPLETE || what == HTTP1_MINE || what == HTTP1_NOT_MINE);
    if (what != HTTP1_MINE) return 0;
    assert(used <= len && body >= in && body + body_len <= in + used && (long)body_len <= spec.max_body);
    static const long shape[] = {64};
    infer_spec_t model = {"input", 5, 1, shape, 64, 32, 32 * 64};
    infer_body_t parsed;
    if (!infer_body_parse(body, body_len, &model, &parsed)) return 0;
    assert(parsed.rows >= 1 && parsed.rows <= model.max_rows);
    float *x = malloc(sizeof(float) * parsed.rows * model.features);
    infer_body_values(&parsed, parsed.rows * model.features, x);
    free(x);
    return 0;
}
