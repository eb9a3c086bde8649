/*
 * rdmacm_test: checks of the rdma_cm functions that need no connection (rdma_event_str,
 * rdma_get_src_port / rdma_get_dst_port, rdma_getaddrinfo / rdma_freeaddrinfo,
 * rdma_get_devices / rdma_free_devices), compiled against Debian's <rdma/rdma_cma.h> and
 * linked against librdmacm (before libibverbs, so that librdmacm's definitions win).
 *
 * Prints "PASS: name" or "FAIL: name (line N: reason)" per check, and "OUT: ..." lines
 * with what the library returned. tests-ext/rdmacm/run.sh runs it on softrdma's
 * librdmacm.so.1 and on Debian's librdmacm (over softrdma's libibverbs): the checks must
 * pass on both, and the OUT lines must be the same.
 *
 *   rdmacm_test -l            list the test groups
 *   rdmacm_test -t GROUP      run one group (default: the groups both libraries share)
 *   rdmacm_test -w            print the file that provides rdma_getaddrinfo
 *
 * Groups: events ports getaddrinfo devices (shared); nodev (run with no device
 * configured), deaddev (run with a device that cannot open); softrdma (what librdmacm
 * does not define: NULL arguments, where librdmacm would crash).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/ib.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

static int failures;

#define CHECK(name, cond, ...)                                          \
	do {                                                            \
		if (cond) {                                             \
			printf("PASS: %s\n", name);                     \
		} else {                                                \
			char why_[256];                                 \
			snprintf(why_, sizeof why_, __VA_ARGS__);       \
			printf("FAIL: %s (line %d: %s)\n", name, __LINE__, why_); \
			failures++;                                     \
		}                                                       \
	} while (0)

/* ------------------------------------------------------------------ events */

static const char *const event_names[] = {
	"RDMA_CM_EVENT_ADDR_RESOLVED",    "RDMA_CM_EVENT_ADDR_ERROR",
	"RDMA_CM_EVENT_ROUTE_RESOLVED",   "RDMA_CM_EVENT_ROUTE_ERROR",
	"RDMA_CM_EVENT_CONNECT_REQUEST",  "RDMA_CM_EVENT_CONNECT_RESPONSE",
	"RDMA_CM_EVENT_CONNECT_ERROR",    "RDMA_CM_EVENT_UNREACHABLE",
	"RDMA_CM_EVENT_REJECTED",         "RDMA_CM_EVENT_ESTABLISHED",
	"RDMA_CM_EVENT_DISCONNECTED",     "RDMA_CM_EVENT_DEVICE_REMOVAL",
	"RDMA_CM_EVENT_MULTICAST_JOIN",   "RDMA_CM_EVENT_MULTICAST_ERROR",
	"RDMA_CM_EVENT_ADDR_CHANGE",      "RDMA_CM_EVENT_TIMEWAIT_EXIT",
};

static void test_events(void)
{
	char name[96];
	int i;

	for (i = 0; i <= RDMA_CM_EVENT_TIMEWAIT_EXIT; i++) {
		const char *s = rdma_event_str(i);

		snprintf(name, sizeof name, "rdma_event_str(%d) is %s", i, event_names[i]);
		CHECK(name, s && !strcmp(s, event_names[i]), "got \"%s\"", s ? s : "(null)");
		printf("OUT: rdma_event_str(%d) = %s\n", i, s ? s : "(null)");
	}
	int bad[] = { RDMA_CM_EVENT_TIMEWAIT_EXIT + 1, 100, -1 };
	for (i = 0; i < 3; i++) {
		const char *s = rdma_event_str((enum rdma_cm_event_type)bad[i]);

		snprintf(name, sizeof name, "rdma_event_str(%d) is UNKNOWN EVENT", bad[i]);
		CHECK(name, s && !strcmp(s, "UNKNOWN EVENT"), "got \"%s\"", s ? s : "(null)");
		printf("OUT: rdma_event_str(%d) = %s\n", bad[i], s ? s : "(null)");
	}
}

/* ------------------------------------------------------------------- ports */

