/*
 * verbs_test.c: checks of a libibverbs.so.1 (softrdma's drop-in, or rdma-core with a
 * provider such as rxe) through the public <infiniband/verbs.h> API only.
 *
 * Both sides run in this process: two QPs on one device connected to each other
 * (the address vector's dgid is the device's own GID). With -f (fork mode) the
 * responder side runs in a child process with its own device and the two talk over
 * the network (for a library where a device cannot reach itself).
 *
 * Each check prints "PASS: name" or "FAIL: name (first reason)"; the last line is
 * "verbs_test: N passed, M failed"; the exit status is 1 when any check failed.
 * The program never aborts on an unexpected result: every wait is bounded and a
 * per-check watchdog turns a hang into a FAIL line.
 *
 *   gcc -O1 -Wall -Werror -o verbs_test verbs_test.c -libverbs
 *   ./verbs_test [-d DEVICE] [-g GID_INDEX] [-i PORT] [-t GROUP,...] [-l] [-q] [-v] [-f]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <infiniband/sa.h>
#include <infiniband/verbs.h>
#include <rdma/ib_user_sa.h>
#include <rdma/ib_user_verbs.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------ */
/* check bookkeeping                                                               */

static int g_pass, g_fail;
static const char *g_check = "(setup)";
static int g_check_failed, g_check_open;
static char g_why[600];
static int g_verbose;
static const char *g_filter;
static int g_watchdog_s = 60;
static int g_child;
static int g_quiet_open; /* -q: no PASS line for the device open check */
static int g_open_before_fork; /* -F: fork mode with the parent's device open at fork() */

static void summary_and_exit(int code)
{
	printf("verbs_test: %d passed, %d failed\n", g_pass, g_fail);
	fflush(stdout);
	_exit(code);
}

static void on_signal(int sig)
{
	char buf[300];
	int n;

	n = snprintf(buf, sizeof(buf), "FAIL: %s (%s)\n", g_check,
		     sig == SIGALRM ? "watchdog: no result in time, the library hung" : strsignal(sig));
	if (write(1, buf, n) < 0) {
		/* nothing to do */
	}
	g_fail++;
	summary_and_exit(1);
}

static void check_begin(const char *name)
{
	g_check = name;
	g_check_failed = 0;
	g_check_open = 1;
	g_why[0] = 0;
	alarm(g_watchdog_s);
	if (g_verbose)
		fprintf(stderr, "--- %s\n", name);
}

static int check_end(void)
{
	int ok = !g_check_failed;

	if (!g_check_open)
		return 1;
	if (ok && g_quiet_open && !strcmp(g_check, "device open and query")) {
		g_check_open = 0;
		alarm(0);
		return 1;
	}
	g_check_open = 0;
	alarm(0);
	if (g_child) { /* the fork-mode child reports on stderr; its exit status is the parent's check */
		if (!ok)
			fprintf(stderr, "child FAIL: %s (%s)\n", g_check, g_why);
		g_fail += !ok;
		return ok;
	}
	if (ok) {
		printf("PASS: %s\n", g_check);
		g_pass++;
	} else {
		printf("FAIL: %s (%s)\n", g_check, g_why);
		g_fail++;
	}
	fflush(stdout);
	return ok;
}

static int expect_(int ok, int line, const char *expr, const char *fmt, ...)
{
	char msg[400];
	va_list ap;

	if (ok)
		return 1;
	if (!g_check_open) { /* a failure in teardown after the check's line: a line of its own */
		va_start(ap, fmt);
		vsnprintf(msg, sizeof(msg), fmt, ap);
		va_end(ap);
		printf("%sFAIL: %s: teardown (line %d: %s — %s)\n", g_child ? "child " : "", g_check, line, msg, expr);
		g_fail++;
		return 0;
	}
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (!g_check_failed)
		snprintf(g_why, sizeof(g_why), "line %d: %s%s%s", line, msg[0] ? msg : expr,
			 msg[0] ? " — " : "", msg[0] ? expr : "");
	g_check_failed = 1;
	fprintf(stderr, "  [%s] line %d: %s: %s\n", g_check, line, expr, msg);
	return 0;
}
#define EXPECT(cond, ...) expect_(!!(cond), __LINE__, #cond, __VA_ARGS__)

/* -t: a comma-separated list of group names (see -l) */
static int selected(const char *name)
{
	const char *p = g_filter;
	size_t n = strlen(name);

	if (!p)
		return 1;
	while ((p = strstr(p, name))) {
		if ((p == g_filter || p[-1] == ',') && (p[n] == 0 || p[n] == ','))
			return 1;
		p += n;
	}
	return 0;
}

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t now_wall_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_REALTIME, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------------------ */
/* device, memory, QP pairs                                                        */

struct dev {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_device_attr_ex attr;
	struct ibv_port_attr port;
	union ibv_gid gid;
	int gidx;
	uint8_t port_num;
	char name[64];
};

static struct dev D;
static const char *g_devname;
static int g_gidx, g_port = 1;

#define BUF_LEN (256 * 1024)
#define ACC_ALL (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
		 IBV_ACCESS_REMOTE_ATOMIC)

struct mem {
	char *buf;
	struct ibv_mr *mr;
	size_t len;
};

static int mem_alloc(struct mem *m, size_t len, int access)
{
	memset(m, 0, sizeof(*m));
	if (posix_memalign((void **)&m->buf, 4096, len))
		return 0;
	memset(m->buf, 0, len);
	m->len = len;
	m->mr = ibv_reg_mr(D.pd, m->buf, len, access);
	EXPECT(m->mr, "ibv_reg_mr(%zu, 0x%x): %s", len, access, strerror(errno));
	return m->mr != NULL;
}

static void mem_free(struct mem *m)
{
	if (m->mr)
		ibv_dereg_mr(m->mr);
	free(m->buf);
	memset(m, 0, sizeof(*m));
}

static void fill(char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (char)((i * 131 + seed * 7 + (i >> 8)) & 0xff);
}

/* first differing offset, or -1 */
static long diff_at(const void *a, const void *b, size_t n)
{
	const unsigned char *x = a, *y = b;

	for (size_t i = 0; i < n; i++)
		if (x[i] != y[i])
			return (long)i;
	return -1;
}

struct ep {
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	struct ibv_qp_cap cap;
};

struct pair_opts {
	enum ibv_qp_type type;
	int sig_all;
	uint32_t max_send_wr, max_recv_wr, max_sge, max_inline;
	struct ibv_srq *srq_b;
	struct ibv_cq *rcq_b; /* use this CQ as B's receive CQ (not owned) */
	int rnr_retry, retry_cnt, timeout, min_rnr_timer;
	int b_rtr_only; /* leave B in RTR */
	int b_access;   /* qp_access_flags of B; 0 = all remote */
	int no_connect;
};

struct pair {
	struct ep a, b;
	struct pair_opts o;
	int owned_rcq_b;
};

#define QKEY 0x11111111u
#define PSN_A 0x001234u
#define PSN_B 0x00abcdu

static void default_opts(struct pair_opts *o, enum ibv_qp_type t)
{
	memset(o, 0, sizeof(*o));
	o->type = t;
	o->sig_all = 1;
	o->max_send_wr = 64;
	o->max_recv_wr = 64;
	o->max_sge = 3;
	o->max_inline = 0;
	o->rnr_retry = 7;
	o->retry_cnt = 6;
	o->timeout = 14;
	o->min_rnr_timer = 1;
}

static int make_ep(struct ep *e, const struct pair_opts *o, struct ibv_srq *srq, struct ibv_cq *rcq)
{
	struct ibv_qp_init_attr ia;

	memset(e, 0, sizeof(*e));
	e->scq = ibv_create_cq(D.ctx, 256, NULL, NULL, 0);
	if (!EXPECT(e->scq, "ibv_create_cq: %s", strerror(errno)))
		return 0;
	if (rcq) {
		e->rcq = rcq;
	} else {
		e->rcq = ibv_create_cq(D.ctx, 256, NULL, NULL, 0);
		if (!EXPECT(e->rcq, "ibv_create_cq: %s", strerror(errno)))
			return 0;
	}
	memset(&ia, 0, sizeof(ia));
	ia.send_cq = e->scq;
	ia.recv_cq = e->rcq;
	ia.srq = srq;
	ia.qp_type = o->type;
	ia.sq_sig_all = o->sig_all;
	ia.cap.max_send_wr = o->max_send_wr;
	ia.cap.max_recv_wr = srq ? 0 : o->max_recv_wr;
	ia.cap.max_send_sge = o->max_sge;
	ia.cap.max_recv_sge = srq ? 0 : o->max_sge;
	ia.cap.max_inline_data = o->max_inline;
	e->qp = ibv_create_qp(D.pd, &ia);
	if (!EXPECT(e->qp, "ibv_create_qp(type %d, inline %u): %s", o->type, o->max_inline, strerror(errno)))
		return 0;
	e->cap = ia.cap;
	return 1;
}

static void fill_ah(struct ibv_ah_attr *ah)
{
	memset(ah, 0, sizeof(*ah));
	ah->is_global = 1;
	ah->grh.dgid = D.gid;
	ah->grh.sgid_index = D.gidx;
	ah->grh.hop_limit = 64;
	ah->port_num = D.port_num;
}

static int qp_to_init(struct ibv_qp *qp, enum ibv_qp_type t, int access)
{
	struct ibv_qp_attr a;
	int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT, rc;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = D.port_num;
	if (t == IBV_QPT_UD) {
		a.qkey = QKEY;
		mask |= IBV_QP_QKEY;
	} else {
		a.qp_access_flags = access;
		mask |= IBV_QP_ACCESS_FLAGS;
	}
	rc = ibv_modify_qp(qp, &a, mask);
	return EXPECT(rc == 0, "modify_qp INIT: %s", strerror(rc));
}

static int qp_to_rtr(struct ibv_qp *qp, enum ibv_qp_type t, uint32_t dqpn, uint32_t rq_psn,
		     int min_rnr_timer)
{
	struct ibv_qp_attr a;
	int mask = IBV_QP_STATE, rc;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	if (t != IBV_QPT_UD) {
		a.path_mtu = D.port.active_mtu;
		a.dest_qp_num = dqpn;
		a.rq_psn = rq_psn;
		fill_ah(&a.ah_attr);
		mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
	}
	if (t == IBV_QPT_RC) {
		a.max_dest_rd_atomic = D.attr.orig_attr.max_qp_rd_atom > 16 ? 16 : D.attr.orig_attr.max_qp_rd_atom;
		if (!a.max_dest_rd_atomic)
			a.max_dest_rd_atomic = 1;
		a.min_rnr_timer = min_rnr_timer;
		mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
	}
	rc = ibv_modify_qp(qp, &a, mask);
	return EXPECT(rc == 0, "modify_qp RTR: %s", strerror(rc));
}

static int qp_to_rts(struct ibv_qp *qp, enum ibv_qp_type t, uint32_t sq_psn, const struct pair_opts *o)
{
	struct ibv_qp_attr a;
	int mask = IBV_QP_STATE | IBV_QP_SQ_PSN, rc;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = sq_psn;
	if (t == IBV_QPT_RC) {
		a.timeout = o->timeout;
		a.retry_cnt = o->retry_cnt;
		a.rnr_retry = o->rnr_retry;
		a.max_rd_atomic = D.attr.orig_attr.max_qp_init_rd_atom > 16 ? 16 : D.attr.orig_attr.max_qp_init_rd_atom;
		if (!a.max_rd_atomic)
			a.max_rd_atomic = 1;
		mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
	}
	rc = ibv_modify_qp(qp, &a, mask);
	return EXPECT(rc == 0, "modify_qp RTS: %s", strerror(rc));
}

static void free_pair(struct pair *p);

static int make_pair(struct pair *p, const struct pair_opts *o)
{
	int acc_b;

	memset(p, 0, sizeof(*p));
	p->o = *o;
	if (!make_ep(&p->a, o, NULL, NULL))
		return 0;
	if (!make_ep(&p->b, o, o->srq_b, o->rcq_b))
		return 0;
	p->owned_rcq_b = o->rcq_b == NULL;
	if (o->no_connect)
		return 1;
	acc_b = o->b_access ? o->b_access :
		(o->type == IBV_QPT_UC ? IBV_ACCESS_REMOTE_WRITE :
		 IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	if (!qp_to_init(p->a.qp, o->type,
			o->type == IBV_QPT_UC ? IBV_ACCESS_REMOTE_WRITE :
			IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC) ||
	    !qp_to_init(p->b.qp, o->type, acc_b))
		return 0;
	if (!qp_to_rtr(p->a.qp, o->type, p->b.qp->qp_num, PSN_B, o->min_rnr_timer) ||
	    !qp_to_rtr(p->b.qp, o->type, p->a.qp->qp_num, PSN_A, o->min_rnr_timer))
		return 0;
	if (!qp_to_rts(p->a.qp, o->type, PSN_A, o))
		return 0;
	if (!o->b_rtr_only && !qp_to_rts(p->b.qp, o->type, PSN_B, o))
		return 0;
	return 1;
}

static void free_ep(struct ep *e, int own_rcq)
{
	if (e->qp && ibv_destroy_qp(e->qp))
		EXPECT(0, "ibv_destroy_qp: %s", strerror(errno));
	if (e->scq && ibv_destroy_cq(e->scq))
		EXPECT(0, "ibv_destroy_cq: %s", strerror(errno));
	if (own_rcq && e->rcq && ibv_destroy_cq(e->rcq))
		EXPECT(0, "ibv_destroy_cq: %s", strerror(errno));
	memset(e, 0, sizeof(*e));
}

static void free_pair(struct pair *p)
{
	free_ep(&p->a, 1);
	free_ep(&p->b, p->owned_rcq_b);
}

/* ------------------------------------------------------------------------------ */
/* posting and polling                                                             */

static int post_recv(struct ibv_qp *qp, uint64_t id, void *addr, uint32_t len, uint32_t lkey)
{
	struct ibv_sge sge = { (uintptr_t)addr, len, lkey };
	struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad = NULL;
	int rc = ibv_post_recv(qp, &wr, &bad);

	return EXPECT(rc == 0, "ibv_post_recv: %s", strerror(rc));
}

static int post_srq_recv(struct ibv_srq *srq, uint64_t id, void *addr, uint32_t len, uint32_t lkey)
{
	struct ibv_sge sge = { (uintptr_t)addr, len, lkey };
	struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad = NULL;
	int rc = ibv_post_srq_recv(srq, &wr, &bad);

	return EXPECT(rc == 0, "ibv_post_srq_recv: %s", strerror(rc));
}

struct sendspec {
	uint64_t id;
	enum ibv_wr_opcode op;
	void *addr;
	uint32_t len;
	uint32_t lkey;
	unsigned flags;
	uint64_t raddr;
	uint32_t rkey;
	uint32_t imm; /* host order; posted as htonl */
	uint64_t cmp_add, swap;
	uint32_t inv_rkey;
};

static int post_send1(struct ibv_qp *qp, const struct sendspec *s)
{
	struct ibv_sge sge = { (uintptr_t)s->addr, s->len, s->lkey };
	struct ibv_send_wr wr, *bad = NULL;
	int rc;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = s->id;
	wr.opcode = s->op;
	wr.sg_list = &sge;
	wr.num_sge = s->len || s->addr ? 1 : 0;
	wr.send_flags = s->flags;
	switch (s->op) {
	case IBV_WR_RDMA_WRITE:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
	case IBV_WR_RDMA_READ:
		wr.wr.rdma.remote_addr = s->raddr;
		wr.wr.rdma.rkey = s->rkey;
		break;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		wr.wr.atomic.remote_addr = s->raddr;
		wr.wr.atomic.rkey = s->rkey;
		wr.wr.atomic.compare_add = s->cmp_add;
		wr.wr.atomic.swap = s->swap;
		break;
	default:
		break;
	}
	if (s->op == IBV_WR_SEND_WITH_IMM || s->op == IBV_WR_RDMA_WRITE_WITH_IMM)
		wr.imm_data = htonl(s->imm);
	if (s->op == IBV_WR_SEND_WITH_INV)
		wr.invalidate_rkey = s->inv_rkey;
	rc = ibv_post_send(qp, &wr, &bad);
	return EXPECT(rc == 0, "ibv_post_send(opcode %d): %s", s->op, strerror(rc));
}

/* Polls until n completions or timeout; returns how many were polled. */
static int poll_n(struct ibv_cq *cq, struct ibv_wc *wc, int n, int timeout_ms)
{
	int got = 0;
	uint64_t end = now_ms() + timeout_ms;
	unsigned spins = 0;

	while (got < n) {
		int r = ibv_poll_cq(cq, n - got, wc + got);

		if (r < 0) {
			EXPECT(0, "ibv_poll_cq returned %d", r);
			return got;
		}
		got += r;
		if (got >= n)
			break;
		if (now_ms() > end)
			break;
		if (++spins > 1000)
			sleep_ms(1);
		else
			sched_yield();
	}
	return got;
}

static int poll1(struct ibv_cq *cq, struct ibv_wc *wc, const char *what)
{
	int n = poll_n(cq, wc, 1, 10000);

	return EXPECT(n == 1, "no completion for %s within 10 s", what);
}

static int expect_cq_empty(struct ibv_cq *cq, int ms, const char *what)
{
	struct ibv_wc wc;
	int n = poll_n(cq, &wc, 1, ms);

	return EXPECT(n == 0, "unexpected completion on %s: wr_id %" PRIu64 " status %s opcode %d",
		      what, wc.wr_id, ibv_wc_status_str(wc.status), wc.opcode);
}

#define ANY (-1L)
struct want {
	uint64_t wr_id;
	enum ibv_wc_status status;
	long opcode;   /* ANY */
	long byte_len; /* ANY */
	long qp_num;   /* ANY */
	long flags;    /* exact wc_flags & (IMM|INV|GRH), ANY */
	long imm;      /* host-order immediate (compared as ntohl(imm_data)), ANY */
	long src_qp;   /* ANY */
};

static int check_wc(const struct ibv_wc *wc, const struct want *w, const char *what)
{
	int ok = 1;

	ok &= EXPECT(wc->wr_id == w->wr_id, "%s: wr_id %" PRIu64 " want %" PRIu64, what, wc->wr_id, w->wr_id);
	ok &= EXPECT(wc->status == w->status, "%s: status %s (%d, vendor_err 0x%x) want %s", what,
		     ibv_wc_status_str(wc->status), wc->status, wc->vendor_err, ibv_wc_status_str(w->status));
	if (w->qp_num != ANY)
		ok &= EXPECT(wc->qp_num == (uint32_t)w->qp_num, "%s: qp_num 0x%x want 0x%lx", what, wc->qp_num, w->qp_num);
	if (wc->status != IBV_WC_SUCCESS)
		return ok; /* the other fields are undefined on error */
	if (w->opcode != ANY)
		ok &= EXPECT(wc->opcode == w->opcode, "%s: opcode %d want %ld", what, wc->opcode, w->opcode);
	if (w->byte_len != ANY)
		ok &= EXPECT(wc->byte_len == w->byte_len, "%s: byte_len %u want %ld", what, wc->byte_len, w->byte_len);
	/* IBV_WC_GRH is checked only where it is asked for (UD): on RC and UC over RoCE some
	 * providers set it (rxe) and some do not. */
	if (w->flags != ANY) {
		unsigned mask = IBV_WC_WITH_IMM | IBV_WC_WITH_INV | (w->flags & IBV_WC_GRH);

		ok &= EXPECT((wc->wc_flags & mask) == w->flags, "%s: wc_flags 0x%x want 0x%lx (of mask 0x%x)", what,
			     wc->wc_flags, w->flags, mask);
	}
	if (w->imm != ANY)
		ok &= EXPECT(ntohl(wc->imm_data) == (uint32_t)w->imm,
			     "%s: imm_data (network order) 0x%08x want 0x%08lx", what, ntohl(wc->imm_data), w->imm);
	if (w->src_qp != ANY)
		ok &= EXPECT(wc->src_qp == (uint32_t)w->src_qp, "%s: src_qp 0x%x want 0x%lx", what, wc->src_qp, w->src_qp);
	return ok;
}

static struct want W(uint64_t id, enum ibv_wc_status st, long op, long len, long qpn)
{
	struct want w = { id, st, op, len, qpn, ANY, ANY, ANY };

	return w;
}

/* RC/UC receive completions: src_qp is defined for UD only; rxe leaves it 0 and softrdma
 * sets the peer's QPN, so either is accepted. */
static int check_rc_src_qp(const struct ibv_wc *wc, uint32_t peer)
{
	return EXPECT(wc->src_qp == 0 || wc->src_qp == peer, "src_qp 0x%x: neither 0 nor the peer 0x%x",
		      wc->src_qp, peer);
}

static int wait_async_on(struct ibv_context *ctx, enum ibv_event_type type, struct ibv_async_event *out,
			 int timeout_ms)
{
	uint64_t end = now_ms() + timeout_ms;
	struct ibv_async_event ev;

	for (;;) {
		struct pollfd pfd = { ctx->async_fd, POLLIN, 0 };
		int left = (int)(end - now_ms());
		int r;

		if ((int64_t)(end - now_ms()) <= 0)
			return 0;
		r = poll(&pfd, 1, left);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return 0;
		if (ibv_get_async_event(ctx, &ev)) {
			if (errno == EAGAIN)
				continue;
			EXPECT(0, "ibv_get_async_event: %s", strerror(errno));
			return 0;
		}
		if (ev.event_type == type) {
			*out = ev;
			return 1;
		}
		fprintf(stderr, "  [%s] note: other async event %s\n", g_check, ibv_event_type_str(ev.event_type));
		ibv_ack_async_event(&ev);
	}
}

static int wait_async(enum ibv_event_type type, struct ibv_async_event *out, int timeout_ms)
{
	return wait_async_on(D.ctx, type, out, timeout_ms);
}

static void drain_async(void)
{
	struct ibv_async_event ev;

	while (wait_async((enum ibv_event_type)-1, &ev, 0))
		ibv_ack_async_event(&ev);
}

/* ------------------------------------------------------------------------------ */
/* checks                                                                          */

static void t_status_str(void)
{
	static const struct {
		enum ibv_wc_status s;
		const char *str;
	} tab[] = {
		{ IBV_WC_SUCCESS, "success" },
		{ IBV_WC_LOC_LEN_ERR, "local length error" },
		{ IBV_WC_LOC_PROT_ERR, "local protection error" },
		{ IBV_WC_WR_FLUSH_ERR, "Work Request Flushed Error" },
		{ IBV_WC_REM_INV_REQ_ERR, "remote invalid request error" },
		{ IBV_WC_REM_ACCESS_ERR, "remote access error" },
		{ IBV_WC_RETRY_EXC_ERR, "transport retry counter exceeded" },
		{ IBV_WC_RNR_RETRY_EXC_ERR, "RNR retry counter exceeded" },
		{ IBV_WC_GENERAL_ERR, "general error" },
		{ IBV_WC_FATAL_ERR, "fatal error" },
		{ IBV_WC_TM_RNDV_INCOMPLETE, "TM software rendezvous" },
	};

	check_begin("ibv_wc_status_str");
	for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++) {
		const char *s = ibv_wc_status_str(tab[i].s);

		EXPECT(s && !strcmp(s, tab[i].str), "status %d: \"%s\" want \"%s\"", tab[i].s, s ? s : "(null)",
		       tab[i].str);
	}
	{
		const char *s = ibv_wc_status_str((enum ibv_wc_status)9999);

		EXPECT(s && !strcmp(s, "unknown"), "status 9999: \"%s\"", s ? s : "(null)");
	}
	check_end();

	check_begin("other _str functions");
	EXPECT(!strcmp(ibv_event_type_str(IBV_EVENT_SRQ_LIMIT_REACHED), "SRQ limit reached"), "%s",
	       ibv_event_type_str(IBV_EVENT_SRQ_LIMIT_REACHED));
	EXPECT(!strcmp(ibv_event_type_str(IBV_EVENT_COMM_EST), "communication established"), "%s",
	       ibv_event_type_str(IBV_EVENT_COMM_EST));
	EXPECT(!strcmp(ibv_port_state_str(IBV_PORT_ACTIVE), "active"), "%s", ibv_port_state_str(IBV_PORT_ACTIVE));
	EXPECT(!strcmp(ibv_node_type_str(IBV_NODE_CA), "InfiniBand channel adapter"), "%s",
	       ibv_node_type_str(IBV_NODE_CA));
	check_end();
}

