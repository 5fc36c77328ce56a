// Replays a captured tinygrad JIT's CPU kernels from C (cpu_graph.py): every kernel in order, in one
// call from Python, the pieces of thread-split kernels (a `core_id` argument) claimed by the calling
// thread and a few spinning workers.
//
// Kernels are called through a pointer typed with MAX_ARGS 64-bit arguments: tinygrad's CPU
// kernels take pointers and ints only, the x86-64 and AArch64 C conventions pass the first
// arguments in the same registers whatever the prototype, and extra ones are ignored by the
// callee (ctypes calls them the same way, every argument a uint64).
//
// Pieces are claimed from a ticket, (generation << 32) | next piece, with a compare-and-swap, so a
// worker that wakes late (its core taken by another process) finds them all claimed and the
// caller does not wait for it. Workers spin a short while after each kernel, then sleep on a futex.
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_ARGS 32
#define MAX_WORKERS 63
#define SPIN_ROUNDS 20000

typedef void (*kernel_fn)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                          uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                          uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                          uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);

typedef struct {
  uint64_t fn;       // kernel address
  uint64_t args;     // address of its uint64 arguments
  int64_t core_arg;  // index of its core_id argument, -1 if not thread-split
  int64_t pieces;    // core_id values 0 .. pieces-1
} launch_t;

typedef struct {
  _Atomic uint64_t ticket;
  _Atomic uint32_t done;
  _Atomic uint32_t epoch;
  _Atomic int32_t sleepers;
  _Atomic int32_t stop;
  const launch_t *_Atomic slots[2];
  uint32_t generation;  // of the last split kernel; written by the calling thread only
  pthread_mutex_t calling;  // one caller at a time
  int workers;
  pthread_t tids[MAX_WORKERS];
} pool_t;

static inline void cpu_relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static void run_piece(const launch_t *l, int64_t piece) {
  uint64_t a[MAX_ARGS];
  memcpy(a, (const uint64_t *)l->args, sizeof(a));
  if (l->core_arg >= 0) a[l->core_arg] = (uint64_t)piece;
  ((kernel_fn)l->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14],
                     a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28],
                     a[29], a[30], a[31]);
}

static void claim_pieces(pool_t *p) {
  for (;;) {
    uint64_t t = atomic_load(&p->ticket);
    const launch_t *l = p->slots[(t >> 32) & 1];
    uint32_t piece = (uint32_t)t;
    if (l == NULL || piece >= (uint64_t)l->pieces) return;
    if (!atomic_compare_exchange_weak(&p->ticket, &t, t + 1)) continue;
    run_piece(l, piece);
    atomic_fetch_add(&p->done, 1);
  }
}

static void *worker(void *arg) {
  pool_t *p = arg;
  uint32_t seen = atomic_load(&p->epoch);
  while (!atomic_load(&p->stop)) {
    uint32_t now = atomic_load(&p->epoch);
    for (int spins = 0; now == seen && spins < SPIN_ROUNDS && !atomic_load(&p->stop); spins++) {
      cpu_relax();
      now = atomic_load(&p->epoch);
    }
    if (now == seen) {  // idle: sleep until the next split kernel
      atomic_fetch_add(&p->sleepers, 1);
      syscall(SYS_futex, &p->epoch, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      atomic_fetch_sub(&p->sleepers, 1);
      continue;
    }
    seen = now;
    claim_pieces(p);
  }
  return NULL;
}

pool_t *pool_create(int threads) {
  pool_t *p = calloc(1, sizeof(pool_t));
  if (p == NULL) return NULL;
  pthread_mutex_init(&p->calling, NULL);
  for (int i = 0; i < threads - 1 && i < MAX_WORKERS; i++) {
    if (pthread_create(&p->tids[i], NULL, worker, p) != 0) break;
    p->workers++;
  }
  return p;
}

void pool_destroy(pool_t *p) {
  if (p == NULL) return;
  atomic_store(&p->stop, 1);
  atomic_fetch_add(&p->epoch, 1);
  syscall(SYS_futex, &p->epoch, FUTEX_WAKE_PRIVATE, MAX_WORKERS, NULL, NULL, 0);
  for (int i = 0; i < p->workers; i++) pthread_join(p->tids[i], NULL);
  free(p);
}

static void run_split(pool_t *p, const launch_t *l) {
  uint32_t gen = ++p->generation;
  p->slots[gen & 1] = l;
  atomic_store(&p->done, 0);
  atomic_store(&p->ticket, (uint64_t)gen << 32);
  atomic_fetch_add(&p->epoch, 1);
  if (atomic_load(&p->sleepers) > 0) syscall(SYS_futex, &p->epoch, FUTEX_WAKE_PRIVATE, MAX_WORKERS, NULL, NULL, 0);
  claim_pieces(p);
  while (atomic_load(&p->done) < (uint32_t)l->pieces) cpu_relax();
}

// Runs launches[0 .. count-1] in order; thread-split ones over the pool (NULL: on this thread).
void run_launches(pool_t *p, const launch_t *launches, int64_t count) {
  if (p != NULL) pthread_mutex_lock(&p->calling);
  for (int64_t i = 0; i < count; i++) {
    const launch_t *l = &launches[i];
    if (l->core_arg < 0 || l->pieces <= 1 || p == NULL || p->workers == 0) {
      for (int64_t piece = 0; piece < (l->core_arg < 0 ? 1 : l->pieces); piece++) run_piece(l, piece);
    } else {
      run_split(p, l);
    }
  }
  if (p != NULL) pthread_mutex_unlock(&p->calling);
}