static void test_ports(void)
{
	struct rdma_cm_id id;
	struct sockaddr_ib *sib;

	memset(&id, 0, sizeof id);
	CHECK("unbound id: src port 0", rdma_get_src_port(&id) == 0, "got %u",
	      rdma_get_src_port(&id));
	CHECK("unbound id: dst port 0", rdma_get_dst_port(&id) == 0, "got %u",
	      rdma_get_dst_port(&id));

	id.route.addr.src_sin.sin_family = AF_INET;
	id.route.addr.src_sin.sin_port = htons(7471);
	id.route.addr.dst_sin6.sin6_family = AF_INET6;
	id.route.addr.dst_sin6.sin6_port = htons(0x1234);
	CHECK("AF_INET src port in network order", rdma_get_src_port(&id) == htons(7471),
	      "got 0x%04x, want 0x%04x", rdma_get_src_port(&id), htons(7471));
	CHECK("AF_INET6 dst port in network order", rdma_get_dst_port(&id) == htons(0x1234),
	      "got 0x%04x, want 0x%04x", rdma_get_dst_port(&id), htons(0x1234));
	printf("OUT: ports inet %04x inet6 %04x\n", rdma_get_src_port(&id), rdma_get_dst_port(&id));

	/* AF_IB: the port is the low 16 bits of the service ID. */
	memset(&id, 0, sizeof id);
	sib = (struct sockaddr_ib *)&id.route.addr.src_storage;
	sib->sib_family = AF_IB;
	sib->sib_sid = htobe64(RDMA_IB_IP_PS_TCP | 0xabcd);
	CHECK("AF_IB src port from the service ID", rdma_get_src_port(&id) == htons(0xabcd),
	      "got 0x%04x, want 0x%04x", rdma_get_src_port(&id), htons(0xabcd));
	sib = (struct sockaddr_ib *)&id.route.addr.dst_storage;
	sib->sib_family = AF_IB;
	sib->sib_sid = htobe64(RDMA_IB_IP_PS_UDP | 0x0102);
	CHECK("AF_IB dst port from the service ID", rdma_get_dst_port(&id) == htons(0x0102),
	      "got 0x%04x, want 0x%04x", rdma_get_dst_port(&id), htons(0x0102));
	printf("OUT: ports ib %04x %04x\n", rdma_get_src_port(&id), rdma_get_dst_port(&id));

	/* A family the CM does not know: 0. */
	memset(&id, 0, sizeof id);
	id.route.addr.src_addr.sa_family = AF_UNIX;
	id.route.addr.src_sin.sin_port = htons(99);
	CHECK("unknown family: port 0", rdma_get_src_port(&id) == 0, "got %u",
	      rdma_get_src_port(&id));
}

/* ------------------------------------------------------------- getaddrinfo */

static void fmt_addr(char *out, size_t n, const struct sockaddr *sa, socklen_t len)
{
	char ip[INET6_ADDRSTRLEN];
	size_t i, o;

	if (!sa) {
		snprintf(out, n, "none/%u", len);
		return;
	}
	switch (sa->sa_family) {
	case AF_INET: {
		const struct sockaddr_in *s = (const void *)sa;

		inet_ntop(AF_INET, &s->sin_addr, ip, sizeof ip);
		snprintf(out, n, "inet %s:%u/%u", ip, ntohs(s->sin_port), len);
		return;
	}
	case AF_INET6: {
		const struct sockaddr_in6 *s = (const void *)sa;

		inet_ntop(AF_INET6, &s->sin6_addr, ip, sizeof ip);
		snprintf(out, n, "inet6 [%s]:%u flow %u scope %u/%u", ip, ntohs(s->sin6_port),
			 ntohl(s->sin6_flowinfo), s->sin6_scope_id, len);
		return;
	}
	default:
		o = snprintf(out, n, "family %u bytes", sa->sa_family);
		for (i = 0; i < len && o + 3 < n; i++)
			o += snprintf(out + o, n - o, "%02x", ((const uint8_t *)sa)[i]);
		snprintf(out + o, n - o, "/%u", len);
	}
}

