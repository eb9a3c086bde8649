/* tests-ext/ibverbs/provider_test.c: softrdma's stand-ins for Debian's provider libraries
 * (libmlx5.so.1, libefa.so.1, libmlx4.so.1, libmana.so.1), called as a program built
 * against Debian's headers and libraries calls them, run under `softrdma run --`.
 *
 * Each stand-in must load in place of Debian's library, claim no device and answer
 * every call with the documented "not supported" result: EOPNOTSUPP returned (the
 * errno-value APIs), NULL with errno EOPNOTSUPP (constructors), -1 with errno or
 * -EOPNOTSUPP where the manual page says so, false from mlx5dv_is_supported.
 *
 *   gcc -Wall -Werror -o provider_test provider_test.c -lmlx5 -lefa -lmlx4 -lmana -libverbs -ldl
 *   softrdma run -- ./provider_test [-d DEVICE]
 *
 * One "PASS: name" or "FAIL: name (line N: reason)" line per check; exit 1 on a failure.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/efadv.h>
#include <infiniband/manadv.h>
#include <infiniband/mlx4dv.h>
#include <infiniband/mlx5dv.h>
#include <infiniband/verbs.h>

/* mlx5dv_init_obj as programs linked before MLX5_1.2 bind it. */
int mlx5dv_init_obj_1_0(struct mlx5dv_obj *obj, uint64_t obj_type);
__asm__(".symver mlx5dv_init_obj_1_0, mlx5dv_init_obj@MLX5_1.0");

static int failures;

#define CHECK(name, cond, ...)                                                   \
  do {                                                                           \
    if (cond) {                                                                  \
      printf("PASS: %s\n", name);                                                \
    } else {                                                                     \
      printf("FAIL: %s (line %d: ", name, __LINE__);                             \
      printf(__VA_ARGS__);                                                       \
      printf(")\n");                                                             \
      failures++;                                                                \
    }                                                                            \
    fflush(stdout);                                                              \
  } while (0)

/* An int call that must return EOPNOTSUPP. */
#define EXPECT_EOPNOTSUPP(name, call)                                            \
  do {                                                                           \
    int r_ = (call);                                                             \
    CHECK(name, r_ == EOPNOTSUPP, "returned %d, want EOPNOTSUPP (%d)", r_,       \
          EOPNOTSUPP);                                                           \
  } while (0)

/* A pointer call that must return NULL with errno EOPNOTSUPP. */
#define EXPECT_NULL(name, call)                                                  \
  do {                                                                           \
    errno = 0;                                                                   \
    void *p_ = (void *)(call);                                                   \
    int e_ = errno;                                                              \
    CHECK(name, p_ == NULL && e_ == EOPNOTSUPP, "returned %p, errno %d (%s)",    \
          p_, e_, strerror(e_));                                                 \
  } while (0)

/* Which file a function was loaded from: the stand-in, not Debian's library. */
static void check_origin(const char *name, void *fn) {
  Dl_info info;
  char what[128];
  snprintf(what, sizeof what, "%s comes from softrdma's stand-in", name);
  if (!dladdr(fn, &info) || !info.dli_fname) {
    CHECK(what, 0, "dladdr failed");
    return;
  }
  char real[4096];
  const char *path = realpath(info.dli_fname, real) ? real : info.dli_fname;
  CHECK(what, strstr(path, "/usr/lib") != path && strstr(path, "/lib/") != path,
        "loaded from %s", path);
}

