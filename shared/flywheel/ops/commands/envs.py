"""``flywheel env init | list | push | install | fork | show | import | visibility``: environment
packages and the hub."""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path
from typing import Any

from flywheel.contract.hub import check_env_id
from flywheel.ops.commands.options import add_settings, settings_from
from flywheel.ops.scaffold import scaffold
from flywheel.ops.tables import table

IMPORTERS = "flywheel.importers"  # entry points: a format's name -> convert(src, dest, owner, name) -> Path


def add(commands: Any) -> None:
    """Add this module's commands to ``commands`` (the parser's subparsers)."""
    env = commands.add_parser("env", help="environment packages: scaffold, list, push to the hub, install, fork",
                              description="Work with environment packages.")
    env_commands = env.add_subparsers(dest="env_command", required=True, metavar="COMMAND")
    init = env_commands.add_parser(
        "init", help="create an environment package that passes its own tests",
        description="Create the folder NAME/ with a package: pyproject.toml (registering the environment under "
                    "the flywheel.environments entry points), the environment module (tasks from a JSONL file, a "
                    "chat harness, a reward, a metric and a group reward), tasks, a README and tests. "
                    "Then: pip install -e NAME && pytest NAME.")
    init.add_argument("name", metavar="NAME", help="package name: lowercase letters, digits, '_' or '-'")
    init.add_argument("--owner", default="local", help="the id's owner part: OWNER/NAME (default local)")
    init.add_argument("--dir", default=".", help="where to create NAME/ (default: here)")
    init.set_defaults(func=cmd_env_init)
    listing = env_commands.add_parser("list", help="installed environments and their versions",
                                      description="Every environment registered under the flywheel.environments "
                                                  "entry points, with its package's version and where it is "
                                                  "installed: this Python's environment, or a folder of its own "
                                                  "in the data dir (hub environments).")
    add_settings(listing, ("data_dir",))
    listing.set_defaults(func=cmd_env_list)
    hub_note = ("The gateway is the settings' gateway_url; a gateway that wants API keys gets the one in "
                "FLYWHEEL_API_KEY.")
    pushing = env_commands.add_parser(
        "push", help="build, check and upload an environment package to the hub",
        description="Build DIR's package (python -m build: a wheel and an sdist), check the built wheel in a process "
                    "of its own (load_environment with its defaults, a few task rows against its schema, every reward "
                    "on a rollout answering with the reference answer), and upload it as the version in its "
                    "pyproject.toml. A version that exists, a package that does not load or a name of another "
                    "tenant is refused, and nothing is stored. " + hub_note)
    pushing.add_argument("dir", metavar="DIR", nargs="?", default=".", help="the package's folder (default: here)")
    pushing.add_argument("--as", dest="as_id", metavar="OWNER/NAME",
                         help="for a verifiers or OpenEnv package (unmodified): the hub id it goes under")
    pushing.add_argument("--private", action="store_true",
                         help="a new environment is seen by its owner's keys alone (default: public)")
    pushing.add_argument("--no-scoring", action="store_true",
                         help="skip the dry scoring (rewards that need a sandbox or a model)")
    add_settings(pushing, ("gateway_url",))
    pushing.set_defaults(func=cmd_env_push)
    installing = env_commands.add_parser(
        "install", help="install an environment from the hub by id, or a verifiers taskset",
        description="verifiers:PACKAGE or openenv:PACKAGE (a requirement, a wheel or a project folder) installs "
                    "a verifiers taskset or an OpenEnv environment and what it needs that this Python's environment "
                    "does not satisfy (verifiers, openenv-core) into a folder of its own "
                    "(environments/verifiers-NAME, environments/openenv-NAME); runs name it env = \"verifiers:NAME\" "
                    "or \"openenv:NAME\". "
                    "Otherwise: download ID's wheel (owner/name@version; the newest version without @version), "
                    "check its sha256 against the hub's and its content by the hub's rules, and pip install that "
                    "file into a folder of its own in the data dir (environments/OWNER-NAME-VERSION), with the "
                    "dependencies this Python's environment does not satisfy, wheels only (from pip's usual index; "
                    "no sdist is ever built). Never into this Python's environment: environment workers put the "
                    "folder first on their path. " + hub_note)
    installing.add_argument("spec", metavar="ID", help="owner/name, owner/name@version, verifiers:PACKAGE or "
                            "openenv:PACKAGE")
    add_settings(installing, ("gateway_url", "data_dir"))
    installing.set_defaults(func=cmd_env_install)
    forking = env_commands.add_parser(
        "fork", help="copy an environment on the hub under a new id, with its lineage",
        description="Download ID's sdist (owner/name[@version]) into DIR/NEW_NAME, rename it to NEW_ID (its "
                    "distribution, entry point and module) and push it with its lineage; then edit and push new "
                    "versions as usual. " + hub_note)
    forking.add_argument("spec", metavar="ID", help="owner/name or owner/name@version to fork")
    forking.add_argument("new_id", metavar="NEW_ID", help="new-owner/new-name (the new owner: your tenant)")
    forking.add_argument("--dir", default=".", help="where to write the fork's folder (default: here)")
    forking.add_argument("--private", action="store_true", help="the fork is seen by its owner's keys alone")
    forking.add_argument("--no-scoring", action="store_true", help="skip the dry scoring of the push")
    add_settings(forking, ("gateway_url",))
    forking.set_defaults(func=cmd_env_fork)
    showing = env_commands.add_parser(
        "show", help="an environment on the hub: versions, lineage, forks, leaderboard",
        description="Show ID's versions (newest first, with their sha256), what it was forked from, its forks and "
                    "the evals pushed to it (flywheel eval --push), best first; without ID, the environments on the "
                    "hub the key sees. " + hub_note)
    showing.add_argument("spec", metavar="ID", nargs="?", help="owner/name")
    add_settings(showing, ("gateway_url",))
    showing.set_defaults(func=cmd_env_show)
    importing = env_commands.add_parser(
        "import", help="turn tasks of another format into an environment package",
        description="Write DIR/NAME, an environment package registering OWNER/NAME, from tasks in another format: "
                    "harbor, Harbor task folders (SRC: a task folder, or a folder of them; each runs in a sandbox "
                    "with a bash tool, rewarded by its own tests/test.sh; what is not carried over is listed in the "
                    "package's README). Then: flywheel env push DIR/NAME.")
    importing.add_argument("format", help="the tasks' format (harbor; more where a package registers an importer "
                                          "under the flywheel.importers entry points)")
    importing.add_argument("src", metavar="SRC", help="the tasks")
    importing.add_argument("new_id", metavar="OWNER/NAME", help="the new environment's id (OWNER: your tenant)")
    importing.add_argument("--dir", default=".", help="where to write NAME/ (default: here)")
    importing.set_defaults(func=cmd_env_import)
    visibility = env_commands.add_parser(
        "visibility", help="make an environment on the hub public or private",
        description="Private: seen, installed and evaluated by its owner's keys alone; public: by every key. " +
                    hub_note)
    visibility.add_argument("spec", metavar="ID", help="owner/name (yours)")
    visibility.add_argument("setting", choices=["public", "private"])
    add_settings(visibility, ("gateway_url",))
    visibility.set_defaults(func=cmd_env_visibility)



