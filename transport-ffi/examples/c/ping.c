/*
 * ping serve URI                  serves method 1 (echo) at URI with a C handler; prints
 *                                 "listening URI", serves until its standard input ends.
 * ping call URI [CALLS [SIZE]]    calls method 1 CALLS times (default 20000) with SIZE bytes
 *                                 (default 0), one at a time, after 1000 warm-up calls; prints
 *                                 "CALLS calls of SIZE bytes: X us per call, Y MB/s".
 *
 * The C side of the ABI comparison: `cargo run --release -p transport-ffi --example ping`
 * is the same program in Rust (docs/adapters.md).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transport_ffi.h"

static int32_t echo(void *user, uint32_t method, const uint8_t *req, size_t len,
                    tp_reply *reply) {
    (void)user;
    if (method != 1)
        return 1;
    return tp_reply_set(reply, req, len) == TP_OK ? 0 : 2;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int fail(const char *what, tp_status s) {
    fprintf(stderr, "ping: %s: status %d: %s\n", what, (int)s, tp_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[1], "serve") != 0 && strcmp(argv[1], "call") != 0)) {
        fprintf(stderr, "usage: ping serve URI | ping call URI [CALLS [SIZE]]\n");
        return 2;
    }
    /* A server needs a thread of the runtime's own; a client is driven by its calls. */
    int serving = strcmp(argv[1], "serve") == 0;
    tp_runtime *rt = NULL;
    tp_status s = tp_runtime_new(serving ? 1 : 0, &rt);
    if (s != TP_OK)
        return fail("runtime", s);
    int rc = 0;
    if (serving) {
        tp_rpc_server *server = NULL;
        s = tp_rpc_serve(rt, argv[2], NULL, echo, NULL, &server);
        if (s != TP_OK) {
            tp_runtime_free(rt);
            return fail("serve", s);
        }
        printf("listening %s\n", tp_rpc_server_uri(server));
        fflush(stdout);
        while (getchar() != EOF) {
        }
        tp_rpc_server_free(server);
    } else {
        long calls = argc > 3 ? atol(argv[3]) : 20000;
        size_t size = argc > 4 ? (size_t)atol(argv[4]) : 0;
        tp_rpc_client *client = NULL;
        s = tp_rpc_connect(rt, argv[2], NULL, 10000, &client);
        if (s != TP_OK) {
            tp_runtime_free(rt);
            return fail("connect", s);
        }
        uint8_t *payload = calloc(1, size ? size : 1);
        double start = 0;
        for (long i = -1000; i < calls && rc == 0; i++) {
            if (i == 0)
                start = now_us();
            tp_message *reply = NULL;
            s = tp_rpc_call(client, 1, payload, size, 10000, &reply);
            if (s != TP_OK) {
                rc = fail("call", s);
                break;
            }
            size_t n;
            tp_message_payload(reply, &n);
            if (n != size) {
                fprintf(stderr, "ping: %zu bytes back, %zu sent\n", n, size);
                rc = 1;
            }
            tp_message_free(reply);
        }
        double us = now_us() - start;
        if (rc == 0)
            printf("%ld calls of %zu bytes: %.2f us per call, %.1f MB/s\n", calls, size,
                   us / (calls ? calls : 1), calls * (double)size / (us ? us : 1));
        free(payload);
        tp_rpc_client_free(client);
    }
    tp_runtime_free(rt);
    return rc;
}
