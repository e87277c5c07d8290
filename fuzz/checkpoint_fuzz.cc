// Checkpoint fuzzer: the input is a small checkpoint folder, opened whole
// (src/checkpoint/checkpoint.h, Checkpoint::open) and through the C ABI's
// checkpoint calls (lwo_checkpoint_*, the queries lwo info makes of a
// checkpoint). An input that starts with '{' is an index folder: the input
// is cut at each "@@@@" into model.safetensors.index.json and the shards
// a.safetensors .. d.safetensors, beside in.safetensors (a symlink to
// a.safetensors, inside the folder) and out.safetensors (a symlink to a file
// outside it); the index is opened. Any other input is one model.safetensors,
// opened as a file (fuzz.h, write_checkpoint_input: info_fuzz.cc's layout too).
//
// The oracle: a failure is lwo::Error with a status of lwo_checkpoint_open's
// list (docs/API.md), and the C ABI returns the same status; what opens was
// consumed whole: its files are exactly the shards the index names (each
// once), its tensors exactly the index's names, each in the shard the index
// says, within its file; names resolve to their own entry; every index the
// queries take below the count answers and the count itself is
// LWO_ERR_OUT_OF_RANGE; the layer mapping calls fail only with their statuses.
//
// Built by scripts/fuzz in the LWO_FUZZ build (clang -fsanitize=fuzzer);
// without LWO_LIBFUZZER a plain program that opens each input file it is
// given (the seed corpus, fuzz/corpus_checkpoint, in the unit tests).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fuzz.h"
#include "lwo.h"
#include "src/checkpoint/checkpoint.h"
#include "src/checkpoint/safetensors.h"
#include "src/common/error.h"