def cmd_env_init(args: argparse.Namespace) -> int:
    folder = scaffold(args.name, Path(args.dir), owner=args.owner)
    print(f"created {folder}: pip install -e {folder} && pytest {folder}")
    return 0


def cmd_env_push(args: argparse.Namespace) -> int:
    from flywheel.ops.hub import push
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        pushed = push(Path(args.dir), hub, private=args.private, scoring=not args.no_scoring, as_id=args.as_id)
    print(f"pushed {pushed['env_id']}@{pushed['version']} (sha256 {pushed['sha256']})")
    return 0


def cmd_env_install(args: argparse.Namespace) -> int:
    # imported here: --help loads no msgspec, pydantic or nats (tests/unit/test_cli.py)
    from flywheel.runtime import installs

    settings = settings_from(args)
    prefix = installs.bridged_kind(args.spec)
    if prefix is not None:
        name, place = installs.install_bridged(prefix, args.spec.removeprefix(prefix), settings.data_dir, say=print)
        print(f"{name} is installed in {place}, a folder of its own: env = \"{prefix}{name}\" runs it")
        return 0
    folder = installs.ensure(args.spec, settings.data_dir, gateway_url=settings.resolved_gateway_url)
    if folder is None:
        print(f"{args.spec} is installed in this Python's environment already: runs use it as it is")
    else:
        print(f"{args.spec} is installed in {folder}, a folder of its own: its environment workers put it first "
              "on their path")
    return 0


