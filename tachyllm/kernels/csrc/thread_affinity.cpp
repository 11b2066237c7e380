// Pins the worker threads of the caller's OpenMP team, one CPU each (the CPUs: platform.compute_thread_cpus).
//
// On a VM whose idle vCPUs halt, the scheduler may wake both threads of a two-thread team on one vCPU
// after a pause, and every parallel region then waits for a time slice: a lone embedding step after 30
// ms of idle took 16 ms at p90 against 5.7 ms with the worker pinned
// (docs/design_measurements.md#compute-thread-binding). The calling thread (team thread 0) is left as it
// is: it is the user's thread in an offline LLM, and every thread it starts would inherit its mask.
#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>

#include <vector>

#include "ops.h"

std::vector<int64_t> bind_team_threads(const std::vector<int64_t>& cpus) {
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> bound(threads, -1);
  // One index per team thread: at::parallel_for gives thread t the chunk [t, t + 1) when there are as
  // many indices as threads. A region run serially (one thread, or inside another region) binds nothing:
  // its indices all run on the caller, whose thread number is then 0.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t == 0 || at::get_thread_num() != t || t >= static_cast<int64_t>(cpus.size()) || cpus[t] < 0 ||
          cpus[t] >= CPU_SETSIZE)
        continue;
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[t]), &set);
      if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0) bound[t] = cpus[t];
    }
  });
  return bound;
}
