// tandem.worker.serve._front, gRPC: the gRPC port's connections, on libnghttp2's server session.
//
// HTTP/2 itself (framing, HPACK, flow control both ways, SETTINGS, RFC 9113's protocol errors, and the flood
// mitigations: rapid reset, CONTINUATION, unread PING/SETTINGS acknowledgements) is libnghttp2's; the bytes read go
// to nghttp2_session_mem_recv and what it has to send goes through nghttp2_session_mem_send into the connection's
// output buffer, flushed once per round of events (or once per batch of answers). What is Tandem's: the limits
// (worker/serve/limits.py, given by Python: windows, streams, header list, message size, buffered bytes per
// connection and per process, unread answers, timeouts), the gRPC answers, and the one call it serves itself:
// ModelInfer for the served model with one FP32 input of the model's example shape in raw_input_contents (as
// tritonclient.grpc sends it), decoded by _front_infer.c, queued with the HTTP port's requests and answered here.
// Every other call (another method, typed contents, compression, parameters, a token that is not the one the front
// holds, a malformed request, any call before a model is served) goes whole to the Python server (calls(): its
// headers and body), which answers it through answer_call; the connection stays here.
//
// Buffered request bytes (DATA received and not yet answered) count against the connection's and the process's
// budgets; received DATA is acknowledged (nghttp2_session_consume, which reopens the client's windows) only while
// both are under budget, so flow control stops a client beyond them. A message over max_message is answered
// RESOURCE_EXHAUSTED at once and its stream reset.
#include "_front.h"
#include "_front_infer.h"

#include <nghttp2/nghttp2.h>

#define INFER_PATH "/inference.GRPCInferenceService/ModelInfer"

enum { OK = 0, INVALID_ARGUMENT = 3, DEADLINE_EXCEEDED = 4, NOT_FOUND = 5, PERMISSION_DENIED = 7,
       RESOURCE_EXHAUSTED = 8, UNIMPLEMENTED = 12, INTERNAL = 13, UNAVAILABLE = 14, UNAUTHENTICATED = 16 };

typedef struct {
    char *bytes;
    size_t len, cap;
} buffer_t;

struct stream {
    stream_t *prev, *next;     // the connection's open streams
    request_t *request;        // its inference request while queued or in a batch
    int32_t id;
    int headers_done;          // the request's headers are in
    int called;                // queued, handed to Python or answered: later DATA is dropped
    int bridged;               // handed to Python, not answered yet
    int cut;                   // answered before its request ended: reset (NO_ERROR) once the answer is sent
    int64_t opened, headers_at;
    size_t head_size;          // the header list's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it
    size_t held;               // DATA received on it, counted in the budgets until it closes
    size_t owed;               // DATA received on it and not acknowledged yet (over budget)
    long max_message;
    buffer_t fields;           // its headers: (u32 length, name, u32 length, value) each
    buffer_t body;
    char *outgoing;            // the answer's DATA (the data provider's source), then its trailers
    size_t outgoing_len, outgoing_sent;
    int code;
    char *message;
    size_t message_len;
};

struct h2 {
    Front *f;
    connection_t *c;
    nghttp2_session *session;
    uint64_t serial;           // names the connection in calls()
    int started;               // the client's preface and first SETTINGS are in
    int failed;                // ended (a flood, a fatal error, a timeout): closed once what is buffered is tried
    stream_t *streams;
    int stream_count;
    int64_t opened, idle_since, last_written;
    stream_t *receiving;       // the stream whose header block is coming in (blocks are never interleaved)
    size_t held;               // DATA buffered over all its streams
    size_t loose;              // DATA not acknowledged whose stream is gone (the connection's window only)
    int owing;                 // some DATA is not acknowledged (over a budget)
    size_t unsent, connection_budget, max_head;
};

static nghttp2_session_callbacks *callbacks;

// Room for `n` more bytes (a call's headers and a small message fit the first allocation).
static void reserve(buffer_t *b, size_t n) {
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 512;
        b->bytes = grown(b->bytes, b->cap);
    }
}

