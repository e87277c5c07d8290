// Pools over safetensors checkpoints, on the recording backend: registered
// and staged paths, layer mapping, sharded checkpoints, a file that changes.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>

#include "checkpoint_files.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

class CheckpointTest : public WithFiles<EngineTest> {
 protected:
  // Writes `ts` as model.safetensors; returns its path.
  std::string write_model(const std::vector<FileTensor>& ts) {
    const std::string path = file("model.safetensors");
    write_safetensors(path, ts);
    return path;
  }
  // Writes ts to the file `name` and opens it into *ck.
  void open_model(const std::vector<FileTensor>& ts, lwo_checkpoint** ck,
                  const std::string& name = "model.safetensors") {
    const std::string path = file(name);
    write_safetensors(path, ts);
    ASSERT_LWO(lwo_checkpoint_open(path.c_str(), ck));
  }
  // Opens the checkpoint at `path` into *ck and makes a pool of its layers
  // "blocks.{i}." into *pool.
  void open_blocks(const std::string& path, lwo_checkpoint** ck, lwo_pool** pool,
                   uint32_t flags = 0) {
    ASSERT_LWO(lwo_checkpoint_open(path.c_str(), ck));
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "blocks.{i}.";
    cfg.flags = flags;
    ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, *ck, &cfg, pool));
  }
  // open_blocks of path, then a ring of depth 2 over its pool with layer 0
  // staged and released.
  void open_and_stage_first(const std::string& path, lwo_checkpoint** ck, lwo_pool** pool,
                            lwo_ring** ring) {
    ASSERT_NO_FATAL_FAILURE(open_blocks(path, ck, pool));
    *ring = make_ring(*pool, 2);
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(*ring, 0, &t));
    ASSERT_LWO(lwo_ring_release(*ring, t, nullptr));
  }
  // Streams every layer twice through a ring of depth 2 and checks every
  // tensor's slot bytes against the file's.
  void stream_and_check(lwo_pool* pool, const std::vector<FileTensor>& ts, uint32_t L) {
    lwo_ring* ring = make_ring(pool, 2);
    StreamH c = gpu->new_stream();
    for (int pass = 0; pass < 2; ++pass)
      for (uint32_t l = 0; l < L; ++l) {
        lwo_ticket t{};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_NO_FATAL_FAILURE(acquire(ring, l, c, &t, &v));
        ASSERT_EQ(v.n_tensors, 2u);
        void* w = nullptr;
        void* b = nullptr;
        ASSERT_LWO(lwo_ring_tensor(ring, t, "weight", &w));
        ASSERT_LWO(lwo_ring_tensor(ring, t, "bias", &b));
        const FileTensor& fw = ts[1 + 2 * l];
        const FileTensor& fb = ts[2 + 2 * l];
        EXPECT_EQ(std::memcmp(w, fw.bytes.data(), fw.bytes.size()), 0) << "layer " << l;
        EXPECT_EQ(std::memcmp(b, fb.bytes.data(), fb.bytes.size()), 0) << "layer " << l;
        gpu->read(c, v.base, v.record_bytes);
        ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
      }
    EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
    ASSERT_LWO(lwo_ring_destroy(ring));
  }
};

