// Asynchronous SSD engine: a pool of worker threads doing pread/pwrite (O_DIRECT when the caller opened the file
// that way) on caller-owned, 4 KiB-aligned buffers, computing a CRC32C of the data in the same worker.
//
// Requests are split into chunks of `chunk_bytes` that the workers execute in parallel; each chunk fills the CRCs
// of the fixed 256 KiB checksum blocks it covers, so the page checksum does not depend on how the request was
// chunked. Errors (errno, short transfers) are stored on the request and surfaced by the Python handle; nothing
// is dropped. No torch headers: buffers are raw addresses and sizes.
#include "crc32c.h"

#include <pybind11/pybind11.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/uio.h>
#include <unistd.h>

namespace py = pybind11;

namespace angel {

enum class Op : int { Read = 0, Write = 1 };

struct Request {
    Op op;
    int fd;
    char* buf;
    size_t nbytes;
    int64_t offset;
    bool checksum;

    std::vector<uint32_t> block_crcs;
    std::atomic<size_t> pending_chunks{0};
    std::atomic<size_t> bytes_done{0};

    std::mutex mutex;
    std::condition_variable finished_cv;
    bool finished = false;
    int error = 0;            // first errno seen (0 = success)
    std::string message;      // human-readable detail for the first error

    void fail(int err, const std::string& what) {
        std::lock_guard<std::mutex> lock(mutex);
        if (error == 0) {
            error = err;
            message = what;
        }
    }
    bool failed() {
        std::lock_guard<std::mutex> lock(mutex);
        return error != 0;
    }
    void chunk_done() {
        if (pending_chunks.fetch_sub(1) == 1) {
            std::lock_guard<std::mutex> lock(mutex);
            finished = true;
            finished_cv.notify_all();
        }
    }
    bool done() {
        std::lock_guard<std::mutex> lock(mutex);
        return finished;
    }
    void wait() {
        std::unique_lock<std::mutex> lock(mutex);
        finished_cv.wait(lock, [this] { return finished; });
    }
    uint32_t page_checksum() const { return combine_block_crcs(block_crcs); }
};

struct Chunk {
    std::shared_ptr<Request> request;
    size_t start;   // byte offset inside the request
    size_t length;
};

class Engine {
  public:
    Engine(int threads, int queue_depth, size_t chunk_bytes, int checksum_threads)
        : queue_depth_(queue_depth), chunk_bytes_(chunk_bytes) {
        if (threads < 1) throw std::invalid_argument("threads must be >= 1");
        if (queue_depth < 1) throw std::invalid_argument("queue_depth must be >= 1");
        if (chunk_bytes == 0 || chunk_bytes % kChecksumBlock != 0)
            throw std::invalid_argument("chunk_bytes must be a positive multiple of 256 KiB");
        if (checksum_threads < 1) throw std::invalid_argument("checksum_threads must be >= 1");
        for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
        for (int i = 0; i < checksum_threads; ++i) checksummers_.emplace_back([this] { checksum_loop(); });
    }
    ~Engine() { shutdown(); }

