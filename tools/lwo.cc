// The lwo program: subcommands that measure how fast host weights stream
// through a ring of device slots (probe), stream a synthetic model (run) or
// safetensors checkpoints (stream), checking every byte, train a chain of
// linear layers through the ring (train), plan a budget (plan) and describe
// a checkpoint (info). This file dispatches and prints the help;
// docs/CLI.md is the reference. (The sharded multi-GPU benchmark is
// bench/bench_shard.cc, built on the same pieces.)
#include <algorithm>
#include <cstdio>
#include <string>

#include "tools/cli.h"

namespace cli {
namespace {

const char* const kOverviewHint = "run 'lwo help' for the commands";

// "probe, run, ..., help or version": the command table's names.
std::string command_names() {
  std::string out;
  const auto& all = commands();
  for (size_t i = 0; i < all.size(); ++i)
    out += std::string(i == 0 ? "" : i + 1 == all.size() ? " or " : ", ") + all[i]->name;
  return out;
}

constexpr size_t kWidth = 79;     // columns of the help text
constexpr size_t kFlagCol = 21;   // where a flag's help starts

// `text` wrapped at kWidth, every line after the first indented by `indent`
// (the first starts at column `at`); words are split at spaces.
std::string wrap(const std::string& text, size_t at, size_t indent) {
  std::string out;
  size_t col = at;
  size_t b = 0;
  while ((b = text.find_first_not_of(' ', b)) != std::string::npos) {
    const size_t e = std::min(text.find(' ', b), text.size());
    const std::string word = text.substr(b, e - b);
    b = e;
    if (!out.empty() && col + 1 + word.size() > kWidth) {
      out += "\n" + std::string(indent, ' ');
      col = indent;
    } else if (!out.empty()) {
      out += ' ';
      ++col;
    }
    out += word;
    col += word.size();
  }
  return out;
}

const Command* find_command(const std::string& name) {
  for (const Command* c : commands())
    if (name == c->name) return c;
  return nullptr;
}

void print_overview(std::FILE* out) {
  std::fprintf(out,
               "lwo %s: streams model layers from host memory through a ring of GPU slots\n\n"
               "usage: lwo COMMAND [flags]\n\ncommands:\n",
               version_text().c_str());
  for (const Command* c : commands()) {
    std::string head = strf("  %s %s", c->name, c->operands);
    std::fprintf(out, "%-18s%s\n", head.c_str(), wrap(c->summary, 18, 18).c_str());
  }
  std::fputs(
      "\n"
      "Sizes are whole numbers with an optional K, M or G suffix (powers of 1024);\n"
      "bandwidths are in GB/s (1e9 bytes/s). Results go to stdout; progress to\n"
      "stderr: a bar on a terminal, else one line per phase; --quiet silences it.\n"
      "--json FILE also writes the results of a command as JSON.\n"
      "\n"
      "exit status:\n"
      "  0  success\n"
      "  1  runtime failure: no usable GPU, a failed call, a checksum or check\n"
      "     mismatch, a file that cannot be read\n"
      "  2  usage error: a bad command, flag or value, or a pattern or name list\n"
      "     that does not fit the checkpoint (one line, then a hint)\n"
      "\n"
      "The reference: docs/CLI.md\n",
      out);
}

}  // namespace

void print_command_help(const Command& c, std::FILE* out) {
  std::fprintf(out, "usage: %s%s%s%s%s%s\n\n", g_program.c_str(), *c.name ? " " : "", c.name,
               *c.operands ? " " : "", c.operands, c.flags ? " [flags]" : "");
  std::fputs(c.about, out);
  if (!c.flags) return;
  std::fputs("\nflags:\n", out);
  for (const Flag& f : c.flags()) {
    if (f.hidden()) continue;
    std::string head = "  " + f.name + (f.value.empty() ? "" : " " + f.value);
    if (head.size() + 1 > kFlagCol) {
      std::fprintf(out, "%s\n%s", head.c_str(), std::string(kFlagCol, ' ').c_str());
    } else {
      std::fprintf(out, "%-*s", static_cast<int>(kFlagCol), head.c_str());
    }
    std::fprintf(out, "%s\n", wrap(f.help, kFlagCol, kFlagCol).c_str());
  }
  std::fputs("  --help, -h         this help\n", out);
}

namespace {

void no_argument_after(int argc, char** argv, int n) {
  if (argc > n)
    throw UsageError(strf("unexpected argument %s", quoted(argv[n]).c_str()), kOverviewHint);
}

int cmd_help(int argc, char** argv) {
  no_argument_after(argc, argv, 3);
  if (argc == 2) {
    print_overview(stdout);
    return kExitOk;
  }
  const Command* c = find_command(argv[2]);
  if (!c) throw UsageError(strf("unknown command %s", quoted(argv[2]).c_str()), kOverviewHint);
  print_command_help(*c, stdout);
  return kExitOk;
}

int cmd_version(int argc, char** argv) {
  no_argument_after(argc, argv, 2);
  std::printf("lwo %s\n", version_text().c_str());
  return kExitOk;
}

}  // namespace

// The two commands the dispatcher answers itself: no flags.
const Command kHelpCommand = {"help", "[COMMAND]",
    "this overview, or the flags of COMMAND (lwo COMMAND --help)",
    "the overview of the commands, or with COMMAND its flags (the same as\n"
    "lwo COMMAND --help)\n",
    nullptr, cmd_help};
const Command kVersionCommand = {"version", "",
    "the library version (also --version)",
    "prints the version of the lwo program and of the liblwo it runs (also\n"
    "lwo --version)\n",
    nullptr, cmd_version};

const std::vector<const Command*>& commands() {
  static const std::vector<const Command*> all = {
      &kProbeCommand, &kRunCommand,   &kTrainCommand, &kStreamCommand, &kInfoCommand,
      &kPlanCommand,  &kHelpCommand,  &kVersionCommand};
  return all;
}

int dispatch(int argc, char** argv) {
  if (argc < 2) throw UsageError("a command is needed: " + command_names(), kOverviewHint);
  std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h") cmd = "help";
  if (cmd == "--version") cmd = "version";
  const Command* c = find_command(cmd);
  if (!c) throw UsageError(strf("unknown command %s", quoted(cmd).c_str()), kOverviewHint);
  g_command = c->name;
  g_running = c;
  return c->main(argc, argv);
}

}  // namespace cli
