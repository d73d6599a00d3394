"""The overlay's layer diagram: parse docs/layers.txt, check the imports against it, draw it.

    python scripts/layers.py --check          # exit 1 and name every import that points up
    python scripts/layers.py --draw docs/layers.png

The text file is the source; tests/tools/test_layers.py runs the check, so the picture in
docs/architecture.md cannot drift from the code. Imports are read with ``ast`` (nothing is
imported), including imports inside functions.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS_FILE = ROOT / "docs" / "layers.txt"
OVERLAY = ROOT / "overlay"


@dataclass(frozen=True)
class Layer:
    name: str
    about: str
    prefixes: tuple[str, ...]


def read_layers(path: Path = LAYERS_FILE) -> list[Layer]:
    """Layers top to bottom; ``name | about | prefixes`` per non-comment line."""
    layers = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [part.strip() for part in line.split("|")]
        if len(parts) != 3 or not parts[2]:
            raise ValueError(f"{path}:{number}: expected 'name | about | module prefixes', got {line!r}")
        layers.append(Layer(parts[0], parts[1], tuple(parts[2].split())))
    return layers


def layer_of(module: str, layers: list[Layer]) -> int | None:
    """Index of the layer whose longest prefix matches ``module`` (0 = top), None outside the overlay."""
    best: tuple[int, int] | None = None
    for index, layer in enumerate(layers):
        for prefix in layer.prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def overlay_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((OVERLAY / "vllm_afd").rglob("*.py")):
        parts = path.relative_to(OVERLAY).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(module: str, path: Path) -> set[str]:
    """Absolute names of the ``vllm_afd`` modules ``path`` imports (relative imports resolved)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
    return {name for name in found if name == "vllm_afd" or name.startswith("vllm_afd.")}


def upward_imports(layers: list[Layer]) -> list[str]:
    """Every import from a lower layer to a higher one, and every module no layer holds."""
    problems = []
    for module, path in overlay_modules().items():
        own = layer_of(module, layers)
        if own is None:
            problems.append(f"{path.relative_to(ROOT)}: module {module} is in no layer of {LAYERS_FILE.name}")
            continue
        for target in sorted(imports_of(module, path)):
            other = layer_of(target, layers)
            if other is not None and other < own:
                problems.append(
                    f"{path.relative_to(ROOT)}: {module} ({layers[own].name}) imports {target} "
                    f"({layers[other].name}), a higher layer; move the code down or the import up"
                )
    return problems


def draw(layers: list[Layer], out: Path) -> None:
    """One band per layer, top to bottom, with its modules and what it holds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = 0.9 * len(layers) + 0.6
    fig, ax = plt.subplots(figsize=(10, height))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, height)
    ax.axis("off")
    for index, layer in enumerate(layers):
        y = height - 0.9 * (index + 1)
        shade = "#dbe8f5" if layer.name == "wire" else "#f1e6ea"
        ax.add_patch(plt.Rectangle((0.1, y), 9.8, 0.75, facecolor=shade, edgecolor="#555555"))
        ax.text(0.25, y + 0.5, layer.name, fontsize=11, fontweight="bold", va="center")
        ax.text(1.6, y + 0.5, "  ".join(p.removeprefix("vllm_afd.") for p in layer.prefixes),
                fontsize=9, family="monospace", va="center")
        ax.text(1.6, y + 0.2, layer.about, fontsize=8, color="#333333", va="center")
    ax.text(0.1, 0.15, "imports point down only (checked by tests/tools/test_layers.py); "
            "vLLM is imported above the wire layer only", fontsize=8, color="#555555")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail on imports that point up")
    parser.add_argument("--draw", type=Path, metavar="PNG", help="render the diagram")
    args = parser.parse_args(argv)
    if not (args.check or args.draw):
        parser.error("pass --check and/or --draw PNG")
    layers = read_layers()
    if args.check:
        problems = upward_imports(layers)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            return 1
        print(f"layers: {len(overlay_modules())} modules in {len(layers)} layers, no import points up")
    if args.draw:
        draw(layers, args.draw)
        print(f"wrote {args.draw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
