// libFuzzer harness: the C front's ModelInferResponse encoder (infer_response_size, infer_response), over answers
// derived from the input: names and id of any bytes and lengths (empty ones included), 0 to INFER_MAX_DIMS
// dimensions, rows and shape values small, large, zero or negative, and outputs taken from the input. Besides the
// sanitizers' findings (the answer is written into a buffer of exactly the size announced) it checks the size
// against one computed here, and reads the answer back with a protobuf reader of its own: the gRPC prefix, then
// model_name, model_version iff the version is not empty, id iff the id is not empty, the one output (name, "FP32",
// packed shape [rows, shape...]) and raw_output_contents, exactly the outputs' bytes, in field order.
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_front_infer.h"
#include "input.h"

#define LARGEST_ENCODED (1 << 20)  // answers larger than this are sized but not written: keeps the runs fast


// A name or id: a length from the input, then that many of its bytes (fewer where it ends).
static const char *next_text(input_t *in, size_t *len) {
    size_t want = next_byte(in);
    size_t left = in->end - in->p;
    *len = want < left ? want : left;
    const char *text = (const char *)in->p;
    in->p += *len;
    return text;
}

// A row count or shape value: mostly small, sometimes up to 65535, sometimes any 64-bit value (negative included).
static long next_dimension(input_t *in) {
    uint8_t b = next_byte(in);
    if ((b & 0xc0) == 0xc0) return (long)next_bytes(in, 8);
    if (b & 0x80) return (long)next_bytes(in, 2);
    return b & 0x7f;
}

static size_t varint_len(uint64_t value) {
    size_t n = 1;
    for (; value >= 0x80; value >>= 7) n++;
    return n;
}

static uint64_t field_len(uint64_t len) { return 1 + varint_len(len) + len; }

// -- reading the answer back --------------------------------------------------------------------------------------

typedef struct {
    const uint8_t *p, *end;
} reader_t;

static uint64_t read_varint(reader_t *r) {
    uint64_t value = 0;
    for (int shift = 0;; shift += 7) {
        assert(shift < 64 && r->p < r->end);
        uint8_t b = *r->p++;
        value |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return value;
    }
}

// The next field, which must be field `number`, length-delimited: its bytes.
static reader_t read_field(reader_t *r, uint32_t number) {
    assert(read_varint(r) == ((uint64_t)number << 3 | 2));
    uint64_t len = read_varint(r);
    assert(len <= (uint64_t)(r->end - r->p));
    reader_t field = {r->p, r->p + len};
    r->p += len;
    return field;
}

static void assert_bytes(reader_t field, const void *bytes, size_t len) {
    assert((size_t)(field.end - field.p) == len && (len == 0 || memcmp(field.p, bytes, len) == 0));
}

static void check_answer(const answer_t *a, const unsigned char *answer, size_t size, size_t raw_len) {
    assert(size >= 5 && answer[0] == 0);
    size_t prefixed = (size_t)answer[1] << 24 | (size_t)answer[2] << 16 | (size_t)answer[3] << 8 | answer[4];
    assert(prefixed == size - 5);
    reader_t message = {answer + 5, answer + size};
    assert_bytes(read_field(&message, 1), a->model_name, a->model_name_len);
    if (a->version_len) assert_bytes(read_field(&message, 2), a->version, a->version_len);
    if (a->id_len) assert_bytes(read_field(&message, 3), a->id, a->id_len);
    reader_t tensor = read_field(&message, 5);
    assert_bytes(read_field(&tensor, 1), a->output_name, a->output_name_len);
    assert_bytes(read_field(&tensor, 2), "FP32", 4);
    reader_t shape = read_field(&tensor, 3);
    assert(read_varint(&shape) == (uint64_t)a->rows);
    for (int i = 0; i < a->dims; i++) assert(read_varint(&shape) == (uint64_t)a->shape[i]);
    assert(shape.p == shape.end && tensor.p == tensor.end);
    assert_bytes(read_field(&message, 6), a->y, raw_len);
    assert(message.p == message.end);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input_t in = {data, data + size};
    answer_t a;
    long shape[INFER_MAX_DIMS];
    a.dims = next_byte(&in) % (INFER_MAX_DIMS + 1);
    a.model_name = next_text(&in, &a.model_name_len);
    a.version = next_text(&in, &a.version_len);
    a.id = next_text(&in, &a.id_len);
    a.output_name = next_text(&in, &a.output_name_len);
    a.rows = next_dimension(&in);
    for (int i = 0; i < a.dims; i++) shape[i] = next_dimension(&in);
    a.shape = shape;
    a.y = NULL;

    // The size as protobuf writes the answer, or 0 where it cannot be one gRPC message (a negative count, more than
    // 4 GiB of outputs or of message).
    int negative = a.rows < 0;
    unsigned __int128 values = a.rows < 0 ? 0 : (unsigned __int128)a.rows;
    uint64_t shape_len = varint_len((uint64_t)a.rows);
    for (int i = 0; i < a.dims; i++) {
        negative |= shape[i] < 0;
        shape_len += varint_len((uint64_t)shape[i]);
        uint64_t dimension = shape[i] < 0 ? 0 : (uint64_t)shape[i];
        if (dimension == 0) {
            values = 0;
        } else if (values <= UINT32_MAX) {  // past it, it stays past it (unless a 0 follows)
            values *= dimension;
        }
    }
    uint64_t expected = 0;
    if (!negative && values <= UINT32_MAX / sizeof(float)) {
        uint64_t tensor_len = field_len(a.output_name_len) + field_len(4) + field_len(shape_len);
        uint64_t len = field_len(a.model_name_len) + (a.version_len ? field_len(a.version_len) : 0)
                     + (a.id_len ? field_len(a.id_len) : 0) + field_len(tensor_len)
                     + field_len(values * sizeof(float));
        expected = len > UINT32_MAX ? 0 : 5 + len;
    }
    size_t announced = infer_response_size(&a);
    assert(announced == expected);
    if (announced == 0 || announced > LARGEST_ENCODED) return 0;

    // The outputs: the rest of the input, over again as often as they need.
    size_t raw_len = (size_t)values * sizeof(float), left = in.end - in.p;
    unsigned char *y = calloc(raw_len ? raw_len : 1, 1);
    for (size_t at = 0; left && at < raw_len; at += left)
        memcpy(y + at, in.p, raw_len - at < left ? raw_len - at : left);
    a.y = (const float *)y;
    unsigned char *answer = malloc(announced);
    infer_response(&a, answer);
    check_answer(&a, answer, announced, raw_len);
    free(answer);
    free(y);
    return 0;
}