static void dump_rai(const char *tag, int ret, int err, const struct rdma_addrinfo *r)
{
	char src[256], dst[256];

	if (ret) {
		printf("OUT: %s: ret %d%s%s\n", tag, ret, ret == -1 ? " errno " : "",
		       ret == -1 ? strerror(err) : "");
		return;
	}
	fmt_addr(src, sizeof src, r->ai_src_addr, r->ai_src_len);
	fmt_addr(dst, sizeof dst, r->ai_dst_addr, r->ai_dst_len);
	printf("OUT: %s: ret 0 flags %d family %d qp_type %d port_space 0x%x src %s dst %s "
	       "canon %s/%s route %zu connect %zu next %s\n",
	       tag, r->ai_flags, r->ai_family, r->ai_qp_type, r->ai_port_space, src, dst,
	       r->ai_src_canonname ? r->ai_src_canonname : "-",
	       r->ai_dst_canonname ? r->ai_dst_canonname : "-", r->ai_route_len,
	       r->ai_connect_len, r->ai_next ? "yes" : "no");
}

/* rdma_getaddrinfo with errno captured; dumps the result. */
static int gai(const char *tag, const char *node, const char *service,
	       const struct rdma_addrinfo *hints, struct rdma_addrinfo **res)
{
	int ret, err;

	*res = NULL;
	errno = 0;
	ret = rdma_getaddrinfo(node, service, hints, res);
	err = errno;
	dump_rai(tag, ret, err, *res);
	errno = err;
	return ret;
}

static int is_inet(const struct sockaddr *sa, socklen_t len, const char *ip, unsigned port)
{
	const struct sockaddr_in *s = (const void *)sa;
	struct in_addr want;

	inet_pton(AF_INET, ip, &want);
	return sa && len == sizeof(*s) && s->sin_family == AF_INET &&
	       s->sin_addr.s_addr == want.s_addr && ntohs(s->sin_port) == port;
}