static void put(buffer_t *b, const void *bytes, size_t n) {
    reserve(b, n);
    memcpy(b->bytes + b->len, bytes, n);
    b->len += n;
}

static void free_buffer(buffer_t *b) {
    free(b->bytes);
    b->bytes = NULL;
    b->len = b->cap = 0;
}

void free_call(struct call *call) {
    free(call->fields);
    free(call->body);
    free(call);
}

void free_call_answer(struct call_answer *answer) {
    free(answer->message);
    free(answer->data);
    free(answer);
}

void h2_detach(stream_t *s) { s->request = NULL; }

// The gRPC status code of an HTTP status, as Python's grpc_protocol.status_code gives it (the front is given them).
static int status_code(Front *f, int http_status) {
    return http_status >= 400 && http_status < 600 ? f->grpc_codes[http_status - 400] : INTERNAL;
}

// -- budgets of buffered request bytes -----------------------------------------------------------------------------

static int under_budget(h2_t *h) {
    return h->held <= h->connection_budget
        && __atomic_load_n(&h->f->held, __ATOMIC_RELAXED)
               <= (size_t)__atomic_load_n(&h->f->process_buffer, __ATOMIC_RELAXED);
}

static void hold(h2_t *h, long bytes) {
    h->held += bytes;
    __atomic_add_fetch(&h->f->held, bytes, __ATOMIC_RELAXED);
}

// Acknowledge the DATA owed, if the budgets allow now.
static void pay(h2_t *h) {
    if (!h->owing || !under_budget(h)) return;
    for (stream_t *s = h->streams; s; s = s->next)
        if (s->owed) {
            nghttp2_session_consume(h->session, s->id, s->owed);
            s->owed = 0;
        }
    if (h->loose) nghttp2_session_consume_connection(h->session, h->loose);
    h->loose = 0;
    h->owing = 0;
}

// -- answers ---------------------------------------------------------------------------------------------------------

#define NV(name, value, len) {(uint8_t *)(name), (uint8_t *)(value), sizeof(name) - 1, (len), \
                              NGHTTP2_NV_FLAG_NO_COPY_NAME}
#define STATIC_NV(name, value) {(uint8_t *)(name), (uint8_t *)(value), sizeof(name) - 1, sizeof(value) - 1, \
                                NGHTTP2_NV_FLAG_NO_COPY_NAME | NGHTTP2_NV_FLAG_NO_COPY_VALUE}

// grpc-message's encoding: '%' and bytes outside printable ASCII as %XX (the message is UTF-8).
static size_t percent_encoded(const char *message, size_t len, char *into) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = message[i];
        if (ch >= 0x20 && ch <= 0x7e && ch != '%') into[n++] = ch;
        else n += sprintf(into + n, "%%%02X", ch);
    }
    return n;
}

// The status fields (grpc-status, and grpc-message unless an OK without one) appended to nva; their count.
static size_t status_fields(nghttp2_nv *nva, int code, const char *message, size_t len, char *digits, char **encoded) {
    size_t n = 0;
    int digits_len = code >= 10 ? 2 : 1;  // gRPC's codes are 0-16
    digits[0] = code >= 10 ? '0' + code / 10 : '0' + code;
    digits[1] = '0' + code % 10;
    nva[n++] = (nghttp2_nv)NV("grpc-status", digits, digits_len);
    *encoded = NULL;
    if (code != OK || len) {
        *encoded = grown(NULL, len * 3 + 1);
        nva[n++] = (nghttp2_nv)NV("grpc-message", *encoded, percent_encoded(message, len, *encoded));
    }
    return n;
}

static ssize_t read_answer(nghttp2_session *session, int32_t id, uint8_t *buf, size_t length, uint32_t *flags,
                           nghttp2_data_source *source, void *user_data) {
    stream_t *s = source->ptr;
    size_t n = s->outgoing_len - s->outgoing_sent;
    if (n > length) n = length;
    memcpy(buf, s->outgoing + s->outgoing_sent, n);
    s->outgoing_sent += n;
    if (s->outgoing_sent == s->outgoing_len) {
        *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
        nghttp2_nv nva[2];
        char digits[12], *encoded;
        size_t count = status_fields(nva, s->code, s->message, s->message_len, digits, &encoded);
        int failed = nghttp2_submit_trailer(session, id, nva, count);
        free(encoded);
        if (failed) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    }
    return n;
}