TEST_F(CheckpointTest, RegisteredLayersMoveInOneCopyEach) {
  const uint32_t L = 5;
  auto ts = model(L, 10);
  lwo_checkpoint* ck = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_model(ts, &ck));
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_tensor_count(ck, &n));
  EXPECT_EQ(n, 2 * L + 1);
  lwo_checkpoint_tensor info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_checkpoint_tensor_info(ck, 1, &info));
  EXPECT_STREQ(info.name, "blocks.0.weight");
  EXPECT_EQ(info.dtype, LWO_DTYPE_BF16);
  EXPECT_EQ(info.bytes, 16u * 24 * 2);
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  uint32_t un = 0;
  ASSERT_LWO(lwo_checkpoint_unmatched_count(ck, &cfg, &un));
  EXPECT_EQ(un, 1u);
  const char* uname = nullptr;
  ASSERT_LWO(lwo_checkpoint_unmatched_name(ck, &cfg, 0, &uname));
  EXPECT_STREQ(uname, "embed");
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));  // the pool keeps the mapping
  lwo_pool_info pi{};
  pi.size = sizeof pi;
  ASSERT_LWO(lwo_pool_get_info(pool, &pi));
  EXPECT_EQ(pi.n_layers, L);
  EXPECT_EQ(pi.kind, LWO_POOL_CHECKPOINT_MAPPED);
  EXPECT_EQ(gpu->n_registered(), 1u);  // the file mapping, in place
  uint64_t copies = gpu->stats.copies;
  stream_and_check(pool, ts, L);
  EXPECT_EQ(gpu->stats.copies - copies, uint64_t(L) * 2);  // one copy per layer, each pass
  EXPECT_EQ(lwo_pool_write(pool, 0, "weight", ts[1].bytes.data(), ts[1].bytes.size()),
            LWO_ERR_UNSUPPORTED);
  ASSERT_LWO(lwo_pool_destroy(pool));
  EXPECT_EQ(gpu->n_registered(), 0u);
}

TEST_F(CheckpointTest, StagedPathPacksThroughPinnedBuffers) {
  const uint32_t L = 4;
  auto ts = model(L, 20);
  lwo_checkpoint* ck = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_model(ts, &ck));
  for (int how = 0; how < 2; ++how) {  // asked for, and registration refused
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "blocks.{i}.";
    cfg.flags = how == 0 ? LWO_CHECKPOINT_STAGED : 0u;
    gpu->refuse_register = how == 1;
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
    lwo_pool_info pi{};
    pi.size = sizeof pi;
    ASSERT_LWO(lwo_pool_get_info(pool, &pi));
    EXPECT_EQ(pi.kind, LWO_POOL_CHECKPOINT_STAGED);
    gpu->refuse_register = false;
    uint64_t funcs = gpu->stats.host_funcs;
    stream_and_check(pool, ts, L);
    EXPECT_EQ(gpu->stats.host_funcs - funcs, uint64_t(L) * 2);  // one fill per copy
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// A checkpoint whose files would pass the engine's host limit is staged
// (the staging buffers charged instead), not registered, and streams.
TEST_F(CheckpointTest, FilesPastTheHostLimitAreStaged) {
  const uint32_t L = 4;
  auto ts = model(L, 21);
  lwo_checkpoint* ck = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_model(ts, &ck));
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  lwo_pool_info pi{};
  pi.size = sizeof pi;
  ASSERT_LWO(lwo_pool_get_info(pool, &pi));
  EXPECT_EQ(pi.kind, LWO_POOL_CHECKPOINT_MAPPED);
  uint64_t files = 0, charged = 0;
  ASSERT_LWO(lwo_engine_host_usage(engine, nullptr, &files));
  EXPECT_GT(files, 0u);  // the mapped files, registered in place, are charged
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_engine_host_usage(engine, nullptr, &charged));
  EXPECT_EQ(charged, 0u);
  ASSERT_LWO(lwo_engine_set_host_limit(engine, files - 1));
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  ASSERT_LWO(lwo_pool_get_info(pool, &pi));
  EXPECT_EQ(pi.kind, LWO_POOL_CHECKPOINT_STAGED);
  ASSERT_LWO(lwo_engine_host_usage(engine, nullptr, &charged));
  EXPECT_EQ(charged, 0u);  // nothing registered
  // This small model's two staging buffers (whole pages) pass that limit: lift it.
  ASSERT_LWO(lwo_engine_set_host_limit(engine, LWO_HOST_LIMIT_NONE));
  stream_and_check(pool, ts, L);
  ASSERT_LWO(lwo_engine_host_usage(engine, nullptr, &charged));
  EXPECT_GT(charged, 0u);  // the staging buffers
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