static int open_device(void)
{
	struct ibv_device **list;
	int n = 0, i, rc;

	check_begin("device open and query");
	list = ibv_get_device_list(&n);
	if (!EXPECT(list && n > 0, "ibv_get_device_list: %d devices (%s)", n, strerror(errno)))
		return check_end(), 0;
	for (i = 0; i < n; i++)
		if (!g_devname || !strcmp(ibv_get_device_name(list[i]), g_devname))
			break;
	if (!EXPECT(i < n, "device %s not in the list", g_devname)) {
		ibv_free_device_list(list);
		return check_end(), 0;
	}
	snprintf(D.name, sizeof(D.name), "%s", ibv_get_device_name(list[i]));
	D.ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!EXPECT(D.ctx, "ibv_open_device(%s): %s", D.name, strerror(errno)))
		return check_end(), 0;
	rc = ibv_query_device_ex(D.ctx, NULL, &D.attr);
	if (rc) {
		EXPECT(0, "ibv_query_device_ex: %s", strerror(rc));
		memset(&D.attr, 0, sizeof(D.attr));
		rc = ibv_query_device(D.ctx, &D.attr.orig_attr);
		EXPECT(rc == 0, "ibv_query_device: %s", strerror(rc));
	}
	EXPECT(D.attr.orig_attr.max_qp > 0 && D.attr.orig_attr.max_cqe > 0 && D.attr.orig_attr.max_qp_wr > 0 &&
	       D.attr.orig_attr.max_sge >= 3 && D.attr.orig_attr.max_mr > 0 && D.attr.orig_attr.phys_port_cnt >= 1,
	       "device attributes: max_qp %d max_cqe %d max_qp_wr %d max_sge %d max_mr %d ports %d",
	       D.attr.orig_attr.max_qp, D.attr.orig_attr.max_cqe, D.attr.orig_attr.max_qp_wr,
	       D.attr.orig_attr.max_sge, D.attr.orig_attr.max_mr, D.attr.orig_attr.phys_port_cnt);
	D.port_num = g_port;
	rc = ibv_query_port(D.ctx, D.port_num, &D.port);
	EXPECT(rc == 0, "ibv_query_port(%d): %s", D.port_num, strerror(rc));
	EXPECT(D.port.state == IBV_PORT_ACTIVE, "port state %s", ibv_port_state_str(D.port.state));
	EXPECT(D.port.link_layer == IBV_LINK_LAYER_ETHERNET, "link layer %d", D.port.link_layer);
	EXPECT(D.port.active_mtu >= IBV_MTU_256 && D.port.active_mtu <= IBV_MTU_4096, "active_mtu %d",
	       D.port.active_mtu);
	EXPECT(D.port.gid_tbl_len > g_gidx, "gid_tbl_len %d", D.port.gid_tbl_len);
	D.gidx = g_gidx;
	rc = ibv_query_gid(D.ctx, D.port_num, D.gidx, &D.gid);
	EXPECT(rc == 0, "ibv_query_gid(%d): %d", D.gidx, rc);
	{
		static const uint8_t zero[16];
		char s[64];

		EXPECT(memcmp(D.gid.raw, zero, 16), "GID %d is zero", D.gidx);
		inet_ntop(AF_INET6, D.gid.raw, s, sizeof(s));
		fprintf(stderr, "device %s port %d gid[%d] %s mtu %d atomic_cap %d max_qp_rd_atom %d\n", D.name,
			D.port_num, D.gidx, s, 128 << D.port.active_mtu, D.attr.orig_attr.atomic_cap,
			D.attr.orig_attr.max_qp_rd_atom);
	}
	{
		/* Where RDMA software looks for the device, as for a kernel RoCE device: the GID
		 * entry names the interface holding the address, sysfs names the same one, and
		 * the uverbs node is a character device the program may open (UCX's test). */
		struct ibv_gid_entry ge;
		char ifname[IF_NAMESIZE] = "", path[512], sysname[64] = "";
		struct stat st;
		FILE *f;

		rc = ibv_query_gid_ex(D.ctx, D.port_num, D.gidx, &ge, 0);
		EXPECT(rc == 0, "ibv_query_gid_ex(%d): %s", D.gidx, strerror(rc));
		EXPECT(ge.gid_type == IBV_GID_TYPE_ROCE_V2, "gid_type %u", ge.gid_type);
		EXPECT(ge.ndev_ifindex && if_indextoname(ge.ndev_ifindex, ifname),
		       "if_indextoname(ndev_ifindex %u): %s", ge.ndev_ifindex, strerror(errno));
		snprintf(path, sizeof(path), "%s/ports/%d/gid_attrs/ndevs/%d", D.ctx->device->ibdev_path,
			 D.port_num, D.gidx);
		f = fopen(path, "r");
		if (EXPECT(f, "%s: %s", path, strerror(errno))) {
			if (!fgets(sysname, sizeof(sysname), f))
				sysname[0] = 0;
			sysname[strcspn(sysname, "\n")] = 0;
			fclose(f);
			EXPECT(!strcmp(sysname, ifname), "%s says %s, ndev_ifindex names %s", path, sysname,
			       ifname);
		}
		snprintf(path, sizeof(path), "/dev/infiniband/%s", D.ctx->device->dev_name);
		EXPECT(stat(path, &st) == 0 && S_ISCHR(st.st_mode) && access(path, R_OK | W_OK) == 0,
		       "%s is not a character device open for reading and writing", path);
		fprintf(stderr, "device %s gid[%d] on %s, %s\n", D.name, D.gidx, ifname, path);
	}
	D.pd = ibv_alloc_pd(D.ctx);
	EXPECT(D.pd, "ibv_alloc_pd: %s", strerror(errno));
	if (D.ctx->async_fd >= 0) {
		int fl = fcntl(D.ctx->async_fd, F_GETFL);

		EXPECT(fcntl(D.ctx->async_fd, F_SETFL, fl | O_NONBLOCK) == 0, "async_fd O_NONBLOCK: %s",
		       strerror(errno));
	} else {
		EXPECT(0, "async_fd %d", D.ctx->async_fd);
	}
	return check_end() || (D.ctx && D.pd);
}

/* Common fixture: an RC pair and two registered buffers. */
struct fx {
	struct pair p;
	struct mem ma, mb;
};

static int fx_make(struct fx *f, const struct pair_opts *o)
{
	memset(f, 0, sizeof(*f));
	if (!mem_alloc(&f->ma, BUF_LEN, ACC_ALL) || !mem_alloc(&f->mb, BUF_LEN, ACC_ALL))
		return 0;
	return make_pair(&f->p, o);
}

static int fx_rc(struct fx *f)
{
	struct pair_opts o;

	default_opts(&o, IBV_QPT_RC);
	return fx_make(f, &o);
}

static void fx_free(struct fx *f)
{
	free_pair(&f->p);
	mem_free(&f->ma);
	mem_free(&f->mb);
}

static void t_qp_query(void)
{
	struct fx f;
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;
	int rc;

	check_begin("RC connect and ibv_query_qp");
	if (fx_rc(&f)) {
		memset(&a, 0, sizeof(a));
		rc = ibv_query_qp(f.p.a.qp, &a, IBV_QP_STATE | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_SQ_PSN |
				  IBV_QP_RQ_PSN | IBV_QP_AV | IBV_QP_CAP, &ia);
		if (EXPECT(rc == 0, "ibv_query_qp: %s", strerror(rc))) {
			EXPECT(a.qp_state == IBV_QPS_RTS, "qp_state %d", a.qp_state);
			EXPECT(a.path_mtu == D.port.active_mtu, "path_mtu %d", a.path_mtu);
			EXPECT(a.dest_qp_num == f.p.b.qp->qp_num, "dest_qp_num 0x%x", a.dest_qp_num);
			EXPECT(a.sq_psn == PSN_A, "sq_psn 0x%x", a.sq_psn);
			EXPECT(a.rq_psn == PSN_B, "rq_psn 0x%x", a.rq_psn);
			EXPECT(!memcmp(a.ah_attr.grh.dgid.raw, D.gid.raw, 16), "ah_attr dgid differs");
			EXPECT(ia.qp_type == IBV_QPT_RC, "qp_type %d", ia.qp_type);
			EXPECT(ia.cap.max_send_wr >= 64 && ia.cap.max_send_sge >= 3, "cap %u/%u", ia.cap.max_send_wr,
			       ia.cap.max_send_sge);
		}
	}
	fx_free(&f);
	check_end();
}

static void t_send(int with_imm)
{
	struct fx f;
	struct ibv_wc wc;
	struct want w;
	const uint32_t len = 3000; /* > MTU 1024 when the MTU is small: several packets */

	check_begin(with_imm ? "RC SEND_WITH_IMM" : "RC SEND");
	if (fx_rc(&f)) {
		fill(f.ma.buf, len, 1);
		post_recv(f.p.b.qp, 77, f.mb.buf, 8192, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 11, .op = with_imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND,
							 .addr = f.ma.buf, .len = len, .lkey = f.ma.mr->lkey,
							 .imm = 0x12345678 });
		if (poll1(f.p.a.scq, &wc, "the send"))
			check_wc(&wc, &(struct want){ 11, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "sender");
		if (poll1(f.p.b.rcq, &wc, "the receive")) {
			w = W(77, IBV_WC_SUCCESS, IBV_WC_RECV, len, f.p.b.qp->qp_num);
			w.flags = with_imm ? IBV_WC_WITH_IMM : 0;
			if (with_imm)
				w.imm = 0x12345678;
			check_wc(&wc, &w, "receiver");
			check_rc_src_qp(&wc, f.p.a.qp->qp_num);
		}
		EXPECT(diff_at(f.ma.buf, f.mb.buf, len) < 0, "received bytes differ at %ld", diff_at(f.ma.buf, f.mb.buf, len));
		EXPECT(f.mb.buf[len] == 0, "receiver wrote past byte_len");
		expect_cq_empty(f.p.a.rcq, 20, "A's receive CQ");
		expect_cq_empty(f.p.b.scq, 20, "B's send CQ");
	}
	fx_free(&f);
	check_end();
}

static void t_zero_len_send(void)
{
	struct fx f;
	struct ibv_wc wc;
	struct want w;

	check_begin("RC zero-length SEND_WITH_IMM");
	if (fx_rc(&f)) {
		post_recv(f.p.b.qp, 5, f.mb.buf, 64, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 6, .op = IBV_WR_SEND_WITH_IMM, .imm = 0xfeedbeef });
		if (poll1(f.p.a.scq, &wc, "the send"))
			check_wc(&wc, &(struct want){ 6, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "sender");
		if (poll1(f.p.b.rcq, &wc, "the receive")) {
			w = W(5, IBV_WC_SUCCESS, IBV_WC_RECV, 0, f.p.b.qp->qp_num);
			w.flags = IBV_WC_WITH_IMM;
			w.imm = 0xfeedbeef;
			check_wc(&wc, &w, "receiver");
		}
	}
	fx_free(&f);
	check_end();
}

static void t_write(int with_imm)
{
	struct fx f;
	struct ibv_wc wc;
	struct want w;
	const uint32_t len = 10000;
	const size_t off = 4096 + 3;

	check_begin(with_imm ? "RC RDMA_WRITE_WITH_IMM" : "RC RDMA_WRITE");
	if (fx_rc(&f)) {
		fill(f.ma.buf, len, 2);
		if (with_imm)
			post_recv(f.p.b.qp, 88, NULL, 0, 0);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 12,
							 .op = with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE,
							 .addr = f.ma.buf, .len = len, .lkey = f.ma.mr->lkey,
							 .raddr = (uintptr_t)f.mb.buf + off, .rkey = f.mb.mr->rkey,
							 .imm = 0xa1b2c3d4 });
		if (poll1(f.p.a.scq, &wc, "the write"))
			check_wc(&wc, &(struct want){ 12, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY, ANY,
						      ANY }, "sender");
		if (with_imm) {
			if (poll1(f.p.b.rcq, &wc, "the immediate")) {
				w = W(88, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, len, f.p.b.qp->qp_num);
				w.flags = IBV_WC_WITH_IMM;
				w.imm = 0xa1b2c3d4;
				check_wc(&wc, &w, "receiver");
			}
		} else {
			expect_cq_empty(f.p.b.rcq, 50, "B's receive CQ (plain WRITE consumes no receive)");
		}
		EXPECT(diff_at(f.ma.buf, f.mb.buf + off, len) < 0, "written bytes differ at %ld",
		       diff_at(f.ma.buf, f.mb.buf + off, len));
		EXPECT(f.mb.buf[off - 1] == 0 && f.mb.buf[off + len] == 0, "bytes outside the target were written");
	}
	fx_free(&f);
	check_end();
}

static void t_zero_len_write_imm(void)
{
	struct fx f;
	struct ibv_wc wc;
	struct want w;

	check_begin("RC zero-length RDMA_WRITE_WITH_IMM");
	if (fx_rc(&f)) {
		post_recv(f.p.b.qp, 1, f.mb.buf, 16, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 2, .op = IBV_WR_RDMA_WRITE_WITH_IMM, .imm = 7 });
		if (poll1(f.p.a.scq, &wc, "the write"))
			check_wc(&wc, &(struct want){ 2, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY, ANY,
						      ANY }, "sender");
		if (poll1(f.p.b.rcq, &wc, "the immediate")) {
			w = W(1, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, 0, f.p.b.qp->qp_num);
			w.flags = IBV_WC_WITH_IMM;
			w.imm = 7;
			check_wc(&wc, &w, "receiver");
		}
	}
	fx_free(&f);
	check_end();
}

static void t_read(void)
{
	struct fx f;
	struct ibv_wc wc;
	const uint32_t len = 20000;

	check_begin("RC RDMA_READ");
	if (fx_rc(&f)) {
		fill(f.mb.buf + 100, len, 3);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 13, .op = IBV_WR_RDMA_READ, .addr = f.ma.buf + 50,
							 .len = len, .lkey = f.ma.mr->lkey,
							 .raddr = (uintptr_t)f.mb.buf + 100, .rkey = f.mb.mr->rkey });
		if (poll1(f.p.a.scq, &wc, "the read"))
			check_wc(&wc, &(struct want){ 13, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, len, f.p.a.qp->qp_num, ANY, ANY,
						      ANY }, "requester");
		EXPECT(diff_at(f.ma.buf + 50, f.mb.buf + 100, len) < 0, "read bytes differ at %ld",
		       diff_at(f.ma.buf + 50, f.mb.buf + 100, len));
		EXPECT(f.ma.buf[49] == 0 && f.ma.buf[50 + len] == 0, "bytes outside the local target were written");
		expect_cq_empty(f.p.b.rcq, 20, "B's receive CQ");
		expect_cq_empty(f.p.b.scq, 20, "B's send CQ");
	}
	fx_free(&f);
	check_end();
}

static void t_atomics(void)
{
	struct fx f;
	struct ibv_wc wc;
	uint64_t *remote, *local;

	check_begin("RC ATOMIC_CMP_AND_SWP");
	EXPECT(D.attr.orig_attr.atomic_cap != IBV_ATOMIC_NONE, "device reports atomic_cap NONE");
	if (fx_rc(&f)) {
		remote = (uint64_t *)(f.mb.buf + 64);
		local = (uint64_t *)(f.ma.buf + 128);
		*remote = 0x1111222233334444ull;
		/* compare matches: swapped */
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 21, .op = IBV_WR_ATOMIC_CMP_AND_SWP, .addr = local, .len = 8,
							 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)remote,
							 .rkey = f.mb.mr->rkey, .cmp_add = 0x1111222233334444ull,
							 .swap = 0xaaaabbbbccccddddull });
		if (poll1(f.p.a.scq, &wc, "CAS 1"))
			check_wc(&wc, &(struct want){ 21, IBV_WC_SUCCESS, IBV_WC_COMP_SWAP, 8, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "CAS 1");
		EXPECT(*local == 0x1111222233334444ull, "CAS 1 returned 0x%" PRIx64, *local);
		EXPECT(*remote == 0xaaaabbbbccccddddull, "CAS 1 left 0x%" PRIx64, *remote);
		/* compare fails: unchanged */
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 22, .op = IBV_WR_ATOMIC_CMP_AND_SWP, .addr = local, .len = 8,
							 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)remote,
							 .rkey = f.mb.mr->rkey, .cmp_add = 5, .swap = 6 });
		if (poll1(f.p.a.scq, &wc, "CAS 2"))
			check_wc(&wc, &(struct want){ 22, IBV_WC_SUCCESS, IBV_WC_COMP_SWAP, 8, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "CAS 2");
		EXPECT(*local == 0xaaaabbbbccccddddull, "CAS 2 returned 0x%" PRIx64, *local);
		EXPECT(*remote == 0xaaaabbbbccccddddull, "CAS 2 (no match) changed the target to 0x%" PRIx64, *remote);
	}
	fx_free(&f);
	check_end();

	check_begin("RC ATOMIC_FETCH_AND_ADD");
	if (fx_rc(&f)) {
		remote = (uint64_t *)(f.mb.buf + 8);
		local = (uint64_t *)(f.ma.buf + 16);
		*remote = 0xfffffffffffffff0ull;
		for (int i = 0; i < 3; i++) {
			uint64_t before = *remote;

			post_send1(f.p.a.qp, &(struct sendspec){ .id = 30 + i, .op = IBV_WR_ATOMIC_FETCH_AND_ADD, .addr = local,
								 .len = 8, .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)remote,
								 .rkey = f.mb.mr->rkey, .cmp_add = 0x10 });
			if (poll1(f.p.a.scq, &wc, "FETCH_ADD"))
				check_wc(&wc, &(struct want){ 30 + i, IBV_WC_SUCCESS, IBV_WC_FETCH_ADD, 8, f.p.a.qp->qp_num, ANY,
							      ANY, ANY }, "FETCH_ADD");
			EXPECT(*local == before, "FETCH_ADD %d returned 0x%" PRIx64 " want 0x%" PRIx64, i, *local, before);
		}
		/* wraps modulo 2^64 */
		EXPECT(*remote == 0x20, "after 3 adds of 0x10 the target is 0x%" PRIx64, *remote);
	}
	fx_free(&f);
	check_end();
}

static void t_sge_lists(void)
{
	struct fx f;
	struct mem m2a, m2b;
	struct ibv_wc wc;
	struct want w;
	char expect[2048];

	check_begin("RC SEND with 3 SGEs gathered and scattered");
	memset(&m2a, 0, sizeof(m2a));
	memset(&m2b, 0, sizeof(m2b));
	if (fx_rc(&f) && mem_alloc(&m2a, 8192, ACC_ALL) && mem_alloc(&m2b, 8192, ACC_ALL)) {
		struct ibv_sge ss[3] = {
			{ (uintptr_t)f.ma.buf + 100, 10, f.ma.mr->lkey },
			{ (uintptr_t)m2a.buf + 7, 1000, m2a.mr->lkey },
			{ (uintptr_t)f.ma.buf + 5000, 33, f.ma.mr->lkey },
		};
		struct ibv_sge rs[3] = {
			{ (uintptr_t)f.mb.buf, 500, f.mb.mr->lkey },
			{ (uintptr_t)f.mb.buf + 8000, 500, f.mb.mr->lkey },
			{ (uintptr_t)m2b.buf, 100, m2b.mr->lkey },
		};
		struct ibv_send_wr swr = { .wr_id = 1, .sg_list = ss, .num_sge = 3, .opcode = IBV_WR_SEND }, *sbad;
		struct ibv_recv_wr rwr = { .wr_id = 2, .sg_list = rs, .num_sge = 3 }, *rbad;
		int rc;

		fill(f.ma.buf, BUF_LEN, 4);
		fill(m2a.buf, 8192, 5);
		memcpy(expect, f.ma.buf + 100, 10);
		memcpy(expect + 10, m2a.buf + 7, 1000);
		memcpy(expect + 1010, f.ma.buf + 5000, 33);
		rc = ibv_post_recv(f.p.b.qp, &rwr, &rbad);
		EXPECT(rc == 0, "post_recv 3 SGEs: %s", strerror(rc));
		rc = ibv_post_send(f.p.a.qp, &swr, &sbad);
		EXPECT(rc == 0, "post_send 3 SGEs: %s", strerror(rc));
		if (poll1(f.p.a.scq, &wc, "the send"))
			check_wc(&wc, &(struct want){ 1, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "sender");
		if (poll1(f.p.b.rcq, &wc, "the receive")) {
			w = W(2, IBV_WC_SUCCESS, IBV_WC_RECV, 1043, f.p.b.qp->qp_num);
			w.flags = 0;
			check_wc(&wc, &w, "receiver");
		}
		EXPECT(diff_at(f.mb.buf, expect, 500) < 0, "SGE 0 differs");
		EXPECT(diff_at(f.mb.buf + 8000, expect + 500, 500) < 0, "SGE 1 differs");
		EXPECT(diff_at(m2b.buf, expect + 1000, 43) < 0, "SGE 2 differs at %ld", diff_at(m2b.buf, expect + 1000, 43));
		EXPECT(m2b.buf[43] == 0 && f.mb.buf[500] == 0 && f.mb.buf[8500] == 0, "bytes past the message were written");
	}
	check_end();

	check_begin("RC RDMA_WRITE gathering 3 SGEs");
	if (f.p.a.qp && m2a.mr) {
		struct ibv_sge ss[3] = {
			{ (uintptr_t)m2a.buf + 1, 2000, m2a.mr->lkey },
			{ (uintptr_t)f.ma.buf + 60000, 1, f.ma.mr->lkey },
			{ (uintptr_t)f.ma.buf + 70000, 3000, f.ma.mr->lkey },
		};
		struct ibv_send_wr swr = { .wr_id = 3, .sg_list = ss, .num_sge = 3, .opcode = IBV_WR_RDMA_WRITE }, *sbad;
		int rc;
		char *exp = malloc(5001);

		swr.wr.rdma.remote_addr = (uintptr_t)f.mb.buf + 100000;
		swr.wr.rdma.rkey = f.mb.mr->rkey;
		memcpy(exp, m2a.buf + 1, 2000);
		memcpy(exp + 2000, f.ma.buf + 60000, 1);
		memcpy(exp + 2001, f.ma.buf + 70000, 3000);
		rc = ibv_post_send(f.p.a.qp, &swr, &sbad);
		EXPECT(rc == 0, "post_send: %s", strerror(rc));
		if (poll1(f.p.a.scq, &wc, "the write"))
			check_wc(&wc, &(struct want){ 3, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY, ANY,
						      ANY }, "sender");
		EXPECT(diff_at(f.mb.buf + 100000, exp, 5001) < 0, "written bytes differ at %ld",
		       diff_at(f.mb.buf + 100000, exp, 5001));
		free(exp);
	}
	check_end();

	check_begin("RC RDMA_READ scattering into 3 SGEs");
	if (f.p.a.qp && m2a.mr) {
		struct ibv_sge ss[3] = {
			{ (uintptr_t)m2a.buf + 4000, 7, m2a.mr->lkey },
			{ (uintptr_t)f.ma.buf + 150000, 3000, f.ma.mr->lkey },
			{ (uintptr_t)m2a.buf + 5000, 1500, m2a.mr->lkey },
		};
		struct ibv_send_wr swr = { .wr_id = 4, .sg_list = ss, .num_sge = 3, .opcode = IBV_WR_RDMA_READ }, *sbad;
		const char *src = f.mb.buf + 30000;
		int rc;

		fill(f.mb.buf + 30000, 4507, 9);
		memset(m2a.buf, 0, 8192);
		swr.wr.rdma.remote_addr = (uintptr_t)src;
		swr.wr.rdma.rkey = f.mb.mr->rkey;
		rc = ibv_post_send(f.p.a.qp, &swr, &sbad);
		EXPECT(rc == 0, "post_send: %s", strerror(rc));
		if (poll1(f.p.a.scq, &wc, "the read"))
			check_wc(&wc, &(struct want){ 4, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, 4507, f.p.a.qp->qp_num, ANY, ANY,
						      ANY }, "requester");
		EXPECT(diff_at(m2a.buf + 4000, src, 7) < 0, "SGE 0 differs");
		EXPECT(diff_at(f.ma.buf + 150000, src + 7, 3000) < 0, "SGE 1 differs");
		EXPECT(diff_at(m2a.buf + 5000, src + 3007, 1500) < 0, "SGE 2 differs");
		EXPECT(m2a.buf[4007] == 0 && m2a.buf[6500] == 0, "bytes outside the SGEs were written");
	}
	check_end();
	mem_free(&m2a);
	mem_free(&m2b);
	fx_free(&f);
}

static void t_inline(void)
{
	struct fx f;
	struct pair_opts o;
	struct ibv_wc wc;
	struct want w;
	char stackbuf[64], copy[64];

	check_begin("RC inline SEND and RDMA_WRITE (unregistered source reused at once)");
	default_opts(&o, IBV_QPT_RC);
	o.max_inline = 64;
	if (fx_make(&f, &o)) {
		EXPECT(f.p.a.cap.max_inline_data >= 64, "max_inline_data %u", f.p.a.cap.max_inline_data);
		fill(stackbuf, sizeof(stackbuf), 11);
		memcpy(copy, stackbuf, sizeof(copy));
		post_recv(f.p.b.qp, 9, f.mb.buf, 4096, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 10, .op = IBV_WR_SEND, .addr = stackbuf, .len = 64,
							 .lkey = 0xdeadbeef, .flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED });
		memset(stackbuf, 0x5a, sizeof(stackbuf)); /* the data was copied at post time */
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 11, .op = IBV_WR_RDMA_WRITE, .addr = stackbuf, .len = 33,
							 .lkey = 0, .flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED,
							 .raddr = (uintptr_t)f.mb.buf + 9000, .rkey = f.mb.mr->rkey });
		memset(stackbuf, 0, sizeof(stackbuf));
		if (poll1(f.p.a.scq, &wc, "the inline send"))
			check_wc(&wc, &(struct want){ 10, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "inline send");
		if (poll1(f.p.a.scq, &wc, "the inline write"))
			check_wc(&wc, &(struct want){ 11, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY, ANY,
						      ANY }, "inline write");
		if (poll1(f.p.b.rcq, &wc, "the receive")) {
			w = W(9, IBV_WC_SUCCESS, IBV_WC_RECV, 64, f.p.b.qp->qp_num);
			w.flags = 0;
			check_wc(&wc, &w, "receiver");
		}
		EXPECT(diff_at(f.mb.buf, copy, 64) < 0, "inline SEND bytes differ");
		EXPECT(!memcmp(f.mb.buf + 9000, "ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ", 33), "inline WRITE bytes differ");
		EXPECT(f.mb.buf[9033] == 0, "inline WRITE wrote past its length");
	}
	fx_free(&f);
	check_end();
}

