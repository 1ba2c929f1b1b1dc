"""Presets: TOML files loaded, overridden with --set, validated and expanded into cells."""

from __future__ import annotations

import difflib
import itertools
import math
import os
import posixpath
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from runners.cells import params_label
from runners.determinism import PROFILES
from runners.record import record_name_problem
from runners.templates import TemplateError
from runners.templates import template_fields as _fields


def shipped_dir() -> Path:
    """The shipped presets: runners/shipped_presets/ in an installed wheel (setup.py puts them
    there), else presets/ at the top of the checkout this package runs from."""
    here = Path(__file__).resolve().parent
    packaged = here / "shipped_presets"
    return packaged if packaged.is_dir() else here.parent / "presets"


SHIPPED_DIR = shipped_dir()

Scalar = (str, int, float, bool)

# section -> key -> (expected type(s), required, default)
SCHEMA: dict[str, dict[str, tuple[Any, bool, Any]]] = {
    "preset": {
        "name": (str, True, None),
        "kind": (str, True, None),
        "description": (str, False, ""),
    },
    "target": {
        "host": (str, False, "local"),
        "workdir": (str, False, "."),
        "runs": (str, False, ".tracedeck/runs"),
        # "" (the default): the host's lock (runners.config); a path names another on purpose
        "lock": (str, False, ""),
        "python": (str, False, ""),
        "connect_timeout_s": ((int, float), False, 10.0),
        "keepalive_s": ((int, float), False, 5.0),
        "reconnect_attempts": (int, False, 5),
        # "" (the default): the detached launcher on the host; "slurm": the cells go to the
        # Slurm cluster whose login node `host` is, as one job array (runners/launchers/slurm)
        "scheduler": (str, False, ""),
        "partition": (str, False, ""),
        "account": (str, False, ""),
        "gres": (str, False, ""),  # e.g. "gpu:1" (per cell)
        "time_limit": (str, False, ""),  # Slurm's forms: "30", "1:30:00", "2-00:00:00"
        "sbatch": (list, False, []),  # extra #SBATCH lines, e.g. ["--qos=high"]
    },
    # How a run spreads over several hosts (`--target a,b` or a [fleets.NAME] of the config).
    "fleet": {
        # a host whose lock is held: "skip" it (its cells go to the others) or "wait" for it
        "busy": (str, False, "skip"),
        # the cells of a lost host run again on the others
        "requeue": (bool, False, True),
        # cells the kind compares with each other (B3.67: a seed's prefill and decode) run on
        # one host
        "together": (bool, False, True),
    },
    "determinism": {
        "profile": (str, False, "none"),
        "env": (dict, False, {}),
    },
    "engine": {
        "command": (str, True, None),
        "setup": (list, False, []),
        "ship_reference": (bool, False, False),
        "env": (dict, False, {}),
        # Prints the engine's version or commit (first line of stdout), run once on the target
        # in its workdir before the run starts; recorded and shown by `tracedeck diff`.
        "version_command": (str, False, ""),
    },
    "matrix": {},  # free keys, each a non-empty list of scalars
    "vars": {},  # free keys, each a scalar: operator paths and constants for the templates
    "artifacts": {
        "dir": (str, False, "{date}/{name}"),
        "fetch": (list, False, []),
    },
    "traces": {
        "follow": (list, False, []),
    },
    # Where a kind that can judge on the target (runners.kind.HostJudging) judges: "auto" there
    # when its python has what the judging needs, else here (and the run says why); "host"
    # there or not at all; "console" here, fetching everything.
    "judge": {
        "on": (str, False, "auto"),
        "python": (str, False, ""),  # "" is the run's python ([target] python)
        "fetch_held": (bool, False, False),  # bring home what was judged there, too
    },
}
JUDGE_ON = ("auto", "host", "console")
LOCK_RULE = "must be an absolute path (every console must take the same lock)"
# A kind adds its own sections (runners.kind.Kind.sections), checked for its presets only.
REQUIRED_SECTIONS = ("preset", "engine", "matrix")

