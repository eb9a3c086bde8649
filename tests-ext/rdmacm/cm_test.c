/*
 * cm_test: the rdma_cm API over real connections, compiled against Debian's
 * <rdma/rdma_cma.h> and <rdma/rdma_verbs.h> and linked -lrdmacm -libverbs, run through
 * `softrdma run --` (tests-ext/rdmacm/run.sh). Every check asserts what a program sees on
 * Linux: bytes in target memory, completion status and order, event types, status and
 * private data, errnos.
 *
 * Prints "PASS: name" or "FAIL: name (line N: reason)" per check ("SKIP: ..." for a half
 * the host cannot run), "OUT: ..." lines with what was seen; exits 1 on any failure.
 *
 *   cm_test -l            list the groups
 *   cm_test -t GROUP      run one group (each group is meant to run in its own process)
 *
 * Two-sided groups start their peer as a second process (this program again, with
 * -r client -a ARG) unless they say "threads": each process is one softrdma device, so
 * the process groups cross devices and the thread group connects a device to itself.
 *
 * Groups:
 *   connect     event-driven client and server in two processes: private data limits
 *               (56 bytes connect, 57 EINVAL; 196 accept, 197 EINVAL and the peer is
 *               rejected), the CONNECT_REQUEST's resources, retry counts and flow control as
 *               the client set them, ESTABLISHED on both sides, SEND/RECV, RDMA WRITE and
 *               READ with data and completion order checked; the client disconnects: one
 *               DISCONNECTED each side, receives flush (the other side's when it calls
 *               rdma_disconnect on DISCONNECTED: librdmacm leaves the QP until then). Each
 *               side's connected QP (the server's made on CONNECT_REQUEST) has CQs on a
 *               completion channel of the program's and a thread that blocks in
 *               ibv_get_cq_event, acks, re-arms and polls, as rping's does; the flushed
 *               receive ends it, then CQs and channel are destroyed
 *   sdisconnect the same, the server disconnects
 *   threads     the same in one process, two threads with an event channel each (one
 *               device connects to itself), the server disconnects
 *   inflight    disconnect mid-transfer: the client posts 64 RDMA WRITEs and SENDs of 4 KiB
 *               back to back; the server has 8 receives posted, so the ninth SEND meets RNR
 *               (retried without end) and the WRs after it stay in flight, and disconnects
 *               after its 8th receive: one DISCONNECTED each side; nothing of the client's
 *               fails before it calls rdma_disconnect, then each WR completes once, in
 *               order, successes (at least to the eighth SEND, at most to the ninth) then
 *               IBV_WC_WR_FLUSH_ERR; the SENDs' bytes, the WRITEs before each and every WRITE
 *               the client saw succeed (it says on a pipe) are in the server's memory
 *   cinflight   the same, the client disconnects right after posting: its WRs and the
 *               server's receives each complete once, successes then flushed; every SEND the
 *               client saw succeed was received
 *   verbs       rdma_getaddrinfo(RAI_PASSIVE) / rdma_create_ep / rdma_listen /
 *               rdma_get_request / rdma_accept on synchronous ids with rdma_verbs.h's
 *               rdma_reg_msgs, rdma_reg_read, rdma_post_recv/send, rdma_get_send/recv_comp,
 *               as rdma_server and rdma_client do; the server sends two regions' addresses
 *               and rkeys, the client rdma_post_write's into one, rdma_post_read's it back
 *               and the other (completions in order, wr_id the context given); the client
 *               checks what it read, the server its memory after the client's last SEND
 *   reject      rdma_reject with private data: REJECTED, status 28, the data; 149 bytes EINVAL
 *   noport      127.0.0.1 on a port nobody listens on: REJECTED, status 8
 *   unreachable a peer that never answers (a UDP socket this test holds on port 4791):
 *               UNREACHABLE, status -ETIMEDOUT, after 1 + SOFTRDMA_CM_RETRIES REQs
 *   listen2     two binds/listens on one port: EADDRNOTAVAIL (wildcard or loopback),
 *               EADDRINUSE (the same specific address), in one process and across two;
 *               REUSEADDR binds share a port, but none listens while another shares it
 *   wildcard    a wildcard listener on port 0: rdma_get_src_port, reached at 127.0.0.1
 *               and at the host's own address from another process
 *   initqp      QPs made with ibv_create_qp and moved by the program with
 *               rdma_init_qp_attr; rdma_accept / rdma_establish without an id QP
 *   migrate     rdma_migrate_id moves an id and its waiting events; O_NONBLOCK channel
 *               fd: EAGAIN when empty; poll() readable while an event waits
 *   options     rdma_set_option TOS, REUSEADDR, AFONLY, ACK_TIMEOUT (state rules, optlen,
 *               unknown options) and their effect on the route and QP attributes
 *   ud          RDMA_PS_UDP ids: SIDR; ESTABLISHED's ud param (peer QPN, Q_Key 0x01234567,
 *               an address vector) carries a UD SEND to the peer
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#define EV_MS 10000     /* the longest wait for one CM event */
#define WC_MS 10000     /* the longest wait for one completion */
#define DRAIN_MS 300    /* how long to look for events that must not come */
#define PEER_S 60       /* the longest wait for the peer process */
#define PROCESS_S 150   /* the whole process */

#define BUF 8192
#define SLOT 256         /* receive slots at 0, 256, 512, 768 */
#define SEND_OFF 1024
#define WRITE_OFF 2048
#define READ_OFF 4096
#define RDMA_LEN 1024

/* What the client asks for and the server answers with. */
#define CLIENT_RESP 5   /* responder_resources */
#define CLIENT_INIT 3   /* initiator_depth */
#define CLIENT_RETRY 6
#define CLIENT_RNR 4
#define SERVER_RESP 2
#define SERVER_INIT 1
#define UDP_QKEY 0x01234567u

static int failures;
static __thread const char *side = "";
static const char *group = "";
static char self_path[PATH_MAX];

/* ------------------------------------------------------------------ checks */

static int check(int ok, const char *name, int line, const char *fmt, ...)
{
	char why[400];
	va_list ap;

	if (ok) {
		printf("PASS: %s%s\n", side, name);
		return 1;
	}
	va_start(ap, fmt);
	vsnprintf(why, sizeof why, fmt, ap);
	va_end(ap);
	printf("FAIL: %s%s (line %d: %s)\n", side, name, line, why);
	__atomic_add_fetch(&failures, 1, __ATOMIC_SEQ_CST);
	return 0;
}

#define CHECK(name, cond, ...) check(!!(cond), name, __LINE__, __VA_ARGS__)

/* A name with a prefix: N("connection 2", "ESTABLISHED") -> "connection 2: ESTABLISHED". */
static const char *N(const char *what, const char *fmt, ...)
{
	static __thread char buf[4][200];
	static __thread int i;
	char *b = buf[i++ % 4];
	int n = snprintf(b, sizeof buf[0], "%s: ", what);
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(b + n, sizeof buf[0] - n, fmt, ap);
	va_end(ap);
	return b;
}

static uint8_t pat(unsigned seed, size_t i)
{
	return (uint8_t)(seed * 37 + i * 11 + 1);
}

static void fill(void *p, size_t n, unsigned seed)
{
	uint8_t *b = p;

	for (size_t i = 0; i < n; i++)
		b[i] = pat(seed, i);
}

/* The first byte that differs from the pattern, or -1. */
static long mismatch(const void *p, size_t n, unsigned seed)
{
	const uint8_t *b = p;

	for (size_t i = 0; i < n; i++)
		if (b[i] != pat(seed, i))
			return (long)i;
	return -1;
}

static long nonzero(const void *p, size_t n)
{
	const uint8_t *b = p;

	for (size_t i = 0; i < n; i++)
		if (b[i])
			return (long)i;
	return -1;
}

static struct sockaddr_in sin_of(const char *ip, int port)
{
	struct sockaddr_in s;

	memset(&s, 0, sizeof s);
	s.sin_family = AF_INET;
	s.sin_port = htons(port);
	inet_pton(AF_INET, ip, &s.sin_addr);
	return s;
}

static const char *ntop(const struct sockaddr *sa, char *b, size_t n)
{
	const struct sockaddr_in *s = (const void *)sa;

	if (!sa || sa->sa_family != AF_INET) {
		snprintf(b, n, "family %d", sa ? sa->sa_family : -1);
		return b;
	}
	inet_ntop(AF_INET, &s->sin_addr, b, n);
	snprintf(b + strlen(b), n - strlen(b), ":%u", ntohs(s->sin_port));
	return b;
}

/* The host's first IPv4 address that is up and not loopback. */
static int host_addr(char *out, size_t n)
{
	struct ifaddrs *l, *a;
	int found = 0;

	if (getifaddrs(&l))
		return 0;
	for (a = l; a && !found; a = a->ifa_next) {
		if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET)
			continue;
		if (!(a->ifa_flags & IFF_UP) || (a->ifa_flags & IFF_LOOPBACK))
			continue;
		inet_ntop(AF_INET, &((struct sockaddr_in *)a->ifa_addr)->sin_addr, out, n);
		found = 1;
	}
	freeifaddrs(l);
	return found;
}

static long ms_since(const struct timespec *t0)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

/* ------------------------------------------------------------------ events */

/* The next event of `ch` within `ms`, or NULL. */
static struct rdma_cm_event *get_event(struct rdma_event_channel *ch, int ms)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	struct rdma_cm_event *e = NULL;

	if (poll(&p, 1, ms) != 1)
		return NULL;
	if (rdma_get_cm_event(ch, &e))
		return NULL;
	return e;
}

/* The next event, which must be `t` with `status`; NULL (after a FAIL) otherwise. */
static struct rdma_cm_event *expect_ms(struct rdma_event_channel *ch, enum rdma_cm_event_type t,
				       int status, const char *what, int ms)
{
	struct rdma_cm_event *e = get_event(ch, ms);

	if (!CHECK(N(what, "%s, status %d", rdma_event_str(t), status),
		   e && e->event == t && e->status == status, "got %s, status %d",
		   e ? rdma_event_str(e->event) : "no event in time", e ? e->status : 0)) {
		if (e)
			rdma_ack_cm_event(e);
		return NULL;
	}
	return e;
}

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type t,
				    int status, const char *what)
{
	return expect_ms(ch, t, status, what, EV_MS);
}

/* Events that arrive within DRAIN_MS: none may be `t`; TIMEWAIT_EXIT is allowed, other
 * events are failures too. */
static void expect_no_more(struct rdma_event_channel *ch, enum rdma_cm_event_type t, const char *what)
{
	struct rdma_cm_event *e;
	int same = 0, other = 0, n = 0;
	char seen[200] = "";

	while (n < 16 && (e = get_event(ch, DRAIN_MS))) {
		n++;
		if (e->event == t)
			same++;
		else if (e->event != RDMA_CM_EVENT_TIMEWAIT_EXIT)
			other++;
		snprintf(seen + strlen(seen), sizeof seen - strlen(seen), " %s",
			 rdma_event_str(e->event));
		rdma_ack_cm_event(e);
	}
	printf("OUT: %s%s: later events:%s\n", side, what, n ? seen : " none");
	CHECK(N(what, "no second %s and nothing else", rdma_event_str(t)), !same && !other,
	      "later events:%s", seen);
}

/* An id on `ch` in port space `ps` with address and route resolved to ip:port. */
static struct rdma_cm_id *resolved_id(struct rdma_event_channel *ch, enum rdma_port_space ps,
				      const char *ip, int port, const char *what)
{
	struct sockaddr_in dst = sin_of(ip, port);
	struct rdma_cm_event *e;
	struct rdma_cm_id *id = NULL;
	int r, ok;

	r = rdma_create_id(ch, &id, NULL, ps);
	if (!CHECK(N(what, "rdma_create_id"), r == 0, "ret %d errno %d", r, errno))
		return NULL;
	r = rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000);
	if (!CHECK(N(what, "rdma_resolve_addr %s:%d", ip, port), r == 0, "ret %d errno %d", r, errno))
		goto fail;
	e = expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, 0, what);
	if (!e)
		goto fail;
	ok = e->id == id;
	rdma_ack_cm_event(e);
	if (!CHECK(N(what, "ADDR_RESOLVED names the id, which has a device and PD"),
		   ok && id->verbs && id->pd, "id %d verbs %p pd %p", ok, (void *)id->verbs,
		   (void *)id->pd))
		goto fail;
	r = rdma_resolve_route(id, 2000);
	if (!CHECK(N(what, "rdma_resolve_route"), r == 0, "ret %d errno %d", r, errno))
		goto fail;
	e = expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, 0, what);
	if (!e)
		goto fail;
	rdma_ack_cm_event(e);
	return id;
fail:
	rdma_destroy_id(id);
	return NULL;
}

/* ------------------------------------------------------------------- verbs */

static int make_qp(struct rdma_cm_id *id, enum ibv_qp_type t)
{
	struct ibv_qp_init_attr a;

	memset(&a, 0, sizeof a);
	a.cap.max_send_wr = 16;
	a.cap.max_recv_wr = 16;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	a.qp_type = t;
	return rdma_create_qp(id, NULL, &a);
}

static int qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;

	if (ibv_query_qp(qp, &a, IBV_QP_STATE, &ia))
		return -1;
	return a.qp_state;
}

static int post_recv(struct ibv_qp *qp, struct ibv_mr *mr, void *addr, uint32_t len, uint64_t wr_id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)addr, .length = len, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;

	return ibv_post_recv(qp, &wr, &bad);
}

static int post_send(struct ibv_qp *qp, enum ibv_wr_opcode op, struct ibv_mr *mr, void *addr,
		     uint32_t len, uint64_t wr_id, uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)addr, .length = len, .lkey = mr->lkey };
	struct ibv_send_wr wr, *bad;

	memset(&wr, 0, sizeof wr);
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = op;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

/* One completion of `cq` within WC_MS: 1, 0 (none), or negative (poll error). */
static int wait_wc(struct ibv_cq *cq, struct ibv_wc *wc)
{
	struct timespec t0;
	int n;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		n = ibv_poll_cq(cq, 1, wc);
		if (n)
			return n;
		if (ms_since(&t0) > WC_MS)
			return 0;
		usleep(100);
	}
}

static int wc_is(int n, const struct ibv_wc *wc, enum ibv_wc_status st, enum ibv_wc_opcode op, uint64_t wr_id)
{
	return n == 1 && wc->status == st && (st != IBV_WC_SUCCESS || wc->opcode == op) &&
	       wc->wr_id == wr_id;
}

#define WC_FMT "n %d status %s opcode %d wr_id %llu byte_len %u"
#define WC_ARGS(n, wc) n, n == 1 ? ibv_wc_status_str((wc).status) : "-", n == 1 ? (int)(wc).opcode : -1, \
	n == 1 ? (unsigned long long)(wc).wr_id : 0ULL, n == 1 ? (wc).byte_len : 0

/* -------------------------------------------------------- completion channel */

/* A completion channel with a QP's send and receive CQs on it and a thread that blocks in
 * ibv_get_cq_event, acks the event, re-arms the CQ and polls it empty, as rping's cq_thread
 * does; the test takes the completions from a queue per CQ. The thread ends after the first
 * completion in error, which is how every connection that uses one here ends (a flushed
 * receive): no thread is left blocked in the channel when it is destroyed. */
enum { SQ, RQ };
#define CQ_DEPTH 16
#define CQ_QUEUE 32

struct cq_queue {
	struct ibv_cq *cq;
	struct ibv_wc wc[CQ_QUEUE];
	int n, taken;           /* queued by the thread, taken by the test */
	int events;             /* CQ events naming this CQ */
};

