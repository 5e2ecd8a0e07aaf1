// libFuzzer harness: the C front's JSON answer encoder (json_answer, json_answer_bound), over answers derived from
// the input: names as the front serves them (letters, digits, '.', '_', '-'; empty ones too), an id as infer_body_parse
// takes it (a JSON string of printable ASCII and simple escapes, with its quotes) or none, 0 to 8 dimensions, rows and
// shape values small, zero or large, and floats of any bits (NaN, infinities, subnormals, -0.0, the extremes). Besides
// the sanitizers' findings (the answer is written into a buffer of exactly the bound) it reads the answer back with a
// strict JSON reader of its own: the expected object and nothing else, its names and id as given, its shape as given,
// each finite float as a number that reads back to the same float32 both with strtof and as a double rounded to
// float32 (as Python's json and numpy read it), each NaN or infinity as null.
#include <assert.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_front_parse.h"
#include "input.h"

#define MOST_DIMS 8          // the front's MAX_DIMS
#define MOST_VALUES 1024     // answers with more floats are left out: keeps the runs fast
#define LONGEST_NAME 40


// A name the front serves (native.PLAIN_NAME's letters), of a length from the input.
static size_t next_name(input_t *in, char *name) {
    static const char letters[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-";
    size_t len = next_byte(in) % (LONGEST_NAME + 1);
    for (size_t i = 0; i < len; i++) name[i] = letters[next_byte(in) % (sizeof letters - 1)];
    return len;
}

// An id as infer_body_parse takes it: a JSON string, its quotes included, of printable ASCII and simple escapes.
static size_t next_id(input_t *in, char *id) {
    size_t len = 0, chars = next_byte(in) % (LONGEST_NAME + 1);
    id[len++] = '"';
    for (size_t i = 0; i < chars; i++) {
        uint8_t b = next_byte(in);
        if (b >= 0x20 && b < 0x7f && b != '"' && b != '\\') {
            id[len++] = b;
        } else {
            id[len++] = '\\';
            id[len++] = b == '"' || b == '\\' ? b : "\"\\/bfnrt"[b % 8];
        }
    }
    id[len++] = '"';
    return len;
}

// A row count or shape value: mostly small, sometimes any non-negative 64-bit value.
static long next_dimension(input_t *in) {
    uint8_t b = next_byte(in);
    return b & 0x80 ? (long)(next_bytes(in, 8) & LONG_MAX) : b & 0x7f;
}

// A float: one of the cases that matter, or any bits.
static float next_float(input_t *in, int special) {
    static const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, FLT_MIN, -FLT_MIN, FLT_MAX,
                                     -FLT_MAX, FLT_TRUE_MIN, -FLT_TRUE_MIN, 1.17549421e-38f, 16777217.0f, 0.1f,
                                     1e-4f, 123456784.0f, 1e9f, 3.4e38f, 1.0f, -1.0f};
    if (special) return specials[next_byte(in) % (sizeof specials / sizeof *specials)];
    uint32_t bits = next_bytes(in, 4);
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

// -- reading the answer back --------------------------------------------------------------------------------------

typedef struct {
    const char *p, *end;
} text_t;

static void expect(text_t *t, const char *literal) {
    size_t len = strlen(literal);
    assert((size_t)(t->end - t->p) >= len && memcmp(t->p, literal, len) == 0);
    t->p += len;
}

// A JSON string (RFC 8259), which must be `bytes` as written (its quotes included where `quoted`).
static void expect_string(text_t *t, const char *bytes, size_t len, int quoted) {
    const char *begin = t->p;
    assert(t->p < t->end && *t->p == '"');
    for (t->p++;; t->p++) {
        assert(t->p < t->end && (unsigned char)*t->p >= 0x20);
        if (*t->p == '"') break;
        if (*t->p != '\\') continue;
        t->p++;
        assert(t->p < t->end && *t->p && strchr("\"\\/bfnrtu", *t->p));
        if (*t->p == 'u')
            for (int i = 0; i < 4; i++) assert(++t->p < t->end && strchr("0123456789abcdefABCDEF", *t->p) && *t->p);
    }
    t->p++;
    const char *content = quoted ? begin : begin + 1;
    size_t content_len = quoted ? (size_t)(t->p - begin) : (size_t)(t->p - begin - 2);
    assert(content_len == len && (len == 0 || memcmp(content, bytes, len) == 0));
}

static int digit(const text_t *t) { return t->p < t->end && *t->p >= '0' && *t->p <= '9'; }

// A JSON number (RFC 8259's grammar), copied NUL-terminated into `copy`.
static void read_number(text_t *t, char *copy, size_t copy_cap) {
    const char *begin = t->p;
    if (t->p < t->end && *t->p == '-') t->p++;
    assert(digit(t));
    if (*t->p == '0') t->p++;
    else while (digit(t)) t->p++;
    if (t->p < t->end && *t->p == '.') {
        t->p++;
        assert(digit(t));
        while (digit(t)) t->p++;
    }
    if (t->p < t->end && (*t->p == 'e' || *t->p == 'E')) {
        t->p++;
        if (t->p < t->end && (*t->p == '+' || *t->p == '-')) t->p++;
        assert(digit(t));
        while (digit(t)) t->p++;
    }
    size_t len = t->p - begin;
    assert(len < copy_cap);
    memcpy(copy, begin, len);
    copy[len] = 0;
}

static void expect_integer(text_t *t, long value) {
    char copy[32];
    read_number(t, copy, sizeof copy);
    assert(!strpbrk(copy, ".eE") && strtol(copy, NULL, 10) == value);
}

static void expect_float(text_t *t, float value) {
    if (!isfinite(value)) {
        expect(t, "null");
        return;
    }
    char copy[32];
    read_number(t, copy, sizeof copy);
    float as_float = strtof(copy, NULL), as_double = (float)strtod(copy, NULL);
    assert(memcmp(&as_float, &value, sizeof value) == 0);  // bits: -0.0 too
    assert(memcmp(&as_double, &value, sizeof value) == 0);
}

static void check_answer(const answer_t *a, long values, const char *answer, size_t len) {
    text_t t = {answer, answer + len};
    expect(&t, "{\"model_name\":");
    expect_string(&t, a->model_name, a->model_name_len, 0);
    expect(&t, ",\"model_version\":");
    expect_string(&t, a->version, a->version_len, 0);
    if (a->id) {
        expect(&t, ",\"id\":");
        expect_string(&t, a->id, a->id_len, 1);
    }
    expect(&t, ",\"outputs\":[{\"name\":");
    expect_string(&t, a->output_name, a->output_name_len, 0);
    expect(&t, ",\"datatype\":\"FP32\",\"shape\":[");
    expect_integer(&t, a->rows);
    for (int i = 0; i < a->dims; i++) {
        expect(&t, ",");
        expect_integer(&t, a->shape[i]);
    }
    expect(&t, "],\"data\":[");
    for (long i = 0; i < values; i++) {
        if (i) expect(&t, ",");
        expect_float(&t, a->y[i]);
    }
    expect(&t, "]}]}");
    assert(t.p == t.end);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input_t in = {data, data + size};
    char model_name[LONGEST_NAME], version[LONGEST_NAME], output_name[LONGEST_NAME], id[2 + 2 * LONGEST_NAME];
    long shape[MOST_DIMS];
    answer_t a;
    uint8_t flags = next_byte(&in);
    a.dims = (flags & 0x0f) % (MOST_DIMS + 1);
    int has_id = flags & 0x10, special_floats = flags & 0x20;
    a.model_name = model_name;
    a.model_name_len = next_name(&in, model_name);
    a.version = version;
    a.version_len = next_name(&in, version);
    a.output_name = output_name;
    a.output_name_len = next_name(&in, output_name);
    a.id_len = has_id ? next_id(&in, id) : 0;
    a.id = has_id ? id : NULL;
    a.rows = next_dimension(&in);
    long features = 1, values;
    int overflows = 0;
    for (int i = 0; i < a.dims; i++) {
        shape[i] = next_dimension(&in);
        overflows |= __builtin_mul_overflow(features, shape[i], &features);
    }
    a.shape = shape;
    // Counts a long cannot hold are no buffer's (the front's count, rows x out_features, is one); large shape values
    // with a 0 among them or 0 rows make an answer of no floats.
    overflows |= __builtin_mul_overflow(a.rows, features, &values);
    if (overflows || values > MOST_VALUES) return 0;

    float *y = malloc(sizeof(float) * (values ? values : 1));
    input_t floats = in;  // read over again while the answer takes more floats than the input holds
    for (long i = 0; i < values; i++) {
        if (floats.p >= floats.end) floats = in;
        y[i] = next_float(&floats, special_floats);
    }
    a.y = y;
    size_t bound = json_answer_bound(&a);
    char *answer = malloc(bound);
    size_t len = json_answer(&a, answer);
    assert(len < bound && answer[len] == 0);
    check_answer(&a, values, answer, len);
    free(answer);
    free(y);
    return 0;
}
