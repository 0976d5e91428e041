"""Print the requirements of flywheel-rl with the given extras, one a line, from pyproject.toml.

    python3 requirements.py PYPROJECT EXTRA[,EXTRA...]

The image installs them in a layer of its own, before the source is copied, so a change to
the code rebuilds only the last layers. Extras that name other extras
(``flywheel-rl[models]``) are expanded.
"""

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    project = tomllib.load(open(pyproject, "rb"))["project"]
    optional = project["optional-dependencies"]
    found: list[str] = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"extra {extra!r} is not in {pyproject}; choose from {', '.join(optional)}")
        seen.add(extra)
        for req in optional[extra]:
            if req.startswith(project["name"] + "["):
                todo.extend(req[len(project["name"]) + 1:-1].split(","))
            elif req not in found:
                found.append(req)
    return found


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], [e for e in sys.argv[2].split(",") if e])))
