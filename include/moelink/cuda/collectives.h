// The CUDA unit of backend "ep" (backend/collectives.h): the c10d collectives on CUDA tensors,
// stream-ordered like NCCL's. EpBackend validates every call and hands the calls on CUDA
// tensors here; CPU tensors never reach this unit.
//
// Files: unit.h (the unit's class), collectives.cpp (binding the group's device and staging
// areas, how an op runs: streams, the exchange kernel, the host-staged route), ops.cpp (each op,
// and the unit's registration), exchange.{h,cpp} (the in-host plans: who pushes what where,
// torch-free), kernels/exchange.cu (the exchange kernel), work.{h,cpp} (the CudaWork, its end
// events and completion thread), staging.{h,cpp} (host-mapped words, stream memory ops, the
// staging areas mapped over CUDA IPC).
//
// Two executors, chosen once per group (the first CUDA op; every rank agrees):
// - in-host ("nvlink"): every rank on this host and every peer's staging area mapped through
//   CUDA IPC: each collective is one or two exchange kernels (exchange.h) on the
//   group's communication stream; no CPU thread is on the critical path;
// - host-staged ("host"): ranks on several hosts (or MOELINK_RANKS_PER_HOST virtual hosts):
//   the stream copies the inputs into pinned host memory and raises a host-mapped word
//   (cuStreamWriteValue32); the collective worker runs the CPU op on those copies once it
//   sees the word, then raises another that the stream waits for (cuStreamWaitValue32)
//   before copying the results back. No SM waits, and the caller's thread never blocks.
// Both routes share the GPU-side preparation (flattening lists, contiguous copies); the
// host-staged route then hands the worker one flat op over pinned copies, so the CPU never
// reads a copy before the GPU has written it. Point-to-point ops take the host-staged route
// in both cases (it matches tags and sources and lets sends and receives progress
// independently, as batch_isend_irecv needs).
//
// Streams, as NCCL's backend in PyTorch does them: an asynchronous op (`async_op=True`, and
// every point-to-point op) waits for the work queued so far on the caller's current stream,
// runs on the group's communication stream and records an event there; Work::wait() makes the
// current stream wait for it (no host block). A synchronous op (`async_op=False`, which the
// caller follows with wait() at once) runs on the caller's current stream itself, which spares
// the two cross-stream hand-offs. Whatever their streams, a group's ops run on the GPU in the
// order they were issued: an op on another stream than the group's previous op waits for that
// op's end event. Work::getFuture() completes once the GPU has finished the op (a completion
// thread watches the events), and a failure reported by the GPU (a header mismatch, a timeout)
// is raised by wait() or the future once known.
//
// The unit registers itself for c10::DeviceType::CUDA (backend::registerCollectives) when its
// objects are linked in; nothing else names it.
#pragma once
