/*
 * tcp_conn: TCP connection set-up rate on loopback, the reference for rdma_cm's (cmtime).
 *
 *   tcp_conn PORT CONNS ROUNDS
 *
 * A forked server accepts, sends one byte and closes; each round the client opens CONNS
 * non-blocking sockets at once, connects them all, and waits until every one has the
 * server's byte, as cmtime's "connect" step waits for every ESTABLISHED (which needs the
 * server program's rdma_accept). Prints one line per round: "conns_per_s <rate>".
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what)
{
	perror(what);
	exit(1);
}

int main(int argc, char **argv)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	int port, conns, rounds, l, one = 1;
	pid_t srv;

	if (argc != 4) {
		fprintf(stderr, "usage: tcp_conn PORT CONNS ROUNDS\n");
		return 2;
	}
	port = atoi(argv[1]);
	conns = atoi(argv[2]);
	rounds = atoi(argv[3]);
	if (port <= 0 || port > 65535 || conns <= 0 || conns > 4096 || rounds <= 0)
		return 2;
	a.sin_port = htons(port);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);

	l = socket(AF_INET, SOCK_STREAM, 0);
	if (l < 0)
		die("socket");
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, conns))
		die("bind/listen");
	srv = fork();
	if (srv < 0)
		die("fork");
	if (srv == 0) {
		for (long n = 0; n < (long)conns * rounds; n++) {
			int s = accept(l, NULL, NULL);

			if (s < 0)
				die("accept");
			if (write(s, "x", 1) != 1)
				die("write");
			close(s);
		}
		_exit(0);
	}
	close(l);

	int *fd = calloc(conns, sizeof *fd);
	struct pollfd *p = calloc(conns, sizeof *p);

	if (!fd || !p)
		die("calloc");
	for (int r = 0; r < rounds; r++) {
		double t0 = now_s();
		int left = conns;

		for (int i = 0; i < conns; i++) {
			fd[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
			if (fd[i] < 0)
				die("socket");
			if (connect(fd[i], (struct sockaddr *)&a, sizeof a) && errno != EINPROGRESS)
				die("connect");
			p[i] = (struct pollfd){ .fd = fd[i], .events = POLLIN };
		}
		while (left > 0) {
			if (poll(p, conns, 10000) <= 0)
				die("poll (no byte from the server within 10 s)");
			for (int i = 0; i < conns; i++) {
				char c;

				if (p[i].fd < 0 || !p[i].revents)
					continue;
				if (read(fd[i], &c, 1) != 1)
					die("read");
				p[i].fd = -1;
				left--;
			}
		}
		double t1 = now_s();

		for (int i = 0; i < conns; i++)
			close(fd[i]);
		printf("conns_per_s %.1f\n", conns / (t1 - t0));
	}
	waitpid(srv, NULL, 0);
	return 0;
}
