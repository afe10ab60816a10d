"""The build context as an ignore file lets it in (docker's .dockerignore rules): the files
a Dockerfile's COPY can see, which are the files an image's cache key covers."""
from __future__ import annotations

import os
import re
from pathlib import Path


def _pattern_regex(pattern: str) -> str:
    """A .dockerignore pattern as a regular expression over '/'-separated relative paths:
    `*` and `?` stay within one path segment, `**` spans any number of them, [...] is a class,
    a backslash escapes the next character."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                i += 2
                if pattern.startswith("/", i):
                    out.append("(?:.*/)?")
                    i += 1
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                out.append("[" + pattern[i + 1:end].replace("\\", "\\\\") + "]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


class IgnoreRules:
    """The rules of one .dockerignore file: the last pattern that matches a path, or one of its
    parent directories, decides; `!` patterns let a path back in."""

    def __init__(self, text: str):
        self.rules: list[tuple[bool, re.Pattern, list[str]]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pat = os.path.normpath(line[1:].strip() if include else line).lstrip("/")
            self.rules.append((include, re.compile(_pattern_regex(pat)), pat.split("/")))

    def excluded(self, rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        out = False
        for include, rx, _ in self.rules:
            if any(rx.fullmatch(p) for p in prefixes):
                out = not include
        return out

    def may_include_below(self, rel_dir: str) -> bool:
        """Whether some `!` pattern could match a path inside rel_dir (an excluded directory
        is only walked when one could)."""
        dparts = rel_dir.split("/")
        for include, _, pparts in self.rules:
            if not include:
                continue
            for i, d in enumerate(dparts):
                if i >= len(pparts):
                    break
                if pparts[i] == "**":
                    return True
                if not re.fullmatch(_pattern_regex(pparts[i]), d):
                    break
            else:
                if len(pparts) > len(dparts):
                    return True
        return False


def context_files(root: Path, ignorefile: Path) -> list[str]:
    """The relative paths of the files (and symlinks) in the build context that the ignore file
    lets in, sorted: what the Dockerfile's COPY instructions can see."""
    rules = IgnoreRules(ignorefile.read_text())
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if os.path.islink(os.path.join(dirpath, d)):
                if not rules.excluded(rel):
                    found.append(rel)
            elif not rules.excluded(rel) or rules.may_include_below(rel):
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if not rules.excluded(rel):
                found.append(rel)
    return sorted(found)