# Placeholders every template may use besides the matrix keys.
BUILTIN_PLACEHOLDERS = ("python", "out", "run_dir", "workdir", "cell", "date", "run_id", "name")
# Placeholders that are absolute paths on the target: never part of a fetch or trace path.
ABSOLUTE_PLACEHOLDERS = frozenset({"python", "out", "run_dir", "workdir"})
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# More cells than this is a typo in a matrix (a product grows fast), not a run: refused up front.
MAX_CELLS = 10_000
NAME_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class PresetError(Exception):
    """A preset that cannot be used; the message names the file and the key path."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")


@dataclass(frozen=True, slots=True)
class Cell:
    index: int
    params: dict[str, Any]

    def label(self) -> str:
        return params_label(self.params)


@dataclass(slots=True)
class Preset:
    source: str
    data: dict[str, Any]
    overrides: list[str] = field(default_factory=list)
    # What the operator asked for explicitly on the command line (e.g. "loose_thresholds").
    options: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return self.data["preset"]["name"]

    @property
    def kind(self) -> str:
        return self.data["preset"]["kind"]

    @property
    def description(self) -> str:
        return self.data["preset"]["description"]

    def section(self, name: str) -> dict[str, Any]:
        return self.data[name]

    @property
    def matrix(self) -> dict[str, list[Any]]:
        return self.data["matrix"]

    @property
    def vars(self) -> dict[str, Any]:
        return self.data["vars"]

    def cells(self) -> list[Cell]:
        keys = list(self.matrix)
        combos = itertools.product(*(self.matrix[k] for k in keys))
        return [Cell(i, dict(zip(keys, combo, strict=True))) for i, combo in enumerate(combos)]

    def cell_count(self) -> int:
        n = 1
        for values in self.matrix.values():
            n *= len(values)
        return n


def parse_value(raw: str) -> Any:
    """A --set value in TOML value syntax; a bare word that is not TOML is taken as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_override(data: dict[str, Any], assignment: str, source: str) -> None:
    if "=" not in assignment:
        raise PresetError(source, assignment, "--set needs key.path=VALUE (e.g. matrix.seed=[0])")
    path, raw = assignment.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise PresetError(source, path, "--set key path must be section.key (e.g. target.host)")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise PresetError(source, path, f"{key} is not a table")
    node[keys[-1]] = parse_value(raw.strip())


def _type_name(expected: Any) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


def _check_type(source: str, key: str, value: Any, expected: Any) -> None:
    # bool is an int in Python; a number field must not accept true/false.
    wanted = expected if isinstance(expected, tuple) else (expected,)
    ok = isinstance(value, wanted) and not (isinstance(value, bool) and bool not in wanted)
    if not ok:
        raise PresetError(
            source, key, f"expected {_type_name(expected)}, got {type(value).__name__} {value!r}"
        )


def template_fields(template: str, source: str, key: str) -> list[str]:
    try:
        return _fields(template)
    except TemplateError as exc:
        raise PresetError(source, key, str(exc)) from None


class KindRules(Protocol):
    """What loading a preset needs of its run kind (a runners.kind.Kind has all of it)."""

    name: str
    sections: dict[str, dict[str, tuple[Any, bool, Any]]]
    host_judging: Any

    def check(self, data: dict[str, Any], source: str, options: frozenset[str]) -> None: ...

    def matrix_keys_read(self, data: dict[str, Any]) -> set[str]: ...