// Answer the stream: a length-prefixed message then the status (`data` NULL: a trailers-only answer, the status with
// the headers). `data` becomes the stream's (freed with it).
static void send_answer(h2_t *h, stream_t *s, int code, const char *message, size_t len, char *data, size_t data_len) {
    s->called = 1;
    s->bridged = 0;
    nghttp2_nv nva[5] = {STATIC_NV(":status", "200"), STATIC_NV("content-type", "application/grpc"),
                         STATIC_NV("grpc-accept-encoding", "identity,deflate,gzip")};
    if (data) {
        s->outgoing = data;
        s->outgoing_len = data_len;
        s->code = code;
        s->message = len ? copied(message, len) : NULL;
        s->message_len = len;
        nghttp2_data_provider provider = {.source.ptr = s, .read_callback = read_answer};
        nghttp2_submit_response(h->session, s->id, nva, 3, &provider);
        return;
    }
    char digits[12], *encoded;
    size_t count = 3 + status_fields(nva + 3, code, message, len, digits, &encoded);
    nghttp2_submit_response(h->session, s->id, nva, count, NULL);
    free(encoded);
}

static void send_status(h2_t *h, stream_t *s, int code, const char *message, size_t len) {
    send_answer(h, s, code, message, len, NULL, 0);
}

// -- calls -----------------------------------------------------------------------------------------------------------

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

