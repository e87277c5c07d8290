// main() of the lwo program: its commands are dispatched by tools/lwo.cc;
// everything else in tools/ is also built into bench_shard.
#include "tools/cli.h"

int main(int argc, char** argv) { return cli::run_program(argc, argv, cli::dispatch); }
