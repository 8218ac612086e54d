// A second pair of hands for a step that runs on one thread, for cpu_decode_step.cpp
// (included there, inside its anonymous namespace; that file includes what this uses:
// <omp.h>, <unistd.h>, <sys/resource.h>, <sys/syscall.h>, <thread>, <mutex>,
// <condition_variable>, InferenceMode, ParallelGuard).
//
// Why: on 2 cores a busy engine's step thread runs the op while the event loop's thread
// does its Python (plan, commit, Detokenizer, Frontend) on the other core, in bursts.
// An OpenMP team of 2 loses there (ops/team.py chooses 1 thread for most such steps):
// every parallel region ends at a barrier that waits for each thread of the team to
// arrive, and the second thread is often off its core while the loop runs. Here the
// second pair of hands is optional: the step thread posts a job and starts on it at
// once; a helper thread, woken by the post, takes blocks of the job from the same
// counter only if it gets a core before the blocks run out. The step thread then waits
// only for a block the helper has already taken, never for the helper to arrive.
//
// One helper per process, made on first use (and made again in a forked child, whose
// copy has no thread behind it). Its own ATen calls run single-threaded (no OpenMP team
// of its own: a second team would make libgomp shorten every team's spin), under
// InferenceMode as the step thread's do. A job posted while another thread holds the
// helper runs on the posting thread alone.
#pragma once

// The helper thread's niceness. It shares its core with the event loop's thread, whose
// work makes the next step's plan; at the loop's priority a woken helper preempted it,
// and the step then waited for its plan. Niced, it runs on what the loop leaves. On the
// near-zero model offline (host_overhead.py, alternated, seven pairs): the head and
// the draw shared at nice 0, 63.1k-73.2k tok/s (median 69.5k); with the attention
// shared too at nice 10, 70.0k-75.3k (median 71.6k), ahead in all seven. The attention
// shared at nice 0 lost (63.5k-66.7k, three runs): the loop pushed aside for longer.
constexpr int kHelperNice = 10;

class StepHelper {
 public:
  // Run `body` on this thread and, if the helper wakes in time, on the helper too; each
  // runs it once and it must take its work from a counter it shares (a block at a time).
  // Returns once both are done with it; an exception from either is rethrown here.
  void share(const std::function<void()>& body) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (!owner.owns_lock()) {
      body();
      return;
    }
    Job job{&body};
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = &job;
      ++posted_;
    }
    cv_.notify_one();
    std::exception_ptr mine;
    try {
      body();
    } catch (...) {
      mine = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = nullptr;  // a helper that has not joined yet stays out
    }
    while (job.joined.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    if (mine) std::rethrow_exception(mine);
    if (job.error) std::rethrow_exception(job.error);
  }

  // The process's helper (a new one in a forked child).
  static StepHelper& get() {
    static std::mutex made;
    static StepHelper* helper = nullptr;
    std::lock_guard<std::mutex> lock(made);
    if (helper == nullptr || helper->pid_ != getpid()) helper = new StepHelper();  // never freed
    return *helper;
  }

 private:
  struct Job {
    const std::function<void()>* body;
    std::atomic<int> joined{0};
    std::exception_ptr error;
  };

  StepHelper() : pid_(getpid()) { std::thread([this] { loop(); }).detach(); }

  void loop() {
    omp_set_num_threads(1);  // this thread's mm calls: MKL single-threaded, no new team
    // Below the event loop's thread: see kHelperNice. Refused (a sandbox): it helps as is.
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kHelperNice);
    c10::InferenceMode inference;
    c10::ParallelGuard in_region(true);  // ATen's own loops inline, never a team
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return posted_ != seen; });
      seen = posted_;
      Job* job = job_;
      if (job == nullptr) continue;  // closed before this thread got here
      job->joined.fetch_add(1, std::memory_order_relaxed);
      lock.unlock();
      try {
        (*job->body)();
      } catch (...) {
        job->error = std::current_exception();
      }
      job->joined.fetch_sub(1, std::memory_order_release);
      lock.lock();
    }
  }

  const pid_t pid_;
  std::mutex owner_;  // the one poster at a time
  std::mutex m_;
  std::condition_variable cv_;
  Job* job_ = nullptr;
  uint64_t posted_ = 0;
};
