// What the C front's answer encoders are given (_front_parse.c's JSON answer, _front_infer.c's ModelInferResponse):
// the answer to a request the front served.
#ifndef TANDEM_FRONT_ANSWER_H
#define TANDEM_FRONT_ANSWER_H
#include <stddef.h>

// The model's names, the request's id (its encoder says how: a JSON string with its quotes over HTTP, the bytes over
// gRPC; empty or NULL: none), and the outputs, `rows` examples of the per-example `shape` (`dims` values), rows x the
// product of shape floats.
typedef struct {
    const char *model_name, *version, *output_name, *id;
    size_t model_name_len, version_len, output_name_len, id_len;
    long rows;
    int dims;
    const long *shape;
    const float *y;
} answer_t;

#endif