struct cq_thread {
	struct ibv_comp_channel *ch;
	struct cq_queue q[2];   /* SQ, RQ */
	pthread_t th;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int started, ended;
	int strays;             /* events naming another CQ or another context */
	int dropped;            /* completions beyond CQ_QUEUE */
	char err[120];          /* the thread's first failed call */
};

static void cq_thread_fail(struct cq_thread *t, const char *what, int r)
{
	pthread_mutex_lock(&t->mu);
	if (!t->err[0])
		snprintf(t->err, sizeof t->err, "%s: %d (errno %d)", what, r, errno);
	pthread_mutex_unlock(&t->mu);
}

static void *cq_thread_main(void *arg)
{
	struct cq_thread *t = arg;
	struct ibv_cq *cq;
	struct ibv_wc wc;
	void *ctx;
	int end = 0, i, n, r;

	while (!end) {
		r = ibv_get_cq_event(t->ch, &cq, &ctx);
		if (r) {
			cq_thread_fail(t, "ibv_get_cq_event", r);
			break;
		}
		ibv_ack_cq_events(cq, 1);
		for (i = 0; i < 2 && t->q[i].cq != cq; i++)
			;
		pthread_mutex_lock(&t->mu);
		if (i == 2 || ctx != &t->q[i])
			t->strays++;
		else
			t->q[i].events++;
		pthread_mutex_unlock(&t->mu);
		if (i == 2)
			continue;
		r = ibv_req_notify_cq(cq, 0);
		if (r) {
			cq_thread_fail(t, "ibv_req_notify_cq", r);
			break;
		}
		while ((n = ibv_poll_cq(cq, 1, &wc)) == 1) {
			pthread_mutex_lock(&t->mu);
			if (t->q[i].n < CQ_QUEUE)
				t->q[i].wc[t->q[i].n++] = wc;
			else
				t->dropped++;
			pthread_cond_broadcast(&t->cv);
			pthread_mutex_unlock(&t->mu);
			if (wc.status != IBV_WC_SUCCESS)
				end = 1;
		}
		if (n < 0) {
			cq_thread_fail(t, "ibv_poll_cq", n);
			break;
		}
	}
	pthread_mutex_lock(&t->mu);
	t->ended = 1;
	pthread_cond_broadcast(&t->cv);
	pthread_mutex_unlock(&t->mu);
	return NULL;
}

/* The id's QP (RC), made with CQs of a completion channel of the program's own, both armed,
 * and the thread that waits on the channel. */
static int cq_qp(struct cq_thread *t, struct rdma_cm_id *id, const char *what)
{
	struct ibv_qp_init_attr a;
	int i, r = -1;

	memset(t, 0, sizeof *t);
	pthread_mutex_init(&t->mu, NULL);
	pthread_cond_init(&t->cv, NULL);
	t->ch = ibv_create_comp_channel(id->verbs);
	if (!CHECK(N(what, "ibv_create_comp_channel"), t->ch, "errno %d", errno))
		return 0;
	for (i = 0; i < 2; i++) {
		t->q[i].cq = ibv_create_cq(id->verbs, CQ_DEPTH, &t->q[i], t->ch, 0);
		r = t->q[i].cq ? ibv_req_notify_cq(t->q[i].cq, 0) : -1;
		if (!CHECK(N(what, "ibv_create_cq on the channel, ibv_req_notify_cq (%s)",
			     i == SQ ? "send" : "receive"), r == 0, "ret %d errno %d", r, errno))
			return 0;
	}
	memset(&a, 0, sizeof a);
	a.send_cq = t->q[SQ].cq;
	a.recv_cq = t->q[RQ].cq;
	a.cap.max_send_wr = a.cap.max_recv_wr = 8;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.qp_type = IBV_QPT_RC;
	r = rdma_create_qp(id, NULL, &a);
	if (!CHECK(N(what, "rdma_create_qp with those CQs"), r == 0 && id->qp,
		   "ret %d errno %d", r, errno))
		return 0;
	/* librdmacm names only the CQs it made itself (rdma_create_qp_ex). */
	CHECK(N(what, "id->send_cq and id->recv_cq stay NULL"), !id->send_cq && !id->recv_cq,
	      "send_cq %p recv_cq %p", (void *)id->send_cq, (void *)id->recv_cq);
	r = pthread_create(&t->th, NULL, cq_thread_main, t);
	t->started = r == 0;
	return CHECK(N(what, "the CQ thread started"), r == 0, "pthread_create %d", r);
}

static void cq_deadline(struct timespec *ts, int ms)
{
	clock_gettime(CLOCK_REALTIME, ts);
	ts->tv_sec += ms / 1000;
	ts->tv_nsec += (ms % 1000) * 1000000L;
	if (ts->tv_nsec >= 1000000000L) {
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
}

/* The next completion the thread took from CQ `which` within `ms`: 1, or 0. */
static int cq_wait_ms(struct cq_thread *t, int which, struct ibv_wc *wc, int ms)
{
	struct cq_queue *q = &t->q[which];
	struct timespec ts;
	int n = 0;

	cq_deadline(&ts, ms);
	pthread_mutex_lock(&t->mu);
	while (q->taken == q->n && !t->ended)
		if (pthread_cond_timedwait(&t->cv, &t->mu, &ts))
			break;
	if (q->taken < q->n) {
		*wc = q->wc[q->taken++];
		n = 1;
	}
	pthread_mutex_unlock(&t->mu);
	return n;
}

static int cq_wait(struct cq_thread *t, int which, struct ibv_wc *wc)
{
	return cq_wait_ms(t, which, wc, WC_MS);
}

/* The end: the thread has ended at the flushed receive (within WC_MS) and saw no stray
 * event or failed call; every completion was the test's, each CQ with completions had
 * events; then the QP, the CQs (all their events acked) and the channel go. */
static void cq_finish(struct cq_thread *t, struct rdma_cm_id *id)
{
	struct timespec ts;
	int ended, i, r;

	if (!t->ch)
		return;
	if (t->started) {
		cq_deadline(&ts, WC_MS);
		pthread_mutex_lock(&t->mu);
		while (!t->ended)
			if (pthread_cond_timedwait(&t->cv, &t->mu, &ts))
				break;
		ended = t->ended;
		pthread_mutex_unlock(&t->mu);
		if (!CHECK("the CQ thread ends after the flushed receive", ended, "still in ibv_get_cq_event")) {
			/* Blocked in the channel: it and its CQs stay. */
			pthread_detach(t->th);
			if (id->qp)
				rdma_destroy_qp(id);
			return;
		}
		pthread_join(t->th, NULL);
		printf("OUT: %sCQ events: send CQ %d (%d completions), receive CQ %d (%d completions)\n",
		       side, t->q[SQ].events, t->q[SQ].n, t->q[RQ].events, t->q[RQ].n);
		CHECK("every CQ event named one of the channel's CQs and its context, no call failed",
		      !t->strays && !t->err[0] && !t->dropped, "%d stray events, %d completions too many; %s",
		      t->strays, t->dropped, t->err);
		CHECK("each CQ with completions had CQ events, the test took every completion",
		      (t->q[SQ].events > 0) == (t->q[SQ].n > 0) && (t->q[RQ].events > 0) == (t->q[RQ].n > 0) &&
			      t->q[SQ].taken == t->q[SQ].n && t->q[RQ].taken == t->q[RQ].n,
		      "send %d events %d/%d taken, receive %d events %d/%d taken", t->q[SQ].events,
		      t->q[SQ].taken, t->q[SQ].n, t->q[RQ].events, t->q[RQ].taken, t->q[RQ].n);
	}
	if (id->qp)
		rdma_destroy_qp(id);
	for (i = 0; i < 2; i++) {
		if (!t->q[i].cq)
			continue;
		r = ibv_destroy_cq(t->q[i].cq);
		CHECK(N("ibv_destroy_cq", "%s CQ: 0", i == SQ ? "send" : "receive"), r == 0, "ret %d", r);
	}
	r = ibv_destroy_comp_channel(t->ch);
	CHECK("ibv_destroy_comp_channel: 0", r == 0, "ret %d", r);
	t->ch = NULL;
}

/* ------------------------------------------------------------------- peers */

struct peer {
	int thread;
	pid_t pid;
	pthread_t th;
	void (*fn)(const char *arg);
	char arg[128];
};

static void *peer_thread(void *p)
{
	struct peer *pe = p;

	pe->fn(pe->arg);
	return NULL;
}

/* Start the other side: `fn(arg)` in a thread, or this program as `-t GROUP -r client -a ARG`. */
static int start_peer(struct peer *p, int thread, void (*fn)(const char *), const char *fmt, ...)
{
	va_list ap;

	memset(p, 0, sizeof *p);
	va_start(ap, fmt);
	vsnprintf(p->arg, sizeof p->arg, fmt, ap);
	va_end(ap);
	p->thread = thread;
	p->fn = fn;
	if (thread)
		return CHECK("client thread started", pthread_create(&p->th, NULL, peer_thread, p) == 0, "pthread_create");
	fflush(stdout);
	p->pid = fork();
	if (p->pid == 0) {
		execl(self_path, self_path, "-t", group, "-r", "client", "-a", p->arg, (char *)NULL);
		_exit(127);
	}
	return CHECK("client process started", p->pid > 0, "fork: %s", strerror(errno));
}

static void wait_peer(struct peer *p)
{
	int st = 0, i;
	pid_t r = 0;

	if (p->thread) {
		pthread_join(p->th, NULL);
		return;
	}
	if (p->pid <= 0)
		return;
	for (i = 0; i < PEER_S * 20; i++) {
		r = waitpid(p->pid, &st, WNOHANG);
		if (r == p->pid)
			break;
		usleep(50000);
	}
	if (r != p->pid) {
		kill(p->pid, SIGKILL);
		waitpid(p->pid, &st, 0);
		CHECK("client process ends", 0, "killed after %d s", PEER_S);
		return;
	}
	CHECK("client process exits 0", WIFEXITED(st) && WEXITSTATUS(st) == 0, "wait status 0x%x", st);
}

/* A listener on `ch` bound to ip:0 in `ps`; its port in host order through `port`. */
static struct rdma_cm_id *listener(struct rdma_event_channel *ch, enum rdma_port_space ps,
				   const char *ip, int *port)
{
	struct sockaddr_in a = sin_of(ip, 0);
	struct rdma_cm_id *id = NULL;
	int r;

	r = rdma_create_id(ch, &id, NULL, ps);
	if (!CHECK("listener: rdma_create_id", r == 0, "ret %d errno %d", r, errno))
		return NULL;
	r = rdma_bind_addr(id, (struct sockaddr *)&a);
	if (r == 0)
		r = rdma_listen(id, 8);
	*port = ntohs(rdma_get_src_port(id));
	if (!CHECK(N("listener", "bound to %s:0 and listening on a port", ip), r == 0 && *port,
		   "ret %d errno %d port %d", r, errno, *port)) {
		rdma_destroy_id(id);
		return NULL;
	}
	return id;
}

/* ---------------------------------------------------- connect / threads */

struct info {           /* server -> client, after ESTABLISHED */
	uint64_t addr;
	uint32_t rkey;
	uint32_t qpn;
};

struct hello {          /* client -> server: its QPN and a pattern */
	uint32_t qpn;
	uint32_t pad;
	uint8_t data[120];
};

static void conn_params(struct rdma_conn_param *cp, void *pd, int len)
{
	memset(cp, 0, sizeof *cp);
	cp->private_data = pd;
	cp->private_data_len = len;
	cp->responder_resources = CLIENT_RESP;
	cp->initiator_depth = CLIENT_INIT;
	cp->retry_count = CLIENT_RETRY;
	cp->rnr_retry_count = CLIENT_RNR;
	cp->flow_control = 1;
}

/* What the server sees of the client's request. */
static void check_request(struct rdma_cm_event *e, const char *what)
{
	const struct rdma_conn_param *c = &e->param.conn;
	long m = c->private_data ? mismatch(c->private_data, 56, 1) : 0;

	CHECK(N(what, "the 56 bytes of private data arrive intact"),
	      c->private_data && c->private_data_len == 56 && m < 0,
	      "len %u data %p first difference at %ld", c->private_data_len, c->private_data, m);
	/* From the server's point of view: its responder resources are the client's
	 * initiator depth, and the other way round (cma_set_req_event_data). */
	CHECK(N(what, "responder_resources %d, initiator_depth %d as the client set them",
		CLIENT_INIT, CLIENT_RESP),
	      c->responder_resources == CLIENT_INIT && c->initiator_depth == CLIENT_RESP,
	      "responder_resources %u initiator_depth %u", c->responder_resources, c->initiator_depth);
	CHECK(N(what, "retry_count %d, rnr_retry_count %d, flow_control 1, no SRQ, a QPN",
		CLIENT_RETRY, CLIENT_RNR),
	      c->retry_count == CLIENT_RETRY && c->rnr_retry_count == CLIENT_RNR &&
		      c->flow_control == 1 && c->srq == 0 && c->qp_num,
	      "retry %u rnr %u flow %u srq %u qpn %u", c->retry_count, c->rnr_retry_count,
	      c->flow_control, c->srq, c->qp_num);
}

/* The end of a connection: `first` disconnects, then waits for its DISCONNECTED; the
 * other side gets DISCONNECTED (its receives still posted, as librdmacm leaves the QP to
 * rdma_disconnect), then disconnects too, as rping does. Either way the receive posted as
 * `flush_wr` completes with IBV_WC_WR_FLUSH_ERR, and no second DISCONNECTED comes. */
static void disconnect_phase(struct rdma_event_channel *ch, struct rdma_cm_id *id, int first,
			     struct cq_thread *t, uint64_t flush_wr)
{
	struct rdma_cm_event *e;
	struct ibv_wc wc;
	int n, r;

	if (first) {
		r = rdma_disconnect(id);
		CHECK("rdma_disconnect: 0", r == 0, "ret %d errno %d", r, errno);
		e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "after rdma_disconnect");
	} else {
		e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "the peer disconnects");
	}
	if (e) {
		CHECK("DISCONNECTED names the connection's id", e->id == id, "id %p", (void *)e->id);
		rdma_ack_cm_event(e);
	}
	if (!first) {
		n = cq_wait_ms(t, RQ, &wc, DRAIN_MS);
		CHECK("after DISCONNECTED the receive is still posted (rdma_disconnect flushes it)",
		      n == 0, WC_FMT, WC_ARGS(n, wc));
		r = rdma_disconnect(id);
		CHECK("rdma_disconnect after DISCONNECTED: 0", r == 0, "ret %d errno %d", r, errno);
	}
	n = cq_wait(t, RQ, &wc);
	CHECK("the posted receive completes with IBV_WC_WR_FLUSH_ERR",
	      wc_is(n, &wc, IBV_WC_WR_FLUSH_ERR, 0, flush_wr), WC_FMT, WC_ARGS(n, wc));
	CHECK("the QP is in the error state", qp_state(id->qp) == IBV_QPS_ERR, "state %d",
	      qp_state(id->qp));
	expect_no_more(ch, RDMA_CM_EVENT_DISCONNECTED, "after DISCONNECTED");
}

