#!/usr/bin/env python3
"""No markdown file restates include/lwo.h: no code block declares an lwo_
function (a prototype) or defines an lwo struct or enum (the header is the
reference; the docs name its declarations and link it). Exit 1 naming each
copy (file:line); 0 otherwise.

  python3 tests/docs/declarations.py [REPO]
"""
import os
import re
import subprocess
import sys

PROTO = re.compile(r"^\s*(LWO_API\s+)?(const\s+)?[a-z_0-9]+\s*\**\s*lwo_\w+\s*\([^;{]*$|"
                   r"^\s*(LWO_API\s+)?(const\s+)?[a-z_0-9]+\s*\**\s*lwo_\w+\s*\(.*\)\s*;")
TYPEDEF = re.compile(r"^\s*typedef\s+(struct|enum)\s+lwo_\w+\s*\{")


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    files = subprocess.run(["git", "-C", root, "ls-files", "*.md"], capture_output=True,
                           text=True, check=True).stdout.split()
    bad = []
    for rel in files:
        lang = None
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.startswith("```"):
                    lang = None if lang is not None else (line[3:].strip() or "text")
                    continue
                if lang in ("c", "cpp", "c++", "h") and (PROTO.match(line) or
                                                          TYPEDEF.match(line)):
                    bad.append("%s:%d: %s" % (rel, n, line.rstrip()))
    for b in bad:
        print(b)
    if bad:
        print("%d lines restate include/lwo.h: name the declaration and link the header "
              "instead" % len(bad))
        return 1
    print("no markdown file restates a declaration of include/lwo.h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