TEST_F(CheckpointTest, ExplicitNamesAndShardedIndex) {
  // Two shards and an index; layers by explicit names, bias first.
  auto ts = model(4, 30);
  std::vector<FileTensor> a(ts.begin(), ts.begin() + 5), b(ts.begin() + 5, ts.end());
  write_safetensors(file("m-00001.safetensors"), a);
  write_safetensors(file("m-00002.safetensors"), b);
  std::string index = file("m.safetensors.index.json");
  {
    std::ofstream out(index);
    out << "{\"metadata\":{},\"weight_map\":{";
    for (size_t i = 0; i < ts.size(); ++i)
      out << (i ? "," : "") << "\"" << ts[i].name << "\":\"" << (i < 5 ? "m-00001.safetensors" : "m-00002.safetensors") << "\"";
    out << "}}";
  }
  lwo_checkpoint* ck = nullptr;
  ASSERT_LWO(lwo_checkpoint_open(index.c_str(), &ck));
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_tensor_count(ck, &n));
  EXPECT_EQ(n, ts.size());
  std::vector<const char*> names;
  std::vector<uint32_t> n_names;
  for (uint32_t l = 0; l < 4; ++l) {
    names.push_back(ts[2 + 2 * l].name.c_str());
    names.push_back(ts[1 + 2 * l].name.c_str());
    n_names.push_back(2);
  }
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.names = names.data();
  cfg.n_names = n_names.data();
  cfg.n_layers = 4;
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  lwo_ring* ring = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  for (uint32_t l = 0; l < 4; ++l) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(acquire(ring, l, c, &t, &v));
    // In the caller's order: bias, then weight; full names.
    void* p = nullptr;
    ASSERT_LWO(lwo_ring_tensor(ring, t, ts[2 + 2 * l].name.c_str(), &p));
    EXPECT_EQ(p, v.tensors[0]);
    EXPECT_EQ(std::memcmp(v.tensors[0], ts[2 + 2 * l].bytes.data(), ts[2 + 2 * l].bytes.size()), 0);
    EXPECT_EQ(std::memcmp(v.tensors[1], ts[1 + 2 * l].bytes.data(), ts[1 + 2 * l].bytes.size()), 0);
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  destroy(ring, pool);
  // A name the checkpoint does not have.
  names[3] = "blocks.1.nope";
  EXPECT_EQ(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool), LWO_ERR_NOT_FOUND);
  EXPECT_NE(std::string(lwo_last_error_message()).find("blocks.1.nope"), std::string::npos)
      << lwo_last_error_message();
  EXPECT_EQ(pool, nullptr);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

TEST_F(CheckpointTest, AFileThatChangesSizeIsRefused) {
  auto ts = model(3, 40);
  const std::string path = write_model(ts);
  lwo_checkpoint* ck = nullptr;
  lwo_pool* pool = nullptr;
  lwo_ring* ring = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_and_stage_first(path, &ck, &pool, &ring));
  lwo_ticket t{};
  write_text(path, "appended", std::ios::binary | std::ios::app);
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t), LWO_ERR_FILE_CHANGED);
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("lwo_ring_stage"), std::string::npos) << m;
  EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
  destroy(ring, pool, ck);
}

// Not only the size: a file rewritten in place at the same size (its
// modification time changes) is FILE_CHANGED at the next stage; a file
// replaced by a rename is still no change (the mapping keeps the old one).
TEST_F(CheckpointTest, AFileModifiedAtTheSameSizeIsRefused) {
  auto ts = model(3, 41);
  const std::string path = write_model(ts);
  for (int replaced = 0; replaced < 2; ++replaced) {
    SCOPED_TRACE(replaced ? "replaced" : "modified");
    lwo_checkpoint* ck = nullptr;
    lwo_pool* pool = nullptr;
    lwo_ring* ring = nullptr;
    ASSERT_NO_FATAL_FAILURE(open_and_stage_first(path, &ck, &pool, &ring));
    lwo_ticket t{};
    if (replaced) {
      // Another file of the same size and time renamed over the path.
      const std::string other = file("other.safetensors");
      write_safetensors(other, ts);
      struct stat st {};
      ASSERT_EQ(stat(path.c_str(), &st), 0);
      struct timespec times[2] = {st.st_atim, st.st_mtim};
      ASSERT_EQ(utimensat(AT_FDCWD, other.c_str(), times, 0), 0);
      ASSERT_EQ(rename(other.c_str(), path.c_str()), 0);
    } else {
      // The same bytes written again in place, a second later by the clock.
      struct stat st {};
      ASSERT_EQ(stat(path.c_str(), &st), 0);
      write_safetensors(path, ts);
      struct timespec times[2] = {st.st_atim, st.st_mtim};
      times[1].tv_sec += 1;
      ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
    }
    if (replaced) {
      ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
      ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
    } else {
      EXPECT_EQ(lwo_ring_stage(ring, 1, &t), LWO_ERR_FILE_CHANGED);
      std::string m = lwo_last_error_message();
      EXPECT_NE(m.find("modified since it was opened"), std::string::npos) << m;
    }
    destroy(ring, pool, ck);
  }
}

