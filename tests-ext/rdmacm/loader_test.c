/*
 * loader_test: one process gets one softrdma library whichever name it loads.
 *
 * Linked against Debian's librdmacm and libibverbs (in either order: run.sh builds it
 * both ways, with BIND_NOW), it calls one function of each, then checks that
 * dlopen("librdmacm.so.1") and dlopen("libibverbs.so.1") are the object already loaded,
 * that rdma_event_str@RDMACM_1.0 and ibv_get_device_list@IBVERBS_1.1 come from that one
 * file, and that the program's own references bound there. Built with -DDLOPEN_ONLY it
 * links neither library and finds librdmacm.so.1 with dlopen alone.
 *
 * Prints "PASS: name" / "FAIL: name (reason)" lines; exit status 1 on a failure.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#ifndef DLOPEN_ONLY
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#endif

static int failures;

static void check(const char *name, int ok, const char *why)
{
	if (ok) {
		printf("PASS: %s\n", name);
	} else {
		printf("FAIL: %s (%s)\n", name, why);
		failures++;
	}
}

static const char *file_of(void *p)
{
	Dl_info i;

	return p && dladdr(p, &i) && i.dli_fname ? i.dli_fname : "?";
}

int main(void)
{
	char why[512];

#ifndef DLOPEN_ONLY
	int n = -1;
	struct ibv_device **l = ibv_get_device_list(&n);

	check("ibv_get_device_list lists a device", l && n > 0, "no device");
	if (l)
		ibv_free_device_list(l);
	check("rdma_event_str answers",
	      !strcmp(rdma_event_str(RDMA_CM_EVENT_ESTABLISHED), "RDMA_CM_EVENT_ESTABLISHED"),
	      rdma_event_str(RDMA_CM_EVENT_ESTABLISHED));
	snprintf(why, sizeof why, "rdma_event_str in %s, ibv_get_device_list in %s",
		 file_of((void *)rdma_event_str), file_of((void *)ibv_get_device_list));
	{
		Dl_info a, b;

		check("the program's rdma_* and ibv_* references bind in one object",
		      dladdr((void *)rdma_event_str, &a) && dladdr((void *)ibv_get_device_list, &b) &&
			      a.dli_fbase == b.dli_fbase,
		      why);
	}
#endif
	void *cm = dlopen("librdmacm.so.1", RTLD_NOW);
	void *verbs = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);

	snprintf(why, sizeof why, "librdmacm.so.1 %p (%s), libibverbs.so.1 %p", cm,
		 cm ? "ok" : dlerror(), verbs);
	check("dlopen: librdmacm.so.1 and libibverbs.so.1 are one loaded object",
	      cm && cm == verbs, why);
	void *str = cm ? dlvsym(cm, "rdma_event_str", "RDMACM_1.0") : NULL;
	void *gdl = cm ? dlvsym(cm, "ibv_get_device_list", "IBVERBS_1.1") : NULL;

	snprintf(why, sizeof why, "rdma_event_str@RDMACM_1.0 %p, ibv_get_device_list@IBVERBS_1.1 %p",
		 str, gdl);
	check("dlvsym: both version families in that object", str && gdl, why);
#ifndef DLOPEN_ONLY
	check("dlvsym finds the function the program calls", str == (void *)rdma_event_str, why);
#endif
	printf("loader_test: rdma_event_str from %s\n", file_of(str));
	return failures ? 1 : 0;
}
