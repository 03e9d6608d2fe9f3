"""``probe-v3/hops``: pointer chasing whose level is the number of dependent lookups (datamodules/probe.py)."""
from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np
import pytest

from datamodules import probe

TASK = "probe-v3/hops"
EPISODES = 400  # 6,400 queries, 1,600 per level
QUERIES_PER_LEVEL = 2 * probe.HOPS_PER_LEVEL  # per episode: HOPS_PER_LEVEL in each alphabet


def _episodes(count=EPISODES):
    for index in range(count):
        family, (data, levels) = probe.episode(TASK, index)
        yield family, data.decode("ascii"), levels


def _table(text):
    """(name, value) of every memory cell: the cell at position i belongs to the i-th name."""
    return list(zip(probe._NAMES, text[: text.index(probe.BAR)]))


def _queries(text):
    """(position of the answer, query name, answer) after the bar, up to the padding."""
    bar = text.index(probe.BAR)
    return [(i + 1, text[i], text[i + 1]) for i in range(bar + 1, len(text.rstrip(".")) - 1, 2)]


def _path(table, name):
    """name, then the value of each successive lookup, until a value has no binding."""
    binding = dict(table)
    out = [name]
    while out[-1] in binding and len(out) <= len(binding) + 1:
        out.append(binding[out[-1]])
    return out


# ---------------------------------------------------------------------------- generator vs brute force
def test_fewest_lookups_equal_every_label():
    seen = Counter()
    for family, text, levels in _episodes():
        assert family == "hops" and len(text) == len(levels) == probe.EPISODE_LEN - 1
        solved = probe.solve_episode(family, text.encode(), probe.version(TASK))
        assert {i: (ord(text[i]), level) for i, level in enumerate(levels) if level != probe.NO_LABEL} == solved
        seen.update(level for _, level in solved.values())
    per_level = QUERIES_PER_LEVEL * EPISODES
    assert seen == {0: EPISODES, **{k: per_level for k in range(1, probe.HOPS_LEVELS + 1)}}


def test_solver_takes_the_fewest_lookups_and_refuses_ambiguous_or_unreachable_names():
    bindings = {"a": ["b", "c"], "b": ["7"], "c": ["d"], "d": ["4"]}  # a->b->7 (2 lookups), a->c->d->4 (3)
    assert probe.fewest_lookups(bindings, "a") == ("7", 2)
    assert probe.fewest_lookups(bindings, "c") == ("4", 2)
    assert probe.fewest_lookups(bindings, "5") == ("5", 0)
    with pytest.raises(ValueError, match="reaches the digits"):
        probe.fewest_lookups({"a": ["b", "c"], "b": ["1"], "c": ["2"]}, "a")
    with pytest.raises(ValueError, match="no digit is reachable"):
        probe.fewest_lookups({"a": ["b"], "b": ["a"]}, "a")  # a cycle


def test_solver_catches_a_wrong_answer():
    family, (data, levels) = probe.episode(TASK, 5)
    answer = next(i for i, level in enumerate(levels) if level == probe.HOPS_LEVELS)
    wrong = bytearray(data)
    wrong[answer] = ord("0") + (data[answer] - ord("0") + 1) % 10
    assert probe.solve_episode(family, bytes(wrong), "v3")[answer] == (data[answer], probe.HOPS_LEVELS)
    with pytest.raises(ValueError, match="cells"):
        probe.solve_episode(family, data[1:], "v3")  # a memory one cell short


# ---------------------------------------------------------------------------- no shortcut
def test_memory_forms_disjoint_open_chains_of_distinct_names():
    for _, text, _ in _episodes(200):
        table = _table(text)
        values = [v for _, v in table if v not in probe._DIGITS]
        assert [k for k, _ in table] == list(probe._NAMES)  # one cell per name, at a fixed position
        assert len(set(values)) == len(values)  # no name is the value of two names: chains never merge
        assert all(k.islower() == v.islower() for k, v in table if v in probe._NAMES)  # a chain keeps its case
        for key, _ in table:  # open: every path ends in a digit, which has no cell (no f^k = f^(k-N))
            path = _path(table, key)
            assert path[-1] in probe._DIGITS and len(set(path)) == len(path) <= probe.HOPS_LEVELS + 1


def test_the_answer_needs_exactly_its_level_of_lookups():
    """k - 1 lookups give a name (not the answer); a (k + 1)-th lookup does not exist; the query name is
    never a value (a chain's first name), so no other path leads into the chain."""
    for _, text, levels in _episodes(200):
        table = _table(text)
        values = {v for _, v in table}
        for pos, name, answer in _queries(text):
            path = _path(table, name)
            assert len(path) - 1 == levels[pos] and path[-1] == answer
            assert path[-2] != answer and path[-2] in probe._NAMES
            assert name not in values