// File and tensor names from the caller or from a file reach messages
// escaped: an ESC sequence or a newline in a name never reaches a terminal.
TEST_F(CheckpointTest, NamesInMessagesAreEscaped) {
  lwo_checkpoint* ck = nullptr;
  const std::string evil = dir + "/a\x1b[2Jb\nforged line.safetensors";
  EXPECT_EQ(lwo_checkpoint_open(evil.c_str(), &ck), LWO_ERR_IO);
  const std::string m = lwo_last_error_message();
  EXPECT_EQ(m.find('\x1b'), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_NE(m.find("a\\x1b[2Jb\\x0aforged line.safetensors'"), std::string::npos) << m;
  // an index naming a tensor its shard lacks: both names from the file
  const std::string shard = file("s.safetensors");
  write_safetensors(shard, model(1, 2));
  const std::string index = file("i.json");
  write_text(index, "{\"weight_map\": {\"x\\u001b[31m\": \"s.safetensors\"}}");
  EXPECT_NE(lwo_checkpoint_open(index.c_str(), &ck), LWO_OK);
  const std::string m2 = lwo_last_error_message();
  EXPECT_EQ(m2.find('\x1b'), std::string::npos) << m2;
  EXPECT_NE(m2.find("x\\x1b[31m"), std::string::npos) << m2;
}

// The file names of the header's and the index's own messages are escaped
// too: an index's name, and a shard's name as the index spells it.
TEST_F(CheckpointTest, FileNamesInFormatMessagesAreEscaped) {
  lwo_checkpoint* ck = nullptr;
  const std::string index = file("i\x1b[2J\nforged.json");
  write_text(index, "{");
  EXPECT_EQ(lwo_checkpoint_open(index.c_str(), &ck), LWO_ERR_BAD_JSON);
  std::string m = lwo_last_error_message();
  EXPECT_EQ(m.find('\x1b'), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_NE(m.find("i\\x1b[2J\\x0aforged.json'"), std::string::npos) << m;
  // A shard named with an ESC sequence, whose header is bad.
  write_text(file("s\x1b[31m.safetensors"), "abc", std::ios::binary);
  write_text(index, "{\"weight_map\": {\"a\": \"s\\u001b[31m.safetensors\"}}");
  EXPECT_EQ(lwo_checkpoint_open(index.c_str(), &ck), LWO_ERR_TRUNCATED);
  m = lwo_last_error_message();
  EXPECT_EQ(m.find('\x1b'), std::string::npos) << m;
  EXPECT_NE(m.find("s\\x1b[31m.safetensors'"), std::string::npos) << m;
  // A single file with a bad header.
  const std::string single = file("x\x1b]0;title\x07.safetensors");
  write_text(single, "abc", std::ios::binary);
  EXPECT_EQ(lwo_checkpoint_open(single.c_str(), &ck), LWO_ERR_TRUNCATED);
  m = lwo_last_error_message();
  EXPECT_EQ(m.find('\x1b'), std::string::npos) << m;
  EXPECT_EQ(m.find('\x07'), std::string::npos) << m;
  EXPECT_EQ(ck, nullptr);
}

// A shard that is a symlink out of the index's folder is refused (the name
// checks are lexical); links inside the folder, and a hub cache's layout
// (index and shards linked into one blob folder), open.
TEST_F(CheckpointTest, ShardsCannotLeaveTheIndexFolderThroughSymlinks) {
  ASSERT_EQ(mkdir((dir + "/in").c_str(), 0700), 0);
  ASSERT_EQ(mkdir((dir + "/out").c_str(), 0700), 0);
  write_safetensors(dir + "/out/secret.safetensors", model(1, 3));
  ASSERT_EQ(symlink("../out/secret.safetensors", (dir + "/in/s.safetensors").c_str()), 0);
  const std::string index = dir + "/in/m.safetensors.index.json";
  write_text(index, "{\"weight_map\": {\"embed\": \"s.safetensors\"}}");
  lwo_checkpoint* ck = nullptr;
  EXPECT_EQ(lwo_checkpoint_open(index.c_str(), &ck), LWO_ERR_BAD_JSON);
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("s.safetensors' lies outside the index's folder"), std::string::npos) << m;
  EXPECT_NE(m.find("/in'"), std::string::npos) << m;
  EXPECT_NE(m.find("/out/secret.safetensors'"), std::string::npos) << m;
  EXPECT_EQ(ck, nullptr);
  // A link to a file of the same folder opens.
  write_safetensors(dir + "/in/real.safetensors", model(1, 3));
  ASSERT_EQ(unlink((dir + "/in/s.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("real.safetensors", (dir + "/in/s.safetensors").c_str()), 0);
  ASSERT_LWO(lwo_checkpoint_open(index.c_str(), &ck));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
  // A hub cache: snapshots/r/ links to blobs/ for the index and the shard.
  ASSERT_EQ(mkdir((dir + "/blobs").c_str(), 0700), 0);
  ASSERT_EQ(mkdir((dir + "/snap").c_str(), 0700), 0);
  write_safetensors(dir + "/blobs/b1", model(1, 3));
  write_text(dir + "/blobs/b2", "{\"weight_map\": {\"embed\": \"s.safetensors\"}}");
  ASSERT_EQ(symlink("../blobs/b1", (dir + "/snap/s.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("../blobs/b2", (dir + "/snap/m.safetensors.index.json").c_str()), 0);
  ASSERT_LWO(lwo_checkpoint_open((dir + "/snap/m.safetensors.index.json").c_str(), &ck));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// A broken index is a malformed file (a format status), not an argument:
// a tensor its shard lacks, and a weight_map of no tensor.
TEST_F(CheckpointTest, BrokenIndexesGetAFormatStatus) {
  write_safetensors(file("s.safetensors"), model(1, 4));
  const std::string index = file("m.safetensors.index.json");
  write_text(index, "{\"weight_map\": {\"embed\": \"s.safetensors\", \"nope\": \"s.safetensors\"}}");
  lwo_checkpoint* ck = nullptr;
  EXPECT_EQ(lwo_checkpoint_open(index.c_str(), &ck), LWO_ERR_BAD_JSON);
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("tensor 'nope' is not in shard"), std::string::npos) << m;
  write_text(index, "{\"weight_map\": {}}");
  EXPECT_EQ(lwo_checkpoint_open(index.c_str(), &ck), LWO_ERR_BAD_JSON);
  m = lwo_last_error_message();
  EXPECT_NE(m.find("m.safetensors.index.json': the index's weight_map names no tensor"),
            std::string::npos) << m;
  EXPECT_EQ(ck, nullptr);
}

TEST_F(CheckpointTest, BadFilesAndConfigs) {
  lwo_checkpoint* ck = nullptr;
  EXPECT_EQ(lwo_checkpoint_open((dir + "/missing.safetensors").c_str(), &ck), LWO_ERR_IO);
  EXPECT_NE(std::string(lwo_last_error_message()).find("missing.safetensors"), std::string::npos);
  std::string tiny = file("tiny.safetensors");
  write_text(tiny, "abc", std::ios::binary);
  EXPECT_EQ(lwo_checkpoint_open(tiny.c_str(), &ck), LWO_ERR_TRUNCATED);
  EXPECT_EQ(ck, nullptr);
  auto ts = model(2, 50);
  const std::string path = write_model(ts);
  ASSERT_LWO(lwo_checkpoint_open(path.c_str(), &ck));
  lwo_pool* pool = nullptr;
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  EXPECT_EQ(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool), LWO_ERR_INVALID_ARGUMENT);
  cfg.pattern = "blocks.";
  EXPECT_EQ(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("{i}"), std::string::npos);
  cfg.pattern = "blocks.{i}.";
  cfg.flags = 0x10;
  EXPECT_EQ(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool), LWO_ERR_INVALID_ARGUMENT);
  cfg.flags = 0;
  lwo_checkpoint_tensor info{};
  info.size = sizeof info;
  EXPECT_EQ(lwo_checkpoint_tensor_info(ck, 99, &info), LWO_ERR_OUT_OF_RANGE);
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  destroy(pool, ck);
  EXPECT_EQ(lwo_checkpoint_destroy(ck), LWO_ERR_INVALID_HANDLE);
}

// Several patterns: the layers of the first come first; a tensor the first
// took is not matched again; names inside layers lose their own prefix.
TEST_F(CheckpointTest, SeveralPatternsStackTheirLayers) {
  lwo_pool* pool = nullptr;
  std::vector<FileTensor> ts;
  ts.push_back(make_tensor("double_blocks.0.w", "BF16", 2, {8, 4}, 1));
  ts.push_back(make_tensor("double_blocks.1.w", "BF16", 2, {8, 4}, 2));
  ts.push_back(make_tensor("single_blocks.0.w", "F32", 4, {3}, 3));
  ts.push_back(make_tensor("single_blocks.1.w", "F32", 4, {5}, 4));
  ts.push_back(make_tensor("single_blocks.2.w", "F32", 4, {7}, 5));
  ts.push_back(make_tensor("final.w", "F32", 4, {2}, 6));
  lwo_checkpoint* ck = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_model(ts, &ck, "flux.safetensors"));
  const char* const patterns[] = {"double_blocks.{i}.", "single_blocks.{i}."};
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.patterns = patterns;
  cfg.n_patterns = 2;
  uint32_t layer[6];
  const char* name[6];
  uint32_t n_layers = 0;
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, 6, layer, name, &n_layers));
  EXPECT_EQ(n_layers, 5u);
  const uint32_t want[] = {0, 1, 2, 3, 4, LWO_NO_LAYER};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(layer[i], want[i]) << i;
  for (int i = 0; i < 5; ++i) EXPECT_STREQ(name[i], "w") << i;
  EXPECT_EQ(name[5], nullptr);
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  uint64_t rb = 0;
  ASSERT_LWO(lwo_pool_record_bytes(pool, 3, &rb));  // single_blocks.1.w: 5 f32
  EXPECT_EQ(rb, 256u);
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 4, 0, &ti));
  EXPECT_EQ(ti.bytes, 28u);
  ASSERT_LWO(lwo_pool_destroy(pool));
  // A tensor an earlier pattern took is not the later one's.
  const char* const overlapping[] = {"{i}_blocks.0.", "double_blocks.{i}."};
  cfg.patterns = overlapping;
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, 6, layer, name, &n_layers), LWO_ERR_NOT_FOUND);
  // One of pattern, patterns, names.
  cfg.patterns = patterns;
  cfg.pattern = "double_blocks.{i}.";
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, 6, layer, name, &n_layers),
            LWO_ERR_INVALID_ARGUMENT);
  cfg.pattern = nullptr;
  cfg.n_patterns = 0;
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, 6, layer, name, &n_layers),
            LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// LWO_CHECKPOINT_ALLOW_GAPS: a missing layer index is an empty layer, not an