def validate(
    data: dict[str, Any],
    source: str,
    options: frozenset[str] = frozenset(),
    *,
    kinds: Mapping[str, KindRules],
) -> dict[str, Any]:
    """Check every section and key, fill defaults, run the kind's checks; returns the data.

    kinds: the registry (runners.kinds.all_kinds()), passed in: presets imports no kind.
    """
    kind = _kind_of(data, source, kinds)
    schema = {**SCHEMA, **kind.sections}
    for section in data:
        if section not in schema:
            owners = [k.name for k in kinds.values() if section in k.sections]
            why = (
                f"a section of {' and '.join(owners)} presets, not of kind {kind.name!r}"
                if owners
                else f"unknown section; known: {', '.join(schema)}"
            )
            raise PresetError(source, section, why)
    for section in REQUIRED_SECTIONS:
        if section not in data:
            raise PresetError(source, section, "missing section")
    out: dict[str, Any] = {}
    for section, keys in schema.items():
        given = data.get(section, {})
        if not isinstance(given, dict):
            raise PresetError(source, section, "must be a table")
        if section == "matrix":
            out[section] = _validate_matrix(given, source)
            continue
        if section == "vars":
            out[section] = _validate_vars(given, source, set(out.get("matrix", {})))
            continue
        out[section] = _validate_section(section, keys, given, source)

    if out["determinism"]["profile"] not in PROFILES:
        raise PresetError(source, "determinism.profile", f"must be one of {', '.join(PROFILES)}")
    for table in ("determinism.env", "engine.env"):
        sec, key = table.split(".")
        for name, value in out[sec][key].items():
            if name.upper().startswith("TRACEDECK_"):
                raise PresetError(
                    source,
                    f"{table}.{name}",
                    "TRACEDECK_* names are tracedeck's own (the run finds its processes by "
                    "TRACEDECK_RUN_ID and TRACEDECK_CELL, which every cell gets): use another name",
                )
            if not ENV_NAME.fullmatch(name):
                raise PresetError(
                    source,
                    f"{table}.{name}",
                    "not an environment name a shell can export: ASCII letters, digits and _, "
                    "not starting with a digit",
                )
            _check_type(source, f"{table}.{name}", value, (str, int, float))
    for table in ("engine.setup", "artifacts.fetch", "traces.follow"):
        sec, key = table.split(".")
        for i, item in enumerate(out[sec][key]):
            _check_type(source, f"{table}[{i}]", item, str)

    known = set(out["matrix"]) | set(out["vars"]) | set(BUILTIN_PLACEHOLDERS)
    _check_placeholders(source, "engine.command", out["engine"]["command"], known)
    _check_placeholders(
        source,
        "engine.version_command",
        out["engine"]["version_command"],
        set(out["vars"]) | {"python", "workdir"},
    )
    # The run's local directory is named before any cell exists: run-wide names only.
    _check_placeholders(source, "artifacts.dir", out["artifacts"]["dir"], {"date", "name"})
    _check_relative(source, "artifacts.dir", out["artifacts"]["dir"])
    if posixpath.normpath(out["artifacts"]["dir"]) == ".":
        raise PresetError(
            source,
            "artifacts.dir",
            f"{out['artifacts']['dir']!r} is the out directory itself: each run needs a "
            'directory of its own under it (e.g. "{date}/{name}")',
        )
    for sec, key in (("engine", "setup"), ("artifacts", "fetch")):
        for i, item in enumerate(out[sec][key]):
            _check_placeholders(source, f"{sec}.{key}[{i}]", item, known)
    for i, item in enumerate(out["artifacts"]["fetch"]):
        _check_relative(source, f"artifacts.fetch[{i}]", item)
    # A trace path under the run's artifacts dir: per cell when a matrix key or {cell} shapes it.
    trace_names = set(out["vars"]) | set(out["matrix"]) | {"date", "run_id", "cell"}
    for i, item in enumerate(out["traces"]["follow"]):
        _check_placeholders(source, f"traces.follow[{i}]", item, trace_names)
        _check_trace_path(source, f"traces.follow[{i}]", item)
        _check_relative(source, f"traces.follow[{i}]", item)
    for sec in ("determinism", "engine"):
        for name, value in out[sec]["env"].items():
            _check_placeholders(source, f"{sec}.env.{name}", str(value), known)
    _check_run_settings(out, source)
    _check_no_nul(out, source, "")
    _check_rendered_paths(out, source)
    _check_judge(out["judge"], source, kind)
    kind.check(out, source, options)
    return out


