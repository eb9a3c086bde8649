/* tests-ext/middleware/mpi_test.c: checks the data Open MPI moves between ranks, for
 * tests-ext/middleware/run.sh (which runs it with mpirun over softrdma).
 *
 *   point-to-point: MPI_Send/MPI_Recv and MPI_Isend/MPI_Irecv (several messages in flight
 *     in both directions at once), 1 B to 4 MiB, so that eager, bcopy and rendezvous (RDMA
 *     read/write zero-copy) protocols all carry data;
 *   one-sided: MPI_Put and MPI_Get with fences, and with MPI_Win_lock/MPI_Win_unlock
 *     (passive target), 8 B to 4 MiB, each checked in the target window's own bytes;
 *     MPI_Accumulate(MPI_SUM) and MPI_Fetch_and_op on ints;
 *   collectives: MPI_Bcast from every root, MPI_Reduce, MPI_Allreduce, MPI_Allgather,
 *     MPI_Alltoall, MPI_Barrier, small to a few MiB.
 *
 * Every rank checks every byte it receives against the pattern the sender wrote (a
 * function of the check, the sender and the offset, so a misplaced or stale block shows).
 * After each check the ranks agree on the error count (MPI_Allreduce) and rank 0 prints
 * "PASS: NAME" or "FAIL: NAME (N errors)"; a rank that sees a mismatch prints the first
 * few with their offsets. Exits 1 if any check failed on any rank, 0 otherwise; the
 * last line is "mpi_test: N checks passed, M failed".
 *
 *   mpicc -O2 -o mpi_test mpi_test.c && mpirun -np 2 ./mpi_test
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nprocs;
static int checks_passed, checks_failed;

/* The byte a sender (rank `src`) writes at `off` for check `tag`: not periodic at any power
 * of two below 2^24, so a block landing at the wrong offset is seen. */
static uint8_t pat(uint32_t tag, uint32_t src, size_t off) {
  uint64_t x = (uint64_t)off * 0x9E3779B1u + (uint64_t)tag * 0x85EBCA77u + (uint64_t)src * 0xC2B2AE3Du;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return (uint8_t)(x ^ (off >> 16));
}

static void fill(uint8_t *buf, size_t len, uint32_t tag, uint32_t src) {
  for (size_t i = 0; i < len; i++) buf[i] = pat(tag, src, i);
}

/* Counts the bytes of buf that differ from what rank `src` wrote for `tag`; prints the
 * first few. */
static long verify(const char *what, const uint8_t *buf, size_t len, uint32_t tag, uint32_t src) {
  long bad = 0;
  for (size_t i = 0; i < len; i++) {
    uint8_t want = pat(tag, src, i);
    if (buf[i] != want) {
      if (bad < 4)
        fprintf(stderr, "rank %d: %s: byte %zu of %zu is 0x%02x, want 0x%02x (from rank %u)\n", rank, what, i, len,
                buf[i], want, src);
      bad++;
    }
  }
  if (bad > 4) fprintf(stderr, "rank %d: %s: %ld bytes wrong in all\n", rank, what, bad);
  return bad;
}

/* Ends a check: every rank contributes its error count, rank 0 prints the verdict. */
static void report(const char *name, long errs) {
  long total = 0;
  MPI_Allreduce(&errs, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (total == 0) {
    checks_passed++;
    if (rank == 0) printf("PASS: %s\n", name);
  } else {
    checks_failed++;
    if (rank == 0) printf("FAIL: %s (%ld errors)\n", name, total);
  }
  fflush(stdout);
}

static const size_t sizes[] = {1, 8, 100, 1024, 8192, 65536, 262144, 1 << 20, 4 << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))
#define MAXSZ ((size_t)4 << 20)

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "rank %d: out of memory (%zu B)\n", rank, n);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return p;
}

/* Blocking: every rank sends to the next one and receives from the previous one (even
 * ranks send first, odd ones receive first, so it works with blocking rendezvous). */
