"""The layers the design promises, checked rather than described.

- `tandem.api` and `tandem.contract` import neither torch nor `tandem.worker`: the operator imports them.
- `tandem.operator` never imports `tandem.worker` (their contract is the pod), nor torch.
- the worker's training half (`tandem.worker.train`) and serving half (`tandem.worker.serve`) do not import each
  other; both stand on the shared modules at the worker's root, which import neither half.
- the worker never imports the operator or the local backend.

Two checks, because each misses what the other sees: every import statement in a layer's files, read from the
source (so an import inside a function counts too), and each torch-free layer imported in a fresh interpreter,
whose `sys.modules` shows what it pulls in transitively. import-linter cannot see `tandem.worker` and
`tandem.operator` (pyproject maps them in with package-dir); these checks read the mapping from the file tree.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import ROOT

PACKAGES = {"tandem": ROOT / "tandem", "tandem.worker": ROOT / "worker", "tandem.operator": ROOT / "operator"}

# (layer, what its files may not import)
RULES = [
    ("tandem.api", ["torch", "tandem.worker", "tandem.operator", "tandem.backends"]),
    ("tandem.contract", ["torch", "tandem.worker", "tandem.operator", "tandem.backends"]),
    ("tandem.restart_policy", ["torch", "tandem.worker", "tandem.operator", "tandem.backends"]),
    ("tandem.api_errors", ["torch", "tandem.worker", "tandem.operator", "tandem.backends"]),
    ("tandem.operator", ["torch", "tandem.worker", "tandem.backends"]),
    ("tandem.worker.train", ["tandem.worker.serve", "tandem.operator", "tandem.backends"]),
    ("tandem.worker.serve", ["tandem.worker.train", "tandem.operator", "tandem.backends"]),
    ("tandem.worker.checkpoint", ["tandem.worker.train", "tandem.worker.serve", "tandem.operator"]),
    ("tandem.worker.user_code", ["tandem.worker.train", "tandem.worker.serve", "tandem.operator"]),
    ("tandem.worker.cores", ["tandem.worker.train", "tandem.worker.serve", "tandem.operator"]),
    ("tandem.worker.process_exit", ["tandem.worker.train", "tandem.worker.serve", "tandem.operator"]),
]
TORCH_FREE = ["tandem.api", "tandem.contract", "tandem.restart_policy", "tandem.manifest", "tandem.crd",
              "tandem.operator.training", "tandem.operator.handlers", "tandem.operator.main", "tandem.operator.pools",
              "tandem.operator.pool_handlers", "tandem.operator.api_policy", "tandem.operator.daemon",
              "tandem.api_errors"]


def module_files(layer: str, packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """The source files of `layer` (a package or a module), by module name."""
    root_name = max((name for name in packages if layer == name or layer.startswith(name + ".")), key=len)
    path = packages[root_name].joinpath(*layer[len(root_name):].strip(".").split(".")) if layer != root_name \
        else packages[root_name]
    if path.with_suffix(".py").is_file():
        return {layer: path.with_suffix(".py")}
    files = {}
    for file in sorted(path.rglob("*.py")):
        parts = file.relative_to(path).with_suffix("").parts
        name = ".".join([layer, *parts])
        files[name.removesuffix(".__init__")] = file
    return files


def imported_modules(name: str, file: Path) -> set[str]:
    """Every module an import statement in `file` names (relative imports resolved), wherever the statement is."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def violations(layer: str, forbidden: list[str], packages: dict[str, Path] = PACKAGES) -> list[str]:
    problems = []
    for name, file in module_files(layer, packages).items():
        for imported in sorted(imported_modules(name, file)):
            if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                problems.append(f"{file.relative_to(file.parents[1])}: imports {imported}")
    return problems


@pytest.mark.parametrize(("layer", "forbidden"), RULES, ids=[layer for layer, _ in RULES])
def test_no_layer_imports_what_it_may_not(layer, forbidden):
    assert module_files(layer), f"{layer}: no source files found"
    assert violations(layer, forbidden) == []


def test_the_torch_free_layers_pull_in_neither_torch_nor_the_worker():
    probe = ("import sys\n"
             f"for name in {TORCH_FREE!r}: __import__(name)\n"
             "print(' '.join(m for m in sys.modules if m == 'torch' or m.startswith(('tandem.worker', 'torch.'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == ""


def test_the_check_fails_on_a_forbidden_import(tmp_path):
    """The same checks, on a copy of the contract module with one forbidden import added inside a function, and a
    copy of the serving half's app with an import of the training half: both are reported."""
    (tmp_path / "tandem").mkdir()
    contract = (ROOT / "tandem" / "contract.py").read_text()
    (tmp_path / "tandem" / "contract.py").write_text(
        contract + "\n\ndef sneaky():\n    from tandem.worker.train import trainer\n    return trainer\n")
    serve = tmp_path / "worker" / "serve"
    serve.mkdir(parents=True)
    (serve / "app.py").write_text("import torch\nfrom ..train.trainer import train\n")
    packages = {"tandem": tmp_path / "tandem", "tandem.worker": tmp_path / "worker"}
    assert violations("tandem.contract", ["torch", "tandem.worker"], packages) == [
        "tandem/contract.py: imports tandem.worker.train",
        "tandem/contract.py: imports tandem.worker.train.trainer",
    ]
    assert violations("tandem.worker.serve", ["tandem.worker.train"], packages) == [
        "serve/app.py: imports tandem.worker.train.trainer",
        "serve/app.py: imports tandem.worker.train.trainer.train",
    ]


def test_tandem_operator_is_the_checkouts_operator_directory_and_import_operator_the_standard_library():
    """operator/ has no __init__.py so that `import operator` at the repository root stays the standard library;
    tandem/__init__.py extends its own path so that `tandem.operator` still finds it."""
    probe = "import operator, tandem.operator; print(operator.__file__); print(list(tandem.operator.__path__))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    stdlib_operator, operator_path = result.stdout.splitlines()
    assert Path(stdlib_operator).name == "operator.py" and not stdlib_operator.startswith(str(ROOT))
    assert str(ROOT / "operator") in operator_path
