// torchnext's native process-group data path: a c10d::Backend that wraps another c10d::Backend (Gloo today)
// through the virtual c10d::Backend interface only (torch's ProcessGroupWrapper is the model; nothing here
// depends on Gloo's headers).
//
// Per op, on the fast path (no Python):
//   * forward the op to the inner backend;
//   * return a NativeWork: its status is one atomic state machine
//       IN_PROGRESS -> exactly one of COMPLETED / FAILED / ABORTED   (compare-and-swap under the Work's mutex)
//     with a condition variable, so abort() (any thread) wakes every waiter at once, and a deadline (the op's
//     timeout) enforced by wait() and by one watchdog thread per backend (for ops nobody waits on: DDP's futures);
//   * record a Flight Recorder entry in a C++ ring whose fields are those of the Python recorder's slots
//     (torchnext/comms/flight_recorder/entries.py); Python merges the ring into its dumps.
//
// Anything unusual (PREMUL_SUM except on reduce-scatters, several tensors, non-CPU / non-contiguous / sparse tensors, dtype or size
// mismatches, an errored or aborted group, a group switched to the Python path) goes to the Python path
// (`python_path(name, *args)`), which validates, raises the Python path's own errors or runs the op there.
// Failures raise the Python exception the Python side builds (`make_error(...)`: CommTimeout, PeerFailure,
// CommAborted, ...), so callers see the same classes and messages on both paths.
//
// The future of a Work never completes with an error (torch's DDP reducer crashes on one): a failed op's
// outputs are marked invalid (floating point: NaN; integers: the type's extreme value; see mark_invalid) and the
// future completes with the outputs.

#include <torch/extension.h>
#include <pybind11/chrono.h>

#include <ATen/ScalarOps.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PyProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <map>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace torchnext_native {

constexpr int kAbiVersion = 4;

using Clock = std::chrono::steady_clock;
using c10d::OpType;
using c10d::Work;

enum State : uint8_t { kInProgress = 0, kCompleted = 1, kFailed = 2, kAborted = 3 };
// Why an op failed: what the Python side turns into an exception class.
enum Kind : uint8_t { kNone = 0, kTimeout = 1, kBackendError = 2, kAbort = 3 };

// Releases the GIL for its scope when the calling thread holds it. torch's PyProcessGroup trampoline calls the base
// ProcessGroup op (and so this backend) with the GIL held; Gloo's worker thread may drop the last reference to a
// finished op's tensors -- a Python decref, which needs the GIL -- while it holds the queue lock that issuing the
// next op takes. Holding the GIL across that call deadlocks; torch's own groups release it in pybind's call guard.
struct NoGil {
  PyThreadState* state = nullptr;
  NoGil() {
    if (Py_IsInitialized() && PyGILState_Check()) state = PyEval_SaveThread();
  }
  ~NoGil() {
    if (state != nullptr) PyEval_RestoreThread(state);
  }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
};

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ------------------------------------------------------------------------------------------ Flight Recorder ring
// One entry; the fields of the Python recorder's slot (entries.py: _RID ... _ROP), frames excepted.
struct Entry {
  int64_t rid = -1;
  int64_t cseq = 0, pseq = 0, op_id = 0;
  const char* op = "";
  bool p2p = false;
  int64_t peer = -1, tag = 0, root = -1;
  std::vector<std::vector<int64_t>> in_shapes, out_shapes;
  std::vector<c10::ScalarType> in_dtypes, out_dtypes;
  int64_t timeout_ms = 0;
  int64_t t_created = 0, t_started = 0, t_done = 0;
  uint8_t state = kInProgress;  // started / completed / error / timed_out / aborted (see state_name)
  uint8_t kind = kNone;
  uint64_t tid = 0;
  bool async = true;
  std::string error;
  const char* reduce_op = nullptr;
};

// Per-group counters, the Python recorder's layout (groups.py): collective seq, p2p seq, last enqueued / started /
// completed collective, last enqueued / started / completed p2p.
enum { G_CSEQ, G_PSEQ, G_CENQ, G_CSTART, G_CDONE, G_PENQ, G_PSTART, G_PDONE };

class Ring {
 public:
  explicit Ring(int64_t capacity) : slots_(capacity > 0 ? capacity : 0) {}

  bool enabled() const { return !slots_.empty(); }
  static const char* state_of(const Entry& e) { return state_name(e.state, e.kind); }

  int64_t record(const char* op, bool p2p, int64_t op_id, int64_t peer, int64_t tag, int64_t root,
                 const char* reduce_op, const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs,
                 int64_t timeout_ms, bool async) {
    if (slots_.empty()) return -1;
    std::lock_guard<std::mutex> lk(mu_);
    int64_t rid = next_++;
    Entry& e = slots_[rid % static_cast<int64_t>(slots_.size())];
    e.rid = rid;
    if (p2p) {
      e.cseq = counters_[G_CSEQ];
      e.pseq = ++counters_[G_PSEQ];
      counters_[G_PENQ] = counters_[G_PSTART] = e.pseq;
    } else {
      e.cseq = ++counters_[G_CSEQ];
      e.pseq = counters_[G_PSEQ];
      counters_[G_CENQ] = counters_[G_CSTART] = e.cseq;
    }
    e.op_id = op_id;
    e.op = op;
    e.p2p = p2p;
    e.peer = peer;
    e.tag = tag;
    e.root = root;
    e.reduce_op = reduce_op;
    fill(e.in_shapes, e.in_dtypes, ins);
    fill(e.out_shapes, e.out_dtypes, outs);
    e.timeout_ms = timeout_ms;
    e.t_created = e.t_started = wall_ns();
    e.t_done = 0;
    e.state = kInProgress;
    e.kind = kNone;
    e.tid = static_cast<uint64_t>(pthread_self());
    e.async = async;
    e.error.clear();
    return rid;
  }

  void complete(int64_t rid, uint8_t state, uint8_t kind, const std::string& error) {
    if (rid < 0 || slots_.empty()) return;
    std::lock_guard<std::mutex> lk(mu_);
    Entry& e = slots_[rid % static_cast<int64_t>(slots_.size())];
    if (e.rid != rid || e.state != kInProgress) return;
    e.t_done = wall_ns();
    e.state = state;
    e.kind = kind;
    e.error = error;
    if (state == kCompleted) {
      if (e.p2p) {
        if (e.pseq > counters_[G_PDONE]) counters_[G_PDONE] = e.pseq;
      } else if (e.cseq > counters_[G_CDONE]) {
        counters_[G_CDONE] = e.cseq;
      }
    }
  }

  // The live entries, oldest first, as the Python recorder's slot lists (pg_id and generation filled by Python).
  py::list slots() {
    std::vector<Entry> copy;
    {
      std::lock_guard<std::mutex> lk(mu_);
      copy.reserve(slots_.size());
      int64_t n = static_cast<int64_t>(slots_.size());
      for (int64_t rid = std::max<int64_t>(0, next_ - n); rid < next_; ++rid) copy.push_back(slots_[rid % n]);
    }
    py::list out;
    for (const Entry& e : copy) {
      py::list s;
      s.append(e.rid);
      s.append(py::none());  // pg_id: Python's
      s.append(e.cseq);
      s.append(e.pseq);
      s.append(e.op_id);
      s.append(py::str(e.op));
      s.append(e.p2p);
      s.append(e.peer < 0 ? py::object(py::none()) : py::object(py::int_(e.peer)));
      s.append(e.tag);
      s.append(shapes(e.in_shapes));
      s.append(dtypes(e.in_dtypes));
      s.append(shapes(e.out_shapes));
      s.append(dtypes(e.out_dtypes));
      s.append(e.timeout_ms);
      s.append(e.t_created);
      s.append(e.t_started);
      s.append(e.t_done ? py::object(py::int_(e.t_done)) : py::object(py::none()));
      s.append(py::str(state_name(e.state, e.kind)));
      s.append(py::none());  // frames: not recorded on the native path
      s.append(e.tid);
      s.append(py::none());  // generation: Python's
      s.append(e.async);
      s.append(e.error.empty() ? py::object(py::none()) : py::object(py::str(e.error)));
      s.append(e.root < 0 ? py::object(py::none()) : py::object(py::int_(e.root)));
      s.append(e.reduce_op ? py::object(py::str(e.reduce_op)) : py::object(py::none()));
      out.append(s);
    }
    return out;
  }

