"""Entry point: `python launch/tpu_run.py --config=experiments/xbench.py[:preset[,mode]] --workdir=DIR`.

The same command runs the `local` preset on a laptop CPU and the `paper` preset on every host of a TPU pod
slice (where `jax.distributed` is initialised from the TPU environment). N processes on one machine (or on
hosts without a TPU environment) form one job with `--coordinator=HOST:PORT --num_processes=N --process_id=I`.
Logic lives in `mgrpo_jax.rl.trainer`; this file parses flags, sets up processes and logging, and calls it.

Config: `--config=FILE[:PRESET[,MODE]]`. FILE is looked up from the current directory, then from the repository
(so `experiments/xbench.py` works from anywhere); the default is experiments/xbench.py with the default preset.
Override any field with `--config.FIELD=VALUE`, FIELD a dotted path of an existing field: `--config.seed=3`,
`--config.main.loss=gspo`, `--config.train.eval_at_start=true` (or `--config.train.eval_at_start` /
`--noconfig.train.eval_at_start`), tuples as `--config.rewards.alpha="(0.2, 0.8)"`. Overrides come after
`--config`.

A loss of your own: `--loss_module=my_loss.py` (a file, from the current directory) or `--loss_module=pkg.my_loss`
(a module importable from it) is imported before the config is checked; its `@register_loss("name")` makes
`--config.main.loss=name` valid. Repeat the flag for several.

Exit status: 0 when the run finishes (and for --help); 2 for a usage error, found before anything is built: an
unknown flag or config field, a config file, preset or mode that does not exist, an override value of the wrong
type, a config that `mgrpo_jax.config.validate` rejects, a workdir that cannot be written, missing or malformed
benchmark files (`--config.env.benchmark_path`). A usage error prints one `error: ...` line to stderr (a rejected
config: that line, then one indented line per problem) and no traceback. Anything else that stops a run is a
bug or a failure of the machine, and shows its traceback (exit status 1). A run stopped by SIGTERM (a TPU VM's
preemption notice) or Ctrl-C writes a checkpoint and exits with status 75 (EX_TEMPFAIL: run the same command again
to resume); a second Ctrl-C stops at once, drops the checkpoint being written and exits with status 130 (the
same command resumes from the newest complete checkpoint). Every stop writes `summary.json` with its status.
"""

import difflib
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys

from absl import app, flags
from ml_collections import config_dict, config_flags
from ml_collections.config_flags import config_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout

from mgrpo_jax.config import BENCHMARKS, MODES, OPEN_SECTIONS, PRESETS  # noqa: E402
from mgrpo_jax.rl.run import UsageError, choose_platform  # noqa: E402

CHOSEN_PLATFORM = choose_platform()  # before anything starts JAX's backends

EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped on a signal with a checkpoint written; rerun to resume
EXIT_AT_ONCE = 130  # 128 + SIGINT: a second Ctrl-C; rerun to resume from the newest complete checkpoint
DEFAULT_CONFIG = "experiments/xbench.py"
EXPERIMENT_FILES = tuple(f"experiments/{b}.py" for b in BENCHMARKS)
_HELP = ("-?", "-h", "--help", "-help", "--helpshort", "-helpshort", "--helpfull", "-helpfull", "--helpxml",
         "-helpxml")
_CONFIG_ARG = re.compile(r"^--?config(=(?P<value>.*))?$")
_OVERRIDE_ARG = re.compile(r"^--?(no)?config\.(?P<field>[^=]*)(=.*)?$")

# No default here: the launcher inserts --config=DEFAULT_CONFIG when none is given, resolved like any other, so
# the file is never loaded (relative to the wrong directory) while the flag is defined.
_CONFIG = config_flags.DEFINE_config_file(
    "config", None,
    f"Experiment config file[:preset[,mode]], e.g. experiments/xbench.py:local,frozen_sub (default: "
    f"{DEFAULT_CONFIG}; a relative path not found from the current directory is taken from the repository). "
    f"Files: {', '.join(EXPERIMENT_FILES)}. Presets: {', '.join(PRESETS)} (default: local without accelerators, "
    f"paper on TPU; mgrpo_jax/presets.py). Modes: {', '.join(MODES)} (default: {MODES[0]}). Override any "
    f"existing field with --config.FIELD=VALUE after --config, e.g. --config.main.loss=gspo, --config.seed=3, "
    f"--config.rewards.alpha='(0.2, 0.8)'.")
