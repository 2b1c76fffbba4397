// A persistent thread pool for memory-bound kernels (the fused Adam): a call is split into contiguous chunks that
// the calling thread and the workers claim in order. Header-only; one pool per process, rebuilt after a fork.
#pragma once

#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace angel {
namespace parallel {

// ------------------------------------------------------------------------------------------------- thread pool ---
// A job is a function of the part index; the caller runs part 0 and workers the others. One job runs at a time
// (callers from several Python threads queue on `submit_mutex_`). The optimizer calls once per page, back to back,
// so a worker that finishes a part spins for a short while (kIdleSpin) watching for the next job before it sleeps
// on the condition variable: a futex wake-up costs tens of microseconds in a VM, a sizeable part of a 1 MiB page.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

// Parts of split calls handed to workers, and those the caller took back because no worker had started them yet
// (a worker without a core: tools and tests read how often that happens). Process-wide, across pool rebuilds.
inline std::atomic<uint64_t> g_parts_posted{0}, g_parts_taken_back{0};

class Pool {
  public:
    static constexpr std::chrono::microseconds kIdleSpin{200};

    explicit Pool(int threads) : tickets_(static_cast<size_t>(std::max(threads, 1))) {
        for (int k = 1; k < threads; ++k) workers_.emplace_back([this, k] { worker_loop(k); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_.store(true);
        }
        wake_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int threads() const { return static_cast<int>(workers_.size()) + 1; }

    void run(int parts, const std::function<void(int)>& job) {
        std::lock_guard<std::mutex> serial(submit_mutex_);
        parts = std::min(parts, threads());
        if (parts <= 1) {
            job(0);
            return;
        }
        // Worker k runs part k once it claims its posted ticket. The caller runs part 0, then takes back every part
        // no worker has claimed yet: on a machine whose other cores are busy (compute, I/O threads, other ranks) a
        // worker may not get a core for milliseconds, and its chunks are done by then (they are claimed in order by
        // whichever thread comes first). A worker that claims late finds its ticket taken back or replaced and never
        // touches this job, so the caller waits only for parts that are really running.
        const uint64_t number = ++jobs_;
        job_ = &job;
        pending_.store(parts - 1, std::memory_order_relaxed);
        bool sleepers;
        {
            std::lock_guard<std::mutex> lock(mutex_);  // orders the tickets against a worker going to sleep
            for (int k = 1; k < parts; ++k) tickets_[k].value.store(number << 2 | kPosted, std::memory_order_release);
            sleepers = sleepers_ > 0;
        }
        if (sleepers) wake_.notify_all();
        job(0);
        uint64_t taken_back = 0;
        for (int k = 1; k < parts; ++k) {
            uint64_t posted = number << 2 | kPosted;
            if (tickets_[k].value.compare_exchange_strong(posted, number << 2 | kTakenBack, std::memory_order_acq_rel)) {
                pending_.fetch_sub(1, std::memory_order_acq_rel);
                ++taken_back;
            }
        }
        g_parts_posted.fetch_add(static_cast<uint64_t>(parts - 1), std::memory_order_relaxed);
        g_parts_taken_back.fetch_add(taken_back, std::memory_order_relaxed);
        // The parts still pending are running: a short spin catches most finishes without a sleep/wake round.
        for (int spin = 0; spin < 4000 && pending_.load(std::memory_order_acquire) != 0; ++spin) cpu_relax();
        if (pending_.load(std::memory_order_acquire) != 0) {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
        }
    }

  private:
    // A ticket is (job number << 2) | state: posted by the caller, then claimed by its worker or taken back by the
    // caller (whichever swaps it first).
    static constexpr uint64_t kPosted = 1, kClaimed = 2, kTakenBack = 3;

    struct alignas(64) Ticket {  // one cache line each: workers poll their own
        std::atomic<uint64_t> value{0};
    };

    // Waits until worker `index`'s ticket differs from `seen` (or shutdown): spinning first, then asleep.
    uint64_t next_ticket(int index, uint64_t seen) {
        std::atomic<uint64_t>& ticket = tickets_[index].value;
        auto deadline = std::chrono::steady_clock::now() + kIdleSpin;
        for (int spin = 0;; ++spin) {
            uint64_t now = ticket.load(std::memory_order_acquire);
            if (now != seen || stopping_.load(std::memory_order_relaxed)) return now;
            if ((spin & 63) == 63 && std::chrono::steady_clock::now() > deadline) break;
            cpu_relax();
        }
        std::unique_lock<std::mutex> lock(mutex_);
        ++sleepers_;
        wake_.wait(lock, [&] { return stopping_.load() || ticket.load(std::memory_order_acquire) != seen; });
        --sleepers_;
        return ticket.load(std::memory_order_acquire);
    }

    void worker_loop(int index) {
        constexpr uint64_t kState = 3;
        uint64_t seen = 0;
        for (;;) {
            uint64_t now = next_ticket(index, seen);
            if (stopping_.load()) return;
            while ((now & kState) == kPosted) {  // claim it, unless the caller took it back first
                uint64_t expected = now;
                if (tickets_[index].value.compare_exchange_strong(expected, (now & ~kState) | kClaimed,
                                                                  std::memory_order_acq_rel)) {
                    now = (now & ~kState) | kClaimed;
                    (*job_)(index);
                    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                        std::lock_guard<std::mutex> lock(mutex_);  // pairs with the caller's predicate check
                        done_.notify_one();
                    }
                    break;
                }
                now = expected;  // changed meanwhile: taken back, or already a later job's posting (claimed next)
            }
            seen = now;
        }
    }

    std::vector<std::thread> workers_;
    std::vector<Ticket> tickets_;
    std::mutex submit_mutex_;
    std::mutex mutex_;
    std::condition_variable wake_, done_;
    const std::function<void(int)>* job_ = nullptr;  // written before the tickets move, read after
    std::atomic<int> pending_{0};
    std::atomic<bool> stopping_{false};
    int sleepers_ = 0;  // guarded by mutex_
    uint64_t jobs_ = 0;  // jobs run, the number of the last one (guarded by submit_mutex_)
};

inline int default_threads() {
    unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
}

inline std::mutex g_pool_mutex;
inline std::shared_ptr<Pool> g_pool;
inline pid_t g_pool_pid = 0;
inline int g_threads = 0;  // 0: not chosen yet, default_threads() on first use

// A forked child (a DataLoader worker, say) inherits the pool object but none of its threads: it must neither wait
// for them nor join them, so the inherited pool is abandoned (leaked) and the child builds its own.
inline void drop_inherited_pool() {
    if (g_pool && g_pool_pid != getpid()) new std::shared_ptr<Pool>(std::move(g_pool));
}

inline std::shared_ptr<Pool> pool() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    drop_inherited_pool();
    if (!g_pool) {
        if (g_threads == 0) g_threads = default_threads();
        g_pool = std::make_shared<Pool>(g_threads);
        g_pool_pid = getpid();
    }
    return g_pool;
}

inline void set_threads(int threads) {
    if (threads < 1) throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
    std::shared_ptr<Pool> old;
    {
        std::lock_guard<std::mutex> lock(g_pool_mutex);
        drop_inherited_pool();
        if (threads == g_threads && g_pool) return;
        g_threads = threads;
        old = std::move(g_pool);  // a call in flight keeps its pool alive until it returns
    }
}

inline int get_threads() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    return g_threads == 0 ? default_threads() : g_threads;
}

