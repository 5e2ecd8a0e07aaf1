// The gRPC message prefix, the ModelInferRequest decoder (see _front_infer.h: "mine, exactly" or "not mine", never an
// answer of its own) and the ModelInferResponse encoder of the C front.
#include "_front_infer.h"

#include <string.h>

typedef struct {
    const unsigned char *p, *end;
} pb_t;

static int varint(pb_t *s, uint64_t *value) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (s->p >= s->end) return 0;
        unsigned char byte = *s->p++;
        v |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *value = v;
            return 1;
        }
    }
    return 0;
}

// The next field, which must be length-delimited (every field this path takes is): its number and bytes.
static int delimited(pb_t *s, uint32_t *number, pb_t *field) {
    uint64_t key, len;
    if (!varint(s, &key) || (key & 7) != 2 || !varint(s, &len) || len > (uint64_t)(s->end - s->p)) return 0;
    *number = key >> 3;
    field->p = s->p;
    field->end = s->p + len;
    s->p += len;
    return 1;
}

static int equals(pb_t field, const char *text, size_t len) {
    return (size_t)(field.end - field.p) == len && (len == 0 || memcmp(field.p, text, len) == 0);
}

static int printable(pb_t field) {
    for (const unsigned char *p = field.p; p < field.end; p++)
        if (*p < 0x20 || *p > 0x7e) return 0;
    return 1;
}

// An InferInputTensor: the model's input, FP32, shape [rows, <the example's shape>] (packed), nothing else.
static int input_tensor(const infer_model_t *m, pb_t s, long *rows) {
    int seen_name = 0, seen_datatype = 0, seen_shape = 0;
    uint32_t number;
    pb_t field;
    while (s.p < s.end) {
        if (!delimited(&s, &number, &field)) return 0;
        if (number == 1 && !seen_name) {
            if (!equals(field, m->input_name, m->input_name_len)) return 0;
            seen_name = 1;
        } else if (number == 2 && !seen_datatype) {
            if (!equals(field, "FP32", 4)) return 0;
            seen_datatype = 1;
        } else if (number == 3 && !seen_shape) {
            uint64_t dim;
            if (!varint(&field, &dim) || dim < 1 || dim > 100000000) return 0;
            *rows = dim;
            for (int i = 0; i < m->dims; i++)
                if (!varint(&field, &dim) || dim != (uint64_t)m->shape[i]) return 0;
            if (field.p != field.end) return 0;
            seen_shape = 1;
        } else {
            return 0;
        }
    }
    return seen_name && seen_datatype && seen_shape;
}

// An InferRequestedOutputTensor naming the model's output, without parameters.
static int requested_output(const infer_model_t *m, pb_t s) {
    uint32_t number;
    pb_t field;
    if (!delimited(&s, &number, &field) || number != 1 || !equals(field, m->output_name, m->output_name_len))
        return 0;
    return s.p == s.end;
}

int grpc_message(const unsigned char *body, size_t len, const unsigned char **message, size_t *message_len) {
    if (len < 5 || body[0] != 0
        || ((size_t)body[1] << 24 | (size_t)body[2] << 16 | (size_t)body[3] << 8 | body[4]) != len - 5)
        return 0;
    *message = body + 5;
    *message_len = len - 5;
    return 1;
}

int infer_request(const infer_model_t *m, const unsigned char *message, size_t len, infer_call_t *call) {
    pb_t s = {message, message + len}, field, id = {NULL, NULL}, raw = {NULL, NULL};
    int seen_model = 0, seen_version = 0, seen_input = 0;
    long rows = 0;
    uint32_t number;
    while (s.p < s.end) {
        if (!delimited(&s, &number, &field)) return 0;
        if (number == 1 && !seen_model) {
            if (!equals(field, m->model_name, m->model_name_len)) return 0;
            seen_model = 1;
        } else if (number == 2 && !seen_version) {
            if (field.p != field.end && !equals(field, m->version, m->version_len)) return 0;
            seen_version = 1;
        } else if (number == 3 && !id.p) {
            if (!printable(field)) return 0;
            id = field;
        } else if (number == 5 && !seen_input) {
            if (!input_tensor(m, field, &rows)) return 0;
            seen_input = 1;
        } else if (number == 6) {
            if (!requested_output(m, field)) return 0;
        } else if (number == 7 && !raw.p) {
            raw = field;
        } else {
            return 0;  // parameters, typed contents, a repeated field, an unknown one: not ours
        }
    }
    if (!seen_model || !seen_input || !raw.p || rows > m->max_rows) return 0;
    if ((size_t)(raw.end - raw.p) != (size_t)rows * (size_t)m->features * sizeof(float)) return 0;
    call->rows = rows;
    call->raw = raw.p;
    call->raw_len = raw.end - raw.p;
    call->id = id.p;
    call->id_len = id.p ? (size_t)(id.end - id.p) : 0;
    return 1;
}