static void conn_client(const char *arg)
{
	int port = 0, server_disconnects = 0;
	struct cq_thread cqt = { 0 };
	struct rdma_event_channel *ch;
	struct rdma_cm_event *e;
	struct rdma_cm_id *id;
	struct rdma_conn_param cp;
	struct ibv_mr *mr = NULL;
	struct ibv_wc wc;
	uint8_t pd57[57], *buf;
	uint32_t rep_qpn = 0;
	int r, n, i;

	side = "client: ";
	sscanf(arg, "%d,%d", &port, &server_disconnects);
	ch = rdma_create_event_channel();
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	buf = calloc(1, BUF);

	/* 1: the server's accept with 197 bytes fails, which rejects this connection. */
	id = resolved_id(ch, RDMA_PS_TCP, "127.0.0.1", port, "connection 1");
	if (!id)
		goto out;
	r = make_qp(id, IBV_QPT_RC);
	CHECK("connection 1: rdma_create_qp", r == 0, "ret %d errno %d", r, errno);
	fill(pd57, sizeof pd57, 1);
	conn_params(&cp, pd57, 57);
	errno = 0;
	r = rdma_connect(id, &cp);
	CHECK("rdma_connect with 57 bytes of private data: -1 EINVAL", r == -1 && errno == EINVAL,
	      "ret %d errno %d", r, errno);
	conn_params(&cp, pd57, 56);
	r = rdma_connect(id, &cp);
	CHECK("rdma_connect with 56 bytes of private data: 0", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_REJECTED, 28, "connection 1, whose accept failed");
	if (e) {
		CHECK("connection 1: REJECTED carries the REJ's 148 bytes of private data, zeros",
		      e->param.conn.private_data_len == 148 && e->param.conn.private_data &&
			      nonzero(e->param.conn.private_data, 148) < 0,
		      "len %u", e->param.conn.private_data_len);
		rdma_ack_cm_event(e);
		CHECK("connection 1: REJECTED moved the QP to the error state",
		      qp_state(id->qp) == IBV_QPS_ERR, "state %d", qp_state(id->qp));
	}
	rdma_destroy_qp(id);
	rdma_destroy_id(id);

	/* 2: accepted. */
	id = resolved_id(ch, RDMA_PS_TCP, "127.0.0.1", port, "connection 2");
	if (!id)
		goto out;
	if (!cq_qp(&cqt, id, "connection 2"))
		goto out_id;
	mr = ibv_reg_mr(id->pd, buf, BUF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
			IBV_ACCESS_REMOTE_READ);
	if (!CHECK("connection 2: ibv_reg_mr on id->pd", mr, "errno %d", errno))
		goto out_id;
	fill(buf + WRITE_OFF, RDMA_LEN, 4);
	r = post_recv(id->qp, mr, buf, SLOT, 1);
	CHECK("connection 2: receive posted", r == 0, "ret %d", r);
	r = rdma_connect(id, &cp);
	CHECK("connection 2: rdma_connect: 0", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "connection 2");
	if (!e)
		goto out_id;
	{
		const struct rdma_conn_param *c = &e->param.conn;
		long m = c->private_data ? mismatch(c->private_data, 196, 2) : 0;

		CHECK("ESTABLISHED carries the accept's 196 bytes of private data intact",
		      c->private_data && c->private_data_len == 196 && m < 0,
		      "len %u first difference at %ld", c->private_data_len, m);
		CHECK("ESTABLISHED: responder_resources, initiator_depth as the server accepted",
		      c->responder_resources == SERVER_INIT && c->initiator_depth == SERVER_RESP,
		      "responder_resources %u initiator_depth %u", c->responder_resources,
		      c->initiator_depth);
		rep_qpn = c->qp_num;
	}
	rdma_ack_cm_event(e);
	CHECK("connection 2: the QP is in RTS", qp_state(id->qp) == IBV_QPS_RTS, "state %d",
	      qp_state(id->qp));

	/* The server's buffer. */
	n = cq_wait(&cqt, RQ, &wc);
	if (!CHECK("the server's message arrives", wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_RECV, 1) &&
		   wc.byte_len == sizeof(struct info), WC_FMT, WC_ARGS(n, wc)))
		goto out_id;
	struct info in;
	memcpy(&in, buf, sizeof in);
	CHECK("ESTABLISHED's qp_num is the server's QP", rep_qpn == in.qpn, "event %u server %u",
	      rep_qpn, in.qpn);

	/* SEND, WRITE, READ, SEND in one post. */
	struct hello *h = (void *)(buf + SEND_OFF);
	struct ibv_sge sge[4];
	struct ibv_send_wr wr[4], *bad;

	h->qpn = id->qp->qp_num;
	fill(h->data, sizeof h->data, 3);
	memcpy(buf + SEND_OFF + 512, "done", 5);
	memset(wr, 0, sizeof wr);
	sge[0] = (struct ibv_sge){ (uintptr_t)h, sizeof *h, mr->lkey };
	sge[1] = (struct ibv_sge){ (uintptr_t)(buf + WRITE_OFF), RDMA_LEN, mr->lkey };
	sge[2] = (struct ibv_sge){ (uintptr_t)(buf + READ_OFF), RDMA_LEN, mr->lkey };
	sge[3] = (struct ibv_sge){ (uintptr_t)(buf + SEND_OFF + 512), 8, mr->lkey };
	enum ibv_wr_opcode ops[4] = { IBV_WR_SEND, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_SEND };
	for (i = 0; i < 4; i++) {
		wr[i].wr_id = 11 + i;
		wr[i].sg_list = &sge[i];
		wr[i].num_sge = 1;
		wr[i].opcode = ops[i];
		wr[i].send_flags = IBV_SEND_SIGNALED;
		wr[i].next = i < 3 ? &wr[i + 1] : NULL;
	}
	wr[1].wr.rdma.remote_addr = in.addr + WRITE_OFF;
	wr[1].wr.rdma.rkey = in.rkey;
	wr[2].wr.rdma.remote_addr = in.addr + READ_OFF;
	wr[2].wr.rdma.rkey = in.rkey;
	r = ibv_post_send(id->qp, wr, &bad);
	CHECK("SEND, RDMA WRITE, RDMA READ, SEND posted", r == 0, "ret %d", r);
	enum ibv_wc_opcode want[4] = { IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_SEND };
	const char *names[4] = { "SEND", "RDMA WRITE", "RDMA READ", "the last SEND" };
	for (i = 0; i < 4; i++) {
		n = cq_wait(&cqt, SQ, &wc);
		CHECK(N("completions in order", "%s succeeds", names[i]),
		      wc_is(n, &wc, IBV_WC_SUCCESS, want[i], 11 + i), WC_FMT, WC_ARGS(n, wc));
	}
	long m = mismatch(buf + READ_OFF, RDMA_LEN, 5);
	CHECK("RDMA READ: the server's 1024 bytes are in local memory", m < 0, "first difference at %ld", m);

	r = post_recv(id->qp, mr, buf + SLOT, SLOT, 2);
	CHECK("receive posted before the disconnect", r == 0, "ret %d", r);
	disconnect_phase(ch, id, !server_disconnects, &cqt, 2);
out_id:
	if (mr)
		ibv_dereg_mr(mr);
	cq_finish(&cqt, id);
	rdma_destroy_id(id);
out:
	rdma_destroy_event_channel(ch);
	free(buf);
}

static void conn_server(int threads, int server_disconnects)
{
	struct cq_thread cqt = { 0 };
	struct rdma_event_channel *ch;
	struct rdma_cm_id *lid, *id, *id1;
	struct rdma_cm_event *e;
	struct rdma_conn_param cp;
	struct ibv_mr *mr = NULL;
	struct ibv_wc wc;
	struct peer peer;
	uint8_t pd197[197], *buf;
	uint32_t client_qpn = 0;
	int port, r, n;

	side = "server: ";
	ch = rdma_create_event_channel();
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	lid = listener(ch, RDMA_PS_TCP, "127.0.0.1", &port);
	if (!lid)
		return;
	if (!start_peer(&peer, threads, conn_client, "%d,%d", port, server_disconnects))
		return;
	buf = calloc(1, BUF);
	fill(pd197, sizeof pd197, 2);

	/* 1: 197 bytes of private data are one too many: EINVAL, and the request is
	 * rejected (Linux's rdma_accept rejects a request it fails to accept). */
	e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request 1");
	if (!e)
		goto out;
	check_request(e, "request 1");
	id = e->id;
	CHECK("request 1: listen_id is the listener, id a new one", e->listen_id == lid && id != lid,
	      "listen_id %p id %p", (void *)e->listen_id, (void *)id);
	rdma_ack_cm_event(e);
	r = make_qp(id, IBV_QPT_RC);
	CHECK("request 1: rdma_create_qp", r == 0, "ret %d errno %d", r, errno);
	memset(&cp, 0, sizeof cp);
	cp.private_data = pd197;
	cp.private_data_len = 197;
	cp.responder_resources = SERVER_RESP;
	cp.initiator_depth = SERVER_INIT;
	errno = 0;
	r = rdma_accept(id, &cp);
	CHECK("rdma_accept with 197 bytes of private data: -1 EINVAL", r == -1 && errno == EINVAL,
	      "ret %d errno %d", r, errno);
	CHECK("request 1: the failed accept moved the QP to the error state",
	      qp_state(id->qp) == IBV_QPS_ERR, "state %d", qp_state(id->qp));
	/* The id stays until the client's next request, which it makes once the failed
	 * accept's REJ reached it. */
	id1 = id;

	/* 2: accepted with 196 bytes. */
	e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request 2");
	rdma_destroy_qp(id1);
	rdma_destroy_id(id1);
	if (!e)
		goto out;
	check_request(e, "request 2");
	id = e->id;
	client_qpn = e->param.conn.qp_num;
	rdma_ack_cm_event(e);
	if (!cq_qp(&cqt, id, "request 2"))
		goto out_id;
	mr = ibv_reg_mr(id->pd, buf, BUF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
			IBV_ACCESS_REMOTE_READ);
	if (!CHECK("request 2: ibv_reg_mr", mr, "errno %d", errno))
		goto out_id;
	fill(buf + READ_OFF, RDMA_LEN, 5);
	r = post_recv(id->qp, mr, buf, SLOT, 1) || post_recv(id->qp, mr, buf + SLOT, SLOT, 2);
	CHECK("request 2: two receives posted", r == 0, "ret %d", r);
	cp.private_data_len = 196;
	r = rdma_accept(id, &cp);
	CHECK("rdma_accept with 196 bytes of private data: 0", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "connection 2");
	if (!e)
		goto out_id;
	CHECK("ESTABLISHED names the accepted id", e->id == id, "id %p", (void *)e->id);
	rdma_ack_cm_event(e);

	struct info *in = (void *)(buf + SEND_OFF);
	in->addr = (uintptr_t)buf;
	in->rkey = mr->rkey;
	in->qpn = id->qp->qp_num;
	r = post_send(id->qp, IBV_WR_SEND, mr, in, sizeof *in, 10, 0, 0);
	n = r ? 0 : cq_wait(&cqt, SQ, &wc);
	CHECK("SEND of the buffer's address completes", wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_SEND, 10),
	      "post %d " WC_FMT, r, WC_ARGS(n, wc));

	n = cq_wait(&cqt, RQ, &wc);
	if (CHECK("the client's SEND arrives in the first receive",
		  wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_RECV, 1) && wc.byte_len == sizeof(struct hello),
		  WC_FMT, WC_ARGS(n, wc))) {
		struct hello *h = (void *)buf;
		long m = mismatch(h->data, sizeof h->data, 3);

		CHECK("the SEND's bytes are intact", m < 0, "first difference at %ld", m);
		CHECK("the request's qp_num is the client's QP", h->qpn == client_qpn,
		      "event %u client %u", client_qpn, h->qpn);
	}
	n = cq_wait(&cqt, RQ, &wc);
	if (CHECK("the client's last SEND arrives in the second receive",
		  wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_RECV, 2) && wc.byte_len == 8 &&
			  !memcmp(buf + SLOT, "done", 5),
		  WC_FMT, WC_ARGS(n, wc))) {
		long m = mismatch(buf + WRITE_OFF, RDMA_LEN, 4);

		CHECK("RDMA WRITE: the client's 1024 bytes are in the server's memory", m < 0,
		      "first difference at %ld", m);
	}
	r = post_recv(id->qp, mr, buf + 2 * SLOT, SLOT, 3);
	CHECK("receive posted before the disconnect", r == 0, "ret %d", r);
	disconnect_phase(ch, id, server_disconnects, &cqt, 3);
out_id:
	if (mr)
		ibv_dereg_mr(mr);
	cq_finish(&cqt, id);
	rdma_destroy_id(id);
out:
	wait_peer(&peer);
	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
	free(buf);
}

static void test_connect(void)
{
	conn_server(0, 0);
}

static void test_sdisconnect(void)
{
	conn_server(0, 1);
}

static void test_threads(void)
{
	conn_server(1, 1);
}

/* ----------------------------------------------------------------- inflight */

/* The client posts IF_WRS work requests back to back, even ones RDMA WRITEs of IF_LEN
 * bytes to slot i/2 of the server's region, odd ones SENDs of IF_LEN bytes; each carries
 * pattern 100 + i. The server posts IF_RECVS receives, so the client's ninth SEND (WR 17)
 * meets RNR (the server accepts with rnr_retry_count 7: retried without end) and the WRs
 * after it stay in flight until the disconnect ends them. */
#define IF_WRS 64
#define IF_LEN 4096
#define IF_RECVS 8
#define IF_LAST_OK (2 * IF_RECVS + 1)   /* WRs that can succeed: up to the ninth SEND */

static int make_qp_n(struct rdma_cm_id *id, int send_wr, int recv_wr)
{
	struct ibv_qp_init_attr a;

	memset(&a, 0, sizeof a);
	a.cap.max_send_wr = send_wr;
	a.cap.max_recv_wr = recv_wr;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.qp_type = IBV_QPT_RC;
	return rdma_create_qp(id, NULL, &a);
}

/* Up to `want` completions of `cq`, then DRAIN_MS more for ones that must not come, in
 * the order they came; the number, or more than `want` when there were extra ones. */
static int collect_wcs(struct ibv_cq *cq, struct ibv_wc *wcs, int want, int max)
{
	struct timespec t0;
	int got = 0, n;

	while (got < want && wait_wc(cq, &wcs[got]) == 1)
		got++;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	while (got < max && ms_since(&t0) < DRAIN_MS) {
		n = ibv_poll_cq(cq, 1, &wcs[got]);
		if (n == 1)
			got++;
		else
			usleep(1000);
	}
	return got;
}

/* `n` completions of WRs first_wr .. first_wr + want - 1: each exactly once, in posting
 * order (RC completes in order, flushed ones too), successes (with the opcode `op` gives)
 * then IBV_WC_WR_FLUSH_ERR, no success after a flush. The number of successes. */
static int check_wc_run(const struct ibv_wc *wcs, int n, int want, uint64_t first_wr,
			enum ibv_wc_opcode (*op)(int i), const char *what)
{
	int i, ok = 0, flushed = 0, bad = -1;

	for (i = 0; i < n && i < want; i++) {
		const struct ibv_wc *w = &wcs[i];

		if (w->wr_id != first_wr + i) {
			bad = i;
			break;
		}
		if (w->status == IBV_WC_SUCCESS && !flushed && w->opcode == op(i)) {
			ok++;
			continue;
		}
		if (w->status == IBV_WC_WR_FLUSH_ERR) {
			flushed++;
			continue;
		}
		bad = i;
		break;
	}
	printf("OUT: %s%s: %d completions: %d successes, then %d flushed\n", side, what, n, ok, flushed);
	CHECK(N(what, "each of the %d WRs completes once, in order, successes then IBV_WC_WR_FLUSH_ERR", want),
	      n == want && bad < 0 && ok + flushed == want,
	      "%d completions (%d wanted), %d successes, %d flushed; completion %d: wr_id %llu status %s opcode %d",
	      n, want, ok, flushed, bad, bad >= 0 ? (unsigned long long)wcs[bad].wr_id : 0ULL,
	      bad >= 0 ? ibv_wc_status_str(wcs[bad].status) : "-", bad >= 0 ? (int)wcs[bad].opcode : -1);
	return ok;
}