// A call for the Python server with its headers and body (taken from the stream), or, without them, word that the
// call is cancelled (its client reset it, or left).
static void pass_call(Front *f, h2_t *h, stream_t *s, buffer_t *fields, buffer_t *body) {
    struct call *call = grown(NULL, sizeof *call);
    memset(call, 0, sizeof *call);
    call->serial = h->serial;
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

// The call as a request the front serves, or NULL (the model not served yet, or not a call of its shape).
static request_t *recognize_call(Front *f, stream_t *s, int path, int authorized) {
    if (!path || !__atomic_load_n(&f->serving, __ATOMIC_ACQUIRE)) return NULL;
    infer_model_t model = {.model_name = f->model_name, .model_name_len = f->model_name_len, .version = f->version,
                           .version_len = f->version_len, .input_name = f->input_name,
                           .input_name_len = f->input_name_len, .output_name = f->output_name,
                           .output_name_len = f->output_name_len, .dims = f->dims, .features = f->features};
    memcpy(model.shape, f->shape, sizeof model.shape);
    pthread_mutex_lock(&f->lock);
    int needs_token = f->token != NULL;
    model.max_rows = f->max_rows;
    pthread_mutex_unlock(&f->lock);
    const unsigned char *message;
    size_t len;
    infer_call_t call;
    if ((needs_token && !authorized)
        || !grpc_message((const unsigned char *)s->body.bytes, s->body.len, &message, &len)
        || !infer_request(&model, message, len, &call))
        return NULL;
    request_t *r = grown(NULL, sizeof *r + call.raw_len);
    memset(r, 0, sizeof *r);
    r->rows = call.rows;
    memcpy(r->x, call.raw, call.raw_len);
    if (call.id_len) {
        r->id_len = call.id_len;
        r->id = copied((const char *)call.id, call.id_len);
    }
    return r;
}

// The request is complete: answered here (not gRPC: HTTP 415; a deadline of 0: DEADLINE_EXCEEDED), queued, or handed
// to the Python server.
static void dispatch(Front *f, h2_t *h, stream_t *s) {
    s->called = 1;
    int path = 0, grpc = 0, authorized = 0, identity = 1, many = 0;
    int64_t limit = -1;
    for (size_t at = 0; at < s->fields.len;) {
        uint32_t name_len, value_len;
        memcpy(&name_len, s->fields.bytes + at, 4);
        const char *name = s->fields.bytes + at + 4;
        memcpy(&value_len, name + name_len, 4);
        const char *value = name + name_len + 4;
        at += 8 + name_len + value_len;
#define NAMED(text) (name_len == sizeof text - 1 && memcmp(name, text, name_len) == 0)
        if (NAMED(":path")) {
            path = value_len == sizeof INFER_PATH - 1 && memcmp(value, INFER_PATH, value_len) == 0;
        } else if (NAMED("content-type")) {
            many += grpc;
            grpc = value_len >= 16 && memcmp(value, "application/grpc", 16) == 0;
        } else if (NAMED("grpc-encoding")) {
            identity = value_len == 8 && memcmp(value, "identity", 8) == 0;
        } else if (NAMED("grpc-timeout")) {
            many += limit != -1;
            limit = timeout_ns(value, value_len);
            if (limit < 0) limit = -2;  // not one: the Python server explains
        } else if (NAMED("authorization")) {
            many += authorized != 0;
            authorized = token_matches(f, value, value_len) ? 1 : -1;
        }
#undef NAMED
    }
    if (!grpc) {
        nghttp2_nv status = STATIC_NV(":status", "415");
        nghttp2_submit_response(h->session, s->id, &status, 1, NULL);
        return;
    }
    if (limit == 0) {
        static const char why[] = "the call's deadline (grpc-timeout) of 0 passed before it was served";
        send_status(h, s, DEADLINE_EXCEEDED, why, sizeof why - 1);
        return;
    }
    request_t *r = many || !identity || limit == -2 ? NULL : recognize_call(f, s, path, authorized == 1);
    if (!r) {
        s->bridged = 1;
        pass_call(f, h, s, &s->fields, &s->body);
        return;
    }
    free_buffer(&s->body);
    char why[200];
    int why_len;
    r->connection = h->c;
    r->stream = s;
    s->request = r;
    int refused = enqueue(f, r, limit, why, sizeof why, &why_len);
    if (refused) {
        s->request = NULL;
        free_request(r);
        send_status(h, s, status_code(f, refused), why, why_len);
    }
}

// -- nghttp2's callbacks ---------------------------------------------------------------------------------------------

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user_data) {
    h2_t *h = user_data;
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    stream_t *s = grown(NULL, sizeof *s);
    memset(s, 0, sizeof *s);
    s->id = frame->hd.stream_id;
    s->opened = now_ns();
    s->next = h->streams;
    if (h->streams) h->streams->prev = s;
    h->streams = s;
    h->stream_count++;
    h->receiving = s;
    nghttp2_session_set_stream_user_data(session, s->id, s);
    return 0;
}

static int on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name, size_t name_len,
                     const uint8_t *value, size_t value_len, uint8_t flags, void *user_data) {
    h2_t *h = user_data;
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;  // trailers
    stream_t *s = h->receiving;
    if (!s || s->id != frame->hd.stream_id) return 0;
    s->head_size += name_len + value_len + 32;
    if (s->head_size > h->max_head) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;  // the stream is reset
    uint32_t n = name_len;
    reserve(&s->fields, 8 + name_len + value_len);
    put(&s->fields, &n, 4);
    put(&s->fields, name, name_len);
    n = value_len;
    put(&s->fields, &n, 4);
    put(&s->fields, value, value_len);
    return 0;
}

static int on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t id, const uint8_t *data, size_t len,
                         void *user_data) {
    h2_t *h = user_data;
    stream_t *s = nghttp2_session_get_stream_user_data(session, id);
    if (s && !s->called) {
        if (s->body.len + len > (size_t)s->max_message + 5) {
            char why[120];
            int why_len = snprintf(why, sizeof why, "the request message is larger than the server's limit of %ld "
                                   "bytes", s->max_message);
            free_buffer(&s->body);
            send_status(h, s, RESOURCE_EXHAUSTED, why, why_len);
            s->cut = 1;  // the client sends no more of it (on_frame_sent)
        } else {
            if (!s->body.len && len >= 5) {  // room for a small message at once (a large one grows as it comes)
                size_t announced = (size_t)data[1] << 24 | (size_t)data[2] << 16 | (size_t)data[3] << 8 | data[4];
                if (announced <= 65536) reserve(&s->body, 5 + announced);
            }
            put(&s->body, data, len);
            s->held += len;
            hold(h, len);
        }
    }
    if (!h->owing && under_budget(h)) {
        nghttp2_session_consume(session, id, len);
    } else {
        h->owing = 1;
        if (s) s->owed += len;
        else h->loose += len;
    }
    return 0;
}

