/*
 * rsocket_test: rsockets (<rdma/rsocket.h>) over real connections, compiled against
 * Debian's headers and linked -lrdmacm, run through `softrdma run --`
 * (tests-ext/rdmacm/run.sh). A server thread and a client thread in one process (one
 * device connects to itself). Every check asserts what a socket program sees: the bytes
 * read, in order, end of stream, errnos, poll events.
 *
 * Prints "PASS: name" or "FAIL: name (line N: reason)" per check; exits 1 on any failure.
 *
 *   rsocket_test -l            list the groups
 *   rsocket_test -t GROUP      run one group
 *
 * Groups:
 *   stream    1 MiB of a pattern each way through rsend (sizes 1 B to 200 KiB), rsendv
 *             (three buffers) and rwrite, read with rrecv (MSG_WAITALL), rread, rreadv;
 *             MSG_PEEK sees bytes without taking them; rgetpeername / rgetsockname; a
 *             half close (SHUT_WR): the reader gets the rest, then 0, and still sends
 *             back; rclose: the other side reads 0
 *   nonblock  SOCK_NONBLOCK: rconnect EINPROGRESS, rpoll POLLOUT, SO_ERROR 0; rrecv
 *             EAGAIN with nothing to read, rpoll times out (0), then POLLIN with data;
 *             raccept EAGAIN with no connection waiting, rpoll POLLIN on the listener;
 *             rselect (a timeout, writable, readable); rfcntl F_GETFL / F_SETFL
 *   refused   rconnect to a port nobody listens on: ECONNREFUSED (blocking), and
 *             (non-blocking) POLLERR with SO_ERROR ECONNREFUSED
 *   options   SO_RCVBUF / SO_SNDBUF (doubled, as rsockets and Linux report), SOL_RDMA
 *             sizes before the connection and EINVAL after, TCP_NODELAY, SO_KEEPALIVE
 *             with TCP_KEEPIDLE, unknown options ENOTSUP, SOCK_DGRAM and AF_UNIX
 *             ENOTSUP, calls on a descriptor that is no rsocket EBADF
 *   iomap     riomap of a server buffer (RDMA_IOMAPSIZE 1), offered with the next send;
 *             the client's riowrite lands in it (checked byte by byte) with no receive
 *             on the server's side; a write past the mapping stops at its end
 *   many      8 connections at once on one listener, each carrying its own pattern
 *   closewait rclose while another thread waits in rrecv on the socket: that thread
 *             returns (end of stream or EBADF), later calls EBADF, the peer reads 0
 *   halfopen  a connection request that never completes its handshake (an rdma_cm id
 *             without a QP takes the listener's REP and never sends the RTU) does not
 *             stall a non-blocking listener: a legitimate rconnect is accepted within a
 *             bounded number of polls, carries data, and raccept never returns the
 *             half-open one
 *   peerdeath the peer, a forked process (its own device), is killed with SIGKILL while
 *             this side waits in rrecv with nothing in flight: rrecv returns 0 (end of stream) or -1 with
 *             ECONNRESET, as rdma-core's does when the dead process's kernel sends its
 *             DREQ (softrdma's device keepalive finds the silent peer lost); an alarm
 *             fails the group if rrecv still waits after 15 s
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>
#include <rdma/rdma_cma.h>
#include <rdma/rsocket.h>

static int failures;
static const char *current;

#define CHECK(cond, ...)                                                        \
	do {                                                                    \
		if (!(cond)) {                                                  \
			printf("FAIL: %s (line %d: ", current, __LINE__);       \
			printf(__VA_ARGS__);                                    \
			printf(")\n");                                          \
			fflush(stdout);                                         \
			failures++;                                             \
			return -1;                                              \
		}                                                               \
	} while (0)

static void pass(const char *what)
{
	printf("PASS: %s: %s\n", current, what);
	fflush(stdout);
}

static uint16_t port_base(void)
{
	return (uint16_t)(21000 + (getpid() % 4000) * 2);
}

static struct sockaddr_in addr_of(uint16_t port)
{
	struct sockaddr_in a;

	memset(&a, 0, sizeof a);
	a.sin_family = AF_INET;
	a.sin_port = htons(port);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

static uint8_t pattern(size_t i, unsigned seed)
{
	return (uint8_t)((i * 131 + seed * 17 + (i >> 9)) & 0xff);
}

static int listener(uint16_t port, int flags)
{
	struct sockaddr_in a = addr_of(port);
	int s, one = 1;

	s = rsocket(AF_INET, SOCK_STREAM | flags, 0);
	if (s < 0)
		return -1;
	rsetsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (rbind(s, (struct sockaddr *)&a, sizeof a) || rlisten(s, 8)) {
		rclose(s);
		return -1;
	}
	return s;
}

static int connect_to(uint16_t port)
{
	struct sockaddr_in a = addr_of(port);
	int s = rsocket(AF_INET, SOCK_STREAM, 0);

	if (s < 0)
		return -1;
	if (rconnect(s, (struct sockaddr *)&a, sizeof a)) {
		int e = errno;
		rclose(s);
		errno = e;
		return -1;
	}
	return s;
}

/* Read exactly n bytes or fail. */
static int read_all(int s, uint8_t *buf, size_t n)
{
	size_t got = 0;

	while (got < n) {
		ssize_t r = rrecv(s, buf + got, n - got, MSG_WAITALL);
		if (r <= 0)
			return -1;
		got += (size_t)r;
	}
	return 0;
}