static enum ibv_wc_opcode if_send_op(int i)
{
	return i % 2 ? IBV_WC_SEND : IBV_WC_RDMA_WRITE;
}

static enum ibv_wc_opcode if_recv_op(int i)
{
	(void)i;
	return IBV_WC_RECV;
}

static void inflight_client(const char *arg)
{
	int port = 0, client_disconnects = 0, report = -1;
	struct rdma_event_channel *ch;
	struct rdma_cm_event *e;
	struct rdma_cm_id *id;
	struct rdma_conn_param cp;
	struct ibv_mr *mr = NULL;
	struct ibv_wc wcs[IF_WRS + 4];
	struct ibv_sge sge[IF_WRS];
	struct ibv_send_wr wr[IF_WRS], *bad;
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	struct info in;
	uint8_t *buf;
	int r, n, i, ok = 0, sends_ok = 0;

	side = "client: ";
	sscanf(arg, "%d,%d,%d", &port, &client_disconnects, &report);
	ch = rdma_create_event_channel();
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	buf = calloc(IF_WRS, IF_LEN);
	id = resolved_id(ch, RDMA_PS_TCP, "127.0.0.1", port, "connect");
	if (!id)
		goto out;
	r = make_qp_n(id, IF_WRS, 1);
	mr = r ? NULL : ibv_reg_mr(id->pd, buf, IF_WRS * IF_LEN, IBV_ACCESS_LOCAL_WRITE);
	if (!CHECK("rdma_create_qp for 64 send WRs, ibv_reg_mr", r == 0 && mr, "ret %d errno %d", r, errno))
		goto out_id;
	conn_params(&cp, NULL, 0);
	r = rdma_connect(id, &cp);
	CHECK("rdma_connect", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "connect");
	if (!e)
		goto out_id;
	n = e->param.conn.private_data_len >= sizeof in;
	if (n)
		memcpy(&in, e->param.conn.private_data, sizeof in);
	rdma_ack_cm_event(e);
	if (!CHECK("ESTABLISHED carries the server's region in its private data", n && in.rkey,
		   "len ok %d", n))
		goto out_id;
	r = ibv_query_qp(id->qp, &qa, IBV_QP_RNR_RETRY, &qia);
	CHECK("the QP's rnr_retry is the REP's rnr_retry_count 7", r == 0 && qa.rnr_retry == 7,
	      "ret %d rnr_retry %d", r, qa.rnr_retry);

	memset(wr, 0, sizeof wr);
	for (i = 0; i < IF_WRS; i++) {
		fill(buf + i * IF_LEN, IF_LEN, 100 + i);
		sge[i] = (struct ibv_sge){ (uintptr_t)(buf + i * IF_LEN), IF_LEN, mr->lkey };
		wr[i].wr_id = i;
		wr[i].sg_list = &sge[i];
		wr[i].num_sge = 1;
		wr[i].opcode = i % 2 ? IBV_WR_SEND : IBV_WR_RDMA_WRITE;
		wr[i].send_flags = IBV_SEND_SIGNALED;
		wr[i].wr.rdma.remote_addr = in.addr + (i / 2) * IF_LEN;
		wr[i].wr.rdma.rkey = in.rkey;
		wr[i].next = i + 1 < IF_WRS ? &wr[i + 1] : NULL;
	}
	r = ibv_post_send(id->qp, wr, &bad);
	CHECK("64 RDMA WRITEs and SENDs of 4 KiB posted in one call", r == 0, "ret %d", r);

	if (client_disconnects) {
		/* At once: most of them are still in flight. */
		r = rdma_disconnect(id);
		CHECK("rdma_disconnect with the WRs in flight: 0", r == 0, "ret %d errno %d", r, errno);
		e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "after rdma_disconnect");
		n = 0;
	} else {
		e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "the server disconnects");
		/* librdmacm leaves the QP to rdma_disconnect: what has not completed is still
		 * posted, nothing has failed. */
		for (n = 0; n < IF_WRS && ibv_poll_cq(id->send_cq, 1, &wcs[n]) == 1; n++)
			;
		for (i = 0; i < n && wcs[i].status == IBV_WC_SUCCESS; i++)
			;
		CHECK("at DISCONNECTED, before rdma_disconnect: no WR has failed, not all completed",
		      i == n && n < IF_WRS, "%d completions, the first failure at %d", n, i);
		r = rdma_disconnect(id);
		CHECK("rdma_disconnect after DISCONNECTED: 0", r == 0, "ret %d errno %d", r, errno);
	}
	if (e) {
		CHECK("DISCONNECTED names the connection's id", e->id == id, "id %p", (void *)e->id);
		rdma_ack_cm_event(e);
	}
	n += collect_wcs(id->send_cq, wcs + n, IF_WRS - n, IF_WRS + 4 - n);
	ok = check_wc_run(wcs, n, IF_WRS, 0, if_send_op, "the 64 WRs");
	for (i = 0; i < ok; i++)
		sends_ok += i % 2;
	CHECK(N("the 64 WRs", "none succeeded past the ninth SEND (the server had 8 receives)"),
	      ok <= IF_LAST_OK, "%d successes", ok);
	if (!client_disconnects)
		CHECK(N("the 64 WRs", "all up to the eighth SEND succeeded (the server got them)"),
		      ok >= 2 * IF_RECVS, "%d successes", ok);
	CHECK("the QP is in the error state", qp_state(id->qp) == IBV_QPS_ERR, "state %d",
	      qp_state(id->qp));
	expect_no_more(ch, RDMA_CM_EVENT_DISCONNECTED, "after DISCONNECTED");
	if (report >= 0) {
		char line[32];
		int len = snprintf(line, sizeof line, "%d %d\n", ok, sends_ok);

		CHECK("the WRs' outcome reported to the server", write(report, line, len) == len,
		      "errno %d", errno);
		close(report);
	}
out_id:
	if (mr)
		ibv_dereg_mr(mr);
	if (id->qp)
		rdma_destroy_qp(id);
	rdma_destroy_id(id);
out:
	rdma_destroy_event_channel(ch);
	free(buf);
}

/* SEND 2i + 1 landed in receive i: its bytes, and (RC places in order) every WRITE posted
 * before it, in the region. */
static void check_landed(const uint8_t *rbuf, const uint8_t *region, int i)
{
	long m = mismatch(rbuf + i * IF_LEN, IF_LEN, 100 + 2 * i + 1);
	int w, bad = -1;

	for (w = 0; w <= i && bad < 0; w++)
		if (mismatch(region + w * IF_LEN, IF_LEN, 100 + 2 * w) >= 0)
			bad = w;
	CHECK(N("receive", "%d holds SEND %d; the WRITEs before it are in the region", i, 2 * i + 1),
	      m < 0 && bad < 0, "first difference at %ld; WRITE %d not in place", m, 2 * bad);
}

static void inflight_server(int client_disconnects)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *lid, *id = NULL;
	struct rdma_cm_event *e;
	struct rdma_conn_param cp;
	struct ibv_mr *mr = NULL;
	struct ibv_wc wcs[IF_RECVS + 4];
	struct peer peer;
	struct info in;
	uint8_t *region, *rbuf;
	int port, r, n, i, ok = 0, pfd[2] = { -1, -1 };
	int client_ok = -1, client_sends = -1;
	FILE *rep;

	side = "server: ";
	ch = rdma_create_event_channel();
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	lid = listener(ch, RDMA_PS_TCP, "127.0.0.1", &port);
	if (!lid)
		return;
	/* The client says on a pipe which of its WRs succeeded. */
	if (!CHECK("pipe", pipe(pfd) == 0, "errno %d", errno))
		return;
	if (!start_peer(&peer, 0, inflight_client, "%d,%d,%d", port, client_disconnects, pfd[1]))
		return;
	close(pfd[1]);
	region = calloc(IF_WRS / 2 + IF_RECVS, IF_LEN);
	rbuf = region + IF_WRS / 2 * IF_LEN;

	e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request");
	if (!e)
		goto out;
	id = e->id;
	rdma_ack_cm_event(e);
	r = make_qp_n(id, 4, IF_RECVS);
	mr = r ? NULL : ibv_reg_mr(id->pd, region, (IF_WRS / 2 + IF_RECVS) * IF_LEN,
				   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!CHECK("rdma_create_qp, ibv_reg_mr", r == 0 && mr, "ret %d errno %d", r, errno))
		goto out_id;
	for (i = 0; i < IF_RECVS && r == 0; i++)
		r = post_recv(id->qp, mr, rbuf + i * IF_LEN, IF_LEN, 100 + i);
	CHECK("8 receives of 4 KiB posted", r == 0, "ret %d", r);
	memset(&in, 0, sizeof in);
	in.addr = (uintptr_t)region;
	in.rkey = mr->rkey;
	memset(&cp, 0, sizeof cp);
	cp.private_data = &in;
	cp.private_data_len = sizeof in;
	cp.responder_resources = SERVER_RESP;
	cp.initiator_depth = SERVER_INIT;
	cp.rnr_retry_count = 7;
	r = rdma_accept(id, &cp);
	CHECK("rdma_accept with rnr_retry_count 7", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "accepted");
	if (!e)
		goto out_id;
	rdma_ack_cm_event(e);

	if (client_disconnects) {
		e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "the client disconnects");
		n = 0;
	} else {
		/* All 8 receives used, then time for the ninth SEND to meet RNR: the client
		 * has 47 WRs in flight when this side disconnects. */
		for (n = 0; n < IF_RECVS && wait_wc(id->recv_cq, &wcs[n]) == 1; n++)
			;
		usleep(200000);
		r = rdma_disconnect(id);
		CHECK("rdma_disconnect mid-transfer: 0", r == 0, "ret %d errno %d", r, errno);
		e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "after rdma_disconnect");
	}
	if (e) {
		CHECK("DISCONNECTED names the connection's id", e->id == id, "id %p", (void *)e->id);
		rdma_ack_cm_event(e);
	}
	if (client_disconnects) {
		r = rdma_disconnect(id);
		CHECK("rdma_disconnect after DISCONNECTED: 0", r == 0, "ret %d errno %d", r, errno);
	}
	n += collect_wcs(id->recv_cq, wcs + n, IF_RECVS - n, IF_RECVS + 4 - n);
	ok = check_wc_run(wcs, n, IF_RECVS, 100, if_recv_op, "the 8 receives");
	if (!client_disconnects)
		CHECK(N("the 8 receives", "all succeeded before the disconnect"), ok == IF_RECVS,
		      "%d successes", ok);
	for (i = 0; i < ok; i++) {
		CHECK(N("receive", "%d: 4096 bytes", i), wcs[i].byte_len == IF_LEN, "byte_len %u",
		      wcs[i].byte_len);
		check_landed(rbuf, region, i);
	}
	CHECK("the QP is in the error state", qp_state(id->qp) == IBV_QPS_ERR, "state %d",
	      qp_state(id->qp));
	expect_no_more(ch, RDMA_CM_EVENT_DISCONNECTED, "after DISCONNECTED");
out_id:
	wait_peer(&peer);
	peer.pid = 0;
	rep = fdopen(pfd[0], "r");
	pfd[0] = -1;
	if (CHECK("the client's report", rep && fscanf(rep, "%d %d", &client_ok, &client_sends) == 2,
		  "none")) {
		long m = -1;

		printf("OUT: server: the client had %d WRs succeed, %d of them SENDs\n", client_ok,
		       client_sends);
		CHECK("every SEND the client saw succeed was received here", client_sends <= ok,
		      "client %d, received %d", client_sends, ok);
		for (i = 0; i < client_ok && m < 0; i += 2)
			m = mismatch(region + i / 2 * IF_LEN, IF_LEN, 100 + i);
		CHECK("every WRITE the client saw succeed is in the region", m < 0,
		      "WRITE %d: first difference at %ld", i - 2, m);
	}
	if (rep)
		fclose(rep);
	if (mr)
		ibv_dereg_mr(mr);
	if (id) {
		if (id->qp)
			rdma_destroy_qp(id);
		rdma_destroy_id(id);
	}
out:
	if (pfd[0] >= 0)
		close(pfd[0]);
	wait_peer(&peer);
	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
	free(region);
}

static void test_inflight(void)
{
	inflight_server(0);
}

static void test_cinflight(void)
{
	inflight_server(1);
}

/* -------------------------------------------------------------------- verbs */

/* The server's first message: where the client may write and read, then a pattern. */
struct regions {
	uint64_t waddr;         /* RDMA_LEN bytes to write, then a guard of VERBS_GUARD */
	uint32_t wrkey;
	uint32_t pad;
	uint64_t raddr;         /* RDMA_LEN bytes of pattern 23 to read */
	uint32_t rrkey;
	uint32_t pad2;
};
#define VERBS_MSG 64
#define VERBS_GUARD 64

static void verbs_attr(struct ibv_qp_init_attr *attr)
{
	memset(attr, 0, sizeof *attr);
	attr->cap.max_send_wr = 4;      /* the client's WRITE, READ, READ in one go */
	attr->cap.max_recv_wr = 2;      /* the server's hello and done */
	attr->cap.max_send_sge = attr->cap.max_recv_sge = 1;
	attr->sq_sig_all = 1;
}

/* rdma_get_send_comp / rdma_get_recv_comp's completion: one, a success of `op`, whose wr_id
 * is the context the rdma_post_* call was given. */
static int comp_is(int r, const struct ibv_wc *wc, enum ibv_wc_opcode op, uintptr_t ctx)
{
	return r == 1 && wc->status == IBV_WC_SUCCESS && wc->opcode == op && wc->wr_id == ctx;
}

#define COMP_FMT "ret %d errno %d status %s opcode %d wr_id %llu byte_len %u"
#define COMP_ARGS(r, wc) r, errno, r == 1 ? ibv_wc_status_str((wc).status) : "-", \
	r == 1 ? (int)(wc).opcode : -1, r == 1 ? (unsigned long long)(wc).wr_id : 0ULL, \
	r == 1 ? (wc).byte_len : 0

