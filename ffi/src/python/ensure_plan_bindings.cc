// The per-sequence loops of jax_vmm.KVArena.ensure_all over its NumPy tables (ensured,
// covered, valid_gen, ahead_blocked: int64, one entry per sequence). The engine calls
// ensure_all once per decode block with every slot's tokens; done as NumPy expressions
// these loops cost ~20 array operations per call, as one C++ pass each they cost one
// call. Pure functions: the caller (holding the KV arena's lock) applies the result.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "python/bindings.h"

namespace nb = nanobind;

namespace jax_vmm {
namespace {

using Table = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Throws unless every table has `n` entries (the caller's tables are its own, so a
// mismatch is a bug of ours, reported rather than read out of bounds).
void CheckSizes(const char* op, size_t n, std::initializer_list<const Table*> tables) {
  for (const Table* t : tables) {
    if (t->shape(0) != n) {
      throw nb::value_error((std::string(op) + ": tables of " + std::to_string(t->shape(0)) +
                             " and " + std::to_string(n) + " entries")
                                .c_str());
    }
  }
}

// The indices q in [0, n) for which pred(q) holds, in order.
template <typename Pred>
std::vector<int64_t> Indices(size_t n, Pred pred) {
  std::vector<int64_t> out;
  for (size_t q = 0; q < n; ++q) {
    if (pred(q)) out.push_back(static_cast<int64_t>(q));
  }
  return out;
}

// (min, max) of `tokens` ((0, 0) when empty): the range check of ensure_all's argument.
std::tuple<int64_t, int64_t> TokenRange(const Table& tokens) {
  const int64_t* t = tokens.data();
  int64_t lo = 0, hi = 0;
  for (size_t i = 0; i < tokens.shape(0); ++i) {
    if (i == 0 || t[i] < lo) lo = t[i];
    if (i == 0 || t[i] > hi) hi = t[i];
  }
  return {lo, hi};
}

// The sequences that ask for tokens (tokens[q] > 0) beyond the chunks known backed in
// arena generation `gen` (tokens[q] > covered[q], or covered[q] counted in another
// generation): those ensure_all must commit.
std::vector<int64_t> EnsureNeed(const Table& tokens, const Table& covered, const Table& valid_gen,
                                int64_t gen) {
  const size_t n = tokens.shape(0);
  CheckSizes("ensure_need", n, {&covered, &valid_gen});
  const int64_t *t = tokens.data(), *c = covered.data(), *g = valid_gen.data();
  return Indices(n, [&](size_t q) { return t[q] > 0 && (t[q] > c[q] || g[q] != gen); });
}

// The sequences whose asked tokens come within `ahead_tokens` of the end of their backed
// chunks (and can grow, and were not refused a commit ahead at this end): those whose
// next chunk the commit-ahead thread should back.
std::vector<int64_t> AheadDue(const Table& tokens, const Table& covered, const Table& ahead_blocked,
                              int64_t ahead_tokens, int64_t max_tokens) {
  const size_t n = tokens.shape(0);
  CheckSizes("ahead_due", n, {&covered, &ahead_blocked});
  const int64_t *t = tokens.data(), *c = covered.data(), *b = ahead_blocked.data();
  return Indices(n, [&](size_t q) {
    return t[q] > 0 && c[q] - t[q] <= ahead_tokens && c[q] < max_tokens && b[q] != c[q];
  });
}

}  // namespace

void BindEnsurePlan(nb::module_& m) {
  // noconvert: the tables are the arena's own int64 arrays; anything else is a bug, not
  // something to copy silently on every call.
  m.def("token_range", &TokenRange, nb::arg("tokens").noconvert(),
        "(min, max) of an int64 array ((0, 0) when empty).");
  m.def("ensure_need", &EnsureNeed, nb::arg("tokens").noconvert(), nb::arg("covered").noconvert(),
        nb::arg("valid_gen").noconvert(), nb::arg("gen"),
        "Sequences that ask for tokens beyond their chunks known backed.");
  m.def("ahead_due", &AheadDue, nb::arg("tokens").noconvert(), nb::arg("covered").noconvert(),
        nb::arg("ahead_blocked").noconvert(), nb::arg("ahead_tokens"), nb::arg("max_tokens"),
        "Sequences within ahead_tokens of the end of their backed chunks.");
}

}  // namespace jax_vmm
