#!/usr/bin/env python3
"""Functions longer than a limit (issue 35's bar: none over 100 lines). Prints each one as
`LINES PATH NAME FIRST_LINE`, longest first, and exits non-zero if there is one.

    scripts/check_fn_length.py [LIMIT] [DIR ...]      (defaults: 100, crates)

A function's length is its lines from the `fn` line to its closing brace, both included
(doc comments and attributes above it do not count). Braces are counted in code only: the
scanner skips line and block comments, string literals (plain, byte, raw, over several
lines) and character literals, so a `{` in a format string or a comment changes nothing.
Tests inside `src` count; `tests/`, `benches/` and `examples/` do not. The SIMD and
attention kernels (`crates/model/src/kernels`) are exempt: their long functions are
unrolled arithmetic that reads best in one piece.
"""
import os
import re
import sys

EXEMPT = [os.path.join("crates", "model", "src", "kernels")]
SKIPPED_DIRS = ("tests", "benches", "examples")

RAW_START = re.compile(r'b?r(#*)"')
FN_START = re.compile(
    r'\s*(pub(\([^)]*\))?\s+)?(default\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"[^"]*"\s+)?fn\s+(\w+)'
)


def code_only(text):
    """`text` with every comment, string and character literal blanked (newlines kept), so
    that the brackets left are the code's own."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else "")
                    i += 1
        elif c in "br" and not _ident_before(text, i) and RAW_START.match(text, i):
            m = RAW_START.match(text, i)
            end = '"' + m.group(1)
            j = text.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and not _ident_before(text, i)):
            i += 1 if c == '"' else 2
            start = i
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", start, i))
            i += 1
        elif c == "'" or (c == "b" and text.startswith("b'", i) and not _ident_before(text, i)):
            # A character literal ('x', '\n', '\u{7f}', b'x'), or else a lifetime ('a).
            k = i + (1 if c == "'" else 2)
            m = re.match(r"(\\u\{[0-9a-fA-F]*\}|\\.|[^\\'\n])'", text[k:])
            if m:
                out.append("''")
                i = k + m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident_before(text, i):
    return i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")


def long_functions(path, limit):
    lines = code_only(open(path, encoding="utf-8").read()).split("\n")
    found = []
    for first, line in enumerate(lines):
        m = FN_START.match(line)
        if not m:
            continue
        depth, nesting, started, last = 0, 0, False, None
        for k in range(first, len(lines)):
            for ch in lines[k][m.end() if k == first else 0 :]:
                if ch in "([":
                    nesting += 1
                elif ch in ")]":
                    nesting -= 1
                elif ch == ";" and not started and nesting == 0:
                    last = -1  # a declaration without a body (a trait's, an extern's)
                    break
                elif ch == "{":
                    depth, started = depth + 1, True
                elif ch == "}":
                    depth -= 1
                    if started and depth == 0:
                        last = k
                        break
            if last is not None:
                break
        if last is not None and last >= 0 and last - first + 1 > limit:
            found.append((last - first + 1, path, m.group(8), first + 1))
    return found


def main():
    args = sys.argv[1:]
    limit = int(args.pop(0)) if args and args[0].isdigit() else 100
    found = []
    for top in args or ["crates"]:
        for root, dirs, names in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and d != "target")
            if any(root == e or root.startswith(e + os.sep) for e in EXEMPT):
                continue
            if f"{os.sep}src{os.sep}" not in f"{os.sep}{root}{os.sep}":
                continue
            for name in sorted(names):
                if name.endswith(".rs"):
                    found += long_functions(os.path.join(root, name), limit)
    for n, path, name, line in sorted(found, reverse=True):
        print(n, path, name, line)
    if not found:
        print(f"no function over {limit} lines")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
