/*
 * echo_client URI [nb]: connects to an echo_server and checks that messages of every size come
 * back byte-exact, then checks the errors a caller can provoke: a header over
 * TP_MAX_HEADER_LEN, a message over the limit, NULL arguments, a bad URI, a descriptor asked
 * of a runtime without threads. With `nb`, it connects without blocking instead
 * (tp_connect_start, poll, tp_connect_finish; first to a socket that does not exist, which
 * fails) on a runtime with a thread, and receives through the connection's descriptor's
 * queue. Prints "ok" at the
 * end; exit status 0 when everything held.
 */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport_ffi.h"

static int failures = 0;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "echo_client: %s:%d: ", __FILE__, __LINE__);                   \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, " (last error: %s)\n", tp_last_error());                       \
            failures++;                                                                    \
        }                                                                                  \
    } while (0)

static uint8_t pattern(size_t i, size_t seed) { return (uint8_t)(i * 31 + seed * 7 + 1); }

/* One message of `len` bytes (a header of `hlen`), sent copied or from a pool buffer. */
static void round_trip(tp_conn *c, size_t hlen, size_t len, int zero_copy) {
    uint8_t hdr[TP_MAX_HEADER_LEN];
    for (size_t i = 0; i < hlen; i++)
        hdr[i] = pattern(i, 3);
    tp_status s;
    uint8_t *data = malloc(len ? len : 1);
    for (size_t i = 0; i < len; i++)
        data[i] = pattern(i, len);
    if (zero_copy) {
        tp_buffer *b = tp_buffer_alloc(c, len);
        CHECK(b != NULL && tp_buffer_capacity(b) >= len, "buffer of %zu", len);
        if (b == NULL) {
            free(data);
            return;
        }
        if (len)
            memcpy(tp_buffer_data(b), data, len);
        s = tp_send_buffer(c, hdr, hlen, b, len, 10000);
    } else {
        s = tp_send(c, hdr, hlen, data, len, 10000);
    }
    CHECK(s == TP_OK, "send %zu bytes: status %d", len, (int)s);
    tp_message *m = NULL;
    s = tp_recv(c, 10000, &m);
    CHECK(s == TP_OK, "recv %zu bytes: status %d", len, (int)s);
    if (s == TP_OK) {
        size_t got_h, got_p;
        const uint8_t *h = tp_message_header(m, &got_h);
        const uint8_t *p = tp_message_payload(m, &got_p);
        CHECK(got_h == hlen && (hlen == 0 || memcmp(h, hdr, hlen) == 0), "header of %zu", hlen);
        CHECK(got_p == len && (len == 0 || memcmp(p, data, len) == 0), "payload of %zu", len);
        tp_message_free(m);
    }
    free(data);
}