  // The distinct (op, peer) pairs of the live entries (peer -1: none): what render() needs a group text for.
  std::vector<std::pair<std::string, int64_t>> keys() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::pair<std::string, int64_t>> out;
    int64_t n = static_cast<int64_t>(slots_.size());
    for (int64_t rid = std::max<int64_t>(0, next_ - n); rid < next_; ++rid) {
      const Entry& e = slots_[rid % n];
      std::pair<std::string, int64_t> k(e.op, e.peer);
      if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(std::move(k));
    }
    return out;
  }

  // The live entries, oldest first, as (time_created_ns, record id, JSON text) where the text is one entry of the
  // dump (flight_recorder/entries.py: entries_json) from "record_id":N, on -- the caller numbers the merged entries:
  // {"record_id":N,<text>. group_texts: (op, peer) -> the group's fields ("pg_id" ... "peer_global"), as Python
  // writes them; generation and ranks: the group's (root_global = ranks[root]); thread_names: ident -> name.
  struct Rendered {
    int64_t t_created, rid;
    std::string text;
  };
  std::vector<Rendered> render(const std::map<std::pair<std::string, int64_t>, std::string>& group_texts,
                               int64_t generation, const std::vector<int64_t>& ranks,
                               const std::unordered_map<uint64_t, std::string>& thread_names) {
    std::vector<Entry> copy = live();
    std::vector<Rendered> out;
    out.reserve(copy.size());
    std::string unknown = "unknown";
    for (const Entry& e : copy) {
      std::string t;
      t.reserve(640);
      auto g = group_texts.find({e.op, e.peer});
      if (g != group_texts.end()) t += g->second;
      t += ",\"collective_seq_id\":"; num(t, e.cseq);
      t += ",\"p2p_seq_id\":"; num(t, e.pseq);
      t += ",\"op_id\":"; num(t, e.op_id);
      t += ",\"time_created_ns\":"; num(t, e.t_created);
      t += ",\"time_discovered_started_ns\":"; num(t, e.t_started);
      t += ",\"time_discovered_completed_ns\":";
      if (e.t_done) num(t, e.t_done); else t += "null";
      t += ",\"duration_ms\":";
      if (e.t_done) real(t, static_cast<double>(e.t_done - e.t_created) / 1e6); else t += "null";
      const char* st = state_name(e.state, e.kind);
      t += ",\"state\":\""; t += st; t += '"';
      t += ",\"input_sizes\":"; sizes(t, e.in_shapes);
      t += ",\"output_sizes\":"; sizes(t, e.out_shapes);
      t += ",\"input_dtypes\":"; dtype_list(t, e.in_dtypes);
      t += ",\"output_dtypes\":"; dtype_list(t, e.out_dtypes);
      t += ",\"timeout_ms\":"; num(t, e.timeout_ms);
      t += e.p2p ? ",\"is_p2p\":true" : ",\"is_p2p\":false";
      t += e.state != kInProgress ? ",\"retired\":true" : ",\"retired\":false";
      t += ",\"frames\":[],\"thread_name\":";
      auto tn = thread_names.find(e.tid);
      quoted(t, tn != thread_names.end() ? tn->second : unknown);
      t += ",\"thread_id\":\""; t += std::to_string(e.tid); t += '"';
      t += ",\"generation\":"; num(t, generation);
      t += ",\"tag\":"; num(t, e.tag);
      t += e.async ? ",\"async_op\":true" : ",\"async_op\":false";
      t += ",\"error\":";
      if (e.error.empty()) t += "null"; else quoted(t, e.error);
      t += ",\"root\":";
      if (e.root < 0) t += "null"; else num(t, e.root);
      t += ",\"root_global\":";
      if (e.root >= 0 && e.root < static_cast<int64_t>(ranks.size())) num(t, ranks[e.root]); else t += "null";
      t += ",\"reduce_op\":";
      if (e.reduce_op) quoted(t, e.reduce_op); else t += "null";
      t += '}';
      out.push_back({e.t_created, e.rid, std::move(t)});
    }
    return out;
  }

  // A copy of the live entries, oldest first.
  std::vector<Entry> live() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<Entry> copy;
    int64_t n = static_cast<int64_t>(slots_.size());
    copy.reserve(slots_.size());
    for (int64_t rid = std::max<int64_t>(0, next_ - n); rid < next_; ++rid) copy.push_back(slots_[rid % n]);
    return copy;
  }

  std::vector<int64_t> counters() {
    std::lock_guard<std::mutex> lk(mu_);
    return std::vector<int64_t>(counters_, counters_ + 8);
  }

  void set_counters(const std::vector<int64_t>& c) {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < 8 && i < c.size(); ++i) counters_[i] = c[i];
  }

  int64_t recorded() {
    std::lock_guard<std::mutex> lk(mu_);
    return next_;
  }

 private:
  static void num(std::string& t, int64_t v) {
    char buf[24];
    auto r = std::to_chars(buf, buf + sizeof(buf), v);
    t.append(buf, r.ptr);
  }
  // A double as JSON: the shortest text that reads back to the same value (Python's repr may spell it otherwise,
  // "12.0" for "12"; json readers get the same number).
  static void real(std::string& t, double v) {
    char buf[32];
    auto r = std::to_chars(buf, buf + sizeof(buf), v);
    t.append(buf, r.ptr);
  }
  // A JSON string, ASCII only as Python's json.dumps writes it: quote, backslash and control characters escaped,
  // every non-ASCII code point as \uXXXX (surrogate pairs above U+FFFF); a malformed UTF-8 byte as U+FFFD.
  static void quoted(std::string& t, const std::string& s) {
    static const char* hex = "0123456789abcdef";
    auto u = [&](uint32_t c) {
      t += "\\u";
      for (int sh = 12; sh >= 0; sh -= 4) t += hex[(c >> sh) & 0xF];
    };
    t += '"';
    size_t i = 0, n = s.size();
    while (i < n) {
      auto b = static_cast<unsigned char>(s[i]);
      if (b < 0x80) {
        switch (b) {
          case '"': t += "\\\""; break;
          case '\\': t += "\\\\"; break;
          case '\n': t += "\\n"; break;
          case '\r': t += "\\r"; break;
          case '\t': t += "\\t"; break;
          case '\b': t += "\\b"; break;
          case '\f': t += "\\f"; break;
          default:
            if (b < 0x20 || b == 0x7f) u(b); else t += static_cast<char>(b);
        }
        ++i;
        continue;
      }
      int len = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
      uint32_t cp = len == 4 ? b & 0x07 : len == 3 ? b & 0x0F : b & 0x1F;
      bool ok = len > 0 && i + len <= n;
      for (int k = 1; ok && k < len; ++k) {
        auto c = static_cast<unsigned char>(s[i + k]);
        ok = (c & 0xC0) == 0x80;
        cp = (cp << 6) | (c & 0x3F);
      }
      if (!ok) {
        u(0xFFFD);
        ++i;
        continue;
      }
      if (cp >= 0x10000) {
        cp -= 0x10000;
        u(0xD800 + (cp >> 10));
        u(0xDC00 + (cp & 0x3FF));
      } else {
        u(cp);
      }
      i += len;
    }
    t += '"';
  }
  static void sizes(std::string& t, const std::vector<std::vector<int64_t>>& s) {
    t += '[';
    for (size_t i = 0; i < s.size(); ++i) {
      if (i) t += ',';
      t += '[';
      for (size_t j = 0; j < s[i].size(); ++j) {
        if (j) t += ',';
        num(t, s[i][j]);
      }
      t += ']';
    }
    t += ']';
  }
  static void dtype_list(std::string& t, const std::vector<c10::ScalarType>& d) {
    t += '[';
    for (size_t i = 0; i < d.size(); ++i) {
      if (i) t += ',';
      t += '"';
      t += c10::toString(d[i]);
      t += '"';
    }
    t += ']';
  }
  static void fill(std::vector<std::vector<int64_t>>& shapes, std::vector<c10::ScalarType>& dtypes,
                   const std::vector<at::Tensor>& ts) {
    shapes.resize(ts.size());
    dtypes.resize(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      auto sz = ts[i].sizes();
      shapes[i].assign(sz.begin(), sz.end());
      dtypes[i] = ts[i].scalar_type();
    }
  }
  static py::tuple shapes(const std::vector<std::vector<int64_t>>& s) {
    py::tuple t(s.size());
    for (size_t i = 0; i < s.size(); ++i) t[i] = py::tuple(py::cast(s[i]));
    return t;
  }
  static py::tuple dtypes(const std::vector<c10::ScalarType>& d) {
    py::tuple t(d.size());
    for (size_t i = 0; i < d.size(); ++i) t[i] = py::str(c10::toString(d[i]));
    return t;
  }
  static const char* state_name(uint8_t state, uint8_t kind) {
    switch (state) {
      case kInProgress: return "started";
      case kCompleted: return "completed";
      case kAborted: return "aborted";
      default: return kind == kTimeout ? "timed_out" : "error";
    }
  }

  std::mutex mu_;
  std::vector<Entry> slots_;
  int64_t next_ = 0;
  int64_t counters_[8] = {0, 0, -1, -1, -1, -1, -1, -1};
};

// ------------------------------------------------------------------------------------------------ shared state
class NativeWork;

struct Failure {
  uint8_t kind = kNone;
  std::string op, message;
  int64_t op_id = 0, peer = -1;
};

// What the backend, its Works, its watchdog and its waiter threads share (a Work may outlive the backend).
struct Core {
  explicit Core(int64_t capacity) : ring(capacity) {}
  std::mutex mu;  // guards inflight, aborted, first
  std::unordered_map<int64_t, c10::intrusive_ptr<NativeWork>> inflight;  // op_id -> Work
  std::condition_variable watchdog_cv;
  bool stop = false;
  bool aborted = false;
  std::atomic<bool> broken{false};  // errored or aborted: every later op goes to the Python path
  Failure first;                    // the first failure (kind kNone: none yet)
  Ring ring;
  py::object make_error;  // (kind, op, op_id, message, peer) -> exception instance; set by Python
  // Never-raise mode (a fault-tolerant group, see NativeBackend::set_staged): a failed op's wait() returns, its
  // outputs are marked invalid whether or not a future hands them out, and the failure goes to `on_swallowed`
  // (kind, op, op_id, message, peer) on the waiting thread instead of being raised. Set before the first op.
  bool never_raise = false;
  py::object on_swallowed;

  void stop_watchdog() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    watchdog_cv.notify_all();
  }

  void note_failure(uint8_t kind, const char* op, int64_t op_id, const std::string& msg, int64_t peer) {
    std::lock_guard<std::mutex> lk(mu);
    if (first.kind == kNone) first = Failure{kind, op, msg, op_id, peer};
    broken.store(true, std::memory_order_release);
  }
};

// The values of torchnext.comms.process_group.work.invalid_value: NaN for floating point and complex, the most
// negative value of a signed integer type, the largest of an unsigned one; a bool is left as it is.
template <class T>
c10::Scalar extreme() {
  return std::numeric_limits<T>::is_signed ? c10::Scalar(static_cast<int64_t>(std::numeric_limits<T>::min()))
                                           : c10::Scalar(static_cast<uint64_t>(std::numeric_limits<T>::max()));
}

bool invalid_value(at::ScalarType st, c10::Scalar* out) {
  if (at::isFloatingType(st) || at::isComplexType(st)) {
    *out = c10::Scalar(std::numeric_limits<double>::quiet_NaN());
    return true;
  }
  switch (st) {
    case at::kChar: *out = extreme<int8_t>(); return true;
    case at::kShort: *out = extreme<int16_t>(); return true;
    case at::kInt: *out = extreme<int32_t>(); return true;
    case at::kLong: *out = extreme<int64_t>(); return true;
    case at::kByte: *out = extreme<uint8_t>(); return true;
    case at::kUInt16: *out = extreme<uint16_t>(); return true;
    case at::kUInt32: *out = extreme<uint32_t>(); return true;
    case at::kUInt64: *out = extreme<uint64_t>(); return true;
    default: return false;  // bool (and anything without a marking value)
  }
}

void mark_invalid(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    c10::Scalar v;
    if (t.defined() && invalid_value(t.scalar_type(), &v)) {
      try {
        at::NoGradGuard g;
        t.fill_(v);
      } catch (...) {
      }
    }
  }
}

// Private buffers for the in-place ops of a never-raise backend, reused while their ops succeed: take() a buffer
// shaped like the caller's tensor (holding its values), put() it back after a successful op. A failed op's buffer is
// never put back: an abandoned inner backend may still write into it (its own Work keeps it alive).
class StagingPool {
 public:
  static constexpr size_t kKeep = 4;  // free buffers kept per (shape, dtype): DDP has a few buckets in flight

  at::Tensor take(const at::Tensor& t) {
    at::Tensor buf;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = free_.find(key(t));
      if (it != free_.end() && !it->second.empty()) {
        buf = std::move(it->second.back());
        it->second.pop_back();
      }
    }
    if (!buf.defined()) buf = at::empty(t.sizes(), t.options());
    at::NoGradGuard g;
    buf.copy_(t);
    return buf;
  }

  void put(at::Tensor buf) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& list = free_[key(buf)];
    if (list.size() < kKeep) list.push_back(std::move(buf));
  }

 private:
  using Key = std::pair<std::vector<int64_t>, int>;
  static Key key(const at::Tensor& t) {
    return {std::vector<int64_t>(t.sizes().begin(), t.sizes().end()), static_cast<int>(t.scalar_type())};
  }
  std::mutex mu_;
  std::map<Key, std::vector<at::Tensor>> free_;
};

