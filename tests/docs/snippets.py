#!/usr/bin/env python3
"""The shell snippets of the README and docs/BUILD.md that need no GPU, run as
they are written, so that none can rot.

A snippet is a fenced block (```sh) right after a line `<!-- snippet: run -->`;
it runs with bash -e in an empty folder where `build` is the build folder given
and `scripts` the repository's. A fenced block right after
`<!-- snippet: output -->` is what the run before it must print: each of its
lines, in order, must be a line of the output (stdout and stderr together);
a line "..." stands for any lines. Exit 1 naming the file, the line and what
differed; 0 with the count.

  python3 tests/docs/snippets.py REPO BUILD_DIR
"""
import os
import re
import subprocess
import sys
import tempfile

FILES = ["README.md", os.path.join("docs", "BUILD.md")]
MARK = re.compile(r"^<!-- snippet: (run|output) -->\s*$")


def blocks(path):
    """[(kind, line number, text)] of the marked blocks of one file."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if m and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            j = i + 2
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((m.group(1), i + 2, "\n".join(lines[i + 2:j])))
            i = j
        i += 1
    return out


def matches(want, got):
    """Every line of `want` in `got`, in order ("..." for any lines)."""
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


def main():
    repo, build = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    failures, ran = [], 0
    for rel in FILES:
        last = None
        for kind, line, text in blocks(os.path.join(repo, rel)):
            where = "%s:%d" % (rel, line)
            if kind == "run":
                with tempfile.TemporaryDirectory() as tmp:
                    os.symlink(build, os.path.join(tmp, "build"))
                    os.symlink(os.path.join(repo, "scripts"), os.path.join(tmp, "scripts"))
                    r = subprocess.run(["bash", "-e", "-c", text], cwd=tmp,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, timeout=300)
                ran += 1
                last = (where, r.stdout)
                if r.returncode != 0:
                    failures.append("%s: the snippet exited %d:\n%s" % (where, r.returncode,
                                                                         r.stdout))
            elif last is None:
                failures.append("%s: an output block with no snippet run before it" % where)
            else:
                missing = matches(text, last[1])
                if missing is not None:
                    failures.append("%s: the output of %s has no line %r; it was:\n%s"
                                    % (where, last[0], missing, last[1]))
    for f in failures:
        print(f)
    if failures:
        return 1
    if ran == 0:
        print("no marked snippet in %s" % ", ".join(FILES))
        return 1
    print("%d snippets ran as written, their outputs as shown" % ran)
    return 0


if __name__ == "__main__":
    sys.exit(main())
