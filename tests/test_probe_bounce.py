"""``probe-v5/bounce``: a fixed non-associative operation composed in order, in v2's fixed-width segments
(datamodules/probe.py): the level is the number of dependent steps."""
from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict

import numpy as np
import pytest

from datamodules import probe
from tests.conftest import bounce_segments, solved_level_counts

TASK = "probe-v5/bounce"
EPISODES = 400  # 5,600 segments, ~1,120 per level
LEVELS = range(1, probe.MAX_DEPTH + 1)


def _segments(count=EPISODES):
    """(level, operands, result) of every segment of the first ``count`` episodes, read by position."""
    return bounce_segments(TASK, probe.MAX_DEPTH + 1, count)


def _naive(operands):
    """The reference, written out: add while the running value stays within the limit, else reflect."""
    value = operands[0]
    for x in operands[1:]:
        if value + x > probe.BOUNCE_LIMIT:
            value = value - x if value >= x else x - value
        else:
            value = value + x
    return value


def _all_inputs(k):
    """Every (x0, x1, .., xk) of level k and its result: (10^(k+1), k+1) digits, (10^(k+1),) results."""
    inputs = np.array(list(itertools.product(range(10), repeat=k + 1)))
    return inputs, np.array([probe.bounce_chain(row) for row in inputs.tolist()])