/* Connects without blocking: start, wait for the descriptor, finish. */
static tp_status connect_nb(tp_runtime *rt, const char *uri, const tp_settings *settings,
                            tp_conn **out) {
    tp_connecting *pending = NULL;
    tp_status s = tp_connect_start(rt, uri, settings, &pending);
    if (s != TP_OK)
        return s;
    int fd = -1;
    s = tp_connecting_fd(pending, &fd);
    if (s == TP_OK) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        CHECK(poll(&p, 1, 10000) == 1, "the connect's descriptor became readable");
        s = tp_connect_finish(pending, out);
        if (s == TP_OK) {
            tp_conn *again = NULL;
            CHECK(tp_connect_finish(pending, &again) == TP_ERR_INVALID_ARGUMENT && again == NULL,
                  "the connection is given out once");
        }
    }
    tp_connecting_free(pending);
    return s;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: echo_client URI\n");
        return 2;
    }
    int nb = argc > 2 && strcmp(argv[2], "nb") == 0;
    tp_runtime *rt = NULL;
    /* 0: this thread drives the runtime; non-blocking connects need a thread of its own. */
    CHECK(tp_runtime_new(nb ? 1 : 0, &rt) == TP_OK, "runtime");
    tp_conn *c = NULL;
    tp_settings settings;
    memset(&settings, 0, sizeof settings);
    settings.size = sizeof settings;
    settings.max_message_size = 4u << 20;
    tp_status s;
    if (nb) {
        CHECK(connect_nb(rt, "unix:/nonexistent-dir/none.sock", &settings, &c) != TP_OK
                  && c == NULL,
              "a connect to nothing fails through the descriptor");
        s = connect_nb(rt, argv[1], &settings, &c);
    } else {
        s = tp_connect(rt, argv[1], &settings, 10000, &c);
    }
    CHECK(s == TP_OK, "connect %s: status %d", argv[1], (int)s);
    if (s != TP_OK)
        return 1;
    int cfd = -1;
    CHECK((tp_conn_fd(c, &cfd) == TP_OK) == nb, "a descriptor only with runtime threads");
    CHECK(tp_conn_max_message_size(c) == 4u << 20, "limit %zu", tp_conn_max_message_size(c));

    size_t sizes[] = {0, 1, 100, 4096, 65536, 1u << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        round_trip(c, i % 2 ? TP_MAX_HEADER_LEN : 0, sizes[i], 0);
        round_trip(c, 8, sizes[i], 1);
    }

    /* What a caller can get wrong is a typed error, and the connection stays usable. */
    uint8_t big_header[TP_MAX_HEADER_LEN + 1] = {0};
    CHECK(tp_send(c, big_header, sizeof big_header, NULL, 0, -1) == TP_ERR_INVALID_ARGUMENT,
          "header over the limit");
    CHECK(strstr(tp_last_error(), "header") != NULL, "the message names the header");
    uint8_t *huge = calloc(1, (4u << 20) + 1);
    CHECK(tp_send(c, NULL, 0, huge, (4u << 20) + 1, -1) == TP_ERR_TOO_LARGE, "too large");
    free(huge);
    CHECK(tp_buffer_alloc(c, (4u << 20) + 1) == NULL, "buffer over the limit");
    CHECK(tp_send(c, NULL, 0, NULL, 5, -1) == TP_ERR_INVALID_ARGUMENT, "NULL payload");
    CHECK(tp_send(NULL, NULL, 0, NULL, 0, -1) == TP_ERR_INVALID_ARGUMENT, "NULL conn");
    CHECK(tp_recv(c, 0, NULL) == TP_ERR_INVALID_ARGUMENT, "NULL out");
    tp_message *none = NULL;
    CHECK(tp_recv(c, 50, &none) == TP_ERR_TIMED_OUT && none == NULL, "nothing within 50 ms");
    CHECK(tp_send_buffer(c, NULL, 0, NULL, 0, -1) == TP_ERR_INVALID_ARGUMENT, "NULL buffer");
    tp_conn *bad = NULL;
    CHECK(tp_connect(rt, "udp://1.2.3.4:5", NULL, 1000, &bad) == TP_ERR_INVALID_ARGUMENT,
          "bad URI");
    CHECK(strstr(tp_last_error(), "unknown scheme") != NULL, "the message says why");
    if (!nb) {
        int fd = -1;
        CHECK(tp_conn_fd(c, &fd) == TP_ERR_UNSUPPORTED && fd == -1,
              "no background receiving on a runtime without threads");
        CHECK(tp_try_recv(c, &none) == TP_ERR_UNSUPPORTED, "nor a non-blocking take");
    } else {
        CHECK(tp_try_recv(c, &none) == TP_ERR_WOULD_BLOCK && none == NULL, "nothing waits");
    }
    round_trip(c, 4, 1000, 1);

    CHECK(tp_close(c) == TP_OK, "close");
    tp_message *end = NULL;
    CHECK(tp_recv(c, 10000, &end) == TP_ERR_CLOSED, "the server's end after ours");
    tp_conn_free(c);
    tp_runtime_free(rt);
    if (failures == 0)
        printf("ok\n");
    return failures == 0 ? 0 : 1;
}