def cmd_env_fork(args: argparse.Namespace) -> int:
    from flywheel.ops.hub import fork
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        folder, pushed = fork(args.spec, args.new_id, hub, Path(args.dir), private=args.private,
                              scoring=not args.no_scoring)
    print(f"pushed {pushed['env_id']}@{pushed['version']}, forked from {args.spec}; edit {folder} and push new "
          "versions with flywheel env push")
    return 0


def cmd_env_show(args: argparse.Namespace) -> int:
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        if args.spec is None:
            rows = [[e["id"], e["latest_version"] or "-", "private" if e["private"] else "public",
                     e["forked_from"] or "", e["summary"]] for e in hub.environments()]
            print(table(rows, ["environment", "version", "visibility", "forked from", "summary"]) if rows else
                  "no environments on the hub yet (flywheel env push)")
            return 0
        env = hub.environment(args.spec)
        evals = hub.evals(args.spec)
    print(f"{env['id']} ({'private' if env['private'] else 'public'}; pip install --only-binary :all: "
          f"--index-url {hub.url}/hub/simple {env['project']})")
    if env["forked_from"]:
        print(f"forked from {env['forked_from']}")
    if env["forks"]:
        print("forks: " + ", ".join(fork["id"] for fork in env["forks"]))
    print(table([[v["version"], v["sha256"][:16], str(v["created_at"])[:19], v["summary"]] for v in env["versions"]],
                ["version", "sha256", "pushed", "summary"]))
    if evals:
        def num(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        print("leaderboard:")
        print(table([[e["model"], e["version"], num(e["reward_mean"]), num(e["reward_stderr"]),
                      " ".join(f"{k} {num(v)}" for k, v in e["pass_at"].items()),
                      str(e["prompt_tokens"] + e["completion_tokens"]), str(e["created_at"])[:10]] for e in evals],
                    ["model", "version", "reward", "stderr", "pass@k", "tokens", "date"]))
    return 0


def cmd_env_import(args: argparse.Namespace) -> int:
    owner, name = check_env_id(args.new_id)
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=IMPORTERS)}
    if args.format not in found:
        raise ValueError(f"format {args.format!r}: no importer for it is installed; the formats: "
                         f"{', '.join(sorted(found)) or 'none'}")
    convert = found[args.format].load()
    folder = convert(args.src, Path(args.dir) / name, owner, name)
    print(f"wrote {folder}, environment {args.new_id}: flywheel env push {folder}")
    return 0


def cmd_env_visibility(args: argparse.Namespace) -> int:
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        env = hub.set_private(args.spec, args.setting == "private")
    print(f"{env['id']} is {'private' if env['private'] else 'public'}")
    return 0


def cmd_env_list(args: argparse.Namespace) -> int:
    # imported here: --help loads no msgspec, pydantic or nats (tests/unit/test_cli.py)
    from flywheel.runtime import installs

    # imported here: as above
    from flywheel.sdk.environment import available

    rows = [[name, version, "this Python's environment"] for name, version in available().items()]
    rows += [[name, version, str(folder)] for name, versions in installs.installed(settings_from(args).data_dir).items()
             for version, folder in versions.items()]
    if not rows:
        print("no environments installed (packages register them under the flywheel.environments entry points)")
        return 0
    print(table(sorted(rows), ["environment", "version", "installed in"]))
    return 0