static int write_all(int s, const uint8_t *buf, size_t n)
{
	size_t put = 0;

	while (put < n) {
		ssize_t r = rsend(s, buf + put, n - put, 0);
		if (r <= 0)
			return -1;
		put += (size_t)r;
	}
	return 0;
}

/* ---- stream ------------------------------------------------------------------------ */

#define STREAM_LEN (1 << 20)

struct server_arg {
	int lsock;
	int rc;
	uint8_t *buf;
};

static int stream_server(struct server_arg *a)
{
	struct sockaddr_in peer;
	socklen_t plen = sizeof peer;
	uint8_t *buf = a->buf, peek[16];
	int s, i;
	ssize_t r, first;
	struct iovec iov[1];

	s = raccept(a->lsock, (struct sockaddr *)&peer, &plen);
	CHECK(s >= 0, "raccept: %s", strerror(errno));
	CHECK(plen == sizeof peer && peer.sin_family == AF_INET, "raccept address len %u", plen);

	/* MSG_PEEK: the first bytes, twice, then read for real. */
	/* rsockets' peek takes what has arrived and ignores MSG_WAITALL (rdma-core's rrecv
	 * leaves its loop after one peek), and the client sends 1, 2, 4, ... bytes: the
	 * first peek may see fewer than 16, the second at least what the first saw. */
	r = rrecv(s, peek, sizeof peek, MSG_PEEK | MSG_WAITALL);
	CHECK(r > 0, "peek: %zd %s", r, strerror(errno));
	for (i = 0; i < r; i++)
		CHECK(peek[i] == pattern(i, 1), "peeked byte %d is %u", i, peek[i]);
	first = r < 4 ? r : 4;
	memset(peek, 0, sizeof peek);
	r = rrecv(s, peek, 4, MSG_PEEK);
	CHECK(r >= first && r <= 4, "second peek %zd, the first saw %zd", r, first);
	for (i = 0; i < r; i++)
		CHECK(peek[i] == pattern(i, 1), "second peek: byte %d is %u", i, peek[i]);

	/* the first half by rrecv, then rread and rreadv */
	CHECK(read_all(s, buf, STREAM_LEN / 2) == 0, "rrecv: %s", strerror(errno));
	size_t got = STREAM_LEN / 2;
	while (got < 3 * (STREAM_LEN / 4)) {
		r = rread(s, buf + got, 3 * (STREAM_LEN / 4) - got);
		CHECK(r > 0, "rread %zd: %s", r, strerror(errno));
		got += (size_t)r;
	}
	while (got < STREAM_LEN) {
		iov[0].iov_base = buf + got;
		iov[0].iov_len = STREAM_LEN - got;
		r = rreadv(s, iov, 1);
		CHECK(r > 0, "rreadv %zd: %s", r, strerror(errno));
		got += (size_t)r;
	}
	for (i = 0; i < STREAM_LEN; i++)
		CHECK(buf[i] == pattern(i, 1), "byte %d is %u, want %u", i, buf[i], pattern(i, 1));
	pass("1 MiB in order through rsend, rsendv and rwrite; read by rrecv, rread, rreadv; MSG_PEEK leaves bytes");

	/* The client shuts its sending down: end of stream, then we still send. */
	r = rrecv(s, peek, sizeof peek, 0);
	CHECK(r == 0, "after SHUT_WR the reader gets %zd (%s), not 0", r, strerror(errno));
	r = rrecv(s, peek, sizeof peek, 0);
	CHECK(r == 0, "end of stream again: %zd", r);
	pass("SHUT_WR: the reader gets every byte, then 0, twice");

	for (i = 0; i < STREAM_LEN; i++)
		buf[i] = pattern(i, 2);
	CHECK(write_all(s, buf, STREAM_LEN) == 0, "send back after the peer's SHUT_WR: %s", strerror(errno));
	CHECK(rclose(s) == 0, "rclose");
	a->rc = 0;
	return 0;
}

static void *stream_server_thread(void *p)
{
	struct server_arg *a = p;

	a->rc = -1;
	stream_server(a);
	return NULL;
}