static void t_unsignaled(void)
{
	struct fx f;
	struct pair_opts o;
	struct ibv_wc wc[4];
	int n;

	check_begin("RC unsignaled WRs (sq_sig_all=0): one completion for the signaled WR");
	default_opts(&o, IBV_QPT_RC);
	o.sig_all = 0;
	if (fx_make(&f, &o)) {
		fill(f.ma.buf, 3000, 12);
		post_recv(f.p.b.qp, 1, f.mb.buf + 50000, 1000, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 100, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf, .len = 1000,
							 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)f.mb.buf,
							 .rkey = f.mb.mr->rkey });
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 101, .op = IBV_WR_SEND, .addr = f.ma.buf + 1000, .len = 1000,
							 .lkey = f.ma.mr->lkey });
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 102, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf + 2000,
							 .len = 1000, .lkey = f.ma.mr->lkey,
							 .raddr = (uintptr_t)f.mb.buf + 2000, .rkey = f.mb.mr->rkey,
							 .flags = IBV_SEND_SIGNALED });
		n = poll_n(f.p.a.scq, wc, 1, 10000);
		if (EXPECT(n == 1, "no completion for the signaled WR"))
			check_wc(&wc[0], &(struct want){ 102, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY,
							 ANY, ANY }, "signaled write");
		expect_cq_empty(f.p.a.scq, 100, "A's send CQ (unsignaled WRs completed)");
		if (poll1(f.p.b.rcq, wc, "the receive"))
			check_wc(&wc[0], &(struct want){ 1, IBV_WC_SUCCESS, IBV_WC_RECV, 1000, f.p.b.qp->qp_num, 0, ANY, ANY },
				 "receiver");
		EXPECT(diff_at(f.mb.buf, f.ma.buf, 1000) < 0 && diff_at(f.mb.buf + 2000, f.ma.buf + 2000, 1000) < 0 &&
		       diff_at(f.mb.buf + 50000, f.ma.buf + 1000, 1000) < 0, "bytes differ");
		/* a long unsignaled run must not wedge the send queue (its slots are reclaimed) */
		for (int i = 0; i < 4 * (int)f.p.a.cap.max_send_wr; i++) {
			int last = (i % 16) == 15;

			if (!post_send1(f.p.a.qp, &(struct sendspec){ .id = 1000 + i, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf,
								      .len = 64, .lkey = f.ma.mr->lkey,
								      .raddr = (uintptr_t)f.mb.buf + 60000,
								      .rkey = f.mb.mr->rkey,
								      .flags = last ? IBV_SEND_SIGNALED : 0 }))
				break;
			if (last && !poll1(f.p.a.scq, wc, "a signaled write in the run"))
				break;
			if (last)
				EXPECT(wc[0].wr_id == (uint64_t)(1000 + i) && wc[0].status == IBV_WC_SUCCESS,
				       "wr_id %" PRIu64 " status %s", wc[0].wr_id, ibv_wc_status_str(wc[0].status));
		}
	}
	fx_free(&f);
	check_end();
}

static void t_fence(void)
{
	struct fx f;
	struct ibv_wc wc[2];
	const uint32_t len = 32768;
	int n;

	check_begin("RC IBV_SEND_FENCE: WRITE after READ sends the read data");
	if (fx_rc(&f)) {
		for (int round = 0; round < 3; round++) {
			fill(f.mb.buf, len, 20 + round);
			memset(f.ma.buf, 0, len);
			memset(f.mb.buf + 65536, 0, len);
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 1, .op = IBV_WR_RDMA_READ, .addr = f.ma.buf, .len = len,
								 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)f.mb.buf,
								 .rkey = f.mb.mr->rkey });
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 2, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf, .len = len,
								 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)f.mb.buf + 65536,
								 .rkey = f.mb.mr->rkey, .flags = IBV_SEND_FENCE });
			n = poll_n(f.p.a.scq, wc, 2, 10000);
			if (!EXPECT(n == 2, "%d of 2 completions", n))
				break;
			check_wc(&wc[0], &(struct want){ 1, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, len, f.p.a.qp->qp_num, ANY, ANY,
							 ANY }, "read");
			check_wc(&wc[1], &(struct want){ 2, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY, ANY,
							 ANY }, "fenced write");
			if (!EXPECT(diff_at(f.mb.buf + 65536, f.mb.buf, len) < 0,
				    "round %d: the fenced WRITE carried bytes from before the READ finished (first at %ld)",
				    round, diff_at(f.mb.buf + 65536, f.mb.buf, len)))
				break;
		}
	}
	fx_free(&f);
	check_end();
}

static void t_cq_ordering(void)
{
	struct fx f;
	struct ibv_wc wc[40];
	int n, i;

	check_begin("RC 32 mixed WRs complete in order");
	if (fx_rc(&f)) {
		*(uint64_t *)(f.mb.buf + 200000) = 0;
		fill(f.mb.buf, 65536, 30);
		for (i = 0; i < 32; i++)
			post_recv(f.p.b.qp, 500 + i, f.mb.buf + 100000 + i * 512, 512, f.mb.mr->lkey);
		for (i = 0; i < 32; i++) {
			struct sendspec s = { .id = i, .addr = f.ma.buf + i * 512, .len = 512, .lkey = f.ma.mr->lkey,
					      .rkey = f.mb.mr->rkey };

			switch (i % 4) {
			case 0: s.op = IBV_WR_SEND; break;
			case 1: s.op = IBV_WR_RDMA_WRITE; s.raddr = (uintptr_t)f.mb.buf + 70000 + i * 512; break;
			case 2: s.op = IBV_WR_RDMA_READ; s.raddr = (uintptr_t)f.mb.buf + i * 512; break;
			case 3: s.op = IBV_WR_ATOMIC_FETCH_AND_ADD; s.len = 8; s.raddr = (uintptr_t)f.mb.buf + 200000;
				s.cmp_add = 1; break;
			}
			if (!post_send1(f.p.a.qp, &s))
				break;
		}
		n = poll_n(f.p.a.scq, wc, 32, 10000);
		EXPECT(n == 32, "%d of 32 completions", n);
		for (i = 0; i < n; i++) {
			static const int op[4] = { IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_FETCH_ADD };

			if (!check_wc(&wc[i], &(struct want){ i, IBV_WC_SUCCESS, op[i % 4], ANY, f.p.a.qp->qp_num, ANY, ANY,
							      ANY }, "completion"))
				break;
		}
		n = poll_n(f.p.b.rcq, wc, 8, 10000);
		EXPECT(n == 8, "%d of 8 receives", n);
		for (i = 0; i < n; i++)
			EXPECT(wc[i].wr_id == (uint64_t)(500 + i) && wc[i].byte_len == 512, "receive %d: wr_id %" PRIu64, i,
			       wc[i].wr_id);
		EXPECT(*(uint64_t *)(f.mb.buf + 200000) == 8, "counter %" PRIu64, *(uint64_t *)(f.mb.buf + 200000));
	}
	fx_free(&f);
	check_end();
}

/* Memory windows: type 2, bound with IBV_WR_BIND_MW; invalidated by SEND_WITH_INV and
 * LOCAL_INV; a WRITE through an invalidated rkey fails with REM_ACCESS_ERR. */
static int bind_mw2(struct ep *b, struct ibv_mw *mw, uint32_t rkey, struct ibv_mr *mr, void *addr, size_t len,
		    uint64_t id)
{
	struct ibv_send_wr wr, *bad;
	struct ibv_wc wc;
	int rc;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = id;
	wr.opcode = IBV_WR_BIND_MW;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = rkey;
	wr.bind_mw.bind_info.mr = mr;
	wr.bind_mw.bind_info.addr = (uintptr_t)addr;
	wr.bind_mw.bind_info.length = len;
	wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	rc = ibv_post_send(b->qp, &wr, &bad);
	if (!EXPECT(rc == 0, "post BIND_MW: %s", strerror(rc)))
		return 0;
	if (!poll1(b->scq, &wc, "the bind"))
		return 0;
	return check_wc(&wc, &(struct want){ id, IBV_WC_SUCCESS, IBV_WC_BIND_MW, ANY, b->qp->qp_num, ANY, ANY, ANY },
			"bind");
}

static void t_mw(void)
{
	struct fx f;
	struct mem mwmem;
	struct ibv_mw *mw = NULL;
	struct ibv_wc wc;
	struct want w;
	uint32_t rkey = 0;
	char *win;

	memset(&mwmem, 0, sizeof(mwmem));
	check_begin("MW type 2: alloc, BIND_MW, WRITE/READ through the window");
	EXPECT(D.attr.orig_attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW, "device_cap_flags lacks MEM_WINDOW (0x%x)",
	       D.attr.orig_attr.device_cap_flags);
	/* the kernel reports the full flags in device_cap_flags_ex too; accept either field */
	EXPECT((D.attr.orig_attr.device_cap_flags | D.attr.device_cap_flags_ex) &
	       (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B),
	       "device_cap_flags lacks MEM_WINDOW_TYPE_2A/2B");
	if (fx_rc(&f) && mem_alloc(&mwmem, 65536, ACC_ALL | IBV_ACCESS_MW_BIND)) {
		win = mwmem.buf + 4096;
		mw = ibv_alloc_mw(D.pd, IBV_MW_TYPE_2);
		if (EXPECT(mw, "ibv_alloc_mw(TYPE_2): %s", strerror(errno))) {
			EXPECT(mw->type == IBV_MW_TYPE_2 && mw->pd == D.pd, "mw type %d", mw->type);
			rkey = ibv_inc_rkey(mw->rkey);
			if (bind_mw2(&f.p.b, mw, rkey, mwmem.mr, win, 8192, 40)) {
				fill(f.ma.buf, 8192, 40);
				post_send1(f.p.a.qp, &(struct sendspec){ .id = 41, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf,
									 .len = 8192, .lkey = f.ma.mr->lkey,
									 .raddr = (uintptr_t)win, .rkey = rkey });
				if (poll1(f.p.a.scq, &wc, "write through the MW"))
					check_wc(&wc, &(struct want){ 41, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY,
								      f.p.a.qp->qp_num, ANY, ANY, ANY }, "write via MW");
				EXPECT(diff_at(win, f.ma.buf, 8192) < 0, "bytes written through the MW differ");
				EXPECT(win[-1] == 0 && win[8192] == 0, "bytes outside the window were written");
				post_send1(f.p.a.qp, &(struct sendspec){ .id = 42, .op = IBV_WR_RDMA_READ,
									 .addr = f.ma.buf + 10000, .len = 100,
									 .lkey = f.ma.mr->lkey,
									 .raddr = (uintptr_t)win + 8092, .rkey = rkey });
				if (poll1(f.p.a.scq, &wc, "read through the MW"))
					check_wc(&wc, &(struct want){ 42, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, 100,
								      f.p.a.qp->qp_num, ANY, ANY, ANY }, "read via MW");
				EXPECT(diff_at(f.ma.buf + 10000, win + 8092, 100) < 0, "bytes read through the MW differ");
			}
		}
	}
	check_end();

	check_begin("MW type 2: access past the window's end gives REM_ACCESS_ERR");
	if (mw && f.p.a.qp) {
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 43, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf, .len = 200,
							 .lkey = f.ma.mr->lkey,
							 .raddr = (uintptr_t)mwmem.buf + 4096 + 8100, .rkey = rkey });
		if (poll1(f.p.a.scq, &wc, "write past the window"))
			check_wc(&wc, &(struct want){ 43, IBV_WC_REM_ACCESS_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "write past the window");
		EXPECT(mwmem.buf[4096 + 8192] == 0, "bytes past the window were written");
	} else {
		EXPECT(0, "no memory window");
	}
	check_end();
	if (mw)
		EXPECT(ibv_dealloc_mw(mw) == 0, "ibv_dealloc_mw: %s", strerror(errno));
	mw = NULL;
	fx_free(&f);

	/* SEND_WITH_INV on a fresh pair */
	check_begin("SEND_WITH_INV invalidates a bound MW (IBV_WC_WITH_INV, invalidated_rkey)");
	if (fx_rc(&f) && mwmem.mr) {
		mw = ibv_alloc_mw(D.pd, IBV_MW_TYPE_2);
		if (EXPECT(mw, "ibv_alloc_mw: %s", strerror(errno))) {
			rkey = ibv_inc_rkey(mw->rkey);
			if (bind_mw2(&f.p.b, mw, rkey, mwmem.mr, mwmem.buf, 4096, 50)) {
				fill(f.ma.buf, 64, 50);
				post_recv(f.p.b.qp, 51, f.mb.buf, 4096, f.mb.mr->lkey);
				post_send1(f.p.a.qp, &(struct sendspec){ .id = 52, .op = IBV_WR_SEND_WITH_INV, .addr = f.ma.buf,
									 .len = 64, .lkey = f.ma.mr->lkey, .inv_rkey = rkey });
				if (poll1(f.p.a.scq, &wc, "SEND_WITH_INV"))
					check_wc(&wc, &(struct want){ 52, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, f.p.a.qp->qp_num,
								      ANY, ANY, ANY }, "sender");
				if (poll1(f.p.b.rcq, &wc, "the receive")) {
					w = W(51, IBV_WC_SUCCESS, IBV_WC_RECV, 64, f.p.b.qp->qp_num);
					w.flags = IBV_WC_WITH_INV;
					check_wc(&wc, &w, "receiver");
					EXPECT(wc.invalidated_rkey == rkey, "invalidated_rkey 0x%x want 0x%x",
					       wc.invalidated_rkey, rkey);
				}
				EXPECT(diff_at(f.mb.buf, f.ma.buf, 64) < 0, "received bytes differ");
				/* the window is gone: a WRITE through it fails */
				post_send1(f.p.a.qp, &(struct sendspec){ .id = 53, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf,
									 .len = 64, .lkey = f.ma.mr->lkey,
									 .raddr = (uintptr_t)mwmem.buf, .rkey = rkey });
				if (poll1(f.p.a.scq, &wc, "write through the invalidated MW"))
					check_wc(&wc, &(struct want){ 53, IBV_WC_REM_ACCESS_ERR, ANY, ANY, f.p.a.qp->qp_num,
								      ANY, ANY, ANY }, "write after invalidation");
				EXPECT(mwmem.buf[0] == 0, "the invalidated window was written");
			}
			EXPECT(ibv_dealloc_mw(mw) == 0, "ibv_dealloc_mw: %s", strerror(errno));
			mw = NULL;
		}
	}
	fx_free(&f);
	check_end();

	check_begin("LOCAL_INV invalidates a bound MW");
	if (fx_rc(&f) && mwmem.mr) {
		mw = ibv_alloc_mw(D.pd, IBV_MW_TYPE_2);
		if (EXPECT(mw, "ibv_alloc_mw: %s", strerror(errno))) {
			rkey = ibv_inc_rkey(mw->rkey);
			if (bind_mw2(&f.p.b, mw, rkey, mwmem.mr, mwmem.buf + 8192, 4096, 60)) {
				struct ibv_send_wr wr, *bad;
				int rc;

				memset(&wr, 0, sizeof(wr));
				wr.wr_id = 61;
				wr.opcode = IBV_WR_LOCAL_INV;
				wr.send_flags = IBV_SEND_SIGNALED;
				wr.invalidate_rkey = rkey;
				rc = ibv_post_send(f.p.b.qp, &wr, &bad);
				EXPECT(rc == 0, "post LOCAL_INV: %s", strerror(rc));
				if (poll1(f.p.b.scq, &wc, "LOCAL_INV"))
					check_wc(&wc, &(struct want){ 61, IBV_WC_SUCCESS, IBV_WC_LOCAL_INV, ANY, f.p.b.qp->qp_num,
								      ANY, ANY, ANY }, "LOCAL_INV");
				memset(mwmem.buf + 8192, 0, 64);
				post_send1(f.p.a.qp, &(struct sendspec){ .id = 62, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf,
									 .len = 64, .lkey = f.ma.mr->lkey,
									 .raddr = (uintptr_t)mwmem.buf + 8192, .rkey = rkey });
				if (poll1(f.p.a.scq, &wc, "write through the invalidated MW"))
					check_wc(&wc, &(struct want){ 62, IBV_WC_REM_ACCESS_ERR, ANY, ANY, f.p.a.qp->qp_num,
								      ANY, ANY, ANY }, "write after LOCAL_INV");
				EXPECT(mwmem.buf[8192] == 0, "the invalidated window was written");
			}
			EXPECT(ibv_dealloc_mw(mw) == 0, "ibv_dealloc_mw: %s", strerror(errno));
		}
	}
	fx_free(&f);
	mem_free(&mwmem);
	check_end();
}

static void t_srq(void)
{
	struct fx f;
	struct pair_opts o;
	struct ibv_srq *srq = NULL;
	struct ibv_srq_init_attr sia;
	struct ibv_srq_attr sa;
	struct ibv_async_event ev;
	struct ibv_wc wc[8];
	int n, rc, i;

	check_begin("SRQ receives and IBV_EVENT_SRQ_LIMIT_REACHED");
	memset(&sia, 0, sizeof(sia));
	sia.attr.max_wr = 16;
	sia.attr.max_sge = 1;
	drain_async();
	srq = ibv_create_srq(D.pd, &sia);
	if (EXPECT(srq, "ibv_create_srq: %s", strerror(errno))) {
		default_opts(&o, IBV_QPT_RC);
		o.srq_b = srq;
		if (fx_make(&f, &o)) {
			for (i = 0; i < 10; i++)
				post_srq_recv(srq, 300 + i, f.mb.buf + i * 1024, 1024, f.mb.mr->lkey);
			memset(&sa, 0, sizeof(sa));
			sa.srq_limit = 4;
			rc = ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT);
			EXPECT(rc == 0, "ibv_modify_srq(IBV_SRQ_LIMIT 4): %s", strerror(rc));
			memset(&sa, 0, sizeof(sa));
			rc = ibv_query_srq(srq, &sa);
			EXPECT(rc == 0 && sa.srq_limit == 4 && sa.max_wr >= 16, "ibv_query_srq: rc %d limit %u max_wr %u", rc,
			       sa.srq_limit, sa.max_wr);
			fill(f.ma.buf, 8192, 60);
			for (i = 0; i < 5; i++)
				post_send1(f.p.a.qp, &(struct sendspec){ .id = i, .op = IBV_WR_SEND, .addr = f.ma.buf + i * 100,
									 .len = 100, .lkey = f.ma.mr->lkey });
			n = poll_n(f.p.b.rcq, wc, 5, 10000);
			EXPECT(n == 5, "%d of 5 receives", n);
			for (i = 0; i < n; i++) {
				check_wc(&wc[i], &(struct want){ 300 + i, IBV_WC_SUCCESS, IBV_WC_RECV, 100, f.p.b.qp->qp_num, 0,
								 ANY, ANY }, "SRQ receive");
				EXPECT(diff_at(f.mb.buf + i * 1024, f.ma.buf + i * 100, 100) < 0, "receive %d bytes", i);
			}
			/* 5 left >= limit 4: no event yet */
			if (wait_async(IBV_EVENT_SRQ_LIMIT_REACHED, &ev, 200)) {
				EXPECT(0, "SRQ limit event with 5 receives left and limit 4");
				ibv_ack_async_event(&ev);
			}
			for (i = 5; i < 7; i++)
				post_send1(f.p.a.qp, &(struct sendspec){ .id = i, .op = IBV_WR_SEND, .addr = f.ma.buf + i * 100,
									 .len = 100, .lkey = f.ma.mr->lkey });
			n = poll_n(f.p.b.rcq, wc, 2, 10000);
			EXPECT(n == 2, "%d of 2 receives", n);
			if (EXPECT(wait_async(IBV_EVENT_SRQ_LIMIT_REACHED, &ev, 5000),
				   "no IBV_EVENT_SRQ_LIMIT_REACHED after the SRQ fell to 3 with limit 4")) {
				EXPECT(ev.element.srq == srq, "event for srq %p want %p", (void *)ev.element.srq, (void *)srq);
				ibv_ack_async_event(&ev);
				memset(&sa, 0, sizeof(sa));
				rc = ibv_query_srq(srq, &sa);
				EXPECT(rc == 0 && sa.srq_limit == 0, "after the event the limit is disarmed: %u", sa.srq_limit);
			}
			n = poll_n(f.p.a.scq, wc, 7, 10000);
			EXPECT(n == 7, "%d of 7 send completions", n);
		}
		check_end();

		check_begin("SRQ QP to ERR gives IBV_EVENT_QP_LAST_WQE_REACHED");
		if (f.p.b.qp) {
			struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };

			rc = ibv_modify_qp(f.p.b.qp, &a, IBV_QP_STATE);
			EXPECT(rc == 0, "modify_qp ERR: %s", strerror(rc));
			if (EXPECT(wait_async(IBV_EVENT_QP_LAST_WQE_REACHED, &ev, 5000), "no LAST_WQE_REACHED event")) {
				EXPECT(ev.element.qp == f.p.b.qp, "event for qp %p want %p", (void *)ev.element.qp,
				       (void *)f.p.b.qp);
				ibv_ack_async_event(&ev);
			}
		} else {
			EXPECT(0, "no QP");
		}
		check_end();
		fx_free(&f);
		drain_async();
		EXPECT(ibv_destroy_srq(srq) == 0, "ibv_destroy_srq: %s", strerror(errno));
	}
	check_end();
}

