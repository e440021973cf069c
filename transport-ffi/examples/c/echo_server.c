/*
 * echo_server URI [CONNECTIONS]: listens at URI, then serves CONNECTIONS connections (default
 * 1) one after the other, sending every message back (header and payload) until the peer
 * closes. Prints "listening URI" (the bound address) first. Replies are built in buffers of
 * the connection's pool: registered memory on verbs, sent without a copy.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport_ffi.h"

static int fail(const char *what, tp_status s) {
    fprintf(stderr, "echo_server: %s: status %d: %s\n", what, (int)s, tp_last_error());
    return 1;
}

/* Echoes until the peer closes; 0 on a clean end. */
static int serve(tp_conn *c) {
    for (;;) {
        tp_message *m = NULL;
        tp_status s = tp_recv(c, -1, &m);
        if (s == TP_ERR_CLOSED)
            return tp_close(c) == TP_OK ? 0 : fail("close", tp_close(c));
        if (s != TP_OK)
            return fail("recv", s);
        size_t hlen, plen;
        const uint8_t *h = tp_message_header(m, &hlen);
        const uint8_t *p = tp_message_payload(m, &plen);
        tp_buffer *b = tp_buffer_alloc(c, plen);
        if (b == NULL) {
            tp_message_free(m);
            return fail("buffer", TP_ERR_INVALID_ARGUMENT);
        }
        if (plen > 0)
            memcpy(tp_buffer_data(b), p, plen);
        s = tp_send_buffer(c, h, hlen, b, plen, -1); /* takes b */
        tp_message_free(m);
        if (s != TP_OK)
            return fail("send", s);
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: echo_server URI [CONNECTIONS]\n");
        return 2;
    }
    int connections = argc > 2 ? atoi(argv[2]) : 1;
    tp_runtime *rt = NULL;
    tp_status s = tp_runtime_new(0, &rt); /* driven by this thread's blocking calls */
    if (s != TP_OK)
        return fail("runtime", s);
    tp_listener *l = NULL;
    s = tp_listen(rt, argv[1], NULL, &l);
    if (s != TP_OK) {
        tp_runtime_free(rt);
        return fail("listen", s);
    }
    printf("listening %s\n", tp_listener_uri(l));
    fflush(stdout);
    int rc = 0;
    for (int i = 0; i < connections && rc == 0; i++) {
        tp_conn *c = NULL;
        s = tp_accept(l, 30000, &c);
        if (s != TP_OK) {
            rc = fail("accept", s);
            break;
        }
        rc = serve(c);
        tp_conn_free(c);
    }
    tp_listener_free(l);
    tp_runtime_free(rt);
    return rc;
}