def _heuristics(table, previous_answer):
    """Answers a reader could produce without following the chain."""
    digits = [v for _, v in table if v in probe._DIGITS]
    position = {k: i for i, (k, _) in enumerate(table)}

    def nearest_digit(name):  # the digit cell closest to the query's own cell
        return min(((abs(i - position[name]), v) for i, (_, v) in enumerate(table) if v in probe._DIGITS))[1]

    return lambda name: {"most frequent digit": Counter(digits).most_common(1)[0][0],
                         "nearest digit": nearest_digit(name),
                         "previous answer": previous_answer,
                         "first listed digit": digits[0]}


def test_no_shortcut_guesses_the_answer_much_better_than_chance():
    hits, total = Counter(), Counter()
    answers = {k: Counter() for k in range(1, probe.HOPS_LEVELS + 1)}
    for _, text, levels in _episodes():
        table, previous = _table(text), None
        for pos, name, answer in _queries(text):
            guesses = _heuristics(table, previous)(name)
            for rule, guess in guesses.items():
                hits[rule, levels[pos]] += guess == answer
            total[levels[pos]] += 1
            answers[levels[pos]][answer] += 1
            previous = answer
    for (rule, level), n in hits.items():  # level 1: the nearest digit is the query's own value (1 lookup)
        assert level == 1 or n / total[level] < 0.25, (rule, level, n / total[level])  # chance is ~0.1 (0.2 for the modal digit)
    for level, counts in answers.items():  # the answer digit says nothing about the level
        assert max(counts.values()) / total[level] < 0.14 and len(counts) == 10


def test_the_query_cell_holds_the_answer_only_at_level_1():
    """The query's own cell is its first lookup: the answer only at level 1."""
    same = Counter()
    for _, text, levels in _episodes(200):
        first = dict(_table(text))
        for pos, name, answer in _queries(text):
            same[levels[pos]] += first[name] == answer
    assert same[1] == 200 * QUERIES_PER_LEVEL and all(same[k] == 0 for k in range(2, probe.HOPS_LEVELS + 1))


# ---------------------------------------------------------------------------- reproducibility
def test_same_index_gives_the_same_bytes_and_other_indices_differ():
    first = [probe.episode(TASK, i)[1] for i in range(20)]
    assert first == [probe.episode(TASK, i)[1] for i in range(20)]
    assert len({data for data, _ in first}) == 20


# The bytes, labels and family of the first 40 episodes of every task, and each cache fingerprint, as
# they were before v3 was added (and v3's to v6's own, pinned when each was added): a new version must not move them.
PINNED = {
    "probe": ("6d98f8b464fda20da870d577e424392bf5f3f173e55c45de15a4e288f3509856", "probe-probe-112a26be4f973ee9"),
    "probe-v2": ("013c081a477e397aa8c6d41a499a87258196d7cef743a7e702e5533dd645d8fc", "probe-probe-v2-f949e4424e95a35b"),
    "probe-v2/arith": ("d50c7a7e167cab499d87d554b90ce8f9355a35b6dbddd270afc08433fc251309",
                       "probe-probe-v2-arith-56eb8af50abee039"),
    "probe-v2/recall": ("68010618cf7cda2f5e2e75f8f6b0a43140feddd97150714692112feb126006ae",
                        "probe-probe-v2-recall-972b9dad7a2efed3"),
    "probe-v2/text": ("0430da59bf5250fc5a9eb9681023f7eab7a4b1c27741f65a87dcec015012c77c",
                      "probe-probe-v2-text-d8edd359c4f2513a"),
    "probe/arith": ("3d0c4e665725713ebd7f7788e267b35313d65e02049569b4a207cd8e2f5b987d",
                    "probe-probe-arith-c08d6dd040694fe5"),
    "probe/recall": ("68010618cf7cda2f5e2e75f8f6b0a43140feddd97150714692112feb126006ae",
                     "probe-probe-recall-76a1032f0f1ba23e"),
    "probe/text": ("0430da59bf5250fc5a9eb9681023f7eab7a4b1c27741f65a87dcec015012c77c",
                   "probe-probe-text-c212e5d65d94f7ab"),
    TASK: ("4d506e013b89bfd01c3498e4a19e53206bbead9b95b8aac6c14f18f4dfc9171b", "probe-probe-v3-hops-3646a3843be6c1d0"),
    "probe-v4/cups": ("307d8ea43735726ca3bd232f7c830cefc8b694247343ecd9acbb798f1d151ac4",
                      "probe-probe-v4-cups-daf4223875aa4b8a"),
    "probe-v5/bounce": ("b6c09beea37795783372d752cb1ac65cbda7a7c0e8bc1b3afc677b5cbc3623b3",
                        "probe-probe-v5-bounce-608fa0862ca06d70"),
    "probe-v6/bounce": ("394910ab1eb198e066a0a0c86dcccbb28f0eb3abfab66406779654083f1fbbe1",
                        "probe-probe-v6-bounce-7cf496c51577c1df"),
    "probe-v7/shift": ("dfd8ee4e0f909729d478ca64fc2198e439510046fb3128b9a05730d5848f36fb",
                       "probe-probe-v7-shift-abb0b925c4a6d351"),
    "probe-v8/induct": ("d58d05aeb2a51e68ec607989aabf8ea5685a5094e657664e941d3d267c8123d3",
                        "probe-probe-v8-induct-069059bd0d1d8bd3"),
}


