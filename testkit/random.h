// testkit: the one random generator, and host work from all cores.
//
// The generator is splitmix64: word i of the stream of `key` is
//
//   counter_word(key, i) = mix64(key + (i + 1) * kGolden)
//
// so any word can be made on its own (fills from all cores, checksums of
// bytes nobody stored: testkit/checksum.h), and Rng (the same stream, one
// word after the other) serves code that draws as it goes. Keys of numbered
// things (layers, tensors, tags) come from key_of(seed, index).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "lwo.h"

namespace testkit {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

// The splitmix64 finaliser.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline uint64_t counter_word(uint64_t key, uint64_t i) { return mix64(key + (i + 1) * kGolden); }
inline uint64_t key_of(uint64_t seed, uint64_t index) { return mix64(seed ^ mix64(index + 1)); }
// A float uniform in [-1, 1) from the top 24 bits of a word (exact in f32).
inline float uniform_pm1(uint64_t w) {
  return static_cast<float>(w >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

// The stream of one state, word after word: Rng(x).next() is
// counter_word(x, 0), then counter_word(x, 1), ... A UniformRandomBitGenerator,
// so it also drives <random>'s distributions.
class Rng {
 public:
  using result_type = uint64_t;
  explicit Rng(uint64_t state = 0) : state_(state) {}
  uint64_t next() { return mix64(state_ += kGolden); }
  uint64_t operator()() { return next(); }
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return std::numeric_limits<uint64_t>::max(); }
  uint64_t below(uint64_t n) { return next() % n; }  // n > 0
  float uniform_pm1() { return testkit::uniform_pm1(next()); }
  // Folds v into the state (a sub-stream per value: Rng(seed).absorb(layer)).
  Rng& absorb(uint64_t v) {
    state_ ^= v + 0x632be59bd9b4e019ull;
    (void)next();
    return *this;
  }
  uint64_t state() const { return state_; }

 private:
  uint64_t state_;
};

// --- host work over all cores ------------------------------------------------------

// Calls fn(i) for i in [0, n) on the calling thread and up to `n_threads` - 1
// threads of the library's host pool (lwo::ThreadPool::process(); 0: every
// slot), the items taken in turn. An exception from fn stops the other items
// (those not yet begun are skipped) and is rethrown here.
void parallel_for(size_t n, const std::function<void(size_t)>& fn, unsigned n_threads = 0);

// Called with the bytes just done, from any thread (a progress bar's add()).
using Progress = std::function<void(uint64_t bytes)>;

// (pointer, bytes) of host memory: records, tensors, shards.
struct HostRange {
  void* data;
  uint64_t bytes;
};

// Bytes of the stream of `key`, from all cores: data[j] is byte offset + j of
// the stream (8-byte word w is counter_word(key, w), little-endian); bytes
// at or beyond `limit` of the stream are zero. offset and limit: multiples of 8.
struct ByteRange {
  void* data;
  uint64_t bytes;
  uint64_t key;
  uint64_t offset = 0;
  uint64_t limit = std::numeric_limits<uint64_t>::max();
};
void fill_bytes(const std::vector<ByteRange>& ranges, unsigned n_threads = 0,
                const Progress& progress = {});
// Whole ranges, range i from the stream of key_of(seed, i): bytes that depend
// only on the seed, the range's index and its size (the records of lwo run
// and lwo probe).
std::vector<ByteRange> keyed_ranges(const std::vector<HostRange>& ranges, uint64_t seed);

// n elements of dtype (bf16, f16 or f32) uniform in [-bound, bound), rounded
// to nearest even: element i is uniform_pm1(counter_word(key, i)) * bound. From
// all cores.
struct UniformRange {
  void* data;
  lwo_dtype_t dtype;
  uint64_t n;
  float bound;
  uint64_t key;
};
void fill_uniform(const std::vector<UniformRange>& ranges, unsigned n_threads = 0,
                  const Progress& progress = {});

// The GPU tests' bytes of a seed (one thread): the words of
// Rng(seed * 0x2545F4914F6CDD1D + 0x1234567), none of them zero (so that a
// checksum sees every word); a short tail has no zero byte.
void fill_nonzero(void* data, size_t bytes, uint64_t seed);

}  // namespace testkit
