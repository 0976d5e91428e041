"""escape: a hostile environment. Its program harness and its reward each try to get out of the
environment worker they run in: read a credential from their environment or from files, reach
nats-server or the gateway on the loopback (IPv4 and IPv6), read another rollout's files, write
outside their workdir. Each attempt's outcome is recorded, ``ESCAPED: ...`` where it worked,
``blocked: ...`` where it did not: the program's in its rollout's state (``probes``), the
reward's as the reason of a ``probe`` score component (1.0 where it got out).

The task names what to try: ``secret_files`` (paths of credentials the services hold),
``listeners`` (``[host, port]`` of services listening on this machine), ``writable_elsewhere``
(folders a worker sees and must not write, e.g. its own package). Tests import it by name with
``tests/envs`` on ``sys.path``; the program is this file, run with ``program`` as its argument.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

# The rollout's own endpoint and key, given to its program on purpose; not a service's credential.
OWN = {"OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "FLYWHEEL_TASK"}
SUSPECT = ("NATS", "PASSWORD", "TOKEN", "SECRET", "API_KEY", "FLYWHEEL", "DATABASE")


def probe(task: dict[str, Any], marker: str) -> dict[str, str]:
    """Every attempt to get out, by name: ``ESCAPED: <what>`` or ``blocked: <why>``."""
    out: dict[str, str] = {}
    leaked = sorted(k for k in os.environ if k not in OWN and any(s in k.upper() for s in SUSPECT))
    out["environment"] = f"ESCAPED: {leaked}" if leaked else "blocked: no credential among the variables"
    for i, path in enumerate(task.get("secret_files", [])):
        try:
            out[f"file {i}"] = f"ESCAPED: read {len(Path(path).read_bytes())} bytes of {path}"
        except OSError as exc:
            out[f"file {i}"] = f"blocked: {type(exc).__name__}"
    others = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(s.encode() in environ for s in ("NATS_PASSWORD", "FLYWHEEL_NATS")):
            others.append(pid)
    out["other processes"] = f"ESCAPED: pids {others}" if others else "blocked: no process with a credential"
    for host, port in task.get("listeners", []):
        try:
            with socket.create_connection((host, port), timeout=1.0):
                out[f"connect {host}:{port}"] = "ESCAPED: connected"
        except OSError as exc:
            out[f"connect {host}:{port}"] = f"blocked: {type(exc).__name__}"
    package = Path(__file__).resolve().parent  # where the environment's code is (the program: its workdir)
    mine = [] if package == Path.cwd().resolve() else [str(package)]
    for folder in ["/", "/etc", "/usr", *mine, *task.get("writable_elsewhere", [])]:
        target = Path(folder) / f"escaped-{marker}"
        try:
            target.write_text("x")
            out[f"write {folder}"] = f"ESCAPED: wrote {target}"
        except OSError as exc:
            out[f"write {folder}"] = f"blocked: {type(exc).__name__}"
    try:  # its own workdir is the one place it may write
        Path(f"marker-{marker}").write_text(marker)
        out["workdir"] = "blocked: (wrote its own workdir, as it may)"
    except OSError as exc:
        out["workdir"] = f"ESCAPED: its own workdir is not writable ({exc})"
    return out


def others_files(marker: str) -> str:
    """Markers of other rollouts, looked for where a neighbour would leave them."""
    time.sleep(1.0)  # noqa: sleep - the sibling rollouts leave their markers meanwhile
    places = [Path("."), Path("/tmp"), Path("/work")]
    places += [Path(f"/proc/{p}/cwd") for p in os.listdir("/proc") if p.isdigit()]
    found = []
    for place in places:
        try:
            found += [str(f) for f in place.glob("marker-*") if f.name != f"marker-{marker}"]
        except OSError:
            continue
    return f"ESCAPED: {sorted(set(found))}" if found else "blocked: no other rollout's files"


def program() -> None:
    """The harness's program: one model call (its endpoint works), then the attempts."""
    task = json.load(sys.stdin)
    body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        called = json.load(answer)["choices"][0]["message"]["content"] is not None
    marker = f"{task['text']}-{os.getpid()}"
    probes = probe(task, marker)
    probes["other rollouts"] = others_files(marker)
    print(json.dumps({"called": called, "probes": probes}))


def reward_probe(task: dict[str, Any]) -> dict[str, float]:
    """The reward's own attempts: each a component, 1.0 where it got out (the reasons in its name)."""
    return {f"{name} = {outcome}"[:200]: float(outcome.startswith("ESCAPED")) for name, outcome in
            probe(task, "reward").items()}


def load_environment() -> Any:
    from flywheel.sdk.environment import Environment, Reward, TaskSet
    from flywheel.sdk.harness import ProgramHarness

    return Environment(
        name="escape_env",
        tasks=TaskSet.from_rows([{"text": "a", "secret_files": [], "listeners": []}]),
        harness=ProgramHarness(["{python}", "escape_env.py", "program"], timeout_s=120,
                               files={"escape_env.py": Path(__file__).read_text()}),
        prompt=lambda task: task["text"],
        rewards=[Reward(reward_probe, name="probe")],
    )


if __name__ == "__main__" and sys.argv[1:] == ["program"]:
    program()