static int on_frame(nghttp2_session *session, const nghttp2_frame *frame, void *user_data) {
    h2_t *h = user_data;
    if (frame->hd.type == NGHTTP2_SETTINGS) {
        h->started = 1;
        return 0;
    }
    if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA) return 0;
    stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (!s) return 0;
    if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST) {
        s->headers_done = 1;
        s->headers_at = now_ns();
        pthread_mutex_lock(&h->f->lock);
        s->max_message = h->f->max_message;
        pthread_mutex_unlock(&h->f->lock);
    }
    if (frame->hd.flags & NGHTTP2_FLAG_END_STREAM && s->headers_done && !s->called) dispatch(h->f, h, s);
    return 0;
}

// End the connection: GOAWAY with `code`, then it closes once what is buffered is tried.
static void end(h2_t *h, uint32_t code) {
    nghttp2_session_terminate_session(h->session, code);
    h->failed = 1;
}

// libnghttp2's rapid-reset mitigation (past Limits.reset_burst and resets_per_second) ends the connection with
// GOAWAY INTERNAL_ERROR, the only GOAWAY of that code it sends on its own: the client's flood is named as the other
// floods are, ENHANCE_YOUR_CALM.
static int before_frame_sent(nghttp2_session *session, const nghttp2_frame *frame, void *user_data) {
    h2_t *h = user_data;
    if (frame->hd.type != NGHTTP2_GOAWAY || frame->goaway.error_code != NGHTTP2_INTERNAL_ERROR || h->failed) return 0;
    end(h, NGHTTP2_ENHANCE_YOUR_CALM);
    return NGHTTP2_ERR_CANCEL;
}

static int on_frame_sent(nghttp2_session *session, const nghttp2_frame *frame, void *user_data) {
    if (frame->hd.type != NGHTTP2_HEADERS || !(frame->hd.flags & NGHTTP2_FLAG_END_STREAM)) return 0;
    stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s && s->cut) nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, s->id, NGHTTP2_NO_ERROR);
    return 0;
}

static void free_stream(stream_t *s) {
    free_buffer(&s->fields);
    free_buffer(&s->body);
    free(s->outgoing);
    free(s->message);
    free(s);
}

// The stream is over (answered, reset by either side, or its connection ends): its request leaves, its bytes leave
// the budgets.
static void forget(h2_t *h, stream_t *s) {
    if (s->request) abandon(h->f, s->request);  // withdrawn from the queue (or its answer dropped)
    if (s->bridged) pass_call(h->f, h, s, NULL, NULL);
    if (h->receiving == s) h->receiving = NULL;
    if (s->prev) s->prev->next = s->next;
    else h->streams = s->next;
    if (s->next) s->next->prev = s->prev;
    if (--h->stream_count == 0) h->idle_since = now_ns();
    if (s->held) hold(h, -(long)s->held);
    h->loose += s->owed;
    free_stream(s);
}

static int on_stream_close(nghttp2_session *session, int32_t id, uint32_t error_code, void *user_data) {
    h2_t *h = user_data;
    stream_t *s = nghttp2_session_get_stream_user_data(session, id);
    if (!s) return 0;
    nghttp2_session_set_stream_user_data(session, id, NULL);
    forget(h, s);
    pay(h);
    return 0;
}

int h2_init(void) {
    if (nghttp2_session_callbacks_new(&callbacks) != 0) return -1;
    nghttp2_session_callbacks_set_on_begin_headers_callback(callbacks, on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(callbacks, on_header);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks, on_data_chunk);
    nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks, on_frame);
    nghttp2_session_callbacks_set_on_stream_close_callback(callbacks, on_stream_close);
    nghttp2_session_callbacks_set_on_frame_send_callback(callbacks, on_frame_sent);
    nghttp2_session_callbacks_set_before_frame_send_callback(callbacks, before_frame_sent);
    return 0;
}