flags.FLAGS["config"].default_as_str = repr(DEFAULT_CONFIG)  # for --help
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, logs and plots go here; a run resumes from it.")
_ROLE = flags.DEFINE_enum("role", "colocated", ["colocated", "main", "sub"],
                          "colocated: both agents in this job. main / sub: one side of the decoupled mode.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", None, "Initialise jax.distributed (default: on TPU pods, or when "
                                  "--coordinator is given).")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of process 0's coordinator, for processes started "
                                   "by hand (e.g. 127.0.0.1:12345 for N CPU processes on one machine). TPU pods "
                                   "need none: jax.distributed reads the TPU environment.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "How many processes form the job (with --coordinator).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
_LOSS_MODULES = flags.DEFINE_multi_string(
    "loss_module", [], "A Python file (my_loss.py) or module (pkg.my_loss, importable from the current directory) "
    "that registers a loss with mgrpo_jax.core.register_loss; imported before the config is checked, so "
    "--config.main.loss=NAME can select it. Repeat for several; every host of a pod needs the file.")


def _did_you_mean(value: str, options) -> str:
    close = difflib.get_close_matches(value, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _exit_usage(message) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(EXIT_USAGE)


def import_loss_module(value: str) -> list[str]:
    """Imports `value` (a .py file or a module name, both from the current directory) and returns the names of the
    losses it registered; a module that cannot be imported, or registers none, is a UsageError."""
    from mgrpo_jax.core.losses import available_losses

    before, flag = set(available_losses()), f"--loss_module={value}"
    is_file = value.endswith(".py") or os.sep in value
    # `python launch/tpu_run.py` puts launch/, not the current directory, on sys.path; the user's file may
    # import its neighbours.
    folder = os.path.dirname(os.path.abspath(value)) if is_file else os.getcwd()
    sys.path.insert(0, folder)
    try:
        if is_file:
            if not os.path.isfile(value):
                raise UsageError(f"{flag}: no such file (looked in {os.getcwd()})")
            name = os.path.splitext(os.path.basename(value))[0]
            if name in sys.modules:
                raise UsageError(f"{flag}: a module named {name!r} is already imported; rename the file")
            spec = importlib.util.spec_from_file_location(name, os.path.abspath(value))
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
        else:
            importlib.import_module(value)
    except UsageError:
        raise
    except ModuleNotFoundError as e:
        if not is_file and e.name and value.startswith(e.name):
            raise UsageError(f"{flag}: no module named {e.name!r} importable from {os.getcwd()} (or give the "
                             "file's path, ending in .py)") from None
        raise UsageError(f"{flag}: importing it failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's code: any failure is reported as this one line
        raise UsageError(f"{flag}: importing it failed: {type(e).__name__}: {e}") from None
    added = sorted(set(available_losses()) - before)
    if not added:
        raise UsageError(f"{flag}: it registered no loss (decorate the loss function with "
                         "@register_loss(\"name\") from mgrpo_jax.core)")
    return added


def import_loss_modules(values: list[str], config) -> None:
    """Imports every `--loss_module`; an agent whose loss none of them (nor the package) registered is a
    UsageError naming what they did register."""
    if not values:
        return
    added = [name for value in values for name in import_loss_module(value)]
    from mgrpo_jax.core.losses import available_losses

    for agent in ("main", "sub", "single"):
        loss = config[agent].get("loss") if agent in config else None
        if loss and loss not in available_losses():
            raise UsageError(f"{agent}.loss={loss!r}: no loss of that name{_did_you_mean(loss, added)} (the "
                             f"--loss_module files registered {', '.join(added)}; registered: "
                             f"{', '.join(available_losses())})")


# ---- --config: the file, the preset and mode, the overrides ----


def resolve_config_file(value: str) -> str:
    """`value` ("FILE[:ARG]") with FILE found from the current directory or, failing that, from the repository."""
    file, sep, arg = value.partition(":")
    if not file:
        raise UsageError(f"--config={value}: no config file given (e.g. --config={DEFAULT_CONFIG}:local)")
    if os.path.isfile(file):
        return value
    in_repo = os.path.join(REPO, file)
    if not os.path.isabs(file) and os.path.isfile(in_repo):
        return in_repo + sep + arg
    hint = _did_you_mean(file, EXPERIMENT_FILES) or f"; the experiment files are {', '.join(EXPERIMENT_FILES)}"
    raise UsageError(f"--config={value}: no config file {file} (looked in {os.getcwd()} and in the repository "
                     f"{REPO}){hint}")


def load_config(value: str, given: str | None = None):
    """The config of `value` ("FILE[:PRESET[,MODE]]", FILE resolved), as `config_flags` will load it; an unknown
    preset or mode (or any other ValueError of the file's get_config) as a UsageError naming `given` (the value
    as the user wrote it)."""
    file, sep, arg = value.partition(":")
    value = given or value
    loader = importlib.machinery.SourceFileLoader("mgrpo_launch_config", file)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    name, _, mode = arg.partition(",")
    presets = getattr(module, "PRESETS", None)  # the experiment files' convention (mgrpo_jax/presets.py)
    if name and isinstance(presets, dict) and name not in presets:
        raise UsageError(f"--config={value}: unknown preset {name!r}{_did_you_mean(name, presets)} "
                         f"(presets: {', '.join(presets)})")
    if mode and isinstance(presets, dict) and mode not in MODES:
        raise UsageError(f"--config={value}: unknown mode {mode!r}{_did_you_mean(mode, MODES)} "
                         f"(modes: {', '.join(MODES)})")
    try:
        return module.get_config(*([arg] if sep else []))
    except ValueError as e:
        raise UsageError(f"--config={value}: {e}") from None


def _fields(config, prefix: str = ""):
    for key, value in config.items():
        yield prefix + key
        if isinstance(value, config_dict.ConfigDict):
            yield from _fields(value, f"{prefix}{key}.")


def _field_hint(config, section, walked: list[str], part: str) -> str:
    """A did-you-mean for the unknown field `part` of `section` (at the path `walked`): a close name in that
    section, else a field of that name anywhere, else the section's fields."""
    prefix = "".join(f"{p}." for p in walked)
    close = difflib.get_close_matches(part, list(section.keys()), n=1, cutoff=0.7)
    if close:
        return f"; did you mean {prefix + close[0]!r}?"
    if walked and walked[-1] in OPEN_SECTIONS:
        return (f" ({prefix[:-1]} is free-form, and an override can only change a key the preset sets; this one "
                f"sets {', '.join(section.keys()) or 'none'}: add the key in the experiment file)")
    elsewhere = [f for f in _fields(config) if difflib.get_close_matches(part, [f.rsplit(".", 1)[-1]], cutoff=0.7)]
    if elsewhere:
        return f"; did you mean {elsewhere[0]!r}?"
    return f" ({prefix[:-1] + ' has' if walked else 'top-level fields:'} {', '.join(section.keys())})"


def check_override(config, arg: str, field: str) -> None:
    """Raises a UsageError if `field` (of the override `arg`) is not a field of `config`, with a did-you-mean over
    its real fields; field paths with [index] parts are left to config_flags past the first index."""
    try:
        parts = config_path.split(field)
    except ValueError:
        raise UsageError(f"{arg}: cannot read {field!r} as a config field path (e.g. main.loss)") from None
    node, walked = config, []
    for part in parts:
        if not isinstance(part, str):
            return
        if not isinstance(node, config_dict.ConfigDict):
            raise UsageError(f"{arg}: config field {'.'.join(walked)!r} is a {type(node).__name__}, with no field "
                             f"{part!r}")
        if part not in node:
            raise UsageError(f"{arg}: unknown config field {field!r}{_field_hint(config, node, walked, part)}")
        node = node[part]
        walked.append(part)


def _help(argv: list[str], requested: str):
    """absl's help (which exits with status 1), exiting with status 0."""
    try:
        flags.FLAGS([argv[0], "--help" if requested == "-h" else requested])
    except SystemExit as e:
        sys.exit(0 if e.code in (0, 1) else e.code)


def _unknown_flag(error: flags.UnrecognizedFlagError) -> str:
    names = [n for n in flags.FLAGS if not n.startswith("config.")]
    close = difflib.get_close_matches(error.flagname, names, n=1, cutoff=0.6)
    return f"unknown flag --{error.flagname}" + (f"; did you mean --{close[0]}?" if close else "")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with every input error as a UsageError: the config file (resolved), its preset and
    mode, and the override fields are checked here first, so that config_flags, which reports them as tracebacks,
    only sees good ones."""
    argv = list(argv)
    flag_args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    requested = next((a for a in flag_args if a in _HELP), None)
    if requested:
        _help(argv, requested)
    config_at = [i for i, a in enumerate(argv[:len(flag_args) + 1]) if _CONFIG_ARG.match(a)]
    if not config_at:
        argv.insert(1, f"--config={DEFAULT_CONFIG}")
        config_at = [1]
    value = given = None
    for i in config_at:
        match = _CONFIG_ARG.match(argv[i])
        if match.group("value") is not None:
            given = match.group("value")
            value = resolve_config_file(given)
            argv[i] = f"--config={value}"
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            given = argv[i + 1]
            value = argv[i + 1] = resolve_config_file(given)
        else:
            raise UsageError("--config needs a value: --config=FILE[:PRESET[,MODE]]")
    config = load_config(value, given)
    if isinstance(config, config_dict.ConfigDict):
        for arg in flag_args:
            match = _OVERRIDE_ARG.match(arg)
            if match:
                check_override(config, arg, match.group("field"))
    sys.argv[:] = argv  # config_flags reads the overrides from sys.argv
    try:
        rest = flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
        raise UsageError(_unknown_flag(e)) from None
    except flags.Error as e:  # a value of the wrong type, overrides out of order, ...
        raise UsageError(str(e)) from None
    if len(rest) > 1:
        raise UsageError(f"unexpected argument(s) {' '.join(rest[1:])} (flags are --name=value)")
    return rest


def _parse_flags_or_exit(argv: list[str]) -> list[str]:
    try:
        return parse_flags(argv)
    except UsageError as e:
        _exit_usage(e)


def main(argv):
    del argv
    config, workdir, job = _CONFIG.value, _WORKDIR.value, _ROLE.value
    from mgrpo_jax.rl.run import check, check_meshes, execute, log_to_file, log_to_screen

    try:  # on every process, before jax.distributed and before anything is built
        import_loss_modules(_LOSS_MODULES.value, config)
        check(config, workdir, job)
    except UsageError as e:
        _exit_usage(e)

    import jax

    explicit = _COORDINATOR.value is not None
    if _DISTRIBUTED.value or (_DISTRIBUTED.value is None and (
            explicit or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(","))):
        if explicit:
            # CPU processes need a collectives backend to form one mesh (TPUs have their own interconnect).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                                       process_id=_PROCESS_ID.value)
        else:
            jax.distributed.initialize()
    try:  # the meshes need the devices, so only now
        check_meshes(config, job)
    except UsageError as e:
        _exit_usage(e)
    log_to_screen(logging.INFO if jax.process_index() == 0 else logging.ERROR)  # only process 0 logs progress
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every checkpoint file at INFO
    if jax.process_index() == 0:
        log_to_file(workdir, job)
    chosen = ": no accelerator found, set JAX_PLATFORMS to choose" if CHOSEN_PLATFORM else ""
    logging.getLogger("mgrpo_jax").info(
        "preset %s (%d devices, %d processes, %s backend%s), mode %s, benchmark %s, workdir %s", config.preset,
        jax.device_count(), jax.process_count(), jax.default_backend(), chosen, config.mode, config.benchmark,
        workdir)

    from mgrpo_jax.rl.run import AT_ONCE

    _, status = execute(config, workdir, job=job)
    if status == AT_ONCE:  # without waiting for Orbax's threads, whose save was cut off and its files removed
        logging.shutdown()
        os._exit(EXIT_AT_ONCE)
    if status in ("interrupted", "preempted"):
        sys.exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags_or_exit)
