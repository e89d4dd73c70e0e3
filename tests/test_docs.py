"""The examples in docs/ run, in order, page by page, against a real server.

Each page's ```python blocks run in one fresh Python process (so a page reads
top to bottom like a session); its ```ipython blocks run, in order, in a
fresh Pathways kernel. ```python skip and ```ipython skip blocks are
illustrations only (code for a cluster or a hosted runtime the tests do not
have); shell, YAML and text blocks are not Python. Any other block fails
test_every_block_is_run_or_marked, so no example escapes by its label. The
documented address grpc://127.0.0.1:29000 is replaced by the test server's, and its documented
storage root /tmp/pathways-storage by the server's.
"""

from __future__ import annotations

import argparse
import ast
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys

import pytest
import tomllib

import pathways_nb
from pathways_nb import cli, errors
from pathways_nb.core import tuning
from pathways_nb.notebook import magics
from pathways_nb.proxy import versions
from pathways_nb.testing import KernelSession, wait_until

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\s*\n(.*?)^```", re.MULTILINE | re.DOTALL)
IPYTHON_BLOCK = re.compile(r"^```ipython\s*\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOCUMENTED_ADDRESS = "grpc://127.0.0.1:29000"
DOCUMENTED_STORAGE_ROOT = "/tmp/pathways-storage"
FENCE = re.compile(r"^```(.*)$", re.MULTILINE)
NOT_RUN = {"python skip", "ipython skip", "bash", "text", "yaml", "dockerfile"}


def test_every_block_is_run_or_marked():
    """Each fenced block is run (python, ipython) or marked as not Python or not runnable here."""
    for page in sorted(DOCS.glob("*.md")):
        headers = FENCE.findall(page.read_text())[::2]  # opening fences; the closing ones are bare
        unknown = sorted({h.strip() for h in headers} - NOT_RUN - {"python", "ipython"})
        assert not unknown, (
            f"{page.name}: code blocks labelled {unknown}: use one of python, ipython, {sorted(NOT_RUN)}"
        )


def _pages_with_examples() -> list[pathlib.Path]:
    return sorted(page for page in DOCS.glob("*.md") if BLOCK.search(page.read_text()))


@pytest.mark.parametrize("page", _pages_with_examples(), ids=lambda p: p.name)
def test_examples_run(page, proxy_server, tmp_path):
    code = "\n".join(BLOCK.findall(page.read_text())).replace(DOCUMENTED_ADDRESS, proxy_server.address)
    code = code.replace(DOCUMENTED_STORAGE_ROOT, proxy_server.storage_root)
    script = tmp_path / f"{page.stem}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{page.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def _pages_with_ipython() -> list[pathlib.Path]:
    return sorted(page for page in DOCS.glob("*.md") if IPYTHON_BLOCK.search(page.read_text()))


@pytest.mark.parametrize("page", _pages_with_ipython(), ids=lambda p: p.name)
def test_ipython_examples_run(page, kernel_installed):
    kernel = KernelSession("pathways")
    try:
        for block in IPYTHON_BLOCK.findall(page.read_text()):
            out = kernel.run(block)
            problems = out["errors"] + [line for line in out["stderr"].splitlines() if "Error" in line]
            assert not problems, f"{page.name}: {block!r} failed: {problems}"
    finally:
        kernel.close()


# -- the command line: every flag the docs name exists, every flag is documented ---------------

REPOSITORY = DOCS.parent
README = REPOSITORY / "README.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
EVERY_COMMAND = "Every command"


def _commands(program: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Every command of ``program`` (``pathways-nb``) by its words: "" (the program), "up", "deploy k8s", ..."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(words: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        found[" ".join(words)] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk((*words, name), child)

    walk((), program or cli.build_parser())
    return found


def _flags(parser: argparse.ArgumentParser, hidden: bool = False) -> set[str]:
    """The parser's ``--`` flags (with ``hidden``, also --help, those whose help is suppressed and former names)."""
    return {
        option
        for action in parser._actions
        if hidden or (action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction))
        for option in action.option_strings
        if option.startswith("--")
    } | (set(parser.former_names) if hidden else set())


def _cli_sections() -> dict[str, str]:
    """docs/cli.md by section: "" (before the first), "Every command", or a command's words ("deploy k8s")."""
    text = (DOCS / "cli.md").read_text()
    parts = re.split(r"^## (.*)$", text, flags=re.MULTILINE)
    sections = {"": parts[0]}
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        command = re.fullmatch(r"`pathways-nb ?(.*)`", heading.strip())
        sections[command[1] if command else heading.strip()] = body
    return sections