    // `wake` false: the chunks are queued without waking a worker; the caller wakes them with wake() once it has
    // queued a batch (workers that find adjacent chunks queued together merge them into one transfer). A submit
    // that must wait for room in the queue wakes them first, and so does a wait on any request.
    std::shared_ptr<Request> submit(int op, int fd, uintptr_t buf, size_t nbytes, int64_t offset, bool checksum,
                                    bool wake = true) {
        {
            std::lock_guard<std::mutex> lock(queue_mutex_);
            if (stopping_) throw std::runtime_error("engine is shut down");
        }
        auto req = std::make_shared<Request>();
        req->op = static_cast<Op>(op);
        req->fd = fd;
        req->buf = reinterpret_cast<char*>(buf);
        req->nbytes = nbytes;
        req->offset = offset;
        req->checksum = checksum;
        size_t n_blocks = nbytes == 0 ? 0 : (nbytes + kChecksumBlock - 1) / kChecksumBlock;
        req->block_crcs.assign(n_blocks, 0);
        size_t n_chunks = nbytes == 0 ? 0 : (nbytes + chunk_bytes_ - 1) / chunk_bytes_;
        if (n_chunks == 0) {
            req->finished = true;
            return req;
        }
        // Each chunk has an I/O part and, when checksummed, a checksum part run by the checksum threads.
        const size_t parts = checksum ? 2 : 1;
        req->pending_chunks = n_chunks * parts;
        // Reads are what compute waits for: they may queue past a depth filled by write-backs.
        const size_t depth = static_cast<size_t>(queue_depth_) * (req->op == Op::Read ? 2 : 1);
        size_t i = 0;
        {  // The chunks the queue has room for go in with the GIL held: releasing it for a call that does not block
           // hands it to another Python thread, and this one then waits for it back (up to a switch interval).
            std::lock_guard<std::mutex> lock(queue_mutex_);
            for (; i < n_chunks && queue_.size() < depth && !stopping_; ++i) {
                size_t start = i * chunk_bytes_;
                queue_.push_back(Chunk{req, start, std::min(chunk_bytes_, nbytes - start)});
            }
        }
        // One waiting worker, who relays to the next if more is queued: waking every idle worker for one chunk
        // costs the others a wake-up each, and on a machine with as many busy threads as cores each wake-up
        // preempts the caller.
        if (wake) {
            wake_workers(i);
        } else {
            unwoken_.fetch_add(i, std::memory_order_relaxed);
        }
        if (i == n_chunks) return req;
        wake_workers(0);  // the queue is full: every held chunk goes now
        py::gil_scoped_release no_gil;  // the rest may block on a full queue
        for (; i < n_chunks; ++i) {
            size_t start = i * chunk_bytes_;
            size_t length = std::min(chunk_bytes_, nbytes - start);
            std::unique_lock<std::mutex> lock(queue_mutex_);
            not_full_.wait(lock, [this, depth] { return queue_.size() < depth || stopping_; });
            if (stopping_) {  // shut down mid-submit: the chunks not queued are reported, not lost silently
                lock.unlock();
                req->fail(ECANCELED, "engine shut down before the request was queued");
                for (size_t j = i * parts; j < n_chunks * parts; ++j) req->chunk_done();
                break;
            }
            queue_.push_back(Chunk{req, start, length});
            not_empty_.notify_one();
        }
        return req;
    }

    // Wakes one worker if chunks were queued without a wake-up (or `more` now); a worker that takes a chunk and
    // leaves others queued wakes the next (worker_loop), so the submitting thread -- the one compute runs on --
    // pays one futex wake-up (tens of microseconds in a VM) however many chunks it queued.
    void wake_workers(size_t more = 0) {
        size_t n = unwoken_.exchange(0, std::memory_order_relaxed) + more;
        if (n) not_empty_.notify_one();
    }
    void wake() { wake_workers(0); }

    // Test hook: the next `count` chunk operations of kind `op` (0 read, 1 write, -1 any) fail with `err`
    // without touching the file.
    void inject_fault(int op, int err, int count) {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        fault_op_ = op;
        fault_errno_ = err;
        fault_count_ = count;
    }

    void shutdown() {
        {
            std::lock_guard<std::mutex> lock(queue_mutex_);
            if (stopping_ && workers_.empty()) return;
            stopping_ = true;
        }
        not_empty_.notify_all();
        not_full_.notify_all();
        for (auto& t : workers_)
            if (t.joinable()) t.join();
        workers_.clear();
        {  // the I/O workers are gone, so no checksum job can be added any more: drain and stop
            std::lock_guard<std::mutex> lock(checksum_mutex_);
            checksum_stopping_ = true;
        }
        checksum_ready_.notify_all();
        for (auto& t : checksummers_)
            if (t.joinable()) t.join();
        checksummers_.clear();
    }

    int threads() const { return static_cast<int>(workers_.size()); }
    int queue_depth() const { return queue_depth_; }
    std::pair<uint64_t, uint64_t> transfer_counts() const { return {merged_transfers_.load(), merged_chunks_.load()}; }
    size_t chunk_bytes() const { return chunk_bytes_; }

  private:
    bool take_fault(Op op, int* err) {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        if (fault_count_ > 0 && (fault_op_ < 0 || fault_op_ == static_cast<int>(op))) {
            --fault_count_;
            *err = fault_errno_;
            return true;
        }
        return false;
    }