static int run_stream(void)
{
	uint16_t port = port_base();
	struct server_arg sa = { .rc = -1 };
	struct sockaddr_in me, peer;
	socklen_t len;
	pthread_t t;
	uint8_t *buf, *back;
	size_t off = 0, n;
	int s, round = 0;
	ssize_t r;

	buf = malloc(STREAM_LEN);
	back = malloc(STREAM_LEN);
	sa.buf = malloc(STREAM_LEN);
	CHECK(buf && back && sa.buf, "malloc");
	for (size_t i = 0; i < STREAM_LEN; i++)
		buf[i] = pattern(i, 1);
	sa.lsock = listener(port, 0);
	CHECK(sa.lsock >= 0, "listener: %s", strerror(errno));
	pthread_create(&t, NULL, stream_server_thread, &sa);
	s = connect_to(port);
	CHECK(s >= 0, "rconnect: %s", strerror(errno));

	len = sizeof me;
	CHECK(rgetsockname(s, (struct sockaddr *)&me, &len) == 0 && len == sizeof me, "rgetsockname");
	len = sizeof peer;
	CHECK(rgetpeername(s, (struct sockaddr *)&peer, &len) == 0 && len == sizeof peer, "rgetpeername");
	CHECK(peer.sin_family == AF_INET && ntohs(peer.sin_port) == port, "peer port %u, want %u",
	      ntohs(peer.sin_port), port);
	CHECK(me.sin_family == AF_INET && me.sin_port != 0, "own port %u", ntohs(me.sin_port));
	pass("rgetsockname / rgetpeername");

	/* sizes from 1 byte up, through the three send calls in turn */
	while (off < STREAM_LEN) {
		n = (size_t)1 << (round % 18);
		if (n > 200000)
			n = 200000;
		if (n > STREAM_LEN - off)
			n = STREAM_LEN - off;
		if (round % 3 == 0) {
			r = rsend(s, buf + off, n, 0);
		} else if (round % 3 == 1) {
			struct iovec iov[3];
			size_t a = n / 3, b = n / 3;
			iov[0].iov_base = buf + off;
			iov[0].iov_len = a;
			iov[1].iov_base = buf + off + a;
			iov[1].iov_len = b;
			iov[2].iov_base = buf + off + a + b;
			iov[2].iov_len = n - a - b;
			r = rwritev(s, iov, 3);
		} else {
			r = rwrite(s, buf + off, n);
		}
		CHECK(r > 0, "send round %d: %zd %s", round, r, strerror(errno));
		off += (size_t)r;
		round++;
	}
	CHECK(rshutdown(s, SHUT_WR) == 0, "rshutdown SHUT_WR: %s", strerror(errno));
	CHECK(read_all(s, back, STREAM_LEN) == 0, "read back after SHUT_WR: %s", strerror(errno));
	for (size_t i = 0; i < STREAM_LEN; i++)
		CHECK(back[i] == pattern(i, 2), "returned byte %zu is %u", i, back[i]);
	pass("after our SHUT_WR, 1 MiB still comes back in order");
	r = rrecv(s, back, 16, 0);
	CHECK(r == 0, "after the peer's rclose: %zd (%s), want 0", r, strerror(errno));
	pass("the peer's rclose: the reader gets 0");
	pthread_join(t, NULL);
	CHECK(sa.rc == 0, "server side failed");
	CHECK(rclose(s) == 0, "rclose");
	CHECK(rclose(sa.lsock) == 0, "rclose listener");
	free(buf);
	free(back);
	free(sa.buf);
	return 0;
}

/* ---- nonblock ---------------------------------------------------------------------- */