def _bayes(keys, results):
    """Accuracy of the best guess of the labelled units digit from ``keys`` (one hashable per input) and
    the tens digit, which the model has in context when it predicts the units digit."""
    table = defaultdict(Counter)
    for key, result in zip(keys, results.tolist()):
        table[key, result // 10][result % 10] += 1
    return sum(max(c.values()) for c in table.values()) / len(results)


# ---------------------------------------------------------------------------- generator vs brute force
def test_the_solver_re_derives_every_label_from_the_bytes():
    seen = solved_level_counts(TASK, EPISODES)
    segments = EPISODES * ((probe.EPISODE_LEN - 1) // (probe.MAX_DEPTH + 5))
    assert sum(seen.values()) == 2 * segments and all(seen[k] > 0.17 * segments for k in LEVELS)


def test_results_follow_the_naive_rule_and_the_level_is_the_number_of_steps():
    for level, operands, result in _segments():
        assert level == len(operands) - 1 and result == _naive(operands) and 0 <= result <= probe.BOUNCE_LIMIT


def test_the_solver_catches_a_wrong_result_a_wrong_tens_digit_and_a_broken_layout():
    family, (data, levels) = probe.episode(TASK, 5)
    units = levels.index(probe.MAX_DEPTH)
    wrong = bytearray(data)
    wrong[units] = ord("0") + (data[units] - ord("0") + 1) % 10
    assert probe.solve_episode(family, bytes(wrong), "v5")[units] == (data[units], probe.MAX_DEPTH)
    with pytest.raises(ValueError, match="is not 5 slots"):
        probe.solve_episode(family, data[1:], "v5")  # every segment shifted by one byte
    tens = bytearray(data)
    tens[units - 1] = ord("1") if data[units - 1] == ord("0") else ord("0")  # the unlabelled tens digit
    with pytest.raises(ValueError, match="does not hold its result"):
        probe.solve_episode(family, bytes(tens), "v5")


# ---------------------------------------------------------------------------- the operation
def test_the_step_is_neither_associative_nor_commutative_and_every_input_moves_it():
    """Order matters (the reason a reader must apply the steps one after another), and the step table is
    not a Latin square: every input alone shifts the distribution of the result (v1's mod-10 lesson)."""
    orders = {tuple(p): probe.bounce_chain(list(p)) for p in itertools.permutations([7, 6, 5])}
    assert len(set(orders.values())) > 1  # 7+6=13 -> |13-5|=8; 5+6=11 -> |11-7|=4
    pairs = [(x, y) for x in range(10) for y in range(10)]
    reordered = sum(probe.bounce(probe.bounce(s, x), y) != probe.bounce(probe.bounce(s, y), x)
                    for s in range(10) for x, y in pairs)
    assert reordered > 0
    for fixed in range(2):  # the result's distribution given the state alone (given the operand alone)
        given = [tuple(sorted(Counter(probe.bounce(*((v, u) if fixed == 0 else (u, v))) for u in range(10)).items()))
                 for v in range(10)]
        assert len(set(given)) == 10  # differs for every value: each input alone is informative


# Exact (exhaustive over all 10^(k+1) inputs of level k) accuracies on the labelled units digit, the tens
# digit known (it precedes the units digit): guesses that skip a step or read a parallel summary.
EXACT = {
    "tens digit only (chance)": (0.19, 0.167, 0.1678, 0.1691),
    "the sum's units digit": (0.90, 0.61, 0.3526, 0.2192),
    "the steps in reverse order": (1.0, 0.736, 0.5102, 0.3909),
    "best from the sum": (0.97, 0.736, 0.5586, 0.4562),
    "best from the multiset (order ignored)": (1.0, 0.875, 0.7687, 0.6852),
    "best without one input (the best one left out)": (0.2, 0.258, 0.3006, 0.3332),
}


def _exact_ceilings():
    out = {}
    for k in LEVELS:
        inputs, results = _all_inputs(k)
        rows = [tuple(r) for r in inputs.tolist()]
        reverse = np.array([probe.bounce_chain(list(r[::-1])) for r in rows])
        values = {
            "tens digit only (chance)": _bayes([0] * len(rows), results),
            "the sum's units digit": float(np.mean(inputs.sum(1) % 10 == results % 10)),
            "the steps in reverse order": float(np.mean(reverse % 10 == results % 10)),
            "best from the sum": _bayes(inputs.sum(1).tolist(), results),
            "best from the multiset (order ignored)": _bayes([tuple(sorted(r)) for r in rows], results),
            "best without one input (the best one left out)":
                max(_bayes([r[:j] + r[j + 1:] for r in rows], results) for j in range(k + 1)),
        }
        for name, value in values.items():
            out[name, k] = value
    return out


def test_shortcut_ceilings_are_exactly_their_enumerated_values():
    ceilings = _exact_ceilings()
    for (name, k), value in ceilings.items():
        assert value == pytest.approx(EXACT[name][k - 1], abs=5e-4), (name, k, value)


def test_shortcuts_in_the_data_match_their_exact_expectation():
    """The same rules measured on the generated segments (~1,120 per level: s.e. <= 0.015), within 0.05."""
    rules = {"the sum's units digit": lambda ops: sum(ops),
             "the steps in reverse order": lambda ops: probe.bounce_chain(ops[::-1])}
    hits, total = Counter(), Counter()
    for level, operands, result in _segments():
        total[level] += 1
        for name, rule in rules.items():
            hits[name, level] += rule(operands) % 10 == result % 10
    for name in rules:
        for k in LEVELS:
            assert hits[name, k] / total[k] == pytest.approx(EXACT[name][k - 1], abs=0.05), (name, k)


def test_units_digit_distribution_per_level_in_the_data():
    """No digit dominates a level: the most frequent units digit (given nothing) stays below 0.16."""
    counts = {k: Counter() for k in LEVELS}
    for level, _, result in _segments():
        if level in counts:
            counts[level][result % 10] += 1
    for k, c in counts.items():
        assert set(c) == set(range(10)) and max(c.values()) / sum(c.values()) < 0.16, (k, c)


# ---------------------------------------------------------------------------- the corpus and the CLI
def test_v5_is_its_own_family_and_version_and_shares_v2s_operands():
    assert probe.FAMILIES.index("bounce") == 5 and probe.version(TASK) == "v5" and probe.TASKS[TASK] == ("bounce",)
    for index in range(5):  # same rng draws as v2 arithmetic: only the result differs
        _, (v5, _) = probe.episode(TASK, index)
        _, (v2, _) = probe.episode("probe-v2/arith", index)
        assert [s.split("=")[0] for s in v5.decode().split(";")[:-1]] == [s.split("=")[0] for s in v2.decode().split(";")[:-1]]


def test_cli_trains_on_bounce_and_logs_every_level(tmp_path, one_thread):
    from experiments.run import main
    from tests.conftest import TINY_RUN

    run_dir = main(["--data", TASK, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir",
                    str(tmp_path / "c"), "--max_steps", "3", "--val_every", "3", "--log_dir", str(tmp_path),
                    *TINY_RUN, "--model.block_size", "128", "--callbacks.probe_blocks", "4"])
    bounce = json.loads((run_dir / "probe.json").read_text())["families"]["bounce"]
    assert all(bounce[str(k)]["tokens"] > 0 for k in range(probe.MAX_DEPTH + 1))
