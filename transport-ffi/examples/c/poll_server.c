/*
 * poll_server URI [CONNECTIONS]: an echo server on the caller's own event loop. It polls the
 * listener's descriptor and every connection's (tp_listener_fd, tp_conn_fd), takes what is
 * ready without blocking (tp_try_accept, tp_try_recv) and sends each message back. It serves
 * connections side by side and exits once CONNECTIONS of them (default 2) have ended.
 * Prints "listening URI" first.
 */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>

#include "transport_ffi.h"

#define MAX_CONNS 16

static int fail(const char *what, tp_status s) {
    fprintf(stderr, "poll_server: %s: status %d: %s\n", what, (int)s, tp_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: poll_server URI [CONNECTIONS]\n");
        return 2;
    }
    int wanted = argc > 2 ? atoi(argv[2]) : 2;
    tp_runtime *rt = NULL;
    tp_status s = tp_runtime_new(1, &rt); /* background receiving needs a runtime thread */
    if (s != TP_OK)
        return fail("runtime", s);
    tp_listener *l = NULL;
    s = tp_listen(rt, argv[1], NULL, &l);
    if (s != TP_OK)
        return fail("listen", s);
    int lfd = -1;
    if ((s = tp_listener_fd(l, &lfd)) != TP_OK)
        return fail("listener fd", s);
    printf("listening %s\n", tp_listener_uri(l));
    fflush(stdout);

    tp_conn *conns[MAX_CONNS] = {0};
    int ended = 0, rc = 0;
    while (ended < wanted && rc == 0) {
        struct pollfd fds[MAX_CONNS + 1];
        int owner[MAX_CONNS + 1];
        int n = 0;
        fds[n].fd = lfd;
        fds[n].events = POLLIN;
        owner[n++] = -1;
        for (int i = 0; i < MAX_CONNS; i++) {
            int fd;
            if (conns[i] != NULL && tp_conn_fd(conns[i], &fd) == TP_OK) {
                fds[n].fd = fd;
                fds[n].events = POLLIN;
                owner[n++] = i;
            }
        }
        if (poll(fds, n, 30000) <= 0) {
            fprintf(stderr, "poll_server: nothing for 30 s\n");
            rc = 1;
            break;
        }
        for (int k = 0; k < n && rc == 0; k++) {
            if (!(fds[k].revents & POLLIN))
                continue;
            if (owner[k] < 0) {
                tp_conn *c = NULL;
                s = tp_try_accept(l, &c);
                if (s == TP_ERR_WOULD_BLOCK)
                    continue;
                if (s != TP_OK) {
                    rc = fail("accept", s);
                    break;
                }
                int slot = 0;
                while (slot < MAX_CONNS && conns[slot] != NULL)
                    slot++;
                if (slot == MAX_CONNS) {
                    tp_conn_free(c); /* full: refused */
                    continue;
                }
                conns[slot] = c;
                continue;
            }
            tp_conn *c = conns[owner[k]];
            for (;;) { /* everything that waits on this connection */
                tp_message *m = NULL;
                s = tp_try_recv(c, &m);
                if (s == TP_ERR_WOULD_BLOCK)
                    break;
                if (s == TP_ERR_CLOSED) {
                    tp_close(c);
                    tp_conn_free(c);
                    conns[owner[k]] = NULL;
                    ended++;
                    break;
                }
                if (s != TP_OK) {
                    rc = fail("recv", s);
                    break;
                }
                size_t hlen, plen;
                const uint8_t *h = tp_message_header(m, &hlen);
                const uint8_t *p = tp_message_payload(m, &plen);
                s = tp_send(c, h, hlen, p, plen, 10000);
                tp_message_free(m);
                if (s != TP_OK) {
                    rc = fail("send", s);
                    break;
                }
            }
        }
    }
    for (int i = 0; i < MAX_CONNS; i++)
        tp_conn_free(conns[i]);
    tp_listener_free(l);
    tp_runtime_free(rt);
    return rc;
}
