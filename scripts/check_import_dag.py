#!/usr/bin/env python3
"""Import circles between the files of a crate (issue 35's bar: each file's `use crate::…`
edges form a DAG). Prints every strongly connected component of more than one file and
exits non-zero if there is one.

    scripts/check_import_dag.py crates/engine crates/cli
"""
import os
import re
import sys


def module_of(src_root, path):
    rel = os.path.relpath(path, src_root)[: -len(".rs")]
    parts = rel.split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return "::".join(parts)


def edges(src_root):
    files = {}
    for root, _, names in os.walk(src_root):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(root, n)
                files[module_of(src_root, p)] = p
    graph = {m: set() for m in files}
    for m, p in files.items():
        text = open(p, encoding="utf-8").read()
        # Test modules may reach anywhere; only the code's own edges count.
        text = text.split("#[cfg(test)]")[0]
        for path in re.findall(r"crate::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)", text):
            parts = path.split("::")
            # The longest prefix that names a file of the crate.
            for k in range(len(parts), 0, -1):
                target = "::".join(parts[:k])
                if target in files and target != m and not m.startswith(target + "::") and not target.startswith(m + "::"):
                    graph[m].add(target)
                    break
    return graph


def cycles(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    bad = 0
    for crate in sys.argv[1:] or ["crates/engine", "crates/cli"]:
        found = cycles(edges(os.path.join(crate, "src")))
        for comp in found:
            print(f"{crate}: import circle among {len(comp)} files: {', '.join(comp)}")
        bad += len(found)
        if not found:
            print(f"{crate}: no import circle")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