def _placeholders_in(value: Any) -> set[str]:
    """Every {name} any string inside `value` (tables and lists walked) uses as a template."""
    if isinstance(value, str):
        try:
            return set(_fields(value))
        except TemplateError:
            return set()  # not a template (or a bad one, reported where it is checked)
    if isinstance(value, dict):
        return set().union(*(_placeholders_in(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_placeholders_in(v) for v in value))
    return set()


def check_new_matrix_keys(
    out: dict[str, Any], source: str, keys: set[str], kinds: Mapping[str, KindRules]
) -> None:
    """A matrix key an override adds that no template, artifact path or the kind reads is a
    typo (`matrix.seeds` for `matrix.seed`): it would change nothing and leave the whole matrix
    to run. (The preset file's own keys may be labels; an override's new key is never one.)"""
    kind = _kind_of(out, source, kinds)
    used = kind.matrix_keys_read(out) | _placeholders_in(
        {section: value for section, value in out.items() if section != "matrix"}
    )
    for key in sorted(keys):
        if key in used:
            continue
        known = sorted(k for k in used | set(out["matrix"]) - keys if k not in BUILTIN_PLACEHOLDERS)
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        hint = f"did you mean matrix.{near[0]}? " if near else ""
        raise PresetError(
            source,
            f"matrix.{key}",
            f"not a key of this preset's matrix, and no template, artifact path or the "
            f"{kind.name} kind uses it, so it would change nothing; {hint}known keys: "
            f"{', '.join(known) or '(none)'}",
        )


def _check_no_nul(value: Any, source: str, key: str) -> None:
    """No string anywhere in a preset holds a NUL: no command, argument, environment value or
    path can carry one (a shell drops it: the engine would run with another value than the
    plan says)."""
    if isinstance(value, str) and "\0" in value:
        raise PresetError(source, key, f"{value!r} holds a NUL byte; remove it")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_no_nul(v, source, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_no_nul(v, source, f"{key}[{i}]")


def _check_rendered_paths(out: dict[str, Any], source: str) -> None:
    """Every cell's fetch and trace paths, rendered with its values, stay inside the run."""
    from runners.templates import render_plain

    keys = list(out["matrix"])
    sample = {"date": "2000-01-01", "run_id": "run", **out["vars"]}
    combos = itertools.product(*(out["matrix"][k] for k in keys))
    for index, combo in enumerate(combos):
        values = {**sample, **dict(zip(keys, combo, strict=True)), "cell": index}
        for section, key in (("artifacts", "fetch"), ("traces", "follow")):
            for i, template in enumerate(out[section][key]):
                known = set(values)
                used = set(template_fields(template, source, f"{section}.{key}[{i}]"))
                if used & ABSOLUTE_PLACEHOLDERS:
                    raise PresetError(
                        source,
                        f"{section}.{key}[{i}]",
                        f"{template!r}: {{{min(used & ABSOLUTE_PLACEHOLDERS)}}} is an absolute "
                        "path; these paths are relative to the run's artifacts directory ({out}) "
                        "already: drop it",
                    )
                if not used <= known:
                    continue  # an unknown placeholder is reported where it is checked
                rel = render_plain(template, values)
                problem = relative_problem(rel)
                if problem is None and section == "traces":
                    problem = _rendered_trace_problem(rel)
                if problem is None and section == "artifacts":
                    problem = record_name_problem(rel)
                if problem is not None:
                    label = " ".join(f"{k}={v}" for k, v in zip(keys, combo, strict=True))
                    raise PresetError(
                        source,
                        f"{section}.{key}[{i}]",
                        f"{rel!r} (cell {index + 1}: {label}) {problem}",
                    )


def _check_judge(judge: dict[str, Any], source: str, kind: KindRules) -> None:
    if judge["on"] not in JUDGE_ON:
        raise PresetError(source, "judge.on", f"must be one of {', '.join(JUDGE_ON)}")
    if judge["on"] == "host" and kind.host_judging is None:
        raise PresetError(
            source,
            "judge.on",
            f'the {kind.name} kind judges on the console only: remove the key or set "console"',
        )


def _check_run_settings(out: dict[str, Any], source: str) -> None:
    """The preset's name becomes part of paths and ids; timeouts must be real durations."""
    name = out["preset"]["name"]
    if not NAME_CHARS.fullmatch(name):
        raise PresetError(
            source,
            "preset.name",
            f"{name!r}: use letters, digits, '.', '_' and '-' only (it names directories)",
        )
    target = out["target"]
    for key in ("connect_timeout_s", "keepalive_s"):
        value = target[key]
        if not math.isfinite(value) or value <= 0:
            raise PresetError(
                source, f"target.{key}", f"must be a finite number > 0, got {value!r}"
            )
    for key in ("workdir", "runs", "lock"):
        value = target[key]
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise PresetError(
                source, f"target.{key}", f"{value!r} holds a control character; remove it"
            )
        if key != "lock" and not value.strip():
            raise PresetError(source, f"target.{key}", f"{value!r}: name a directory")
        if value.startswith("~") and value != "~" and not value.startswith("~/"):
            raise PresetError(
                source,
                f"target.{key}",
                f"{value!r}: ~user is not expanded; write an absolute path, or one relative to "
                "the target's home (~/x or x)",
            )
    if target["lock"] and not target["lock"].startswith("/"):
        raise PresetError(source, "target.lock", f"{LOCK_RULE}, got {target['lock']!r}")
    if target["reconnect_attempts"] < 0:
        raise PresetError(source, "target.reconnect_attempts", "must be 0 or more")
    _check_scheduler(target, source)
    if out["fleet"]["busy"] not in FLEET_BUSY:
        raise PresetError(
            source,
            "fleet.busy",
            f"must be one of {', '.join(FLEET_BUSY)}, got {out['fleet']['busy']!r}",
        )


FLEET_BUSY = ("skip", "wait")
SCHEDULERS = ("", "slurm")
SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
SLURM_GRES = re.compile(r"[A-Za-z0-9_]+(:[A-Za-z0-9_.-]+)*(,[A-Za-z0-9_]+(:[A-Za-z0-9_.-]+)*)*")
# minutes | MM:SS | HH:MM:SS | D-HH | D-HH:MM | D-HH:MM:SS | UNLIMITED (sbatch --time)
SLURM_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE)", re.I)


def _check_scheduler(target: dict[str, Any], source: str) -> None:
    """The Slurm settings: names Slurm accepts, lines that stay one #SBATCH line each."""
    if target["scheduler"] not in SCHEDULERS:
        raise PresetError(
            source,
            "target.scheduler",
            f'must be "slurm" or absent (the detached launcher), got {target["scheduler"]!r}',
        )
    for key in ("partition", "account"):
        value = target[key]
        if value and not SLURM_NAME.fullmatch(value):
            raise PresetError(source, f"target.{key}", f"{value!r} is not a Slurm {key} name")
    if target["gres"] and not SLURM_GRES.fullmatch(target["gres"]):
        raise PresetError(
            source, "target.gres", f"{target['gres']!r}: give NAME[:TYPE]:COUNT, e.g. gpu:1"
        )
    if target["time_limit"] and not SLURM_TIME.fullmatch(target["time_limit"]):
        raise PresetError(
            source,
            "target.time_limit",
            f"{target['time_limit']!r}: give minutes, MM:SS, HH:MM:SS or D-HH:MM:SS (sbatch "
            "--time)",
        )
    for i, line in enumerate(target["sbatch"]):
        _check_type(source, f"target.sbatch[{i}]", line, str)
        if not line.startswith("--") or any(c in line for c in "\n\r\0"):
            raise PresetError(
                source,
                f"target.sbatch[{i}]",
                f"{line!r}: one sbatch option per item, starting with -- (e.g. --qos=high)",
            )
        option = line.split("=", 1)[0].split()[0]
        # sbatch takes any unambiguous prefix of an option (--arr=0 is --array=0)
        own = sorted(o for o in SBATCH_OWN if o.startswith(option)) if len(option) > 2 else []
        if own:
            raise PresetError(
                source,
                f"target.sbatch[{i}]",
                f"{option}{'' if option == own[0] else ' is ' + own[0] + ','} is set by "
                "tracedeck (the array, its name, files and directory are how it follows the "
                "cells); remove it",
            )


# sbatch options tracedeck sets itself: another value would hide the cells from it.
SBATCH_OWN = frozenset(
    {"--array", "--output", "--error", "--chdir", "--wrap", "--parsable", "--open-mode"}
    | {"--job-name"}  # a console that died before writing slurm/job_id finds the job by it
    | {"--dependency", "--kill-on-invalid-dep", "--input", "--requeue", "--no-requeue"}
)


def _kind_of(data: dict[str, Any], source: str, kinds: Mapping[str, KindRules]) -> KindRules:
    """The run kind a preset names, checked before anything else (it adds sections)."""
    head = data.get("preset")
    if not isinstance(head, dict):
        raise PresetError(
            source, "preset", "missing section" if head is None else "must be a table"
        )
    name = head.get("kind")
    if name is None:
        raise PresetError(source, "preset.kind", "missing required key")
    _check_type(source, "preset.kind", name, str)
    if name not in kinds:
        raise PresetError(source, "preset.kind", f"must be one of {', '.join(kinds)}, got {name!r}")
    return kinds[name]


def _validate_section(
    section: str, keys: dict[str, tuple[Any, bool, Any]], given: dict[str, Any], source: str
) -> dict[str, Any]:
    filled: dict[str, Any] = {}
    for key, value in given.items():
        if key not in keys:
            raise PresetError(source, f"{section}.{key}", f"unknown key; known: {', '.join(keys)}")
        _check_type(source, f"{section}.{key}", value, keys[key][0])
        filled[key] = value
    for key, (_, required, default) in keys.items():
        if key not in filled:
            if required:
                raise PresetError(source, f"{section}.{key}", "missing required key")
            filled[key] = default.copy() if isinstance(default, (dict, list)) else default
    return filled


TRACE_NAME_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-*?[]{}!"
)