namespace {

const lwo_status_t kOpenStatuses[] = {LWO_ERR_IO,         LWO_ERR_TRUNCATED, LWO_ERR_BAD_HEADER_SIZE,
                                      LWO_ERR_BAD_JSON,   LWO_ERR_BAD_DTYPE, LWO_ERR_SHAPE_MISMATCH,
                                      LWO_ERR_SHAPE_OVERFLOW, LWO_ERR_BAD_RANGE, LWO_ERR_OVERLAP};
const lwo_status_t kMapStatuses[] = {LWO_ERR_NOT_FOUND, LWO_ERR_INVALID_ARGUMENT, LWO_ERR_BAD_RANGE};

template <size_t N>
bool in(const lwo_status_t (&set)[N], lwo_status_t s) {
  return std::find(set, set + N, s) != set + N;
}

using lwo_fuzz::folder;

std::string base_name(const std::string& p) {
  size_t k = p.rfind('/');
  return k == std::string::npos ? p : p.substr(k + 1);
}

// The C ABI's view of the same path: the same status, and every query answers.
void check_abi(const std::string& path, lwo_status_t expect, size_t n_entries) {
  lwo_checkpoint* ck = reinterpret_cast<lwo_checkpoint*>(uintptr_t{0x1234});
  const lwo_status_t s = lwo_checkpoint_open(path.c_str(), &ck);
  FUZZ_CHECK(s == expect, std::string(lwo_status_string(s)) + " vs " + lwo_status_string(expect) +
                              ": " + lwo_last_error_message());
  if (s != LWO_OK) {
    FUZZ_CHECK(ck == nullptr, "a failed open leaves a handle");
    FUZZ_CHECK(std::strncmp(lwo_last_error_message(), "lwo_checkpoint_open", 19) == 0,
               lwo_last_error_message());
    return;
  }
  uint32_t n = 0;
  FUZZ_CHECK(lwo_checkpoint_tensor_count(ck, &n) == LWO_OK && n == n_entries, "tensor count");
  for (uint32_t i = 0; i <= n; ++i) {
    lwo_checkpoint_tensor t = LWO_CHECKPOINT_TENSOR_INIT;
    const lwo_status_t q = lwo_checkpoint_tensor_info(ck, i, &t);
    FUZZ_CHECK(q == (i < n ? LWO_OK : LWO_ERR_OUT_OF_RANGE), lwo_last_error_message());
    if (q == LWO_OK) FUZZ_CHECK(t.name && t.dtype_name, "");
  }
  uint32_t nf = 0;
  FUZZ_CHECK(lwo_checkpoint_file_count(ck, &nf) == LWO_OK && nf >= 1, "file count");
  uint64_t held = 0;
  for (uint32_t i = 0; i <= nf; ++i) {
    lwo_checkpoint_file f = LWO_CHECKPOINT_FILE_INIT;
    const lwo_status_t q = lwo_checkpoint_file_info(ck, i, &f);
    FUZZ_CHECK(q == (i < nf ? LWO_OK : LWO_ERR_OUT_OF_RANGE), lwo_last_error_message());
    if (q == LWO_OK) held += f.n_tensors;
  }
  FUZZ_CHECK(held == n, "the files' tensors are the checkpoint's");
  uint32_t nm = 0;
  FUZZ_CHECK(lwo_checkpoint_metadata_count(ck, &nm) == LWO_OK, "");
  for (uint32_t i = 0; i <= nm; ++i) {
    uint32_t file = 0;
    const char *k = nullptr, *v = nullptr;
    const lwo_status_t q = lwo_checkpoint_metadata(ck, i, &file, &k, &v);
    FUZZ_CHECK(q == (i < nm ? LWO_OK : LWO_ERR_OUT_OF_RANGE), lwo_last_error_message());
    if (q == LWO_OK) FUZZ_CHECK(k && v && file < nf, "");
  }
  for (const char* pattern : {"{i}", "layers.{i}.", "model.layers.{i}.", "x"}) {
    lwo_checkpoint_pool_config c = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    c.pattern = pattern;
    uint32_t nu = 0;
    const lwo_status_t q = lwo_checkpoint_unmatched_count(ck, &c, &nu);
    FUZZ_CHECK(q == LWO_OK || in(kMapStatuses, q), lwo_last_error_message());
    if (q == LWO_OK) {
      FUZZ_CHECK(nu <= n, "");
      const char* name = nullptr;
      FUZZ_CHECK(lwo_checkpoint_unmatched_name(ck, &c, nu, &name) == LWO_ERR_OUT_OF_RANGE, "");
    }
  }
  FUZZ_CHECK(lwo_checkpoint_destroy(ck) == LWO_OK, "");
}

void open_and_check(const std::string& path, const std::map<std::string, std::string>* index) {
  lwo_status_t status = LWO_OK;
  size_t n_entries = 0;
  try {
    std::shared_ptr<lwo::Checkpoint> ck = lwo::Checkpoint::open(path);
    const auto& files = ck->files();
    const auto& es = ck->entries();
    n_entries = es.size();
    FUZZ_CHECK(!files.empty(), "");
    std::set<std::string> names;
    for (size_t i = 0; i < es.size(); ++i) {
      const lwo::st::Entry& e = es[i];
      FUZZ_CHECK(e.file < files.size(), "");
      FUZZ_CHECK(e.begin <= e.end && e.end <= files[e.file].size, e.name);
      FUZZ_CHECK(names.insert(e.name).second, "a name twice: " + e.name);
      FUZZ_CHECK(ck->find(e.name) == static_cast<int64_t>(i), e.name);
    }
    FUZZ_CHECK(ck->find("\x01 not a tensor") < 0, "");
    if (index) {
      // Consumed whole: the files are the index's shards, each once; the
      // tensors are the index's names, each in its own shard.
      std::set<std::string> shards, opened;
      for (const auto& kv : *index) shards.insert(kv.second);
      for (const auto& f : files) FUZZ_CHECK(opened.insert(base_name(f.path)).second, f.path);
      FUZZ_CHECK(shards == opened, "the files opened are the shards named");
      FUZZ_CHECK(es.size() == index->size(), "every tensor of the index");
      for (const auto& e : es) {
        auto it = index->find(e.name);
        FUZZ_CHECK(it != index->end() && it->second == base_name(files[e.file].path), e.name);
      }
    }
    try {
      lwo::Checkpoint::Mapping m = ck->map_by_patterns({"{i}"}, /*allow_gaps=*/true);
      (void)m;
    } catch (const lwo::Error& e) {
      FUZZ_CHECK(in(kMapStatuses, e.status()), e.what());
    }
  } catch (const lwo::Error& e) {
    status = e.status();
    FUZZ_CHECK(in(kOpenStatuses, status), std::string(lwo_status_string(status)) + ": " + e.what());
    // The message names the file or the index.
    FUZZ_CHECK(std::strstr(e.what(), folder().c_str()) != nullptr ||
                   std::strstr(e.what(), "safetensors") != nullptr,
               e.what());
  }
  check_abi(path, status, n_entries);
}

void run_input(const uint8_t* data, size_t size) {
  const lwo_fuzz::CheckpointInput in = lwo_fuzz::write_checkpoint_input(data, size);
  if (!in.is_index) {
    open_and_check(in.path, nullptr);
    return;
  }
  std::map<std::string, std::string> index;
  bool parsed = false;
  try {
    index = lwo::st::parse_index(in.index_text, "index");
    parsed = true;
  } catch (const lwo::Error& e) {
    FUZZ_CHECK(e.status() == LWO_ERR_BAD_JSON, e.what());
  }
  open_and_check(in.path, parsed ? &index : nullptr);
}

}  // namespace

LWO_FUZZ_ENTRY(run_input)

#ifndef LWO_LIBFUZZER
LWO_FUZZ_FILES_MAIN(run_input, "lwo_checkpoint_fuzz")
#endif
