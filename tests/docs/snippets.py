#!/usr/bin/env python3
"""Every fenced block of README.md and docs/BUILD.md, checked as far as a machine
without a GPU, root or the network can check it, so that none can rot:

- ``sh``: run with ``bash -e`` in an empty folder where ``build/`` holds the build
  folder's ``lwo`` and ``liblwo.so*`` (links to them: a snippet cannot change the build
  folder), ``scripts`` is the repository's, and ``app.c`` a program that uses only
  lwo.h and needs no GPU (tests/install/consumer.c); ``/opt/lwo`` stands for a scratch
  prefix that the build folder is installed into (``cmake --install``). An untyped
  block right after ``<!-- snippet: output -->`` is what the block before it must
  print: each of its lines, in order, is a line of the output (stdout and stderr
  together), and a line "..." stands for any lines.
- ``cmake``: the end of a consumer project's CMakeLists.txt (``add_executable(app
  app.c)`` before it), configured against that prefix, built, and its program run.
- ``c``: compiled and linked against the build tree (include/lwo.h, liblwo.so) with
  ``-std=c11 -pedantic -Wall -Wextra -Werror``, then run. A fragment is completed as
  FRAGMENTS says: inside ``main`` after the declarations it leaves to the reader, or,
  for an excerpt of an example, compared line by line (comments aside) with that
  file, which is then compiled and linked in its place.
- ``python``: parsed, then run.

NOT_RUN lists, by file and first line, each block that needs what such a machine
lacks, with the reason. Such a block still gets every check above short of running
(compiled and linked, parsed), and a shell block is parsed by bash and the scripts,
``lwo`` commands and ``-D`` options it names must exist. Exit 1 naming the file and
line of each failure and of a block this check has no way to take; 0 with the
counts, the NOT_RUN blocks listed with their reasons. A NOT_RUN or FRAGMENTS entry
that names no block (its block was edited) stops the check before anything runs, so
that an edited block that must not run is never taken for one to run.

  python3 tests/docs/snippets.py REPO BUILD_DIR
  LWO_CC, LWO_CMAKE, LWO_GENERATOR: the C compiler, cmake and the CMake generator
  for the consumer builds (ctest passes the build's; default cc, cmake, cmake's own)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

FILES = ["README.md", os.path.join("docs", "BUILD.md")]
BUILD_MD = os.path.join("docs", "BUILD.md")
OUTPUT_MARK = "<!-- snippet: output -->"
PREFIX_IN_DOCS = "/opt/lwo"
CFLAGS = ["-std=c11", "-pedantic", "-Wall", "-Wextra", "-Werror"]
TIMEOUT = 300

SETUP_AND_TEST = ("needs a GPU (lwo probe, lwo run), and root and the network (scripts/setup "
                  "installs Debian and Python packages); scripts/test is the whole of CI, "
                  "this check included")

# (file, first line of the block) -> why it is not run.
NOT_RUN = {
    ("README.md", "import torch, lwo.torch"):
        "needs a GPU (lwo.torch.offload streams through liblwo on CUDA), and build_model "
        "and data stand for the reader's own",
    ("README.md", "#include <lwo.h>   /* the whole API; no CUDA header needed */"):
        "needs a GPU (lwo_engine_create)",
    ("README.md", "scripts/setup && cmake -S . -B build -G Ninja && cmake --build build && "
                  "build/lwo probe && build/lwo run"): SETUP_AND_TEST,
    ("README.md", "LWO_CHECK(lwo_engine_create(NULL, &engine)); /* NULL config: device 0 */"):
        "needs a GPU (lwo_engine_create)",
    (BUILD_MD, "scripts/setup && cmake -S . -B build -G Ninja && cmake --build build && "
               "build/lwo probe && build/lwo run"): SETUP_AND_TEST,
    (BUILD_MD, "cmake -S . -B build -G Ninja -DLWO_BUILD_TESTS=OFF -DLWO_BUILD_BENCH=OFF "
               "-DLWO_BUILD_TOOLS=OFF"):
        "configures and builds the library again (minutes of nvcc) and installs it into "
        "/opt/lwo (root)",
}

# (file, first line of a C block that is no whole program) -> how to complete it:
# ("declare", the declarations it uses and leaves to the reader, put first in main), or
# ("excerpt", the example it is taken from).
FRAGMENTS = {
    ("README.md", "#include <lwo.h>   /* the whole API; no CUDA header needed */"): ("declare", """\
  static lwo_layer_desc layers[1]; /* the reader's model */
  static uint32_t order[1];
  uint32_t n_layers = 1;
  lwo_engine* engine = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_schedule* sched = NULL;
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  lwo_stream_t stream = NULL;
  lwo_layer_view view = LWO_LAYER_VIEW_INIT;