static int run_nonblock(void)
{
	uint16_t port = port_base() + 1;
	struct sockaddr_in a = addr_of(port);
	struct pollfd p;
	int l, c, s = -1, err, i, fl;
	socklen_t len = sizeof err;
	uint8_t b[64];
	ssize_t r;

	l = listener(port, SOCK_NONBLOCK);
	CHECK(l >= 0, "listener: %s", strerror(errno));
	fl = rfcntl(l, F_GETFL);
	CHECK(fl >= 0 && (fl & O_NONBLOCK), "F_GETFL 0x%x", fl);
	r = raccept(l, NULL, NULL);
	CHECK(r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "raccept with none waiting: %zd %s",
	      r, strerror(errno));
	pass("SOCK_NONBLOCK listener: raccept EAGAIN with no connection waiting");

	c = rsocket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	CHECK(c >= 0, "rsocket");
	r = rconnect(c, (struct sockaddr *)&a, sizeof a);
	CHECK(r == 0 || errno == EINPROGRESS, "rconnect: %zd %s", r, strerror(errno));
	/* the listener becomes readable; the connect completes */
	p.fd = l;
	p.events = POLLIN;
	for (i = 0; i < 100 && s < 0; i++) {
		if (rpoll(&p, 1, 100) == 1 && (p.revents & POLLIN))
			s = raccept(l, NULL, NULL);
		struct pollfd q = { .fd = c, .events = POLLOUT };
		rpoll(&q, 1, 0);
	}
	CHECK(s >= 0, "no connection to accept: %s", strerror(errno));
	p.fd = c;
	p.events = POLLOUT;
	for (i = 0; i < 100; i++)
		if (rpoll(&p, 1, 100) == 1)
			break;
	CHECK(p.revents & POLLOUT, "connecting socket revents 0x%x", p.revents);
	CHECK(rgetsockopt(c, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0, "SO_ERROR %d", err);
	pass("rconnect EINPROGRESS, rpoll POLLOUT, SO_ERROR 0; rpoll POLLIN on the listener");

	CHECK(rfcntl(s, F_SETFL, O_NONBLOCK) == 0, "F_SETFL");
	r = rrecv(s, b, sizeof b, 0);
	CHECK(r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "rrecv with nothing: %zd %s", r,
	      strerror(errno));
	p.fd = s;
	p.events = POLLIN;
	CHECK(rpoll(&p, 1, 50) == 0, "rpoll with nothing to read returned events 0x%x", p.revents);
	pass("nothing to read: rrecv EAGAIN, rpoll times out");

	{
		fd_set rd, wr;
		struct timeval tv = { .tv_sec = 0, .tv_usec = 50000 };
		FD_ZERO(&rd);
		FD_SET(s, &rd);
		CHECK(rselect(s + 1, &rd, NULL, NULL, &tv) == 0 && !FD_ISSET(s, &rd),
		      "rselect with nothing to read");
		FD_ZERO(&wr);
		FD_SET(c, &wr);
		tv.tv_sec = 5;
		CHECK(rselect(c + 1, NULL, &wr, NULL, &tv) == 1 && FD_ISSET(c, &wr), "rselect writable");
	}
	pass("rselect: times out with nothing to read; a connected socket is writable");

	memset(b, 0x5a, sizeof b);
	r = rsend(c, b, 10, 0);
	CHECK(r == 10, "rsend %zd %s", r, strerror(errno));
	{
		fd_set rd;
		struct timeval tv = { .tv_sec = 5, .tv_usec = 0 };
		FD_ZERO(&rd);
		FD_SET(s, &rd);
		CHECK(rselect(s + 1, &rd, NULL, NULL, &tv) == 1 && FD_ISSET(s, &rd), "rselect after data");
	}
	p.events = POLLIN;
	CHECK(rpoll(&p, 1, 5000) == 1 && (p.revents & POLLIN), "rpoll after data: 0x%x", p.revents);
	memset(b, 0, sizeof b);
	r = rrecv(s, b, sizeof b, MSG_DONTWAIT);
	CHECK(r == 10 && b[0] == 0x5a && b[9] == 0x5a && b[10] == 0, "rrecv %zd", r);
	pass("data: rpoll POLLIN, rrecv returns what was sent");

	rclose(c);
	p.events = POLLIN;
	CHECK(rpoll(&p, 1, 5000) == 1, "rpoll after the peer closed");
	r = rrecv(s, b, sizeof b, 0);
	CHECK(r == 0, "after the peer closed: %zd %s", r, strerror(errno));
	pass("the peer's rclose: readable, rrecv 0");
	rclose(s);
	rclose(l);
	return 0;
}

/* ---- refused ----------------------------------------------------------------------- */

static int run_refused(void)
{
	uint16_t port = port_base() + 2;
	struct sockaddr_in a = addr_of(port);
	struct pollfd p;
	int s, err = 0, i;
	socklen_t len = sizeof err;

	s = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(s >= 0, "rsocket");
	CHECK(rconnect(s, (struct sockaddr *)&a, sizeof a) == -1 && errno == ECONNREFUSED,
	      "blocking rconnect: %s", strerror(errno));
	rclose(s);
	pass("blocking rconnect to a closed port: ECONNREFUSED");

	s = rsocket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	CHECK(s >= 0, "rsocket");
	i = rconnect(s, (struct sockaddr *)&a, sizeof a);
	CHECK(i == -1 && (errno == EINPROGRESS || errno == ECONNREFUSED), "rconnect: %d %s", i,
	      strerror(errno));
	p.fd = s;
	p.events = POLLOUT;
	for (i = 0; i < 100; i++)
		if (rpoll(&p, 1, 100) == 1)
			break;
	CHECK(p.revents & POLLERR, "revents 0x%x", p.revents);
	CHECK(rgetsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == ECONNREFUSED,
	      "SO_ERROR %d", err);
	CHECK(rsend(s, "x", 1, 0) == -1, "rsend on a refused socket succeeded");
	rclose(s);
	pass("non-blocking: POLLERR, SO_ERROR ECONNREFUSED, sends fail");
	return 0;
}

/* ---- options ----------------------------------------------------------------------- */

static int run_options(void)
{
	uint16_t port = port_base() + 3;
	int s, l, c, v, r;
	socklen_t len;

	CHECK(rsocket(AF_INET, SOCK_DGRAM, 0) == -1 && errno == ENOTSUP, "SOCK_DGRAM: %s", strerror(errno));
	CHECK(rsocket(AF_UNIX, SOCK_STREAM, 0) == -1 && errno == ENOTSUP, "AF_UNIX: %s", strerror(errno));
	CHECK(rsocket(AF_INET, SOCK_STREAM, IPPROTO_UDP) == -1 && errno == ENOTSUP, "UDP protocol");
	CHECK(rsend(12345, "x", 1, 0) == -1 && errno == EBADF, "rsend on no rsocket: %s", strerror(errno));
	CHECK(rrecv(0, &v, 1, 0) == -1 && errno == EBADF, "rrecv on stdin: %s", strerror(errno));
	CHECK(rlisten(12345, 1) == -1 && errno == EBADF, "rlisten");
	pass("unsupported types ENOTSUP; descriptors that are no rsocket EBADF");

	s = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(s >= 0, "rsocket");
	v = 65536;
	CHECK(rsetsockopt(s, SOL_SOCKET, SO_RCVBUF, &v, sizeof v) == 0, "SO_RCVBUF");
	v = 32768;
	CHECK(rsetsockopt(s, SOL_SOCKET, SO_SNDBUF, &v, sizeof v) == 0, "SO_SNDBUF");
	len = sizeof v;
	CHECK(rgetsockopt(s, SOL_SOCKET, SO_RCVBUF, &v, &len) == 0 && v == 131072, "SO_RCVBUF reads %d", v);
	CHECK(rgetsockopt(s, SOL_SOCKET, SO_SNDBUF, &v, &len) == 0 && v == 65536, "SO_SNDBUF reads %d", v);
	v = 100;
	CHECK(rsetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &v, sizeof v) == 0, "RDMA_SQSIZE");
	CHECK(rgetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &v, &len) == 0 && v == 100, "RDMA_SQSIZE reads %d", v);
	v = 1;
	CHECK(rsetsockopt(s, IPPROTO_TCP, TCP_NODELAY, &v, sizeof v) == 0, "TCP_NODELAY");
	v = 0;
	CHECK(rgetsockopt(s, IPPROTO_TCP, TCP_NODELAY, &v, &len) == 0 && v == 1, "TCP_NODELAY reads %d", v);
	v = 1;
	CHECK(rsetsockopt(s, SOL_SOCKET, SO_KEEPALIVE, &v, sizeof v) == 0, "SO_KEEPALIVE");
	v = 30;
	CHECK(rsetsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &v, sizeof v) == 0, "TCP_KEEPIDLE");
	CHECK(rgetsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &v, &len) == 0 && v == 30, "TCP_KEEPIDLE reads %d", v);
	v = 0;
	CHECK(rsetsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &v, sizeof v) == -1 && errno == EINVAL, "TCP_KEEPIDLE 0");
	CHECK(rsetsockopt(s, SOL_SOCKET, SO_PRIORITY, &v, sizeof v) == -1 && errno == ENOTSUP, "SO_PRIORITY");
	r = rgetsockopt(s, SOL_SOCKET, SO_PRIORITY, &v, &len);
	CHECK(r == -1 && errno == ENOTSUP, "get SO_PRIORITY: %d", r);
	pass("buffer sizes read back doubled; SOL_RDMA sizes; TCP_NODELAY; keepalive; unknown options ENOTSUP");

	/* The sizes hold for the connection; SOL_RDMA cannot change once connected. */
	l = listener(port, 0);
	CHECK(l >= 0, "listener: %s", strerror(errno));
	c = -1;
	{
		struct sockaddr_in a = addr_of(port);
		CHECK(rconnect(s, (struct sockaddr *)&a, sizeof a) == 0, "rconnect: %s", strerror(errno));
	}
	c = raccept(l, NULL, NULL);
	CHECK(c >= 0, "raccept");
	v = 64;
	CHECK(rsetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &v, sizeof v) == -1 && errno == EINVAL,
	      "RDMA_SQSIZE after connect: %s", strerror(errno));
	CHECK(rsend(s, "hello", 5, 0) == 5, "rsend");
	{
		char b[8] = { 0 };
		CHECK(rrecv(c, b, 5, MSG_WAITALL) == 5 && !memcmp(b, "hello", 5), "rrecv '%s'", b);
	}
	pass("RDMA_SQSIZE after the connection: EINVAL; the connection with the sizes set works");
	rclose(s);
	rclose(c);
	rclose(l);
	return 0;
}