def relative_problem(path: str) -> str | None:
    """Why a path cannot stay inside the directory it is relative to, or None when it can."""
    if not path.strip():
        return "is empty"
    if "\0" in path:
        return "holds a NUL byte"
    if path.startswith(("/", "~")):
        return "must be relative to the run's directory, not absolute"
    if ".." in path.split("/"):
        return "must not leave the run's directory ('..')"
    return None


def _check_relative(source: str, key: str, template: str) -> None:
    problem = relative_problem(template)
    if problem is not None:
        raise PresetError(source, key, f"{template!r} {problem}")


def _check_trace_path(source: str, key: str, template: str) -> None:
    """A pattern (* ? [) may shape the file name only, in plain characters."""
    *dirs, name = template.split("/")
    if any(c in part for part in dirs for c in "*?["):
        raise PresetError(source, key, "a pattern (* ? [) may only be in the file name")
    if any(c in name for c in "*?[") and not set(name) <= TRACE_NAME_CHARS:
        raise PresetError(
            source, key, "a file-name pattern may use letters, digits, . _ - * ? [ ] only"
        )


def _rendered_trace_problem(rel: str) -> str | None:
    """A file-name pattern, its values filled in, must still be plain characters: it is handed
    to the host's shell to glob (a value such as $(cmd) would run there)."""
    name = rel.rsplit("/", 1)[-1]
    if any(c in name for c in "*?[") and not set(name) <= TRACE_NAME_CHARS - {"{", "}"}:
        bad = "".join(sorted(set(name) - TRACE_NAME_CHARS))
        return f"is a file-name pattern with {bad!r} from a value: use letters, digits, . _ - only"
    return None