int main(int argc, char **argv) {
  const char *want = "softrdma0";
  int opt;
  while ((opt = getopt(argc, argv, "d:")) != -1) {
    if (opt == 'd')
      want = optarg;
    else {
      fprintf(stderr, "usage: %s [-d DEVICE]\n", argv[0]);
      return 2;
    }
  }

  check_origin("mlx5dv_is_supported", (void *)mlx5dv_is_supported);
  check_origin("efadv_query_device", (void *)efadv_query_device);
  check_origin("mlx4dv_query_device", (void *)mlx4dv_query_device);
  check_origin("manadv_init_obj", (void *)manadv_init_obj);

  int n = 0;
  struct ibv_device **list = ibv_get_device_list(&n);
  struct ibv_device *dev = NULL;
  for (int i = 0; list && i < n; i++)
    if (!strcmp(ibv_get_device_name(list[i]), want))
      dev = list[i];
  CHECK("softrdma's device is listed", dev != NULL, "no %s among %d devices", want, n);
  if (!dev) {
    ibv_free_device_list(list);
    return 1;
  }
  struct ibv_context *ctx = ibv_open_device(dev);
  CHECK("ibv_open_device", ctx != NULL, "errno %d", errno);
  if (!ctx) {
    ibv_free_device_list(list);
    return 1;
  }

  /* mlx5 */
  CHECK("mlx5dv_is_supported is false", !mlx5dv_is_supported(dev), "returned true");
  struct mlx5dv_context mattr = {0};
  EXPECT_EOPNOTSUPP("mlx5dv_query_device", mlx5dv_query_device(ctx, &mattr));
  struct mlx5dv_context_attr oattr = {.flags = MLX5DV_CONTEXT_FLAGS_DEVX};
  EXPECT_NULL("mlx5dv_open_device", mlx5dv_open_device(dev, &oattr));
  struct ibv_cq_init_attr_ex cattr = {.cqe = 16};
  EXPECT_NULL("mlx5dv_create_cq", mlx5dv_create_cq(ctx, &cattr, NULL));
  uint32_t in[4] = {0}, out[4] = {0};
  EXPECT_EOPNOTSUPP("mlx5dv_devx_general_cmd",
                    mlx5dv_devx_general_cmd(ctx, in, sizeof in, out, sizeof out));
  struct mlx5dv_obj obj = {0};
  EXPECT_EOPNOTSUPP("mlx5dv_init_obj", mlx5dv_init_obj(&obj, MLX5DV_OBJ_CQ));
  EXPECT_EOPNOTSUPP("mlx5dv_init_obj@MLX5_1.0", mlx5dv_init_obj_1_0(&obj, MLX5DV_OBJ_CQ));
  uint32_t qpn = 0;
  EXPECT_EOPNOTSUPP("mlx5dv_reserved_qpn_alloc", mlx5dv_reserved_qpn_alloc(ctx, &qpn));
  EXPECT_NULL("mlx5dv_dr_domain_create",
              mlx5dv_dr_domain_create(ctx, MLX5DV_DR_DOMAIN_TYPE_NIC_RX));
  errno = 0;
  ssize_t got = mlx5dv_devx_get_event(NULL, NULL, 0);
  int e = errno;
  CHECK("mlx5dv_devx_get_event", got == -1 && e == EOPNOTSUPP,
        "returned %zd, errno %d", got, e);
  int canceled = mlx5dv_qp_cancel_posted_send_wrs(NULL, 1);
  CHECK("mlx5dv_qp_cancel_posted_send_wrs", canceled == -EOPNOTSUPP, "returned %d",
        canceled);
  mlx5dv_devx_free_uar(NULL); /* void: does nothing */
  CHECK("mlx5dv_devx_free_uar(NULL) returns", 1, "%s", "unreachable");

  /* efa */
  struct efadv_device_attr eattr = {0};
  EXPECT_EOPNOTSUPP("efadv_query_device", efadv_query_device(ctx, &eattr, sizeof eattr));
  struct efadv_cq_init_attr ecattr = {0};
  EXPECT_NULL("efadv_create_cq", efadv_create_cq(ctx, &cattr, &ecattr, sizeof ecattr));
  EXPECT_NULL("efadv_cq_from_ibv_cq_ex", efadv_cq_from_ibv_cq_ex(NULL));

  /* mlx4 and mana */
  struct mlx4dv_context m4attr = {0};
  EXPECT_EOPNOTSUPP("mlx4dv_query_device", mlx4dv_query_device(ctx, &m4attr));
  struct manadv_obj mobj = {0};
  EXPECT_EOPNOTSUPP("manadv_init_obj", manadv_init_obj(&mobj, MANADV_OBJ_QP));

  /* None of that disturbed the device: plain verbs still work on it. */
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  CHECK("ibv_alloc_pd after the provider calls", pd != NULL, "errno %d", errno);
  if (pd)
    ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  return failures ? 1 : 0;
}