static void t_comm_est(void)
{
	struct fx f;
	struct pair_opts o;
	struct ibv_async_event ev;
	struct ibv_wc wc;

	check_begin("IBV_EVENT_COMM_EST when a QP in RTR receives");
	drain_async();
	default_opts(&o, IBV_QPT_RC);
	o.b_rtr_only = 1;
	if (fx_make(&f, &o)) {
		post_recv(f.p.b.qp, 1, f.mb.buf, 64, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 2, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 8,
							 .lkey = f.ma.mr->lkey });
		if (poll1(f.p.b.rcq, &wc, "the receive in RTR"))
			check_wc(&wc, &(struct want){ 1, IBV_WC_SUCCESS, IBV_WC_RECV, 8, f.p.b.qp->qp_num, 0, ANY, ANY },
				 "receive in RTR");
		if (EXPECT(wait_async(IBV_EVENT_COMM_EST, &ev, 3000), "no IBV_EVENT_COMM_EST")) {
			EXPECT(ev.element.qp == f.p.b.qp, "event for qp %p want %p", (void *)ev.element.qp, (void *)f.p.b.qp);
			ibv_ack_async_event(&ev);
		}
		poll1(f.p.a.scq, &wc, "the send");
	}
	fx_free(&f);
	drain_async();
	check_end();
}

/* Two contexts on one device in one process, as Open MPI over UCX opens (one for its
 * point-to-point layer, one for one-sided windows): each has its own async_fd, as each open
 * of a kernel uverbs device has (UCX keys its event handlers by that descriptor and fails
 * on a second context whose async_fd it already watches), and an object's event comes on
 * the context that created the object, not on the other. */
static void t_async_two_contexts(void)
{
	struct ibv_context *c2;
	struct ibv_pd *pd2 = NULL;
	struct ibv_cq *cq2 = NULL;
	struct ibv_srq *srq2 = NULL;
	struct ibv_qp *qp2 = NULL;
	struct ibv_async_event ev;
	struct ibv_port_attr pa;
	int fl;

	check_begin("a second context on the device has its own async_fd and its objects' events");
	drain_async();
	c2 = ibv_open_device(D.ctx->device);
	if (!EXPECT(c2, "second ibv_open_device(%s): %s", D.name, strerror(errno)))
		return (void)check_end();
	EXPECT(c2->async_fd >= 0 && c2->async_fd != D.ctx->async_fd, "async_fd %d, the first context's %d",
	       c2->async_fd, D.ctx->async_fd);
	fl = fcntl(c2->async_fd, F_GETFL);
	EXPECT(fl >= 0 && !(fl & O_NONBLOCK), "a new async_fd is blocking, as the kernel's (flags 0x%x)", fl);
	EXPECT(fcntl(c2->async_fd, F_SETFL, fl | O_NONBLOCK) == 0, "async_fd O_NONBLOCK: %s", strerror(errno));
	pd2 = ibv_alloc_pd(c2);
	cq2 = pd2 ? ibv_create_cq(c2, 16, NULL, NULL, 0) : NULL;
	if (EXPECT(pd2 && cq2, "second context's PD and CQ: %s", strerror(errno))) {
		struct ibv_srq_init_attr sia = { .attr = { .max_wr = 16, .max_sge = 1 } };

		srq2 = ibv_create_srq(pd2, &sia);
		EXPECT(srq2, "ibv_create_srq: %s", strerror(errno));
	}
	if (srq2) {
		struct ibv_qp_init_attr qia = { .send_cq = cq2, .recv_cq = cq2, .srq = srq2, .qp_type = IBV_QPT_RC,
						.cap = { .max_send_wr = 4, .max_send_sge = 1 } };

		qp2 = ibv_create_qp(pd2, &qia);
		EXPECT(qp2, "ibv_create_qp: %s", strerror(errno));
	}
	if (qp2) {
		struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = D.port_num };
		int rc = ibv_modify_qp(qp2, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);

		EXPECT(rc == 0, "modify_qp INIT: %s", strerror(rc));
		a.qp_state = IBV_QPS_ERR;
		rc = ibv_modify_qp(qp2, &a, IBV_QP_STATE);
		EXPECT(rc == 0, "modify_qp ERR: %s", strerror(rc));
		/* The first context looks first: the event must not come there. */
		if (wait_async(IBV_EVENT_QP_LAST_WQE_REACHED, &ev, 300)) {
			EXPECT(0, "the second context's QP event came on the first context (qp %p)", (void *)ev.element.qp);
			ibv_ack_async_event(&ev);
		}
		if (EXPECT(wait_async_on(c2, IBV_EVENT_QP_LAST_WQE_REACHED, &ev, 5000),
			   "no LAST_WQE_REACHED on the second context")) {
			EXPECT(ev.element.qp == qp2, "event for qp %p want %p", (void *)ev.element.qp, (void *)qp2);
			ibv_ack_async_event(&ev);
		}
		EXPECT(ibv_destroy_qp(qp2) == 0, "ibv_destroy_qp: %s", strerror(errno));
	}
	if (srq2)
		EXPECT(ibv_destroy_srq(srq2) == 0, "ibv_destroy_srq: %s", strerror(errno));
	if (cq2)
		EXPECT(ibv_destroy_cq(cq2) == 0, "ibv_destroy_cq: %s", strerror(errno));
	if (pd2)
		EXPECT(ibv_dealloc_pd(pd2) == 0, "ibv_dealloc_pd: %s", strerror(errno));
	EXPECT(ibv_close_device(c2) == 0, "closing the second context: %s", strerror(errno));
	EXPECT(ibv_query_port(D.ctx, D.port_num, &pa) == 0 && pa.state == IBV_PORT_ACTIVE,
	       "the first context after the second closed: port %d", pa.state);
	drain_async();
	check_end();
}

static void t_errors(void)
{
	struct fx f;
	struct pair_opts o;
	struct ibv_wc wc[4];
	int n, rc;

	check_begin("bad rkey: REM_ACCESS_ERR, then later WRs flush with WR_FLUSH_ERR");
	if (fx_rc(&f)) {
		struct ibv_sge sg = { (uintptr_t)f.ma.buf, 64, f.ma.mr->lkey };
		struct ibv_send_wr w3[3], *bad;
		struct ibv_qp_attr qa;
		struct ibv_qp_init_attr qia;

		memset(w3, 0, sizeof(w3));
		for (int i = 0; i < 3; i++) {
			w3[i].wr_id = 70 + i;
			w3[i].sg_list = &sg;
			w3[i].num_sge = 1;
			w3[i].opcode = IBV_WR_RDMA_WRITE;
			w3[i].wr.rdma.remote_addr = (uintptr_t)f.mb.buf;
			w3[i].wr.rdma.rkey = f.mb.mr->rkey;
			w3[i].next = i < 2 ? &w3[i + 1] : NULL;
		}
		w3[0].wr.rdma.rkey = f.mb.mr->rkey ^ 0x5a5a00; /* bad rkey */
		fill(f.ma.buf, 64, 70);
		rc = ibv_post_send(f.p.a.qp, w3, &bad);
		EXPECT(rc == 0, "post_send: %s", strerror(rc));
		n = poll_n(f.p.a.scq, wc, 3, 10000);
		if (EXPECT(n == 3, "%d of 3 completions", n)) {
			check_wc(&wc[0], &(struct want){ 70, IBV_WC_REM_ACCESS_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "bad rkey");
			check_wc(&wc[1], &(struct want){ 71, IBV_WC_WR_FLUSH_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "next WR");
			check_wc(&wc[2], &(struct want){ 72, IBV_WC_WR_FLUSH_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "next WR");
		}
		EXPECT(f.mb.buf[0] == 0, "the target was written");
		/* posting to a QP in ERR flushes */
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 74, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 8,
							 .lkey = f.ma.mr->lkey });
		if (poll1(f.p.a.scq, wc, "a WR posted in ERR"))
			check_wc(&wc[0], &(struct want){ 74, IBV_WC_WR_FLUSH_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "WR posted in ERR");
		memset(&qa, 0, sizeof(qa));
		rc = ibv_query_qp(f.p.a.qp, &qa, IBV_QP_STATE, &qia);
		EXPECT(rc == 0 && qa.qp_state == IBV_QPS_ERR, "requester QP state %d (rc %d) want ERR", qa.qp_state, rc);
	}
	check_end();

	check_begin("a receive posted to a QP in ERR completes with WR_FLUSH_ERR");
	if (f.p.a.qp) {
		post_recv(f.p.a.qp, 75, f.ma.buf, 64, f.ma.mr->lkey);
		if (poll1(f.p.a.rcq, wc, "a receive posted in ERR"))
			check_wc(&wc[0], &(struct want){ 75, IBV_WC_WR_FLUSH_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "receive posted in ERR");
	} else {
		EXPECT(0, "no QP");
	}
	check_end();

	check_begin("to RESET, the QP's completions not yet polled leave its CQs (as mlx4/mlx5 clean them)");
	if (f.p.a.qp) {
		struct ibv_qp_attr ra = { .qp_state = IBV_QPS_RESET };

		post_recv(f.p.a.qp, 76, f.ma.buf, 64, f.ma.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 77, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 8,
							 .lkey = f.ma.mr->lkey });
		/* Both flush at once in ERR; give them a moment to land, unpolled. */
		usleep(20000);
		rc = ibv_modify_qp(f.p.a.qp, &ra, IBV_QP_STATE);
		EXPECT(rc == 0, "modify to RESET: %s", strerror(rc));
		n = ibv_poll_cq(f.p.a.rcq, 4, wc);
		EXPECT(n == 0, "receive CQ after RESET: %d completions (first wr_id %llu)", n,
		       n > 0 ? (unsigned long long)wc[0].wr_id : 0ULL);
		n = ibv_poll_cq(f.p.a.scq, 4, wc);
		EXPECT(n == 0, "send CQ after RESET: %d completions (first wr_id %llu)", n,
		       n > 0 ? (unsigned long long)wc[0].wr_id : 0ULL);
	} else {
		EXPECT(0, "no QP");
	}
	fx_free(&f);
	check_end();

	check_begin("bad lkey: LOC_PROT_ERR");
	if (fx_rc(&f)) {
		post_recv(f.p.b.qp, 1, f.mb.buf, 64, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 80, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 64,
							 .lkey = f.ma.mr->lkey ^ 0x77700 });
		if (poll1(f.p.a.scq, wc, "send with a bad lkey"))
			check_wc(&wc[0], &(struct want){ 80, IBV_WC_LOC_PROT_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "bad lkey");
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 81, .op = IBV_WR_SEND, .addr = f.ma.buf + 100000, .len = 64,
							 .lkey = f.ma.mr->lkey });
		if (poll1(f.p.a.scq, wc, "next send"))
			check_wc(&wc[0], &(struct want){ 81, IBV_WC_WR_FLUSH_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "next send");
	}
	fx_free(&f);
	check_end();

	check_begin("READ past the end of the remote MR: REM_ACCESS_ERR");
	if (fx_rc(&f)) {
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 82, .op = IBV_WR_RDMA_READ, .addr = f.ma.buf, .len = 4096,
							 .lkey = f.ma.mr->lkey,
							 .raddr = (uintptr_t)f.mb.buf + BUF_LEN - 100, .rkey = f.mb.mr->rkey });
		if (poll1(f.p.a.scq, wc, "out-of-bounds read"))
			check_wc(&wc[0], &(struct want){ 82, IBV_WC_REM_ACCESS_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "out-of-bounds read");
	}
	fx_free(&f);
	check_end();

	check_begin("WRITE to an MR without REMOTE_WRITE: REM_ACCESS_ERR");
	if (fx_rc(&f)) {
		struct mem ro;

		if (mem_alloc(&ro, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ)) {
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 83, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf, .len = 16,
								 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)ro.buf,
								 .rkey = ro.mr->rkey });
			if (poll1(f.p.a.scq, wc, "write to a read-only MR"))
				check_wc(&wc[0], &(struct want){ 83, IBV_WC_REM_ACCESS_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY,
								 ANY }, "write to read-only MR");
			mem_free(&ro);
		}
	}
	fx_free(&f);
	check_end();

	check_begin("SEND larger than the receive buffer: REM_INV_REQ_ERR / LOC_LEN_ERR");
	if (fx_rc(&f)) {
		post_recv(f.p.b.qp, 90, f.mb.buf, 100, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 91, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 200,
							 .lkey = f.ma.mr->lkey });
		if (poll1(f.p.a.scq, wc, "oversized send"))
			check_wc(&wc[0], &(struct want){ 91, IBV_WC_REM_INV_REQ_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "sender");
		if (poll1(f.p.b.rcq, wc, "the receive"))
			check_wc(&wc[0], &(struct want){ 90, IBV_WC_LOC_LEN_ERR, ANY, ANY, f.p.b.qp->qp_num, ANY, ANY, ANY },
				 "receiver");
	}
	fx_free(&f);
	check_end();

	check_begin("no receive posted, rnr_retry 0: RNR_RETRY_EXC_ERR");
	default_opts(&o, IBV_QPT_RC);
	o.rnr_retry = 0;
	if (fx_make(&f, &o)) {
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 92, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 16,
							 .lkey = f.ma.mr->lkey });
		if (poll1(f.p.a.scq, wc, "send without a receive"))
			check_wc(&wc[0], &(struct want){ 92, IBV_WC_RNR_RETRY_EXC_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY,
							 ANY }, "sender");
	}
	fx_free(&f);
	check_end();

	check_begin("peer QP in RESET, retry_cnt 1: RETRY_EXC_ERR");
	default_opts(&o, IBV_QPT_RC);
	o.retry_cnt = 1;
	o.timeout = 10; /* 4 ms */
	if (fx_make(&f, &o)) {
		struct ibv_qp_attr a = { .qp_state = IBV_QPS_RESET };

		rc = ibv_modify_qp(f.p.b.qp, &a, IBV_QP_STATE);
		EXPECT(rc == 0, "modify_qp RESET: %s", strerror(rc));
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 93, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf, .len = 16,
							 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)f.mb.buf,
							 .rkey = f.mb.mr->rkey });
		if (poll1(f.p.a.scq, wc, "write to a peer in RESET"))
			check_wc(&wc[0], &(struct want){ 93, IBV_WC_RETRY_EXC_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "sender");
		EXPECT(f.mb.buf[0] == 0, "a QP in RESET accepted a WRITE");
	}
	fx_free(&f);
	check_end();
}

static void t_channel(void)
{
	struct ibv_comp_channel *ch = NULL;
	struct ibv_cq *cq = NULL, *evcq;
	struct fx f;
	struct pair_opts o;
	struct ibv_wc wc;
	void *evctx = NULL;
	int rc, fl;
	static int cq_ctx_tag;

	check_begin("completion channel: req_notify_cq, poll() on the fd, get_cq_event, ack_cq_events");
	memset(&f, 0, sizeof(f));
	ch = ibv_create_comp_channel(D.ctx);
	if (EXPECT(ch, "ibv_create_comp_channel: %s", strerror(errno))) {
		fl = fcntl(ch->fd, F_GETFL);
		EXPECT(fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) == 0, "O_NONBLOCK on the channel fd: %s", strerror(errno));
		cq = ibv_create_cq(D.ctx, 16, &cq_ctx_tag, ch, 0);
		EXPECT(cq && cq->channel == ch && cq->cq_context == &cq_ctx_tag, "ibv_create_cq on the channel: %s",
		       strerror(errno));
	}
	if (cq) {
		default_opts(&o, IBV_QPT_RC);
		o.rcq_b = cq;
		if (fx_make(&f, &o)) {
			struct pollfd pfd = { ch->fd, POLLIN, 0 };

			rc = ibv_req_notify_cq(cq, 0);
			EXPECT(rc == 0, "ibv_req_notify_cq: %s", strerror(rc));
			EXPECT(poll(&pfd, 1, 0) == 0, "the channel fd is readable before any completion");
			post_recv(f.p.b.qp, 1, f.mb.buf, 64, f.mb.mr->lkey);
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 2, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 64,
								 .lkey = f.ma.mr->lkey });
			pfd.revents = 0;
			rc = poll(&pfd, 1, 5000);
			if (EXPECT(rc == 1 && (pfd.revents & POLLIN), "poll() on the channel fd: rc %d revents 0x%x", rc,
				   pfd.revents)) {
				evcq = NULL;
				rc = ibv_get_cq_event(ch, &evcq, &evctx);
				if (EXPECT(rc == 0, "ibv_get_cq_event: %s", strerror(errno))) {
					EXPECT(evcq == cq && evctx == &cq_ctx_tag, "event for cq %p ctx %p", (void *)evcq, evctx);
					ibv_ack_cq_events(cq, 1);
				}
				if (poll1(cq, &wc, "the receive after the event"))
					check_wc(&wc, &(struct want){ 1, IBV_WC_SUCCESS, IBV_WC_RECV, 64, f.p.b.qp->qp_num, 0, ANY,
								      ANY }, "receive");
				/* no new event: the fd is not readable */
				pfd.revents = 0;
				EXPECT(poll(&pfd, 1, 50) == 0, "the channel fd stayed readable after the event was read");
			}
			poll1(f.p.a.scq, &wc, "the send");
		}
	}
	check_end();

	check_begin("completion channel: solicited-only notification");
	if (cq && f.p.a.qp) {
		struct pollfd pfd = { ch->fd, POLLIN, 0 };

		rc = ibv_req_notify_cq(cq, 1);
		EXPECT(rc == 0, "ibv_req_notify_cq(solicited_only): %s", strerror(rc));
		post_recv(f.p.b.qp, 3, f.mb.buf, 64, f.mb.mr->lkey);
		post_recv(f.p.b.qp, 4, f.mb.buf, 64, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 5, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 8,
							 .lkey = f.ma.mr->lkey });
		poll1(f.p.a.scq, &wc, "the unsolicited send");
		EXPECT(poll(&pfd, 1, 200) == 0, "an unsolicited SEND woke a solicited-only CQ");
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 6, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 8,
							 .lkey = f.ma.mr->lkey, .flags = IBV_SEND_SOLICITED });
		poll1(f.p.a.scq, &wc, "the solicited send");
		pfd.revents = 0;
		if (EXPECT(poll(&pfd, 1, 5000) == 1, "a solicited SEND did not wake the CQ")) {
			rc = ibv_get_cq_event(ch, &evcq, &evctx);
			if (EXPECT(rc == 0 && evcq == cq, "ibv_get_cq_event: %s", strerror(errno)))
				ibv_ack_cq_events(cq, 1);
		}
		EXPECT(poll_n(cq, &wc, 1, 5000) == 1 && wc.wr_id == 3, "first receive");
		EXPECT(poll_n(cq, &wc, 1, 5000) == 1 && wc.wr_id == 4, "second receive");
	} else {
		EXPECT(0, "no channel CQ");
	}
	check_end();

	check_begin("completion channel: get_cq_event on an O_NONBLOCK fd with nothing pending fails with EAGAIN");
	if (cq) {
		errno = 0;
		rc = ibv_get_cq_event(ch, &evcq, &evctx);
		EXPECT(rc != 0 && errno == EAGAIN, "get_cq_event with nothing pending: rc %d errno %s", rc,
		       strerror(errno));
		if (rc == 0)
			ibv_ack_cq_events(evcq, 1);
	} else {
		EXPECT(0, "no channel CQ");
	}
	check_end();
	fx_free(&f);
	if (cq)
		EXPECT(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq: %s", strerror(errno));
	if (ch)
		EXPECT(ibv_destroy_comp_channel(ch) == 0, "ibv_destroy_comp_channel: %s", strerror(errno));
}

static void t_dm(void)
{
	struct ibv_alloc_dm_attr da = { .length = 8192, .log_align_req = 0, .comp_mask = 0 };
	struct ibv_dm *dm = NULL;
	struct ibv_mr *dmr = NULL;
	struct fx f;
	struct ibv_wc wc;
	char in[8192], out[8192];
	int rc;

	memset(&f, 0, sizeof(f));
	check_begin("device memory: ibv_alloc_dm, memcpy_to_dm / memcpy_from_dm");
	EXPECT(D.attr.max_dm_size >= 8192, "max_dm_size %" PRIu64, D.attr.max_dm_size);
	dm = ibv_alloc_dm(D.ctx, &da);
	if (EXPECT(dm, "ibv_alloc_dm(8192): %s", strerror(errno))) {
		fill(in, sizeof(in), 90);
		rc = ibv_memcpy_to_dm(dm, 0, in, sizeof(in));
		EXPECT(rc == 0, "ibv_memcpy_to_dm: %s", strerror(rc));
		memset(out, 0, sizeof(out));
		rc = ibv_memcpy_from_dm(out, dm, 100, 1000);
		EXPECT(rc == 0, "ibv_memcpy_from_dm: %s", strerror(rc));
		EXPECT(diff_at(out, in + 100, 1000) < 0, "bytes read back differ");
		rc = ibv_memcpy_to_dm(dm, 8000, in, 500);
		EXPECT(rc != 0, "ibv_memcpy_to_dm past the end succeeded");
		/* copies are in 32-bit words, as mlx5's provider requires (EINVAL otherwise) */
		rc = ibv_memcpy_to_dm(dm, 3, in, 4);
		EXPECT(rc == EINVAL, "ibv_memcpy_to_dm at offset 3: %s, want EINVAL", strerror(rc));
		rc = ibv_memcpy_to_dm(dm, 4, in, 3);
		EXPECT(rc == EINVAL, "ibv_memcpy_to_dm of 3 bytes: %s, want EINVAL", strerror(rc));
		rc = ibv_memcpy_from_dm(out, dm, 3, 4);
		EXPECT(rc == EINVAL, "ibv_memcpy_from_dm at offset 3: %s, want EINVAL", strerror(rc));
		rc = ibv_memcpy_from_dm(out, dm, 4, 3);
		EXPECT(rc == EINVAL, "ibv_memcpy_from_dm of 3 bytes: %s, want EINVAL", strerror(rc));
	}
	check_end();

	check_begin("device memory: ibv_reg_dm_mr as an RDMA_WRITE target and READ source");
	if (dm) {
		dmr = ibv_reg_dm_mr(D.pd, dm, 0, 8192,
				    IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				    IBV_ACCESS_REMOTE_READ);
		if (EXPECT(dmr, "ibv_reg_dm_mr: %s", strerror(errno)) && fx_rc(&f)) {
			fill(f.ma.buf, 4096, 91);
			/* zero-based: the remote address is an offset into the DM */
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 1, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf, .len = 4096,
								 .lkey = f.ma.mr->lkey, .raddr = 1024, .rkey = dmr->rkey });
			if (poll1(f.p.a.scq, &wc, "write into DM"))
				check_wc(&wc, &(struct want){ 1, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY,
							      ANY, ANY }, "write into DM");
			memset(out, 0, sizeof(out));
			rc = ibv_memcpy_from_dm(out, dm, 0, 8192);
			EXPECT(rc == 0, "ibv_memcpy_from_dm: %s", strerror(rc));
			EXPECT(diff_at(out + 1024, f.ma.buf, 4096) < 0, "DM bytes after the WRITE differ at %ld",
			       diff_at(out + 1024, f.ma.buf, 4096));
			EXPECT(diff_at(out, in, 1024) < 0 && diff_at(out + 5120, in + 5120, 3072) < 0,
			       "DM bytes outside the WRITE changed");
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 2, .op = IBV_WR_RDMA_READ, .addr = f.mb.buf, .len = 2048,
								 .lkey = f.mb.mr->lkey, .raddr = 6000, .rkey = dmr->rkey });
			if (poll1(f.p.a.scq, &wc, "read from DM"))
				check_wc(&wc, &(struct want){ 2, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, 2048, f.p.a.qp->qp_num, ANY,
							      ANY, ANY }, "read from DM");
			EXPECT(diff_at(f.mb.buf, out + 6000, 2048) < 0, "bytes read from DM differ");
		}
	} else {
		EXPECT(0, "no DM");
	}
	fx_free(&f);
	if (dmr)
		EXPECT(ibv_dereg_mr(dmr) == 0, "dereg DM MR: %s", strerror(errno));
	if (dm)
		EXPECT(ibv_free_dm(dm) == 0, "ibv_free_dm: %s", strerror(errno));
	check_end();
}

