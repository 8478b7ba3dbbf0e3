// The C++ half of torch.distributed's backend "ferrovod" (see _front.py): a c10d::Backend whose
// every op is the Python backend's (process_group.py), and a c10d::Work over the work that
// backend hands back.
//
// It exists for what torch asks of a backend's work in C++ and never forwards to one written in
// Python: whether the work has completed (`Work.is_completed()`) and, for a receive from any
// source, who sent (`Work._source_rank()`). The ops themselves, their names, checks and
// futures stay in Python, so there is one way through: torch -> this -> process_group.py ->
// the engine's door.
//
// Every call into Python takes the GIL: torch calls a backend with it released (its bindings
// drop it) and from its own threads (DDP's reducer, autograd's).

#include <pybind11/chrono.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

namespace ferrovod {

namespace py = pybind11;
using c10d::Work;

// A Python object that may be released on a thread without the GIL (torch frees works and
// backends wherever their last reference goes).
class PyHandle {
 public:
  explicit PyHandle(py::object obj) : obj_(std::move(obj)) {}
  PyHandle(const PyHandle&) = delete;
  PyHandle& operator=(const PyHandle&) = delete;
  ~PyHandle() {
    if (!Py_IsInitialized()) {
      // Freed after the interpreter (a group never destroyed, held by torch's statics): there
      // is no GIL to take, and nothing left to free the object into.
      obj_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    obj_ = py::object();
  }
  // Only with the GIL held.
  const py::object& get() const { return obj_; }

 private:
  py::object obj_;
};

// The work of one op: the Python backend's, asked for what torch's trampoline would not ask.
class FrontWork : public Work {
 public:
  explicit FrontWork(py::object work) : work_(std::move(work)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    try {
      bool done;
      {
        py::gil_scoped_acquire gil;
        done = work_.get().attr("wait")(timeout).cast<bool>();
      }
      if (done) {
        finish();
      }
      return done;
    } catch (...) {
      // Completed with an error: `is_completed()` is true and the error is the work's.
      finish(std::current_exception());
      throw;
    }
  }

  bool isCompleted() override {
    if (Work::isCompleted()) {
      return true;
    }
    py::gil_scoped_acquire gil;
    return work_.get().attr("is_completed")().cast<bool>();
  }

  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return work_.get().attr("_source_rank")().cast<int>();
  }

  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    return work_.get().attr("result")().cast<std::vector<at::Tensor>>();
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    py::gil_scoped_acquire gil;
    py::object fut = work_.get().attr("get_future")();
    return fut.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  }

 private:
  PyHandle work_;
};

// The backend: every op is the Python backend's method of torch's trampoline name.
class FrontBackend : public c10d::Backend {
 public:
  FrontBackend(py::object impl, int rank, int size)
      : Backend(rank, size), impl_(std::move(impl)) {}

  const std::string getBackendName() const override { return "ferrovod"; }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts) override {
    return op("broadcast", tensors, opts);
  }
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) override {
    return op("allreduce", tensors, opts);
  }
  c10::intrusive_ptr<Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return op("allreduce_coalesced", tensors, opts);
  }
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                                  const c10d::ReduceOptions& opts) override {
    return op("reduce", tensors, opts);
  }
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    return op("allgather", outputs, inputs, opts);
  }
  // The older names of the single-tensor and coalesced ops: every torch that has the newer
  // ones forwards them here, and an older one calls these alone.
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override {
    return op("all_gather_single", output, input, opts);
  }
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    return op("allgather_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return op("all_gather_single_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    return op("gather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    return op("scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    return op("reduce_scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override {
    return op("reduce_scatter_single", output, input, opts);
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return op("reduce_scatter_single_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const c10d::AllToAllOptions& opts) override {
    return op("all_to_all_single", output, input, output_splits, input_splits, opts);
  }
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    return op("alltoall", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    return op("barrier", opts);
  }
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return op("send", tensors, dst, tag);
  }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return op("recv", tensors, src, tag);
  }
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return op("recv_anysource", tensors, tag);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    impl_.get().attr("monitored_barrier")(opts, wait_all_ranks);
  }
  uint64_t getSequenceNumberForGroup() override {
    py::gil_scoped_acquire gil;
    return impl_.get().attr("_get_sequence_number_for_group")().cast<uint64_t>();
  }
  void shutdown() override {
    py::gil_scoped_acquire gil;
    impl_.get().attr("shutdown")();
  }
  void abort() override {
    py::gil_scoped_acquire gil;
    impl_.get().attr("abort")();
  }

  // The Python backend, for what torch reaches through the group's Python object.
  py::object impl() const { return impl_.get(); }

 private:
  template <typename... Args>
  c10::intrusive_ptr<Work> op(const char* name, Args&... args) {
    py::gil_scoped_acquire gil;
    py::object work = impl_.get().attr(name)(args...);
    if (work.is_none()) {
      return c10::intrusive_ptr<Work>();
    }
    return c10::make_intrusive<FrontWork>(std::move(work));
  }

  PyHandle impl_;
};

}  // namespace ferrovod

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The C++ half of torch.distributed's backend \"ferrovod\" (see _front.py).";
  pybind11::class_<ferrovod::FrontBackend, c10d::Backend,
                   c10::intrusive_ptr<ferrovod::FrontBackend>>(m, "Backend")
      .def(pybind11::init<pybind11::object, int, int>(), pybind11::arg("impl"),
           pybind11::arg("rank"), pybind11::arg("size"))
      .def_property_readonly("impl", &ferrovod::FrontBackend::impl);
}
