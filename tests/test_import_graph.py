"""The package's import graph and layout (issue #20: one home per concept, imports pointing one way).

The graph is read statically (ast, nothing imported): an edge A -> B for every import of B in A's
source, at module level, inside functions and under `if TYPE_CHECKING:` alike, so an import moved into
a function to dodge a cycle still counts. `from pkg import name` is an edge to the submodule pkg.name
when that is a module, else to pkg itself. Between homes (a subpackage or a top-level module) imports
point one way too, but for the pairs listed in TWO_WAY_HOMES with their reason.

Run against another tree: `python tests/test_import_graph.py PATH/TO/jaxspec` prints its cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "jaxspec"

# Top level of jaxspec/: the public API and the few cross-cutting modules; everything else has a home in
# a subpackage named for what it is.
TOP_LEVEL_MODULES = {
    "__init__", "cli", "compile_cache", "config", "distributed", "errors", "resources", "sharding"
}  # fmt: skip
SUBPACKAGES = {"batch", "bench", "decoding", "drafters", "loading", "model", "sampling", "train"}
HEAD_FAMILIES = {"eagle", "medusa", "mtp"}  # drafters/heads/<family>/: module(s), drafter, loader


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package rooted at package_dir."""
    root = package_dir.name
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [root, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def import_edges(package_dir: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same package: line of the first such import}."""
    modules = module_names(package_dir)
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        out = edges.setdefault(name, {})
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target in modules and target != name:
                    out.setdefault(target, node.lineno)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one closed walk."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def describe(component: list[str], edges: dict[str, dict[str, int]], package_dir: Path) -> str:
    """One cycle through the component's first module, each step with the importing line."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:  # walk inside the component until we come back to the start
        here = path[-1]
        nxt = sorted(w for w in edges[here] if w in members)
        back = start if start in nxt else None
        step = back or next((w for w in nxt if w not in seen), nxt[0])
        path.append(step)
        if step == start or step in seen:
            break
        seen.add(step)
    modules = module_names(package_dir)
    return "\n  ".join(
        f"{a} -> {b}   ({modules[a].relative_to(package_dir.parent)}:{edges[a][b]})"
        for a, b in zip(path, path[1:], strict=False)
    )


def cycle_report(package_dir: Path) -> list[str]:
    edges = import_edges(package_dir)
    return [describe(c, edges, package_dir) for c in cycles(edges)]


def test_the_package_has_no_import_cycle():
    report = cycle_report(PACKAGE_DIR)
    assert not report, "import cycles in jaxspec/:\n  " + "\n\n  ".join(report)


# Homes (subpackages and top-level modules) that import each other, each with its reason. sharding.py is
# the one table of sharding rules: model/forward runs attention per shard through it, and it places the
# model's KV caches (model/kv_cache) on the mesh. No module-level cycle results (test above).
TWO_WAY_HOMES = {frozenset({"jaxspec.model", "jaxspec.sharding"})}


def home_edges(edges: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The graph between homes: jaxspec.<subpackage or top-level module>, one edge per importing pair."""

    def home(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, dict[str, int]] = {}
    for a, targets in edges.items():
        for b in targets:
            if home(a) != home(b):
                out.setdefault(home(a), {}).setdefault(home(b), 0)
                out[home(a)][home(b)] += 1
            out.setdefault(home(b), {})
    return out


def test_subpackages_import_one_way():
    homes = home_edges(import_edges(PACKAGE_DIR))
    two_way = {frozenset({a, b}) for a in homes for b in homes[a] if a in homes.get(b, {})}
    assert two_way <= TWO_WAY_HOMES, (
        f"homes importing each other: {sorted(map(sorted, two_way - TWO_WAY_HOMES))}"
    )
    for pair in TWO_WAY_HOMES:
        pruned = {a: {b: n for b, n in ts.items() if frozenset({a, b}) != pair} for a, ts in homes.items()}
        assert not cycles(pruned), cycles(pruned)


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import c\n    return c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    edges = import_edges(pkg)
    assert edges["pkg.a"] == {"pkg.sub.b": 1}
    assert edges["pkg.sub.b"] == {"pkg.c": 2}
    assert edges["pkg.c"] == {"pkg.a": 1}
    assert cycles(edges) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("")
    assert cycles(import_edges(pkg)) == []


def test_the_top_level_holds_only_the_api_and_cross_cutting_modules():
    modules = {p.stem for p in PACKAGE_DIR.glob("*.py")}
    packages = {p.name for p in PACKAGE_DIR.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert modules == TOP_LEVEL_MODULES, f"top-level modules: {sorted(modules ^ TOP_LEVEL_MODULES)}"
    assert packages == SUBPACKAGES, f"subpackages: {sorted(packages ^ SUBPACKAGES)}"


def test_every_head_family_has_one_home_with_its_drafter_and_loader():
    heads = PACKAGE_DIR / "drafters" / "heads"
    families = {p.name for p in heads.iterdir() if (p / "__init__.py").is_file()}
    assert families == HEAD_FAMILIES
    for family in families:
        files = {p.stem for p in (heads / family).glob("*.py")}
        assert {"__init__", "drafter", "loader"} <= files, (family, files)


def test_the_readme_layout_names_every_module_of_the_core_packages():
    readme = (PACKAGE_DIR.parent / "README.md").read_text()
    start = readme.index("## Layout")
    section = readme[start : readme.index("\n## ", start + 1)]
    missing = [f"{name}.py" for name in TOP_LEVEL_MODULES if f"{name}.py" not in section]
    missing += [f"{name}/" for name in SUBPACKAGES if f"{name}/" not in section]
    for package in ("model", "loading", "decoding", "sampling", "drafters", "batch"):
        for path in (PACKAGE_DIR / package).rglob("*.py"):
            if path.stem != "__init__" and path.stem not in section:
                missing.append(str(path.relative_to(PACKAGE_DIR)))
    assert not missing, f"README.md's Layout section does not name: {missing}"


if __name__ == "__main__":
    target = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE_DIR
    found = cycle_report(target)
    print(f"{target}: {len(found)} import cycle(s)")
    for text in found:
        print("  " + text + "\n")
    sys.exit(1 if found else 0)