/* ibv_import_device and the shared PD, MR and DM: a dup of a context's cmd_fd makes a
 * second context on the same objects, as on a kernel device */
static void t_import(void)
{
	struct ibv_context *c2 = NULL;
	struct ibv_pd *pd2 = NULL, *other = NULL;
	struct ibv_mr *mr2 = NULL;
	struct ibv_dm *dm = NULL, *dm2 = NULL;
	struct ibv_alloc_dm_attr da = { .length = 4096 };
	struct ibv_cq *cq2 = NULL;
	struct ibv_qp *qp2 = NULL;
	struct mem m;
	char in[256], out[256];
	int fd, fl, rc;

	memset(&m, 0, sizeof(m));
	check_begin("import: cmd_fd is an open close-on-exec descriptor");
	fl = fcntl(D.ctx->cmd_fd, F_GETFD);
	EXPECT(D.ctx->cmd_fd >= 0 && fl >= 0 && (fl & FD_CLOEXEC), "cmd_fd %d, F_GETFD %d", D.ctx->cmd_fd, fl);
	check_end();

	check_begin("import: ibv_import_device of a dup of cmd_fd");
	fd = dup(D.ctx->cmd_fd);
	c2 = ibv_import_device(fd);
	if (EXPECT(c2, "ibv_import_device: %s", strerror(errno))) {
		EXPECT(c2 != D.ctx && c2->cmd_fd == fd, "context %p cmd_fd %d (dup %d)", (void *)c2, c2->cmd_fd, fd);
		EXPECT(!strcmp(ibv_get_device_name(c2->device), ibv_get_device_name(D.ctx->device)),
		       "device %s", ibv_get_device_name(c2->device));
	} else {
		close(fd);
	}
	check_end();

	check_begin("import: ibv_import_pd, ibv_import_mr and objects on them");
	if (c2 && mem_alloc(&m, 8192, ACC_ALL)) {
		pd2 = ibv_import_pd(c2, D.pd->handle);
		if (EXPECT(pd2, "ibv_import_pd: %s", strerror(errno))) {
			EXPECT(pd2->handle == D.pd->handle && pd2->context == c2, "handle %u context %p", pd2->handle,
			       (void *)pd2->context);
			mr2 = ibv_import_mr(pd2, m.mr->handle);
			if (EXPECT(mr2, "ibv_import_mr: %s", strerror(errno)))
				EXPECT(mr2->lkey == m.mr->lkey && mr2->rkey == m.mr->rkey && mr2->length == m.mr->length &&
				       mr2->addr == NULL && mr2->pd == pd2 && mr2->context == c2,
				       "lkey 0x%x rkey 0x%x length %zu addr %p", mr2->lkey, mr2->rkey, mr2->length, mr2->addr);
			other = ibv_alloc_pd(c2);
			errno = 0;
			EXPECT(other && !ibv_import_mr(other, m.mr->handle) && errno == EINVAL,
			       "importing an MR into another PD: %s, want EINVAL", strerror(errno));
			cq2 = ibv_create_cq(c2, 16, NULL, NULL, 0);
			EXPECT(cq2, "ibv_create_cq on the imported context: %s", strerror(errno));
			if (cq2) {
				struct ibv_qp_init_attr qa = { .send_cq = cq2, .recv_cq = cq2, .qp_type = IBV_QPT_RC,
							       .cap = { .max_send_wr = 4, .max_recv_wr = 4,
									.max_send_sge = 1, .max_recv_sge = 1 } };

				qp2 = ibv_create_qp(pd2, &qa);
				EXPECT(qp2, "ibv_create_qp on the imported PD: %s", strerror(errno));
			}
		}
		errno = 0;
		EXPECT(!ibv_import_pd(c2, D.pd->handle ^ 0x5a5a) && errno == EINVAL,
		       "importing a PD handle that is none: %s, want EINVAL", strerror(errno));
	}
	check_end();

	check_begin("import: ibv_import_dm reads what the original wrote");
	if (c2) {
		dm = ibv_alloc_dm(D.ctx, &da);
		if (EXPECT(dm, "ibv_alloc_dm: %s", strerror(errno))) {
			dm2 = ibv_import_dm(c2, dm->handle);
			if (EXPECT(dm2, "ibv_import_dm: %s", strerror(errno))) {
				fill(in, sizeof(in), 77);
				rc = ibv_memcpy_to_dm(dm, 512, in, sizeof(in));
				EXPECT(rc == 0, "ibv_memcpy_to_dm: %s", strerror(rc));
				rc = ibv_memcpy_from_dm(out, dm2, 512, sizeof(out));
				EXPECT(rc == 0 && diff_at(in, out, sizeof(in)) < 0, "ibv_memcpy_from_dm of the import: %s",
				       strerror(rc));
				ibv_unimport_dm(dm2);
			}
			EXPECT(ibv_free_dm(dm) == 0, "ibv_free_dm after unimport: %s", strerror(errno));
		}
	}
	check_end();

	check_begin("import: unimport leaves the originals; closing the import closes its descriptor");
	if (qp2)
		EXPECT(ibv_destroy_qp(qp2) == 0, "destroy QP: %s", strerror(errno));
	if (cq2)
		EXPECT(ibv_destroy_cq(cq2) == 0, "destroy CQ: %s", strerror(errno));
	if (other)
		EXPECT(ibv_dealloc_pd(other) == 0, "dealloc PD: %s", strerror(errno));
	if (mr2)
		ibv_unimport_mr(mr2);
	if (pd2)
		ibv_unimport_pd(pd2);
	if (m.mr)
		EXPECT(ibv_dereg_mr(m.mr) == 0, "dereg the original MR: %s", strerror(errno));
	m.mr = NULL;
	mem_free(&m);
	if (c2) {
		EXPECT(ibv_close_device(c2) == 0, "close the imported context: %s", strerror(errno));
		EXPECT(fcntl(fd, F_GETFD) < 0 && errno == EBADF, "the imported cmd_fd is still open");
	}
	EXPECT(fcntl(D.ctx->cmd_fd, F_GETFD) >= 0, "the original cmd_fd was closed");
	{
		struct ibv_pd *p = ibv_alloc_pd(D.ctx);

		EXPECT(p && ibv_dealloc_pd(p) == 0, "the original context after: %s", strerror(errno));
	}
	check_end();

	check_begin("import: a descriptor that is no context's is EOPNOTSUPP, a closed one EBADF");
	fd = open("/dev/null", O_RDWR | O_CLOEXEC);
	errno = 0;
	EXPECT(!ibv_import_device(fd) && errno == EOPNOTSUPP, "/dev/null: %s, want EOPNOTSUPP", strerror(errno));
	EXPECT(fcntl(fd, F_GETFD) >= 0, "a refused descriptor was closed");
	close(fd);
	errno = 0;
	EXPECT(!ibv_import_device(fd) && errno == EBADF, "closed fd: %s, want EBADF", strerror(errno));
	check_end();
}

static void t_cq_ex(void)
{
	struct ibv_cq_init_attr_ex ca;
	struct ibv_cq_ex *cqx = NULL;
	struct ibv_poll_cq_attr pa = { 0 };
	struct fx f;
	struct pair_opts o;
	struct ibv_wc wc;
	uint64_t ts[2] = { 0, 0 }, wall[2] = { 0, 0 }, wall_before = now_wall_ns();
	int rc, have_ts = 1;

	memset(&f, 0, sizeof(f));
	check_begin("ibv_create_cq_ex with IBV_WC_EX_WITH_COMPLETION_TIMESTAMP and _WALLCLOCK");
	EXPECT(D.attr.completion_timestamp_mask != 0, "completion_timestamp_mask is 0");
	EXPECT(D.attr.hca_core_clock != 0, "hca_core_clock is 0");
	memset(&ca, 0, sizeof(ca));
	ca.cqe = 32;
	ca.wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK |
		      IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_SRC_QP;
	cqx = ibv_create_cq_ex(D.ctx, &ca);
	EXPECT(cqx, "ibv_create_cq_ex(COMPLETION_TIMESTAMP | _WALLCLOCK): %s", strerror(errno));
	if (!cqx) {
		/* go on with the standard flags, to check the polling API */
		have_ts = 0;
		ca.wc_flags = IBV_WC_STANDARD_FLAGS;
		cqx = ibv_create_cq_ex(D.ctx, &ca);
	}
	check_end();

	check_begin("extended CQ: ibv_start_poll / ibv_next_poll / ibv_end_poll and the read_* accessors");
	if (EXPECT(cqx, "ibv_create_cq_ex(standard flags): %s", strerror(errno))) {
		struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);

		rc = ibv_start_poll(cqx, &pa);
		EXPECT(rc == ENOENT, "ibv_start_poll on an empty CQ: %d want ENOENT", rc);
		if (rc == 0)
			ibv_end_poll(cqx);
		default_opts(&o, IBV_QPT_RC);
		o.rcq_b = cq;
		if (fx_make(&f, &o)) {
			post_recv(f.p.b.qp, 1, f.mb.buf, 256, f.mb.mr->lkey);
			post_recv(f.p.b.qp, 2, f.mb.buf + 256, 256, f.mb.mr->lkey);
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 3, .op = IBV_WR_SEND_WITH_IMM, .addr = f.ma.buf,
								 .len = 100, .lkey = f.ma.mr->lkey, .imm = 0x01020304 });
			poll1(f.p.a.scq, &wc, "send 1");
			sleep_ms(2);
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 4, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 200,
								 .lkey = f.ma.mr->lkey });
			poll1(f.p.a.scq, &wc, "send 2");
			{
				uint64_t end = now_ms() + 10000;

				while ((rc = ibv_start_poll(cqx, &pa)) == ENOENT && now_ms() < end)
					sched_yield();
			}
			if (EXPECT(rc == 0, "ibv_start_poll: %d", rc)) {
				EXPECT(cqx->wr_id == 1 && cqx->status == IBV_WC_SUCCESS, "first: wr_id %" PRIu64 " status %s",
				       cqx->wr_id, ibv_wc_status_str(cqx->status));
				EXPECT(ibv_wc_read_opcode(cqx) == IBV_WC_RECV, "first: opcode %d", ibv_wc_read_opcode(cqx));
				EXPECT(ibv_wc_read_byte_len(cqx) == 100, "first: byte_len %u", ibv_wc_read_byte_len(cqx));
				EXPECT(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM, "first: wc_flags 0x%x",
				       ibv_wc_read_wc_flags(cqx));
				EXPECT(ntohl(ibv_wc_read_imm_data(cqx)) == 0x01020304, "first: imm 0x%x",
				       ntohl(ibv_wc_read_imm_data(cqx)));
				EXPECT(ibv_wc_read_qp_num(cqx) == f.p.b.qp->qp_num, "first: qp_num 0x%x",
				       ibv_wc_read_qp_num(cqx));
				if (have_ts) {
					ts[0] = ibv_wc_read_completion_ts(cqx);
					wall[0] = ibv_wc_read_completion_wallclock_ns(cqx);
				}
				rc = ibv_next_poll(cqx);
				{
					uint64_t end = now_ms() + 10000;

					while (rc == ENOENT && now_ms() < end) {
						sched_yield();
						rc = ibv_next_poll(cqx);
					}
				}
				if (EXPECT(rc == 0, "ibv_next_poll: %d", rc)) {
					EXPECT(cqx->wr_id == 2 && cqx->status == IBV_WC_SUCCESS,
					       "second: wr_id %" PRIu64 " status %s", cqx->wr_id, ibv_wc_status_str(cqx->status));
					EXPECT(ibv_wc_read_opcode(cqx) == IBV_WC_RECV && ibv_wc_read_byte_len(cqx) == 200,
					       "second: opcode %d byte_len %u", ibv_wc_read_opcode(cqx),
					       ibv_wc_read_byte_len(cqx));
					EXPECT(!(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM), "second: wc_flags 0x%x",
					       ibv_wc_read_wc_flags(cqx));
					if (have_ts) {
						ts[1] = ibv_wc_read_completion_ts(cqx);
						wall[1] = ibv_wc_read_completion_wallclock_ns(cqx);
					}
				}
				rc = ibv_next_poll(cqx);
				EXPECT(rc == ENOENT, "ibv_next_poll on an empty CQ: %d want ENOENT", rc);
				ibv_end_poll(cqx);
			}
		}
	}
	check_end();

	check_begin("extended CQ: ibv_wc_read_completion_ts");
	if (EXPECT(have_ts && cqx, "no timestamp CQ")) {
		EXPECT(ts[0] != 0 && ts[1] != 0, "timestamps %" PRIu64 " %" PRIu64, ts[0], ts[1]);
		EXPECT(ts[1] > ts[0], "timestamps not increasing: %" PRIu64 " then %" PRIu64, ts[0], ts[1]);
		if (D.attr.hca_core_clock) {
			/* hca_core_clock is in kHz; the two completions were >= 2 ms apart */
			uint64_t min_ticks = D.attr.hca_core_clock; /* 1 ms worth */

			EXPECT(ts[1] - ts[0] >= min_ticks, "completions 2 ms apart are %" PRIu64 " ticks apart (clock %" PRIu64
			       " kHz)", ts[1] - ts[0], D.attr.hca_core_clock);
		}
	}
	check_end();

	check_begin("extended CQ: ibv_wc_read_completion_wallclock_ns is real time on the same clock; "
		    "ibv_query_rt_values_ex reads that clock now");
	if (EXPECT(have_ts && cqx, "no timestamp CQ")) {
		struct ibv_values_ex v = { .comp_mask = IBV_VALUES_MASK_RAW_CLOCK };
		uint64_t wall_after = now_wall_ns();

		EXPECT(wall[0] >= wall_before && wall[1] <= wall_after && wall[1] > wall[0],
		       "wall-clock times %" PRIu64 " %" PRIu64 " outside [%" PRIu64 ", %" PRIu64 "]", wall[0], wall[1],
		       wall_before, wall_after);
		EXPECT(wall[1] - wall[0] == ts[1] - ts[0], "wall-clock gap %" PRIu64 " ns, device-clock gap %" PRIu64,
		       wall[1] - wall[0], ts[1] - ts[0]);
		rc = ibv_query_rt_values_ex(D.ctx, &v);
		if (EXPECT(rc == 0 && v.comp_mask == IBV_VALUES_MASK_RAW_CLOCK, "ibv_query_rt_values_ex: %s mask %u",
			   strerror(rc), v.comp_mask))
			EXPECT(v.raw_clock.tv_sec == 0 && (uint64_t)v.raw_clock.tv_nsec >= ts[1],
			       "raw clock %lld.%09ld, last completion at %" PRIu64, (long long)v.raw_clock.tv_sec,
			       v.raw_clock.tv_nsec, ts[1]);
		v.comp_mask = IBV_VALUES_MASK_RAW_CLOCK | IBV_VALUES_MASK_RESERVED;
		rc = ibv_query_rt_values_ex(D.ctx, &v);
		EXPECT(rc == EINVAL, "an unknown mask bit: %s", strerror(rc));
	}
	check_end();
	fx_free(&f);
	if (cqx)
		EXPECT(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) == 0, "destroy cq_ex: %s", strerror(errno));
}

static void t_ud(void)
{
	struct pair p;
	struct pair_opts o;
	struct mem ma, mb;
	struct ibv_ah_attr aha;
	struct ibv_ah *ah = NULL;
	struct ibv_wc wc;
	struct want w;
	struct ibv_send_wr wr, *bad;
	struct ibv_sge sge;
	int rc;

	check_begin("UD SEND_WITH_IMM through an AH: GRH, src_qp, byte_len + 40");
	memset(&p, 0, sizeof(p));
	memset(&ma, 0, sizeof(ma));
	memset(&mb, 0, sizeof(mb));
	default_opts(&o, IBV_QPT_UD);
	if (mem_alloc(&ma, 8192, ACC_ALL) && mem_alloc(&mb, 8192, ACC_ALL) && make_pair(&p, &o)) {
		fill_ah(&aha);
		ah = ibv_create_ah(D.pd, &aha);
		if (EXPECT(ah, "ibv_create_ah: %s", strerror(errno))) {
			uint32_t len = 128 << D.port.active_mtu; /* a full MTU */

			fill(ma.buf, len, 100);
			post_recv(p.b.qp, 1, mb.buf, len + 40, mb.mr->lkey);
			memset(&wr, 0, sizeof(wr));
			sge = (struct ibv_sge){ (uintptr_t)ma.buf, len, ma.mr->lkey };
			wr.wr_id = 2;
			wr.opcode = IBV_WR_SEND_WITH_IMM;
			wr.imm_data = htonl(0xcafe0001);
			wr.sg_list = &sge;
			wr.num_sge = 1;
			wr.wr.ud.ah = ah;
			wr.wr.ud.remote_qpn = p.b.qp->qp_num;
			wr.wr.ud.remote_qkey = QKEY;
			rc = ibv_post_send(p.a.qp, &wr, &bad);
			EXPECT(rc == 0, "post_send: %s", strerror(rc));
			if (poll1(p.a.scq, &wc, "the UD send"))
				check_wc(&wc, &(struct want){ 2, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, p.a.qp->qp_num, ANY, ANY, ANY },
					 "sender");
			if (poll1(p.b.rcq, &wc, "the UD receive")) {
				w = W(1, IBV_WC_SUCCESS, IBV_WC_RECV, len + 40, p.b.qp->qp_num);
				w.flags = IBV_WC_WITH_IMM | IBV_WC_GRH;
				w.imm = 0xcafe0001;
				w.src_qp = p.a.qp->qp_num;
				check_wc(&wc, &w, "receiver");
				EXPECT(wc.pkey_index == 0, "pkey_index %u", wc.pkey_index);
			}
			EXPECT(diff_at(mb.buf + 40, ma.buf, len) < 0, "payload after the 40-byte GRH differs");
			if (IN6_IS_ADDR_V4MAPPED((struct in6_addr *)D.gid.raw))
				EXPECT((unsigned char)mb.buf[20] == 0x45 && !memcmp(mb.buf + 20 + 12, D.gid.raw + 12, 4),
				       "GRH area does not hold the IPv4 header (byte 20 = 0x%02x)", (unsigned char)mb.buf[20]);
			else
				EXPECT(((unsigned char)mb.buf[0] >> 4) == 6 && !memcmp(mb.buf + 8, D.gid.raw, 16),
				       "GRH does not hold the IPv6 header with the source GID");

			/* a datagram with the wrong Q_Key is dropped silently */
			post_recv(p.b.qp, 3, mb.buf, len + 40, mb.mr->lkey);
			wr.wr_id = 4;
			wr.wr.ud.remote_qkey = QKEY + 1;
			rc = ibv_post_send(p.a.qp, &wr, &bad);
			EXPECT(rc == 0, "post_send: %s", strerror(rc));
			if (poll1(p.a.scq, &wc, "the wrong-qkey send"))
				EXPECT(wc.status == IBV_WC_SUCCESS, "UD send with a wrong Q_Key: %s", ibv_wc_status_str(wc.status));
			expect_cq_empty(p.b.rcq, 200, "B's receive CQ (wrong Q_Key)");
		}
	}
	check_end();

	check_begin("UD SEND larger than the path MTU is refused");
	if (ah) {
		uint32_t len = (128 << D.port.active_mtu) + 1;

		sge = (struct ibv_sge){ (uintptr_t)ma.buf, len, ma.mr->lkey };
		wr.wr_id = 5;
		wr.opcode = IBV_WR_SEND;
		wr.wr.ud.remote_qkey = QKEY;
		bad = NULL;
		rc = ibv_post_send(p.a.qp, &wr, &bad);
		if (rc == 0) {
			/* some providers fail the WR with a completion instead */
			if (poll1(p.a.scq, &wc, "the oversized UD send"))
				EXPECT(wc.status != IBV_WC_SUCCESS, "a UD SEND of MTU+1 bytes succeeded");
		} else {
			EXPECT(bad == &wr, "bad_wr not set");
		}
		expect_cq_empty(p.b.rcq, 100, "B's receive CQ (oversized)");
	} else {
		EXPECT(0, "no AH");
	}
	check_end();
	if (ah)
		ibv_destroy_ah(ah);
	free_pair(&p);
	mem_free(&ma);
	mem_free(&mb);
}

static void t_uc(void)
{
	struct fx f;
	struct pair_opts o;
	struct ibv_wc wc;
	struct want w;

	check_begin("UC RDMA_WRITE_WITH_IMM and SEND");
	default_opts(&o, IBV_QPT_UC);
	if (fx_make(&f, &o)) {
		fill(f.ma.buf, 5000, 110);
		post_recv(f.p.b.qp, 1, NULL, 0, 0);
		post_recv(f.p.b.qp, 2, f.mb.buf + 10000, 5000, f.mb.mr->lkey);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 3, .op = IBV_WR_RDMA_WRITE_WITH_IMM, .addr = f.ma.buf,
							 .len = 5000, .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)f.mb.buf,
							 .rkey = f.mb.mr->rkey, .imm = 99 });
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 4, .op = IBV_WR_SEND, .addr = f.ma.buf, .len = 5000,
							 .lkey = f.ma.mr->lkey });
		if (poll1(f.p.a.scq, &wc, "UC write"))
			check_wc(&wc, &(struct want){ 3, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "UC write");
		if (poll1(f.p.a.scq, &wc, "UC send"))
			check_wc(&wc, &(struct want){ 4, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
				 "UC send");
		if (poll1(f.p.b.rcq, &wc, "UC write imm")) {
			w = W(1, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, 5000, f.p.b.qp->qp_num);
			w.flags = IBV_WC_WITH_IMM;
			w.imm = 99;
			check_wc(&wc, &w, "UC write imm");
		}
		if (poll1(f.p.b.rcq, &wc, "UC receive"))
			check_wc(&wc, &(struct want){ 2, IBV_WC_SUCCESS, IBV_WC_RECV, 5000, f.p.b.qp->qp_num, 0, ANY, ANY },
				 "UC receive");
		EXPECT(diff_at(f.mb.buf, f.ma.buf, 5000) < 0, "UC written bytes differ");
		EXPECT(diff_at(f.mb.buf + 10000, f.ma.buf, 5000) < 0, "UC received bytes differ");
	}
	fx_free(&f);
	check_end();
}

