"""The package's layout rules, checked on the source: no import cycles, no module over 400
lines unless listed as one concept, private modules used only in their package, no
polling loops; and the suite's: no test that waits by sleeping."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rollpipe"
TESTS = Path(__file__).resolve().parent
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _lazy_exports(tree: ast.Module) -> dict[str, str]:
    """``rollpipe/__init__.py``'s ``_EXPORTS`` table: public name -> defining module."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if node.value is not None and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets
        ):
            return {str(k): str(v) for k, v in ast.literal_eval(node.value).items()}
    return {}


def import_graph() -> dict[str, set[str]]:
    """Module -> the rollpipe modules it imports, from every import statement anywhere in
    it: module level, inside functions (lazy imports can still be circular) and inside
    ``if TYPE_CHECKING:`` (a cycle there is still a tangle, and breaks the day someone
    needs the import at runtime).

    * ``from rollpipe.a import b`` points at ``rollpipe.a.b`` when ``b`` is a submodule,
      else at ``rollpipe.a``.
    * The package ``rollpipe/__init__.py`` imports its submodules only under
      ``TYPE_CHECKING`` (for type checkers; at runtime it loads them lazily through the
      ``_EXPORTS`` table, whose entries are strings), so its ``TYPE_CHECKING`` imports
      are skipped and it is a leaf: edges into it would otherwise make every module that
      imports ``rollpipe.x`` part of one big cycle through the re-export table.
    * ``from rollpipe import Name`` inside the package points at the module that
      ``_EXPORTS`` says defines ``Name``: that is what runs.
    * Importing ``rollpipe.a.b`` also runs ``rollpipe/a/__init__.py``; that implicit
      parent import is not an edge (a package ``__init__`` that imports its own
      submodules would otherwise always be a cycle).
    """
    modules = _modules()
    root = PACKAGE.name
    exports = _lazy_exports(ast.parse(modules[root].read_text()))
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = _runtime_nodes(tree) if name == root else list(ast.walk(tree))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in nodes:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif base == root and alias.name in exports:
                        targets.append(exports[alias.name])
                    else:
                        targets.append(base)
            for target in targets:
                if target == root or target.startswith(root + "."):
                    while target not in modules and "." in target:
                        target = target.rpartition(".")[0]  # rollpipe.a.B -> rollpipe.a
                    if target != name:
                        graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_import_graph_sees_real_imports() -> None:
    graph = import_graph()
    assert "rollpipe.data.proto" in graph["rollpipe.data.rows"]
    assert graph["rollpipe"] == set()  # the package's own imports are TYPE_CHECKING only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


LONGER_MODULES: dict[str, str] = {
    "rollpipe.agent.records": "the episode's four records (spec, turn, trajectory, group) "
    "with their checkpoint round-trips: one data model, read together",
    "rollpipe.data.proto.dataproto": "verl's DataProto, one class with its 29 public methods "
    "(its helpers are already the private modules beside it)",
    "rollpipe.agent.chat": "ChatFormat, the one place a prompt is rendered and tokenized, "
    "with the tokenizer shortcuts it takes (each exactly the general path's result)",
    "rollpipe.agent.conversation": "the one conversation: its state, its turn's sampling, "
    "its engine request and the records it builds (a turn is built nowhere else)",
    "rollpipe.agent.dialog": "Dialog, one class: a chat episode's token-exact conversation "
    "(its first prompt, each response's action, each continuation by a window render with "
    "its checks and prefix-break paths); the row's text record is row_text, the kept "
    "repeats are repeats",
    "rollpipe.engines.weight_broadcast": "BroadcastChannel and its host's WeightReceiver: "
    "one protocol, the group's life (formed, re-formed after a failure) and one update's "
    "failure paths (the buckets' layout is weight_buckets)",
    "rollpipe.nodes.rollout": "the EpisodeRunner node, one class: admission, its book of "
    "specs in flight, the episodes' lifecycle and close (where an episode runs, this loop or "
    "a worker process, is rollpipe.workers)",
    "rollpipe.pipeline": "RolloutPipeline, one class: ROLL's scheduler API, each public method "
    "with its runnable example (the chain it drives is chain.py)",
}
"""Modules allowed over ``MAX_LINES``, each with the reason it is still one concept."""


