// torchnext.ft.DistributedDataParallel's data path in C++: no Python per bucket, none for the used-parameter map.
//
// A fault-tolerant group (torchnext/ft/process_group.py) keeps one Route, pointed at the native backend of its
// current generation, or at nothing when that generation runs on the Python path. Per op, from C++::
//
//     route(pg, tensors, opts):  backend = route.current
//                                backend ? backend->allreduce(tensors, opts)   # staged, never-raise (native.cpp)
//                                        : pg->allreduce(tensors, opts)        # the group's own method: its Python
//                                                                              #   path, through torch's trampoline
//
// The native backend itself sends an op to the group's Python path whenever the group asks for Python per op (a
// user hook, check_collectives) or its generation is broken, so both branches are the op the Python comm hook
// `ft.process_group.allreduce([bucket], AVG)` would have issued; they differ only in who pays for the call.
//
// * AverageHook: DDP's comm hook (c10d::CommHookInterface), AVG of the bucket buffer through the route; its result
//   is the future's first tensor (the bucket buffer itself: the staged op copies its result back into it).
// * RouteBackend: the c10d::Backend the DDP's own group (ft/ddp.py: _DDPGroup) takes its all_reduce from after
//   construction -- the used-parameter map of find_unused_parameters (int32 SUM) -- through the same route.
// * Counters (per DDP) say which branch ran: what tests check, what a user may look at.
// * Tracker: DistributedDataParallel(vote_early=True)'s count of one backward's ops (ft/ddp.py's _Backward is the
//   reference); `on_ready()` -- ft's early vote, the one Python call -- from the thread that completed the last op.

#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torchnext_native {

// The current generation's native backend of a fault-tolerant group, or none (set by Python at every
// reconfiguration; read per op from any thread).
class Route {
 public:
  void set(c10::intrusive_ptr<c10d::Backend> backend) {
    std::lock_guard<std::mutex> lk(mu_);
    cur_ = std::move(backend);
  }

  c10::intrusive_ptr<c10d::Backend> current() const {
    std::lock_guard<std::mutex> lk(mu_);
    return cur_;
  }

 private:
  mutable std::mutex mu_;
  c10::intrusive_ptr<c10d::Backend> cur_;
};

// How many ops of one DDP took each branch of the route.
struct RouteCounts {
  enum { kBucketNative, kBucketGroup, kUsedMapNative, kUsedMapGroup, kN };
  std::array<std::atomic<int64_t>, kN> n{};
  py::dict as_dict() const {
    py::dict d;
    d["bucket_native"] = n[kBucketNative].load();
    d["bucket_group"] = n[kBucketGroup].load();
    d["used_map_native"] = n[kUsedMapNative].load();
    d["used_map_group"] = n[kUsedMapGroup].load();
    return d;
  }
};

// The early vote's tracker (ft/ddp.py: _Backward, the same rules)::
//
//     on each op issued: pending += 1          on each completion: pending -= 1
//     if the last bucket and (the used map, if expected) were issued and pending == 0: on_ready()
class Tracker : public std::enable_shared_from_this<Tracker> {
 public:
  Tracker(bool expect_used_map, py::object on_ready)
      : expect_used_map_(expect_used_map), on_ready_(std::move(on_ready)) {}

  ~Tracker() {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      on_ready_ = py::object();
    } else {
      on_ready_.release();
    }
  }

  // Count `fut` (an op just issued); its completion is counted by a callback (run at once if it is complete).
  void add(const c10::intrusive_ptr<c10::ivalue::Future>& fut, bool last_bucket, bool used_map) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      last_bucket_ = last_bucket_ || last_bucket;  // the used map comes after the last bucket; a new backward
      used_map_ = used_map_ || used_map;           // starts over once the vote left
      ++pending_;
    }
    std::weak_ptr<Tracker> me = weak_from_this();
    fut->addCallback([me](c10::ivalue::Future&) {
      if (auto t = me.lock()) t->done();
    });
  }

 private:
  void done() {
    bool ready;
    {
      std::lock_guard<std::mutex> lk(mu_);
      --pending_;
      ready = pending_ == 0 && last_bucket_ && (used_map_ || !expect_used_map_);
      if (ready) last_bucket_ = used_map_ = false;
    }
    if (!ready) return;
    py::gil_scoped_acquire gil;
    try {
      on_ready_();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("torchnext DistributedDataParallel: the early vote");
    }
  }

  const bool expect_used_map_;
  py::object on_ready_;
  std::mutex mu_;
  int64_t pending_ = 0;
  bool last_bucket_ = false, used_map_ = false;
};

// One all_reduce through the route (see the top of this file); `native_slot`: the counter of the native branch
// (the group branch's is the next one).
c10::intrusive_ptr<c10d::Work> route_allreduce(const Route& route, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                               RouteCounts& counts, int native_slot, std::vector<at::Tensor>& ts,
                                               const c10d::AllreduceOptions& opts) {
  auto backend = route.current();
  if (backend && ts.size() == 1 && ts[0].device().is_cpu()) {
    counts.n[native_slot].fetch_add(1, std::memory_order_relaxed);
    return backend->allreduce(ts, opts);
  }
  counts.n[native_slot + 1].fetch_add(1, std::memory_order_relaxed);
  return pg->allreduce(ts, opts);
}