static void t_bad_args(void)
{
	char *buf = malloc(65536);
	struct ibv_mr *mr;
	struct ibv_cq *cq;
	struct ibv_qp *qp = NULL;
	struct ibv_qp_init_attr ia;
	struct ibv_qp_attr a;
	int rc;

	check_begin("ibv_reg_mr REMOTE_WRITE without LOCAL_WRITE: NULL, EINVAL");
	errno = 0;
	mr = ibv_reg_mr(D.pd, buf, 65536, IBV_ACCESS_REMOTE_WRITE);
	EXPECT(!mr && errno == EINVAL, "mr %p errno %s", (void *)mr, strerror(errno));
	if (mr)
		ibv_dereg_mr(mr);
	errno = 0;
	mr = ibv_reg_mr(D.pd, buf, 65536, IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ);
	EXPECT(!mr && errno == EINVAL, "REMOTE_ATOMIC without LOCAL_WRITE: mr %p errno %s", (void *)mr, strerror(errno));
	if (mr)
		ibv_dereg_mr(mr);
	check_end();

	check_begin("ibv_create_cq of 0 entries, and of more than max_cqe: NULL, EINVAL");
	errno = 0;
	cq = ibv_create_cq(D.ctx, 0, NULL, NULL, 0);
	EXPECT(!cq && errno == EINVAL, "cqe 0: cq %p errno %s", (void *)cq, strerror(errno));
	if (cq)
		ibv_destroy_cq(cq);
	errno = 0;
	cq = ibv_create_cq(D.ctx, D.attr.orig_attr.max_cqe + 1, NULL, NULL, 0);
	EXPECT(!cq && errno == EINVAL, "cqe max+1: cq %p errno %s", (void *)cq, strerror(errno));
	if (cq)
		ibv_destroy_cq(cq);
	check_end();

	check_begin("ibv_create_cq / ibv_create_cq_ex with comp_vector >= num_comp_vectors: NULL, EINVAL");
	{
		int nv = D.ctx->num_comp_vectors;
		struct ibv_cq_init_attr_ex cx;
		struct ibv_cq_ex *cqx;

		EXPECT(nv >= 1, "num_comp_vectors %d", nv);
		cq = ibv_create_cq(D.ctx, 16, NULL, NULL, nv - 1);
		EXPECT(cq, "comp_vector %d (the last): %s", nv - 1, strerror(errno));
		if (cq)
			ibv_destroy_cq(cq);
		errno = 0;
		cq = ibv_create_cq(D.ctx, 16, NULL, NULL, nv);
		EXPECT(!cq && errno == EINVAL, "comp_vector %d: cq %p errno %s", nv, (void *)cq, strerror(errno));
		if (cq)
			ibv_destroy_cq(cq);
		errno = 0;
		cq = ibv_create_cq(D.ctx, 16, NULL, NULL, -1);
		EXPECT(!cq && errno == EINVAL, "comp_vector -1: cq %p errno %s", (void *)cq, strerror(errno));
		if (cq)
			ibv_destroy_cq(cq);
		memset(&cx, 0, sizeof(cx));
		cx.cqe = 16;
		cx.comp_vector = nv;
		cx.wc_flags = IBV_WC_STANDARD_FLAGS;
		errno = 0;
		cqx = ibv_create_cq_ex(D.ctx, &cx);
		EXPECT(!cqx && errno == EINVAL, "cq_ex comp_vector %d: cq %p errno %s", nv, (void *)cqx,
		       strerror(errno));
		if (cqx)
			ibv_destroy_cq(ibv_cq_ex_to_cq(cqx));
	}
	check_end();

	check_begin("ibv_create_qp_ex with IBV_QP_INIT_ATTR_CREATE_FLAGS: flags 0 accepted, a flag refused");
	cq = ibv_create_cq(D.ctx, 16, NULL, NULL, 0);
	if (EXPECT(cq, "create_cq: %s", strerror(errno))) {
		struct ibv_qp_init_attr_ex qx;

		memset(&qx, 0, sizeof(qx));
		qx.send_cq = qx.recv_cq = cq;
		qx.qp_type = IBV_QPT_RC;
		qx.cap.max_send_wr = qx.cap.max_recv_wr = 4;
		qx.cap.max_send_sge = qx.cap.max_recv_sge = 1;
		qx.pd = D.pd;
		qx.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS;
		qx.create_flags = 0;
		qp = ibv_create_qp_ex(D.ctx, &qx);
		EXPECT(qp, "create_flags 0: %s", strerror(errno));
		if (qp)
			ibv_destroy_qp(qp);
		qx.create_flags = IBV_QP_CREATE_SCATTER_FCS;
		errno = 0;
		qp = ibv_create_qp_ex(D.ctx, &qx);
		EXPECT(!qp && errno == EOPNOTSUPP, "create_flags SCATTER_FCS: qp %p errno %s", (void *)qp,
		       strerror(errno));
		if (qp)
			ibv_destroy_qp(qp);
		ibv_destroy_cq(cq);
	}
	check_end();

	check_begin("ibv_modify_qp RESET to RTS: EINVAL; RESET to INIT without PORT: EINVAL");
	cq = ibv_create_cq(D.ctx, 16, NULL, NULL, 0);
	if (EXPECT(cq, "create_cq: %s", strerror(errno))) {
		memset(&ia, 0, sizeof(ia));
		ia.send_cq = ia.recv_cq = cq;
		ia.qp_type = IBV_QPT_RC;
		ia.cap.max_send_wr = ia.cap.max_recv_wr = 4;
		ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
		qp = ibv_create_qp(D.pd, &ia);
		if (EXPECT(qp, "create_qp: %s", strerror(errno))) {
			memset(&a, 0, sizeof(a));
			a.qp_state = IBV_QPS_RTS;
			a.sq_psn = 1;
			a.timeout = 14;
			a.retry_cnt = 7;
			a.rnr_retry = 7;
			a.max_rd_atomic = 1;
			rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					   IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
			EXPECT(rc == EINVAL, "RESET->RTS returned %d (%s)", rc, strerror(rc));
			memset(&a, 0, sizeof(a));
			a.qp_state = IBV_QPS_INIT;
			a.qp_access_flags = 0;
			rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS);
			EXPECT(rc == EINVAL, "RESET->INIT without PKEY_INDEX/PORT returned %d (%s)", rc, strerror(rc));
			memset(&a, 0, sizeof(a));
			rc = ibv_query_qp(qp, &a, IBV_QP_STATE, &ia);
			EXPECT(rc == 0 && a.qp_state == IBV_QPS_RESET, "after failed modifies: state %d rc %d", a.qp_state, rc);
			rc = ibv_destroy_cq(cq);
			EXPECT(rc == EBUSY, "ibv_destroy_cq with a QP attached returned %d (%s), want EBUSY", rc,
			       strerror(rc));
			if (rc == 0)
				cq = NULL;
		}
	}
	check_end();

	check_begin("posting more than max_send_wr / max_recv_wr: ENOMEM and bad_wr");
	if (qp) {
		ibv_destroy_qp(qp);
		qp = NULL;
	}
	{
		struct fx f;
		struct pair_opts o;

		default_opts(&o, IBV_QPT_RC);
		o.max_send_wr = 8;
		o.max_recv_wr = 8;
		o.min_rnr_timer = 31; /* the peer has no receives: the first SEND waits on RNR */
		if (fx_make(&f, &o)) {
			uint32_t sc = f.p.a.cap.max_send_wr, rcap = f.p.a.cap.max_recv_wr;
			struct ibv_send_wr *sw = calloc(sc + 1, sizeof(*sw)), *sbad = NULL;
			struct ibv_recv_wr *rw = calloc(rcap + 1, sizeof(*rw)), *rbad = NULL;
			struct ibv_sge sge = { (uintptr_t)f.ma.buf, 8, f.ma.mr->lkey };
			struct ibv_qp_attr ea = { .qp_state = IBV_QPS_ERR };
			struct ibv_wc wcs[64];

			EXPECT(sc >= 8 && sc < 4096 && rcap >= 8 && rcap < 4096, "caps %u/%u", sc, rcap);
			for (uint32_t i = 0; i <= sc; i++) {
				sw[i].wr_id = i;
				sw[i].opcode = IBV_WR_SEND;
				sw[i].sg_list = &sge;
				sw[i].num_sge = 1;
				sw[i].next = i < sc ? &sw[i + 1] : NULL;
			}
			rc = ibv_post_send(f.p.a.qp, sw, &sbad);
			EXPECT(rc == ENOMEM, "posting %u send WRs on a queue of %u returned %d (%s)", sc + 1, sc, rc,
			       strerror(rc));
			EXPECT(sbad == &sw[sc], "bad_wr is WR #%ld want #%u", sbad ? (long)(sbad - sw) : -1L, sc);
			for (uint32_t i = 0; i <= rcap; i++) {
				rw[i].wr_id = i;
				rw[i].sg_list = &sge;
				rw[i].num_sge = 1;
				rw[i].next = i < rcap ? &rw[i + 1] : NULL;
			}
			rc = ibv_post_recv(f.p.a.qp, rw, &rbad);
			EXPECT(rc == ENOMEM, "posting %u receive WRs on a queue of %u returned %d (%s)", rcap + 1, rcap, rc,
			       strerror(rc));
			EXPECT(rbad == &rw[rcap], "recv bad_wr is WR #%ld want #%u", rbad ? (long)(rbad - rw) : -1L, rcap);
			check_end();
			check_begin("num_sge above the QP's max_send_sge: EINVAL and bad_wr");
			{
				struct ibv_sge many[64];
				struct ibv_send_wr w1 = { .wr_id = 999, .sg_list = many, .opcode = IBV_WR_SEND }, *b1 = NULL;

				for (int i = 0; i < 64; i++)
					many[i] = sge;
				w1.num_sge = f.p.a.cap.max_send_sge + 1 > 64 ? 64 : f.p.a.cap.max_send_sge + 1;
				/* make room: ERR flushes the queue */
				rc = ibv_modify_qp(f.p.a.qp, &ea, IBV_QP_STATE);
				EXPECT(rc == 0, "modify ERR: %s", strerror(rc));
				poll_n(f.p.a.scq, wcs, sc < 64 ? sc : 64, 2000);
				rc = ibv_post_send(f.p.a.qp, &w1, &b1);
				EXPECT(rc == EINVAL && b1 == &w1, "num_sge %d > max_send_sge %u: returned %d (%s)", w1.num_sge,
				       f.p.a.cap.max_send_sge, rc, strerror(rc));
			}
			free(sw);
			free(rw);
		}
		fx_free(&f);
	}
	check_end();

	check_begin("ibv_create_qp beyond the device limits: NULL, EINVAL");
	if (!cq)
		cq = ibv_create_cq(D.ctx, 16, NULL, NULL, 0);
	if (EXPECT(cq, "create_cq")) {
		memset(&ia, 0, sizeof(ia));
		ia.send_cq = ia.recv_cq = cq;
		ia.qp_type = IBV_QPT_RC;
		ia.cap.max_send_wr = D.attr.orig_attr.max_qp_wr + 1;
		ia.cap.max_recv_wr = 4;
		ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
		errno = 0;
		qp = ibv_create_qp(D.pd, &ia);
		EXPECT(!qp && errno == EINVAL, "max_send_wr max+1: qp %p errno %s", (void *)qp, strerror(errno));
		if (qp)
			ibv_destroy_qp(qp);
		ia.cap.max_send_wr = 4;
		ia.cap.max_send_sge = D.attr.orig_attr.max_sge + 1;
		errno = 0;
		qp = ibv_create_qp(D.pd, &ia);
		EXPECT(!qp && errno == EINVAL, "max_send_sge max+1: qp %p errno %s", (void *)qp, strerror(errno));
		if (qp)
			ibv_destroy_qp(qp);
		qp = NULL;
	}
	check_end();

	check_begin("ibv_dealloc_pd with an MR registered: EBUSY");
	{
		struct ibv_pd *pd = ibv_alloc_pd(D.ctx);

		if (EXPECT(pd, "alloc_pd: %s", strerror(errno))) {
			mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
			if (EXPECT(mr, "reg_mr: %s", strerror(errno))) {
				rc = ibv_dealloc_pd(pd);
				EXPECT(rc == EBUSY, "dealloc_pd returned %d (%s) want EBUSY", rc, strerror(rc));
				if (rc == 0)
					pd = NULL;
				ibv_dereg_mr(mr);
			}
			if (pd)
				EXPECT(ibv_dealloc_pd(pd) == 0, "dealloc_pd after dereg: %s", strerror(errno));
		}
	}
	check_end();

	check_begin("ibv_query_gid / ibv_query_port out of range fail");
	{
		union ibv_gid g;
		struct ibv_port_attr pa;

		EXPECT(ibv_query_gid(D.ctx, D.port_num, D.port.gid_tbl_len + 5, &g) != 0, "gid index past the table");
		EXPECT(ibv_query_port(D.ctx, D.attr.orig_attr.phys_port_cnt + 1, &pa) != 0, "port past the last");
	}
	check_end();

	if (cq)
		ibv_destroy_cq(cq);
	free(buf);
}

/* ------------------------------------------------------------------------------ */
/* fork mode: the responder side in a child process with its own device            */

struct peer_info {
	uint32_t qpn, psn, rkey, pad;
	uint64_t addr;
	uint8_t gid[16];
};

static int xfer(int fd, void *p, size_t n, int wr)
{
	char *c = p;

	while (n) {
		ssize_t r = wr ? write(fd, c, n) : read(fd, c, n);

		if (r <= 0) {
			if (r < 0 && errno == EINTR)
				continue;
			return 0;
		}
		c += r;
		n -= (size_t)r;
	}
	return 1;
}

static int fork_connect(struct ibv_qp *qp, const struct peer_info *me, const struct peer_info *peer)
{
	struct ibv_qp_attr a;
	struct pair_opts o;
	int rc;

	default_opts(&o, IBV_QPT_RC);
	if (!qp_to_init(qp, IBV_QPT_RC, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC))
		return 0;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = D.port.active_mtu;
	a.dest_qp_num = peer->qpn;
	a.rq_psn = peer->psn;
	fill_ah(&a.ah_attr);
	memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 1;
	rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	if (!EXPECT(rc == 0, "modify RTR: %s", strerror(rc)))
		return 0;
	return qp_to_rts(qp, IBV_QPT_RC, me->psn, &o);
}

/* Child: a passive responder. It posts receives, connects, then reports each receive
 * completion to the parent (wr_id, status, opcode, byte_len, flags, imm) and the first
 * bytes of its buffer, and exits when the parent closes the socket. */
static int fork_child(int sock)
{
	struct mem m;
	struct ep e;
	struct pair_opts o;
	struct peer_info me, peer;
	struct ibv_wc wc;
	int i;

	g_child = 1;
	if (!open_device())
		return 1;
	check_begin("child setup");
	default_opts(&o, IBV_QPT_RC);
	if (!mem_alloc(&m, BUF_LEN, ACC_ALL) || !make_ep(&e, &o, NULL, NULL))
		return check_end(), 1;
	me = (struct peer_info){ e.qp->qp_num, PSN_B, m.mr->rkey, 0, (uintptr_t)m.buf, { 0 } };
	memcpy(me.gid, D.gid.raw, 16);
	if (!xfer(sock, &me, sizeof(me), 1) || !xfer(sock, &peer, sizeof(peer), 0))
		return check_end(), 1;
	if (!fork_connect(e.qp, &me, &peer))
		return check_end(), 1;
	for (i = 0; i < 4; i++)
		post_recv(e.qp, 500 + i, m.buf + 65536 + i * 4096, 4096, m.mr->lkey);
	/* the receives are posted before the parent's first SEND: it waits for this byte */
	if (!xfer(sock, "k", 1, 1))
		return check_end(), 1;
	if (!check_end())
		return 1;
	alarm(0);
	for (;;) {
		char cmd;

		if (!xfer(sock, &cmd, 1, 0))
			break;
		if (cmd == 'r') { /* report one receive completion and its bytes */
			struct ibv_wc out;
			int n = poll_n(e.rcq, &wc, 1, 10000);

			memset(&out, 0, sizeof(out));
			if (n == 1)
				out = wc;
			else
				out.status = (enum ibv_wc_status)-1;
			out.vendor_err = e.qp->qp_num;
			if (!xfer(sock, &out, sizeof(out), 1))
				break;
			if (n == 1 && !xfer(sock, m.buf + 65536 + (wc.wr_id - 500) * 4096, 4096, 1))
				break;
		} else if (cmd == 'm') { /* send a 64 KiB snapshot of the target area */
			if (!xfer(sock, m.buf, 65536, 1))
				break;
		} else if (cmd == 's') { /* set the target area from the parent */
			if (!xfer(sock, m.buf, 65536, 0))
				break;
		}
	}
	check_begin("child teardown");
	free_ep(&e, 1);
	mem_free(&m);
	check_end();
	return g_fail ? 1 : 0;
}

static void fork_mode(void)
{
	int sv[2], status = 0;
	pid_t pid;
	struct mem m;
	struct ep e;
	struct pair_opts o;
	struct peer_info me, peer;
	struct ibv_wc wc, rw;
	char *remote = malloc(65536), *rbytes = malloc(4096);

	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) {
		perror("socketpair");
		summary_and_exit(1);
	}
	/* -F: the child inherits an open context (as Python's multiprocessing children do) and
	 * must still get a device of its own, with its own address and progress */
	if (g_open_before_fork && !open_device())
		summary_and_exit(1);
	pid = fork();
	if (pid == 0) {
		close(sv[0]);
		alarm(g_watchdog_s * 3);
		_exit(fork_child(sv[1]));
	}
	close(sv[1]);
	if (!g_open_before_fork && !open_device())
		summary_and_exit(1);
	check_begin("fork: connect an RC QP to a QP on another process's device");
	default_opts(&o, IBV_QPT_RC);
	if (mem_alloc(&m, BUF_LEN, ACC_ALL) && make_ep(&e, &o, NULL, NULL) && xfer(sv[0], &peer, sizeof(peer), 0)) {
		me = (struct peer_info){ e.qp->qp_num, PSN_A, m.mr->rkey, 0, (uintptr_t)m.buf, { 0 } };
		memcpy(me.gid, D.gid.raw, 16);
		char k = 0;

		EXPECT(xfer(sv[0], &me, sizeof(me), 1), "exchange");
		if (!memcmp(me.gid, peer.gid, 16))
			fprintf(stderr, "note: the child's device has the same GID as ours (one shared device)\n");
		fork_connect(e.qp, &me, &peer);
		EXPECT(xfer(sv[0], &k, 1, 0) && k == 'k', "the child did not get ready");
	}
	if (!check_end())
		goto out;

	check_begin("fork: SEND_WITH_IMM");
	fill(m.buf, 4096, 200);
	post_send1(e.qp, &(struct sendspec){ .id = 1, .op = IBV_WR_SEND_WITH_IMM, .addr = m.buf, .len = 3000,
					     .lkey = m.mr->lkey, .imm = 0x10203040 });
	if (poll1(e.scq, &wc, "send"))
		check_wc(&wc, &(struct want){ 1, IBV_WC_SUCCESS, IBV_WC_SEND, ANY, e.qp->qp_num, ANY, ANY, ANY }, "sender");
	if (xfer(sv[0], "r", 1, 1) && xfer(sv[0], &rw, sizeof(rw), 0) &&
	    EXPECT(rw.status != (enum ibv_wc_status)-1, "the child saw no receive")) {
		struct want w = W(500, IBV_WC_SUCCESS, IBV_WC_RECV, 3000, rw.vendor_err);

		w.flags = IBV_WC_WITH_IMM;
		w.imm = 0x10203040;
		check_wc(&rw, &w, "receiver");
		check_rc_src_qp(&rw, e.qp->qp_num);
		if (xfer(sv[0], rbytes, 4096, 0))
			EXPECT(diff_at(rbytes, m.buf, 3000) < 0, "received bytes differ");
	}
	check_end();

	check_begin("fork: RDMA_WRITE and RDMA_WRITE_WITH_IMM");
	fill(m.buf, 65536, 201);
	post_send1(e.qp, &(struct sendspec){ .id = 2, .op = IBV_WR_RDMA_WRITE, .addr = m.buf, .len = 20000,
					     .lkey = m.mr->lkey, .raddr = peer.addr, .rkey = peer.rkey });
	post_send1(e.qp, &(struct sendspec){ .id = 3, .op = IBV_WR_RDMA_WRITE_WITH_IMM, .addr = m.buf + 20000,
					     .len = 100, .lkey = m.mr->lkey, .raddr = peer.addr + 20000, .rkey = peer.rkey,
					     .imm = 5 });
	if (poll1(e.scq, &wc, "write"))
		check_wc(&wc, &(struct want){ 2, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, e.qp->qp_num, ANY, ANY, ANY },
			 "write");
	if (poll1(e.scq, &wc, "write imm"))
		check_wc(&wc, &(struct want){ 3, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, e.qp->qp_num, ANY, ANY, ANY },
			 "write imm");
	if (xfer(sv[0], "r", 1, 1) && xfer(sv[0], &rw, sizeof(rw), 0) &&
	    EXPECT(rw.status != (enum ibv_wc_status)-1, "the child saw no immediate")) {
		struct want w = W(501, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, 100, rw.vendor_err);

		w.flags = IBV_WC_WITH_IMM;
		w.imm = 5;
		check_wc(&rw, &w, "receiver");
		xfer(sv[0], rbytes, 4096, 0);
	}
	if (xfer(sv[0], "m", 1, 1) && xfer(sv[0], remote, 65536, 0))
		EXPECT(diff_at(remote, m.buf, 20100) < 0, "written bytes differ at %ld", diff_at(remote, m.buf, 20100));
	check_end();

	check_begin("fork: RDMA_READ");
	memset(m.buf + 100000, 0, 30000);
	post_send1(e.qp, &(struct sendspec){ .id = 4, .op = IBV_WR_RDMA_READ, .addr = m.buf + 100000, .len = 30000,
					     .lkey = m.mr->lkey, .raddr = peer.addr + 1000, .rkey = peer.rkey });
	if (poll1(e.scq, &wc, "read"))
		check_wc(&wc, &(struct want){ 4, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, 30000, e.qp->qp_num, ANY, ANY, ANY },
			 "read");
	EXPECT(diff_at(m.buf + 100000, remote + 1000, 30000) < 0, "read bytes differ");
	check_end();

	check_begin("fork: ATOMIC_CMP_AND_SWP and ATOMIC_FETCH_AND_ADD");
	{
		uint64_t *l = (uint64_t *)(m.buf + 200000), v0 = *(uint64_t *)(remote + 40000);

		post_send1(e.qp, &(struct sendspec){ .id = 5, .op = IBV_WR_ATOMIC_FETCH_AND_ADD, .addr = l, .len = 8,
						     .lkey = m.mr->lkey, .raddr = peer.addr + 40000, .rkey = peer.rkey,
						     .cmp_add = 3 });
		if (poll1(e.scq, &wc, "fetch-add"))
			check_wc(&wc, &(struct want){ 5, IBV_WC_SUCCESS, IBV_WC_FETCH_ADD, 8, e.qp->qp_num, ANY, ANY, ANY },
				 "fetch-add");
		EXPECT(*l == v0, "fetch-add returned 0x%" PRIx64 " want 0x%" PRIx64, *l, v0);
		post_send1(e.qp, &(struct sendspec){ .id = 6, .op = IBV_WR_ATOMIC_CMP_AND_SWP, .addr = l, .len = 8,
						     .lkey = m.mr->lkey, .raddr = peer.addr + 40000, .rkey = peer.rkey,
						     .cmp_add = v0 + 3, .swap = 42 });
		if (poll1(e.scq, &wc, "cmp-swap"))
			check_wc(&wc, &(struct want){ 6, IBV_WC_SUCCESS, IBV_WC_COMP_SWAP, 8, e.qp->qp_num, ANY, ANY, ANY },
				 "cmp-swap");
		EXPECT(*l == v0 + 3, "cmp-swap returned 0x%" PRIx64, *l);
		if (xfer(sv[0], "m", 1, 1) && xfer(sv[0], remote, 65536, 0))
			EXPECT(*(uint64_t *)(remote + 40000) == 42, "target 0x%" PRIx64, *(uint64_t *)(remote + 40000));
	}
	check_end();

	check_begin("fork: bad rkey gives REM_ACCESS_ERR, then WR_FLUSH_ERR");
	post_send1(e.qp, &(struct sendspec){ .id = 7, .op = IBV_WR_RDMA_WRITE, .addr = m.buf, .len = 8, .lkey = m.mr->lkey,
					     .raddr = peer.addr, .rkey = peer.rkey ^ 0x4400 });
	post_send1(e.qp, &(struct sendspec){ .id = 8, .op = IBV_WR_RDMA_WRITE, .addr = m.buf, .len = 8, .lkey = m.mr->lkey,
					     .raddr = peer.addr, .rkey = peer.rkey });
	if (poll1(e.scq, &wc, "bad rkey"))
		check_wc(&wc, &(struct want){ 7, IBV_WC_REM_ACCESS_ERR, ANY, ANY, e.qp->qp_num, ANY, ANY, ANY }, "bad rkey");
	if (poll1(e.scq, &wc, "flushed"))
		check_wc(&wc, &(struct want){ 8, IBV_WC_WR_FLUSH_ERR, ANY, ANY, e.qp->qp_num, ANY, ANY, ANY }, "flushed");
	check_end();
