// The Python module moelink._C: the only place that sees both torch and Python.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include "moelink/backend/ep_backend.h"

namespace py = pybind11;
using moelink::backend::EpBackend;

PYBIND11_MODULE(_C, m) {
  m.doc() = "moelink native module: the 'ep' c10d backend";
  py::module_::import("torch.distributed");
  m.attr("TORCH_VERSION") = TORCH_VERSION;

  py::class_<EpBackend, c10d::Backend, c10::intrusive_ptr<EpBackend>>(m, "EpBackend", R"(
The c10d backend behind ``backend="ep"``. Created by torch.distributed through the
registered creator; use ``moelink.get_backend(group)`` to reach it.)")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return c10::make_intrusive<EpBackend>(store, rank, size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("transport_of", &EpBackend::transportOf, py::arg("rank"),
           "How this rank reaches `rank` for collectives: 'shm', 'tcp' or 'local'.")
      .def("active_ranks", &EpBackend::activeRanks, "Ranks currently in the active-rank mask.")
      .def_property_readonly("timeout", &EpBackend::timeout);
}