"""),
    ("README.md", "LWO_CHECK(lwo_engine_create(NULL, &engine)); /* NULL config: device 0 */"):
        ("excerpt", os.path.join("examples", "first_program.c")),
}

FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")


def blocks(path):
    """[(language, line number of the first line, text, after the output mark)]."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            marked = i > 0 and lines[i - 1].strip() == OUTPUT_MARK
            out.append((m.group(1), i + 2, "\n".join(lines[i + 1:j]), marked))
            i = j
        i += 1
    return out


def matches(want, got):
    """None if every line of `want` is a line of `got`, in order ("..." for any
    lines); else the first line that is not."""
    got_lines = got.split("\n")
    pos = 0
    for w in want.split("\n"):
        if w.strip() == "...":
            continue
        while pos < len(got_lines) and got_lines[pos].rstrip() != w.rstrip():
            pos += 1
        if pos == len(got_lines):
            return w
        pos += 1
    return None


def c_code_lines(text):
    """The code of each line of C text, comments taken out and spaces collapsed,
    without the lines left empty."""
    out, in_comment = [], False
    for line in text.split("\n"):
        code, i = "", 0
        while i < len(line):
            if in_comment:
                j = line.find("*/", i)
                if j < 0:
                    break
                in_comment, i = False, j + 2
            else:
                j = line.find("/*", i)
                if j < 0:
                    code += line[i:]
                    break
                code, in_comment, i = code + line[i:j], True, j + 2
        code = " ".join(code.split())
        if code:
            out.append(code)
    return out