static void p2p_blocking(uint8_t *sbuf, uint8_t *rbuf) {
  int next = (rank + 1) % nprocs, prev = (rank + nprocs - 1) % nprocs;
  for (size_t s = 0; s < NSIZES; s++) {
    size_t len = sizes[s];
    uint32_t tag = 100 + (uint32_t)s;
    char name[96];
    long errs = 0;
    fill(sbuf, len, tag, (uint32_t)rank);
    memset(rbuf, 0, len);
    MPI_Status st;
    if (rank % 2 == 0) {
      MPI_Send(sbuf, (int)len, MPI_BYTE, next, (int)tag, MPI_COMM_WORLD);
      MPI_Recv(rbuf, (int)len, MPI_BYTE, prev, (int)tag, MPI_COMM_WORLD, &st);
    } else {
      MPI_Recv(rbuf, (int)len, MPI_BYTE, prev, (int)tag, MPI_COMM_WORLD, &st);
      MPI_Send(sbuf, (int)len, MPI_BYTE, next, (int)tag, MPI_COMM_WORLD);
    }
    int count;
    MPI_Get_count(&st, MPI_BYTE, &count);
    if ((size_t)count != len || st.MPI_SOURCE != prev || st.MPI_TAG != (int)tag) {
      fprintf(stderr, "rank %d: recv status count %d source %d tag %d, want %zu %d %u\n", rank, count, st.MPI_SOURCE,
              st.MPI_TAG, len, prev, tag);
      errs++;
    }
    snprintf(name, sizeof name, "MPI_Send/MPI_Recv %zu B", len);
    errs += verify(name, rbuf, len, tag, (uint32_t)prev);
    report(name, errs);
  }
}

/* Non-blocking: every rank posts receives from every other rank first, then its sends,
 * several messages per pair in flight, each with its own tag and pattern. */
#define INFLIGHT 4
static void p2p_nonblocking(void) {
  int npeers = nprocs - 1 > 0 ? nprocs - 1 : 1;
  for (size_t s = 0; s < NSIZES; s++) {
    size_t len = sizes[s];
    /* 4 MiB x 4 x peers x 2 is fine for two ranks; keep the total bounded for more. */
    int inflight = len >= (1 << 20) ? 2 : INFLIGHT;
    size_t nbuf = (size_t)npeers * (size_t)inflight;
    uint8_t *sb = xmalloc(nbuf * len), *rb = xmalloc(nbuf * len);
    MPI_Request *req = xmalloc(2 * nbuf * sizeof(MPI_Request));
    int nreq = 0, k = 0;
    long errs = 0;
    memset(rb, 0, nbuf * len);
    for (int p = 0; p < nprocs; p++) {
      if (p == rank && nprocs > 1) continue;
      for (int m = 0; m < inflight; m++, k++)
        MPI_Irecv(rb + (size_t)k * len, (int)len, MPI_BYTE, p, 200 + m, MPI_COMM_WORLD, &req[nreq++]);
    }
    k = 0;
    for (int p = 0; p < nprocs; p++) {
      if (p == rank && nprocs > 1) continue;
      for (int m = 0; m < inflight; m++, k++) {
        uint8_t *b = sb + (size_t)k * len;
        /* The pattern names the receiver too, so a message delivered to the wrong rank shows. */
        fill(b, len, (uint32_t)(1000 * (s + 1) + 10 * (size_t)m + (size_t)p), (uint32_t)rank);
        MPI_Isend(b, (int)len, MPI_BYTE, p, 200 + m, MPI_COMM_WORLD, &req[nreq++]);
      }
    }
    MPI_Waitall(nreq, req, MPI_STATUSES_IGNORE);
    char name[96];
    snprintf(name, sizeof name, "MPI_Isend/MPI_Irecv %zu B x %d in flight", len, inflight);
    k = 0;
    for (int p = 0; p < nprocs; p++) {
      if (p == rank && nprocs > 1) continue;
      for (int m = 0; m < inflight; m++, k++)
        errs += verify(name, rb + (size_t)k * len, len, (uint32_t)(1000 * (s + 1) + 10 * (size_t)m + (size_t)rank),
                       (uint32_t)p);
    }
    report(name, errs);
    free(sb);
    free(rb);
    free(req);
  }
}

