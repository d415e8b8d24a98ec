"""Runs a training script written for HF transformers' `Trainer`, unchanged, with zeropp sharding
its model: the entry point for a script launched the way DeepSpeed users launch theirs.

    torchrun --nproc_per_node 8 -m zpp_compile.launch run_clm.py --deepspeed ds_config.json ...
    accelerate launch -m zpp_compile.launch run_clm.py --deepspeed ds_config.json ...
    python -m zpp_compile.launch [--zeropp-option KEY=VALUE ...] SCRIPT [ARGS ...]
    python -m zpp_compile.launch [--zeropp-option KEY=VALUE ...] -m MODULE [ARGS ...]

What it does, and why (see docs/integrations.md):
- it takes `--deepspeed PATH` (or `--deepspeed=PATH`) out of the script's arguments, so that
  transformers neither turns DeepSpeed on nor imports it, and reads the file as `ZeroppTrainer`
  reads it: the `zero_optimization` keys (the ZeRO++ switches among them) as Config fields, the
  training keys ("auto", or equal) checked against the script's TrainingArguments. Without it, every
  Trainer trains with zeropp's defaults (plain ZeRO-3);
- every `transformers.Trainer` the script makes, of any subclass (TRL's, Seq2SeqTrainer), is made as
  that class with `ZeroppTrainerMixin` in front of it (`_LaunchedTrainers`): the model is sharded
  after the Trainer's own setup and compiled with the zeropp backend;
- `--zeropp-option KEY=VALUE` (repeatable, JSON or Python values) sets a Config field on top;
- the script runs as `python SCRIPT ARGS` would run it (as `__main__`, with its own sys.argv);
  rank 0 says which Config its Trainers use, and warns at the end if the script made none (the
  config was read and never used).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys
from typing import Any, Sequence

from .config import Config, ConfigError, field_setting, read_json_object
from .runtime.job import speaks_for_the_job, warn_for_the_job

PROGRAM = "python -m zpp_compile.launch"


@dataclasses.dataclass
class Launch:
    """What the command line asked for: the script, its arguments, the DeepSpeed config, options."""

    target: str  # a script's path, or a module's name with `module`
    module: bool
    arguments: list[str]  # the script's, without --deepspeed
    deepspeed: dict[str, Any] | None
    deepspeed_path: str | None
    options: dict[str, Any]


def parse(argv: Sequence[str]) -> Launch:
    """The launch `argv` (this module's arguments, then the script and its own) describes."""
    p = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zeropp-option", type=field_setting, action="append", default=[], metavar="KEY=VALUE",
                   help="a zpp.Config field on top of the DeepSpeed config's, e.g. compile_layers_once=true")
    p.add_argument("-m", dest="module", action="store_true", help="run a module (as python -m), not a script")
    p.add_argument("target", metavar="SCRIPT", help="the training script (a module's name with -m)")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = p.parse_args(argv)
    options = dict(args.zeropp_option)
    unknown = sorted(set(options) - {field.name for field in dataclasses.fields(Config)})
    if unknown:
        p.error(f"--zeropp-option {', '.join(unknown)}: not zpp.Config fields; they are: "
                f"{', '.join(field.name for field in dataclasses.fields(Config))}")
    if not args.module and not os.path.isfile(args.target):
        p.error(f"{args.target}: no such script (a module needs -m: {PROGRAM} -m {args.target} ...)")
    arguments, path = _without_deepspeed(p, args.arguments)
    deepspeed = None
    if path is not None:
        try:
            deepspeed = read_json_object(path)
        except (OSError, ConfigError, ValueError) as error:
            p.error(f"--deepspeed {path}: {error}")
    return Launch(args.target, args.module, arguments, deepspeed, path, options)


def _without_deepspeed(p: argparse.ArgumentParser, arguments: list[str]) -> tuple[list[str], str | None]:
    """The script's arguments less `--deepspeed PATH` / `--deepspeed=PATH`, and PATH (None without)."""
    kept, path, items = [], None, iter(arguments)
    for item in items:
        if item == "--deepspeed" or item.startswith("--deepspeed="):
            if path is not None:
                p.error("--deepspeed is given twice in the script's arguments")
            path = item.partition("=")[2] if "=" in item else next(items, None)
            if not path:
                p.error("--deepspeed needs the DeepSpeed config's path")
        else:
            kept.append(item)
    return kept, path