out:
	close(sv[0]);
	{
		uint64_t end = now_ms() + 10000;
		int r;

		while ((r = waitpid(pid, &status, WNOHANG)) == 0 && now_ms() < end)
			sleep_ms(10);
		if (r == 0) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
		}
	}
	check_begin("fork: the child exited cleanly");
	EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status 0x%x", status);
	check_end();
	free(remote);
	free(rbytes);
}

/* ------------------------------------------------------------------------------ */

/* UD multicast: B attached to 239.1.2.3 (MGID ::ffff:239.1.2.3) gets the SENDs A posts
 * to the group (QPN 0xFFFFFF) through the device's own IP multicast loopback; the
 * errnos of ibv_attach_mcast / ibv_detach_mcast are the kernel's. */
#define MCAST_N 4
static void t_mcast(void)
{
	struct pair p;
	struct pair_opts o;
	struct ep rc_ep;
	struct mem ma, mb;
	struct ibv_ah_attr aha;
	struct ibv_ah *ah = NULL;
	struct ibv_wc wc[MCAST_N];
	struct ibv_send_wr wr, *bad;
	struct ibv_sge sge;
	union ibv_gid mgid;
	int attached = 0, rc, n;
	const uint32_t len = 200;

	memset(&p, 0, sizeof(p));
	memset(&rc_ep, 0, sizeof(rc_ep));
	memset(&ma, 0, sizeof(ma));
	memset(&mb, 0, sizeof(mb));
	memset(&mgid, 0, sizeof(mgid));
	mgid.raw[10] = mgid.raw[11] = 0xff;
	mgid.raw[12] = 239;
	mgid.raw[13] = 1;
	mgid.raw[14] = 2;
	mgid.raw[15] = 3;

	check_begin("ibv_attach_mcast/ibv_detach_mcast: 0 or the kernel's errno");
	default_opts(&o, IBV_QPT_UD);
	if (mem_alloc(&ma, 8192, ACC_ALL) && mem_alloc(&mb, 8192, ACC_ALL) && make_pair(&p, &o)) {
		struct pair_opts ro;

		EXPECT(D.attr.orig_attr.max_mcast_grp > 0 && D.attr.orig_attr.max_mcast_qp_attach > 0,
		       "ibv_query_device: max_mcast_grp %d, max_mcast_qp_attach %d",
		       D.attr.orig_attr.max_mcast_grp, D.attr.orig_attr.max_mcast_qp_attach);
		rc = ibv_attach_mcast(p.b.qp, &mgid, 0);
		attached = EXPECT(rc == 0, "attach: %s", strerror(rc));
		rc = ibv_attach_mcast(p.b.qp, &mgid, 0);
		EXPECT(rc == 0, "attaching again: %s", strerror(rc));
		rc = ibv_attach_mcast(p.b.qp, &D.gid, 0);
		EXPECT(rc == EINVAL, "attach to a unicast GID: %s, want EINVAL", strerror(rc));
		rc = ibv_detach_mcast(p.a.qp, &mgid, 0);
		EXPECT(rc == EINVAL, "detach of a QP not attached: %s, want EINVAL", strerror(rc));
		rc = ibv_destroy_qp(p.b.qp);
		EXPECT(rc == EBUSY, "destroying an attached QP: %s, want EBUSY", strerror(rc));
		default_opts(&ro, IBV_QPT_RC);
		if (make_ep(&rc_ep, &ro, NULL, NULL)) {
			rc = ibv_attach_mcast(rc_ep.qp, &mgid, 0);
			EXPECT(rc == EINVAL, "attach of an RC QP: %s, want EINVAL", strerror(rc));
		}
	}
	check_end();

	check_begin("UD SEND to 239.1.2.3: the attached QP gets it with the GRH, then nothing after detach");
	if (attached) {
		fill_ah(&aha);
		aha.grh.dgid = mgid;
		/* The group is IPv4: it is sent to from an IPv4 GID (RoCEv2 puts both GIDs in one
		 * IP header), whichever index the other checks use. */
		for (n = 0; n < D.port.gid_tbl_len; n++) {
			union ibv_gid g;
			static const uint8_t mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };

			if (ibv_query_gid(D.ctx, D.port_num, n, &g) == 0 && !memcmp(g.raw, mapped, 12)) {
				aha.grh.sgid_index = n;
				break;
			}
		}
		ah = ibv_create_ah(D.pd, &aha);
		EXPECT(ah, "ibv_create_ah to the group: %s", strerror(errno));
	}
	if (ah) {
		for (int i = 0; i < MCAST_N; i++)
			post_recv(p.b.qp, 100 + i, mb.buf + i * 1024, 1024, mb.mr->lkey);
		memset(&wr, 0, sizeof(wr));
		wr.opcode = IBV_WR_SEND;
		wr.sg_list = &sge;
		wr.num_sge = 1;
		wr.wr.ud.ah = ah;
		wr.wr.ud.remote_qpn = 0xffffff;
		wr.wr.ud.remote_qkey = QKEY;
		for (int i = 0; i < MCAST_N; i++) {
			fill(ma.buf + i * 1024, len, 300 + i);
			sge = (struct ibv_sge){ (uintptr_t)(ma.buf + i * 1024), len, ma.mr->lkey };
			wr.wr_id = i;
			rc = ibv_post_send(p.a.qp, &wr, &bad);
			EXPECT(rc == 0, "post_send: %s", strerror(rc));
			if (poll1(p.a.scq, wc, "a multicast send"))
				EXPECT(wc[0].status == IBV_WC_SUCCESS, "send: %s", ibv_wc_status_str(wc[0].status));
		}
		/* Multicast may lose datagrams: at least one, each whole and in order. */
		n = poll_n(p.b.rcq, wc, MCAST_N, 3000);
		EXPECT(n >= 1, "none of %d multicast SENDs arrived", MCAST_N);
		for (int k = 0, i = 0; k < n; k++, i++) {
			char *at = mb.buf + (wc[k].wr_id - 100) * 1024;

			EXPECT(wc[k].status == IBV_WC_SUCCESS && wc[k].byte_len == len + 40 &&
				       (wc[k].wc_flags & IBV_WC_GRH) && wc[k].src_qp == p.a.qp->qp_num &&
				       wc[k].qp_num == p.b.qp->qp_num,
			       "receive %d: status %s byte_len %u flags 0x%x src_qp 0x%x", k,
			       ibv_wc_status_str(wc[k].status), wc[k].byte_len, wc[k].wc_flags, wc[k].src_qp);
			while (i < MCAST_N && diff_at(at + 40, ma.buf + i * 1024, len) >= 0)
				i++;
			EXPECT(i < MCAST_N, "receive %d holds no payload sent (in order)", k);
			EXPECT((unsigned char)at[20] == 0x45 && !memcmp(at + 20 + 16, mgid.raw + 12, 4),
			       "receive %d: the GRH's IPv4 destination is not the group", k);
		}
		expect_cq_empty(p.a.rcq, 100, "A's receive CQ (A is not attached)");

		rc = ibv_detach_mcast(p.b.qp, &mgid, 0);
		attached = !EXPECT(rc == 0, "detach: %s", strerror(rc));
		post_recv(p.b.qp, 200, mb.buf + 7 * 1024, 1024, mb.mr->lkey);
		memset(mb.buf + 7 * 1024, 0xee, 1024);
		sge = (struct ibv_sge){ (uintptr_t)ma.buf, len, ma.mr->lkey };
		wr.wr_id = 9;
		rc = ibv_post_send(p.a.qp, &wr, &bad);
		EXPECT(rc == 0, "post_send: %s", strerror(rc));
		if (poll1(p.a.scq, wc, "the send after detach"))
			EXPECT(wc[0].status == IBV_WC_SUCCESS, "send: %s", ibv_wc_status_str(wc[0].status));
		expect_cq_empty(p.b.rcq, 300, "B's receive CQ after detach");
		EXPECT((unsigned char)mb.buf[7 * 1024] == 0xee, "the buffer of a detached QP was written");
		rc = ibv_detach_mcast(p.b.qp, &mgid, 0);
		EXPECT(rc == EINVAL, "detaching twice: %s, want EINVAL", strerror(rc));
	}
	check_end();
	if (attached)
		ibv_detach_mcast(p.b.qp, &mgid, 0);
	if (ah)
		ibv_destroy_ah(ah);
	free_ep(&rc_ep, 1);
	free_pair(&p);
	mem_free(&ma);
	mem_free(&mb);
}

/* ------------------------------------------------------------------------------ */
/* Registered memory the process does not back. The kernel pins the pages at
 * registration (ib_umem_get): unmapped memory, or a read-only page with an access that
 * lets the device write, is EFAULT; a length of 0 at a page boundary spans no page
 * (EINVAL). Memory unmapped (or write-protected) after registration must not crash the
 * process: the device access fails with an error completion and the QP goes to ERR. */

static void *map_pages(size_t len, int prot)
{
	void *p = mmap(NULL, len, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	return p == MAP_FAILED ? NULL : p;
}

static void t_mr_backing(void)
{
	struct ibv_mr *mr;
	char *p, *q;

	check_begin("ibv_reg_mr of 1 TiB over a 1 MiB buffer: NULL, EFAULT");
	p = map_pages(1 << 20, PROT_READ | PROT_WRITE);
	if (EXPECT(p, "mmap: %s", strerror(errno))) {
		errno = 0;
		mr = ibv_reg_mr(D.pd, p, (size_t)1 << 40, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
		EXPECT(!mr && errno == EFAULT, "mr %p errno %s", (void *)mr, strerror(errno));
		if (mr)
			ibv_dereg_mr(mr);
		errno = 0;
		mr = ibv_reg_mr(D.pd, p, (size_t)1 << 40, IBV_ACCESS_REMOTE_READ);
		EXPECT(!mr && errno == EFAULT, "read-only access: mr %p errno %s", (void *)mr, strerror(errno));
		if (mr)
			ibv_dereg_mr(mr);
		mr = ibv_reg_mr(D.pd, p, 1 << 20, ACC_ALL);
		EXPECT(mr, "the 1 MiB itself: %s", strerror(errno));
		if (mr)
			ibv_dereg_mr(mr);
		munmap(p, 1 << 20);
	}
	check_end();

	check_begin("ibv_reg_mr of a read-only page: REMOTE_WRITE (or LOCAL_WRITE) EFAULT, REMOTE_READ accepted");
	p = map_pages(8192, PROT_READ);
	if (EXPECT(p, "mmap: %s", strerror(errno))) {
		static const int writing[] = { IBV_ACCESS_LOCAL_WRITE,
					       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
					       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC, ACC_ALL };

		for (unsigned i = 0; i < sizeof(writing) / sizeof(writing[0]); i++) {
			errno = 0;
			mr = ibv_reg_mr(D.pd, p, 8192, writing[i]);
			EXPECT(!mr && errno == EFAULT, "access 0x%x: mr %p errno %s", writing[i], (void *)mr,
			       strerror(errno));
			if (mr)
				ibv_dereg_mr(mr);
		}
		mr = ibv_reg_mr(D.pd, p, 8192, IBV_ACCESS_REMOTE_READ);
		EXPECT(mr, "REMOTE_READ: %s", strerror(errno));
		if (mr)
			ibv_dereg_mr(mr);
		munmap(p, 8192);
	}
	check_end();

	check_begin("ibv_reg_mr of unmapped or PROT_NONE memory: NULL, EFAULT");
	p = map_pages(3 * 4096, PROT_READ | PROT_WRITE);
	if (EXPECT(p, "mmap: %s", strerror(errno))) {
		munmap(p + 4096, 4096); /* a hole in the middle */
		errno = 0;
		mr = ibv_reg_mr(D.pd, p, 3 * 4096, IBV_ACCESS_REMOTE_READ);
		EXPECT(!mr && errno == EFAULT, "over a hole: mr %p errno %s", (void *)mr, strerror(errno));
		if (mr)
			ibv_dereg_mr(mr);
		EXPECT(mprotect(p, 4096, PROT_NONE) == 0, "mprotect: %s", strerror(errno));
		errno = 0;
		mr = ibv_reg_mr(D.pd, p, 4096, 0);
		EXPECT(!mr && errno == EFAULT, "PROT_NONE: mr %p errno %s", (void *)mr, strerror(errno));
		if (mr)
			ibv_dereg_mr(mr);
		munmap(p, 3 * 4096);
	}
	check_end();

	check_begin("ibv_reg_mr of length 0: EINVAL at a page boundary, accepted inside a mapped page");
	p = map_pages(4096, PROT_READ | PROT_WRITE);
	if (EXPECT(p, "mmap: %s", strerror(errno))) {
		errno = 0;
		mr = ibv_reg_mr(D.pd, p, 0, ACC_ALL);
		EXPECT(!mr && errno == EINVAL, "page-aligned: mr %p errno %s", (void *)mr, strerror(errno));
		if (mr)
			ibv_dereg_mr(mr);
		mr = ibv_reg_mr(D.pd, p + 64, 0, ACC_ALL);
		if (EXPECT(mr, "inside the page: %s", strerror(errno))) {
			EXPECT(mr->length == 0, "length %zu", mr->length);
			ibv_dereg_mr(mr);
		}
		munmap(p, 4096);
	}
	check_end();

	check_begin("ibv_rereg_mr: input errors ERR_INPUT/EINVAL, device refusals ERR_CMD, "
		    "success updates the ibv_mr and keeps the keys");
	p = map_pages(2 * 4096, PROT_READ | PROT_WRITE);
	q = map_pages(4096, PROT_READ | PROT_WRITE);
	mr = p && q ? ibv_reg_mr(D.pd, q, 4096, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (EXPECT(mr, "mmap or reg: %s", strerror(errno))) {
		struct ibv_pd *pd2 = ibv_alloc_pd(D.ctx);
		uint32_t lkey = mr->lkey, rkey = mr->rkey;
		int r;

		errno = 0;
		r = ibv_rereg_mr(mr, 0x100, NULL, NULL, 0, 0);
		EXPECT(r == IBV_REREG_MR_ERR_INPUT && errno == EINVAL, "unknown flag: %d %s", r,
		       strerror(errno));
		errno = 0;
		r = ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, 4096, 0);
		EXPECT(r == IBV_REREG_MR_ERR_INPUT && errno == EINVAL, "no address: %d %s", r,
		       strerror(errno));
		errno = 0;
		r = ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, pd2, NULL, 0, IBV_ACCESS_LOCAL_WRITE);
		EXPECT(r == IBV_REREG_MR_ERR_INPUT && errno == EINVAL,
		       "access without CHANGE_ACCESS: %d %s", r, strerror(errno));
		errno = 0;
		r = ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
				 IBV_ACCESS_REMOTE_WRITE);
		EXPECT(r == IBV_REREG_MR_ERR_CMD && errno == EINVAL,
		       "REMOTE_WRITE without LOCAL_WRITE: %d %s", r, strerror(errno));
		errno = 0;
		r = ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, p, (size_t)1 << 40, 0);
		EXPECT(r == IBV_REREG_MR_ERR_CMD && errno == EFAULT, "1 TiB of 8 KiB: %d %s", r,
		       strerror(errno));
		EXPECT(mr->addr == q && mr->length == 4096 && mr->pd == D.pd,
		       "a refused rereg changed the ibv_mr");
		r = ibv_rereg_mr(mr,
				 IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_PD |
					 IBV_REREG_MR_CHANGE_ACCESS,
				 pd2, p, 8192, ACC_ALL);
		EXPECT(r == 0, "all three: %d %s", r, strerror(errno));
		EXPECT(mr->addr == p && mr->length == 8192 && mr->pd == pd2 && mr->lkey == lkey &&
			       mr->rkey == rkey,
		       "after: addr %p length %zu pd %p keys 0x%x/0x%x (were 0x%x/0x%x)", mr->addr,
		       mr->length, (void *)mr->pd, mr->lkey, mr->rkey, lkey, rkey);
		EXPECT(ibv_dereg_mr(mr) == 0, "dereg: %s", strerror(errno));
		mr = NULL;
		if (pd2)
			EXPECT(ibv_dealloc_pd(pd2) == 0, "dealloc the new PD: %s", strerror(errno));
	}
	if (mr)
		ibv_dereg_mr(mr);
	if (p)
		munmap(p, 2 * 4096);
	if (q)
		munmap(q, 4096);
	check_end();
}

static int qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;

	if (ibv_query_qp(qp, &a, IBV_QP_STATE, &ia))
		return -1;
	return a.qp_state;
}

/* One remote operation on B's memory after B unmapped it (or, `ro`, write-protected it). */
static void gone_remote(const char *name, enum ibv_wr_opcode op, int ro)
{
	struct fx f;
	struct ibv_wc wc;
	const size_t len = 2 * 4096;
	char *t;
	struct ibv_mr *tmr = NULL;

	check_begin(name);
	if (fx_rc(&f) && EXPECT((t = map_pages(len, PROT_READ | PROT_WRITE)), "mmap: %s", strerror(errno))) {
		memset(t, 7, len);
		tmr = ibv_reg_mr(D.pd, t, len, ACC_ALL);
		if (EXPECT(tmr, "reg_mr: %s", strerror(errno))) {
			if (ro)
				EXPECT(mprotect(t, len, PROT_READ) == 0, "mprotect: %s", strerror(errno));
			else
				EXPECT(munmap(t, len) == 0, "munmap: %s", strerror(errno));
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 90, .op = op, .addr = f.ma.buf,
								 .len = op == IBV_WR_RDMA_READ || op == IBV_WR_RDMA_WRITE ? 4000 : 8,
								 .lkey = f.ma.mr->lkey, .raddr = (uintptr_t)t + 4096 - 8,
								 .rkey = tmr->rkey, .cmp_add = 1, .swap = 2 });
			if (poll1(f.p.a.scq, &wc, "the requester's completion"))
				check_wc(&wc, &(struct want){ 90, IBV_WC_REM_ACCESS_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
					 "requester");
			/* still here: no signal; the target's QP reports the error */
			{
				uint64_t end = now_ms() + 5000;
				int st;

				while ((st = qp_state(f.p.b.qp)) != IBV_QPS_ERR && now_ms() < end)
					sleep_ms(5);
				EXPECT(st == IBV_QPS_ERR, "target QP state %d, want ERR", st);
			}
			EXPECT(qp_state(f.p.a.qp) == IBV_QPS_ERR, "requester QP state %d, want ERR", qp_state(f.p.a.qp));
			ibv_dereg_mr(tmr);
			if (ro)
				EXPECT((unsigned char)t[4096 - 8] == 7 && (unsigned char)t[4096] == 7, "the read-only page changed");
		}
		if (ro)
			munmap(t, len);
	}
	fx_free(&f);
	check_end();
}

static void t_mr_gone(void)
{
	struct fx f;
	struct ibv_wc wc;
	const size_t len = 2 * 4096;
	char *l;
	struct ibv_mr *lmr;

	gone_remote("RDMA_READ of memory the target unmapped: REM_ACCESS_ERR, target alive, its QP in ERR",
		    IBV_WR_RDMA_READ, 0);
	gone_remote("RDMA_WRITE to memory the target unmapped: REM_ACCESS_ERR, target alive, its QP in ERR",
		    IBV_WR_RDMA_WRITE, 0);
	gone_remote("RDMA_WRITE to memory the target made read-only: REM_ACCESS_ERR, nothing written",
		    IBV_WR_RDMA_WRITE, 1);
	gone_remote("ATOMIC_FETCH_AND_ADD on memory the target unmapped: REM_ACCESS_ERR, QP in ERR",
		    IBV_WR_ATOMIC_FETCH_AND_ADD, 0);
	gone_remote("ATOMIC_CMP_AND_SWP on memory the target made read-only: REM_ACCESS_ERR, QP in ERR",
		    IBV_WR_ATOMIC_CMP_AND_SWP, 1);

	check_begin("SEND from memory unmapped after registration: LOC_PROT_ERR, QP in ERR");
	if (fx_rc(&f) && EXPECT((l = map_pages(len, PROT_READ | PROT_WRITE)), "mmap: %s", strerror(errno))) {
		lmr = ibv_reg_mr(D.pd, l, len, ACC_ALL);
		if (EXPECT(lmr, "reg_mr: %s", strerror(errno))) {
			post_recv(f.p.b.qp, 91, f.mb.buf, 8192, f.mb.mr->lkey);
			EXPECT(munmap(l, len) == 0, "munmap: %s", strerror(errno));
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 92, .op = IBV_WR_SEND, .addr = l, .len = 6000,
								 .lkey = lmr->lkey });
			if (poll1(f.p.a.scq, &wc, "the send's completion"))
				check_wc(&wc, &(struct want){ 92, IBV_WC_LOC_PROT_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
					 "sender");
			EXPECT(qp_state(f.p.a.qp) == IBV_QPS_ERR, "QP state %d, want ERR", qp_state(f.p.a.qp));
			ibv_dereg_mr(lmr);
		}
	}
	fx_free(&f);
	check_end();

	check_begin("RDMA_READ into memory unmapped after registration: LOC_PROT_ERR, QP in ERR");
	if (fx_rc(&f) && EXPECT((l = map_pages(len, PROT_READ | PROT_WRITE)), "mmap: %s", strerror(errno))) {
		lmr = ibv_reg_mr(D.pd, l, len, ACC_ALL);
		if (EXPECT(lmr, "reg_mr: %s", strerror(errno))) {
			EXPECT(munmap(l, len) == 0, "munmap: %s", strerror(errno));
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 93, .op = IBV_WR_RDMA_READ, .addr = l, .len = 6000,
								 .lkey = lmr->lkey, .raddr = (uintptr_t)f.mb.buf,
								 .rkey = f.mb.mr->rkey });
			if (poll1(f.p.a.scq, &wc, "the read's completion"))
				check_wc(&wc, &(struct want){ 93, IBV_WC_LOC_PROT_ERR, ANY, ANY, f.p.a.qp->qp_num, ANY, ANY, ANY },
					 "reader");
			EXPECT(qp_state(f.p.a.qp) == IBV_QPS_ERR, "QP state %d, want ERR", qp_state(f.p.a.qp));
			ibv_dereg_mr(lmr);
		}
	}
	fx_free(&f);
	check_end();
}

/* On-demand paging: the capabilities, regions over memory mapped only later, the implicit
 * region, and ibv_advise_mr. */
