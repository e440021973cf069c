/*
 * rpc URI [CALLS [SIZE]]: serves an RPC handler at URI and calls it from a client in the same
 * process: method 1 echoes, method 2 fails with code 1042, oneway calls are counted. Then
 * CALLS calls of SIZE bytes one at a time (default 2000 of 32 bytes), timed: prints
 * "ping: N calls, X us per call" and "ok". Exit status 0 when everything held.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transport_ffi.h"

static int failures = 0;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "rpc: %s:%d: ", __FILE__, __LINE__);                           \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, " (last error: %s)\n", tp_last_error());                       \
            failures++;                                                                    \
        }                                                                                  \
    } while (0)

struct counters {
    atomic_long calls;
    atomic_long oneways;
};

static int32_t handler(void *user, uint32_t method, const uint8_t *req, size_t len,
                       tp_reply *reply) {
    struct counters *n = user;
    switch (method) {
    case 1:
        atomic_fetch_add(&n->calls, 1);
        return tp_reply_set(reply, req, len) == TP_OK ? 0 : 1;
    case 2:
        return 1042;
    case 3:
        atomic_fetch_add(&n->oneways, 1);
        return 0;
    default:
        return 1;
    }
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: rpc URI [CALLS [SIZE]]\n");
        return 2;
    }
    long calls = argc > 2 ? atol(argv[2]) : 2000;
    size_t size = argc > 3 ? (size_t)atol(argv[3]) : 32;
    struct counters n;
    atomic_init(&n.calls, 0);
    atomic_init(&n.oneways, 0);
    tp_runtime *rt = NULL;
    CHECK(tp_runtime_new(2, &rt) == TP_OK, "runtime");
    tp_rpc_server *server = NULL;
    tp_status s = tp_rpc_serve(rt, argv[1], NULL, handler, &n, &server);
    CHECK(s == TP_OK, "serve %s: status %d", argv[1], (int)s);
    if (s != TP_OK)
        return 1;
    CHECK(tp_rpc_serve(rt, argv[1], NULL, NULL, &n, &server) == TP_ERR_INVALID_ARGUMENT,
          "a NULL handler");
    tp_runtime *callers_only = NULL;
    CHECK(tp_runtime_new(0, &callers_only) == TP_OK, "a runtime without threads");
    tp_rpc_server *refused = NULL;
    CHECK(tp_rpc_serve(callers_only, argv[1], NULL, handler, &n, &refused) == TP_ERR_UNSUPPORTED
              && refused == NULL,
          "a server on a runtime without threads");
    tp_runtime_free(callers_only);
    tp_rpc_client *client = NULL;
    s = tp_rpc_connect(rt, tp_rpc_server_uri(server), NULL, 10000, &client);
    CHECK(s == TP_OK, "connect %s: status %d", tp_rpc_server_uri(server), (int)s);
    if (s != TP_OK)
        return 1;

    const char hello[] = "hello over the C ABI";
    tp_message *reply = NULL;
    s = tp_rpc_call(client, 1, (const uint8_t *)hello, sizeof hello, 10000, &reply);
    CHECK(s == TP_OK, "call: status %d", (int)s);
    if (s == TP_OK) {
        size_t len;
        const uint8_t *p = tp_message_payload(reply, &len);
        CHECK(len == sizeof hello && memcmp(p, hello, len) == 0, "the echo");
        tp_message_free(reply);
    }
    reply = NULL;
    CHECK(tp_rpc_call(client, 2, NULL, 0, 10000, &reply) == TP_ERR_REMOTE && reply == NULL,
          "the handler's error");
    CHECK(strstr(tp_last_error(), "1042") != NULL, "the code is in the message");
    for (int i = 0; i < 10; i++)
        CHECK(tp_rpc_oneway(client, 3, (const uint8_t *)"x", 1) == TP_OK, "oneway");
    CHECK(tp_rpc_call(client, 1, NULL, 0, 10000, &reply) == TP_OK, "an empty call");
    tp_message_free(reply);

    uint8_t *payload = calloc(1, size ? size : 1);
    double start = now_us();
    for (long i = 0; i < calls; i++) {
        s = tp_rpc_call(client, 1, payload, size, 10000, &reply);
        if (s != TP_OK) {
            CHECK(0, "call %ld: status %d", i, (int)s);
            break;
        }
        tp_message_free(reply);
    }
    double per_call = (now_us() - start) / (calls ? calls : 1);
    free(payload);
    printf("ping: %ld calls of %zu bytes, %.2f us per call\n", calls, size, per_call);

    tp_rpc_client_free(client);
    tp_rpc_server_free(server); /* graceful: handlers done, so the counts are final */
    CHECK(atomic_load(&n.oneways) == 10, "oneways counted: %ld", atomic_load(&n.oneways));
    CHECK(atomic_load(&n.calls) == calls + 2, "calls counted: %ld", atomic_load(&n.calls));
    tp_runtime_free(rt);
    if (failures == 0)
        printf("ok\n");
    return failures == 0 ? 0 : 1;
}