/* One-sided. Every rank exposes a window of MAXSZ bytes; the target of rank r is r+1. */
static void one_sided(uint8_t *origin) {
  int target = (rank + 1) % nprocs, source = (rank + nprocs - 1) % nprocs;
  uint8_t *base;
  MPI_Win win;
  MPI_Win_allocate((MPI_Aint)MAXSZ, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);

  static const size_t osizes[] = {8, 1024, 65536, 1 << 20, 4 << 20};
  for (size_t s = 0; s < sizeof osizes / sizeof osizes[0]; s++) {
    size_t len = osizes[s];
    /* An offset into the window that is not a multiple of anything convenient. */
    size_t off = len < MAXSZ ? (MAXSZ - len) / 3 : 0;
    char name[96];
    long errs;

    /* MPI_Put, fence: the source's bytes land at off in this rank's window. */
    uint32_t tag = 300 + (uint32_t)s;
    memset(base, 0, MAXSZ);
    fill(origin, len, tag, (uint32_t)rank);
    MPI_Win_fence(0, win);
    MPI_Put(origin, (int)len, MPI_BYTE, target, (MPI_Aint)off, (int)len, MPI_BYTE, win);
    MPI_Win_fence(0, win);
    snprintf(name, sizeof name, "MPI_Put (fence) %zu B", len);
    errs = verify(name, base + off, len, tag, (uint32_t)source);
    /* and nothing around it */
    for (size_t i = 0; i < off; i++) errs += base[i] != 0;
    for (size_t i = off + len; i < MAXSZ; i++) errs += base[i] != 0;
    report(name, errs);

    /* MPI_Get, fence: read the target's window, which the target filled itself. */
    tag = 400 + (uint32_t)s;
    fill(base + off, len, tag, (uint32_t)rank);
    memset(origin, 0, len);
    MPI_Win_fence(0, win);
    MPI_Get(origin, (int)len, MPI_BYTE, target, (MPI_Aint)off, (int)len, MPI_BYTE, win);
    MPI_Win_fence(0, win);
    snprintf(name, sizeof name, "MPI_Get (fence) %zu B", len);
    report(name, verify(name, origin, len, tag, (uint32_t)target));

    /* Passive target: MPI_Put under an exclusive lock, then MPI_Get of what is there
     * under a shared one; the target checks its window after a barrier. */
    tag = 500 + (uint32_t)s;
    MPI_Win_lock(MPI_LOCK_EXCLUSIVE, rank, 0, win);
    memset(base, 0, MAXSZ);
    MPI_Win_unlock(rank, win);
    MPI_Barrier(MPI_COMM_WORLD);
    fill(origin, len, tag, (uint32_t)rank);
    MPI_Win_lock(MPI_LOCK_EXCLUSIVE, target, 0, win);
    MPI_Put(origin, (int)len, MPI_BYTE, target, (MPI_Aint)off, (int)len, MPI_BYTE, win);
    MPI_Win_unlock(target, win);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Win_lock(MPI_LOCK_EXCLUSIVE, rank, 0, win); /* synchronises the public and private copies */
    snprintf(name, sizeof name, "MPI_Put (lock/unlock) %zu B", len);
    errs = verify(name, base + off, len, tag, (uint32_t)source);
    MPI_Win_unlock(rank, win);
    uint8_t *back = xmalloc(len);
    memset(back, 0, len);
    MPI_Win_lock(MPI_LOCK_SHARED, target, 0, win);
    MPI_Get(back, (int)len, MPI_BYTE, target, (MPI_Aint)off, (int)len, MPI_BYTE, win);
    MPI_Win_unlock(target, win);
    errs += verify("MPI_Get (lock/unlock) of the put", back, len, tag, (uint32_t)rank);
    free(back);
    report(name, errs);
    MPI_Barrier(MPI_COMM_WORLD);
  }

  /* MPI_Accumulate(MPI_SUM) from every rank into one int array at rank 0, and
   * MPI_Fetch_and_op: each rank adds rank+1 to a counter at rank 0 many times. */
  {
    const int n = 4096, reps = 50;
    int32_t *acc = (int32_t *)(void *)base, *src = xmalloc(n * sizeof(int32_t));
    long errs = 0;
    MPI_Win_lock(MPI_LOCK_EXCLUSIVE, rank, 0, win);
    memset(base, 0, (size_t)(n + 1) * sizeof(int32_t));
    MPI_Win_unlock(rank, win);
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < n; i++) src[i] = (i % 1000) * (rank + 1) + 1;
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
    MPI_Accumulate(src, n, MPI_INT32_T, 0, 0, n, MPI_INT32_T, MPI_SUM, win);
    MPI_Win_unlock(0, win);
    int32_t one = rank + 1, old;
    for (int r = 0; r < reps; r++) {
      MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
      MPI_Fetch_and_op(&one, &old, MPI_INT32_T, 0, (MPI_Aint)(n * sizeof(int32_t)), MPI_SUM, win);
      MPI_Win_unlock(0, win);
      if (old < 0 || old > reps * nprocs * (nprocs + 1) / 2) errs++;
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
      MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 0, 0, win);
      int32_t ranksum = nprocs * (nprocs + 1) / 2;
      for (int i = 0; i < n; i++) {
        int32_t want = (i % 1000) * ranksum + nprocs;
        if (acc[i] != want) {
          if (errs < 4) fprintf(stderr, "rank 0: MPI_Accumulate: int %d is %d, want %d\n", i, acc[i], want);
          errs++;
        }
      }
      if (acc[n] != reps * ranksum) {
        fprintf(stderr, "rank 0: MPI_Fetch_and_op: counter is %d, want %d\n", acc[n], reps * ranksum);
        errs++;
      }
      MPI_Win_unlock(0, win);
    }
    free(src);
    report("MPI_Accumulate(MPI_SUM) and MPI_Fetch_and_op (lock/unlock)", errs);
  }
  MPI_Win_free(&win);
}

