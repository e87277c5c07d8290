#!/usr/bin/env python3
"""Every relative link of the repository's markdown files (tracked ones, as
git lists them) points at a file that exists, and a #fragment at a heading of
the target, named as GitHub names heading anchors (lower case, punctuation
but '-' and '_' dropped, spaces to '-', repeats numbered -1, -2, ...).
Links inside code blocks and inline code are text, not links; a link's
text may run over a line break. Exit 1 naming
each broken link (file:line: target (why)); 0 with a count otherwise.

  python3 tests/docs/links.py [REPO]
"""
import os
import re
import subprocess
import sys

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\[\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"`[^`]*`")


def slug(text):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def scan(path):
    """(anchors, [(line number, target)]) of one markdown file. A link whose text
    runs over a line break counts, at the line where it starts."""
    anchors, seen, text = set(), {}, []
    in_code = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                in_code = not in_code
                text.append("")
                continue
            if in_code:
                text.append("")
                continue
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                k = seen.get(base, 0)
                anchors.add(base if k == 0 else "%s-%d" % (base, k))
                seen[base] = k + 1
            text.append(CODE.sub("", line.rstrip("\n")))
    text = "\n".join(text)
    links = [(text.count("\n", 0, lm.start()) + 1, lm.group(1)) for lm in LINK.finditer(text)]
    return anchors, links


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    files = subprocess.run(["git", "-C", root, "ls-files", "*.md"], capture_output=True,
                           text=True, check=True).stdout.split()
    scanned = {os.path.normpath(os.path.join(root, f)): scan(os.path.join(root, f))
               for f in files}
    bad, count = [], 0
    for path, (_anchors, links) in scanned.items():
        rel = os.path.relpath(path, root)
        for n, target in links:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue  # a URL or mailto: not checked here
            count += 1
            file_part, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
                if file_part else path
            if not os.path.exists(dest):
                bad.append("%s:%d: %s (no such file)" % (rel, n, target))
                continue
            if frag and dest.endswith(".md"):
                anchors = scanned[dest][0] if dest in scanned else scan(dest)[0]
                if frag.lower() not in anchors:
                    bad.append("%s:%d: %s (no such heading)" % (rel, n, target))
    for b in bad:
        print(b)
    if bad:
        print("%d broken of %d relative links in %d markdown files" % (len(bad), count,
                                                                       len(scanned)))
        return 1
    print("%d relative links in %d markdown files: all resolve" % (count, len(scanned)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
