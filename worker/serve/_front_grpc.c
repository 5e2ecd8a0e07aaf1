// tandem.worker.serve._front, gRPC: the gRPC port's common inference call served without the interpreter.
//
// The front owns the gRPC port's connections as it owns the HTTP port's (_front.c): HTTP/2 over cleartext with prior
// knowledge, as grpc_server.py speaks it (the same SETTINGS, windows, limits and GOAWAY codes), with HPACK decoded
// here (RFC 7541, Huffman code included). A call of the one shape it knows, ModelInfer for the served model with one
// FP32 input of the model's example shape in raw_input_contents (as tritonclient.grpc sends it), no parameters,
// identity encoding, is queued with the HTTP port's requests and answered here. Every other call (another method,
// typed contents, compression, parameters, a token that is not the one the front holds, a malformed request) is
// handed whole to the Python server (calls(): its headers and body), which answers it as grpc_server.py would
// (answer_call); unlike an HTTP/1.1 connection, an HTTP/2 one carries many calls and its HPACK state, so the calls
// travel, not the connection.
#include "_front.h"
#include "_front_tables.h"

#define PREFACE "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#define PREFACE_LEN 24
enum { DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION };
#define END_STREAM 0x1
#define ACK 0x1
#define END_HEADERS 0x4
#define PADDED 0x8
#define PRIORITY_FLAG 0x20
enum { NO_ERROR = 0x0, PROTOCOL_ERROR = 0x1, FLOW_CONTROL_ERROR = 0x3, FRAME_SIZE_ERROR = 0x6,
       REFUSED_STREAM = 0x7, COMPRESSION_ERROR = 0x9, ENHANCE_YOUR_CALM = 0xB };
#define SETTINGS_MAX_CONCURRENT_STREAMS 0x3
#define SETTINGS_INITIAL_WINDOW_SIZE 0x4
#define SETTINGS_MAX_FRAME_SIZE 0x5

// As grpc_server.py's (see there for why).
#define MAX_FRAME 16384
#define MAX_WINDOW 0x7fffffffLL
#define DEFAULT_WINDOW 65535
#define STREAM_WINDOW (1 << 30)
#define CONNECTION_WINDOW (1 << 30)
#define MAX_STREAMS 256
#define MAX_HEADER_BLOCK (64 << 10)
#define MAX_HEADER_LIST (64 << 10)  // decoded, as hpack's Decoder limits it
#define HEADER_TABLE 4096           // SETTINGS_HEADER_TABLE_SIZE: HTTP/2's default, which the server keeps
#define INFER_PATH "/inference.GRPCInferenceService/ModelInfer"

enum { OK = 0, INVALID_ARGUMENT = 3, DEADLINE_EXCEEDED = 4, NOT_FOUND = 5, PERMISSION_DENIED = 7,
       RESOURCE_EXHAUSTED = 8, UNIMPLEMENTED = 12, INTERNAL = 13, UNAVAILABLE = 14, UNAUTHENTICATED = 16 };

typedef struct {
    char *name, *value;
    size_t name_len, value_len;
} entry_t;

typedef struct {
    char *bytes;
    size_t len, cap;
} buffer_t;

struct stream {
    request_t *request;        // its inference request while queued or in a batch
    stream_t *next;
    uint32_t id;
    int headers_done;          // the request's headers are in
    int called;                // queued, handed to Python or answered: later DATA is dropped
    int bridged;               // handed to Python
    int blocked;               // its answer waits for a window
    buffer_t fields;           // its headers: (u32 length, name, u32 length, value) each
    buffer_t body;
    int64_t send_window;
    char *outgoing;            // the answer's DATA not sent yet, then its trailers
    size_t outgoing_len, outgoing_sent;
    char *trailers;
    size_t trailers_len;
};

struct h2 {
    uint64_t serial;           // names the connection in calls()
    int started;               // the client's preface is read
    stream_t *streams;
    int stream_count;
    uint32_t last_stream;
    uint32_t continuing;       // the stream of a header block awaiting CONTINUATION (0: none)
    int continuing_flags;
    buffer_t block;
    int64_t send_window, initial_send_window, unacknowledged;
    uint32_t max_send_frame;
    entry_t *table;            // HPACK's dynamic table, oldest first
    size_t table_count, table_cap, table_size, table_max;
    buffer_t decoded;          // a header block's fields as decoded
};

static int16_t huffman_trie[512][2];  // children of each node: > 0 a node, < 0 -(symbol + 1), 0 none
static char response_headers[128], ok_trailers[32];
static size_t response_headers_len, ok_trailers_len;

static void put(buffer_t *b, const void *bytes, size_t n) {
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->bytes = grown(b->bytes, b->cap);
    }
    memcpy(b->bytes + b->len, bytes, n);
    b->len += n;
}

static void free_buffer(buffer_t *b) {
    free(b->bytes);
    b->bytes = NULL;
    b->len = b->cap = 0;
}

// -- HPACK ---------------------------------------------------------------------------------------------------------

static size_t put_hpack_int(char *into, uint64_t value, int prefix_bits, unsigned char high_bits) {
    uint64_t limit = (1u << prefix_bits) - 1;
    size_t n = 0;
    if (value < limit) {
        into[n++] = high_bits | value;
        return n;
    }
    into[n++] = high_bits | limit;
    value -= limit;
    while (value >= 0x80) {
        into[n++] = (value & 0x7f) | 0x80;
        value >>= 7;
    }
    into[n++] = value;
    return n;
}