// A never-raise op's failure, told to Python (Core::on_swallowed) by the thread that waited on it.
void report_swallowed(Core& core, uint8_t kind, const std::string& op, int64_t op_id, const std::string& msg,
                      int64_t peer) {
  py::gil_scoped_acquire gil;
  if (!core.on_swallowed) return;
  try {
    core.on_swallowed(static_cast<int>(kind), op, op_id, msg, peer);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("torchnext native backend: reporting a failed op");
  }
}

[[noreturn]] void raise_python(Core& core, uint8_t kind, const std::string& op, int64_t op_id,
                               const std::string& msg, int64_t peer) {
  {
    py::gil_scoped_acquire gil;
    if (core.make_error) {
      py::object exc = core.make_error(static_cast<int>(kind), op, op_id, msg, peer);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw py::error_already_set();
    }
  }
  throw c10::DistBackendError(op + " (op_id=" + std::to_string(op_id) + "): " + msg);
}

// ------------------------------------------------------------------------------------------------- the Work
class NativeWork : public Work {
 public:
  NativeWork(std::shared_ptr<Core> core, const char* op, OpType type, int64_t op_id, std::vector<at::Tensor> outputs,
             std::chrono::milliseconds timeout, int64_t rid, int64_t peer)
      : Work(-1, type),
        core_(std::move(core)),
        op_(op),
        op_id_(op_id),
        outputs_(std::move(outputs)),
        timeout_(timeout),
        t0_(Clock::now()),
        deadline_(t0_ + timeout),
        rid_(rid),
        peer_(peer) {
    op_type_is_recv_any_ = type == OpType::RECVANYSOURCE;
  }

  // The one transition out of IN_PROGRESS (first caller wins). Returns whether this call made it.
  bool finish(uint8_t to, uint8_t kind, const std::string& msg) {
    if (state_.load(std::memory_order_acquire) != kInProgress) return false;
    std::string message = msg;
    if (to == kCompleted && finalize_) {  // e.g. all_to_all's copy out of its flat buffer
      try {
        finalize_();
      } catch (const std::exception& e) {
        to = kFailed;
        kind = kBackendError;
        message = e.what();
      }
    }
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    c10::intrusive_ptr<Work> drop_inner;  // dropped with no lock held (a Python decref may wait for the GIL)
    std::function<void()> drop_finalize;
    bool has_future;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      uint8_t expected = kInProgress;
      if (!state_.compare_exchange_strong(expected, to, std::memory_order_acq_rel)) return false;
      kind_ = kind;
      message_ = message;
      t_end_ = Clock::now();
      if (to != kCompleted) exception_ = std::make_exception_ptr(c10::DistBackendError(describe()));
      if (inner_ && op_type_is_recv_any_) {
        try {
          source_rank_ = inner_->sourceRank();
        } catch (...) {
        }
      }
      drop_inner = std::move(inner_);  // breaks work -> inner work -> its future -> our callback -> work
      drop_finalize = std::move(finalize_);
      finalize_ = nullptr;
      has_future = static_cast<bool>(future_);
    }
    drop_inner.reset();
    drop_finalize = nullptr;
    if (!staged_.empty()) {
      // an in-place op run on staging buffers: the caller's tensors get the result only when it succeeded, and the
      // buffers go back to the pool; a failed op's buffers are dropped (its inner Work may still write into them)
      if (to == kCompleted) {
        try {
          at::NoGradGuard g;
          for (size_t i = 0; i < staged_.size() && i < outputs_.size(); ++i) {
            if (divide_by_ > 0)  // AVG: the division fused with the copy back (one pass, not two)
              at::div_out(outputs_[i], staged_[i], at::native::wrapped_scalar_tensor(c10::Scalar(divide_by_)));
            else
              outputs_[i].copy_(staged_[i]);
          }
          if (pool_)
            for (auto& b : staged_) pool_->put(b);
        } catch (...) {
        }
      }
      staged_.clear();
      pool_.reset();
    }
    // Bookkeeping before anyone sees the op terminal (as post hooks run before wait() returns on the Python path):
    // the group's failure noted, invalid outputs marked where a future will hand them out (a waiter gets the
    // exception instead), the Flight Recorder entry finished.
    if (to != kCompleted) {
      if (to == kFailed && breaks_) core_->note_failure(kind, op_, op_id_, message, peer_);
      if (has_future || core_->never_raise) mark_invalid(outputs_);
    }
    core_->ring.complete(rid_, to, kind, to == kCompleted ? std::string() : message);
    c10::intrusive_ptr<NativeWork> self;  // the table's reference, dropped after the lock
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      auto it = core_->inflight.find(op_id_);
      if (it != core_->inflight.end()) {
        self = std::move(it->second);
        core_->inflight.erase(it);
      }
    }
    self.reset();
    if (core_->never_raise) {
      // A never-raise (fault-tolerant) op completes its future -- its callbacks run -- before its waiters are
      // released, as the Python path's order under the GIL makes it: DDP's reducer waits on the used-parameter
      // map's Work, and the early vote (ft's DistributedDataParallel(vote_early=True)) is sent by that op's future
      // callback; releasing the reducer first let the training thread reach commit() and vote first. A callback
      // that waits on this Work on this thread does not block (see wait()).
      {
        std::lock_guard<std::mutex> lk(mutex_);
        publishing_ = true;  // getFuture() from now on hands out a completed future
        fut = future_;
      }
      finisher_.store(std::this_thread::get_id(), std::memory_order_release);
      if (fut) fut->markCompleted(c10::IValue(outputs_));
      {
        std::lock_guard<std::mutex> lk(mutex_);
        completed_ = true;
        done_.store(true, std::memory_order_release);
      }
      cv_.notify_all();
      return true;
    }
    {
      std::lock_guard<std::mutex> lk(mutex_);
      completed_ = true;
      done_.store(true, std::memory_order_release);
      fut = future_;
    }
    cv_.notify_all();
    if (fut) fut->markCompleted(c10::IValue(outputs_));
    return true;
  }

  bool isCompleted() override { return done_.load(std::memory_order_acquire); }
  bool isSuccess() const override { return state_.load(std::memory_order_acquire) == kCompleted; }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lk(mutex_);
    return exception_;
  }

  int sourceRank() const override {
    std::lock_guard<std::mutex> lk(mutex_);
    if (source_rank_ < 0) TORCH_CHECK(false, op_, ": no source rank (not a completed recv from any source)");
    return static_cast<int>(source_rank_);
  }

  std::vector<at::Tensor> result() override {
    wait();
    return outputs_;
  }

  void synchronize() override {}

  // Block until terminal (or the op's deadline: then the op times out, or `timeout`: RuntimeError, the op keeps
  // running); raise the op's exception if it did not complete.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    auto until = deadline_;
    bool bounded = timeout != kNoTimeout && timeout.count() > 0;
    if (bounded) until = std::min(until, Clock::now() + timeout);
    if (!done_.load(std::memory_order_acquire) &&
        finisher_.load(std::memory_order_acquire) == std::this_thread::get_id()) {
      return outcome();  // a future callback of this op waits on it (see finish): its outcome is settled
    }
    if (!done_.load(std::memory_order_acquire)) {
      NoGil nogil;
      std::unique_lock<std::mutex> lk(mutex_);
      cv_.wait_until(lk, until, [&] { return done_.load(std::memory_order_acquire); });
    }
    if (!done_.load(std::memory_order_acquire)) {
      if (Clock::now() >= deadline_) {
        NoGil nogil;
        time_out();
        std::unique_lock<std::mutex> lk(mutex_);  // another thread may be finishing it: wait for its bookkeeping
        cv_.wait(lk, [&] { return done_.load(std::memory_order_acquire); });
      } else {
        TORCH_CHECK(false, op_, ": wait() timed out after ", timeout.count(),
                    " ms (the op is still in flight; wait again, or abort the group)");
      }
    }
    return outcome();
  }

  // wait()'s result once the op is terminal: true, or (a failure) the never-raise report or the exception.
  bool outcome() {
    uint8_t s = state_.load(std::memory_order_acquire);
    if (s == kCompleted) return true;
    std::string msg;
    uint8_t kind;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      msg = message_;
      kind = kind_;
    }
    if (core_->never_raise) {  // recorded, not raised: outputs already marked invalid (finish)
      report_swallowed(*core_, kind, op_, op_id_, msg, peer_);
      return true;
    }
    raise_python(*core_, kind, op_, op_id_, msg, peer_);
  }

  // Block until terminal without raising (the synchronous path): the op's deadline times it out, abort() ends it.
  // The caller holds no GIL.
  void settle() {
    if (done_.load(std::memory_order_acquire)) return;
    {
      std::unique_lock<std::mutex> lk(mutex_);
      if (cv_.wait_until(lk, deadline_, [&] { return done_.load(std::memory_order_acquire); })) return;
    }
    time_out();
    std::unique_lock<std::mutex> lk(mutex_);  // another thread may be finishing it: wait for its bookkeeping
    cv_.wait(lk, [&] { return done_.load(std::memory_order_acquire); });
  }

  // An op the inner backend ran inline, already completed when its issue returned, with no future: finished by the
  // issuing thread, after the issue lock is released, instead of by a waiter thread. (Not Gloo's reduce-scatters,
  // as was assumed here: in torch 2.13 their Work never reports completion -- the allreduce is waited for and the
  // chunk copied out inside its wait() -- so they went to a waiter thread; see NativeBackend::rs_as_allreduce_.)
  // Reference::
  //
  //   inner.exception() ? finish(FAILED, its message) : finish(COMPLETED)
  void finish_inline() {
    c10::intrusive_ptr<Work> iw = std::move(ran_inline_);
    if (!iw) return;
    std::exception_ptr ex = iw->exception();
    if (!ex) {
      finish(kCompleted, kNone, "");
      return;
    }
    try {
      std::rethrow_exception(ex);
    } catch (const std::exception& e) {
      finish(kFailed, kBackendError, e.what());
    }
  }

  void time_out() {
    finish(kFailed, kTimeout,
           "did not complete within its timeout of " + fmt_seconds(timeout_) + " (the communicator is now errored)");
  }

  void abort() override { finish(kAborted, kAbort, "cancelled by abort()"); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    bool done;
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      if (!future_) {
        future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
        done = done_.load(std::memory_order_acquire) || publishing_;
        fut = future_;
      } else {
        return future_;
      }
    }
    if (done) {
      if (state_.load(std::memory_order_acquire) != kCompleted) mark_invalid(outputs_);
      fut->markCompleted(c10::IValue(outputs_));
    }
    return fut;
  }

  float getDuration() const override {
    std::lock_guard<std::mutex> lk(mutex_);
    auto end = completed_ ? t_end_ : Clock::now();
    return std::chrono::duration<float, std::milli>(end - t0_).count();
  }

  uint64_t getSequencenumber() const override { return static_cast<uint64_t>(op_id_); }

  Clock::time_point deadline() const { return deadline_; }
  int64_t op_id() const { return op_id_; }
  const char* op() const { return op_; }
  uint8_t state() const { return state_.load(std::memory_order_acquire); }

  std::string describe() const {
    return std::string(op_) + " (op_id=" + std::to_string(op_id_) + "): " + message_;
  }

  static std::string fmt_seconds(std::chrono::milliseconds ms) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3fs", ms.count() / 1000.0);
    return buf;
  }

  // The inner backend's Work while this op is in flight (null once it ended) and the seconds left to its deadline:
  // what an abort hands to the communicator's grave (the inner op may run on after this Work was finished).
  std::pair<c10::intrusive_ptr<Work>, double> inner_and_left() {
    std::lock_guard<std::mutex> lk(mutex_);
    return {inner_, std::chrono::duration<double>(deadline_ - Clock::now()).count()};
  }

  void set_inner(const c10::intrusive_ptr<Work>& iw) {
    std::lock_guard<std::mutex> lk(mutex_);
    if (state_.load(std::memory_order_acquire) == kInProgress) inner_ = iw;
  }

  // set by the backend before the Work is published (inner_: by set_inner)
  c10::intrusive_ptr<Work> inner_;
  c10::intrusive_ptr<Work> ran_inline_;  // an inner Work completed at issue, with no future (see finish_inline)
  std::function<void()> finalize_;
  std::vector<at::Tensor> staged_;     // staging buffers of an in-place op (outputs_: the caller's tensors)
  std::shared_ptr<StagingPool> pool_;  // where they go back after a success
  int64_t divide_by_ = 0;              // > 0: an AVG run as SUM on the staging buffers; outputs = staged / this
  bool op_type_is_recv_any_ = false;
  bool breaks_ = true;

 private:
  std::shared_ptr<Core> core_;
  const char* op_;
  int64_t op_id_;
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  Clock::time_point t0_, deadline_, t_end_;
  int64_t rid_;
  int64_t peer_;
  std::atomic<uint8_t> state_{kInProgress};  // the state machine: one CAS out of IN_PROGRESS
  std::atomic<bool> done_{false};            // the terminal state is published (bookkeeping done)
  uint8_t kind_ = kNone;
  std::string message_;
  int64_t source_rank_ = -1;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool publishing_ = false;                 // never-raise: terminal, the future being completed (guarded by mutex_)
  std::atomic<std::thread::id> finisher_{};  // never-raise: the thread completing the future
};