def _check_placeholders(source: str, key: str, template: str, known: set[str]) -> None:
    for name in template_fields(template, source, key):
        if name not in known:
            raise PresetError(
                source, key, f"unknown placeholder {{{name}}}; known: {', '.join(sorted(known))}"
            )


def _validate_matrix(matrix: dict[str, Any], source: str) -> dict[str, list[Any]]:
    if not matrix:
        raise PresetError(source, "matrix", "needs at least one key (a list of values)")
    cells = 1
    for values in matrix.values():
        cells *= len(values) if isinstance(values, list) else 1
    if cells > MAX_CELLS:
        sizes = " x ".join(
            f"{key} {len(v) if isinstance(v, list) else 1}" for key, v in matrix.items()
        )
        raise PresetError(
            source,
            "matrix",
            f"{cells:,} cells ({sizes}) is more than {MAX_CELLS:,}: split it into presets, or "
            "narrow a key with --set",
        )
    for key, values in matrix.items():
        if not key.isidentifier() or key in BUILTIN_PLACEHOLDERS:
            raise PresetError(source, f"matrix.{key}", "must be an identifier, not a built-in name")
        if not isinstance(values, list) or not values:
            raise PresetError(source, f"matrix.{key}", f"must be a non-empty list, got {values!r}")
        for i, value in enumerate(values):
            if not isinstance(value, Scalar):
                raise PresetError(source, f"matrix.{key}[{i}]", f"must be a scalar, got {value!r}")
    return matrix


