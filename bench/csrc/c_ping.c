/*
 * The C client of `bench scenario c-abi`: the loop of transport-ffi's examples/c/ping.c
 * (ping_loop.h), called by the bench in its own process beside the Rust client.
 */
#include <stdio.h>

#include "ping_loop.h"
#include "transport_ffi.h"

/* Connects to `uri` on a runtime the calling thread drives, makes `warmup` and then `calls`
 * calls of `method` with `size` bytes, and disconnects. Returns 0 with the timed calls'
 * microseconds in *us, or non-zero with the reason in `err` (`err_len` bytes). */
int bench_c_ping(const char *uri, uint32_t method, size_t size, long warmup, long calls,
                 double *us, char *err, size_t err_len) {
    tp_runtime *rt = NULL;
    tp_rpc_client *client = NULL;
    tp_payload *payload = NULL;
    int rc = 0;
    tp_status s = tp_runtime_new(0, &rt);
    if (s == TP_OK)
        s = tp_rpc_connect(rt, uri, NULL, 10000, &client);
    if (s != TP_OK) {
        snprintf(err, err_len, "connect: status %d: %s", (int)s, tp_last_error());
        rc = 1;
    } else if ((payload = ping_payload(client, size)) == NULL) {
        snprintf(err, err_len, "payload: %s", tp_last_error());
        rc = 1;
    } else {
        int r = ping_loop(client, method, payload, warmup, calls, us);
        if (r > 0)
            snprintf(err, err_len, "call: status %d: %s", r, tp_last_error());
        else if (r < 0)
            snprintf(err, err_len, "a reply of the wrong length");
        rc = r != 0;
    }
    tp_payload_free(payload);
    tp_rpc_client_free(client);
    tp_runtime_free(rt);
    return rc;
}