static void collectives(uint8_t *buf) {
  static const size_t csizes[] = {8, 4096, 262144, 4 << 20};
  char name[96];
  for (size_t s = 0; s < sizeof csizes / sizeof csizes[0]; s++) {
    size_t len = csizes[s];
    for (int root = 0; root < nprocs; root++) {
      uint32_t tag = 600 + 10 * (uint32_t)s;
      if (rank == root)
        fill(buf, len, tag, (uint32_t)root);
      else
        memset(buf, 0, len);
      MPI_Bcast(buf, (int)len, MPI_BYTE, root, MPI_COMM_WORLD);
      snprintf(name, sizeof name, "MPI_Bcast %zu B from rank %d", len, root);
      report(name, verify(name, buf, len, tag, (uint32_t)root));
    }
  }

  /* Reduce and Allreduce of int64 sums: element i of rank r is f(i, r); sums are exact. */
  static const size_t counts[] = {1, 1000, 1 << 17, 1 << 19};
  for (size_t s = 0; s < sizeof counts / sizeof counts[0]; s++) {
    size_t n = counts[s];
    int64_t *in = xmalloc(n * 8), *out = xmalloc(n * 8);
    for (size_t i = 0; i < n; i++) in[i] = (int64_t)(i * 2654435761u % 1000003) * (rank + 1) + rank;
    int64_t wsum = (int64_t)nprocs * (nprocs + 1) / 2, rsum = (int64_t)nprocs * (nprocs - 1) / 2;
    for (int all = 0; all < 2; all++) {
      long errs = 0;
      memset(out, 0xAB, n * 8);
      if (all)
        MPI_Allreduce(in, out, (int)n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      else
        MPI_Reduce(in, out, (int)n, MPI_INT64_T, MPI_SUM, nprocs - 1, MPI_COMM_WORLD);
      snprintf(name, sizeof name, "%s(MPI_SUM) %zu x int64", all ? "MPI_Allreduce" : "MPI_Reduce", n);
      if (all || rank == nprocs - 1)
        for (size_t i = 0; i < n; i++) {
          int64_t want = (int64_t)(i * 2654435761u % 1000003) * wsum + rsum;
          if (out[i] != want) {
            if (errs < 4) fprintf(stderr, "rank %d: %s: element %zu is %lld, want %lld\n", rank, name, i,
                                  (long long)out[i], (long long)want);
            errs++;
          }
        }
      report(name, errs);
    }
    free(in);
    free(out);
  }

  /* Allgather and Alltoall: block p of the result is what rank p wrote for this rank. */
  static const size_t bsizes[] = {8, 4096, 262144, 2 << 20};
  for (size_t s = 0; s < sizeof bsizes / sizeof bsizes[0]; s++) {
    size_t len = bsizes[s];
    uint8_t *sb = xmalloc(len * (size_t)nprocs), *rb = xmalloc(len * (size_t)nprocs);
    long errs = 0;
    uint32_t tag = 700 + (uint32_t)s;
    fill(sb, len, tag, (uint32_t)rank);
    memset(rb, 0, len * (size_t)nprocs);
    MPI_Allgather(sb, (int)len, MPI_BYTE, rb, (int)len, MPI_BYTE, MPI_COMM_WORLD);
    snprintf(name, sizeof name, "MPI_Allgather %zu B per rank", len);
    for (int p = 0; p < nprocs; p++) errs += verify(name, rb + (size_t)p * len, len, tag, (uint32_t)p);
    report(name, errs);

    errs = 0;
    for (int p = 0; p < nprocs; p++) fill(sb + (size_t)p * len, len, 800 + 10 * (uint32_t)s + (uint32_t)p, (uint32_t)rank);
    memset(rb, 0, len * (size_t)nprocs);
    MPI_Alltoall(sb, (int)len, MPI_BYTE, rb, (int)len, MPI_BYTE, MPI_COMM_WORLD);
    snprintf(name, sizeof name, "MPI_Alltoall %zu B per rank", len);
    for (int p = 0; p < nprocs; p++)
      errs += verify(name, rb + (size_t)p * len, len, 800 + 10 * (uint32_t)s + (uint32_t)rank, (uint32_t)p);
    report(name, errs);
    free(sb);
    free(rb);
  }

  /* Barriers with traffic around them: each rank sends a token to every rank before ten
   * barriers, and every token must arrive intact after them. */
  {
    long errs = 0;
    int token = rank * 7 + 1, flag = 0;
    int *got = xmalloc((size_t)nprocs * sizeof(int));
    MPI_Request *rq = xmalloc((size_t)nprocs * 2 * sizeof(MPI_Request));
    int nr = 0;
    for (int p = 0; p < nprocs; p++) {
      got[p] = -1;
      MPI_Irecv(&got[p], 1, MPI_INT, p, 900, MPI_COMM_WORLD, &rq[nr++]);
    }
    for (int p = 0; p < nprocs; p++) MPI_Send(&token, 1, MPI_INT, p, 900, MPI_COMM_WORLD);
    for (int i = 0; i < 10; i++) MPI_Barrier(MPI_COMM_WORLD);
    MPI_Testall(nr, rq, &flag, MPI_STATUSES_IGNORE);
    if (!flag) MPI_Waitall(nr, rq, MPI_STATUSES_IGNORE);
    for (int p = 0; p < nprocs; p++)
      if (got[p] != p * 7 + 1) {
        fprintf(stderr, "rank %d: token from rank %d is %d, want %d\n", rank, p, got[p], p * 7 + 1);
        errs++;
      }
    free(got);
    free(rq);
    report("MPI_Barrier x 10 (with messages around it)", errs);
  }
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nprocs);
  if (rank == 0) {
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int n;
    MPI_Get_library_version(lib, &n);
    printf("mpi_test: %d ranks, %.*s\n", nprocs, (int)strcspn(lib, "\n"), lib);
    fflush(stdout);
  }
  const char *only = getenv("MPI_TEST_ONLY"); /* p2p, rma, coll: a subset, for debugging */
  uint8_t *a = xmalloc(MAXSZ), *b = xmalloc(MAXSZ);
  if (!only || strstr(only, "p2p")) {
    p2p_blocking(a, b);
    p2p_nonblocking();
  }
  if (!only || strstr(only, "rma")) one_sided(a);
  if (!only || strstr(only, "coll")) collectives(a);
  free(a);
  free(b);
  if (rank == 0) printf("mpi_test: %d checks passed, %d failed\n", checks_passed, checks_failed);
  fflush(stdout);
  MPI_Finalize();
  return checks_failed ? 1 : 0;
}
