// The C front's parsers (see _front_parse.h): "mine, exactly" or "not mine". HTTP/1.1 is llhttp's to parse, strict
// (no lenient flag); the front only looks at what it parsed. The JSON body is the front's own, and so is its answer's.
#include "_front_parse.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "llhttp.h"

// -- the request: llhttp's callbacks over one pass of the input from its start -----------------------------------

typedef struct {
    llhttp_t parser;           // first: the callbacks' llhttp_t * is this
    const http1_spec_t *spec;
    const char *in;
    size_t url_len;
    const char *field, *value;  // the header being parsed (llhttp gives each as one span or, at the input's end,
    size_t field_len, value_len;  // its part so far: one pass over contiguous bytes)
    int hosts, authorized;
} recognition_t;

// A span of the head: at most max_head bytes from the input's start.
static int within_head(recognition_t *r, const char *at, size_t n) {
    return (size_t)(at + n - r->in) <= r->spec->max_head;
}

static int on_url(llhttp_t *p, const char *at, size_t n) {
    recognition_t *r = (recognition_t *)p;
    const http1_spec_t *spec = r->spec;
    if (p->method != HTTP_POST || r->url_len + n > spec->path_len || memcmp(at, spec->path + r->url_len, n) != 0)
        return -1;
    r->url_len += n;
    return 0;
}

static int on_header_field(llhttp_t *p, const char *at, size_t n) {
    recognition_t *r = (recognition_t *)p;
    if (!r->field) r->field = at;
    r->field_len += n;
    return within_head(r, at, n) ? 0 : -1;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n) {
    recognition_t *r = (recognition_t *)p;
    if (!r->value) r->value = at;
    r->value_len += n;
    return within_head(r, at, n) ? 0 : -1;
}

static int named(recognition_t *r, const char *name) {
    size_t n = strlen(name);
    return r->field_len == n && strncasecmp(r->field, name, n) == 0;
}

// A header whole: one of ours, or one that makes the request another's.
static int on_header_value_complete(llhttp_t *p) {
    recognition_t *r = (recognition_t *)p;
    const char *value = r->value ? r->value : "";
    size_t len = r->value_len;
    while (len && (value[len - 1] == ' ' || value[len - 1] == '\t')) len--;
    int ours = 1;
    if (named(r, "host")) {
        ours = ++r->hosts == 1;
    } else if (named(r, "authorization")) {
        ours = !r->authorized && r->spec->token_ok(r->spec->context, value, len);
        r->authorized = 1;
    } else if (named(r, "connection")) {
        ours = len == 10 && strncasecmp(value, "keep-alive", 10) == 0;
    } else if (named(r, "transfer-encoding") || named(r, "content-encoding") || named(r, "expect")
               || named(r, "upgrade") || named(r, "inference-header-content-length")) {
        ours = 0;
    }
    r->field = r->value = NULL;
    r->field_len = r->value_len = 0;
    return ours ? 0 : -1;
}

// The head whole: ours, or not. Paused here: llhttp's position is then the head's end.
static int on_headers_complete(llhttp_t *p) {
    recognition_t *r = (recognition_t *)p;
    const http1_spec_t *spec = r->spec;
    int ours = p->method == HTTP_POST && r->url_len == spec->path_len && p->http_major == 1 && p->http_minor == 1
               && r->hosts == 1 && (p->flags & F_CONTENT_LENGTH) && !p->upgrade
               && !(p->flags & (F_CHUNKED | F_TRANSFER_ENCODING | F_UPGRADE | F_CONNECTION_CLOSE
                                | F_CONNECTION_UPGRADE))
               && p->content_length <= (unsigned long)spec->max_body && (r->authorized || !spec->needs_token);
    return ours ? HPE_PAUSED : -1;
}

static const llhttp_settings_t settings = {
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_header_value_complete = on_header_value_complete,
    .on_headers_complete = on_headers_complete,
};

