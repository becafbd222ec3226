"""The package's layering, read from its modules' own import statements (ast: top-level and
in-function imports alike, absolute and relative; `if TYPE_CHECKING:` blocks, annotations
alone, are left out).

Layers, bottom to top (docs/architecture.md draws them):
  0  framework.config, framework.atomic     the config's schema, errors, checks' common parts
  1  models, parallel, checkpoint, data     what a run is built from
  2  training                               the loop, the objectives, the builder's stages
  3  validate, not_yet                      the whole config's checks before launch
  4  launch                                 the ranks started here, under torchrun, Slurm
  5  cli                                    composing configs, the commands' common parts
  6  the commands                           generate, evaluate, dryrun, inspect, verify, hpo, ...
  7  planner                                mesh=auto's layouts, priced by the dry run
  8  train                                  the command that starts a run, the planner's too
A module may import its own layer or below. No import circle anywhere."""
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "framework"
LAYERS = {"config": 0, "atomic": 0, "models": 1, "parallel": 1, "checkpoint": 1, "data": 1, "training": 2,
          "validate": 3, "not_yet": 3, "launch": 4, "cli": 5, "planner": 7, "train": 8}
COMMANDS = 6  # every other module of the package's top
MAX_LINES = 400

# The imports from a lower layer up that stay, each with its reason (the structure issue allows 5).
UPWARD = {
    ("framework.checkpoint.manager", "framework.training.schedule"): "the LR schedule is a Stateful part it saves",
    ("framework.checkpoint.manager", "framework.training.state"): "TrainState is a Stateful part it saves",
    ("framework.validate", "framework.launch.threads"): "the threads a rank gets, checked before launch (a leaf "
                                                        "module of launch that imports nothing of the framework)",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(tree: ast.AST, package: str = ""):
    """Every name an import statement reaches, outside TYPE_CHECKING blocks; a relative one
    (`from . import x`, `from ..y import z`) resolved against `package`, the module's own."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in imported_names(ast.Module([child], []), package))
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)
        yield from imported_names(node, package)


def import_graph() -> dict:
    known = modules()

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    graph = defaultdict(set)
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target in imported_names(ast.parse(path.read_text()), package):
            if target.startswith("framework."):
                found = resolve(target)
                if found not in ("", "framework", name):
                    graph[name].add(found)
    return graph


def layer(module: str) -> int:
    return LAYERS.get(module.split(".")[1], COMMANDS)


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_a_circle_and_an_upward_import():
    """The checks below can fail: a made-up graph with both."""
    graph = {"framework.data.a": {"framework.data.b"}, "framework.data.b": {"framework.data.a"},
             "framework.config.c": {"framework.training.d"}}
    assert cycles(graph) == [["framework.data.a", "framework.data.b"]]
    assert layer("framework.config.c") < layer("framework.training.d")
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from framework.x import y\n"
                     "def f():\n    from framework.z import w\n")
    assert {n for n in imported_names(tree) if n.startswith("framework")} == {"framework.z", "framework.z.w"}


def test_the_reader_sees_relative_imports_and_the_floors_above_training():
    """`from . import x` and `from ..y import z` of a module in framework.launch; and the loop
    launch -> planner -> cli -> launch (the torchrun launcher asking the planner, which composes
    with the cli, which reports the launchers' errors) as two imports up the floors."""
    tree = ast.parse("from . import local\nfrom .handoff import rank_config\n"
                     "def f():\n    from ..planner import auto\n")
    assert set(imported_names(tree, "framework.launch")) == {
        "framework.launch", "framework.launch.local", "framework.launch.handoff",
        "framework.launch.handoff.rank_config", "framework.planner", "framework.planner.auto"}
    floors = ["framework.validate", "framework.launch.local", "framework.cli", "framework.dryrun",
              "framework.planner.auto", "framework.train"]
    assert [layer(m) for m in floors] == sorted({layer(m) for m in floors}), [layer(m) for m in floors]
    loop = {"framework.launch.torchrun": {"framework.planner.auto"}, "framework.planner.auto": {"framework.cli"},
            "framework.cli": {"framework.launch.local"}}
    assert [(a, b) for a, targets in loop.items() for b in targets if layer(b) > layer(a)] == [
        ("framework.launch.torchrun", "framework.planner.auto")]


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_nothing_imports_from_a_lower_layer_up_but_the_listed_pairs():
    graph = import_graph()
    upward = {(a, b) for a, targets in graph.items() for b in targets if layer(b) > layer(a)}
    assert upward <= set(UPWARD), sorted(upward - set(UPWARD))


def test_no_module_over_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