static void test_getaddrinfo(void)
{
	struct rdma_addrinfo hints, *res;
	struct sockaddr_in sin;
	int ret;

	errno = 0;
	ret = rdma_getaddrinfo(NULL, NULL, NULL, &res);
	CHECK("no node, service or hints: -1 EINVAL", ret == -1 && errno == EINVAL,
	      "ret %d errno %d", ret, errno);

	/* Active side, no hints: getaddrinfo's first answer, a stream socket: RC over TCP's
	 * port space. */
	ret = gai("127.0.0.1 7471 no hints", "127.0.0.1", "7471", NULL, &res);
	CHECK("127.0.0.1:7471, no hints: resolves", ret == 0 && res, "ret %d", ret);
	if (!ret) {
		CHECK("no hints: AF_INET, RC, RDMA_PS_TCP, flags 0",
		      res->ai_family == AF_INET && res->ai_qp_type == IBV_QPT_RC &&
			      res->ai_port_space == RDMA_PS_TCP && res->ai_flags == 0,
		      "family %d qp %d ps 0x%x flags %d", res->ai_family, res->ai_qp_type,
		      res->ai_port_space, res->ai_flags);
		CHECK("no hints: the destination is 127.0.0.1:7471, no source",
		      is_inet(res->ai_dst_addr, res->ai_dst_len, "127.0.0.1", 7471) &&
			      !res->ai_src_addr && !res->ai_src_len,
		      "dst len %u src %p", res->ai_dst_len, (void *)res->ai_src_addr);
		CHECK("no hints: no route, connect data, names or next",
		      !res->ai_route && !res->ai_route_len && !res->ai_connect &&
			      !res->ai_connect_len && !res->ai_src_canonname &&
			      !res->ai_dst_canonname && !res->ai_next,
		      "route %zu connect %zu next %p", res->ai_route_len, res->ai_connect_len,
		      (void *)res->ai_next);
		rdma_freeaddrinfo(res);
	}

	/* Passive side: the wildcard address as the source. */
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_PASSIVE;
	hints.ai_port_space = RDMA_PS_TCP;
	ret = gai("passive 7471", NULL, "7471", &hints, &res);
	CHECK("RAI_PASSIVE, service only: resolves", ret == 0 && res, "ret %d", ret);
	if (!ret) {
		const struct sockaddr_in *s = (const void *)res->ai_src_addr;
		const struct sockaddr_in6 *s6 = (const void *)res->ai_src_addr;
		int any = s && ((s->sin_family == AF_INET && s->sin_addr.s_addr == INADDR_ANY &&
				 ntohs(s->sin_port) == 7471) ||
				(s->sin_family == AF_INET6 &&
				 IN6_IS_ADDR_UNSPECIFIED(&s6->sin6_addr) &&
				 ntohs(s6->sin6_port) == 7471));

		CHECK("RAI_PASSIVE: flags RAI_PASSIVE, RC, RDMA_PS_TCP",
		      res->ai_flags == RAI_PASSIVE && res->ai_qp_type == IBV_QPT_RC &&
			      res->ai_port_space == RDMA_PS_TCP,
		      "flags %d qp %d ps 0x%x", res->ai_flags, res->ai_qp_type, res->ai_port_space);
		CHECK("RAI_PASSIVE: the wildcard source on port 7471, no destination",
		      any && !res->ai_dst_addr && !res->ai_dst_len, "src family %d dst len %u",
		      s ? s->sin_family : -1, res->ai_dst_len);
		rdma_freeaddrinfo(res);
	}

	/* Numeric IPv6. */
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_NUMERICHOST;
	ret = gai("::1 7174 numeric", "::1", "7174", &hints, &res);
	CHECK("RAI_NUMERICHOST ::1: AF_INET6 destination", ret == 0 && res &&
	      res->ai_family == AF_INET6 && res->ai_dst_len == sizeof(struct sockaddr_in6) &&
	      ntohs(((struct sockaddr_in6 *)res->ai_dst_addr)->sin6_port) == 7174 &&
	      IN6_IS_ADDR_LOOPBACK(&((struct sockaddr_in6 *)res->ai_dst_addr)->sin6_addr),
	      "ret %d", ret);
	if (!ret)
		rdma_freeaddrinfo(res);

	/* RAI_NUMERICHOST refuses a name, with getaddrinfo's code. */
	ret = gai("localhost numeric", "localhost", "7174", &hints, &res);
	CHECK("RAI_NUMERICHOST with a name: EAI_NONAME", ret == EAI_NONAME && !res,
	      "ret %d (%s)", ret, gai_strerror(ret));

	/* An unknown service: getaddrinfo's code, passed through. */
	ret = gai("unknown service", "127.0.0.1", "no-such-service-softrdma", NULL, &res);
	CHECK("unknown service: getaddrinfo's EAI_ code", ret != 0 && ret != -1 && !res,
	      "ret %d", ret);

	/* UD: the hints' QP type and port space are kept. */
	memset(&hints, 0, sizeof hints);
	hints.ai_qp_type = IBV_QPT_UD;
	hints.ai_port_space = RDMA_PS_UDP;
	ret = gai("UD UDP", "127.0.0.1", "7174", &hints, &res);
	CHECK("UD, RDMA_PS_UDP: kept", ret == 0 && res && res->ai_qp_type == IBV_QPT_UD &&
	      res->ai_port_space == RDMA_PS_UDP &&
	      is_inet(res->ai_dst_addr, res->ai_dst_len, "127.0.0.1", 7174),
	      "ret %d", ret);
	if (!ret)
		rdma_freeaddrinfo(res);

	/* UD alone: a datagram socket type, whose protocol gives the UDP port space. */
	hints.ai_port_space = 0;
	ret = gai("UD only", "127.0.0.1", "7174", &hints, &res);
	CHECK("UD without a port space: RDMA_PS_UDP", ret == 0 && res &&
	      res->ai_qp_type == IBV_QPT_UD && res->ai_port_space == RDMA_PS_UDP,
	      "ret %d qp %d ps 0x%x", ret, res ? res->ai_qp_type : -1,
	      res ? res->ai_port_space : -1);
	if (!ret)
		rdma_freeaddrinfo(res);

	/* The UDP port space alone: the protocol gives a datagram socket: UD. */
	hints.ai_qp_type = 0;
	hints.ai_port_space = RDMA_PS_UDP;
	ret = gai("PS_UDP only", "127.0.0.1", "7174", &hints, &res);
	CHECK("RDMA_PS_UDP without a QP type: UD", ret == 0 && res &&
	      res->ai_qp_type == IBV_QPT_UD && res->ai_port_space == RDMA_PS_UDP,
	      "ret %d qp %d ps 0x%x", ret, res ? res->ai_qp_type : -1,
	      res ? res->ai_port_space : -1);
	if (!ret)
		rdma_freeaddrinfo(res);

	/* A QP type and port space that disagree: whatever getaddrinfo says of a datagram
	 * socket over TCP (compared between the libraries). */
	hints.ai_qp_type = IBV_QPT_UD;
	hints.ai_port_space = RDMA_PS_TCP;
	ret = gai("UD over PS_TCP", "127.0.0.1", "7174", &hints, &res);
	if (!ret)
		rdma_freeaddrinfo(res);

	/* A source address in the hints is copied when resolution found none. */
	memset(&hints, 0, sizeof hints);
	memset(&sin, 0, sizeof sin);
	sin.sin_family = AF_INET;
	sin.sin_port = htons(1234);
	inet_pton(AF_INET, "127.0.0.2", &sin.sin_addr);
	hints.ai_src_addr = (struct sockaddr *)&sin;
	hints.ai_src_len = sizeof sin;
	ret = gai("hinted source", "127.0.0.1", "7471", &hints, &res);
	CHECK("hints' source address copied", ret == 0 && res &&
	      res->ai_src_addr != (struct sockaddr *)&sin &&
	      is_inet(res->ai_src_addr, res->ai_src_len, "127.0.0.2", 1234) &&
	      is_inet(res->ai_dst_addr, res->ai_dst_len, "127.0.0.1", 7471),
	      "ret %d", ret);
	if (!ret)
		rdma_freeaddrinfo(res);

	/* Neither node nor service: the hints are the answer. */
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_NUMERICHOST | RAI_NOROUTE;
	hints.ai_family = AF_INET;
	hints.ai_qp_type = IBV_QPT_UC;
	hints.ai_port_space = RDMA_PS_IB;
	sin.sin_port = htons(4321);
	hints.ai_dst_addr = (struct sockaddr *)&sin;
	hints.ai_dst_len = sizeof sin;
	ret = gai("hints only", NULL, NULL, &hints, &res);
	CHECK("hints only: copied", ret == 0 && res &&
	      res->ai_flags == (RAI_NUMERICHOST | RAI_NOROUTE) && res->ai_family == AF_INET &&
	      res->ai_qp_type == IBV_QPT_UC && res->ai_port_space == RDMA_PS_IB &&
	      res->ai_dst_addr != (struct sockaddr *)&sin &&
	      is_inet(res->ai_dst_addr, res->ai_dst_len, "127.0.0.2", 4321) &&
	      !res->ai_src_addr,
	      "ret %d", ret);
	if (!ret)
		rdma_freeaddrinfo(res);

	/* AF_IB: a numeric IPv6 address read as a GID, with the service ID of the port
	 * space and port. */
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_FAMILY | RAI_NUMERICHOST;
	hints.ai_family = AF_IB;
	hints.ai_port_space = RDMA_PS_TCP;
	ret = gai("AF_IB fe80::2:3 7174", "fe80::2:3", "7174", &hints, &res);
	if (!ret && res) {
		const struct sockaddr_ib *sib = (const void *)res->ai_dst_addr;
		struct in6_addr gid;

		inet_pton(AF_INET6, "fe80::2:3", &gid);
		CHECK("AF_IB: a sockaddr_ib destination", res->ai_family == AF_IB &&
		      res->ai_dst_len == sizeof(*sib) && sib && sib->sib_family == AF_IB,
		      "family %d len %u", res->ai_family, res->ai_dst_len);
		CHECK("AF_IB: GID, P_Key 0xffff, service ID and mask",
		      !memcmp(&sib->sib_addr, &gid, 16) && sib->sib_pkey == htobe16(0xffff) &&
			      sib->sib_sid == htobe64(RDMA_IB_IP_PS_TCP | 7174) &&
			      sib->sib_sid_mask ==
				      htobe64(RDMA_IB_IP_PS_MASK | RDMA_IB_IP_PORT_MASK),
		      "pkey %04x sid %016llx mask %016llx", sib->sib_pkey,
		      (unsigned long long)be64toh(sib->sib_sid),
		      (unsigned long long)be64toh(sib->sib_sid_mask));
		rdma_freeaddrinfo(res);
	} else {
		CHECK("AF_IB: resolves", 0, "ret %d", ret);
	}

	/* AF_IB, passive, no port: the port space alone in the service ID. */
	hints.ai_flags = RAI_FAMILY | RAI_NUMERICHOST | RAI_PASSIVE;
	ret = gai("AF_IB passive ::", "::", "0", &hints, &res);
	if (!ret && res) {
		const struct sockaddr_ib *sib = (const void *)res->ai_src_addr;

		CHECK("AF_IB passive: source service ID of the port space alone",
		      res->ai_family == AF_IB && sib && sib->sib_family == AF_IB &&
			      sib->sib_sid == htobe64(RDMA_IB_IP_PS_TCP) &&
			      sib->sib_sid_mask == htobe64(RDMA_IB_IP_PS_MASK),
		      "family %d", res->ai_family);
		rdma_freeaddrinfo(res);
	} else {
		CHECK("AF_IB passive: resolves", 0, "ret %d", ret);
	}

	rdma_freeaddrinfo(NULL);
	CHECK("rdma_freeaddrinfo(NULL) returns", 1, "-");
}