// Every line of the head ends in CRLF, the head in an empty line, and no CR or LF stands alone: llhttp 8 takes a CR
// followed by another byte as a line's end, which the Python server's llhttp refuses (a head read two ways is how
// requests are smuggled), so such a head is not ours.
static int crlf_only(const char *head, size_t len) {
    if (len < 4 || memcmp(head + len - 4, "\r\n\r\n", 4) != 0) return 0;
    for (size_t i = 0; i < len; i++) {
        if (head[i] == '\r' && head[i + 1] != '\n') return 0;  // i + 1 < len: the head ends in "\r\n"
        if (head[i] == '\n' && (i == 0 || head[i - 1] != '\r')) return 0;
    }
    return 1;
}

int http1_recognise(const char *in, size_t len, const http1_spec_t *spec, const char **body, size_t *body_len,
                    size_t *used) {
    recognition_t r;
    memset(&r, 0, sizeof r);
    llhttp_init(&r.parser, HTTP_REQUEST, &settings);
    r.spec = spec;
    r.in = in;
    llhttp_errno_t error = llhttp_execute(&r.parser, in, len);
    if (error == HPE_OK) return len < spec->max_head ? HTTP1_INCOMPLETE : HTTP1_NOT_MINE;  // the head goes on
    if (error != HPE_PAUSED) return HTTP1_NOT_MINE;
    size_t head = llhttp_get_error_pos(&r.parser) - in;
    if (head > spec->max_head || !crlf_only(in, head)) return HTTP1_NOT_MINE;
    size_t length = r.parser.content_length;
    if (len - head < length) return HTTP1_INCOMPLETE;
    *body = in + head;
    *body_len = length;
    *used = head + length;
    return HTTP1_MINE;
}

// -- the JSON body ------------------------------------------------------------------------------------------------

typedef struct {
    const char *p, *end;
} cursor_t;

static void skip_space(cursor_t *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static int eat(cursor_t *s, char ch) {
    skip_space(s);
    if (s->p < s->end && *s->p == ch) {
        s->p++;
        return 1;
    }
    return 0;
}

// A JSON string without escapes (a key or name); its content in [*start, *start + *len). An escape is not ours.
static int plain_string(cursor_t *s, const char **start, size_t *len) {
    if (!eat(s, '"')) return 0;
    const char *begin = s->p;
    while (s->p < s->end && *s->p != '"') {
        if (*s->p == '\\' || (unsigned char)*s->p < 0x20) return 0;
        s->p++;
    }
    if (s->p >= s->end) return 0;
    *start = begin;
    *len = s->p - begin;
    s->p++;
    return 1;
}

// A JSON string of printable ASCII and simple escapes (the request's id, echoed as sent): its bytes with the quotes.
// Other bytes and \u escapes are the Python server's to judge (invalid UTF-8, lone surrogates).
static int any_string(cursor_t *s, const char **start, size_t *len) {
    skip_space(s);
    if (s->p >= s->end || *s->p != '"') return 0;
    const char *begin = s->p++;
    while (s->p < s->end && *s->p != '"') {
        unsigned char ch = *s->p;
        if (ch < 0x20 || ch >= 0x7f) return 0;
        if (ch == '\\') {
            if (s->p + 1 >= s->end) return 0;
            char e = s->p[1];
            if (!e || !strchr("\"\\/bfnrt", e)) return 0;
            s->p += 2;
            continue;
        }
        s->p++;
    }
    if (s->p >= s->end) return 0;
    s->p++;
    *start = begin;
    *len = s->p - begin;
    return 1;
}

static int is_key(const char *start, size_t len, const char *key) {
    return len == strlen(key) && memcmp(start, key, len) == 0;
}

// A JSON number (strict grammar) as a float, read as the Python server reads it (as a double, then rounded to float32:
// reading it to float32 directly can round the other way near a tie); one float32 cannot hold (it rounds to an
// infinity: 1e39) is not ours (the Python server refuses it, naming the input); one that underflows to 0 is.
static int number(cursor_t *s, float *value) {
    skip_space(s);
    const char *p = s->p, *begin = p;
    if (p < s->end && *p == '-') p++;
    if (p >= s->end || !isdigit((unsigned char)*p)) return 0;
    if (*p == '0') p++;
    else while (p < s->end && isdigit((unsigned char)*p)) p++;
    if (p < s->end && *p == '.') {
        p++;
        if (p >= s->end || !isdigit((unsigned char)*p)) return 0;
        while (p < s->end && isdigit((unsigned char)*p)) p++;
    }
    if (p < s->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < s->end && (*p == '+' || *p == '-')) p++;
        if (p >= s->end || !isdigit((unsigned char)*p)) return 0;
        while (p < s->end && isdigit((unsigned char)*p)) p++;
    }
    size_t len = p - begin;
    char copy[64];
    if (len >= sizeof copy) return 0;
    memcpy(copy, begin, len);
    copy[len] = 0;
    *value = (float)strtod(copy, NULL);
    if (!isfinite(*value)) return 0;
    s->p = p;
    return 1;
}