// error; without it the mapping refuses, naming the missing layer.
TEST_F(CheckpointTest, GapsBecomeEmptyLayersOnRequest) {
  lwo_pool* pool = nullptr;
  std::vector<FileTensor> ts;
  ts.push_back(make_tensor("h.0.w", "F32", 4, {4}, 1));
  ts.push_back(make_tensor("h.3.w", "F32", 4, {4}, 2));
  lwo_checkpoint* ck = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_model(ts, &ck, "gaps.safetensors"));
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "h.{i}.";
  uint32_t layer[2];
  uint32_t n_layers = 0;
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, 2, layer, nullptr, &n_layers), LWO_ERR_NOT_FOUND);
  EXPECT_NE(std::string(lwo_last_error_message()).find("layer 1"), std::string::npos)
      << lwo_last_error_message();
  cfg.flags = LWO_CHECKPOINT_ALLOW_GAPS;
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, 2, layer, nullptr, &n_layers));
  EXPECT_EQ(n_layers, 4u);
  EXPECT_EQ(layer[0], 0u);
  EXPECT_EQ(layer[1], 3u);
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  uint32_t nt = 9;
  ASSERT_LWO(lwo_pool_layer_tensor_count(pool, 1, &nt));
  EXPECT_EQ(nt, 0u);
  uint64_t rb = 9;
  ASSERT_LWO(lwo_pool_record_bytes(pool, 2, &rb));
  EXPECT_EQ(rb, 0u);
  destroy(pool, ck);
}