static void verbs_client(const char *port)
{
	struct rdma_addrinfo hints, *res = NULL;
	struct ibv_qp_init_attr attr;
	struct rdma_cm_id *id = NULL;
	struct ibv_mr *smr = NULL, *rmr = NULL, *lmr = NULL;
	struct ibv_wc wc;
	struct regions rg;
	uint8_t sbuf[VERBS_MSG], rbuf[VERBS_MSG], *lbuf = calloc(3, RDMA_LEN);
	int r, i;

	side = "client: ";
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	r = rdma_getaddrinfo("127.0.0.1", port, &hints, &res);
	if (!CHECK("rdma_getaddrinfo 127.0.0.1", r == 0, "ret %d errno %d", r, errno))
		goto out_buf;
	verbs_attr(&attr);
	r = rdma_create_ep(&id, res, NULL, &attr);
	rdma_freeaddrinfo(res);
	if (!CHECK("rdma_create_ep: a synchronous id with its QP", r == 0 && id->qp,
		   "ret %d errno %d", r, errno))
		goto out_buf;
	rmr = rdma_reg_msgs(id, rbuf, sizeof rbuf);
	smr = rdma_reg_msgs(id, sbuf, sizeof sbuf);
	/* Local memory of RDMA WRITE's source and both READs' targets. */
	lmr = rdma_reg_msgs(id, lbuf, 3 * RDMA_LEN);
	if (!CHECK("rdma_reg_msgs", rmr && smr && lmr, "errno %d", errno))
		goto out;
	memset(rbuf, 0, sizeof rbuf);
	r = rdma_post_recv(id, (void *)1, rbuf, sizeof rbuf, rmr);
	CHECK("rdma_post_recv", r == 0, "ret %d errno %d", r, errno);
	r = rdma_connect(id, NULL);
	if (!CHECK("rdma_connect returns 0 once connected", r == 0, "ret %d errno %d", r, errno))
		goto out;
	fill(sbuf, sizeof sbuf, 20);
	r = rdma_post_send(id, (void *)2, sbuf, sizeof sbuf, smr, 0);
	CHECK("rdma_post_send", r == 0, "ret %d errno %d", r, errno);
	r = rdma_get_send_comp(id, &wc);
	CHECK("rdma_get_send_comp: the SEND succeeded", comp_is(r, &wc, IBV_WC_SEND, 2),
	      COMP_FMT, COMP_ARGS(r, wc));
	r = rdma_get_recv_comp(id, &wc);
	if (!CHECK("rdma_get_recv_comp: the server's 64 bytes, its regions then a pattern",
		   comp_is(r, &wc, IBV_WC_RECV, 1) && wc.byte_len == VERBS_MSG &&
			   mismatch(rbuf + sizeof rg, VERBS_MSG - sizeof rg, 21) < 0,
		   COMP_FMT, COMP_ARGS(r, wc)))
		goto disconnect;
	memcpy(&rg, rbuf, sizeof rg);

	/* Back to back: WRITE pattern 22, READ it back, READ the server's pattern 23. An RC
	 * responder executes them in order, so the first READ sees the WRITE. */
	fill(lbuf, RDMA_LEN, 22);
	r = rdma_post_write(id, (void *)3, lbuf, RDMA_LEN, lmr, 0, rg.waddr, rg.wrkey);
	CHECK("rdma_post_write to the server's address and rkey", r == 0, "ret %d errno %d", r, errno);
	r = rdma_post_read(id, (void *)4, lbuf + RDMA_LEN, RDMA_LEN, lmr, 0, rg.waddr, rg.wrkey);
	CHECK("rdma_post_read of the same bytes", r == 0, "ret %d errno %d", r, errno);
	r = rdma_post_read(id, (void *)5, lbuf + 2 * RDMA_LEN, RDMA_LEN, lmr, 0, rg.raddr, rg.rrkey);
	CHECK("rdma_post_read of the server's second region", r == 0, "ret %d errno %d", r, errno);
	{
		const enum ibv_wc_opcode want[3] = { IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_RDMA_READ };
		const char *names[3] = { "RDMA WRITE", "RDMA READ back", "RDMA READ of the second region" };

		for (i = 0; i < 3; i++) {
			r = rdma_get_send_comp(id, &wc);
			CHECK(N("rdma_get_send_comp in order", "%s succeeds", names[i]),
			      comp_is(r, &wc, want[i], 3 + i), COMP_FMT, COMP_ARGS(r, wc));
		}
	}
	long m = mismatch(lbuf + RDMA_LEN, RDMA_LEN, 22);
	CHECK("RDMA READ back: the 1024 bytes written are in the server's memory", m < 0,
	      "first difference at %ld", m);
	m = mismatch(lbuf + 2 * RDMA_LEN, RDMA_LEN, 23);
	CHECK("RDMA READ of the second region: the server's 1024 bytes are in local memory", m < 0,
	      "first difference at %ld", m);
	m = mismatch(lbuf, RDMA_LEN, 22);
	CHECK("the WRITE's source is unchanged", m < 0, "first difference at %ld", m);

	/* Done: the server then looks at its memory. */
	fill(sbuf, sizeof sbuf, 24);
	r = rdma_post_send(id, (void *)6, sbuf, sizeof sbuf, smr, 0);
	if (r == 0)
		r = rdma_get_send_comp(id, &wc);
	CHECK("rdma_post_send, rdma_get_send_comp: the last SEND succeeded",
	      comp_is(r, &wc, IBV_WC_SEND, 6), COMP_FMT, COMP_ARGS(r, wc));
disconnect:
	r = rdma_disconnect(id);
	CHECK("rdma_disconnect", r == 0, "ret %d errno %d", r, errno);
out:
	if (lmr)
		rdma_dereg_mr(lmr);
	if (rmr)
		rdma_dereg_mr(rmr);
	if (smr)
		rdma_dereg_mr(smr);
	rdma_destroy_ep(id);
out_buf:
	free(lbuf);
}

static void test_verbs(void)
{
	struct rdma_addrinfo hints, *res = NULL;
	struct ibv_qp_init_attr attr;
	struct rdma_cm_id *lid = NULL, *id = NULL;
	struct ibv_mr *smr = NULL, *rmr = NULL, *wmr = NULL, *dmr = NULL;
	struct ibv_wc wc;
	struct peer peer;
	struct regions rg;
	uint8_t sbuf[VERBS_MSG], rbuf[2][VERBS_MSG];
	uint8_t *wbuf = calloc(1, RDMA_LEN + VERBS_GUARD), *dbuf = calloc(1, RDMA_LEN);
	int r, port;
	long m;

	side = "server: ";
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_PASSIVE;
	hints.ai_port_space = RDMA_PS_TCP;
	r = rdma_getaddrinfo("127.0.0.1", "0", &hints, &res);
	if (!CHECK("rdma_getaddrinfo RAI_PASSIVE 127.0.0.1", r == 0, "ret %d errno %d", r, errno))
		goto out_buf;
	verbs_attr(&attr);
	r = rdma_create_ep(&lid, res, NULL, &attr);
	rdma_freeaddrinfo(res);
	if (!CHECK("rdma_create_ep (passive)", r == 0, "ret %d errno %d", r, errno))
		goto out_buf;
	r = rdma_listen(lid, 0);
	port = ntohs(rdma_get_src_port(lid));
	if (!CHECK("rdma_listen on a port", r == 0 && port, "ret %d errno %d port %d", r, errno, port))
		goto out;
	char ps[16];
	snprintf(ps, sizeof ps, "%d", port);
	if (!start_peer(&peer, 0, verbs_client, "%s", ps))
		goto out;
	r = rdma_get_request(lid, &id);
	if (!CHECK("rdma_get_request: an id with a QP from rdma_create_ep's attributes",
		   r == 0 && id && id->qp && id->qp->qp_type == IBV_QPT_RC,
		   "ret %d errno %d", r, errno))
		goto out_peer;
	rmr = rdma_reg_msgs(id, rbuf, sizeof rbuf);
	smr = rdma_reg_msgs(id, sbuf, sizeof sbuf);
	/* The region the client writes and reads back (rdma_reg_write would not let it read),
	 * and one it only reads. */
	wmr = ibv_reg_mr(id->pd, wbuf, RDMA_LEN + VERBS_GUARD, IBV_ACCESS_LOCAL_WRITE |
			 IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	fill(dbuf, RDMA_LEN, 23);
	dmr = rdma_reg_read(id, dbuf, RDMA_LEN);
	if (!CHECK("rdma_reg_msgs, ibv_reg_mr (remote write and read), rdma_reg_read",
		   rmr && smr && wmr && dmr, "errno %d", errno))
		goto out_id;
	memset(rbuf, 0, sizeof rbuf);
	r = rdma_post_recv(id, (void *)1, rbuf[0], VERBS_MSG, rmr);
	if (r == 0)
		r = rdma_post_recv(id, (void *)2, rbuf[1], VERBS_MSG, rmr);
	CHECK("rdma_post_recv twice", r == 0, "ret %d errno %d", r, errno);
	r = rdma_accept(id, NULL);
	if (!CHECK("rdma_accept returns 0 once established", r == 0, "ret %d errno %d", r, errno))
		goto out_id;
	r = rdma_get_recv_comp(id, &wc);
	CHECK("rdma_get_recv_comp: the client's 64 bytes", comp_is(r, &wc, IBV_WC_RECV, 1) &&
	      wc.byte_len == VERBS_MSG && mismatch(rbuf[0], VERBS_MSG, 20) < 0,
	      COMP_FMT, COMP_ARGS(r, wc));

	memset(&rg, 0, sizeof rg);
	rg.waddr = (uintptr_t)wmr->addr;
	rg.wrkey = wmr->rkey;
	rg.raddr = (uintptr_t)dmr->addr;
	rg.rrkey = dmr->rkey;
	memcpy(sbuf, &rg, sizeof rg);
	fill(sbuf + sizeof rg, VERBS_MSG - sizeof rg, 21);
	r = rdma_post_send(id, (void *)3, sbuf, sizeof sbuf, smr, 0);
	CHECK("rdma_post_send of the regions' addresses and rkeys", r == 0, "ret %d errno %d", r, errno);
	r = rdma_get_send_comp(id, &wc);
	CHECK("rdma_get_send_comp: the SEND succeeded", comp_is(r, &wc, IBV_WC_SEND, 3),
	      COMP_FMT, COMP_ARGS(r, wc));

	/* The client's last SEND follows its WRITE and READs. */
	r = rdma_get_recv_comp(id, &wc);
	if (CHECK("rdma_get_recv_comp: the client's done, after its RDMA", comp_is(r, &wc, IBV_WC_RECV, 2) &&
		  wc.byte_len == VERBS_MSG && mismatch(rbuf[1], VERBS_MSG, 24) < 0,
		  COMP_FMT, COMP_ARGS(r, wc))) {
		m = mismatch(wbuf, RDMA_LEN, 22);
		CHECK("RDMA WRITE: the client's 1024 bytes are in the server's memory", m < 0,
		      "first difference at %ld", m);
		m = nonzero(wbuf + RDMA_LEN, VERBS_GUARD);
		CHECK("RDMA WRITE: the bytes after them are untouched", m < 0, "nonzero at %ld", m);
		m = mismatch(dbuf, RDMA_LEN, 23);
		CHECK("the region read is unchanged", m < 0, "first difference at %ld", m);
	}
	/* Both sides disconnect, as rdma_server and rdma_client do; each call returns once
	 * its DISCONNECTED came. */
	r = rdma_disconnect(id);
	CHECK("rdma_disconnect", r == 0, "ret %d errno %d", r, errno);
out_id:
	wait_peer(&peer);
	if (dmr)
		rdma_dereg_mr(dmr);
	if (wmr)
		ibv_dereg_mr(wmr);
	if (rmr)
		rdma_dereg_mr(rmr);
	if (smr)
		rdma_dereg_mr(smr);
	if (id)
		rdma_destroy_ep(id);
	rdma_destroy_ep(lid);
	goto out_buf;
out_peer:
	wait_peer(&peer);
out:
	rdma_destroy_ep(lid);
out_buf:
	free(wbuf);
	free(dbuf);
}

/* ------------------------------------------------------------------- reject */

static void reject_client(const char *arg)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_conn_param cp;
	struct rdma_cm_event *e;
	struct rdma_cm_id *id;
	uint8_t pd[56];
	int r;

	side = "client: ";
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	id = resolved_id(ch, RDMA_PS_TCP, "127.0.0.1", atoi(arg), "connect");
	if (!id)
		goto out;
	r = make_qp(id, IBV_QPT_RC);
	CHECK("rdma_create_qp", r == 0, "ret %d errno %d", r, errno);
	fill(pd, sizeof pd, 1);
	conn_params(&cp, pd, sizeof pd);
	r = rdma_connect(id, &cp);
	CHECK("rdma_connect", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_REJECTED, 28, "rejected by the server");
	if (e) {
		const struct rdma_conn_param *c = &e->param.conn;
		long m = c->private_data ? mismatch(c->private_data, 100, 9) : 0;
		long z = c->private_data ? nonzero((const uint8_t *)c->private_data + 100, 48) : 0;

		CHECK("REJECTED carries the 100 bytes of rdma_reject, then zeros to the REJ's 148",
		      c->private_data && c->private_data_len == 148 && m < 0 && z < 0,
		      "len %u first difference at %ld, nonzero at %ld", c->private_data_len, m, z);
		CHECK("REJECTED names the connecting id", e->id == id, "id %p", (void *)e->id);
		rdma_ack_cm_event(e);
		CHECK("REJECTED moved the QP to the error state", qp_state(id->qp) == IBV_QPS_ERR,
		      "state %d", qp_state(id->qp));
	}
	expect_no_more(ch, RDMA_CM_EVENT_REJECTED, "after REJECTED");
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
out:
	rdma_destroy_event_channel(ch);
}

static void test_reject(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *lid, *id;
	struct rdma_cm_event *e;
	struct peer peer;
	uint8_t pd[149];
	int port, r;

	side = "server: ";
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	lid = listener(ch, RDMA_PS_TCP, "127.0.0.1", &port);
	if (!lid || !start_peer(&peer, 0, reject_client, "%d", port))
		return;
	e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request");
	if (e) {
		id = e->id;
		rdma_ack_cm_event(e);
		fill(pd, sizeof pd, 9);
		errno = 0;
		r = rdma_reject(id, pd, 149);
		CHECK("rdma_reject with 149 bytes of private data: -1 EINVAL", r == -1 && errno == EINVAL,
		      "ret %d errno %d", r, errno);
		r = rdma_reject(id, pd, 100);
		CHECK("rdma_reject with 100 bytes of private data: 0", r == 0, "ret %d errno %d", r, errno);
		expect_no_more(ch, RDMA_CM_EVENT_REJECTED, "after rdma_reject");
		rdma_destroy_id(id);
	}
	wait_peer(&peer);
	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
}

/* ------------------------------------------------------------------- noport */

static void test_noport(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct sockaddr_in a = sin_of("127.0.0.1", 0);
	struct rdma_cm_id *hold = NULL, *id;
	struct rdma_conn_param cp;
	struct rdma_cm_event *e;
	int r, port;

	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	/* An id bound to the port and never listening: nobody can listen there. */
	r = rdma_create_id(ch, &hold, NULL, RDMA_PS_TCP);
	if (r == 0)
		r = rdma_bind_addr(hold, (struct sockaddr *)&a);
	port = hold ? ntohs(rdma_get_src_port(hold)) : 0;
	if (!CHECK("an id bound to 127.0.0.1 on a port, not listening", r == 0 && port,
		   "ret %d errno %d", r, errno))
		goto out;
	id = resolved_id(ch, RDMA_PS_TCP, "127.0.0.1", port, "connect");
	if (!id)
		goto out;
	r = make_qp(id, IBV_QPT_RC);
	CHECK("rdma_create_qp", r == 0, "ret %d errno %d", r, errno);
	conn_params(&cp, NULL, 0);
	r = rdma_connect(id, &cp);
	CHECK("rdma_connect", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_REJECTED, 8, "a port nobody listens on");
	if (e) {
		CHECK("REJECTED names the connecting id", e->id == id, "id %p", (void *)e->id);
		rdma_ack_cm_event(e);
		CHECK("REJECTED moved the QP to the error state", qp_state(id->qp) == IBV_QPS_ERR,
		      "state %d", qp_state(id->qp));
	}
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
out:
	if (hold)
		rdma_destroy_id(hold);
	rdma_destroy_event_channel(ch);
}

/* -------------------------------------------------------------- unreachable */

