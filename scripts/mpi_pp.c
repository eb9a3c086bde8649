/* scripts/mpi_pp.c: an Open MPI ping-pong between ranks 0 and 1, for scripts/bench.
 *
 * Prints two lines (rank 0):
 *   RESULT lat8 <µs>    8-byte MPI_Send/MPI_Recv half round trip, median of per-turn times
 *   RESULT bw1m <GB/s>  1 MiB messages streamed 0 -> 1 (16 MPI_Isend in flight), each
 *                       window acknowledged by a 1-byte reply; the last byte of every
 *                       message is checked by the receiver
 *
 *   mpicc -O2 -o mpi_pp mpi_pp.c && mpirun -np 2 ./mpi_pp [turns] [windows]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != 2) {
    if (rank == 0) fprintf(stderr, "mpi_pp: needs 2 ranks\n");
    MPI_Finalize();
    return 2;
  }
  int turns = argc > 1 ? atoi(argv[1]) : 20000;
  int windows = argc > 2 ? atoi(argv[2]) : 100;
  if (turns < 1 || windows < 1) {
    if (rank == 0) fprintf(stderr, "mpi_pp: turns and windows must be positive\n");
    MPI_Finalize();
    return 2;
  }
  int peer = 1 - rank, bad = 0;
  char small[8] = {0};
  double *t = malloc(sizeof(double) * (size_t)turns);
  for (int i = -1000; i < turns; i++) {
    double t0 = MPI_Wtime();
    if (rank == 0) {
      small[0] = (char)i;
      MPI_Send(small, 8, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
      MPI_Recv(small, 8, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      bad |= small[0] != (char)(i + 1);
    } else {
      MPI_Recv(small, 8, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      small[0]++;
      MPI_Send(small, 8, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
    }
    if (i >= 0) t[i] = (MPI_Wtime() - t0) * 1e6 / 2;
  }
  enum { WIN = 16, SZ = 1 << 20 };
  char *buf = malloc((size_t)WIN * SZ);
  memset(buf, 0, (size_t)WIN * SZ);
  MPI_Request req[WIN];
  char ack = 0;
  double b0 = 0;
  for (int w = -2; w < windows; w++) {
    if (w == 0) {
      MPI_Barrier(MPI_COMM_WORLD);
      b0 = MPI_Wtime();
    }
    for (int k = 0; k < WIN; k++) {
      char *m = buf + (size_t)k * SZ;
      if (rank == 0) {
        m[SZ - 1] = (char)(w * WIN + k);
        MPI_Isend(m, SZ, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &req[k]);
      } else {
        MPI_Irecv(m, SZ, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &req[k]);
      }
    }
    MPI_Waitall(WIN, req, MPI_STATUSES_IGNORE);
    if (rank == 0) {
      MPI_Recv(&ack, 1, MPI_BYTE, peer, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
      for (int k = 0; k < WIN; k++) bad |= buf[(size_t)k * SZ + SZ - 1] != (char)(w * WIN + k);
      MPI_Send(&ack, 1, MPI_BYTE, peer, 3, MPI_COMM_WORLD);
    }
  }
  double secs = MPI_Wtime() - b0;
  int any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
  if (rank == 0) {
    qsort(t, (size_t)turns, sizeof(double), cmp);
    if (any) {
      printf("mpi_pp: data mismatch\n");
    } else {
      printf("RESULT lat8 %.3f\n", t[turns / 2]);
      printf("RESULT bw1m %.3f\n", (double)windows * WIN * SZ / secs / 1e9);
    }
  }
  free(buf);
  free(t);
  MPI_Finalize();
  return any ? 1 : 0;
}