// Every safetensors dtype is an lwo dtype, so a layer holding integer,
// boolean and f64 tensors streams as bytes.
TEST_F(CheckpointTest, EveryDtypeStreamsAsBytes) {
  lwo_pool* pool = nullptr;
  std::vector<FileTensor> ts;
  ts.push_back(make_tensor("embed", "F32", 4, {2}, 9));
  ts.push_back(make_tensor("blocks.0.weight", "I64", 8, {3, 5}, 1));
  ts.push_back(make_tensor("blocks.0.bias", "BOOL", 1, {7}, 2));
  ts.push_back(make_tensor("blocks.1.weight", "F64", 8, {4, 2}, 3));
  ts.push_back(make_tensor("blocks.1.bias", "U16", 2, {9}, 4));
  lwo_checkpoint* ck = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_model(ts, &ck, "ints.safetensors"));
  lwo_checkpoint_tensor info = LWO_CHECKPOINT_TENSOR_INIT;
  ASSERT_LWO(lwo_checkpoint_tensor_info(ck, 2, &info));
  EXPECT_EQ(info.dtype, LWO_DTYPE_BOOL);
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 0, &ti));
  EXPECT_EQ(ti.dtype, LWO_DTYPE_I64);
  stream_and_check(pool, ts, 2);
  destroy(pool, ck);
}