static void test_unreachable(void)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id;
	struct rdma_conn_param cp;
	struct rdma_cm_event *e;
	char ip[32] = "";
	int s, r, i, retries, reqs = 0, other = 0;

	/* Short CM timeouts, unless the caller chose others (read when the CM starts). */
	setenv("SOFTRDMA_CM_RETRIES", "1", 0);
	setenv("SOFTRDMA_CM_RESPONSE_TIMEOUT", "12", 0);
	retries = atoi(getenv("SOFTRDMA_CM_RETRIES"));

	/* A "device" at 127.0.0.25x that never answers: its RoCE port is this socket. */
	s = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
	for (i = 250; i <= 254 && s >= 0; i++) {
		struct sockaddr_in a;

		snprintf(ip, sizeof ip, "127.0.0.%d", i);
		a = sin_of(ip, 4791);
		if (bind(s, (struct sockaddr *)&a, sizeof a) == 0)
			break;
	}
	if (!CHECK("a UDP socket holds port 4791 of a loopback address", s >= 0 && i <= 254,
		   "socket %d errno %d", s, errno))
		return;
	ch = rdma_create_event_channel();
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	id = resolved_id(ch, RDMA_PS_TCP, ip, 7471, "connect to the silent peer");
	if (!id)
		goto out;
	r = make_qp(id, IBV_QPT_RC);
	CHECK("rdma_create_qp", r == 0, "ret %d errno %d", r, errno);
	conn_params(&cp, NULL, 0);
	r = rdma_connect(id, &cp);
	CHECK("rdma_connect", r == 0, "ret %d errno %d", r, errno);
	e = expect_ms(ch, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT, "a peer that never answers", 30000);
	if (e) {
		CHECK("UNREACHABLE names the connecting id", e->id == id, "id %p", (void *)e->id);
		rdma_ack_cm_event(e);
	}
	/* What arrived at the silent peer: RoCEv2 UD SENDs to QP1 carrying CM REQ MADs. */
	for (;;) {
		uint8_t p[512];
		ssize_t n = recv(s, p, sizeof p, 0);

		if (n < 0)
			break;
		/* BTH: opcode 0x64 (UD SEND only), destination QP 1; DETH; MAD: class 0x07
		 * (CM), attribute 0x0010 (REQ). */
		if (n >= 12 + 8 + 24 && p[0] == 0x64 && p[5] == 0 && p[6] == 0 && p[7] == 1 &&
		    p[20 + 1] == 0x07 && p[20 + 16] == 0x00 && p[20 + 17] == 0x10)
			reqs++;
		else
			other++;
	}
	printf("OUT: the silent peer received %d CM REQs, %d other datagrams\n", reqs, other);
	CHECK("the REQ was sent 1 + SOFTRDMA_CM_RETRIES times to the peer's QP1",
	      reqs == 1 + retries && !other, "%d REQs, %d other datagrams, retries %d", reqs, other,
	      retries);
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
out:
	rdma_destroy_event_channel(ch);
	close(s);
}

/* ------------------------------------------------------------------ listen2 */

/* Bind (and listen) a new id at ip:port; -1 with errno, or 0. The id is kept in *out. */
static int bind_listen(struct rdma_event_channel *ch, const char *ip, int port, int reuse,
		       int do_listen, struct rdma_cm_id **out)
{
	struct sockaddr_in a = sin_of(ip, port);
	struct rdma_cm_id *id = NULL;
	int r, e;

	*out = NULL;
	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		return -1;
	r = reuse ? rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &reuse, sizeof reuse) : 0;
	if (r == 0)
		r = rdma_bind_addr(id, (struct sockaddr *)&a);
	if (r == 0 && do_listen)
		r = rdma_listen(id, 4);
	e = errno;
	if (r) {
		rdma_destroy_id(id);
		errno = e;
		return -1;
	}
	*out = id;
	return 0;
}

static void bind_fails(struct rdma_event_channel *ch, const char *ip, int port, int want, const char *what)
{
	struct rdma_cm_id *id;
	int r, e;

	errno = 0;
	r = bind_listen(ch, ip, port, 0, 0, &id);
	e = errno;
	CHECK(N(what, "rdma_bind_addr %s:%d: -1 %s", ip, port, want == EADDRINUSE ? "EADDRINUSE" : "EADDRNOTAVAIL"),
	      r == -1 && e == want, "ret %d errno %d (%s)", r, e, strerror(e));
	if (id)
		rdma_destroy_id(id);
}

static void listen2_client(const char *arg)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	char host[64] = "";
	int p = 0, q = 0, h = 0;

	side = "other process: ";
	sscanf(arg, "%d,%d,%d,%63s", &p, &q, &h, host);
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	bind_fails(ch, "127.0.0.1", p, EADDRNOTAVAIL, "127.0.0.1 listens");
	bind_fails(ch, "0.0.0.0", p, EADDRNOTAVAIL, "127.0.0.1 listens");
	bind_fails(ch, "127.0.0.1", q, EADDRNOTAVAIL, "0.0.0.0 listens");
	if (h)
		bind_fails(ch, host, h, EADDRINUSE, "the host's address listens");
	rdma_destroy_event_channel(ch);
}

static void test_listen2(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *a = NULL, *w = NULL, *hl = NULL, *x = NULL, *y = NULL;
	char host[64];
	int r, e, p = 0, q = 0, h = 0, s;
	int have_host = host_addr(host, sizeof host);
	struct peer peer;

	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	r = bind_listen(ch, "127.0.0.1", 0, 0, 1, &a);
	p = a ? ntohs(rdma_get_src_port(a)) : 0;
	if (!CHECK("listen on 127.0.0.1, port 0", r == 0 && p, "ret %d errno %d", r, errno))
		goto out;
	bind_fails(ch, "127.0.0.1", p, EADDRNOTAVAIL, "127.0.0.1 listens");
	bind_fails(ch, "0.0.0.0", p, EADDRNOTAVAIL, "127.0.0.1 listens");
	bind_fails(ch, "127.0.0.2", p, EADDRNOTAVAIL, "127.0.0.1 listens");

	r = bind_listen(ch, "0.0.0.0", 0, 0, 1, &w);
	q = w ? ntohs(rdma_get_src_port(w)) : 0;
	if (!CHECK("listen on 0.0.0.0, port 0", r == 0 && q, "ret %d errno %d", r, errno))
		goto out;
	bind_fails(ch, "127.0.0.1", q, EADDRNOTAVAIL, "0.0.0.0 listens");
	bind_fails(ch, "0.0.0.0", q, EADDRNOTAVAIL, "0.0.0.0 listens");

	if (have_host) {
		r = bind_listen(ch, host, 0, 0, 1, &hl);
		h = hl ? ntohs(rdma_get_src_port(hl)) : 0;
		if (CHECK(N("the host's address", "listen on %s, port 0", host), r == 0 && h,
			  "ret %d errno %d", r, errno)) {
			bind_fails(ch, host, h, EADDRINUSE, "the host's address listens");
			bind_fails(ch, "0.0.0.0", h, EADDRNOTAVAIL, "the host's address listens");
		}
	} else {
		printf("SKIP: the host has no non-loopback IPv4 address: EADDRINUSE not checked\n");
	}

	/* Two REUSEADDR binds share a port; rdma_listen checks again without REUSEADDR, so
	 * neither can listen while the other is there (Linux's rdma_listen ->
	 * cma_check_port(.., 0)); alone, it can, and then it shares no more. */
	s = 1;
	r = bind_listen(ch, "127.0.0.1", 0, s, 0, &x);
	s = x ? ntohs(rdma_get_src_port(x)) : 0;
	if (CHECK("REUSEADDR: bind 127.0.0.1, port 0", r == 0 && s, "ret %d errno %d", r, errno)) {
		struct rdma_cm_id *z;

		r = bind_listen(ch, "127.0.0.1", s, 1, 0, &y);
		CHECK("REUSEADDR: a second REUSEADDR bind of the same address and port: 0", r == 0,
		      "ret %d errno %d", r, errno);
		errno = 0;
		r = rdma_listen(x, 4);
		e = errno;
		CHECK("REUSEADDR: rdma_listen while another binding shares the port: -1 EADDRNOTAVAIL",
		      r == -1 && e == EADDRNOTAVAIL, "ret %d errno %d", r, e);
		if (y)
			rdma_destroy_id(y);
		y = NULL;
		r = rdma_listen(x, 4);
		CHECK("REUSEADDR: rdma_listen once alone: 0", r == 0, "ret %d errno %d", r, errno);
		errno = 0;
		r = bind_listen(ch, "127.0.0.1", s, 1, 0, &z);
		e = errno;
		CHECK("REUSEADDR: a REUSEADDR bind beside the listener: -1 EADDRNOTAVAIL",
		      r == -1 && e == EADDRNOTAVAIL, "ret %d errno %d", r, e);
		if (z)
			rdma_destroy_id(z);
	}

	/* The same from another process (the port space is the host's). */
	if (start_peer(&peer, 0, listen2_client, "%d,%d,%d,%s", p, q, h, have_host ? host : "-"))
		wait_peer(&peer);
out:
	if (y)
		rdma_destroy_id(y);
	if (x)
		rdma_destroy_id(x);
	if (hl)
		rdma_destroy_id(hl);
	if (w)
		rdma_destroy_id(w);
	if (a)
		rdma_destroy_id(a);
	rdma_destroy_event_channel(ch);
}

/* ----------------------------------------------------------------- wildcard */

static int is_addr(const struct sockaddr *sa, const char *ip, int port)
{
	const struct sockaddr_in *s = (const void *)sa;
	struct in_addr want;

	inet_pton(AF_INET, ip, &want);
	return sa && s->sin_family == AF_INET && s->sin_addr.s_addr == want.s_addr &&
	       ntohs(s->sin_port) == port;
}

static void wildcard_client(const char *arg)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	const char *targets[2] = { "127.0.0.1", NULL };
	struct rdma_cm_event *e;
	struct rdma_cm_id *id;
	char host[64] = "-", b[64];
	int port = 0, i, r;

	side = "client: ";
	sscanf(arg, "%d,%63s", &port, host);
	if (strcmp(host, "-"))
		targets[1] = host;
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	for (i = 0; i < 2 && targets[i]; i++) {
		const char *what = N("wildcard listener", "at %s", targets[i]);

		id = resolved_id(ch, RDMA_PS_TCP, targets[i], port, what);
		if (!id)
			continue;
		CHECK(N(what, "rdma_get_dst_port is the port, in network byte order"),
		      rdma_get_dst_port(id) == htons(port), "0x%04x", rdma_get_dst_port(id));
		r = make_qp(id, IBV_QPT_RC);
		if (r == 0)
			r = rdma_connect(id, NULL);
		CHECK(N(what, "rdma_connect"), r == 0, "ret %d errno %d", r, errno);
		e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, what);
		if (e) {
			rdma_ack_cm_event(e);
			CHECK(N(what, "the peer address is the one dialed"),
			      is_addr(rdma_get_peer_addr(id), targets[i], port), "%s",
			      ntop(rdma_get_peer_addr(id), b, sizeof b));
			r = rdma_disconnect(id);
			CHECK(N(what, "rdma_disconnect"), r == 0, "ret %d errno %d", r, errno);
			e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, what);
			if (e)
				rdma_ack_cm_event(e);
		}
		rdma_destroy_qp(id);
		rdma_destroy_id(id);
	}
	rdma_destroy_event_channel(ch);
}

static void test_wildcard(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct sockaddr_in any = sin_of("0.0.0.0", 0);
	struct rdma_cm_id *lid = NULL, *id;
	struct rdma_cm_event *e;
	struct peer peer;
	const char *dialed[2] = { "127.0.0.1", NULL };
	char host[64], b[64];
	int r, i, port;
	__be16 be;

	side = "server: ";
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	r = rdma_create_id(ch, &lid, NULL, RDMA_PS_TCP);
	if (r == 0)
		r = rdma_bind_addr(lid, (struct sockaddr *)&any);
	if (!CHECK("bind 0.0.0.0, port 0", r == 0, "ret %d errno %d", r, errno))
		goto out;
	be = rdma_get_src_port(lid);
	port = ntohs(be);
	CHECK("rdma_get_src_port: the port bound, as the local address has it (network byte order)",
	      be && be == ((struct sockaddr_in *)rdma_get_local_addr(lid))->sin_port &&
		      is_addr(rdma_get_local_addr(lid), "0.0.0.0", port),
	      "port 0x%04x local %s", be, ntop(rdma_get_local_addr(lid), b, sizeof b));
	r = rdma_listen(lid, 4);
	if (!CHECK("rdma_listen", r == 0, "ret %d errno %d", r, errno))
		goto out;
	if (host_addr(host, sizeof host))
		dialed[1] = host;
	else
		printf("SKIP: the host has no non-loopback IPv4 address: not dialed\n");
	if (!start_peer(&peer, 0, wildcard_client, "%d,%s", port, dialed[1] ? dialed[1] : "-"))
		goto out;
	for (i = 0; i < 2 && dialed[i]; i++) {
		const char *what = N("wildcard listener", "request to %s", dialed[i]);

		e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, what);
		if (!e)
			break;
		id = e->id;
		rdma_ack_cm_event(e);
		CHECK(N(what, "the new id's local address is the one dialed, its port the listener's"),
		      is_addr(rdma_get_local_addr(id), dialed[i], port) && rdma_get_src_port(id) == be,
		      "%s", ntop(rdma_get_local_addr(id), b, sizeof b));
		r = make_qp(id, IBV_QPT_RC);
		if (r == 0)
			r = rdma_accept(id, NULL);
		CHECK(N(what, "rdma_accept"), r == 0, "ret %d errno %d", r, errno);
		e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, what);
		if (e)
			rdma_ack_cm_event(e);
		e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, what);
		if (e)
			rdma_ack_cm_event(e);
		rdma_disconnect(id);
		rdma_destroy_qp(id);
		rdma_destroy_id(id);
	}
	wait_peer(&peer);
out:
	if (lid)
		rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
}

/* ------------------------------------------------------------------- initqp */

/* The program's own QP, on the id's device. */
struct own {
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	uint8_t buf[1024];
};

static int own_make(struct own *o, struct ibv_context *verbs)
{
	struct ibv_qp_init_attr ia;

	memset(o, 0, sizeof *o);
	o->pd = ibv_alloc_pd(verbs);
	o->cq = o->pd ? ibv_create_cq(verbs, 16, NULL, NULL, 0) : NULL;
	memset(&ia, 0, sizeof ia);
	ia.send_cq = ia.recv_cq = o->cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = ia.cap.max_recv_wr = 4;
	ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
	o->qp = o->cq ? ibv_create_qp(o->pd, &ia) : NULL;
	o->mr = o->qp ? ibv_reg_mr(o->pd, o->buf, sizeof o->buf, IBV_ACCESS_LOCAL_WRITE) : NULL;
	return CHECK("ibv_alloc_pd, ibv_create_cq, ibv_create_qp, ibv_reg_mr on id->verbs", o->mr,
		     "errno %d", errno);
}

static void own_free(struct own *o)
{
	if (o->mr)
		ibv_dereg_mr(o->mr);
	if (o->qp)
		ibv_destroy_qp(o->qp);
	if (o->cq)
		ibv_destroy_cq(o->cq);
	if (o->pd)
		ibv_dealloc_pd(o->pd);
}

/* rdma_init_qp_attr for `state`, then ibv_modify_qp with what it gave. */
static int own_move(struct rdma_cm_id *id, struct own *o, enum ibv_qp_state state, int need,
		    const char *name, struct ibv_qp_attr *out)
{
	struct ibv_qp_attr a;
	int mask = 0, r, m;

	memset(&a, 0, sizeof a);
	a.qp_state = state;
	r = rdma_init_qp_attr(id, &a, &mask);
	if (!CHECK(N(name, "rdma_init_qp_attr gives the state and the attributes it needs"),
		   r == 0 && a.qp_state == state && (mask & (IBV_QP_STATE | need)) == (IBV_QP_STATE | need),
		   "ret %d errno %d state %d mask 0x%x want 0x%x", r, errno, a.qp_state, mask,
		   IBV_QP_STATE | need))
		return 0;
	m = ibv_modify_qp(o->qp, &a, mask);
	if (out)
		*out = a;
	return CHECK(N(name, "ibv_modify_qp with them"), m == 0 && qp_state(o->qp) == (int)state,
		     "ret %d state %d", m, qp_state(o->qp));
}

#define RTR_NEEDS (IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | \
		   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)
