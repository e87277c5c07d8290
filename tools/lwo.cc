// The lwo program: measures how fast host weights stream through a ring of
// device slots (probe), streams a synthetic model or a safetensors checkpoint,
// checking every byte (run, run --weights), trains a chain of linear layers
// through the ring (run --train), streams host weights sharded across the
// GPUs of one machine (shard), and describes a checkpoint (info).
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "tools/cli.h"

namespace cli {

const char* const kUsage =
    "usage: lwo <command> [flags]\n"
    "\n"
    "commands:\n"
    "  probe      pinned copy bandwidth by size, and ring streaming bandwidth by\n"
    "             ring depth and record size\n"
    "  run        stream a synthetic model through a ring, time each pass against\n"
    "             the pinned-copy peak and check every byte that arrives; with\n"
    "             --weights, stream a safetensors checkpoint instead; with\n"
    "             --train, train a chain of linear layers through the ring\n"
    "  shard      shard the host weights across N GPUs (one NCCL rank each) and\n"
    "             measure the link peaks, the all-gather, forward streaming and a\n"
    "             training step against the number of ranks\n"
    "  info       list a safetensors checkpoint's tensors, the layers they map to\n"
    "             and the device memory a ring over them needs (no GPU needed)\n"
    "  help       print this help (also --help, -h)\n"
    "  version    print the library version (also --version)\n"
    "\n"
    "lwo probe [flags]\n"
    "  --max-depth N    deepest ring measured, 1..64 (default 8)\n"
    "  --sizes LIST     copy sizes, e.g. 256K,1M,1G (default 256K,1M,4M,16M,64M,256M,1G)\n"
    "  --records LIST   ring record sizes (default 4M,16M,64M,256M)\n"
    "\n"
    "lwo run [flags]\n"
    "  --layers N       layers of the model (default 32)\n"
    "  --rows R         rows of each layer's tensor \"weight\" (default 8192)\n"
    "  --cols C         columns of it (default 8192)\n"
    "  --dtype T        bf16, f16, f32, f8_e4m3, f8_e5m2, i8 or u8 (default bf16)\n"
    "  --depth D        ring depth (default 2)\n"
    "  --passes P       timed passes, after one warm-up pass (default 5)\n"
    "  --seed S         seed of the random weights (default 1)\n"
    "  --timing         create the ring with LWO_RING_TIMING (copy and wait times)\n"
    "\n"
    "lwo run --weights FILE [flags]\n"
    "  Streams the layers of a safetensors checkpoint (a .safetensors file, or\n"
    "  the shards of a *.safetensors.index.json) through a ring, as lwo run\n"
    "  does: checksums of every layer against the file's bytes, bandwidth\n"
    "  against the pinned-copy peak of the same copy sizes. The file is mapped\n"
    "  and registered for DMA in place (\"registered\" path; target >= 97% of\n"
    "  the peak at depth >= 2); where that is refused, or with --staged, layers\n"
    "  go through pinned staging buffers (\"staged\" path; its share is\n"
    "  reported). Processes that stream the same file share its pages.\n"
    "  --weights FILE   the checkpoint\n"
    "  --pattern P      layer names: a prefix with one {i} for the layer index\n"
    "                   (default: the first of \"model.layers.{i}.\", \"blocks.{i}.\",\n"
    "                   \"layers.{i}.\", \"h.{i}.\", \"transformer.h.{i}.\" that maps\n"
    "                   a tensor); tensors that match no layer are left out\n"
    "  --staged         stream through pinned staging buffers, not the registered\n"
    "                   file (LWO_CHECKPOINT_STAGED)\n"
    "  --depth, --passes and --timing as for lwo run\n"
    "\n"
    "lwo run --train [flags]\n"
    "  Trains a chain of square linear layers y = x W^T on random data: one\n"
    "  schedule streams layers 0..L-1 forward, then L-1..0 backward; weight\n"
    "  gradients go to f32 host buffers (lwo_grads). Each step is timed against\n"
    "  max(resident compute, H2D bytes / H2D peak, D2H bytes / D2H peak), all\n"
    "  measured in the same run, and the first timed step is checked bit for bit\n"
    "  against the same computation with every weight resident on the device.\n"
    "  --train          train (the flags below need it)\n"
    "  --frozen         every layer frozen: input gradients only, no weight\n"
    "                   gradients (implies --train)\n"
    "  --tokens T       tokens per step (default 8192)\n"
    "  --steps S        timed steps, after one warm-up step (default 5)\n"
    "  --grad-depth G   gradient staging slots, 1..64 (default 2)\n"
    "  --native-wire    gradients travel in the layer dtype, not f32\n"
    "                   (LWO_GRADS_NATIVE_WIRE)\n"
    "  --bias           each layer also has a tensor \"bias\" [rows]\n"
    "  --layers, --rows, --cols, --depth, --seed and --timing as for lwo run;\n"
    "  --rows must equal --cols; --dtype is bf16, f16 or f32 (default bf16)\n"
    "\n"
    "lwo shard [flags]\n"
    "  Runs N ranks as threads of this process, rank r on GPU r, each with its\n"
    "  own engine, NCCL communicator and a sharded pool holding 1/N of every\n"
    "  layer (a chain of layers \"weight\" [rows x cols] bf16; rank r fills only\n"
    "  its shard). Measures, in one run and per rank count: each GPU's pinned\n"
    "  H2D peak of shard-sized copies, alone and with all GPUs at once; the\n"
    "  in-place NCCL all-gather of one record; forward streaming through a ring\n"
    "  (every slot checksummed against the records; bandwidth per GPU = layers\n"
    "  x record bytes x passes / time, the slowest rank, and its ratio to the\n"
    "  link peak); and a training step (forward, backward, weight gradients\n"
    "  summed over the ranks into host shards, checked) against max(resident\n"
    "  compute, H2D, D2H, collectives), each term measured in the same run.\n"
    "  Sets NCCL_NVLS_ENABLE=0 unless it is set.\n"
    "  --ranks N        ranks, 1..GPUs (default: every GPU)\n"
    "  --ranks-list L   several rank counts in turn, e.g. 1,2 (each with its own\n"
    "                   threads, engines and communicators)\n"
    "  --layers N       layers of the model (default 32)\n"
    "  --rows R         rows of each layer's tensor \"weight\" (default 8192)\n"
    "  --cols C         columns of it (default 8192)\n"
    "  --depth D        ring depth (default 2)\n"
    "  --passes P       timed passes and training steps, after one warm-up each\n"
    "                   (default 5)\n"
    "  --tokens T       tokens per training step (default 8192)\n"
    "  --grad-depth G   gradient staging slots, 1..64 (default 2)\n"
    "  --no-train       skip the training step (it needs f32 gradient shards on\n"
    "                   the host: twice the weights' host memory)\n"
    "  --check-collectives  engines with LWO_ENGINE_CHECK_COLLECTIVES (slow: finds\n"
    "                   ranks whose collective calls differ)\n"
    "  --seed S         seed of the records (the same bytes as lwo run --seed S)\n"
    "  --json and --quiet as below (the JSON holds one result per rank count);\n"
    "  --device does not apply: rank r runs on GPU r\n"
    "\n"
    "lwo info FILE [flags]\n"
    "  Prints every tensor of a safetensors checkpoint (name, dtype, shape,\n"
    "  bytes, file, offset), the layers a pattern maps them to (tensors and\n"
    "  bytes per layer), the unmatched tensors, and the device memory a ring of\n"
    "  depth D needs: D x the largest record, from a pool on the device when one\n"
    "  is present, else estimated (each tensor rounded up to 256 bytes).\n"
    "  --pattern P      as for lwo run --weights\n"
    "  --depth D        ring depth for the memory figure (default 2)\n"
    "  --estimate       estimate even when a CUDA device is present\n"
    "\n"
    "flags of all:\n"
    "  --device N       CUDA device ordinal (default 0)\n"
    "  --json FILE      also write the results as JSON to FILE\n"
    "  --quiet          no progress lines on stderr\n"
    "\n"
    "Sizes are whole numbers with an optional K, M or G suffix (powers of 1024);\n"
    "bandwidths are in GB/s (1e9 bytes/s). Exit status: 0 success, 1 failure\n"
    "(no CUDA device, a failed call, a checksum or check mismatch), 2 bad command\n"
    "line.\n";

}  // namespace cli