// One header as a literal without indexing, new name, no Huffman coding (grpc_server.header_field).
static void put_field(buffer_t *b, const char *name, size_t name_len, const char *value, size_t value_len) {
    char prefix[12];
    put(b, "\0", 1);
    put(b, prefix, put_hpack_int(prefix, name_len, 7, 0));
    put(b, name, name_len);
    put(b, prefix, put_hpack_int(prefix, value_len, 7, 0));
    put(b, value, value_len);
}

int h2_init_tables(void) {
    int nodes = 1;
    for (int symbol = 0; symbol < 257; symbol++) {
        int node = 0;
        for (int bit = huffman_lengths[symbol] - 1; bit >= 0; bit--) {
            int branch = (huffman_codes[symbol] >> bit) & 1;
            if (bit == 0) {
                huffman_trie[node][branch] = -(symbol + 1);
            } else {
                if (huffman_trie[node][branch] == 0) {
                    if (nodes >= 512) return -1;
                    huffman_trie[node][branch] = nodes++;
                }
                node = huffman_trie[node][branch];
            }
        }
    }
    buffer_t b = {0};
    put_field(&b, ":status", 7, "200", 3);
    put_field(&b, "content-type", 12, "application/grpc", 16);
    put_field(&b, "grpc-accept-encoding", 20, "identity,deflate,gzip", 21);
    memcpy(response_headers, b.bytes, b.len);
    response_headers_len = b.len;
    b.len = 0;
    put_field(&b, "grpc-status", 11, "0", 1);
    memcpy(ok_trailers, b.bytes, b.len);
    ok_trailers_len = b.len;
    free_buffer(&b);
    return 0;
}

static int huffman_decode(const unsigned char *in, size_t len, buffer_t *out) {
    int node = 0, depth = 0, ones = 1;
    for (size_t i = 0; i < len; i++) {
        for (int bit = 7; bit >= 0; bit--) {
            int branch = (in[i] >> bit) & 1;
            int next = huffman_trie[node][branch];
            depth++;
            ones &= branch;
            if (next < 0) {
                if (next == -257) return -1;  // EOS in a string
                char symbol = -next - 1;
                put(out, &symbol, 1);
                node = depth = 0;
                ones = 1;
            } else if (next == 0) {
                return -1;
            } else {
                node = next;
            }
        }
    }
    return depth > 7 || !ones ? -1 : 0;  // padding: at most 7 bits, all ones (EOS's prefix)
}

static int hpack_int(const unsigned char **p, const unsigned char *end, int prefix_bits, uint64_t *value) {
    if (*p >= end) return -1;
    uint64_t limit = (1u << prefix_bits) - 1, v = **p & limit;
    (*p)++;
    if (v == limit) {
        for (int shift = 0;; shift += 7) {
            if (*p >= end || shift > 28) return -1;
            unsigned char byte = *(*p)++;
            v += (uint64_t)(byte & 0x7f) << shift;
            if (!(byte & 0x80)) break;
        }
    }
    *value = v;
    return 0;
}

// A string literal, appended to `out` as (u32 length, bytes).
static int hpack_string(const unsigned char **p, const unsigned char *end, buffer_t *out) {
    if (*p >= end) return -1;
    int huffman = **p & 0x80;
    uint64_t len;
    if (hpack_int(p, end, 7, &len) < 0 || len > (uint64_t)(end - *p)) return -1;
    size_t at = out->len;
    uint32_t n = len;
    put(out, &n, 4);
    if (huffman) {
        if (huffman_decode(*p, len, out) < 0) return -1;
        n = out->len - at - 4;
        memcpy(out->bytes + at, &n, 4);
    } else {
        put(out, *p, len);
    }
    *p += len;
    return 0;
}

static void evict(h2_t *h, size_t room) {
    size_t dropped = 0;
    while (dropped < h->table_count && h->table_size + room > h->table_max) {
        entry_t *e = &h->table[dropped++];
        h->table_size -= e->name_len + e->value_len + 32;
        free(e->name);
        free(e->value);
    }
    memmove(h->table, h->table + dropped, (h->table_count - dropped) * sizeof *h->table);
    h->table_count -= dropped;
}

static void insert(h2_t *h, const char *name, size_t name_len, const char *value, size_t value_len) {
    size_t size = name_len + value_len + 32;
    evict(h, size);
    if (size > h->table_max) return;  // larger than the table: it empties it, and is not kept
    if (h->table_count == h->table_cap) {
        h->table_cap = h->table_cap * 2 + 8;
        h->table = grown(h->table, h->table_cap * sizeof *h->table);
    }
    entry_t *e = &h->table[h->table_count++];
    e->name = copied(name, name_len);
    e->value = copied(value, value_len);
    e->name_len = name_len;
    e->value_len = value_len;
    h->table_size += size;
}

// The (name, value) at `index` of the static then the dynamic table, appended to `out`; -1 if there is none.
static int indexed(h2_t *h, uint64_t index, int name_only, buffer_t *out) {
    const char *name, *value;
    size_t name_len, value_len;
    if (index >= 1 && index <= 61) {
        name = static_table[index - 1][0];
        value = static_table[index - 1][1];
        name_len = strlen(name);
        value_len = strlen(value);
    } else if (index > 61 && index - 61 <= h->table_count) {
        entry_t *e = &h->table[h->table_count - (index - 61)];
        name = e->name, value = e->value, name_len = e->name_len, value_len = e->value_len;
    } else {
        return -1;
    }
    uint32_t n = name_len;
    put(out, &n, 4);
    put(out, name, name_len);
    if (!name_only) {
        n = value_len;
        put(out, &n, 4);
        put(out, value, value_len);
    }
    return 0;
}