#define RTS_NEEDS (IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | \
		   IBV_QP_MAX_QP_RD_ATOMIC)
#define INIT_NEEDS (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)

static void initqp_client(const char *arg)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_conn_param cp;
	struct rdma_cm_event *e;
	struct rdma_cm_id *id;
	struct ibv_qp_attr a;
	struct ibv_wc wc;
	struct own o;
	uint32_t rep_qpn = 0;
	int r, n;

	side = "client: ";
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	id = resolved_id(ch, RDMA_PS_TCP, "127.0.0.1", atoi(arg), "connect");
	if (!id)
		goto out;
	if (!own_make(&o, id->verbs))
		goto out_id;
	if (!own_move(id, &o, IBV_QPS_INIT, INIT_NEEDS, "INIT", NULL))
		goto out_qp;
	r = post_recv(o.qp, o.mr, o.buf, 512, 1);
	conn_params(&cp, NULL, 0);
	cp.qp_num = o.qp->qp_num;
	r = r ? r : rdma_connect(id, &cp);
	CHECK("rdma_connect with the QP's number and no id QP", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_CONNECT_RESPONSE, 0, "without an id QP");
	if (!e)
		goto out_qp;
	rep_qpn = e->param.conn.qp_num;
	CHECK("CONNECT_RESPONSE: the REP's 196 bytes of private data, resources as accepted",
	      e->param.conn.private_data_len == 196 && e->param.conn.responder_resources == SERVER_INIT &&
		      e->param.conn.initiator_depth == SERVER_RESP,
	      "len %u resp %u init %u", e->param.conn.private_data_len, e->param.conn.responder_resources,
	      e->param.conn.initiator_depth);
	rdma_ack_cm_event(e);
	if (!own_move(id, &o, IBV_QPS_RTR, RTR_NEEDS, "RTR", &a))
		goto out_qp;
	CHECK("RTR: the destination QP is the one CONNECT_RESPONSE named", a.dest_qp_num == rep_qpn,
	      "dest %u rep %u", a.dest_qp_num, rep_qpn);
	if (!own_move(id, &o, IBV_QPS_RTS, RTS_NEEDS, "RTS", &a))
		goto out_qp;
	CHECK("RTS: max_rd_atomic is the server's responder resources", a.max_rd_atomic == SERVER_RESP,
	      "max_rd_atomic %u", a.max_rd_atomic);
	r = rdma_establish(id);
	CHECK("rdma_establish: 0", r == 0, "ret %d errno %d", r, errno);

	struct hello *h = (void *)(o.buf + 512);
	h->qpn = o.qp->qp_num;
	fill(h->data, sizeof h->data, 30);
	r = post_send(o.qp, IBV_WR_SEND, o.mr, h, sizeof *h, 2, 0, 0);
	n = r ? 0 : wait_wc(o.cq, &wc);
	CHECK("a SEND on the program's QP completes", wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_SEND, 2),
	      "post %d " WC_FMT, r, WC_ARGS(n, wc));
	n = wait_wc(o.cq, &wc);
	CHECK("the server's reply arrives intact", wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_RECV, 1) &&
	      wc.byte_len == 64 && mismatch(o.buf, 64, 31) < 0, WC_FMT, WC_ARGS(n, wc));
	r = rdma_disconnect(id);
	CHECK("rdma_disconnect without an id QP: 0", r == 0, "ret %d errno %d", r, errno);
	/* The next event is DISCONNECTED: the active side gets no ESTABLISHED of its own
	 * after rdma_establish (Linux reports only CONNECT_RESPONSE to it). */
	e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "after rdma_establish and rdma_disconnect");
	if (e)
		rdma_ack_cm_event(e);
out_qp:
	own_free(&o);
out_id:
	rdma_destroy_id(id);
out:
	rdma_destroy_event_channel(ch);
}

static void test_initqp(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_conn_param cp;
	struct rdma_cm_id *lid, *id;
	struct rdma_cm_event *e;
	struct ibv_qp_attr a;
	struct ibv_wc wc;
	struct peer peer;
	struct own o;
	uint32_t client_qpn;
	int port, r, n;

	side = "server: ";
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	lid = listener(ch, RDMA_PS_TCP, "127.0.0.1", &port);
	if (!lid || !start_peer(&peer, 0, initqp_client, "%d", port))
		return;
	e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request");
	if (!e)
		goto out;
	id = e->id;
	client_qpn = e->param.conn.qp_num;
	rdma_ack_cm_event(e);
	CHECK("the new id has no QP", !id->qp, "qp %p", (void *)id->qp);
	if (!own_make(&o, id->verbs))
		goto out_id;
	if (!own_move(id, &o, IBV_QPS_INIT, INIT_NEEDS, "INIT", &a))
		goto out_qp;
	CHECK("INIT: remote write and read allowed (the client asked for READ resources)",
	      (a.qp_access_flags & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)) ==
		      (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ),
	      "access 0x%x", a.qp_access_flags);
	if (!own_move(id, &o, IBV_QPS_RTR, RTR_NEEDS, "RTR", &a))
		goto out_qp;
	CHECK("RTR: the destination QP is the client's, max_dest_rd_atomic its initiator depth",
	      a.dest_qp_num == client_qpn && a.max_dest_rd_atomic == CLIENT_INIT,
	      "dest %u client %u max_dest_rd_atomic %u", a.dest_qp_num, client_qpn,
	      a.max_dest_rd_atomic);
	if (!own_move(id, &o, IBV_QPS_RTS, RTS_NEEDS, "RTS", NULL))
		goto out_qp;
	r = post_recv(o.qp, o.mr, o.buf, 512, 1);
	memset(&cp, 0, sizeof cp);
	cp.qp_num = o.qp->qp_num;
	cp.responder_resources = SERVER_RESP;
	cp.initiator_depth = SERVER_INIT;
	r = r ? r : rdma_accept(id, &cp);
	CHECK("rdma_accept with the QP's number and no id QP", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "after rdma_establish");
	if (e)
		rdma_ack_cm_event(e);
	n = wait_wc(o.cq, &wc);
	if (CHECK("the client's SEND arrives", wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_RECV, 1) &&
		  wc.byte_len == sizeof(struct hello), WC_FMT, WC_ARGS(n, wc))) {
		struct hello *h = (void *)o.buf;

		CHECK("the SEND's bytes are intact", mismatch(h->data, sizeof h->data, 30) < 0 &&
		      h->qpn == client_qpn, "qpn %u", h->qpn);
	}
	fill(o.buf + 512, 64, 31);
	r = post_send(o.qp, IBV_WR_SEND, o.mr, o.buf + 512, 64, 2, 0, 0);
	n = r ? 0 : wait_wc(o.cq, &wc);
	CHECK("the reply's SEND completes", wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_SEND, 2),
	      "post %d " WC_FMT, r, WC_ARGS(n, wc));
	e = expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "the client disconnects");
	if (e)
		rdma_ack_cm_event(e);
	r = rdma_disconnect(id);
	CHECK("rdma_disconnect without an id QP: 0", r == 0, "ret %d errno %d", r, errno);
out_qp:
	own_free(&o);
out_id:
	rdma_destroy_id(id);
out:
	wait_peer(&peer);
	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
}

/* ------------------------------------------------------------------ migrate */

static int readable(struct rdma_event_channel *ch, int ms)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };

	return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

static void test_migrate(void)
{
	struct rdma_event_channel *a = rdma_create_event_channel(), *b = rdma_create_event_channel();
	struct sockaddr_in dst = sin_of("127.0.0.1", 7471);
	struct rdma_cm_event *e = NULL;
	struct rdma_cm_id *id = NULL;
	int r, err, fl;

	if (!CHECK("two event channels", a && b, "errno %d", errno))
		return;
	fl = fcntl(b->fd, F_GETFL);
	r = fcntl(b->fd, F_SETFL, fl | O_NONBLOCK);
	CHECK("channel B's fd made O_NONBLOCK", fl >= 0 && r == 0, "errno %d", errno);
	errno = 0;
	r = rdma_get_cm_event(b, &e);
	err = errno;
	CHECK("an empty non-blocking channel: rdma_get_cm_event -1 EAGAIN", r == -1 && err == EAGAIN,
	      "ret %d errno %d", r, err);
	CHECK("an empty channel: poll says not readable", !readable(b, 0), "readable");

	r = rdma_create_id(a, &id, NULL, RDMA_PS_TCP);
	if (r == 0)
		r = rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000);
	if (!CHECK("an id on channel A resolves 127.0.0.1", r == 0, "ret %d errno %d", r, errno))
		goto out;
	CHECK("channel A readable while ADDR_RESOLVED waits", readable(a, EV_MS), "not readable");
	r = rdma_migrate_id(id, b);
	CHECK("rdma_migrate_id to channel B: 0, id->channel is B", r == 0 && id->channel == b,
	      "ret %d errno %d", r, errno);
	CHECK("the waiting event left channel A with the id", !readable(a, 0), "A readable");
	CHECK("channel B readable: the event waits there", readable(b, 0), "B not readable");
	e = NULL;
	r = rdma_get_cm_event(b, &e);
	CHECK("channel B gives ADDR_RESOLVED for the id", r == 0 && e &&
	      e->event == RDMA_CM_EVENT_ADDR_RESOLVED && e->id == id && e->status == 0,
	      "ret %d event %s", r, e ? rdma_event_str(e->event) : "-");
	if (r == 0)
		rdma_ack_cm_event(e);
	errno = 0;
	r = rdma_get_cm_event(b, &e);
	err = errno;
	CHECK("then channel B is empty: -1 EAGAIN", r == -1 && err == EAGAIN, "ret %d errno %d", r, err);

	r = rdma_resolve_route(id, 2000);
	CHECK("rdma_resolve_route", r == 0, "ret %d errno %d", r, errno);
	CHECK("ROUTE_RESOLVED comes to channel B", readable(b, EV_MS), "B not readable");
	CHECK("and not to channel A", !readable(a, 0), "A readable");
	e = NULL;
	r = rdma_get_cm_event(b, &e);
	CHECK("channel B gives ROUTE_RESOLVED", r == 0 && e && e->event == RDMA_CM_EVENT_ROUTE_RESOLVED,
	      "ret %d event %s", r, e ? rdma_event_str(e->event) : "-");
	if (r == 0)
		rdma_ack_cm_event(e);

	r = rdma_migrate_id(id, NULL);
	CHECK("rdma_migrate_id to NULL: a channel of its own", r == 0 && id->channel &&
	      id->channel != a && id->channel != b, "ret %d errno %d", r, errno);
	errno = 0;
	r = rdma_migrate_id(id, NULL);
	err = errno;
	CHECK("a synchronous id to NULL again: -1 EINVAL", r == -1 && err == EINVAL, "ret %d errno %d", r, err);
out:
	if (id)
		rdma_destroy_id(id);
	rdma_destroy_event_channel(a);
	rdma_destroy_event_channel(b);
}

/* ------------------------------------------------------------------ options */

static int setopt(struct rdma_cm_id *id, int level, int name, void *v, size_t len)
{
	errno = 0;
	return rdma_set_option(id, level, name, v, len);
}

#define OPT_OK(what, call) do { int r_ = (call), e_ = errno; \
	CHECK(what, r_ == 0, "ret %d errno %d", r_, e_); } while (0)
#define OPT_ERR(what, call, want) do { int r_ = (call), e_ = errno; \
	CHECK(what, r_ == -1 && e_ == (want), "ret %d errno %d", r_, e_); } while (0)