def test_modules_are_concepts_not_lengths() -> None:
    """A module holds one concept; past ``MAX_LINES`` it is usually two. A concept that is
    longer is listed in ``LONGER_MODULES`` with its reason (and leaves it when it shrinks);
    a concept too long for one file is a package whose private (underscore) helper modules
    sit beside it (``test_private_modules_stay_in_their_package``)."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in LONGER_MODULES}
    assert not long, (
        f"modules over {MAX_LINES} lines: {long}; split them by concept, or list one in "
        "LONGER_MODULES with the reason it is one concept"
    )
    stale = {name for name in LONGER_MODULES if lengths.get(name, 0) <= MAX_LINES}
    assert not stale, f"LONGER_MODULES lists modules no longer over {MAX_LINES} lines: {stale}"


def _private_owner(module: str) -> str | None:
    """The package that owns ``module`` when its own name starts with ``_``, else None."""
    package, _, leaf = module.rpartition(".")
    return package if leaf.startswith("_") and not leaf.startswith("__") else None


def test_private_modules_stay_in_their_package() -> None:
    """``rollpipe/data/proto/_meta.py`` is DataProto's helper: only modules of
    ``rollpipe.data.proto`` import it, so the concept reads as one package."""
    outside = {
        (name, target)
        for name, targets in import_graph().items()
        for target in targets
        if (owner := _private_owner(target)) is not None
        and owner.startswith("rollpipe.")
        and not (name == owner or name.startswith(owner + "."))
    }
    assert not outside, f"private modules imported from outside their package: {outside}"


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0


def _polls(tree: ast.AST) -> list[tuple[int, str]]:
    """``sleep(<literal or name>)`` and ``.result(timeout=...)`` calls inside ``while`` loops.

    A loop that sleeps a fixed interval (or waits on a future in timeout slices) and
    checks again is polling: it adds latency and burns CPU; wait on the event instead.
    ``sleep(0)`` is allowed: it yields to the event loop without waiting. A sleep whose
    duration is computed (an attribute, an expression) is not flagged: that is a wait
    for a known time (e.g. a batching window), not a check-again loop.
    """
    found: list[tuple[int, str]] = []
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.While):
            continue
        for node in (n for stmt in loop.body for n in ast.walk(stmt)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            args = [*node.args, *(k.value for k in node.keywords)]
            fixed = bool(args) and isinstance(args[0], (ast.Constant, ast.Name))
            if fname == "sleep" and fixed and not _is_zero(args[0]):
                found.append((node.lineno, ast.unparse(node)))
            if fname == "result" and isinstance(func, ast.Attribute):
                timeout = [k.value for k in node.keywords if k.arg == "timeout"] + node.args[:1]
                if timeout and not (
                    isinstance(timeout[0], ast.Constant) and timeout[0].value is None
                ):
                    found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_the_poll_check_flags_polls_only() -> None:
    src = """
while True:
    time.sleep(0.1)
while not done:
    await asyncio.sleep(POLL_S)
while x:
    await asyncio.sleep(0)
    await asyncio.sleep(self.window_s)
    fut.result(timeout=None)
while y:
    fut.result(timeout=0.5)
time.sleep(1)
"""
    assert [line for line, _ in _polls(ast.parse(src))] == [3, 5, 11]


def test_no_polling_loops() -> None:
    polls = {
        name: _polls(ast.parse(path.read_text()))
        for name, path in _modules().items()
        if "sleep" in path.read_text() or ".result(" in path.read_text()
    }
    polls = {name: found for name, found in polls.items() if found and name not in EXTERNAL_WAITS}
    assert not polls, f"polling inside while loops (wait on an event instead): {polls}"


EXTERNAL_WAITS = {"rollpipe.engines.server"}
"""Modules allowed bounded check-again loops, because what they wait for is outside
rollpipe and offers no event: a vLLM server process becoming ready (``/health``) and its
process group ending after a signal (grandchildren cannot be ``wait``ed on). Each such
loop has a deadline and an error naming what did not happen."""


def test_external_waits_are_only_those_listed() -> None:
    """The allowance stays narrow: only ``ServerProcess``'s start and stop loops."""
    tree = ast.parse(_modules()["rollpipe.engines.server"].read_text())
    lines = {line for line, _ in _polls(tree)}
    functions = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        and any(f.lineno <= line <= (f.end_lineno or f.lineno) for line in lines)
    }
    assert functions == {"close", "_wait_ready"}, functions


WORK_MARK = "# work, not a wait"
WAIT_HELPERS = TESTS / "waiting.py"


