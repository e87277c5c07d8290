// The checkpoint calls of the C ABI, on the recording backend: destroy with
// pools alive, file info, shard numbering, metadata, tensor mapping by
// pattern and by names, pool kinds and access.
#include "abi_fixture.h"

namespace lwo {
namespace testing {
namespace {

/* ---------------------------------------------------------------------- */
/* Checkpoints                                                            */
/* ---------------------------------------------------------------------- */

uint64_t file_size(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  return static_cast<uint64_t>(st.st_size);
}

class CheckpointCalls : public WithFiles<AbiTest> {
 protected:
  // Writes ts to the temporary file `name` and opens it.
  lwo_checkpoint* write_and_open(const std::string& name, const std::vector<FileTensor>& ts) {
    const std::string path = file(name);
    write_safetensors(path, ts);
    return open(path);
  }
  lwo_checkpoint* open(const std::string& path) {
    lwo_checkpoint* ck = nullptr;
    EXPECT_EQ(lwo_checkpoint_open(path.c_str(), &ck), LWO_OK) << msg();
    return ck;
  }
  lwo_checkpoint_file file_info(lwo_checkpoint* ck, uint32_t i) {
    lwo_checkpoint_file f = LWO_CHECKPOINT_FILE_INIT;
    EXPECT_EQ(lwo_checkpoint_file_info(ck, i, &f), LWO_OK) << msg();
    return f;
  }
  lwo_checkpoint_tensor tensor_info(lwo_checkpoint* ck, uint32_t i) {
    lwo_checkpoint_tensor t = LWO_CHECKPOINT_TENSOR_INIT;
    EXPECT_EQ(lwo_checkpoint_tensor_info(ck, i, &t), LWO_OK) << msg();
    return t;
  }
};

// lwo_checkpoint_destroy: NULL is fine, the handle is dead afterwards, and
// a pool made from it keeps the files mapped and streams them.
TEST_F(CheckpointCalls, DestroyKeepsPoolsWorking) {
  auto ts = model(2, 10);
  std::string path = file("m.safetensors");
  write_safetensors(path, ts);
  EXPECT_EQ(lwo_checkpoint_destroy(nullptr), LWO_OK);
  lwo_checkpoint* ck = open(path);
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
  uint32_t n = 0;
  EXPECT_EQ(lwo_checkpoint_tensor_count(ck, &n), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_checkpoint_file_count(ck, &n), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_checkpoint_destroy(ck), LWO_ERR_INVALID_HANDLE);
  EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_destroy: ")) << msg();
  lwo_ring* ring = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  for (uint32_t l = 0; l < 2; ++l) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(acquire(ring, l, c, &t, &v));
    void* w = nullptr;
    ASSERT_LWO(lwo_ring_tensor(ring, t, "weight", &w));
    EXPECT_EQ(std::memcmp(w, ts[1 + 2 * l].bytes.data(), ts[1 + 2 * l].bytes.size()), 0);
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  destroy(ring, pool);
}

// lwo_checkpoint_file_count / file_info for one file: its path as opened,
// its size, its tensor count; index 1 is out of range; the size rule holds.
TEST_F(CheckpointCalls, FileInfoOfOneFile) {
  auto ts = model(3, 20);
  std::string path = file("one.safetensors");
  write_safetensors(path, ts);
  lwo_checkpoint* ck = open(path);
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_file_count(ck, &n));
  EXPECT_EQ(n, 1u);
  lwo_checkpoint_file f = file_info(ck, 0);
  EXPECT_EQ(f.size, sizeof(lwo_checkpoint_file));
  EXPECT_EQ(std::string(f.path), path);
  EXPECT_EQ(f.bytes, file_size(path));
  EXPECT_EQ(f.n_tensors, ts.size());
  EXPECT_EQ(lwo_checkpoint_file_info(ck, 1, &f), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_file_info: ")) << msg();
  f.size = 0;
  EXPECT_EQ(lwo_checkpoint_file_info(ck, 0, &f), LWO_ERR_INVALID_ARGUMENT);
  alignas(lwo_checkpoint_file) uint8_t buf[sizeof(lwo_checkpoint_file)];
  std::memset(buf, kSentinel, sizeof buf);
  auto* fp = reinterpret_cast<lwo_checkpoint_file*>(buf);
  fp->size = offsetof(lwo_checkpoint_file, n_tensors);
  ASSERT_LWO(lwo_checkpoint_file_info(ck, 0, fp));
  EXPECT_EQ(fp->bytes, file_size(path));
  EXPECT_TRUE(untouched(buf, offsetof(lwo_checkpoint_file, n_tensors), sizeof buf));
  EXPECT_EQ(lwo_checkpoint_file_count(ck, nullptr), LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// Files of an index are numbered in shard-name order, whatever the order
// of the index and of the tensor names: here the index lists the second
// shard's tensors first and they sort first by name. Each tensor's `file`
// is the file_info whose path holds it; tensors come in file order.
TEST_F(CheckpointCalls, ShardsAreNumberedInNameOrder) {
  // Shard "m-00002" holds "a.*", shard "m-00001" holds "b.*".
  std::vector<FileTensor> s2 = {make_tensor("a.x", "F32", 4, {8}, 1),
                                make_tensor("a.y", "F32", 4, {3, 4}, 2)};
  std::vector<FileTensor> s1 = {make_tensor("b.x", "BF16", 2, {16}, 3),
                                make_tensor("b.y", "F32", 4, {5}, 4),
                                make_tensor("b.z", "F32", 4, {2}, 5)};
  std::string p1 = file("m-00001.safetensors"), p2 = file("m-00002.safetensors");
  write_safetensors(p2, s2);  // the second shard is written first, too
  write_safetensors(p1, s1);
  std::string index = file("m.safetensors.index.json");
  {
    std::ofstream out(index);
    out << "{\"metadata\":{\"total_size\":\"0\"},\"weight_map\":{"
        << "\"a.y\":\"m-00002.safetensors\",\"a.x\":\"m-00002.safetensors\","
        << "\"b.z\":\"m-00001.safetensors\",\"b.x\":\"m-00001.safetensors\","
        << "\"b.y\":\"m-00001.safetensors\"}}";
  }
  lwo_checkpoint* ck = open(index);
  uint32_t nf = 0;
  ASSERT_LWO(lwo_checkpoint_file_count(ck, &nf));
  ASSERT_EQ(nf, 2u);
  lwo_checkpoint_file f0 = file_info(ck, 0), f1 = file_info(ck, 1);
  EXPECT_EQ(std::string(f0.path), p1);
  EXPECT_EQ(std::string(f1.path), p2);
  EXPECT_EQ(f0.bytes, file_size(p1));
  EXPECT_EQ(f1.bytes, file_size(p2));
  EXPECT_EQ(f0.n_tensors, 3u);
  EXPECT_EQ(f1.n_tensors, 2u);
  uint32_t nt = 0;
  ASSERT_LWO(lwo_checkpoint_tensor_count(ck, &nt));
  ASSERT_EQ(nt, 5u);
  uint32_t last_file = 0;
  for (uint32_t i = 0; i < nt; ++i) {
    lwo_checkpoint_tensor t = tensor_info(ck, i);
    std::string name = t.name;
    SCOPED_TRACE(name);
    ASSERT_LT(t.file, nf);
    EXPECT_EQ(std::string(file_info(ck, t.file).path), name[0] == 'b' ? p1 : p2);
    EXPECT_GE(t.file, last_file);  // file order
    last_file = t.file;
  }
  EXPECT_STREQ(tensor_info(ck, 0).name, "b.x");  // file 0, offset order
  EXPECT_STREQ(tensor_info(ck, 3).name, "a.x");
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// lwo_checkpoint_metadata_count / metadata: one file's "__metadata__" key by
// key in byte order (not the file's order), with its file index; the file
// pointer may be NULL; out of range leaves the outputs alone.
TEST_F(CheckpointCalls, MetadataOfOneFileInKeyByteOrder) {
  auto ts = model(1, 30);
  std::string path = file("meta.safetensors");
  write_safetensors(path, ts, {{"b", "2"}, {"a", "1"}, {"B", "3"}, {"\xc3\xa9", "4"}});
  lwo_checkpoint* ck = open(path);
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_metadata_count(ck, &n));
  ASSERT_EQ(n, 4u);
  const char* want[4][2] = {{"B", "3"}, {"a", "1"}, {"b", "2"}, {"\xc3\xa9", "4"}};
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t f = 9;
    const char* k = nullptr;
    const char* v = nullptr;
    ASSERT_LWO(lwo_checkpoint_metadata(ck, i, &f, &k, &v));
    EXPECT_EQ(f, 0u);
    EXPECT_STREQ(k, want[i][0]) << i;
    EXPECT_STREQ(v, want[i][1]) << i;
  }
  const char* k = nullptr;
  const char* v = nullptr;
  ASSERT_LWO(lwo_checkpoint_metadata(ck, 1, nullptr, &k, &v));
  EXPECT_STREQ(k, "a");
  uint32_t f = 9;
  k = v = "kept";
  EXPECT_EQ(lwo_checkpoint_metadata(ck, 4, &f, &k, &v), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_metadata: ")) << msg();
  EXPECT_EQ(f, 9u);
  EXPECT_STREQ(k, "kept");
  EXPECT_EQ(lwo_checkpoint_metadata(ck, 0, &f, nullptr, &v), LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));

  // No metadata at all.
  std::string plain = file("plain.safetensors");
  write_safetensors(plain, ts);
  ck = open(plain);
  ASSERT_LWO(lwo_checkpoint_metadata_count(ck, &n));
  EXPECT_EQ(n, 0u);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// Metadata of an index's shards: file by file in file (shard-name) order,
// each file's keys in byte order, each entry naming its file.
TEST_F(CheckpointCalls, MetadataOfShardsInFileOrder) {
  std::string p1 = file("s-00001.safetensors"), p2 = file("s-00002.safetensors");
  write_safetensors(p2, {make_tensor("a.w", "F32", 4, {4}, 1)}, {{"shard", "two"}, {"format", "pt"}});
  write_safetensors(p1, {make_tensor("b.w", "F32", 4, {4}, 2)}, {{"shard", "one"}});
  std::string index = file("s.safetensors.index.json");
  {
    std::ofstream out(index);
    out << "{\"weight_map\":{\"a.w\":\"s-00002.safetensors\",\"b.w\":\"s-00001.safetensors\"}}";
  }
  lwo_checkpoint* ck = open(index);
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_metadata_count(ck, &n));
  ASSERT_EQ(n, 3u);
  const struct {
    uint32_t file;
    const char *key, *value;
  } want[] = {{0, "shard", "one"}, {1, "format", "pt"}, {1, "shard", "two"}};
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t f = 9;
    const char* k = nullptr;
    const char* v = nullptr;
    ASSERT_LWO(lwo_checkpoint_metadata(ck, i, &f, &k, &v));
    EXPECT_EQ(f, want[i].file) << i;
    EXPECT_STREQ(k, want[i].key) << i;
    EXPECT_STREQ(v, want[i].value) << i;
  }
  EXPECT_EQ(std::string(file_info(ck, 1).path), p2);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// lwo_checkpoint_map_tensors with a pattern: layers[i] and names[i] (the
// prefix taken off) for matched tensors, LWO_NO_LAYER and NULL for the
// others, n_layers; exactly what lwo_pool_create_from_checkpoint builds.
TEST_F(CheckpointCalls, MapTensorsByPatternAgreesWithThePool) {
  const uint32_t L = 3;
  auto ts = model(L, 40);
  ts.push_back(make_tensor("head.weight", "F32", 4, {7}, 99));
  lwo_checkpoint* ck = write_and_open("map.safetensors", ts);
  uint32_t nt = 0;
  ASSERT_LWO(lwo_checkpoint_tensor_count(ck, &nt));
  ASSERT_EQ(nt, ts.size());
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  std::vector<uint32_t> layers(nt, 12345);
  std::vector<const char*> names(nt, "unset");
  uint32_t nl = 0;
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers.data(), names.data(), &nl));
  EXPECT_EQ(nl, L);
  std::map<uint32_t, std::vector<std::string>> by_layer;
  for (uint32_t i = 0; i < nt; ++i) {
    std::string full = tensor_info(ck, i).name;
    SCOPED_TRACE(full);
    if (full == "embed" || full == "head.weight") {
      EXPECT_EQ(layers[i], LWO_NO_LAYER);
      EXPECT_EQ(names[i], nullptr);
      continue;
    }
    uint32_t l = static_cast<uint32_t>(std::stoul(full.substr(7)));
    EXPECT_EQ(layers[i], l);
    ASSERT_NE(names[i], nullptr);
    EXPECT_EQ(std::string(names[i]), full.substr(std::string("blocks.").size() + 2));
    by_layer[layers[i]].push_back(names[i]);
  }
  // names and n_layers may be NULL.
  std::vector<uint32_t> layers2(nt, 12345);
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers2.data(), nullptr, nullptr));
  EXPECT_EQ(layers2, layers);
  // The pool has the same layers, with the same tensor names.
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  ASSERT_EQ(pool_info(pool).n_layers, nl);
  for (uint32_t l = 0; l < nl; ++l) {
    uint32_t n = 0;
    ASSERT_LWO(lwo_pool_layer_tensor_count(pool, l, &n));
    ASSERT_EQ(n, by_layer[l].size()) << "layer " << l;
    for (uint32_t k = 0; k < n; ++k) {
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
      EXPECT_EQ(std::string(ti.name), by_layer[l][k]) << "layer " << l << " tensor " << k;
    }
  }
  destroy(pool, ck);
}

