/*
 * preload_test: a plain socket program (socket, bind, listen, accept, connect, send,
 * recv, close; no rsockets calls) for tests-ext/rdmacm/run.sh, which runs it with
 * rdma-core's librspreload.so preloaded under `softrdma run --`: its TCP sockets become
 * rsockets on softrdma's librdmacm. A server thread takes 1 MiB of a pattern from a client
 * and checks every byte, then answers "ok". The program also asks both of its connected
 * sockets for an rsockets option (SOL_RDMA, RDMA_SQSIZE): only an rsocket knows it, so
 * with -r (expect rsockets) a kernel socket is a failure.
 *
 *   preload_test [-r] PORT
 */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define LEN (1 << 20)
#define SOL_RDMA 0x10000
#define RDMA_SQSIZE 0

static int port, want_rsocket, server_rc = 1;
static volatile int ready;

static int is_rsocket(int fd)
{
	int v = 0;
	socklen_t len = sizeof v;

	return getsockopt(fd, SOL_RDMA, RDMA_SQSIZE, &v, &len) == 0 && v > 0;
}

static struct sockaddr_in loopback(void)
{
	struct sockaddr_in a;

	memset(&a, 0, sizeof a);
	a.sin_family = AF_INET;
	a.sin_port = htons(port);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

static void *server(void *arg)
{
	struct sockaddr_in a = loopback();
	int l, s, one = 1;
	size_t got = 0, i;
	ssize_t r;
	char *b = malloc(LEN);

	(void)arg;
	l = socket(AF_INET, SOCK_STREAM, 0);
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (!b || l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1)) {
		perror("server: socket/bind/listen");
		ready = -1;
		return NULL;
	}
	ready = 1;
	s = accept(l, NULL, NULL);
	if (s < 0) {
		perror("accept");
		return NULL;
	}
	while (got < LEN && (r = recv(s, b + got, LEN - got, 0)) > 0)
		got += (size_t)r;
	if (got != LEN)
		printf("server: got %zu of %d bytes\n", got, LEN);
	for (i = 0; i < got; i++) {
		if (b[i] != (char)(i * 7 + (i >> 12))) {
			printf("server: byte %zu is %d\n", i, b[i]);
			got = 0;
			break;
		}
	}
	if (got != LEN) {
		close(s);
		close(l);
		return NULL;
	}
	if (want_rsocket && !is_rsocket(s)) {
		printf("server: the accepted socket is no rsocket\n");
		send(s, "no", 2, 0);
	} else if (send(s, "ok", 2, 0) == 2) {
		server_rc = 0;
	}
	close(s);
	close(l);
	free(b);
	return NULL;
}

int main(int argc, char **argv)
{
	struct sockaddr_in a;
	pthread_t t;
	char ok[3] = { 0 }, *b;
	size_t put = 0, i;
	ssize_t r;
	int c;

	if (argc == 3 && !strcmp(argv[1], "-r")) {
		want_rsocket = 1;
		port = atoi(argv[2]);
	} else if (argc == 2) {
		port = atoi(argv[1]);
	} else {
		fprintf(stderr, "usage: preload_test [-r] PORT\n");
		return 2;
	}
	a = loopback();
	pthread_create(&t, NULL, server, NULL);
	while (!ready)
		usleep(1000);
	if (ready < 0)
		return 1;
	c = socket(AF_INET, SOCK_STREAM, 0);
	if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof a)) {
		perror("connect");
		return 1;
	}
	b = malloc(LEN);
	for (i = 0; i < LEN; i++)
		b[i] = (char)(i * 7 + (i >> 12));
	while (put < LEN && (r = send(c, b + put, LEN - put, 0)) > 0)
		put += (size_t)r;
	r = recv(c, ok, 2, MSG_WAITALL);
	pthread_join(t, NULL);
	if (want_rsocket && !is_rsocket(c)) {
		printf("client: the connected socket is no rsocket\n");
		return 1;
	}
	printf("sent %zu bytes, reply '%s', %s\n", put, ok, is_rsocket(c) ? "rsockets" : "kernel sockets");
	close(c);
	free(b);
	return server_rc || put != LEN || strcmp(ok, "ok") != 0;
}
