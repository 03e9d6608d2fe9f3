"""Is a retraining the result it retrains? Bit-for-bit comparison of a published report's run rows, or of a
published leaderboard's runs, with those of the same command run again, leaving out only what a retraining may
change (the clocks and the folders). ``experiments.repro.publish --restore`` adds a report's run records only when
these find no difference; ``machine_mismatch`` says beforehand why this machine cannot give them back
(``experiments.repro.retrain`` refuses on it)."""
from __future__ import annotations

import json
import re
from importlib import metadata
from typing import Any, Dict, Iterator, List, Optional, Tuple

from analysis.provenance import cpu_id, cpu_model
from architectures.config import ConfigError

# what a retraining may change in a row (the machine's load); everything else must come back equal for --restore
CLOCK_FIELDS = ("step_time_s", "train_time_s", "wall_s", "wall_measured", "wall_resumed", "run_seconds", "run_step_s")
PATH_FIELDS = ("run_dir", "run_dir_trained")
FREE_FIELDS = frozenset({*CLOCK_FIELDS, *PATH_FIELDS})


def as_text(value: Any) -> str:
    """A value as the JSON text it is stored as: equal texts are equal bit for bit (1 is not 1.0; NaN equals NaN)."""
    return json.dumps(value, sort_keys=True)


def code_state(results: Dict[str, Any]) -> Tuple[Any, Any, Any]:
    """The commit a report was computed at, whether its tree was dirty, and the difference's hash."""
    provenance = results.get("provenance") or {}
    return provenance.get("commit"), provenance.get("dirty"), provenance.get("diff_sha256")


def reused_from_earlier_code(published_row: Dict[str, Any], retrained_row: Dict[str, Any], label: str) -> bool:
    """Whether a published row is a run the report reused from an earlier commit (a programme keeps the finished runs
    of its ``--out``; the row's ``code`` is that clean commit) that the retraining trained at the report's own code
    (``label``, as ``analysis.provenance.code_label`` names it): the rows' ``code`` then differ by construction, and
    the row still counts as restored only if every other figure comes back equal."""
    code = published_row.get("code")
    return (isinstance(code, str) and re.fullmatch("[0-9a-f]{10}", code) is not None and code != label
            and retrained_row.get("code") == label)


def report_label(results: Dict[str, Any]) -> str:
    """The code a report was computed at, as its rows' ``code`` names theirs."""
    from analysis.provenance import code_label

    return code_label({"provenance": results.get("provenance")})


def row_name(i: int, row: Dict[str, Any]) -> str:
    return f"row {i} ({row.get('variant', row.get('name'))} seed {row.get('seed')})"


def differences(published: Any, retrained: Any, path: str = "") -> Iterator[Tuple[str, Optional[str], Optional[str]]]:
    """Each place ``retrained`` differs from ``published``, in order: the dotted keys into nested dicts, then both
    values as JSON text (None: the key is missing there). Lists are compared whole. Lazy, so the first costs little."""
    if not (isinstance(published, dict) and isinstance(retrained, dict)):
        if as_text(published) != as_text(retrained):
            yield path, as_text(published), as_text(retrained)
        return
    key_path = lambda key: f"{path}.{key}" if path else str(key)  # noqa: E731
    for key, value in published.items():
        if key in retrained:
            yield from differences(value, retrained[key], key_path(key))
        else:
            yield key_path(key), as_text(value), None
    for key, value in retrained.items():
        if key not in published:
            yield key_path(key), None, as_text(value)


def first_difference(published: Any, retrained: Any, extra_allowed: bool) -> Optional[str]:
    """The first of ``differences`` in words, or None. A key only ``retrained`` has is left out where
    ``extra_allowed`` (a figure later code adds: a run a report reused from an earlier commit wrote its ``probe.json``
    without it); one ``published`` has must come back."""
    for path, old, new in differences(published, retrained):
        if old is not None or not extra_allowed:
            return f"{path} {old or 'missing'} published, {new or 'missing'} retrained"  # JSON text is never empty
    return None


def retrained_only(retrained: Dict[str, Any], published: Dict[str, Any]) -> List[str]:
    """The figures (dotted paths into nested dicts) a retrained row has and its published row lacks, clocks and
    paths left out: what ``first_difference`` leaves out of the comparison."""
    return [path for path, old, _ in differences(published, retrained) if old is None and path not in FREE_FIELDS]