// Decode a header block into h->decoded; -1: COMPRESSION_ERROR.
static int decode_block(h2_t *h, const unsigned char *p, size_t len) {
    const unsigned char *end = p + len;
    buffer_t *out = &h->decoded;
    out->len = 0;
    size_t listed = 0;
    while (p < end) {
        unsigned char first = *p;
        uint64_t index;
        size_t at = out->len;
        if (first & 0x80) {  // indexed
            if (hpack_int(&p, end, 7, &index) < 0 || index == 0 || indexed(h, index, 0, out) < 0) return -1;
        } else if ((first & 0xe0) == 0x20) {  // dynamic table size update
            if (hpack_int(&p, end, 5, &index) < 0 || index > HEADER_TABLE) return -1;
            h->table_max = index;
            evict(h, 0);
            continue;
        } else {  // literal: with incremental indexing (01), without (0000) or never indexed (0001)
            int indexing = first & 0x40;
            if (hpack_int(&p, end, indexing ? 6 : 4, &index) < 0) return -1;
            if (index ? indexed(h, index, 1, out) < 0 : hpack_string(&p, end, out) < 0) return -1;
            if (hpack_string(&p, end, out) < 0) return -1;
            if (indexing) {
                uint32_t name_len, value_len;
                memcpy(&name_len, out->bytes + at, 4);
                memcpy(&value_len, out->bytes + at + 4 + name_len, 4);
                insert(h, out->bytes + at + 4, name_len, out->bytes + at + 8 + name_len, value_len);
            }
        }
        listed += out->len - at - 8 + 32;
        if (listed > MAX_HEADER_LIST) return -1;
    }
    return 0;
}

// The next header of a fields buffer: 1 and its name and value, or 0 at the end.
static int next_field(const buffer_t *fields, size_t *at, const char **name, uint32_t *name_len, const char **value,
                      uint32_t *value_len) {
    if (*at >= fields->len) return 0;
    memcpy(name_len, fields->bytes + *at, 4);
    *name = fields->bytes + *at + 4;
    memcpy(value_len, *name + *name_len, 4);
    *value = *name + *name_len + 4;
    *at += 8 + *name_len + *value_len;
    return 1;
}

// -- frames ----------------------------------------------------------------------------------------------------------

static void put_frame(connection_t *c, int kind, int flags, uint32_t stream, const char *payload, size_t len) {
    unsigned char head[9] = {len >> 16, len >> 8, len, kind, flags, stream >> 24 & 0x7f, stream >> 16, stream >> 8,
                             stream};
    append(c, (const char *)head, 9);
    if (len) append(c, payload, len);
}

static void put_code(connection_t *c, int kind, uint32_t stream, uint32_t code) {
    char payload[4] = {code >> 24, code >> 16, code >> 8, code};
    put_frame(c, kind, 0, stream, payload, 4);
}

static stream_t *find(h2_t *h, uint32_t id) {
    for (stream_t *s = h->streams; s; s = s->next)
        if (s->id == id) return s;
    return NULL;
}

static void free_stream(stream_t *s) {
    free_buffer(&s->fields);
    free_buffer(&s->body);
    free(s->outgoing);
    free(s->trailers);
    free(s);
}

// The stream's call is over (answered, refused or reset by the client).
static void forget(h2_t *h, stream_t *s) {
    for (stream_t **p = &h->streams; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            h->stream_count--;
            break;
        }
    free_stream(s);
}

void h2_detach(stream_t *s) { s->request = NULL; }

// A breach of HTTP/2 by the client: GOAWAY naming it, then the connection closes.
static void fail(Front *f, connection_t *c, uint32_t code, const char *message) {
    h2_t *h = c->h2;
    size_t len = strlen(message);
    char *payload = grown(NULL, 8 + len);
    uint32_t last = h->last_stream;
    unsigned char ids[8] = {last >> 24, last >> 16, last >> 8, last, code >> 24, code >> 16, code >> 8, code};
    memcpy(payload, ids, 8);
    memcpy(payload + 8, message, len);
    put_frame(c, GOAWAY, 0, 0, payload, 8 + len);
    free(payload);
    flush(f, c);
    close_connection(f, c);
}

// The answer's DATA as the windows allow, then its trailers (the call is over).
static void send_data(connection_t *c, stream_t *s) {
    h2_t *h = c->h2;
    while (s->outgoing_sent < s->outgoing_len) {
        int64_t size = s->outgoing_len - s->outgoing_sent;
        if (size > h->send_window) size = h->send_window;
        if (size > s->send_window) size = s->send_window;
        if (size > h->max_send_frame) size = h->max_send_frame;
        if (size <= 0) {
            s->blocked = 1;
            return;
        }
        put_frame(c, DATA, 0, s->id, s->outgoing + s->outgoing_sent, size);
        s->outgoing_sent += size;
        h->send_window -= size;
        s->send_window -= size;
    }
    s->blocked = 0;
    put_frame(c, HEADERS, END_HEADERS | END_STREAM, s->id, s->trailers, s->trailers_len);
    forget(h, s);
}

static void send_blocked(connection_t *c) {
    for (stream_t *s = c->h2->streams, *next; s; s = next) {
        next = s->next;
        if (s->blocked) send_data(c, s);
    }
}