static int integer(cursor_t *s, long *value) {
    skip_space(s);
    const char *p = s->p;
    long v = 0;
    if (p >= s->end || !isdigit((unsigned char)*p)) return 0;
    while (p < s->end && isdigit((unsigned char)*p)) {
        if (v > 100000000) return 0;
        v = v * 10 + (*p++ - '0');
    }
    if (p < s->end && (*p == '.' || *p == 'e' || *p == 'E')) return 0;
    s->p = p;
    *value = v;
    return 1;
}

// The one input: {"name": <the input's>, "shape": [rows, <the example's shape>], "datatype": "FP32", "data": [...]},
// keys in any order, each once. Its numbers are read later (infer_body_values), once the caller has room for them.
static int parse_input(const infer_spec_t *spec, cursor_t *s, infer_body_t *out) {
    if (!eat(s, '{')) return 0;
    int seen_name = 0, seen_datatype = 0;
    long rows = -1;
    const char *data = NULL;
    for (int first = 1;; first = 0) {
        if (!first && !eat(s, ',')) break;
        const char *key;
        size_t key_len;
        if (!plain_string(s, &key, &key_len) || !eat(s, ':')) return 0;
        if (is_key(key, key_len, "name") && !seen_name) {
            const char *name;
            size_t name_len;
            if (!plain_string(s, &name, &name_len)) return 0;
            if (name_len != spec->input_name_len || memcmp(name, spec->input_name, name_len) != 0) return 0;
            seen_name = 1;
        } else if (is_key(key, key_len, "datatype") && !seen_datatype) {
            const char *type;
            size_t type_len;
            if (!plain_string(s, &type, &type_len) || !is_key(type, type_len, "FP32")) return 0;
            seen_datatype = 1;
        } else if (is_key(key, key_len, "shape") && rows < 0) {
            if (!eat(s, '[') || !integer(s, &rows) || rows < 1) return 0;
            for (int i = 0; i < spec->dims; i++) {
                long dim;
                if (!eat(s, ',') || !integer(s, &dim) || dim != spec->shape[i]) return 0;
            }
            if (!eat(s, ']')) return 0;
        } else if (is_key(key, key_len, "data") && !data) {
            skip_space(s);
            data = s->p;
            if (!eat(s, '[')) return 0;
            int depth = 1;  // skip to its end: only numbers, commas and spaces are ours
            while (s->p < s->end && depth) {
                char ch = *s->p++;
                if (ch == ']') depth--;
                else if (ch == '[' || ch == '{' || ch == '"') return 0;
            }
            if (depth) return 0;
        } else {
            return 0;  // parameters, a repeated key, anything else: not ours
        }
    }
    if (!eat(s, '}') || !seen_name || !seen_datatype || rows < 0 || !data) return 0;
    if (rows > spec->max_rows || rows * spec->features > spec->max_values) return 0;
    out->rows = rows;
    out->data = data;
    out->end = s->end;
    return 1;
}

int infer_body_parse(const char *body, size_t len, const infer_spec_t *spec, infer_body_t *out) {
    cursor_t s = {body, body + len};
    int input = 0;
    out->id = NULL;
    out->id_len = 0;
    if (!eat(&s, '{')) return 0;
    for (int first = 1;; first = 0) {
        if (!first && !eat(&s, ',')) break;
        const char *key;
        size_t key_len;
        if (!plain_string(&s, &key, &key_len) || !eat(&s, ':')) return 0;
        if (is_key(key, key_len, "inputs") && !input) {
            if (!eat(&s, '[') || !parse_input(spec, &s, out) || !eat(&s, ']')) return 0;
            input = 1;
        } else if (is_key(key, key_len, "id") && !out->id) {
            if (!any_string(&s, &out->id, &out->id_len)) return 0;
        } else {
            return 0;
        }
    }
    if (!eat(&s, '}') || !input) return 0;
    skip_space(&s);
    return s.p == s.end;
}