def _validate_vars(given: dict[str, Any], source: str, matrix: set[str]) -> dict[str, Any]:
    for key, value in given.items():
        if not key.isidentifier() or key in BUILTIN_PLACEHOLDERS or key in matrix:
            raise PresetError(
                source, f"vars.{key}", "must be an identifier, not a built-in or matrix name"
            )
        _check_type(source, f"vars.{key}", value, (str, int, float, bool))
    return given


def load_preset(
    path: str | os.PathLike[str],
    overrides: list[str] | None = None,
    options: frozenset[str] = frozenset(),
    *,
    kinds: Mapping[str, KindRules],
) -> Preset:
    """A preset file, --set overrides applied, validated against its kind from `kinds` (the
    registry: runners.kinds.load_preset passes every usable kind)."""
    source = str(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise PresetError(source, "", "no such preset file") from None
    except IsADirectoryError:
        raise PresetError(source, "", "a directory, not a preset file (name a .toml)") from None
    except UnicodeDecodeError as exc:
        raise PresetError(
            source, "", f"not a UTF-8 text file (byte {exc.start}): is this a preset?"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(source, "", f"not valid TOML: {exc}") from None
    except OSError as exc:
        raise PresetError(source, "", f"cannot read it ({exc.strerror})") from None
    given = data.get("matrix")
    file_keys = set(given) if isinstance(given, dict) else set()
    for assignment in overrides or []:
        apply_override(data, assignment, f"{source} (--set {assignment})")
    try:
        validated = validate(data, source, options, kinds=kinds)
        check_new_matrix_keys(validated, source, set(validated["matrix"]) - file_keys, kinds)
    except PresetError as exc:
        culprit = _override_for(exc.key, overrides or [])
        if culprit is None:
            raise
        message = str(exc).split(": ", 2)[-1]
        raise PresetError(f"{source} (--set {culprit})", exc.key, message) from None
    return Preset(source=source, data=validated, overrides=list(overrides or []), options=options)


def _override_for(key: str, overrides: list[str]) -> str | None:
    """The --set assignment that wrote the key an error is about, if one did."""
    for assignment in reversed(overrides):
        path = assignment.split("=", 1)[0].strip()
        if key == path or key.startswith(path + ".") or key.startswith(path + "["):
            return assignment
    return None


def user_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tracedeck" / "presets"


def preset_files() -> list[Path]:
    """Shipped presets, then the operator's own (~/.config/tracedeck/presets)."""
    files: list[Path] = []
    for folder in (SHIPPED_DIR, user_dir()):
        if folder.is_dir():
            files.extend(sorted(folder.glob("*.toml")))
    return files


def resolve_preset(name_or_path: str) -> Path:
    """A path as given, or a preset name looked up among preset_files()."""
    if os.sep in name_or_path or name_or_path.endswith(".toml"):
        return Path(name_or_path)
    for path in preset_files():
        if path.stem == name_or_path:
            return path
    known = ", ".join(p.stem for p in preset_files()) or "none"
    raise PresetError(name_or_path, "", f"no preset of that name; known presets: {known}")