class AverageHook : public c10d::CommHookInterface {
 public:
  AverageHook(std::shared_ptr<Route> route, c10::intrusive_ptr<c10d::ProcessGroup> pg,
              std::shared_ptr<RouteCounts> counts, std::shared_ptr<Tracker> tracker)
      : route_(std::move(route)), pg_(std::move(pg)), counts_(std::move(counts)), tracker_(std::move(tracker)) {
    opts_.reduceOp = c10d::ReduceOp(c10d::ReduceOp::AVG);
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::vector<at::Tensor> ts{bucket.getBufferRef()};
    auto fut = route_allreduce(*route_, pg_, *counts_, RouteCounts::kBucketNative, ts, opts_)->getFuture();
    if (!tracker_) return fut;
    tracker_->add(fut, bucket.isLast(), false);
    // The reducer waits on the future returned here, and a Future releases its waiters before it runs its
    // callbacks: a future completed by the tracker's callback (registered first, so run first) keeps the training
    // thread in backward until the vote left -- the Python hook's `fut.then(...)` order.
    return fut->then([](c10::ivalue::Future& f) { return f.value(); }, fut->elementType());
  }

  // The native branch's future holds [buffer]; the group branch's (a Python Work's) the Python list [buffer].
  at::Tensor parseHookResult(const c10::IValue& result) override { return c10d::detail::parseCppCommHookResult(result); }

 private:
  std::shared_ptr<Route> route_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<RouteCounts> counts_;
  std::shared_ptr<Tracker> tracker_;  // vote_early, else null
  c10d::AllreduceOptions opts_;
};

// all_reduce through the route; every other op is refused (the DDP's group runs them in Python, on its one-rank
// local group, and never sends them here).
class RouteBackend : public c10d::Backend {
 public:
  RouteBackend(std::shared_ptr<Route> route, c10::intrusive_ptr<c10d::ProcessGroup> pg,
               std::shared_ptr<RouteCounts> counts, std::shared_ptr<Tracker> tracker, int rank, int size)
      : Backend(rank, size),
        route_(std::move(route)),
        pg_(std::move(pg)),
        counts_(std::move(counts)),
        tracker_(std::move(tracker)) {}

  const std::string getBackendName() const override { return "torchnext-ft-route"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& opts) override {
    auto work = route_allreduce(*route_, pg_, *counts_, RouteCounts::kUsedMapNative, ts, opts);
    if (tracker_) tracker_->add(work->getFuture(), false, true);
    return work;
  }

 private:
  std::shared_ptr<Route> route_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<RouteCounts> counts_;
  std::shared_ptr<Tracker> tracker_;  // vote_early, else null
};

void init_ddp(py::module_& m) {
  using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
  using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
  py::class_<Route, std::shared_ptr<Route>>(m, "Route")
      .def(py::init<>())
      .def(
          "set", [](Route& r, std::optional<BackendPtr> b) { r.set(b ? std::move(*b) : BackendPtr()); },
          py::arg("backend").none(true))
      .def("current", [](const Route& r) -> std::optional<BackendPtr> {
        auto b = r.current();
        return b ? std::optional<BackendPtr>(b) : std::nullopt;
      });
  py::class_<RouteCounts, std::shared_ptr<RouteCounts>>(m, "RouteCounts")
      .def(py::init<>())
      .def("as_dict", &RouteCounts::as_dict);
  py::class_<Tracker, std::shared_ptr<Tracker>>(m, "Tracker")
      .def(py::init<bool, py::object>(), py::arg("expect_used_map"), py::arg("on_ready"));
  // register_ddp_hook(reducer, route, group, counts, tracker): AverageHook on torch's Reducer (once per Reducer:
  // torch refuses a second hook).
  m.def(
      "register_ddp_hook",
      [](const std::shared_ptr<c10d::Reducer>& reducer, std::shared_ptr<Route> route, GroupPtr pg,
         std::shared_ptr<RouteCounts> counts, std::shared_ptr<Tracker> tracker) {
        TORCH_CHECK(reducer && route && pg && counts, "register_ddp_hook: missing argument");
        reducer->register_comm_hook(
            std::make_unique<AverageHook>(std::move(route), std::move(pg), std::move(counts), std::move(tracker)));
      },
      py::arg("reducer"), py::arg("route"), py::arg("group"), py::arg("counts"), py::arg("tracker").none(true));
  m.def(
      "create_route_backend",
      [](std::shared_ptr<Route> route, GroupPtr pg, std::shared_ptr<RouteCounts> counts,
         std::shared_ptr<Tracker> tracker, int rank, int size) -> BackendPtr {
        TORCH_CHECK(route && pg && counts, "create_route_backend: missing argument");
        return c10::make_intrusive<RouteBackend>(std::move(route), std::move(pg), std::move(counts),
                                                 std::move(tracker), rank, size);
      },
      py::arg("route"), py::arg("group"), py::arg("counts"), py::arg("tracker").none(true), py::arg("rank"),
      py::arg("size"));
}

}  // namespace torchnext_native