// ------------------------------------------------------------------------------- watchdog and waiter threads
// One watchdog per backend: times out ops past their deadline that nobody waits on (a waiter enforces its own op's
// deadline exactly). It looks at the in-flight table every kWatchdogPeriod and is never woken per op: on a small
// machine a thread wake-up per op costs more than the op. Detached; it owns a reference to the Core and leaves
// once `stop` is set.
constexpr auto kWatchdogPeriod = std::chrono::milliseconds(50);

void watchdog(std::shared_ptr<Core> core) {
  pthread_setname_np(pthread_self(), "tn-watchdog");  // (15 characters at most) what `top -H` and /proc show
  std::unique_lock<std::mutex> lk(core->mu);
  while (!core->stop) {
    auto now = Clock::now();
    auto next = now + kWatchdogPeriod;
    std::vector<c10::intrusive_ptr<NativeWork>> expired;
    for (auto& kv : core->inflight) {
      auto d = kv.second->deadline();
      if (d <= now) expired.push_back(kv.second);
      else if (d < next) next = d;
    }
    if (!expired.empty()) {
      lk.unlock();
      for (auto& w : expired) w->time_out();
      expired.clear();
      lk.lock();
      continue;
    }
    core->watchdog_cv.wait_until(lk, next);
  }
}

// Waits on inner Works that have no future (Gloo's send/recv, its list-form reduce_scatter, and its
// _reduce_scatter_base when run as the reference): a pool that grows when every thread
// is busy (a recv may wait for long), threads detached.
class WaiterPool {
 public:
  struct Job {
    c10::intrusive_ptr<Work> inner;
    c10::intrusive_ptr<NativeWork> work;
    std::chrono::milliseconds timeout;
  };

  void push(Job job) {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->jobs.push_back(std::move(job));
    if (state_->idle == 0) {
      std::thread(run, state_).detach();
    } else {
      state_->cv.notify_one();
    }
  }

  ~WaiterPool() {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->stop = true;
    state_->cv.notify_all();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> jobs;
    int idle = 0;
    bool stop = false;
  };

  static void run(std::shared_ptr<State> st) {
    pthread_setname_np(pthread_self(), "tn-waiter");
    std::unique_lock<std::mutex> lk(st->mu);
    while (true) {
      while (st->jobs.empty() && !st->stop) {
        ++st->idle;
        st->cv.wait(lk);
        --st->idle;
      }
      if (st->jobs.empty()) return;
      Job job = std::move(st->jobs.front());
      st->jobs.pop_front();
      lk.unlock();
      try {
        job.inner->wait(job.timeout);
        job.work->finish(kCompleted, kNone, "");
      } catch (const std::exception& e) {
        job.work->finish(kFailed, kBackendError, e.what());
      }
      job = Job{};
      lk.lock();
    }
  }

  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// The Work of an op run on the Python path: the Python path's Work (a GroupWork) seen from C++. Every method asks
// the Python object (torch's PyWorkHolder forwards only wait() and getFuture(), so is_completed(), exception() or a
// recv's source rank would read the base Work's never-set state).
class PyPathWork : public Work {
 public:
  explicit PyPathWork(py::object work) : Work(-1, OpType::UNKNOWN), py_(std::move(work)) {}

  ~PyPathWork() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      py_ = py::object();
    } else {
      py_.release();
    }
  }

  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return py_.attr("is_completed")().cast<bool>();
  }
  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return py_.attr("is_success")().cast<bool>();
  }
  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object exc = py_.attr("exception")();
    if (exc.is_none()) return nullptr;
    return std::make_exception_ptr(c10::DistBackendError(py::str(exc).cast<std::string>()));
  }
  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return py_.attr("source_rank")().cast<int>();
  }
  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    py::object r = py_.attr("result")();
    try {
      return r.cast<std::vector<at::Tensor>>();
    } catch (const py::cast_error&) {
      return {};  // a nested layout (all_gather's list of lists): no flat tensor list to give
    }
  }
  void synchronize() override {
    py::gil_scoped_acquire gil;
    py_.attr("synchronize")();
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    py::gil_scoped_acquire gil;
    return py_.attr("wait")(timeout).cast<bool>();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    py::gil_scoped_acquire gil;
    py::object fut = py_.attr("get_future")();
    return fut.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  }

 private:
  py::object py_;
};

// ----------------------------------------------------------------------------------------------- the Backend
bool plain(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous();
}

bool all_plain(const std::vector<at::Tensor>& ts, c10::ScalarType dtype) {
  for (const auto& t : ts) {
    if (!plain(t) || t.scalar_type() != dtype) return false;
  }
  return true;
}

// The ReduceOp's name as the Python recorder writes it (ReduceOp._value_), or nullptr: not on the fast path.
const char* reduce_name(const c10d::ReduceOp& op, c10::ScalarType dtype) {
  if (dtype == c10::kBool) return nullptr;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "sum";
    case c10d::ReduceOp::PRODUCT: return "product";
    case c10d::ReduceOp::MIN: return "min";
    case c10d::ReduceOp::MAX: return "max";
    case c10d::ReduceOp::AVG: return (c10::isFloatingType(dtype) || c10::isComplexType(dtype)) ? "avg" : nullptr;
    default: return nullptr;  // PREMUL_SUM, bitwise ops: the Python path
  }
}

// PREMUL_SUM on the fast path, as the Python path runs it (process_group/group.py: _premul): SUM of each rank's
// input multiplied by the factor -- `in * factor` in a new tensor of in's dtype (a double factor, or the one-element
// factor tensor as a 0-dim tensor on in's device), the caller's input untouched. False: not here (no factor, a
// factor or input that is not floating: the Python path validates and raises).
bool premul_input(const c10d::ReduceOp& op, const at::Tensor& in, at::Tensor& scaled) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return false;
  auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  if (sup == nullptr || !(c10::isFloatingType(in.scalar_type()) || c10::isComplexType(in.scalar_type()))) return false;
  if (sup->tensor_factor.defined()) {
    const at::Tensor& f = sup->tensor_factor;
    if (f.numel() != 1 || !(c10::isFloatingType(f.scalar_type()) || c10::isComplexType(f.scalar_type()))) return false;
    scaled = at::mul(in, f.reshape({}).to(in.device())).to(in.scalar_type());
  } else {
    scaled = at::mul(in, at::Scalar(sup->double_factor));
  }
  return true;
}

// The inner Works an abort left running (see NativeBackend::abort_all), as one object for the communicator's grave:
// completed once every one of them is.
struct RunningWorks {
  std::vector<c10::intrusive_ptr<Work>> works;
  bool is_completed() {
    for (auto& w : works) {
      try {
        if (!w->isCompleted()) return false;
      } catch (...) {  // a Work that raises is finished with an error
      }
    }
    return true;
  }
};

