"""The map of ``docs/design.md`` is true: every module is on it, and the imports keep its rules.

The floors are read from the map itself (its ``### Floor N`` sections, one bullet
per module), so the map and this check cannot diverge:

* every Python module and native source of the packages is listed, exactly once,
  and nothing listed is missing from the tree;
* a module imports only from its own floor or a lower one (lazy imports inside
  functions count too);
* the imports between modules form no circle;
* only ``hvd_mesh_impl/mesh_impl.py`` and ``hvd_mesh_impl/runtime.py`` import
  Horovod, and of ``flowpm_mtf`` only ``backend.py`` imports them;
* importing every ``flowpm_mtf`` module starts no Horovod (a fresh interpreter);
* the benchmark library and scripts never import from ``tests/``;
* the migration (``flowpm_mtf/mesh/domain.py``) imports nothing about the cosmology or the
  buffer sizes (its callers pass the sizes);
* Mesh TF is patched in one place: only ``hvd_mesh_impl/mtf_compat.py`` calls its
  ``enable_*`` functions (everyone else calls ``mtf_compat.apply``);
* no Python module of the packages is longer than :data:`MAX_MODULE_LINES` (split it by
  concern).
"""
import ast
import os
import re

import pytest

import fresh_imports

pytestmark = pytest.mark.rank_independent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAP = os.path.join(REPO, "docs", "design.md")
PACKAGES = ("hvd_mesh_impl", "flowpm_mtf", "mri_mtf", "flowpm_bench")
NATIVE_SUFFIXES = (".cc", ".h")
HOROVOD_MODULES = {"hvd_mesh_impl.mesh_impl", "hvd_mesh_impl.runtime"}
# names of hvd_mesh_impl's package namespace that load a Horovod module (its lazy __getattr__)
HOROVOD_NAMES = {"HvdSimdMeshImpl": "hvd_mesh_impl.mesh_impl",
                 "export_local_slice": "hvd_mesh_impl.mesh_impl",
                 "runtime": "hvd_mesh_impl.runtime"}
HOROVOD_IMPORTERS = {"flowpm_mtf.backend"}
# what the communication layer may not know: the cosmology and the sizes built on it
_SIZES = frozenset({"flowpm_mtf.config", "flowpm_mtf.physics.cosmology",
                    "flowpm_mtf.physics.linear_power", "flowpm_mtf.physics.halofit",
                    "flowpm_mtf.physics.sizing"})
PHYSICS_FREE = {m: _SIZES for m in ("flowpm_mtf.mesh.domain", "flowpm_mtf.mesh.domain_local",
                                    "flowpm_mtf.mesh.slots")}
MTF_PATCHES = ("enable_complex_gradients", "enable_lazy_masters")
#: Lines of the longest module the packages may hold.
MAX_MODULE_LINES = 800


