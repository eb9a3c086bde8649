/* udp_pp: busy-polled UDP ping-pong on loopback where every turn is K datagrams sent in
 * one sendmmsg call, for K = 1 and K = 2. It shows what the second datagram of an RC
 * half round trip (the responder's ACK, which leaves in the same sendmmsg as its reply)
 * costs on this machine, with no RDMA engine involved: scripts/bench runs it beside
 * `softrdma perf send-lat --busy-poll`.
 *
 *   udp_pp server PORT CPU
 *   udp_pp client PORT CPU ITERS      (prints "K half_rtt_median_us" for K = 1, 2)
 *
 * The first datagram of a turn is 28 bytes (a BTH + AETH + ICRC, an ACK's size), the
 * last 40 bytes (a 8-byte SEND: BTH + payload + ICRC); with K = 1 only the last is sent.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

/* Send one turn of k datagrams to `to` in one sendmmsg call. */
static void turn(int fd, const struct sockaddr_in *to, int k) {
    static char ack[28], req[40];
    struct iovec iov[2] = {{ack, sizeof ack}, {req, sizeof req}};
    struct mmsghdr m[2];
    memset(m, 0, sizeof m);
    for (int i = 0; i < 2; i++) {
        m[i].msg_hdr.msg_name = (void *)to;
        m[i].msg_hdr.msg_namelen = sizeof *to;
    }
    m[0].msg_hdr.msg_iov = k == 2 ? &iov[0] : &iov[1];
    m[0].msg_hdr.msg_iovlen = 1;
    m[1].msg_hdr.msg_iov = &iov[1];
    m[1].msg_hdr.msg_iovlen = 1;
    if (sendmmsg(fd, m, k, 0) != k) {
        perror("sendmmsg");
        exit(1);
    }
}

/* Busy-poll until k datagrams have arrived; returns the sender's address in `from`. */
static void await(int fd, int k, struct sockaddr_in *from) {
    char buf[2][64];
    struct iovec iov[2] = {{buf[0], 64}, {buf[1], 64}};
    struct mmsghdr m[2];
    int got = 0;
    while (got < k) {
        memset(m, 0, sizeof m);
        for (int i = 0; i < 2; i++) {
            m[i].msg_hdr.msg_iov = &iov[i];
            m[i].msg_hdr.msg_iovlen = 1;
            m[i].msg_hdr.msg_name = from;
            m[i].msg_hdr.msg_namelen = sizeof *from;
        }
        int n = recvmmsg(fd, m, k - got, MSG_DONTWAIT, NULL);
        if (n > 0)
            got += n;
        else if (errno != EAGAIN) {
            perror("recvmmsg");
            exit(1);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: udp_pp server PORT CPU | udp_pp client PORT CPU ITERS\n");
        return 2;
    }
    int server = strcmp(argv[1], "server") == 0;
    int port = atoi(argv[2]);
    pin(atoi(argv[3]));
    int iters = argc > 4 ? atoi(argv[4]) : 20000;
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(server ? port : 0)};
    me.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&me, sizeof me) < 0) {
        perror("bind");
        return 1;
    }
    struct sockaddr_in peer = me;
    peer.sin_port = htons(port);
    if (server) {
        /* Echo turns forever: a turn of k datagrams is answered with k; a 1-byte
         * datagram announces k for what follows. */
        int k = 1;
        for (;;) {
            char b[64];
            struct sockaddr_in from;
            socklen_t fl = sizeof from;
            ssize_t n = recvfrom(fd, b, sizeof b, MSG_DONTWAIT, (struct sockaddr *)&from, &fl);
            if (n < 0) {
                if (errno == EAGAIN)
                    continue;
                perror("recvfrom");
                return 1;
            }
            if (n == 1) {
                if (b[0] == 0)
                    return 0;
                k = b[0];
                sendto(fd, b, 1, 0, (struct sockaddr *)&from, fl);
                continue;
            }
            if (k == 2)
                await(fd, 1, &from);
            turn(fd, &from, k);
        }
    }
    double *t = malloc(sizeof(double) * iters);
    for (int k = 1; k <= 2; k++) {
        char c = (char)k;
        struct sockaddr_in from;
        sendto(fd, &c, 1, 0, (struct sockaddr *)&peer, sizeof peer);
        await(fd, 1, &from);
        for (int i = 0; i < iters + 1000; i++) {
            double t0 = now_us();
            turn(fd, &peer, k);
            await(fd, k, &from);
            if (i >= 1000)
                t[i - 1000] = (now_us() - t0) / 2;
        }
        qsort(t, iters, sizeof *t, cmp);
        printf("%d %.3f\n", k, t[iters / 2]);
    }
    char z = 0;
    sendto(fd, &z, 1, 0, (struct sockaddr *)&peer, sizeof peer);
    return 0;
}