class NativeBackend : public c10d::Backend {
 public:
  NativeBackend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size, std::chrono::milliseconds timeout,
                int64_t fr_capacity, py::object python_path, py::object make_error)
      : Backend(rank, size),
        inner_(std::move(inner)),
        timeout_(timeout),
        core_(std::make_shared<Core>(fr_capacity)),
        python_path_(std::move(python_path)) {
    core_->make_error = std::move(make_error);
    inner_gloo_ = inner_->getBackendName() == "gloo";
    rs_as_allreduce_.store(inner_gloo_, std::memory_order_release);
    std::thread(watchdog, core_).detach();
  }

  ~NativeBackend() override {
    c10::intrusive_ptr<c10d::Backend> drop;
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      core_->stop = true;
      drop = std::move(inner_);
    }
    drop.reset();
    core_->watchdog_cv.notify_all();
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      python_path_ = py::object();
      core_->make_error = py::object();
      core_->on_swallowed = py::object();
    } else {
      python_path_.release();
      core_->make_error.release();
      core_->on_swallowed.release();
    }
  }

  const std::string getBackendName() const override { return "torchnext-native"; }

  void setTimeout(std::chrono::milliseconds timeout) override { timeout_.store(timeout); }

  // ------------------------------------------------------------------------------------ controls (from Python)
  void set_python_mode(bool on) { python_mode_.store(on, std::memory_order_release); }
  // Run _reduce_scatter_base through the inner backend's own reduce-scatter (`on`: the reference) or, for Gloo, as
  // its allreduce plus a copy out (see rs_as_allreduce_).
  void set_rs_reference(bool on) {
    rs_as_allreduce_.store(!on && inner_gloo_, std::memory_order_release);
  }
  bool rs_reference() const { return !rs_as_allreduce_.load(std::memory_order_acquire); }
  // How the fast path's ops were finished so far: by the inner Work's future callback, by the issuing thread (an op
  // the inner backend ran inline), by a waiter thread (an inner Work with no future).
  std::array<int64_t, 3> handoffs() const {
    return {handoffs_[0].load(), handoffs_[1].load(), handoffs_[2].load()};
  }

  // Never-raise staged mode (a fault-tolerant group; call before the first op): all_reduce, broadcast and reduce
  // run on private staging buffers copied back only on success, a failed op never raises (its outputs are marked
  // invalid, `on_swallowed(kind, op, op_id, message, peer)` is told on the waiting thread), and every other op goes
  // to the Python path (whose out-of-place ops have their own guard against an abandoned backend's late writes).
  void set_staged(py::object on_swallowed) {
    core_->on_swallowed = std::move(on_swallowed);
    core_->never_raise = true;
    pool_ = std::make_shared<StagingPool>();
  }
  bool staged() const { return static_cast<bool>(pool_); }
  bool python_mode() const { return python_mode_.load(std::memory_order_acquire); }
  int64_t op_counter() const { return op_counter_.load(); }
  void set_op_counter(int64_t n) { op_counter_.store(n); }

  // Finish every op in flight as ABORTED (their waiters raise at once), refuse later ops (the Python path raises
  // the abort's CommAborted) and drop the inner backend (the Python side buries it).
  // Returns the inner Works of the ops it finished, each with the seconds left to its deadline: the inner backend
  // may still run them (Gloo cannot cancel an op), so Python hands them to the communicator's grave -- the reaper
  // releases the backend, and the interpreter's exit drains, only once they ended.
  std::vector<std::pair<c10::intrusive_ptr<Work>, double>> abort_all(const std::string& reason) {
    std::vector<c10::intrusive_ptr<NativeWork>> works;
    c10::intrusive_ptr<c10d::Backend> drop;
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      core_->aborted = true;
      core_->broken.store(true, std::memory_order_release);
      if (core_->first.kind == kNone) core_->first = Failure{kAbort, "abort", reason, 0, -1};
      for (auto& kv : core_->inflight) works.push_back(kv.second);
      drop = std::move(inner_);
    }
    drop.reset();
    // oldest first: a thread waiting on its ops in order is released by the first of them
    std::sort(works.begin(), works.end(), [](const auto& a, const auto& b) { return a->op_id() < b->op_id(); });
    std::string msg = "cancelled by abort()" + (reason.empty() ? std::string() : " (" + reason + ")");
    std::vector<std::pair<c10::intrusive_ptr<Work>, double>> running;
    for (auto& w : works) {
      auto inner = w->inner_and_left();
      if (inner.first) running.push_back(std::move(inner));
    }
    for (auto& w : works) w->finish(kAborted, kAbort, msg);
    core_->stop_watchdog();  // nothing in flight, nothing issued any more
    return running;
  }

  // Let go of the inner backend once the ops in flight are done (bounded by their deadlines): shutdown.
  void release() {
    std::vector<c10::intrusive_ptr<NativeWork>> works;
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      for (auto& kv : core_->inflight) works.push_back(kv.second);
    }
    {
      py::gil_scoped_release nogil;
      for (auto& w : works) {
        try {
          w->Work::wait();  // the base: the state machine's cv (no Python exception)
        } catch (...) {
        }
      }
    }
    c10::intrusive_ptr<c10d::Backend> drop;
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      core_->broken.store(true, std::memory_order_release);
      drop = std::move(inner_);
    }
    py::gil_scoped_release nogil;
    drop.reset();
    core_->stop_watchdog();
  }

  // The first failure as (kind, op, op_id, message, peer), or None.
  py::object first_failure() {
    std::lock_guard<std::mutex> lk(core_->mu);
    if (core_->first.kind == kNone) return py::none();
    const Failure& f = core_->first;
    return py::make_tuple(static_cast<int>(f.kind), f.op, f.op_id, f.message, f.peer);
  }

  bool broken() const { return core_->broken.load(std::memory_order_acquire); }
  size_t in_flight() {
    std::lock_guard<std::mutex> lk(core_->mu);
    return core_->inflight.size();
  }
  Ring& ring() { return core_->ring; }

  // ---------------------------------------------------------------------------------------------- reductions
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& opts) override {
    const char* rop = ts.size() == 1 && plain(ts[0]) ? reduce_name(opts.reduceOp, ts[0].scalar_type()) : nullptr;
    if (!fast(true) || rop == nullptr || opts.sparseIndices.has_value())
      return python_op("allreduce", [&] { return py::make_tuple(py::cast(ts), py::cast(opts, py::return_value_policy::copy)); });
    if (staged() && opts.reduceOp.op_ == c10d::ReduceOp::AVG) {
      // Gloo's AVG is SUM, then `t /= size` over the result: here SUM on the staging buffer, and the division done
      // by the copy back into the caller's tensor (bitwise the same quotient, one pass over the buffer less)
      c10d::AllreduceOptions sum = opts;
      sum.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
      return issue_staged("all_reduce", OpType::ALLREDUCE, ts, -1, rop, opts.timeout, opts.asyncOp,
                          [&](c10d::Backend& b, std::vector<at::Tensor>& s) { return b.allreduce(s, sum); },
                          getSize());
    }
    if (staged())
      return issue_staged("all_reduce", OpType::ALLREDUCE, ts, -1, rop, opts.timeout, opts.asyncOp,
                          [&](c10d::Backend& b, std::vector<at::Tensor>& s) { return b.allreduce(s, opts); });
    return issue("all_reduce", OpType::ALLREDUCE, ts, ts, -1, -1, 0, rop, opts.timeout, opts.asyncOp,
                 [&](c10d::Backend& b) { return b.allreduce(ts, opts); });
  }

  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& opts) override {
    const char* rop = ts.size() == 1 && plain(ts[0]) ? reduce_name(opts.reduceOp, ts[0].scalar_type()) : nullptr;
    if (!fast(true) || rop == nullptr || !valid_rank(opts.rootRank)) return python_op("reduce", [&] { return py::make_tuple(py::cast(ts), py::cast(opts, py::return_value_policy::copy)); });
    if (staged())
      return issue_staged("reduce", OpType::REDUCE, ts, opts.rootRank, rop, opts.timeout, opts.asyncOp,
                          [&](c10d::Backend& b, std::vector<at::Tensor>& s) { return b.reduce(s, opts); });
    return issue("reduce", OpType::REDUCE, ts, ts, opts.rootRank, -1, 0, rop, opts.timeout, opts.asyncOp,
                 [&](c10d::Backend& b) { return b.reduce(ts, opts); });
  }

  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                          const c10d::ReduceScatterOptions& opts) override {
    bool ok = fast() && outs.size() == 1 && ins.size() == 1 && plain(outs[0]) &&
              static_cast<int>(ins[0].size()) == getSize() && all_plain(ins[0], outs[0].scalar_type());
    if (ok)
      for (const auto& t : ins[0]) ok = ok && t.sizes() == outs[0].sizes();
    const char* rop = ok ? reduce_name(opts.reduceOp, outs[0].scalar_type()) : nullptr;
    std::vector<std::vector<at::Tensor>> scaled;
    c10d::ReduceScatterOptions sum = opts;
    if (ok && rop == nullptr && opts.reduceOp.op_ == c10d::ReduceOp::PREMUL_SUM) {
      scaled.emplace_back(ins[0].size());
      for (size_t i = 0; ok && i < ins[0].size(); ++i) ok = premul_input(opts.reduceOp, ins[0][i], scaled[0][i]);
      if (ok) {
        rop = "sum";  // what the Python path records: the SUM of the pre-multiplied inputs
        sum.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
      }
    }
    if (rop == nullptr) return python_op("reduce_scatter", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
    auto& src = scaled.empty() ? ins : scaled;
    return issue("reduce_scatter", OpType::REDUCE_SCATTER, ins[0], outs, -1, -1, 0, rop, opts.timeout, opts.asyncOp,
                 [&](c10d::Backend& b) { return b.reduce_scatter(outs, src, sum); });
  }

  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                const c10d::ReduceScatterOptions& opts) override {
    bool ok = fast() && plain(out) && plain(in) && in.scalar_type() == out.scalar_type() &&
              in.numel() == out.numel() * getSize();
    const char* rop = ok ? reduce_name(opts.reduceOp, out.scalar_type()) : nullptr;
    at::Tensor scaled;
    c10d::ReduceScatterOptions sum = opts;
    if (ok && rop == nullptr && premul_input(opts.reduceOp, in, scaled)) {  // FSDP2's gradient reduce-scatter
      rop = "sum";  // what the Python path records: the SUM of the pre-multiplied inputs
      sum.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    }
    if (rop == nullptr) return python_op("_reduce_scatter_base", [&] { return py::make_tuple(py::cast(out), py::cast(in), py::cast(opts, py::return_value_policy::copy)); });
    // flat views, as the Python path passes them (Gloo checks chunk shapes against the input's shape)
    at::Tensor fo = out.view({-1}), fi = (scaled.defined() ? scaled : in).view({-1});
    if (rs_as_allreduce_.load(std::memory_order_acquire)) {
      // Gloo's own reduce-scatter, as this backend runs it (see rs_as_allreduce_): the same allreduce of a private
      // copy of the input, the rank's chunk copied out when the allreduce's future completes. A pre-multiplied
      // input is already a private copy.
      at::Tensor buf = scaled.defined() ? fi : at::empty_like(fi);  // filled under NoGil, in the launch below
      bool copy_in = !scaled.defined();
      c10d::AllreduceOptions ar;
      ar.reduceOp = sum.reduceOp;
      ar.timeout = opts.timeout;
      ar.asyncOp = opts.asyncOp;
      int64_t n = fo.numel(), off = getRank() * n;
      auto copy_out = [fo, buf, off, n]() {
        at::NoGradGuard g;
        fo.copy_(buf.narrow(0, off, n));
      };
      return issue("reduce_scatter_single", OpType::_REDUCE_SCATTER_BASE, {in}, {out}, -1, -1, 0, rop, opts.timeout,
                   opts.asyncOp, [&](c10d::Backend& b) {
                     if (copy_in) {
                       at::NoGradGuard g;
                       buf.copy_(fi);
                     }
                     std::vector<at::Tensor> ts{buf};
                     return b.allreduce(ts, ar);
                   }, copy_out);
    }
    return issue("reduce_scatter_single", OpType::_REDUCE_SCATTER_BASE, {in}, {out}, -1, -1, 0, rop, opts.timeout,
                 opts.asyncOp, [&](c10d::Backend& b) { return b._reduce_scatter_base(fo, fi, sum); });
  }

  // ------------------------------------------------------------------------------------------- data movement
  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& opts) override {
    if (!fast(true) || ts.size() != 1 || !plain(ts[0]) || !valid_rank(opts.rootRank))
      return python_op("broadcast", [&] { return py::make_tuple(py::cast(ts), py::cast(opts, py::return_value_policy::copy)); });
    if (staged())
      return issue_staged("broadcast", OpType::BROADCAST, ts, opts.rootRank, nullptr, opts.timeout, opts.asyncOp,
                          [&](c10d::Backend& b, std::vector<at::Tensor>& s) { return b.broadcast(s, opts); });
    return issue("broadcast", OpType::BROADCAST, ts, ts, opts.rootRank, -1, 0, nullptr, opts.timeout, opts.asyncOp,
                 [&](c10d::Backend& b) { return b.broadcast(ts, opts); });
  }

  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                     const c10d::AllgatherOptions& opts) override {
    bool ok = fast() && ins.size() == 1 && outs.size() == 1 && plain(ins[0]) &&
              static_cast<int>(outs[0].size()) == getSize() && all_plain(outs[0], ins[0].scalar_type());
    if (ok)
      for (const auto& t : outs[0]) ok = ok && t.sizes() == ins[0].sizes();
    if (!ok) return python_op("allgather", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
    return issue("all_gather", OpType::ALLGATHER, ins, outs[0], -1, -1, 0, nullptr, opts.timeout, opts.asyncOp,
                 [&](c10d::Backend& b) { return b.allgather(outs, ins, opts); });
  }

  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::AllgatherOptions& opts) override {
    bool ok = fast() && plain(out) && plain(in) && in.scalar_type() == out.scalar_type() &&
              out.numel() == in.numel() * getSize();
    if (!ok) return python_op("_allgather_base", [&] { return py::make_tuple(py::cast(out), py::cast(in), py::cast(opts, py::return_value_policy::copy)); });
    at::Tensor fo = out.view({-1}), fi = in.view({-1});
    return issue("all_gather_single", OpType::_ALLGATHER_BASE, {in}, {out}, -1, -1, 0, nullptr, opts.timeout,
                 opts.asyncOp, [&](c10d::Backend& b) { return b._allgather_base(fo, fi, opts); });
  }

  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                         std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts) override {
    bool ok = fast() && plain(out) && plain(in) && in.scalar_type() == out.scalar_type() && in.dim() >= 1 &&
              out.dim() >= 1 && splits_ok(out_splits, out) && splits_ok(in_splits, in);
    if (!ok)
      return python_op("alltoall_base", [&] { return py::make_tuple(py::cast(out), py::cast(in), py::cast(out_splits), py::cast(in_splits),
                    py::cast(opts, py::return_value_policy::copy)); });
    return issue("all_to_all_single", OpType::ALLTOALL_BASE, {in}, {out}, -1, -1, 0, nullptr, opts.timeout,
                 opts.asyncOp, [&](c10d::Backend& b) { return b.alltoall_base(out, in, out_splits, in_splits, opts); });
  }

  // The list form runs as one all_to_all_single over flat buffers, always (as the Python path does on Gloo: every
  // rank must take the same path, and a rank cannot see the other ranks' sizes).
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                    const c10d::AllToAllOptions& opts) override {
    bool ok = fast() && !ins.empty() && static_cast<int>(ins.size()) == getSize() && outs.size() == ins.size() &&
              all_plain(ins, ins[0].scalar_type()) && all_plain(outs, ins[0].scalar_type());
    if (!ok) return python_op("alltoall", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
    std::vector<at::Tensor> flat_in;
    std::vector<int64_t> in_splits, out_splits;
    int64_t out_total = 0;
    for (const auto& t : ins) {
      flat_in.push_back(t.reshape({-1}));
      in_splits.push_back(t.numel());
    }
    for (const auto& t : outs) {
      out_splits.push_back(t.numel());
      out_total += t.numel();
    }
    at::Tensor in_buf = at::cat(flat_in);
    at::Tensor out_buf = at::empty({out_total}, outs[0].options());
    std::vector<at::Tensor> targets = outs;
    auto finalize = [targets, out_buf, out_splits]() {
      int64_t off = 0;
      for (size_t i = 0; i < targets.size(); ++i) {
        targets[i].view({-1}).copy_(out_buf.narrow(0, off, out_splits[i]));
        off += out_splits[i];
      }
    };
    return issue("all_to_all", OpType::ALLTOALL, ins, outs, -1, -1, 0, nullptr, opts.timeout, opts.asyncOp,
                 [&](c10d::Backend& b) { return b.alltoall_base(out_buf, in_buf, out_splits, in_splits, opts); },
                 finalize);
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    if (!fast()) return python_op("barrier", [&] { return py::make_tuple(py::cast(opts, py::return_value_policy::copy)); });
    return issue("barrier", OpType::BARRIER, {}, {}, -1, -1, 0, nullptr, opts.timeout, opts.asyncOp,
                 [&](c10d::Backend& b) { return b.barrier(opts); });
  }

  // ----------------------------------------------------------------------------------------- point to point
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    if (!fast() || ts.size() != 1 || !plain(ts[0]) || !valid_peer(dst) || tag < 0)
      return python_op("send", [&] { return py::make_tuple(py::cast(ts), dst, tag); });
    return issue("send", OpType::SEND, ts, {}, -1, dst, tag, nullptr, c10d::kUnsetTimeout, true,
                 [&](c10d::Backend& b) { return b.send(ts, dst, tag); });
  }

  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    if (!fast() || ts.size() != 1 || !plain(ts[0]) || !valid_peer(src) || tag < 0)
      return python_op("recv", [&] { return py::make_tuple(py::cast(ts), src, tag); });
    return issue("recv", OpType::RECV, {}, ts, -1, src, tag, nullptr, c10d::kUnsetTimeout, true,
                 [&](c10d::Backend& b) { return b.recv(ts, src, tag); });
  }

  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    if (!fast() || ts.size() != 1 || !plain(ts[0]) || tag < 0)
      return python_op("recv_anysource", [&] { return py::make_tuple(py::cast(ts), tag); });
    return issue("recv", OpType::RECVANYSOURCE, {}, ts, -1, -1, tag, nullptr, c10d::kUnsetTimeout, true,
                 [&](c10d::Backend& b) { return b.recvAnysource(ts, tag); });
  }

  // --------------------------------------------------------------- the rest: the Python path (validates, runs)
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                               const c10d::AllreduceCoalescedOptions& opts) override {
    return python_op("allreduce_coalesced", [&] { return py::make_tuple(py::cast(ts), py::cast(opts, py::return_value_policy::copy)); });
  }
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                               std::vector<at::Tensor>& ins,
                                               const c10d::AllgatherOptions& opts) override {
    return python_op("allgather_coalesced", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                           std::vector<at::Tensor>& ins,
                                                           const c10d::AllgatherOptions& opts) override {
    return python_op("allgather_into_tensor_coalesced", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                           std::vector<at::Tensor>& ins,
                                                           const c10d::ReduceScatterOptions& opts) override {
    return python_op("reduce_scatter_tensor_coalesced", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
  }
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                  const c10d::GatherOptions& opts) override {
    return python_op("gather", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                   const c10d::ScatterOptions& opts) override {
    return python_op("scatter", [&] { return py::make_tuple(py::cast(outs), py::cast(ins), py::cast(opts, py::return_value_policy::copy)); });
  }

 private:
  // Whether an op goes on the fast path; `inplace`: one of the ops a staged backend runs natively.
  bool fast(bool inplace = false) const {
    return !python_mode_.load(std::memory_order_acquire) && !core_->broken.load(std::memory_order_acquire) &&
           (inplace || !pool_);
  }
  bool valid_rank(int64_t r) const { return r >= 0 && r < getSize(); }
  bool valid_peer(int64_t r) const { return valid_rank(r) && r != getRank(); }
  bool splits_ok(const std::vector<int64_t>& splits, const at::Tensor& t) const {
    if (splits.empty()) return t.size(0) % getSize() == 0;
    if (static_cast<int>(splits.size()) != getSize()) return false;
    int64_t total = 0;
    for (auto s : splits) {
      if (s < 0) return false;
      total += s;
    }
    return total == t.size(0);
  }

  std::chrono::milliseconds op_timeout(std::chrono::milliseconds t) const {
    return t.count() > 0 ? t : timeout_.load();  // kUnsetTimeout (-1) and 0: the default
  }

  // The Python path of the group for this op: `python_path(name, *make_args())` under the GIL (the arguments are
  // built there: pybind casts need the GIL). Its Work is a Python object; PyWorkHolder keeps it alive.
  template <class MakeArgs>
  c10::intrusive_ptr<Work> python_op(const char* name, MakeArgs&& make_args) {
    NoGil nogil;                               // the order: issue_mu_, then the GIL (never the other way round)
    std::lock_guard<std::mutex> order(issue_mu_);
    py::gil_scoped_acquire gil;
    TORCH_CHECK(python_path_, "torchnext native backend: no Python path for ", name);
    py::tuple args = make_args();
    py::object work = python_path_(name, *args);
    return c10::make_intrusive<PyPathWork>(std::move(work));
  }

  // Issue one op on the fast path. `async` false (`opts.asyncOp`, torch's `async_op=False`): the synchronous path
  // -- the op is waited for here, in C++ with no GIL and no issue lock held, and returned terminal; torch's Python
  // wrapper then calls wait() on a finished Work (it raises a failed op's exception: see NativeWork::wait).
  template <class Launch>
  c10::intrusive_ptr<Work> issue(const char* op, OpType type, const std::vector<at::Tensor>& ins,
                                 const std::vector<at::Tensor>& outs, int64_t root, int64_t peer, int64_t tag,
                                 const char* rop, std::chrono::milliseconds timeout, bool async, Launch&& launch,
                                 std::function<void()> finalize = nullptr) {
    NoGil nogil;  // see NoGil
    c10::intrusive_ptr<NativeWork> work = hand_over(op, type, ins, outs, root, peer, tag, rop, timeout, async,
                                                    std::forward<Launch>(launch), std::move(finalize));
    work->finish_inline();
    if (!async) work->settle();
    return work;
  }

  // An in-place op of a staged backend: `launch(inner, staged)` on private copies of `ts`, whose result reaches
  // `ts` only when the op succeeded (NativeWork::finish); `divide_by` > 0: divided by it on the way (AVG).
  template <class Launch>
  c10::intrusive_ptr<Work> issue_staged(const char* op, OpType type, std::vector<at::Tensor>& ts, int64_t root,
                                        const char* rop, std::chrono::milliseconds timeout, bool async,
                                        Launch&& launch, int64_t divide_by = 0) {
    NoGil nogil;  // the copy in needs no GIL
    std::vector<at::Tensor> staged;
    staged.reserve(ts.size());
    for (const auto& t : ts) staged.push_back(pool_->take(t));
    c10::intrusive_ptr<NativeWork> work = hand_over(
        op, type, ts, ts, root, -1, 0, rop, timeout, async,
        [&](c10d::Backend& b) { return launch(b, staged); }, nullptr, &staged, divide_by);
    work->finish_inline();
    if (!async) work->settle();
    return work;
  }

  template <class Launch>
  c10::intrusive_ptr<NativeWork> hand_over(const char* op, OpType type, const std::vector<at::Tensor>& ins,
                                           const std::vector<at::Tensor>& outs, int64_t root, int64_t peer,
                                           int64_t tag, const char* rop, std::chrono::milliseconds timeout,
                                           bool async, Launch&& launch, std::function<void()> finalize,
                                           const std::vector<at::Tensor>* staged = nullptr, int64_t divide_by = 0) {
    std::lock_guard<std::mutex> order(issue_mu_);  // one op handed over at a time (see issue_mu_)
    auto td = op_timeout(timeout);
    int64_t op_id = ++op_counter_;
    bool p2p = type == OpType::SEND || type == OpType::RECV || type == OpType::RECVANYSOURCE;
    int64_t rid = core_->ring.record(op, p2p, op_id, peer, tag, root, rop, ins, outs, td.count(), async);
    auto work = c10::make_intrusive<NativeWork>(core_, op, type, op_id, outs, td, rid, peer);
    work->finalize_ = std::move(finalize);
    if (staged != nullptr) {
      work->staged_ = *staged;
      work->pool_ = pool_;
      work->divide_by_ = divide_by;
    }
    c10::intrusive_ptr<c10d::Backend> inner;
    {
      std::lock_guard<std::mutex> lk(core_->mu);
      if (!core_->aborted && inner_) {
        inner = inner_;
        core_->inflight.emplace(op_id, work);
      }
    }
    if (!inner) {  // aborted (or released) since fast() said yes
      work->finish(kAborted, kAbort, "refused: the group was aborted");
      return work;
    }
    c10::intrusive_ptr<Work> iw;
    try {
      iw = launch(*inner);
    } catch (const std::exception& e) {
      // the backend refused the op while issuing it (nothing was issued): the group stays usable
      work->breaks_ = false;
      work->finish(kFailed, kBackendError, e.what());
      throw;
    }
    work->set_inner(iw);
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    try {
      fut = iw->getFuture();
    } catch (const std::exception&) {
      fut.reset();
    }
    if (fut) {
      c10::intrusive_ptr<NativeWork> w = work;
      fut->addCallback([w](c10::ivalue::Future& f) {
        if (f.hasError()) {
          w->finish(kFailed, kBackendError, f.tryRetrieveErrorMessage());
        } else {
          w->finish(kCompleted, kNone, "");
        }
      });
    } else if (iw->isCompleted()) {
      work->ran_inline_ = iw;  // the issuing thread finishes it once the issue lock is released (finish_inline)
    } else {
      waiters_.push(WaiterPool::Job{iw, work, td});
    }
    handoffs_[fut ? 0 : work->ran_inline_ ? 1 : 2].fetch_add(1, std::memory_order_relaxed);
    return work;
  }

  std::atomic<bool> python_mode_{false};
  // Whether _reduce_scatter_base runs as the inner backend's allreduce of a copy of its input plus a copy out of this
  // rank's chunk (true for Gloo, whose reduce-scatter is exactly that: ProcessGroupGloo::reduce_scatter_tensor_coalesced
  // in torch 2.13) rather than the inner backend's own reduce-scatter, the reference (set_rs_reference). Gloo's
  // reduce-scatter returns a Work with no future that never reports completion (the allreduce's wait and the copy out
  // run inside its wait()), so a waiter thread had to wait on it, and the caller was woken by that thread: two more
  // wake-ups per op (~20 context switches per FSDP2 step of 4 reduce-scatters), ~0.2-0.25 ms per 4 MiB op on 2 cores
  // (paired ratio to torch's group 0.955; 1.009 this way). The allreduce's future finishes the op on Gloo's own
  // thread, as for every other op. Same results bit for bit (the same allreduce on the same values).
  std::atomic<bool> rs_as_allreduce_{false};
  bool inner_gloo_ = false;  // the inner backend is Gloo (set once, at construction)
  std::atomic<int64_t> handoffs_[3] = {};  // see handoffs()
  // Several threads issuing on one group are serialized from the op's id to its hand-off to the inner backend (and
  // an op sent to the Python path likewise), as torch's own groups take them and as the Python path does: without
  // it two threads' ops got their ids, Flight Recorder records and inner-backend order interleaved differently, and
  // across ranks the inner backend paired one thread's op with the other's. Held without the GIL.
  std::mutex issue_mu_;
  std::atomic<int64_t> op_counter_{0};
  c10::intrusive_ptr<c10d::Backend> inner_;  // guarded by core_->mu (read under it when issuing)
  std::atomic<std::chrono::milliseconds> timeout_;
  std::shared_ptr<Core> core_;
  std::shared_ptr<StagingPool> pool_;  // set: staged never-raise mode (set_staged)
  WaiterPool waiters_;
  py::object python_path_;  // (name, *args) -> Work: the Python path of the group
};

// The backend a fault-tolerant group registers once: every op goes to the current generation's NativeBackend, which
// the group swaps at each reconfiguration (`switch_to`). An op keeps the backend -- and so the inner backend, Core,
// ring and op counter -- of the generation it was issued in.
class SwitchBackend : public c10d::Backend {
 public:
  explicit SwitchBackend(c10::intrusive_ptr<NativeBackend> first) : Backend(0, 1), cur_(std::move(first)) {}

  const std::string getBackendName() const override { return "torchnext-native-switch"; }

  void switch_to(c10::intrusive_ptr<NativeBackend> next) {
    c10::intrusive_ptr<NativeBackend> old;
    {
      std::lock_guard<std::mutex> lk(mu_);
      old = std::move(cur_);
      cur_ = std::move(next);
    }
    py::gil_scoped_release nogil;  // the old one may be destroyed here
    old.reset();
  }

  c10::intrusive_ptr<NativeBackend> current() const {
    std::lock_guard<std::mutex> lk(mu_);
    return cur_;
  }

  void setTimeout(std::chrono::milliseconds timeout) override { current()->setTimeout(timeout); }

  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    return current()->allreduce(ts, o);
  }
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                               const c10d::AllreduceCoalescedOptions& o) override {
    return current()->allreduce_coalesced(ts, o);
  }
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    return current()->reduce(ts, o);
  }
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                          const c10d::ReduceScatterOptions& o) override {
    return current()->reduce_scatter(outs, ins, o);
  }
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                const c10d::ReduceScatterOptions& o) override {
    return current()->_reduce_scatter_base(out, in, o);
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                           const c10d::ReduceScatterOptions& o) override {
    return current()->reduce_scatter_tensor_coalesced(outs, ins, o);
  }
  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    return current()->broadcast(ts, o);
  }
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                     const c10d::AllgatherOptions& o) override {
    return current()->allgather(outs, ins, o);
  }
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    return current()->_allgather_base(out, in, o);
  }
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                               std::vector<at::Tensor>& ins, const c10d::AllgatherOptions& o) override {
    return current()->allgather_coalesced(outs, ins, o);
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                           const c10d::AllgatherOptions& o) override {
    return current()->allgather_into_tensor_coalesced(outs, ins, o);
  }
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                                         std::vector<int64_t>& is, const c10d::AllToAllOptions& o) override {
    return current()->alltoall_base(out, in, os, is, o);
  }
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                    const c10d::AllToAllOptions& o) override {
    return current()->alltoall(outs, ins, o);
  }
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override { return current()->barrier(o); }
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    return current()->send(ts, dst, tag);
  }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return current()->recv(ts, src, tag);
  }
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return current()->recvAnysource(ts, tag);
  }
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                  const c10d::GatherOptions& o) override {
    return current()->gather(outs, ins, o);
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                   const c10d::ScatterOptions& o) override {
    return current()->scatter(outs, ins, o);
  }

 private:
  mutable std::mutex mu_;
  c10::intrusive_ptr<NativeBackend> cur_;
};

}  // namespace torchnext_native