// -- the answer -------------------------------------------------------------------------------------------------------

static size_t varint_size(uint64_t value) {
    size_t n = 1;
    while (value >= 0x80) {
        value >>= 7;
        n++;
    }
    return n;
}

static unsigned char *put_varint(unsigned char *into, uint64_t value) {
    while (value >= 0x80) {
        *into++ = (value & 0x7f) | 0x80;
        value >>= 7;
    }
    *into++ = value;
    return into;
}

static size_t delimited_size(size_t len) { return 1 + varint_size(len) + len; }  // field numbers below 16

static unsigned char *put_delimited(unsigned char *into, uint32_t number, const void *bytes, size_t len) {
    *into++ = number << 3 | 2;
    into = put_varint(into, len);
    if (len) memcpy(into, bytes, len);
    return into + len;
}

// The sizes of the answer's parts: the packed shape, the output tensor, the raw contents and the whole message (without
// its 5-byte prefix); 0 if they overflow or the message is over what the prefix can say (4 GiB).
typedef struct {
    size_t shape, tensor, raw, message;
} answer_sizes_t;

static int answer_sizes(const answer_t *a, answer_sizes_t *sizes) {
    if (a->rows < 0) return 0;
    int empty = a->rows == 0;
    sizes->shape = varint_size((uint64_t)a->rows);
    for (int i = 0; i < a->dims; i++) {
        if (a->shape[i] < 0) return 0;
        sizes->shape += varint_size((uint64_t)a->shape[i]);
        empty |= a->shape[i] == 0;
    }
    uint64_t values = empty ? 0 : (uint64_t)a->rows;
    for (int i = 0; i < a->dims && !empty; i++) {
        if (values > UINT32_MAX / (uint64_t)a->shape[i]) return 0;
        values *= (uint64_t)a->shape[i];
    }
    if (values > UINT32_MAX / sizeof(float)) return 0;
    sizes->raw = values * sizeof(float);
    sizes->tensor = delimited_size(a->output_name_len) + delimited_size(4) + delimited_size(sizes->shape);
    uint64_t message = delimited_size(a->model_name_len) + (a->version_len ? delimited_size(a->version_len) : 0)
                     + (a->id_len ? delimited_size(a->id_len) : 0) + delimited_size(sizes->tensor)
                     + delimited_size(sizes->raw);
    if (message > UINT32_MAX) return 0;
    sizes->message = message;
    return 1;
}

size_t infer_response_size(const answer_t *a) {
    answer_sizes_t sizes;
    return answer_sizes(a, &sizes) ? 5 + sizes.message : 0;
}

void infer_response(const answer_t *a, unsigned char *into) {
    answer_sizes_t sizes;
    answer_sizes(a, &sizes);
    size_t len = sizes.message;
    unsigned char *p = into;
    *p++ = 0;
    *p++ = len >> 24;
    *p++ = len >> 16;
    *p++ = len >> 8;
    *p++ = len;
    p = put_delimited(p, 1, a->model_name, a->model_name_len);
    if (a->version_len) p = put_delimited(p, 2, a->version, a->version_len);
    if (a->id_len) p = put_delimited(p, 3, a->id, a->id_len);
    *p++ = 5 << 3 | 2;
    p = put_varint(p, sizes.tensor);
    p = put_delimited(p, 1, a->output_name, a->output_name_len);
    p = put_delimited(p, 2, "FP32", 4);
    *p++ = 3 << 3 | 2;
    p = put_varint(p, sizes.shape);
    p = put_varint(p, (uint64_t)a->rows);
    for (int i = 0; i < a->dims; i++) p = put_varint(p, (uint64_t)a->shape[i]);
    put_delimited(p, 6, a->y, sizes.raw);
}