def test_every_flag_of_every_command_is_in_its_section_of_cli_md():
    sections = _cli_sections()
    everywhere = set(FLAG.findall(sections.get(EVERY_COMMAND, "")))
    problems = []
    for command, parser in _commands().items():
        flags = _flags(parser) - everywhere
        if not command:
            missing = flags - set(FLAG.findall(sections[""]))
        elif not flags:
            continue  # a group of commands (deploy, kernel): its commands have the sections
        elif command not in sections:
            problems.append(f"no section ## `pathways-nb {command}` for its flags {sorted(flags)}")
            continue
        else:
            missing = flags - set(FLAG.findall(sections[command]))
        if missing:
            problems.append(f"pathways-nb {command}".strip() + f": {sorted(missing)} are not in its section")
    assert not problems, "docs/cli.md leaves out flags:\n" + "\n".join(problems)


def _wrong_defaults(command: str, parser: argparse.ArgumentParser, section: str) -> list[str]:
    """Table rows whose default is not the parser's (where the parser has one; words where it has None)."""
    # A default the program sets for all its commands (--log_level's) is the program's, not the parser's.
    program = cli.build_parser()
    defaults = {
        option: program.get_default(action.dest) if action.default == argparse.SUPPRESS else action.default
        for action in parser._actions
        for option in action.option_strings
    }
    wrong = []
    for flag, documented in re.findall(r"^\| `(--[\w-]+)` \| ([^|]*) \|", section, flags=re.MULTILINE):
        default = defaults[flag]
        if default is None or isinstance(default, bool):
            continue  # said in words ("$PATHWAYS_CLUSTER_TOKEN", "(required)", "a quarter of RAM")
        expected = f"{default:g}" if isinstance(default, float) else str(default)
        if documented.strip().strip("`") != expected:
            wrong.append(f"pathways-nb {command} {flag} defaults to {expected}, its table says {documented.strip()}")
    return wrong


def test_the_flags_cli_md_names_exist_with_the_defaults_it_gives():
    commands = _commands()
    anywhere = set().union(*(_flags(p, hidden=True) for p in commands.values()))
    problems = []
    for name, section in _cli_sections().items():
        named = set(FLAG.findall(section))
        if name == EVERY_COMMAND:
            for command, parser in commands.items():
                if command:  # the program itself takes only --help and --version
                    if named - _flags(parser):
                        problems.append(
                            f"{EVERY_COMMAND}: pathways-nb {command} has no {sorted(named - _flags(parser))}"
                        )
                    problems += _wrong_defaults(command, parser, section)
        elif name in commands and name:
            unknown = named - _flags(commands[name], hidden=True)
            if unknown:
                problems.append(f"the section on pathways-nb {name} names {sorted(unknown)}, not its flags")
            problems += _wrong_defaults(name, commands[name], section)
        elif named - anywhere:
            problems.append(f"{name or 'the introduction'}: no command has {sorted(named - anywhere)}")
    assert not problems, "docs/cli.md:\n" + "\n".join(problems)


def _command_lines(text: str, program: str) -> list[str]:
    """What follows each ``program`` in ``text``, to the end of its command (lines continued by ``\\``)."""
    text = text.replace("\\\n", " ")
    return [m.group(1) for m in re.finditer(rf"(?<![\w/.-]){re.escape(program)} ([^\n`|;#]*)", text)]


def _pages() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("program", ["pathways-nb", "%pathways"])
def test_every_command_in_the_readme_and_docs_uses_flags_it_has(program):
    """``pathways-nb ...`` against the CLI's parsers, ``%pathways ...`` against the magic's."""
    commands = _commands(magics._parser() if program == "%pathways" else None)
    anywhere = set().union(*(_flags(p, hidden=True) for p in commands.values()))
    problems = []
    for page in _pages():
        for line in _command_lines(page.read_text(), program):
            words = line.split()
            named = next(
                (" ".join(words[:n]) for n in range(len(words), 0, -1) if " ".join(words[:n]) in commands), None
            )
            flags = {w.strip("[]").split("=")[0] for w in words if FLAG.fullmatch(w.strip("[]").split("=")[0])}
            unknown = flags - (_flags(commands[named], hidden=True) if named else anywhere)
            if unknown:
                problems.append(
                    f"{page.relative_to(REPOSITORY)}: `{program} {line.strip()}`: "
                    f"{sorted(unknown)} are not flags of {program} {named or '(any command)'}"
                )
    assert not problems, "\n".join(problems)