// Anything but a regular file is refused at once, without blocking: a named
// pipe nobody writes to would block a plain open forever.
TEST_F(CheckpointTest, NonRegularFilesAreRefusedWithoutBlocking) {
  std::string fifo = file("pipe.safetensors");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  lwo_checkpoint* ck = nullptr;
  EXPECT_EQ(lwo_checkpoint_open(fifo.c_str(), &ck), LWO_ERR_IO);
  EXPECT_NE(std::string(lwo_last_error_message()).find("named pipe"), std::string::npos)
      << lwo_last_error_message();
  std::string index = file("pipe.safetensors.index.json");
  ASSERT_EQ(mkfifo(index.c_str(), 0600), 0);
  EXPECT_EQ(lwo_checkpoint_open(index.c_str(), &ck), LWO_ERR_IO);
  EXPECT_EQ(lwo_checkpoint_open(dir.c_str(), &ck), LWO_ERR_IO);
  EXPECT_NE(std::string(lwo_last_error_message()).find("a folder"), std::string::npos)
      << lwo_last_error_message();
  EXPECT_EQ(ck, nullptr);
}

// An index above the limit is refused from its size, before it is read: a
// sparse file of 2 GiB costs neither the time nor the memory of reading it.
TEST_F(CheckpointTest, AnIndexAboveTheLimitIsRefusedFromItsSize) {
  const std::string index = file("big.safetensors.index.json");
  write_text(index, "{\"weight_map\": {}}");
  ASSERT_EQ(truncate(index.c_str(), off_t(2) << 30), 0);
  lwo_checkpoint* ck = nullptr;
  EXPECT_EQ(lwo_checkpoint_open(index.c_str(), &ck), LWO_ERR_BAD_HEADER_SIZE);
  const std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("big.safetensors.index.json'"), std::string::npos) << m;
  EXPECT_NE(m.find("2147483648 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("above the limit of 104857600"), std::string::npos) << m;
  EXPECT_EQ(ck, nullptr);
}

// A file cut short after the stage's check and before its host threads copy
// the layer out of the mapping (the recording backend's hook runs between
// the two): the copy's SIGBUS is a status, the process lives, the pool then
// refuses every stage and acquire for good (hits included, and even once the
// file is whole again with its old modification time), every object can
// still be destroyed, and the checkpoint reopened streams as before.
TEST_F(CheckpointTest, AFileCutShortDuringAStagedCopyIsAStatus) {
  const uint32_t L = 3;
  auto ts = model(L, 60);
  std::string path = file("model.safetensors");
  write_safetensors(path, ts);
  struct stat at_open {};
  ASSERT_EQ(stat(path.c_str(), &at_open), 0);
  lwo_checkpoint* ck = nullptr;
  lwo_pool* pool = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_blocks(path, &ck, &pool, LWO_CHECKPOINT_STAGED));
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ticket t{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
  int cuts = 0;
  gpu->before_host_func = [&] {
    if (cuts++ == 0) {
      ASSERT_EQ(truncate(path.c_str(), 0), 0);
    }
  };
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t), LWO_ERR_FILE_CHANGED);
  gpu->before_host_func = nullptr;
  EXPECT_EQ(cuts, 1);
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("lwo_ring_stage"), std::string::npos) << m;
  EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("cut short while a layer was copied"), std::string::npos) << m;
  lwo_ring_info ri{};
  ri.size = sizeof ri;
  ASSERT_LWO(lwo_ring_get_info(ring, &ri));
  EXPECT_EQ(ri.n_free, 2u);  // the failed stage holds no slot
  // The file whole again, its modification time put back: the size and time
  // check passes, the fault still stands.
  write_safetensors(path, ts);
  struct timespec times[2] = {at_open.st_atim, at_open.st_mtim};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  for (uint32_t l : {0u, 1u, 2u}) {  // layer 0 would be a hit
    EXPECT_EQ(lwo_ring_stage(ring, l, &t), LWO_ERR_FILE_CHANGED) << "layer " << l;
    m = lwo_last_error_message();
    EXPECT_NE(m.find("cut short"), std::string::npos) << m;
  }
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
  // Reopened, the same file streams as before.
  ASSERT_NO_FATAL_FAILURE(open_blocks(path, &ck, &pool, LWO_CHECKPOINT_STAGED));
  stream_and_check(pool, ts, L);
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