@pytest.mark.parametrize("task", sorted(PINNED))
def test_every_version_keeps_its_bytes_labels_and_cache_name(task):
    h = hashlib.sha256()
    for i in range(40):
        family, (data, levels) = probe.episode(task, i)
        h.update(family.encode())
        h.update(data)
        h.update(np.asarray(levels, np.int8).tobytes())
    assert (h.hexdigest(), probe.ProbeCorpus(task).fingerprint()) == PINNED[task]
    assert set(PINNED) == set(probe.TASKS)  # a new probe name gets its pin here


@pytest.mark.parametrize("task", sorted(probe.TASKS))
def test_every_probe_declares_the_levels_its_labels_use(task):
    """``level_count`` (the default of --callbacks.probe_levels) holds every label of 200 episodes (fewer would
    refuse the data) and is the shared 0..MAX_DEPTH layout or the top label + 1 (no empty levels beyond it)."""
    top = max(max(probe.episode(task, i)[1][1]) for i in range(200))
    assert top < probe.level_count(task) in (top + 1, probe.MAX_DEPTH + 1)


def test_an_explicit_probe_levels_beats_the_datasets_default():
    from experiments.run import build_parser, expand_aliases, parse_with_presets

    def levels(*argv):
        return parse_with_presets(build_parser(), expand_aliases(list(argv))).callbacks.probe_levels

    assert levels("--data", "probe-v6/bounce") == 8 and levels("--data", "probe-v5/bounce") == 5
    assert levels("--data", "probe-v6/bounce", "--callbacks.probe_levels", "12") == 12
    assert levels("--data", "embedded") == levels() == 5  # not a probe: the dataclass default
    hard = parse_with_presets(build_parser(), expand_aliases(["--data", "probe-v7/shift"])).callbacks
    assert (hard.probe_levels, hard.probe_hard_from) == (2, 1)  # two levels: the usual 3 would be refused


def test_a_sweep_takes_each_configurations_own_dataset_defaults():
    """experiments.sweep validates a grid with run's parse: a v6 job gets its 8 levels, and no job's dataset
    default leaks into the next one's."""
    from experiments import sweep

    parsed = sweep.validate([["--data", "probe-v6/bounce"], ["--data", "probe-v5/bounce"], ["--data", "probe-v7/shift"],
                             ["--data", "probe-v6/bounce", "--callbacks.probe_levels", "9"], []])
    assert [(c.callbacks.probe_levels, c.callbacks.probe_hard_from) for c in parsed] == [(8, 3), (5, 3), (2, 1), (9, 3),
                                                                                         (5, 3)]


def test_v3_is_its_own_family_index_and_v1_v2_indices_stay():
    assert probe.FAMILIES[:3] == ("arith", "recall", "text") and probe.FAMILIES.index("hops") == 3
    assert probe.TASKS[TASK] == ("hops",) and not any(t.startswith("probe/hops") for t in probe.TASKS)


# ---------------------------------------------------------------------------- the corpus and the CLI
def test_cli_trains_on_hops_and_logs_every_level(tmp_path, one_thread):
    from experiments.run import main
    from tests.conftest import TINY_RUN

    run_dir = main(["--data", TASK, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir",
                    str(tmp_path / "c"), "--max_steps", "3", "--val_every", "3", "--log_dir", str(tmp_path),
                    *TINY_RUN, "--model.block_size", "128", "--callbacks.probe_blocks", "4"])
    metrics = json.loads((run_dir / "summary.json").read_text())["val_metrics"]
    assert all(0 <= metrics[f"probe/level{k}/acc"] <= 1 for k in range(probe.HOPS_LEVELS + 1))
    detail = json.loads((run_dir / "probe.json").read_text())
    hops = detail["families"]["hops"]
    assert {k: hops[k]["tokens"] for k in hops} == {k: v["tokens"] for k, v in detail["levels"].items()}
    episodes = hops["0"]["tokens"]  # one bar per whole episode in the evaluated blocks
    assert episodes >= 1 and all(hops[str(k)]["tokens"] == episodes * QUERIES_PER_LEVEL for k in range(1, 5))
