// The Python module moelink._C: the only place that sees both torch and Python.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include "moelink/backend/ep_backend.h"
#include "moelink/backend/work.h"
#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/cuda/exchange.h"
#include "moelink/ep/ibgda/probe.h"
#include "moelink/ep/layout.h"
#include "moelink/ep/routes.h"
#ifdef MOELINK_WITH_CUDA
#include "moelink/ep/low_latency_buffer.h"
#include "moelink/ep/normal_buffer.h"
#endif

namespace py = pybind11;
using moelink::backend::EpBackend;

namespace {

// The holder of a backend's Python object. Its last reference goes without the GIL: the
// backend's teardown joins its worker thread, and that thread may need the GIL to finish (a
// completed op's tensors are released there), so tearing down while holding it deadlocks.
// Python drops the object with the GIL held (c10d's ProcessGroup releases its backends
// through their Python objects), hence the release here, where Python and the backend meet.
// One intrusive_ptr, as c10d's own holder of Backend, which pybind11 reads it as.
template <typename T>
class ReleasedWithoutGil {
 public:
  ReleasedWithoutGil() = default;
  // pybind11 wraps an object it does not own this way: take a reference of its own.
  explicit ReleasedWithoutGil(T* p) : ptr_(c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(p)) {}
  explicit ReleasedWithoutGil(c10::intrusive_ptr<T> p) : ptr_(std::move(p)) {}
  ReleasedWithoutGil(const ReleasedWithoutGil&) = default;
  ReleasedWithoutGil(ReleasedWithoutGil&&) noexcept = default;
  ReleasedWithoutGil& operator=(const ReleasedWithoutGil&) = default;
  ReleasedWithoutGil& operator=(ReleasedWithoutGil&&) noexcept = default;
  ~ReleasedWithoutGil() {
    if (ptr_ && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      ptr_.reset();
    }
  }
  T* get() const { return ptr_.get(); }

 private:
  c10::intrusive_ptr<T> ptr_;
};

// What the normal-mode route decision needs (moelink/ep/routes.h), gathered from the
// backend and, when the call's tensors are on a GPU with kernels, from the GPU buffer.
moelink::ep::RouteFacts routeFacts(const EpBackend& backend, const py::object& impl, bool connected) {
  moelink::ep::RouteFacts f;
  f.rank = backend.getRank();
  f.world = backend.getSize();
  for (int32_t a : backend.activeMask()) f.active.push_back(a);
  f.connected = connected;
  f.two_hop = moelink::settings::flag("MOELINK_EP_TWO_HOP");
  f.ranks_per_host = static_cast<int>(moelink::settings::numberIfSet("MOELINK_EP_RANKS_PER_HOST").value_or(0));
#ifdef MOELINK_WITH_CUDA
  if (!impl.is_none()) {
    const auto& buffer = impl.cast<const moelink::ep::LowLatencyBuffer&>();
    f.kernels = true;
    for (int r = 0; r < f.world; ++r) f.kernel_paths.push_back(buffer.transportOf(r));
  }
#else
  if (!impl.is_none()) throw py::type_error("moelink normal_route: this build has no GPU buffer");
#endif
  if (!f.kernels && f.ranks_per_host <= 0) {
    for (int r = 0; r < f.world; ++r) f.group_paths.push_back(backend.transportOf(r));
  }
  return f;
}

// The in-host CUDA tuning of a group of `world` (MOELINK_CUDA_* over the group size's defaults),
// or ValueError naming `who` for a size outside the path's range or a bad setting.
moelink::cuda::ExchangeTuning cudaTuning(const char* who, int world) {
  if (world < 1 || world > moelink::cuda::kExchangeMaxRanks)
    throw py::value_error(std::string(who) + ": in-host CUDA groups hold 1.." +
                          std::to_string(moelink::cuda::kExchangeMaxRanks) + " ranks, not " + std::to_string(world));
  try {
    return moelink::cuda::ExchangeTuning::fromEnv(world);
  } catch (const moelink::Error& e) {
    throw py::value_error(e.what());
  }
}

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, ReleasedWithoutGil<T>, true);