    void worker_loop() {
        std::vector<Chunk> run;
        for (;;) {
            run.clear();
            {
                std::unique_lock<std::mutex> lock(queue_mutex_);
                not_empty_.wait(lock, [this] { return !queue_.empty() || stopping_; });
                if (queue_.empty()) return;  // stopping and drained
                // Reads first: a write-back can wait, the page being read is wanted by compute. Among reads (and
                // among writes) the order of submission holds.
                auto next = queue_.begin();
                for (auto it = queue_.begin(); it != queue_.end(); ++it) {
                    if (it->request->op == Op::Read) {
                        next = it;
                        break;
                    }
                }
                run.push_back(std::move(*next));
                queue_.erase(next);
                if (fault_count_ == 0) take_adjacent(run);  // (an injected fault counts single transfers)
                not_full_.notify_all();
                if (!queue_.empty()) not_empty_.notify_one();  // the relay: another worker for what is left
            }
            if (run.size() == 1)
                run_chunk(run[0]);
            else
                run_merged(run);
            merged_transfers_.fetch_add(1, std::memory_order_relaxed);  // counted before a waiter can see it done
            merged_chunks_.fetch_add(run.size(), std::memory_order_relaxed);
            for (Chunk& chunk : run) chunk.request->chunk_done();
        }
    }

    // Queued chunks of the same operation on the same file that continue `run` (in file order, before or after
    // it) join it, up to chunk_bytes in all and kMaxMergedChunks buffers: pages written back (or read) one after
    // another usually sit in adjacent slots, and one vectored transfer of N pages costs the kernel (and a virtual
    // disk) far less than N transfers. Called with queue_mutex_ held; `run` is kept in file order.
    void take_adjacent(std::vector<Chunk>& run) {
        const Request& first = *run.front().request;
        int64_t begin = first.offset + static_cast<int64_t>(run.front().start);
        int64_t end = begin + static_cast<int64_t>(run.front().length);
        size_t bytes = run.front().length;
        bool grew = true;
        while (grew && run.size() < kMaxMergedChunks) {
            grew = false;
            for (auto it = queue_.begin(); it != queue_.end(); ++it) {
                const Request& r = *it->request;
                if (r.op != first.op || r.fd != first.fd || bytes + it->length > chunk_bytes_) continue;
                int64_t at = r.offset + static_cast<int64_t>(it->start);
                const size_t length = it->length;
                if (at == end) {
                    end += static_cast<int64_t>(it->length);
                    run.push_back(std::move(*it));
                } else if (at + static_cast<int64_t>(it->length) == begin) {
                    begin = at;
                    run.insert(run.begin(), std::move(*it));
                } else {
                    continue;
                }
                bytes += length;
                queue_.erase(it);
                grew = true;
                break;
            }
        }
    }