/* ----------------------------------------------------------------- devices */

static void test_devices(void)
{
	struct ibv_context **l, **l2;
	struct ibv_device_attr attr;
	int n = -1, n2 = -1, i;

	errno = 0;
	l = rdma_get_devices(&n);
	CHECK("rdma_get_devices: a list", l != NULL, "NULL, errno %d", errno);
	if (!l)
		return;
	CHECK("rdma_get_devices: at least one device", n > 0, "n %d", n);
	for (i = 0; i < n; i++)
		if (!l[i])
			break;
	CHECK("rdma_get_devices: n contexts, then NULL", i == n && l[n] == NULL, "i %d n %d", i, n);
	for (i = 0; i < n; i++) {
		int r = ibv_query_device(l[i], &attr);

		CHECK("rdma_get_devices: each context answers ibv_query_device", r == 0, "ret %d", r);
		printf("OUT: device %d: %s ports %d\n", i, ibv_get_device_name(l[i]->device),
		       r ? -1 : attr.phys_port_cnt);
	}
	l2 = rdma_get_devices(&n2);
	CHECK("rdma_get_devices again: the same open contexts",
	      l2 && n2 == n && !memcmp(l, l2, (n + 1) * sizeof(*l)), "n %d n2 %d", n, n2);
	rdma_free_devices(l);
	if (l2) {
		CHECK("contexts stay open after rdma_free_devices",
		      n2 > 0 && ibv_query_device(l2[0], &attr) == 0, "query failed");
		rdma_free_devices(l2);
	}
	l = rdma_get_devices(NULL);
	CHECK("rdma_get_devices(NULL): a list", l && l[0], "NULL");
	if (l)
		rdma_free_devices(l);
}