class Check:
    def __init__(self, repo, build):
        self.repo, self.build = repo, build
        self.cc = os.environ.get("LWO_CC") or "cc"
        self.cmake = os.environ.get("LWO_CMAKE") or "cmake"
        self.generator = os.environ.get("LWO_GENERATOR") or ""
        self.tmp = tempfile.mkdtemp(prefix="lwo-docs-snippets.")
        self.prefix = None
        self.failures = []
        self.counts = {}

    def count(self, what):
        self.counts[what] = self.counts.get(what, 0) + 1

    def fail(self, where, what, output=""):
        self.failures.append("%s: %s%s" % (where, what, ("\n" + output.rstrip()) if output else ""))

    def run(self, cmd, cwd, where, what, **kw):
        """Runs cmd; None (and a failure noted) if it fails, else its output."""
        try:
            r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=TIMEOUT, **kw)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.fail(where, "%s: %s" % (what, e))
            return None
        if r.returncode != 0:
            self.fail(where, "%s exited %d" % (what, r.returncode), r.stdout)
            return None
        return r.stdout

    def scratch(self, name):
        d = tempfile.mkdtemp(prefix=name + ".", dir=self.tmp)
        return d

    def installed_prefix(self, where):
        """The build folder installed to a scratch prefix, made once."""
        if self.prefix is None:
            prefix = os.path.join(self.tmp, "prefix")
            if self.run([self.cmake, "--install", self.build, "--prefix", prefix], self.tmp, where,
                        "installing the build folder for %s" % PREFIX_IN_DOCS) is None:
                return None
            self.prefix = prefix
        return self.prefix

    def with_prefix(self, text, where):
        if PREFIX_IN_DOCS not in text:
            return text
        prefix = self.installed_prefix(where)
        return None if prefix is None else text.replace(PREFIX_IN_DOCS, prefix)

    def consumer_folder(self, name):
        d = self.scratch(name)
        shutil.copy(os.path.join(self.repo, "tests", "install", "consumer.c"),
                    os.path.join(d, "app.c"))
        return d

    # -- sh --------------------------------------------------------------------
    def shell_static(self, text, where):
        """bash parses it; the scripts, lwo commands and -D options it names exist."""
        self.run(["bash", "-n", "-c", text], self.tmp, where, "bash -n")
        for m in re.finditer(r"(?<![\w./-])scripts/([\w.-]+)", text):
            path = os.path.join(self.repo, "scripts", m.group(1))
            if not os.access(path, os.X_OK):
                self.fail(where, "names scripts/%s, which is no executable file" % m.group(1))
        for m in re.finditer(r"(?<![\w./-])build/lwo\s+([a-z][\w-]*)", text):
            self.run([os.path.join(self.build, "lwo"), "help", m.group(1)], self.tmp, where,
                     "lwo help %s (the command it names)" % m.group(1))
        with open(os.path.join(self.repo, "CMakeLists.txt"), encoding="utf-8") as f:
            options = set(re.findall(r"^\s*option\((\w+)", f.read(), re.M))
        for m in re.finditer(r"-D(LWO_\w+)=", text):
            if m.group(1) not in options:
                self.fail(where, "sets -D%s, which CMakeLists.txt has no option() of"
                          % m.group(1))

    def shell_run(self, text, where):
        text = self.with_prefix(text, where)
        if text is None:
            return None
        d = self.consumer_folder("sh")
        os.mkdir(os.path.join(d, "build"))
        for name in os.listdir(self.build):
            if name == "lwo" or name.startswith("liblwo.so"):
                os.symlink(os.path.join(self.build, name), os.path.join(d, "build", name))
        os.symlink(os.path.join(self.repo, "scripts"), os.path.join(d, "scripts"))
        return self.run(["bash", "-e", "-c", text], d, where, "the snippet")

    # -- cmake -----------------------------------------------------------------
    def cmake_run(self, text, where):
        prefix = self.installed_prefix(where)
        if prefix is None:
            return None
        d = self.consumer_folder("cmake")
        with open(os.path.join(d, "CMakeLists.txt"), "w", encoding="utf-8") as f:
            f.write("cmake_minimum_required(VERSION 3.24)\nproject(app LANGUAGES C)\n"
                    "add_executable(app app.c)\n" + text.replace(PREFIX_IN_DOCS, prefix) + "\n")
        b = os.path.join(d, "b")
        cmd = [self.cmake, "-S", d, "-B", b, "-DCMAKE_C_COMPILER=" + self.cc,
               "-DCMAKE_PREFIX_PATH=" + prefix, "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"]
        if self.generator:
            cmd += ["-G", self.generator]
        if self.run(cmd, d, where, "configuring the consumer project") is None:
            return None
        if self.run([self.cmake, "--build", b], d, where, "building it") is None:
            return None
        return self.run([os.path.join(b, "app")], d, where, "its program")

    # -- c ---------------------------------------------------------------------
    def c_program(self, rel, line, text, where):
        """The path of a whole program for the block, or None (failure noted)."""
        how = FRAGMENTS.get((rel, text.split("\n")[0].strip()))
        d = self.scratch("c")
        if how is None:
            src = os.path.join(d, "snippet.c")
            with open(src, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            return src
        kind, arg = how
        if kind == "declare":
            lines = text.split("\n")
            head = [ln for ln in lines if ln.lstrip().startswith("#")]
            body = [ln for ln in lines if not ln.lstrip().startswith("#")]
            src = os.path.join(d, "fragment.c")
            with open(src, "w", encoding="utf-8") as f:
                f.write("\n".join(head) + "\nint main(void) {\n" + arg + "\n".join(body) +
                        "\n  return 0;\n}\n")
            return src
        src = os.path.join(self.repo, arg)
        with open(src, encoding="utf-8") as f:
            whole = c_code_lines(f.read())
        pos = 0
        for code in c_code_lines(text):
            while pos < len(whole) and whole[pos] != code:
                pos += 1
            if pos == len(whole):
                self.fail(where, "an excerpt of %s, but the file has no line %r (in this order)"
                          % (arg, code))
                return None
            pos += 1
        return src

    def c_compile(self, src, where):
        exe = os.path.join(self.scratch("exe"), "program")
        cmd = [self.cc] + CFLAGS + ["-I", os.path.join(self.repo, "include"), src,
                                    "-L" + self.build, "-llwo", "-Wl,-rpath," + self.build,
                                    "-o", exe]
        if self.run(cmd, self.tmp, where, "compiling and linking %s" % os.path.basename(src)) \
                is None:
            return None
        return exe

    # -- the files -------------------------------------------------------------
    def check_file(self, rel, found):
        last = None  # (where, output) of the block run last
        for lang, line, text, marked in found:
            where = "%s:%d" % (rel, line)
            reason = NOT_RUN.get((rel, text.split("\n")[0].strip()))
            if marked and not lang:
                if last is None:
                    self.fail(where, "an output block with no block run before it")
                else:
                    missing = matches(text, last[1])
                    if missing is not None:
                        self.fail(where, "the output of %s has no line %r" % (last[0], missing),
                                  "its output was:\n" + last[1])
                    self.count("outputs compared")
                continue
            last = None
            if lang in ("sh", "bash", "shell"):
                if reason:
                    self.shell_static(text, where)
                    self.count("shell blocks checked, not run")
                    continue
                out = self.shell_run(text, where)
                self.count("shell blocks run")
            elif lang == "cmake":
                if reason:
                    self.count("cmake blocks not run")
                    continue
                out = self.cmake_run(text, where)
                self.count("cmake blocks configured, built and run")
            elif lang == "c":
                src = self.c_program(rel, line, text, where)
                exe = None if src is None else self.c_compile(src, where)
                if reason or exe is None:
                    self.count("C blocks compiled and linked, not run")
                    continue
                out = self.run([exe], self.tmp, where, "the program")
                self.count("C blocks compiled, linked and run")
            elif lang == "python":
                try:
                    compile(text, where, "exec")
                except SyntaxError as e:
                    self.fail(where, "Python that does not parse: %s" % e)
                if reason:
                    self.count("Python blocks parsed, not run")
                    continue
                out = self.run([sys.executable, "-c", text], self.tmp, where, "the Python")
                self.count("Python blocks run")
            elif reason:
                self.count("other blocks not run")
                continue
            else:
                self.fail(where, "a block of language %r, which this check cannot take: give it "
                          "a language it runs (sh, cmake, c, python), mark it as output (%s "
                          "right before it) or list it in NOT_RUN with the reason"
                          % (lang, OUTPUT_MARK))
                continue
            if out is not None:
                last = (where, out)

    def main(self):
        found = {rel: blocks(os.path.join(self.repo, rel)) for rel in FILES}
        seen = {(rel, b[2].split("\n")[0].strip()) for rel in FILES for b in found[rel]}
        for table, name in ((NOT_RUN, "NOT_RUN"), (FRAGMENTS, "FRAGMENTS")):
            for rel, first in sorted(set(table) - seen):
                self.fail(rel, "%s names a block that begins %r, and there is none: update "
                          "the entry to the block's first line (nothing was run)" % (name, first))
        try:
            if not self.failures:
                for rel in FILES:
                    self.check_file(rel, found[rel])
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        for f in self.failures:
            print(f)
        if self.failures:
            print("%d failures in the blocks of %s" % (len(self.failures), ", ".join(FILES)))
            return 1
        print("not run (each still checked as far as it can be without running):")
        for (rel, first), why in sorted(NOT_RUN.items()):
            print("  %s, the block %r: %s" % (rel, first[:60], why))
        print("; ".join("%d %s" % (n, what) for what, n in sorted(self.counts.items())))
        return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        sys.exit(2)
    sys.exit(Check(os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])).main())
