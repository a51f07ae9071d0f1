// Typed errors of the jax_vmm core. The nanobind module maps each to one Python
// exception type (see ffi/src/python/module.cc), so every message here reaches users:
// name the operation, the expected and the actual values.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace jax_vmm {

// Bad argument from the caller (range outside a buffer, zero size, ...). -> ValueError
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Use of an arena after close(). -> jax_vmm.ArenaClosedError (a RuntimeError)
class ArenaClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Commit/release of an arena that sleep() emptied. -> jax_vmm.ArenaAsleepError (a
// RuntimeError)
class ArenaAsleep : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call on an arena inherited through fork(): the child shares the parent's physical
// memory (host) or cannot use its CUDA context at all, so it may change nothing.
// -> jax_vmm.ForkedProcessError (a RuntimeError)
class ForkedProcess : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The virtual range has no room for a new buffer. -> jax_vmm.ReservationFullError
class ReservationFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Physical memory could not be committed. -> MemoryError. Carries the numbers so that
// Python can add the JAX allocator settings to the message.
class OutOfMemory : public std::runtime_error {
 public:
  OutOfMemory(const std::string& what, size_t requested, size_t free_bytes)
      : std::runtime_error(what), requested_bytes(requested), free_bytes(free_bytes) {}
  size_t requested_bytes;
  size_t free_bytes;
};

// The OS or CUDA driver failed for a reason other than memory. -> jax_vmm.DriverError
class DriverError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace jax_vmm