# -- environment variables: every one the code reads is in docs/api.md's table -----------------

# Variables the code reads that a user never sets, each with the reason it is not in the table.
UNDOCUMENTED_VARIABLES = {
    "PATHWAYS_PARENT_PID": "internal: set by the launcher (LocalCluster, up) for each child server, which "
    "stops itself once that process is gone",
    "JUPYTER_PATH": "Jupyter's own search path, documented by Jupyter: the quickstart only puts its "
    "temporary kernel in front of it",
    "PATH": "the shell's: a colocated host passes it on to the executors it starts (their only inherited variable)",
}


def _module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` (and ``A, B = "a", "b"``) assignments."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = (
                zip(target.elts, value.elts, strict=False)
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                else [(target, value)]
            )
            for name, text in pairs:
                if isinstance(name, ast.Name) and isinstance(text, ast.Constant) and isinstance(text.value, str):
                    constants[name.id] = text.value
    return constants


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _variable_keys(tree: ast.Module) -> list[ast.expr]:
    """The expressions that name a variable in ``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]``,
    ``X in os.environ``, ``os.environ.setdefault/pop(X)``."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "setdefault", "pop") and _is_environ(node.func.value):
                keys.append(node.args[0])
            elif node.func.attr == "getenv":
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            if any(_is_environ(c) for c in node.comparators):
                keys.append(node.left)
    return keys


def _environment_variables() -> dict[str, set[str]]:
    """Each variable pathways_nb reads or sets, with the modules that do."""
    package = REPOSITORY / "pathways_nb"
    trees = {
        ".".join(path.relative_to(REPOSITORY).with_suffix("").parts).removesuffix(".__init__"): ast.parse(
            path.read_text()
        )
        for path in package.rglob("*.py")
    }
    constants = {module: _module_constants(tree) for module, tree in trees.items()}
    found: dict[str, set[str]] = {}
    for module, tree in trees.items():
        imported = {}  # local name -> (module, name or None for a module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    imported[alias.asname or alias.name] = (
                        (submodule, None) if submodule in trees else (node.module, alias.name)
                    )
        if module == "pathways_nb.core.tuning":  # its variables come from its registry (checked below)
            found.update((setting.env_var, {module}) for setting in tuning.SETTINGS.values())
            continue
        for key in _variable_keys(tree):
            name = None
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                name = key.value
            elif isinstance(key, ast.Name):
                source, attribute = imported.get(key.id, (module, key.id))
                name = constants.get(source, {}).get(attribute or "")
            elif isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name):
                source, attribute = imported.get(key.value.id, (None, None))
                name = constants.get(source, {}).get(key.attr) if attribute is None else None
            assert name, (
                f"{module} line {key.lineno}: cannot tell which environment variable {ast.unparse(key)} is; "
                "name it with a module-level constant (NAME_ENV = '...') so that this test can check docs/api.md"
            )
            found.setdefault(name, set()).add(module)
    return found


def _documented_variables() -> set[str]:
    table = (DOCS / "api.md").read_text().split("## Environment variables", 1)[1]
    cells = re.findall(r"^\| ([^|]*) \|", table, flags=re.MULTILINE)
    return {name for cell in cells for name in re.findall(r"`([A-Z][A-Z0-9_]+)(?:=[^`]*)?`", cell)}


def test_every_environment_variable_the_code_reads_is_in_the_api_table():
    read = _environment_variables()
    assert "PATHWAYS_CLUSTER_TOKEN" in read and "PATHWAYS_WEIGHT" in read  # the scan finds what it should
    missing = {name: sorted(modules) for name, modules in read.items() if name not in UNDOCUMENTED_VARIABLES}
    missing = {name: modules for name, modules in missing.items() if name not in _documented_variables()}
    assert not missing, f"environment variables missing from docs/api.md's table (add a row, or a reason): {missing}"
    stale = set(UNDOCUMENTED_VARIABLES) - set(read)
    assert not stale, f"UNDOCUMENTED_VARIABLES names variables the code no longer reads: {stale}"


def test_every_tuning_setting_is_in_the_api_table_with_its_default():
    table = (DOCS / "api.md").read_text().split("## Tuning", 1)[1]
    rows = re.findall(r"^\| `([A-Z0-9_]+)` \| `([a-z0-9_]+)` \| `([^`]*)` \|", table, flags=re.MULTILINE)
    documented = {name: (variable, default) for variable, name, default in rows}
    registry = {s.name: (s.env_var, str(s.default)) for s in tuning.SETTINGS.values()}
    assert documented == registry, "docs/api.md's Tuning table and pathways_nb.core.tuning differ"


# -- versions: what the docs claim comes from the constants the code uses ----------------------

VERSION = r"\d+\.\d+\.\d+(?:\.\d+)?"


def _claims() -> list[tuple[pathlib.Path, str]]:
    """The texts where versions are claimed: the README, docs/, binder/."""
    paths = [*_pages(), *sorted((REPOSITORY / "binder").iterdir())]
    return [(path, path.read_text()) for path in paths if path.is_file()]


def test_the_supported_range_and_version_are_pyproject_s():
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    for package in ("jax", "jaxlib"):
        (requirement,) = [r for r in project["dependencies"] if re.match(rf"{package}\b(?![-_])", r)]
        assert requirement == f"{package}{errors.SUPPORTED_RANGE}"
    low, high = re.fullmatch(rf"({VERSION}) to ({VERSION})", errors.SUPPORTED_JAXLIB).groups()
    lower_bound, upper_bound = re.fullmatch(r">=([\d.]+),<([\d.]+)", errors.SUPPORTED_RANGE).groups()
    assert low == lower_bound

    def number(version: str) -> tuple[int, ...]:
        return tuple(map(int, version.split(".")))

    assert number(low) <= number(high) < number(upper_bound)
    assert project["version"] == pathways_nb.__version__, "pyproject.toml and pathways_nb/_version.py differ"


def test_the_docs_claim_the_versions_the_code_supports():
    """Version ranges, requirement specifiers, image tags and Python floors, as the code's constants say."""
    servers = errors.SUPPORTED_JAXLIB
    clients = re.search(rf"{VERSION} to {VERSION}", versions.SUPPORTED_CLIENTS)[0]
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    python = re.fullmatch(r">=(\d+\.\d+)", project["requires-python"])[1]
    problems = []
    for path, text in _claims():
        where = path.relative_to(REPOSITORY)
        for claimed in re.findall(rf"{VERSION} to {VERSION}", text):
            if claimed not in (servers, clients):
                problems.append(f"{where}: {claimed}: servers run on {servers}, clients are {clients}")
        for claimed in re.findall(r">=\s*[\d.]+\s*,\s*<\s*[\d.]+", text):
            if claimed.replace(" ", "") != errors.SUPPORTED_RANGE:
                problems.append(f"{where}: {claimed}: pyproject requires {errors.SUPPORTED_RANGE}")
        for claimed in re.findall(r"(?<![\w./-])pathways-nb:(\d+\.\d+\.\d+)", text):
            if claimed != pathways_nb.__version__:
                problems.append(f"{where}: the image pathways-nb:{claimed}: this is {pathways_nb.__version__}")
        for claimed in re.findall(r"Python (\d+\.\d+)(?:\+| or newer)", text):
            if claimed != python:
                problems.append(f"{where}: Python {claimed} or newer: pyproject requires >={python}")
        for pinned in re.findall(r"\bpin(?:s|ned)?\b[^.\n]*\bjax", text):
            problems.append(f"{where}: {pinned!r}: pathways-nb takes a range of jax, {errors.SUPPORTED_RANGE}")
    assert not problems, "\n".join(problems)


def test_nothing_says_to_pip_install_pathways_nb_by_name():
    """It is not on a package index: installs name the checkout (``pip install .``, ``-e ".[bench]"``)."""
    sources = [
        *_pages(),
        *(REPOSITORY / "binder").iterdir(),
        *(REPOSITORY / "notebooks").glob("*.ipynb"),
        *(REPOSITORY / "pathways_nb").rglob("*.py"),
        *(REPOSITORY / "benchmarks").glob("*.py"),
    ]
    for path in sources:
        for command in re.findall(r"pip install ([^\n`]*)", path.read_text()):
            for word in command.split():
                name = word.strip("'\"\\")
                assert not re.fullmatch(r"pathways[-_]nb(\[[^\]]*\])?", name), (
                    f"{path.relative_to(REPOSITORY)}: pip install {command.strip()}: "
                    "pathways-nb is not on a package index (pip install . in the checkout)"
                )


# -- the README's "Using it", as a new user follows it -------------------------------------------

BASH_BLOCK = re.compile(r"^```bash\s*\n(.*?)^```", re.MULTILINE | re.DOTALL)
PRINTED_EXPORT = re.compile(r"export \w+=\$\(cat ([^)]+)\)")


def _using_it() -> tuple[str, str, str]:
    """The README's "Using it": its two shell blocks (start the cluster; the other terminal) and its notebook."""
    section = README.read_text().split("## Using it", 1)[1].split("\n## ", 1)[0]
    (start, terminal), (notebook,) = BASH_BLOCK.findall(section), IPYTHON_BLOCK.findall(section)
    return start, terminal, notebook


def _commands_of(block: str) -> list[list[str]]:
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_readme_s_using_it_runs_as_written(tmp_path, monkeypatch):
    """`pathways-nb up`, the token line it prints, the kernel installed, then the README's notebook lines."""
    start, terminal, notebook = _using_it()
    bin_dir = pathlib.Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "PATHWAYS_"))}
    env.update(HOME=str(tmp_path / "home"), PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    for name in ("JUPYTER_DATA_DIR", "XDG_DATA_HOME", "JUPYTER_PATH"):
        env.pop(name, None)

    ((up, *up_args),) = _commands_of(start)
    assert up == "pathways-nb" and up_args[0] == "up", start
    up_args = ["0" if word == DOCUMENTED_ADDRESS.rsplit(":", 1)[1] else word for word in up_args]  # a free port
    shape = cli.build_parser().parse_args(up_args)
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        cluster = subprocess.Popen(
            ["pathways-nb", *up_args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
        )

    def printed() -> str:
        text = log.read_text()
        assert PRINTED_EXPORT.search(text) or cluster.poll() is None, f"`pathways-nb up` ended:\n{text[-3000:]}"
        return text

    kernel = None
    try:
        text = wait_until(
            printed, 180, "the token line of `pathways-nb up`", holds=PRINTED_EXPORT.search, interval_s=0.2
        )
        export = PRINTED_EXPORT.search(text)
        address = re.search(r"cluster serving (grpc://\S+):", log.read_text())[1]
        printed = export[0]
        for command in _commands_of(terminal):
            if command[0] == "export":  # "the line `up` printed": the README shows it with another path
                pattern = re.escape(printed).replace(re.escape(export[1]), r"\S+")
                assert re.fullmatch(pattern, " ".join(command)), (
                    f"README's {command} is not the line up prints: {printed}"
                )
                shell = subprocess.run(
                    ["bash", "-c", f'{printed}; printf %s "$PATHWAYS_CLUSTER_TOKEN"'],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert shell.returncode == 0 and shell.stdout, shell.stderr
                env["PATHWAYS_CLUSTER_TOKEN"] = shell.stdout
            elif command[:3] == ["pathways-nb", "kernel", "install"]:
                installed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
                assert installed.returncode == 0, installed.stderr
                kernels = re.search(r"kernel in (\S+)", installed.stdout)[1]
                monkeypatch.setenv("JUPYTER_PATH", str(pathlib.Path(kernels).parent.parent))
            else:  # Jupyter itself: this test's kernel stands in for it
                assert command[0] == "jupyter", f"README's Using it has a step this test does not run: {command}"
        kernel = KernelSession("pathways", env=env)
        outputs = {}
        for line in notebook.replace(DOCUMENTED_ADDRESS, address).splitlines():
            out = kernel.run(line)
            problems = out["errors"] + [text for text in out["stderr"].splitlines() if "Error" in text]
            assert not problems, f"README: {line!r} failed: {problems}"
            outputs[line.split("#")[0].strip()] = out
        devices = shape.islands * shape.hosts_per_island * shape.devices_per_host
        (listed,) = [out for line, out in outputs.items() if line.endswith("jax.devices()")]
        assert len(re.findall(r"id=\d+", listed["data"][-1]["text/plain"])) == devices, listed
        (islands,) = [out for line, out in outputs.items() if line == "%pathways islands"]
        island_map = kernel.widget_state(islands["widgets"][-1])["value"]
        assert all(f'data-island="{i}"' in island_map for i in range(shape.islands)), island_map
    finally:
        if kernel is not None:
            kernel.close()
        cluster.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            assert cluster.wait(60) == 0, log.read_text()[-3000:]
        finally:
            if cluster.poll() is None:
                cluster.kill()
                cluster.wait()