/* ---- iomap ------------------------------------------------------------------------- */

#define MAP_LEN 65536

struct iomap_arg {
	int lsock;
	int rc;
};

static int iomap_server(struct iomap_arg *a)
{
	uint8_t *buf = mmap(NULL, MAP_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	uint8_t c = 0;
	int s, i;
	off_t off;

	CHECK(buf != MAP_FAILED, "mmap");
	s = raccept(a->lsock, NULL, NULL);
	CHECK(s >= 0, "raccept");
	off = riomap(s, buf, MAP_LEN, PROT_WRITE, 0, 0);
	CHECK(off == 0, "riomap: %lld %s", (long long)off, strerror(errno));
	/* the offer goes with this send */
	CHECK(rsend(s, "m", 1, 0) == 1, "rsend");
	/* the client says it is done (its direct writes precede this on the connection) */
	CHECK(rrecv(s, &c, 1, MSG_WAITALL) == 1 && c == 'd', "rrecv done marker %u", c);
	for (i = 0; i < MAP_LEN; i++)
		CHECK(buf[i] == pattern(i, 3), "mapped byte %d is %u, want %u", i, buf[i], pattern(i, 3));
	CHECK(riounmap(s, buf, MAP_LEN) == 0, "riounmap");
	CHECK(riounmap(s, buf, MAP_LEN) == -1 && errno == EINVAL, "second riounmap");
	rclose(s);
	munmap(buf, MAP_LEN);
	a->rc = 0;
	return 0;
}

static void *iomap_server_thread(void *p)
{
	struct iomap_arg *a = p;

	a->rc = -1;
	iomap_server(a);
	return NULL;
}

static int run_iomap(void)
{
	uint16_t port = port_base() + 4;
	struct iomap_arg ia = { .rc = -1 };
	struct sockaddr_in a = addr_of(port);
	uint8_t *src = malloc(MAP_LEN + 4096), m = 0;
	pthread_t t;
	size_t w;
	int s, v = 1;

	CHECK(src != NULL, "malloc");
	for (int i = 0; i < MAP_LEN + 4096; i++)
		src[i] = pattern(i, 3);
	ia.lsock = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(ia.lsock >= 0, "rsocket");
	CHECK(rsetsockopt(ia.lsock, SOL_RDMA, RDMA_IOMAPSIZE, &v, sizeof v) == 0, "listener iomap size");
	CHECK(rbind(ia.lsock, (struct sockaddr *)&a, sizeof a) == 0 && rlisten(ia.lsock, 1) == 0,
	      "listen: %s", strerror(errno));
	pthread_create(&t, NULL, iomap_server_thread, &ia);
	s = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(s >= 0, "rsocket");
	CHECK(rsetsockopt(s, SOL_RDMA, RDMA_IOMAPSIZE, &v, sizeof v) == 0, "iomap size");
	CHECK(rconnect(s, (struct sockaddr *)&a, sizeof a) == 0, "rconnect: %s", strerror(errno));
	CHECK(rrecv(s, &m, 1, MSG_WAITALL) == 1 && m == 'm', "offer marker");
	/* in pieces, the last one running past the mapping's end */
	w = riowrite(s, src, 1000, 0, 0);
	CHECK(w == 1000, "riowrite 1000: %zd %s", (ssize_t)w, strerror(errno));
	w = riowrite(s, src + 1000, 40000, 1000, 0);
	CHECK(w == 40000, "riowrite 40000: %zd", (ssize_t)w);
	w = riowrite(s, src + 41000, MAP_LEN + 4096 - 41000, 41000, 0);
	CHECK(w == MAP_LEN - 41000, "riowrite past the end wrote %zd, want %d", (ssize_t)w, MAP_LEN - 41000);
	CHECK(rsend(s, "d", 1, 0) == 1, "done marker");
	pthread_join(t, NULL);
	CHECK(ia.rc == 0, "server side failed");
	pass("riowrite lands in the peer's riomap buffer byte for byte; a write past its end stops there");
	rclose(s);
	rclose(ia.lsock);
	free(src);
	return 0;
}

/* ---- many -------------------------------------------------------------------------- */

#define MANY 8
#define MANY_LEN (256 * 1024)

static int many_lsock;
static int many_rc[MANY];

static void *many_client(void *p)
{
	int k = (int)(intptr_t)p, s;
	uint8_t *b = malloc(MANY_LEN);

	many_rc[k] = -1;
	s = connect_to(port_base() + 5);
	if (s < 0 || !b)
		return NULL;
	for (int i = 0; i < MANY_LEN; i++)
		b[i] = pattern(i, 10 + k);
	/* the first byte says who we are */
	b[0] = (uint8_t)k;
	if (write_all(s, b, MANY_LEN) == 0)
		many_rc[k] = 0;
	rclose(s);
	free(b);
	return NULL;
}

static int run_many(void)
{
	pthread_t t[MANY];
	int s[MANY], seen[MANY] = { 0 };
	uint8_t *b = malloc(MANY_LEN);

	CHECK(b != NULL, "malloc");
	many_lsock = listener(port_base() + 5, 0);
	CHECK(many_lsock >= 0, "listener: %s", strerror(errno));
	for (intptr_t k = 0; k < MANY; k++)
		pthread_create(&t[k], NULL, many_client, (void *)k);
	for (int k = 0; k < MANY; k++) {
		s[k] = raccept(many_lsock, NULL, NULL);
		CHECK(s[k] >= 0, "raccept %d: %s", k, strerror(errno));
	}
	for (int k = 0; k < MANY; k++) {
		CHECK(read_all(s[k], b, MANY_LEN) == 0, "read connection %d: %s", k, strerror(errno));
		int who = b[0];
		CHECK(who < MANY && !seen[who], "connection %d says it is %d", k, who);
		seen[who] = 1;
		for (int i = 1; i < MANY_LEN; i++)
			CHECK(b[i] == pattern(i, 10 + who), "connection %d byte %d", who, i);
		CHECK(rrecv(s[k], b, 1, 0) == 0, "connection %d: end of stream", who);
		rclose(s[k]);
	}
	for (int k = 0; k < MANY; k++) {
		pthread_join(t[k], NULL);
		CHECK(many_rc[k] == 0, "client %d failed", k);
	}
	rclose(many_lsock);
	free(b);
	pass("8 connections on one listener, each stream whole and its own");
	return 0;
}

/* ---- closewait --------------------------------------------------------------------- */

static int closewait_sock;
static ssize_t closewait_ret;
static int closewait_errno;

static void *closewait_reader(void *p)
{
	char b[16];

	(void)p;
	closewait_ret = rrecv(closewait_sock, b, sizeof b, 0);
	closewait_errno = errno;
	return NULL;
}

static int run_closewait(void)
{
	uint16_t port = port_base() + 6;
	pthread_t t;
	int l, c;

	l = listener(port, 0);
	CHECK(l >= 0, "listener: %s", strerror(errno));
	c = connect_to(port);
	CHECK(c >= 0, "rconnect: %s", strerror(errno));
	closewait_sock = raccept(l, NULL, NULL);
	CHECK(closewait_sock >= 0, "raccept");
	closewait_ret = 1;
	pthread_create(&t, NULL, closewait_reader, NULL);
	usleep(200000);
	CHECK(rclose(closewait_sock) == 0, "rclose while another thread reads");
	pthread_join(t, NULL);
	CHECK(closewait_ret == 0 || (closewait_ret == -1 && closewait_errno == EBADF),
	      "the waiting reader got %zd (%s)", closewait_ret, strerror(closewait_errno));
	CHECK(rrecv(closewait_sock, &port, 1, 0) == -1 && errno == EBADF, "rrecv after rclose: %s",
	      strerror(errno));
	CHECK(rrecv(c, &port, 1, 0) == 0, "the peer reads end of stream");
	rclose(c);
	rclose(l);
	pass("rclose while another thread waits in rrecv: that reader returns (0 or EBADF), later calls EBADF");
	return 0;
}

/* ---- halfopen ---------------------------------------------------------------------- */

/* A connection request to the listener on `port` that never completes: a synchronous id
 * without a QP sends the REQ with rsockets' connection data (version 1, credits, a
 * target SGL of 2 entries, a 4 KiB buffer) and takes the REP as CONNECT_RESPONSE, but
 * never calls rdma_establish, so no RTU goes out. NULL on failure. */
static struct rdma_cm_id *half_open(uint16_t port)
{
	struct sockaddr_in a = addr_of(port);
	struct rdma_conn_param p;
	struct rdma_cm_id *id;
	uint8_t cd[40];
	uint16_t credits = htons(64);
	uint32_t sgl = htonl(2), len = htonl(4096);

	if (rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP))
		return NULL;
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&a, 2000) ||
	    rdma_resolve_route(id, 2000))
		goto err;
	memset(cd, 0, sizeof cd);
	cd[0] = 1;
	memcpy(cd + 2, &credits, 2);
	memcpy(cd + 20, &sgl, 4);
	memcpy(cd + 36, &len, 4);
	memset(&p, 0, sizeof p);
	p.private_data = cd;
	p.private_data_len = sizeof cd;
	p.responder_resources = 1;
	p.initiator_depth = 1;
	p.flow_control = 1;
	p.retry_count = 7;
	p.rnr_retry_count = 7;
	p.qp_num = 0xabcdef;
	if (rdma_connect(id, &p) || !id->event || id->event->event != RDMA_CM_EVENT_CONNECT_RESPONSE)
		goto err;
	return id;