static void test_options(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel(), *cc = rdma_create_event_channel();
	struct sockaddr_in lo = sin_of("127.0.0.1", 0), dst;
	struct rdma_cm_id *id = NULL, *ud = NULL, *c = NULL, *sid = NULL;
	struct rdma_conn_param cp;
	struct rdma_cm_event *e;
	struct ibv_qp_attr a;
	struct ibv_port_attr pa;
	uint8_t tos = 32, ltos = 64, to = 18;
	int one = 1, zero = 0, r, mask, port, mtu = -1;
	uint64_t eight = 1;

	if (!CHECK("two event channels", ch && cc, "errno %d", errno))
		return;
	r = rdma_create_id(ch, &id, NULL, RDMA_PS_TCP);
	if (!CHECK("rdma_create_id", r == 0, "ret %d errno %d", r, errno))
		return;
	OPT_OK("TOS (one byte): 0", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, 1));
	OPT_ERR("TOS with optlen 4: -1 EINVAL", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &one, 4), EINVAL);
	OPT_OK("REUSEADDR before bind: 0", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &one, sizeof one));
	OPT_ERR("REUSEADDR with optlen 1: -1 EINVAL", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &one, 1), EINVAL);
	OPT_OK("AFONLY before bind: 0", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &one, sizeof one));
	OPT_ERR("AFONLY with optlen 8: -1 EINVAL", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &eight, 8), EINVAL);
	OPT_OK("ACK_TIMEOUT (one byte) on an RC id: 0", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &to, 1));
	OPT_ERR("ACK_TIMEOUT with optlen 4: -1 EINVAL", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &one, 4), EINVAL);
	OPT_ERR("an unknown option: -1 ENOSYS", setopt(id, RDMA_OPTION_ID, 99, &one, sizeof one), ENOSYS);
	OPT_ERR("an unknown level: -1 ENOSYS", setopt(id, 99, RDMA_OPTION_ID_TOS, &tos, 1), ENOSYS);

	r = rdma_bind_addr(id, (struct sockaddr *)&lo);
	port = ntohs(rdma_get_src_port(id));
	if (!CHECK("bind 127.0.0.1, port 0", r == 0 && port, "ret %d errno %d", r, errno))
		goto out;
	/* Linux's rdma_set_reuseaddr: turning it on is allowed until the id listens, turning
	 * it off only before bind; rdma_set_afonly: until the id listens. */
	OPT_ERR("REUSEADDR off after bind: -1 EINVAL", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &zero, sizeof zero), EINVAL);
	OPT_OK("REUSEADDR on after bind, before listen: 0", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &one, sizeof one));
	OPT_OK("AFONLY after bind, before listen: 0", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &one, sizeof one));
	r = rdma_listen(id, 4);
	if (!CHECK("rdma_listen", r == 0, "ret %d errno %d", r, errno))
		goto out;
	OPT_ERR("REUSEADDR on a listening id: -1 EINVAL", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &one, sizeof one), EINVAL);
	OPT_ERR("AFONLY on a listening id: -1 EINVAL", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &one, sizeof one), EINVAL);
	OPT_OK("TOS on a listening id: 0", setopt(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &ltos, 1));

	r = rdma_create_id(ch, &ud, NULL, RDMA_PS_UDP);
	if (CHECK("a UDP id", r == 0, "ret %d errno %d", r, errno)) {
		OPT_ERR("ACK_TIMEOUT on a UD id: -1 EINVAL", setopt(ud, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &to, 1), EINVAL);
		OPT_OK("TOS on a UD id: 0", setopt(ud, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, 1));
	}

	/* The effect: a client with TOS 32 and ACK_TIMEOUT 18 (no QPs: the attributes come
	 * from rdma_init_qp_attr). */
	r = rdma_create_id(cc, &c, NULL, RDMA_PS_TCP);
	if (!CHECK("client id", r == 0, "ret %d errno %d", r, errno))
		goto out;
	OPT_OK("client: TOS 32", setopt(c, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, 1));
	OPT_OK("client: ACK_TIMEOUT 18", setopt(c, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &to, 1));
	dst = sin_of("127.0.0.1", port);
	r = rdma_resolve_addr(c, NULL, (struct sockaddr *)&dst, 2000);
	e = r ? NULL : expect(cc, RDMA_CM_EVENT_ADDR_RESOLVED, 0, "client");
	if (!e)
		goto out;
	rdma_ack_cm_event(e);
	r = rdma_resolve_route(c, 2000);
	e = r ? NULL : expect(cc, RDMA_CM_EVENT_ROUTE_RESOLVED, 0, "client");
	if (!e)
		goto out;
	rdma_ack_cm_event(e);
	CHECK("the route's path record has the TOS as its traffic class",
	      c->route.num_paths == 1 && c->route.path_rec && c->route.path_rec->traffic_class == tos,
	      "paths %d traffic_class %d", c->route.num_paths,
	      c->route.path_rec ? c->route.path_rec->traffic_class : -1);
	/* Linux gives a RoCE route its netdev's MTU, and rxe its port the same: on lo, 4096. */
	r = ibv_query_port(c->verbs, c->port_num, &pa);
	if (c->route.path_rec)
		mtu = c->route.path_rec->mtu;
	CHECK("the route's path record has the link's MTU, the port's active MTU",
	      r == 0 && mtu == (int)pa.active_mtu && mtu >= IBV_MTU_256 && mtu <= IBV_MTU_4096,
	      "ret %d path mtu %d active_mtu %d", r, mtu, (int)pa.active_mtu);
	{
		FILE *f = fopen("/sys/class/net/lo/mtu", "r");
		int lo_mtu = 0;

		if (f) {
			if (fscanf(f, "%d", &lo_mtu) != 1)
				lo_mtu = 0;
			fclose(f);
		}
		if (lo_mtu >= 4096 + 96)
			CHECK("on lo (MTU 65536 by default) that is 4096", mtu == IBV_MTU_4096,
			      "lo MTU %d, path mtu %d", lo_mtu, mtu);
	}
	conn_params(&cp, NULL, 0);
	cp.qp_num = 0xabc;
	r = rdma_connect(c, &cp);
	CHECK("client: rdma_connect without a QP", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "server");
	if (!e)
		goto out;
	sid = e->id;
	CHECK("the request names QP 0xabc", e->param.conn.qp_num == 0xabc, "qp_num 0x%x", e->param.conn.qp_num);
	rdma_ack_cm_event(e);
	/* The passive side's path is the REQ's: the client's TOS, not the listener's 64. */
	CHECK("the request's id: its path record has the client's TOS as traffic class",
	      sid->route.num_paths == 1 && sid->route.path_rec &&
		      sid->route.path_rec->traffic_class == tos,
	      "paths %d traffic_class %d", sid->route.num_paths,
	      sid->route.path_rec ? sid->route.path_rec->traffic_class : -1);
	CHECK("the request's id: its path record has the REQ's MTU",
	      sid->route.path_rec && sid->route.path_rec->mtu == mtu, "mtu %d, the client's %d",
	      sid->route.path_rec ? sid->route.path_rec->mtu : -1, mtu);
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	r = rdma_init_qp_attr(sid, &a, &mask);
	CHECK("the request's id: RTR attributes with the REQ's path MTU",
	      r == 0 && (mask & IBV_QP_PATH_MTU) && (int)a.path_mtu == mtu, "ret %d mask 0x%x path_mtu %d",
	      r, mask, (int)a.path_mtu);
	CHECK("the request's id: RTR attributes with the client's TOS as traffic class",
	      r == 0 && (mask & IBV_QP_AV) && a.ah_attr.grh.traffic_class == tos && a.dest_qp_num == 0xabc,
	      "ret %d mask 0x%x traffic_class %d dest 0x%x", r, mask, a.ah_attr.grh.traffic_class,
	      a.dest_qp_num);
	memset(&cp, 0, sizeof cp);
	cp.qp_num = 0xdef;
	cp.responder_resources = SERVER_RESP;
	cp.initiator_depth = SERVER_INIT;
	r = rdma_accept(sid, &cp);
	CHECK("server: rdma_accept without a QP", r == 0, "ret %d errno %d", r, errno);
	e = expect(cc, RDMA_CM_EVENT_CONNECT_RESPONSE, 0, "client");
	if (!e)
		goto out;
	rdma_ack_cm_event(e);
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	r = rdma_init_qp_attr(c, &a, &mask);
	CHECK("RTR attributes: the TOS as the address vector's traffic class, QP 0xdef",
	      r == 0 && (mask & IBV_QP_AV) && a.ah_attr.is_global &&
		      a.ah_attr.grh.traffic_class == tos && a.dest_qp_num == 0xdef,
	      "ret %d mask 0x%x global %d traffic_class %d dest 0x%x", r, mask, a.ah_attr.is_global,
	      a.ah_attr.grh.traffic_class, a.dest_qp_num);
	CHECK("RTR attributes: the route's path MTU", r == 0 && (int)a.path_mtu == mtu,
	      "ret %d path_mtu %d", r, (int)a.path_mtu);
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	r = rdma_init_qp_attr(c, &a, &mask);
	CHECK("RTS attributes: the ACK_TIMEOUT as the QP's timeout",
	      r == 0 && (mask & IBV_QP_TIMEOUT) && a.timeout == to, "ret %d mask 0x%x timeout %d", r,
	      mask, a.timeout);
	r = rdma_establish(c);
	CHECK("client: rdma_establish", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "server");
	if (e)
		rdma_ack_cm_event(e);
out:
	if (c)
		rdma_destroy_id(c);
	if (sid)
		rdma_destroy_id(sid);
	if (ud)
		rdma_destroy_id(ud);
	if (id)
		rdma_destroy_id(id);
	rdma_destroy_event_channel(cc);
	rdma_destroy_event_channel(ch);
}

/* ----------------------------------------------------------------------- ud */

#define GRH 40
#define UD_LEN 64

static void ud_client(const char *arg)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_conn_param cp;
	struct rdma_cm_event *e;
	struct rdma_cm_id *id;
	struct ibv_ah *ah = NULL;
	struct ibv_mr *mr = NULL;
	struct ibv_wc wc;
	uint8_t pd[64], buf[256];
	uint32_t qpn = 0, qkey = 0;
	int r, n;

	side = "client: ";
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	id = resolved_id(ch, RDMA_PS_UDP, "127.0.0.1", atoi(arg), "UD");
	if (!id)
		goto out;
	CHECK("a UDP id's qp_type is UD", id->qp_type == IBV_QPT_UD, "qp_type %d", id->qp_type);
	r = make_qp(id, IBV_QPT_UD);
	mr = r ? NULL : ibv_reg_mr(id->pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	if (!CHECK("UD QP and MR", r == 0 && mr, "ret %d errno %d", r, errno))
		goto out_id;
	{
		struct ibv_qp_attr a;
		struct ibv_qp_init_attr ia;

		r = ibv_query_qp(id->qp, &a, IBV_QP_STATE | IBV_QP_QKEY, &ia);
		CHECK("rdma_create_qp left the UD QP in RTS with Q_Key 0x01234567",
		      r == 0 && a.qp_state == IBV_QPS_RTS && a.qkey == UDP_QKEY,
		      "ret %d state %d qkey 0x%x", r, a.qp_state, a.qkey);
	}
	memset(pd, 0, sizeof pd);
	memcpy(pd, &id->qp->qp_num, 4);
	fill(pd + 4, sizeof pd - 4, 6);
	memset(&cp, 0, sizeof cp);
	cp.private_data = pd;
	cp.private_data_len = sizeof pd;
	r = rdma_connect(id, &cp);
	CHECK("rdma_connect (SIDR)", r == 0, "ret %d errno %d", r, errno);
	e = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "UD");
	if (!e)
		goto out_id;
	{
		const struct rdma_ud_param *u = &e->param.ud;
		uint32_t server_qpn = 0;

		if (u->private_data)
			memcpy(&server_qpn, u->private_data, 4);
		CHECK("ESTABLISHED carries the SIDR_REP's 136 bytes of private data",
		      u->private_data && u->private_data_len == 136 &&
			      mismatch((const uint8_t *)u->private_data + 4, 60, 7) < 0,
		      "len %u", u->private_data_len);
		CHECK("ESTABLISHED's qp_num is the server's QP", u->qp_num && u->qp_num == server_qpn,
		      "qp_num %u server %u", u->qp_num, server_qpn);
		CHECK("ESTABLISHED's qkey is RDMA_UDP_QKEY 0x01234567", u->qkey == UDP_QKEY,
		      "qkey 0x%x", u->qkey);
		qpn = u->qp_num;
		qkey = u->qkey;
		ah = ibv_create_ah(id->pd, (struct ibv_ah_attr *)&u->ah_attr);
		CHECK("ibv_create_ah from ESTABLISHED's ah_attr", ah, "errno %d", errno);
	}
	rdma_ack_cm_event(e);
	if (!ah)
		goto out_id;
	{
		struct ibv_sge sge = { (uintptr_t)buf, UD_LEN, mr->lkey };
		struct ibv_send_wr wr, *bad;

		fill(buf, UD_LEN, 8);
		memset(&wr, 0, sizeof wr);
		wr.wr_id = 5;
		wr.sg_list = &sge;
		wr.num_sge = 1;
		wr.opcode = IBV_WR_SEND;
		wr.send_flags = IBV_SEND_SIGNALED;
		wr.wr.ud.ah = ah;
		wr.wr.ud.remote_qpn = qpn;
		wr.wr.ud.remote_qkey = qkey;
		r = ibv_post_send(id->qp, &wr, &bad);
		n = r ? 0 : wait_wc(id->send_cq, &wc);
		CHECK("the UD SEND completes", wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_SEND, 5),
		      "post %d " WC_FMT, r, WC_ARGS(n, wc));
	}
	expect_no_more(ch, RDMA_CM_EVENT_ESTABLISHED, "UD");
out_id:
	if (ah)
		ibv_destroy_ah(ah);
	if (mr)
		ibv_dereg_mr(mr);
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
out:
	rdma_destroy_event_channel(ch);
}

static void test_ud(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_conn_param cp;
	struct rdma_cm_id *lid, *id;
	struct rdma_cm_event *e;
	struct ibv_mr *mr = NULL;
	struct ibv_wc wc;
	struct peer peer;
	uint8_t pd[64], buf[512];
	uint32_t client_qpn = 0;
	int port, r, n;

	side = "server: ";
	if (!CHECK("rdma_create_event_channel", ch, "errno %d", errno))
		return;
	lid = listener(ch, RDMA_PS_UDP, "127.0.0.1", &port);
	if (!lid || !start_peer(&peer, 0, ud_client, "%d", port))
		return;
	e = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "UD request");
	if (!e)
		goto out;
	id = e->id;
	{
		const struct rdma_ud_param *u = &e->param.ud;

		if (u->private_data)
			memcpy(&client_qpn, u->private_data, 4);
		CHECK("the request carries the SIDR_REQ's 180 bytes of private data, intact",
		      u->private_data && u->private_data_len == 180 &&
			      mismatch((const uint8_t *)u->private_data + 4, 60, 6) < 0 &&
			      nonzero((const uint8_t *)u->private_data + 64, 116) < 0,
		      "len %u", u->private_data_len);
	}
	rdma_ack_cm_event(e);
	r = make_qp(id, IBV_QPT_UD);
	mr = r ? NULL : ibv_reg_mr(id->pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	if (!CHECK("UD QP and MR on the new id", r == 0 && mr, "ret %d errno %d", r, errno))
		goto out_id;
	memset(buf, 0, sizeof buf);
	r = post_recv(id->qp, mr, buf, GRH + 256, 1);
	CHECK("receive posted", r == 0, "ret %d", r);
	memset(pd, 0, sizeof pd);
	memcpy(pd, &id->qp->qp_num, 4);
	fill(pd + 4, sizeof pd - 4, 7);
	memset(&cp, 0, sizeof cp);
	cp.private_data = pd;
	cp.private_data_len = sizeof pd;
	r = rdma_accept(id, &cp);
	CHECK("rdma_accept (SIDR_REP)", r == 0, "ret %d errno %d", r, errno);
	n = wait_wc(id->recv_cq, &wc);
	CHECK("the client's UD SEND arrives: 40 bytes of GRH, then its 64 bytes intact",
	      wc_is(n, &wc, IBV_WC_SUCCESS, IBV_WC_RECV, 1) && wc.byte_len == GRH + UD_LEN &&
		      mismatch(buf + GRH, UD_LEN, 8) < 0,
	      WC_FMT, WC_ARGS(n, wc));
	CHECK("its source QP is the client's", n == 1 && wc.src_qp == client_qpn, "src_qp %u client %u",
	      wc.src_qp, client_qpn);
	wait_peer(&peer);
	peer.pid = 0;
out_id:
	if (mr)
		ibv_dereg_mr(mr);
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
out:
	wait_peer(&peer);
	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
}

/* --------------------------------------------------------------------- main */

static const struct {
	const char *name;
	void (*fn)(void);
	void (*client)(const char *arg);
} groups[] = {
	{ "connect", test_connect, conn_client },
	{ "sdisconnect", test_sdisconnect, conn_client },
	{ "threads", test_threads, conn_client },
	{ "inflight", test_inflight, inflight_client },
	{ "cinflight", test_cinflight, inflight_client },
	{ "verbs", test_verbs, verbs_client },
	{ "reject", test_reject, reject_client },
	{ "noport", test_noport, NULL },
	{ "unreachable", test_unreachable, NULL },
	{ "listen2", test_listen2, listen2_client },
	{ "wildcard", test_wildcard, wildcard_client },
	{ "initqp", test_initqp, initqp_client },
	{ "migrate", test_migrate, NULL },
	{ "options", test_options, NULL },
	{ "ud", test_ud, ud_client },
};
#define NGROUPS (sizeof groups / sizeof groups[0])

static char alarm_msg[256];

static void on_alarm(int sig)
{
	ssize_t w;

	(void)sig;
	w = write(1, alarm_msg, strlen(alarm_msg));
	(void)w;
	_exit(3);
}

int main(int argc, char **argv)
{
	const char *only = NULL, *role = NULL, *arg = "";
	size_t g;
	ssize_t n;
	int c;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((c = getopt(argc, argv, "lt:r:a:")) != -1) {
		switch (c) {
		case 'l':
			for (g = 0; g < NGROUPS; g++)
				printf("%s\n", groups[g].name);
			return 0;
		case 't':
			only = optarg;
			break;
		case 'r':
			role = optarg;
			break;
		case 'a':
			arg = optarg;
			break;
		default:
			fprintf(stderr, "usage: %s [-l] -t GROUP\n", argv[0]);
			return 2;
		}
	}
	n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
	if (n <= 0)
		return 2;
	self_path[n] = 0;
	if (!only) {
		/* Every group, each in a process of its own. */
		int bad = 0;

		for (g = 0; g < NGROUPS; g++) {
			pid_t p;
			int st = 0;

			fflush(stdout);
			p = fork();
			if (p == 0) {
				execl(self_path, self_path, "-t", groups[g].name, (char *)NULL);
				_exit(127);
			}
			if (p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st))
				bad = 1;
		}
		return bad;
	}
	for (g = 0; g < NGROUPS; g++)
		if (!strcmp(only, groups[g].name))
			break;
	if (g == NGROUPS) {
		fprintf(stderr, "no group %s\n", only);
		return 2;
	}
	group = groups[g].name;
	snprintf(alarm_msg, sizeof alarm_msg, "FAIL: %s%s: the process ends within %d s (timed out)\n",
		 role ? "client process " : "", group, PROCESS_S);
	signal(SIGALRM, on_alarm);
	signal(SIGPIPE, SIG_IGN);
	alarm(PROCESS_S);
	if (role) {
		if (!groups[g].client)
			return 2;
		groups[g].client(arg);
	} else {
		groups[g].fn();
	}
	return failures ? 1 : 0;
}