def retraining_mismatch(published: Dict[str, Any], retrained: Dict[str, Any]) -> Optional[str]:
    """Where ``retrained`` differs from ``published`` beyond the clocks and paths, in words; None if nowhere. Rows
    match by position (a programme trains its plan in order); a field only the retrained row has, at any depth of its
    nested dicts, is not compared unless the published row says it trained at the report's own code (its ``code``:
    then the same code wrote both, and an extra figure is a difference) (``first_difference``), nor the ``code`` of a
    row the report reused from an earlier commit (``reused_from_earlier_code``), but a retrained row must have trained
    at the report's code. The report's own numbers (a reference loss, the budget) must be equal too. Values compare as
    their JSON text: bit for bit (1 is not 1.0), and a NaN equals a NaN."""
    states = [code_state(r) for r in (published, retrained)]
    if states[0][0] is None:
        return "the published report names no commit, so no retraining can be shown to be of the same code"
    if states[0] != states[1]:
        return f"the report's code (commit, dirty, diff) is {states[0]}, the retraining's {states[1]}"
    if len(published["runs"]) != len(retrained["runs"]):
        return f"{len(published['runs'])} published rows, {len(retrained['runs'])} retrained"
    label = report_label(published)
    for i, (old, new) in enumerate(zip(published["runs"], retrained["runs"])):
        if new.get("code", label) != label:
            return (f"{row_name(i, new)} trained at {new['code']}, not at the report's {label}: the retraining reused "
                    "a run it did not train; retrain into an empty --out")
        free = FREE_FIELDS | ({"code"} if reused_from_earlier_code(old, new, label) else set())
        compared = [{k: v for k, v in row.items() if k not in free} for row in (old, new)]
        found = first_difference(*compared, extra_allowed=old.get("code") != label)
        if found:
            return f"{row_name(i, old)}: {found}"
    numbers = [k for k, v in published.items() if isinstance(v, (int, float)) and k not in FREE_FIELDS]
    return next((f"the report's {k} is {as_text(published[k])}, the retraining's {as_text(retrained.get(k))}"
                 for k in numbers if as_text(retrained.get(k)) != as_text(published[k])), None)


def board_runs(board: Dict[str, Any]) -> Dict[Tuple[str, Any], Dict[str, Any]]:
    """A leaderboard's runs by (their row's options, as JSON text, and seed), without the fields a retraining may
    change (its step time, its folder); one line when two runs share a row and a seed."""
    row_of = {run_dir: as_text({k: row.get(k) for k in board["options"]}) for row in board["rows"]
              for run_dir in row["runs"]}
    keyed: Dict[Tuple[str, Any], Dict[str, Any]] = {}
    for run in board["runs"]:
        key = (row_of[run["run_dir"]], run["seed"])
        if key in keyed:
            raise ConfigError(f"publish --restore: two runs of the row {key[0]} have seed {key[1]}; a leaderboard whose "
                              "runs cannot be told apart cannot be restored")
        keyed[key] = {k: v for k, v in run.items() if k not in FREE_FIELDS}
    return keyed


def board_mismatch(stored: Dict[str, Any], retrained: Dict[str, Any]) -> Optional[str]:
    """Where a retrained leaderboard differs from the stored one beyond the clocks and folders, in words; None if
    nowhere (values compared as JSON text: bit for bit; a field only one side has counts as null there)."""
    if stored["options"] != retrained["options"]:
        return f"the board's rows differ in {stored['options']}, the retraining's in {retrained['options']}"
    old, new = board_runs(stored), board_runs(retrained)
    if set(old) != set(new):
        missing = sorted(set(old) ^ set(new), key=str)[0]
        side = "only the stored" if missing in old else "only the retrained"
        return f"the run of {missing[0]} seed {missing[1]} is in {side} board"
    if stored["code"] != retrained["code"]:
        return f"the board's code is {stored['code']}, the retraining's {retrained['code']}"
    for key in sorted(old, key=str):
        for field in sorted(set(old[key]) | set(new[key])):
            if as_text(old[key].get(field)) != as_text(new[key].get(field)):
                return (f"{key[0]} seed {key[1]}: {field} {as_text(old[key].get(field))} stored, "
                        f"{as_text(new[key].get(field))} retrained")
    return None


def machine_mismatch(provenance: Dict[str, Any]) -> Optional[str]:
    """Why this machine cannot give back the report's runs bit for bit (its CPU model, the CPU id where the report
    recorded one (older reports did not), or its torch version differs from the recorded one; or the report recorded
    no CPU, kernel variables or torch), or None."""
    kernels = provenance.get("kernels") or {}
    recorded = {"CPU": kernels.get("cpu"), "CPU id": kernels.get("cpu_id"),
                "torch": (provenance.get("libraries") or {}).get("torch")}
    missing = [what for what in ("CPU", "torch") if not recorded[what]]
    if missing or not isinstance(kernels.get("environment"), dict):
        return f"it records no {' or '.join(missing or ['kernel variables'])} its runs trained with"
    here = {"CPU": cpu_model(), "CPU id": cpu_id(), "torch": metadata.version("torch")}
    for what in ("CPU", "CPU id", "torch"):
        if recorded[what] is not None and recorded[what] != here[what]:
            return f"its runs trained with {what} {recorded[what]!r}, this machine has {here[what]!r}"
    return None


def other_libraries(provenance: Dict[str, Any]) -> List[str]:
    """The recorded library versions (torch aside: refused) that differ here, as 'name recorded -> here': a warning,
    as most never touch the numbers; ``restore`` refuses at the end if any figure differs."""
    def installed(name: str) -> Optional[str]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    recorded = {k: v for k, v in (provenance.get("libraries") or {}).items() if k != "torch"}
    return [f"{name} {version} -> {installed(name)}" for name, version in recorded.items() if installed(name) != version]