// Answer the stream: its headers (none: trailers-only), its DATA (a length-prefixed message, or none), its trailers.
static void send_answer(connection_t *c, stream_t *s, const char *headers, size_t headers_len, const char *data,
                        size_t data_len, const char *trailers, size_t trailers_len) {
    h2_t *h = c->h2;
    if (headers) put_frame(c, HEADERS, END_HEADERS, s->id, headers, headers_len);
    if (data_len && (int64_t)data_len <= h->send_window && (int64_t)data_len <= s->send_window
        && data_len <= h->max_send_frame) {
        put_frame(c, DATA, 0, s->id, data, data_len);
        h->send_window -= data_len;
        s->send_window -= data_len;
        data_len = 0;
    }
    if (!data_len) {
        put_frame(c, HEADERS, END_HEADERS | END_STREAM, s->id, trailers, trailers_len);
        forget(h, s);
        return;
    }
    s->outgoing = copied(data, data_len);
    s->outgoing_len = data_len;
    s->trailers = copied(trailers, trailers_len);
    s->trailers_len = trailers_len;
    send_data(c, s);
}

static int status_code(int http_status) {
    switch (http_status) {  // grpc_protocol.STATUS_CODES
        case 400: return INVALID_ARGUMENT;
        case 401: return UNAUTHENTICATED;
        case 403: return PERMISSION_DENIED;
        case 404: return NOT_FOUND;
        case 405: case 415: return UNIMPLEMENTED;
        case 413: case 429: return RESOURCE_EXHAUSTED;
        case 503: return UNAVAILABLE;
        case 504: return DEADLINE_EXCEEDED;
        default: return http_status >= 500 ? INTERNAL : INVALID_ARGUMENT;
    }
}

// A trailers-only answer: the call failed with `code` and `message` (percent-encoded as grpc-message is).
static void send_status(connection_t *c, stream_t *s, int code, const char *message, size_t len) {
    buffer_t block = {0};
    put(&block, response_headers, response_headers_len);
    char digits[12];
    put_field(&block, "grpc-status", 11, digits, snprintf(digits, sizeof digits, "%d", code));
    char *encoded = grown(NULL, len * 3 + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = message[i];
        if (ch >= 0x20 && ch <= 0x7e && ch != '%') encoded[n++] = ch;
        else n += sprintf(encoded + n, "%%%02X", ch);
    }
    put_field(&block, "grpc-message", 12, encoded, n);
    free(encoded);
    send_answer(c, s, NULL, 0, NULL, 0, block.bytes, block.len);
    free_buffer(&block);
}

// -- the fast path: "mine, exactly" or "not mine" ------------------------------------------------------------------

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

static void put_varint(buffer_t *b, uint64_t value) {
    char bytes[10];
    size_t n = 0;
    do {
        bytes[n++] = (value & 0x7f) | (value >= 0x80 ? 0x80 : 0);
        value >>= 7;
    } while (value);
    put(b, bytes, n);
}

static void put_delimited(buffer_t *b, uint32_t number, const char *bytes, size_t len) {
    put_varint(b, number << 3 | 2);
    put_varint(b, len);
    put(b, bytes, len);
}

static int equals(pb_t field, const char *text, size_t len) {
    return (size_t)(field.end - field.p) == len && memcmp(field.p, text, len) == 0;
}

static int printable(pb_t field) {
    for (const unsigned char *p = field.p; p < field.end; p++)
        if (*p < 0x20 || *p > 0x7e) return 0;
    return 1;
}

// An InferInputTensor: the model's input, FP32, shape [rows, <the example's shape>] (packed), nothing else.
static int input_tensor(Front *f, pb_t s, long *rows) {
    int seen_name = 0, seen_datatype = 0, seen_shape = 0;
    uint32_t number;
    pb_t field;
    while (s.p < s.end) {
        if (!delimited(&s, &number, &field)) return 0;
        if (number == 1 && !seen_name) {
            if (!equals(field, f->input_name, f->input_name_len)) return 0;
            seen_name = 1;
        } else if (number == 2 && !seen_datatype) {
            if (!equals(field, "FP32", 4)) return 0;
            seen_datatype = 1;
        } else if (number == 3 && !seen_shape) {
            uint64_t dim;
            if (!varint(&field, &dim) || dim < 1 || dim > 100000000) return 0;
            *rows = dim;
            for (int i = 0; i < f->dims; i++)
                if (!varint(&field, &dim) || dim != (uint64_t)f->shape[i]) return 0;
            if (field.p != field.end) return 0;
            seen_shape = 1;
        } else {
            return 0;
        }
    }
    return seen_name && seen_datatype && seen_shape;
}

// An InferRequestedOutputTensor naming the model's output, without parameters.
static int requested_output(Front *f, pb_t s) {
    uint32_t number;
    pb_t field;
    if (!delimited(&s, &number, &field) || number != 1 || !equals(field, f->output_name, f->output_name_len))
        return 0;
    return s.p == s.end;
}