def _fixed_duration(node: ast.Call) -> bool:
    """A ``sleep`` call whose duration is a non-zero number literal or a CONSTANT name."""
    args = [*node.args, *(k.value for k in node.keywords)]
    if not args:
        return False
    arg = args[0]
    if isinstance(arg, ast.Constant):
        return isinstance(arg.value, (int, float)) and arg.value != 0
    return isinstance(arg, ast.Name) and arg.id.isupper()


def _timed_sleeps(source: str) -> list[tuple[int, str]]:
    """Sleeps in test code that wait instead of being work: ``(line, call)`` each.

    A test that sleeps to let something happen ("the request is in flight", "the pause
    has landed", "the callbacks ran") and then asserts guesses how fast the machine is:
    too fast and the work is already over, too loaded and it has not started. Tests wait
    for the state itself with ``tests/waiting.py`` (``wait_until``: a deadline, not a
    duration; ``holds_for``: an invariant that must hold however long one looks).

    Flagged: every call of a function named ``sleep`` (``time.sleep``, ``asyncio.sleep``,
    a bare ``sleep``) whose duration is fixed (a non-zero number literal or an UPPER_CASE
    name), anywhere in a test module, at any depth. Not flagged:

    * ``sleep(0)``: it yields to the event loop and waits for nothing.
    * ``tests/waiting.py`` itself (not scanned): its sleeps pace check-again loops that
      end at a deadline or check an invariant.
    * A sleep that *is* the work of a stand-in (an env whose ``step`` hangs or is slow, a
      coroutine that must not answer in time), marked with a trailing
      ``# work, not a wait``. The mark counts only inside a class or a function that is
      not itself a test (``test*``): in a test's own body or at module level a sleep can
      only be a wait.
    * A computed duration (``sleep(delay)``, a point in time a hypothesis test draws):
      the test chose to vary it, and its assertions hold for every value.
    * ``sleep`` passed as a function (``threads.call(time.sleep, 0.3)``): that is an env
      call's work, not a wait of the test.
    """
    lines = source.splitlines()
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, scopes: tuple[ast.AST, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scopes = (*scopes, node)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "sleep" and _fixed_duration(node):
                inner = scopes[-1] if scopes else None
                stand_in = inner is not None and not (
                    isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and inner.name.startswith("test")
                )
                end = node.end_lineno or node.lineno
                marked = lines[end - 1].rstrip().endswith(WORK_MARK)
                if not (stand_in and marked):
                    found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, scopes)

    visit(ast.parse(source), ())
    return sorted(found)


def test_the_sleep_check_flags_waits_only() -> None:
    src = """
import asyncio, time

def test_waits():
    task = start()
    time.sleep(0.3)
    assert not task.done()
    await asyncio.sleep(0)
    sleep(1)  # work, not a wait
    time.sleep(POLL_S)
    time.sleep(delay)
    threads.call(time.sleep, 0.3)

    class HangingEnv:
        def step(self, action):
            time.sleep(60)  # work, not a wait
            time.sleep(60)

    async def never_answers():
        await asyncio.sleep(10)  # work, not a wait

def helper():
    time.sleep(0.05)

time.sleep(1)  # work, not a wait
"""
    assert [line for line, _ in _timed_sleeps(src)] == [6, 9, 10, 17, 23, 25]


def test_no_test_waits_by_sleeping() -> None:
    """No test decides an outcome by sleeping (see ``_timed_sleeps``)."""
    found = {
        str(path.relative_to(TESTS)): hits
        for path in sorted(TESTS.rglob("*.py"))
        if path != WAIT_HELPERS and (hits := _timed_sleeps(path.read_text()))
    }
    assert not found, (
        "tests that sleep to let something happen (wait for the state with "
        f"tests/waiting.py, or mark a stand-in's work with {WORK_MARK!r}): {found}"
    )


def test_every_public_name_resolves():
    """``from rollpipe import X`` keeps working for every exported name, wherever its
    module moved."""
    import importlib

    import rollpipe

    for name in rollpipe.__all__:
        value = getattr(rollpipe, name)
        module = importlib.import_module(rollpipe._EXPORTS[name])
        assert getattr(module, name) is value, name


TRAINING = "rollpipe.training"
TRAINING_USERS = {"rollpipe", "rollpipe.cli"}
"""What may import the training package: the lazy re-export table (``RolloutBuffer``,
the tiny model), the CLI (``rollpipe train``, its default model) and the tiny VLM (built
on the tiny model's tokenizer, into its cache dir)."""


