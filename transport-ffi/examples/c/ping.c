/*
 * ping serve URI                  serves method 1 (echo) at URI with a C handler; prints
 *                                 "listening URI", serves until its standard input ends.
 * ping call URI [CALLS [SIZE]]    calls method 1 CALLS times (default 20000) with SIZE bytes
 *                                 (default 0, written once in the pool and not copied again),
 *                                 one at a time, after 1000 warm-up calls; prints
 *                                 "CALLS calls of SIZE bytes: X us per call, Y MB/s".
 *
 * The C side of the ABI comparison: `cargo run --release -p transport-ffi --example ping`
 * is the same program in Rust (docs/adapters.md).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ping_loop.h"
#include "transport_ffi.h"

static int32_t echo(void *user, uint32_t method, const uint8_t *req, size_t len,
                    tp_reply *reply) {
    (void)user;
    if (method != 1)
        return 1;
    return tp_reply_set(reply, req, len) == TP_OK ? 0 : 2;
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
        tp_payload *payload = ping_payload(client, size);
        double us = 0;
        if (payload == NULL) {
            fprintf(stderr, "ping: payload: %s\n", tp_last_error());
            rc = 1;
        } else {
            int r = ping_loop(client, 1, payload, 1000, calls, &us);
            if (r > 0)
                rc = fail("call", (tp_status)r);
            else if (r < 0)
                rc = 1;
        }
        if (rc == 0)
            printf("%ld calls of %zu bytes: %.2f us per call, %.1f MB/s\n", calls, size,
                   us / (calls ? calls : 1), calls * (double)size / (us ? us : 1));
        tp_payload_free(payload);
        tp_rpc_client_free(client);
    }
    tp_runtime_free(rt);
    return rc;
}