    // The I/O part of each chunk of a run (file order, adjacent) as vectored transfers, each chunk's checksum part
    // as run_chunk does it. A transfer that fails or comes up short hands the rest of the run to single transfers,
    // which name the chunk, offset and errno exactly as an unmerged transfer would.
    void run_merged(std::vector<Chunk>& run) {
        const Op op = run.front().request->op;
        std::vector<bool> checksum_queued(run.size(), false);
        for (size_t k = 0; k < run.size(); ++k) checksum_queued[k] = checksum_before(run[k]);
        std::vector<struct iovec> iov;
        std::vector<size_t> members;  // run indices whose chunks the vector covers (failed requests are skipped)
        int64_t pos = -1;
        for (size_t k = 0; k < run.size(); ++k) {
            Request& req = *run[k].request;
            int64_t at = req.offset + static_cast<int64_t>(run[k].start);
            if (req.failed()) continue;
            if (!iov.empty() && at != pos) break;  // a skipped chunk left a gap: the rest go one by one below
            iov.push_back({req.buf + run[k].start, run[k].length});
            members.push_back(k);
            pos = at + static_cast<int64_t>(run[k].length);
        }
        size_t transferred = 0;  // members fully transferred, in order
        if (!iov.empty()) {
            int64_t at = run[members[0]].request->offset + static_cast<int64_t>(run[members[0]].start);
            size_t index = 0, within = 0;
            while (index < iov.size()) {
                iov[index].iov_base = static_cast<char*>(iov[index].iov_base) + within;
                iov[index].iov_len -= within;
                int count = static_cast<int>(iov.size() - index);
                ssize_t n = op == Op::Read ? ::preadv(run[members[0]].request->fd, iov.data() + index, count, at)
                                           : ::pwritev(run[members[0]].request->fd, iov.data() + index, count, at);
                if (n < 0 && errno == EINTR) {
                    iov[index].iov_base = static_cast<char*>(iov[index].iov_base) - within;
                    iov[index].iov_len += within;
                    continue;
                }
                iov[index].iov_base = static_cast<char*>(iov[index].iov_base) - within;
                iov[index].iov_len += within;
                if (n <= 0) break;  // an error or end of file: the single transfers below say which chunk
                at += n;
                size_t left = static_cast<size_t>(n);
                while (left > 0 && index < iov.size()) {
                    size_t rest = iov[index].iov_len - within;
                    if (left >= rest) {
                        left -= rest;
                        within = 0;
                        run[members[index]].request->bytes_done.fetch_add(iov[index].iov_len);
                        ++index;
                    } else {
                        within += left;
                        left = 0;
                    }
                }
            }
            transferred = index;  // (a chunk cut short is redone whole below: the same bytes again)
        }
        std::vector<bool> done(run.size(), false);
        for (size_t i = 0; i < transferred; ++i) done[members[i]] = true;
        for (size_t k = 0; k < run.size(); ++k)
            if (!done[k]) transfer(run[k]);  // (a failed request's chunk is skipped inside)
        for (size_t k = 0; k < run.size(); ++k) checksum_after(run[k], checksum_queued[k]);
    }
    // Checksums run on their own threads so an I/O worker goes straight on to its next transfer: a write's data is
    // checksummed while it is being written (the buffer is not modified meanwhile), a read's once it has arrived.
    void checksum_later(const Chunk& chunk) {
        {
            std::lock_guard<std::mutex> lock(checksum_mutex_);
            checksum_jobs_.push_back(chunk);
        }
        checksum_ready_.notify_one();
    }

    void checksum_loop() {
        for (;;) {
            Chunk chunk;
            {
                std::unique_lock<std::mutex> lock(checksum_mutex_);
                checksum_ready_.wait(lock, [this] { return !checksum_jobs_.empty() || checksum_stopping_; });
                if (checksum_jobs_.empty()) return;
                chunk = std::move(checksum_jobs_.front());
                checksum_jobs_.pop_front();
            }
            fill_block_crcs(*chunk.request, chunk);
            chunk.request->chunk_done();
        }
    }

    void run_chunk(const Chunk& chunk) {
        bool checksum_queued = checksum_before(chunk);
        transfer(chunk);
        checksum_after(chunk, checksum_queued);
    }

    // A chunk's checksum part, before its transfer: a small chunk (one checksum block: microseconds of CRC32C)
    // is checksummed by this worker (handing it to a checksum thread costs a wake-up of that thread, more than the
    // checksum, and on a machine with as many busy threads as cores each wake-up preempts someone); a larger write
    // goes to the checksum threads now (its buffer is not modified while it is written). Whether it was queued.
    bool checksum_before(const Chunk& chunk) {
        Request& req = *chunk.request;
        if (!req.checksum || req.op != Op::Write || req.failed()) return false;
        if (chunk.length <= kChecksumBlock) {
            fill_block_crcs(req, chunk);
            return false;
        }
        checksum_later(chunk);
        return true;
    }

    // ... and after it: a read's data is checksummed once it has arrived; the checksum part of a chunk whose
    // checksum was not queued is settled here.
    void checksum_after(const Chunk& chunk, bool checksum_queued) {
        Request& req = *chunk.request;
        if (!req.checksum || checksum_queued) return;
        if (req.op == Op::Read && !req.failed()) {
            if (chunk.length <= kChecksumBlock) {
                fill_block_crcs(req, chunk);
            } else {
                checksum_later(chunk);
                return;
            }
        }
        req.chunk_done();
    }