def test_the_rollout_core_does_not_import_training() -> None:
    """The demo trainer, SFT, expert and PPO pieces stay out of the rollout core's path."""
    graph = import_graph()
    exports = _lazy_exports(ast.parse(_modules()["rollpipe"].read_text()))
    assert any(m.startswith(TRAINING) for m in exports.values())  # the check can see one
    users = {
        name
        for name, targets in graph.items()
        if not name.startswith(TRAINING)
        and any(t == TRAINING or t.startswith(TRAINING + ".") for t in targets)
    }
    assert users <= TRAINING_USERS, f"rollout-core modules importing {TRAINING}: {users}"


def test_tests_do_not_import_test_modules() -> None:
    """A test module imported from another one (``from tests.test_x import ...``) is loaded
    twice (pytest imports it as ``test_x``): its import-time side effects (env
    registrations) then point at the second copy's classes. Shared helpers go in a
    non-test module (``tests/waiting.py``, ``tests/records.py``)."""
    found = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad = [n for n in names if n.rpartition(".")[2].startswith("test_")]
            if bad:
                found[str(path.relative_to(TESTS))] = bad
    assert not found, f"test modules imported by other tests: {found}"


def _imports_of(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and the rollpipe modules it imports."""
    return {
        name: targets
        for name, targets in import_graph().items()
        if name == package or name.startswith(package + ".")
    }


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_agent_does_not_import_envs() -> None:
    """The env contract (the protocols the episode calls and the step metrics it reads,
    ``env_contract``) lives in ``rollpipe.agent``, where the episode uses it: envs depend
    on it, never the other way round."""
    graph = import_graph()
    assert "rollpipe.agent.env_contract" in graph["rollpipe.envs.base"]  # the check sees
    up = {
        (name, target)
        for name, targets in _imports_of("rollpipe.agent").items()
        for target in targets
        if _within(target, "rollpipe.envs")
    }
    assert not up, f"rollpipe.agent modules importing rollpipe.envs: {sorted(up)}"


def _calls_to(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in names:
                found.append((node.lineno, name))
    return found


CONVERSATION = "rollpipe.agent.conversation"
TURN_BUILDING = {"Turn", "Trajectory", "generate_turn", "stopping_at_end_of_turn"}
"""What building a turn means: its engine request, its sampling, its record, the result."""


def test_one_conversation_builds_every_turn() -> None:
    """One conversation implementation serves the env episode and the front door: only
    ``rollpipe.agent.conversation`` requests a turn, builds a ``Turn`` or a
    ``Trajectory`` (``records`` defines them), and both drivers go through it."""
    allowed = {CONVERSATION, "rollpipe.agent.records"}
    copies = {
        name: hits
        for name, path in _modules().items()
        if name not in allowed
        and not _within(name, TRAINING)
        and (hits := _calls_to(ast.parse(path.read_text()), TURN_BUILDING))
    }
    assert not copies, f"turns built outside {CONVERSATION}: {copies}"
    assert _calls_to(ast.parse(_modules()[CONVERSATION].read_text()), {"Turn", "Trajectory"})
    graph = import_graph()
    for driver in ("rollpipe.agent.episode", "rollpipe.frontdoor.session"):
        assert CONVERSATION in graph[driver], f"{driver} does not drive {CONVERSATION}"


def _runs_a_tool_runner(tree: ast.AST) -> list[int]:
    """Lines calling ``<something runner>.run(...)``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "run"
        and "runner" in ast.unparse(node.func.value).lower()
    ]


def test_tools_are_run_by_the_episode_not_by_envs() -> None:
    """An env with tools (``ToolEnv``, ``TRLEnv``, the adapters) declares its
    ``tool_runner``; the episode runs a turn's calls with it (``EnvCaller.run_tools``) and
    steps the env with their results. No env module runs one itself."""
    envs = ("rollpipe.envs", "rollpipe.integrations")
    runs = {
        name: lines
        for name, path in _modules().items()
        if any(_within(name, e) for e in envs)
        and (lines := _runs_a_tool_runner(ast.parse(path.read_text())))
    }
    assert not runs, f"env modules running tool calls themselves (lines): {runs}"
    caller = ast.parse((PACKAGE / "agent" / "env_caller.py").read_text())
    assert _runs_a_tool_runner(caller), "the episode's env caller runs the tools (the check sees)"