PYBIND11_MODULE(_C, m) {
  m.doc() = "moelink native module: the 'ep' c10d backend";
  py::module_::import("torch.distributed");
  m.attr("TORCH_VERSION") = TORCH_VERSION;

  py::class_<EpBackend, c10d::Backend, ReleasedWithoutGil<EpBackend>>(m, "EpBackend", R"(
The c10d backend behind ``backend="ep"``. Created by torch.distributed through the
registered creator; use ``moelink.get_backend(group)`` to reach it.)")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, bool raise_on_peer_failure, bool extension,
                       int initial_size) {
             EpBackend::Options o;
             o.raise_on_peer_failure = raise_on_peer_failure;
             o.extension = extension;
             o.initial_size = initial_size;
             return ReleasedWithoutGil<EpBackend>(c10::make_intrusive<EpBackend>(store, rank, size, timeout, o));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("raise_on_peer_failure") = false, py::arg("extension") = false, py::arg("initial_size") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("tcp_address", &EpBackend::tcpAddress, "The \"ip:port\" this rank's tcp transport listens on.")
      .def("active_mask", &EpBackend::activeMask, "Per rank: 1 = active (int32 list).")
      .def("peer_state", &EpBackend::peerState, py::arg("ranks"), py::call_guard<py::gil_scoped_release>(),
           "Per rank in `ranks`, as seen by this rank: 1 when active, or when a replacement process waits to be "
           "readmitted and answers.")
      .def("mirror_mask", &EpBackend::mirrorMask, py::arg("mirror"),
           "Keeps `mirror` (CPU int32, at least size() entries) equal to the group's mask, updated by the worker at "
           "every membership change.")
      .def("num_synced_ranks", &EpBackend::numSyncedRanks, py::call_guard<py::gil_scoped_release>(),
           "Ranks active or with a process waiting to be readmitted, as this rank sees them.")
      .def("recover_ranks", &EpBackend::recoverRanks, py::arg("ranks"), py::call_guard<py::gil_scoped_release>(),
           "Readmits `ranks` (collective over the active ranks).")
      .def_property_readonly("epoch", &EpBackend::epoch)
      .def("transport_of", &EpBackend::transportOf, py::arg("rank"),
           "How this rank reaches `rank` for collectives: 'shm', 'tcp' or 'local'.")
      .def("reads_directly", &EpBackend::readsDirectly, py::arg("rank"),
           "Whether `rank` reads this rank's large collective payloads straight from this process's memory.")
      .def("active_ranks", &EpBackend::activeRanks, "Ranks currently in the active-rank mask.")
      .def("cuda_path", &EpBackend::cudaPath,
           "How CUDA tensors travel in this group: 'nvlink' (in-host kernels), 'host' (staged through host "
           "memory), or '' before the group's first CUDA op.")
      .def_property_readonly("timeout", &EpBackend::timeout)
      .def_property_readonly("store", &EpBackend::store);

  m.def(
      "setting",
      [](const std::string& name) -> py::object {
        using moelink::settings::Kind;
        for (const auto& s : moelink::settings::all()) {
          if (name != s.name) continue;
          try {
            switch (s.kind) {
              case Kind::kFlag: return py::bool_(moelink::settings::flag(s.name));
              case Kind::kNumber: {
                auto v = moelink::settings::numberIfSet(s.name);
                if (v) return py::int_(*v);
                return *s.default_text ? py::object(py::none()) : py::object(py::int_(s.number));
              }
              default: return py::str(moelink::settings::text(s.name));
            }
          } catch (const moelink::Error& e) {
            throw py::value_error(e.what());
          }
        }
        throw py::key_error(name + " is not a moelink setting");
      },
      py::arg("name"),
      "The value of a MOELINK_* setting as the library reads it (None: unset, a default that depends on the group); "
      "raises ValueError for a value that does not fit.");
  m.def(
      "cuda_tuning",
      [](int world) {
        const moelink::cuda::ExchangeTuning t = cudaTuning("moelink.cuda_tuning", world);
        const auto& d = moelink::cuda::exchangeDefaults(world);
        py::dict out;
        out["lamport_bytes"] = t.lamport_bytes;
        out["lamport_two_shot_bytes"] = world > 2 && t.lamport_bytes ? t.lamport_two_shot_bytes : 0;
        out["one_shot_bytes"] = t.oneShot(world, UINT64_MAX) ? py::object(py::none()) : py::object(py::int_(t.one_shot_bytes));
        out["blocks"] = t.blocks;
        out["round_bytes"] = t.round_bytes;
        out["split"] = t.split;
        out["lamport_narrow_bytes"] = t.lamport_narrow_bytes;
        out["lamport_threads"] = std::min(t.lamport_threads, moelink::cuda::lamportThreads(world));
        out["defaults_measured_on"] = *d.measured ? py::object(py::str(d.measured)) : py::object(py::none());
        return out;
      },
      py::arg("world"),
      "The in-host CUDA path's tuning for a group of `world` ranks on one host: the MOELINK_CUDA_* settings "
      "as set, else the defaults of the group size's row (docs/PERF.md, \"Defaults by group size\"). "
      "one_shot_bytes None: allreduce and broadcast are one exchange at every size (above it a broadcast is "
      "forwarded: each rank but the root passes its block on to the others as it lands, and an all_reduce that "
      "the two-shot Lamport kernel does not take is a reduce-scatter and an all-gather in one launch); "
      "lamport_narrow_bytes / lamport_threads: the Lamport kernel runs 256-thread blocks where the longest "
      "pair is at most lamport_narrow_bytes, blocks of lamport_threads above; lamport_two_shot_bytes: all_reduce "
      "above lamport_bytes and up to this size runs the two-shot Lamport kernel (0: never); defaults_measured_on None: "
      "no machine of this size has measured the row's defaults.");
  m.def(
      "cuda_sms",
      [](const std::string& op, int world, uint64_t nbytes) {
        using moelink::collective::OpKind;
        static const std::pair<const char*, OpKind> kOps[] = {
            {"all_reduce", OpKind::kAllreduce}, {"all_gather", OpKind::kAllgather},
            {"reduce_scatter", OpKind::kReduceScatter}, {"all_to_all", OpKind::kAlltoall},
            {"broadcast", OpKind::kBroadcast}};
        const OpKind* kind = nullptr;
        for (const auto& [name, k] : kOps)
          if (op == name) kind = &k;
        if (!kind)
          throw py::value_error("moelink.cuda_sms: op must be all_reduce, all_gather, reduce_scatter, all_to_all or "
                                "broadcast, not '" + op + "'");
        return moelink::cuda::collectiveSms(*kind, world, nbytes, cudaTuning("moelink.cuda_sms", world));
      },
      py::arg("op"), py::arg("world"), py::arg("nbytes"),
      "The most SMs a rank's kernel holds for one collective on the in-host CUDA path (group of `world`, tuning as "
      "cuda_tuning(world)); `nbytes`: the op's largest tensor (all_gather's output, reduce_scatter's and "
      "all_to_all's input, the buffer of all_reduce and broadcast), float32 reductions, even all_to_all pairs.");
  m.def(
      "settings_table",
      [] {
        using moelink::settings::Kind;
        py::list out;
        for (const auto& s : moelink::settings::all()) {
          py::dict d;
          d["name"] = s.name;
          d["area"] = s.area;
          d["kind"] = s.kind == Kind::kNumber ? "number" : s.kind == Kind::kFlag ? "flag" : s.kind == Kind::kChoice ? "choice" : "text";
          d["default"] = py::int_(s.number);
          d["min"] = py::int_(s.min);
          d["max"] = py::int_(s.max);
          d["choices"] = s.choices;
          d["default_text"] = s.default_text;
          d["doc"] = s.doc;
          out.append(d);
        }
        return out;
      },
      "Every MOELINK_* setting as declared (name, area, kind, default, range or choices, meaning).");

  m.def("_shutdown_all", &EpBackend::shutdownAll, py::call_guard<py::gil_scoped_release>(),
        "Shuts down every 'ep' backend of this process (moelink's atexit hook: no worker thread outlives the "
        "interpreter).");

  m.def(
      "failed_ranks",
      [](const c10::intrusive_ptr<c10d::Work>& work) { return EpBackend::lostRanksOf(work); },
      py::arg("work"), "The ranks an op of backend 'ep' lost while it ran (None for another backend's work).");
  m.def(
      "work_group_size",
      [](const c10::intrusive_ptr<c10d::Work>& work) -> std::optional<int> {
        auto* w = dynamic_cast<const moelink::backend::LostRanks*>(work.get());
        if (w == nullptr) return std::nullopt;
        return w->groupSize();
      },
      py::arg("work"), "The size of the group an op of backend 'ep' ran in (None for another backend's work).");

  m.def(
      "ibgda_status",
      [] {
        auto r = moelink::ep::ibgda::probe();
        py::dict d;
        d["usable"] = r.usable;
        d["reason"] = r.reason;
        d["verbs_library"] = r.verbs_library;
        d["devices"] = r.devices;
        d["mlx5_devices"] = r.mlx5_devices;
        d["gpudirect"] = r.gpudirect;
        d["plugin"] = r.plugin;
        return d;
      },
      "What this machine offers for IBGDA (see moelink.ibgda_status).");

  m.def(
      "normal_route",
      [](const EpBackend& backend, const py::object& impl, bool connected) {
        try {
          auto facts = routeFacts(backend, impl, connected);
          return py::make_tuple(moelink::ep::routeName(moelink::ep::chooseNormalRoute(facts)),
                                moelink::ep::ranksPerHostSeen(facts));
        } catch (const moelink::Error& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("backend"), py::arg("impl"), py::arg("connected"),
      "The route of a normal-mode EP call as this rank sees the group, and the ranks per host it sees for the "
      "two-hop route: ('nvlink' | 'group' | 'ask', int). `impl`: the GPU buffer when the call's tensors are on "
      "its GPU, else None; `connected`: that buffer is connected at the group's membership epoch. 'ask': the "
      "two-hop route if every rank sees the same ranks per host (see agreed_ranks_per_host), else the group path.");
  m.def(
      "ep_buffer_size_hint",
      [](int64_t num_ranks, int64_t max_tokens, int64_t hidden, int64_t num_experts) {
        try {
          return static_cast<int64_t>(moelink::ep::EpLayout::make(static_cast<int>(num_ranks),
                                                                  static_cast<int>(num_experts),
                                                                  static_cast<int>(max_tokens), static_cast<int>(hidden))
                                          .totalBytes());
        } catch (const moelink::Error& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("num_ranks"), py::arg("max_tokens"), py::arg("hidden"), py::arg("num_experts"),
      "Bytes of the low-latency EP buffer per rank for these sizes (built with or without CUDA); ValueError for "
      "sizes the buffer does not take.");
  m.def("agreed_ranks_per_host", &moelink::ep::agreedRanksPerHost, py::arg("highest"), py::arg("lowest"),
        "The two-hop route's ranks per host given the largest and smallest that the group's ranks see (0: the "
        "group path).");

#ifdef MOELINK_WITH_CUDA
  using moelink::ep::DispatchOutputs;
  using moelink::ep::LowLatencyBuffer;
  m.attr("HAS_CUDA") = true;
  py::class_<DispatchOutputs>(m, "DispatchOutputs")
      .def_readonly("recv_x", &DispatchOutputs::recv_x)
      .def_readonly("recv_scales", &DispatchOutputs::recv_scales)
      .def_readonly("recv_count", &DispatchOutputs::recv_count)
      .def_readonly("src_info", &DispatchOutputs::src_info)
      .def_readonly("src_slot", &DispatchOutputs::src_slot)
      .def_readonly("layout_range", &DispatchOutputs::layout_range)
      .def_readonly("half", &DispatchOutputs::half);
  py::class_<LowLatencyBuffer, std::shared_ptr<LowLatencyBuffer>>(m, "LowLatencyBuffer")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, const std::string&, int64_t, int64_t,
                    int64_t, const std::vector<int64_t>&>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("key"), py::arg("max_tokens"),
           py::arg("hidden"), py::arg("num_experts"), py::arg("active") = std::vector<int64_t>{},
           py::call_guard<py::gil_scoped_release>())
      .def("nonce", &LowLatencyBuffer::nonce)
      .def("pairs_hash", &LowLatencyBuffer::pairsHash)
      .def("settle", &LowLatencyBuffer::settle, py::call_guard<py::gil_scoped_release>())
      .def("update_members", &LowLatencyBuffer::updateMembers, py::arg("mask"), py::arg("nonces"), py::arg("generation"),
           py::call_guard<py::gil_scoped_release>())
      .def("dispatch", &LowLatencyBuffer::dispatch)
      .def("dispatch_recv", &LowLatencyBuffer::dispatchRecv)
      .def("combine", &LowLatencyBuffer::combine)
      .def("combine_recv", &LowLatencyBuffer::combineRecv)
      .def("transport_of", &LowLatencyBuffer::transportOf)
      .def("proxy_transport_of", &LowLatencyBuffer::proxyTransportOf)
      .def("active_ranks", &LowLatencyBuffer::activeRanks)
      .def("set_trace", &LowLatencyBuffer::setTrace)
      .def("num_sms", &LowLatencyBuffer::numSms);
  using moelink::ep::NormalBuffer;
  using moelink::ep::NormalDispatchResult;
  using moelink::ep::NormalShape;
  py::class_<NormalShape>(m, "NormalShape")
      .def(py::init([](int64_t channels, int64_t ring_tokens, int64_t send_chunk) {
             return NormalShape{channels, ring_tokens, send_chunk};
           }),
           py::arg("channels"), py::arg("ring_tokens"), py::arg("send_chunk"));
  py::class_<NormalDispatchResult>(m, "NormalDispatchResult")
      .def_readonly("recv_x", &NormalDispatchResult::recv_x)
      .def_readonly("recv_scales", &NormalDispatchResult::recv_scales)
      .def_readonly("recv_topk_idx", &NormalDispatchResult::recv_topk_idx)
      .def_readonly("recv_topk_weights", &NormalDispatchResult::recv_topk_weights)
      .def_readonly("recv_src_idx", &NormalDispatchResult::recv_src_idx)
      .def_readonly("rank_prefix", &NormalDispatchResult::rank_prefix)
      .def_readonly("channel_prefix", &NormalDispatchResult::channel_prefix)
      .def_readonly("recv_channel_prefix", &NormalDispatchResult::recv_channel_prefix)
      .def_readonly("send_head", &NormalDispatchResult::send_head)
      .def_readonly("num_recv_per_expert", &NormalDispatchResult::num_recv_per_expert)
      .def_readonly("num_recv", &NormalDispatchResult::num_recv);
  py::class_<NormalBuffer, std::shared_ptr<NormalBuffer>>(m, "NormalBuffer")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, const std::string&, int64_t, int64_t>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("key"), py::arg("bytes"),
           py::arg("num_experts"), py::call_guard<py::gil_scoped_release>())
      .def_static("bytes_needed", &NormalBuffer::bytesNeeded)
      .def_static("layout", &NormalBuffer::layout)
      .def("dispatch", &NormalBuffer::dispatch, py::call_guard<py::gil_scoped_release>())
      .def("cached_dispatch", &NormalBuffer::cachedDispatch, py::call_guard<py::gil_scoped_release>())
      .def("combine", &NormalBuffer::combine, py::call_guard<py::gil_scoped_release>())
      .def("bytes", &NormalBuffer::bytes);
#else
  m.attr("HAS_CUDA") = false;
#endif
}