// Layers large enough to be copied by several host threads (two parts of
// 18 MiB each), the file cut in the middle of the second layer: the part
// past the new end faults on its own thread, the stage is a status, and a
// ticket staged before the cut cannot be acquired (its pool has a lost copy)
// but can be released.
TEST_F(CheckpointTest, AFileCutShortUnderSeveralCopyThreadsIsAStatus) {
  const int64_t rows = 9 * 1024, cols = 1024;  // 36 MiB of F32 per layer
  std::vector<FileTensor> ts;
  for (uint32_t i = 0; i < 2; ++i)
    ts.push_back(make_tensor("blocks." + std::to_string(i) + ".weight", "F32", 4, {rows, cols},
                             70 + i));
  std::string path = file("big.safetensors");
  write_safetensors(path, ts);
  struct stat whole {};
  ASSERT_EQ(stat(path.c_str(), &whole), 0);
  lwo_checkpoint* ck = nullptr;
  lwo_pool* pool = nullptr;
  ASSERT_NO_FATAL_FAILURE(open_blocks(path, &ck, &pool, LWO_CHECKPOINT_STAGED));
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ticket t0{}, t1{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t0));
  // Three quarters of the way through layer 1: its first part is whole.
  const off_t cut = whole.st_size - static_cast<off_t>(ts[1].bytes.size() / 4);
  gpu->before_host_func = [&] { ASSERT_EQ(truncate(path.c_str(), cut), 0); };
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t1), LWO_ERR_FILE_CHANGED);
  gpu->before_host_func = nullptr;
  std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("big.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("cut short"), std::string::npos) << m;
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_ring_acquire(ring, t0, stream(c), &v), LWO_ERR_FILE_CHANGED);
  m = lwo_last_error_message();
  EXPECT_NE(m.find("lwo_ring_acquire"), std::string::npos) << m;
  ASSERT_LWO(lwo_ring_release(ring, t0, stream(c)));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

}  // namespace
}  // namespace testing
}  // namespace lwo