// lwo_checkpoint_map_tensors with explicit names: full names, the caller's
// layers; a wrong n_tensors is LWO_ERR_SIZE_MISMATCH and a missing name
// LWO_ERR_NOT_FOUND, with the arrays left as they were.
TEST_F(CheckpointCalls, MapTensorsByNamesAndErrors) {
  auto ts = model(2, 50);
  lwo_checkpoint* ck = write_and_open("names.safetensors", ts);
  const uint32_t nt = static_cast<uint32_t>(ts.size());  // embed, b0.w, b0.b, b1.w, b1.b
  // Layer 0: blocks.1.bias, embed; layer 1: blocks.0.weight.
  const char* nm[3] = {"blocks.1.bias", "embed", "blocks.0.weight"};
  uint32_t nn[2] = {2, 1};
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.names = nm;
  cfg.n_names = nn;
  cfg.n_layers = 2;
  std::vector<uint32_t> layers(nt, 12345);
  std::vector<const char*> names(nt, "unset");
  uint32_t nl = 0;
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers.data(), names.data(), &nl));
  EXPECT_EQ(nl, 2u);
  const uint32_t want_layer[5] = {0, 1, LWO_NO_LAYER, LWO_NO_LAYER, 0};
  for (uint32_t i = 0; i < nt; ++i) {
    std::string full = tensor_info(ck, i).name;
    SCOPED_TRACE(full);
    EXPECT_EQ(layers[i], want_layer[i]);
    if (want_layer[i] == LWO_NO_LAYER) {
      EXPECT_EQ(names[i], nullptr);
    } else {
      ASSERT_NE(names[i], nullptr);
      EXPECT_EQ(std::string(names[i]), full);  // unstripped
    }
  }
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 1, &ti));
  EXPECT_STREQ(ti.name, "embed");
  ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 0, &ti));
  EXPECT_STREQ(ti.name, "blocks.0.weight");
  ASSERT_LWO(lwo_pool_destroy(pool));

  for (uint32_t wrong : {nt - 1, nt + 1, 0u}) {
    EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, wrong, layers.data(), names.data(), &nl),
              LWO_ERR_SIZE_MISMATCH);
    EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_map_tensors: ")) << msg();
  }
  nm[2] = "blocks.0.nope";
  std::fill(layers.begin(), layers.end(), 777u);
  nl = 99;
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers.data(), names.data(), &nl),
            LWO_ERR_NOT_FOUND);
  EXPECT_TRUE(contains(msg(), "blocks.0.nope")) << msg();
  EXPECT_EQ(layers, std::vector<uint32_t>(nt, 777u));
  EXPECT_EQ(nl, 99u);
  // A pattern's whole prefix for layer i comes off ("blocks.0.w" of
  // "blocks.0.weight").
  lwo_checkpoint_pool_config pat = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  pat.pattern = "blocks.{i}.w";  // only "blocks.<i>.weight": layers 0 and 1
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &pat, nt, layers.data(), names.data(), &nl));
  EXPECT_EQ(nl, 2u);
  EXPECT_STREQ(names[1], "eight");
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, nullptr, nt, layers.data(), names.data(), &nl),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &pat, nt, nullptr, names.data(), &nl),
            LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// lwo_pool_get_info of checkpoint pools: mapped when the files register,
