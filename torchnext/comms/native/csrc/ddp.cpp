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
              std::shared_ptr<RouteCounts> counts)
      : route_(std::move(route)), pg_(std::move(pg)), counts_(std::move(counts)) {
    opts_.reduceOp = c10d::ReduceOp(c10d::ReduceOp::AVG);
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::vector<at::Tensor> ts{bucket.getBufferRef()};
    return route_allreduce(*route_, pg_, *counts_, RouteCounts::kBucketNative, ts, opts_)->getFuture();
  }

  // The native branch's future holds [buffer]; the group branch's (a Python Work's) the Python list [buffer].
  at::Tensor parseHookResult(const c10::IValue& result) override { return c10d::detail::parseCppCommHookResult(result); }

 private:
  std::shared_ptr<Route> route_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<RouteCounts> counts_;
  c10d::AllreduceOptions opts_;
};

// all_reduce through the route; every other op is refused (the DDP's group runs them in Python, on its one-rank
// local group, and never sends them here).
class RouteBackend : public c10d::Backend {
 public:
  RouteBackend(std::shared_ptr<Route> route, c10::intrusive_ptr<c10d::ProcessGroup> pg,
               std::shared_ptr<RouteCounts> counts, int rank, int size)
      : Backend(rank, size), route_(std::move(route)), pg_(std::move(pg)), counts_(std::move(counts)) {}

  const std::string getBackendName() const override { return "torchnext-ft-route"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& opts) override {
    return route_allreduce(*route_, pg_, *counts_, RouteCounts::kUsedMapNative, ts, opts);
  }

 private:
  std::shared_ptr<Route> route_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<RouteCounts> counts_;
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
  // register_ddp_hook(reducer, route, group, counts): AverageHook on torch's Reducer (once per Reducer: torch
  // refuses a second hook).
  m.def(
      "register_ddp_hook",
      [](const std::shared_ptr<c10d::Reducer>& reducer, std::shared_ptr<Route> route, GroupPtr pg,
         std::shared_ptr<RouteCounts> counts) {
        TORCH_CHECK(reducer && route && pg && counts, "register_ddp_hook: missing argument");
        reducer->register_comm_hook(std::make_unique<AverageHook>(std::move(route), std::move(pg), std::move(counts)));
      },
      py::arg("reducer"), py::arg("route"), py::arg("group"), py::arg("counts"));
  m.def(
      "create_route_backend",
      [](std::shared_ptr<Route> route, GroupPtr pg, std::shared_ptr<RouteCounts> counts, int rank,
         int size) -> BackendPtr {
        TORCH_CHECK(route && pg && counts, "create_route_backend: missing argument");
        return c10::make_intrusive<RouteBackend>(std::move(route), std::move(pg), std::move(counts), rank, size);
      },
      py::arg("route"), py::arg("group"), py::arg("counts"), py::arg("rank"), py::arg("size"));
}

}  // namespace torchnext_native