err:
	rdma_destroy_id(id);
	return NULL;
}

static int run_halfopen(void)
{
	uint16_t port = port_base() + 7;
	struct sockaddr_in a = addr_of(port);
	struct rdma_cm_id *half;
	int l, c, s = -1, i, err = -1, connected = 0;
	socklen_t len = sizeof err;
	uint8_t b[16];
	ssize_t r;

	l = listener(port, SOCK_NONBLOCK);
	CHECK(l >= 0, "listener: %s", strerror(errno));
	half = half_open(port);
	CHECK(half, "the half-open request: %s", strerror(errno));
	pass("a request that never sends its RTU got the listener's REP");

	c = rsocket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	CHECK(c >= 0, "rsocket");
	r = rconnect(c, (struct sockaddr *)&a, sizeof a);
	CHECK(r == 0 || errno == EINPROGRESS, "rconnect: %zd %s", r, strerror(errno));
	/* 20 rounds of two 250 ms polls at most (the half-open request's REP times out
	 * only after a minute) */
	for (i = 0; i < 20 && (s < 0 || !connected); i++) {
		struct pollfd p = { .fd = l, .events = POLLIN };
		struct pollfd q = { .fd = c, .events = POLLOUT };

		if (s < 0 && rpoll(&p, 1, 250) == 1 && (p.revents & POLLIN))
			s = raccept(l, NULL, NULL);
		if (!connected && rpoll(&q, 1, 250) == 1 && (q.revents & POLLOUT))
			connected = 1;
	}
	CHECK(s >= 0 && connected, "the listener stalled: accepted %d, connected %d", s, connected);
	CHECK(rgetsockopt(c, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0, "SO_ERROR %d", err);
	r = raccept(l, NULL, NULL);
	CHECK(r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "a second raccept: %zd %s", r,
	      strerror(errno));
	pass("a legitimate rconnect is accepted behind it; raccept never returns the half-open one");

	memset(b, 0x3c, sizeof b);
	CHECK(rfcntl(s, F_SETFL, 0) == 0 && rfcntl(c, F_SETFL, 0) == 0, "F_SETFL");
	CHECK(rsend(c, b, sizeof b, 0) == sizeof b, "rsend: %s", strerror(errno));
	memset(b, 0, sizeof b);
	CHECK(read_all(s, b, sizeof b) == 0 && b[0] == 0x3c && b[15] == 0x3c, "the bytes");
	pass("the accepted connection carries data");
	rclose(c);
	rclose(s);
	rclose(l);
	rdma_destroy_id(half);
	return 0;
}

/* ---- peerdeath -------------------------------------------------------------------- */

static int peerdeath_sock;
static ssize_t peerdeath_ret;
static int peerdeath_errno;

static void *peerdeath_reader(void *p)
{
	char b[16];

	(void)p;
	errno = 0;
	peerdeath_ret = rrecv(peerdeath_sock, b, sizeof b, 0);
	peerdeath_errno = errno;
	return NULL;
}

static void peerdeath_alarm(int sig)
{
	static const char msg[] = "FAIL: peerdeath (rrecv still waits 15 s after the peer was killed)\n";

	(void)sig;
	if (write(1, msg, sizeof msg - 1) < 0)
		_exit(1);
	_exit(1);
}

static int run_peerdeath(void)
{
	uint16_t port = port_base() + 8;
	int ready[2], l, s;
	pthread_t t;
	char b[1];
	pid_t pid;

	CHECK(pipe(ready) == 0, "pipe: %s", strerror(errno));
	/* Forked before any rsocket call: the child opens a device of its own. */
	pid = fork();
	CHECK(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		close(ready[0]);
		l = listener(port, 0);
		if (l < 0 || write(ready[1], "L", 1) != 1)
			_exit(1);
		s = raccept(l, NULL, NULL);
		if (s < 0 || write(ready[1], "A", 1) != 1)
			_exit(1);
		for (;;)
			pause();
	}
	close(ready[1]);
	CHECK(read(ready[0], b, 1) == 1 && b[0] == 'L', "the peer did not listen");
	peerdeath_sock = connect_to(port);
	CHECK(peerdeath_sock >= 0, "rconnect: %s", strerror(errno));
	CHECK(read(ready[0], b, 1) == 1 && b[0] == 'A', "the peer did not accept");
	pthread_create(&t, NULL, peerdeath_reader, NULL);
	/* The reader settles in rrecv (what it sends on the way, credits, is acknowledged
	 * by the live peer): then nothing is in flight when the peer dies. */
	usleep(500000);
	CHECK(kill(pid, SIGKILL) == 0, "kill: %s", strerror(errno));
	CHECK(waitpid(pid, NULL, 0) == pid, "waitpid: %s", strerror(errno));
	signal(SIGALRM, peerdeath_alarm);
	alarm(15);
	pthread_join(t, NULL);
	alarm(0);
	CHECK(peerdeath_ret == 0 || (peerdeath_ret == -1 && peerdeath_errno == ECONNRESET),
	      "rrecv returned %zd (%s)", peerdeath_ret, strerror(peerdeath_errno));
	rclose(peerdeath_sock);
	pass("an idle rrecv returns (0 or ECONNRESET) once the peer process is killed with SIGKILL");
	return 0;
}

static const struct {
	const char *name;
	int (*run)(void);
} groups[] = {
	{ "stream", run_stream },   { "nonblock", run_nonblock }, { "refused", run_refused },
	{ "options", run_options }, { "iomap", run_iomap },       { "many", run_many },
	{ "closewait", run_closewait }, { "halfopen", run_halfopen },
	{ "peerdeath", run_peerdeath },
};

int main(int argc, char **argv)
{
	size_t i;

	if (argc == 2 && !strcmp(argv[1], "-l")) {
		for (i = 0; i < sizeof groups / sizeof groups[0]; i++)
			printf("%s\n", groups[i].name);
		return 0;
	}
	if (argc != 3 || strcmp(argv[1], "-t")) {
		fprintf(stderr, "usage: rsocket_test -l | -t GROUP\n");
		return 2;
	}
	for (i = 0; i < sizeof groups / sizeof groups[0]; i++) {
		if (!strcmp(argv[2], groups[i].name)) {
			current = groups[i].name;
			groups[i].run();
			return failures ? 1 : 0;
		}
	}
	fprintf(stderr, "no group %s\n", argv[2]);
	return 2;
}