// A ModelInferRequest of the one shape the front serves (else NULL): the served model (and version, if named), an
// optional printable id, the one input with its raw contents, outputs naming the model's.
static request_t *infer_request(Front *f, const unsigned char *message, size_t len) {
    pb_t s = {message, message + len}, field, id = {NULL, NULL}, raw = {NULL, NULL};
    int seen_model = 0, seen_version = 0, seen_input = 0;
    long rows = 0;
    uint32_t number;
    while (s.p < s.end) {
        if (!delimited(&s, &number, &field)) return NULL;
        if (number == 1 && !seen_model) {
            if (!equals(field, f->model_name, f->model_name_len)) return NULL;
            seen_model = 1;
        } else if (number == 2 && !seen_version) {
            if (field.p != field.end && !equals(field, f->version, f->version_len)) return NULL;
            seen_version = 1;
        } else if (number == 3 && !id.p) {
            if (!printable(field)) return NULL;
            id = field;
        } else if (number == 5 && !seen_input) {
            if (!input_tensor(f, field, &rows)) return NULL;
            seen_input = 1;
        } else if (number == 6) {
            if (!requested_output(f, field)) return NULL;
        } else if (number == 7 && !raw.p) {
            raw = field;
        } else {
            return NULL;  // parameters, typed contents, a repeated field, an unknown one: not ours
        }
    }
    if (!seen_model || !seen_input || !raw.p) return NULL;
    pthread_mutex_lock(&f->lock);
    long max_rows = f->max_rows;
    pthread_mutex_unlock(&f->lock);
    size_t count = (size_t)rows * f->features;
    if (rows > max_rows || (size_t)(raw.end - raw.p) != count * sizeof(float)) return NULL;
    request_t *r = grown(NULL, sizeof *r + count * sizeof(float));
    memset(r, 0, sizeof *r);
    r->rows = rows;
    memcpy(r->x, raw.p, count * sizeof(float));
    if (id.p && id.end > id.p) {
        r->id_len = id.end - id.p;
        r->id = copied((const char *)id.p, r->id_len);
    }
    return r;
}

// grpc-timeout's nanoseconds (up to 8 digits and a unit); -1 if it is not one (the Python server explains).
static int64_t timeout_ns(const char *value, uint32_t len) {
    if (len < 2 || len > 9) return -1;
    int64_t n = 0;
    for (uint32_t i = 0; i + 1 < len; i++) {
        if (!isdigit((unsigned char)value[i])) return -1;
        n = n * 10 + (value[i] - '0');
    }
    double unit;
    switch (value[len - 1]) {
        case 'H': unit = 3600e9; break;
        case 'M': unit = 60e9; break;
        case 'S': unit = 1e9; break;
        case 'm': unit = 1e6; break;
        case 'u': unit = 1e3; break;
        case 'n': unit = 1; break;
        default: return -1;
    }
    return n * unit > 9e18 ? INT64_MAX : (int64_t)(n * unit);  // past any pool's timeout
}

// The call as a request the front serves, with its deadline's limit (-1: none); NULL if it is not one.
static request_t *recognize_call(Front *f, stream_t *s, int64_t *limit) {
    const char *name, *value;
    uint32_t name_len, value_len;
    int path = 0, grpc = 0, authorized = 0;
    *limit = -1;
    for (size_t at = 0; next_field(&s->fields, &at, &name, &name_len, &value, &value_len);) {
#define NAMED(text) (name_len == sizeof text - 1 && memcmp(name, text, name_len) == 0)
        if (NAMED(":path")) {
            if (path++ || value_len != sizeof INFER_PATH - 1 || memcmp(value, INFER_PATH, value_len) != 0)
                return NULL;
        } else if (NAMED("content-type")) {
            if (grpc++ || value_len < 16 || memcmp(value, "application/grpc", 16) != 0) return NULL;
        } else if (NAMED("grpc-encoding")) {
            if (value_len != 8 || memcmp(value, "identity", 8) != 0) return NULL;
        } else if (NAMED("grpc-timeout")) {
            if (*limit >= 0 || (*limit = timeout_ns(value, value_len)) < 0) return NULL;
        } else if (NAMED("authorization")) {
            if (authorized++ || !token_matches(f, value, value_len)) return NULL;
        }
#undef NAMED
    }
    pthread_mutex_lock(&f->lock);
    int needs_token = f->token != NULL;
    pthread_mutex_unlock(&f->lock);
    const unsigned char *body = (const unsigned char *)s->body.bytes;
    size_t len = s->body.len;
    if (!path || !grpc || (needs_token && !authorized) || len < 5 || body[0] != 0
        || ((size_t)body[1] << 24 | (size_t)body[2] << 16 | (size_t)body[3] << 8 | body[4]) != len - 5)
        return NULL;
    return infer_request(f, body + 5, len - 5);
}

// A call for the Python server with its headers and body (taken from the stream), or, without them, word that the
// call is cancelled (its client reset it, or left).
static void pass_call(Front *f, connection_t *c, stream_t *s, buffer_t *fields, buffer_t *body) {
    struct call *call = grown(NULL, sizeof *call);
    memset(call, 0, sizeof *call);
    call->serial = c->h2->serial;
    call->stream = s->id;
    call->cancelled = !fields;
    if (fields) {
        call->fields = fields->bytes;
        call->fields_len = fields->len;
        call->body = body->bytes;
        call->body_len = body->len;
        *fields = (buffer_t){0};
        *body = (buffer_t){0};
    }
    pthread_mutex_lock(&f->lock);
    call->next = f->calls_head;
    f->calls_head = call;
    pthread_mutex_unlock(&f->lock);
    signal_fd(f->handed_fd);
}

// The request is complete: queue it, or hand it to the Python server.
static void dispatch(Front *f, connection_t *c, stream_t *s) {
    s->called = 1;
    int64_t limit;
    request_t *r = recognize_call(f, s, &limit);
    if (r) {
        free_buffer(&s->body);
        char why[200];
        int why_len;
        r->connection = c;
        r->stream = s;
        s->request = r;
        int refused = enqueue(f, r, limit, why, sizeof why, &why_len);
        if (refused) {
            s->request = NULL;
            free_request(r);
            send_status(c, s, status_code(refused), why, why_len);
        }
        return;
    }
    s->bridged = 1;
    pass_call(f, c, s, &s->fields, &s->body);
}

void free_call(struct call *call) {
    free(call->fields);
    free(call->body);
    free(call);
}

void free_call_answer(struct call_answer *answer) {
    free(answer->headers);
    free(answer->data);
    free(answer->trailers);
    free(answer);
}