// -- the connection ------------------------------------------------------------------------------------------------

void h2_start(Front *f, connection_t *c) {
    h2_t *h = grown(NULL, sizeof *h);
    memset(h, 0, sizeof *h);
    h->f = f;
    h->c = c;
    h->serial = ++f->next_serial;
    h->opened = h->idle_since = h->last_written = now_ns();
    pthread_mutex_lock(&f->lock);
    h->unsent = f->unsent_bytes;
    h->connection_budget = f->connection_buffer;
    h->max_head = f->max_head;
    nghttp2_settings_entry settings[] = {{NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, f->max_streams},
                                         {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, f->stream_window},
                                         {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, f->max_head},
                                         {NGHTTP2_SETTINGS_NO_RFC7540_PRIORITIES, 1}};
    int32_t connection_window = f->connection_window;
    nghttp2_option *option;
    nghttp2_option_new(&option);
    nghttp2_option_set_no_auto_window_update(option, 1);
    nghttp2_option_set_no_closed_streams(option, 1);  // no RFC 7540 priorities: nothing to keep closed streams for
    nghttp2_option_set_max_outbound_ack(option, f->max_owed_acks);
    nghttp2_option_set_max_settings(option, f->max_settings);
    nghttp2_option_set_stream_reset_rate_limit(option, f->reset_burst, f->resets_per_second);
    nghttp2_option_set_max_continuations(option, f->max_continuations);
    pthread_mutex_unlock(&f->lock);
    int failed = nghttp2_session_server_new2(&h->session, callbacks, h, option);
    nghttp2_option_del(option);
    if (failed) {
        fputs("tandem _front: out of memory\n", stderr);
        abort();
    }
    c->h2 = h;
    nghttp2_submit_settings(h->session, NGHTTP2_FLAG_NONE, settings, sizeof settings / sizeof *settings);
    nghttp2_session_set_local_window_size(h->session, NGHTTP2_FLAG_NONE, 0, connection_window);
    h2_writable(f, c);
}

void h2_readable(Front *f, connection_t *c) {
    h2_t *h = c->h2;
    uint8_t in[65536];
    ssize_t k = recv(c->fd, in, sizeof in, 0);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) {
        close_connection(f, c);
        return;
    }
    if (k < 0) return;
    c->last_activity = now_ns();
    ssize_t done = nghttp2_session_mem_recv(h->session, in, k);
    if (done < 0)  // a flood nghttp2 counts, or a client that is not HTTP/2's
        end(h, done == NGHTTP2_ERR_FLOODED || done == NGHTTP2_ERR_TOO_MANY_CONTINUATIONS ? NGHTTP2_ENHANCE_YOUR_CALM
               : done == NGHTTP2_ERR_BAD_CLIENT_MAGIC ? NGHTTP2_PROTOCOL_ERROR : NGHTTP2_INTERNAL_ERROR);
    h2_writable(f, c);
}

// What nghttp2 has to send, into the output buffer while the client reads it; 1 if it stopped at `unsent` bytes.
static int pump(connection_t *c) {
    h2_t *h = c->h2;
    while (c->out_len < h->unsent) {
        const uint8_t *data;
        ssize_t n = nghttp2_session_mem_send(h->session, &data);
        if (n <= 0) {
            if (n < 0) h->failed = 1;
            return 0;
        }
        append(c, (const char *)data, n);
    }
    return 1;
}

// Write what is to be written; closed once written if the session is over (or it is closing), at once if it failed.
void h2_writable(Front *f, connection_t *c) {
    h2_t *h = c->h2;
    for (;;) {
        int capped = pump(c);
        size_t pending = c->out_len;
        if (flush(f, c) < 0) {
            close_connection(f, c);
            return;
        }
        if (c->out_len < pending) h->last_written = now_ns();
        if (c->out_len || !capped || h->failed) break;
    }
    if (!c->out_len) h->last_written = now_ns();
    watch_events(f, c);
    int over = !nghttp2_session_want_read(h->session) && !nghttp2_session_want_write(h->session);
    if (h->failed || ((over || (c->closing && !nghttp2_session_want_write(h->session))) && !c->out_len))
        close_connection(f, c);
}