static void t_odp(void)
{
	struct fx f;
	struct ibv_wc wc;
	struct ibv_mr *mr, *plain;
	char *p;
	const int odp_acc = ACC_ALL | IBV_ACCESS_ON_DEMAND;

	check_begin("ibv_query_device_ex: device_cap_flags_ex holds device_cap_flags (as the kernel reports "
		    "it); ODP supported, implicit too, for every RC operation");
	{
		struct ibv_device_attr_ex a;
		const uint32_t rc = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
				    IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_ATOMIC | IBV_ODP_SUPPORT_SRQ_RECV;

		memset(&a, 0, sizeof(a));
		if (EXPECT(ibv_query_device_ex(D.ctx, NULL, &a) == 0, "query: %s", strerror(errno))) {
			EXPECT(a.device_cap_flags_ex == a.orig_attr.device_cap_flags && a.device_cap_flags_ex != 0,
			       "device_cap_flags_ex 0x%llx, device_cap_flags 0x%x",
			       (unsigned long long)a.device_cap_flags_ex, a.orig_attr.device_cap_flags);
			EXPECT(a.odp_caps.general_caps == (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT),
			       "general_caps 0x%llx", (unsigned long long)a.odp_caps.general_caps);
			EXPECT(a.odp_caps.per_transport_caps.rc_odp_caps == rc, "rc 0x%x",
			       a.odp_caps.per_transport_caps.rc_odp_caps);
			EXPECT(a.odp_caps.per_transport_caps.ud_odp_caps ==
				       (IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_SRQ_RECV),
			       "ud 0x%x", a.odp_caps.per_transport_caps.ud_odp_caps);
		}
	}
	check_end();

	check_begin("ON_DEMAND region over PROT_NONE memory: registered; a WRITE lands once the target maps it");
	p = map_pages(2 * 4096, PROT_NONE);
	mr = p ? ibv_reg_mr(D.pd, p, 2 * 4096, odp_acc) : NULL;
	if (EXPECT(mr, "mmap or reg_mr: %s", strerror(errno)) && fx_rc(&f)) {
		EXPECT(mprotect(p, 2 * 4096, PROT_READ | PROT_WRITE) == 0, "mprotect: %s", strerror(errno));
		fill(f.ma.buf, 5000, 3);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 70, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf,
							 .len = 5000, .lkey = f.ma.mr->lkey,
							 .raddr = (uintptr_t)p + 100, .rkey = mr->rkey });
		if (poll1(f.p.a.scq, &wc, "the write"))
			check_wc(&wc, &(struct want){ 70, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num,
						      ANY, ANY, ANY }, "writer");
		EXPECT(diff_at(f.ma.buf, p + 100, 5000) < 0, "written bytes differ at %ld",
		       diff_at(f.ma.buf, p + 100, 5000));
		EXPECT(p[99] == 0 && p[5100] == 0, "bytes outside the target were written");
	}
	if (mr)
		ibv_dereg_mr(mr);
	if (p)
		munmap(p, 2 * 4096);
	fx_free(&f);
	check_end();

	check_begin("implicit ODP region (NULL, SIZE_MAX): one rkey reaches any buffer; iova other "
		    "than 0 EINVAL; rereg EOPNOTSUPP");
	errno = 0;
	mr = ibv_reg_mr_iova(D.pd, NULL, SIZE_MAX, 4096, odp_acc);
	EXPECT(!mr && errno == EINVAL, "iova 4096: mr %p errno %s", (void *)mr, strerror(errno));
	if (mr)
		ibv_dereg_mr(mr);
	mr = ibv_reg_mr(D.pd, NULL, SIZE_MAX, odp_acc);
	if (EXPECT(mr, "implicit: %s", strerror(errno)) && fx_rc(&f)) {
		char *target = calloc(1, 8192);

		EXPECT(mr->addr == NULL && mr->length == SIZE_MAX, "addr %p length %zu", mr->addr, mr->length);
		fill(f.ma.buf, 3000, 5);
		post_send1(f.p.a.qp, &(struct sendspec){ .id = 71, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf,
							 .len = 3000, .lkey = f.ma.mr->lkey,
							 .raddr = (uintptr_t)target + 1000, .rkey = mr->rkey });
		if (poll1(f.p.a.scq, &wc, "the write"))
			check_wc(&wc, &(struct want){ 71, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY, f.p.a.qp->qp_num,
						      ANY, ANY, ANY }, "writer");
		EXPECT(diff_at(f.ma.buf, target + 1000, 3000) < 0, "written bytes differ at %ld",
		       diff_at(f.ma.buf, target + 1000, 3000));
		EXPECT(target[999] == 0 && target[4000] == 0, "bytes outside the target were written");
		errno = 0;
		EXPECT(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, ACC_ALL) ==
				       IBV_REREG_MR_ERR_CMD &&
			       errno == EOPNOTSUPP,
		       "rereg: errno %s", strerror(errno));
		free(target);
	}
	if (mr)
		EXPECT(ibv_dereg_mr(mr) == 0, "dereg: %s", strerror(errno));
	fx_free(&f);
	check_end();

	check_begin("ibv_advise_mr: prefetch of an ODP range; EINVAL, EOPNOTSUPP and EFAULT as documented");
	p = map_pages(2 * 4096, PROT_READ | PROT_WRITE);
	mr = p ? ibv_reg_mr(D.pd, p, 2 * 4096, odp_acc) : NULL;
	plain = p ? ibv_reg_mr(D.pd, p, 4096, ACC_ALL) : NULL;
	if (EXPECT(mr && plain, "mmap or reg_mr: %s", strerror(errno))) {
		struct ibv_sge sge = { .addr = (uintptr_t)p, .length = 2 * 4096, .lkey = mr->lkey };
		struct ibv_sge past = { .addr = (uintptr_t)p + 1, .length = 2 * 4096, .lkey = mr->lkey };
		struct ibv_sge pinned = { .addr = (uintptr_t)p, .length = 64, .lkey = plain->lkey };
		int r;

		r = ibv_advise_mr(D.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH, &sge, 1);
		EXPECT(r == 0, "prefetch for writing: %s", strerror(r));
		r = ibv_advise_mr(D.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sge, 1);
		EXPECT(r == 0, "asynchronous prefetch: %s", strerror(r));
		r = ibv_advise_mr(D.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 2, &sge, 1);
		EXPECT(r == EINVAL, "unknown flag: %s", strerror(r));
		r = ibv_advise_mr(D.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sge, 0);
		EXPECT(r == EINVAL, "no SGE: %s", strerror(r));
		r = ibv_advise_mr(D.pd, (enum ibv_advise_mr_advice)9, 0, &sge, 1);
		EXPECT(r == EOPNOTSUPP, "unknown advice: %s", strerror(r));
		r = ibv_advise_mr(D.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &past, 1);
		EXPECT(r == EFAULT, "past the region: %s", strerror(r));
		r = ibv_advise_mr(D.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &pinned, 1);
		EXPECT(r == EFAULT, "a region not on demand: %s", strerror(r));
		EXPECT(munmap(p + 4096, 4096) == 0, "munmap: %s", strerror(errno));
		r = ibv_advise_mr(D.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, IBV_ADVISE_MR_FLAG_FLUSH, &sge, 1);
		EXPECT(r == EFAULT, "a page unmapped since: %s", strerror(r));
	}
	if (mr)
		ibv_dereg_mr(mr);
	if (plain)
		ibv_dereg_mr(plain);
	if (p)
		munmap(p, 4096);
	check_end();
}

/* Parent and thread domains: a parent domain stands for its protection domain wherever a
 * PD may, and holds it (and its thread domain) until it goes. */
static void t_parent_domain(void)
{
	struct fx f;
	struct ibv_wc wc;
	struct ibv_pd *pd = NULL, *parent = NULL, *bad;
	struct ibv_td *td = NULL;
	struct ibv_mr *mr = NULL;
	struct ibv_cq_ex *cqx;
	char *buf = calloc(1, 4096);

	memset(&f, 0, sizeof(f));
	check_begin("ibv_alloc_td / ibv_alloc_parent_domain: made, and their input checked");
	{
		struct ibv_td_init_attr ta = { .comp_mask = 1 };

		errno = 0;
		td = ibv_alloc_td(D.ctx, &ta);
		EXPECT(!td && errno == EINVAL, "td with comp_mask 1: %p %s", (void *)td, strerror(errno));
		ta.comp_mask = 0;
		td = ibv_alloc_td(D.ctx, &ta);
		EXPECT(td && td->context == D.ctx, "ibv_alloc_td: %s", strerror(errno));
		pd = ibv_alloc_pd(D.ctx);
		if (EXPECT(pd && td, "alloc: %s", strerror(errno))) {
			struct ibv_parent_domain_init_attr pa = { .pd = pd, .td = td };

			parent = ibv_alloc_parent_domain(D.ctx, &pa);
			EXPECT(parent && parent != pd && parent->context == D.ctx, "ibv_alloc_parent_domain: %s",
			       strerror(errno));
			pa.comp_mask = 4;
			errno = 0;
			bad = ibv_alloc_parent_domain(D.ctx, &pa);
			EXPECT(!bad && errno == EINVAL, "unknown comp_mask bit: %p %s", (void *)bad, strerror(errno));
			pa.comp_mask = 0;
			pa.pd = parent;
			errno = 0;
			bad = parent ? ibv_alloc_parent_domain(D.ctx, &pa) : NULL;
			EXPECT(!bad && (errno == EINVAL || !parent), "a parent domain of a parent domain: %p %s",
			       (void *)bad, strerror(errno));
		}
	}
	check_end();

	check_begin("a parent domain holds its PD and thread domain: their deallocation is EBUSY until it goes");
	if (EXPECT(parent, "no parent domain")) {
		EXPECT(ibv_dealloc_pd(pd) == EBUSY, "ibv_dealloc_pd of its protection domain");
		EXPECT(ibv_dealloc_td(td) == EBUSY, "ibv_dealloc_td of its thread domain");
	}
	check_end();

	check_begin("a parent domain stands for its PD: an MR registered in it serves the PD's QPs, and holds it");
	if (parent && fx_rc(&f)) {
		struct ibv_parent_domain_init_attr pa = { .pd = D.pd };
		struct ibv_pd *dparent = ibv_alloc_parent_domain(D.ctx, &pa);

		mr = dparent ? ibv_reg_mr(dparent, buf, 4096, ACC_ALL) : NULL;
		if (EXPECT(mr && mr->pd == dparent, "reg_mr in a parent domain of D's PD: %s", strerror(errno))) {
			fill(f.ma.buf, 1000, 9);
			post_send1(f.p.a.qp, &(struct sendspec){ .id = 80, .op = IBV_WR_RDMA_WRITE, .addr = f.ma.buf,
								 .len = 1000, .lkey = f.ma.mr->lkey,
								 .raddr = (uintptr_t)buf + 8, .rkey = mr->rkey });
			if (poll1(f.p.a.scq, &wc, "the write"))
				check_wc(&wc, &(struct want){ 80, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, ANY,
							      f.p.a.qp->qp_num, ANY, ANY, ANY }, "writer");
			EXPECT(diff_at(f.ma.buf, buf + 8, 1000) < 0, "written bytes differ at %ld",
			       diff_at(f.ma.buf, buf + 8, 1000));
			EXPECT(ibv_dealloc_pd(dparent) == EBUSY, "ibv_dealloc_pd of a parent domain with an MR in it");
		}
		if (mr)
			EXPECT(ibv_dereg_mr(mr) == 0, "dereg: %s", strerror(errno));
		if (dparent)
			EXPECT(ibv_dealloc_pd(dparent) == 0, "dealloc the parent of D's PD: %s", strerror(errno));
	}
	fx_free(&f);
	check_end();

	check_begin("ibv_create_cq_ex in a parent domain; a plain PD there is EINVAL");
	if (parent) {
		struct ibv_cq_init_attr_ex ca = { .cqe = 16, .wc_flags = IBV_WC_STANDARD_FLAGS,
						  .comp_mask = IBV_CQ_INIT_ATTR_MASK_PD, .parent_domain = pd };

		errno = 0;
		cqx = ibv_create_cq_ex(D.ctx, &ca);
		EXPECT(!cqx && errno == EINVAL, "plain PD: %p %s", (void *)cqx, strerror(errno));
		if (cqx)
			ibv_destroy_cq(ibv_cq_ex_to_cq(cqx));
		ca.parent_domain = parent;
		cqx = ibv_create_cq_ex(D.ctx, &ca);
		if (EXPECT(cqx, "parent domain: %s", strerror(errno)))
			EXPECT(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) == 0, "destroy: %s", strerror(errno));
	}
	check_end();

	check_begin("deallocation in order: parent domain, then thread domain and PD");
	if (parent)
		EXPECT(ibv_dealloc_pd(parent) == 0, "parent: %s", strerror(errno));
	if (td)
		EXPECT(ibv_dealloc_td(td) == 0, "td: %s", strerror(errno));
	if (pd)
		EXPECT(ibv_dealloc_pd(pd) == 0, "pd: %s", strerror(errno));
	check_end();
	free(buf);
}

/* libibverbs exports these (marshall.h), which Debian does not ship: declared here. */
void ibv_copy_qp_attr_from_kern(struct ibv_qp_attr *dst, struct ib_uverbs_qp_attr *src);
void ibv_copy_ah_attr_from_kern(struct ibv_ah_attr *dst, struct ib_uverbs_ah_attr *src);
void ibv_copy_path_rec_from_kern(struct ibv_sa_path_rec *dst, struct ib_user_path_rec *src);
void ibv_copy_path_rec_to_kern(struct ib_user_path_rec *dst, struct ibv_sa_path_rec *src);

/* The kernel-ABI copies: every field lands where its name says. */
static void t_marshall(void)
{
	struct ib_uverbs_qp_attr kq;
	struct ibv_qp_attr q;
	struct ib_user_path_rec kp, back;
	struct ibv_sa_path_rec p;

	check_begin("ibv_copy_qp_attr_from_kern / ibv_copy_ah_attr_from_kern: field by field");
	memset(&kq, 0, sizeof(kq));
	memset(&q, 0xee, sizeof(q));
	kq.qp_state = IBV_QPS_RTS;
	kq.cur_qp_state = IBV_QPS_RTR;
	kq.path_mtu = IBV_MTU_2048;
	kq.path_mig_state = IBV_MIG_ARMED;
	kq.qkey = 0x11111111;
	kq.rq_psn = 0x222222;
	kq.sq_psn = 0x333333;
	kq.dest_qp_num = 0x444444;
	kq.qp_access_flags = IBV_ACCESS_REMOTE_READ;
	kq.ah_attr.grh.dgid[15] = 0x55;
	kq.ah_attr.grh.flow_label = 0x66666;
	kq.ah_attr.grh.sgid_index = 7;
	kq.ah_attr.grh.hop_limit = 8;
	kq.ah_attr.grh.traffic_class = 9;
	kq.ah_attr.dlid = 0x0a0a;
	kq.ah_attr.sl = 11;
	kq.ah_attr.src_path_bits = 12;
	kq.ah_attr.static_rate = 13;
	kq.ah_attr.is_global = 1;
	kq.ah_attr.port_num = 1;
	kq.alt_ah_attr.dlid = 0x0b0b;
	kq.alt_ah_attr.grh.dgid[0] = 0xfe;
	kq.max_send_wr = 14;
	kq.max_recv_wr = 15;
	kq.max_send_sge = 16;
	kq.max_recv_sge = 17;
	kq.max_inline_data = 18;
	kq.pkey_index = 19;
	kq.alt_pkey_index = 20;
	kq.en_sqd_async_notify = 1;
	kq.sq_draining = 1;
	kq.max_rd_atomic = 21;
	kq.max_dest_rd_atomic = 22;
	kq.min_rnr_timer = 23;
	kq.port_num = 1;
	kq.timeout = 24;
	kq.retry_cnt = 5;
	kq.rnr_retry = 6;
	kq.alt_port_num = 2;
	kq.alt_timeout = 25;
	ibv_copy_qp_attr_from_kern(&q, &kq);
	EXPECT(q.qp_state == IBV_QPS_RTS && q.cur_qp_state == IBV_QPS_RTR && q.path_mtu == IBV_MTU_2048 &&
		       q.path_mig_state == IBV_MIG_ARMED,
	       "states %d %d %d %d", q.qp_state, q.cur_qp_state, q.path_mtu, q.path_mig_state);
	EXPECT(q.qkey == 0x11111111 && q.rq_psn == 0x222222 && q.sq_psn == 0x333333 && q.dest_qp_num == 0x444444 &&
		       q.qp_access_flags == IBV_ACCESS_REMOTE_READ,
	       "qkey/psns/qpn/access %x %x %x %x %x", q.qkey, q.rq_psn, q.sq_psn, q.dest_qp_num, q.qp_access_flags);
	EXPECT(q.cap.max_send_wr == 14 && q.cap.max_recv_wr == 15 && q.cap.max_send_sge == 16 &&
		       q.cap.max_recv_sge == 17 && q.cap.max_inline_data == 18,
	       "cap %u %u %u %u %u", q.cap.max_send_wr, q.cap.max_recv_wr, q.cap.max_send_sge, q.cap.max_recv_sge,
	       q.cap.max_inline_data);
	EXPECT(q.ah_attr.grh.dgid.raw[15] == 0x55 && q.ah_attr.grh.flow_label == 0x66666 &&
		       q.ah_attr.grh.sgid_index == 7 && q.ah_attr.grh.hop_limit == 8 &&
		       q.ah_attr.grh.traffic_class == 9 && q.ah_attr.dlid == 0x0a0a && q.ah_attr.sl == 11 &&
		       q.ah_attr.src_path_bits == 12 && q.ah_attr.static_rate == 13 && q.ah_attr.is_global == 1 &&
		       q.ah_attr.port_num == 1,
	       "ah_attr");
	EXPECT(q.alt_ah_attr.dlid == 0x0b0b && q.alt_ah_attr.grh.dgid.raw[0] == 0xfe, "alt_ah_attr");
	EXPECT(q.pkey_index == 19 && q.alt_pkey_index == 20 && q.en_sqd_async_notify == 1 && q.sq_draining == 1 &&
		       q.max_rd_atomic == 21 && q.max_dest_rd_atomic == 22 && q.min_rnr_timer == 23 &&
		       q.port_num == 1 && q.timeout == 24 && q.retry_cnt == 5 && q.rnr_retry == 6 &&
		       q.alt_port_num == 2 && q.alt_timeout == 25,
	       "the one-byte fields");
	check_end();

	check_begin("ibv_copy_path_rec_from_kern / _to_kern: field by field, and back unchanged");
	memset(&kp, 0, sizeof(kp));
	for (int i = 0; i < 16; i++) {
		kp.dgid[i] = (uint8_t)(i + 1);
		kp.sgid[i] = (uint8_t)(0x80 + i);
	}
	kp.dlid = htons(0x1234);
	kp.slid = htons(0x5678);
	kp.raw_traffic = 1;
	kp.flow_label = htonl(0xabcde);
	kp.reversible = 1;
	kp.mtu = IBV_MTU_4096;
	kp.pkey = htons(0xffff);
	kp.hop_limit = 64;
	kp.traffic_class = 3;
	kp.numb_path = 1;
	kp.sl = 4;
	kp.mtu_selector = 2;
	kp.rate_selector = 2;
	kp.rate = 7;
	kp.packet_life_time_selector = 2;
	kp.packet_life_time = 18;
	kp.preference = 9;
	memset(&p, 0xee, sizeof(p));
	ibv_copy_path_rec_from_kern(&p, &kp);
	EXPECT(p.dgid.raw[0] == 1 && p.dgid.raw[15] == 16 && p.sgid.raw[0] == 0x80 && p.sgid.raw[15] == 0x8f,
	       "gids");
	EXPECT(ntohs(p.dlid) == 0x1234 && ntohs(p.slid) == 0x5678 && p.raw_traffic == 1 &&
		       ntohl(p.flow_label) == 0xabcde && p.reversible == 1 && p.mtu == IBV_MTU_4096 &&
		       ntohs(p.pkey) == 0xffff,
	       "lids, flow label, mtu, pkey");
	EXPECT(p.hop_limit == 64 && p.traffic_class == 3 && p.numb_path == 1 && p.sl == 4 && p.mtu_selector == 2 &&
		       p.rate_selector == 2 && p.rate == 7 && p.packet_life_time_selector == 2 &&
		       p.packet_life_time == 18 && p.preference == 9,
	       "the one-byte fields");
	memset(&back, 0xee, sizeof(back));
	ibv_copy_path_rec_to_kern(&back, &p);
	EXPECT(memcmp(&back, &kp, sizeof(kp)) == 0, "to_kern(from_kern(x)) differs from x");
	check_end();
}

struct test {
	const char *name;
	void (*fn)(void);
};

static void t_send_plain(void) { t_send(0); }
static void t_send_imm(void) { t_send(1); }
static void t_write_plain(void) { t_write(0); }
static void t_write_imm(void) { t_write(1); }

static const struct test tests[] = {
	{ "query_qp", t_qp_query },
	{ "send", t_send_plain },
	{ "send_imm", t_send_imm },
	{ "zero_len_send", t_zero_len_send },
	{ "write", t_write_plain },
	{ "write_imm", t_write_imm },
	{ "zero_len_write_imm", t_zero_len_write_imm },
	{ "read", t_read },
	{ "atomics", t_atomics },
	{ "sge", t_sge_lists },
	{ "inline", t_inline },
	{ "unsignaled", t_unsignaled },
	{ "fence", t_fence },
	{ "ordering", t_cq_ordering },
	{ "mw", t_mw },
	{ "srq", t_srq },
	{ "comm_est", t_comm_est },
	{ "async_ctx", t_async_two_contexts },
	{ "errors", t_errors },
	{ "channel", t_channel },
	{ "dm", t_dm },
	{ "import", t_import },
	{ "cq_ex", t_cq_ex },
	{ "ud", t_ud },
	{ "uc", t_uc },
	{ "mcast", t_mcast },
	{ "bad_args", t_bad_args },
	{ "mr_backing", t_mr_backing },
	{ "mr_gone", t_mr_gone },
	{ "odp", t_odp },
	{ "parent_domain", t_parent_domain },
	{ "marshall", t_marshall },
};

static void usage(const char *argv0)
{
	fprintf(stderr,
		"usage: %s [-d DEVICE] [-g GID_INDEX] [-i PORT] [-t GROUP,...] [-w WATCHDOG_S] [-l] [-q] [-v] [-f|-F]\n"
		"  -t  run only these test groups (-l lists them); the device is opened in any case\n"
		"  -q  no PASS line for opening the device (for running one group per process)\n"
		"  -w  seconds one check may take before it is failed as hung (default 60)\n"
		"  -f  fork mode: the responder runs in a child process with its own device\n"
		"  -F  fork mode, with the parent's device already open when it forks\n",
		argv0);
}

int main(int argc, char **argv)
{
	int c, fork_mode_on = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((c = getopt(argc, argv, "d:g:i:t:w:lvfFqh")) != -1) {
		switch (c) {
		case 'd': g_devname = optarg; break;
		case 'g': g_gidx = atoi(optarg); break;
		case 'i': g_port = atoi(optarg); break;
		case 't': g_filter = optarg; break;
		case 'w': g_watchdog_s = atoi(optarg); break;
		case 'v': g_verbose = 1; break;
		case 'f': fork_mode_on = 1; break;
		case 'F': fork_mode_on = 1; g_open_before_fork = 1; break;
		case 'q': g_quiet_open = 1; break;
		case 'l':
			printf("strings\n");
			for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
				printf("%s\n", tests[i].name);
			return 0;
		default:
			usage(argv[0]);
			return 2;
		}
	}
	signal(SIGALRM, on_signal);
	signal(SIGSEGV, on_signal);
	signal(SIGBUS, on_signal);
	signal(SIGABRT, on_signal);
	signal(SIGFPE, on_signal);
	signal(SIGPIPE, SIG_IGN);

	if (fork_mode_on) {
		fork_mode();
		summary_and_exit(g_fail ? 1 : 0);
	}
	if (selected("strings"))
		t_status_str();
	if (!open_device()) {
		summary_and_exit(1);
	}
	for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
		if (selected(tests[i].name))
			tests[i].fn();
	drain_async();
	if (D.pd)
		ibv_dealloc_pd(D.pd);
	if (D.ctx && ibv_close_device(D.ctx)) {
		g_check = "ibv_close_device";
		printf("FAIL: ibv_close_device (%s)\n", strerror(errno));
		g_fail++;
	}
	summary_and_exit(g_fail ? 1 : 0);
	return 0;
}