// -- reading -------------------------------------------------------------------------------------------------------

static const unsigned char *unpad(const unsigned char *payload, size_t *len, int flags) {
    if (!(flags & PADDED)) return payload;
    if (*len == 0 || payload[0] >= *len) return NULL;
    *len = *len - 1 - payload[0];
    return payload + 1;
}

static void on_header_block(Front *f, connection_t *c, uint32_t id, int flags, const unsigned char *block,
                            size_t len) {
    h2_t *h = c->h2;
    if (decode_block(h, block, len) < 0) {
        fail(f, c, COMPRESSION_ERROR, "a header block HPACK cannot decode");
        return;
    }
    stream_t *s = find(h, id);
    if (!s) return;  // a stream gone already: its block was decoded only to keep HPACK's table in step
    if (s->headers_done) {  // the client's trailers
        if (flags & END_STREAM && !s->called) dispatch(f, c, s);
        return;
    }
    put(&s->fields, h->decoded.bytes, h->decoded.len);
    s->headers_done = 1;
    if (flags & END_STREAM) dispatch(f, c, s);
}

static void on_headers(Front *f, connection_t *c, uint32_t id, int flags, const unsigned char *payload, size_t len) {
    h2_t *h = c->h2;
    payload = unpad(payload, &len, flags);
    if (!payload) {
        fail(f, c, PROTOCOL_ERROR, "padding as long as the frame");
        return;
    }
    if (flags & PRIORITY_FLAG) {
        size_t skip = len < 5 ? len : 5;
        payload += skip;
        len -= skip;
    }
    if (!find(h, id)) {
        if (id % 2 == 0) {
            char why[80];
            snprintf(why, sizeof why, "HEADERS on stream %u, not a client's stream", id);
            fail(f, c, PROTOCOL_ERROR, why);
            return;
        }
        if (id > h->last_stream) {
            h->last_stream = id;
            if (h->stream_count >= MAX_STREAMS) {  // past the limit the settings gave: refused (its block still read)
                put_code(c, RST_STREAM, id, REFUSED_STREAM);
            } else {
                stream_t *s = grown(NULL, sizeof *s);
                memset(s, 0, sizeof *s);
                s->id = id;
                s->send_window = h->initial_send_window;
                s->next = h->streams;
                h->streams = s;
                h->stream_count++;
            }
        }
    }
    if (len > MAX_HEADER_BLOCK) {
        fail(f, c, ENHANCE_YOUR_CALM, "a header block of over 65536 bytes");
        return;
    }
    if (flags & END_HEADERS) {
        on_header_block(f, c, id, flags, payload, len);
    } else {
        h->continuing = id;
        h->continuing_flags = flags;
        h->block.len = 0;
        put(&h->block, payload, len);
    }
}

static void on_data(Front *f, connection_t *c, uint32_t id, int flags, const unsigned char *payload, size_t len) {
    h2_t *h = c->h2;
    h->unacknowledged += len;
    stream_t *s = find(h, id);
    if (!s || s->called || !s->headers_done) return;  // refused, reset or answered already: dropped
    payload = unpad(payload, &len, flags);
    if (!payload) {
        fail(f, c, PROTOCOL_ERROR, "padding as long as the frame");
        return;
    }
    put(&s->body, payload, len);
    pthread_mutex_lock(&f->lock);
    long max_message = f->max_message;
    pthread_mutex_unlock(&f->lock);
    if (s->body.len > (size_t)max_message + 5) {
        s->called = 1;
        char why[120];
        int why_len = snprintf(why, sizeof why, "the request message is larger than the server's limit of %ld bytes",
                               max_message);
        uint32_t stream = s->id;
        send_status(c, s, RESOURCE_EXHAUSTED, why, why_len);
        put_code(c, RST_STREAM, stream, NO_ERROR);  // send no more of it
    } else if (flags & END_STREAM) {
        dispatch(f, c, s);
    }
}

