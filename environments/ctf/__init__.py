"""ctf: capture the flag in a terminal. A flag is hidden in the rollout's sandbox; the model
finds it with a ``bash`` tool and hands it in with ``submit_flag``.

Each task names a challenge (the registry :data:`CHALLENGES`) and describes it obliquely. The
harness's setup makes a fresh flag for the rollout (``flag{`` + 20 random hex digits + ``}``),
plants it in the rollout's sandbox session as the challenge says (files written with the
session, then a setup command: permissions, file times), and keeps only its SHA-256 in the
state. So the flag is in no task row, no prompt and no recorded state; it cannot be memorized
across rollouts either, only found. The session is destroyed when the rollout ends.

Challenges: a hidden backup in nested folders, a base64 message, a rot13 letter, a hex dump,
a file in a tar.gz backup, a file and a folder tree without permissions (the sandbox user owns
them, so ``chmod`` opens them), a secret among many logs, fragments to put back in order, the
oldest of many look-alike messages (file times), a SQLite database, reversed base64, a
compressed payload in base64, a script that decrypts with a PIN nobody remembers (brute force
it), and a file that is not what its name says. Each can be solved with bash, coreutils and
python3 alone; the local backend's sandbox also has the host's tools (tar, xxd, file, ...).

``submit_flag`` answers right or wrong; the rollout ends at the right flag or when the
submissions (``max_submissions``) run out. The reward reads the final state: ``captured`` (1
when a submission hashes to the flag's SHA-256). Metrics: ``num_submissions``,
``num_commands``.

Not covered: challenges that need network services, other users or root inside the sandbox
(the sandbox gives none of these).
"""

from __future__ import annotations

import base64
import codecs
import gzip
import hashlib
import io
import random
import secrets
import sqlite3
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness, RolloutContext, ToolError
from flywheel.sdk.sandbox import SandboxSpec
from flywheel.sdk.sandbox_tools import SandboxTools, sandbox_session

TASKS_FILE = Path(__file__).parent / "tasks.jsonl"
SCHEMA = {"id": str, "challenge": str, "prompt": str}
SYSTEM_PROMPT = (
    "You are solving a capture-the-flag challenge in a Linux sandbox: bash, the usual command line tools and "
    "python3; no network; you are an unprivileged user; your working folder is /work. Somewhere in the sandbox is "
    "a flag, a string of the form flag{{...}}. Explore with the bash tool, one command per call, and submit the flag "
    "with submit_flag. You have {max_submissions} submissions; the challenge ends at the right flag.")