def _plain_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """What `object.__new__` does for a class with an `__init__` of its own: the arguments are `__init__`'s."""
    return object.__new__(cls)


class _LaunchedTrainers:
    """Makes every `transformers.Trainer` of this process a zeropp one for `launch`: Trainer's
    `__new__` returns an instance of the class the script asked for with `ZeroppTrainerMixin` in
    front (one such class per Trainer class, made at its first use). A class that has the mixin
    already (`ZeroppTrainer`, the script's own) is made as it is."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.made = 0  # Trainers made: none at the end means the config was never used
        self._classes: dict[type, type] = {}
        self._replaced: Any = None  # Trainer's own __new__, if it has one

    def install(self) -> None:
        import transformers

        from .integrations.transformers import ZeroppTrainerMixin

        trainers = self

        def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
            if not issubclass(cls, ZeroppTrainerMixin):
                cls = trainers.zeropp_class(cls)
            trainers.made += 1
            return object.__new__(cls)

        self._replaced = transformers.Trainer.__dict__.get("__new__")
        transformers.Trainer.__new__ = __new__

    def uninstall(self) -> None:
        """Trainers are made as the script's classes again (after the script, in a process that goes on)."""
        import transformers

        # Deleting an assigned __new__ would leave CPython calling object.__new__ with the constructor's
        # arguments, which it refuses ("takes exactly one argument"): a plain one takes its place.
        transformers.Trainer.__new__ = self._replaced if self._replaced is not None else _plain_new

    def zeropp_class(self, trainer_class: type) -> type:
        from .integrations.transformers import ZeroppTrainerMixin, trainer_config

        if trainer_class not in self._classes:
            launch = self.launch

            def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:
                ZeroppTrainerMixin.__init__(trainer, *args, zeropp=launch.deepspeed, **kwargs)

            def _zeropp_config(trainer: Any, value: Any) -> Config:
                config = trainer_config(value, trainer.args)
                config = dataclasses.replace(config, **launch.options) if launch.options else config
                if speaks_for_the_job():
                    print(f"zeropp: {type(trainer).__name__} trains its model sharded by zeropp, "
                          f"{_described(config, launch)}", file=sys.stderr, flush=True)
                return config

            self._classes[trainer_class] = type(trainer_class.__name__, (ZeroppTrainerMixin, trainer_class), {
                "__init__": __init__, "_zeropp_config": _zeropp_config, "__module__": trainer_class.__module__,
                "__qualname__": trainer_class.__qualname__})
        return self._classes[trainer_class]


def _described(config: Config, launch: Launch) -> str:
    """The Config's fields that differ from the defaults, and where they came from."""
    changed = [f"{field.name}={getattr(config, field.name)!r}" for field in dataclasses.fields(Config)
               if getattr(config, field.name) != getattr(Config(), field.name)]
    source = f"from {launch.deepspeed_path}" if launch.deepspeed_path else "zeropp's defaults"
    return f"Config {source}" + (f": {', '.join(changed)}" if changed else " (plain ZeRO-3)")


def main(argv: Sequence[str] | None = None) -> None:
    launch = parse(sys.argv[1:] if argv is None else argv)
    trainers = _LaunchedTrainers(launch)
    trainers.install()
    saved_argv = sys.argv
    sys.argv = [launch.target, *launch.arguments]
    try:
        if launch.module:
            runpy.run_module(launch.target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(launch.target)))  # as python SCRIPT does
            runpy.run_path(launch.target, run_name="__main__")
    finally:
        sys.argv = saved_argv
        trainers.uninstall()
    if not trainers.made:
        warn_for_the_job(f"zeropp: {launch.target} made no transformers.Trainer, so nothing was sharded by zeropp"
                      + (f" and {launch.deepspeed_path} was never used" if launch.deepspeed_path else "")
                      + "; a script with its own loop shards its model itself: zpp.shard(model, "
                        "zpp.Config.load(\"ds_config.json\"))", stacklevel=1)


if __name__ == "__main__":
    main()