def _tree_files():
    """Repository-relative paths of the packages' Python modules and native sources."""
    out = set()
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(REPO, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py") or f.endswith(NATIVE_SUFFIXES):
                    out.add(os.path.relpath(os.path.join(root, f), REPO))
    return out


def read_map(path=MAP):
    """``{path: floor}`` from the map's ``### Floor N`` sections (bullets starting with a path)."""
    floors, floor = {}, None
    entry = re.compile(r"^[-*]\s+`([\w/.]+\.(?:py|cc|h))`")
    with open(path) as f:
        for line in f:
            head = re.match(r"^###\s+Floor\s+(\d+)\b", line)
            if head:
                floor = int(head.group(1))
                continue
            if line.startswith("## "):
                floor = None
                continue
            m = entry.match(line.strip())
            if m and floor is not None:
                assert m.group(1) not in floors, "%s is listed twice in the map" % m.group(1)
                floors[m.group(1)] = floor
    return floors


def module_name(path):
    name = path[:-3].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imports_of(path, modules):
    """Modules of ``modules`` (a set of dotted names) that the file at ``path`` imports.

    Every import statement counts, including those inside functions. ``from pkg
    import name`` counts as an import of ``pkg.name`` when that is a module, else of
    ``pkg`` (and of the Horovod module behind ``hvd_mesh_impl``'s lazy names).
    ``horovod`` itself is reported as ``"horovod"``.
    """
    name = module_name(path)
    is_pkg = path.endswith("__init__.py")
    tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
    found = set()

    def add(dotted):
        if dotted.split(".")[0] == "horovod":
            found.add("horovod")
            return
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            found.add(dotted)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts if is_pkg else parts[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            for a in node.names:
                if prefix == "hvd_mesh_impl" and a.name in HOROVOD_NAMES:
                    add(HOROVOD_NAMES[a.name])
                elif prefix + "." + a.name in modules:
                    add(prefix + "." + a.name)
                else:
                    add(prefix)
    return found


@pytest.fixture(scope="module")
def floors():
    return read_map()


@pytest.fixture(scope="module")
def graph(floors):
    py = [p for p in floors if p.endswith(".py")]
    modules = {module_name(p): p for p in py}
    return {module_name(p): imports_of(p, set(modules)) for p in py}, modules


def test_map_lists_every_module_once(floors):
    listed, tree = set(floors), _tree_files()
    assert not tree - listed, "modules missing from docs/design.md: %s" % sorted(tree - listed)
    assert not listed - tree, "docs/design.md lists files that do not exist: %s" % sorted(listed - tree)


def test_no_module_is_longer_than_the_limit():
    lengths = {}
    for path in sorted(_tree_files()):
        if path.endswith(".py"):
            with open(os.path.join(REPO, path)) as f:
                lengths[path] = sum(1 for _ in f)
    assert len(lengths) > 100
    too_long = {p: n for p, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not too_long, "modules over %d lines (split them by concern): %s" % (
        MAX_MODULE_LINES, too_long)


def floor_violations(floors, deps, modules):
    """``"a (floor i) imports b (floor j)"`` for every import that goes up a floor."""
    floor = {m: floors[p] for m, p in modules.items()}
    return ["%s (floor %d) imports %s (floor %d)" % (m, floor[m], d, floor[d])
            for m, ds in sorted(deps.items()) for d in sorted(ds)
            if d in floor and floor[d] > floor[m]]


def test_no_import_from_a_higher_floor(floors, graph):
    bad = floor_violations(floors, *graph)
    assert not bad, "imports from a higher floor:\n" + "\n".join(bad)


def find_cycle(deps):
    """One import circle of ``deps`` (``{module: set of modules}``) as a list, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(deps.get(m, ())):
            if d not in deps:
                continue
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(deps):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_finds_a_circle_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_form_no_circle(graph):
    deps, _ = graph
    cycle = find_cycle(deps)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_only_the_backend_factory_reaches_horovod(graph):
    deps, _ = graph
    direct = {m for m, ds in deps.items() if "horovod" in ds}
    assert direct == HOROVOD_MODULES, "modules importing horovod: %s" % sorted(direct)
    users = {m for m, ds in deps.items() if ds & HOROVOD_MODULES
             and not m.startswith("hvd_mesh_impl") and not m.startswith("flowpm_bench")}
    assert users == HOROVOD_IMPORTERS, "flowpm_mtf modules importing the Horovod backend: %s" % sorted(users)


def test_migration_knows_no_physics(graph):
    deps, _ = graph
    bad = {m: sorted(deps[m] & banned) for m, banned in PHYSICS_FREE.items() if deps[m] & banned}
    assert not bad, "communication modules importing physics or sizing: %s" % bad


def test_mesh_tf_is_patched_in_one_place(floors):
    """Only mtf_compat calls its enable_* functions; the others call mtf_compat.apply()."""
    bad = []
    for path in sorted(p for p in floors if p.endswith(".py")):
        if path == "hvd_mesh_impl/mtf_compat.py":
            continue
        tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in MTF_PATCHES:
                    bad.append("%s:%d calls %s" % (path, node.lineno, name))
    assert not bad, "\n".join(bad)


def test_importing_flowpm_mtf_starts_no_horovod(floors):
    """Every module of flowpm_mtf and mri_mtf on the map imported in a fresh interpreter
    (``fresh_imports.ours_first()``, after the import checks that share it) loads no
    Horovod module."""
    mods = sorted(module_name(p) for p in floors if p.endswith(".py")
                  and p.startswith(("flowpm_mtf", "mri_mtf")))
    assert sorted(fresh_imports.package_modules()) == mods
    assert fresh_imports.ours_first()["horovod"] == []


def test_scripts_never_import_tests():
    test_modules = {f[:-3] for f in os.listdir(os.path.join(REPO, "tests")) if f.endswith(".py")}
    test_modules.discard("__init__")
    files = [os.path.join("scripts", f) for f in os.listdir(os.path.join(REPO, "scripts"))
             if f.endswith(".py")]
    files += sorted(p for p in _tree_files() if p.startswith("flowpm_bench") and p.endswith(".py"))
    bad = []
    for path in files:
        tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += ["%s imports %s" % (path, n) for n in names
                    if n.split(".")[0] in test_modules or n.split(".")[0] == "tests"]
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_wrong_map(tmp_path, floors, graph):
    """The floor check fails when a module is moved one floor too low on the map."""
    deps, modules = graph
    # a module that imports something on its own floor: lowering it breaks the rule
    m, d = next((m, d) for m, ds in sorted(deps.items()) for d in sorted(ds)
                if d in modules and floors[modules[d]] == floors[modules[m]] >= 1)
    text = open(MAP).read()
    lowered = floors[modules[m]] - 1
    assert lowered >= 0
    # move m's bullet into the section of the floor below
    bullet = next(line for line in text.splitlines() if line.strip().startswith("- `%s`" % modules[m]))
    text = text.replace(bullet + "\n", "")
    head = next(line for line in text.splitlines() if re.match(r"^###\s+Floor\s+%d\b" % lowered, line))
    text = text.replace(head + "\n", head + "\n" + bullet + "\n")
    (tmp_path / "design.md").write_text(text)
    wrong = read_map(str(tmp_path / "design.md"))
    assert wrong[modules[m]] == lowered
    bad = floor_violations(wrong, deps, modules)
    assert "%s (floor %d) imports %s (floor %d)" % (m, lowered, d, floors[modules[d]]) in bad
