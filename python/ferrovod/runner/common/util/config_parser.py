"""``ferrovodrun --config-file``: Horovod's YAML configuration file, and the variables the
launcher's flags give the workers (Horovod's ``horovod.runner.common.util.config_parser``).

The file holds Horovod's sections::

    params:          {fusion_threshold_mb, cycle_time_ms, cache_capacity, hierarchical_allreduce,
                      hierarchical_allgather, torus_allreduce}
    autotune:        {enabled, log_file, warmup_samples, steps_per_sample, bayes_opt_max_samples,
                      gaussian_process_noise}
    timeline:        {filename, mark_cycles}
    stall_check:     {enabled, warning_time_seconds, shutdown_time_seconds}
    library_options: {mpi_threads_disable, num_nccl_streams, thread_affinity, gloo_timeout_seconds}
    logging:         {level, with_timestamp}
    controller:      gloo | mpi

and, beyond Horovod, ``elastic: {min_np, max_np, slots_per_host, elastic_timeout, reset_limit,
blacklist_cooldown_range: [LO, HI], host_discovery_script}``, so that a Kubernetes manifest
can keep the whole launch in one ConfigMap. A flag given on the command line wins over the
file, wherever it stands (as in Horovod). Every value is checked as its flag would be, and a
key the file does not know is an error naming it (Horovod ignores it silently, so a typo used
to leave a setting unapplied without a word).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Mapping, MutableMapping, Optional, Tuple

from ...worker_env import tunable_env

__all__ = ["ConfigError", "read_config_file", "set_args_from_config", "set_env_from_args"]


class ConfigError(ValueError):
    """The configuration file cannot be read or holds something the launcher refuses."""


def _negate(value: Any) -> Any:
    return not value


# section -> key -> (argparse dest, conversion from the file's value to the dest's)
_SECTIONS: Dict[str, Dict[str, Tuple[str, Optional[Callable[[Any], Any]]]]] = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", None),
        "cycle_time_ms": ("cycle_time_ms", None),
        "cache_capacity": ("cache_capacity", None),
        "hierarchical_allreduce": ("hierarchical_allreduce", None),
        "hierarchical_allgather": ("hierarchical_allgather", None),
        "torus_allreduce": ("torus_allreduce", None),
    },
    "autotune": {
        "enabled": ("autotune", None),
        "log_file": ("autotune_log_file", None),
        "warmup_samples": ("autotune_warmup_samples", None),
        "steps_per_sample": ("autotune_steps_per_sample", None),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", None),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", None),
    },
    "timeline": {
        "filename": ("timeline_filename", None),
        "mark_cycles": ("timeline_mark_cycles", None),
    },
    "stall_check": {
        "enabled": ("no_stall_check", _negate),
        "warning_time_seconds": ("stall_check_warning_time_seconds", None),
        "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", None),
    },
    "library_options": {
        "mpi_threads_disable": ("mpi_threads_disable", None),
        "num_nccl_streams": ("num_nccl_streams", None),
        "thread_affinity": ("thread_affinity", None),
        "gloo_timeout_seconds": ("gloo_timeout_seconds", None),
    },
    "logging": {
        "level": ("log_level", None),
        "with_timestamp": ("log_with_timestamp", None),
    },
    "elastic": {
        "min_np": ("min_num_proc", None),
        "max_np": ("max_num_proc", None),
        "slots_per_host": ("slots", None),
        "elastic_timeout": ("elastic_timeout", None),
        "reset_limit": ("reset_limit", None),
        "blacklist_cooldown_range": ("cooldown_range", None),
        "host_discovery_script": ("host_discovery_script", None),
    },
}
_CONTROLLERS = {"gloo": "use_gloo", "mpi": "use_mpi"}


def read_config_file(path: str) -> Dict[str, Any]:
    """The mapping a YAML configuration file holds (an empty file is an empty mapping)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"--config-file {path}: reading it needs PyYAML "
                          "(pip install pyyaml)") from None
    try:
        with open(path, "rb") as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--config-file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config-file {path} is not valid YAML: {exc}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(f"--config-file {path} must hold a mapping of sections, not "
                          f"{type(config).__name__}")
    return config


def _checked(parser: argparse.ArgumentParser, dest: str, where: str, value: Any) -> Any:
    """A file's ``value`` for ``dest``, checked and converted as the command line's flag would
    be (``where`` names it in errors)."""
    action = next(a for a in parser._actions if a.dest == dest)  # noqa: SLF001 - argparse's own list
    flag = max(action.option_strings, key=len)
    if action.const is not None and action.nargs == 0:  # an on/off flag
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false (as {flag}), got {value!r}")
        return value
    if isinstance(value, (dict, bool)) or (isinstance(value, list) and not action.nargs):
        raise ConfigError(f"{where}: {value!r} is not a value {flag} takes")
    values = value if isinstance(value, list) else [value]
    if action.nargs not in (None, 1) and len(values) != action.nargs:
        raise ConfigError(f"{where} takes {action.nargs} values (as {flag}), got {value!r}")
    out = []
    for item in values:
        try:
            out.append(action.type(str(item)) if action.type else str(item))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ConfigError(f"{where} (as {flag}): {exc}") from None
    return out if isinstance(value, list) else out[0]


def set_args_from_config(args: argparse.Namespace, config: Mapping[str, Any],
                         override_args: Optional[set] = None,
                         parser: Optional[argparse.ArgumentParser] = None,
                         source: str = "the config file") -> None:
    """Applies ``config`` (a parsed file) to ``args``, except the dests in ``override_args``
    (default: every dest the command line gave, i.e. not None). Raises :class:`ConfigError`
    naming the key of anything unknown or out of range."""
    if parser is None:
        from ...flags import build_parser

        parser = build_parser()
    given = set(override_args) if override_args is not None else {
        dest for section in _SECTIONS.values() for dest, _ in section.values()
        if getattr(args, dest, None) is not None}
    for name, body in config.items():
        if name == "controller":
            if str(body).lower() not in _CONTROLLERS:
                raise ConfigError(f"{source}: controller must be gloo or mpi, got {body!r}")
            if not args.use_gloo and not args.use_mpi:
                setattr(args, _CONTROLLERS[str(body).lower()], True)
            continue
        keys = _SECTIONS.get(name)
        if keys is None:
            raise ConfigError(f"{source}: unknown section {name!r} (known: "
                              f"{', '.join(sorted([*_SECTIONS, 'controller']))})")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section {name!r} must be a mapping, got {body!r}")
        for key, value in body.items():
            if key not in keys:
                raise ConfigError(f"{source}: unknown key {name}.{key} (known in {name}: "
                                  f"{', '.join(keys)})")
            dest, convert = keys[key]
            if value is None or dest in given:
                continue
            checked = _checked(parser, dest, f"{source}: {name}.{key}", value)
            setattr(args, dest, convert(checked) if convert else checked)


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reads ``args.config_file``, when given, into ``args`` (flags given win)."""
    path = getattr(args, "config_file", None)
    if path:
        set_args_from_config(args, read_config_file(path), parser=parser,
                             source=f"--config-file {path}")


def set_env_from_args(env: MutableMapping[str, str], args: argparse.Namespace) -> MutableMapping[str, str]:
    """Adds to ``env`` the variables the flags in ``args`` give every worker (only flags that
    were given, as horovodrun does); returns ``env``."""
    env.update(tunable_env(args, env))
    return env