void h2_answer(Front *f, request_t *r, batch_t *b, long offset) {
    connection_t *c = r->connection;
    stream_t *s = r->stream;
    h2_t *h = c->h2;
    s->request = NULL;
    r->connection = NULL;
    r->stream = NULL;
    if (b->status != 200) {
        send_status(h, s, status_code(f, b->status), b->message, b->message_len);
        return;
    }
    answer_t answer = answer_of(f, r, b, offset);
    size_t len = infer_response_size(&answer);
    if (!len) {
        static const char why[] = "the answer is larger than a gRPC message can be (4 GiB)";
        send_status(h, s, RESOURCE_EXHAUSTED, why, sizeof why - 1);
        return;
    }
    unsigned char *message = grown(NULL, len);
    infer_response(&answer, message);
    send_answer(h, s, OK, NULL, 0, (char *)message, len);
}

void h2_answer_error(Front *f, request_t *r, int status, const char *message, size_t len) {
    connection_t *c = r->connection;
    stream_t *s = r->stream;
    s->request = NULL;
    r->connection = NULL;
    r->stream = NULL;
    send_status(c->h2, s, status_code(f, status), message, len);  // written by the caller (a write may close c)
}

// Deadlines, budgets freed elsewhere, and the connection's time limits: the client's preface and each stream's
// header block within header_timeout, each request's body within body_timeout of its headers, no open stream for
// idle_timeout (GOAWAY NO_ERROR), answers left unread for idle_timeout.
void h2_sweep(Front *f, connection_t *c, int64_t now) {
    h2_t *h = c->h2;
    pthread_mutex_lock(&f->lock);
    int64_t header_timeout = f->header_timeout_ns, body_timeout = f->body_timeout_ns, idle = f->idle_timeout_ns;
    pthread_mutex_unlock(&f->lock);
    int changed = 0;
    for (stream_t *s = h->streams, *next; s; s = next) {
        next = s->next;
        if (s->request && now > s->request->deadline) {
            expire(f, s->request, now);
            changed = 1;
        }
    }
    if (h->owing) {
        pay(h);
        changed = 1;
    }
    int slow = !h->started && now - h->opened > header_timeout;
    for (stream_t *s = h->streams; s && !slow; s = s->next)
        slow = s->headers_done ? !s->called && now - s->headers_at > body_timeout : now - s->opened > header_timeout;
    if (slow) {
        end(h, NGHTTP2_ENHANCE_YOUR_CALM);
        changed = 1;
    } else if (!h->stream_count && now - h->idle_since > idle) {
        end(h, NGHTTP2_NO_ERROR);
        changed = 1;
    } else if (c->out_len && now - h->last_written > idle) {
        close_connection(f, c);  // its client reads nothing
        return;
    }
    if (changed) h2_writable(f, c);
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
            send_status(h, s, UNAVAILABLE, message, len);
        }
    }
    nghttp2_submit_goaway(h->session, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(h->session),
                          NGHTTP2_NO_ERROR, NULL, 0);
    h2_writable(f, c);
}

// The connection is closed: its requests leave (abandon), its state is freed.
void h2_release(Front *f, connection_t *c) {
    h2_t *h = c->h2;
    while (h->streams) forget(h, h->streams);  // nghttp2_session_del calls no callback
    nghttp2_session_del(h->session);
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
        stream_t *s = c ? nghttp2_session_get_stream_user_data(c->h2->session, answer->stream) : NULL;
        if (s && s->bridged) {
            send_answer(c->h2, s, answer->code, answer->message, answer->message_len, answer->data, answer->data_len);
            answer->data = NULL;  // the stream's now
            h2_writable(f, c);
        }
        struct call_answer *next = answer->next;
        free_call_answer(answer);
        answer = next;
    }
}