static void on_settings(Front *f, connection_t *c, int flags, const unsigned char *payload, size_t len) {
    h2_t *h = c->h2;
    if (flags & ACK) return;
    if (len % 6) {
        fail(f, c, FRAME_SIZE_ERROR, "a SETTINGS frame of a length not a multiple of 6");
        return;
    }
    int64_t window = -1, frame_size = -1;
    for (size_t i = 0; i < len; i += 6) {
        uint32_t id = payload[i] << 8 | payload[i + 1];
        uint32_t value = (uint32_t)payload[i + 2] << 24 | payload[i + 3] << 16 | payload[i + 4] << 8 | payload[i + 5];
        if (id == SETTINGS_INITIAL_WINDOW_SIZE) window = value;
        else if (id == SETTINGS_MAX_FRAME_SIZE) frame_size = value;
    }
    if (window > MAX_WINDOW) {
        fail(f, c, FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1");
        return;
    }
    if (frame_size >= 0 && (frame_size < MAX_FRAME || frame_size >= 1 << 24)) {
        fail(f, c, PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE outside 2^14..2^24-1");
        return;
    }
    put_frame(c, SETTINGS, ACK, 0, NULL, 0);
    if (frame_size >= 0) h->max_send_frame = frame_size;
    if (window >= 0) {
        int64_t change = window - h->initial_send_window;
        h->initial_send_window = window;
        for (stream_t *s = h->streams; s; s = s->next) s->send_window += change;
        if (change > 0) send_blocked(c);
    }
}

static void on_window_update(Front *f, connection_t *c, uint32_t id, const unsigned char *payload, size_t len) {
    h2_t *h = c->h2;
    if (len != 4) {
        fail(f, c, FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame of other than 4 bytes");
        return;
    }
    int64_t increment = ((uint32_t)payload[0] << 24 | payload[1] << 16 | payload[2] << 8 | payload[3]) & 0x7fffffff;
    if (id == 0) {
        h->send_window += increment;
        if (h->send_window > MAX_WINDOW) {
            fail(f, c, FLOW_CONTROL_ERROR, "the connection's window grown above 2^31-1");
            return;
        }
        send_blocked(c);
        return;
    }
    stream_t *s = find(h, id);
    if (s) {
        s->send_window += increment;
        if (s->blocked) send_data(c, s);
    }
}

static void on_reset(Front *f, connection_t *c, uint32_t id) {
    stream_t *s = find(c->h2, id);
    if (!s) return;
    if (s->request) abandon(f, s->request);  // withdrawn from the queue (or its answer dropped)
    if (s->bridged) pass_call(f, c, s, NULL, NULL);
    forget(c->h2, s);
}

// The frames read so far; 0, or -1 once the connection is closed.
static int read_frames(Front *f, connection_t *c) {
    h2_t *h = c->h2;
    const unsigned char *in = (const unsigned char *)c->in;
    size_t offset = 0, size = c->in_len;
    if (!h->started) {
        size_t n = size < PREFACE_LEN ? size : PREFACE_LEN;
        if (memcmp(in, PREFACE, n) != 0) {
            fail(f, c, PROTOCOL_ERROR, "not HTTP/2's client preface: a gRPC server speaks HTTP/2 (h2c, prior knowledge)");
            return -1;
        }
        if (size < PREFACE_LEN) return 0;
        offset = PREFACE_LEN;
        h->started = 1;
    }
    while (size - offset >= 9 && !c->closed) {
        size_t len = (size_t)in[offset] << 16 | in[offset + 1] << 8 | in[offset + 2];
        if (len > MAX_FRAME) {
            char why[64];
            snprintf(why, sizeof why, "a frame of %zu bytes, above %d", len, MAX_FRAME);
            fail(f, c, FRAME_SIZE_ERROR, why);
            return -1;
        }
        if (offset + 9 + len > size) break;
        int kind = in[offset + 3], flags = in[offset + 4];
        uint32_t id = ((uint32_t)in[offset + 5] << 24 | in[offset + 6] << 16 | in[offset + 7] << 8 | in[offset + 8])
                      & 0x7fffffff;
        const unsigned char *payload = in + offset + 9;
        offset += 9 + len;
        if (h->continuing && kind != CONTINUATION) {
            fail(f, c, PROTOCOL_ERROR, "a header block interrupted before END_HEADERS");
            return -1;
        }
        switch (kind) {
            case DATA: on_data(f, c, id, flags, payload, len); break;
            case HEADERS: on_headers(f, c, id, flags, payload, len); break;
            case CONTINUATION:
                if (!h->continuing || h->continuing != id) {
                    fail(f, c, PROTOCOL_ERROR, "CONTINUATION with no header block open on its stream");
                    return -1;
                }
                put(&h->block, payload, len);
                if (h->block.len > MAX_HEADER_BLOCK) {
                    fail(f, c, ENHANCE_YOUR_CALM, "a header block of over 65536 bytes");
                    return -1;
                }
                if (flags & END_HEADERS) {
                    h->continuing = 0;
                    on_header_block(f, c, id, h->continuing_flags, (const unsigned char *)h->block.bytes,
                                    h->block.len);
                }
                break;
            case SETTINGS: on_settings(f, c, flags, payload, len); break;
            case WINDOW_UPDATE: on_window_update(f, c, id, payload, len); break;
            case RST_STREAM: on_reset(f, c, id); break;
            case PING:
                if (len != 8) {
                    fail(f, c, FRAME_SIZE_ERROR, "a PING frame of other than 8 bytes");
                    return -1;
                }
                if (!(flags & ACK)) put_frame(c, PING, ACK, 0, (const char *)payload, 8);
                break;
            case PUSH_PROMISE:
                fail(f, c, PROTOCOL_ERROR, "PUSH_PROMISE from a client");
                return -1;
            default: break;  // PRIORITY, GOAWAY (the client closes its side itself) and unknown kinds
        }
    }
    if (c->closed) return -1;
    memmove(c->in, c->in + offset, size - offset);
    c->in_len = size - offset;
    if (h->unacknowledged > CONNECTION_WINDOW / 2) {
        put_code(c, WINDOW_UPDATE, 0, h->unacknowledged);
        h->unacknowledged = 0;
    }
    return 0;
}

// -- the connection ------------------------------------------------------------------------------------------------

void h2_start(Front *f, connection_t *c) {
    h2_t *h = grown(NULL, sizeof *h);
    memset(h, 0, sizeof *h);
    h->serial = ++f->next_serial;
    h->send_window = h->initial_send_window = DEFAULT_WINDOW;
    h->max_send_frame = MAX_FRAME;
    h->table_max = HEADER_TABLE;
    c->h2 = h;
    unsigned char settings[12] = {0, SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW >> 24, 0, 0, 0,
                                  0, SETTINGS_MAX_CONCURRENT_STREAMS, 0, 0, MAX_STREAMS >> 8, MAX_STREAMS & 0xff};
    put_frame(c, SETTINGS, 0, 0, (const char *)settings, 12);
    put_code(c, WINDOW_UPDATE, 0, CONNECTION_WINDOW - DEFAULT_WINDOW);
    h2_writable(f, c);
}

void h2_readable(Front *f, connection_t *c) {
    if (c->in_cap - c->in_len < 16384) {
        c->in_cap = c->in_cap * 2 + 65536;
        c->in = grown(c->in, c->in_cap);
    }
    ssize_t k = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) {
        close_connection(f, c);
        return;
    }
    if (k < 0) return;
    c->in_len += k;
    c->last_activity = now_ns();
    if (read_frames(f, c) == 0) h2_writable(f, c);
}

// Write what is buffered; closed once written if it is closing.
void h2_writable(Front *f, connection_t *c) {
    if (flush(f, c) < 0 || (c->closing && !c->out_len)) close_connection(f, c);
}

void h2_answer(Front *f, request_t *r, batch_t *b, long offset) {
    connection_t *c = r->connection;
    stream_t *s = r->stream;
    s->request = NULL;
    r->connection = NULL;
    r->stream = NULL;
    if (b->status != 200) {
        send_status(c, s, status_code(b->status), b->message, b->message_len);
        return;
    }
    // ModelInferResponse: model_name (1), model_version (2), id (3), outputs (5): {name (1), datatype (2), shape (3,
    // packed)}, raw_output_contents (6); in field order, as protobuf writes it.
    size_t raw_len = (size_t)r->rows * b->out_features * sizeof(float);
    buffer_t dims = {0};
    put_varint(&dims, r->rows);
    for (int i = 0; i < b->out_dims; i++) put_varint(&dims, b->out_shape[i]);
    const char *shape = dims.bytes;
    size_t shape_len = dims.len;
    buffer_t tensor = {0}, m = {0};
    put_delimited(&tensor, 1, f->output_name, f->output_name_len);
    put_delimited(&tensor, 2, "FP32", 4);
    put_delimited(&tensor, 3, shape, shape_len);
    put(&m, "\0\0\0\0\0", 5);
    put_delimited(&m, 1, f->model_name, f->model_name_len);
    if (f->version_len) put_delimited(&m, 2, f->version, f->version_len);
    if (r->id_len) put_delimited(&m, 3, r->id, r->id_len);
    put_delimited(&m, 5, tensor.bytes, tensor.len);
    put_delimited(&m, 6, (const char *)(b->y + offset * b->out_features), raw_len);
    free_buffer(&tensor);
    free_buffer(&dims);
    uint32_t message_len = m.len - 5;
    unsigned char length[4] = {message_len >> 24, message_len >> 16, message_len >> 8, message_len};
    memcpy(m.bytes + 1, length, 4);
    send_answer(c, s, response_headers, response_headers_len, m.bytes, m.len, ok_trailers, ok_trailers_len);
    free_buffer(&m);
}

void h2_answer_error(Front *f, request_t *r, int status, const char *message, size_t len) {
    connection_t *c = r->connection;
    stream_t *s = r->stream;
    s->request = NULL;
    r->connection = NULL;
    r->stream = NULL;
    send_status(c, s, status_code(status), message, len);  // written by the caller (a write may close c)
}

void h2_sweep(Front *f, connection_t *c, int64_t now) {
    int expired = 0;
    for (stream_t *s = c->h2->streams, *next; s; s = next) {
        next = s->next;
        if (s->request && now > s->request->deadline) {
            expire(f, s->request, now);
            expired = 1;
        }
    }
    if (expired) h2_writable(f, c);
}

// The server stops: calls not answered are answered UNAVAILABLE, GOAWAY, closed once written.
void h2_stop(Front *f, connection_t *c, const char *message, size_t len) {
    h2_t *h = c->h2;
    c->closing = 1;
    for (stream_t *s = h->streams, *next; s; s = next) {
        next = s->next;
        if (s->request) {
            pthread_mutex_lock(&f->lock);
            f->pending--;
            f->failed++;
            pthread_mutex_unlock(&f->lock);
            h2_answer_error(f, s->request, 503, message, len);
        } else if (s->bridged) {
            send_status(c, s, UNAVAILABLE, message, len);
        }
    }
    uint32_t last = h->last_stream;
    unsigned char payload[8] = {last >> 24, last >> 16, last >> 8, last, 0, 0, 0, NO_ERROR};
    put_frame(c, GOAWAY, 0, 0, (const char *)payload, 8);
    h2_writable(f, c);
}

// The connection is closed: its requests leave (abandon), its state is freed.
void h2_release(Front *f, connection_t *c) {
    h2_t *h = c->h2;
    while (h->streams) {
        stream_t *s = h->streams;
        h->streams = s->next;
        if (s->request) abandon(f, s->request);
        if (s->bridged) pass_call(f, c, s, NULL, NULL);
        free_stream(s);
    }
    for (size_t i = 0; i < h->table_count; i++) {
        free(h->table[i].name);
        free(h->table[i].value);
    }
    free(h->table);
    free_buffer(&h->block);
    free_buffer(&h->decoded);
    free(h);
    c->h2 = NULL;
}

// The Python server's answers to calls (answer_call), written to the calls' streams if still open.
void h2_write_call_answers(Front *f) {
    struct call_answer *answer;
    TAKE_IN_ORDER(f, call_answers_head, struct call_answer, answer);
    while (answer) {
        connection_t *c = f->connections;
        while (c && !(c->h2 && c->h2->serial == answer->serial)) c = c->next;
        stream_t *s = c ? find(c->h2, answer->stream) : NULL;
        if (s && s->bridged) {
            send_answer(c, s, answer->headers, answer->headers_len, answer->data, answer->data_len, answer->trailers,
                        answer->trailers_len);
            h2_writable(f, c);
        }
        struct call_answer *next = answer->next;
        free_call_answer(answer);
        answer = next;
    }
}