// staged when asked (LWO_CHECKPOINT_STAGED) or when registration is
// refused; rank 0 of 1. Checkpoint pools are read-only (write_range
// LWO_ERR_UNSUPPORTED) and their shard calls give the whole tensor.
TEST_F(CheckpointCalls, PoolKindsAndAccess) {
  auto ts = model(2, 60);
  lwo_checkpoint* ck = write_and_open("kinds.safetensors", ts);
  for (int how = 0; how < 3; ++how) {
    SCOPED_TRACE(how);
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "blocks.{i}.";
    cfg.flags = how == 1 ? LWO_CHECKPOINT_STAGED : 0u;
    gpu->refuse_register = how == 2;
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
    gpu->refuse_register = false;
    lwo_pool_info pi = pool_info(pool);
    EXPECT_EQ(pi.kind, how == 0 ? LWO_POOL_CHECKPOINT_MAPPED : LWO_POOL_CHECKPOINT_STAGED);
    EXPECT_EQ(pi.rank, 0);
    EXPECT_EQ(pi.n_ranks, 1);
    EXPECT_EQ(pi.n_layers, 2u);
    uint8_t x[4] = {1, 2, 3, 4};
    EXPECT_EQ(lwo_pool_write_range(pool, 0, "bias", 0, x, 4), LWO_ERR_UNSUPPORTED);
    EXPECT_TRUE(starts_with(msg(), "lwo_pool_write_range: ")) << msg();
    void* th = nullptr;
    ASSERT_LWO(lwo_pool_tensor_host(pool, 1, "weight", &th, nullptr));
    void* d = nullptr;
    uint64_t first = 99, ne = 0;
    ASSERT_LWO(lwo_pool_shard_tensor(pool, 1, "weight", &d, &first, &ne));
    EXPECT_EQ(d, th);
    EXPECT_EQ(first, 0u);
    EXPECT_EQ(ne, ts[3].bytes.size() / 2);
    EXPECT_EQ(std::memcmp(d, ts[3].bytes.data(), ts[3].bytes.size()), 0);
    void* wh = nullptr;
    uint64_t wb = 0, off = 99, sb = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, 1, &wh, &wb));
    ASSERT_LWO(lwo_pool_shard_host(pool, 1, &d, &off, &sb));
    EXPECT_EQ(d, wh);
    EXPECT_EQ(off, 0u);
    EXPECT_EQ(sb, wb);
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
  // A failed pool creation sets the pool to NULL.
  lwo_checkpoint_pool_config bad = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  bad.pattern = "nothing.{i}.";
  lwo_pool* pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_from_checkpoint(engine, ck, &bad, &pool), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(pool, nullptr);
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_from_checkpoint(nullptr, ck, &bad, &pool), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(pool, nullptr);
  // A newer caller's larger checkpoint config: a zero tail is fine, else the
  // first nonzero byte is named.
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  Larger<lwo_checkpoint_pool_config> big(cfg);
  uint32_t un = 0;
  ASSERT_LWO(lwo_checkpoint_unmatched_count(ck, &big.cfg, &un));
  EXPECT_EQ(un, 1u);
  size_t at = big.poke(3);
  EXPECT_EQ(lwo_checkpoint_unmatched_count(ck, &big.cfg, &un), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(msg(), "byte " + std::to_string(at) + " ")) << msg();
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

}  // namespace
}  // namespace testing
}  // namespace lwo
