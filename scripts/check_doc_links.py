#!/usr/bin/env python3
"""Checks every relative link in the repository's Markdown files: the file it names exists, and an anchor
(#section) names a heading of that file (GitHub's slugs). Prints one line per broken link; exit 1 if any.
Usage: scripts/check_doc_links.py [ROOT]"""
import os
import re
import sys

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SKIP_DIRS = {".git", "build", "gpu-out", ".whl", ".gl", "node_modules"}
# (and the .devrun-* staging folders of device runs: copies of the tree, ignored by git)


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[`*_~]", "", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    out, in_code = set(), False
    counts = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            m = re.match(r"#{1,6}\s+(.*)", line)
            if m:
                base = slug(m.group(1))
                n = counts.get(base, 0)
                counts[base] = n + 1
                out.add(base if n == 0 else f"{base}-{n}")
    return out


def main(root):
    bad = 0
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".devrun")]
        for name in files:
            if not name.endswith(".md"):
                continue
            path = os.path.join(dirpath, name)
            in_code = False
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.startswith("```"):
                        in_code = not in_code
                    if in_code:
                        continue
                    for target in LINK.findall(line):
                        if re.match(r"^[a-z]+:", target):
                            continue  # http:, https:, mailto:
                        file_part, _, anchor = target.partition("#")
                        dest = path if not file_part else os.path.normpath(os.path.join(dirpath, file_part))
                        rel = os.path.relpath(path, root)
                        if not os.path.exists(dest):
                            print(f"{rel}:{lineno}: broken link {target!r}: {os.path.relpath(dest, root)} does not exist")
                            bad += 1
                        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                            print(f"{rel}:{lineno}: broken link {target!r}: no heading #{anchor} in "
                                  f"{os.path.relpath(dest, root)}")
                            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
