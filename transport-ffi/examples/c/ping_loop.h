/*
 * The timed loop of ping.c, shared with `bench scenario c-abi` (bench/csrc/c_ping.c), so that
 * the bench measures this very code against the Rust client.
 */
#ifndef PING_LOOP_H
#define PING_LOOP_H

#include <stdio.h>
#include <string.h>
#include <time.h>

#include "transport_ffi.h"

static double ping_now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* A request of `size` zero bytes, written once in the client's pool and sent without a copy
 * by every call; NULL on failure (see tp_last_error). */
static tp_payload *ping_payload(tp_rpc_client *client, size_t size) {
    tp_buffer *b = tp_rpc_buffer_alloc(client, size);
    if (b == NULL)
        return NULL;
    memset(tp_buffer_data(b), 0, size);
    return tp_buffer_freeze(b, size);
}

/* `warmup` calls, then `calls` timed ones, of `method` with `request`, one at a time; each
 * reply must be as long as the request. Returns TP_OK and the timed calls' microseconds in
 * *us; a call's status when one fails; -1 (with a message on stderr) for a short reply. */
static int ping_loop(tp_rpc_client *client, uint32_t method, const tp_payload *request,
                     long warmup, long calls, double *us) {
    size_t size = 0;
    tp_payload_data(request, &size);
    double start = ping_now_us();
    for (long i = -warmup; i < calls; i++) {
        if (i == 0)
            start = ping_now_us();
        tp_message *reply = NULL;
        tp_status s = tp_rpc_call_payload(client, method, request, 10000, &reply);
        if (s != TP_OK)
            return (int)s;
        size_t n = 0;
        tp_message_payload(reply, &n);
        tp_message_free(reply);
        if (n != size) {
            fprintf(stderr, "ping: %zu bytes back, %zu sent\n", n, size);
            return -1;
        }
    }
    *us = ping_now_us() - start;
    return TP_OK;
}

#endif
