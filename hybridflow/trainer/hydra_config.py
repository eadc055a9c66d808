"""veRL's Hydra command line: ``--config-path DIR --config-name NAME`` (or ``--config-path=DIR --config-name=NAME``).

veRL's scripts start ``python3 -m verl.trainer.main_ppo --config-path=config --config-name=my_grpo key=value ...``;
``hybridflow train`` (and ``sft``) take the same two flags. The named YAML is composed as Hydra composes it, with
OmegaConf (no Hydra dependency):

* its ``defaults:`` list is followed in order: ``- name`` (another file, at this file's package, ``name@pkg`` at
  ``pkg``), ``- group: option`` / ``- group@pkg: option`` (``group/option.yaml`` at the package ``group`` or ``pkg``;
  ``optional`` entries may be missing, ``null`` options are skipped, a later ``override group: option`` changes the
  choice), ``_self_`` marks where the file's own keys go (last when it is not listed), nested defaults recurse;
* files are looked up beside the including file, in ``--config-path``, then in ``hydra.searchpath``'s ``file://``
  directories;
* veRL's own top configs (``ppo_trainer``, ``sft_trainer``, ... : what a user's YAML names in its defaults to start
  from veRL's defaults) are not needed as files: they stand for hybridflow's defaults, which carry the same keys;
  ``*megatron*`` ones are refused with the reason;
* ``${...}`` interpolations are resolved as OmegaConf does, over hybridflow's defaults plus the composed files.

The result is the list of dotted ``key=value`` settings the user's files made; they go in front of the command
line's overrides, so each key is taken, renamed or refused exactly as on the command line (``--dry-run`` lists them).
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.trainer.config import ConfigError

# veRL's top-level config names -> what stands for them here: hybridflow's defaults of that command
VERL_BASE_CONFIGS = {
    "ppo_trainer": "train",
    "_generated_ppo_trainer": "train",
    "sft_trainer": "sft",
    "sft_trainer_engine": "sft",
}
_MEGATRON = "Megatron-LM training is not supported: hybridflow trains with FSDP2; start from ppo_trainer instead"


def _stem(name: str) -> str:
    name = name[:-5] if name.endswith(".yaml") else name[:-4] if name.endswith(".yml") else name
    return name.strip("/")


def _join(package: str, child: str) -> str:
    return ".".join(p for p in (package, child) if p)


class _Composer:
    def __init__(self, search: list[str], command: str):
        self.search = list(search)
        self.command = command
        self.layers: list[tuple[str, dict, str]] = []  # (package, the file's own keys, file)
        self.overrides: dict[str, Any] = {}  # group -> option, from `override` entries
        self.stack: list[str] = []

    def find(self, rel: str, here: str | None) -> str | None:
        for root in ([here] if here else []) + self.search:
            for ext in (".yaml", ".yml"):
                path = os.path.join(root, _stem(rel) + ext)
                if os.path.isfile(path):
                    return path
        return None

    def include(self, rel: str, package: str, here: str | None, *, optional: bool = False, where: str = "") -> None:
        path = self.find(rel, here)
        if path is None:
            stem = os.path.basename(_stem(rel))
            if stem in VERL_BASE_CONFIGS and "/" not in _stem(rel):
                if VERL_BASE_CONFIGS[stem] != self.command:
                    raise ConfigError(
                        f"{where or 'the command line'}: config '{stem}' is veRL's {VERL_BASE_CONFIGS[stem]} config; "
                        f"it does not start a `hybridflow {self.command}` run"
                    )
                return  # hybridflow's defaults: the base every composition starts from
            if "megatron" in stem:
                raise ConfigError(f"{where or 'the command line'}: config '{stem}': {_MEGATRON}")
            if optional:
                return
            searched = [d for d in ([here] if here else []) + self.search]
            raise ConfigError(
                f"{where or 'the command line'}: config '{rel}' not found (looked for {_stem(rel)}.yaml in "
                f"{', '.join(searched) or 'no directory'}); give --config-path DIR with the file in it"
            )
        real = os.path.realpath(path)
        if real in self.stack:
            raise ConfigError(f"{path}: its defaults list includes itself (through {' -> '.join(self.stack)})")
        self.stack.append(real)
        try:
            self._compose_file(path, package)
        finally:
            self.stack.pop()

    def _compose_file(self, path: str, package: str) -> None:
        try:  # OmegaConf's YAML loader, as Hydra reads files: 3e-6 is a float there, ${...} stays unresolved
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
        except (yaml.YAMLError, OmegaConfBaseException) as err:
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config file must hold a mapping of keys, not {type(raw).__name__}")
        here = os.path.dirname(path)
        defaults = raw.pop("defaults", None) or []
        hydra = raw.pop("hydra", None) or {}
        if not isinstance(defaults, list):
            raise ConfigError(f"{path}: 'defaults' must be a list")
        for entry in (hydra.get("searchpath") or []) if isinstance(hydra, dict) else []:
            # file://DIR is relative to the working directory, as in Hydra; pkg:// paths name Python packages
            # (veRL's own config tree): the names they hold are covered by VERL_BASE_CONFIGS
            if isinstance(entry, str) and entry.startswith("file://"):
                self.search.append(os.path.abspath(entry[len("file://"):]))
        unknown_hydra = set(hydra) - {"searchpath"} if isinstance(hydra, dict) else set()
        if unknown_hydra:
            raise ConfigError(
                f"{path}: hydra.{sorted(unknown_hydra)[0]}: Hydra's own run settings are not used by hybridflow "
                "(the run folder is trainer.default_local_dir); remove the hydra section but its searchpath"
            )
        if "_self_" not in defaults:
            defaults = [*defaults, "_self_"]
        # `override group: option` entries change the choice of groups that configs earlier in the list include
        for entry in defaults:
            if isinstance(entry, dict) and len(entry) == 1 and str(next(iter(entry))).split()[0] == "override":
                self.overrides[str(next(iter(entry))).split()[-1].partition("@")[0].strip("/")] = next(iter(entry.values()))
        for entry in defaults:
            if entry == "_self_":
                self.layers.append((package, raw, path))
            elif isinstance(entry, str):
                name, _, pkg = entry.partition("@")
                self.include(name, _join(package, pkg) if pkg != "_global_" else "", here, where=path)
            elif isinstance(entry, dict) and len(entry) == 1:
                (key, option), = entry.items()
                words = str(key).split()
                flags, spec = set(words[:-1]), words[-1]
                if flags - {"optional", "override"}:
                    raise ConfigError(f"{path}: defaults entry {entry!r}: only 'optional' and 'override' may prefix a group")
                group, _, pkg = spec.partition("@")
                if "override" in flags:
                    continue  # recorded before the list was walked
                option = self.overrides.get(group.strip("/"), option)
                if option is None:
                    continue
                if pkg == "_global_":
                    target = ""
                elif pkg:
                    target = _join(package, pkg)
                else:
                    target = _join(package, os.path.basename(group.strip("/")).replace("/", "."))
                for choice in option if isinstance(option, list) else [option]:
                    self.include(f"{group}/{choice}", target, here, optional="optional" in flags, where=path)
            else:
                raise ConfigError(f"{path}: defaults entry {entry!r} is neither a name nor a 'group: option' pair")


def _leaves(node: Any, prefix: str) -> list[str]:
    """The dotted keys a file sets (an empty mapping is a leaf: `override_config: {}` sets the whole dict)."""
    if isinstance(node, dict) and node:
        out: list[str] = []
        for k, v in node.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [prefix] if prefix else []


def _nest(package: str, node: dict) -> dict:
    for part in reversed([p for p in package.split(".") if p]):
        node = {part: node}
    return node


def hydra_overrides(config_path: str | None, config_name: str, base: dict, command: str = "train") -> list[str]:
    """The dotted ``key=value`` settings of the composed config `config_name` (see the module docstring).

    base: the command's defaults as a plain dict (the interpolations' last resort). Raises ConfigError naming the
    file and the entry for a missing file, a bad defaults entry or an interpolation that does not resolve.
    """
    # veRL's `--config-path=config` with `-m verl.trainer.main_ppo` is relative to main_ppo.py: veRL's own config
    # folder, absent here; its top configs need no file (VERL_BASE_CONFIGS), any other name is then not found
    search = [os.path.abspath(os.path.expanduser(config_path))] if config_path else []
    missing_dir = bool(search) and not os.path.isdir(search[0])
    composer = _Composer([] if missing_dir else search, command)
    try:
        composer.include(config_name, "", None, where="--config-name")
    except ConfigError as err:
        if missing_dir and "not found" in str(err):
            raise ConfigError(f"--config-path {config_path}: no such directory (and {err})") from None
        raise
    if not composer.layers:
        return []  # only veRL's base config: hybridflow's defaults as they are
    try:
        merged = OmegaConf.merge(OmegaConf.create(base), *(OmegaConf.create(_nest(p, raw)) for p, raw, _ in composer.layers))
    except OmegaConfBaseException as err:
        raise ConfigError(f"--config-name {config_name}: the files do not merge: {err}") from None
    out: list[str] = []
    seen: set[str] = set()
    for package, raw, path in composer.layers:
        for key in _leaves(raw, ""):
            full = _join(package, key)
            try:
                value = OmegaConf.select(merged, full, throw_on_missing=True)
                if OmegaConf.is_config(value):
                    value = OmegaConf.to_container(value, resolve=True)
            except OmegaConfBaseException as err:
                raise ConfigError(f"{path}: {full}: {err}") from None
            if full in seen:  # a later file set it again: its value (merged above) is the one kept
                out = [o for o in out if not o.startswith(full + "=")]
            seen.add(full)
            out.append(f"{full}={_yaml_value(value)}")
    return out


def _yaml_value(value: Any) -> str:
    """`value` as the override parser reads it back (YAML flow style: PyYAML writes floats it can load)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9)
    return text[: -len("\n...\n")] if text.endswith("\n...\n") else text.rstrip("\n")


def with_config_file(config_path: str | None, config_name: str | None, overrides: list[str],
                     command: str = "train") -> list[str]:
    """The command line's overrides behind the settings of `--config-name` (composed from `--config-path`)."""
    if config_name is None:
        if config_path is not None:
            raise ConfigError(f"--config-path {config_path} needs --config-name NAME (the YAML file to start from)")
        return list(overrides)
    if command == "sft":
        from hybridflow.trainer.sft_trainer import SFTConfig

        base = OmegaConf.to_container(OmegaConf.structured(SFTConfig), resolve=True)
    else:
        from hybridflow.trainer.config import HybridFlowConfig, to_dict

        base = to_dict(HybridFlowConfig())
    return hydra_overrides(config_path, config_name, base, command) + list(overrides)


def split_hydra_flags(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(--config-path, --config-name, the other arguments) from veRL-style arguments (also -cp / -cn, `=` or a space)."""
    path = name = None
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in ("--config-path", "-cp", "--config-name", "-cn"):
            if not eq:
                value = next(it, None)
                if value is None:
                    raise ConfigError(f"{flag} needs a value")
            if flag in ("--config-path", "-cp"):
                path = value
            else:
                name = value
        else:
            rest.append(arg)
    return path, name, rest
