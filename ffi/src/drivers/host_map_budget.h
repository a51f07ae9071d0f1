// The host driver's memory mappings against the process limit vm.max_map_count.
//
// A host arena maps each committed piece of its memfd separately, and the kernel merges
// neighbouring mappings only when their file offsets are contiguous, so a large arena at
// small chunks can need one mapping per chunk. Past the limit every mmap of the process
// fails, malloc's included: the arena could no longer restore the zero mapping of a
// released chunk, and a C++ allocation elsewhere would throw where nothing can catch it.
// The budget refuses a commit (OutOfMemory, the arena rolls back) while a margin is left.
#pragma once

#include <cstddef>

namespace jax_vmm::host {

// Throws OutOfMemory unless `more` further mappings fit under the limit with a margin
// left for the rest of the process (malloc, JAX, the zero mappings a release restores).
// `bytes` is what the caller commits (for the message). Cheap: /proc/self/maps is read
// only when the estimate nears the limit. Thread-safe.
void ReserveMappings(size_t more, size_t bytes);

// Where the limit comes from: vm.max_map_count unless another source is installed (the
// testing layer installs one, so that tests reach the limit without filling the maps).
using MapLimitSource = size_t (*)();
// Installs `source` (nullptr: vm.max_map_count again); the next commit reads it and
// re-counts. Thread-safe.
void SetMapLimitSource(MapLimitSource source);

}  // namespace jax_vmm::host