    void transfer(const Chunk& chunk) {
        Request& req = *chunk.request;
        if (req.failed()) return;  // an earlier chunk failed: the request is already lost, skip the I/O
        int injected = 0;
        if (take_fault(req.op, &injected)) {
            req.fail(injected, std::string("injected fault: ") + std::strerror(injected));
            return;
        }
        char* data = req.buf + chunk.start;
        size_t done = 0;
        while (done < chunk.length) {
            off_t pos = static_cast<off_t>(req.offset + chunk.start + done);
            ssize_t n = req.op == Op::Read ? ::pread(req.fd, data + done, chunk.length - done, pos)
                                           : ::pwrite(req.fd, data + done, chunk.length - done, pos);
            if (n < 0) {
                if (errno == EINTR) continue;
                int err = errno;
                req.fail(err, std::string(req.op == Op::Read ? "pread" : "pwrite") + " at offset " +
                                  std::to_string(pos) + ": " + std::strerror(err));
                return;
            }
            if (n == 0) {
                req.fail(EIO, std::string(req.op == Op::Read ? "short read" : "short write") + ": " +
                                  std::to_string(done) + " of " + std::to_string(chunk.length) +
                                  " bytes at offset " + std::to_string(req.offset + chunk.start));
                return;
            }
            done += static_cast<size_t>(n);
        }
        req.bytes_done.fetch_add(done);
    }

    static void fill_block_crcs(Request& req, const Chunk& chunk) {
        // Chunks are multiples of the checksum block, so each block belongs to exactly one chunk.
        crc32c_blocks(reinterpret_cast<const uint8_t*>(req.buf + chunk.start), chunk.length,
                      req.block_crcs.data() + chunk.start / kChecksumBlock);
    }

    int queue_depth_;
    size_t chunk_bytes_;
    std::vector<std::thread> workers_;
    std::deque<Chunk> queue_;
    std::mutex queue_mutex_;
    std::condition_variable not_empty_, not_full_;
    bool stopping_ = false;
    std::vector<std::thread> checksummers_;
    std::deque<Chunk> checksum_jobs_;
    std::mutex checksum_mutex_;
    std::condition_variable checksum_ready_;
    bool checksum_stopping_ = false;
    int fault_op_ = -1, fault_errno_ = 0, fault_count_ = 0;
    static constexpr size_t kMaxMergedChunks = 64;  // buffers in one vectored transfer (IOV_MAX is 1024)
    std::atomic<uint64_t> merged_transfers_{0}, merged_chunks_{0};  // transfers made, chunks they carried
    std::atomic<size_t> unwoken_{0};  // chunks queued with wake=false since the last wake
};

}  // namespace angel

void register_aio(py::module_& m) {
    using angel::Engine;
    using angel::Request;
    py::class_<Request, std::shared_ptr<Request>>(m, "Request")
        .def("wait",
             [](Request& r) {
                 if (r.done()) return;  // finished: the GIL is kept (releasing it would hand it away for nothing)
                 py::gil_scoped_release no_gil;
                 r.wait();
             },
             "Block (without the GIL) until every chunk of the request has finished.")
        .def("done", &Request::done)
        .def_property_readonly("error", [](Request& r) { std::lock_guard<std::mutex> l(r.mutex); return r.error; })
        .def_property_readonly("message",
                               [](Request& r) { std::lock_guard<std::mutex> l(r.mutex); return r.message; })
        .def_property_readonly("bytes_done", [](Request& r) { return r.bytes_done.load(); })
        .def_property_readonly("nbytes", [](Request& r) { return r.nbytes; })
        .def_property_readonly("checksum", &Request::page_checksum);

    py::class_<Engine>(m, "Engine")
        .def(py::init<int, int, size_t, int>(), py::arg("threads"), py::arg("queue_depth"), py::arg("chunk_bytes"),
             py::arg("checksum_threads") = 1)
        .def("submit", &Engine::submit, py::arg("op"), py::arg("fd"), py::arg("buffer"), py::arg("nbytes"),
             py::arg("offset"), py::arg("checksum") = true, py::arg("wake") = true)
        .def("wake", &Engine::wake, "Wake workers for the chunks submitted with wake=False.")
        .def("inject_fault", &Engine::inject_fault, py::arg("op"), py::arg("errno"), py::arg("count"))
        .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("threads", &Engine::threads)
        .def_property_readonly("queue_depth", &Engine::queue_depth)
        .def_property_readonly("chunk_bytes", &Engine::chunk_bytes)
        .def_property_readonly("transfer_counts", &Engine::transfer_counts,
                               "(transfers made, chunks they carried): adjacent queued chunks share one transfer");
}