int infer_body_values(const infer_body_t *parsed, long count, float *x) {
    cursor_t d = {parsed->data + 1, parsed->end};
    for (long i = 0; i < count; i++)
        if ((i && !eat(&d, ',')) || !number(&d, &x[i])) return 0;
    return eat(&d, ']');
}

// -- the JSON answer ----------------------------------------------------------------------------------------------

#define ANSWER_MODEL "{\"model_name\":\""
#define ANSWER_VERSION "\",\"model_version\":\""
#define ANSWER_ID "\",\"id\":"     // the version's closing quote, then the id's key
#define ANSWER_NO_ID "\""
#define ANSWER_OUTPUT ",\"outputs\":[{\"name\":\""
#define ANSWER_SHAPE "\",\"datatype\":\"FP32\",\"shape\":["
#define ANSWER_DATA "],\"data\":["
#define ANSWER_END "]}]}"
#define LITERAL_LEN(text) (sizeof(text) - 1)
#define LONG_TEXT_MAX 20   // "-9223372036854775808"
#define FLOAT_TEXT_MAX 15  // "-1.17549435e-38": %.9g's longest for a float32 ("null" is shorter)

// The shortest of %.8g and %.9g that reads back as the same float32.
static int format_float(char *into, float value) {
    if (!isfinite(value)) return sprintf(into, "null");  // as orjson writes NaN and infinities
    int n = sprintf(into, "%.8g", value);
    if (strtof(into, NULL) != value) n = sprintf(into, "%.9g", value);
    return n;
}

static char *put(char *into, const char *bytes, size_t len) {
    if (len) memcpy(into, bytes, len);
    return into + len;
}

static long answer_values(const answer_t *a) {
    long features = 1;
    for (int i = 0; i < a->dims; i++) features *= a->shape[i];
    long values = a->rows * features;
    return values > 0 ? values : 0;
}

size_t json_answer_bound(const answer_t *a) {
    size_t text = LITERAL_LEN(ANSWER_MODEL) + LITERAL_LEN(ANSWER_VERSION) + LITERAL_LEN(ANSWER_ID)
                + LITERAL_LEN(ANSWER_OUTPUT) + LITERAL_LEN(ANSWER_SHAPE) + LITERAL_LEN(ANSWER_DATA)
                + LITERAL_LEN(ANSWER_END);
    return text + a->model_name_len + a->version_len + a->id_len + a->output_name_len + LONG_TEXT_MAX
         + (size_t)a->dims * (1 + LONG_TEXT_MAX) + (size_t)answer_values(a) * (1 + FLOAT_TEXT_MAX) + 1;
}

size_t json_answer(const answer_t *a, char *into) {
    char *p = put(into, ANSWER_MODEL, LITERAL_LEN(ANSWER_MODEL));
    p = put(p, a->model_name, a->model_name_len);
    p = put(p, ANSWER_VERSION, LITERAL_LEN(ANSWER_VERSION));
    p = put(p, a->version, a->version_len);
    if (a->id) {
        p = put(p, ANSWER_ID, LITERAL_LEN(ANSWER_ID));
        p = put(p, a->id, a->id_len);
    } else {
        p = put(p, ANSWER_NO_ID, LITERAL_LEN(ANSWER_NO_ID));
    }
    p = put(p, ANSWER_OUTPUT, LITERAL_LEN(ANSWER_OUTPUT));
    p = put(p, a->output_name, a->output_name_len);
    p = put(p, ANSWER_SHAPE, LITERAL_LEN(ANSWER_SHAPE));
    p += sprintf(p, "%ld", a->rows);
    for (int i = 0; i < a->dims; i++) p += sprintf(p, ",%ld", a->shape[i]);
    p = put(p, ANSWER_DATA, LITERAL_LEN(ANSWER_DATA));
    long values = answer_values(a);
    for (long i = 0; i < values; i++) {
        if (i) *p++ = ',';
        p += format_float(p, a->y[i]);
    }
    p = put(p, ANSWER_END, LITERAL_LEN(ANSWER_END));
    *p = 0;
    return p - into;
}