// ------------------------------------------------------------------------------------------------ the module
namespace torchnext_native {

NativeBackend& native(const c10::intrusive_ptr<c10d::Backend>& b) {
  auto* n = dynamic_cast<NativeBackend*>(b.get());
  TORCH_CHECK(n != nullptr, "not a torchnext native backend: ", b->getBackendName());
  return *n;
}

c10::intrusive_ptr<NativeBackend> native_ptr(const c10::intrusive_ptr<c10d::Backend>& b) {
  native(b);  // checks the type
  return c10::intrusive_ptr<NativeBackend>::reclaim_copy(static_cast<NativeBackend*>(b.get()));
}

SwitchBackend& switch_backend(const c10::intrusive_ptr<c10d::Backend>& b) {
  auto* s = dynamic_cast<SwitchBackend*>(b.get());
  TORCH_CHECK(s != nullptr, "not a torchnext switch backend: ", b->getBackendName());
  return *s;
}

// The entries as dicts (fr_dicts), built with the CPython API: a dump of 2,000 entries through py::list slots and
// Python's formatter took ~8 ms, these ~1.5 ms. Every value a new reference handed to the dict.
py::list entry_dicts(const std::vector<Entry>& entries, const py::dict& group_dicts, int64_t generation,
                     const std::vector<int64_t>& ranks, const py::dict& thread_names) {
  static const char* names[] = {"collective_seq_id", "p2p_seq_id", "op_id", "time_created_ns",
                                "time_discovered_started_ns", "time_discovered_completed_ns", "duration_ms", "state",
                                "input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "timeout_ms",
                                "is_p2p", "retired", "frames", "thread_name", "thread_id", "generation", "tag",
                                "async_op", "error", "root", "root_global", "reduce_op"};
  enum { CSEQ, PSEQ, OPID, TCREATED, TSTARTED, TDONE, DUR, STATE, INS, OUTS, INDT, OUTDT, TIMEOUT, P2P, RETIRED,
         FRAMES, TNAME, TID, GEN, TAG, ASYNC, ERR, ROOT, ROOTG, ROP, NKEYS };
  static PyObject* keys[NKEYS] = {nullptr};
  if (keys[0] == nullptr)
    for (int i = 0; i < NKEYS; ++i) keys[i] = PyUnicode_InternFromString(names[i]);  // kept for the process
  auto put = [](PyObject* d, PyObject* k, PyObject* v) {  // steals v
    if (v == nullptr) throw py::error_already_set();
    int rc = PyDict_SetItem(d, k, v);
    Py_DECREF(v);
    if (rc != 0) throw py::error_already_set();
  };
  auto borrowed = [](PyObject* v) { Py_INCREF(v); return v; };
  auto int_or_none = [&](bool present, int64_t v) { return present ? PyLong_FromLongLong(v) : borrowed(Py_None); };

  std::map<std::pair<std::string, int64_t>, py::object> groups;
  for (auto item : group_dicts) {
    auto key = item.first.cast<py::tuple>();
    groups[{key[0].cast<std::string>(), key[1].is_none() ? -1 : key[1].cast<int64_t>()}] =
        py::reinterpret_borrow<py::object>(item.second);
  }
  std::unordered_map<uint64_t, py::object> tnames;
  for (auto item : thread_names) tnames[item.first.cast<uint64_t>()] = py::reinterpret_borrow<py::object>(item.second);
  py::str unknown("unknown");
  py::int_ gen(generation);
  py::list frames;  // one empty list for every entry, as the reference shares equal frame lists
  std::map<std::vector<std::vector<int64_t>>, py::object> size_lists;
  std::map<std::vector<c10::ScalarType>, py::object> dtype_lists;
  auto sizes = [&](const std::vector<std::vector<int64_t>>& s) {
    auto it = size_lists.find(s);
    if (it == size_lists.end()) {
      py::list l;
      for (auto& shape : s) l.append(py::cast(shape));
      it = size_lists.emplace(s, std::move(l)).first;
    }
    return borrowed(it->second.ptr());
  };
  auto dtypes = [&](const std::vector<c10::ScalarType>& d) {
    auto it = dtype_lists.find(d);
    if (it == dtype_lists.end()) {
      py::list l;
      for (auto t : d) l.append(py::str(c10::toString(t)));
      it = dtype_lists.emplace(d, std::move(l)).first;
    }
    return borrowed(it->second.ptr());
  };

  py::list out;
  for (const Entry& e : entries) {
    auto g = groups.find({e.op, e.peer});
    py::object d = py::reinterpret_steal<py::object>(g != groups.end() ? PyDict_Copy(g->second.ptr()) : PyDict_New());
    if (!d) throw py::error_already_set();
    PyObject* p = d.ptr();
    put(p, keys[CSEQ], PyLong_FromLongLong(e.cseq));
    put(p, keys[PSEQ], PyLong_FromLongLong(e.pseq));
    put(p, keys[OPID], PyLong_FromLongLong(e.op_id));
    put(p, keys[TCREATED], PyLong_FromLongLong(e.t_created));
    put(p, keys[TSTARTED], PyLong_FromLongLong(e.t_started));
    put(p, keys[TDONE], int_or_none(e.t_done != 0, e.t_done));
    put(p, keys[DUR], e.t_done ? PyFloat_FromDouble(static_cast<double>(e.t_done - e.t_created) / 1e6)
                               : borrowed(Py_None));
    put(p, keys[STATE], PyUnicode_InternFromString(Ring::state_of(e)));
    put(p, keys[INS], sizes(e.in_shapes));
    put(p, keys[OUTS], sizes(e.out_shapes));
    put(p, keys[INDT], dtypes(e.in_dtypes));
    put(p, keys[OUTDT], dtypes(e.out_dtypes));
    put(p, keys[TIMEOUT], PyLong_FromLongLong(e.timeout_ms));
    put(p, keys[P2P], PyBool_FromLong(e.p2p));
    put(p, keys[RETIRED], PyBool_FromLong(e.state != kInProgress));
    put(p, keys[FRAMES], borrowed(frames.ptr()));
    auto tn = tnames.find(e.tid);
    put(p, keys[TNAME], borrowed(tn != tnames.end() ? tn->second.ptr() : unknown.ptr()));
    put(p, keys[TID], PyUnicode_FromString(std::to_string(e.tid).c_str()));
    put(p, keys[GEN], borrowed(gen.ptr()));
    put(p, keys[TAG], PyLong_FromLongLong(e.tag));
    put(p, keys[ASYNC], PyBool_FromLong(e.async));
    put(p, keys[ERR], e.error.empty() ? borrowed(Py_None)
                                      : PyUnicode_DecodeUTF8(e.error.data(), static_cast<Py_ssize_t>(e.error.size()),
                                                             "replace"));
    put(p, keys[ROOT], int_or_none(e.root >= 0, e.root));
    bool rooted = e.root >= 0 && e.root < static_cast<int64_t>(ranks.size());
    put(p, keys[ROOTG], int_or_none(rooted, rooted ? ranks[e.root] : 0));
    put(p, keys[ROP], e.reduce_op ? PyUnicode_InternFromString(e.reduce_op) : borrowed(Py_None));
    out.append(py::make_tuple(e.t_created, e.rid, std::move(d)));
  }
  return out;
}

void init_ddp(py::module_& m);  // csrc/ddp.cpp

}  // namespace torchnext_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace torchnext_native;
  using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
  m.doc() = "torchnext's native process-group backend (see torchnext/comms/native/__init__.py)";
  m.def("abi_version", [] { return kAbiVersion; });
  init_ddp(m);
  m.def(
      "create",
      [](BackendPtr inner, int rank, int size, std::chrono::milliseconds timeout, int64_t fr_capacity,
         py::object python_path, py::object make_error) -> BackendPtr {
        TORCH_CHECK(inner, "create: no inner backend");
        return c10::make_intrusive<NativeBackend>(std::move(inner), rank, size, timeout, fr_capacity,
                                                  std::move(python_path), std::move(make_error));
      },
      py::arg("inner"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("fr_capacity"),
      py::arg("python_path"), py::arg("make_error"));
  m.def("set_timeout", [](const BackendPtr& b, std::chrono::milliseconds t) { native(b).setTimeout(t); });
  m.def("set_python_mode", [](const BackendPtr& b, bool on) { native(b).set_python_mode(on); });
  m.def("set_staged", [](const BackendPtr& b, py::object on_swallowed) { native(b).set_staged(std::move(on_swallowed)); },
        py::arg("backend"), py::arg("on_swallowed"));
  m.def("create_switch", [](const BackendPtr& first) -> BackendPtr {
    return c10::make_intrusive<SwitchBackend>(native_ptr(first));
  });
  m.def("switch_to", [](const BackendPtr& s, const BackendPtr& next) { switch_backend(s).switch_to(native_ptr(next)); });
  m.def("switch_current", [](const BackendPtr& s) -> BackendPtr { return switch_backend(s).current(); });
  m.def("python_mode", [](const BackendPtr& b) { return native(b).python_mode(); });
  m.def("set_rs_reference", [](const BackendPtr& b, bool on) { native(b).set_rs_reference(on); });
  m.def("rs_reference", [](const BackendPtr& b) { return native(b).rs_reference(); });
  m.def("handoffs", [](const BackendPtr& b) {
    auto h = native(b).handoffs();
    py::dict d;
    d["future"] = h[0];
    d["inline"] = h[1];
    d["waiter"] = h[2];
    return d;
  });
  m.def("op_counter", [](const BackendPtr& b) { return native(b).op_counter(); });
  m.def("set_op_counter", [](const BackendPtr& b, int64_t n) { native(b).set_op_counter(n); });
  // abort() -> (RunningWorks, seconds to the latest deadline) or None: the inner Works Gloo may still run, as one
  // object (thousands of ops in flight: one Python object each made abort() slower than its 100 ms bound).
  py::class_<RunningWorks, std::shared_ptr<RunningWorks>>(m, "RunningWorks")
      .def("is_completed", &RunningWorks::is_completed, py::call_guard<py::gil_scoped_release>())
      .def("__len__", [](const RunningWorks& r) { return r.works.size(); });
  m.def("abort", [](const BackendPtr& b, const std::string& reason) -> py::object {
    std::vector<std::pair<c10::intrusive_ptr<Work>, double>> running;
    {
      py::gil_scoped_release nogil;
      running = native(b).abort_all(reason);
    }
    if (running.empty()) return py::none();
    auto works = std::make_shared<RunningWorks>();
    double left = 0.0;
    for (auto& [w, l] : running) {
      works->works.push_back(std::move(w));
      left = std::max(left, l);
    }
    return py::make_tuple(py::cast(works), left);
  });
  m.def("release", [](const BackendPtr& b) { native(b).release(); });
  m.def("first_failure", [](const BackendPtr& b) { return native(b).first_failure(); });
  m.def("broken", [](const BackendPtr& b) { return native(b).broken(); });
  m.def("in_flight", [](const BackendPtr& b) { return native(b).in_flight(); });
  m.def("fr_slots", [](const BackendPtr& b) { return native(b).ring().slots(); });
  m.def("fr_counters", [](const BackendPtr& b) { return native(b).ring().counters(); });
  m.def("fr_keys", [](const BackendPtr& b) {
    py::list out;
    for (auto& [op, peer] : native(b).ring().keys())
      out.append(py::make_tuple(op, peer < 0 ? py::object(py::none()) : py::object(py::int_(peer))));
    return out;
  });
  // The ring's entries as JSON texts (Ring::render): [(time_created_ns, record id, text)], oldest first.
  m.def("fr_render", [](const BackendPtr& b, const py::dict& group_texts, int64_t generation,
                        const std::vector<int64_t>& ranks, const py::dict& thread_names) {
    std::map<std::pair<std::string, int64_t>, std::string> texts;
    for (auto item : group_texts) {
      auto key = item.first.cast<py::tuple>();
      int64_t peer = key[1].is_none() ? -1 : key[1].cast<int64_t>();
      texts[{key[0].cast<std::string>(), peer}] = item.second.cast<std::string>();
    }
    std::unordered_map<uint64_t, std::string> names;
    for (auto item : thread_names) names[item.first.cast<uint64_t>()] = item.second.cast<std::string>();
    std::vector<Ring::Rendered> rendered;
    {
      py::gil_scoped_release nogil;
      rendered = native(b).ring().render(texts, generation, ranks, names);
    }
    py::list out;
    for (auto& r : rendered) out.append(py::make_tuple(r.t_created, r.rid, py::str(r.text)));
    return out;
  });
  // The ring's entries as the pickle dump's dicts (entries.py: format_entries(..., torch_compat=True), equal size /
  // dtype lists shared as there): [(time_created_ns, record id, dict)], oldest first, "record_id" left to the caller
  // (it numbers the merged entries). group_dicts: (op, peer) -> the group's fields ("pg_id" ... "peer_global"),
  // copied into each entry; generation, ranks, thread_names: as fr_render's.
  m.def("fr_dicts", [](const BackendPtr& b, const py::dict& group_dicts, int64_t generation,
                       const std::vector<int64_t>& ranks, const py::dict& thread_names) {
    std::vector<Entry> copy;
    {
      py::gil_scoped_release nogil;
      copy = native(b).ring().live();
    }
    return entry_dicts(copy, group_dicts, generation, ranks, thread_names);
  });
  m.def("fr_set_counters", [](const BackendPtr& b, const std::vector<int64_t>& c) { native(b).ring().set_counters(c); });
  m.def("fr_recorded", [](const BackendPtr& b) { return native(b).ring().recorded(); });
  // A measurement, for benchmarks/comms/bench_flight_recorder.py: nanoseconds per op of what the ring does for one
  // op of the fast path -- record() at issue and complete() at the end, one input and one output tensor of `numel`
  // elements -- over `n` ops into a fresh ring of `capacity` entries (0: the ring off, the cost of the check).
  m.def(
      "fr_record_cost",
      [](int64_t capacity, int64_t n, int64_t numel) {
        Ring ring(capacity);
        std::vector<at::Tensor> ts{at::zeros({numel}, at::kFloat)};
        auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < n; ++i) {
          int64_t rid = ring.record("all_reduce", false, i + 1, -1, 0, -1, "sum", ts, ts, 30000, true);
          ring.complete(rid, kCompleted, kNone, std::string());
        }
        auto dt = std::chrono::steady_clock::now() - t0;
        return std::chrono::duration<double, std::nano>(dt).count() / static_cast<double>(n > 0 ? n : 1);
      },
      py::arg("capacity"), py::arg("n"), py::arg("numel") = 1, py::call_guard<py::gil_scoped_release>());
}