WORDS = ("alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "tango", "zulu", "nova", "orbit", "pixel")


def make_flag() -> str:
    return f"flag{{{secrets.token_hex(10)}}}"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Planted:
    """A challenge's sandbox: files (path -> content) and a bash command run after writing them."""

    files: dict[str, bytes] = field(default_factory=dict)
    command: str = ""


Challenge = Callable[[str, random.Random], Planted]


def _decoy_flag(rng: random.Random) -> str:
    return "flag{" + "".join(rng.choice("0123456789abcdef") for _ in range(20)) + "}"


def _filler(rng: random.Random, num_lines: int) -> str:
    return "".join(f"{' '.join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))}\n" for _ in range(num_lines))


def hidden_backup(flag: str, rng: random.Random) -> Planted:
    files = {f"projects/{name}/README.md": f"# {name}\n\n{_filler(rng, 4)}".encode()
             for name in ("atlas", "borealis", "cascade")}
    files["projects/borealis/2021/drafts/plan.txt"] = _filler(rng, 6).encode()
    files["projects/borealis/2021/drafts/.backup/notes.txt"] = \
        f"Meeting notes (backup)\n{_filler(rng, 3)}remember: {flag}\n{_filler(rng, 2)}".encode()
    return Planted(files)


def base64_message(flag: str, rng: random.Random) -> Planted:
    text = f"Well done, agent.\nThe flag is {flag}\n{_filler(rng, 3)}"
    return Planted({"message.txt": base64.encodebytes(text.encode())})


def rot13_letter(flag: str, rng: random.Random) -> Planted:
    text = f"Dear colleague,\n\n{_filler(rng, 3)}The password you asked for is {flag}\n\nBest regards\n"
    return Planted({"letter.txt": codecs.encode(text, "rot13").encode()})


def hex_dump(flag: str, rng: random.Random) -> Planted:
    secret = f"{_filler(rng, 2)}secret={flag}\n{_filler(rng, 2)}".encode()
    digits = secret.hex()
    return Planted({"memory.dump": "".join(digits[i:i + 60] + "\n" for i in range(0, len(digits), 60)).encode()})


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tar_backup(flag: str, rng: random.Random) -> Planted:
    members = {f"home/user/docs/{w}.txt": _filler(rng, 3).encode() for w in rng.sample(WORDS, 5)}
    members["home/user/.config/vault/secret.txt"] = f"{flag}\n".encode()
    return Planted({"backups/nightly.tar.gz": _tar_gz(members)})


def locked_file(flag: str, rng: random.Random) -> Planted:
    return Planted({"vault/flag.txt": f"{flag}\n".encode(), "vault/README": b"Authorized readers only.\n"},
                   "chmod 000 vault/flag.txt")


def locked_tree(flag: str, rng: random.Random) -> Planted:
    return Planted({"safe/inner/core/flag.txt": f"{flag}\n".encode()},
                   "chmod 000 safe/inner/core/flag.txt && chmod 000 safe/inner/core safe/inner && chmod 100 safe")


def log_needle(flag: str, rng: random.Random) -> Planted:
    files = {}
    chosen = rng.randrange(40)
    for i in range(40):
        lines = [f"2024-05-{(i % 28) + 1:02d}T{h:02d}:{rng.randrange(60):02d}:00Z INFO {rng.choice(WORDS)} request "
                 f"served in {rng.randrange(1, 900)} ms" for h in range(12)]
        if i == chosen:
            lines.insert(rng.randrange(len(lines)), f"2024-05-{(i % 28) + 1:02d}T07:13:00Z DEBUG auth token issued: "
                                                   f"{flag}")
        files[f"logs/service-{i:02d}.log"] = ("\n".join(lines) + "\n").encode()
    return Planted(files)


def fragments(flag: str, rng: random.Random) -> Planted:
    cut1, cut2 = len(flag) // 3, 2 * len(flag) // 3
    parts = [flag[:cut1], flag[cut1:cut2], flag[cut2:]]
    places = ["var/cache/", "notes/2019/", "tmp/old/misc/"]
    rng.shuffle(places)
    files = {f"{place}fragment-{i + 1}.txt": f"{part}\n".encode()
             for i, (place, part) in enumerate(zip(places, parts, strict=True))}
    files["README.txt"] = b"Three numbered fragments make the flag. Join them in order, without newlines.\n"
    return Planted(files)


def oldest_message(flag: str, rng: random.Random) -> Planted:
    num = 15
    real = rng.randrange(num)
    files = {}
    days = rng.sample(range(2, 27), num)
    real_day = 1  # earlier than every decoy
    touches = []
    for i in range(num):
        name = f"inbox/msg-{rng.getrandbits(32):08x}.txt"
        token = flag if i == real else _decoy_flag(rng)
        files[name] = f"From: {rng.choice(WORDS)}@example.org\n\nThe flag is {token}\n".encode()
        touches.append(f"touch -d '2023-03-{real_day if i == real else days[i]:02d} 09:00' {name}")
    return Planted(files, " && ".join(touches))


def _sqlite(rows: list[tuple[str, str, str]]) -> bytes:
    db = sqlite3.connect(":memory:")
    try:
        db.execute("CREATE TABLE users (name TEXT, role TEXT, api_key TEXT)")
        db.executemany("INSERT INTO users VALUES (?, ?, ?)", rows)
        db.commit()
        return db.serialize()
    finally:
        db.close()


def sqlite_db(flag: str, rng: random.Random) -> Planted:
    rows = [(w, rng.choice(["viewer", "editor"]), _decoy_flag(rng)) for w in rng.sample(WORDS, 8)]
    rows.insert(rng.randrange(len(rows) + 1), ("root-ops", "admin", flag))
    return Planted({"data/app.db": _sqlite(rows)})


def reversed_base64(flag: str, rng: random.Random) -> Planted:
    return Planted({"note.txt": base64.b64encode(f"the flag: {flag}".encode())[::-1] + b"\n"})


def compressed_payload(flag: str, rng: random.Random) -> Planted:
    payload = base64.encodebytes(gzip.compress(f"{_filler(rng, 5)}{flag}\n{_filler(rng, 5)}".encode(), mtime=0))
    return Planted({"mail/attachment.b64": payload})


UNLOCK_SCRIPT = '''"""Prints the flag, given the right four-digit PIN: python3 unlock.py PIN"""
import hashlib
import sys

SEALED = bytes.fromhex("{sealed}")


def unlock(pin):
    stream = hashlib.sha256(("pin:" + pin).encode()).digest() * 4
    text = bytes(a ^ b for a, b in zip(SEALED, stream))
    return text.decode() if text.startswith(b"flag{{") else None


if __name__ == "__main__":
    found = unlock(sys.argv[1] if len(sys.argv) > 1 else "")
    print(found or "wrong PIN")
'''


def pin_script(flag: str, rng: random.Random) -> Planted:
    pin = f"{rng.randrange(10000):04d}"
    stream = hashlib.sha256(("pin:" + pin).encode()).digest() * 4
    sealed = bytes(a ^ b for a, b in zip(flag.encode(), stream, strict=False)).hex()
    return Planted({"unlock.py": UNLOCK_SCRIPT.format(sealed=sealed).encode()})


def disguised_file(flag: str, rng: random.Random) -> Planted:
    archive = _tar_gz({"holiday/readme.txt": f"{_filler(rng, 2)}{flag}\n".encode()})
    return Planted({"pictures/beach.jpg": archive, "pictures/README": b"Photos from the trip.\n"})


CHALLENGES: dict[str, Challenge] = {
    "hidden_backup": hidden_backup,
    "base64_message": base64_message,
    "rot13_letter": rot13_letter,
    "hex_dump": hex_dump,
    "tar_backup": tar_backup,
    "locked_file": locked_file,
    "locked_tree": locked_tree,
    "log_needle": log_needle,
    "fragments": fragments,
    "oldest_message": oldest_message,
    "sqlite_db": sqlite_db,
    "reversed_base64": reversed_base64,
    "compressed_payload": compressed_payload,
    "pin_script": pin_script,
    "disguised_file": disguised_file,
}


class Game:
    """The harness's setup (plant the flag), the ``submit_flag`` tool and the stop condition."""

    def __init__(self, spec: SandboxSpec, max_submissions: int) -> None:
        self.spec = spec
        self.max_submissions = max_submissions

    async def setup(self, task: dict[str, Any], state: dict[str, Any], ctx: RolloutContext) -> None:
        flag = make_flag()
        planted = challenge_of(task)(flag, random.Random(secrets.randbits(64)))
        client, box = await sandbox_session(ctx, msgspec.structs.replace(self.spec, files=planted.files))
        if planted.command:
            result = await client.exec(box, planted.command, timeout_s=30)
            if result.exit_code != 0:
                raise RuntimeError(f"ctf: setting up {task['challenge']!r} failed ({result.exit_code}): "
                                   f"{result.stderr[-500:]}")
        state.update(flag_sha256=sha256(flag), submissions=[], captured=False, max_submissions=self.max_submissions)

    def submit_flag(self, flag: str, ctx: RolloutContext) -> str:
        """Submit the flag you found (the whole string, flag{...}); you are told whether it is right."""
        state = ctx.state
        if state.get("captured"):
            return "You already captured the flag."
        if len(state["submissions"]) >= self.max_submissions:
            raise ToolError("no submissions left")
        answer = flag.strip()
        state["submissions"].append(answer[:200])
        if sha256(answer) == state["flag_sha256"]:
            state["captured"] = True
            return "Correct: flag captured."
        left = self.max_submissions - len(state["submissions"])
        return f"Wrong flag. {left} submission{'s' if left != 1 else ''} left."

    def over(self, state: dict[str, Any]) -> bool:
        return bool(state.get("captured")) or len(state.get("submissions", [])) >= self.max_submissions


# --- rewards: read from the final state -----------------------------------------------------


def captured(state: dict) -> float:
    wanted = state.get("flag_sha256")
    return float(wanted is not None and any(sha256(s) == wanted for s in state.get("submissions", [])))


def num_submissions(state: dict) -> float:
    return float(len(state.get("submissions", [])))


def num_commands(state: dict) -> float:
    return float(state.get("sandbox_calls", {}).get("command", 0))


def prompt(task: dict[str, Any]) -> str:
    return task["prompt"]


def challenge_of(task: dict[str, Any]) -> Challenge:
    try:
        return CHALLENGES[task["challenge"]]
    except KeyError:
        raise EnvironmentLoadError(f"ctf: task {task.get('id')!r} names challenge {task.get('challenge')!r}; "
                                   f"there are {sorted(CHALLENGES)}") from None


def load_environment(tasks_file: str | None = None, max_turns: int = 30, max_submissions: int = 3,
                     command_timeout_s: float = 20.0, memory_mb: int = 512) -> Environment:
    """``max_turns``: model calls per rollout; ``max_submissions``: flags it may submit;
    ``command_timeout_s``: each bash call's limit; ``memory_mb``: the sandbox's memory."""
    if max_submissions < 1 or max_turns < 1:
        raise EnvironmentLoadError(f"ctf: max_submissions={max_submissions}, max_turns={max_turns}; each at least 1")
    spec = SandboxSpec(memory_mb=memory_mb)
    game = Game(spec, max_submissions)
    tools = SandboxTools(spec=spec, timeout_s=command_timeout_s)
    tasks = TaskSet.from_jsonl(tasks_file or TASKS_FILE, schema=SCHEMA)
    for row in tasks.rows(tasks.size or 0):
        challenge_of(row)
    return Environment(
        name="ctf",
        tasks=tasks,
        harness=ChatHarness(system_prompt=SYSTEM_PROMPT.format(max_submissions=max_submissions),
                            tools=[*tools.tools("bash"), game.submit_flag], setup=game.setup,
                            stop=game.over, max_turns=max_turns),
        prompt=prompt,
        rewards=[Reward(captured), Metric(num_submissions), Metric(num_commands)],
        sampling={"max_tokens": 1024},
    )