namespace {

int dispatch(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(cli::kUsage, stderr);
    return cli::kExitUsage;
  }
  const char* cmd = argv[1];
  if (!std::strcmp(cmd, "help") || !std::strcmp(cmd, "--help") || !std::strcmp(cmd, "-h")) {
    std::fputs(cli::kUsage, stdout);
    return 0;
  }
  if (!std::strcmp(cmd, "version") || !std::strcmp(cmd, "--version")) {
    std::printf("lwo %s\n", cli::version_text().c_str());
    return 0;
  }
  if (!std::strcmp(cmd, "probe")) return cli::cmd_probe(argc, argv);
  if (!std::strcmp(cmd, "run")) return cli::cmd_run(argc, argv);
  if (!std::strcmp(cmd, "info")) return cli::cmd_info(argc, argv);
  if (!std::strcmp(cmd, "shard")) return cli::cmd_shard(argc, argv);
  throw cli::UsageError(cli::strf("unknown command '%s'", cmd));
}

}  // namespace

int main(int argc, char** argv) {
  int rc = cli::kExitFailure;
  try {
    rc = dispatch(argc, argv);
  } catch (const cli::UsageError& e) {
    std::fprintf(stderr, "lwo: %s\n\n%s", e.what(), cli::kUsage);
    return cli::kExitUsage;
  } catch (const cli::Failure&) {
    rc = cli::kExitFailure;  // already printed
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lwo: %s\n", e.what());
    rc = cli::kExitFailure;
  } catch (...) {
    std::fprintf(stderr, "lwo: unknown error\n");
    rc = cli::kExitFailure;
  }
  return cli::g_cleanup_failed && rc == 0 ? cli::kExitFailure : rc;
}
