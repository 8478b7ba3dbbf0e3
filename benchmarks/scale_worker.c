/* The Open MPI peer of examples/scale_worker.rs for benchmarks/scale_many.py: a rank without
 * Python that times loops of 4-byte and 64 KiB float32 sum allreduces (MPI_Allreduce in place)
 * and has rank 0 print one line, SCALE_RESULT {json}, with the slowest rank's figures: start-up
 * (MPI_Init), microseconds per op, file descriptors, threads and resident memory.
 *
 * Build: mpicc.openmpi -O2 -o scale_worker_mpi scale_worker.c
 * Usage: mpirun -np N scale_worker_mpi [ITERS] */
#include <dirent.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double count(const char *dir) {
    DIR *d = opendir(dir);
    double n = 0;
    if (!d) return 0;
    while (readdir(d)) n++;
    closedir(d);
    return n - 2; /* . and .. */
}

static double rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0) kib = atof(line + 6);
    if (f) fclose(f);
    return kib;
}

int main(int argc, char **argv) {
    double t0 = now();
    MPI_Init(&argc, &argv);
    double init_s = now() - t0;
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int iters = argc > 1 ? atoi(argv[1]) : 200;
    int elems[2] = {1, 16384};
    double us[2];
    float *buf = malloc(sizeof(float) * 16384);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < elems[k]; i++) buf[i] = 1.0f;
        MPI_Allreduce(MPI_IN_PLACE, buf, elems[k], MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        if (buf[0] != (float)size) {
            fprintf(stderr, "rank %d: allreduce of ones gave %f\n", rank, buf[0]);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        double best = 1e30;
        for (int round = 0; round < 3; round++) {
            for (int i = 0; i < elems[k]; i++) buf[i] = 0.0f;
            double t = now();
            for (int i = 0; i < iters; i++)
                MPI_Allreduce(MPI_IN_PLACE, buf, elems[k], MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double per = (now() - t) * 1e6 / iters;
            if (per < best) best = per;
        }
        us[k] = best;
    }
    double mine[6] = {init_s, us[0], us[1], count("/proc/self/fd"), count("/proc/self/task"),
                      rss_kib()};
    double worst[6], first_fds = mine[3];
    MPI_Reduce(mine, worst, 6, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0)
        printf("SCALE_RESULT {\"ranks\": %d, \"init_s\": %.3f, \"us_4B\": %.1f, \"us_64KiB\": %.1f, "
               "\"fds\": %.0f, \"fds_rank0\": %.0f, \"threads\": %.0f, \"rss_kib\": %.0f}\n",
               size, worst[0], worst[1], worst[2], worst[3], first_fds, worst[4], worst[5]);
    free(buf);
    MPI_Finalize();
    return 0;
}