/* No RDMA device configured: everything that needs one fails with ENODEV. */
static void test_nodev(void)
{
	struct rdma_addrinfo *res = NULL;
	struct ibv_context **l;
	int n = -1, ret;

	errno = 0;
	l = rdma_get_devices(&n);
	CHECK("no device: rdma_get_devices is NULL, ENODEV, count 0",
	      !l && errno == ENODEV && n == 0, "list %p errno %d n %d", (void *)l, errno, n);
	errno = 0;
	ret = rdma_getaddrinfo("127.0.0.1", "7471", NULL, &res);
	CHECK("no device: rdma_getaddrinfo is -1 ENODEV", ret == -1 && errno == ENODEV,
	      "ret %d errno %d", ret, errno);
	printf("OUT: nodev: list %s n %d getaddrinfo %d\n", l ? "yes" : "NULL", n, ret);
}

/* A device is listed but cannot open: rdma_get_devices leaves it out; name resolution,
 * which opens no device, works. */
static void test_deaddev(void)
{
	struct rdma_addrinfo *res = NULL;
	struct ibv_context **l;
	int n = -1, ret;

	l = rdma_get_devices(&n);
	CHECK("a device that cannot open: an empty list", l && !l[0] && n == 0,
	      "list %p n %d", (void *)l, n);
	if (l)
		rdma_free_devices(l);
	ret = rdma_getaddrinfo("127.0.0.1", "7471", NULL, &res);
	CHECK("a device that cannot open: rdma_getaddrinfo works", ret == 0 && res, "ret %d", ret);
	if (!ret)
		rdma_freeaddrinfo(res);
	printf("OUT: deaddev: list %s n %d getaddrinfo %d\n", l ? "yes" : "NULL", n, ret);
}