// Below this many elements a call runs on the calling thread alone: waking workers costs more than it saves.
static constexpr size_t kMinParallel = 1 << 15;
// Split points are multiples of this many elements, so every thread's range starts on a cache line of every buffer.
static constexpr size_t kSplitAlign = 64;
// Work is handed out in chunks of about n / (threads * kChunksPerThread) elements, never below kMinChunk (a 64 KiB
// run of each fp32 buffer).
static constexpr size_t kMinChunk = 1 << 14;
static constexpr size_t kChunksPerThread = 4;

// Runs body(begin, end) over [0, n) on the pool. The range is cut into contiguous chunks (a few per thread, each
// long enough for the hardware prefetchers to stream every buffer) that the threads claim in order: on a dedicated
// machine that is a static split, and when another process takes a core for a while, the other threads take over
// its chunks instead of waiting for it.
template <class Body>
void parallel_ranges(size_t n, const Body& body) {
    if (n == 0) return;
    std::shared_ptr<Pool> p = pool();
    int threads = n < kMinParallel ? 1 : p->threads();
    if (threads == 1) {
        body(0, n);
        return;
    }
    size_t chunk = std::max(kMinChunk, n / (static_cast<size_t>(threads) * kChunksPerThread));
    chunk = (chunk + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
    size_t chunks = (n + chunk - 1) / chunk;
    std::atomic<size_t> next{0};
    std::function<void(int)> job = [&](int) {
        for (size_t k = next.fetch_add(1, std::memory_order_relaxed); k < chunks;
             k = next.fetch_add(1, std::memory_order_relaxed)) {
            body(k * chunk, std::min(n, (k + 1) * chunk));
        }
    };
    p->run(static_cast<int>(std::min<size_t>(chunks, static_cast<size_t>(threads))), job);
}

}  // namespace parallel
}  // namespace angel