/* What librdmacm leaves undefined (it would crash): softrdma returns an error instead. */
static void test_softrdma(void)
{
	struct rdma_addrinfo hints;
	struct rdma_addrinfo *res = NULL;
	int ret;

	rdma_free_devices(NULL);
	CHECK("rdma_free_devices(NULL) returns", 1, "-");
	CHECK("rdma_get_src_port(NULL) is 0", rdma_get_src_port(NULL) == 0, "nonzero");
	CHECK("rdma_get_dst_port(NULL) is 0", rdma_get_dst_port(NULL) == 0, "nonzero");
	errno = 0;
	ret = rdma_getaddrinfo("127.0.0.1", "7471", NULL, NULL);
	CHECK("rdma_getaddrinfo with no result pointer: -1 EINVAL", ret == -1 && errno == EINVAL,
	      "ret %d errno %d", ret, errno);
	/* librdmacm reads an IPv4 answer as an IPv6 address for AF_IB; softrdma refuses it. */
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_FAMILY | RAI_NUMERICHOST;
	hints.ai_family = AF_IB;
	ret = rdma_getaddrinfo("127.0.0.1", "7471", &hints, &res);
	CHECK("AF_IB with an IPv4 address: EAI_ADDRFAMILY", ret == EAI_ADDRFAMILY && !res,
	      "ret %d", ret);
	/* A source address hint of nonzero length but no address. */
	memset(&hints, 0, sizeof hints);
	hints.ai_src_len = sizeof(struct sockaddr_in);
	errno = 0;
	ret = rdma_getaddrinfo("127.0.0.1", "7471", &hints, &res);
	CHECK("a source length without an address: -1 EINVAL", ret == -1 && errno == EINVAL,
	      "ret %d errno %d", ret, errno);
}

static const struct {
	const char *name;
	void (*fn)(void);
	int shared; /* run by default */
} groups[] = {
	{ "events", test_events, 1 },   { "ports", test_ports, 1 },
	{ "getaddrinfo", test_getaddrinfo, 1 }, { "devices", test_devices, 1 },
	{ "nodev", test_nodev, 0 },     { "deaddev", test_deaddev, 0 },
	{ "softrdma", test_softrdma, 0 },
};
#define NGROUPS (sizeof groups / sizeof groups[0])

int main(int argc, char **argv)
{
	const char *only = NULL;
	size_t g;
	int c;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((c = getopt(argc, argv, "lt:w")) != -1) {
		switch (c) {
		case 'l':
			for (g = 0; g < NGROUPS; g++)
				printf("%s\n", groups[g].name);
			return 0;
		case 't':
			only = optarg;
			break;
		case 'w': {
			Dl_info info;

			if (!dladdr((void *)rdma_getaddrinfo, &info) || !info.dli_fname)
				return 1;
			printf("%s\n", info.dli_fname);
			return 0;
		}
		default:
			fprintf(stderr, "usage: %s [-l] [-t GROUP] [-w]\n", argv[0]);
			return 2;
		}
	}
	for (g = 0; g < NGROUPS; g++) {
		if (only ? strcmp(only, groups[g].name) != 0 : !groups[g].shared)
			continue;
		groups[g].fn();
	}
	return failures ? 1 : 0;
}
